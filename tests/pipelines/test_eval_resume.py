"""Resumability: SIGKILL a real `python -m pipelines.eval` run mid-way, rerun, compare."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from configs import gsm8k as gsm8k_config
from pipelines.eval import run
from pipelines.beam.testing import FakeClock

REPO = pathlib.Path(__file__).resolve().parents[2]
N = 24


def _command(out):
  return [sys.executable, "-m", "pipelines.eval", "--config=configs/gsm8k.py:smoke=True,policy=sample_n",
          "--config.model.predictor=fake", "--config.model.fake_delay_s=0.25", f"--config.dataset.n={N // 2}",
          "--config.policy.n=2", "--config.runner.batch_size=2", "--config.runner.direct_running_mode=in_memory",
          "--config.runner.direct_num_workers=1", "--config.runner.progress=False", f"--output_dir={out}"]


def _records(path):
  return [json.loads(l) for l in pathlib.Path(path).read_text().splitlines()]


def _without_timing(records):
  return [json.dumps({k: v for k, v in r.items() if k != "timing"}) for r in records]


def test_kill_9_then_rerun_finishes_without_recomputing(tmp_path):
  out = tmp_path / "killed"
  store = out / "store"
  proc = subprocess.Popen(_command(out), cwd=REPO, start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline and len(list(store.glob("*.json"))) < 4:
    assert proc.poll() is None, "the run ended before it could be killed"
    time.sleep(0.05)
  os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, like a lost machine
  proc.wait()
  before = {p.name: p.stat().st_mtime_ns for p in store.glob("*.json")}
  assert 4 <= len(before) < N, len(before)
  assert not (out / "summary.json").exists()

  rerun = subprocess.run(_command(out), cwd=REPO, capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  # Nothing finished was recomputed: the stored files are untouched.
  assert {n: (store / n).stat().st_mtime_ns for n in before} == before
  summary = json.loads((out / "summary.json").read_text())
  assert summary["run"]["resumed"] == len(before)
  assert summary["run"]["computed"] == N - len(before)
  records = _records(out / "results.jsonl")
  assert len(records) == N
  assert len({(r["example_id"], r["sample_index"]) for r in records}) == N

  # Same records and metrics as an uninterrupted run.
  cfg = gsm8k_config.get_config("smoke=True,policy=sample_n")
  cfg.model.predictor = "fake"
  cfg.dataset.n = N // 2
  cfg.policy.n = 2
  cfg.runner.direct_running_mode = "in_memory"
  cfg.runner.direct_num_workers = 1
  clean = run(cfg, str(tmp_path / "clean"), clock=FakeClock(), progress=False, report=False)
  assert _without_timing(records) == _without_timing(_records(tmp_path / "clean" / "results.jsonl"))
  for key in ("examples", "samples", "accuracy", "sample_accuracy", "tokens"):
    assert summary[key] == clean[key], key
  assert (out / "report.md").exists()
