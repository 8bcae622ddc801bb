"""Helpers shared by the kernel tests (imported by basename; pytest puts this dir on sys.path)."""

import jax
import numpy as np


def rel_err(got, want) -> float:
  """||got - want|| / ||want|| in f64 (0 when both are 0)."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  denom = np.linalg.norm(want)
  num = np.linalg.norm(got - want)
  return float(num / denom) if denom > 0 else float(num)


# Relative-norm tolerances keyed by the dtype the result is rounded to.
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}


def tol_for(dtype) -> float:
  return TOL[np.dtype(dtype).name]


def lowers_for_cuda(fn, *args) -> str:
  """Lowers `fn(*args)` for CUDA on any host (no GPU needed); returns the text."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
