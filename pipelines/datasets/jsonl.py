"""Dataset files read through Beam's file systems, never raising per record.

`apache_beam.io.filesystems.FileSystems.open` is used so local paths, ``gs://``
and ``s3://`` (where their extras are installed) all work, with compression
detected from the extension. Beam is imported lazily: without it, plain local
paths still work, which keeps these modules usable in tests and small tools.

Formats (`dataset_format`): JSON Lines (the default), a JSON array of objects (a
file whose first character is ``[``), Parquet (what the Hugging Face Hub serves:
``PAR1`` magic) and CSV/TSV (by the ``.csv`` / ``.tsv`` extension, a header row
naming the fields). Every record is numbered like a line (a Parquet row or array
element by its 1-based position; a CSV row by the line it starts on), so dead
letters, duplicates and line-based ids work the same in each.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import csv
import datetime
import decimal
import io
import dataclasses
import glob
import gzip
import hashlib
import json
import lzma
import math
import os
import pathlib
import re
import zlib
from typing import Any, Callable, IO, Iterator, Optional, Union

import numpy as np

from pipelines.datasets.records import (DatasetError, DeadLetter, Duplicate, Example, RecordError,
                                        lone_surrogate)

_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_GZIP_MAGIC = b"\x1f\x8b"
_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def _magic(local: str) -> bytes:
  """The first two bytes of a local regular file (b"" when it cannot be read: the open
  that follows says why)."""
  try:
    with open(local, "rb") as f:
      return f.read(2)
  except OSError:
    return b""


@contextlib.contextmanager
def open_binary(path: str) -> Iterator[IO[bytes]]:
  """Open `path` for binary reading via Beam FileSystems (auto compression; a local .gz
  through `gzip`, which notices a truncated archive).

  A file that is missing or cannot be opened raises `DatasetError` naming it (one line
  for the user, not an OSError traceback).
  """
  try:
    from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
  except ImportError:
    FileSystems = None  # pylint: disable=invalid-name
  local = None if _SCHEME_RE.match(path) and not path.startswith("file://") else path.removeprefix("file://")
  if local is not None and os.path.isdir(local):  # (a sharded dataset's folder, often)
    suffixes = {os.path.splitext(f.name)[1] for f in os.scandir(local) if f.is_file()}
    suffix = suffixes.pop() if len(suffixes) == 1 else ".parquet"
    raise DatasetError(f"dataset path is a directory: {path} (name a file, or its files with "
                       f"a pattern: {local.rstrip('/')}/*{suffix})")
  try:
    if local is not None and os.path.exists(local) and not os.path.isdir(local) \
        and not os.path.isfile(local):
      # A FIFO or device: opening it waits for a writer (a hang), and the job reads the
      # dataset twice (the launcher's scan, then the workers), which a pipe cannot give.
      raise DatasetError(f"dataset file is not a regular file: {path} (a pipe or device; the "
                         f"dataset is read more than once: write it to a file)")
    if local is not None and (local.endswith(".gz") or _magic(local) == _GZIP_MAGIC):
      # gzip raises EOFError on a truncated archive, where Beam's reader stops quietly at the
      # cut (the rest of the dataset would be missing without a word). gzip data under another
      # name (data.jsonl) is read too, not turned into a dead letter per line of bad UTF-8.
      f = gzip.open(local, "rb")
    elif FileSystems is not None:
      where = path if local is None else local  # (Beam knows no "file" scheme)
      if not FileSystems.exists(where):  # object stores raise assorted errors for a missing key
        raise FileNotFoundError(path)
      ext = next((e for e in _DECOMPRESSORS if path.lower().endswith(e)), None)
      if ext is None:
        f = FileSystems.open(where)
      else:  # (Beam's readers stop quietly where a cut archive ends, gzip's too)
        from apache_beam.io.filesystem import CompressionTypes  # pylint: disable=g-import-not-at-top
        f = io.BufferedReader(_Decompressed(
            FileSystems.open(where, compression_type=CompressionTypes.UNCOMPRESSED), ext),
            1 << 16)
    elif _SCHEME_RE.match(path) and not path.startswith("file://"):
      raise RuntimeError(f"reading {path!r} needs apache-beam with the scheme's extra")
    else:
      f = open(local, "rb")
  except FileNotFoundError as e:
    raise DatasetError(f"dataset file not found: {path}") from e
  except OSError as e:
    raise DatasetError(f"cannot read dataset file {path}: {e.strerror or e}") from e
  try:
    yield f
  finally:
    f.close()


def _zstd():
  import zstandard  # pylint: disable=g-import-not-at-top  (Beam's dependency)
  return zstandard.ZstdDecompressor(max_window_size=1 << 31).decompressobj()


# Compression by extension (Beam's table), each a decompressor with `eof` and `unused_data`.
_DECOMPRESSORS: dict[str, Callable[[], Any]] = {
    ".gz": lambda: zlib.decompressobj(16 + zlib.MAX_WBITS), ".bz2": lambda: bz2.BZ2Decompressor(),
    ".deflate": zlib.decompressobj, ".zst": _zstd, ".zstd": _zstd,
    ".xz": lambda: lzma.LZMADecompressor(), ".lzma": lambda: lzma.LZMADecompressor()}


class _Decompressed(io.RawIOBase):
  """The decompressed bytes of a raw stream, stream after stream (gzip members, bz2 and xz
  streams, zstd frames may follow each other); `EOFError` where the file ends inside one
  (Beam's reader stopped there without a word: a cut .bz2 or .xz dataset lost its tail),
  OSError for data that is not of the format."""

  def __init__(self, raw: IO[bytes], ext: str):
    super().__init__()
    self._raw, self._ext, self._make = raw, ext, _DECOMPRESSORS[ext]
    self._decompressor, self._fed = self._make(), False
    self._pending, self._at = b"", 0  # decompressed, not yet read from `_at` on

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    while self._at == len(self._pending):
      self._pending, self._at = b"", 0
      if self._decompressor.eof:  # the next stream, if any, starts in what is left
        rest = self._decompressor.unused_data
        self._decompressor, self._fed = self._make(), False
      else:
        rest = b""
      chunk = rest or self._raw.read(1 << 13)
      if not chunk:
        if self._fed:
          raise EOFError("the compressed file ends inside a stream (a cut or partial copy?)")
        return 0
      if not self._fed and self._ext == ".xz":
        chunk = chunk.lstrip(b"\0")  # (xz's stream padding, between and after streams)
        if not chunk:
          continue
      try:
        self._pending = self._decompressor.decompress(chunk)
      except Exception as e:  # zlib.error, lzma.LZMAError, zstandard.ZstdError, OSError
        raise OSError(f"not {self._ext.lstrip('.')} data ({e})") from e
      self._fed = not self._decompressor.eof
    n = min(len(buffer), len(self._pending) - self._at)
    buffer[:n] = memoryview(self._pending)[self._at:self._at + n]
    self._at += n
    return n

  def close(self) -> None:
    self._raw.close()
    super().close()


def _read_lines(f: IO[bytes], path: str) -> Iterator[bytes]:
  """The file's lines; a file that cannot be read to its end (not gzip data behind a .gz
  name, a truncated archive, an I/O error) raises `DatasetError` naming it and the line."""
  # Beam's CompressedFile has readline() but is not iterable.
  line_number = 0
  while True:
    try:
      line = f.readline()
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
      where = f" after line {line_number}" if line_number else ""
      raise DatasetError(f"cannot read dataset file {path}{where}: {e}") from e
    if not line:
      return
    line_number += 1
    yield line


def _read_all(f: IO[bytes], path: str) -> bytes:
  """The whole file, with `_read_lines`' errors (a whole-file format: JSON array, Parquet,
  CSV)."""
  try:
    return f.read()
  except (OSError, EOFError, zlib.error) as e:
    raise DatasetError(f"cannot read dataset file {path}: {e}") from e


@dataclasses.dataclass(frozen=True)
class JsonLine:
  """A successfully decoded JSON object plus where it came from. offset: the records of
  the files before this one, when a pattern names several (`dataset_files`)."""
  source: str
  line_number: int
  raw: str
  obj: dict[str, Any]
  offset: int = 0
  header_lines: int = 0  # lines before the first record (CSV/TSV: the header row)

  @property
  def index(self) -> int:
    """0-based position in the whole dataset (line-based ids: shards in name order number
    their records as one file holding them in that order would; a CSV's first row is 0,
    its header not counted)."""
    return self.offset + self.line_number - 1 - self.header_lines


def iter_json_lines(path: str) -> Iterator[Union[JsonLine, DeadLetter]]:
  """Yield each non-blank line of a JSONL file as `JsonLine` or `DeadLetter`.

  Bad UTF-8, invalid JSON, non-object values and strings that are not text (a
  "\\ud800" escape: a lone surrogate) become dead letters carrying the 1-based line
  number; blank lines are skipped silently. Returns the number of lines (blank ones
  at the end too: the next shard's lines are numbered after them, as in one file).
  """
  lines = 0
  with open_binary(path) as f:
    for line_number, raw_bytes in enumerate(_read_lines(f, path), start=1):
      lines = line_number
      if line_number == 1 and raw_bytes.startswith(codecs.BOM_UTF8):  # as some editors save
        raw_bytes = raw_bytes[len(codecs.BOM_UTF8):]
      if line_number == 1 and raw_bytes.startswith(_UTF16_BOMS):  # every line would be bad UTF-8
        raise DatasetError(f"dataset file is UTF-16, not UTF-8: {path} (convert it, e.g. "
                           f"iconv -f UTF-16 -t UTF-8)")
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
        # (e.msg alone ended mid-phrase: "Unterminated string starting at")
        yield DeadLetter(path, line_number,
                         f"invalid JSON: {e.msg.removesuffix(' at')} at column {e.colno}", raw)
        continue
      except RecursionError:  # valid JSON nested deeper than the decoder's recursion limit
        yield DeadLetter(path, line_number, "invalid JSON: nested too deeply", raw)
        continue
      except ValueError as e:  # an integer longer than Python converts (4300 digits)
        yield DeadLetter(path, line_number, f"invalid JSON: {e}", raw)
        continue
      if not isinstance(obj, dict):
        yield DeadLetter(path, line_number,
                         f"expected a JSON object, got {type(obj).__name__}", raw)
        continue
      bad = lone_surrogate(obj) if "\\u" in text else None  # only a \uXXXX escape makes one
      if bad:
        where = f"field {bad[0]!r}" if bad[0] else "a top-level key"
        yield DeadLetter(path, line_number, f"invalid JSON: lone surrogate {bad[1]!r} in {where}", raw)
        continue
      yield JsonLine(path, line_number, raw, obj)
  return lines


def _counted(records: Iterator, box: list) -> Iterator:
  """`records`, with what its generator returns put in `box` once it ends."""
  box.append((yield from records))


FORMATS = ("jsonl", "json", "parquet", "csv", "tsv")
_PARQUET_MAGIC = b"PAR1"
_SNIFF_BYTES = 1 << 16


def dataset_format(path: str) -> str:
  """The format of a dataset file (one of `FORMATS`): CSV/TSV by extension (before a
  compression suffix), Parquet by its magic bytes, a JSON array by a leading ``[``,
  JSON Lines otherwise. Raises `DatasetError` for a file that cannot be opened."""
  name = re.sub(r"\.(gz|bz2|deflate|zst|lzma|xz)$", "", path.lower())
  for ext in ("csv", "tsv"):
    if name.endswith(f".{ext}"):
      return ext
  with open_binary(path) as f:
    try:
      head = f.read(_SNIFF_BYTES)
    except (OSError, EOFError, zlib.error):  # the line reader names the line it stops at
      head = b""
  if head.startswith(_PARQUET_MAGIC):
    return "parquet"
  if name.endswith(".parquet"):  # (it was read as JSON Lines: a shard's rows, dead letters)
    raise DatasetError(f"cannot read dataset file {path} as Parquet: it does not start with "
                       f"{_PARQUET_MAGIC.decode()}{_not_parquet_hint(head)}")
  if head.removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"["):
    return "json"
  return "jsonl"


def _not_parquet_hint(head: bytes) -> str:
  """What a file named .parquet holds instead, where it is a common mistake."""
  if head.startswith(b"version https://git-lfs"):
    return " (a Git LFS pointer: fetch the file itself, e.g. git lfs pull)"
  if head.removeprefix(codecs.BOM_UTF8).lstrip()[:1] == b"<":
    return " (an HTML or XML page, e.g. a download's error page)"
  return ""


def iter_records(path: str) -> Iterator[Union[JsonLine, DeadLetter]]:
  """Each record of a dataset file in any of `FORMATS`, as `JsonLine` (numbered like
  lines) or `DeadLetter`."""
  fmt = dataset_format(path)
  if fmt == "parquet":
    return _parquet_records(path)
  if fmt == "json":
    return _json_array_records(path)
  if fmt in ("csv", "tsv"):
    return _csv_records(path, "\t" if fmt == "tsv" else ",")
  return iter_json_lines(path)


def _not_text(obj: Any) -> Optional[str]:
  """Why a decoded record is not text, else None: bytes that were not UTF-8 (decoded with
  surrogateescape) or a lone surrogate escape."""
  bad = lone_surrogate(obj)
  if bad is None:
    return None
  where = f"field {bad[0]!r}" if bad[0] else "a key"
  code = ord(bad[1])
  if 0xDC80 <= code <= 0xDCFF:
    return f"invalid UTF-8 (byte 0x{code - 0xDC00:02x}) in {where}"
  return f"invalid JSON: lone surrogate {bad[1]!r} in {where}"


def _record(path: str, number: int, obj: Any) -> Union[JsonLine, DeadLetter]:
  """A decoded record as `JsonLine`, or a `DeadLetter` when it is not an object of text."""
  if not isinstance(obj, dict):
    return DeadLetter(path, number, f"expected a JSON object, got {type(obj).__name__}",
                      json.dumps(obj, default=str))
  problem = _not_text(obj)
  if problem:
    return DeadLetter(path, number, problem, json.dumps(obj, default=str))  # ASCII escapes
  return JsonLine(path, number, json.dumps(obj, ensure_ascii=False, default=str), obj)


def _first_line_closes(text: str) -> bool:
  """Whether the first line holds one whole bracketed value and more lines follow: JSON
  Lines whose first line is an array (one nested too deeply for the decoder too), read
  without recursion: its brackets outside strings close on it."""
  first, _, rest = text.lstrip().partition("\n")
  depth, in_string, escaped = 0, False, False
  for ch in first:
    if in_string:
      escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
    elif ch == '"':
      in_string = True
    elif ch in "[{":
      depth += 1
    elif ch in "]}":
      depth -= 1
      if depth == 0:
        return bool(rest.strip())
  return False


def _json_array_records(path: str) -> Iterator[Union[JsonLine, DeadLetter]]:
  """The elements of a file holding one JSON array. A file that starts with a JSON value
  followed by more (JSON Lines whose first line is an array) is read as JSON Lines."""
  with open_binary(path) as f:
    data = _read_all(f, path)
  # Bytes that are not UTF-8 stay in the text as surrogates: their record is a dead letter.
  text = data.removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="surrogateescape")
  try:
    items = json.loads(text)
  except (json.JSONDecodeError, RecursionError, ValueError) as e:
    if _first_line_closes(text):  # a first value, then more lines (or one nested too deeply)
      yield from iter_json_lines(path)
      return
    why = (f"{e.msg} (line {e.lineno} column {e.colno})" if isinstance(e, json.JSONDecodeError)
           else str(e))
    raise DatasetError(f"dataset file {path} is a JSON array that does not parse: {why}") from None
  if not isinstance(items, list):  # "[" then a parse to something else cannot happen
    raise DatasetError(f"dataset file {path} holds a JSON {type(items).__name__}, not an array")
  for number, obj in enumerate(items, start=1):
    yield _record(path, number, obj)


def _plain(value: Any) -> Any:
  """A Parquet cell as a JSON value: text for bytes (UTF-8) and dates, numbers kept."""
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, bytes):  # (not UTF-8: surrogates, which make the record a dead letter)
    return value.decode("utf-8", errors="surrogateescape")
  if isinstance(value, (datetime.date, datetime.time, datetime.timedelta)):
    return value.isoformat() if hasattr(value, "isoformat") else str(value)
  if isinstance(value, decimal.Decimal):  # (plain decimals: str() wrote 1E-7)
    return format(value, "f")
  return value


def _parquet_records(path: str) -> Iterator[Union[JsonLine, DeadLetter]]:
  """The rows of a Parquet file (pyarrow, which apache-beam installs)."""
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise DatasetError(f"dataset file {path} is Parquet, which needs pyarrow "
                       f"(pip install pyarrow)") from e
  with open_binary(path) as f:
    data = _read_all(f, path)
  try:
    table = pq.read_table(io.BytesIO(data))
  except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
    raise DatasetError(f"cannot read dataset file {path} as Parquet: {e}") from e
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  # float32/float16 columns: each value as its own type's shortest decimal (to_pylist
  # widens 0.1f to 0.10000000149011612, a gold no reply of "0.1" matched)
  narrow = {f.name: np.float32 if f.type == pa.float32() else np.float16
            for f in table.schema if f.type in (pa.float32(), pa.float16())}
  for number, row in enumerate(table.to_pylist(), start=1):
    for name, kind in narrow.items():
      if isinstance(row.get(name), float) and math.isfinite(row[name]):
        row[name] = float(str(kind(row[name])))
    yield _record(path, number, _plain(row))


def _csv_records(path: str, delimiter: str) -> Iterator[Union[JsonLine, DeadLetter]]:
  """The rows of a CSV/TSV file with a header row; every value is a string. A row with
  more or fewer cells than the header, or with a stray quote (read strictly: a lenient
  reader would take the next rows into its cell), is a dead letter."""
  with open_binary(path) as f:
    data = _read_all(f, path)
  if data.startswith(_UTF16_BOMS):
    raise DatasetError(f"dataset file is UTF-16, not UTF-8: {path} (convert it, e.g. "
                       f"iconv -f UTF-16 -t UTF-8)")
  text = data.removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="surrogateescape")
  lines = io.StringIO(text, newline="").readlines()  # as the reader counts them

  def as_written(first: int, last: int) -> str:
    """Lines first..last as the file has them, for a dead letter (cells joined again lose
    their quoting); bytes that are not UTF-8 as \\x escapes."""
    text = "".join(lines[first - 1:last]).rstrip("\r\n")
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
  reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
  try:
    header = next(reader, None)
  except csv.Error as e:
    raise DatasetError(f"cannot read dataset file {path} as CSV: the header row (line "
                       f"{reader.line_num}): {e}") from e
  if header is None:
    return
  header = [h.strip() for h in header]
  if not any(header):
    raise DatasetError(f"dataset file {path} has an empty header row (line 1): the first "
                       f"row names the fields")
  twice = sorted({h for h in header if header.count(h) > 1})
  if twice:
    raise DatasetError(f"dataset file {path}: the header row names {twice[0]!r} twice")
  start = reader.line_num + 1
  while True:
    try:
      cells = next(reader)
    except StopIteration:
      return
    except csv.Error as e:  # the reader goes on at the next line
      yield DeadLetter(path, start, f"not CSV: {e} (a quote that is not closed or doubled)",
                       as_written(start, reader.line_num))
      start = reader.line_num + 1
      continue
    number, start = start, reader.line_num + 1
    if not any(c.strip() for c in cells):
      continue
    raw = delimiter.join(cells).encode("utf-8", "backslashreplace").decode("utf-8")
    if len(cells) != len(header):
      yield DeadLetter(path, number, f"{len(cells)} cells where the header has "
                       f"{len(header)}", as_written(number, reader.line_num))
      continue
    obj = dict(zip(header, cells))
    problem = _not_text(obj)
    if problem:
      yield DeadLetter(path, number, problem, as_written(number, reader.line_num))
      continue
    yield JsonLine(path, number, raw, obj, header_lines=1)


_GLOB_CHARS = re.compile(r"[*?\[]")


def _literal_dirs_escaped(pattern: str, resolve: bool = False) -> str:
  """`pattern` with its longest leading run of directories that exist as written escaped
  for `glob`: only what follows them is a pattern. `resolve`: that run through its links."""
  parts = pathlib.PurePath(pattern).parts
  for i in range(len(parts) - 1, 0, -1):
    head = os.path.join(*parts[:i])
    if os.path.isdir(head):
      return os.path.join(glob.escape(os.path.realpath(head) if resolve else head), *parts[i:])
  return pattern


def dataset_files(path: str) -> list[str]:
  """The files `path` names: itself, or for a pattern (``*``, ``?``, ``[...]``, ``**`` for
  any depth: e.g. the Hub's shards, ``data/test-*.parquet``) the files it matches, sorted
  by name. A pattern
  matching no file raises `DatasetError`; a file whose name holds those characters is
  itself, and so is a directory (``runs[1]/data/*.jsonl``: the pattern is the part after
  the longest directory that exists as written)."""
  local = None if _SCHEME_RE.match(path) and not path.startswith("file://") else path.removeprefix("file://")
  if not _GLOB_CHARS.search(path) or (local is not None and os.path.exists(local)):
    return [path]
  if local is not None:
    files = sorted(f for f in glob.glob(_literal_dirs_escaped(local), recursive=True)
                   if not os.path.isdir(f))
  else:
    try:
      from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
      matched = FileSystems.match([path])[0].metadata_list
    except ImportError as e:
      raise DatasetError(f"reading {path!r} needs apache-beam with the scheme's extra") from e
    except Exception as e:  # object stores raise assorted errors for a bad bucket
      raise DatasetError(f"cannot list dataset files {path}: {e}") from e
    files = sorted(m.path for m in matched)
  if not files:
    raise DatasetError(f"dataset path pattern matches no file: {path}")
  return files


def load_records(
    path: str,
    parse: Callable[[JsonLine], Example],
) -> Iterator[Union[Example, DeadLetter, Duplicate]]:
  """Run `parse` over every record of the file, or of the files a pattern names in name
  order (`dataset_files`; each file any of `FORMATS`: `iter_records`); its `RecordError`s
  become dead letters.

  A line holding the same JSON object as an earlier one (key order and spacing aside)
  becomes a `Duplicate` and is skipped: the first line keeps the example. A different
  line whose example takes an id already taken is a dead letter (results, votes and
  request ids are per example id).
  """
  files = dataset_files(path)
  first_line: dict[bytes, tuple[str, int]] = {}  # sha256 of the canonical object -> its first line
  id_line: dict[str, tuple[str, int]] = {}
  offset = 0  # records of the files before this one
  for source in files:
    header = 1 if dataset_format(source) in ("csv", "tsv") else 0  # its header row
    last, lines = 0, []
    for item in _counted(iter_records(source), lines):
      last = item.line_number - header
      if isinstance(item, DeadLetter):
        yield item
        continue
      item = dataclasses.replace(item, offset=offset)
      where = (item.source, item.line_number)
      digest = hashlib.sha256(json.dumps(item.obj, sort_keys=True).encode()).digest()
      if digest in first_line:
        first_source, first_number = first_line[digest]
        yield Duplicate(item.source, item.line_number, first_number,
                        "" if first_source == item.source else first_source)
        continue
      first_line[digest] = where
      try:
        example = _with_step_limit(parse(item))
      except RecordError as e:
        yield DeadLetter(item.source, item.line_number, str(e), item.raw)
        continue
      taken = id_line.setdefault(example.id, where)
      if taken != where:
        at = f"line {taken[1]}" if taken[0] == item.source else f"{taken[0]} line {taken[1]}"
        yield DeadLetter(item.source, item.line_number,
                         f"example id {example.id!r} is already used by {at}", item.raw)
        continue
      yield example
    offset += max(last, lines[0] or 0)  # (a JSONL file: every line, blank ones at its end too)


def _with_step_limit(example: Example) -> Example:
  """An example's own step limit (`metadata.max_steps`, read by the reasoning controller)
  checked where its line is known: found at inference it took the whole batch to dead
  letters, named with no file or line. An integral float (a Parquet int column with nulls)
  or a CSV cell of digits is that int; null is no limit."""
  steps = (example.metadata or {}).get("max_steps")
  if steps is None:
    return example
  value = steps
  if isinstance(steps, float) and steps.is_integer():
    value = int(steps)
  elif isinstance(steps, str) and re.fullmatch(r"[0-9]+", steps.strip()):  # (not "²": isdigit)
    value = int(steps.strip())
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise RecordError(f"field 'max_steps' (the example's step limit) must be an int >= 1, got "
                      f"{steps!r}")
  return dataclasses.replace(example, metadata={**example.metadata, "max_steps": value})


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
  # A JSON number as written in decimals: Python spells 1e16 and 1e-7 with an exponent,
  # which no answer matcher reads as the number.
  s = format(decimal.Decimal(repr(cur)), "f") if isinstance(cur, float) else str(cur)
  if not s.strip():
    raise RecordError(f"field {label} is empty")
  return s
