"""Helpers shared by the kernel tests (imported by basename; pytest puts this dir on sys.path)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


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


def make_paged_cache(rng, batch, kv_heads, head_dim, block_size, max_blocks, used, dtype,
                     fp8=False, scale_shape=None):
  """Random paged K/V pools whose unused slots are NaN (kernels must never read them), and
  so are their per-token FP8 scales (a slot keeps its last owner's, NaN where that row was).

  used[b] = tokens of sequence b that are real. Pages are assigned in a random
  order with spare blocks. Returns (k_pages, v_pages, block_tables, k_scale, v_scale);
  FP8 pools are float8_e4m3fn with scales of `scale_shape` (default per token, as the
  engine's pools: [nb, block_size, kv_heads]; "nb" in a shape stands for the block count)."""
  import jax.numpy as jnp
  nb = batch * max_blocks + 3
  shape = (nb, block_size, kv_heads, head_dim)
  perm = rng.permutation(nb)[: batch * max_blocks].reshape(batch, max_blocks).astype(np.int32)
  live = np.zeros((nb, block_size), bool)
  for b in range(batch):
    for t in range(int(used[b])):
      live[perm[b, t // block_size], t % block_size] = True
  pools = []
  for _ in range(2):
    x = rng.normal(size=shape).astype(np.float32)
    x[~live] = np.nan
    pools.append(x)
  ks = vs = None
  if fp8:
    scale_shape = scale_shape or (nb, block_size, kv_heads)
    scale_shape = tuple(nb if s == "nb" else s for s in scale_shape)
    ks, vs = (rng.uniform(0.25, 2.0, size=scale_shape).astype(np.float32) for _ in range(2))
    if scale_shape == (nb, block_size, kv_heads):
      ks[~live], vs[~live] = np.nan, np.nan
    ks, vs = jnp.asarray(ks), jnp.asarray(vs)
    kp, vp = (jnp.asarray(p).astype(jnp.float8_e4m3fn) for p in pools)
  else:
    kp, vp = (jnp.asarray(p, dtype) for p in pools)
  return kp, vp, jnp.asarray(perm), ks, vs


def cpu_flags() -> set[str]:
  """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
  try:
    return set(pathlib.Path("/proc/cpuinfo").read_text().split())
  except OSError:
    return set()


def run_native_build(arch_flags: str, needs: set[str], script: str, *args: str) -> dict:
  """Runs `script` (Python printing one JSON line last) in a process of its own whose
  native kernels are built with O1JAX_NATIVE_ARCH_FLAGS=arch_flags (the library loads
  once per process), after skipping where this CPU lacks a flag in `needs`."""
  missing = needs - cpu_flags()
  if missing:
    pytest.skip(f"this CPU lacks {sorted(missing)}")
  env = {**os.environ, "O1JAX_NATIVE_ARCH_FLAGS": arch_flags}
  proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                        text=True, timeout=600, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.splitlines()[-1])
