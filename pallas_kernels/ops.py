"""Public ops: validate inputs and pick a backend.

`backend="auto"` uses the Pallas kernel on GPU and the XLA reference elsewhere;
`"pallas"` forces the kernel (with `interpret=True` it runs on CPU for tests);
`"reference"` forces the XLA path. Bad shapes/dtypes raise ValueError naming
the offending shapes, whatever the backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quantized_matmul as qmm
from pallas_kernels.quantized_tensor import QuantizedTensor

BACKENDS = ("auto", "pallas", "reference")


def _resolve_backend(backend: str) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r} not in {BACKENDS}")
  if backend == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "reference"
  return backend


def _dtype_name(dtype) -> str:
  return np.dtype(dtype).name


# --- quantized matmul --------------------------------------------------------------


def quantized_matmul(x: jax.Array, w: QuantizedTensor, *, backend: str = "auto",
                     interpret: bool = False, x_scale: jax.Array | None = None,
                     out_dtype=None, block_m: int | None = None, block_n: int | None = None,
                     k_splits: int | None = None) -> jax.Array:
  """y = x @ dequant(W): x [..., K], W logical [K, N] -> [..., N].

  x: bf16/f16/f32, or float8_e4m3fn with `x_scale` ([...] or [..., 1]; the real
  activation row is x * x_scale). Output dtype: `out_dtype`, else x's dtype
  (bf16 for FP8). block_m/block_n/k_splits override the kernel's tiling."""
  w.validate("quantized_matmul: W")
  k, n = w.shape
  if x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(f"quantized_matmul: x.shape={x.shape} does not match W.shape={w.shape}")
  if x.dtype not in qmm.ACT_DTYPES:
    raise ValueError(f"quantized_matmul: x.dtype={_dtype_name(x.dtype)} (x.shape={x.shape}) "
                     f"not in {[_dtype_name(d) for d in qmm.ACT_DTYPES]}")
  lead = x.shape[:-1]
  if x.dtype in qmm.FP8_DTYPES and x_scale is None:
    raise ValueError(f"quantized_matmul: FP8 x (shape {x.shape}) needs x_scale of shape {lead}")
  if x_scale is not None and x_scale.shape not in (lead, lead + (1,)):
    raise ValueError(f"quantized_matmul: x_scale.shape={x_scale.shape} must be {lead} or "
                     f"{lead + (1,)} for x.shape={x.shape}")
  requested, backend = backend, _resolve_backend(backend)
  if backend == "pallas":
    why = qmm.pallas_support_error(k, n, w)
    if why is not None and requested == "pallas":
      raise ValueError(f"quantized_matmul (pallas): W.shape={w.shape}: {why}")
    if why is not None:  # auto: shapes the kernel cannot tile stay on XLA
      backend = "reference"
  if backend == "reference":
    return qmm.quantized_matmul_reference(x, w, x_scale, out_dtype)
  m = int(np.prod(lead, dtype=np.int64))
  x2 = x.reshape(m, k)
  xs2 = None if x_scale is None else x_scale.reshape(m)
  if m == 0:
    dt = out_dtype or (jnp.bfloat16 if x.dtype in qmm.FP8_DTYPES else x.dtype)
    return jnp.zeros(lead + (n,), dt)
  y = qmm.quantized_matmul_pallas(x2, w, xs2, out_dtype=out_dtype, block_m=block_m,
                                  block_n=block_n, k_splits=k_splits, interpret=interpret)
  return y.reshape(*lead, n)
