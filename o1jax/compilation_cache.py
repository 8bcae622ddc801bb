"""Persistent XLA compilation cache, so runs and tests do not pay compiles twice."""

from __future__ import annotations

import os
import pathlib

import jax

DEFAULT_DIR = pathlib.Path.home() / ".cache" / "o1jax" / "jax"


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> pathlib.Path:
  """Turns on JAX's on-disk cache ($O1JAX_JAX_CACHE or ~/.cache/o1jax/jax)."""
  path = pathlib.Path(directory or os.environ.get("O1JAX_JAX_CACHE") or DEFAULT_DIR)
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  # Cache every program: our decode steps compile in seconds but run often.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
