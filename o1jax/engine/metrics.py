"""Serving metrics: per-request latencies, aggregates, mergeable histograms, gauges.

Times come from an injectable clock (seconds, monotonic); tests pass a fake one.
Per request: TTFT = first token - arrival; TPOT = mean gap between consecutive
tokens of a sample (over all samples); end-to-end = finish - arrival; and the
emit timestamp of every token. The engine samples up to `decode_steps` tokens per
device call; a token's timestamp is the call's start plus its step's share of
the call's wall time (step j of a call that ran k steps: start + (j+1)/k of it).
Aggregates: throughput, P50/P90/P95/P99, mean, coefficient of variation
(population std / mean) and a fixed-bucket histogram per latency that adds up
across workers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np

# Bucket edges in ms: [0, 10), [10, 50), ..., [1000, +inf).
LATENCY_BUCKETS_MS = (0.0, 10.0, 50.0, 100.0, 200.0, 500.0, 1000.0, math.inf)
PERCENTILES = (50, 90, 95, 99)
LATENCY_NAMES = ("ttft", "tpot", "e2e")


@dataclasses.dataclass
class RequestMetrics:
  """Timestamps of one request (all samples); latencies are derived properties."""

  arrival: float
  prompt_tokens: int = 0
  prompt_tokens_computed: int = 0  # prompt tokens actually run through the model
  recomputed_tokens: int = 0  # tokens run again after a preemption freed their KV
  first_token: float | None = None
  finish: float | None = None
  token_times: list[list[float]] = dataclasses.field(default_factory=list)  # [sample][token]
  # Token limits it ran under (a latency-aware budget): {"at_ms", "steps", "tokens", "why"}.
  budget: list[dict] = dataclasses.field(default_factory=list)
  spec_drafted: int = 0  # speculative decoding: drafted tokens verified for it
  spec_accepted: int = 0  # and accepted

  def record_token(self, sample: int, now: float) -> None:
    while len(self.token_times) <= sample:
      self.token_times.append([])
    self.token_times[sample].append(now)
    if self.first_token is None or now < self.first_token:
      self.first_token = now

  @property
  def generated_tokens(self) -> int:
    """Tokens sampled, over all samples: their token_ids, and the eos / stop id that ended
    a sample (sampled, but not part of its output); not what a row sampled past a stop
    string (dropped)."""
    return sum(len(t) for t in self.token_times)

  @property
  def ttft(self) -> float | None:
    return None if self.first_token is None else self.first_token - self.arrival

  @property
  def e2e(self) -> float | None:
    return None if self.finish is None else self.finish - self.arrival

  @property
  def tpot(self) -> float | None:
    """Mean seconds between consecutive tokens of a sample (None below 2 tokens)."""
    gaps = [b - a for times in self.token_times for a, b in zip(times, times[1:])]
    return float(np.mean(gaps)) if gaps else None


class LatencyHistogram:
  """Counts per bucket of LATENCY_BUCKETS_MS; `merge` adds another worker's counts."""

  def __init__(self, edges_ms: Sequence[float] = LATENCY_BUCKETS_MS, counts=None):
    self.edges_ms = tuple(float(e) for e in edges_ms)
    self.counts = list(counts) if counts is not None else [0] * (len(self.edges_ms) - 1)

  def add(self, seconds: float) -> None:
    ms = seconds * 1e3
    for i in range(len(self.counts)):
      if self.edges_ms[i] <= ms < self.edges_ms[i + 1]:
        self.counts[i] += 1
        return
    self.counts[-1 if ms >= self.edges_ms[-2] else 0] += 1  # negatives (clock skew) go first

  def merge(self, other: "LatencyHistogram") -> "LatencyHistogram":
    if other.edges_ms != self.edges_ms:
      raise ValueError(f"cannot merge histograms with edges {self.edges_ms} and {other.edges_ms}")
    return LatencyHistogram(self.edges_ms, [a + b for a, b in zip(self.counts, other.counts)])

  @property
  def total(self) -> int:
    return sum(self.counts)

  def to_dict(self) -> dict:
    labels = [f"[{lo:g},{hi:g})" for lo, hi in zip(self.edges_ms, self.edges_ms[1:])]
    return dict(zip(labels, self.counts))


def summarize(values: Iterable[float]) -> dict:
  """P50/P90/P95/P99 (linear interpolation), mean and coefficient of variation (population
  std / mean; None for a mean of 0, as the run summary's) of the finite values (a NaN
  made every statistic NaN)."""
  arr = np.asarray([v for v in values if v is not None], np.float64)
  arr = arr[np.isfinite(arr)]
  if arr.size == 0:
    return {"count": 0}
  out = {"count": int(arr.size), "mean": float(arr.mean())}
  for p in PERCENTILES:
    out[f"p{p}"] = float(np.percentile(arr, p))
  out["cv"] = float(arr.std() / arr.mean()) if arr.mean() > 0 else None
  return out


class MetricsCollector:
  """Finished requests, gauges and wall time of one engine (or merged workers)."""

  def __init__(self):
    self.requests: list[RequestMetrics] = []
    self.histograms = {name: LatencyHistogram() for name in LATENCY_NAMES}
    self.busy_seconds = 0.0  # wall time while requests were in flight
    self.kv_blocks_total = 0
    self.kv_blocks_in_use = 0
    self.kv_blocks_peak = 0
    self.preemptions = 0
    self.pool_rebuilds = 0  # KV pools lost to a failed device call and rebuilt (Engine.step)
    self.decode_calls = 0  # device calls of the decode loop (= host round trips)
    self.decode_steps = 0  # decode steps those calls ran
    # Wall time of those calls: drafting included, and the wait for a prefill chunk
    # dispatched just before a call (the device runs it first), with or without speculation.
    self.decode_seconds = 0.0
    self.spec_calls = 0  # of those, verify calls of speculative decoding
    self.spec_drafted = 0  # drafted tokens they checked
    self.spec_accepted = 0  # and accepted

  def add_request(self, m: RequestMetrics) -> None:
    self.requests.append(m)
    for name in LATENCY_NAMES:
      value = getattr(m, name)
      if value is not None:
        self.histograms[name].add(value)

  def set_blocks(self, in_use: int, total: int) -> None:
    self.kv_blocks_in_use, self.kv_blocks_total = in_use, total
    self.kv_blocks_peak = max(self.kv_blocks_peak, in_use)

  def merge(self, other: "MetricsCollector") -> "MetricsCollector":
    """Combines two workers (busy time adds: workers are assumed to run serially
    on the same cores; divide by the number of parallel workers if not)."""
    out = MetricsCollector()
    out.requests = self.requests + other.requests
    out.histograms = {n: self.histograms[n].merge(other.histograms[n]) for n in LATENCY_NAMES}
    out.busy_seconds = self.busy_seconds + other.busy_seconds
    out.kv_blocks_total = self.kv_blocks_total + other.kv_blocks_total
    out.kv_blocks_in_use = self.kv_blocks_in_use + other.kv_blocks_in_use
    out.kv_blocks_peak = self.kv_blocks_peak + other.kv_blocks_peak
    out.preemptions = self.preemptions + other.preemptions
    out.pool_rebuilds = self.pool_rebuilds + other.pool_rebuilds
    out.decode_calls = self.decode_calls + other.decode_calls
    out.decode_steps = self.decode_steps + other.decode_steps
    out.decode_seconds = self.decode_seconds + other.decode_seconds
    out.spec_calls = self.spec_calls + other.spec_calls
    out.spec_drafted = self.spec_drafted + other.spec_drafted
    out.spec_accepted = self.spec_accepted + other.spec_accepted
    return out

  def summary(self) -> dict:
    """Throughput (tokens / busy second), latency stats in seconds, histograms, gauges."""
    prompt = sum(r.prompt_tokens for r in self.requests)
    computed = sum(r.prompt_tokens_computed for r in self.requests)
    generated = sum(r.generated_tokens for r in self.requests)
    busy = self.busy_seconds
    out = {
        "requests": len(self.requests),
        "prompt_tokens": prompt,
        "prompt_tokens_computed": computed,
        "generated_tokens": generated,
        "busy_seconds": busy,
        "prompt_tokens_per_s": computed / busy if busy else 0.0,
        "generated_tokens_per_s": generated / busy if busy else 0.0,
        "kv_blocks_in_use": self.kv_blocks_in_use,
        "kv_blocks_total": self.kv_blocks_total,
        "kv_blocks_peak": self.kv_blocks_peak,
        "preemptions": self.preemptions,
        "pool_rebuilds": self.pool_rebuilds,
        "recomputed_tokens": sum(r.recomputed_tokens for r in self.requests),
        "decode_calls": self.decode_calls,
        "decode_seconds": self.decode_seconds,
        "decode_steps_per_call": (self.decode_steps / self.decode_calls
                                  if self.decode_calls else 0.0),
        "speculative": {"verify_calls": self.spec_calls, "drafted": self.spec_drafted,
                        "accepted": self.spec_accepted,
                        "acceptance_rate": (self.spec_accepted / self.spec_drafted
                                            if self.spec_drafted else 0.0)},
    }
    for name in LATENCY_NAMES:
      out[name] = summarize(getattr(r, name) for r in self.requests)
      out[name]["histogram_ms"] = self.histograms[name].to_dict()
    return out
