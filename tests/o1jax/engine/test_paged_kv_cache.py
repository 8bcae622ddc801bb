"""The paged cache against the contiguous KVCache, and its block bookkeeping.

Tolerance: paged and contiguous attention sum the same f32 products in a
different order (gathered pages, multiply-then-sum vs a dot), so logits agree
to ~1e-5 relative; we assert atol 2e-4 on logits of magnitude <~ 10."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from o1jax.engine import BlockAllocator, BlockState, OutOfBlocks, PagedKVCache, copy_blocks
from o1jax.engine import reserve_for_append, share_rows, truncate_rows
from o1jax.engine.kv_cache import write_pages, write_pages_fp8
from pallas_kernels import native
from pallas_kernels.paged_attention import gather_kv
from o1jax.model import KVCache

ATOL = 2e-4


def _paged(config, num_blocks, block_size, dtype="float32"):
  return PagedKVCache.create(config.n_layers, num_blocks, block_size, config.n_kv_heads,
                             config.head_dim, dtype)


_JITTED = {}


def _jitted(model):
  """model(tokens, starts, cache) jitted with the parameters passed in (fast tests)."""
  if id(model) not in _JITTED:
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, t, s, c: nnx.merge(graphdef, st)(t, s, c))
    _JITTED[id(model)] = lambda t, s, c: fn(state, t, s, c)
  return _JITTED[id(model)]


def _reference_logits(model, tokens):
  """All-position logits of each row run alone through a contiguous cache. tokens [B, T]."""
  cache = KVCache.zeros(model.config, tokens.shape[0], 128)
  logits, _ = _jitted(model)(jnp.asarray(tokens), jnp.zeros((tokens.shape[0],), jnp.int32), cache)
  return np.asarray(logits)


def test_chunked_prefill_and_decode_match_contiguous(tiny):
  model, bs = tiny.model, 4
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 259, size=(2, 29)).astype(np.int32)
  ref = _reference_logits(model, tokens)
  # Scattered, non-contiguous physical blocks per row.
  perm = rng.permutation(40).astype(np.int32)
  tables = np.stack([perm[:8], perm[8:16]])
  cache = _paged(model.config, 40, bs)
  start = 0
  for chunk in (9, 8, 7):  # chunked prefill, chunk boundaries not block-aligned
    cache = cache.for_batch(tables, np.full(2, chunk, np.int32))
    logits, cache = _jitted(model)(jnp.asarray(tokens[:, start:start + chunk]),
                          jnp.full((2,), start, jnp.int32), cache)
    np.testing.assert_allclose(np.asarray(logits), ref[:, start:start + chunk], atol=ATOL)
    start += chunk
  for t in range(start, 29):  # decode one token at a time
    cache = cache.for_batch(tables, np.ones(2, np.int32))
    logits, cache = _jitted(model)(jnp.asarray(tokens[:, t:t + 1]), jnp.full((2,), t, jnp.int32), cache)
    np.testing.assert_allclose(np.asarray(logits)[:, 0], ref[:, t], atol=ATOL)


def test_padding_rows_write_nothing(tiny):
  model = tiny.model
  cache = _paged(model.config, 8, 4)
  tokens = jnp.asarray(np.arange(3, 11, dtype=np.int32).reshape(1, 8))
  cache = cache.for_batch(np.array([[0, 1]], np.int32), np.array([5], np.int32))
  _, cache = model(tokens, jnp.zeros((1,), jnp.int32), cache)
  k0 = np.asarray(cache.k_pages[0])
  assert np.abs(k0[0]).sum() > 0 and np.abs(k0[1, 0]).sum() > 0  # positions 0..4 written
  assert np.abs(k0[1, 1:]).sum() == 0 and np.abs(k0[2:]).sum() == 0  # 5..7 are padding


def _fp8_rows(x):
  """An independent FP8 quantization (ml_dtypes' e4m3, numpy): per (token, head) scale
  max |x| / 448 over head_dim; returns the values the pool represents."""
  import ml_dtypes
  scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True) / 448.0, 1e-12).astype(np.float32)
  q = (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  return q * scale


def test_fp8_writes_store_each_token_under_its_own_scale():
  """Writes of 11 tokens into FP8 pages, grouped three ways: the pools hold the same
  bits (what a token stores does not depend on how the writes were grouped), what an
  independent per-token quantization gives, within e4m3's precision of the f32 values."""
  rng = np.random.default_rng(0)
  new = rng.standard_normal((2, 11, 2, 8)).astype(np.float32)
  new *= np.array([1.0, 30.0], np.float32)[:, None, None, None]
  tables = np.array([[3, 1, 0], [2, 5, 4]], np.int32)
  pools = []
  for groups in ([(0, 11)], [(0, 5), (5, 1), (6, 5)], [(i, 1) for i in range(11)]):
    pages, scale = jnp.zeros((6, 4, 2, 8), jnp.float8_e4m3fn), jnp.ones((6, 4, 2))
    for start, n in groups:
      chunk = jnp.asarray(new[:, start:start + n])
      pages, scale = write_pages_fp8(pages, scale, chunk, tables, jnp.full(2, start),
                                     jnp.full(2, n))
    pools.append((np.asarray(pages).view(np.uint8), np.asarray(scale)))
  for pages, scale in pools[1:]:
    np.testing.assert_array_equal(pages, pools[0][0])
    np.testing.assert_array_equal(scale, pools[0][1])
  got = np.asarray(gather_kv(jnp.asarray(pools[0][0].view(jnp.float8_e4m3fn)),
                             jnp.asarray(pools[0][1]), tables))[:, :11]
  np.testing.assert_allclose(got, _fp8_rows(new), rtol=1e-6)  # (XLA's f32 division: 1 ulp)
  # e4m3 has 3 mantissa bits: relative error per value <= 1/16, ~2-3% in norm.
  assert np.linalg.norm(got - new) / np.linalg.norm(new) < 0.04


def test_fp8_pool_logits_close_to_f32(tiny):
  model = tiny.model
  rng = np.random.default_rng(1)
  tokens = rng.integers(3, 259, size=(1, 21)).astype(np.int32)
  ref = _reference_logits(model, tokens)
  tables = np.array([[5, 2, 7, 0, 3, 1]], np.int32)
  cache = _paged(model.config, 8, 4, "float8_e4m3fn")
  cache = cache.for_batch(tables, np.array([21], np.int32))
  logits, cache = model(jnp.asarray(tokens), jnp.zeros((1,), jnp.int32), cache)
  got, want = np.asarray(logits)[0], ref[0]
  assert cache.k_pages[0].dtype == jnp.float8_e4m3fn
  # ~2.5% KV error grows through the layers of this random model; f32 pools give 1e-6.
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.2


def test_fork_cow_and_truncate_on_device_match_contiguous(tiny):
  """Row 0 holds a 10-token prompt (block size 4: 2 full blocks + a partial one).

  1. fork rows 1, 2 from row 0 -> all blocks shared (count 3);
  2. each row appends its own 4 tokens: the first write into the shared partial
     block copies it (copy-on-write), later ones take fresh blocks;
  3. row 1 is truncated back to 11 tokens and appends different tokens.
  Every row's logits must equal a contiguous run of its own token sequence."""
  model, bs, nb = tiny.model, 4, 16
  rng = np.random.default_rng(2)
  prompt = rng.integers(3, 259, size=10).astype(np.int32)
  cache = _paged(model.config, nb, bs)
  state = BlockState.create(np.zeros((3, 8)), np.zeros(3), np.zeros(3), np.zeros(nb), bs)
  state = state.replace(tables=state.tables.at[0, :3].set(jnp.array([9, 4, 6])),
                        used=state.used.at[0].set(3), lengths=state.lengths.at[0].set(10),
                        refcounts=state.refcounts.at[jnp.array([9, 4, 6])].set(1))
  cache = cache.for_batch(state.tables[:1], np.array([10], np.int32))
  _, cache = model(jnp.asarray(prompt[None]), jnp.zeros((1,), jnp.int32), cache)

  state = jax.jit(share_rows)(state, jnp.array([1, 2], jnp.int32), jnp.array([0, 0], jnp.int32))
  assert np.asarray(state.refcounts)[[9, 4, 6]].tolist() == [3, 3, 3]
  seqs = [list(prompt) for _ in range(3)]
  extra = rng.integers(3, 259, size=(3, 6)).astype(np.int32)

  def append(rows_tokens, active):
    nonlocal state, cache
    state, src, dst, ok = jax.jit(reserve_for_append)(state, jnp.asarray(active))
    assert bool(np.all(np.asarray(ok)))
    cache = copy_blocks(cache, src, dst)
    pos = np.asarray(state.lengths)
    cache = cache.for_batch(state.tables, np.asarray(active, np.int32))
    logits, cache = _jitted(model)(jnp.asarray(rows_tokens[:, None]), jnp.asarray(pos * active), cache)
    state = state.replace(lengths=state.lengths + jnp.asarray(active, jnp.int32))
    return np.asarray(logits)[:, 0]

  all_rows = np.ones(3, bool)
  for step in range(4):
    logits = append(extra[:, step], all_rows)
    for r in range(3):
      seqs[r].append(int(extra[r, step]))
      want = _reference_logits(model, np.array([seqs[r]], np.int32))[0, -1]
      np.testing.assert_allclose(logits[r], want, atol=ATOL)
  counts = np.asarray(state.refcounts)
  assert counts[6] == 1 and counts[9] == 3 and counts[4] == 3  # partial block was copied twice

  before = int(np.sum(np.asarray(state.refcounts) > 0))
  state = jax.jit(truncate_rows)(state, jnp.array([14, 11, 14], jnp.int32))
  assert int(np.asarray(state.lengths)[1]) == 11 and int(np.asarray(state.used)[1]) == 3
  assert int(np.sum(np.asarray(state.refcounts) > 0)) == before - 1  # row 1's 4th block freed
  seqs[1] = seqs[1][:11]
  only_row1 = np.array([False, True, False])
  for step in range(4, 6):
    logits = append(extra[:, step], only_row1)
    seqs[1].append(int(extra[1, step]))
    want = _reference_logits(model, np.array([seqs[1]], np.int32))[0, -1]
    np.testing.assert_allclose(logits[1], want, atol=ATOL)


def test_reserve_reports_out_of_blocks():
  state = BlockState.create(np.zeros((2, 4)), np.zeros(2), np.zeros(2), np.array([1, 1, 0]), 4)
  state, _, _, ok = reserve_for_append(state, jnp.array([True, True]))
  assert np.asarray(ok).tolist() == [True, False]  # one free block, two rows asking
  assert np.asarray(state.tables)[0, 0] == 2 and np.asarray(state.refcounts).tolist() == [1, 1, 1]


def test_allocator_counts_prefix_cache_and_eviction():
  alloc = BlockAllocator(4, 2)
  a, b = alloc.allocate(), alloc.allocate()
  tokens = [5, 6, 7, 8, 9]
  alloc.register_prefix(tokens, [a, b], n_computed=4)  # two full blocks of 2
  alloc.free_all([a, b])
  assert alloc.num_free == 4 and alloc.num_used == 0  # parked, still reusable
  assert alloc.cached_prefix([5, 6, 7, 8, 1], limit=4) == 2
  assert alloc.cached_prefix([5, 6, 0, 0], limit=4) == 1
  assert alloc.num_free == 4 and alloc.refcounts.tolist() == [0] * 4  # counting takes nothing
  hit = alloc.match_prefix([5, 6, 7, 8, 1], limit=4)
  assert hit == [a, b] and alloc.refcounts[a] == 1
  assert alloc.match_prefix([5, 6, 0, 0], limit=4) == [a]  # second block differs
  assert alloc.refcounts[a] == 2
  alloc.free_all([a, b, a])
  # Exhaust: 2 free + 2 parked (evicted LRU-first), then nothing.
  got = [alloc.allocate() for _ in range(4)]
  assert sorted(got) == [0, 1, 2, 3]
  assert alloc.match_prefix(tokens, limit=4) == []  # evicted blocks left the cache
  with pytest.raises(OutOfBlocks):
    alloc.allocate()
  with pytest.raises(AssertionError):
    alloc.free_all(got + [got[0]])


@pytest.mark.parametrize("pairs", [1, 3])
def test_copy_blocks_copies_only_the_named_blocks(pairs):
  """One pair is padded internally (a one-row XLA scatter may rewrite the whole
  pool); dst = num_blocks is a no-op either way."""
  rng = np.random.default_rng(0)
  cache = PagedKVCache.create(2, 6, 4, 2, 8)
  fill = lambda pools: tuple(jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for p in pools)
  cache = cache.replace(k_pages=fill(cache.k_pages), v_pages=fill(cache.v_pages))
  src = jnp.array([2, 5, 0][:pairs], jnp.int32)
  dst = jnp.array([4, 6, 1][:pairs], jnp.int32)  # 6 = num_blocks: dropped
  out = jax.jit(copy_blocks)(cache, src, dst)
  for before, after in zip(cache.k_pages + cache.v_pages, out.k_pages + out.v_pages):
    want = np.asarray(before).copy()
    for s, d in zip(np.asarray(src), np.asarray(dst)):
      if d < 6:
        want[d] = np.asarray(before)[s]
    np.testing.assert_array_equal(np.asarray(after), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("n_rows", [1, 3])
def test_scatter_rows_copies_exact_bits_and_drops_out_of_range(dtype, n_rows):
  from pallas_kernels.ops import scatter_rows

  rng = np.random.default_rng(n_rows)
  pool = jnp.asarray(rng.standard_normal((10, 4, 2, 3)), dtype)
  rows = jnp.asarray(rng.standard_normal((n_rows, 4, 2, 3)), dtype)
  dst = np.array([7, 10, 2][:n_rows], np.int32)  # 10: past the pool, dropped
  got = np.asarray(jax.jit(lambda p, r, d: scatter_rows(p, (d,), r))(pool, rows, jnp.asarray(dst)))
  want = np.asarray(pool).copy()
  for i, d in enumerate(dst):
    if d < 10:
      want[d] = np.asarray(rows)[i]
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_copy_blocks_copies_exact_blocks_and_skips_dropped(dtype):
  cache = PagedKVCache.create(2, 12, 4, 2, 3, dtype)
  rng = np.random.default_rng(0)
  fill = lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype)
  cache = cache.replace(k_pages=tuple(map(fill, cache.k_pages)),
                        v_pages=tuple(map(fill, cache.v_pages)))
  src, dst = jnp.asarray([3, 5, 0], jnp.int32), jnp.asarray([7, 12, 1], jnp.int32)  # 12: dropped
  out = jax.jit(copy_blocks)(cache, src, dst)
  for before, after in zip(cache.k_pages + cache.v_pages, out.k_pages + out.v_pages):
    want = np.asarray(before).copy()
    want[7], want[1] = want[3], want[0]
    np.testing.assert_array_equal(np.asarray(after).view(np.uint8), want.view(np.uint8))


@pytest.mark.skipif(not native.available(), reason="native kernels not built here")
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_copy_blocks_never_converts_the_whole_pool(dtype):
  """XLA's CPU scatter converts a bf16 or FP8 pool to f32 and back around the
  update; copy_blocks must not (the controller calls it in every decode step)."""
  cache = PagedKVCache.create(1, 440, 16, 3, 64, dtype)
  f = jax.jit(copy_blocks)
  hlo = f.lower(cache, jnp.arange(4, dtype=jnp.int32), jnp.arange(4, 8, dtype=jnp.int32))
  hlo = hlo.compile().as_text()
  # A fusion whose result is the pool in f32 is a whole-pool conversion; an f32
  # convert inside a gather fusion only touches the gathered blocks.
  whole = re.findall(r"= f32\[440,16,3,64\]\{[^}]*\} (?:fusion|scatter)\(", hlo)
  assert not whole, whole


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_writes_past_the_block_table_are_dropped(dtype):
  """A 3-block table of block size 3 holds 9 positions; 4 tokens written at 8 put the
  last 3 past it. They are dropped: they used to land on the last block's slots 0 and 1
  (the table index clamped), overwriting positions 6 and 7."""
  cache = PagedKVCache.create(1, 6, 3, 1, 2, dtype, batch=1, max_blocks=3)
  tables = jnp.asarray([[4, 2, 5]], jnp.int32)
  first = jnp.arange(1.0, 17.0).reshape(1, 8, 1, 2)  # positions 0..7
  later = jnp.full((1, 4, 1, 2), 99.0)  # positions 8..11
  k, s = cache.k_pages[0], cache.k_scale[0] if cache.is_fp8 else None
  for new, start in ((first, 0), (later, 8)):
    starts, lens = jnp.asarray([start]), jnp.asarray([new.shape[1]])
    if cache.is_fp8:
      k, s = write_pages_fp8(k, s, new, tables, starts, lens)
    else:
      k = write_pages(k, new, tables, starts, lens)
  got = np.asarray(gather_kv(k, s, tables))[0, :, 0]
  np.testing.assert_allclose(got[:8], np.asarray(first)[0, :, 0], rtol=0.07)  # e4m3: 3 bits
  np.testing.assert_array_equal(got[8], [99.0, 99.0])
