"""Paged decode attention: one query token per sequence vs a paged KV cache.

Cache layout (one pool per layer, K and V separate):
  k_pages, v_pages  [num_blocks, block_size, kv_heads, head_dim]
  block_tables      [batch, max_blocks] int32 (logical page -> physical block)
  lengths           [batch] int32 (tokens in the cache; 0 = empty, output 0)
  k_scale, v_scale  optional f32 [num_blocks, block_size, kv_heads] for FP8 (e4m3)
                    pools: real K = k_pages * k_scale[block, slot, head], a scale per
                    token (the ops wrapper broadcasts coarser scales).
The query of sequence b sits at position lengths[b] - 1 and attends to keys
0..lengths[b]-1, or with `sliding_window=w` to the last w of them.

Backend: the kernel targets the Pallas *Triton* GPU backend (`plt.CompilerParams`)
and runs with `interpret=True` anywhere. One program = (sequence, kv head,
context split); the query heads of the GQA group are the rows of a
[rows>=16, head_dim] tile so QK^T and PV are tensor-core dots. KV is read as
gathered token rows (page id from the block table, then row = page*bs + slot),
so a step of `block_kv` tokens works for any page size and needs no alignment.
Splits (flash-decoding) return unnormalised partials that the wrapper merges
with a log-sum-exp, which keeps small batches bandwidth-bound.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.fp8_activations import FP8_DTYPES

KV_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32) + FP8_DTYPES
_HIGHEST = jax.lax.Precision.HIGHEST
# Finite "minus infinity": keeps exp(m_old - m_new) NaN-free when nothing is valid yet.
NEG_INF = -1e30


# --- reference ---------------------------------------------------------------------


def gather_kv(pages: jax.Array, scale: jax.Array | None, block_tables: jax.Array) -> jax.Array:
  """Pages of each sequence in logical order, dequantized to f32.

  pages [NB, bs, KVH, D], scale [NB, bs, KVH] or None, block_tables [B, MB]
  -> [B, MB * bs, KVH, D]. Out-of-range table entries are clamped (masked later)."""
  nb, bs, kvh, d = pages.shape
  b, mb = block_tables.shape
  ids = jnp.clip(block_tables, 0, nb - 1)
  kv = jnp.take(pages, ids, axis=0).astype(jnp.float32)  # [B, MB, bs, KVH, D]
  if scale is not None:
    s = jnp.take(scale.astype(jnp.float32), ids, axis=0)  # [B, MB, bs, KVH]
    kv = kv * s[..., None]
  return kv.reshape(b, mb * bs, kvh, d)


def paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths, k_scale=None,
                                     v_scale=None, *, sliding_window: int | None = None,
                                     sm_scale: float | None = None):
  """q [B, H, D] -> [B, H, D] (q's dtype): one query per row over its paged keys, f32.

  1. gather the row's pages: K, V [B, L, KVH, D] with L = max_blocks * block_size;
  2. scores by multiply-then-sum over D of the pre-scaled query: [B, L, KVH, G];
  3. masked softmax over L (keys >= lengths[b], or older than the window, masked;
     length 0 -> zeros);
  4. output = sum over L of p * V: [B, KVH, G, D] -> [B, H, D].
  Multiply-then-sum rather than batched dots because this is also the CPU path when
  the native kernel cannot run (FP8 pools, a window): dots ran 30 layers alone in 15
  vs 90 ms at B=32, L=256, but the whole decode step was the same within noise (162 vs
  167 ms at L=128), the gather (~0.75 ms per 6.3 MB pool per layer) dominating."""
  b, h, d = q.shape
  kvh = k_pages.shape[2]
  g = h // kvh
  sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
  k = gather_kv(k_pages, k_scale, block_tables)
  v = gather_kv(v_pages, v_scale, block_tables)
  pos = jnp.arange(k.shape[1], dtype=jnp.int32)
  lengths = lengths.astype(jnp.int32)
  valid = pos[None, :] < lengths[:, None]  # [B, L]
  if sliding_window is not None:
    valid &= pos[None, :] >= lengths[:, None] - sliding_window
  # Unused pages may hold garbage (even NaN): zero V there so 0 * NaN never happens
  # (K's scores are replaced by -inf).
  v = jnp.where(valid[:, :, None, None], v, 0.0)
  qg = q.astype(jnp.float32).reshape(b, 1, kvh, g, d) * sm_scale
  s = jnp.sum(qg * k[:, :, :, None, :], axis=-1)  # [B, L, KVH, G]
  s = jnp.where(valid[:, :, None, None], s, -jnp.inf)
  m = jnp.max(s, axis=1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(valid[:, :, None, None], jnp.exp(s - m), 0.0)
  denom = jnp.sum(p, axis=1)  # [B, KVH, G]
  out = jnp.sum(p[..., None] * v[:, :, :, None, :], axis=1)  # [B, KVH, G, D]
  out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
  return out.reshape(b, h, d).astype(q.dtype)


# --- kernel helpers shared with the prefill kernel ------------------------------------


def compute_dtype(q_dtype, kv_dtype):
  """Dtype fed to the dots: q's (bf16/f16/f32); FP8 KV is upcast to it."""
  del kv_dtype
  return q_dtype


def load_token_rows(t, b, h, bt_ref, kv_ref, scale_ref, *, block_size: int, num_blocks: int,
                    max_blocks: int):
  """Gathers the K or V rows of tokens `t` ([C] int32) of sequence b, kv head h; the
  pool and its scales flattened to token rows ([NB * bs, KVH, D], [NB * bs, KVH]).

  Returns (rows [C, D] in the pool dtype, per-token scale [C] f32 or None)."""
  pidx = jnp.minimum(t // block_size, max_blocks - 1)
  page = jnp.clip(bt_ref[b, pidx], 0, num_blocks - 1)
  rows = page * block_size + t % block_size
  kv = kv_ref[rows, h, :]
  scale = None if scale_ref is None else scale_ref[rows, h].astype(jnp.float32)
  return kv, scale


def attend_chunk(q, k, v, k_scale, v_scale, mask, kv_valid, carry, *, sm_scale: float, cd):
  """One online-softmax step. q [R, D]; k, v [C, D]; mask [R, C]; kv_valid [C].

  carry = (m [R], l [R], acc [R, D]) in f32, unnormalised."""
  m, l, acc = carry
  precision = _HIGHEST if cd == jnp.float32 else jax.lax.Precision.DEFAULT
  k = k.astype(jnp.float32).astype(cd) if k.dtype in FP8_DTYPES else k.astype(cd)
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                          precision=precision)
  s = s * sm_scale
  if k_scale is not None:
    s = s * k_scale[None, :]
  s = jnp.where(mask, s, NEG_INF)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  alpha = jnp.exp(m - m_new)
  p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
  l = l * alpha + jnp.sum(p, axis=1)
  if v_scale is not None:
    # A slot past the length keeps its last owner's scale, NaN where that row was NaN:
    # NaN x 0 is NaN, so the scale is masked too, not only the values.
    p = p * jnp.where(kv_valid, v_scale, 0.0)[None, :]
  # Garbage (even NaN) in unused page slots must not reach the PV dot.
  v = jnp.where(kv_valid[:, None], v.astype(jnp.float32), 0.0).astype(cd)
  pv = jnp.dot(p.astype(cd), v, preferred_element_type=jnp.float32, precision=precision)
  acc = acc * alpha[:, None] + pv
  return m_new, l, acc


# --- decode kernel ---------------------------------------------------------------------


def _decode_kernel(*refs, block_size: int, num_blocks: int, max_blocks: int, block_kv: int,
                   tokens_per_split: int, sliding_window: int | None, sm_scale: float,
                   has_scale: bool, cd):
  if has_scale:
    q_ref, bt_ref, len_ref, k_ref, v_ref, ks_ref, vs_ref, acc_ref, m_ref, l_ref = refs
  else:
    q_ref, bt_ref, len_ref, k_ref, v_ref, acc_ref, m_ref, l_ref = refs
    ks_ref = vs_ref = None
  # q_ref,    # [rows, head_dim]  (query heads of one GQA group, zero-padded)
  # bt_ref,   # [batch, max_blocks] int32 (whole array)
  # len_ref,  # [batch] int32
  # k_ref,    # [num_blocks * block_size, kv_heads, head_dim] (whole pool)
  # v_ref,    # [num_blocks * block_size, kv_heads, head_dim]
  # ks_ref,   # [num_blocks * block_size, kv_heads] f32 (FP8 only)
  # acc_ref,  # [rows, head_dim] f32 unnormalised output of this split
  # m_ref,    # [rows] f32 running max
  # l_ref,    # [rows] f32 softmax denominator
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, d = q_ref.shape
  q = q_ref[...].astype(cd)
  length = len_ref[b]
  lo = jnp.int32(0)
  if sliding_window is not None:
    lo = jnp.maximum(length - sliding_window, 0)
  start = jnp.maximum(lo, split * tokens_per_split)
  # (keys past the table are none: a length beyond it re-read the last page's slots as
  # new keys, where the reference and the native kernel stop at the table's end)
  end = jnp.minimum(jnp.minimum(length, max_blocks * block_size), (split + 1) * tokens_per_split)
  n_steps = pl.cdiv(jnp.maximum(end - start, 0), block_kv)
  load = functools.partial(load_token_rows, block_size=block_size, num_blocks=num_blocks,
                           max_blocks=max_blocks)

  def body(i, carry):
    t = start + i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
    kv_valid = t < end
    k, ks = load(t, b, h, bt_ref, k_ref, ks_ref)
    v, vs = load(t, b, h, bt_ref, v_ref, vs_ref)
    mask = jnp.broadcast_to(kv_valid[None, :], (rows, block_kv))
    return attend_chunk(q, k, v, ks, vs, mask, kv_valid, carry, sm_scale=sm_scale, cd=cd)

  carry = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, d), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, n_steps, body, carry)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def merge_splits(acc, m, l):
  """acc [..., S, R, D], m/l [..., S, R] -> normalised [..., R, D] f32 (0 where empty)."""
  m_max = jnp.max(m, axis=-2, keepdims=True)
  w = jnp.exp(m - m_max)
  l_tot = jnp.sum(w * l, axis=-2)
  o = jnp.sum(w[..., None] * acc, axis=-3)
  return o / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]


def choose_decode_config(batch: int, kv_heads: int, max_tokens: int, *,
                         target_programs: int = 264, block_kv: int | None = None):
  """(block_kv, num_splits): split the context until ~2 programs per SM."""
  block_kv = block_kv or 64
  chunks = max(1, pl.cdiv(max_tokens, block_kv))
  splits = max(1, min(chunks, pl.cdiv(target_programs, batch * kv_heads), 32))
  return block_kv, splits


def paged_decode_attention_pallas(q, k_pages, v_pages, block_tables, lengths, k_scale=None,
                                  v_scale=None, *, sliding_window: int | None = None,
                                  sm_scale: float | None = None, block_kv: int | None = None,
                                  num_splits: int | None = None, num_warps: int = 4,
                                  num_stages: int = 2, interpret: bool = False):
  """q [B, H, D] -> [B, H, D]. Inputs assumed validated by the ops wrapper;
  k_scale/v_scale are [num_blocks, block_size, kv_heads] f32 or None."""
  b, h, d = q.shape
  nb, bs, kvh, _ = k_pages.shape
  mb = block_tables.shape[1]
  r = h // kvh
  rows = max(16, pl.next_power_of_2(r))
  sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
  bkv, splits = choose_decode_config(b, kvh, mb * bs, block_kv=block_kv)
  splits = num_splits or splits
  tokens_per_split = pl.cdiv(pl.cdiv(mb * bs, splits), bkv) * bkv
  qg = q.reshape(b, kvh, r, d)
  if rows != r:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - r), (0, 0)))
  has_scale = k_scale is not None
  kernel = functools.partial(
      _decode_kernel, block_size=bs, num_blocks=nb, max_blocks=mb, block_kv=bkv,
      tokens_per_split=tokens_per_split, sliding_window=sliding_window, sm_scale=sm_scale,
      has_scale=has_scale, cd=compute_dtype(q.dtype, k_pages.dtype))
  whole = pl.BlockSpec(memory_space=pl.ANY)
  in_specs = [pl.BlockSpec((None, None, rows, d), lambda i, j, s: (i, j, 0, 0))] + [whole] * 4
  args = [qg, block_tables.astype(jnp.int32), lengths.astype(jnp.int32),
          k_pages.reshape(nb * bs, kvh, d), v_pages.reshape(nb * bs, kvh, d)]
  if has_scale:
    in_specs += [whole, whole]
    args += [s.reshape(nb * bs, kvh).astype(jnp.float32) for s in (k_scale, v_scale)]
  acc, m, l = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((b, kvh, splits, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, splits, rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, splits, rows), jnp.float32)),
      grid=(b, kvh, splits),
      in_specs=in_specs,
      out_specs=(pl.BlockSpec((None, None, None, rows, d), lambda i, j, s: (i, j, s, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0))),
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="paged_decode_attention",
  )(*args)
  o = merge_splits(acc, m, l)[:, :, :r]
  return o.reshape(b, h, d).astype(q.dtype)


def decode_bytes_and_flops(batch: int, heads: int, kv_heads: int, head_dim: int, context: int,
                           kv_itemsize: int = 2) -> tuple[int, int]:
  """Minimum HBM bytes (K and V of every cached token) and FLOPs of one decode step."""
  nbytes = 2 * batch * context * kv_heads * head_dim * kv_itemsize
  return nbytes, 4 * batch * heads * context * head_dim
