"""The device-resident decode loop: several decode steps per call give the same
tokens, log-probs and decisions as one step per call, with fewer host round trips."""

import itertools

import numpy as np
import pytest

from o1jax.engine import Engine, EngineConfig, GenerationParams, Request


def _engines(tiny, **config):
  return [Engine(tiny.model, tiny.tokenizer, EngineConfig(decode_steps=k, **config)) for k in (1, 8)]


@pytest.fixture(scope="module")
def engines(tiny):
  """One step per call and 8 steps per call, same settings (shared: compiling dominates)."""
  return _engines(tiny, max_slots=8, num_blocks=128)


def _same(a, b):
  assert [r.request_id for r in a] == [r.request_id for r in b]
  for ra, rb in zip(a, b):
    for sa, sb in zip(ra.samples, rb.samples):
      assert sa.token_ids == sb.token_ids
      assert sa.finish_reason == sb.finish_reason
      assert sa.text == sb.text
      if sa.logprobs is not None:
        np.testing.assert_allclose(sa.logprobs, sb.logprobs, rtol=1e-5, atol=1e-5)
      if sa.top_logprobs is not None:
        assert [[i for i, _ in t] for t in sa.top_logprobs] == [[i for i, _ in t] for t in sb.top_logprobs]


def test_mixed_workload_matches_one_step_per_call(tiny, engines, make_prompts):
  """Greedy, sampled, filtered, n=3, eos honoured, stop ids, log-probs and top-K,
  short and long budgets, more requests than slots (so requests wait for slots)."""
  prompts = make_prompts(10, seed=21)
  one, many = engines
  free = many.generate([Request(prompts[0], GenerationParams(max_new_tokens=20, ignore_eos=True))])[0]
  params = [
      GenerationParams(max_new_tokens=20, ignore_eos=True),
      GenerationParams(max_new_tokens=17, temperature=1.0, seed=3, logprobs=True),
      GenerationParams(max_new_tokens=9, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=5,
                       top_logprobs=3),
      GenerationParams(max_new_tokens=13, temperature=1.0, seed=2, n=3, ignore_eos=True),
      GenerationParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(free.token_ids[4],)),
      GenerationParams(max_new_tokens=3, ignore_eos=True),
  ]
  requests = [Request(p, params[i % len(params)], request_id=i) for i, p in enumerate(prompts)]
  calls = [e.metrics.decode_calls for e in engines]
  _same(one.generate(requests), many.generate(requests))
  assert many.metrics.decode_calls - calls[1] < one.metrics.decode_calls - calls[0]
  assert one.metrics.summary()["decode_steps_per_call"] == 1.0
  # The stop id ended request 4 early, on the device, without the id in its output.
  assert many.metrics.summary()["decode_steps_per_call"] > 1.5


def test_stop_string_inside_a_call_drops_the_tokens_after_it(tiny, engines, make_prompts):
  prompt = make_prompts(1, seed=30)[0]
  one, many = engines
  free = many.generate([Request(prompt, GenerationParams(max_new_tokens=24, ignore_eos=True))])[0]
  # A stop string that completes at token 5: mid-call for 8 steps per call.
  stop = tiny.tokenizer.decode(free.token_ids[4:6])
  params = GenerationParams(max_new_tokens=24, ignore_eos=True, stop=(stop,))
  a = one.generate([Request(prompt, params)])
  b = many.generate([Request(prompt, params)])
  _same(a, b)
  assert b[0].finish_reason == "stop" and stop not in b[0].text
  assert len(b[0].token_ids) < 24
  assert not many.has_work()
  events = list(many.stream(Request(prompt, params, request_id=0)))
  assert [e.token_id for e in events if e.token_id is not None] == b[0].token_ids
  assert "".join(e.text for e in events) == b[0].text


def test_preemption_and_context_limit_match_one_step_per_call(tiny, make_prompts):
  """A pool too small for all rows (preemption while reserving a call's blocks)
  and budgets that run into the context limit."""
  prompts = make_prompts(6, seed=40, low=20, high=60)
  params = GenerationParams(max_new_tokens=400, temperature=1.0, seed=9, ignore_eos=True)
  config = dict(max_slots=6, num_blocks=24, max_context=96, prefill_chunk=32)
  one, many = _engines(tiny, **config)
  a = one.generate([Request(p, params) for p in prompts])
  b = many.generate([Request(p, params) for p in prompts])
  _same(a, b)
  assert all(r.finish_reason == "length" and len(r.prompt_token_ids) + len(r.token_ids) == 96
             for r in b)
  assert many.metrics.preemptions > 0
  assert not many.has_work()


def test_token_times_spread_over_the_steps_of_a_call(engines):
  engine = engines[1]
  ticks = itertools.count()  # every clock read advances 1 ms
  clock, engine.clock = engine.clock, lambda: next(ticks) * 1e-3
  calls, steps = engine.metrics.decode_calls, engine.metrics.decode_steps
  try:
    res = engine.generate([Request([5, 6, 7, 8], GenerationParams(max_new_tokens=16, ignore_eos=True))])
  finally:
    engine.clock = clock
  times = res[0].metrics.token_times[0]
  assert len(times) == 16 and all(a < b for a, b in zip(times, times[1:]))
  assert engine.metrics.decode_calls - calls == 2 and engine.metrics.decode_steps - steps == 16


def test_a_request_ends_when_its_last_token_was_sampled(engines):
  """Latency = the sum of the token times: the host's work on the other rows of the call
  after the token (stop strings, streaming) is not part of it, for any sample count."""
  engine = engines[1]
  ticks = itertools.count()  # every clock read advances 1 ms
  clock, engine.clock = engine.clock, lambda: next(ticks) * 1e-3
  try:
    res = engine.generate([Request([5, 6, 7, 8 + i], GenerationParams(
        max_new_tokens=3 + 5 * i, ignore_eos=True, n=1 + i % 2, temperature=1.0, seed=i))
        for i in range(4)])
  finally:
    engine.clock = clock
  for r in res:
    m = r.metrics
    assert m.finish == max(t[-1] for t in m.token_times) > m.arrival
    if len(m.token_times) == 1:  # what the pipelines record: ttft_ms + token_ms = latency_ms
      times = m.token_times[0]
      assert m.ttft + sum(b - a for a, b in zip(times[:-1], times[1:])) == pytest.approx(m.e2e)


def _mixed_requests(tiny, make_prompts, seed):
  prompts = make_prompts(10, seed=seed)
  params = [
      GenerationParams(max_new_tokens=20, ignore_eos=True),
      GenerationParams(max_new_tokens=17, temperature=1.0, seed=3, logprobs=True),
      GenerationParams(max_new_tokens=9, temperature=0.8, top_k=20, top_p=0.9, seed=5,
                       top_logprobs=3),
      GenerationParams(max_new_tokens=13, temperature=1.0, seed=2, n=3, ignore_eos=True),
      GenerationParams(max_new_tokens=11),
  ]
  return [Request(p, params[i % len(params)], request_id=i) for i, p in enumerate(prompts)]


def test_fixed_trip_loop_matches_the_while_loop(tiny, engines, make_prompts, monkeypatch):
  """What a GPU runs (`steps.fixed_trip_loops`: a static trip count, a power of two of
  steps a call, rows idle once stopped) gives the same tokens, log-probs and decisions
  as the CPU's while loop: single steps while prompts fill, calls cut short by waiting
  requests' budgets, rows stopping mid-call."""
  from o1jax.engine import steps
  many = engines[1]
  requests = _mixed_requests(tiny, make_prompts, seed=23)
  want = many.generate(requests)
  monkeypatch.setattr(steps, "fixed_trip_loops", lambda: True)
  fixed = _engines(tiny, max_slots=8, num_blocks=128)[1]
  _same(want, fixed.generate(requests))
  assert fixed.metrics.decode_steps > fixed.metrics.decode_calls  # multi-step calls ran
  # A call runs a power of two of steps (its trips all run): 1/2/4/8-step programs.
  steps_per_call = {shape[-1] for shape in fixed._decode_shapes.compiled}
  assert steps_per_call <= {1, 2, 4, 8} and {1, 8} <= steps_per_call
  assert {shape[-1] for shape in many._decode_shapes.compiled} == {8}
  # Every fixed-trip program was traced as such, none taken from the while-loop engine
  # on the same model (the loop form is part of a shared program's key).
  assert fixed.trace_counts["decode"] == len(fixed._decode_shapes.compiled)


def test_batches_draw_by_their_kind_with_the_same_tokens(tiny, engines, make_prompts):
  """All-greedy, all-sampled (unfiltered) and all-filtered batches compile a draw without
  the sampler's branches their kind cannot take (`steps.draw_kind`); their tokens equal
  those of the same requests drawn together (the general kind)."""
  many = _engines(tiny, max_slots=16, num_blocks=128)[1]
  prompts = make_prompts(4, seed=51)
  greedy = [Request(p, GenerationParams(max_new_tokens=12, ignore_eos=True), request_id=i)
            for i, p in enumerate(prompts)]
  sampled = [Request(p, GenerationParams(max_new_tokens=12, temperature=0.9, seed=4, n=2,
                                         ignore_eos=True), request_id=10 + i)
             for i, p in enumerate(prompts)]
  filtered = Request(prompts[0], GenerationParams(max_new_tokens=12, temperature=0.7, top_p=0.8,
                                                  seed=1, ignore_eos=True), request_id=99)
  alone = many.generate(greedy) + many.generate(sampled) + many.generate([filtered])
  mixed = many.generate(greedy + sampled + [filtered])
  _same(alone, mixed)
  kinds = {shape[4] for shape in many._decode_shapes.compiled}
  assert kinds == {"greedy", "sampled", "filtered", "any"}


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_gpu_decode_call_has_no_data_dependent_control_flow(tiny, kind, monkeypatch):
  """Traced as on a GPU, the decode program of a greedy or an unfiltered sampled batch has
  no `cond` and no `while` outside the kernels (a GPU reads their predicates on the host
  after every step): its loops are scans of static length."""
  import jax
  import jax.extend
  import jax.numpy as jnp

  from o1jax.engine import steps
  from o1jax.testing import as_if_on_gpu

  monkeypatch.delenv("O1JAX_FIXED_TRIP_LOOPS", raising=False)  # a GPU's default loop
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=4, num_blocks=32))
  b, mb = 4, 4
  i32 = lambda v: jnp.full((b,), v, jnp.int32)
  batch = steps.DecodeBatch(
      tokens=i32(5), positions=i32(3), active=jnp.ones(b, bool),
      block_tables=jnp.zeros((b, mb), jnp.int32), keys=jnp.zeros((b, 2), jnp.uint32),
      steps=i32(0), temperature=jnp.full((b,), 0.0 if kind == "greedy" else 0.9),
      top_k=i32(0), top_p=jnp.ones(b), min_p=jnp.zeros(b), draw_kind=kind)
  with as_if_on_gpu():
    assert steps.fixed_trip_loops()  # what the engine's host passes as fixed_trips there
    jaxpr = jax.make_jaxpr(lambda cache, batch: steps.decode_loop(
        engine.graphdef, engine.state, cache, batch, i32(8), jnp.full((b, 8), -1, jnp.int32),
        jnp.int32(8), num_steps=8, fixed_trips=steps.fixed_trip_loops()))(engine.cache, batch)
  found = []

  def walk(jx):
    for eqn in jx.eqns:
      if eqn.primitive.name == "pallas_call":
        continue  # the kernels' own loops run on the device
      found.append(eqn.primitive.name)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  assert "scan" in found  # the decode loop itself
  assert not {"cond", "while"} & set(found), sorted(set(found))


@pytest.mark.parametrize("steps", [0, -1])
def test_decode_steps_must_be_positive(steps):
  with pytest.raises(ValueError, match="decode_steps"):
    EngineConfig(decode_steps=steps)


# --- the loop itself: one driver for every row program (the engine's and the controller's) ---


def test_run_rows_drives_any_row_program():
  """A bigram "model" as a row program: greedy rows follow the table's chain, a sampled
  row draws with fold_in(key, step) (the same bits as calling the sampler directly),
  each row stops at its own limit, and the loop ends when the program says so."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  from o1jax.engine import steps
  from o1jax.model.sampling import sample

  v = 7
  chain = jnp.array([3, 5, 1, 6, 2, 0, 4])  # argmax successor of each token
  table = jax.nn.one_hot(chain, v) * 4.0  # soft enough that the sampled row can stray

  @dataclasses.dataclass(frozen=True)
  class Bigram:
    limits: jax.Array
    temperature: jax.Array
    keys: jax.Array

    def more(self, c):
      return jnp.any(c["n"] < self.limits)

    def feed(self, c):
      live = c["n"] < self.limits
      draw = steps.Draw(keys=self.keys, steps=c["n"], temperature=self.temperature,
                        top_k=jnp.zeros(2, jnp.int32), top_p=jnp.ones(2), min_p=jnp.zeros(2))
      return c["last"], c["n"], live, draw

    def forward(self, c, tokens, positions, live):
      return table[tokens], dict(c, calls=c["calls"] + 1)

    def advance(self, c, logits, drawn):
      live = c["n"] < self.limits
      out = c["out"].at[jnp.arange(2), c["n"]].set(jnp.where(live, drawn, -1), mode="drop")
      return dict(c, last=jnp.where(live, drawn, c["last"]), n=c["n"] + live, out=out)

  keys = jnp.stack([jax.random.PRNGKey(1), jax.random.PRNGKey(2)]).astype(jnp.uint32)
  program = Bigram(limits=jnp.array([5, 3]), temperature=jnp.array([0.0, 1.0]), keys=keys)
  start = dict(last=jnp.array([0, 0]), n=jnp.zeros(2, jnp.int32),
               out=jnp.full((2, 6), -1), calls=jnp.int32(0))
  end = jax.jit(lambda c: steps.run_rows(program, c))(start)
  assert int(end["calls"]) == 5  # the longest row's limit; then `more` is False
  assert end["out"][0].tolist() == [3, 6, 4, 2, 1, -1]  # greedy: the chain from 0
  # The sampled row, redrawn step by step with the sampler called directly.
  last, want = 0, []
  for step in range(3):
    key = jax.random.fold_in(keys[1], step)[None]
    last = int(sample(table[jnp.array([last])], key, jnp.array([1.0]), jnp.array([0]),
                      jnp.array([1.0]), jnp.array([0.0]))[0])
    want.append(last)
  assert end["out"][1].tolist() == want + [-1, -1, -1]
  # A program's own iteration (the controller's verify calls) replaces the plain one.
  twice = lambda p, c: steps.decode_iteration(p, steps.decode_iteration(p, c))
  end2 = jax.jit(lambda c: steps.run_rows(program, c, twice))(start)
  assert int(end2["calls"]) == 6 and end2["out"][0].tolist() == [3, 6, 4, 2, 1, -1]
