"""HumanEval through the pipeline's scoring stage: all canonical solutions pass, wrong ones fail."""

import json

import pytest

from configs import humaneval as humaneval_config
from pipelines.beam import build_plan, plan_items
from pipelines.beam.testing import FakeClock, reference_loader
from pipelines.datasets import Example
from pipelines.eval import run


def test_all_164_canonical_solutions_pass_through_the_pipeline(tmp_path):
  cfg = humaneval_config.get_config()
  cfg.runner.update(direct_num_workers=1, direct_running_mode="in_memory", batch_size=16)
  cfg.sandbox.timeout_s = 10.0  # a loaded shared machine must not turn a pass into a timeout
  summary = run(cfg, str(tmp_path), clock=FakeClock(), loader=reference_loader, progress=False, report=False)
  records = [json.loads(l) for l in (tmp_path / "results.jsonl").read_text().splitlines()]
  failed = [(r["example_id"], r["score"]["status"], r["score"]["detail"]) for r in records if not r["correct"]]
  assert len(records) == 164 and not failed, failed
  assert summary["pass_at_k"] == {"1": 1.0}
  assert summary["dead_letters"]["total"] == 0


def test_wrong_and_truncated_completions_fail_and_pass_at_k_covers_every_k(tmp_path):
  cfg = humaneval_config.get_config("policy=sample_n")
  cfg.dataset.n = 1
  cfg.prompt.style = "completion"  # the model's text as is, cut at the Codex stop sequences
  plan = build_plan(cfg, str(tmp_path))
  example = Example.from_dict(plan_items(plan)[0][0].example)
  canonical = example.metadata["canonical_solution"]
  stop = plan.task.prompt(example)[1]
  # The text after a stop sequence ("\ndef ...") is cut before execution, so the
  # third completion passes even though the model kept writing.
  scores = plan.task.score_batch([(example, "    return None\n", stop), (example, "    raise ValueError\n", stop),
                                  (example, canonical + "\ndef extra():\n  syntax error here", stop)])
  assert [s["correct"] for s in scores] == [False, False, True]
  assert scores[0]["status"] == "failed"
  from pipelines.summary import summarize
  recs = [{"example_id": example.id, "example_index": 0, "sample_index": i, "correct": s["correct"], "score": s,
           "policy": "sample_n", "tokens": {}, "finish_reason": "stop", "reference": None}
          for i, s in enumerate(scores)]
  summary = summarize(recs, task="humaneval")
  # pass@k with n=3, c=1: 1 - C(2,k)/C(3,k) -> k=1: 1/3, k=2: 2/3, k=3: 1.
  assert summary["pass_at_k"] == {"1": pytest.approx(1 / 3, abs=1e-4), "2": pytest.approx(2 / 3, abs=1e-4),
                                  "3": 1.0}


def test_a_lone_surrogate_fails_its_own_completion_and_no_other(tmp_path):
  cfg = humaneval_config.get_config()
  cfg.dataset.n = 1
  plan = build_plan(cfg, str(tmp_path))
  example = Example.from_dict(plan_items(plan)[0][0].example)
  canonical = example.metadata["canonical_solution"]
  stop = plan.task.prompt(example)[1]
  scores = plan.task.score_batch([(example, canonical, stop),
                                  (example, canonical + "    # \ud800\n", stop),
                                  (example, "    x = '\udcff'\n" + canonical, stop)] + [(example, canonical, stop)])
  assert [s["correct"] for s in scores] == [True, False, False, True]
  assert [s["status"] for s in scores[1:3]] == ["failed", "failed"]
  assert "surrogate" in scores[1]["detail"]
