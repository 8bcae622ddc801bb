"""Every program the engine runs, lowered for CUDA with the Pallas kernels compiled (not
interpreted), on a CPU: what `backend="auto"` runs on a GPU, caught here rather than in
the GPU check's few minutes (a bf16 KV pool under an f32 model was refused by the
kernels on a GPU, and nothing on a CPU ran that path).

The engine runs the calls in Pallas interpret mode (dispatching as on a GPU); each new program (name, argument
shapes and dtypes) is also traced with the compiled-kernel model and lowered for CUDA, with
`jax.default_backend()` answering "gpu" while it is built and traced, so that every
dispatch (`backend="auto"`: the kernels, and XLA where a kernel cannot tile a weight; the
sampler's GPU branch) takes the branch a GPU takes."""

import numpy as np
import pytest
from flax import nnx

from o1jax.checkpoint import load_checkpoint
from o1jax.engine import EngineConfig, GenerationParams, Request, SpeculativeConfig
from o1jax.model import Llama
from o1jax.testing import (as_if_on_gpu, cuda_lowering_engine, tiny_config,
                           tiny_gemma3_config, write_gguf_checkpoint)


class LoweringEngine(cuda_lowering_engine()):
  """Records the name of each program it lowered for CUDA."""

  def __init__(self, *args, **kwargs):
    self.lowered: list[str] = []
    super().__init__(*args, **kwargs)

  def on_lowered(self, name, lowered):
    self.lowered.append(name)


def _copy_prompts(n: int, seed: int) -> list[list[int]]:
  """A random passage twice and its start again: prompt lookup drafts the rest."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    passage = rng.integers(3, 259, size=24).tolist()
    out.append(passage + passage + passage[:4])
  return out


CASES = {
    # name: (config, GGUF matrix type, model kwargs, engine kwargs, speculative)
    "llama_q4_1": (tiny_config(max_context=256), "Q4_1", {}, {}, None),
    "llama_q4_0_bf16_kv": (tiny_config(max_context=256), "Q4_0", {},
                           {"kv_dtype": "bfloat16"}, None),
    "llama_q8_0_fp8_kv": (tiny_config(max_context=256), "Q8_0", {},
                          {"kv_dtype": "float8_e4m3fn"}, None),
    "llama_fp8_activations": (tiny_config(max_context=256), "Q4_0",
                              {"matmul_dtype": "float8"}, {}, None),
    "gemma3_sliding_window": (tiny_gemma3_config(max_context=256), "Q4_0", {}, {}, None),
    "llama_speculative": (tiny_config(max_context=256), "Q4_1", {}, {},
                          SpeculativeConfig(max_drafts=4)),
    # Pages the Pallas kernels cannot tile: 'auto' takes XLA's attention (was refused).
    "llama_block_size_12": (tiny_config(max_context=256), "Q4_1", {}, {"block_size": 12}, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_programs_lower_for_cuda(case, tmp_path):
  config, matrix_type, model_kw, engine_kw, speculative = CASES[case]
  path = tmp_path / "m.gguf"
  write_gguf_checkpoint(path, config, seed=1, matrix_type=matrix_type)
  ck = load_checkpoint(path)
  kw = dict(backend="auto", weight_mode="quantized", **model_kw)
  with as_if_on_gpu():
    cuda_graphdef, _ = nnx.split(Llama(ck.config, ck.params, interpret=False, **kw))
    model = Llama(ck.config, ck.params, interpret=True, **kw)
  engine = LoweringEngine(
      model, ck.tokenizer,
      EngineConfig(max_slots=4, num_blocks=64, prefill_chunk=32, decode_steps=4,
                   prefix_caching=False, **engine_kw),
      speculative=speculative)
  engine.cuda_graphdef = cuda_graphdef
  prompts = (_copy_prompts(4, seed=2) if speculative else
             [np.random.default_rng(i).integers(3, 259, size=5 + 9 * i).tolist()
              for i in range(4)])
  results = engine.generate([Request(p, GenerationParams(max_new_tokens=12, ignore_eos=True))
                             for p in prompts])
  assert all(len(r.token_ids) == 12 for r in results)
  expected = {"prefill", "decode"} | ({"verify"} if speculative else set())
  assert expected <= set(engine.lowered), engine.lowered
