"""Line-oriented JSONL reading through Beam's file systems, never raising per line.

`apache_beam.io.filesystems.FileSystems.open` is used so local paths, ``gs://``
and ``s3://`` (where their extras are installed) all work, with compression
detected from the extension. Beam is imported lazily: without it, plain local
paths still work, which keeps these modules usable in tests and small tools.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import re
from typing import Any, Callable, IO, Iterator, Optional, Union

from pipelines.datasets.records import DeadLetter, Example, RecordError

_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


@contextlib.contextmanager
def open_binary(path: str) -> Iterator[IO[bytes]]:
  """Open `path` for binary reading via Beam FileSystems (auto compression)."""
  try:
    from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
  except ImportError:
    FileSystems = None  # pylint: disable=invalid-name
  if FileSystems is not None:
    f = FileSystems.open(path)
  elif _SCHEME_RE.match(path) and not path.startswith("file://"):
    raise RuntimeError(f"reading {path!r} needs apache-beam with the scheme's extra")
  else:
    local = path[len("file://"):] if path.startswith("file://") else path
    f = gzip.open(local, "rb") if local.endswith(".gz") else open(local, "rb")
  try:
    yield f
  finally:
    f.close()


def _read_lines(f: IO[bytes]) -> Iterator[bytes]:
  # Beam's CompressedFile has readline() but is not iterable.
  while True:
    line = f.readline()
    if not line:
      return
    yield line


@dataclasses.dataclass(frozen=True)
class JsonLine:
  """A successfully decoded JSON object plus where it came from."""
  source: str
  line_number: int
  raw: str
  obj: dict[str, Any]


def iter_json_lines(path: str) -> Iterator[Union[JsonLine, DeadLetter]]:
  """Yield each non-blank line of a JSONL file as `JsonLine` or `DeadLetter`.

  Bad UTF-8, invalid JSON and non-object values become dead letters carrying
  the 1-based line number; blank lines are skipped silently.
  """
  with open_binary(path) as f:
    for line_number, raw_bytes in enumerate(_read_lines(f), start=1):
      raw = raw_bytes.decode("utf-8", errors="replace").rstrip("\r\n")
      if not raw.strip():
        continue
      try:
        text = raw_bytes.decode("utf-8")
      except UnicodeDecodeError as e:
        yield DeadLetter(path, line_number, f"invalid UTF-8: {e}", raw)
        continue
      try:
        obj = json.loads(text)
      except json.JSONDecodeError as e:
        yield DeadLetter(path, line_number, f"invalid JSON: {e.msg}", raw)
        continue
      if not isinstance(obj, dict):
        yield DeadLetter(path, line_number,
                         f"expected a JSON object, got {type(obj).__name__}", raw)
        continue
      yield JsonLine(path, line_number, raw, obj)


def load_jsonl(
    path: str,
    parse: Callable[[JsonLine], Example],
) -> Iterator[Union[Example, DeadLetter]]:
  """Run `parse` over every decoded line; its `RecordError`s become dead letters."""
  for item in iter_json_lines(path):
    if isinstance(item, DeadLetter):
      yield item
      continue
    try:
      yield parse(item)
    except RecordError as e:
      yield DeadLetter(item.source, item.line_number, str(e), item.raw)


def require_str(obj: dict[str, Any], key: str, *, what: Optional[str] = None) -> str:
  """Fetch a required non-empty string field or raise `RecordError`.

  `key` may be dotted (``meta.question``) to reach into nested objects.
  """
  cur: Any = obj
  label = f"{what!r} (source field {key!r})" if what and what != key else repr(key)
  for part in key.split("."):
    if not isinstance(cur, dict) or part not in cur:
      raise RecordError(f"missing field {label}")
    cur = cur[part]
  if isinstance(cur, bool) or not isinstance(cur, (str, int, float)):
    raise RecordError(f"field {label} must be a string, got {type(cur).__name__}")
  s = str(cur)
  if not s.strip():
    raise RecordError(f"field {label} is empty")
  return s
