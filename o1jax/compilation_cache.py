"""Compiled programs: the persistent XLA compilation cache (runs and tests do not pay
compiles twice) and a bound on the programs JAX keeps in memory."""

from __future__ import annotations

import gc
import logging
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


# -- compiled programs in memory -----------------------------------------------------------

# XLA:CPU maps each compiled kernel's code, constants and data into regions of their own:
# a new controller setting (its loop and admission programs) took ~1,050 memory maps on a
# 2-layer model and ~1,750 on the embedded one. JAX keeps every program for the process'
# life, so a one-process sweep of controller settings on the 2-layer model aborted at
# its 61st (Linux's vm.max_map_count is 65,530) with "LLVM compilation error: Cannot
# allocate memory" (docs/measurements/2026-12-04_compiled_programs.md). Past this
# fraction of the limit the in-memory programs are dropped (the next call of each
# compiles again, from the disk cache above when it is on).
RELEASE_AT_MAP_FRACTION = 0.5
_MAX_MAP_COUNT = pathlib.Path("/proc/sys/vm/max_map_count")
_PROCESS_MAPS = pathlib.Path("/proc/self/maps")
# JAX records it for each program compiled or loaded from the disk cache.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_programs_built = 0  # compiles and disk-cache loads (JAX's backend-compile event)
_programs_checked = 0
log = logging.getLogger(__name__)


def _count_program(event: str, duration: float, **kwargs) -> None:
  global _programs_built
  if event == BACKEND_COMPILE_EVENT:
    _programs_built += 1


def map_limit() -> int | None:
  """The kernel's limit on one process' memory maps (None where it has none to read)."""
  try:
    return int(_MAX_MAP_COUNT.read_text())
  except (OSError, ValueError):
    return None


def maps_in_use() -> int:
  with _PROCESS_MAPS.open("rb") as f:
    return sum(1 for _ in f)


def release_programs_near_map_limit() -> bool:
  """Drops JAX's in-memory programs (`jax.clear_caches`) when the process' memory maps
  pass RELEASE_AT_MAP_FRACTION of the kernel's limit; True if it did. Cheap when no
  program was built since the last call (an integer compare): callers check it before
  each device call that may compile (the engine's step, the controller's loop calls)."""
  global _programs_checked
  if _programs_built == _programs_checked:
    return False
  _programs_checked = _programs_built
  limit = map_limit()
  if limit is None:
    return False
  used = maps_in_use()
  if used < RELEASE_AT_MAP_FRACTION * limit:
    return False
  jax.clear_caches()
  gc.collect()
  log.warning("released JAX's compiled programs: the process held %d of its %d memory maps "
              "(now %d); the next call of each compiles it again", used, limit, maps_in_use())
  return True


jax.monitoring.register_event_duration_secs_listener(_count_program)
