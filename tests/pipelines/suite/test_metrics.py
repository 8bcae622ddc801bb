"""Per-category metrics computed by hand from made-up records."""

import pytest

from pipelines.suite.metrics import category_accuracy, category_summaries
from pipelines.suite.report import category_table


def record(cat, ex, sample=0, correct=True, metrics=None, token_ms=None, ttft=None, **score):
  timing = {"latency_ms": 100.0, "start_ms": 0.0, "end_ms": 100.0}
  if token_ms is not None:
    timing.update(token_ms=token_ms, ttft_ms=ttft)
  return {"example_id": f"{cat}/{ex}", "example_index": ex, "sample_index": sample, "correct": correct,
          "reference": "7", "tokens": {"prompt": 10, "completion": len(token_ms or [1])},
          "score": {"category": cat, "metrics": metrics or {}, **score}, "timing": timing}


def test_instruction_level_accuracy_counts_instructions_not_prompts():
  recs = [record("instructions", 0, metrics={"prompt_strict": 1.0, "prompt_loose": 1.0, "instructions_strict": 1,
                                             "instructions_loose": 1, "instructions_total": 1}),
          record("instructions", 1, metrics={"prompt_strict": 0.0, "prompt_loose": 1.0, "instructions_strict": 1,
                                             "instructions_loose": 3, "instructions_total": 3})]
  # Prompt level: 1 of 2 strict, 2 of 2 loose; instruction level: 2 of 4 strict, 4 of 4 loose.
  assert category_accuracy("instructions", recs) == {"prompt_strict": 0.5, "prompt_loose": 1.0,
                                                     "instruction_strict": 0.5, "instruction_loose": 1.0}


def test_code_pass_at_k_and_math_majority_vote():
  # Problem 0: 1 of 2 samples pass; problem 1: 0 of 2. pass@1 = (1/2 + 0) / 2, pass@2 = (1 + 0) / 2.
  code = [record("code", 0, 0, True), record("code", 0, 1, False), record("code", 1, 0, False),
          record("code", 1, 1, False)]
  assert category_accuracy("code", code) == {"pass@1": 0.25, "pass@2": 0.5}
  math = [record("math", 0, i, strict_answer=a, flexible_answer=a) for i, a in enumerate(("7", "7", "8"))]
  assert category_accuracy("math", math, vote=True) == {"strict": 1.0, "flexible": 1.0}


def test_code_leaves_sandbox_errors_out_and_math_votes_only_numbers():
  # Problem 0: pass, sandbox error, fail -> n=2, c=1; problem 1: only a sandbox error -> left out.
  code = [record("code", 0, 0, True), record("code", 0, 1, False, sandbox_error=True), record("code", 0, 2, False),
          record("code", 1, 0, False, sandbox_error=True)]
  assert category_accuracy("code", code) == {"pass@1": 0.5, "pass@2": 1.0}
  # Two samples end in "..." (no digit): no vote; the one number wins.
  math = [record("math", 0, i, strict_answer=None, flexible_answer=a) for i, a in enumerate(("...", "...", "7"))]
  assert category_accuracy("math", math, vote=True) == {"strict": 0.0, "flexible": 1.0}


def test_latency_profile_percentiles_and_coefficient_of_variation():
  # Per-token times 10, 20, 30, 40 ms: mean 25, population std sqrt(125) = 11.18, CV 0.4472.
  # (the times after each first token; a first value equal to the TTFT would read as a
  # record written before 2026-12-07, whose token_ms began with it)
  recs = [record("qa", 0, token_ms=[20.0, 10.0], ttft=10.0, metrics={"exact_match": 1.0, "f1": 1.0}),
          record("qa", 1, token_ms=[40.0, 30.0], ttft=30.0, metrics={"exact_match": 0.0, "f1": 0.5})]
  qa = category_summaries(recs)["qa"]
  assert qa["accuracy"] == 0.5 and qa["metrics"] == {"exact_match": 0.5, "f1": 0.75}
  p = qa["per_token_ms"]
  assert (p["p50"], p["mean"], p["cv"], p["source"]) == (25.0, 25.0, pytest.approx(0.4472, abs=1e-4), "tokens")
  assert p["histogram"]["10-50"] == 4 and qa["ttft_ms"] == {"p50": 20.0, "p95": 29.0, "count": 2}
  table = category_table({"qa": qa})
  assert "| qa | exact_match 0.500 | f1 0.750 | 2 |" in table


def test_the_suite_says_where_code_pass_at_k_is_capped_and_that_math_voted():
  # Item 0 kept 2 scored samples, item 1 one (a sandbox error): pass@k stops at k = 1.
  code = [record("code", 0, 0, True), record("code", 0, 1, False), record("code", 1, 0, False),
          record("code", 1, 1, False, sandbox_error=True)]
  math = [record("math", 0, i, strict_answer=a, flexible_answer=a) for i, a in enumerate(("7", "7", "8"))]
  cats = category_summaries(code + math, vote=True)
  assert cats["code"]["pass_at_k_capped"] == {"k_max": 1, "samples_most": 2, "examples_with_fewer": 1}
  assert cats["math"]["majority_vote"] and "majority_vote" not in category_summaries(math)["math"]
  table = category_table(cats)
  assert "| math | strict (majority vote) 1.000 |" in table
