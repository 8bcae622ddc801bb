"""DeepConf's consensus stop: answer keys read in the loop, and the stop rule.

The loop stops a request's running rows at the first iteration where its
confidence-weighted vote is decided, never before. Hand-computed cases use a
chain where every token has the same confidence c = ln(e^5 + 19) - 1 = 4.1205
(one logit-5 edge per row of a 20-token vocabulary, top-5 mean), so with a
window of 4 a running row's bound on its vote is +inf for 3 tokens and c from
the 4th on."""

import math
import random
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from o1jax.controller import Controller, LoopSettings, ReasoningLoop, ReasoningRequest, answers
from o1jax.controller import state as S
from o1jax.controller.answers import extract_number
from o1jax.controller.registry import build_policy
from o1jax.controller.testing import MockDecodeModel, MockTokenizer
from tests.o1jax.controller.conftest import VOCAB, MockWorld

C = math.log(math.exp(5) + 19) - 1
# "\n\n" leads the forced answer prefix after a token that does not end in whitespace.
LOOP = [("Q", " A", 5), (" A", " B", 5), (" B", " A", 5), ("\n\n", "The answer is", 5),
        ("The answer is", " 7", 5), (" 7", "</s>", 5)]
# Seed 5: its 16 samples at temperature 1 reach all three answers (7, 3 and none),
# which the consensus cases below need (they assert it).
REQ = [ReasoningRequest(prompt="Q", request_id=0, seed=5)]
VOTE = dict(answer_vote=True, conf_window=4, max_thinking_tokens=12, answer_on_eos=True)


@pytest.fixture(scope="module")
def loop_model():
  # One model object per module: compiled loops are cached by the model's identity.
  return MockWorld(LOOP).model()


def controller(model, **kw):
  return Controller(model, MockTokenizer(VOCAB), **kw)


# -- the answer-key automaton ------------------------------------------------------------

def test_automaton_reads_answers_like_extract_number():
  rng = random.Random(0)
  alphabet = list("0123456789") + [".", ",", "-", "$", " ", "x"]
  for _ in range(20000):
    body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
    state, codes = answers.key_of_classes(answers.char_classes(body))
    if state >= S.KEY_INT:
      assert answers.key_text(codes) == extract_number("P" + body, "P"), body
    else:  # no number after the prefix: the key is unknown (extract_number falls back)
      assert not re.search(r"\d", body), body
  assert answers.char_classes("x٣") is None  # a non-ASCII digit: not readable
  assert answers.text_key("-1.5") == [answers.MINUS, 1, answers.DOT, 5]
  assert answers.text_key("1e5") is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_automaton_equals_host_automaton(seed):
  """`ReasoningLoop._read_key` over random tokens (each a few character classes)."""
  rng = np.random.default_rng(seed)
  v, c, b, steps, a = 40, 3, 8, 10, 24
  classes = np.full((v, c), -1, np.int32)
  for t in range(v):
    pool = [*range(10), answers.DOT, answers.COMMA, answers.MINUS, answers.DOLLAR, answers.OTHER]
    n = rng.integers(0, c + 1)
    classes[t, :n] = rng.choice(pool, n)
  k = types.SimpleNamespace(key_classes=jnp.asarray(classes),
                            key_overflow=jnp.zeros(v, bool))
  s = types.SimpleNamespace(key_state=jnp.zeros(b, jnp.int32), key=jnp.zeros((b, a), jnp.int32),
                            key_len=jnp.zeros(b, jnp.int32), key_commit=jnp.zeros(b, jnp.int32),
                            key_unknown=jnp.zeros(b, bool))
  loop = ReasoningLoop(MockDecodeModel(np.zeros((v, v))), vote=True)
  toks = rng.integers(0, v, (steps, b))
  feed = rng.random((steps, b)) < 0.8
  for i in range(steps):
    out = loop._read_key(k, s, jnp.asarray(toks[i]), jnp.asarray(feed[i]), jnp.zeros(b, bool))
    s = types.SimpleNamespace(**dict(zip(("key_state", "key", "key_len", "key_commit",
                                          "key_unknown"), out)))
  for r in range(b):
    seq = [int(x) for t in toks[feed[:, r], r] for x in classes[t] if x >= 0]
    state, codes = answers.key_of_classes(seq)
    assert int(s.key_state[r]) == state
    assert list(np.asarray(s.key[r, :int(s.key_commit[r])])) == codes


def test_answer_key_matches_the_extracted_answer_on_the_mock(loop_model):
  ctl = controller(loop_model)
  t, = ctl.generate(REQ, LoopSettings(**VOTE), 1).traces[0]
  assert t.answer == t.answer_key == "7"
  off, = ctl.generate(REQ, LoopSettings(**{**VOTE, "answer_vote": False}), 1).traces[0]
  assert off.answer_key is None and off.token_ids == t.token_ids


# -- the stop rule, by hand ----------------------------------------------------------------

def _gen(model, n, prior, floor=None, **settings):
  ctl = controller(model)
  return ctl.generate(REQ, LoopSettings(**{**VOTE, **settings}), n, prior_votes=[list(prior)],
                      vote_floor=floor).traces[0]


FULL = 15  # 12 thinking tokens, the forced "\n\n" + prefix, " 7" (then end of sequence)


@pytest.mark.parametrize("weight, stopped_at", [(2 * C + 0.01, 4), (2 * C - 0.01, None)])
def test_stops_when_running_rows_cannot_change_the_winner(loop_model, weight, stopped_at):
  # A prior vote for "7" of `weight`; two running rows could add 2c once their windows
  # are full (token 4) and +inf before: decided at token 4 iff weight > 2c.
  traces = _gen(loop_model, 2, [("7", weight)], stop_when_decided=True)
  for t in traces:
    if stopped_at is None:
      assert t.exit_reason == "answer_eos" and t.tokens.generated == FULL
    else:
      assert t.exit_reason == "consensus" and t.stopped_consensus
      assert t.tokens.generated == stopped_at and t.steps[-1].action == "consensus_stop"


def test_unknown_answers_are_wildcards(loop_model):
  # 2c + 0.01 alone decides (above); a finished vote with an unknown answer (0.1) could
  # join any side, so the same lead is no longer enough.
  traces = _gen(loop_model, 2, [("7", 2 * C + 0.01), (None, 0.1)], stop_when_decided=True)
  assert all(t.tokens.generated == FULL for t in traces)


def test_vote_floor_removes_running_rows_that_cannot_vote(loop_model):
  # Rows whose lowest confidence (c) is below the floor can no longer vote: from token 4
  # nothing can change a lead of 0.5.
  traces = _gen(loop_model, 2, [("7", 0.5)], floor=C + 0.01, stop_when_decided=True)
  assert [t.tokens.generated for t in traces] == [4, 4]
  traces = _gen(loop_model, 2, [("7", 0.5)], stop_when_decided=True)
  assert [t.tokens.generated for t in traces] == [FULL, FULL]


@pytest.mark.parametrize("rival, min_votes, generated", [
    (0.04, 2, 1),  # 1 / 1.04 = 0.9615 >= 0.95 with 2 votes: decided at the first token
    (0.06, 2, FULL),  # 1 / 1.06 = 0.9434 < 0.95: never (the rows then vote for 7 together)
    (0.04, 3, FULL),  # only 2 votes were cast before the rows finish
])
def test_consensus_share(loop_model, rival, min_votes, generated):
  traces = _gen(loop_model, 2, [("7", 1.0), ("3", rival)], consensus_share=0.95,
                consensus_min_votes=min_votes)
  assert [t.tokens.generated for t in traces] == [generated] * 2


def test_a_row_that_keeps_no_token_abstains():
  # An end of sequence first (answer_on_eos off) ends a row with no text: the host's
  # vote skips it. It used to count as an unknown answer of weight +inf (no confidence),
  # which no lead or share can beat: the rule above never fired for its request.
  model = MockWorld(LOOP + [("Q", "</s>", 5)]).model()
  ctl = controller(model)
  st = LoopSettings(**{**VOTE, "answer_on_eos": False, "temperature": 1.0,
                       "consensus_share": 0.95, "consensus_min_votes": 2})
  traces = ctl.generate(REQ, st, 8, prior_votes=[[("7", 1.0), ("3", 0.04)]]).traces[0]
  silent = [t for t in traces if not t.token_ids]
  assert silent and all(t.exit_reason == "eos" and t.answer is None for t in silent)
  # The others stop where the share rule holds, at their first token.
  assert all(t.stopped_consensus and t.tokens.generated == 1
             for t in traces if t.token_ids), [t.token_ids for t in traces]


def test_settings_validation(loop_model):
  with pytest.raises(ValueError, match="answer_vote"):
    LoopSettings(stop_when_decided=True)
  with pytest.raises(ValueError, match="0.5"):
    LoopSettings(answer_vote=True, consensus_share=0.5)
  with pytest.raises(ValueError, match="answer_vote"):
    controller(loop_model).generate(REQ, LoopSettings(), 1, vote_floor=1.0)


# -- the stop rule against a reference, on sampled traces --------------------------------

# Three openings: " A" (likely, short loops) answers " 7"; " B" (longer loops) answers
# " 3" (a " B" in the context boosts it); " C" answers " E", no number: an unknown key.
# The boosts are cancelled (-1000) in the rows where they must not win.
BRANCH = [("Q", " A", 9), ("Q", " B", 7.5), ("Q", " C", 6.5), (" A", " A", 8),
          (" A", "The answer is", 8), (" B", " B", 9), (" B", "The answer is", 8),
          (" C", "The answer is", 8), ("The answer is", " 7", 8), (" 7", "</s>", 9),
          (" 3", "</s>", 9), (" E", "</s>", 9), (" B", " 3", -1000), (" 3", " 3", -1000),
          (" C", " E", -1000), (" E", " E", -1000)]
TRIGGERS = [(" B", {" 3": 30.0}), (" C", {" E": 30.0})]


@pytest.fixture(scope="module")
def branch_model():
  return MockWorld(BRANCH, triggers=TRIGGERS).model()


def reference_decisions(h, n, prior, settings):
  """Pure-Python rule over one recorded state of rows 0..n-1 (one request): decided?"""
  w = h.conf_ring.shape[1]
  votes, wild, running, cast = {}, 0.0, 0.0, list(prior)
  for r in range(n):
    lowest = float(h.lowest_conf[r])
    if int(h.phase[r]) != S.DONE:
      running += lowest if math.isfinite(lowest) else math.inf
      continue
    if int(h.exit_reason[r]) in (S.EXIT_LOW_CONF, S.EXIT_CONSENSUS) or not h.conf_count[r]:
      continue  # stopped, or no token kept: no text, no answer (the host's vote skips it)
    tail = float(h.conf_ring[r].sum()) / min(int(h.conf_count[r]), w)
    known = (int(h.answer_start[r]) >= 0 and int(h.key_state[r]) >= S.KEY_INT
             and not bool(h.key_unknown[r]))
    key = answers.key_text(h.key[r, :int(h.key_commit[r])]) if known else None
    cast.append((key, lowest if math.isfinite(lowest) else tail))
  for key, weight in cast:
    if key is None:
      wild += weight
    else:
      votes[key] = votes.get(key, 0.0) + weight
  if not votes:
    return False
  ranked = sorted(votes.values(), reverse=True) + [0.0]
  total = sum(weight for _, weight in cast)
  sure = settings.stop_when_decided and ranked[0] - ranked[1] > running + wild
  share = ranked[0] >= settings.consensus_share * total and len(cast) >= settings.consensus_min_votes
  return sure or share


def _record(ctl, st, n, prior):
  prompts = [ctl.encode("Q")]
  state = ctl.initial_state(REQ, prompts, st, n, 0, [-math.inf], None, [prior])
  states = []
  ctl.loop(st).run_python(ctl.model.params, state,
                          lambda s: states.append(jax.device_get(s.replace(cache=None))))
  return states


@pytest.mark.parametrize("mode, prior, stops", [
    (dict(stop_when_decided=True), [], True),
    (dict(stop_when_decided=True), [("3", 40.0)], False),  # a heavy prior vote for 3
    (dict(consensus_share=0.7, consensus_min_votes=3), [], True),
    (dict(consensus_share=0.8, consensus_min_votes=2, stop_when_decided=True), [("3", 3.0)], True),
])
def test_stops_exactly_at_the_first_decided_iteration(branch_model, mode, prior, stops):
  n = 16
  base = LoopSettings(temperature=1.0, answer_vote=True, conf_window=2, max_thinking_tokens=24,
                      answer_on_eos=True)
  stop = LoopSettings(**{**base.__dict__, **mode})
  # 1. Without the stop, record every iteration; the reference finds the first decided one.
  free = _record(controller(branch_model), base, n, prior)
  decided = [i for i, h in enumerate(free) if reference_decisions(h, n, prior, stop)
             and any(int(p) != S.DONE for p in h.phase[:n])]
  assert bool(decided) == stops
  # 2. With the stop: rows running then stop right there, the others are unchanged.
  traces = controller(branch_model).generate(REQ, stop, n, prior_votes=[prior]).traces[0]
  plain = controller(branch_model).generate(REQ, base, n, prior_votes=[prior]).traces[0]
  assert {t.answer_key for t in plain} >= {"7", "3"} and None in {t.answer_key for t in plain}
  if not decided:
    assert [t.token_ids for t in traces] == [t.token_ids for t in plain]
    assert not any(t.stopped_consensus for t in traces)
    return
  at = decided[0] + 1  # iterations run when it was decided
  h = free[decided[0]]
  for r, (t, p) in enumerate(zip(traces, plain)):
    if int(h.phase[r]) == S.DONE:
      assert t.token_ids == p.token_ids and not t.stopped_consensus
    else:
      assert t.stopped_consensus and t.tokens.generated == at
      assert t.token_ids == p.token_ids[:at]
  assert any(t.stopped_consensus for t in traces)
  # 3. The debugging twin makes the same decisions.
  twin = controller(branch_model, python_twin=True).generate(
      REQ, stop, n, prior_votes=[prior]).traces[0]
  assert [(t.token_ids, t.exit_reason) for t in twin] == [(t.token_ids, t.exit_reason)
                                                          for t in traces]


def test_warmup_traces_vote_in_the_loop_as_on_the_host(branch_model):
  """DeepConf's second call gets the warm-up votes as priors: each voter's host answer
  (not the loop's reading of it) and confidence; a trace without an answer abstains
  there as in the final vote (it used to join as a wildcard of its confidence)."""
  policy = build_policy({"name": "deepconf", "n": 8, "warmup": 4, "temperature": 1.0,
                         "top_p": 1.0, "window": 2, "max_thinking_tokens": 24,
                         "answer_on_eos": True})
  ctl = controller(branch_model)
  calls, generate = [], ctl.generate
  ctl.generate = lambda *a, **kw: calls.append(kw) or generate(*a, **kw)
  results = ctl.run([ReasoningRequest(prompt="Q", request_id=i, seed=i) for i in range(12)],
                    policy)
  priors, = [kw["prior_votes"] for kw in calls if "prior_votes" in kw]
  started = [r for r in results if any(t.token_ids for t in r.traces[4:])]
  assert len(started) == len(priors)
  for res, prior in zip(started, priors):
    voters = [t for t in res.traces[:4] if t.answer is not None]
    assert prior == [(t.answer, t.lowest_group_confidence) for t in voters]
  # Some warm-ups held a trace of the " C" branch (no number); those whose other votes
  # agree start no other trace (a wildcard used to send them to the loop).
  silent = [r for r in results if any(t.answer is None for t in r.traces[:4])]
  assert silent and any(r not in started for r in silent), [
      [t.answer for t in r.traces[:4]] for r in silent]


def test_error_traces_do_not_vote_in_the_loop():
  """A forced answer prefix the model gives -inf: the trace's log p is not finite, the host
  calls it an "error" with no answer. The loop counted its key as a vote, so the exact
  rule (stop_when_decided) decided for "7" on votes the host then dropped (8 of 24 seeds
  answered otherwise than without the stop; found by a helper's fuzz)."""
  world = [("Q", " A", 9.0), ("Q", " B", 7.5), (" A", "</s>", 9.0), (" B", " B", 6.0),
           (" B", "The answer is", 5.0), ("\n\n", "The answer is", -math.inf),
           ("The answer is", " 7", 8.0), (" 7", "</s>", 9.0), (" 3", "</s>", 9.0),
           (" B", " 3", -1000), (" 3", " 3", -1000)]
  ctl = MockWorld(world, triggers=[(" B", {" 3": 30.0})]).controller()
  requests = [ReasoningRequest(prompt="Q", request_id=i, seed=i) for i in range(24)]
  policy = dict(name="deepconf", n=8, warmup=1, window=1, keep_percent=100.0,
                consensus=math.inf, temperature=1.0, top_p=1.0, max_thinking_tokens=12,
                answer_on_eos=True)
  stop = ctl.run(requests, {**policy, "stop_when_decided": True})
  free = ctl.run(requests, {**policy, "stop_when_decided": False})
  assert any(t.exit_reason == "error" for r in free for t in r.traces)
  assert [r.answer for r in stop] == [r.answer for r in free]


def test_a_warmup_trace_without_a_token_sets_no_threshold():
  """A warm-up trace that ended at its first token has confidence +inf; at the top rank it
  made the per-request threshold +inf: every other trace stopped at its first window, and
  with filter_votes the +inf floor left only that trace (no answer) to vote."""
  world = [("Q", " A", 6.0), ("Q", "</s>", 4.0), (" A", " A", 5.0), (" A", "The answer is", 4.0),
           ("The answer is", " 7", 8.0), (" 7", "</s>", 9.0), ("\n\n", "The answer is", 8.0)]
  ctl = MockWorld(world).controller()
  requests = [ReasoningRequest(prompt="Q", request_id=i, seed=i) for i in range(8)]
  seen = 0
  for filter_votes in (True, False):
    policy = dict(name="deepconf", n=8, warmup=4, window=2, keep_percent=10.0,
                  filter_votes=filter_votes, consensus=math.inf, temperature=1.0, top_p=1.0,
                  max_thinking_tokens=8, answer_on_eos=False)
    for r in ctl.run(requests, policy):
      warm = r.traces[:4]
      if not any(not t.token_ids for t in warm):
        continue
      seen += 1
      measured = [t.lowest_group_confidence for t in warm if t.token_ids]
      assert math.isfinite(r.info["threshold"]) and r.info["threshold"] <= max(measured)
      assert r.answer == "7" and not all(t.stopped_low_confidence for t in r.traces[4:])
  assert seen
