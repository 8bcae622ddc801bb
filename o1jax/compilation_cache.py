"""Compiled programs: how the model's programs are compiled (`jit`: batch-invariant
numerics), the persistent XLA compilation cache (runs and tests do not pay compiles twice)
and a bound on the programs JAX keeps in memory."""

from __future__ import annotations

import functools
import gc
import logging
import os
import pathlib
import threading

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

DEFAULT_DIR = pathlib.Path.home() / ".cache" / "o1jax" / "jax"


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> pathlib.Path:
  """Turns on JAX's on-disk cache ($O1JAX_JAX_CACHE or ~/.cache/o1jax/jax)."""
  path = pathlib.Path(directory or os.environ.get("O1JAX_JAX_CACHE") or DEFAULT_DIR)
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  # Cache every program: our decode steps compile in seconds but run often, and the
  # small ones too (a new engine or controller compiles its own: with programs under
  # 0.5 s cached as well, four heavy test modules ran in 51-57 s warm instead of
  # 58-60 s, three runs each; the default eval job the same; cache +10 %).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


# -- how programs are compiled ------------------------------------------------------------

# XLA:CPU (jaxlib 0.10-0.11) hands elementwise ops and row reductions to YNNPACK fusions
# whose sums depend on how many rows the program has: RMSNorm of the same row came out
# 2e-6 apart in a batch of 1 and of 4, and an 830-token prompt's logits 4e-5 (f32) / 1e-2
# (int8) apart alone and beside 3 others (docs/measurements/2026-12-05_batch_invariance.md).
# A request's tokens must not depend on its batch (the engine's promise; a resumed eval
# job batches its records anew), so the model's programs keep YNNPACK for single dots and
# convolutions only: bf16 products stay on it (their rows are padded to stay invariant).
YNN_FUSION_OPTION = "xla_cpu_experimental_ynn_fusion_type"
BATCH_INVARIANT_CPU_OPTIONS = {
    YNN_FUSION_OPTION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"}


@functools.cache
def compiler_options() -> dict[str, str] | None:
  """The XLA options the model's programs compile with (`jit`): BATCH_INVARIANT_CPU_OPTIONS
  on a CPU backend whose XLA takes them (probed once with a tiny program: an XLA without
  the option refuses it), else None (GPU and TPU: XLA's defaults; and where XLA_FLAGS sets
  the option itself: the user's choice is kept)."""
  if jax.default_backend() != "cpu":
    return None
  if f"--{YNN_FUSION_OPTION}=" in os.environ.get("XLA_FLAGS", ""):
    log.warning("XLA_FLAGS sets %s: the model's programs keep it (a row's numerics may then "
                "depend on its batch)", YNN_FUSION_OPTION)
    return None
  try:
    jax.jit(lambda x: x * x, compiler_options=BATCH_INVARIANT_CPU_OPTIONS).lower(
        jnp.zeros(2)).compile()
  except Exception as e:  # noqa: BLE001 - whatever this XLA says, fall back to its defaults
    log.warning("XLA:CPU refused %s (%s): a row's numerics may depend on its batch",
                BATCH_INVARIANT_CPU_OPTIONS, str(e).splitlines()[0])
    return None
  return dict(BATCH_INVARIANT_CPU_OPTIONS)


class _Jit:
  """`jax.jit(fun, **kwargs)` with `compiler_options()`, built at its first use (the
  backend is known only then; importing a module must not start it). Calls, attribute
  reads (lower, trace, _cache_size) and method binding go to the jitted function."""

  def __init__(self, fun, kwargs):
    functools.update_wrapper(self, fun)
    self._fun, self._kwargs, self._jitted = fun, kwargs, None
    self._lock = threading.Lock()  # Beam's threads: one jitted function, one set of programs

  def _get(self):
    if self._jitted is None:
      with self._lock:
        if self._jitted is None:
          self._jitted = jax.jit(self._fun, compiler_options=compiler_options(), **self._kwargs)
    return self._jitted

  def __call__(self, *args, **kwargs):
    return self._get()(*args, **kwargs)

  def __getattr__(self, name):
    if name.startswith("__") or name in ("_fun", "_kwargs", "_jitted", "_lock"):
      raise AttributeError(name)
    return getattr(self._get(), name)

  def __get__(self, obj, objtype=None):
    return self if obj is None else self._get().__get__(obj, objtype)


def jit(fun=None, **kwargs):
  """`jax.jit` for the programs that run the model (decorator or call, same arguments):
  compiled with `compiler_options()`, so a row's numbers do not depend on its batch."""
  if fun is None:
    return functools.partial(jit, **kwargs)
  return _Jit(fun, kwargs)


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
