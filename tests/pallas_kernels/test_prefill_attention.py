"""Chunked prefill attention: reference by hand, kernel vs reference, CUDA lowering, validation."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from tests.pallas_kernels.kernel_testing import lowers_for_cuda, make_paged_cache, rel_err, tol_for
from pallas_kernels import ops
from pallas_kernels.prefill_attention import (paged_prefill_attention_blocked,
                                              paged_prefill_attention_reference)

NAN = float("nan")


class TestReference:

  def _cache(self):
    # block_size 2; sequence 0 uses blocks [2, 0]: k0=[1,0] k1=[0,1] k2=[1,1],
    # v0=[1,0] v1=[0,5] v2=[2,0]; every other slot is NaN garbage.
    k = np.full((3, 2, 1, 2), NAN, np.float32)
    v = np.full((3, 2, 1, 2), NAN, np.float32)
    k[2, 0, 0], k[2, 1, 0], k[0, 0, 0] = [1, 0], [0, 1], [1, 1]
    v[2, 0, 0], v[2, 1, 0], v[0, 0, 0] = [1, 0], [0, 5], [2, 0]
    return jnp.asarray(k), jnp.asarray(v), jnp.asarray([[2, 0], [1, 1]], jnp.int32)

  def test_causal_chunk_by_hand(self):
    # Chunk of 2 real queries at positions 1, 2 (start 1), plus one padding row.
    # q = [ln2, 0], sm_scale 1 -> scores vs k0, k1, k2 = ln2, 0, ln2.
    # pos 1: keys k0, k1, weights [2, 1] / 3 -> o = (2*[1,0] + [0,5]) / 3 = [2/3, 5/3]
    # pos 2: keys k0..k2, weights [2, 1, 2] / 5 -> o = [1.2, 1.0]
    # padding row and the empty sequence 1 -> 0.
    k, v, bt = self._cache()
    q = jnp.tile(jnp.asarray([math.log(2), 0.0], jnp.float32), (2, 3, 1, 1))
    o = paged_prefill_attention_reference(q, k, v, bt, jnp.asarray([1, 0]), jnp.asarray([2, 0]),
                                          sm_scale=1.0)
    want = np.zeros((2, 3, 1, 2), np.float32)
    want[0, 0, 0], want[0, 1, 0] = [2 / 3, 5 / 3], [1.2, 1.0]
    np.testing.assert_allclose(np.asarray(o), want, rtol=1e-6, atol=1e-7)

  def test_sliding_window_by_hand(self):
    # window 1: each query sees only itself. pos 1 -> v1 = [0,5]; pos 2 -> v2 = [2,0].
    k, v, bt = self._cache()
    q = jnp.ones((1, 2, 1, 2), jnp.float32)
    o = paged_prefill_attention_reference(q, k, v, bt[:1], jnp.asarray([1]), jnp.asarray([2]),
                                          sliding_window=1)
    np.testing.assert_allclose(np.asarray(o)[0, :, 0], [[0, 5], [2, 0]], rtol=1e-6)

  def test_last_row_matches_decode(self):
    # The last query of a chunk is exactly a decode step at length start + chunk_len.
    rng = np.random.default_rng(3)
    kp, vp, bt, _, _ = make_paged_cache(rng, 2, 2, 16, 8, 4, [29, 11], jnp.float32)
    q = jnp.asarray(rng.normal(size=(2, 5, 4, 16)), jnp.float32)
    starts, clens = jnp.asarray([24, 6], jnp.int32), jnp.asarray([5, 5], jnp.int32)
    o = ops.paged_prefill_attention(q, kp, vp, bt, starts, clens, backend="reference")
    d = ops.paged_decode_attention(q[:, -1], kp, vp, bt, starts + clens, backend="reference")
    np.testing.assert_allclose(np.asarray(o[:, -1]), np.asarray(d), rtol=1e-5, atol=1e-6)


def case_inputs(case, seed: int, spare_blocks: int):
  """(q, pools, tables, starts, chunk_lens) and the cache kwargs of a sweep case."""
  b, t, h, kvh, d, bs, starts, clens, dtype, scale_shape, window, _ = case
  rng = np.random.default_rng(sum(starts) + t + h + seed)
  used = [s + c for s, c in zip(starts, clens)]
  max_blocks = -(-max(used) // bs) + spare_blocks
  kp, vp, bt, ks, vs = make_paged_cache(rng, b, kvh, d, bs, max_blocks, used, dtype,
                                        scale_shape is not None, scale_shape)
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
  args = (q, kp, vp, bt, jnp.asarray(starts, jnp.int32), jnp.asarray(clens, jnp.int32))
  return args, dict(k_scale=ks, v_scale=vs, sliding_window=window)


def assert_like_reference(got, args, kw, case, tol: float) -> None:
  """q's shape and dtype, finite, zero padding rows, and within tol of the reference."""
  q, clens = args[0], case[7]
  assert got.shape == q.shape and got.dtype == q.dtype
  got32 = np.asarray(got, np.float32)
  assert np.all(np.isfinite(got32))
  for i, c in enumerate(clens):
    np.testing.assert_array_equal(got32[i, c:], 0.0)  # padding rows
  assert rel_err(got, ops.paged_prefill_attention(*args, backend="reference", **kw)) <= tol


# (batch, T, heads, kv_heads, D, block_size, starts, chunk_lens, dtype, fp8 scales, window, block_q)
SWEEP = [
    (2, 5, 4, 4, 32, 16, [0, 11], [5, 5], jnp.float32, None, None, 16),  # GQA 1, full prefill
    (2, 6, 6, 2, 16, 8, [8, 0], [6, 0], jnp.bfloat16, None, None, 16),  # GQA 3, empty seq
    (1, 4, 8, 1, 32, 16, [12], [4], jnp.float16, None, None, 16),  # GQA 8, ends on boundary
    (2, 7, 2, 1, 32, 16, [1, 20], [3, 7], jnp.float32, None, 9, 16),  # window, padded rows
    (2, 4, 6, 2, 32, 16, [30, 0], [4, 1], jnp.bfloat16, ("nb", 2), None, 32),  # FP8, len 1
    (1, 3, 4, 2, 16, 32, [40], [3], jnp.float32, (1, 2), 20, 16),  # FP8 per head + window
    (2, 5, 4, 2, 32, 16, [13, 0], [5, 3], jnp.bfloat16, ("nb", 16, 2), None, 16),  # FP8 per token
]


@pytest.mark.gpu_only
class TestPagedPrefillKernel:
  INTERPRET = False

  @pytest.mark.parametrize("case", SWEEP)
  def test_matches_reference(self, case):
    args, kw = case_inputs(case, seed=0, spare_blocks=1)
    got = ops.paged_prefill_attention(*args, backend="pallas", interpret=self.INTERPRET,
                                      block_q=case[-1], block_kv=16, **kw)
    assert_like_reference(got, args, kw, case, tol_for(case[8]))


class TestPagedPrefillKernelInterpret(TestPagedPrefillKernel):
  INTERPRET = True


LONG = [
    (2, 64, 9, 3, 64, 16, [700, 1300], [64, 40], jnp.float32, None, None, None),  # mid-prompt
    (1, 128, 9, 3, 64, 16, [0], [128], jnp.float32, None, None, None),  # first chunk
    (3, 32, 4, 2, 32, 16, [500, 0, 90], [32, 0, 7], jnp.bfloat16, None, 100, None),  # window
]


@pytest.mark.parametrize("case, key_block",  # 48: 3 blocks of 16 (1 of 32) a step
                         [(c, 48) for c in SWEEP] + [(c, k) for c in LONG for k in (48, 256)])
def test_blocked_xla_path_matches_reference(case, key_block):
  # The CPU's auto path: key blocks up to the chunk's last key, online softmax. NaN in every
  # slot no query reads (make_paged_cache) must not leak in.
  args, kw = case_inputs(case, seed=key_block, spare_blocks=2)  # table width past the keys
  if kw["k_scale"] is None:
    got = paged_prefill_attention_blocked(*args, sliding_window=kw["sliding_window"],
                                          key_block=key_block)
  else:  # ops brings per-head scales to [blocks, kv heads] first
    got = ops.paged_prefill_attention(*args, backend="auto", **kw)
  assert_like_reference(got, args, kw, case, 1e-5 if case[8] == jnp.float32 else tol_for(case[8]))


@pytest.mark.parametrize("window", [None, 3])
def test_queries_past_the_table_read_its_keys_only_as_the_reference(window):
  # starts + chunk_lens past the table (the engine never asks this): the Pallas kernel
  # re-read the last page's slots and the blocked path the padding's block 0 as keys past
  # the table (up to 0.5 off the reference on those rows); every path now stops there.
  rng = np.random.default_rng(7)
  kp, vp, bt, _, _ = make_paged_cache(rng, 1, 2, 16, 8, 2, [16], jnp.float32)
  q = jnp.asarray(rng.normal(size=(1, 4, 4, 16)), jnp.float32)
  args = (q, kp, vp, bt, jnp.asarray([14], jnp.int32), jnp.asarray([4], jnp.int32))
  want = ops.paged_prefill_attention(*args, backend="reference", sliding_window=window)
  for got in (ops.paged_prefill_attention(*args, backend="pallas", interpret=True, block_q=16,
                                          block_kv=8, sliding_window=window),
              paged_prefill_attention_blocked(*args, sliding_window=window, key_block=8)):
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("dtype,fp8,q_dtype", [(jnp.bfloat16, False, jnp.bfloat16),
                                               (jnp.float32, False, jnp.float32),
                                               (jnp.bfloat16, True, jnp.bfloat16),
                                               (jnp.bfloat16, False, jnp.float32)])
def test_lowers_for_cuda(dtype, fp8, q_dtype):
  rng = np.random.default_rng(0)
  kp, vp, bt, ks, vs = make_paged_cache(rng, 2, 2, 64, 16, 4, [20, 50], dtype, fp8)
  q = jnp.asarray(rng.normal(size=(2, 8, 6, 64)), q_dtype)
  starts, clens = jnp.asarray([12, 42], jnp.int32), jnp.asarray([8, 8], jnp.int32)
  text = lowers_for_cuda(
      lambda q, kp, vp, bt, s, c, ks, vs: ops.paged_prefill_attention(
          q, kp, vp, bt, s, c, k_scale=ks, v_scale=vs, sliding_window=24, backend="pallas"),
      q, kp, vp, bt, starts, clens, ks, vs)
  assert "__gpu$xla.gpu.triton" in text and "paged_prefill_attention" in text


class TestValidation:

  def _args(self):
    q = jnp.zeros((2, 3, 4, 16), jnp.float32)
    kp = jnp.zeros((5, 16, 2, 16), jnp.float32)
    n = jnp.zeros((2,), jnp.int32)
    return q, kp, kp, jnp.zeros((2, 3), jnp.int32), n, n

  def test_q_rank(self):
    q, kp, vp, bt, s, c = self._args()
    with pytest.raises(ValueError, match=r"q.shape=\(2, 4, 16\)"):
      ops.paged_prefill_attention(q[:, 0], kp, vp, bt, s, c)

  def test_kv_shape_mismatch(self):
    q, kp, vp, bt, s, c = self._args()
    with pytest.raises(ValueError, match=r"v_pages.shape=\(5, 16, 1, 16\)"):
      ops.paged_prefill_attention(q, kp, vp[:, :, :1], bt, s, c)

  def test_starts_and_chunk_lens(self):
    q, kp, vp, bt, s, c = self._args()
    with pytest.raises(ValueError, match=r"starts.shape=\(1,\)"):
      ops.paged_prefill_attention(q, kp, vp, bt, s[:1], c)
    with pytest.raises(ValueError, match=r"chunk_lens.shape=\(2,\) dtype=float32"):
      ops.paged_prefill_attention(q, kp, vp, bt, s, c.astype(jnp.float32))

  def test_pallas_head_dim(self):
    q, kp, vp, bt, s, c = self._args()
    kp = jnp.zeros((5, 16, 2, 24), jnp.float32)
    with pytest.raises(ValueError, match=r"head_dim=24"):
      ops.paged_prefill_attention(jnp.zeros((2, 3, 4, 24)), kp, kp, bt, s, c, backend="pallas",
                                  interpret=True)


@pytest.mark.parametrize("name, value", [("block_q", 24), ("block_kv", 12), ("block_q", 0),
                                         ("block_kv", True)])
def test_a_bad_prefill_tiling_is_one_line(name, value):
  # Before: 24 and 12 ran interpreted and failed only in CUDA lowering.
  rng = np.random.default_rng(2)
  kp, vp, bt, _, _ = make_paged_cache(rng, 2, 2, 16, 8, 2, [16, 16], jnp.float32)
  q = jnp.ones((2, 4, 4, 16), jnp.float32)
  with pytest.raises(ValueError, match=rf"^paged_prefill_attention: {name}={value!r} must be a "
                                       rf"power of two >= 8$"):
    ops.paged_prefill_attention(q, kp, vp, bt, jnp.zeros(2, jnp.int32),
                                jnp.asarray([4, 4], jnp.int32), backend="pallas",
                                interpret=True, **{name: value})
