"""Reasoning policies: small frozen classes chosen by name, every parameter in config.

A policy implements one method, `run(controller, requests) -> [ReasoningResult]`,
usually as: build `LoopSettings` from its fields -> `controller.generate(...)`
-> aggregate the traces -> `controller.result(...)`. Register a new class with
`@register` and name it in a config (see docs/controller.md for a worked example);
the registry (registry.py) also holds the plain sampling policies (sampling_policies.py).

  greedy_cot              one greedy chain of thought
  self_consistency        n samples sharing the prompt's cache; majority vote
  best_of_n               n samples; the best by a named scorer
  deepconf                warm-up traces set a confidence threshold (percentile of
                          their lowest group confidence); later traces stop once their
                          group confidence falls below it, and all stop once the
                          confidence-weighted vote is decided (consensus)
  think_verify_backtrack  step verifier + backtracking + early exit at tau
  budget_forcing          s1: "Wait" below a minimum of thinking tokens, answer at a maximum
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar, Sequence

import numpy as np

from o1jax.controller.answers import best_index, weighted_vote
from o1jax.controller.controller import CONFIDENCE_TOP_K, Controller, LoopSettings
from o1jax.controller.registry import MAX_SAMPLES, BasePolicy, register
from o1jax.controller.results import ReasoningRequest, ReasoningResult, Trace
from o1jax.controller.verifiers import (SCORERS, Verifier, check_backtrack_threshold,
                                       get_verifier)
from o1jax.engine.budget import BudgetConfig, BudgetLoop, allocate_budget
from o1jax.model.sampling import check_int, is_real


@dataclasses.dataclass(frozen=True)
class Policy(BasePolicy):
  """Base of the reasoning policies: the decoding / budget parameters they all share.

  One work item per example: the policy draws its traces itself, sharing the prompt's cache."""

  controller: ClassVar[bool] = True
  own_sampling: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k")
  # Raised when a change of the rules (the loop's, a vote's) changes what a policy's sample
  # computes: a stored sample's content key holds it from 2 on (1: not in the key, so the
  # stores of policies never changed stay valid).
  RULES: ClassVar[int] = 1
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  max_thinking_tokens: int = 256
  max_answer_tokens: int = 16
  step_delimiter: str = "\n\n"
  step_max_tokens: int = 64
  answer_prefix: str = "The answer is"
  answer_on_eos: bool = True  # a trace that ends without an answer gets the prefix forced

  def __post_init__(self):
    # A bad param fails where the policy is built (a config before any batch runs),
    # named with the policy, rather than inside `run` or its jitted loop.
    try:
      self.check_params()
    except ValueError as e:
      raise ValueError(f"{self.name}: {e}") from None

  def check_params(self) -> None:
    """Raises ValueError for a bad param. The shared ones are checked by the `LoopSettings`
    they make; a subclass checks its own after calling this."""
    self.settings()

  @abc.abstractmethod
  def run(self, ctl: Controller, requests: Sequence[ReasoningRequest]) -> list[ReasoningResult]:
    """One result per request, same order."""

  @property
  def num_samples(self) -> int:
    return 1

  def loop_settings(self) -> LoopSettings:
    """The settings of the loop calls `run` makes (what a check before any request sizes)."""
    return self.settings()

  @property
  def traces_per_call(self) -> int:
    """Most traces per request in one `generate` call of `run`."""
    return 1

  def settings(self, **overrides) -> LoopSettings:
    """LoopSettings from this policy's shared fields (+ overrides)."""
    base = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                max_thinking_tokens=self.max_thinking_tokens,
                max_answer_tokens=self.max_answer_tokens, step_delimiter=self.step_delimiter,
                step_max_tokens=self.step_max_tokens, answer_prefix=self.answer_prefix,
                answer_on_eos=self.answer_on_eos)
    base.update(overrides)
    return LoopSettings(**base)

  def to_dict(self) -> dict[str, Any]:
    # Params in name order: how results.jsonl records have always spelled a reasoning policy.
    return {"name": self.name, **dict(sorted(dataclasses.asdict(self).items()))}

  def sample_identity(self) -> dict[str, Any]:
    out = super().sample_identity()
    return {**out, "rules": self.RULES} if self.RULES > 1 else out


def _check_count(policy, name: str, low: int = 1) -> None:
  check_int(getattr(policy, name), name, low)


def _check_sampled(policy) -> None:
  """n traces at temperature 0 would be n copies of one greedy trace (sample_n refuses
  the same)."""
  check_int(policy.n, "n", 1, MAX_SAMPLES)  # (n=1e8 was found too big only by a worker)
  if policy.n > 1 and not policy.temperature > 0:
    raise ValueError(f"n={policy.n} traces need temperature > 0, got {policy.temperature!r}")
  if policy.n > 1 and policy.top_k == 1:  # (the argmax alone: greedy too)
    raise ValueError(f"n={policy.n} traces need top_k != 1 (top_k=1 draws the most likely "
                     f"token only)")


def _check_flags(policy, *names: str) -> None:
  for name in names:
    if not isinstance(getattr(policy, name), (bool, np.bool_)):
      raise ValueError(f"{name} must be a bool, got {getattr(policy, name)!r}")


def _first(ctl, traces: list[Trace], among: list[Trace], answer) -> int | None:
  """Index of the trace in `among` that stands for the voted `answer`: the first whose
  answer is `answer` and whose text the scoring task reads as it (`Controller.reads_as`),
  else the first whose answer is `answer`."""
  ids = {id(t) for t in among}
  winners = [j for j, t in enumerate(traces) if id(t) in ids and t.answer == answer]
  if answer is not None and ctl.reads_as is not None:
    winners = [j for j in winners if ctl.reads_as(ctl.final_text(traces[j]), answer)] or winners
  return winners[0] if winners else None


def _vote_results(ctl, policy, requests, batch, settings, weights_fn=None, keep_fn=None):
  """Majority (or weighted) vote over each request's traces."""
  out = []
  for i, req in enumerate(requests):
    traces = batch.traces[i]
    keep = [t for t in traces if keep_fn is None or keep_fn(t)] or traces
    weights = None if weights_fn is None else [weights_fn(t) for t in keep]
    winner, votes = weighted_vote([t.answer for t in keep], weights)
    chosen = _first(ctl, traces, keep, winner)
    out.append(ctl.result(req, policy.name, traces, chosen, winner, batch.wall_time_s[i],
                          batch.invocations[i], votes))
  return out


def _one_trace(policy: Policy, ctl, requests):
  """One trace per request under the policy's loop settings; its answer is the result's."""
  batch = ctl.generate(requests, policy.loop_settings(), 1)
  return [ctl.result(r, policy.name, batch.traces[i], 0, batch.traces[i][0].answer,
                     batch.wall_time_s[i], batch.invocations[i])
          for i, r in enumerate(requests)]


@dataclasses.dataclass(frozen=True)
class GreedyCoT(Policy):
  """One greedy chain of thought, then the answer."""

  name: ClassVar[str] = "greedy_cot"

  def run(self, ctl, requests):
    return _one_trace(self, ctl, requests)


@dataclasses.dataclass(frozen=True)
class SelfConsistency(Policy):
  """n sampled traces sharing the prompt's cache; majority vote (Wang et al., 2022)."""

  name: ClassVar[str] = "self_consistency"
  # 2 (2026-12-07): the chosen trace is the first winner the task reads as the vote (`_first`).
  RULES: ClassVar[int] = 2
  n: int = 8
  temperature: float = 0.7
  top_p: float = 0.95

  def check_params(self):
    super().check_params()
    _check_sampled(self)

  @property
  def traces_per_call(self) -> int:
    return self.n

  def run(self, ctl, requests):
    st = self.loop_settings()
    return _vote_results(ctl, self, requests, ctl.generate(requests, st, self.n), st)


@dataclasses.dataclass(frozen=True)
class BestOfN(Policy):
  """n sampled traces; the one with the best `score` (a registered host scorer:
  mean_logprob, mean_confidence, lowest_group_confidence, tail_confidence, or
  one the pipeline registered with `register_scorer`) among the traces that give an
  answer (all of them if none does: a trace without one abstains, as in a vote)."""

  name: ClassVar[str] = "best_of_n"
  # 2 (2026-12-06): traces without an answer abstain (the best-scored one was taken, and
  # the request had no answer while other traces had one).
  RULES: ClassVar[int] = 2
  n: int = 4
  temperature: float = 0.7
  top_p: float = 0.95
  score: str = "mean_logprob"

  def check_params(self):
    super().check_params()
    _check_sampled(self)
    if not isinstance(self.score, str):
      raise ValueError(f"score must be a registered scorer's name, got {self.score!r}")
    # (the modules of --config.imports register theirs before policies are built: an
    # unknown name found here is named before any work, not once per example)
    if self.score not in SCORERS:
      raise ValueError(f"unknown scorer {self.score!r}; registered: {sorted(SCORERS)}")

  @property
  def traces_per_call(self) -> int:
    return self.n

  def run(self, ctl, requests):
    scorer = SCORERS[self.score]
    batch = ctl.generate(requests, self.loop_settings(), self.n)
    out = []
    for i, req in enumerate(requests):
      traces = batch.traces[i]
      for t in traces:
        t.score = float(scorer(req, t))
      answered = [j for j, t in enumerate(traces) if t.answer is not None] or list(range(len(traces)))
      chosen = answered[best_index([traces[j].score for j in answered])]
      out.append(ctl.result(req, self.name, traces, chosen, traces[chosen].answer,
                            batch.wall_time_s[i], batch.invocations[i]))
    return out


@dataclasses.dataclass(frozen=True)
class DeepConf(Policy):
  """DeepConf online (Fu et al., 2025), per request:

  1. `warmup` traces run to the end; each trace's confidence is its lowest
     group confidence (window `window` tokens, token confidence = -mean top-k log p);
  2. threshold s = percentile(warm-up confidences, 100 - keep_percent): keep_percent 10
     is DeepConf-low (aggressive), 90 is DeepConf-high;
  3. the other n - warmup traces run in one batch with s as a stop threshold: a
     trace stops as soon as its group confidence (full window) falls below s;
  4. the vote: every trace that was not stopped (warm-up traces included),
     weighted by its confidence; with filter_votes only those with confidence >= s;
  5. consensus stop, checked in the loop at every token: the request's running
     traces stop once the vote's leader holds `consensus` of the weight cast by at
     least `consensus_min_votes` traces, or (stop_when_decided) once the running
     traces could no longer change the winner even if each voted with its current
     lowest group confidence. `consensus` > 1 and stop_when_decided=False turn it off.
     A request whose warm-up votes already decide it starts no other trace
     (`Trace.unstarted`).

  Consensus needs the loop to read answers the way the host does: it is used
  with the default numeric extraction only (not with a custom extract_answer).
  The defaults (window 8, keep 10, consensus 0.95 of >= 2 votes) were chosen on
  synthetic GSM problems that the benchmark does not use (docs/controller.md).

  `threshold`: a fixed stop threshold in place of step 2's per-request
  percentile, e.g. `calibrate()` on held-out problems (a percentile over many
  traces rather than over a request's few warm-up traces). The warm-up traces
  are then never stopped for low confidence and run in the same loop call as
  the others (one host round trip; the consensus stop may still end them). None
  (default) is the paper's per-request threshold."""

  name: ClassVar[str] = "deepconf"
  # 2 (2026-12-06): the loop votes as the host does (no-token and error traces abstain,
  # warm-up priors are the host's answers); thresholds over the traces that kept a token.
  # 3 (2026-12-06): the window ending at the last thinking token can stop a trace.
  # 4 (2026-12-07): the chosen trace is the first winner the task reads as the vote.
  RULES: ClassVar[int] = 4
  n: int = 8
  warmup: int = 2
  keep_percent: float = 10.0
  window: int = 8
  consensus: float = 0.95
  consensus_min_votes: int = 2
  stop_when_decided: bool = True
  filter_votes: bool = False
  threshold: float | None = None
  temperature: float = 0.7
  top_p: float = 0.95

  def check_params(self):
    super().check_params()
    _check_sampled(self)
    _check_count(self, "warmup")
    if not 1 <= self.warmup <= self.n:
      raise ValueError(f"need 1 <= warmup <= n, got warmup={self.warmup} n={self.n}")
    if self.threshold is not None and not (  # (the loop compares in float32: 1e39 was inf)
        is_real(self.threshold) and abs(self.threshold) <= np.finfo(np.float32).max):
      raise ValueError(f"threshold must be a finite number or None, got {self.threshold!r}")
    if not is_real(self.keep_percent) or not 0 < self.keep_percent <= 100:
      raise ValueError(f"keep_percent must be in (0, 100], got {self.keep_percent!r}")
    if not is_real(self.consensus) or not self.consensus > 0.5:  # (NaN: never stopped)
      raise ValueError(f"consensus must be > 0.5 (> 1 turns it off), got {self.consensus!r}")
    _check_count(self, "window")
    if self.window > self.max_thinking_tokens:  # (the loop stops thinking only)
      raise ValueError(f"window={self.window} > max_thinking_tokens="
                       f"{self.max_thinking_tokens}: no thinking window would ever be full, "
                       f"so no trace could be stopped for low confidence")
    _check_count(self, "consensus_min_votes")
    if self.consensus <= 1.0 and self.consensus_min_votes > self.n > 1:  # (n=1: nothing to stop)
      raise ValueError(f"consensus_min_votes={self.consensus_min_votes} > n={self.n}: the "
                       f"consensus would never stop a trace (consensus > 1 turns it off)")
    _check_flags(self, "stop_when_decided", "filter_votes")
    self._online_settings(self.settings(conf_window=self.window, answer_vote=True), True)

  @property
  def cross_row_stops(self) -> bool:
    return self.consensus <= 1.0 or self.stop_when_decided

  def loop_settings(self) -> LoopSettings:
    return self.settings(conf_window=self.window)

  @property
  def traces_per_call(self) -> int:
    # A known threshold runs all n in one call; else the warm-up call, then the rest.
    return self.n if self.threshold is not None else max(self.warmup, self.n - self.warmup)

  def run(self, ctl, requests):
    # The loop's answer keys mirror the default extraction only.
    consensus = ctl.extract_answer is None
    st = dataclasses.replace(self.loop_settings(), answer_vote=consensus)
    if self.threshold is not None:
      return self._run_fixed_threshold(ctl, requests, st, consensus)
    warm = ctl.generate(requests, st, self.warmup, finishes_requests=self.n == self.warmup)
    thresholds = [self._percentile(self._confidences(traces)) for traces in warm.traces]
    floors = thresholds if self.filter_votes else [-math.inf] * len(requests)
    # The warm-up traces vote in the loop as they will in `_result`: with the host's own
    # answer (exact, where the loop's key is a reading of it); none if they abstain.
    priors = [[(t.answer, t.lowest_group_confidence) for t in self._voters(traces, f)
               if t.answer is not None] for traces, f in zip(warm.traces, floors)]
    # A request its warm-up votes already decide starts no other trace (the loop would
    # stop them at their first token, after prefilling their prompt again).
    todo = [i for i in range(len(requests))
            if self.n > self.warmup and not (consensus and self._decided(ctl, priors[i]))]
    if self.n > self.warmup:  # the requests the warm-up decided end here
      ctl.observe_finished(len(requests) - len(todo))
    rest = {}
    if todo:
      pick = lambda xs: [xs[i] for i in todo]
      extra = dict(vote_floor=pick(floors), prior_votes=pick(priors)) if consensus else {}
      batch = ctl.generate(pick(requests), self._online_settings(st, consensus),
                           self.n - self.warmup, sample_offset=self.warmup,
                           conf_stop=pick(thresholds), **extra)
      rest = {i: (batch.traces[j], batch.wall_time_s[j], batch.invocations[j])
              for j, i in enumerate(todo)}
    out = []
    for i, req in enumerate(requests):
      traces, wall, calls = rest.get(
          i, ([Trace.unstarted(j) for j in range(self.warmup, self.n)], 0.0, 0))
      out.append(self._result(ctl, req, warm.traces[i] + traces, thresholds[i], floors[i],
                              warm.wall_time_s[i] + wall, warm.invocations[i] + calls))
    return out

  def _decided(self, ctl, votes) -> bool:
    """Whether the loop's consensus stop holds on `votes` ((answer, weight)) before any
    other trace runs, for the case the warm-up makes common: at least
    consensus_min_votes votes, all for one answer the loop can hold as a key, and a share
    rule that is on. (Otherwise the loop decides: a split vote's share, and
    stop_when_decided, which needs a full window of every running trace.)"""
    cast = [key for key, weight in votes if weight > 0]
    return (self.consensus <= 1.0 and len(cast) >= self.consensus_min_votes
            and ctl.key_codes(cast[0]) is not None and len(set(cast)) == 1)

  def _online_settings(self, st, consensus: bool):
    if not consensus:
      return st
    return dataclasses.replace(st, consensus_share=self.consensus,
                               consensus_min_votes=self.consensus_min_votes,
                               stop_when_decided=self.stop_when_decided)

  def _run_fixed_threshold(self, ctl, requests, st, consensus: bool):
    """A known threshold needs no warm-up call: all n traces run in one loop call,
    the first `warmup` of them never stopped for low confidence. The warm-up
    traces vote as they finish (in the loop too, for the consensus stop)."""
    s = float(np.float32(self.threshold))
    floor = s if self.filter_votes else -math.inf
    extra = dict(vote_floor=[floor] * len(requests)) if consensus else {}
    batch = ctl.generate(requests, self._online_settings(st, consensus), self.n,
                         conf_stop=[s] * len(requests), unstopped_samples=self.warmup, **extra)
    return [self._result(ctl, req, traces, s, floor, wall, calls)
            for req, traces, wall, calls in zip(requests, batch.traces, batch.wall_time_s,
                                                batch.invocations)]

  @staticmethod
  def _confidences(traces) -> list[float]:
    """The confidences a threshold is a percentile of: of the traces that kept a token
    and have an answer's worth of log p (not "error"). A trace that kept none has
    confidence +inf: at the top rank it made the threshold +inf, which stopped every
    other trace and, as a vote floor, left only itself (no answer) to vote."""
    return [t.lowest_group_confidence for t in traces
            if t.token_ids and t.exit_reason != "error"]

  @staticmethod
  def _voters(traces, floor):
    """The traces that vote: not stopped; of those, the ones with confidence >= floor
    (all of them if none has)."""
    voted = [t for t in traces if not (t.stopped_low_confidence or t.stopped_consensus)]
    return [t for t in voted if t.lowest_group_confidence >= floor] or voted

  def _result(self, ctl, req, traces, s, floor, wall, calls):
    voters = self._voters(traces, floor)
    winner, votes = weighted_vote([t.answer for t in voters],
                                  [t.lowest_group_confidence for t in voters])
    # Voters whose loop-read answer differs from the host's extraction (expected 0):
    # the consensus stop is exact only when they agree.
    mismatched = sum(t.answer_key is not None and t.answer_key != t.answer for t in voters)
    return ctl.result(req, self.name, traces, _first(ctl, traces, voters, winner), winner,
                      wall, calls, votes, threshold=s,
                      stopped=sum(t.stopped_low_confidence for t in traces),
                      consensus_stopped=sum(t.stopped_consensus for t in traces),
                      key_mismatches=mismatched)

  def _percentile(self, confidences) -> float:
    """The (100 - keep_percent)th percentile, in f32 like the loop's confidences (host and
    loop compare the same numbers); -inf (stop nothing, every trace votes) with none."""
    if not len(confidences):
      return -math.inf
    xs = np.sort(np.asarray(confidences, np.float64))
    q = 100.0 - self.keep_percent
    if np.isinf(xs).any() and not np.isnan(xs).any():
      # A trace without a full window and no token has confidence +inf; numpy's
      # interpolation gives inf - inf = NaN next to it (a NaN threshold stops nothing
      # and filters every vote). Interpolate by hand: inf beside inf is inf.
      rank = (len(xs) - 1) * q / 100.0
      lo, hi = int(math.floor(rank)), int(math.ceil(rank))
      t = rank - lo
      if lo == hi or t == 0 or xs[lo] == xs[hi]:
        value = xs[lo]
      elif np.isinf(xs[lo]) or np.isinf(xs[hi]):
        value = xs[hi] if np.isinf(xs[hi]) and xs[hi] > 0 else xs[lo]
      else:
        value = np.percentile(xs[lo:hi + 1], 100.0 * t)
      return float(np.float32(value))
    return float(np.float32(np.percentile(xs, q)))

  def calibrate(self, ctl, requests) -> float:
    """A fixed threshold from held-out requests: `n` traces each, run in full
    (no stopping) with this policy's sampling and window; the (100 - keep_percent)th
    percentile of all their confidences. Use it as `threshold` on other problems."""
    batch = ctl.generate(requests, self.loop_settings(), self.n)
    return self._percentile(self._confidences([t for traces in batch.traces for t in traces]))


@dataclasses.dataclass(frozen=True)
class ThinkVerifyBacktrack(Policy):
  """The full loop: score every step with `verifier`; backtrack a step scoring
  below `backtrack_threshold` (resampled with a fresh key and temperature +
  temp_bump per retry), at most `max_step_backtracks` per step and
  `max_backtracks` per trace; exit early once the answer confidence (the
  probability of the greedy answer's first token after the answer prefix, read
  past a whitespace-only token: P(" ") x P("3" | " ")) reaches `exit_tau`.
  Steps: `max_steps`, or allocate_budget(latency_slo_s, load) when
  max_steps = 0; `adaptive` runs a live budget with this SLO instead
  (o1jax/engine/budget.py: re-evaluated on a wall clock between loop calls
  from the measured load and latency), unless the controller has its own; a
  `max_steps` set with it caps the budget."""

  name: ClassVar[str] = "think_verify_backtrack"
  # 2 (2026-12-06): a rolled-back step's tokens leave the confidences (a retry was scored
  # with the rejected attempt's window) and the mean log p.
  # 3 (2026-12-07): the step the model ends by writing the answer prefix is verified (and
  # may be backtracked); an accepted one gets the prefix forced.
  RULES: ClassVar[int] = 3
  verifier: str = "self_verify"
  backtrack_threshold: float = 0.5
  max_step_backtracks: int = 2
  max_backtracks: int = 6
  temp_bump: float = 0.3
  exit_tau: float = 0.85
  max_steps: int = 0
  latency_slo_s: float = 0.5
  load: float = 0.8
  adaptive: bool = False
  step_delimiter: str = "\n"

  def check_params(self):
    super().check_params()
    _check_count(self, "max_steps", 0)
    for name in ("latency_slo_s", "load", "exit_tau"):
      if not is_real(getattr(self, name)):
        raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
    allocate_budget(self.latency_slo_s, self.load)  # (its checks; `adaptive` uses the SLO too)
    _check_flags(self, "adaptive")
    if not isinstance(self.verifier, (str, Verifier)):
      raise ValueError(f"verifier must be a registered verifier's name, got {self.verifier!r}")
    settings = self.loop_settings()  # builds the verifier: an unknown name is refused now
    # (with the default controller's k; a controller checks its own when it runs)
    check_backtrack_threshold(settings.verifier, self.backtrack_threshold, CONFIDENCE_TOP_K)

  def loop_settings(self) -> LoopSettings:
    steps = self.max_steps or allocate_budget(self.latency_slo_s, self.load)
    return self.settings(verifier=get_verifier(self.verifier),
                         backtrack_threshold=self.backtrack_threshold,
                         max_step_backtracks=self.max_step_backtracks,
                         max_backtracks=self.max_backtracks, temp_bump=self.temp_bump,
                         exit_tau=self.exit_tau, answer_probe=self.exit_tau <= 1.0, max_steps=steps)

  def run(self, ctl, requests):
    st = self.loop_settings()
    steps = st.max_steps
    # adaptive: a live budget with this SLO for the call, unless the controller has one.
    budget = (BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=self.latency_slo_s))
              if self.adaptive and ctl.budget is None else None)
    live = self.adaptive or ctl.budget is not None
    if live and self.max_steps:
      # A live budget replaces the policy's step limit; one set here caps it, as a
      # request's own (it was ignored: max_steps=1 ran 3-6 steps, recorded as 1).
      requests = [r if r.max_steps is not None and r.max_steps <= self.max_steps
                  else dataclasses.replace(r, max_steps=self.max_steps) for r in requests]
    elif live:
      steps = None  # the live budget's, logged per request ("budget")
    batch = ctl.generate(requests, st, 1, budget=budget)
    return [ctl.result(r, self.name, batch.traces[i], 0, batch.traces[i][0].answer,
                       batch.wall_time_s[i], batch.invocations[i], max_steps=steps)
            for i, r in enumerate(requests)]


@dataclasses.dataclass(frozen=True)
class BudgetForcing(Policy):
  """s1 budget forcing (Muennighoff et al., 2025): while fewer than
  `min_thinking_tokens` were thought, the end of thinking is replaced by
  `wait_text`; at `max_thinking_tokens` the answer prefix is forced."""

  name: ClassVar[str] = "budget_forcing"
  # 2 (2026-12-06): an answer prefix rolled back for "Wait" leaves the mean log p.
  RULES: ClassVar[int] = 2
  min_thinking_tokens: int = 64
  max_thinking_tokens: int = 256
  wait_text: str = " Wait"

  def check_params(self):
    super().check_params()
    self.loop_settings()

  def loop_settings(self) -> LoopSettings:
    return self.settings(min_thinking_tokens=self.min_thinking_tokens, wait_text=self.wait_text)

  def run(self, ctl, requests):
    return _one_trace(self, ctl, requests)


for _cls in (GreedyCoT, SelfConsistency, BestOfN, DeepConf, ThinkVerifyBacktrack, BudgetForcing):
  register(_cls)
