"""Policies on the mock: registry (reasoning and plain sampling), votes, best-of-N, DeepConf
stopping, budgets, configs."""

import dataclasses
import math

import ml_collections
import numpy as np
import pytest

from configs.policies import policy_config, policy_params
from o1jax.controller import (POLICIES, LoopSettings, ReasoningRequest, SamplingSpec,
                              build_policy, extract_number, get_policy, get_verifier,
                              majority_vote, policy_names, weighted_vote)
from tests.o1jax.controller.conftest import MockWorld

POLICY_NAMES = ["greedy_cot", "self_consistency", "best_of_n", "deepconf",
                "think_verify_backtrack", "budget_forcing"]


def test_extract_and_vote():
  assert extract_number("so 3 + 4 = 7.\nThe answer is $1,200.00.") == "1200"
  assert extract_number("first 12 then 15 apples") == "15"
  assert extract_number("The answer is 5. Later 9.") == "5"
  assert extract_number("no digits") is None
  assert majority_vote(["3", None, "7", "3"]) == ("3", {"3": 2.0, "7": 1.0})
  assert weighted_vote(["3", "7", "3"], [1.0, 5.0, 1.0])[0] == "7"
  assert majority_vote(["7", "3"])[0] == "7"  # ties: first seen
  assert majority_vote([None]) == (None, {})


def test_registry_and_configs():
  assert set(POLICY_NAMES) <= set(POLICIES)
  with pytest.raises(ValueError, match="valid policies.*reasoning controller"):
    get_policy("nope")
  with pytest.raises(ValueError, match="valid"):
    get_policy("self_consistency", m=3)
  for name in POLICY_NAMES:
    cfg = policy_config(name, smoke=True)
    assert isinstance(cfg, ml_collections.ConfigDict) and cfg.name == name
    policy = build_policy(cfg)
    assert policy.name == name and policy.max_thinking_tokens == 24
  assert build_policy({"name": "deepconf", "n": 16, "warmup": 4}).n == 16


def test_the_policy_classes_are_public():
  """docs/controller.md names `DeepConf(threshold=s)` and `DeepConf.calibrate`: the
  classes were importable from o1jax.controller.policies only."""
  import o1jax.controller
  from o1jax.controller import policy_class
  for name in POLICY_NAMES:
    cls = policy_class(name)
    assert getattr(o1jax.controller, cls.__name__) is cls


def test_plain_sampling_policies_share_the_namespace():
  assert policy_names(controller=False) == ["greedy", "sample_n"]
  assert set(POLICY_NAMES) <= set(policy_names(controller=True))  # + any a test registered
  assert build_policy({"name": "greedy"}).num_samples == 1
  p = build_policy({"name": "sample_n", "n": 5, "temperature": 0.9, "top_p": 0.9, "top_k": 0})
  assert p.num_samples == 5 and p.vote and not p.controller
  base = SamplingSpec(max_new_tokens=8, seed=3)
  assert p.sampling(base, 4) == SamplingSpec(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=3)
  # What a sample's content hash and record hold (min_p only when set: old keys stay valid).
  assert list(base.to_dict()) == ["max_new_tokens", "temperature", "top_p", "top_k", "seed"]
  assert SamplingSpec(min_p=0.05).to_dict()["min_p"] == 0.05
  with pytest.raises(ValueError, match="top_p must be in"):
    SamplingSpec(top_p=0.0)  # checked once, by o1jax.model.sampling.Sampling
  with pytest.raises(ValueError, match=r"valid: \['n', 'temperature', 'top_k', 'top_p'\]"):
    build_policy({"name": "sample_n", "m": 2})
  sc = build_policy({"name": "self_consistency"})
  assert sc.controller and sc.num_samples == 1 and not sc.vote and sc.sampling(base, 0) is base
  # A plain policy is sampled by the engine, one work item per sample: the controller refuses it.
  with pytest.raises(ValueError, match="'greedy' samples plainly"):
    MockWorld(FORK).controller().run(["Q"], "greedy")
  # Smoke shrinks reasoning budgets only; a plain policy keeps its class defaults.
  assert policy_params("sample_n", smoke=True) == {"n": 4, "temperature": 0.7,
                                                            "top_p": 0.95, "top_k": 0}


# Two ways out of "Q": " A" (logit 2) and " B" (logit 1); " A" leads to answer 7, " B" to 3.
FORK = [("Q", " A", 2.0), ("Q", " B", 1.0), (" A", "The answer is", 9), (" B", "The answer is", 9),
        ("The answer is", " 7", 9), (" 7", "</s>", 9), (" 3", "</s>", 9)]


def _fork_world():
  # After " B", the answer is " 3": a " B" in the context adds 20 to " 3".
  return MockWorld(FORK, triggers=[(" B", {" 3": 20.0})])


def test_self_consistency_votes_the_majority():
  ctl = _fork_world().controller()
  res, = ctl.run([ReasoningRequest("Q", request_id=1, seed=0)],
                 get_policy("self_consistency", n=16, temperature=1.0, top_p=1.0))
  answers = [t.answer for t in res.traces]
  assert set(answers) == {"7", "3"}
  assert res.answer == max(set(answers), key=answers.count)
  assert res.votes == {a: float(answers.count(a)) for a in set(answers)}
  assert res.traces[res.chosen].answer == res.answer
  assert res.tokens.generated == sum(t.tokens.generated for t in res.traces)
  assert res.loop_invocations == 1


def test_best_of_n_picks_the_highest_scoring_trace():
  ctl = _fork_world().controller()
  res, = ctl.run(["Q"], get_policy("best_of_n", n=8, temperature=1.0, top_p=1.0))
  scores = [t.score for t in res.traces]
  assert len(set(scores)) > 1 and scores == [t.mean_logprob for t in res.traces]
  assert res.chosen == int(np.argmax(scores))
  assert res.answer == res.traces[res.chosen].answer


def test_deepconf_stops_low_confidence_traces_and_saves_tokens():
  # From " A" the chain is sure (logit 9); from " B" it wanders through a flat row
  # (" B" -> " C" -> " D" ... logit 0.5), so B traces have a low group confidence.
  edges = [("Q", " A", 2.0), ("Q", " B", 2.0), (" A", " E", 9), (" E", " A", 9),
           (" B", " C", 0.5), (" C", " D", 0.5), (" D", " B", 0.5),
           ("The answer is", " 7", 9), (" 7", "</s>", 9)]
  ctl = MockWorld(edges).controller()
  # Every trace answers 7: the consensus stop (tested below) would end all of them at once.
  kw = dict(n=12, warmup=4, keep_percent=50.0, window=4, temperature=1.0, top_p=1.0,
            max_thinking_tokens=16, consensus=2.0, stop_when_decided=False)
  calls, generate = [], ctl.generate
  ctl.generate = lambda requests, settings, n, **kw: (calls.append((settings, n)),
                                                      generate(requests, settings, n, **kw))[1]
  policy = get_policy("deepconf", **kw)
  res, = ctl.run([ReasoningRequest("Q", request_id=5)], policy)
  del ctl.generate
  # What a pipeline worker sizes at load (`check_policy_fits`) is the largest call made.
  assert [n for _, n in calls] == [4, 8] and policy.traces_per_call == 8
  assert all(s.conf_window == policy.loop_settings().conf_window == 4 for s, _ in calls)
  stopped = [t for t in res.traces if t.stopped_low_confidence]
  assert res.info["stopped"] == len(stopped) > 0
  assert all(t.sample_index >= 4 for t in stopped)  # warm-up traces always finish
  assert all(t.lowest_group_confidence < res.info["threshold"] for t in stopped)
  assert all(t.tokens.thinking < 16 for t in stopped)
  full, = ctl.run([ReasoningRequest("Q", request_id=5)],
                  get_policy("self_consistency", n=12, temperature=1.0, top_p=1.0,
                             max_thinking_tokens=16))
  assert res.tokens.generated < full.tokens.generated
  assert res.loop_invocations == 2
  # Every unstopped trace votes by default; filter_votes keeps those at or above the threshold.
  voted = [t for t in res.traces if not t.stopped_low_confidence]
  assert sum(res.votes.values()) == pytest.approx(sum(t.lowest_group_confidence for t in voted))
  high, = ctl.run([ReasoningRequest("Q", request_id=5)],
                  get_policy("deepconf", **kw, filter_votes=True))
  above = [t.lowest_group_confidence for t in high.traces
           if not t.stopped_low_confidence and t.lowest_group_confidence >= high.info["threshold"]]
  assert sum(high.votes.values()) == pytest.approx(sum(above)) and len(above) < len(voted)


def test_deepconf_fixed_threshold_and_calibration():
  edges = [("Q", " A", 2.0), ("Q", " B", 2.0), (" A", " E", 9), (" E", " A", 9),
           (" B", " C", 0.5), (" C", " D", 0.5), (" D", " B", 0.5),
           ("The answer is", " 7", 9), (" 7", "</s>", 9)]
  ctl = MockWorld(edges).controller()
  req = [ReasoningRequest("Q", request_id=5)]
  kw = dict(n=12, warmup=4, keep_percent=50.0, window=4, temperature=1.0, top_p=1.0,
            max_thinking_tokens=16, consensus=2.0, stop_when_decided=False)
  # A threshold below every confidence stops nothing: the same traces as self_consistency.
  never, = ctl.run(req, get_policy("deepconf", **kw, threshold=-1e9))
  full, = ctl.run(req, get_policy("self_consistency", n=12, temperature=1.0, top_p=1.0,
                                  max_thinking_tokens=16))
  assert never.info["stopped"] == 0 and never.tokens.generated == full.tokens.generated
  assert [t.token_ids for t in never.traces] == [t.token_ids for t in full.traces]
  # calibrate(): the percentile over n unstopped traces of the held-out requests.
  policy = get_policy("deepconf", **kw)
  s = policy.calibrate(ctl, req)
  confs = [t.lowest_group_confidence for t in never.traces]
  assert s == pytest.approx(float(np.percentile(confs, 50.0)), rel=1e-6)
  fixed, = ctl.run(req, get_policy("deepconf", **kw, threshold=s))
  assert fixed.info["threshold"] == float(np.float32(s))
  stopped = [t for t in fixed.traces if t.stopped_low_confidence]
  assert stopped and all(t.sample_index >= 4 and t.lowest_group_confidence < s for t in stopped)
  # A threshold above every confidence stops every later trace at its first full window
  # (traces whose thinking ends sooner never have one).
  always, = ctl.run(req, get_policy("deepconf", **kw, threshold=1e9))
  later = always.traces[4:]
  assert always.info["stopped"] > 0 and always.loop_invocations == 1
  assert not any(t.stopped_low_confidence for t in always.traces[:4])  # the warm-up
  assert all(t.tokens.thinking == 4 if t.stopped_low_confidence else t.tokens.thinking < 4
             for t in later)
  with pytest.raises(ValueError, match="threshold"):
    get_policy("deepconf", threshold=float("nan"))
  # One loop call gives the traces of a warm-up call followed by an online call.
  st = policy.settings(conf_window=4, answer_vote=True)
  warm = ctl.generate(req, st, 4).traces[0]
  rest = ctl.generate(req, st, 8, sample_offset=4, conf_stop=[s]).traces[0]
  assert [t.token_ids for t in fixed.traces] == [t.token_ids for t in warm + rest]
  assert [t.stopped_low_confidence for t in fixed.traces] == [
      t.stopped_low_confidence for t in warm + rest]


# " A" (likely) loops a while and answers 7; " B" answers 3 (a " B" in the context boosts " 3",
# cancelled in the rows where it must not win).
VOTING = [("Q", " A", 9), ("Q", " B", 7.5), (" A", " A", 8), (" A", "The answer is", 8),
          (" B", "The answer is", 9), ("The answer is", " 7", 9), (" 7", "</s>", 9),
          (" 3", "</s>", 9), (" B", " 3", -1000), (" 3", " 3", -1000)]


def test_deepconf_consensus_stop_saves_tokens_and_keeps_the_decided_answer():
  ctl = MockWorld(VOTING, triggers=[(" B", {" 3": 30.0})]).controller()
  reqs = [ReasoningRequest("Q", request_id=r) for r in range(3)]
  kw = dict(n=12, warmup=2, keep_percent=90.0, window=2, temperature=1.0, top_p=1.0,
            max_thinking_tokens=24)
  off = ctl.run(reqs, get_policy("deepconf", **kw, consensus=2.0, stop_when_decided=False))
  sure = ctl.run(reqs, get_policy("deepconf", **kw, consensus=2.0, stop_when_decided=True))
  share = ctl.run(reqs, get_policy("deepconf", **kw, consensus=0.8, consensus_min_votes=2,
                                        stop_when_decided=False))
  assert {"7", "3"} <= {t.answer for r in off for t in r.traces}
  for a, b, c in zip(off, sure, share):
    # Stopping once the running traces cannot change the winner never changes the answer.
    assert b.answer == a.answer and b.tokens.generated <= a.tokens.generated
    assert c.tokens.generated <= a.tokens.generated
    for r in (b, c):
      assert r.info["key_mismatches"] == 0
      assert all(t.sample_index >= 2 for t in r.traces if t.stopped_consensus)
      assert r.info["consensus_stopped"] == sum(t.stopped_consensus for t in r.traces)
  assert sum(r.info["consensus_stopped"] for r in sure) > 0
  assert sum(r.tokens.generated for r in sure) < sum(r.tokens.generated for r in off)
  assert sum(r.tokens.generated for r in share) < sum(r.tokens.generated for r in off)


def test_deepconf_starts_no_trace_its_warm_up_votes_decided():
  """Warm-up votes all for one answer decide the share rule before any other trace runs:
  those traces never start (the loop stopped each at its first token, after prefilling
  the prompt again); a split warm-up runs them."""
  ctl = MockWorld(VOTING, triggers=[(" B", {" 3": 30.0})]).controller()
  reqs = [ReasoningRequest("Q", request_id=r) for r in range(8)]
  policy = get_policy("deepconf", n=6, warmup=2, keep_percent=90.0, window=2, temperature=1.0,
                      top_p=1.0, max_thinking_tokens=24, consensus=0.8, stop_when_decided=False)
  results = ctl.run(reqs, policy)
  st = dataclasses.replace(policy.loop_settings(), answer_vote=True)
  warm = ctl.generate(reqs, st, 2).traces
  kinds = set()
  for req, r, w in zip(reqs, results, warm):
    assert [t.token_ids for t in r.traces[:2]] == [t.token_ids for t in w]
    unanimous = len({t.answer_key for t in w}) == 1 and w[0].answer_key is not None
    kinds.add(unanimous)
    if unanimous:
      assert all(t.tokens.generated == 0 and t.stopped_consensus and t.exit_reason == "consensus"
                 for t in r.traces[2:])
      assert r.info["consensus_stopped"] == 4 and r.loop_invocations == 1
      assert r.answer == w[0].answer
      # What the loop did with them: every one stopped at its first token.
      rest, = ctl.generate([req], policy._online_settings(st, True), 4, sample_offset=2,
                           conf_stop=[r.info["threshold"]], vote_floor=[-math.inf],
                           prior_votes=[[(t.answer_key, t.lowest_group_confidence)
                                         for t in w]]).traces
      assert all(t.stopped_consensus and t.tokens.generated == 1 for t in rest)
    else:
      assert r.loop_invocations == 2 and all(t.tokens.generated > 0 for t in r.traces)
  assert kinds == {True, False}


def test_think_verify_backtrack_policy_and_budget_forcing_policy():
  edges = [("Q", " A", 5), (" A", " B", 5), (" B", " C", 5), (" C", "</s>", 5), (" Wait", " A", 5),
           ("The answer is", " 7", 5), (" 7", "</s>", 5)]
  ctl = MockWorld(edges).controller()
  res, = ctl.run(["Q"], get_policy("budget_forcing", min_thinking_tokens=8, max_thinking_tokens=20))
  assert res.traces[0].tokens.waits == 2 and res.answer == "7"
  tvb = get_policy("think_verify_backtrack", verifier="mean_logprob", backtrack_threshold=0.0,
                   exit_tau=2.0, latency_slo_s=0.25, step_delimiter="\n\n")
  res, = ctl.run(["Q"], tvb)
  assert res.info["max_steps"] == 32 and res.answer == "7"


def test_an_adaptive_budget_keeps_the_policys_own_step_limit():
  """With adaptive=True the live budget replaced the policy's step limit: max_steps=1 ran
  3-6 steps a trace, its record saying 1. A limit set caps the budget (as a request's own);
  without one the record names none (the budget's limits are logged per request)."""
  edges = [("Q", " A", 5), (" A", "\n\n", 5), ("\n\n", " A", 5), ("The answer is", " 7", 5),
           (" 7", "</s>", 5)]
  ctl = MockWorld(edges).controller()
  common = dict(verifier="mean_logprob", backtrack_threshold=0.0, exit_tau=2.0,
                step_delimiter="\n\n", max_thinking_tokens=40, adaptive=True)
  capped, = ctl.run(["Q"], get_policy("think_verify_backtrack", max_steps=1, **common))
  assert capped.traces[0].n_steps == 1 and capped.info["max_steps"] == 1
  assert capped.traces[0].steps[-1].action == "answer_steps"
  live, = ctl.run(["Q"], get_policy("think_verify_backtrack", **common))
  assert live.traces[0].n_steps > 1 and live.info["max_steps"] is None
  assert live.info["budget"][0]["steps"] == live.info["budget"][-1]["steps"] > 1
  # The controller's own live budget is capped the same way.
  from o1jax.engine.budget import BudgetConfig, BudgetLoop
  own = MockWorld(edges).controller(budget=BudgetLoop(BudgetConfig(mode="adaptive",
                                                                   latency_slo_s=0.5)))
  common["adaptive"] = False
  capped, = own.run(["Q"], get_policy("think_verify_backtrack", max_steps=1, **common))
  assert capped.traces[0].n_steps == 1 and capped.info["max_steps"] == 1


def test_a_backtrack_threshold_under_a_verifiers_floor_is_refused():
  """group_confidence scores are -mean of the top-5 log p, at least ln 5 = 1.609: the
  default threshold 0.5 (made for [0, 1] verifiers) never backtracked, without a word."""
  logp = np.log(np.random.default_rng(0).dirichlet(np.full(50, 0.05), size=2000))
  assert (-np.sort(logp, axis=1)[:, -5:].mean(axis=1)).min() >= math.log(5)
  ctl = MockWorld([("Q", " A", 5), (" A", "\n\n", 5), ("\n\n", " A", 5),
                   ("The answer is", " 7", 5), (" 7", "</s>", 5)]).controller()
  common = dict(exit_tau=2.0, step_delimiter="\n\n", max_thinking_tokens=12)
  for verifier in ("group_confidence", "lowest_group_confidence"):
    message = (rf"backtrack_threshold=0.5 never backtracks with verifier {verifier}: its scores "
               rf"are at least 1.6094 \(ln 5\); set a threshold above that, or 0 for none$")
    with pytest.raises(ValueError, match="^think_verify_backtrack: " + message):  # when built
      get_policy("think_verify_backtrack", verifier=verifier, **common)
    settings = LoopSettings(verifier=get_verifier(verifier), backtrack_threshold=0.5)
    with pytest.raises(ValueError, match="^" + message):  # a policy of one's own: at run
      ctl.generate([ReasoningRequest(prompt="Q")], settings, 1)
    for threshold in (0.0, 2.0):  # none, and one on its scale
      res, = ctl.run(["Q"], get_policy("think_verify_backtrack", verifier=verifier,
                                       backtrack_threshold=threshold, **common))
      assert res.answer == "7"


def test_an_empty_answer_prefix_needs_a_thinking_span():
  """Without a thinking span nothing ended thinking: the "answer" was more thinking and its
  number the last one anywhere ("... and 6 of them get off at" answered 6)."""
  ctl = MockWorld([("Q", " A", 5), (" A", "</s>", 5)]).controller()
  with pytest.raises(ValueError, match=r"^answer_prefix='': without a thinking span the answer "
                                       r"is read after the answer prefix; give one "):
    ctl.run(["Q"], get_policy("greedy_cot", answer_prefix=""))


def test_unset_optional_params_are_typed_config_placeholders():
  """deepconf's threshold defaults to None, yet `--config.policy.threshold=3.1` must parse:
  the config holds a float placeholder, in the controller's and the pipeline's configs."""
  from configs import gsm8k as gsm8k_config

  cfg = policy_config("deepconf")
  assert cfg.threshold is None and cfg.get_ref("threshold").get_type() is float
  assert build_policy(cfg).threshold is None
  cfg.threshold = 3.1
  assert build_policy(cfg).threshold == 3.1
  pipeline = gsm8k_config.get_config("policy=deepconf,smoke=True")
  assert pipeline.policy.threshold is None
  assert pipeline.policy.get_ref("threshold").get_type() is float


def test_a_sample_needs_a_token_budget():
  with pytest.raises(ValueError, match=r"^max_new_tokens must be an int >= 1, got 0$"):
    SamplingSpec(max_new_tokens=0)
  with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
    SamplingSpec(temperature=-1)  # the `Sampling` checks still run


NAN = float("nan")


@pytest.mark.parametrize("section, match", [
    # Shared params, checked by the LoopSettings they make, when the policy is built.
    ({"name": "greedy_cot", "temperature": NAN}, r"^greedy_cot: temperature must be finite"),
    ({"name": "greedy_cot", "top_k": 2.5}, r"^greedy_cot: top_k must be an int in \[0, 2147483647\], got 2.5$"),
    ({"name": "greedy_cot", "max_thinking_tokens": 2.5},
     r"^greedy_cot: max_thinking_tokens must be an int >= 0, got 2.5$"),
    ({"name": "greedy_cot", "max_answer_tokens": NAN},
     r"^greedy_cot: max_answer_tokens must be an int >= 1, got nan$"),
    ({"name": "greedy_cot", "step_delimiter": None}, r"^greedy_cot: step_delimiter must be a str"),
    ({"name": "greedy_cot", "answer_on_eos": "no"}, r"^greedy_cot: answer_on_eos must be a bool"),
    # Their own params.
    ({"name": "self_consistency", "n": 0}, r"^self_consistency: n must be an int in \[1, 100000\], got 0$"),
    ({"name": "self_consistency", "n": 2.5}, r"^self_consistency: n must be an int in \[1, 100000\]"),
    ({"name": "self_consistency", "n": True}, r"^self_consistency: n must be an int in \[1, 100000\]"),
    ({"name": "best_of_n", "n": 0}, r"^best_of_n: n must be an int in \[1, 100000\], got 0$"),
    # (a million: the launcher planned work items for minutes without a word)
    ({"name": "sample_n", "n": 10**6},
     r"^policy sample_n: n must be an int in \[1, 100000\], got 1000000$"),
    # n identical greedy traces (sample_n refused the same; these ran them).
    ({"name": "self_consistency", "temperature": 0.0},
     r"^self_consistency: n=8 traces need temperature > 0, got 0\.0$"),
    ({"name": "best_of_n", "n": 2, "temperature": 0},
     r"^best_of_n: n=2 traces need temperature > 0, got 0$"),
    ({"name": "deepconf", "temperature": 0.0},
     r"^deepconf: n=8 traces need temperature > 0, got 0\.0$"),
    ({"name": "best_of_n", "score": None}, r"^best_of_n: score must be a registered scorer"),
    ({"name": "best_of_n", "score": "bogus"},  # was: found per example, after the model ran
     r"^best_of_n: unknown scorer 'bogus'; registered: \['lowest_group_confidence', "),
    ({"name": "deepconf", "warmup": 2.5}, r"^deepconf: warmup must be an int >= 1, got 2.5$"),
    ({"name": "deepconf", "window": 0}, r"^deepconf: window must be an int >= 1, got 0$"),
    ({"name": "deepconf", "consensus": NAN}, r"^deepconf: consensus must be > 0.5"),
    ({"name": "deepconf", "consensus_min_votes": 0},
     r"^deepconf: consensus_min_votes must be an int >= 1, got 0$"),
    ({"name": "deepconf", "threshold": "1"}, r"^deepconf: threshold must be a finite number"),
    ({"name": "deepconf", "threshold": 1e39},  # (inf in the loop's float32)
     r"^deepconf: threshold must be a finite number or None, got 1e\+39$"),
    ({"name": "deepconf", "consensus": 0.6, "consensus_min_votes": 9},
     r"^deepconf: consensus_min_votes=9 > n=8: the consensus would never stop a trace"),
    ({"name": "deepconf", "filter_votes": "x"}, r"^deepconf: filter_votes must be a bool"),
    # The loop stops thinking only: a window longer than it never filled (ran unstopped).
    ({"name": "deepconf", "window": 65, "max_thinking_tokens": 64},
     r"^deepconf: window=65 > max_thinking_tokens=64: no thinking window would ever be full"),
    ({"name": "deepconf", "max_thinking_tokens": 0}, r"^deepconf: window=8 > max_thinking_"),
    ({"name": "think_verify_backtrack", "backtrack_threshold": NAN},
     r"^think_verify_backtrack: backtrack_threshold must be a number, got nan$"),
    ({"name": "think_verify_backtrack", "exit_tau": NAN},
     r"^think_verify_backtrack: exit_tau must be a number, got nan$"),
    ({"name": "think_verify_backtrack", "temp_bump": -1},
     r"^think_verify_backtrack: temp_bump must be finite and >= 0, got -1$"),
    # A retry's temperature the device would raise (1e-9 -> 1e-6) or overflow.
    ({"name": "think_verify_backtrack", "temperature": 0, "temp_bump": 1e-9},
     r"^think_verify_backtrack: temp_bump=1e-09 gives retry temperatures outside \[1e-06, "),
    ({"name": "think_verify_backtrack", "temp_bump": 2e38},
     r"^think_verify_backtrack: temp_bump=2e\+38 gives retry temperatures outside .*"
     r"up to 2 backtracks a step\)$"),
    ({"name": "think_verify_backtrack", "max_backtracks": -1},
     r"^think_verify_backtrack: max_backtracks must be an int >= 0, got -1$"),
    ({"name": "think_verify_backtrack", "max_steps": -1},
     r"^think_verify_backtrack: max_steps must be an int >= 0, got -1$"),
    ({"name": "think_verify_backtrack", "verifier": "bogus"},
     r"^think_verify_backtrack: unknown verifier 'bogus'; registered: \['group_confidence', "),
    ({"name": "think_verify_backtrack", "latency_slo_s": 0},
     r"^think_verify_backtrack: latency_slo_s must be > 0, got 0$"),
    ({"name": "budget_forcing", "min_thinking_tokens": -1},
     r"^budget_forcing: min_thinking_tokens must be an int >= 0, got -1$"),
    ({"name": "budget_forcing", "wait_text": ""},
     r"^budget_forcing: min_thinking_tokens > 0 needs a non-empty wait_text$"),
    # top_k=1 draws the argmax alone: n copies of one greedy trace, as at temperature 0.
    ({"name": "self_consistency", "top_k": 1},
     r"^self_consistency: n=8 traces need top_k != 1 \(top_k=1 draws the most likely token only\)$"),
    ({"name": "deepconf", "top_k": 1}, r"^deepconf: n=8 traces need top_k != 1 "),
    ({"name": "sample_n", "n": 3, "temperature": 0.7, "top_k": 1},
     r"^policy sample_n: n=3 samples need top_k != 1 "),
    ({"name": "sample_n", "n": 2.5}, r"^policy sample_n: n must be an int in \[1, 100000\], got 2.5$"),
    ({"name": "sample_n", "temperature": NAN}, r"^policy sample_n: temperature must be finite"),
    ({}, r"^a policy is a name or \{'name': \.\.\., \*\*params\}, got \{\}"),
])
def test_bad_policy_params_fail_when_the_policy_is_built(section, match):
  """Each used to run (NaN thresholds turned their rule off, float counts were cut, ...)
  or to fail inside `run` with a message that named no param."""
  with pytest.raises(ValueError, match=match):
    build_policy(section)


def test_controller_run_refuses_a_policy_that_is_no_policy():
  ctl = MockWorld(FORK).controller()
  for policy in (None, 5):
    with pytest.raises(ValueError, match=r"^a policy is a name or"):
      ctl.run(["Q"], policy)
  # Valid edge values still build (0 thinking tokens, "" delimiter: one step, threshold < 0).
  for section in ({"name": "greedy_cot", "max_thinking_tokens": 0},
                  {"name": "self_consistency", "step_delimiter": "", "n": 1},
                  {"name": "deepconf", "threshold": -1.0, "consensus": math.inf},
                  {"name": "think_verify_backtrack", "exit_tau": 0.0},
                  # no retry can happen, so no retry temperature is refused
                  {"name": "think_verify_backtrack", "temperature": 0, "temp_bump": 1e-9,
                   "max_backtracks": 0}):
    build_policy(section)
  res, = ctl.run(["Q"], {"name": "greedy_cot", "max_thinking_tokens": 0})
  assert res.answer == "7"


# --- aggregation edge cases against hand-computed results (host side, no model) ----------

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("answers, weights, winner", [
    (["1", "2", "2", "1"], None, "1"),  # a tie: the one seen first
    ([None, None], None, None),  # every trace without an answer: no winner
    (["5"], None, "5"),  # a single trace
    (["1", "2"], [NAN, 1.0], "2"),  # a NaN total never beats a number (max() crashed)
    (["1", "2"], [1.0, NAN], "1"),
    (["2", "3"], [NAN, -INF], "3"),  # ... not even -inf
    (["1", "2", "1"], [INF, 1.0, -INF], "2"),  # inf + -inf = NaN
    (["1", "2"], [NAN, NAN], "1"),  # every total NaN: the first seen
    (["1", "2"], [INF, INF], "1"),  # tied at inf: the first seen
    (["1", "2", "2"], [0.0, 0.0, 0.0], "1"),  # zero weights tie
    (["1", "2"], [-1.0, -2.0], "1"),
    ([None, "2", "3"], [1.0, NAN, -INF], "3"),
])
def test_weighted_vote_edge_weights(answers, weights, winner):
  got, votes = weighted_vote(answers, weights)
  assert got == winner
  assert list(votes) == list(dict.fromkeys(a for a in answers if a is not None))


class _FakeCtl:
  """generate() hands out prepared traces; result() returns what the policy chose."""
  extract_answer = None
  reads_as = None
  budget = None
  key_capacity = 24

  def __init__(self, *batches):
    self.batches = list(batches)

  def generate(self, requests, settings, n, **kw):
    from o1jax.controller.controller import Batch
    traces = self.batches.pop(0)
    assert len(traces) == n
    return Batch([traces], [0.0], [1])

  def result(self, req, name, traces, chosen, answer, wall, calls, votes=None, **info):
    return chosen, answer, dict(votes or {}), info

  def observe_finished(self, count=1):  # (no live budget)
    pass

  def final_text(self, trace):
    return trace.text


def _trace(i, answer, conf=1.0, logprob=-1.0, stopped=False, token_ids=(5,), text=""):
  from o1jax.controller.results import TokenCounts, Trace
  return Trace(sample_index=i, token_ids=list(token_ids), text=text, thinking_text="", answer_text="",
               answer=answer, steps=[], tokens=TokenCounts(), backtracks=0, early_exit=False,
               exit_reason="eos", mean_logprob=logprob, mean_confidence=conf,
               lowest_group_confidence=conf, tail_confidence=conf,
               stopped_low_confidence=stopped)


@pytest.mark.parametrize("scores, chosen", [
    ([-1.0, -0.5, -0.5], 1),  # the highest, first among ties
    ([NAN, -1.0, -2.0], 1),  # a NaN score is no score (np.argmax picked the NaN)
    ([-2.0, NAN, INF], 2),
    ([NAN, -INF], 1),
    ([NAN, NAN], 0),
    ([-3.0], 0),  # n = 1
])
def test_best_of_n_skips_nan_scores(scores, chosen):
  traces = [_trace(i, str(i), logprob=s) for i, s in enumerate(scores)]
  got = get_policy("best_of_n", n=len(scores)).run(_FakeCtl(traces), [ReasoningRequest("Q")])
  assert got[0][:2] == (chosen, str(chosen))


@pytest.mark.parametrize("confs, keep, threshold", [
    ([1.0, 2.0], 10.0, 1.9),
    ([1.0, 2.0], 100.0, 1.0),  # keep everything: the lowest
    ([1.0, 2.0], 1e-9, 2.0),  # keep almost nothing: the highest
    ([3.0], 10.0, 3.0),  # one warm-up trace
    ([2.0, INF], 10.0, INF),  # a trace without a window has +inf: numpy gave NaN
    ([2.0, 2.0, INF], 0.001, INF),
    ([2.0, INF], 100.0, 2.0),
    ([INF, INF], 50.0, INF),
    ([1.0, 2.0, INF], 60.0, 1.8),  # inf beyond the interpolated pair
])
def test_deepconf_threshold_is_the_documented_percentile(confs, keep, threshold):
  got = get_policy("deepconf", n=4, warmup=2, keep_percent=keep)._percentile(confs)
  assert got == pytest.approx(float(np.float32(threshold)), rel=1e-6)


def test_deepconf_vote_with_an_infinite_warmup_confidence():
  # Warm-up confidences 2 and +inf (keep 10): threshold inf, filter_votes keeps only the
  # inf trace (a NaN threshold had filtered every vote, then let all vote).
  warm = [_trace(0, "7", conf=2.0), _trace(1, "8", conf=INF)]
  rest = [_trace(2, "7", conf=3.0), _trace(3, "7", conf=3.0)]
  pol = get_policy("deepconf", n=4, warmup=2, keep_percent=10.0, filter_votes=True)
  chosen, answer, votes, info = pol.run(_FakeCtl(warm, rest), [ReasoningRequest("Q")])[0]
  assert info["threshold"] == INF and (chosen, answer, votes) == (1, "8", {"8": INF})
  # A trace that kept no token (+inf: no confidence at all) sets no threshold: the
  # others' 10% cut stands, and every trace kept votes.
  warm = [_trace(0, "7", conf=2.0), _trace(1, None, conf=INF, token_ids=())]
  chosen, answer, votes, info = pol.run(_FakeCtl(warm, rest), [ReasoningRequest("Q")])[0]
  assert info["threshold"] == 2.0 and (answer, votes) == ("7", {"7": 8.0})
  # a NaN confidence abstains from the weighted vote instead of crashing it
  warm = [_trace(0, "7", conf=NAN), _trace(1, "8", conf=1.0)]
  pol = get_policy("deepconf", n=2, warmup=2, keep_percent=100.0)
  chosen, answer, _, _ = pol.run(_FakeCtl(warm), [ReasoningRequest("Q")])[0]
  assert (chosen, answer) == (1, "8")


def test_the_chosen_trace_is_the_first_winner_the_task_reads_as_the_vote():
  """A task scores the chosen trace's text by its own reading (`Controller.reads_as`): the
  first trace carrying the voted value was chosen, and scored wrong where the vote was
  right. Without a reading, or where it accepts no winner: the first winner."""
  texts = ["The answer is 18.00.", "The answer is 20.", "The answer is 18.", "The answer is 20.",
           "The answer is 18."]
  traces = [_trace(i, extract_number(t), text=t) for i, t in enumerate(texts)]
  policies = (get_policy("self_consistency", n=5),
              get_policy("deepconf", n=5, warmup=5, keep_percent=100.0))
  for reads_as, chosen in ((None, 0), (lambda text, key: text == f"The answer is {key}.", 2),
                           (lambda text, key: False, 0)):
    ctl = _FakeCtl(traces, traces)
    ctl.reads_as = reads_as
    for policy in policies:
      assert policy.run(ctl, [ReasoningRequest("Q")])[0][:2] == (chosen, "18"), policy.name


def test_content_keys_carry_the_rules_version_of_policies_whose_rules_changed():
  # Their rules changed what a sample computes (2026-12-06): stores of the earlier rules
  # are computed again, other policies' are kept.
  assert {name: get_policy(name).sample_identity().get("rules") for name in POLICY_NAMES} == {
      "greedy_cot": None, "self_consistency": 2, "best_of_n": 2, "deepconf": 4,
      "think_verify_backtrack": 3, "budget_forcing": 2}


@pytest.mark.parametrize("answers, scores, chosen", [
    (["7", None, "3"], [-2.0, -0.5, -1.0], 2),  # the best-scored trace has no answer: abstains
    ([None, None], [-2.0, -1.0], 1),  # none answers: the best of all
    ([None, "7"], [NAN, -5.0], 1),
])
def test_best_of_n_chooses_among_the_traces_that_answer(answers, scores, chosen):
  traces = [_trace(i, a, logprob=s) for i, (a, s) in enumerate(zip(answers, scores))]
  got = get_policy("best_of_n", n=len(scores)).run(_FakeCtl(traces), [ReasoningRequest("Q")])
  assert got[0][:2] == (chosen, answers[chosen])


def _tvb(**overrides):
  values = dict(verifier="mean_logprob", max_step_backtracks=2, max_backtracks=4, exit_tau=2.0,
                temperature=0.0, temp_bump=0.5, max_steps=4, step_delimiter="\n\n",
                step_max_tokens=8, max_thinking_tokens=16, max_answer_tokens=4)
  return get_policy("think_verify_backtrack", **{**values, **overrides})


def test_the_step_the_model_ends_by_writing_the_answer_prefix_is_verified():
  """docs/controller.md, step 3: a step ends at a delimiter, the step cap, or the model
  writing the answer prefix, and the verifier scores it. The last of these went to the
  answer unscored (score NaN, never backtracked): on the embedded model 3 of 8 GSM traces
  verified no step at all."""
  from tests.o1jax.controller.conftest import MockWorld
  world = MockWorld(edges=[("Q", " bad", 1.0), (" bad", "The answer is", 8.0),
                           ("The answer is", " 7", 8.0), (" 7", "</s>", 8.0),
                           ("\n\n", " A", 8.0), (" A", "\n\n", 8.0)])
  ctl = world.controller()
  # " bad" (P ~ 0.125) then the model's own prefix: below 0.9 it is backtracked.
  (rejected,) = ctl.run([ReasoningRequest("Q", request_id=1, seed=0)], _tvb(backtrack_threshold=0.9))
  t = rejected.traces[0]
  first = t.steps[0]
  assert (first.action, first.text) == ("backtrack", "") and 0.12 < first.score < 0.13
  assert t.backtracks == 1 and not t.text.startswith(" bad")
  # Above 0.05 it is accepted, scored, and the answer prefix is forced after it.
  (accepted,) = ctl.run([ReasoningRequest("Q", request_id=1, seed=0)], _tvb(backtrack_threshold=0.05))
  t = accepted.traces[0]
  (step,) = t.steps
  assert (step.action, step.text) == ("model_answer", " bad") and 0.12 < step.score < 0.13
  assert t.text == " bad\n\nThe answer is 7" and t.answer == "7" and t.backtracks == 0
  counts = t.tokens.to_dict()
  assert counts["discarded"] == 1  # the model's own prefix token, replaced by the forced one
  assert counts["generated"] == counts["thinking"] + counts["answer"] + counts["discarded"]


def test_an_unprobed_last_step_is_no_early_exit():
  """exit_tau <= 0: the last step (no answer probe runs there) read its confidence 0 as
  >= tau and was labelled an early exit."""
  from tests.o1jax.controller.conftest import MockWorld
  world = MockWorld(edges=[("Q", " A", 8.0), (" A", "\n\n", 8.0), ("\n\n", " B", 8.0),
                           (" B", "\n\n", 8.0), ("The answer is", " 7", 8.0), (" 7", "</s>", 8.0)])
  (r,) = world.controller().run([ReasoningRequest("Q", request_id=1, seed=0)],
                                _tvb(backtrack_threshold=0.0, exit_tau=0.0, max_steps=1))
  t = r.traces[0]
  assert not t.early_exit and [s.action for s in t.steps] == ["answer_steps"]
  assert t.tokens.probe == 0


def test_budget_forcing_ends_with_an_answer_however_often_the_prefix_comes_early():
  """A model writing the answer prefix at once and after every "Wait": each early prefix
  is rolled back (discarded), and those tokens ran the trace into max_generated, which
  budgeted only backtracks: it ended "length" with no answer."""
  from tests.o1jax.controller.conftest import MockWorld
  world = MockWorld(edges=[("Q", "The answer is", 8.0), (" Wait", "The answer is", 8.0),
                           ("The answer is", " 7", 8.0), (" 7", "</s>", 8.0)])
  ctl = world.controller()
  for low, high in ((8, 16), (40, 48)):
    policy = get_policy("budget_forcing", min_thinking_tokens=low, max_thinking_tokens=high,
                        max_answer_tokens=4, step_max_tokens=4)
    (r,) = ctl.run([ReasoningRequest("Q", request_id=1, seed=0)], policy)
    t = r.traces[0]
    assert t.exit_reason == "answer_eos" and t.answer == "7", (low, t.tokens.to_dict())
    assert t.tokens.thinking >= low


def test_every_step_of_a_long_trace_is_recorded():
  """A fixed 64 step records per trace: a 100-step trace reported 64 steps (n_steps and the
  result's steps) and lost its last records, its answer event among them."""
  from tests.o1jax.controller.conftest import MockWorld
  world = MockWorld(edges=[("Q", " A", 8.0), (" A", "\n\n", 8.0), ("\n\n", " A", 8.0),
                           ("The answer is", " 7", 8.0), (" 7", "</s>", 8.0)])
  policy = _tvb(backtrack_threshold=0.0, max_steps=100, max_thinking_tokens=200)
  (r,) = world.controller().run([ReasoningRequest("Q", request_id=1, seed=0)], policy)
  t = r.traces[0]
  assert t.n_steps == r.steps == 100 and t.steps[-1].action == "answer_steps"


def test_a_prefix_right_after_a_delimiter_is_no_step_of_its_own():
  """"\n\nThe answer is": the step ends at the delimiter, and the prefix after it has no
  step to verify (an empty one was probed on the same context and backtracked, or scored
  1.0 by mean_logprob)."""
  from tests.o1jax.controller.conftest import MockWorld
  world = MockWorld(edges=[("Q", " A", 8.0), (" A", "\n\n", 8.0), ("\n\n", "The answer is", 8.0),
                           ("The answer is", " 7", 8.0), (" 7", "</s>", 8.0)])
  (r,) = world.controller().run([ReasoningRequest("Q", request_id=1, seed=0)],
                                _tvb(backtrack_threshold=0.01))
  t = r.traces[0]
  assert [s.action for s in t.steps] == ["continue", "model_answer"]
  assert math.isnan(t.steps[-1].score) and t.tokens.discarded == 0
  assert t.text == " A\n\nThe answer is 7"


def test_record_and_row_budgets_are_bounded_by_what_a_row_can_do():
  """max_backtracks=10**6 made a million step records a row (and a row budget of 64 M
  tokens): a row backtracks at most max_step_backtracks per step it can take."""
  from tests.o1jax.controller.conftest import MockWorld
  ctl = MockWorld(edges=[("Q", " A", 8.0)]).controller()
  settings = _tvb(backtrack_threshold=0.5, max_backtracks=10**6, max_step_backtracks=2,
                  max_steps=10).loop_settings()
  assert ctl.record_capacity(settings) == 64  # 10 steps + 20 backtracks + 4, the floor 64
  assert ctl.max_generated(settings) < 2_000
