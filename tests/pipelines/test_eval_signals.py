"""Killing the launcher stops its Beam worker processes with it, and the store stays valid."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _children(pid: int) -> dict[int, int]:
  """pid -> parent pid of every descendant of `pid` (from /proc)."""
  parents = {}
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
      except OSError:
        continue
      parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
  out, frontier = {}, [pid]
  while frontier:
    p = frontier.pop()
    for child, parent in parents.items():
      if parent == p and child not in out:
        out[child] = parent
        frontier.append(child)
  return out


def _alive(pid: int) -> bool:
  try:
    state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
  except OSError:
    return False
  return state not in ("Z", "X")  # a zombie has stopped; only its parent's wait is missing


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_killing_the_launcher_stops_its_workers(tmp_path, sig):
  out = tmp_path / "run"
  store = out / "store"
  # Each batch of one sleeps 2 s in the fake predictor: a worker is always mid-batch.
  cmd = [sys.executable, "-m", "pipelines.eval", "--config=configs/gsm8k.py:smoke=True,policy=sample_n",
         "--config.model.predictor=fake", "--config.model.fake_delay_s=2.0", "--config.dataset.n=8",
         "--config.policy.n=2", "--config.runner.batch_size=1", "--config.runner.direct_num_workers=2",
         "--config.runner.direct_running_mode=multi_processing", "--config.runner.progress=False",
         f"--output_dir={out}"]
  tmp = tmp_path / "tmp"  # the temp directory of the launcher and its workers
  tmp.mkdir()
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env={**os.environ, "TMPDIR": str(tmp)},
                          start_new_session=True)  # the test kills only the launcher, not its group
  workers = []
  try:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(store.glob("*.json"))) < 2:
      assert proc.poll() is None, "the run ended before it could be killed"
      time.sleep(0.05)
    workers = [p for p in _children(proc.pid) if "sdk_worker_main" in _cmdline(p)]
    assert len(workers) >= 2, _children(proc.pid)
    killed = time.monotonic()
    os.kill(proc.pid, sig)
    # The workers were sleeping in a 2 s batch; before they watched the launcher they noticed
    # its death through their gRPC channel about 1 s later (SIGINT: the launcher took 1 s to exit).
    while time.monotonic() < killed + 0.5 and any(_alive(p) for p in workers):
      time.sleep(0.02)
    assert not [p for p in workers if _alive(p)]
    assert proc.wait(timeout=1) == (-sig if sig == signal.SIGKILL else 128 + sig)
  finally:
    for p in workers + list(_children(proc.pid)):
      try:
        os.kill(p, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if proc.poll() is None:
      proc.kill()
  files = list(store.glob("*.json"))
  assert files and all(isinstance(json.loads(f.read_text()), dict) for f in files)
  assert not (out / "results.jsonl").exists()
  if sig != signal.SIGKILL:  # Beam's shared-model files go with a stopped run (they were left)
    assert not list(tmp.glob("o1jax-*")), list(tmp.iterdir())


def _cmdline(pid: int) -> str:
  try:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
  except OSError:
    return ""


def test_ctrl_c_while_the_launcher_starts_is_one_line(tmp_path):
  # The launcher's imports take ~1.5 s; a Ctrl-C there printed a KeyboardInterrupt
  # traceback (the one-line handler came with `main`).
  proc = subprocess.Popen([sys.executable, "-m", "pipelines.eval", f"--output_dir={tmp_path}"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  time.sleep(0.5)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in err, err
  assert err.strip().splitlines()[-1].startswith("stopped by SIGINT")


def _worker_with_launcher(value, seconds=20):
  """A process that imports the worker plugin (as a Beam worker does) under this launcher
  mark, then sleeps."""
  return subprocess.Popen([sys.executable, "-c", "import pipelines.beam.worker, time; "
                           f"time.sleep({seconds})"], cwd=REPO,
                          env={**os.environ, "O1JAX_EVAL_LAUNCHER_PID": value},
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _start_time(pid):
  with open(f"/proc/{pid}/stat", "rb") as f:
    return f.read().rsplit(b")", 1)[1].split()[19].decode()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_a_worker_whose_launcher_is_gone_or_not_its_parent_follows_it():
  # Before: the watch needed the launcher as the worker's parent or grandparent; a launcher
  # killed during start-up left its workers (their `sh -c` re-parented) computing ~1 min.
  launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    mark = f"{launcher.pid}:{_start_time(launcher.pid)}"
    follower = _worker_with_launcher(mark)  # the launcher is alive, and not its parent
    time.sleep(3)
    assert follower.poll() is None
    launcher.kill()
    assert follower.wait(timeout=5) == -signal.SIGKILL
  finally:
    launcher.kill()
    launcher.wait()
  # gone: the same mark now names no process; reused: the pid alive with another start time
  gone = _worker_with_launcher(mark)
  assert gone.wait(timeout=30) == -signal.SIGKILL
  reused = _worker_with_launcher(f"{os.getpid()}:1", seconds=1)
  assert reused.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_a_stopping_launcher_kills_its_workers_that_are_still_starting():
  # A worker still starting waits up to 60 s for Beam's log channel before it imports the
  # watch: stopped then, the workers lived on for 45-90 s. The launcher now kills every
  # process that carries its mark; a process of another launcher, or none, is left.
  script = """
import os, subprocess, sys, time
from pipelines.beam import worker
worker.mark_launcher()
ours = [subprocess.Popen(["/bin/sh", "-c", "sleep 60"]) for _ in range(2)]
other = subprocess.Popen(["sleep", "60"], env={**os.environ, worker.LAUNCHER_PID_ENV: "1:1"})
time.sleep(0.5)
print(worker.stop_workers(), flush=True)
print([p.wait(timeout=10) for p in ours], other.poll(), flush=True)
other.kill()
"""
  out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
  assert out.returncode == 0, out.stderr
  killed, waited = out.stdout.splitlines()
  assert int(killed) >= 2  # each `sh -c` (and its sleep where sh forks one)
  assert waited == f"[{-signal.SIGKILL}, {-signal.SIGKILL}] None"
