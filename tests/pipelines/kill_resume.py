"""Kill a real `python -m pipelines.eval` run mid-way, rerun it, and check the resume: nothing
finished is recomputed, and the records and metrics equal an uninterrupted run's. Shared by
the DirectRunner (test_eval_resume.py) and Dask (test_eval_dask.py) tests."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from configs import gsm8k as gsm8k_config
from pipelines.beam.testing import FakeClock
from pipelines.eval import run

REPO = pathlib.Path(__file__).resolve().parents[2]
N = 24  # samples: N // 2 examples x 2


def command(out, *runner_flags: str) -> list[str]:
  """A fake-model sample_n job slow enough (0.25 s a batch of 2) to be killed mid-way."""
  return [sys.executable, "-m", "pipelines.eval",
          "--config=configs/gsm8k.py:smoke=True,policy=sample_n", "--config.model.predictor=fake",
          "--config.model.fake_delay_s=0.25", f"--config.dataset.n={N // 2}", "--config.policy.n=2",
          "--config.runner.batch_size=2", "--config.runner.progress=False", *runner_flags,
          f"--output_dir={out}"]


def records(path) -> list[dict]:
  return [json.loads(l) for l in pathlib.Path(path).read_text().splitlines()]


def without_timing(recs) -> list[str]:
  return [json.dumps({k: v for k, v in r.items() if k != "timing"}, sort_keys=True) for r in recs]


def start_and_kill(out, cmd, *, whole_group: bool, timeout_s: float = 120) -> dict[str, int]:
  """Starts `cmd`, SIGKILLs it once 4 results are stored, and returns {stored file: mtime}.

  whole_group: kill the launcher's process group (a lost machine); else the launcher
  alone, whose workers must then end by themselves within 15 s."""
  store = pathlib.Path(out) / "store"
  proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and len(list(store.glob("*.json"))) < 4:
    assert proc.poll() is None, "the run ended before it could be killed"
    time.sleep(0.05)
  (os.killpg if whole_group else os.kill)(proc.pid, signal.SIGKILL)
  proc.wait()
  if not whole_group:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
      try:
        os.killpg(proc.pid, 0)  # anyone left in the launcher's process group?
      except ProcessLookupError:
        break
      time.sleep(0.1)
    else:
      os.killpg(proc.pid, signal.SIGKILL)
      raise AssertionError("worker processes outlived the launcher by 15 s")
  before = {p.name: p.stat().st_mtime_ns for p in store.glob("*.json")}
  assert 4 <= len(before) < N, len(before)
  assert not (pathlib.Path(out) / "summary.json").exists()
  return before


def rerun_and_compare(out, cmd, before: dict[str, int], clean_dir) -> dict:
  """Reruns `cmd` to the end; checks nothing stored was recomputed and that records and
  metrics equal an uninterrupted in-memory DirectRunner run's (in `clean_dir`). Returns
  the rerun's summary."""
  out = pathlib.Path(out)
  rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  store = out / "store"
  assert {n: (store / n).stat().st_mtime_ns for n in before} == before  # nothing recomputed
  summary = json.loads((out / "summary.json").read_text())
  assert summary["run"]["resumed"] == len(before)
  assert summary["run"]["computed"] == N - len(before)
  got = records(out / "results.jsonl")
  assert len({(r["example_id"], r["sample_index"]) for r in got}) == len(got) == N
  cfg = gsm8k_config.get_config("smoke=True,policy=sample_n")
  cfg.model.predictor = "fake"
  cfg.dataset.n = N // 2
  cfg.policy.n = 2
  cfg.runner.batch_size = 2
  cfg.runner.direct_running_mode = "in_memory"
  cfg.runner.direct_num_workers = 1
  clean = run(cfg, str(clean_dir), clock=FakeClock(), progress=False, report=False)
  assert without_timing(got) == without_timing(records(pathlib.Path(clean_dir) / "results.jsonl"))
  for key in ("examples", "samples", "accuracy", "sample_accuracy", "tokens"):
    assert summary[key] == clean[key], key
  return summary
