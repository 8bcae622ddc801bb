"""`PagedLlama`: the controller's DecodeModel over the engine's paged KV cache.

Rows share blocks instead of holding copies: the n samples of a prompt hold
its blocks once (reference counts) plus blocks of their own for what they
write; a backtrack releases the blocks past the step start. The bookkeeping
is the engine's device-side `BlockState`, so it runs inside the controller's
jitted while_loop with no host sync.

  init_cache  zero pools ([NB, bs, KVH, D] per layer, NB below) and empty
              block tables [batch, MB], MB = ceil(length / bs)
  forward     1. every block the written span touches is made present and
                 private, in position order (`reserve_for_append` once per
                 block: a fresh block past the row's last, or a copy of a
                 shared one: copy-on-write); 2. `copy_blocks` for the copies;
              3. the Llama forward through `PagedKVCache.attend` (writes the
                 K/V through the tables, then paged attention). Only tokens up
                 to logits_at are written: later ones (prompt and probe
                 padding) cannot change the logits and would hold blocks
  prefill_rows  the rows release their blocks past their start (0, or the whole
              blocks of a prompt prefix shared from another row) and write their
              prompts from there into fresh ones
  copy_rows   dst rows release their blocks and take src's tables; each
              block's count rises by its new holders. Nothing is copied: the
              first write into a shared partial block copies it (step 1 above)
  truncate    `truncate_rows`: blocks wholly past the new length are released
  check       host side: raises `PagedCacheOverflow` if a write found no block

Pool size. With `num_blocks=None` the pool is sized from the `CachePlan` the
controller passes to `init_cache`, and a run always fits: a prefill row holds
at most ceil(prompt_tokens / bs) blocks, and a row sharing a prompt writes only
positions prompt_len - 1 .. prompt_len - 1 + new_tokens (the loop ends a row
at `max_generated` tokens; a probe reaches at most `probe_capacity` past the
end), so besides the shared prompt blocks it owns at most
ceil(new_tokens / bs) + 1 blocks at any time. NB = batch * ceil(prompt_tokens / bs)
+ rows * (ceil(new_tokens / bs) + 1). A fixed `num_blocks` (to cap memory
below that bound) may run out; then the write of the row that found no block
is dropped (that row only: no other row's blocks are touched), a sticky flag
is set, and `check`, which the controller calls after every loop call,
raises on the host with the pool size, so such a run's results are never
returned. The alternative, sizing the pool for every row filling `length`,
would hold more than the contiguous cache.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from o1jax.controller.decode_model import CacheConfig, CachePlan, ProgramKeyed, place_on_mesh
from o1jax.engine.kv_cache import (BlockState, PagedKVCache, copy_blocks, reserve_for_append,
                                   share_rows, truncate_rows)
from o1jax.model.llama import Llama, check_llama
from o1jax.sharding import tensor_parallel


class PagedCacheOverflow(RuntimeError):
  """The block pool ran out during a run: its results are incomplete."""


@flax.struct.dataclass
class PagedCache:
  """The pools plus the block bookkeeping of B rows (one pytree: the loop's carry)."""

  pages: PagedKVCache  # pools of every layer; its tables are the rows' (set per forward)
  blocks: BlockState  # tables [B, MB], used [B], lengths [B] (positions held), refcounts [NB]
  overflow: jax.Array  # [] bool: some write found no free block (sticky)
  peak_blocks: jax.Array  # [] i32: most blocks held at once

  @property
  def blocks_in_use(self) -> jax.Array:
    return jnp.sum(self.blocks.refcounts > 0).astype(jnp.int32)


def reserve_span(blocks: BlockState, starts: jax.Array, write_lens: jax.Array, t: int):
  """Makes the blocks of positions starts[b] .. starts[b] + write_lens[b] - 1 present
  and private to row b, block by block in position order.

  t: static bound on write_lens (the call's token count). A row fails (ok False,
  nothing reserved past the failure) when no block is free, when the span runs
  past its table, or when it starts past the row's held blocks (a gap).
  Returns (blocks, copy_src [N], copy_dst [N], ok [B]); dst = num_blocks: no copy."""
  bs = blocks.block_size
  nb, mb = blocks.num_blocks, blocks.tables.shape[1]
  b = starts.shape[0]
  starts = starts.astype(jnp.int32)
  end = starts + write_lens.astype(jnp.int32)
  ok = (end <= mb * bs) & (starts // bs <= blocks.used)
  held = blocks.lengths
  nt = (t + bs - 2) // bs + 1  # blocks a run of t tokens can touch

  def one_block(j, carry):
    blocks, ok, src, dst = carry
    pos = jnp.maximum(starts, (starts // bs + j) * bs)  # first position written in block j
    blocks, s, d, got = reserve_for_append(blocks.replace(lengths=pos), ok & (pos < end))
    return blocks, ok & got, src.at[j].set(s), dst.at[j].set(d)

  carry = (blocks, ok, jnp.zeros((nt, b), jnp.int32), jnp.full((nt, b), nb, jnp.int32))
  if nt <= 2:  # decode and probes: unrolled
    for j in range(nt):
      carry = one_block(j, carry)
  else:  # prefill: one compiled block step, not nt copies of it
    carry = jax.lax.fori_loop(0, nt, one_block, carry)
  blocks, ok, src, dst = carry
  return blocks.replace(lengths=held), src.reshape(-1), dst.reshape(-1), ok


class PagedLlama(ProgramKeyed):
  """`Llama` over the engine's `PagedKVCache` + `BlockState` (see the module doc).

  block_size: tokens per block. num_blocks: a fixed pool (None: sized from the
  controller's CachePlan so that a run always fits). kv_dtype: "float32",
  "bfloat16" or "float8_e4m3fn" (as the engine's EngineConfig.kv_dtype).
  mesh: a mesh with a "model" axis: weights and pools split by heads, block
  tables replicated (as the engine's; the controller runs its calls with the mesh set).
  Hash and equality are by the program's fields (`ProgramKeyed`: a valid static jit
  argument, shared by equal models)."""

  PROGRAM_FIELDS = ("graphdef", "config", "block_size", "num_blocks", "kv_dtype", "mesh")

  def __init__(self, model: Llama, block_size: int = 16, num_blocks: int | None = None,
               kv_dtype: str = "float32", mesh=None):
    check_llama(model, "PagedLlama")
    if num_blocks is not None and num_blocks < 1:
      raise ValueError(f"num_blocks={num_blocks} must be >= 1 (or None: sized from the plan)")
    CacheConfig("paged", block_size, num_blocks or 0, kv_dtype)  # the checks, in one place
    self.mesh, model = place_on_mesh(model, mesh)
    self.graphdef, self.params = nnx.split(model)
    self.config = model.config
    self.vocab_size = model.config.vocab_size
    self.block_size = int(block_size)
    self.num_blocks = num_blocks
    self.kv_dtype = kv_dtype

  def pool_blocks(self, batch: int, length: int, plan: CachePlan | None) -> int:
    """Blocks of the pool for `batch` prefill rows (see the module doc)."""
    if self.num_blocks is not None:
      return self.num_blocks
    per_row = math.ceil(length / self.block_size)
    if plan is None:  # nothing known: every row may fill its table, and no more rows come
      return batch * per_row
    prompt = math.ceil(plan.prompt_tokens / self.block_size)
    own = min(math.ceil(plan.new_tokens / self.block_size) + 1, per_row)
    prompts = batch if plan.prompts is None else plan.prompts
    return prompts * min(prompt, per_row) + plan.rows * own

  def init_cache(self, batch: int, length: int, plan: CachePlan | None = None) -> PagedCache:
    c = self.config
    mb = math.ceil(length / self.block_size)
    nb = self.pool_blocks(batch, length, plan)
    pages = PagedKVCache.create(c.n_layers, nb, self.block_size, c.n_kv_heads, c.head_dim,
                                self.kv_dtype, batch=batch, max_blocks=mb)
    if self.mesh is not None:
      pages = tensor_parallel.shard_pools(pages, self.mesh)
    zeros = lambda: jnp.zeros((batch,), jnp.int32)  # distinct buffers: the state is donated
    blocks = BlockState.create(jnp.zeros((batch, mb), jnp.int32), zeros(), zeros(),
                               jnp.zeros((nb,), jnp.int32), self.block_size)
    return PagedCache(pages=pages, blocks=blocks, overflow=jnp.zeros((), bool),
                      peak_blocks=jnp.zeros((), jnp.int32))

  def forward(self, params, cache: PagedCache, tokens, starts, logits_at):
    logits_at = logits_at.astype(jnp.int32)
    # Tokens past logits_at cannot change these logits: they are not written.
    return self._forward(params, cache, tokens, starts, logits_at, logits_at + 1)

  def forward_all(self, params, cache: PagedCache, tokens, starts, counts):
    # Only the first counts[b] tokens take blocks (padding drafts are not written). Each
    # query attends as a decode row (`PagedKVCache.decode_queries`): a verified position
    # gets the bits a plain step would give it, as in the engine.
    return self._forward(params, cache, tokens, starts, None, counts.astype(jnp.int32),
                         decode_queries=True)

  def _forward(self, params, cache: PagedCache, tokens, starts, logits_at, write_lens,
               decode_queries: bool = False):
    t = tokens.shape[1]
    starts = starts.astype(jnp.int32)
    blocks, src, dst, ok = reserve_span(cache.blocks, starts, write_lens, t)
    write_lens = jnp.where(ok, write_lens, 0)  # a row without its blocks writes nothing
    pages = copy_blocks(cache.pages, src, dst).for_batch(blocks.tables, write_lens,
                                                         decode_queries=decode_queries)
    model = nnx.merge(self.graphdef, params)
    logits, pages = model(tokens.astype(jnp.int32), starts, pages, logits_at=logits_at)
    pages = pages.replace(decode_queries=False)  # the loop's carry keeps one structure
    blocks = blocks.replace(lengths=jnp.maximum(blocks.lengths, starts + write_lens))
    return logits, self._note(cache.replace(pages=pages, blocks=blocks,
                                            overflow=cache.overflow | ~jnp.all(ok)))

  def prefill_rows(self, params, cache: PagedCache, rows, tokens, last, starts):
    """The rows release their blocks past `starts` (0, or a prompt prefix shared from
    another row), then the prompts are written from there through a view of those rows
    over the same pool (fresh blocks past a block-aligned start; padding rows write
    nothing)."""
    b = cache.blocks.tables.shape[0]
    rows = rows.astype(jnp.int32)
    real = rows < b
    at = jnp.minimum(rows, b - 1)
    starts = jnp.where(real, starts.astype(jnp.int32), 0)
    keep_all = jnp.full((b,), jnp.iinfo(jnp.int32).max, jnp.int32)
    blocks = truncate_rows(cache.blocks, keep_all.at[rows].set(starts, mode="drop"))
    row = lambda x: jnp.where(real.reshape((-1,) + (1,) * (x.ndim - 1)), x[at], 0)
    view = blocks.replace(tables=row(blocks.tables), used=row(blocks.used),
                          lengths=row(blocks.lengths))
    last = last.astype(jnp.int32)
    _, sub = self._forward(params, cache.replace(blocks=view), tokens, starts,
                           jnp.where(real, last, 0), jnp.where(real, last + 1, 0))
    put = lambda x, y: x.at[rows].set(y, mode="drop")
    blocks = blocks.replace(tables=put(blocks.tables, sub.blocks.tables),
                            used=put(blocks.used, sub.blocks.used),
                            lengths=put(blocks.lengths, sub.blocks.lengths),
                            refcounts=sub.blocks.refcounts)
    return sub.replace(blocks=blocks, pages=sub.pages.for_batch(blocks.tables,
                                                               jnp.zeros((b,), jnp.int32)))

  def copy_rows(self, cache: PagedCache, dst, src):
    """dst rows release their blocks and share src's (counts rise; nothing copied)."""
    blocks = share_rows(cache.blocks, dst, src)
    pages = cache.pages.for_batch(blocks.tables, jnp.zeros((blocks.tables.shape[0],), jnp.int32))
    return self._note(cache.replace(pages=pages, blocks=blocks))

  def truncate(self, cache: PagedCache, lengths):
    return cache.replace(blocks=truncate_rows(cache.blocks, lengths.astype(jnp.int32)))

  def check(self, cache: PagedCache) -> None:
    """Raises PagedCacheOverflow if a write found no block (one scalar to the host)."""
    if not bool(cache.overflow):
      return
    fix = ("raise num_blocks (a config's controller.num_blocks), or leave it None (0 in a "
           "config) to size the pool from the controller's plan"
           if self.num_blocks is not None else
           "pass the controller's CachePlan to init_cache, or set num_blocks")
    raise PagedCacheOverflow(
        f"the paged KV cache ran out of blocks: a pool of {cache.blocks.num_blocks} blocks of "
        f"{self.block_size} tokens was too small for this batch (or a write ran past a row's "
        f"block table); {fix}")

  @staticmethod
  def _note(cache: PagedCache) -> PagedCache:
    return cache.replace(peak_blocks=jnp.maximum(cache.peak_blocks, cache.blocks_in_use))

  # -- host-side accounting -----------------------------------------------------------

  def bytes_per_block(self) -> int:
    c = self.config
    probe = PagedKVCache.create(c.n_layers, 1, self.block_size, c.n_kv_heads, c.head_dim,
                                self.kv_dtype)
    return probe.bytes_per_block()
