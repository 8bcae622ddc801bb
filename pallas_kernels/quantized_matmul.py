"""Quantized matmul `y = x @ dequant(W)`: reference (XLA) implementation.

The Pallas kernel lives beside it (see `ops.quantized_matmul` for dispatch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize


def quantized_matmul_reference(x: jax.Array, w: QuantizedTensor) -> jax.Array:
  """x: [..., K] -> [..., N]; dequantizes W to f32 and accumulates in f32.

  Exact on CPU (f32 dot at HIGHEST precision); output in x's dtype."""
  wf = dequantize(w, jnp.float32)
  y = jnp.dot(x.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)
  return y.astype(x.dtype)
