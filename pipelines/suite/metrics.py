"""Per-category metrics of a suite run, from its records (pure Python; summary and report use it).

  categories = category_summaries(records, vote=False)

For each category: its accuracy metrics (the headline first, see each category module;
math's by a majority vote of each item's samples when the policy votes, `majority_vote`;
code's pass@k capped where an item kept fewer scored samples, `pass_at_k_capped`),
samples, completion tokens, time to first token P50/P95, per-token latency P50/P90/P95 with
its coefficient of variation (population std / mean) and the fixed-bucket histogram
(0/10/50/100/200/500/1000 ms). Per-token latency is the engine's measured per-token time
(`timing.token_ms`, after the first token: the TTFT is its own) when the records carry it, else request latency / completion tokens.
"""

from __future__ import annotations

import collections
from typing import Any, Optional, Sequence

from pipelines.datasets.records import normalize_answer
from pipelines.summary import (coefficient_of_variation, group_by_example, histogram, is_time,
                               majority, pass_at_k_cap, pass_counts, per_token_latencies,
                               percentile, scored_samples)
from pipelines.tasks import mean_pass_at_k
from pipelines.tasks.gsm8k import answer_key

# The metric that is the category's "accuracy" in the cross-category table.
HEADLINE = {"code": "pass@1", "math": "strict", "qa": "exact_match",
            "instructions": "prompt_strict", "summarization": "key_fact_recall"}


def _r(x: Optional[float], nd: int = 4) -> Optional[float]:
  return None if x is None else round(float(x), nd)


def _mean_metric(samples: Sequence[dict], key: str) -> Optional[float]:
  vals = [float(r["score"]["metrics"][key]) for r in samples if key in r["score"].get("metrics", {})]
  return _r(sum(vals) / len(vals)) if vals else None


def category_accuracy(category: str, records: Sequence[dict], vote: bool = False) -> dict[str, Any]:
  """The category's metrics, headline first."""
  groups = group_by_example(records)
  if category == "code":
    pass_k = mean_pass_at_k(pass_counts(groups))  # a sandbox error is no verdict
    return {f"pass@{k}": _r(v) for k, v in pass_k.items()}
  if category == "math":
    if vote:
      out = {}
      for kind in ("strict", "flexible"):
        right = sum(majority([r["score"].get(f"{kind}_answer") for r in g], key=answer_key)
                    == normalize_answer(g[0]["reference"]) for g in groups)
        out[kind] = _r(right / len(groups)) if groups else None
      return out
    return {k: _mean_metric(records, k) for k in ("strict", "flexible")}
  if category == "qa":
    return {k: _mean_metric(records, k) for k in ("exact_match", "f1")}
  if category == "instructions":
    total = sum(r["score"]["metrics"]["instructions_total"] for r in records)
    inst = {k: _r(sum(r["score"]["metrics"][f"instructions_{k}"] for r in records) / total) if total else None
            for k in ("strict", "loose")}
    return {"prompt_strict": _mean_metric(records, "prompt_strict"),
            "prompt_loose": _mean_metric(records, "prompt_loose"),
            "instruction_strict": inst["strict"], "instruction_loose": inst["loose"]}
  if category == "summarization":
    return {k: _mean_metric(records, k) for k in ("key_fact_recall", "rouge_l")}
  raise ValueError(f"unknown suite category {category!r}")


def latency_profile(records: Sequence[dict]) -> dict[str, Any]:
  """TTFT P50/P95, per-token P50/P90/P95 + CV + histogram, for one category's records."""
  per_token, source = per_token_latencies(records)
  ttft = [float(r["timing"]["ttft_ms"]) for r in records  # (measured times only)
          if r.get("timing") and is_time(r["timing"].get("ttft_ms"))]
  mean = sum(per_token) / len(per_token) if per_token else None
  return {"ttft_ms": {"p50": _r(percentile(ttft, 50), 3), "p95": _r(percentile(ttft, 95), 3),
                      "count": len(ttft)},
          "per_token_ms": {"p50": _r(percentile(per_token, 50), 3), "p90": _r(percentile(per_token, 90), 3),
                           "p95": _r(percentile(per_token, 95), 3), "mean": _r(mean, 3),
                           "cv": coefficient_of_variation(per_token),
                           "count": len(per_token), "source": source, "histogram": histogram(per_token)}}


def category_summaries(records: Sequence[dict], vote: bool = False) -> dict[str, dict]:
  """{category: {headline, accuracy, examples, samples, tokens, ttft_ms, per_token_ms}}."""
  by_cat: dict[str, list[dict]] = collections.defaultdict(list)
  for r in records:
    by_cat[r["score"].get("category") or "unknown"].append(r)
  from pipelines.suite.items import CATEGORIES
  out = {}
  for category in [c for c in CATEGORIES if c in by_cat]:
    recs = by_cat[category]
    acc = category_accuracy(category, recs, vote)
    completion = [int((r.get("tokens") or {}).get("completion", 0)) for r in recs]
    prompt = [int((r.get("tokens") or {}).get("prompt", 0)) for r in recs]
    out[category] = {
        "headline": HEADLINE[category], "accuracy": acc.get(HEADLINE[category]), "metrics": acc,
        "examples": len(group_by_example(recs)), "samples": len(recs),
        "tokens": {"prompt": sum(prompt), "completion": sum(completion),
                   "completion_per_sample": _r(sum(completion) / len(recs), 2),
                   "prompt_per_sample": _r(sum(prompt) / len(recs), 1)},
        **latency_profile(recs)}
    if category == "code" and (cap := pass_at_k_cap(pass_counts(group_by_example(recs)))):
      out[category]["pass_at_k_capped"] = cap
    if category == "math" and vote:  # (the other categories: means over samples)
      out[category]["majority_vote"] = True
    errors = len(recs) - len(scored_samples(recs))
    if errors:  # programs the sandbox could not judge (left out of the category's metrics)
      out[category]["sandbox_errors"] = errors
  return out
