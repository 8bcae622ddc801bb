"""Paged decode attention: reference by hand, kernel vs reference, CUDA lowering, validation."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from tests.pallas_kernels.kernel_testing import lowers_for_cuda, make_paged_cache, rel_err, tol_for
from pallas_kernels import ops
from pallas_kernels.paged_attention import paged_decode_attention_reference

NAN = float("nan")


def _hand_cache(dtype=jnp.float32):
  # block_size 2, 3 blocks; sequence 0 uses blocks [2, 0] with 3 tokens:
  # k0=[1,0] k1=[0,1] (block 2), k2=[1,1] (block 0 slot 0); block 0 slot 1 is garbage.
  k = np.full((3, 2, 1, 2), NAN, np.float32)
  v = np.full((3, 2, 1, 2), NAN, np.float32)
  k[2, 0, 0], k[2, 1, 0], k[0, 0, 0] = [1, 0], [0, 1], [1, 1]
  v[2, 0, 0], v[2, 1, 0], v[0, 0, 0] = [1, 0], [0, 5], [2, 0]
  bt = jnp.asarray([[2, 0], [1, 1]], jnp.int32)
  return jnp.asarray(k).astype(dtype), jnp.asarray(v).astype(dtype), bt


class TestReference:

  def test_by_hand_with_empty_sequence(self):
    # q=[ln2, 0], sm_scale 1: scores [ln2, 0, ln2] -> weights [2, 1, 2] / 5
    # o = (2*[1,0] + 1*[0,5] + 2*[2,0]) / 5 = [1.2, 1.0]; sequence 1 is empty -> 0.
    k, v, bt = _hand_cache()
    q = jnp.asarray([[[math.log(2), 0.0]], [[1.0, 1.0]]], jnp.float32)
    o = paged_decode_attention_reference(q, k, v, bt, jnp.asarray([3, 0]), sm_scale=1.0)
    np.testing.assert_allclose(np.asarray(o), [[[1.2, 1.0]], [[0.0, 0.0]]], rtol=1e-6)

  def test_sliding_window_by_hand(self):
    # window 2 keeps k1, k2: weights [1, 2] / 3 -> o = ([0,5] + 2*[2,0]) / 3 = [4/3, 5/3]
    k, v, bt = _hand_cache()
    q = jnp.asarray([[[math.log(2), 0.0]], [[1.0, 1.0]]], jnp.float32)
    o = paged_decode_attention_reference(q, k, v, bt, jnp.asarray([3, 0]), sliding_window=2,
                                         sm_scale=1.0)
    np.testing.assert_allclose(np.asarray(o)[0, 0], [4 / 3, 5 / 3], rtol=1e-6)

  def test_fp8_per_block_scale_by_hand(self):
    # The values are exact in e4m3. v_scale: block 2 -> 2, others 1, so
    # v0=[2,0] v1=[0,10] v2=[2,0]; o = (2*[2,0] + [0,10] + 2*[2,0]) / 5 = [1.6, 2.0]
    k, v, bt = _hand_cache(jnp.float8_e4m3fn)
    q = jnp.asarray([[[math.log(2), 0.0]], [[1.0, 1.0]]], jnp.float32)
    vs = jnp.asarray([[1.0], [1.0], [2.0]])
    o = ops.paged_decode_attention(q, k, v, bt, jnp.asarray([3, 0], jnp.int32), v_scale=vs,
                                   sm_scale=1.0, backend="reference")
    np.testing.assert_allclose(np.asarray(o)[0, 0], [1.6, 2.0], rtol=1e-6)

  def test_fp8_per_token_scale_by_hand(self):
    # A scale per (block, slot, head), as the engine's pools: v1 (block 2 slot 1) x 0.2,
    # v2 (block 0 slot 0) x 3: v0=[1,0] v1=[0,1] v2=[6,0];
    # o = (2*[1,0] + [0,1] + 2*[6,0]) / 5 = [2.8, 0.2]
    k, v, bt = _hand_cache(jnp.float8_e4m3fn)
    q = jnp.asarray([[[math.log(2), 0.0]], [[1.0, 1.0]]], jnp.float32)
    vs = np.ones((3, 2, 1), np.float32)
    vs[2, 1, 0], vs[0, 0, 0] = 0.2, 3.0
    o = ops.paged_decode_attention(q, k, v, bt, jnp.asarray([3, 0], jnp.int32),
                                   v_scale=jnp.asarray(vs), sm_scale=1.0, backend="reference")
    np.testing.assert_allclose(np.asarray(o)[0, 0], [2.8, 0.2], rtol=1e-6)


# (batch, heads, kv_heads, head_dim, block_size, lengths, dtype, fp8 scale shape, window, splits)
SWEEP = [
    (3, 4, 4, 32, 16, [1, 16, 0], jnp.float32, None, None, 1),  # GQA 1, boundary, empty
    (2, 6, 2, 16, 8, [9, 24], jnp.bfloat16, None, None, 2),  # GQA 3, block 8
    (2, 8, 1, 64, 16, [33, 32], jnp.float16, None, None, 3),  # GQA 8, uneven splits
    (2, 8, 1, 32, 32, [45, 7], jnp.float32, None, 20, 2),  # sliding window
    (2, 6, 2, 32, 16, [17, 0], jnp.bfloat16, ("nb", 2), None, 1),  # FP8, block-and-head
    (1, 3, 1, 32, 16, [40], jnp.float32, ("nb", 1), 17, 2),  # FP8 per-block + window
    (2, 4, 2, 16, 16, [5, 31], jnp.float32, (1, 2), None, 1),  # FP8 per-head
    (2, 6, 2, 32, 16, [23, 9], jnp.bfloat16, ("nb", 16, 2), None, 2),  # FP8 per token (engine)
    (1, 4, 1, 16, 8, [30], jnp.float32, ("nb", 8, 1), 11, 1),  # FP8 per token + window
]


@pytest.mark.gpu_only
class TestPagedDecodeKernel:
  INTERPRET = False

  @pytest.mark.parametrize("case", SWEEP)
  def test_matches_reference(self, case):
    b, h, kvh, d, bs, lens, dtype, scale_shape, window, splits = case
    rng = np.random.default_rng(sum(lens) + h)
    max_blocks = -(-max(lens) // bs) + 1
    fp8 = scale_shape is not None
    kp, vp, bt, ks, vs = make_paged_cache(rng, b, kvh, d, bs, max_blocks, lens, dtype, fp8,
                                          scale_shape)
    q = jnp.asarray(rng.normal(size=(b, h, d)), dtype)
    lengths = jnp.asarray(lens, jnp.int32)
    kw = dict(k_scale=ks, v_scale=vs, sliding_window=window)
    got = ops.paged_decode_attention(q, kp, vp, bt, lengths, backend="pallas",
                                     interpret=self.INTERPRET, block_kv=16, num_splits=splits, **kw)
    want = ops.paged_decode_attention(q, kp, vp, bt, lengths, backend="reference", **kw)
    assert got.shape == (b, h, d) and got.dtype == dtype
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    for i, n in enumerate(lens):
      if n == 0:
        np.testing.assert_array_equal(np.asarray(got[i], np.float32), 0.0)
    assert rel_err(got, want) <= tol_for(dtype)


  @pytest.mark.parametrize("window", [None, 4])
  def test_lengths_past_the_table_stop_at_its_end_as_the_reference(self, window):
    # A length beyond max_blocks * block_size re-read the last page's slots as new keys
    # (up to 1.5 off the reference with a window); the reference and the native kernel
    # stop at the table's end.
    rng = np.random.default_rng(5)
    kp, vp, bt, _, _ = make_paged_cache(rng, 2, 2, 16, 8, 2, [16, 16], jnp.float32)
    q = jnp.asarray(rng.normal(size=(2, 4, 16)), jnp.float32)
    lengths = jnp.asarray([21, 16], jnp.int32)
    got = ops.paged_decode_attention(q, kp, vp, bt, lengths, backend="pallas",
                                     interpret=self.INTERPRET, block_kv=8, num_splits=2,
                                     sliding_window=window)
    want = ops.paged_decode_attention(q, kp, vp, bt, lengths, backend="reference",
                                      sliding_window=window)
    assert rel_err(got, want) <= tol_for(jnp.float32)


class TestPagedDecodeKernelInterpret(TestPagedDecodeKernel):
  INTERPRET = True


@pytest.mark.parametrize("window", [2.5, True, 0, "4"])
def test_a_sliding_window_that_is_no_whole_number_is_one_line(window):
  # 2.5 was read as 2 by XLA and failed deep inside Pallas; True was a window of 1.
  k, v, bt = _hand_cache()
  q = jnp.ones((2, 1, 2), jnp.float32)
  for backend in ("reference", "pallas"):
    with pytest.raises(ValueError, match=rf"sliding_window={window!r} must be an int >= 1 or None"):
      ops.paged_decode_attention(q, k, v, bt, jnp.asarray([3, 0], jnp.int32),
                                 sliding_window=window, backend=backend, interpret=True)


@pytest.mark.parametrize("dtype,fp8,q_dtype", [(jnp.bfloat16, False, jnp.bfloat16),
                                               (jnp.float32, False, jnp.float32),
                                               (jnp.bfloat16, True, jnp.bfloat16),
                                               (jnp.bfloat16, False, jnp.float32)])
def test_lowers_for_cuda(dtype, fp8, q_dtype):
  rng = np.random.default_rng(0)
  kp, vp, bt, ks, vs = make_paged_cache(rng, 2, 2, 64, 16, 4, [10, 50], dtype, fp8)
  q = jnp.asarray(rng.normal(size=(2, 6, 64)), q_dtype)
  lengths = jnp.asarray([10, 50], jnp.int32)
  text = lowers_for_cuda(
      lambda q, kp, vp, bt, n, ks, vs: ops.paged_decode_attention(
          q, kp, vp, bt, n, k_scale=ks, v_scale=vs, sliding_window=32, backend="pallas"),
      q, kp, vp, bt, lengths, ks, vs)
  assert "__gpu$xla.gpu.triton" in text and "paged_decode_attention" in text


class TestValidation:

  def _args(self):
    q = jnp.zeros((2, 4, 16), jnp.float32)
    kp = jnp.zeros((5, 16, 2, 16), jnp.float32)
    return q, kp, kp, jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)

  def test_heads_not_multiple_of_kv_heads(self):
    q, kp, vp, bt, n = self._args()
    with pytest.raises(ValueError, match=r"heads=3 not a multiple of kv_heads=2"):
      ops.paged_decode_attention(q[:, :3], kp, vp, bt, n)

  def test_head_dim_mismatch(self):
    q, kp, vp, bt, n = self._args()
    with pytest.raises(ValueError, match=r"head_dim=8 != k_pages.shape=\(5, 16, 2, 16\)"):
      ops.paged_decode_attention(q[..., :8], kp, vp, bt, n)

  def test_block_table_batch(self):
    q, kp, vp, bt, n = self._args()
    with pytest.raises(ValueError, match=r"block_tables.shape=\(3, 3\)"):
      ops.paged_decode_attention(q, kp, vp, jnp.zeros((3, 3), jnp.int32), n)

  def test_lengths_shape(self):
    q, kp, vp, bt, n = self._args()
    with pytest.raises(ValueError, match=r"lengths.shape=\(3,\)"):
      ops.paged_decode_attention(q, kp, vp, bt, jnp.zeros((3,), jnp.int32))

  def test_kv_dtype(self):
    q, kp, vp, bt, n = self._args()
    kb, vb = kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16)
    # Every backend widens a bf16 pool under f32 q (an engine with bf16 KV under an f32
    # model on a GPU); bf16 pages under f16 q are refused.
    for backend in ("pallas", "reference"):
      with pytest.raises(ValueError, match=r"KV dtype bfloat16"):
        ops.paged_decode_attention(q.astype(jnp.float16), kb, vb, bt, n, backend=backend,
                                   interpret=True)
      got = ops.paged_decode_attention(q, kb, vb, bt, n, backend=backend, interpret=True)
      want = ops.paged_decode_attention(q, kb.astype(jnp.float32), vb.astype(jnp.float32), bt, n,
                                        backend=backend, interpret=True)
      assert got.dtype == jnp.float32
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)

  def test_scale_shape(self):
    q, kp, vp, bt, n = self._args()
    kp8 = kp.astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"k_scale.shape=\(2, 5\)"):
      ops.paged_decode_attention(q, kp8, kp8, bt, n, k_scale=jnp.ones((2, 5)))
    nb, bs, kvh, _ = kp.shape  # per token, but of another block size
    with pytest.raises(ValueError, match=rf"k_scale.shape=\({nb}, {bs + 1}, {kvh}\) must be one "
                                         rf"of \[\({nb}, {bs}, {kvh}\), "):
      ops.paged_decode_attention(q, kp8, kp8, bt, n, k_scale=jnp.ones((nb, bs + 1, kvh)))

  def test_pallas_block_size(self):
    q, kp, vp, bt, n = self._args()
    kp = jnp.zeros((5, 12, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"block_size=12"):
      ops.paged_decode_attention(q, kp, kp, bt, n, backend="pallas", interpret=True)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_auto_on_a_gpu_takes_xla_attention_for_a_head_dim_the_kernels_cannot_tile(head_dim):
  """Phi-3 (96) and 80-wide heads: 'auto' on a GPU picked the Pallas kernels, which refuse
  them, so such a model failed at its first prefill; it takes XLA's attention, as
  quantized_matmul takes XLA's product for weights its kernel cannot tile."""
  from o1jax.testing import as_if_on_gpu
  rng = np.random.default_rng(7)
  kp, vp, bt, _, _ = make_paged_cache(rng, 2, 2, head_dim, 16, 2, [20, 5], jnp.float32)
  q = jnp.asarray(rng.normal(size=(2, 4, head_dim)), jnp.float32)
  lengths = jnp.asarray([20, 5], jnp.int32)
  chunk = jnp.asarray(rng.normal(size=(2, 3, 4, head_dim)), jnp.float32)
  starts, lens = jnp.asarray([17, 2], jnp.int32), jnp.asarray([3, 3], jnp.int32)
  want = ops.paged_decode_attention(q, kp, vp, bt, lengths, backend="reference")
  want_prefill = ops.paged_prefill_attention(chunk, kp, vp, bt, starts, lens, backend="reference")
  with as_if_on_gpu():
    got = ops.paged_decode_attention(q, kp, vp, bt, lengths, backend="auto")
    got_prefill = ops.paged_prefill_attention(chunk, kp, vp, bt, starts, lens, backend="auto")
    with pytest.raises(ValueError, match=rf"head_dim={head_dim} .* must be a power of two"):
      ops.paged_decode_attention(q, kp, vp, bt, lengths, backend="pallas")  # (asked for)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_prefill), np.asarray(want_prefill))


@pytest.mark.parametrize("name, value, want", [
    ("block_kv", 24, "a power of two >= 8"), ("block_kv", -16, "a power of two >= 8"),
    ("block_kv", 4, "a power of two >= 8"), ("num_splits", 0, "an int >= 1"),
    ("num_splits", -1, "an int >= 1"), ("num_splits", 2.0, "an int >= 1")])
def test_a_bad_decode_tiling_is_one_line_on_every_backend(name, value, want):
  # Before: 24 ran interpreted and failed only in CUDA lowering; -16 and -1 failed deep in
  # Pallas or XLA.
  k, v, bt, _, _ = make_paged_cache(np.random.default_rng(2), 2, 2, 16, 8, 2, [16, 3],
                                    jnp.float32)
  q = jnp.ones((2, 4, 16), jnp.float32)
  for backend in ("reference", "pallas"):
    with pytest.raises(ValueError, match=rf"^paged_decode_attention: {name}={value!r} must be "
                                         rf"{want}$"):
      ops.paged_decode_attention(q, k, v, bt, jnp.asarray([16, 3], jnp.int32), backend=backend,
                                 interpret=True, **{name: value})
