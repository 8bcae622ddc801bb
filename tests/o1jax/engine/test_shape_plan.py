"""Rent-or-buy of compiled prefill shapes (o1jax/engine/shape_plan.py): the rule on
hand-fed costs, and the engine through it (fewer programs, the same tokens)."""

import dataclasses

import jax
import pytest

from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.engine.shape_plan import ShapePlan, prefill_fits


def measured_plan(compiled=((4, 32, 32),), compile_s=1.0, per_position=1e-3) -> ShapePlan:
  plan = ShapePlan()
  for shape in compiled:
    plan.observe_compile(shape, compile_s)
    rows, t, _ = shape
    plan.observe_run(shape, rows * t * per_position)
  return plan


def test_nothing_measured_or_nothing_fitting_compiles_the_wanted_shape():
  assert ShapePlan().choose((4, 16, 32)) == (4, 16, 32)
  plan = measured_plan()
  assert plan.position_seconds == pytest.approx(1e-3) and plan.compile_seconds == 1.0
  assert plan.choose((4, 48, 32)) == (4, 48, 32)  # longer rows than any compiled
  assert plan.choose((4, 16, 64)) == (4, 16, 64)  # a wider table
  assert plan.choose((4, 16, 8)) == (4, 16, 8)  # 32 blocks is over twice the 8 it needs
  assert not prefill_fits((1, 128, 16), (4, 16, 16))  # fewer rows
  assert plan.rented == 0


def test_rents_the_cheapest_fitting_shape_until_the_padding_would_pay_for_a_compile():
  # Compiled (4,32) and (4,64); a (4,16) call pads 64 positions into (4,32): 0.064 s each.
  plan = measured_plan(((4, 64, 32), (4, 32, 32)), compile_s=0.3)
  picks = [plan.choose((4, 16, 32)) for _ in range(6)]
  # 4 calls rent (debt 0.256 s); the 5th would bring it to 0.32 >= 0.3: it compiles.
  assert picks == [(4, 32, 32)] * 4 + [(4, 16, 32)] * 2
  assert plan.debt[(4, 16, 32)] == pytest.approx(0.256) and plan.rented == 4
  plan.observe_compile((4, 16, 32), 0.3)
  assert plan.choose((4, 16, 32)) == (4, 16, 32) and plan.debt[(4, 16, 32)] == 0
  # A one-row call may rent four rows when a compile costs more than the padding.
  assert plan.choose((1, 24, 32)) == (4, 32, 32)


@pytest.mark.parametrize("compile_s,per_position,calls", [(1.0, 1e-3, 3), (1.0, 1e-3, 40),
                                                          (5.0, 1e-6, 1000), (0.01, 1e-3, 10)])
def test_cost_is_within_twice_the_best_choice_in_hindsight(compile_s, per_position, calls):
  """The ski-rental bound: padding paid plus compiles bought <= 2 x min(compile once,
  always pad), for any number of calls of one uncompiled shape."""
  plan = measured_plan(compile_s=compile_s, per_position=per_position)
  extra = (4 * 32 - 4 * 16) * per_position
  paid = 0.0
  for _ in range(calls):
    shape = plan.choose((4, 16, 32))
    if shape == (4, 16, 32):
      if shape not in plan.compiled:
        paid += compile_s
        plan.observe_compile(shape, compile_s)
    else:
      paid += extra
  assert paid <= 2 * min(compile_s, calls * extra) + 1e-12


def test_engine_rents_compiled_prefill_shapes_with_the_same_tokens(tiny, make_prompts):
  """Prompts of many lengths: the engine that rents compiles fewer prefill programs
  than the one that compiles every bucket, and every request gets the same tokens
  (greedy and seeded sampling)."""
  prompts = make_prompts(24, seed=31, low=3, high=120)
  params = [GenerationParams(max_new_tokens=6, ignore_eos=True),
            GenerationParams(max_new_tokens=6, temperature=0.9, seed=5, ignore_eos=True)]
  config = EngineConfig(max_slots=8, num_blocks=256, prefill_chunk=64, prefix_caching=False)
  results, engines = {}, {}
  for reuse in (True, False):
    jax.clear_caches()  # each engine compiles its own (engines on one model share programs)
    engine = Engine(tiny.model, tiny.tokenizer,
                    dataclasses.replace(config, reuse_compiled_shapes=reuse))
    results[reuse] = [r.token_ids for r in engine.generate(
        [Request(p, params[i % 2], request_id=i) for i, p in enumerate(prompts)])]
    engines[reuse] = engine
  assert results[True] == results[False]
  plan = engines[True]._prefill_shapes
  assert plan.rented > 0 and engines[False]._prefill_shapes is None
  assert engines[True].trace_counts["prefill"] < engines[False].trace_counts["prefill"]
  assert engines[True].trace_counts["prefill"] == len(plan.compiled)


def test_engine_rents_compiled_decode_shapes_with_the_same_tokens(tiny, make_prompts):
  """Long prompts first (wide tables, full rows), then short ones one by one: the
  engine that rents runs them in the compiled wide programs (fewer decode programs) and
  every request gets the same tokens."""
  long_prompts = make_prompts(8, seed=32, low=150, high=160)
  short = make_prompts(3, seed=33, low=3, high=10)
  params = GenerationParams(max_new_tokens=5, temperature=0.9, seed=2, ignore_eos=True)
  config = EngineConfig(max_slots=8, num_blocks=256, prefill_chunk=64, prefix_caching=False)
  tokens, engines = {}, {}
  for reuse in (True, False):
    jax.clear_caches()  # each engine compiles its own (engines on one model share programs)
    engine = Engine(tiny.model, tiny.tokenizer,
                    dataclasses.replace(config, reuse_compiled_shapes=reuse))
    out = engine.generate([Request(p, params, request_id=i) for i, p in enumerate(long_prompts)])
    for j, p in enumerate(short):
      out += engine.generate([Request(p, params, request_id=100 + j)])
    tokens[reuse], engines[reuse] = [r.token_ids for r in out], engine
  assert tokens[True] == tokens[False]
  decode = engines[True]._decode_shapes
  assert decode.rented > 0 and engines[True].trace_counts["decode"] == len(decode.compiled)
  assert engines[True].trace_counts["decode"] < engines[False].trace_counts["decode"]


def test_reuse_compiled_shapes_must_be_a_bool():
  with pytest.raises(ValueError, match="reuse_compiled_shapes must be True or False, got 'no'"):
    EngineConfig(reuse_compiled_shapes="no")


def test_decode_calls_rent_wider_tables_and_more_rows_of_the_same_program_kind():
  from o1jax.engine.shape_plan import decode_fits
  plan = ShapePlan(fits=decode_fits)
  shape = lambda *dims: (*dims, "any", 8)  # (rows, width, stop width, top-K, kind, steps)
  plan.observe_compile(shape(8, 16, 8, 0), 1.0)
  plan.observe_run(shape(8, 16, 8, 0), 8 * 16 * 1e-4 * 8, repeats=8)  # 1e-4 s per row-block
  assert plan.position_seconds == pytest.approx(1e-4)
  assert plan.choose(shape(8, 12, 8, 0), repeats=8) == shape(8, 16, 8, 0)  # 32 x 1e-4 x 8 steps
  assert plan.debt[shape(8, 12, 8, 0)] == pytest.approx(32 * 1e-4 * 8)
  assert plan.choose(shape(1, 16, 8, 0)) == shape(8, 16, 8, 0)
  assert plan.choose(shape(8, 16, 16, 0)) == shape(8, 16, 16, 0)  # other stop-id width: its own
  assert plan.choose(shape(8, 16, 8, 20)) == shape(8, 16, 8, 20)  # with top-K alternatives too
  assert plan.choose(shape(8, 6, 8, 0)) == shape(8, 6, 8, 0)  # 16 is over twice 6
  # Other draw kinds and steps per call (fixed trips) are other programs.
  assert plan.choose((8, 16, 8, 0, "greedy", 8)) == (8, 16, 8, 0, "greedy", 8)
  assert plan.choose((8, 12, 8, 0, "any", 4)) == (8, 12, 8, 0, "any", 4)
