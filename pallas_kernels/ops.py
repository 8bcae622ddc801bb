"""Public ops: validate inputs and pick a backend.

`backend="auto"` uses the Pallas kernel on GPU and the XLA reference elsewhere;
`"pallas"` forces the kernel (with `interpret=True` it runs on CPU for tests);
`"reference"` forces the XLA path."""

from __future__ import annotations

import jax

from pallas_kernels.quantized_matmul import quantized_matmul_reference
from pallas_kernels.quantized_tensor import QuantizedTensor

BACKENDS = ("auto", "pallas", "reference")


def _resolve_backend(backend: str) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r} not in {BACKENDS}")
  if backend == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "reference"
  return backend


def quantized_matmul(x: jax.Array, w: QuantizedTensor, *, backend: str = "auto",
                     interpret: bool = False) -> jax.Array:
  """x: [..., K] @ W[K, N] -> [..., N]."""
  k, _ = w.shape
  if x.shape[-1] != k:
    raise ValueError(f"quantized_matmul: x.shape={x.shape} does not match W.shape={w.shape}")
  backend = _resolve_backend(backend)
  if backend == "reference":
    return quantized_matmul_reference(x, w)
  raise NotImplementedError("the Pallas quantized matmul kernel has not landed yet")
