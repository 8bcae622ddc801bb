"""Worker processes end with their launcher, and outlive a log that cannot be written:
imported by every DirectRunner worker at start-up.

  launcher: mark_launcher()   # before pipeline.run(); its pid goes into the workers' environment
            stop_workers()    # as it stops on a signal: the workers still starting go too
  workers:  --beam_plugins=pipelines.beam.worker (options.py adds it) imports this module first

Why: the DirectRunner starts each worker through `/bin/sh -c`, so when the launcher is
killed (SIGTERM, SIGKILL, or Ctrl-C on it alone) a worker notices only when its gRPC
channel breaks, about a second later, computing meanwhile; and a parent-death signal set
in the worker would watch the shell, which outlives the launcher. Here a daemon thread
waits on a pidfd of the launcher (an fd that becomes readable when that process exits)
and kills its own process at once. The store stays consistent: a record file appears
whole (temp file + rename) or not at all.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from typing import Optional

LAUNCHER_PID_ENV = "O1JAX_EVAL_LAUNCHER_PID"


def mark_launcher() -> None:
  """This process launches the job: worker processes started from now on watch it. The
  value is "pid:start time" (the start time tells the launcher from a later process of the
  same pid); "pid" alone where /proc is not there."""
  pid = os.getpid()
  started = _start_time(pid)
  os.environ[LAUNCHER_PID_ENV] = f"{pid}:{started}" if started is not None else str(pid)


def stop_workers() -> int:
  """In the launcher as it stops: SIGKILL every process started with this launcher's mark
  (its workers, and the `sh -c` around each); returns how many. A worker still starting
  imports this module only after Beam's log handler connects to the launcher, which waits
  up to 60 s: stopped then, its workers lived on for 45-90 s. None where /proc is not
  there (the workers' own watch is all there is)."""
  mark = os.environ.get(LAUNCHER_PID_ENV, "")
  if mark.partition(":")[0] != str(os.getpid()) or not os.path.isdir("/proc"):
    return 0
  entry = f"{LAUNCHER_PID_ENV}={mark}".encode()
  killed = 0
  for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) == os.getpid():
      continue
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        marked = entry in f.read().split(b"\0")
      if marked:
        os.kill(int(name), signal.SIGKILL)
        killed += 1
    except OSError:  # gone meanwhile, or not ours to read
      continue
  return killed


def _stat_fields(pid: int) -> Optional[list[bytes]]:
  """/proc/PID/stat's fields after the command name (field 3 on), or None."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rsplit(b")", 1)[1].split()
  except (OSError, IndexError):
    return None


def _parent(pid: int) -> Optional[int]:
  fields = _stat_fields(pid)
  try:
    return int(fields[1]) if fields else None
  except (ValueError, IndexError):
    return None


def _start_time(pid: int) -> Optional[str]:
  """The process's start time in clock ticks since boot (stat field 22), or None."""
  fields = _stat_fields(pid)
  return fields[19].decode() if fields and len(fields) > 19 else None


def _started_by(pid: int) -> bool:
  """Whether `pid` is this process's parent or the shell's parent (Beam's `sh -c`)."""
  parent = os.getppid()
  return pid in (parent, _parent(parent))


def _wait_for_exit(pid: int) -> None:
  try:
    fd = os.pidfd_open(pid)  # Linux >= 5.3
  except (AttributeError, OSError):
    fd = None
  if fd is not None:
    select.select([fd], [], [])
    return
  while True:  # no pidfd: poll
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return
    except PermissionError:
      pass
    time.sleep(0.05)


def watch_launcher() -> bool:
  """In a worker process started by a marked launcher: kill this process when the launcher
  exits. Returns whether a watch started (not in the launcher itself, not elsewhere)."""
  value = os.environ.get(LAUNCHER_PID_ENV, "")
  pid_text, _, started = value.partition(":")
  try:
    pid = int(pid_text)
  except ValueError:
    return False
  if pid == os.getpid():  # in-process runners run here in the launcher
    return False
  if started and os.path.isdir("/proc"):
    # The launcher by its start time, wherever this process sits in the tree (Beam's `sh -c`
    # is re-parented when the launcher dies first; the parent check then let a worker of a
    # launcher killed during start-up compute on for a minute): gone, or a later process
    # under its pid, means this worker has nobody to work for.
    if _start_time(pid) != started:
      os.kill(os.getpid(), signal.SIGKILL)
  elif not _started_by(pid):  # (no start time: a process the launcher did not start is left)
    return False

  def watch():
    _wait_for_exit(pid)
    os.kill(os.getpid(), signal.SIGKILL)

  threading.Thread(target=watch, name="o1jax-launcher-watch", daemon=True).start()
  return True


class LossyStderr:
  """sys.stderr whose writes a full disk cannot fail: fd 2 is the run's log file
  (OUTPUT_DIR/eval.log), and Beam's worker harness prints a failed bundle's traceback to
  sys.stderr before it answers the runner. On a full disk that print raised, the answer
  (the store's "No space left on device" line) never left, and the DirectRunner waited for
  it forever. A write the file refuses is dropped here (the error itself still reaches the
  launcher through the runner); everything the disk can hold is written as before, to the
  same fd."""

  def __init__(self, stream):
    self._stream = stream

  def write(self, text):
    try:
      return self._stream.write(text)
    except OSError:
      return len(text)

  def writelines(self, lines):
    for line in lines:
      self.write(line)

  def flush(self):
    try:
      self._stream.flush()
    except OSError:
      pass

  def __getattr__(self, name):  # fileno, encoding, isatty, buffer ... of the real stream
    return getattr(self._stream, name)


def tolerate_a_full_log() -> None:
  """Put `LossyStderr` over this process's sys.stderr (once)."""
  if sys.stderr is not None and not isinstance(sys.stderr, LossyStderr):
    sys.stderr = LossyStderr(sys.stderr)


if watch_launcher():  # (a worker process of a local run)
  tolerate_a_full_log()
