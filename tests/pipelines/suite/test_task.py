"""The suite through the Beam pipeline with the fake predictor: records, per-category summary,
report, token budgets, policies a category rejects, and a scorer that raises on one item."""

import json

import pytest

from configs import suite as suite_config
from pipelines import eval as eval_main
from pipelines.beam import build_plan, plan_items
from pipelines.suite import summarization
from pipelines.suite.task import ScoringError


def fake_config(cache_dir, arg="smoke=True"):
  cfg = suite_config.get_config(arg)
  cfg.model.predictor = "fake"
  cfg.dataset.cache_dir = str(cache_dir)
  cfg.runner.direct_running_mode = "in_memory"
  cfg.runner.direct_num_workers = 1
  return cfg


def test_smoke_run_scores_every_category_and_reports_the_table(suite_cache_dir, tmp_path, monkeypatch):
  real_score = summarization.score

  def score_or_raise(example, text, stop=()):
    if example.id == "suite/summarization/1":
      raise RuntimeError("injected scorer failure")
    return real_score(example, text, stop)

  monkeypatch.setattr(summarization, "score", score_or_raise)  # in_memory: same process
  out = tmp_path / "run"
  summary = eval_main.run(fake_config(suite_cache_dir), str(out), progress=False)
  # 15 items; the one whose scorer raised is a dead letter, the run went on.
  assert summary["samples"] == 14 and summary["dead_letters"]["by_stage"] == {"scoring": 1}
  dead = [json.loads(line) for line in (out / "dead_letters.jsonl").read_text().splitlines()]
  assert dead[0]["example_id"] == "suite/summarization/1"
  assert "RuntimeError: injected scorer failure" in dead[0]["reason"]
  cats = summary["categories"]
  assert list(cats) == ["code", "math", "qa", "instructions", "summarization"]
  assert [cats[c]["samples"] for c in cats] == [3, 3, 3, 3, 2]
  # FakePredictor answers with the reference: canonical code passes (3 in 4 samples, by its
  # hash rule), a QA reference is an exact match, a reference summary recalls every fact.
  records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
  by_id = {r["example_id"]: r for r in records}
  for ex_id, r in by_id.items():
    if "/qa/" in ex_id or "/summarization/" in ex_id:
      assert r["correct"] == (r["output"] == r["reference"])
  assert cats["summarization"]["metrics"]["key_fact_recall"] == pytest.approx(
      sum(by_id[f"suite/summarization/{i}"]["score"]["key_fact_recall"] for i in (0, 2)) / 2)
  assert summary["accuracy"] == {c: v["accuracy"] for c, v in cats.items()}
  for c in cats.values():
    assert set(c["per_token_ms"]) >= {"p50", "p90", "p95", "cv", "histogram"}
    assert set(c["ttft_ms"]) == {"p50", "p95", "count"}
  assert summary["data"]["items"] == {c: 3 for c in cats} and len(summary["data"]["content_sha256"]) == 64
  assert summary["latency_stability"]["per_token_cv"] is not None
  report = (out / "report.md").read_text()
  assert "## Suite: per category" in report and summary["data"]["items_sha256"] in report
  # (the mean of the samples' `correct` is not a headline: a summary is correct with all 5 facts)
  assert "| per-sample `correct` (mean over categories' samples) |" in report
  assert (out / "suite_latency_heatmap.png").stat().st_size > 0


def test_each_category_has_its_own_token_budget_and_prompt_shape(suite_cache_dir, tmp_path):
  cfg = fake_config(suite_cache_dir)
  cfg.sampling.max_new_tokens = 40  # caps the per-category budgets
  items, _ = plan_items(build_plan(cfg, str(tmp_path)))
  budget = {i.example["metadata"]["category"]: i.sampling.max_new_tokens for i in items}
  expected = {c: min(40, b) for c, b in suite_config.SMOKE_MAX_NEW_TOKENS.items()}
  assert budget == expected
  shapes = {i.example["metadata"]["category"]: type(i.prompt).__name__ for i in items}
  assert shapes == {"code": "list", "math": "list", "qa": "list", "instructions": "list",
                    "summarization": "list"}  # code: the chat style by default
  cfg.prompt.code_style = "completion"
  items, _ = plan_items(build_plan(cfg, str(tmp_path)))
  assert {type(i.prompt).__name__ for i in items if i.example["metadata"]["category"] == "code"} == {
      "str"}
  cfg.prompt.code_style = "diff"
  with pytest.raises(ValueError, match="prompt.code_style='diff'"):
    build_plan(cfg, str(tmp_path))


def test_controller_policies_only_with_category_math(suite_cache_dir, tmp_path):
  with pytest.raises(ValueError, match=r"policy 'self_consistency' is a reasoning-controller policy.*"
                                       r"\['code', 'qa', 'instructions', 'summarization'\] reject it"):
    build_plan(fake_config(suite_cache_dir, "smoke=True,policy=self_consistency"), str(tmp_path))
  plan = build_plan(fake_config(suite_cache_dir, "smoke=True,category=math,policy=self_consistency"),
                    str(tmp_path))
  assert plan.predictor.name == "fake" and len(plan_items(plan)[0]) == 3
  plan = build_plan(fake_config(suite_cache_dir, "smoke=True,category=qa,policy=sample_n"), str(tmp_path))
  assert len(plan_items(plan)[0]) == 3 * plan.policy.num_samples
  # A controller policy's token budgets are its own: the math category's budget, which it
  # never reads, is not in its samples' keys (a change of it recomputed every sample).
  keys = []
  for budget in (64, 16):
    cfg = fake_config(suite_cache_dir, "smoke=True,category=math,policy=self_consistency")
    cfg.dataset.max_new_tokens.math = budget
    keys.append([i.key for i in plan_items(build_plan(cfg, str(tmp_path)))[0]])
  assert keys[0] == keys[1]
  cfg = fake_config(suite_cache_dir, "smoke=True,category=math,policy=sample_n")
  keys.append([i.key for i in plan_items(build_plan(cfg, str(tmp_path)))[0]])
  cfg.dataset.max_new_tokens.math = 16  # (plain sampling reads it: other keys)
  assert not set(keys[2]) & {i.key for i in plan_items(build_plan(cfg, str(tmp_path)))[0]}


@pytest.mark.parametrize("key, value, message", [
    # Each ran before: the style ignored, n capped at 200 (the summary said 100000), a
    # negative budget named as sampling's would be.
    ("prompt.style", "fewshot", r"^prompt\.style='fewshot': the suite renders each category's "
                                r"own prompt \(per_category\)"),
    ("dataset.n", 100000, r"^dataset\.n=100000: the suite holds 200 items per category "
                          r"\(0 = all of them\)$"),
    ("dataset.max_new_tokens.qa", -5, r"^dataset\.max_new_tokens\.qa=-5: expected an int >= 1"),
])
def test_suite_settings_it_would_drop_or_clamp_are_named(suite_cache_dir, tmp_path, key,
                                                         value, message):
  cfg = fake_config(suite_cache_dir, "smoke=True,category=qa")
  section, _, name = key.partition(".")
  target = cfg[section]
  while "." in name:
    part, _, name = name.partition(".")
    target = target[part]
  target[name] = value
  with pytest.raises(ValueError, match=message):
    build_plan(cfg, str(tmp_path))


def test_budgets_that_sampling_caps_are_a_warning(suite_cache_dir, tmp_path):
  cfg = fake_config(suite_cache_dir, "smoke=True,category=qa")
  plan = build_plan(cfg, str(tmp_path))
  assert plan.task.warnings(plan.sampling) == []
  cfg.dataset.max_new_tokens.qa = 500
  cfg.sampling.max_new_tokens = 5
  plan = build_plan(cfg, str(tmp_path))
  assert plan.task.warnings(plan.sampling) == [
      "sampling.max_new_tokens=5 caps the per-category budgets (dataset.max_new_tokens) of qa 500"]
  assert {i.sampling.max_new_tokens for i in plan_items(plan)[0]} == {5}


def test_a_variant_given_twice_is_refused():
  # Before: the last one won without a word ("category=math,category=qa" ran qa only).
  with pytest.raises(ValueError, match=r"^config variant 'category' is given twice: it takes "
                                       r"one value$"):
    suite_config.get_config("category=math,category=qa")
  with pytest.raises(ValueError, match=r"^config variant 'qa': .* \(a variant takes one value\)$"):
    suite_config.get_config("category=math,qa")


def test_unknown_category_variant_lists_the_valid_ones():
  with pytest.raises(ValueError, match=r"unknown suite category 'poetry'.*code, math, qa"):
    suite_config.get_config("category=poetry")


def test_score_batch_returns_the_error_in_the_failing_items_place(suite_cache_dir, tmp_path, monkeypatch):
  plan = build_plan(fake_config(suite_cache_dir, "smoke=True,category=qa"), str(tmp_path))
  examples = list(plan.task.load())
  monkeypatch.setattr("pipelines.suite.multihop_qa.score",
                      lambda ex, text, stop=(): 1 / 0 if ex.id.endswith("/1") else {"answer": text, "correct": True})
  scores = plan.task.score_batch([(ex, "x", ()) for ex in examples])
  assert isinstance(scores[1], ScoringError) and "ZeroDivisionError" in str(scores[1])
  assert scores[0]["category"] == "qa" and scores[2]["correct"]


def test_cli_unknown_category_is_one_line_naming_it_and_the_valid_ones():
  import pathlib
  import subprocess
  import sys
  repo = pathlib.Path(__file__).resolve().parents[3]
  out = subprocess.run([sys.executable, "-m", "pipelines.eval", "--config=configs/suite.py:category=poetry"],
                       cwd=repo, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2 and out.stdout == ""
  assert out.stderr.strip().splitlines() == [
      "error: unknown suite category 'poetry': valid categories are code, math, qa, instructions, "
      "summarization (or all)"]
