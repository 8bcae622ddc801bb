"""Building blocks of the decoder, as pure functions (f32 math on CPU).

Every matmul goes through `linear`, which takes a dense array, a
`QuantizedTensor` (dispatched to `pallas_kernels.ops`) or a `VnniWeight`
(int8 activation levels, `pallas_kernels.vnni_matmul`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import ops as kernel_ops
from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize_columns
from pallas_kernels.vnni_matmul import VnniWeight, vnni_matmul

_HIGHEST = jax.lax.Precision.HIGHEST


# A bf16 x bf16 dot with f32 accumulation takes XLA's fast CPU path (AMX /
# AVX512-BF16) only from this many rows: one row runs ~6x slower than f32, and
# two rows round differently from three or more. Fewer rows are zero-padded,
# so a row's result never depends on how many other rows are in the batch.
BF16_MIN_ROWS = 4


def bf16_dot(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., K] (rounded to bf16) @ w [K, N] bf16, accumulated in f32 -> f32 [..., N]."""
  lead, k = x.shape[:-1], x.shape[-1]
  rows = math.prod(lead)
  x2 = x.reshape(rows, k).astype(jnp.bfloat16)
  if rows < BF16_MIN_ROWS:
    x2 = jnp.pad(x2, ((0, BF16_MIN_ROWS - rows), (0, 0)))
  y = jnp.dot(x2, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  return y[:rows].reshape(*lead, w.shape[-1])


MATMUL_DTYPES = ("float32", "bfloat16", "int8")


def linear(x: jax.Array, w, bias: jax.Array | None = None, *, backend: str = "auto",
           interpret: bool = False, matmul_dtype: str = "float32") -> jax.Array:
  """x: [..., K] @ w: [K, N] (+ bias [N]) -> [..., N].

  matmul_dtype "bfloat16": dense weights go through `bf16_dot` (x rounded to
  bf16, f32 accumulation and output); "float32": dense weights are cast to
  x's dtype (exact f32 math for f32 x). Quantized weights ignore it; a
  `VnniWeight` (the model's "int8" matmuls) always quantizes x to two int8
  levels per block of 32."""
  if isinstance(w, VnniWeight):
    y = vnni_matmul(x, w, backend=backend).astype(x.dtype)
  elif isinstance(w, QuantizedTensor):
    y = kernel_ops.quantized_matmul(x, w, backend=backend, interpret=interpret)
  elif matmul_dtype == "bfloat16":
    y = bf16_dot(x, w)
  else:
    y = jnp.dot(x, w.astype(x.dtype), precision=_HIGHEST)
  if bias is not None:
    y = y + bias.astype(y.dtype)
  return y


def embed(table, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Rows of the embedding table. table: [d_model, vocab] (head layout); ids: [...] -> [..., d]."""
  flat = ids.reshape(-1)
  if isinstance(table, QuantizedTensor):
    rows = dequantize_columns(table, flat, dtype)
  else:
    rows = jnp.take(table, flat, axis=1).T.astype(dtype)
  return rows.reshape(*ids.shape, rows.shape[-1])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) * weight, computed in f32."""
  xf = x.astype(jnp.float32)
  var = jnp.mean(xf * xf, axis=-1, keepdims=True)
  return (xf * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> jax.Array:
  """Inverse frequencies [head_dim/2], with HF-style linear or llama3 scaling, or divided
  by llama.cpp's per-frequency factors (GGUF rope_freqs)."""
  inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if not scaling:
    return inv
  kind = scaling.get("rope_type", scaling.get("type"))
  factor = float(scaling.get("factor", 1.0))
  if kind == "linear":
    return inv / factor
  if kind == "freq_factors":
    return inv / jnp.asarray(scaling["factors"], jnp.float32)
  if kind == "llama3":
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = jnp.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return jnp.where(is_mid, mid, scaled)
  raise ValueError(f"rope scaling type {kind!r} is not supported (linear, llama3, freq_factors)")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotate-half rotary embedding. x: [B, T, heads, D]; positions: [B, T]."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_positions: jax.Array,
              kv_valid: jax.Array | None = None, window: int | None = None) -> jax.Array:
  """Causal grouped-query attention against a contiguous cache.

  q: [B, T, H, D]; k_cache, v_cache: [B, KVH, S, D]; q_positions: [B, T] absolute
  positions (key s is visible to query t iff s <= q_positions[b, t], and with a
  sliding `window` also s > q_positions[b, t] - window);
  kv_valid: optional [B, S] bool of keys that may be attended at all.
  Returns [B, T, H, D]."""
  b, t, h, d = q.shape
  kvh, s = k_cache.shape[1], k_cache.shape[2]
  g = h // kvh
  qg = q.reshape(b, t, kvh, g, d).astype(jnp.float32) * (1.0 / math.sqrt(d))
  scores = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache.astype(jnp.float32), precision=_HIGHEST)
  mask = jnp.arange(s)[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
  if window is not None:
    mask = mask & (jnp.arange(s)[None, None, :] > q_positions[:, :, None] - window)
  if kv_valid is not None:
    mask = mask & kv_valid[:, None, :]
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(mask[:, None, None], probs, 0.0)  # rows with no visible key -> 0
  out = jnp.einsum("bkgts,bksd->btkgd", probs, v_cache.astype(jnp.float32), precision=_HIGHEST)
  return out.reshape(b, t, h, d).astype(q.dtype)


# Gate activations of the gated MLP by ModelConfig.activation: SwiGLU, and Gemma's GeGLU
# (GELU's tanh approximation, as HF's gelu_pytorch_tanh and llama.cpp's ggml_gelu).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def gated_mlp(x: jax.Array, w_gate, w_up, w_down, activation: str = "silu", **kw) -> jax.Array:
  """act(x @ w_gate) * (x @ w_up) @ w_down; kw as for `linear`."""
  gate = linear(x, w_gate, **kw)
  up = linear(x, w_up, **kw)
  return linear(ACTIVATIONS[activation](gate) * up, w_down, **kw)


def swiglu(x: jax.Array, w_gate, w_up, w_down, **kw) -> jax.Array:
  """silu(x @ w_gate) * (x @ w_up) @ w_down; kw as for `linear`."""
  gate = linear(x, w_gate, **kw)
  up = linear(x, w_up, **kw)
  return linear(jax.nn.silu(gate) * up, w_down, **kw)
