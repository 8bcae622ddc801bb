"""Test doubles for the evaluation pipeline, importable by Beam worker processes.

Fakes live in a package module (not a test file) so multi-process workers can
unpickle them by reference.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pipelines.predictors import FakePredictor, PredictorSpec, WorkItem


class FakeClock:
  """`time_ns()` that starts at `start_ms` and advances `step_ms` per call (per process)."""

  def __init__(self, start_ms: float = 1_000_000.0, step_ms: float = 25.0):
    self.now_ns = int(start_ms * 1e6)
    self.step_ns = int(step_ms * 1e6)

  def time_ns(self) -> int:
    self.now_ns += self.step_ns
    return self.now_ns


@dataclasses.dataclass
class FlakyPredictor:
  """FakePredictor that raises for any batch holding an example id in `fail_ids`."""
  fail_ids: frozenset = frozenset()

  def predict(self, items: Sequence[WorkItem]) -> list[dict]:
    bad = sorted({i.example["id"] for i in items} & set(self.fail_ids))
    if bad:
      raise RuntimeError(f"injected failure for {bad}")
    return FakePredictor().predict(items)


@dataclasses.dataclass(frozen=True)
class FlakyLoader:
  fail_ids: frozenset = frozenset()

  def __call__(self, spec: PredictorSpec) -> FlakyPredictor:
    return FlakyPredictor(self.fail_ids)


class ReferencePredictor:
  """Answers every item with its example's reference (HumanEval: the canonical solution)."""

  def predict(self, items: Sequence[WorkItem]) -> list[dict]:
    return [{"text": i.example["reference"], "tokens": {"prompt": 1, "completion": 1},
             "finish_reason": "stop", "latency_s": 0.0, "trace": {}} for i in items]


def reference_loader(spec: PredictorSpec) -> ReferencePredictor:
  return ReferencePredictor()


@dataclasses.dataclass
class LoggingPredictor(FlakyPredictor):
  """FlakyPredictor that appends `item KEY` to `path` for every item it is asked to predict."""
  path: str = ""

  def predict(self, items: Sequence[WorkItem]) -> list[dict]:
    with open(self.path, "a") as f:
      f.write("".join(f"item {i.key}\n" for i in items))
    return super().predict(items)


@dataclasses.dataclass(frozen=True)
class CountingLoader:
  """Loads a LoggingPredictor and appends `load PID` to `path` at each load: how often and
  in which processes a runner loads the model, and how often each item is predicted."""
  path: str
  fail_ids: frozenset = frozenset()
  load_s: float = 0.0  # seconds a load takes (a real model: tens of seconds)

  def __call__(self, spec: PredictorSpec) -> LoggingPredictor:
    import os
    import time
    time.sleep(self.load_s)
    with open(self.path, "a") as f:
      f.write(f"load {os.getpid()}\n")
    return LoggingPredictor(self.fail_ids, self.path)
