"""FP8 (e4m3) activations: a matrix whose products take their input rows in FP8.

`Fp8ActivationWeight` marks a model matrix (dense, or a `QuantizedTensor`) so that
`pallas_kernels.ops.matmul` rounds each input row to float8_e4m3fn under its own
scale before the product (`Llama(matmul_dtype="float8")`). A row's scale is its
largest magnitude / 448 (e4m3's largest finite value), so the row's largest entry
lands on 448 and nothing overflows; a zero row keeps scale 1. The product itself is
exact on the FP8 values (e4m3 widens exactly into bf16/f32) with f32 accumulation,
and the row's scale multiplies the result: `y = (x8 @ W) * scale`. Quantized
matrices go through `quantized_matmul` with `x_scale` (the Pallas kernels on a GPU
take FP8 rows as they are).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPE = jnp.float8_e4m3fn
FP8_DTYPES = (FP8_DTYPE,)  # the FP8 formats the kernels read (activations and KV pools)
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
FP8_MIN_SCALE = float(np.finfo(np.float32).tiny)


@flax.struct.dataclass
class Fp8ActivationWeight:
  matrix: object  # a [K, N] array or a QuantizedTensor

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.matrix.shape)

  @property
  def ndim(self) -> int:
    return 2


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [..., K] -> (x8 float8_e4m3fn [..., K], scale f32 [...]) with x ~= x8 * scale."""
  xf = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(xf), axis=-1)
  # Times the f32 reciprocal, not divided: XLA may rewrite a division by a constant so.
  # At least the smallest normal f32: amax / 448 of a tiny row (amax < 5e-36) flushes to 0.
  scale = jnp.where(amax > 0, jnp.maximum(amax * np.float32(1 / FP8_MAX), FP8_MIN_SCALE),
                    1.0).astype(jnp.float32)
  x8 = jnp.clip(xf / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
  return x8, scale


def dense_matmul(x8: jax.Array, scale: jax.Array, w: jax.Array) -> jax.Array:
  """(x8 @ w) * scale in f32, x8 widened exactly into w's dtype: [..., K] x [K, N] -> [..., N]."""
  precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
  y = jnp.dot(x8.astype(w.dtype), w, preferred_element_type=jnp.float32, precision=precision)
  return y * scale[..., None]


__all__ = ["FP8_DTYPE", "FP8_DTYPES", "FP8_MAX", "FP8_MIN_SCALE", "Fp8ActivationWeight", "dense_matmul", "quantize_rows"]
