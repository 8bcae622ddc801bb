"""Named implementations a config picks by name: policies, verifiers, scorers, tasks.

  POLICIES = Registry("policy");  POLICIES["deepconf"] = DeepConf

A name holds one implementation. Registering another one under a taken name is refused:
the modules a config imports are not part of a sample's content key (its policy's,
task's and verifiers' names and settings are), so a module that replaced the built-in
"gsm8k" task or "mean_logprob" scorer with its own resumed the original's stored verdicts
as its own. The same implementation loaded again (a module imported twice, a script
run as __main__ that its config also imports, an example re-run in a notebook) keeps the
name.
"""

from __future__ import annotations

import functools
import sys
from typing import Any


def _origin(value: Any) -> str:
  """Where an implementation is defined: module and qualified name (for messages)."""
  return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


def _source(module_name: str) -> str:
  """The file a module was loaded from (a script run as __main__ and imported by its name
  is one file), else its name."""
  module = sys.modules.get(module_name)
  return str(getattr(module, "__file__", None) or module_name)


def _same(a: Any, b: Any) -> bool:
  """Whether two implementations are the same one, loaded again: a class of the same name
  in the same file; a function of the same code and closure values (so two lambdas of one
  factory, `_trace_attr("a")` and `_trace_attr("b")`, differ); a partial of the same
  function and arguments. Anything else by identity."""
  if a is b:
    return True
  if isinstance(a, functools.partial) and isinstance(b, functools.partial):
    return _same(a.func, b.func) and a.args == b.args and a.keywords == b.keywords
  if isinstance(a, type) and isinstance(b, type):
    return (a.__qualname__ == b.__qualname__
            and _source(a.__module__) == _source(b.__module__))
  code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
  if code_a is None or code_b is None:
    return False
  cells = lambda f: tuple(c.cell_contents for c in (f.__closure__ or ()))
  try:
    return (a.__qualname__ == b.__qualname__ and _source(a.__module__) == _source(b.__module__)
            and code_a.co_code == code_b.co_code and code_a.co_consts == code_b.co_consts
            and cells(a) == cells(b))
  except (ValueError, TypeError):  # (an empty cell; values without ==)
    return False


class Registry(dict):
  """name -> implementation; a taken name keeps its implementation (see the module)."""

  def __init__(self, kind: str):
    super().__init__()
    self.kind = kind

  def __setitem__(self, name: str, value: Any) -> None:
    held = self.get(name)
    if held is not None and not _same(held, value):
      raise ValueError(f"{self.kind} name {name!r} is taken by {_origin(held)}: register "
                       f"{_origin(value)} under a name of its own (stored results of the one "
                       f"would be read as the other's)")
    super().__setitem__(name, value)

  def update(self, *args, **kwargs) -> None:
    for name, value in dict(*args, **kwargs).items():
      self[name] = value

  def __ior__(self, other):  # (dict's |= writes past __setitem__)
    self.update(other)
    return self

  def setdefault(self, name: str, value: Any = None) -> Any:
    if name not in self:
      self[name] = value
    return self[name]
