"""`--config.imports=tests.pipelines.full_store_disk` for CLI tests: in the job's worker
processes, every store record write fails as on a full disk (ENOSPC). With the run's log
made a link to /dev/full, the log's writes fail too: the disk that is full holds both."""

import builtins
import os

from pipelines.beam.worker import LAUNCHER_PID_ENV

_real_open = builtins.open


class _FullFile:

  def __init__(self, f):
    self._f = f

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._f.close()

  def write(self, data):
    raise OSError(28, "No space left on device")


def _open(path, mode="r", *args, **kwargs):
  f = _real_open(path, mode, *args, **kwargs)
  if isinstance(path, str) and "/store/" in path and path.endswith(".tmp") and "w" in mode:
    return _FullFile(f)
  return f


launcher = os.environ.get(LAUNCHER_PID_ENV, "").partition(":")[0]
if launcher and launcher != str(os.getpid()):  # a worker process (the launcher probes the store)
  builtins.open = _open
