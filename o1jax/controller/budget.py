"""Budgets: steps from a latency SLO and load, and the adaptive re-budgeting between calls.

allocate_budget(slo, load) = clamp(round(64 * (slo / 0.5 s) / clamp(load / 0.8, 0.5, 2.0)), 16, 128)

  slo 0.5 s, load 0.8 -> 64      slo 0.25 s, load 0.8 -> 32
  slo 1.0 s, load 0.4 -> 256 -> 128 (clamped)      slo 0.5 s, load 3.2 -> 32
  slo 0.1 s, load 0.8 -> 12.8 -> 16 (clamped)      slo 0.5 s, load 0.2 -> 128

`AdaptiveBudget` recomputes max_steps between loop invocations from what was
measured: the P95 latency of one reasoning step (seconds per iteration x
tokens per step) and the share of busy rows (the load). A step budget is the
number of steps that fit the SLO at that latency, divided by the same load
factor, clamped to [16, 128].
"""

from __future__ import annotations

import dataclasses

import numpy as np

BASE_STEPS = 64
BASE_SLO_S = 0.5
NOMINAL_LOAD = 0.8
MIN_STEPS, MAX_STEPS = 16, 128


def load_factor(load: float) -> float:
  return float(np.clip(load / NOMINAL_LOAD, 0.5, 2.0))


def allocate_budget(latency_slo_s: float, load: float) -> int:
  """Maximum reasoning steps for a request under a latency SLO and a load in [0, inf)."""
  if latency_slo_s <= 0:
    raise ValueError(f"latency_slo_s must be > 0, got {latency_slo_s}")
  if load < 0:
    raise ValueError(f"load must be >= 0, got {load}")
  steps = BASE_STEPS * (latency_slo_s / BASE_SLO_S) / load_factor(load)
  return int(np.clip(round(steps), MIN_STEPS, MAX_STEPS))


@dataclasses.dataclass
class AdaptiveBudget:
  """Step budget recomputed between loop invocations.

  1. start from allocate_budget(slo, initial_load);
  2. after each invocation `observe(step_latencies_s, busy_share)`;
  3. max_steps = clamp(slo / P95(step latency) / load_factor(busy_share), 16, 128)."""

  latency_slo_s: float
  initial_load: float = NOMINAL_LOAD
  max_steps: int = dataclasses.field(init=False)
  history: list = dataclasses.field(default_factory=list, init=False)

  def __post_init__(self):
    self.max_steps = allocate_budget(self.latency_slo_s, self.initial_load)

  def observe(self, step_latencies_s, busy_share: float) -> int:
    lat = np.asarray(step_latencies_s, np.float64)
    lat = lat[lat > 0]
    if lat.size:
      p95 = float(np.percentile(lat, 95))
      steps = self.latency_slo_s / p95 / load_factor(busy_share)
      self.max_steps = int(np.clip(round(steps), MIN_STEPS, MAX_STEPS))
      self.history.append({"p95_step_s": p95, "busy_share": busy_share,
                           "max_steps": self.max_steps})
    return self.max_steps
