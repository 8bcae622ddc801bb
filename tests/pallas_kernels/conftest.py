"""Shared helpers for the kernel tests; skips compiled-mode tests off GPU.

Test classes come in pairs: a base class with INTERPRET = False marked gpu_only
(compiled Pallas, needs a GPU) and a subclass named *Interpret with
INTERPRET = True that runs everywhere. Marks are inherited, so the skip keys on
INTERPRET rather than on the mark alone."""

import jax
import pytest


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="gpu_only: compiled Pallas needs a GPU")
  for item in items:
    if item.get_closest_marker("gpu_only") and not getattr(item.cls, "INTERPRET", False):
      item.add_marker(skip)
