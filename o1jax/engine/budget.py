"""The latency-aware compute budget: the reference formula, and the live loop that feeds it.

The formula (the reference system's; `int` truncates, as it does):

  allocate_budget(slo, load) = max(16, min(128, int(64 * (slo / 0.5 s) / clamp(load / 0.8, 0.5, 2.0))))

  slo 0.5 s, load 0.8 -> 64      slo 0.3 s, load 1.0 -> 30      slo 0.5 s, load 1.2 -> 42
  slo 1.0 s, load 0.4 -> 256 -> 128 (clamped)      slo 0.1 s, load 0.8 -> 12 -> 16 (clamped)

The live loop (`BudgetLoop`, used by the engine and the controller) closes it:

  * load is measured, not configured:
        load = busy slots / slots + queued / slots
    (busy = slots holding a running or prefilling request; queued = what waits for a
    slot, in the slots' unit: the engine's slot is a sequence, so a waiting request of
    n samples counts n; the controller's slot holds a request's n traces, so it counts
    1; plus, in a pipeline, the requests of Beam batches waiting for the model). 0.8 is
    nominal; a full batch with nothing queued is 1.0.
  * a latency observer keeps sliding windows of end-to-end request latency and of
    per-step latency: the last `window` values, none older than `window_s` seconds (so
    a slow start, compilation included, stops steering the budget once it is past),
    and reports their P95.
  * every `interval_s` of wall clock (`tick`) the budget is re-evaluated:
        steps = allocate_budget(slo, measured load)
    and, once requests have finished, when their P95 end-to-end latency exceeds the
    SLO the budget shrinks in proportion:
        steps = max(16, int(steps * slo / p95))
    The decision (time, load, P95s, KV use, steps, why) is kept in `decisions`.
  * pruning (the reference's rule): while the observed P95 exceeds the SLO, or the
    KV pool is more than `kv_limit` (85%) full, redundant branches are pruned: each
    request that still has two or more running traces (sampled policies) stops its
    lowest-confidence one. The controller ranks by its confidence (the mean
    log-prob it keeps per row), the engine an n > 1 request's samples by their mean
    log-prob so far (finish reason "pruned"). `Decision.prune` says so.

Mode "fixed" (the default) runs no live loop: requests keep their own limits (an
engine request its max_new_tokens, a controller policy its own steps, e.g.
think_verify_backtrack's allocate_budget(slo, load)). The budget unit is a reasoning step in the controller (the answer is
forced when a trace reaches it); a plain engine request has no steps, so its
max_new_tokens is the budget's ceiling (128 steps) and its token limit scales with
the steps: ceil(max_new_tokens * steps / 128), from 1/8 of it at 16 steps to all of
it at 128 (see `token_limit`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
import time
from typing import Callable, Optional

import numpy as np

from o1jax.engine import fields
from o1jax.model.sampling import is_int, is_real

BASE_STEPS = 64
BASE_SLO_S = 0.5
NOMINAL_LOAD = 0.8
MIN_STEPS, MAX_STEPS = 16, 128
MODES = ("fixed", "adaptive")


def load_factor(load: float) -> float:
  return min(max(load / NOMINAL_LOAD, 0.5), 2.0)


def check_slo(latency_slo_s, name: str = "latency_slo_s") -> None:
  """ValueError naming `name` unless the SLO is a finite number > 0 (an infinite one
  overflowed `int` in `allocate_budget`; a str failed its comparison with a TypeError)."""
  if not is_real(latency_slo_s):
    raise ValueError(f"{name} must be a number, got {latency_slo_s!r}")
  if not _finite(latency_slo_s):
    raise ValueError(f"{name} must be finite, got {latency_slo_s}")
  if not latency_slo_s > 0:
    raise ValueError(f"{name} must be > 0, got {latency_slo_s}")


def _finite(value) -> bool:
  try:
    return math.isfinite(value)
  except OverflowError:  # an int past float's range
    return False


def allocate_budget(latency_slo_s: float, load: float) -> int:
  """Maximum reasoning steps for a request under a latency SLO and a load in [0, inf)."""
  check_slo(latency_slo_s)
  if not is_real(load) or not load >= 0:
    raise ValueError(f"load must be >= 0, got {load!r}")
  # (an int past float's range is an infinite load, not an OverflowError)
  steps = BASE_STEPS * (latency_slo_s / BASE_SLO_S) / load_factor(
      float(load) if _finite(load) else math.inf)
  # (clamped before `int`: an SLO past ~2.8e306 s makes the quotient inf)
  return max(MIN_STEPS, int(min(steps, MAX_STEPS)))


def token_limit(max_new_tokens: int, steps: int) -> int:
  """A plain request's token limit under a budget of `steps` (128 = its max_new_tokens)."""
  return max(1, min(max_new_tokens, math.ceil(max_new_tokens * steps / MAX_STEPS)))


def measured_load(busy_slots: int, queued: int, slots: int) -> float:
  """busy / slots + queued / slots (see the module doc)."""
  return (busy_slots + queued) / max(slots, 1)


@dataclasses.dataclass(frozen=True)
class BudgetConfig:
  """The `budget` config section."""

  mode: str = "fixed"  # fixed | adaptive
  latency_slo_s: float = 0.5
  interval_ms: float = 200.0  # adaptive: re-evaluate the budget this often (wall clock)
  window: int = 64  # adaptive: latencies kept for the P95s ...
  window_s: float = 10.0  # ... and none older than this (seconds)
  kv_limit: float = 0.85  # adaptive: prune above this share of the KV pool in use

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"budget.mode={self.mode!r}: valid modes are {list(MODES)}")
    check_slo(self.latency_slo_s, "budget.latency_slo_s")
    # Types first (a str compared with a TypeError; True read as 1).
    for name in ("interval_ms", "window_s", "kv_limit"):
      if not is_real(getattr(self, name)):
        raise ValueError(f"budget.{name} must be a number, got {getattr(self, name)!r}")
    if not 0 < self.interval_ms < math.inf:  # (inf: the budget never re-evaluated)
      raise ValueError(f"budget.interval_ms must be a finite number > 0, got {self.interval_ms}")
    # A deque's maxlen: 2.5 failed at first use, past sys.maxsize at the worker's start.
    if not is_int(self.window) or self.window < 1:
      raise ValueError(f"budget.window must be an int >= 1, got {self.window!r}")
    if self.window > sys.maxsize:
      raise ValueError(f"budget.window must be at most {sys.maxsize}, got {self.window}")
    if not self.window_s > 0:
      raise ValueError(f"budget.window_s must be > 0, got {self.window_s}")
    if not 0 < self.kv_limit <= 1:
      raise ValueError(f"budget.kv_limit must be in (0, 1], got {self.kv_limit}")
    # One value, one form (5 and 5.0 are one budget: the content hash reads these).
    for name in ("latency_slo_s", "interval_ms", "window_s", "kv_limit"):
      try:
        object.__setattr__(self, name, float(getattr(self, name)))
      except OverflowError:  # an int past float's range
        raise ValueError(f"budget.{name} must be a float, got {getattr(self, name)}") from None
    object.__setattr__(self, "window", int(self.window))

  @classmethod
  def from_dict(cls, values) -> "BudgetConfig":
    return fields.from_dict(cls, values, "budget section has no keys")


class LatencyWindow:
  """The last `size` latencies (seconds), each stamped with when it was observed; the P95
  of those no older than `max_age_s` at `now`, and not stamped after it (a clock that went
  back made them count until it caught up: an hour for a step back of an hour)."""

  def __init__(self, size: int, max_age_s: float = math.inf):
    self.values: collections.deque[tuple[float, float]] = collections.deque(maxlen=size)
    self.max_age_s = max_age_s

  def add(self, seconds: float, at: float = 0.0) -> None:
    if seconds is not None and math.isfinite(seconds) and seconds >= 0:
      self.values.append((float(at), float(seconds)))

  def p95(self, now: float = 0.0) -> Optional[float]:
    recent = [v for t, v in self.values if 0 <= now - t <= self.max_age_s]
    return float(np.percentile(recent, 95)) if recent else None


@dataclasses.dataclass(frozen=True)
class Decision:
  """One re-evaluation of the budget."""

  at_s: float  # clock time of the decision
  steps: int
  load: float
  p95_request_s: Optional[float]
  p95_step_s: Optional[float]
  kv_use: float
  prune: bool
  why: str

  def to_dict(self, at_ms: float) -> dict:
    """The decision for a request's log, `at_ms` after its admission."""
    r = lambda x, d=4: None if x is None else round(float(x), d)
    return {"at_ms": r(at_ms, 1), "steps": self.steps, "load": r(self.load, 3),
            "p95_request_ms": r(None if self.p95_request_s is None else self.p95_request_s * 1e3, 1),
            "p95_step_ms": r(None if self.p95_step_s is None else self.p95_step_s * 1e3, 2),
            "kv_use": r(self.kv_use, 3), "prune": self.prune, "why": self.why}


class BudgetLoop:
  """The budget as a function of measured latency and load, re-evaluated on a clock.

  The owner (engine or controller) reports what it measures (`observe_request`,
  `observe_step`) and calls `tick(busy, queued, slots, kv_use)` between device
  calls; `tick` returns a new `Decision` when `interval_ms` has passed since the
  last one (always on the first call), else None. `steps` is the budget in force
  (allocate_budget(slo, 0.8) before the first decision). The config's mode is not
  read here: whoever builds a loop wants it live."""

  def __init__(self, config: BudgetConfig = BudgetConfig(), *,
               clock: Optional[Callable[[], float]] = None):
    self.config = config
    self.clock = clock or time.perf_counter
    self.requests = LatencyWindow(config.window, config.window_s)
    self.steps_window = LatencyWindow(config.window, config.window_s)
    self._now = 0.0  # the clock at the last tick: stamps what is observed until the next
    self.queued_outside = 0  # requests waiting before the owner (e.g. Beam batches on a lock)
    self.decisions: list[Decision] = []
    self.steps = allocate_budget(config.latency_slo_s, NOMINAL_LOAD)

  @property
  def interval_s(self) -> float:
    return self.config.interval_ms / 1e3

  @property
  def prune(self) -> bool:
    return bool(self.decisions) and self.decisions[-1].prune

  def observe_request(self, seconds: float) -> None:
    self.requests.add(seconds, self._now)

  def observe_step(self, seconds: float) -> None:
    self.steps_window.add(seconds, self._now)

  def decide(self, now: float, load: float, kv_use: float) -> Decision:
    """The budget for this load and the latencies observed so far (pure but for the windows)."""
    slo = self.config.latency_slo_s
    steps = allocate_budget(slo, load)
    why = f"load {load:.2f}"
    p95 = self.requests.p95(now)
    over_slo = p95 is not None and p95 > slo
    if over_slo:
      steps = max(MIN_STEPS, int(steps * slo / p95))
      why += f", P95 {p95:.3f} s > SLO {slo:g} s"
    over_kv = kv_use > self.config.kv_limit
    if over_kv:
      why += f", KV {kv_use:.0%} > {self.config.kv_limit:.0%}"
    return Decision(at_s=now, steps=steps, load=load, p95_request_s=p95,
                    p95_step_s=self.steps_window.p95(now), kv_use=kv_use, prune=over_slo or over_kv,
                    why=why)

  def tick(self, busy: int, queued: int, slots: int, kv_use: float = 0.0) -> Optional[Decision]:
    now = self._now = self.clock()
    # (a clock that went back past the last decision decides now: waiting for it to
    # catch up froze the budget)
    if self.decisions and 0 <= now - self.decisions[-1].at_s < self.interval_s:
      return None
    decision = self.decide(now, measured_load(busy, queued + self.queued_outside, slots), kv_use)
    self.decisions.append(decision)
    self.steps = decision.steps
    return decision
