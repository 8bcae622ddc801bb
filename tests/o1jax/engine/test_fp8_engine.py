"""The engine with FP8 activations (matmul_dtype="float8") and FP8 KV pools keeps its
determinism guarantees: a request's tokens do not depend on the batch it decodes in, nor
on how its tokens were grouped into writes of the pool (each token is stored under its
own scale)."""

import pytest

from o1jax.engine import Engine, EngineConfig, GenerationParams, Request, SpeculativeConfig
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


def test_fp8_kv_tokens_do_not_depend_on_how_the_writes_were_grouped(tiny, make_prompts):
  """With a scale per block, each write re-quantized its whole block, so tokens changed
  with the prefill chunk, speculation's verify writes and recompute after preemption
  (6 prompts x 40 greedy tokens: 5/6, 5/6 and 3/6 differed); with a scale per token
  none may."""
  prompts = make_prompts(6, seed=11, low=20, high=40)
  params = GenerationParams(max_new_tokens=40, ignore_eos=True)

  def run(speculative=None, **config):
    cfg = dict(max_slots=8, num_blocks=256, prefill_chunk=64, kv_dtype="float8_e4m3fn")
    engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(**{**cfg, **config}),
                    speculative=speculative)
    return [r.token_ids for r in engine.generate([Request(p, params) for p in prompts])], engine

  plain, _ = run()
  assert run(prefill_chunk=5, min_chunk_bucket=4)[0] == plain
  assert run(SpeculativeConfig(drafter="early_exit", max_drafts=3, adaptive=False))[0] == plain
  assert run(SpeculativeConfig(max_drafts=3, adaptive=False))[0] == plain  # prompt lookup
  preempted, engine = run(num_blocks=12)
  assert engine.metrics.preemptions > 0 and preempted == plain
