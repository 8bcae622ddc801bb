"""Dataclasses built from config dicts, naming the keys they do not have."""

from __future__ import annotations

import dataclasses


def from_dict(cls, values, what: str):
  """cls(**values); an unknown key raises ValueError "{what} {keys}; known: [...]"."""
  values = dict(values or {})
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(f"{what} {unknown}; known: {sorted(known)}")
  return cls(**values)
