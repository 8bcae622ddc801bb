"""Admission between loop calls: more requests than slots stream through the slots.

A loop call returns as soon as a request's rows are all done while another request
waits; the host collects the finished request and prefills the next one into the
freed slot. Every request must get exactly the traces it gets when it runs alone
(rows never depend on their neighbours), on the mock, on a tiny Llama over both
KV caches, and with DeepConf's prior votes (which live per slot)."""

import numpy as np
import pytest
from flax import nnx

from o1jax.controller import (ContiguousLlama, Controller, LoopSettings, PagedLlama,
                              ReasoningRequest, SelfVerify, build_policy, get_policy)
from o1jax.controller.testing import MockTokenizer
from tests.o1jax.controller.conftest import VOCAB
from tests.o1jax.controller.test_twin_and_batch import SAMPLED, _random_mock, _same


def _check_streamed(streamed, alone, rtol=1e-6):
  for ts, ta in zip(streamed.traces, alone, strict=True):
    for a, b in zip(ts, ta, strict=True):
      _same(a, b) if rtol == 1e-6 else _same_scores(a, b, rtol)


def _same_scores(a, b, rtol):
  assert a.token_ids == b.token_ids
  assert [(s.start, s.end, s.action) for s in a.steps] == [(s.start, s.end, s.action)
                                                            for s in b.steps]
  np.testing.assert_allclose([s.score for s in a.steps], [s.score for s in b.steps], rtol=rtol)
  assert a.tokens == b.tokens and a.exit_reason == b.exit_reason


MOCK_PROMPTS = [" A", " B C", " D", " C C C", " bad", " A B", " 7"]


def test_streamed_requests_equal_each_alone_on_the_mock():
  model, tok = _random_mock(1), MockTokenizer(VOCAB)
  requests = [ReasoningRequest(prompt=p, request_id=30 + i, seed=2)
              for i, p in enumerate(MOCK_PROMPTS)]
  streamed = Controller(model, tok, max_rows=4).generate(requests, SAMPLED, 2)  # 2 slots
  alone = [Controller(model, tok).generate([r], SAMPLED, 2).traces[0] for r in requests]
  _check_streamed(streamed, alone)
  # Requests were admitted while others ran: later ones started in later loop calls,
  # and no request waited for the whole batch (each call returned when one finished).
  assert len(set(streamed.invocations)) > 1 and max(streamed.invocations) < len(requests)
  lengths = [max(t.tokens.generated for t in ts) for ts in streamed.traces]
  assert len(set(lengths)) > 1  # requests of different lengths shared the slots
  twin = Controller(model, tok, max_rows=4, python_twin=True).generate(requests, SAMPLED, 2)
  _check_streamed(twin, streamed.traces)
  assert twin.invocations == streamed.invocations


def test_one_slot_runs_requests_one_after_another():
  model, tok = _random_mock(2), MockTokenizer(VOCAB)
  requests = [ReasoningRequest(prompt=p, request_id=i, seed=9) for i, p in enumerate(MOCK_PROMPTS[:3])]
  one = Controller(model, tok, max_rows=2).generate(requests, SAMPLED, 2)
  alone = [Controller(model, tok).generate([r], SAMPLED, 2).traces[0] for r in requests]
  _check_streamed(one, alone)
  assert one.invocations == [1, 1, 1]  # each request: one loop call of its own


PROMPTS = ["hello there", "a much longer prompt than the others", "xyz", "0123456789abcdef", "q"]
SETTINGS = LoopSettings(temperature=0.8, temp_bump=0.3, backtrack_threshold=0.5,
                        max_step_backtracks=1, max_backtracks=2, step_delimiter="a",
                        step_max_tokens=5, max_thinking_tokens=14, max_answer_tokens=3,
                        max_steps=4, verifier=SelfVerify(probe=" ok?", yes="y", no="n"))


@pytest.fixture(scope="module")
def llama_models(tiny_llama):
  contiguous, tok = tiny_llama
  llama = nnx.merge(contiguous.graphdef, contiguous.params)
  return contiguous, PagedLlama(llama, block_size=4), tok


def test_streamed_requests_equal_each_alone_on_a_tiny_llama(llama_models):
  contiguous, paged, tok = llama_models
  requests = [ReasoningRequest(p, request_id=50 + i, seed=3) for i, p in enumerate(PROMPTS)]
  alone = [Controller(contiguous, tok).generate([r], SETTINGS, 2).traces[0] for r in requests]
  assert sum(t.backtracks for ts in alone for t in ts) > 0  # decisions were exercised
  for model, rtol in ((contiguous, 1e-6), (paged, 1e-5)):  # paged: f32 sums in another order
    streamed = Controller(model, tok, max_rows=4).generate(requests, SETTINGS, 2)
    _check_streamed(streamed, alone, rtol)


def test_deepconf_prior_votes_follow_their_request_through_the_slots(llama_models):
  """Per-request DeepConf: the warm-up traces' votes are priors of the second call;
  streamed through 2 slots they must land in the right slot's vote."""
  contiguous, paged, tok = llama_models
  policy = get_policy("deepconf", n=4, warmup=2, window=4, max_thinking_tokens=14,
                      max_answer_tokens=3, step_delimiter="a", step_max_tokens=5, temperature=0.9)
  requests = [ReasoningRequest(p, request_id=70 + i, seed=6) for i, p in enumerate(PROMPTS)]
  together = Controller(contiguous, tok, max_rows=64).run(requests, policy)
  for model in (contiguous, paged):
    streamed = Controller(model, tok, max_rows=4).run(requests, policy)
    for a, b in zip(together, streamed, strict=True):
      assert (a.answer, a.chosen) == (b.answer, b.chosen)
      # Batch shapes differ (64 rows vs 4): f32 sums may round apart (~1e-7).
      assert a.info["threshold"] == pytest.approx(b.info["threshold"], rel=1e-5)
      assert [t.token_ids for t in a.traces] == [t.token_ids for t in b.traces]
      assert [t.exit_reason for t in a.traces] == [t.exit_reason for t in b.traces]
      assert a.votes == pytest.approx(b.votes, rel=1e-5)


def test_prior_votes_stay_with_their_request_in_a_reused_slot(world):
  """Consensus stops hang on the prior votes: a request whose prior (a heavy vote
  for 3) blocks the stop must keep it after its slot held another request."""
  from tests.o1jax.controller.test_consensus import BRANCH, TRIGGERS

  ctl = lambda **kw: world(BRANCH, triggers=TRIGGERS).controller(**kw)
  st = LoopSettings(temperature=1.0, answer_vote=True, conf_window=2, max_thinking_tokens=24,
                    answer_on_eos=True, stop_when_decided=True)
  requests = [ReasoningRequest(prompt="Q", request_id=0, seed=5) for _ in range(3)]
  priors = [[], [("3", 40.0)], []]
  streamed = ctl(max_rows=16).generate(requests, st, 16, prior_votes=priors)  # one slot
  assert streamed.invocations == [1, 1, 1]
  alone = [ctl().generate([r], st, 16, prior_votes=[p]).traces[0]
           for r, p in zip(requests, priors)]
  _check_streamed(streamed, alone)
  stopped = [any(t.stopped_consensus for t in ts) for ts in streamed.traces]
  assert stopped == [True, False, True]  # the prior of request 1 decided its run


def test_paged_pool_is_sized_for_the_slots_not_the_requests(llama_models):
  contiguous, paged, tok = llama_models
  ctl = Controller(paged, tok, max_rows=4)
  requests = [ReasoningRequest(p, request_id=i, seed=1) for i, p in enumerate(PROMPTS * 2)]
  ctl.generate(requests, SETTINGS, 2)  # 10 requests through 2 slots; raises if the pool ran out
  longest = max(len(ctl.encode(p)) for p in PROMPTS)
  plan = ctl.cache_plan(SETTINGS, 4, longest, prompts=2)
  length = ctl.cache_length(SETTINGS, longest)
  assert paged.pool_blocks(4, length, plan) < paged.pool_blocks(4, length, ctl.cache_plan(
      SETTINGS, 4, longest, prompts=10))


def test_adaptive_budget_keeps_replanning_while_requests_stream():
  """A live budget with admission: re-evaluated on its clock (here a fake one that
  passes the 200 ms interval at every reading) between loop calls, the calls that
  free a slot too; every request still finishes and carries the limits it ran under."""
  import itertools
  from o1jax.engine.budget import BudgetConfig, BudgetLoop
  model, tok = _random_mock(3), MockTokenizer(VOCAB)
  requests = [ReasoningRequest(prompt=p, request_id=i, seed=4) for i, p in enumerate(MOCK_PROMPTS)]
  policy = get_policy("think_verify_backtrack", verifier="mean_logprob",
                      max_thinking_tokens=30, step_delimiter="\n\n", step_max_tokens=6,
                      exit_tau=2.0)
  clock = itertools.count(0.0, 0.25).__next__
  budget = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=0.5), clock=clock)
  results = Controller(model, tok, max_rows=2, budget=budget).run(requests, policy)
  assert len(results) == len(requests) and all(r.traces[0].tokens.generated > 0 for r in results)
  assert max(r.loop_invocations for r in results) > 1  # the budget had calls to act between
  assert len(budget.decisions) > len(requests)  # re-planned throughout, not once per request
  # Measured load: 7 requests on 2 slots start at (2 busy + 5 queued) / 2 = 3.5; each
  # admission takes one off the queue (-0.5; two finishing in one call, -1.0) until both
  # slots hold the last two (1.0).
  loads = [d.load for d in budget.decisions]
  assert loads[0] == 3.5 and loads == sorted(loads, reverse=True)
  distinct = sorted(set(loads), reverse=True)
  assert all((a - b) % 0.5 == 0 for a, b in zip(distinct, distinct[1:]))
  assert len(distinct) >= 5 and min(loads) <= 1.0
  for r in results:
    assert r.info["budget"] and all(entry["steps"] >= 16 for entry in r.info["budget"])


def test_budget_over_slo_prunes_the_weakest_running_trace():
  """An SLO no request can meet (1 us): once a request has finished, every decision
  prunes the lowest-confidence running trace of each request with two or more running.
  A pruned trace stops where it is, does not vote (answer None), and every request
  keeps at least one trace that ran to its own end."""
  import itertools
  from o1jax.engine.budget import BudgetConfig, BudgetLoop
  model, tok = _random_mock(1), MockTokenizer(VOCAB)
  requests = [ReasoningRequest(prompt=p, request_id=50 + i, seed=2)
              for i, p in enumerate(MOCK_PROMPTS[:4])]
  budget = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=1e-6, interval_ms=50),
                      clock=itertools.count().__next__)  # 1 s per reading: always due
  batch = Controller(model, tok, max_rows=8, budget=budget).generate(requests, SAMPLED, 4)
  assert not budget.decisions[0].prune and budget.decisions[-1].prune
  pruned = [t for ts in batch.traces for t in ts if t.exit_reason == "pruned"]
  assert pruned and all(t.answer is None for t in pruned)
  for ts in batch.traces:
    assert any(t.exit_reason != "pruned" for t in ts)


class _RecordingController(Controller):
  """Records the request ids in the order `admit` puts them into slots."""

  def __init__(self, *args, **kw):
    super().__init__(*args, **kw)
    self.admitted = []

  def admit(self, state, settings, n, admissions, **kw):
    self.admitted += [req.request_id for _, req, _ in admissions]
    return super().admit(state, settings, n, admissions, **kw)


def test_own_step_limits_equal_the_policy_limit_alone(world):
  """A request's max_steps caps its traces exactly as the same limit in LoopSettings does,
  beside requests that run the policy's limit, through shared slots."""
  from tests.o1jax.controller.test_loop_decisions import CHAIN
  settings = LoopSettings(max_steps=3)
  limits = [1, None, 2, 1, None]
  requests = [ReasoningRequest(prompt="Q", request_id=i, max_steps=s)
              for i, s in enumerate(limits)]
  mixed = world(CHAIN).controller(max_rows=2).generate(requests, settings, 1)
  for req, traces in zip(requests, mixed.traces, strict=True):
    alone = world(CHAIN).controller().generate(
        [ReasoningRequest(prompt="Q", request_id=req.request_id)],
        LoopSettings(max_steps=req.max_steps or 3), 1).traces[0]
    _same(traces[0], alone[0])
  steps = [len(ts[0].steps) for ts in mixed.traces]
  assert steps == [1, 3, 2, 1, 3]  # a step record per accepted step, the last answers


def test_shortest_budget_admits_the_fewest_remaining_steps_first(world):
  """One slot: FIFO admits in request order; shortest_budget by min(own limit, policy's),
  ties in request order. Either way every request gets the traces it gets alone."""
  from tests.o1jax.controller.test_loop_decisions import CHAIN
  settings = LoopSettings(max_steps=3)
  limits = [None, 2, 1, 5, 2, 1]  # effective: 3, 2, 1, 3, 2, 1
  requests = [ReasoningRequest(prompt="Q", request_id=i, max_steps=s)
              for i, s in enumerate(limits)]
  runs = {}
  for admission in ("fifo", "shortest_budget"):
    c = _RecordingController(world(CHAIN).model(), MockTokenizer(world(CHAIN).vocab), max_rows=1,
                             admission=admission)
    runs[admission] = c.generate(requests, settings, 1)
    order = c.admitted
    assert order == ([0, 1, 2, 3, 4, 5] if admission == "fifo" else [2, 5, 1, 4, 0, 3])
  for a, b in zip(runs["fifo"].traces, runs["shortest_budget"].traces, strict=True):
    _same(a[0], b[0])
  with pytest.raises(ValueError, match="admission='length_groups'"):
    world(CHAIN).controller(admission="length_groups")
  # Under a live budget (its floor: 16 steps) the rows run min(budget, own): the order is
  # by those, not by the policy's 3 (which tied every request limited above it: FIFO).
  import itertools
  from o1jax.engine.budget import BudgetConfig, BudgetLoop
  budget = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=0.5),
                      clock=itertools.count(0.0, 0.25).__next__)
  c = _RecordingController(world(CHAIN).model(), MockTokenizer(world(CHAIN).vocab), max_rows=1,
                           admission="shortest_budget", budget=budget)
  requests = [ReasoningRequest(prompt="Q", request_id=i, max_steps=s)
              for i, s in enumerate([10, 5, None, 4])]
  batch = c.generate(requests, settings, 1)
  steps = [len(ts[0].steps) for ts in batch.traces]
  assert steps[:2] + steps[3:] == [10, 5, 4] and steps[2] >= 16
  assert c.admitted == [3, 1, 0, 2]


@pytest.mark.parametrize("fields, match", [
    (dict(max_rows=0), r"^max_rows must be an int >= 1, got 0$"),  # was: a 0-row loop
    (dict(max_rows=8.0), r"^max_rows must be an int >= 1, got 8.0$"),
    (dict(top_k=0), r"^top_k must be an int >= 1, got 0$"),  # was: 0/0 confidences
    (dict(pattern_capacity=True), r"^pattern_capacity must be an int >= 1, got True$"),
    (dict(iterations_per_call=-1), r"^iterations_per_call must be an int >= 0, got -1$"),
    (dict(python_twin="yes"), r"^python_twin must be a bool, got 'yes'$"),
    (dict(extract_answer="\\d+"), r"^extract_answer must be a function of the text"),
    (dict(budget={"mode": "adaptive"}), r"^budget must be a BudgetLoop or None, got dict$"),
    (dict(speculative="prompt_lookup"),
     r"^speculative must be a SpeculativeConfig or None, got str$"),
])
def test_controller_arguments_are_checked_when_it_is_built(world, fields, match):
  from tests.o1jax.controller.test_loop_decisions import CHAIN
  with pytest.raises(ValueError, match=match):
    world(CHAIN).controller(**fields)
  assert world(CHAIN).controller(max_rows=np.int64(4)).max_rows == 4
  assert world(CHAIN).controller(top_k=10**6).top_k == len(VOCAB)  # every token


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True])
def test_request_max_steps_is_checked(bad):
  with pytest.raises(ValueError, match="max_steps must be an int >= 1"):
    ReasoningRequest(prompt="Q", max_steps=bad)
  assert ReasoningRequest(prompt="Q", max_steps=np.int64(4)).max_steps == 4


@pytest.mark.parametrize("fields, match", [
    (dict(request_id=-1), r"^request_id must be an int in \[0, 2\*\*64\) or a str, got -1$"),
    (dict(request_id=2**64), r"^request_id must be an int in \[0, 2\*\*64\)"),
    (dict(request_id=b"a"), r"^request_id must be an int in \[0, 2\*\*64\) or a str, got b'a'$"),
    (dict(request_id=1.5), r"^request_id must be an int"),  # was: read as 1
    (dict(request_id=True), r"^request_id must be an int"),
    (dict(seed=2**63), r"^request 0: seed must be an int in \[-2\*\*63, 2\*\*63\)"),
    (dict(seed=1.5), r"^request 0: seed must be an int"),
])
def test_request_id_and_seed_are_checked(fields, match):
  with pytest.raises(ValueError, match=match):
    ReasoningRequest(prompt="Q", **fields)


def test_bad_requests_and_prompts_are_refused_before_the_loop(world):
  """Every one of these used to run silently wrong (a prompt per character, token ids
  clamped into the vocabulary, 13.0 read as 13, bytes read as ids) or crash unnamed."""
  from tests.o1jax.controller.test_loop_decisions import CHAIN
  ctl = world(CHAIN).controller()
  policy = {"name": "greedy_cot", "max_thinking_tokens": 4}
  ok, = ctl.run(["Q"], policy)
  for requests, match in [
      ("QQ", r"^requests must be a list of requests or prompts, got one str$"),
      ([None], r"^prompt must be text, chat messages or token ids, got NoneType$"),
      ([b"Q"], r"^prompt must be text, chat messages or token ids, got bytes$"),
      ([{"role": "user", "content": "Q"}],  # one message, not in a list
       r"^prompt must be text, chat messages or token ids, got dict$"),
      ([[999]], r"^prompt has token ids outside the vocabulary \[0, 20\): \[999\]$"),
      ([[-1]], r"^prompt has token ids outside the vocabulary"),
      ([[13.0]], r"^prompt token ids must be ints, got 13.0$"),
      ([ReasoningRequest("Q", request_id=3), ReasoningRequest("Q", request_id=3, seed=1)],
       r"^request ids must be unique in one run, got \[3\] more than once \("),
      # Two requests without ids, or a bare prompt at an explicit id's position: the message
      # says where the ids came from (they were never written).
      ([ReasoningRequest("Q"), ReasoningRequest("R")],
       r"^request ids must be unique in one run, got \[0\] more than once \(a prompt given bare "
       r"takes its position in the list as id, and a ReasoningRequest's request_id defaults to 0\)$"),
      (["Q", "Q ", [13, 999]], r"^request 2 \(request_id=2\): prompt has token ids outside the "),
      ([ReasoningRequest("Q", request_id="a"), ReasoningRequest("Q", request_id=1),
        ReasoningRequest("R", request_id="a")],
       r"^request ids must be unique in one run, got \['a'\] more than once"),
  ]:
    with pytest.raises(ValueError, match=match):
      ctl.run(requests, policy)
  assert ctl.run([], policy) == []
  again, = ctl.run(["Q"], policy)
  assert again.traces[0].token_ids == ok.traces[0].token_ids
  # A str id (the engine's Request takes one) keys its samples as the engine hashes it.
  sampled = {"name": "self_consistency", "n": 3, "max_thinking_tokens": 4, "temperature": 1.0}
  named = ReasoningRequest("Q", request_id="item-7", seed=5)
  first, other = ctl.run([named, ReasoningRequest("Q", request_id="item-8", seed=5)], sampled)
  assert first.request_id == "item-7"
  assert [t.token_ids for t in ctl.run([named], sampled)[0].traces] == [t.token_ids for t in first.traces]
  with pytest.raises(ValueError, match=r"^n must be an int >= 1, got 2.5$"):
    ctl.generate([ReasoningRequest("Q")], LoopSettings(), 2.5)
  with pytest.raises(ValueError, match=r"^conf_stop has 2 entries for 1 requests$"):
    ctl.generate([ReasoningRequest("Q")], LoopSettings(), 1, conf_stop=[0.0, 1.0])


def test_live_budget_replaces_the_policy_limit_but_not_the_requests_own(world):
  """A live budget replaces the policy's step limit (3 here; the budget's floor is 16)
  but a request limited to 1 step keeps its 1."""
  import itertools
  from o1jax.engine.budget import BudgetConfig, BudgetLoop
  from tests.o1jax.controller.test_loop_decisions import CHAIN
  budget = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=0.5),
                      clock=itertools.count(0.0, 0.25).__next__)
  requests = [ReasoningRequest(prompt="Q", request_id=i, max_steps=s)
              for i, s in enumerate([1, None])]
  batch = world(CHAIN).controller(max_rows=2, budget=budget).generate(
      requests, LoopSettings(max_steps=3), 1)
  assert budget.decisions and budget.steps >= 16
  steps = [len(ts[0].steps) for ts in batch.traces]
  assert steps[0] == 1 and steps[1] > 3


def test_a_loop_state_larger_than_the_device_is_refused_before_allocating(world):
  """Before: numpy's MemoryError (8 GiB for n=2**31 rows; 4 TiB for 10**12), or XLA's RESOURCE_EXHAUSTED for a
  huge token budget or DeepConf window, from inside the state's allocation."""
  from tests.o1jax.controller.test_loop_decisions import CHAIN
  ctl = world(CHAIN).controller(max_rows=8)
  what = r"^(deepconf: )?the reasoning loop \(\d+ rows for n=\d+, \d+ positions each, conf_window \d+\) "
  for policy, detail in [
      ({"name": "self_consistency", "n": 100_000, "max_thinking_tokens": 2**20},
       r"131072 rows for n=100000, \d+ positions each"),  # (rows: a bucket)
      # (each fits the loop's int32 counters; 64 rows of them do not fit a device)
      ({"name": "self_consistency", "n": 64, "max_thinking_tokens": 2**30},
       r"64 rows for n=64, 2147483648 positions each"),
      ({"name": "self_consistency", "n": 64, "max_answer_tokens": 2**30},
       r"64 rows for n=64, 2147483648 positions each"),
      # (a window no longer than the thinking it reads: a longer one is refused at once)
      ({"name": "deepconf", "n": 64, "warmup": 64, "window": 2**30, "max_thinking_tokens": 2**30},
       r"conf_window 1073741824"),
  ]:
    with pytest.raises(ValueError, match=what + r"needs [\d,.]+ GiB but the device has [\d,.]+ GiB: "
                                                r"lower n, max_rows, the token budgets"):
      ctl.run(["Q"], policy)
    with pytest.raises(ValueError, match=detail):
      ctl.run(["Q"], policy)
    with pytest.raises(ValueError, match=detail):  # what a pipeline worker checks at load
      ctl.check_policy_fits(build_policy(policy))
  with pytest.raises(ValueError, match=r"^self_consistency: n must be an int in \[1, 100000\], "
                                       r"got 2147483648$"):  # (a count past any study's)
    ctl.run(["Q"], {"name": "self_consistency", "n": 2**31})
  assert ctl.run(["Q"], {"name": "self_consistency", "n": 9})[0].answer is not None  # n > max_rows
  for policy in ({"name": "self_consistency", "n": 9}, {"name": "deepconf", "n": 64},
                 {"name": "think_verify_backtrack"}, {"name": "budget_forcing"}):
    ctl.check_policy_fits(build_policy(policy))


@pytest.mark.parametrize("section, traces", [
    ({"name": "greedy_cot"}, 1), ({"name": "budget_forcing"}, 1),
    ({"name": "think_verify_backtrack"}, 1), ({"name": "self_consistency", "n": 12}, 12),
    ({"name": "best_of_n", "n": 5}, 5),
    ({"name": "deepconf", "n": 16, "warmup": 4}, 12),  # warm-up call, then the other 12
    ({"name": "deepconf", "n": 16, "warmup": 12}, 12),
    ({"name": "deepconf", "n": 16, "warmup": 4, "threshold": 1.0}, 16),  # one call of all
])
def test_traces_per_call_is_the_largest_generate_call(section, traces):
  """What `check_policy_fits` sizes: the policy's largest `generate` call (a real run's
  calls are recorded in tests/o1jax/controller/test_policies.py)."""
  assert build_policy(section).traces_per_call == traces


def test_token_budgets_past_the_loops_int32_counters_are_named(world):
  """Before: the int32 knobs wrapped around: step_max_tokens=2**31 - 1 ended every trace at
  once with no answer, max_step_backtracks=10**12 became a negative limit."""
  from tests.o1jax.controller.test_loop_decisions import CHAIN
  ctl = world(CHAIN).controller()
  for fields in (dict(max_step_backtracks=10**12), dict(step_max_tokens=2**31)):
    name, value = next(iter(fields.items()))
    with pytest.raises(ValueError, match=rf"^{name}={value} exceeds the loop's int32 counters "
                                         r"\(2147483647\)$"):
      LoopSettings(**fields)
  with pytest.raises(ValueError, match=r"^a trace may generate \d+ tokens \(max_thinking_"
                                       r"tokens \+ .*\), more than the loop's int32 counters hold"):
    ctl.run(["Q"], {"name": "greedy_cot", "step_max_tokens": 2**31 - 1})
  with pytest.raises(ValueError, match=r"^a trace may generate 5368709\d+ tokens"):
    # (with max_step_backtracks 0 no step can be backtracked: the budget leaves them out)
    ctl.generate([ReasoningRequest("Q")], LoopSettings(step_max_tokens=2**30, max_backtracks=4,
                                                      max_step_backtracks=4), 1)


def test_requests_and_policy_names_of_the_wrong_type_are_named(world):
  from tests.o1jax.controller.test_loop_decisions import CHAIN
  ctl = world(CHAIN).controller()
  # Before: TypeError: 'NoneType' object is not iterable / unhashable type: 'list'.
  with pytest.raises(ValueError, match=r"^requests must be a list of requests or prompts, got NoneType$"):
    ctl.run(None, "greedy_cot")
  with pytest.raises(ValueError, match=r"^unknown policy \['greedy_cot'\]; valid policies: "):
    ctl.run(["Q"], {"name": ["greedy_cot"]})
  with pytest.raises(ValueError, match=r"^think_verify_backtrack: latency_slo_s must be finite, got inf$"):
    get_policy("think_verify_backtrack", latency_slo_s=float("inf"))  # was: OverflowError


def test_a_prompt_longer_than_the_models_context_is_refused(tiny_llama):
  """Before: the controller ran it past the context (RoPE positions the model never saw)
  and answered, where the engine and the Generator refuse it."""
  decode_model, tok = tiny_llama  # max_context 512
  ctl = Controller(decode_model, tok)
  policy = {"name": "greedy_cot", "max_thinking_tokens": 2, "max_answer_tokens": 1}
  with pytest.raises(ValueError, match=r"^prompt has 600 tokens but the model's context is 512 "
                                       r"tokens$"):
    ctl.run([[5] * 600], policy)
  assert ctl.run([[5] * 20], policy)[0].traces


def test_a_thinking_budget_past_the_models_context_is_lowered_for_that_request(tiny_llama, caplog):
  """The loop has no stop of its own at the context: a prompt that fits with a budget that
  does not ran on at positions the model never saw. Now that request's thinking budget is
  lowered to what fits (the engine likewise ends a sequence at the context); a request
  that fits keeps its budget and its traces, whatever it runs beside."""
  decode_model, tok = tiny_llama  # max_context 512
  ctl = Controller(decode_model, tok)
  policy = {"name": "budget_forcing", "max_thinking_tokens": 400, "min_thinking_tokens": 400,
            "max_answer_tokens": 8}
  long_prompt, short_prompt = [7] * 100, [9] * 10
  with caplog.at_level("WARNING", logger="o1jax.controller.controller"):
    together = ctl.run([long_prompt, short_prompt], policy)
    ctl.run([long_prompt], policy)
  alone = ctl.run([short_prompt], policy)[0]
  # One warning for the job's console (pipelines.eval prints workers' warnings), not one
  # per request.
  warned = [r.getMessage() for r in caplog.records if "thinking_limit" in r.getMessage()]
  assert len(warned) == 1 and warned[0].startswith(
      "controller: max_thinking_tokens=400 does not fit the model's context of 512 tokens"), warned
  long_trace = together[0].traces[0]
  assert len(long_prompt) + len(long_trace.token_ids) <= 512
  assert long_trace.tokens.thinking <= together[0].info["thinking_limit"] < 400  # lowered
  assert "thinking_limit" not in together[1].info
  assert together[1].traces[0].token_ids == alone.traces[0].token_ids
  assert alone.traces[0].tokens.thinking >= 400  # min_thinking_tokens: the full budget ran
  # A prompt whose answer budget alone passes the context is named, before any request
  # runs (it was found at its turn: the earlier requests' traces were lost).
  with pytest.raises(ValueError, match=r"^prompt has 500 tokens: with "
                                       r"max_answer_tokens=8 and the forced text it does not "
                                       r"fit the model's context of 512 tokens$"):
    ctl.run([[5] * 500], policy)
  admitted = []
  real_admit = ctl.admit
  ctl.admit = lambda *a, **k: admitted.append(1) or real_admit(*a, **k)
  with pytest.raises(ValueError, match=r"^request 2 \(request_id=2\): prompt has 500 tokens: "):
    ctl.run([short_prompt, [9] * 11, [5] * 500], policy)
  assert admitted == []  # nothing ran


def test_generate_arguments_a_policy_of_ones_own_may_get_wrong_are_named(world):
  """Controller.generate, what a researcher's own policy calls. Before: a NaN threshold or
  vote floor silently stopped / filtered nothing; the others were an AttributeError,
  TypeError, ValueError ("could not convert string to float") or OverflowError (uint32)
  from inside the batch's setup."""
  from tests.o1jax.controller.test_loop_decisions import CHAIN
  ctl = world(CHAIN).controller()
  req = [ReasoningRequest("Q", request_id=1)]
  vote = LoopSettings(answer_vote=True)
  for args, kwargs, match in [
      ((req, LoopSettings(), 2), dict(conf_stop=float("nan")),
       r"^conf_stop entries must be numbers \(not NaN\), got nan$"),
      ((req, LoopSettings(), 2), dict(conf_stop="x"), r"^conf_stop entries must be numbers \(not NaN\), "
                                                      r"got 'x'$"),
      ((req, LoopSettings(), 2), dict(conf_stop=[None]), r"^conf_stop entries .*got None$"),
      ((req, vote, 2), dict(vote_floor=float("nan")), r"^vote_floor entries must be numbers"),
      ((req, vote, 2), dict(prior_votes=[[5]]),
       r"^prior_votes entries must be \(answer key or None, weight\) pairs, got 5$"),
      ((req, vote, 2), dict(prior_votes=[[("7", float("nan"))]]), r"^prior_votes entries .*got \('7', nan\)$"),
      ((req, {"temperature": 1.0}, 2), {}, r"^settings must be LoopSettings, got dict$"),
      ((["Q"], LoopSettings(), 1), {}, r"^requests must be ReasoningRequests \(Controller.run also "
                                       r"takes prompts\), got str$"),
      ((req, LoopSettings(), 2), dict(sample_offset=2**40),
       r"^the last sample index \(sample_offset \+ n - 1\) must be an int in \[0, 2\*\*32\), "
       r"got 1099511627777$"),
  ]:
    with pytest.raises(ValueError, match=match):
      ctl.generate(*args, **kwargs)
  ok = ctl.generate(req, vote, 2, conf_stop=-float("inf"), vote_floor=0.0, prior_votes=[[("7", 1.0)]])
  assert len(ok.traces[0]) == 2


def test_objects_of_the_wrong_kind_are_named_when_built(tiny_llama):
  """Passing the checkpoint for the Llama, or the Llama for its decode model, are natural
  slips; each was an AttributeError, a KeyError or a JAX TypeError at the first call."""
  import types
  from o1jax.model import Generator, Llama
  decode_model, tok = tiny_llama
  ck = types.SimpleNamespace(config=decode_model.config, params={})
  for build, message in [
      (lambda: Controller(_llama_of(decode_model), tok),
       r"^model must be a decode model: wrap the Llama, ContiguousLlama\(llama\) or "),
      (lambda: Controller(decode_model, None),
       r"^tokenizer must be the checkpoint's tokenizer \(ck\.tokenizer\), got NoneType$"),
      (lambda: ContiguousLlama(ck), r"^ContiguousLlama takes an o1jax\.model\.Llama, got "
                                    r"SimpleNamespace \(build it: Llama\(ck\.config, ck\.params\)\)$"),
      (lambda: PagedLlama(ck), r"^PagedLlama takes an o1jax\.model\.Llama, got SimpleNamespace"),
      (lambda: Generator(ck, tok), r"^Generator takes an o1jax\.model\.Llama, got SimpleNamespace "
                                   r"\(build it: Llama\(ck\.config, ck\.params\)\)$"),
      (lambda: Llama(decode_model.config, {}),
       r"^params must be the checkpoint's parameters \(ck\.params\): no 'embed' in a dict$"),
      (lambda: Llama(None, {}), r"^config must be the checkpoint's ModelConfig \(ck\.config\), "
                                r"got NoneType$")]:
    with pytest.raises(ValueError, match=message):
      build()


def _llama_of(decode_model):
  from flax import nnx
  return nnx.merge(decode_model.graphdef, decode_model.params)


def test_threads_sharing_a_controller_take_turns_and_get_their_traces(tiny_llama):
  """A run's logs (budget decisions, latencies, lowered thinking budgets) are the
  controller's: two runs at once mixed them. Runs take turns now."""
  import concurrent.futures
  decode_model, tok = tiny_llama
  ctl = Controller(decode_model, tok)
  policy = {"name": "self_consistency", "n": 2, "temperature": 1.0, "max_thinking_tokens": 6,
            "max_answer_tokens": 3}
  batches = [[[5, 6, 7]], [[9, 10]], [[11, 12, 13, 14]]]
  # (each batch's request has id 0: the logs of runs at once went to one another's)
  seen = lambda r: ([t.token_ids for t in r.traces], len(r.info.get("token_ms", [])))
  alone = [seen(ctl.run(b, policy)[0]) for b in batches]
  assert all(n_times > 0 for _, n_times in alone)
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    futures = [pool.submit(ctl.run, b, policy) for b in batches]
    threaded = [seen(f.result()[0]) for f in futures]
  assert threaded == alone


def test_traces_drawn_from_non_finite_logits_exit_error_without_an_answer(tmp_path, caplog):
  """A finite weight that overflows (3e38 in the final norm) makes the logits NaN; such a
  trace exits "error", has no answer and does not vote (its tokens are arbitrary)."""
  from o1jax.checkpoint import load_checkpoint
  from o1jax.model import Llama
  from o1jax.testing import tiny_config, write_hf_checkpoint
  write_hf_checkpoint(tmp_path, tiny_config(max_context=128), seed=5)
  ck = load_checkpoint(tmp_path)
  params = dict(ck.params)
  params["final_norm"] = np.full_like(np.asarray(params["final_norm"]), 3e38)
  ctl = Controller(ContiguousLlama(Llama(ck.config, params)), ck.tokenizer)
  with caplog.at_level("WARNING", logger="o1jax.controller.controller"):
    result, = ctl.run([[5, 6, 7]], {"name": "self_consistency", "n": 2, "temperature": 1.0,
                                    "max_thinking_tokens": 4, "max_answer_tokens": 2})
  assert [(t.exit_reason, t.answer) for t in result.traces] == [("error", None)] * 2
  assert result.answer is None
  assert any("logits were not finite" in r.getMessage() for r in caplog.records)


def test_a_self_verify_probe_is_read_inside_the_models_context(tmp_path, monkeypatch):
  """The thinking budget near the context leaves room for the verifier's probe (written
  after a step, a forced "Wait" before it), whose verdict is read at the probe's last
  position: every logit the loop computes lies inside the context. Before, a 90-token
  prompt (context 136) read a 40-token probe's verdict at position 137."""
  import jax
  from o1jax.checkpoint import load_checkpoint
  from o1jax.controller import paged_model
  from o1jax.model import Llama
  from o1jax.testing import tiny_config, write_hf_checkpoint

  write_hf_checkpoint(tmp_path, tiny_config(max_context=136), seed=6)  # (its own programs)
  ck = load_checkpoint(tmp_path)
  read = []
  forward = paged_model.PagedLlama.forward

  def recording(self, params, cache, tokens, starts, logits_at):
    jax.debug.callback(lambda s, at: read.append(int(np.max(s + at))), starts, logits_at)
    return forward(self, params, cache, tokens, starts, logits_at)

  monkeypatch.setattr(paged_model.PagedLlama, "forward", recording)
  # (The byte tokenizer makes the default probe 40 tokens: past the default capacity of
  # 16; the call runs with one that fits.)
  ctl = Controller(PagedLlama(Llama(ck.config, ck.params), block_size=16), ck.tokenizer)
  policy = get_policy("think_verify_backtrack", max_thinking_tokens=64, max_answer_tokens=8,
                      step_max_tokens=8)
  settings = policy.loop_settings()
  probe = len(ck.tokenizer.encode(settings.verifier.probe)) + len(
      ck.tokenizer.encode(settings.wait_text))
  rng = np.random.default_rng(0)
  for length in (60, 90):
    read.clear()
    result, = ctl.run([rng.integers(3, 259, size=length).tolist()], policy)
    assert read and max(read) < 136
    assert result.info.get("thinking_limit", 64) == min(64, max(0, 136 - length - probe))
  assert result.tokens.probe == 0  # no room for a probe: no step was verified


def test_the_live_budget_sees_the_wait_for_a_slot(monkeypatch):
  """The budget's P95 is of end-to-end latency, as the engine's: a request that waited for
  a slot reports the wait too (it reported from its admission: a queue far past the SLO
  looked fast). Its log starts at 0 ms with the budget it was admitted under (it read
  the time since its admission of a decision made before it: negative)."""
  import itertools
  import types
  from o1jax.controller import controller as controller_module
  from o1jax.engine.budget import BudgetConfig, BudgetLoop
  # The controller's clock advances 1 s per reading: every wait is long and exact.
  monkeypatch.setattr(controller_module, "time",
                      types.SimpleNamespace(perf_counter=itertools.count(0.0, 1.0).__next__))
  model, tok = _random_mock(3), MockTokenizer(VOCAB)
  requests = [ReasoningRequest(prompt=p, request_id=i, seed=4) for i, p in enumerate(MOCK_PROMPTS)]
  policy = get_policy("think_verify_backtrack", verifier="mean_logprob",
                      max_thinking_tokens=30, step_delimiter="\n\n", step_max_tokens=6,
                      exit_tau=2.0)
  budget = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=0.5, interval_ms=1e9))
  observed = []
  monkeypatch.setattr(budget, "observe_request", observed.append)
  batch = Controller(model, tok, max_rows=2, budget=budget).generate(requests, policy.loop_settings(), 1)
  # Finished in order of admission on 2 slots; the last admitted waited for 5 finishes.
  assert len(observed) == len(requests)
  assert max(observed) > max(batch.wall_time_s) + 5
  results = Controller(model, tok, max_rows=2, budget=budget).run(requests, policy)
  assert len(budget.decisions) == 1  # one decision (the interval is long), made first
  for r in results:
    assert r.info["budget"][0]["at_ms"] == 0.0 and all(e["at_ms"] >= 0 for e in r.info["budget"])
  # An interval past what a float divides into: the loop calls' size overflowed to inf
  # (OverflowError: the batch's samples went to dead letters).
  longest = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=0.5, interval_ms=1.7e308))
  assert len(Controller(model, tok, max_rows=2, budget=longest).run(requests, policy)) == len(requests)


def test_the_live_budget_sees_each_deepconf_request_once_end_to_end(monkeypatch):
  """DeepConf runs a warm-up call, then the rest: a request is observed once, when it
  ends, from the start of its run (it was observed in each call, from that call's start:
  twice, each half its latency)."""
  import itertools
  import types
  from o1jax.controller import controller as controller_module
  from o1jax.engine.budget import BudgetConfig, BudgetLoop
  ticks = itertools.count(0.0, 1.0)
  monkeypatch.setattr(controller_module, "time", types.SimpleNamespace(perf_counter=ticks.__next__))
  model, tok = _random_mock(3), MockTokenizer(VOCAB)
  requests = [ReasoningRequest(prompt=p, request_id=i, seed=4) for i, p in enumerate(MOCK_PROMPTS)]
  budget = BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=0.5, interval_ms=1e9))
  observed = []
  monkeypatch.setattr(budget, "observe_request", observed.append)
  ctl = Controller(model, tok, max_rows=4, budget=budget)
  results = ctl.run(requests, get_policy("deepconf", n=4, warmup=2, consensus=2.0,
                                         stop_when_decided=False))
  assert len(observed) == len(requests) == len(results)
  assert observed == sorted(observed)  # one start: the later a request ends, the longer
  # The last request ended in the second call: its latency spans the warm-up call too.
  assert observed[-1] > sum(r.wall_time_s for r in results[-1:])


def test_forced_and_probe_texts_longer_than_the_default_capacities_run(tiny_llama):
  """An answer_prefix or a verifier probe longer than the default array sizes
  (force 20, probe 16 tokens; byte tokens here): the call runs with sizes that fit
  (every sample of such a config went to dead letters: "answer_prefix is 19 tokens;
  capacity is 16"); the controller's own sizes stay for other calls."""
  decode_model, tok = tiny_llama
  ctl = Controller(decode_model, tok)
  prefix = "After all that checking, the final answer is"  # 44 byte tokens
  policy = get_policy("think_verify_backtrack", max_thinking_tokens=24, max_answer_tokens=4,
                      step_max_tokens=6, step_delimiter="a", answer_prefix=prefix)
  result, = ctl.run([[7] * 20], policy)
  trace = result.traces[0]
  assert ctl.capacities(policy.loop_settings()) == (64, 64)
  assert (ctl.force_capacity, ctl.probe_capacity) == (20, 16)
  assert prefix in tok.decode(trace.token_ids) and result.tokens.probe > 0


def test_trace_texts_are_what_their_tokens_add_to_the_prompt(tmp_path):
  """A Llama-2 style vocabulary drops a text's first space when decoding (the prefix's
  Strip): a trace decoded alone lost the space its first token spells. Its text is what
  its tokens add to the prompt's text (decoding the whole, taking the prompt off)."""
  import string

  from o1jax.checkpoint import Tokenizer, load_checkpoint
  from o1jax.model import Llama
  from o1jax.testing import tiny_config, write_hf_checkpoint
  write_hf_checkpoint(tmp_path, tiny_config(vocab_size=320, max_context=128), seed=5)
  ck = load_checkpoint(tmp_path)
  model = Llama(ck.config, dict(ck.params, embed=np.asarray(ck.params["embed"]) * 0.05))
  words = ["\u2581" + c for c in string.ascii_lowercase] + list(string.ascii_lowercase)
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + words
  spm = Tokenizer.from_gguf_metadata({
      "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
      "tokenizer.ggml.scores": [0.0] * len(tokens),
      "tokenizer.ggml.token_type": [3, 3, 3, 2] + [6] * 256 + [1] * len(words),
      "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1})
  assert spm.drops_text_start
  rng = np.random.default_rng(4)
  prompts = [[int(i) for i in rng.integers(260, len(tokens), 6)] for _ in range(64)]
  results = Controller(ContiguousLlama(model), spm).run(
      prompts, {"name": "self_consistency", "n": 2, "temperature": 3.0,
                "max_thinking_tokens": 5, "max_answer_tokens": 2})
  differs = 0
  for prompt, result in zip(prompts, results):
    head = spm.decode(prompt, skip_special=True)
    for trace in result.traces:
      whole = spm.decode(prompt + trace.token_ids, skip_special=True)
      assert whole.startswith(head) and trace.text == whole[len(head):]
      differs += trace.text != spm.decode(trace.token_ids, skip_special=True)
  assert differs  # (the case is exercised)
