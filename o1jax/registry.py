"""Named implementations a config picks by name: policies, verifiers, scorers, tasks.

  POLICIES = Registry("policy");  POLICIES["deepconf"] = DeepConf

A name holds one implementation. Registering another one under a taken name is refused:
the modules a config imports are not part of a sample's content key (its policy's,
task's and verifiers' names and settings are), so a module that replaced the built-in
"gsm8k" task or "mean_logprob" scorer with its own resumed the original's stored verdicts
as its own. The same implementation again (a module imported twice, an example re-run
in a notebook) is the same name.
"""

from __future__ import annotations

from typing import Any


def _origin(value: Any) -> str:
  """Where an implementation is defined: module and qualified name."""
  return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


class Registry(dict):
  """name -> implementation; a taken name keeps its implementation (see the module)."""

  def __init__(self, kind: str):
    super().__init__()
    self.kind = kind

  def __setitem__(self, name: str, value: Any) -> None:
    held = self.get(name)
    if held is not None and _origin(held) != _origin(value):
      raise ValueError(f"{self.kind} name {name!r} is taken by {_origin(held)}: register "
                       f"{_origin(value)} under a name of its own (stored results of the one "
                       f"would be read as the other's)")
    super().__setitem__(name, value)

  def update(self, *args, **kwargs) -> None:
    for name, value in dict(*args, **kwargs).items():
      self[name] = value

  def setdefault(self, name: str, value: Any = None) -> Any:
    if name not in self:
      self[name] = value
    return self[name]
