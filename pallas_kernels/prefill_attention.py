"""Chunked-prefill attention over the paged KV cache (flash-style online softmax).

A chunk of T new queries per sequence sits at absolute positions
start..start+T-1; its own K/V are already written into the pages, so query
position p attends to cached keys 0..p (or the last `sliding_window` of them).
That one layout serves full prefill (start=0), chunked prefill and prefix reuse
(start = length of the reused prefix). Same cache layout and FP8 scales as
`paged_attention.py`. Rows t >= chunk_lens[b] are padding and come back as 0.

Backend: Pallas *Triton* GPU backend (`plt.CompilerParams`); `interpret=True`
anywhere. One program = (sequence, kv head, tile of block_q query rows), where
the rows of a tile are (query, head-in-GQA-group) pairs, row = t * group + j, so
the whole group shares each K/V load. Keys are gathered `block_kv` tokens at a
time through the block table; the loop stops at the tile's last causal key.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_attention import (NEG_INF, _HIGHEST, attend_chunk, compute_dtype,
                                            gather_kv, load_token_rows)


# --- reference ---------------------------------------------------------------------


def paged_prefill_attention_reference(q, k_pages, v_pages, block_tables, starts, chunk_lens,
                                      k_scale=None, v_scale=None, *,
                                      sliding_window: int | None = None,
                                      sm_scale: float | None = None):
  """q [B, T, H, D] -> [B, T, H, D] (q's dtype). f32 math, masked softmax, no batch loop."""
  b, t, h, d = q.shape
  kvh = k_pages.shape[2]
  r = h // kvh
  sm_scale = d ** -0.5 if sm_scale is None else sm_scale
  k = gather_kv(k_pages, k_scale, block_tables)  # [B, L, KVH, D]
  v = gather_kv(v_pages, v_scale, block_tables)
  kpos = jnp.arange(k.shape[1], dtype=jnp.int32)
  tq = jnp.arange(t, dtype=jnp.int32)
  qpos = starts.astype(jnp.int32)[:, None] + tq[None, :]  # [B, T]
  row_ok = tq[None, :] < chunk_lens.astype(jnp.int32)[:, None]  # [B, T]
  mask = (kpos[None, None, :] <= qpos[:, :, None]) & row_ok[:, :, None]  # [B, T, L]
  if sliding_window is not None:
    mask &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
  kv_used = jnp.any(mask, axis=1)  # [B, L]: slots some query reads
  k = jnp.where(kv_used[:, :, None, None], k, 0.0)
  v = jnp.where(kv_used[:, :, None, None], v, 0.0)
  qg = q.astype(jnp.float32).reshape(b, t, kvh, r, d)
  s = jnp.einsum("btgrd,blgd->bgrtl", qg, k, precision=_HIGHEST) * sm_scale
  mask5 = mask[:, None, None, :, :]
  s = jnp.where(mask5, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask5, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bgrtl,blgd->btgrd", p, v, precision=_HIGHEST)
  l = jnp.moveaxis(l[..., 0], 3, 1)[..., None]  # [B, T, KVH, r, 1]
  o = o / jnp.where(l > 0, l, 1.0)
  return o.reshape(b, t, h, d).astype(q.dtype)


# --- blocked XLA path (CPU) ---------------------------------------------------------


# jit: every layer of a model calls this with the same shapes; as one jitted function it is
# traced once per program, not once per layer (its loop body was 2.4 s of the embedded
# model's first prefill calls in a new process; XLA inlines the call, same program).
@functools.partial(jax.jit, static_argnames=("sliding_window", "sm_scale", "key_block"))
def paged_prefill_attention_blocked(q, k_pages, v_pages, block_tables, starts, chunk_lens,
                                    k_scale=None, v_scale=None, *,
                                    sliding_window: int | None = None,
                                    sm_scale: float | None = None, key_block: int = 256):
  """As the reference, in XLA, over `key_block` keys at a time with an online softmax.

  The reference scores every query against the table's whole width: [B, H, T, L] f32 at
  once (hundreds of MB for a long prompt, memory-bound on a CPU) and keys past the chunk.
  This loops over key blocks from the first key any query of the call may read (0, or the
  window's start) to the last (the longest row's last query), so a chunk early in a long
  prompt reads only the keys before it, and each step's scores stay [B, KVH, T*r, key_block]
  (rows = (query, head-in-group) pairs, so the group shares each key block's product).
  Results equal the reference to f32 rounding (another summation order)."""
  b, t, h, d = q.shape
  _, bs, kvh, _ = k_pages.shape
  r = h // kvh
  sm_scale = d ** -0.5 if sm_scale is None else sm_scale
  per_step = max(1, key_block // bs)  # table entries per step
  width = block_tables.shape[1]
  steps_total = -(-width // per_step)
  tables = jnp.pad(block_tables, ((0, 0), (0, steps_total * per_step - width)))
  kb = per_step * bs
  starts = starts.astype(jnp.int32)
  lens = chunk_lens.astype(jnp.int32)
  tq = jnp.arange(t, dtype=jnp.int32)
  qpos = jnp.repeat(starts[:, None] + tq[None, :], r, axis=1)  # [B, T*r]
  row_ok = jnp.repeat(tq[None, :] < lens[:, None], r, axis=1)
  qg = (q.astype(jnp.float32) * sm_scale).reshape(b, t, kvh, r, d)
  qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(b, kvh, t * r, d)
  last = jnp.max(jnp.where(lens > 0, starts + lens, 0))  # keys [0, last) may be read
  first = jnp.int32(0)
  if sliding_window is not None:
    first = jnp.maximum(jnp.min(jnp.where(lens > 0, starts, last)) - sliding_window + 1, 0)
  lo = jnp.minimum(first // kb, steps_total)
  hi = jnp.minimum(-(-last // kb), steps_total)

  def body(i, carry):
    m, l, acc = carry
    ids = jax.lax.dynamic_slice_in_dim(tables, i * per_step, per_step, axis=1)
    k = jnp.transpose(gather_kv(k_pages, k_scale, ids), (0, 2, 1, 3))  # [B, KVH, kb, D]
    v = jnp.transpose(gather_kv(v_pages, v_scale, ids), (0, 2, 1, 3))
    kpos = i * kb + jnp.arange(kb, dtype=jnp.int32)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & row_ok[:, :, None]  # [B, T*r, kb]
    # (keys past the table are none, as the reference's: the padding read block 0)
    mask &= (kpos < width * bs)[None, None, :]
    if sliding_window is not None:
      mask &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
    # Unread slots may hold anything (stale or non-finite bytes): zeroed, as the reference.
    used = jnp.any(mask, axis=1)[:, None, :, None]
    k = jnp.where(used, k, 0.0)
    v = jnp.where(used, v, 0.0)
    mask = mask[:, None]  # [B, 1, T*r, kb]
    s = jnp.where(mask, jnp.einsum("bgqd,bgkd->bgqk", qg, k, precision=_HIGHEST), -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
    scale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
    l = l * scale + jnp.sum(p, axis=-1)
    acc = acc * scale[..., None] + jnp.einsum("bgqk,bgkd->bgqd", p, v, precision=_HIGHEST)
    return m_new, l, acc

  rows = t * r
  init = (jnp.full((b, kvh, rows), -jnp.inf, jnp.float32),
          jnp.zeros((b, kvh, rows), jnp.float32), jnp.zeros((b, kvh, rows, d), jnp.float32))
  _, l, acc = jax.lax.fori_loop(lo, hi, body, init)
  o = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, KVH, T*r, D]
  o = jnp.transpose(o.reshape(b, kvh, t, r, d), (0, 2, 1, 3, 4))
  return o.reshape(b, t, h, d).astype(q.dtype)


# --- kernel ---------------------------------------------------------------------------


def _prefill_kernel(*refs, block_size: int, num_blocks: int, max_blocks: int, block_kv: int,
                    group: int, sliding_window: int | None, sm_scale: float, has_scale: bool,
                    cd):
  if has_scale:
    q_ref, bt_ref, start_ref, clen_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref = refs
  else:
    q_ref, bt_ref, start_ref, clen_ref, k_ref, v_ref, o_ref = refs
    ks_ref = vs_ref = None
  # q_ref,      # [block_q, head_dim]  rows = (query t, head j in group) -> t * group + j
  # bt_ref,     # [batch, max_blocks] int32 (whole array)
  # start_ref,  # [batch] int32 absolute position of query 0
  # clen_ref,   # [batch] int32 valid queries in the chunk
  # k_ref,      # [num_blocks * block_size, kv_heads, head_dim] (whole pool)
  # v_ref,      # [num_blocks * block_size, kv_heads, head_dim]
  # ks_ref,     # [num_blocks * block_size, kv_heads] f32 (FP8 only)
  # o_ref,      # [block_q, head_dim] normalised output
  b, h, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_q, d = q_ref.shape
  q = q_ref[...].astype(cd)
  start = start_ref[b]
  clen = clen_ref[b]
  row = tile * block_q + jnp.arange(block_q, dtype=jnp.int32)
  tq = row // group
  qpos = start + tq
  row_ok = tq < clen
  first_t = (tile * block_q) // group
  last_t = jnp.minimum(((tile + 1) * block_q - 1) // group, clen - 1)
  hi = jnp.where(first_t < clen, start + last_t + 1, 0)  # one past the last key needed
  # (keys past the table are none, as the reference's: the last page was read again)
  hi = jnp.minimum(hi, max_blocks * block_size)
  lo = jnp.int32(0)
  if sliding_window is not None:
    lo = jnp.maximum(start + first_t - sliding_window + 1, 0)
  n_steps = pl.cdiv(jnp.maximum(hi - lo, 0), block_kv)
  load = functools.partial(load_token_rows, block_size=block_size, num_blocks=num_blocks,
                           max_blocks=max_blocks)

  def body(i, carry):
    t = lo + i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
    kv_valid = t < hi
    k, ks = load(t, b, h, bt_ref, k_ref, ks_ref)
    v, vs = load(t, b, h, bt_ref, v_ref, vs_ref)
    mask = (t[None, :] <= qpos[:, None]) & row_ok[:, None] & kv_valid[None, :]
    if sliding_window is not None:
      mask &= t[None, :] > qpos[:, None] - sliding_window
    return attend_chunk(q, k, v, ks, vs, mask, kv_valid, carry, sm_scale=sm_scale, cd=cd)

  carry = (jnp.full((block_q,), NEG_INF, jnp.float32), jnp.zeros((block_q,), jnp.float32),
           jnp.zeros((block_q, d), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, n_steps, body, carry)
  o = acc / jnp.where(l > 0, l, 1.0)[:, None]
  o_ref[...] = o.astype(o_ref.dtype)


def paged_prefill_attention_pallas(q, k_pages, v_pages, block_tables, starts, chunk_lens,
                                   k_scale=None, v_scale=None, *,
                                   sliding_window: int | None = None,
                                   sm_scale: float | None = None, block_q: int | None = None,
                                   block_kv: int | None = None, num_warps: int = 4,
                                   num_stages: int = 2, interpret: bool = False):
  """q [B, T, H, D] -> [B, T, H, D]. Inputs assumed validated by the ops wrapper;
  k_scale/v_scale are [num_blocks, block_size, kv_heads] f32 or None."""
  b, t, h, d = q.shape
  nb, bs, kvh, _ = k_pages.shape
  mb = block_tables.shape[1]
  r = h // kvh
  sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
  n_rows = t * r
  bq = block_q or min(64, max(16, pl.next_power_of_2(n_rows)))
  bkv = block_kv or 32
  rows_p = pl.cdiv(n_rows, bq) * bq
  # [B, T, KVH, r, D] -> [B, KVH, T * r, D]: a tile's rows share one kv head.
  qg = jnp.moveaxis(q.reshape(b, t, kvh, r, d), 2, 1).reshape(b, kvh, n_rows, d)
  if rows_p != n_rows:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows_p - n_rows), (0, 0)))
  has_scale = k_scale is not None
  kernel = functools.partial(
      _prefill_kernel, block_size=bs, num_blocks=nb, max_blocks=mb, block_kv=bkv, group=r,
      sliding_window=sliding_window, sm_scale=sm_scale, has_scale=has_scale,
      cd=compute_dtype(q.dtype, k_pages.dtype))
  whole = pl.BlockSpec(memory_space=pl.ANY)
  tile_spec = pl.BlockSpec((None, None, bq, d), lambda i, j, s: (i, j, s, 0))
  in_specs = [tile_spec] + [whole] * 5
  args = [qg, block_tables.astype(jnp.int32), starts.astype(jnp.int32),
          chunk_lens.astype(jnp.int32), k_pages.reshape(nb * bs, kvh, d),
          v_pages.reshape(nb * bs, kvh, d)]
  if has_scale:
    in_specs += [whole, whole]
    args += [s.reshape(nb * bs, kvh).astype(jnp.float32) for s in (k_scale, v_scale)]
  o = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((b, kvh, rows_p, d), q.dtype),
      grid=(b, kvh, rows_p // bq),
      in_specs=in_specs,
      out_specs=tile_spec,
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="paged_prefill_attention",
  )(*args)
  o = o[:, :, :n_rows].reshape(b, kvh, t, r, d)
  return jnp.moveaxis(o, 1, 2).reshape(b, t, h, d)


def prefill_bytes_and_flops(batch: int, chunk: int, heads: int, kv_heads: int, head_dim: int,
                            start: int, kv_itemsize: int = 2, q_itemsize: int = 2):
  """Minimum HBM bytes and causal FLOPs of one prefill chunk per sequence."""
  ctx = start + chunk
  nbytes = 2 * batch * ctx * kv_heads * head_dim * kv_itemsize
  nbytes += 2 * batch * chunk * heads * head_dim * q_itemsize
  # Each query attends to start + its index + 1 keys on average.
  keys = chunk * start + chunk * (chunk + 1) // 2
  return nbytes, 4 * batch * heads * keys * head_dim
