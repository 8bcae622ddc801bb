"""Building blocks of the decoder, as pure functions (f32 math on CPU).

Every matmul goes through `linear`, and so through `pallas_kernels.ops.matmul`,
which picks the product by the weight: a dense f32 or bf16 array, a
`TiledF32Weight` (f32 in the native kernel's column tiles), a `QuantizedTensor`
or a `VnniWeight` (int8 activation levels).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import ops as kernel_ops

_HIGHEST = jax.lax.Precision.HIGHEST


MATMUL_DTYPES = ("float32", "bfloat16", "int8", "float8")


def linear(x: jax.Array, w, bias: jax.Array | None = None, *, backend: str = "auto",
           interpret: bool = False) -> jax.Array:
  """x: [..., K] @ w: [K, N] (+ bias [N]) -> [..., N]. The weight says how
  (`pallas_kernels.ops.matmul`: int8, quantized, bf16 or full-precision dense)."""
  y = kernel_ops.matmul(x, w, backend=backend, interpret=interpret)
  if bias is not None:
    y = y + bias.astype(y.dtype)
  return y


def embed(table, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Rows of the embedding table. table: [d_model, vocab] (head layout); ids: [...] -> [..., d]."""
  rows = kernel_ops.embedding_rows(table, ids.reshape(-1), dtype)
  return rows.reshape(*ids.shape, rows.shape[-1])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) * weight, computed in f32."""
  xf = x.astype(jnp.float32)
  var = jnp.mean(xf * xf, axis=-1, keepdims=True)
  return (xf * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)).astype(x.dtype)


def _base_inv_freq(rotary_dim: int, theta: float) -> jax.Array:
  return 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None = None) -> jax.Array:
  """Inverse frequencies [rotary_dim/2], with HF-style linear or llama3 scaling, divided
  by llama.cpp's per-frequency factors (GGUF rope_freqs), or by longrope's short factors
  (its long ones: `rope_tables`)."""
  inv = _base_inv_freq(rotary_dim, theta)
  if not scaling:
    return inv
  kind = scaling.get("rope_type", scaling.get("type"))
  factor = float(scaling.get("factor", 1.0))
  if kind == "linear":
    return inv / factor
  if kind == "freq_factors":
    return inv / jnp.asarray(scaling["factors"], jnp.float32)
  if kind == "longrope":
    return inv / jnp.asarray(scaling["short_factor"], jnp.float32)
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
  raise ValueError(f"rope scaling type {kind!r} is not supported "
                   f"(linear, llama3, freq_factors, longrope)")


def rope_tables(positions: jax.Array, rotary_dim: int, theta: float,
                scaling: dict | None = None) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) [B, T, rotary_dim/2] f32 of the rotary embedding at positions [B, T].

  longrope (Phi-3.5, Phi-4-mini): a position below original_max_position_embeddings
  turns by the short factors, one at or past it by the long ones, and cos and sin are
  scaled by attention_factor. That is transformers' choice for a token decoded at that
  position (it switches the whole model to the long factors once the sequence passes the
  original context; keys already cached keep their short rotation); a prompt longer than
  the original context that transformers runs in one call turns by the long factors
  throughout."""
  inv = rope_inv_freq(rotary_dim, theta, scaling)
  pos = positions.astype(jnp.float32)[..., None]
  angles = pos * inv
  scale = 1.0
  if scaling and scaling.get("rope_type", scaling.get("type")) == "longrope":
    long_inv = _base_inv_freq(rotary_dim, theta) / jnp.asarray(scaling["long_factor"],
                                                               jnp.float32)
    long_from = int(scaling["original_max_position_embeddings"])
    angles = jnp.where(positions[..., None] >= long_from, pos * long_inv, angles)
    scale = float(scaling["attention_factor"])
  return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate-half rotary embedding of the first 2 * cos.shape[-1] dimensions of each head
  (the rest pass through: partial rotary). x: [B, T, heads, D]; cos, sin: [B, T, r/2]."""
  half = cos.shape[-1]
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
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
  # The products as B*KVH equal [G*T, D] x [D, S] ones, one batch dimension: a row's
  # numbers do not depend on B. (With batch dims (b, k), XLA:CPU dropped b at B = 1 and
  # summed in another order: a prompt alone and beside others differed by ~5e-7 per
  # layer, 4e-5 in the logits. This form also ran 1.6-2.4x faster there.)
  qg = q.reshape(b, t, kvh, g, d).astype(jnp.float32) * (1.0 / math.sqrt(d))
  qg = qg.transpose(0, 2, 3, 1, 4).reshape(b * kvh, g * t, d)
  keys = k_cache.astype(jnp.float32).reshape(b * kvh, s, d)
  values = v_cache.astype(jnp.float32).reshape(b * kvh, s, d)
  scores = jnp.einsum("nqd,nsd->nqs", qg, keys, precision=_HIGHEST).reshape(b, kvh, g, t, s)
  mask = jnp.arange(s)[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
  if window is not None:
    mask = mask & (jnp.arange(s)[None, None, :] > q_positions[:, :, None] - window)
  if kv_valid is not None:
    mask = mask & kv_valid[:, None, :]
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(mask[:, None, None], probs, 0.0)  # rows with no visible key -> 0
  out = jnp.einsum("nqs,nsd->nqd", probs.reshape(b * kvh, g * t, s), values, precision=_HIGHEST)
  return out.reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


# Gate activations of the gated MLP by ModelConfig.activation: SwiGLU, and Gemma's GeGLU
# (GELU's tanh approximation, as HF's gelu_pytorch_tanh and llama.cpp's ggml_gelu).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def gated_mlp(x: jax.Array, w_gate, w_up, w_down, activation: str = "silu", **kw) -> jax.Array:
  """act(x @ w_gate) * (x @ w_up) @ w_down; kw as for `linear`."""
  gate = linear(x, w_gate, **kw)
  up = linear(x, w_up, **kw)
  return linear(ACTIVATIONS[activation](gate) * up, w_down, **kw)
