"""The engine with FP8 activations (matmul_dtype="float8") and FP8 KV pools keeps its
determinism guarantee for a prompt prefilled in one write: a request's tokens do not
depend on the batch it decodes in. (An FP8 block's values do depend on how a prompt's
prefill is cut, which its neighbours can move: the README's "FP8 KV and write grouping".)"""

import pytest

from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.model import Llama

PARAMS = [GenerationParams(max_new_tokens=12, ignore_eos=True),
          GenerationParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=3, ignore_eos=True)]


@pytest.fixture(scope="module")
def engine_fp8(tiny):
  model = Llama(tiny.config, tiny.params, matmul_dtype="float8")
  return Engine(model, tiny.tokenizer, EngineConfig(max_slots=32, num_blocks=512,
                                                    prefill_chunk=64, kv_dtype="float8_e4m3fn"))


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_same_tokens_at_batch_1_7_and_32(engine_fp8, make_prompts, params):
  # Each row is rounded under its own scale, and on a CPU the f32 products run in the
  # native kernel, whose rows do not depend on the batch (XLA's dot did: batch 1 and 3
  # forked within 16 greedy tokens on the embedded model).
  target = Request(make_prompts(1, seed=98, low=20, high=21)[0], params, request_id=77)
  alone = engine_fp8.generate([target])[0].token_ids
  fillers = make_prompts(31, seed=6)
  batch7 = [Request(p, PARAMS[1]) for p in fillers[:3]] + [target] + \
           [Request(p, PARAMS[0]) for p in fillers[3:6]]
  batch32 = [Request(p, PARAMS[i % 2]) for i, p in enumerate(fillers)] + [target]
  assert engine_fp8.generate(batch7)[3].token_ids == alone
  assert engine_fp8.generate(batch32)[31].token_ids == alone
  assert len(alone) == 12
