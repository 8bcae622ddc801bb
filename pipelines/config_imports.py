"""The modules a config names in `imports`: a researcher's own policies, verifiers, scorers, tasks.

  python -m pipelines.eval --config=configs/gsm8k.py:policy=my_vote --config.imports=mypkg.policies

Importing such a module runs its `@register` / `register_verifier` / `register_scorer`
calls (a task: `pipelines.task_specs.TASKS[name] = cls`), so the names it defines are
valid wherever a name is looked up.
It is imported:
  1. by the launcher, before the config file is read (`imports_in_argv`: a variant such
     as `policy=my_vote` is checked against the registry) and again from the final config
     (`run`), so a bad module name is one `error:` line before any work starts;
  2. by every Beam worker process at start-up (`--beam_plugins`, `options.beam_args`);
  3. where a predictor is built (`predictors.build_predictor`), which with a model shared
     across processes may be a process of its own.
"""

from __future__ import annotations

import ast
import importlib
from typing import Iterable, Sequence

FLAG = "--config.imports="


class ConfigImportError(ValueError):
  """A module named in `imports` cannot be imported (the message names it)."""


def module_names(imports: Iterable[str] | str) -> tuple[str, ...]:
  """("a", "b,c") or "a,b" -> ("a", "b", "c"): entries may hold comma-separated names."""
  entries = (imports,) if isinstance(imports, str) else tuple(imports)
  return tuple(name.strip() for entry in entries for name in str(entry).split(",") if name.strip())


def import_modules(imports: Iterable[str] | str) -> tuple[str, ...]:
  """Imports every named module (once; Python caches them); returns the names.

  Raises ConfigImportError naming the first module that fails, whatever it raised."""
  names = module_names(imports)
  for name in names:
    try:
      importlib.import_module(name)
    except (Exception, SystemExit) as e:  # ModuleNotFoundError, or whatever the module raises
      # (SystemExit too: a module that calls sys.exit() ended the launcher without a word)
      raise ConfigImportError(f"cannot import module {name!r} named in config.imports: "
                              f"{type(e).__name__}: {e}") from e
  return names


def imports_in_argv(argv: Sequence[str]) -> tuple[str, ...]:
  """The module names of the last `--config.imports=...` before `--`, parsed as
  ml_collections parses a tuple field (`a`, `a,b`, `('a', 'b')`)."""
  value = None
  for arg in argv:
    if arg == "--":
      break
    if arg.startswith(FLAG):
      value = arg[len(FLAG):]
  if value is None:
    return ()
  try:
    parsed = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    parsed = value  # a bare module name
  return module_names(parsed if isinstance(parsed, (str, tuple, list)) else str(parsed))
