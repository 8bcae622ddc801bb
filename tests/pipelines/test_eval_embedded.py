"""End to end with the real embedded model: the CLI, the report, resume on rerun."""

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_embedded_model_cli_end_to_end_and_rerun_resumes(tmp_path):
  out = tmp_path / "run"
  cmd = [sys.executable, "-m", "pipelines.eval", "--config=configs/gsm8k.py:smoke=True",
         "--config.dataset.n=4", "--config.sampling.max_new_tokens=24", "--config.runner.batch_size=4",
         "--config.runner.direct_running_mode=in_memory", "--config.runner.direct_num_workers=1",
         f"--output_dir={out}"]
  first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "eval:" in first.stderr  # the progress bar
  summary = json.loads((out / "summary.json").read_text())
  assert summary["samples"] == 4 and summary["dead_letters"]["total"] == 0
  assert summary["model"]["file"].endswith(".gguf")
  records = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
  assert all(r["output"] and r["tokens"]["completion"] > 0 for r in records)
  assert summary["latency_ms"]["p50"] > 0 and summary["throughput"]["completion_tokens_per_s"] > 0
  for f in ("report.md", "latency_histogram.png", "latency_heatmap.png"):
    assert (out / f).stat().st_size > 0

  again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  rerun = json.loads((out / "summary.json").read_text())
  assert rerun["run"]["resumed"] == 4 and rerun["run"]["computed"] == 0
  assert rerun["accuracy"] == summary["accuracy"]
  assert (out / "results.jsonl").read_text().splitlines() == [json.dumps(r) for r in records]
