"""Engine test fixtures: a tiny random model with soft logits, and shared engines.

The tiny checkpoint's embeddings are scaled down (x0.05) so its next-token
distributions are spread out: greedy runs do not collapse to one repeated
token and sampling actually samples."""

import dataclasses

import numpy as np
import pytest

from o1jax.checkpoint import load_checkpoint
from o1jax.engine import Engine, EngineConfig
from o1jax.model import Llama
from o1jax.testing import tiny_config, write_hf_checkpoint


@dataclasses.dataclass
class Tiny:
  model: Llama
  tokenizer: object
  config: object
  params: dict


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_engine")
  write_hf_checkpoint(path, tiny_config(max_context=256), seed=3)
  ck = load_checkpoint(path)
  params = dict(ck.params)
  params["embed"] = np.asarray(params["embed"]) * 0.05
  model = Llama(ck.config, params)
  return Tiny(model=model, tokenizer=ck.tokenizer, config=ck.config, params=params)


@pytest.fixture(scope="session")
def engine32(tiny):
  """32 slots, roomy pool: shared by tests that only read results."""
  return Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=32, num_blocks=512,
                                                         prefill_chunk=64))


@pytest.fixture(scope="session")
def make_prompts():
  """make_prompts(n, seed, low, high) -> n random token-id prompts of lengths in [low, high)."""

  def make(n: int, seed: int, low: int = 3, high: int = 40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 259, size=int(rng.integers(low, high))).tolist() for _ in range(n)]

  return make


@pytest.fixture(scope="session")
def engine32_bf16(tiny):
  """engine32 on the same weights with bf16 matmuls (matmul_dtype="bfloat16")."""
  model = Llama(tiny.config, tiny.params, matmul_dtype="bfloat16")
  return Engine(model, tiny.tokenizer, EngineConfig(max_slots=32, num_blocks=512, prefill_chunk=64))


@pytest.fixture(scope="session")
def engine32_int8(tiny):
  """engine32 with int8 activations and 8-bit weights (matmul_dtype="int8"; the
  tiny checkpoint is dense, so its matrices become Q8_0), bf16 KV pools."""
  model = Llama(tiny.config, tiny.params, matmul_dtype="int8")
  return Engine(model, tiny.tokenizer, EngineConfig(max_slots=32, num_blocks=512, prefill_chunk=64,
                                                    kv_dtype="bfloat16"))


@pytest.fixture(scope="session")
def engine32_bf16kv(tiny):
  """engine32 with bf16 KV pools (f32 matmuls)."""
  return Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=32, num_blocks=512,
                                                         prefill_chunk=64, kv_dtype="bfloat16"))
