"""The latency-aware budget: the reference formula, the live loop on a fake clock, and the
engine applying it to running requests (and priority by remaining steps)."""

import itertools

import pytest

from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.engine.budget import (BudgetConfig, BudgetLoop, LatencyWindow, allocate_budget,
                                 measured_load, token_limit)


@pytest.mark.parametrize("slo, load, steps", [
    (0.5, 0.8, 64),  # base
    (0.3, 1.0, 30),  # 64 * 0.6 / 1.25 = 30.72 -> 30 (truncated, as the reference does)
    (0.5, 1.2, 42),  # 64 / 1.5 = 42.67 -> 42
    (0.25, 0.8, 32),  # half the SLO
    (1.0, 0.8, 128),  # 64 * 2 = 128 (the upper clamp exactly)
    (1.0, 0.4, 128),  # 64 * 2 / 0.5 = 256 -> 128
    (0.5, 3.2, 32),  # the load factor clamps at 2: 64 / 2
    (0.5, 0.2, 128),  # the load factor clamps at 0.5: 64 / 0.5
    (0.1, 0.8, 16),  # 12.8 -> 12 -> 16 (lower clamp)
    (0.26, 0.8, 33),  # 33.28 -> 33
])
def test_allocate_budget_is_the_reference_formula(slo, load, steps):
  assert allocate_budget(slo, load) == steps
  reference = max(16, min(128, int(64 * (slo / 0.5) / min(max(load / 0.8, 0.5), 2.0))))
  assert allocate_budget(slo, load) == reference


@pytest.mark.parametrize("slo, load", [(0, 0.8), (-1, 0.8), (0.5, -0.1), (float("nan"), 0.8)])
def test_allocate_budget_rejects_bad_input(slo, load):
  with pytest.raises(ValueError):
    allocate_budget(slo, load)


def test_token_limit_and_measured_load():
  assert token_limit(200, 128) == 200  # the largest budget runs the configured limit
  assert token_limit(200, 64) == 100 and token_limit(200, 16) == 25
  assert token_limit(200, 51) == 80  # ceil(79.69)
  assert token_limit(3, 16) == 1  # ceil(0.375)
  assert measured_load(busy_slots=6, queued=0, slots=8) == 0.75
  assert measured_load(busy_slots=8, queued=4, slots=8) == 1.5


@pytest.mark.parametrize("field, value, match", [
    ("mode", "live", "budget.mode='live': valid modes are"),
    ("latency_slo_s", 0.0, "budget.latency_slo_s"),
    ("interval_ms", 0, "budget.interval_ms"),
    ("window", 0, "budget.window"),
    ("kv_limit", 1.5, "budget.kv_limit"),
])
def test_budget_config_errors_name_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    BudgetConfig(**{field: value})
  with pytest.raises(ValueError, match=r"budget section has no keys \['slo'\]"):
    BudgetConfig.from_dict({"slo": 1.0})


def test_latency_window_keeps_the_last_and_recent_values():
  w = LatencyWindow(4, max_age_s=10.0)
  assert w.p95() is None
  for t, x in enumerate([10.0, 1.0, 2.0, 3.0, 4.0, float("nan"), -1.0]):  # nan, < 0 ignored
    w.add(x, at=float(t))
  assert [v for _, v in w.values] == [1.0, 2.0, 3.0, 4.0]
  assert w.p95(now=4.0) == pytest.approx(3.85)  # numpy's linear interpolation: 3 + 0.85 * 1
  assert w.p95(now=12.0) == pytest.approx(3.9)  # 1.0 (at 1 s) is 11 s old: 2, 3, 4 remain
  assert w.p95(now=100.0) is None


def test_budget_loop_decides_on_its_clock_from_a_latency_and_load_trace():
  """A fake clock read once per tick: 0, 0.125, 0.25, ... s (exact in binary); interval 250 ms."""
  clock = itertools.count(0.0, 0.125)
  loop = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=0.5, interval_ms=250, window=3),
                    clock=clock.__next__)
  assert loop.steps == 64  # before any decision: the nominal load
  d = loop.tick(busy=8, queued=0, slots=8)  # t=0: the first tick always decides
  assert (d.steps, d.load, d.prune, d.why) == (51, 1.0, False, "load 1.00")  # 64 / 1.25 = 51.2
  assert loop.tick(busy=8, queued=8, slots=8) is None  # t=0.125: inside the interval
  d = loop.tick(busy=8, queued=8, slots=8)  # t=0.25: load 2 -> factor 2 (clamped): 32
  assert (d.steps, d.load) == (32, 2.0)
  # Requests of 0.4, 0.6, 1.0 s: P95 = 0.96 s > SLO 0.5 s -> shrink by 0.5 / 0.96, and prune.
  for seconds in (0.4, 0.6, 1.0):
    loop.observe_request(seconds)
  assert loop.tick(busy=4, queued=0, slots=8) is None  # t=0.375
  d = loop.tick(busy=4, queued=0, slots=8)  # t=0.5: load 0.5 -> 64 / 0.625 = 102.4 -> 102
  assert d.steps == int(102 * 0.5 / 0.96) == 53 and d.prune
  assert d.why == "load 0.50, P95 0.960 s > SLO 0.5 s"
  # Fast requests push the slow ones out of the window (3): P95 under the SLO again.
  for seconds in (0.1, 0.1, 0.1):
    loop.observe_request(seconds)
  loop.tick(busy=4, queued=0, slots=8)  # t=0.625
  d = loop.tick(busy=4, queued=0, slots=8, kv_use=0.9)  # t=0.75: KV above 85% alone prunes
  assert (d.steps, d.prune, d.why) == (102, True, "load 0.50, KV 90% > 85%")
  assert loop.steps == 102 and [x.steps for x in loop.decisions] == [51, 32, 53, 102]
  record = d.to_dict(at_ms=250.04)
  assert record["at_ms"] == 250.0 and record["p95_request_ms"] == 100.0 and record["prune"]


def test_a_slow_start_stops_steering_the_budget_once_it_is_past():
  """Requests of 50 s (a cold start) push the budget to its floor; window_s later they no
  longer count, and the budget returns to what the load gives."""
  clock = iter([0.0, 1.0, 12.0])
  loop = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=0.5, window_s=10.0),
                    clock=clock.__next__)
  loop.tick(busy=4, queued=0, slots=8)  # t=0: load 0.5 -> 102 steps
  for _ in range(8):
    loop.observe_request(50.0)  # stamped 0 s
  assert loop.tick(busy=4, queued=0, slots=8).steps == 16  # t=1: P95 50 s
  d = loop.tick(busy=4, queued=0, slots=8)  # t=12: the 50 s latencies are 12 s old
  assert (d.steps, d.p95_request_s, d.prune) == (102, None, False)


def test_a_clock_that_goes_back_does_not_freeze_the_budget():
  """A custom clock stepped back (an NTP correction of a wall clock, a replayed trace):
  the loop decides at once instead of waiting for the clock to pass its last decision."""
  clock = iter([100.0, 5.0, 5.1, 5.3])
  loop = BudgetLoop(BudgetConfig(mode="adaptive", interval_ms=200.0), clock=clock.__next__)
  assert loop.tick(busy=4, queued=0, slots=8).steps == 102  # t=100: load 0.5
  assert loop.tick(busy=8, queued=8, slots=8).steps == 32  # t=5: back 95 s; was None
  assert loop.tick(busy=8, queued=8, slots=8) is None  # 100 ms after it: within the interval
  assert loop.tick(busy=4, queued=0, slots=8).steps == 102  # 300 ms after it


def test_latencies_stamped_after_a_clock_went_back_stop_counting():
  """A 20 s burst seen before the clock stepped back an hour no longer steers the budget
  (it counted until the clock caught up with its stamps, an hour later)."""
  t = [1000.0]
  loop = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=1.0, window_s=10.0),
                    clock=lambda: t[0])
  loop.tick(busy=4, queued=0, slots=8)
  for _ in range(64):
    loop.observe_request(20.0)
  t[0] += 0.3
  assert loop.tick(busy=4, queued=0, slots=8).steps == 16  # P95 20 s over the 1 s SLO
  t[0] -= 3600.0
  d = loop.tick(busy=4, queued=0, slots=8)
  assert d.p95_request_s is None and d.steps == allocate_budget(1.0, 0.5)


def _fake_clock(step_s=0.01):
  ticks = itertools.count()
  return lambda: next(ticks) * step_s


def test_engine_applies_the_budget_to_running_requests(tiny, make_prompts):
  """8 greedy requests on 4 slots under a live budget (fake clock: every reading 10 ms
  later; interval 20 ms). At the start 4 run and 4 wait: load (4 + 4) / 4 = 2 -> 32 steps
  -> ceil(40 * 32 / 128) = 10 tokens. When the queue has drained the load falls and the
  limits rise. Every output is a prefix of the same request run without a budget (the
  budget only stops requests), and its length is the last limit it ran under."""
  prompts = make_prompts(8, seed=11, low=4, high=12)
  params = GenerationParams(max_new_tokens=40, ignore_eos=True)
  config = EngineConfig(max_slots=4, num_blocks=128, decode_steps=4)
  free = Engine(tiny.model, tiny.tokenizer, config).generate([Request(p, params) for p in prompts])
  clock = _fake_clock()
  budget = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=0.5, interval_ms=20),
                      clock=clock)
  engine = Engine(tiny.model, tiny.tokenizer, config, clock=clock, budget=budget)
  got = engine.generate([Request(p, params) for p in prompts])
  # 4 running + 4 queued: load 2 -> 32 steps; once the first 4 finish, the last 4 run
  # with nothing queued: load 1 -> 51 steps -> ceil(40 * 51 / 128) = 16 tokens.
  assert {(d.load, d.steps) for d in budget.decisions} == {(2.0, 32), (1.0, 51)}
  for g, f in zip(got, free):
    changes = g.metrics.budget
    assert changes[0]["why"] == "budget at arrival" and changes[1]["why"] == "load 2.00"
    assert g.token_ids == f.token_ids[:len(g.token_ids)]
    assert len(g.token_ids) == changes[-1]["tokens"] and g.finish_reason == "length"
  assert [len(g.token_ids) for g in got] == [10] * 4 + [16] * 4
  assert [c["tokens"] for c in got[-1].metrics.budget] == [20, 10, 16]


def test_budget_stops_a_request_already_past_its_new_limit(tiny, make_prompts):
  """A request that generated more than a lowered limit stops at the next tick."""
  prompt = make_prompts(1, seed=12, low=5, high=6)[0]
  clock = _fake_clock()
  budget = BudgetLoop(BudgetConfig(mode="adaptive", interval_ms=10_000), clock=clock)
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=4, num_blocks=64,
                                                           decode_steps=8),
                  clock=clock, budget=budget)
  engine.add_request(Request(prompt, GenerationParams(max_new_tokens=64, ignore_eos=True)))
  for _ in range(4):
    engine.step()
  group = engine._groups[0]
  seq = group.samples[0]
  assert len(seq.generated) > 8 and seq.finish_reason is None
  budget.observe_request(5.0)  # P95 10x the SLO: the next decision shrinks to 16 steps
  budget.decisions[-1] = budget.decisions[-1].__class__(**{**budget.decisions[-1].__dict__,
                                                           "at_s": -1e9})  # interval passed
  engine.step()
  assert seq.finish_reason == "length" and len(seq.generated) > token_limit(64, 16) == 8
  assert group.metrics.budget[-1]["tokens"] == 8
  assert "P95 5.000 s > SLO 0.5 s" in group.metrics.budget[-1]["why"]


def test_budget_stops_a_preempted_request_past_its_new_limit_without_recomputing(tiny,
                                                                                 make_prompts):
  """A sample preempted for memory waits with its tokens; a limit lowered below them
  stopped only running samples, so it was admitted, its prompt and tokens prefilled
  again, and given one token more than the limit."""
  clock = _fake_clock()
  budget = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=1.0, interval_ms=10_000),
                      clock=clock)
  engine = Engine(tiny.model, tiny.tokenizer,
                  EngineConfig(max_slots=2, block_size=4, num_blocks=16, decode_steps=1,
                               prefix_caching=False), clock=clock, budget=budget)
  params = GenerationParams(max_new_tokens=40, ignore_eos=True)
  handles = [engine.add_request(Request(p, params))
             for p in make_prompts(2, seed=13, low=15, high=16)]
  for _ in range(200):
    engine.step()
    waiting = [s for s in engine._waiting if s.generated]
    if waiting:
      break
  seq = waiting[0]
  assert len(seq.generated) > token_limit(40, 16) and seq.preemptions == 1
  budget.observe_request(50.0)  # P95 50x the SLO: the next decision shrinks to 16 steps
  budget.decisions[-1] = budget.decisions[-1].__class__(**{**budget.decisions[-1].__dict__,
                                                           "at_s": -1e9})  # interval passed
  tokens = len(seq.generated)
  engine.step()
  assert seq.finish_reason == "length" and not any(s is seq for s in engine._waiting)
  engine.run_until_idle()
  result = engine.result(seq.group)
  assert (len(result.token_ids), result.finish_reason) == (tokens, "length")  # none added
  assert result.metrics.recomputed_tokens == 0  # its prompt and tokens not prefilled again
  for other in handles:
    if other is not seq.group:
      engine.result(other)
  assert engine.allocator.num_used == 0 and not engine.has_work()


@pytest.mark.parametrize("policy, preempted", [("fifo", "short"), ("shortest_budget", "long")])
def test_remaining_steps_priority_preempts_the_longest_remaining(tiny, make_prompts, policy,
                                                                  preempted):
  """Two requests that cannot both fit the pool: FIFO preempts the later arrival (the
  short one); priority by remaining steps preempts the one with the most tokens left."""
  long_prompt, short_prompt = make_prompts(2, seed=13, low=15, high=16)
  engine = Engine(tiny.model, tiny.tokenizer,
                  EngineConfig(max_slots=2, block_size=4, num_blocks=16, decode_steps=1,
                               prefix_caching=False, policy=policy))
  results = engine.generate([
      Request(long_prompt, GenerationParams(max_new_tokens=40, ignore_eos=True)),
      Request(short_prompt, GenerationParams(max_new_tokens=24, ignore_eos=True))])
  long_, short = (r.samples[0].preemptions for r in results)
  assert engine.metrics.preemptions > 0
  assert (long_ > 0, short > 0) == ((True, False) if preempted == "long" else (False, True))
  assert [len(r.token_ids) for r in results] == [40, 24]


def test_budget_prunes_the_lowest_confidence_sample_of_an_n_sample_request(tiny, make_prompts):
  """Over the KV limit every decision prunes: a request with n = 4 running samples loses
  its lowest-confidence one (mean log-prob so far) per decision down to one. Samples run
  in lockstep, so when a sample was pruned after L tokens, every sample still running had
  L tokens too, none with a lower mean log-prob over them. Each output is a prefix of the
  same sample run without a budget, and the last sample runs to its limit."""
  prompt = make_prompts(1, seed=14, low=6, high=7)[0]
  params = GenerationParams(n=4, max_new_tokens=24, temperature=1.0, ignore_eos=True,
                            logprobs=True)
  config = EngineConfig(max_slots=8, num_blocks=64, decode_steps=2)
  free, = Engine(tiny.model, tiny.tokenizer, config).generate([Request(prompt, params)])
  clock = _fake_clock()
  budget = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=1.0, interval_ms=20,
                                   kv_limit=1e-6), clock=clock)
  got, = Engine(tiny.model, tiny.tokenizer, config, clock=clock, budget=budget).generate(
      [Request(prompt, params)])
  reasons = [s.finish_reason for s in got.samples]
  assert sorted(reasons) == ["length", "pruned", "pruned", "pruned"]
  mean = lambda lps, n: sum(lps[:n]) / n
  for g, f in zip(got.samples, free.samples):
    assert g.token_ids == f.token_ids[:len(g.token_ids)]
  pruned = sorted((s for s in got.samples if s.finish_reason == "pruned"),
                  key=lambda s: len(s.token_ids))
  assert len({len(s.token_ids) for s in pruned}) == 3  # one per decision
  for p in pruned:
    n = len(p.token_ids)
    later = [free.samples[s.index] for s in got.samples
             if s.index != p.index and len(s.token_ids) >= n]
    assert all(mean(p.logprobs, n) <= mean(s.logprobs, n) for s in later)
  assert len(next(s for s in got.samples if s.finish_reason == "length").token_ids) == 24


@pytest.mark.parametrize("slo, match", [
    (float("inf"), r"^latency_slo_s must be finite, got inf$"),  # was: OverflowError from int()
    (float("nan"), r"^latency_slo_s must be finite, got nan$"),  # was: "must be > 0"
    ("0.5", r"^latency_slo_s must be a number, got '0.5'$"),  # was: TypeError from the comparison
])
def test_allocate_budget_names_an_slo_that_is_no_finite_number(slo, match):
  with pytest.raises(ValueError, match=match):
    allocate_budget(slo, 0.8)
  with pytest.raises(ValueError, match=match.replace("^", "^budget.")):
    BudgetConfig(latency_slo_s=slo)
  with pytest.raises(ValueError, match=r"^load must be >= 0, got '1'$"):
    allocate_budget(0.5, "1")
  assert allocate_budget(0.5, float("inf")) == 32  # an infinite load is a clamped factor of 2
  assert allocate_budget(0.5, 10**400) == 32  # (an int past float's range: was OverflowError)


def test_budget_interval_must_be_finite():
  # Before: inf was accepted, and an adaptive budget never re-evaluated.
  for interval in (float("inf"), 0.0, float("nan")):
    with pytest.raises(ValueError, match=r"^budget.interval_ms must be a finite number > 0"):
      BudgetConfig(mode="adaptive", interval_ms=interval)


def test_budget_values_the_worker_would_fail_on_are_named_or_clamped():
  """Before: an SLO past ~2.8e306 s overflowed `int` in the worker; a window past
  sys.maxsize failed as a deque's maxlen there; a str interval / window_s / kv_limit
  compared with a TypeError, and True passed as 1."""
  import sys
  assert allocate_budget(1e308, 0.8) == 128 and allocate_budget(3e306, 0.0) == 128
  assert BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=1e308)).steps == 128
  with pytest.raises(ValueError, match=rf"^budget.window must be at most {sys.maxsize}, "):
    BudgetConfig(window=10**20)
  for name in ("interval_ms", "window_s", "kv_limit"):
    for value in ("200", None, True):
      with pytest.raises(ValueError, match=rf"^budget.{name} must be a number, got {value!r}$"):
        BudgetConfig(**{name: value})
  for name in ("latency_slo_s", "interval_ms", "window_s"):  # an int past float's range
    with pytest.raises(ValueError, match=rf"^budget.{name} must be (finite|a float), got 1000"):
      BudgetConfig(**{name: 10**400})
  # One value, one form: 5 and 5.0 are one budget (the content hash reads the section).
  assert BudgetConfig(latency_slo_s=5, kv_limit=1) == BudgetConfig(latency_slo_s=5.0, kv_limit=1.0)
  assert repr(BudgetConfig(latency_slo_s=5)) == repr(BudgetConfig(latency_slo_s=5.0))


def test_budget_window_must_be_a_count():
  # Before: 2.5 was accepted (a deque's maxlen fails at first use); "x" a TypeError.
  for window in (2.5, "x"):
    with pytest.raises(ValueError, match=rf"^budget.window must be an int >= 1, got {window!r}$"):
      BudgetConfig(window=window)
