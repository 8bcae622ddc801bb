"""The suite's items: generated once per (version, seed) into a versioned JSONL cache.

  items, info = load_or_create(cache_dir="", seed=0)    # all 5 x 200 items + hashes
  select(items, category="all", per_category=3)          # the smoke subset

File: `<cache dir>/suite-v<VERSION>-seed<SEED>.jsonl` (cache dir: `dataset.cache_dir`, else
$O1JAX_SUITE_CACHE, else ~/.cache/o1jax/suite). Line 1 is a header
{"suite_version", "seed", "items_per_category", "categories", "content_sha256"}; every
other line is one `Example` as canonical JSON (sorted keys, compact). `content_sha256` is
the sha256 of those item lines joined by newlines, so two runs that report the same hash
scored the same items. Every generator draws from its own `random.Random(text seed)`
(string seeds hash the same in every process, whatever PYTHONHASHSEED), so the file is
byte-identical on every machine. A file that does not read back exactly (bad JSON, a
header of another version or seed, a hash that does not match its items) is an error
naming the file; deleting it regenerates it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import uuid
from typing import Sequence

from pipelines.datasets.records import DatasetError, Example, text_bytes
from pipelines.suite import (code_generation, instructions, math_reasoning, multihop_qa,
                             summarization)

# Bump when any generator's output changes. 2: distinct instruction prompts; no QA
# question names its own answer.
SUITE_VERSION = 2
ITEMS_PER_CATEGORY = 200
CATEGORY_MODULES = {m.CATEGORY: m for m in (code_generation, math_reasoning, multihop_qa,
                                             instructions, summarization)}
CATEGORIES: tuple[str, ...] = tuple(CATEGORY_MODULES)


class SuiteCacheError(DatasetError):
  """The suite's cache file cannot be used as it is (one line, naming the file)."""


def check_category(category: str) -> str:
  if category != "all" and category not in CATEGORY_MODULES:
    raise ValueError(f"unknown suite category {category!r}: valid categories are "
                     f"{', '.join(CATEGORIES)} (or all)")
  return category


def default_cache_dir() -> pathlib.Path:
  env = os.environ.get("O1JAX_SUITE_CACHE")
  return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "o1jax" / "suite"


def cache_path(cache_dir: str | os.PathLike = "", seed: int = 0) -> pathlib.Path:
  # "~" as a shell would read it (a quoted flag value made a directory named "~" here)
  directory = pathlib.Path(cache_dir).expanduser() if str(cache_dir) else default_cache_dir()
  return directory / f"suite-v{SUITE_VERSION}-seed{seed}.jsonl"


def _line(example: Example) -> str:
  return json.dumps(example.to_dict(), sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def sha256_lines(lines: Sequence[str]) -> str:
  return hashlib.sha256(text_bytes("\n".join(lines))).hexdigest()


def generate_items(seed: int = 0, per_category: int = ITEMS_PER_CATEGORY) -> list[Example]:
  """Every category's items, categories in CATEGORIES order; a pure function of its args."""
  return [ex for module in CATEGORY_MODULES.values() for ex in module.generate(per_category, seed)]


def _header(seed: int, digest: str) -> dict:
  return {"suite_version": SUITE_VERSION, "seed": seed, "items_per_category": ITEMS_PER_CATEGORY,
          "categories": list(CATEGORIES), "content_sha256": digest}


def write_cache(path: pathlib.Path, items: Sequence[Example], seed: int) -> str:
  """Writes the file atomically (temp file + rename: concurrent writers leave one whole file)."""
  lines = [_line(ex) for ex in items]
  digest = sha256_lines(lines)
  tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text("\n".join([json.dumps(_header(seed, digest), sort_keys=True)] + lines) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)
  except OSError as e:  # the cache directory is a file, not writable, on a full disk, ...
    with contextlib.suppress(OSError):
      tmp.unlink(missing_ok=True)
    where = f"{e.filename}: " if e.filename and str(e.filename) != str(tmp) else ""
    why = e.strerror or e
    blocking = next((p for p in reversed(path.parents) if p.is_file()), None)
    if blocking is not None:  # (mkdir says "File exists" or "Not a directory")
      where, why = "", f"{blocking} is a file, not a directory"
    raise SuiteCacheError(f"cannot write the suite cache {path}: {where}{why} (set "
                          f"dataset.cache_dir to a writable directory)") from e
  return digest


def read_cache(path: pathlib.Path, seed: int) -> tuple[list[Example], str]:
  """The cached items and their hash; SuiteCacheError when the file is not what we wrote."""
  def bad(why: str) -> SuiteCacheError:
    return SuiteCacheError(f"suite cache {path} is malformed ({why}); delete it to regenerate it")
  try:
    raw = path.read_bytes().decode("utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise bad(f"cannot be read: {e}") from e
  if not raw.strip():
    raise bad("empty file")
  lines = raw.split("\n")
  if lines[-1] == "":
    lines.pop()
  try:
    header = json.loads(lines[0])
  except ValueError as e:
    raise bad(f"line 1: invalid JSON header: {e}") from e
  expected = {k: v for k, v in _header(seed, "").items() if k != "content_sha256"}
  if not isinstance(header, dict):
    raise bad("line 1: the header is not a JSON object")
  differ = [k for k, v in expected.items() if header.get(k) != v]
  if differ:
    raise bad(f"line 1: header fields {differ} are not those of suite version {SUITE_VERSION}, seed {seed}")
  items = []
  for number, line in enumerate(lines[1:], start=2):
    try:
      items.append(Example.from_dict(json.loads(line)))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise bad(f"line {number}: not an item: {type(e).__name__}: {e}") from e
  digest = sha256_lines(lines[1:])
  if digest != header.get("content_sha256"):
    raise bad(f"content sha256 {digest[:12]}... does not match the header's "
              f"{str(header.get('content_sha256'))[:12]}...")
  counts = {c: sum(ex.metadata.get("category") == c for ex in items) for c in CATEGORIES}
  if any(n != ITEMS_PER_CATEGORY for n in counts.values()):
    raise bad(f"items per category {counts}, expected {ITEMS_PER_CATEGORY} each")
  return items, digest


def load_or_create(cache_dir: str | os.PathLike = "", seed: int = 0) -> tuple[list[Example], dict]:
  """All items (written to the cache first if absent) and {file, content_sha256}."""
  path = cache_path(cache_dir, seed)
  if path.exists():
    items, digest = read_cache(path, seed)
  else:
    items = generate_items(seed)
    digest = write_cache(path, items, seed)
  return items, {"suite_version": SUITE_VERSION, "seed": seed, "cache_file": path.name,
                 "content_sha256": digest}


def select(items: Sequence[Example], category: str = "all", per_category: int = 0) -> list[Example]:
  """The first `per_category` items (0 = all) of one category or of every category."""
  check_category(category)
  wanted = CATEGORIES if category == "all" else (category,)
  out = []
  for c in wanted:
    of_c = [ex for ex in items if ex.metadata.get("category") == c]
    out += of_c[:per_category] if per_category else of_c
  return out


def items_sha256(items: Sequence[Example]) -> str:
  """Hash of a selection (the items a run scores), same canonical lines as the cache."""
  return sha256_lines([_line(ex) for ex in items])
