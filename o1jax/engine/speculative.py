"""Speculative decoding: drafters, and how many drafts a verify call checks.

A drafter proposes up to K tokens per running sequence; the engine checks
them in one forward over K + 1 positions (`steps.verify_step`) and emits the
accepted drafts plus the target's own token. The emitted tokens are the ones
one-token decoding would produce (greedy or sampled: see `verify_step`), so
speculation changes speed, never outputs.

Drafters (one interface: `propose` on the host, or drafts made on the device):
  prompt_lookup: model-free; the continuation of the most recent earlier
    occurrence of the sequence's longest matching suffix n-gram (prompt and
    generated text both count), up to K tokens.
  early_exit: self-speculation; the model's first `exit_layer` layers with its
    own final norm and output head draft K greedy tokens on the device
    (`steps.draft_greedy`), sharing the target's KV pools.
  draft_model: a smaller model that shares the tokenizer (`draft_source`: any
    checkpoint `load_checkpoint` reads, or `Engine(draft_model=)`) drafts K
    greedy tokens on the device (`steps.draft_greedy`) from its own KV pools,
    addressed by the target's block tables; each sequence's draft K/V catches
    up over the tokens it has not seen before drafting (`Engine._speculate_once`).

How many drafts (`SpeculationPlanner`): each sequence keeps a decayed count
of accepted drafts and of rejections, i.e. an estimate a of the chance that
its next draft is accepted (starting from the engine-wide estimate, and
drifting back to it while the sequence does not draft); a verify call with d drafts is then expected to
emit (1 - a^(d+1)) / (1 - a) tokens. The planner times every decode call
shape (rows, K + 1), plain decoding included (K = 0, per step; the median of the
last few timings of whole calls, host work included), and picks the
K of `K_BUCKETS` (or 0: no speculation) with the most expected tokens per
second for the whole batch, or, when no request waits, the earliest predicted
end of the batch's last row. So speculation turns itself off where drafts are
rarely accepted or where a wider call costs more than it emits (large
batches on a compute-bound device). A draft model's catch-up is weighed too
(`SpeculationPlanner`).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Sequence

import numpy as np

from o1jax.engine import fields
from o1jax.model.sampling import is_int

DRAFTERS = ("prompt_lookup", "early_exit", "draft_model")
K_BUCKETS = (1, 3, 7, 15)  # drafts per verify call (K + 1 = 2, 4, 8, 16 positions)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """The `speculative` config section (`o1jax.engine.Engine(..., speculative=)`)."""

  drafter: str = "prompt_lookup"  # prompt_lookup | early_exit | draft_model
  max_drafts: int = 7  # the largest K a verify call checks (K_BUCKETS up to it)
  ngram_max: int = 4  # prompt_lookup: longest suffix n-gram matched
  ngram_min: int = 1  # and the shortest
  exit_layer: int = 0  # early_exit: layers the draft runs (0: a quarter of the model's)
  # draft_model: its checkpoint ("embedded", a .gguf, an HF or orbax directory);
  # unused when the engine is given the draft model itself.
  draft_source: str = ""
  # True: K per call from acceptance and measured cost (0 = no speculation);
  # False: always the largest K the drafter can fill (for studies).
  adaptive: bool = True

  def __post_init__(self):
    if self.drafter not in DRAFTERS:
      raise ValueError(f"speculative.drafter={self.drafter!r} not in {DRAFTERS}")
    # Counts are ints (a float max_drafts failed as a slice index inside the engine's step),
    # adaptive a bool (a str was truthy).
    for name in ("max_drafts", "ngram_max", "ngram_min", "exit_layer"):
      if not is_int(getattr(self, name)):
        raise ValueError(f"speculative.{name} must be an int, got {getattr(self, name)!r}")
    if not isinstance(self.adaptive, (bool, np.bool_)):
      raise ValueError(f"speculative.adaptive must be a bool, got {self.adaptive!r}")
    if not isinstance(self.draft_source, str):  # (None or 5 failed inside the loader)
      raise ValueError(f"speculative.draft_source must be a path or a model name (a str), got "
                       f"{self.draft_source!r}")
    if self.max_drafts < 1:
      raise ValueError(f"speculative.max_drafts={self.max_drafts} must be >= 1")
    if not 1 <= self.ngram_min <= self.ngram_max:
      raise ValueError(f"speculative n-gram sizes need 1 <= ngram_min <= ngram_max, got "
                       f"{self.ngram_min}, {self.ngram_max}")
    if self.exit_layer < 0:
      raise ValueError(f"speculative.exit_layer={self.exit_layer} must be >= 0")
    if self.draft_source and self.drafter != "draft_model":
      raise ValueError(f"speculative.draft_source is read by drafter 'draft_model' only, "
                       f"not {self.drafter!r}")

  @classmethod
  def from_dict(cls, values: dict) -> "SpeculativeConfig":
    return fields.from_dict(cls, values, "speculative section has no keys")

  @property
  def k_buckets(self) -> tuple[int, ...]:
    fits = tuple(k for k in K_BUCKETS if k < self.max_drafts)
    return fits + (self.max_drafts,)

  def resolved_exit_layer(self, n_layers: int) -> int:
    layer = self.exit_layer or max(1, n_layers // 4)
    if layer >= n_layers:
      raise ValueError(f"speculative.exit_layer={layer} must be below the model's {n_layers} layers")
    return layer


def check_draft_vocabulary(target, draft) -> None:
  """A draft model proposes token ids of the target's vocabulary: the two `ModelConfig`s
  must have the same vocab_size (one-line ValueError)."""
  if draft.vocab_size != target.vocab_size:
    raise ValueError(f"draft model vocab_size={draft.vocab_size} differs from the target's "
                     f"{target.vocab_size}: it must share the tokenizer")


def prompt_lookup(tokens: Sequence[int], max_drafts: int, ngram_max: int = 4,
                  ngram_min: int = 1) -> list[int]:
  """Drafts from the sequence itself: for n = ngram_max .. ngram_min, the last n
  tokens are searched for earlier in `tokens`; the most recent earlier match
  with a continuation gives up to `max_drafts` tokens (what followed it)."""
  if max_drafts < 1 or len(tokens) < 2:
    return []
  arr = np.asarray(tokens, np.int64)
  size = len(arr)
  for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
    suffix = arr[size - n:]
    # Windows starting at 0 .. size - n - 1: every earlier occurrence with at least one
    # token after it (the suffix itself is excluded).
    windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)
    hits = np.flatnonzero(np.all(windows == suffix, axis=1))
    if hits.size:
      start = int(hits[-1]) + n
      return arr[start:start + max_drafts].tolist()
  return []


def expected_tokens(drafts: int, acceptance: float) -> float:
  """Tokens a verify call with `drafts` drafts emits when each is accepted with
  probability `acceptance` until the first rejection: 1 + a + ... + a^drafts."""
  a = min(max(acceptance, 0.0), 1.0)
  return float(drafts + 1) if a >= 1.0 else (1.0 - a ** (drafts + 1)) / (1.0 - a)


class Acceptance:
  """Decayed counts of accepted drafts and of rejections (a sequence's, or the engine's).

  Geometric model: each draft is accepted with probability a until the first
  rejection, so the estimate is accepted / (accepted + rejections)."""

  IDLE_DECAY = 0.9  # per decode call without drafts: the estimate drifts back to the prior

  def __init__(self, decay: float = 0.7):
    self.decay = decay  # weight of the past per verify call
    self.accepted = 0.0
    self.rejected = 0.0

  def rate(self, prior: float = 0.5, strength: float = 2.0) -> float:
    """The estimate, with `strength` pseudo-drafts at the `prior` rate."""
    return (self.accepted + strength * prior) / (self.accepted + self.rejected + strength)

  def observe(self, drafted: int, accepted: int) -> None:
    if drafted <= 0:
      return
    self.accepted = self.decay * self.accepted + accepted
    self.rejected = self.decay * self.rejected + (1.0 if accepted < drafted else 0.0)

  def idle(self) -> None:
    """A decode call that drafted nothing for it: what it learned counts a little less,
    so a sequence that once had its drafts rejected gets to try again later."""
    self.accepted *= self.IDLE_DECAY
    self.rejected *= self.IDLE_DECAY


class SpeculationPlanner:
  """Chooses K per decode call from acceptance estimates and measured call times.

  A shape's cost is the median of its last `KEEP` timings (whole calls, host work
  included; not the wait for a prefill chunk dispatched before the call): one slow
  outlier (another process, a page-fault storm) does not make the planner shun a
  shape, as it would a mean. An unmeasured shape's cost is estimated from another K
  measured at the same row count (what one draft added there), else from the same K
  measured at another row count (its cost relative to plain decoding there), else
  from a plain step: per position `PRIOR_PER_POSITION` of it plus, per draft, the
  drafter's share of a step (`draft_step_share`: the early exit's layers, a draft
  model's weight bytes; it overestimates a draft model whose head and embedding
  dominate its bytes, so the first measured K corrects it).
  Every shape is timed apart while the batch fills (`single`: plain calls are one
  step then) and after; plain decoding is re-timed after `STALE` decisions without
  a plain call of that kind.

  Exploring: two choices count as optimistic, since they may cost more than they
  win: a sequence with no evidence of its own drafting at no less than
  `OPTIMISTIC_RATE` (else a drafter never tried, or one unlucky stretch of the
  engine, would stop every later sequence from trying; the engine-wide estimate is
  the realistic one), and a shape not timed for `STALE` decisions tried again at
  its estimated cost (it may have got cheaper). The planner takes the optimistic
  choice only while what such calls cost beyond a plain step is at most a share of
  the decode time it has seen (`explore_share`; the first one is free):
  `EXPLORE_SHARE` once speculation has saved at least what exploring cost (verify
  calls' tokens at a plain step's time, less their time: `saved_seconds`), down to
  `EXPLORE_FLOOR` while it has saved nothing. So a drafter whose drafts are almost
  never accepted (an untrained early exit) costs under a percent, not one verify
  call per admitted sequence (at batch 8-32, where rows arrive one by one, that was
  6-30% of the calls and up to 14% of the time; at a 2% share, 2-4% at batch 1),
  while one that pays for some sequences (prompt lookup over a mix of copying and
  free text) keeps trying every new one. These totals cover the last
  `HISTORY_SECONDS` of decode time seen (scaled down together past it): a long-lived
  engine whose workload changes (copying, then free text) judges exploring by what it
  saves now, and a long stretch without exploring does not bank a budget that a burst
  of new sequences would then spend at once.

  While no request waits (`draining`), the batch ends with its last row: rows
  still prefilling (`pending`) count with the calls they have ahead, so no verify
  call lengthens the steps their prefill chunks share for rows that end earlier.

  A draft model must first catch up over the tokens a row has not shown it (its
  prompt, or what plain decoding added since): a one-off cost, measured per token
  apart from the calls (`observe_catch_up`), and charged to a row's choice spread
  over the verify calls its remaining budget leaves. While that cost or the shape
  is unmeasured, a call lets at most one row that must catch up draft
  (`drafting`): so trying a shape costs one prompt's catch-up, not a whole batch's
  (at batch 8 on a CPU, 8 prompts' catch-up cost more than a 64-token run won).
  While the batch fills no row starts a catch-up: the full batch decides whether
  speculation pays, and a catch-up started before would likely be stranded."""

  KEEP = 8
  STALE = 64
  PRIOR_PER_POSITION = 0.15  # unmeasured shape: a plain step's time x (1 + this x K) ...
  EXPLORE_SHARE = 0.02  # optimistic calls' cost beyond a plain step / decode time seen ...
  EXPLORE_FLOOR = 0.005  # ... and the same while speculation has saved nothing
  # A sequence with no evidence, when exploring: high enough that a drafter which pays
  # only at high acceptance (a draft model's steps cost a share of a step each) is tried.
  OPTIMISTIC_RATE = 0.9
  HISTORY_SECONDS = 300.0  # decode time the exploring totals cover (see above)

  def __init__(self, config: SpeculativeConfig, draft_step_share: float = 0.0):
    self.config = config
    # ... + this x K: one draft step's cost relative to a plain step
    self.draft_step_share = draft_step_share
    self.acceptance = Acceptance(decay=0.98)  # over every sequence (the last ~50 calls)
    # (rows, K, single) -> seconds per call (plain decoding: per step)
    self.timings: dict[tuple[int, int, bool], collections.deque] = {}
    self._timed_at: dict[tuple[int, int, bool], int] = {}  # decision count at the last timing
    self.decisions = 0
    self.catch_up: collections.deque = collections.deque(maxlen=self.KEEP)  # s per token
    self.seen_seconds = 0.0  # decode time observed (every timed call)
    self.explored_seconds = 0.0  # what optimistic calls cost beyond a plain step
    self.saved_seconds = 0.0  # what verify calls saved over plain decoding (< 0: lost)
    self.explorations = 0
    self._exploring: tuple[int, int, bool] | None = None  # the shape of an optimistic choice

  def observe_catch_up(self, tokens: int, seconds: float) -> None:
    """Wall time of a draft model's catch-up over `tokens` tokens (awaited)."""
    if tokens > 0:
      self.catch_up.append(seconds / tokens)

  @staticmethod
  def _key(rows: int, k: int, single: bool) -> tuple[int, int, bool]:
    return rows, k, bool(single)

  def observe(self, rows: int, k: int, seconds: float, single: bool = False,
              steps: int = 1, one_off: float = 0.0, emitted: float | None = None) -> None:
    """Wall time of one call of this shape (plain decoding: per step, over `steps`
    steps; `single`: while the batch fills; the engine leaves out calls that compiled).
    `one_off`: what the call spent apart from its shape (a draft model's catch-up,
    timed on its own): decode time seen, and an exploring cost when exploring.
    `emitted`: a verify call's tokens per running row; what it saved over plain
    steps of this batch adds to `saved_seconds` (negative when it lost)."""
    key = self._key(rows, k, single)
    plain = self.cost(rows, 0, single)
    if key == self._exploring:
      self.explored_seconds += max(0.0, seconds - (plain or 0.0)) + one_off
      self._exploring = None
    if k and emitted is not None and plain is not None:
      self.saved_seconds += emitted * plain - seconds - one_off
    self.seen_seconds += seconds * steps + one_off
    if self.seen_seconds > self.HISTORY_SECONDS:
      forget = self.HISTORY_SECONDS / self.seen_seconds
      self.seen_seconds *= forget
      self.explored_seconds *= forget
      self.saved_seconds *= forget
    self.timings.setdefault(key, collections.deque(maxlen=self.KEEP)).append(seconds)
    self._timed_at[key] = self.decisions

  def rate(self, seq: Acceptance, optimistic: bool = False) -> float:
    """A sequence's acceptance estimate around the engine-wide one: a sequence with
    evidence drifts back to it (`Acceptance.idle`), one without starts from it, or,
    `optimistic`, from no less than `OPTIMISTIC_RATE` (what exploring assumes)."""
    prior = self.acceptance.rate()
    if optimistic and seq.accepted + seq.rejected == 0:
      prior = max(prior, self.OPTIMISTIC_RATE)
    return seq.rate(prior=prior)

  def record(self, seq: Acceptance, drafted: int, accepted: int) -> None:
    seq.observe(drafted, accepted)
    self.acceptance.observe(drafted, accepted)

  def cost(self, rows: int, k: int, single: bool = False) -> float | None:
    """Seconds per call of shape (rows, K) while the batch fills (`single`) or not:
    measured, the other phase's timing when this one is unmeasured, or the estimate
    from plain decoding (`prior`; K = 0: per step, None while untimed)."""
    for key in (self._key(rows, k, single), self._key(rows, k, not single)):
      if key in self.timings:
        return statistics.median(self.timings[key])
    return None if k == 0 else self.prior(rows, k, single)

  def prior(self, rows: int, k: int, single: bool = False,
            transfer: bool = True) -> float | None:
    """An unmeasured shape's cost (`transfer`: from measured ones): at these rows, a
    plain step plus K times what a draft added at the nearest measured K (same phase
    first; a draft step and a verified position each: linear in K); else a plain
    step times the ratio the same K measured at the nearest other row count (same
    phase first); else a plain step x (1 + K x (PRIOR_PER_POSITION + draft_step_share))."""
    step = self.cost(rows, 0, single)
    if step is None:
      return None
    same_rows, same_k = [], []
    for (r, kk, ph), times in self.timings.items() if transfer else ():
      plain = self.timings.get(self._key(r, 0, ph)) or self.timings.get(self._key(r, 0, not ph))
      if r == rows and kk not in (0, k) and plain:
        same_rows.append(((ph != single, abs(kk - k)),
                          (statistics.median(times) - statistics.median(plain)) / kk))
      if kk == k and r != rows and plain:
        same_k.append(((ph != single, abs(r - rows)),
                       statistics.median(times) / statistics.median(plain)))
    if same_rows:
      return step + k * max(0.0, min(same_rows)[1])
    if same_k:
      return step * min(same_k)[1]
    return step * (1.0 + k * (self.PRIOR_PER_POSITION + self.draft_step_share))

  def explore_share(self) -> float:
    """The share of decode time optimistic calls may cost: `EXPLORE_SHARE` once
    speculation has saved what exploring cost, down to `EXPLORE_FLOOR` in
    proportion while it has saved less (the first exploration is free either way)."""
    if self.explored_seconds <= 0.0:
      return self.EXPLORE_SHARE
    paid = min(1.0, max(0.0, self.saved_seconds / self.explored_seconds))
    return self.EXPLORE_FLOOR + (self.EXPLORE_SHARE - self.EXPLORE_FLOOR) * paid

  def drafting(self, rows: int, k: int, behind: Sequence[int], single: bool = False) -> list[bool]:
    """Which rows draft in a call of K drafts; behind[i]: tokens row i must catch up
    over first. With adaptive off, all of them. Else, while the batch fills
    (`single`), none that must catch up; once the shape (and the catch-up cost) is
    measured, all; until then the rows with nothing to catch up and the one least
    behind (the call still times the whole shape: every row runs through the draft
    and verify calls)."""
    if k == 0 or not self.config.adaptive:
      return [True] * len(behind)
    if single:
      return [c == 0 for c in behind]
    owing = [i for i, c in enumerate(behind) if c > 0]
    if len(owing) <= 1 or (self._key(rows, k, False) in self.timings and self.catch_up):
      return [True] * len(behind)
    least = min(owing, key=lambda i: behind[i])
    return [c == 0 or i == least for i, c in enumerate(behind)]

  def choose(self, rows: int, available: Sequence[int], rates: Sequence[float],
             behind: Sequence[int] | None = None, remaining: Sequence[int] | None = None,
             single: bool = False, draining: bool = False, pending: Sequence[int] = (),
             optimistic: Sequence[float] | None = None) -> int:
    """K for the next call (0: plain decoding). available[i]: drafts row i can take
    (its drafter's proposal, budget and context); rates[i]: its acceptance estimate
    (optimistic[i]: the same when exploring, `rate(optimistic=True)`; default: rates);
    behind[i]: tokens it must catch up over first (a draft model) and remaining[i]:
    tokens its budget has left, over which that one-off cost is spread; single: the
    batch fills (the plain call that would run instead is one step, and no row
    starts a catch-up); pending[j]: calls a row still prefilling has ahead (its
    prefill chunks and its budget).

    The best K: while requests wait, the most expected tokens per second over all
    rows (a row that ends frees its slot for the next request). When `draining` (no
    request waits) the batch lasts until its last row ends, so the K with the
    earliest predicted end of the last row, prefilling rows included: a verify call
    costs more than a plain step, and rows with few drafts accepted, or none yet,
    would otherwise finish later. The optimistic choice (see the class doc) replaces
    it while the exploring budget allows."""
    self.decisions += 1
    self._exploring = None
    behind = list(behind or [0] * len(available))
    if self.config.adaptive and single:
      available = [0 if c else a for a, c in zip(available, behind)]
    most = max(available, default=0)
    if most == 0:
      return 0
    buckets = [k for k in self.config.k_buckets if k <= most] or [self.config.k_buckets[0]]
    if not self.config.adaptive:
      return max(buckets)
    # Time plain decoding of the kind that would run first (it is the baseline of
    # every choice), and again when its timing is STALE.
    plain_key = self._key(rows, 0, single)
    if (plain_key not in self.timings
        or self.decisions - self._timed_at[plain_key] > self.STALE):
      return 0
    plain = self.cost(rows, 0, single)
    remaining = remaining or [0] * len(available)
    per_token = statistics.median(self.catch_up) if self.catch_up else 0.0

    def best(rates: Sequence[float], retry: bool) -> int:
      """The K of the highest score; retry: stale shapes at their estimated cost."""
      def charge(k: int) -> float:  # catch-up seconds per call, over the calls each row has left
        total = 0.0
        for a, r, c, left in zip(available, rates, behind, remaining):
          if c and min(k, a):
            total += c * per_token / max(1.0, left / expected_tokens(min(k, a), r))
        return total

      def score(k: int, seconds: float) -> float:  # higher is better; k = 0: plain decoding
        if draining and (any(remaining) or pending):
          calls = [left / expected_tokens(min(k, a), r)
                   for a, r, left in zip(available, rates, remaining)]
          return -seconds * max(calls + list(pending))
        return sum(expected_tokens(min(k, a), r) for a, r in zip(available, rates)) / seconds

      best_k, best_score = 0, score(0, plain)
      for k in buckets:
        key = self._key(rows, k, single)
        stale = self.decisions - self._timed_at.get(key, self.decisions) > self.STALE
        seconds = (self.prior(rows, k, single, transfer=False) if retry and stale
                   else self.cost(rows, k, single))
        value = score(k, seconds + charge(k))
        if value > best_score:
          best_k, best_score = k, value
      return best_k

    chosen = best(rates, retry=False)
    if self.explored_seconds <= self.explore_share() * self.seen_seconds:
      bold = best(rates if optimistic is None else optimistic, retry=True)
      if bold and bold != chosen:
        self._exploring = self._key(rows, bold, single)
        self.explorations += 1
        return bold
    return chosen
