"""Content-addressed result store: one JSON file per finished sample, written atomically.

  store = ResultStore("runs/sc8/store")
  store.get(key)            # the record dict, or None when not finished (or not a record of key)
  store.read(key)           # (record, None), (None, None) when absent, (None, why) when damaged
  store.put(key, record)    # visible all at once, or not at all; WriteError names the file
  store.check_writable()    # raises OutputError now rather than after the samples are computed

Why it makes runs resumable: 1. every work item's key is a content hash of (model,
generation config, example, sample index); 2. a sample counts as finished only
once its file exists, and a file only ever appears complete (local: write a
temporary file, then rename; object stores: an upload is published whole); 3. a
rerun skips keys whose file exists, so a kill -9 at any point loses at most the
samples in flight, and writing the same key twice yields the same single file. A file
that is not a record of its key (truncated by a crash outside put, emptied, a directory,
another key's record) counts as not finished: `read` says why, and the sample is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import uuid
from typing import Optional

_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_SUFFIX = ".json"


class OutputError(ValueError):
  """The output directory (or its store) cannot be written: found before any work starts."""


class WriteError(OutputError):
  """A store record or a result file could not be written once work started (disk full,
  quota, a directory in the way): the run stops with this one line; every record stored
  before it stays valid, so a rerun resumes from there."""


def os_reason(e: BaseException) -> str:
  """`No space left on device`, or `TypeName: message` for what is not an OSError."""
  return e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"


def is_local(path: str) -> bool:
  return not _SCHEME_RE.match(path) or path.startswith("file://")


def _local(path: str) -> str:
  return path[len("file://"):] if path.startswith("file://") else path


def write_whole(path: str, data: bytes, what: str = "") -> None:
  """Writes a whole file: a local one appears atomically (temp file + rename: readers see
  the old state or the whole file). Raises `WriteError` ("cannot write {what}{path}:
  reason"; disk full, a directory in the way, an object store's error) and leaves no
  temporary file."""
  tmp = None
  try:
    if is_local(path):
      final = _local(path)
      # (as the OS resolves it: abspath's lexical ".." made a stray "link/../" directory)
      os.makedirs(os.path.dirname(final) or ".", exist_ok=True)
      tmp = f"{final}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
      with open(tmp, "wb") as f:
        f.write(data)
      os.replace(tmp, final)
      return
    from apache_beam.io.filesystems import FileSystems
    with FileSystems.create(path) as f:
      f.write(data)
  except Exception as e:  # OSError locally (ENOSPC, EDQUOT, EISDIR...); object stores: their own
    if tmp is not None:
      try:
        os.remove(tmp)
      except OSError:
        pass
    raise WriteError(f"cannot write {what}{path}: {os_reason(e)}") from e


def utf8(text: str) -> bytes:
  """UTF-8 that never raises. A lone surrogate (a command-line byte that is not UTF-8,
  or a JSON "\\ud800" escape) cannot be encoded; it is written as the escape `\\udXXX`,
  which inside a JSON string reads back as the same text (elsewhere: a visible escape)."""
  return text.encode("utf-8", "backslashreplace")


def check_writable(directory: str) -> None:
  """Creates `directory` and writes, renames and deletes a probe file in it, the way the
  store and the result files are written; raises `OutputError` naming it if that fails."""
  probe = f"{directory.rstrip('/')}/.o1jax-write-check.{os.getpid()}.{uuid.uuid4().hex[:8]}"
  try:
    if is_local(directory):
      if os.path.exists(_local(directory)) and not os.path.isdir(_local(directory)):
        raise OutputError(f"output directory is not writable: {directory} (a file is in the way)")
      os.makedirs(_local(directory), exist_ok=True)
      with open(_local(probe) + ".tmp", "wb") as f:
        f.write(b"{}\n")
      os.replace(_local(probe) + ".tmp", _local(probe))
      os.remove(_local(probe))
      return
    from apache_beam.io.filesystems import FileSystems
    with FileSystems.create(probe) as f:
      f.write(b"{}\n")
    FileSystems.delete([probe])
  except OutputError:
    raise
  except Exception as e:  # OSError locally; object stores raise their own types
    raise OutputError(f"output directory is not writable: {directory} ({os_reason(e)})") from e


# `ResultStore.read`'s problem for a record path taken by a directory: the launcher
# refuses the run (the sample could be computed but never stored).
IS_A_DIRECTORY = "is a directory"
NOT_A_FILE = "is not a regular file (a FIFO, a socket or a device)"
# What `write_whole` appends to a local file's name while it writes: NAME.PID.XXXXXXXX.tmp.
TEMPORARY_SUFFIX = r"\.\d+\.[0-9a-f]{8}\.tmp"
_TEMPORARY = re.compile(r"[0-9a-f]{16,64}\.json" + TEMPORARY_SUFFIX)


# Each stored record carries the sha256 of its content: a record still valid JSON after an
# edit or a flipped bit (a changed output, `correct` flipped) was resumed as it was, and the
# summary then disagreed with itself.
CHECKSUM_FIELD = "record_sha256"


def strict_json(value, named: bool = False):
  """`value` with NaN and +-inf floats as None: records are strict JSON (Python writes
  NaN / Infinity, which jq, JavaScript and most JSON readers refuse); a value that is
  not finite is no measurement. named: as the strings "nan", "inf", "-inf" instead, for
  what a config holds (budget.window_s=inf is said, not dropped)."""
  if isinstance(value, float):
    return value if math.isfinite(value) else (repr(value) if named else None)
  if isinstance(value, dict):
    return {k: strict_json(v, named) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict_json(v, named) for v in value]
  return value


def record_digest(record: dict) -> str:
  """sha256 of the record's canonical JSON (sorted keys, ASCII escapes: any text hashes)."""
  return hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


class ResultStore:
  """Records keyed by content hash under `root` (a local directory, gs://, s3://, ...)."""

  def __init__(self, root: str):
    self.root = root.rstrip("/")
    self.local = is_local(root)

  def path(self, key: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{16,64}", key):
      raise ValueError(f"store keys are hex digests, got {key!r}")
    return f"{self.root}/{key}{_SUFFIX}"

  def get(self, key: str) -> Optional[dict]:
    return self.read(key)[0]

  def read(self, key: str) -> tuple[Optional[dict], Optional[str]]:
    """(record, None); (None, None) when no file; (None, why) when the file is not a
    record of `key` (`why` completes "store record PATH ...")."""
    path = self.path(key)
    try:
      if self.local:
        # (non-blocking: a FIFO in its place hung the launcher's scan; one to /dev/zero
        # would read forever)
        fd = os.open(_local(path), os.O_RDONLY | os.O_NONBLOCK)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
          os.close(fd)
          return None, IS_A_DIRECTORY if stat.S_ISDIR(mode) else NOT_A_FILE
        with open(fd, "rb") as f:
          data = f.read()
      else:
        from apache_beam.io.filesystems import FileSystems
        if not FileSystems.exists(path):
          return None, None
        with FileSystems.open(path) as f:
          data = f.read()
    except FileNotFoundError:
      return None, None
    except IsADirectoryError:
      return None, IS_A_DIRECTORY
    except OSError as e:
      return None, f"cannot be read ({os_reason(e)})"
    if not data.strip(b" \t\r\n\0"):
      return None, "is empty" if not data else "holds no JSON (blank or NUL bytes)"
    try:
      record = json.loads(data)
    except ValueError:
      return None, "is not valid JSON (truncated or damaged)"
    if not isinstance(record, dict):
      return None, f"holds a JSON {type(record).__name__}, not a record"
    if record.get("key") != key:
      return None, f"holds the record of another key ({str(record.get('key'))[:16]!r})"
    if record.pop(CHECKSUM_FIELD, None) != record_digest(record):
      return None, "does not match its checksum (edited or damaged)"
    return record, None

  def check_writable(self) -> None:
    """Raises `OutputError` unless a record could be stored now (checked before any work)."""
    check_writable(self.root)

  def put(self, key: str, record: dict) -> None:
    """Writes the record whole; raises `WriteError` naming the file (no partial file is
    left: the temporary file is removed)."""
    # The digest of the record as it will read back (JSON makes int keys strings).
    plain = json.loads(json.dumps(strict_json(record), ensure_ascii=False, allow_nan=False))
    data = utf8(json.dumps({**plain, CHECKSUM_FIELD: record_digest(plain)},
                           ensure_ascii=False, sort_keys=False, allow_nan=False) + "\n")
    write_whole(self.path(key), data, "store record ")

  def remove_temporary_files(self) -> int:
    """Removes the temporary files of record writes that never finished (`write_whole`'s
    KEY.json.PID.XXXXXXXX.tmp: a worker killed mid-write); call it only while this run
    holds the output directory and no worker runs. Returns how many (local stores)."""
    if not self.local:
      return 0
    removed = 0
    try:
      entries = list(os.scandir(_local(self.root)))
    except FileNotFoundError:
      return 0
    for e in entries:
      if _TEMPORARY.fullmatch(e.name) and e.is_file(follow_symlinks=False):
        try:
          os.remove(e.path)
          removed += 1
        except OSError:
          pass
    return removed

  def count(self) -> int:
    """Finished records (local stores only; for the progress bar)."""
    try:
      return sum(1 for e in os.scandir(_local(self.root)) if e.name.endswith(_SUFFIX))
    except FileNotFoundError:
      return 0

  def keys(self) -> Optional[set[str]]:
    """Keys of the stored records (files by name; `read` checks one): a local directory's
    entries, or a remote store's one listing (Beam's FileSystems.match: a call, not a
    request per key); None where a remote store cannot be listed (the listing failed, or
    its path holds a glob character the pattern would misread): ask `read` per key."""
    if not self.local:
      from apache_beam.io.filesystems import FileSystems
      if re.search(r"[*?\[\]{}]", self.root):
        return None
      try:
        matched = FileSystems.match([f"{self.root}/*{_SUFFIX}"])[0].metadata_list
      except Exception:  # (BeamIOError: no access, no such file system, ...)
        return None
      names = (m.path.rstrip("/").rsplit("/", 1)[-1] for m in matched)
      return {n[:-len(_SUFFIX)] for n in names if n.endswith(_SUFFIX)}
    try:
      return {e.name[:-len(_SUFFIX)] for e in os.scandir(_local(self.root)) if e.name.endswith(_SUFFIX)}
    except FileNotFoundError:
      return set()
