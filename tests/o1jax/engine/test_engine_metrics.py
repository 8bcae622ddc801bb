"""Metrics math by hand, histogram merging, and an engine run on a fake clock."""

import itertools
import math

import pytest

from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.engine.metrics import LatencyHistogram, MetricsCollector, RequestMetrics, summarize


def test_request_latencies_by_hand():
  m = RequestMetrics(arrival=10.0, prompt_tokens=5)
  for t in (10.5, 10.7, 11.0):
    m.record_token(0, t)
  m.record_token(1, 10.6)
  m.record_token(1, 10.9)
  m.finish = 11.2
  assert m.ttft == pytest.approx(0.5)  # first token of any sample
  assert m.e2e == pytest.approx(1.2)
  # gaps: sample 0: 0.2, 0.3; sample 1: 0.3 -> mean 0.8 / 3
  assert m.tpot == pytest.approx(0.8 / 3)
  assert m.generated_tokens == 5


def test_summary_percentiles_and_cv_by_hand():
  s = summarize([1.0, 2.0, 3.0, 4.0, None])
  # linear interpolation on 4 points: p50 = 2.5, p90 = 3 + 0.7 * 1 = 3.7
  assert s["count"] == 4 and s["p50"] == pytest.approx(2.5) and s["p90"] == pytest.approx(3.7)
  assert s["p99"] == pytest.approx(3.97)
  # population std of 1..4 = sqrt(1.25); mean 2.5
  assert s["cv"] == pytest.approx(math.sqrt(1.25) / 2.5)
  assert summarize([]) == {"count": 0}
  # A time that is not finite is no measurement (it made every statistic NaN); a mean of
  # 0 has no CV (the run summary's rule; it was 0.0 here).
  assert summarize([1.0, 2.0, 3.0, 4.0, math.nan, math.inf]) == s
  assert summarize([0.0, 0.0])["cv"] is None


def test_histogram_buckets_and_merge():
  a, b = LatencyHistogram(), LatencyHistogram()
  for seconds in (0.0, 0.0099, 0.010, 0.2, 0.9999, 1.0, 5.0):
    a.add(seconds)
  b.add(0.06)
  # buckets [0,10) [10,50) [50,100) [100,200) [200,500) [500,1000) [1000,inf) ms
  assert a.counts == [2, 1, 0, 0, 1, 1, 2]
  merged = a.merge(b)
  assert merged.counts == [2, 1, 1, 0, 1, 1, 2] and merged.total == 8
  assert list(merged.to_dict())[-1] == "[1000,inf)"
  with pytest.raises(ValueError):
    a.merge(LatencyHistogram((0.0, 1.0, math.inf)))


def test_collector_throughput_and_merge():
  c1, c2 = MetricsCollector(), MetricsCollector()
  m = RequestMetrics(arrival=0.0, prompt_tokens=10, prompt_tokens_computed=4)
  for t in (0.1, 0.2, 0.3):
    m.record_token(0, t)
  m.finish = 0.3
  c1.add_request(m)
  c1.busy_seconds = 0.5
  c1.preemptions = 2
  c2.busy_seconds = 0.5
  merged = c1.merge(c2)
  s = merged.summary()
  assert s["generated_tokens_per_s"] == pytest.approx(3.0) and s["prompt_tokens_per_s"] == 4.0
  assert s["preemptions"] == 2 and s["ttft"]["p50"] == pytest.approx(0.1)
  assert s["e2e"]["histogram_ms"]["[200,500)"] == 1


def test_engine_records_timestamps_on_an_injected_clock(tiny):
  ticks = itertools.count()  # every clock read advances 1 ms
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=4, num_blocks=32),
                  clock=lambda: next(ticks) * 1e-3)
  res = engine.generate([Request([5, 6, 7, 8], GenerationParams(max_new_tokens=6, ignore_eos=True)),
                         Request([9, 10], GenerationParams(max_new_tokens=3, ignore_eos=True))])
  for r in res:
    times = r.metrics.token_times[0]
    assert len(times) == len(r.token_ids) and times == sorted(times)
    assert 0 < r.metrics.ttft <= r.metrics.e2e
    assert r.metrics.tpot == pytest.approx((times[-1] - times[0]) / (len(times) - 1))
  s = engine.metrics.summary()
  assert s["requests"] == 2 and s["generated_tokens"] == 9 and s["kv_blocks_total"] == 32
  assert s["kv_blocks_in_use"] == 0 and s["kv_blocks_peak"] >= 2
