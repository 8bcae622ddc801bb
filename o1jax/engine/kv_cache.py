"""Paged KV cache: a block pool per layer, addressed through per-sequence block tables.

Layout (one pool per layer, K and V separate, as `pallas_kernels.ops` expects):
  k_pages[i], v_pages[i]  [num_blocks, block_size, kv_heads, head_dim]
  k_scale[i], v_scale[i]  [num_blocks, block_size, kv_heads] f32, only for FP8 (e4m3) pools:
                          one scale per token and KV head
  block_tables            [batch, max_blocks] int32: logical block j of row b -> physical block
  write_lens              [batch] int32: how many of this call's T tokens are real

`PagedKVCache` is a pytree that implements the model's cache protocol
(`check_fits`, `attend`), so `Llama.__call__` runs unchanged on it. The host
(`allocator.BlockAllocator`) decides which physical blocks a sequence owns; the
functions at the bottom of this file (`share_rows`, `truncate_rows`,
`reserve_for_append`) do the same bookkeeping on device arrays so a
`jax.lax.while_loop` can fork, roll back and grow sequences without the host.

All functions here are pure and jittable.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels import ops as kernel_ops
from pallas_kernels import fp8_activations

FP8 = jnp.float8_e4m3fn
FP8_MAX = fp8_activations.FP8_MAX  # largest finite float8_e4m3fn
KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float8_e4m3fn": FP8}


# --- writes ------------------------------------------------------------------------


def token_slots(block_tables: jax.Array, starts: jax.Array, write_lens: jax.Array, t: int,
                block_size: int, num_blocks: int):
  """Physical (block, offset) of token t' of row b, at position starts[b] + t'.

  Returns (block [B, T], offset [B, T]); tokens t' >= write_lens[b], and tokens past
  the table's blocks (clamped onto its last block, they overwrote its earlier tokens),
  get block = num_blocks, which `.at[].set(mode="drop")` discards."""
  ts = jnp.arange(t, dtype=jnp.int32)
  pos = starts.astype(jnp.int32)[:, None] + ts[None, :]  # [B, T]
  logical = pos // block_size
  mb = block_tables.shape[1]
  block = jnp.take_along_axis(block_tables, jnp.clip(logical, 0, mb - 1), axis=1)
  valid = (ts[None, :] < write_lens[:, None]) & (logical < mb)
  return jnp.where(valid, block, num_blocks), pos % block_size


@jax.jit  # every layer writes the same shapes: one trace per program
def write_pages(pages: jax.Array, new: jax.Array, block_tables: jax.Array, starts: jax.Array,
                write_lens: jax.Array) -> jax.Array:
  """Scatters new K or V rows into a float pool.

  1. slot of each new token from the block table (`token_slots`);
  2. one write of the B*T rows (`pallas_kernels.ops.write_pool_rows`); padding
     rows are dropped.
  pages [NB, bs, KVH, D]; new [B, T, KVH, D]. Returns the updated pool."""
  nb, bs, kvh, d = pages.shape
  b, t = new.shape[:2]
  block, offset = token_slots(block_tables, starts, write_lens, t, bs, nb)
  return kernel_ops.write_pool_rows(pages, new.reshape(b * t, kvh, d), block.reshape(-1),
                                    offset.reshape(-1))


@jax.jit  # every layer writes the same shapes: one trace per program
def write_pages_fp8(pages: jax.Array, scale: jax.Array, new: jax.Array, block_tables: jax.Array,
                    starts: jax.Array, write_lens: jax.Array):
  """Writes new rows into an FP8 pool with one scale per (token, KV head): its largest
  magnitude over head_dim / 448.

  What a token stores depends on its own values only. (One scale per block made each
  write re-quantize its whole block, so a token's stored values depended on how the
  block's writes were grouped: the prefill chunk, speculation's verify writes,
  recompute after preemption, the batch's prefill budget.)
  pages [NB, bs, KVH, D] float8_e4m3fn; scale [NB, bs, KVH] f32; new [B, T, KVH, D].
  Returns (pages, scale)."""
  nb, bs, kvh, d = pages.shape
  b, t = new.shape[:2]
  block, offset = token_slots(block_tables, starts, write_lens, t, bs, nb)
  block, offset = block.reshape(-1), offset.reshape(-1)
  rows = new.astype(jnp.float32).reshape(b * t, kvh, d)
  row_scale = jnp.maximum(jnp.max(jnp.abs(rows), axis=-1) / FP8_MAX, 1e-12)  # [B*T, KVH]
  quant = (rows / row_scale[..., None]).astype(pages.dtype)
  pages = kernel_ops.write_pool_rows(pages, quant, block, offset)
  scale = kernel_ops.scatter_rows(scale, (block, offset), row_scale)
  return pages, scale


# --- attention ---------------------------------------------------------------------


# --- the cache pytree --------------------------------------------------------------


@flax.struct.dataclass
class PagedKVCache:
  """Block pools for every layer plus this call's block tables (see module doc).

  The pools persist across calls; `block_tables` / `write_lens` describe the
  batch of the next model call and are replaced with `for_batch` each step."""

  k_pages: tuple[jax.Array, ...]
  v_pages: tuple[jax.Array, ...]
  k_scale: tuple[jax.Array, ...] | None
  v_scale: tuple[jax.Array, ...] | None
  block_tables: jax.Array  # [B, MB] int32
  write_lens: jax.Array  # [B] int32
  # T > 1 calls that verify drafted tokens: every query attends as its own decode
  # row (`attend`), so a position gets the sums of one-token decoding, not prefill's.
  decode_queries: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def create(cls, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
             dtype=jnp.float32, batch: int = 1, max_blocks: int = 1) -> "PagedKVCache":
    """Zero-filled pools (finite garbage only: masked keys never make NaNs)."""
    dtype = KV_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    shape = (num_blocks, block_size, kv_heads, head_dim)
    fp8 = jnp.dtype(dtype) == jnp.dtype(FP8)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(n_layers))
    scales = lambda: tuple(jnp.ones(shape[:3], jnp.float32) for _ in range(n_layers))
    return cls(k_pages=zeros(), v_pages=zeros(), k_scale=scales() if fp8 else None,
               v_scale=scales() if fp8 else None,
               block_tables=jnp.zeros((batch, max_blocks), jnp.int32),
               write_lens=jnp.zeros((batch,), jnp.int32))

  @property
  def num_blocks(self) -> int:
    return self.k_pages[0].shape[0]

  @property
  def block_size(self) -> int:
    return self.k_pages[0].shape[1]

  @property
  def is_fp8(self) -> bool:
    return self.k_scale is not None

  def bytes_per_block(self) -> int:
    """K and V bytes of one block over all layers (plus FP8 scales)."""
    nb, bs, kvh, d = self.k_pages[0].shape
    per_layer = 2 * bs * kvh * d * jnp.dtype(self.k_pages[0].dtype).itemsize
    if self.is_fp8:
      per_layer += 2 * bs * kvh * 4  # a scale per token and KV head
    return per_layer * len(self.k_pages)

  def for_batch(self, block_tables: jax.Array, write_lens: jax.Array,
                decode_queries: bool = False) -> "PagedKVCache":
    """The same pools addressed by a new batch: tables [B, MB], write_lens [B].
    decode_queries: attend a T > 1 call's queries as decode rows (verification)."""
    return self.replace(block_tables=jnp.asarray(block_tables, jnp.int32),
                        write_lens=jnp.asarray(write_lens, jnp.int32),
                        decode_queries=decode_queries)

  def pools_only(self) -> "PagedKVCache":
    """The same pools with 1x1 placeholder tables. Steps return this, so the
    table width of one call never becomes part of the next call's jit signature."""
    return self.for_batch(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32))

  def check_fits(self, tokens_shape) -> None:
    b, t = tokens_shape
    rows, mb = self.block_tables.shape
    if b != rows:
      raise ValueError(f"tokens shape {tuple(tokens_shape)} has batch {b} but the paged cache's "
                       f"block tables have {rows} rows")
    if t > mb * self.block_size:
      raise ValueError(f"tokens shape {tuple(tokens_shape)}: {t} tokens do not fit {mb} blocks of "
                       f"{self.block_size}")

  def attend(self, layer: int, q, k, v, positions, starts, *, backend: str = "auto",
             interpret: bool = False, window: int | None = None):
    """Writes k/v into the pages, then attends q causally over the row's cache.

    window: a local (sliding-window) layer sees only its last `window` positions.
    Keys older than that stay in their blocks (masked, not freed): the pool holds
    every layer's full history, as the global layers need it anyway.

    1. write k, v [B, T, KVH, D] at positions starts[b].. through the block
       table (only the first write_lens[b] tokens; FP8: each under its own scale);
    2. T == 1 (decode): lengths = starts + write_lens; the paged decode op
       (`pallas_kernels.ops` picks Pallas on GPU, the native kernel on a CPU where
       it fits, else the XLA reference; backend "reference" forces that);
       T > 1 (chunked prefill): the paged prefill op (rows past write_lens -> 0);
       T > 1 with `decode_queries` (verifying drafts): each query as a decode row.
    q [B, T, H, D]; positions [B, T] (= starts[b] + t). Returns (out [B, T, H, D], cache)."""
    del positions  # = starts + arange(T); the write and the ops derive it
    tables, lens = self.block_tables, self.write_lens
    starts = starts.astype(jnp.int32)
    if self.is_fp8:
      kp, ks = write_pages_fp8(self.k_pages[layer], self.k_scale[layer], k, tables, starts, lens)
      vp, vs = write_pages_fp8(self.v_pages[layer], self.v_scale[layer], v, tables, starts, lens)
    else:
      kp = write_pages(self.k_pages[layer], k, tables, starts, lens)
      vp = write_pages(self.v_pages[layer], v, tables, starts, lens)
      ks = vs = None
    b, t, h, d = q.shape
    if t == 1:
      out = self._decode_attention(q[:, 0], kp, vp, tables, starts + lens, ks, vs, backend,
                                   interpret, window)[:, None]
    elif self.decode_queries:
      # Query t of row b sees positions < starts[b] + t + 1 (its own and the earlier
      # drafts'), through the kernel one-token decoding uses: the same sums per query.
      upto = jnp.minimum(jnp.arange(1, t + 1, dtype=jnp.int32)[None, :],
                         jnp.maximum(lens, 1)[:, None])
      lengths = jnp.where(lens[:, None] > 0, starts[:, None] + upto, 0).reshape(b * t)
      out = self._decode_attention(q.reshape(b * t, h, d), kp, vp, jnp.repeat(tables, t, axis=0),
                                   lengths, ks, vs, backend, interpret,
                                   window).reshape(b, t, h, d)
    else:
      out = kernel_ops.paged_prefill_attention(q, kp, vp, tables, starts, lens, k_scale=ks,
                                               v_scale=vs, sliding_window=window,
                                               backend=backend, interpret=interpret)
    replace = lambda xs, x: xs[:layer] + (x,) + xs[layer + 1:]
    new = self.replace(k_pages=replace(self.k_pages, kp), v_pages=replace(self.v_pages, vp))
    if self.is_fp8:
      new = new.replace(k_scale=replace(self.k_scale, ks), v_scale=replace(self.v_scale, vs))
    return out, new

  def _decode_attention(self, q, kp, vp, tables, lengths, ks, vs, backend: str, interpret: bool,
                        window: int | None = None):
    """One query per row ([R, H, D]) over its paged keys < lengths[r], the last `window`
    of them for a local layer (`pallas_kernels.ops.paged_decode_attention` picks the
    kernel; the native CPU one has no window, so local layers take the reference)."""
    return kernel_ops.paged_decode_attention(q, kp, vp, tables, lengths, k_scale=ks, v_scale=vs,
                                             sliding_window=window, backend=backend,
                                             interpret=interpret)


def copy_blocks(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
  """Copy-on-write: block src[i] -> dst[i] in every layer (dst = num_blocks: no-op).

  src, dst [N] int32 (pad with dst = num_blocks to keep N a fixed bucket)."""
  src = jnp.clip(src, 0, cache.num_blocks - 1)
  cp = lambda pools: tuple(kernel_ops.write_pool_blocks(p, dst, p[src]) for p in pools)
  new = cache.replace(k_pages=cp(cache.k_pages), v_pages=cp(cache.v_pages))
  if cache.is_fp8:
    new = new.replace(k_scale=cp(cache.k_scale), v_scale=cp(cache.v_scale))
  return new


# --- block bookkeeping on device arrays (for jit / while_loop) ----------------------


@flax.struct.dataclass
class BlockState:
  """Block tables, lengths and reference counts as device arrays.

  tables [S, MB] int32 (entries past `used` are 0 and meaningless);
  used [S] int32 blocks held per row; lengths [S] int32 tokens in the cache;
  refcounts [NB] int32 (0 = free). Blocks the host's prefix cache keeps must
  carry a count of at least 1 here so the device allocator never takes them."""

  tables: jax.Array
  used: jax.Array
  lengths: jax.Array
  refcounts: jax.Array
  block_size: int = flax.struct.field(pytree_node=False, default=16)

  @classmethod
  def create(cls, tables, used, lengths, refcounts, block_size: int) -> "BlockState":
    return cls(tables=jnp.asarray(tables, jnp.int32), used=jnp.asarray(used, jnp.int32),
               lengths=jnp.asarray(lengths, jnp.int32),
               refcounts=jnp.asarray(refcounts, jnp.int32), block_size=int(block_size))

  @property
  def num_blocks(self) -> int:
    return self.refcounts.shape[0]


def _add_refs(refcounts: jax.Array, tables: jax.Array, mask: jax.Array, amount) -> jax.Array:
  nb = refcounts.shape[0]
  ids = jnp.where(mask, tables, nb).reshape(-1)
  return refcounts.at[ids].add(jnp.broadcast_to(amount, ids.shape).astype(refcounts.dtype),
                               mode="drop")


def add_row_refs(refcounts: jax.Array, tables: jax.Array, used: jax.Array, amount) -> jax.Array:
  """refcounts + amount for every block the rows hold (tables [S, MB], used [S])."""
  held = jnp.arange(tables.shape[1], dtype=jnp.int32)[None, :] < used[:, None]
  return _add_refs(refcounts, tables, held, amount)


def share_rows(state: BlockState, dst: jax.Array, src: jax.Array) -> BlockState:
  """Rows `dst` [C] release their blocks and become copies of rows `src` [C], sharing
  their blocks (each shared block's count rises; nothing is copied). A `dst` past the
  last row is padding and changes nothing. The last partial block is shared too:
  `reserve_for_append` copies it on the first write (copy-on-write)."""
  b = state.tables.shape[0]
  dst, src = dst.astype(jnp.int32), jnp.minimum(src.astype(jnp.int32), b - 1)
  real = dst < b
  d = jnp.minimum(dst, b - 1)
  refcounts = add_row_refs(state.refcounts, state.tables[d], jnp.where(real, state.used[d], 0), -1)
  refcounts = add_row_refs(refcounts, state.tables[src], jnp.where(real, state.used[src], 0), 1)
  put = lambda x: x.at[dst].set(x[src], mode="drop")
  return state.replace(tables=put(state.tables), used=put(state.used),
                       lengths=put(state.lengths), refcounts=refcounts)


def truncate_rows(state: BlockState, new_lengths: jax.Array) -> BlockState:
  """Rolls rows back to new_lengths [S] (<= lengths; larger values are ignored).

  Blocks wholly past the new length are released; the kept partial block stays
  (if shared, the next write copies it)."""
  new_lengths = jnp.minimum(new_lengths, state.lengths)
  block_size = state.block_size
  keep = (new_lengths + block_size - 1) // block_size
  keep = jnp.minimum(keep, state.used)
  idx = jnp.arange(state.tables.shape[1], dtype=jnp.int32)[None, :]
  drop = (idx >= keep[:, None]) & (idx < state.used[:, None])
  refcounts = _add_refs(state.refcounts, state.tables, drop, -1)
  return state.replace(used=keep, lengths=new_lengths, refcounts=refcounts,
                       tables=jnp.where(drop, 0, state.tables))


def reserve_for_append(state: BlockState, append: jax.Array):
  """Makes room for one more token in each row where append [S] is True.

  A row needs a fresh block when its next position starts a new block, or when
  the block it writes into is shared (count > 1: copy-on-write). Fresh blocks
  are the lowest-numbered free ones, handed out in row order.
  Returns (state, copy_src [S], copy_dst [S], ok [S]): pass copy_src/copy_dst
  to `copy_blocks` (dst = num_blocks: nothing to copy); ok is False where no
  block was free (the caller must preempt or stop). Lengths are not advanced."""
  s, mb = state.tables.shape
  nb = state.num_blocks
  block_size = state.block_size
  pos = state.lengths
  logical = pos // block_size
  fresh = append & (logical >= state.used)
  cur = jnp.take_along_axis(state.tables, jnp.clip(logical, 0, mb - 1)[:, None], axis=1)[:, 0]
  shared = append & ~fresh & (state.refcounts[cur] > 1)
  need = (fresh | shared) & (logical < mb)
  rank = jnp.cumsum(need.astype(jnp.int32)) - 1
  free_ids = jnp.nonzero(state.refcounts == 0, size=s, fill_value=nb)[0]
  got = jnp.where(need, free_ids[jnp.clip(rank, 0, s - 1)], nb)
  ok = ~need | (got < nb)
  take = need & ok
  refcounts = state.refcounts.at[jnp.where(take, got, nb)].add(1, mode="drop")
  refcounts = refcounts.at[jnp.where(take & shared, cur, nb)].add(-1, mode="drop")
  rows = jnp.arange(s)
  tables = state.tables.at[jnp.where(take, rows, s), jnp.clip(logical, 0, mb - 1)].set(
      got, mode="drop")
  used = jnp.where(take & fresh, state.used + 1, state.used)
  copy_src = jnp.where(take & shared, cur, 0)
  copy_dst = jnp.where(take & shared, got, nb)
  new = state.replace(tables=tables, used=used, refcounts=refcounts)
  return new, copy_src, copy_dst, ok
