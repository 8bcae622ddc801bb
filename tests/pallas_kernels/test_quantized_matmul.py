"""Quantized matmul: reference by hand, pack/unpack, kernel vs reference, CUDA lowering."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.pallas_kernels.kernel_testing import lowers_for_cuda, rel_err, tol_for
from o1jax.testing import as_if_on_gpu
from pallas_kernels import ops
from pallas_kernels.quantized_matmul import quantized_matmul_reference
from pallas_kernels.quantized_tensor import (QuantizedTensor, as_jax, dequantize, pack_int4,
                                             quantize, unpack_int4, with_split)

# q codes [K=4, N=2] for the hand-computed 4-bit cases (groups of 2 rows).
Q4 = np.array([[8, 15], [0, 7], [9, 8], [10, 12]], np.uint8)
X4 = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)


def _q4(minimum=None):
  return QuantizedTensor(
      packed=jnp.asarray(pack_int4(Q4)),
      scale=jnp.asarray([[1.0, 0.5], [2.0, 1.0]], jnp.float32),
      minimum=None if minimum is None else jnp.asarray(minimum, jnp.float32),
      bits=4, group_size=2)


class TestReference:

  def test_q4_symmetric_by_hand(self):
    # w = (q - 8) * scale: rows [0, 3.5], [-8, -0.5], [2, 0], [4, 4]
    # y = 1*[0, 3.5] + 2*[-8, -0.5] + 3*[2, 0] + 4*[4, 4] = [6, 18.5]
    y = quantized_matmul_reference(jnp.asarray(X4), _q4())
    np.testing.assert_array_equal(np.asarray(y), [[6.0, 18.5]])

  def test_q4_1_scale_min_by_hand(self):
    # minimum [[-1, 0], [0.5, 1]]; w = q * scale + minimum:
    # rows [7, 7.5], [-1, 3.5], [18.5, 9], [20.5, 13]
    # y = [7 - 2 + 55.5 + 82, 7.5 + 7 + 27 + 52] = [142.5, 93.5]
    y = quantized_matmul_reference(jnp.asarray(X4), _q4([[-1.0, 0.0], [0.5, 1.0]]))
    np.testing.assert_array_equal(np.asarray(y), [[142.5, 93.5]])

  def test_q8_by_hand(self):
    # w = q * scale = [[1, -2], [3, 4]] * [0.5, 2] = [[0.5, -4], [1.5, 8]]
    # y = 2*[0.5, -4] - 1*[1.5, 8] = [-0.5, -16]
    w = QuantizedTensor(packed=jnp.asarray([[1, -2], [3, 4]], jnp.int8),
                        scale=jnp.asarray([[0.5, 2.0]], jnp.float32), minimum=None,
                        bits=8, group_size=2)
    y = quantized_matmul_reference(jnp.asarray([[2.0, -1.0]]), w)
    np.testing.assert_array_equal(np.asarray(y), [[-0.5, -16.0]])

  def test_fp8_row_scale_by_hand(self):
    # 1..4 are exact in e4m3; x_scale 0.5 halves [6, 18.5] -> [3, 9.25] (bf16-exact)
    x = jnp.asarray(X4).astype(jnp.float8_e4m3fn)
    y = quantized_matmul_reference(x, _q4(), x_scale=jnp.asarray([0.5]))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), [[3.0, 9.25]])


class TestPackUnpack:

  def test_split_halves_bit_exact(self):
    # Every (low, high) nibble pair, including 0, 7, 8, 15 at both ends.
    lo, hi = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    q = np.concatenate([lo.reshape(1, -1), hi.reshape(1, -1)], axis=0).astype(np.uint8)
    packed = pack_int4(q)
    assert packed.dtype == np.uint8 and packed.shape == (1, 256)
    np.testing.assert_array_equal(packed[0], (q[0] | (q[1] << 4)))
    for special in (0, 7, 8, 15):
      col = int(np.flatnonzero((q[0] == special) & (q[1] == 15 - special))[0])
      assert packed[0, col] == special | ((15 - special) << 4)
    np.testing.assert_array_equal(unpack_int4(packed), q)
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed))), q)
    np.testing.assert_array_equal(np.asarray(pack_int4(jnp.asarray(q))), packed)


class TestSplitOverAMesh:
  """`with_split`: a matrix marked as split over a mesh's devices (o1jax.sharding)."""

  @pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True)])
  @pytest.mark.parametrize("kind", ["rows", "columns"])
  def test_same_values_and_each_devices_rows_are_its_codes(self, bits, symmetric, kind):
    rng = np.random.default_rng(5)
    w = as_jax(quantize(rng.normal(size=(256, 48)).astype(np.float32), bits=bits,
                        group_size=32, symmetric=symmetric))
    split = with_split(w, kind, 4)
    assert split.split == (kind, 4) and split.shape == w.shape
    np.testing.assert_array_equal(np.asarray(dequantize(split)), np.asarray(dequantize(w)))
    if kind == "rows" and bits == 4:
      # Device d's packed rows [32 d, 32 d + 32) are a split-halves matrix of its own
      # 64 rows: with no split, they dequantize to rows [64 d, 64 d + 64) of W.
      for d in range(4):
        part = QuantizedTensor(packed=split.packed[32 * d:32 * d + 32],
                               scale=split.scale[2 * d:2 * d + 2],
                               minimum=None if w.minimum is None else
                               split.minimum[2 * d:2 * d + 2], bits=4, group_size=32)
        np.testing.assert_array_equal(np.asarray(dequantize(part)),
                                      np.asarray(dequantize(w))[64 * d:64 * d + 64])
    else:  # the codes' layout is the whole matrix's
      np.testing.assert_array_equal(np.asarray(split.packed), np.asarray(w.packed))
    # Marked again (another mesh): from the codes as they are packed now.
    again = with_split(with_split(split, "rows", 2), "columns", 2)
    np.testing.assert_array_equal(np.asarray(again.packed), np.asarray(w.packed))
    np.testing.assert_array_equal(np.asarray(unpack_int4(pack_int4(np.arange(32).reshape(
        16, 2) % 16, blocks=4), blocks=4)), np.arange(32).reshape(16, 2) % 16)

  @pytest.mark.parametrize("kind,parts,want", [
      ("rows", 3, "must be ('rows' | 'columns', n) with n dividing (256, 48)"),
      ("rows", 16, "K / 16 = 16 rows is not a multiple of group_size=32"),
      ("diagonal", 2, "must be ('rows' | 'columns', n)"),
      ("columns", 5, "with n dividing (256, 48)"),
      ("rows", True, "must be ('rows' | 'columns', n)")])
  def test_a_split_that_does_not_divide_is_named(self, kind, parts, want):
    w = as_jax(quantize(np.ones((256, 48), np.float32), bits=4, group_size=32))
    with pytest.raises(ValueError, match=re.escape(want)):
      with_split(w, kind, parts)

  @pytest.mark.parametrize("bits,kind", [(4, "rows"), (8, "rows"), (4, "columns")])
  def test_the_kernels_take_a_split_matrix_only_on_its_mesh(self, bits, kind):
    # Off its mesh (here: none), a split is XLA's to partition (a 4-bit row split's
    # per-device packing is not even the kernels' layout): "pallas" says so in one line,
    # "auto" takes XLA's product (the same values). Before, a column split or an 8-bit
    # row split raised under "auto" too, and the 4-bit message said "run on the mesh".
    rng = np.random.default_rng(6)
    w = with_split(as_jax(quantize(rng.normal(size=(128, 32)).astype(np.float32), bits=bits)),
                   kind, 2)
    x = jnp.asarray(rng.normal(size=(2, 128)), jnp.float32)
    with as_if_on_gpu():
      with pytest.raises(ValueError, match=re.escape(
          f"W.shape=(128, 32): split=('{kind}', 2) but the mesh's 'model' axis has 1 "
          f"device(s)")):
        ops.quantized_matmul(x, w, backend="pallas", interpret=True)
      y = ops.quantized_matmul(x, w, backend="auto", interpret=True)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ dequantize(w)), rtol=1e-5,
                               atol=1e-5)
    # Taking columns keeps a row split's packing (its codes are read per device).
    from o1jax.checkpoint.params import take_columns
    part = take_columns(w, slice(0, 16))
    np.testing.assert_array_equal(np.asarray(dequantize(part)),
                                  np.asarray(dequantize(w))[:, :16])

  def test_a_split_matrix_is_not_stored(self):
    from o1jax.checkpoint.params import flatten
    w = with_split(as_jax(quantize(np.ones((64, 32), np.float32))), "rows", 2)
    with pytest.raises(ValueError, match=r"layers.0.wo: a matrix split over a mesh"):
      flatten({"embed": np.ones((4, 4)), "final_norm": np.ones(4), "layers": [{"wo": w}]})


def _case(rng, bits, group, symmetric, m, k, n, dtype):
  w = as_jax(quantize(rng.normal(size=(k, n)).astype(np.float32), bits=bits,
                      group_size=group, symmetric=symmetric))
  x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
  xs = None
  if dtype == jnp.float8_e4m3fn:
    amax = jnp.max(jnp.abs(x), axis=1)
    xs = amax / 448.0
    x = (x / xs[:, None]).astype(dtype)
  else:
    x = x.astype(dtype)
  return x, w, xs


# (bits, group, symmetric): Q4_0 g32 / g128, Q4_1 g32, Q8_0 g32
FORMATS = [(4, 32, True), (4, 128, True), (4, 32, False), (8, 32, True)]
SWEEP = [
    # fmt index, M, K, N, dtype
    (0, 1, 64, 16, jnp.bfloat16),
    (0, 5, 192, 48, jnp.float32),  # M, N not multiples of the tiles
    (0, 64, 128, 64, jnp.float16),
    (1, 3, 256, 32, jnp.bfloat16),
    (1, 130, 256, 16, jnp.float32),  # prefill-sized M, padded
    (2, 1, 64, 32, jnp.float32),
    (2, 17, 128, 80, jnp.bfloat16),
    (3, 1, 32, 16, jnp.float16),
    (3, 9, 96, 48, jnp.bfloat16),
    (0, 2, 128, 32, jnp.float8_e4m3fn),
    (2, 4, 64, 16, jnp.float8_e4m3fn),
    (3, 3, 64, 32, jnp.float8_e4m3fn),
]


# The layouts GGUF K-quants load into (o1jax.checkpoint.gguf_blocks): f32 per-group scales,
# groups of 16, 8-bit codes with a minimum. (bits, group, has minimum, M, K, N)
KQUANT_LAYOUTS = [
    (4, 32, True, 3, 256, 32),  # Q4_K
    (8, 32, True, 2, 256, 48),  # Q5_K: 5-bit codes as int8
    (8, 16, False, 5, 256, 32),  # Q6_K, Q3_K
    (4, 16, True, 1, 512, 16),  # Q2_K
    (8, 256, False, 4, 512, 16),  # Q8_K
]
# The small-M kernel's rows (M <= GEMV_ROW_LIMIT = 4).
GEMV_KQUANT_LAYOUTS = [(b, g, h, min(m, 4), k, n) for b, g, h, m, k, n in KQUANT_LAYOUTS]


def _kquant_case(rng, bits, group, has_min, m, k, n):
  """Random codes in the format's range, f32 scales that are not f16 values."""
  lo, hi = (0, 16) if bits == 4 else (-32, 32)
  q = rng.integers(lo, hi, (k, n))
  scale = (rng.uniform(0.5, 1.5, (k // group, n)) / 16).astype(np.float32)
  minimum = (-rng.uniform(0, 1, (k // group, n))).astype(np.float32) if has_min else None
  packed = pack_int4(q.astype(np.uint8)) if bits == 4 else q.astype(np.int8)
  w = as_jax(QuantizedTensor(packed=packed, scale=scale, minimum=minimum, bits=bits,
                             group_size=group))
  return jnp.asarray(rng.normal(size=(m, k)), jnp.float32), w


@pytest.mark.gpu_only
class TestQuantizedMatmulKernel:
  INTERPRET = False

  @pytest.mark.parametrize("fmt,m,k,n,dtype", SWEEP)
  def test_matches_reference(self, fmt, m, k, n, dtype):
    bits, group, symmetric = FORMATS[fmt]
    x, w, xs = _case(np.random.default_rng(m * 1000 + k + n), bits, group, symmetric, m, k, n,
                     dtype)
    got = ops.quantized_matmul(x, w, x_scale=xs, backend="pallas", interpret=self.INTERPRET)
    want = ops.quantized_matmul(x, w, x_scale=xs, backend="reference")
    assert got.shape == (m, n) and got.dtype == want.dtype
    assert rel_err(got, want) <= tol_for(want.dtype)

  @pytest.mark.parametrize("k_splits", [1, 2, 4])
  def test_split_k_and_batch_dims(self, k_splits):
    x, w, _ = _case(np.random.default_rng(1), 4, 32, True, 6, 256, 32, jnp.float32)
    x = x.reshape(2, 3, 256)
    got = ops.quantized_matmul(x, w, backend="pallas", interpret=self.INTERPRET,
                               k_splits=k_splits)
    want = ops.quantized_matmul(x, w, backend="reference")
    assert got.shape == (2, 3, 32)
    assert rel_err(got, want) <= tol_for(jnp.float32)

  def test_in_kernel_unpack_bit_exact(self):
    # x = identity picks out each weight row, scale 1: y must equal q - 8 exactly,
    # for every nibble value in both halves.
    k, n = 64, 16
    q = (np.arange(k * n).reshape(k, n) * 7 % 16).astype(np.uint8)
    q[0, :4] = [0, 7, 8, 15]
    q[k // 2, :4] = [15, 8, 7, 0]
    w = QuantizedTensor(packed=jnp.asarray(pack_int4(q)), scale=jnp.ones((2, n), jnp.float16),
                        minimum=None, bits=4, group_size=32)
    y = ops.quantized_matmul(jnp.eye(k, dtype=jnp.bfloat16), w, backend="pallas",
                             interpret=self.INTERPRET)
    np.testing.assert_array_equal(np.asarray(y, np.float32), q.astype(np.float32) - 8)


  @pytest.mark.parametrize("bits,group,has_min,m,k,n", KQUANT_LAYOUTS)
  def test_kquant_layouts_match_reference(self, bits, group, has_min, m, k, n):
    x, w = _kquant_case(np.random.default_rng(k + n + group), bits, group, has_min, m, k, n)
    got = ops.quantized_matmul(x, w, backend="pallas", interpret=self.INTERPRET)
    want = ops.quantized_matmul(x, w, backend="reference")
    assert rel_err(got, want) <= tol_for(jnp.float32)


class TestQuantizedMatmulKernelInterpret(TestQuantizedMatmulKernel):
  INTERPRET = True


# The small-M kernel: M <= GEMV_ROW_LIMIT, every format, layout and activation dtype.
GEMV_SWEEP = [
    (0, 1, 64, 16, jnp.bfloat16),
    (0, 3, 192, 48, jnp.float32),  # M not a power of two, N not a tile multiple of 128
    (1, 2, 256, 32, jnp.float16),
    (2, 1, 128, 80, jnp.bfloat16),
    (2, 4, 256, 32, jnp.float32),
    (3, 3, 64, 16, jnp.bfloat16),
    (0, 4, 128, 32, jnp.float8_e4m3fn),
    (1, 4, 1024, 1024, jnp.bfloat16),  # the default tiling: 512 columns, K split
    (3, 1, 64, 32, jnp.float8_e4m3fn),
]


@pytest.mark.gpu_only
class TestQuantizedGemvKernel:
  INTERPRET = False

  def _both(self, x, w, xs=None, **tiling):
    got = ops.quantized_matmul(x, w, x_scale=xs, backend="pallas", kernel="gemv",
                               interpret=self.INTERPRET, **tiling)
    want = ops.quantized_matmul(x, w, x_scale=xs, backend="reference")
    assert got.shape == want.shape and got.dtype == want.dtype
    return got, want

  @pytest.mark.parametrize("fmt,m,k,n,dtype", GEMV_SWEEP)
  def test_matches_reference(self, fmt, m, k, n, dtype):
    bits, group, symmetric = FORMATS[fmt]
    x, w, xs = _case(np.random.default_rng(m * 1000 + k + n), bits, group, symmetric, m, k, n,
                     dtype)
    got, want = self._both(x, w, xs)
    assert rel_err(got, want) <= tol_for(want.dtype)

  @pytest.mark.parametrize("bits,group,has_min,m,k,n", GEMV_KQUANT_LAYOUTS)
  def test_kquant_layouts_match_reference(self, bits, group, has_min, m, k, n):
    x, w = _kquant_case(np.random.default_rng(k + n + group), bits, group, has_min, m, k, n)
    got, want = self._both(x, w)
    assert rel_err(got, want) <= tol_for(jnp.float32)

  @pytest.mark.parametrize("k_splits,block_n", [(1, 16), (2, 32), (4, 16)])
  @pytest.mark.parametrize("lead", [(2, 2), (3, 1)])  # (3, 1): rows padded to 4
  def test_tilings_and_batch_dims(self, k_splits, block_n, lead):
    rows = int(np.prod(lead))
    x, w, _ = _case(np.random.default_rng(2), 4, 32, False, rows, 512, 32, jnp.float32)
    got, want = self._both(x.reshape(*lead, 512), w, k_splits=k_splits, block_n=block_n)
    assert got.shape == (*lead, 32)
    assert rel_err(got, want) <= tol_for(jnp.float32)

  @pytest.mark.parametrize("fmt", range(len(FORMATS)))
  @pytest.mark.parametrize("groups_per_iter,k_splits", [(2, 1), (4, 2), (8, 1)])
  def test_several_groups_per_iteration(self, fmt, groups_per_iter, k_splits):
    # Each iteration's groups are its own (a kernel reading the first group of every
    # iteration twice passed every default-tiling test: the default takes one).
    from pallas_kernels.quantized_matmul import quantized_gemv_pallas
    bits, group, symmetric = FORMATS[fmt]
    x, w, _ = _case(np.random.default_rng(fmt + 7), bits, group, symmetric, 3, 2048, 32,
                    jnp.float32)  # 8 or more loop groups in every format
    got = quantized_gemv_pallas(x, w, groups_per_iter=groups_per_iter, k_splits=k_splits,
                                interpret=self.INTERPRET)
    want = ops.quantized_matmul(x, w, backend="reference")
    assert rel_err(got, want) <= tol_for(jnp.float32)

  def test_in_kernel_unpack_bit_exact(self):
    # Rows of the identity pick out weight rows (scale 1): y = q - 8 exactly, every
    # nibble value in both halves.
    # Every row differs from its neighbours (a row taken for another shows) and holds
    # all 16 values.
    k, n = 64, 16
    r, c = np.indices((k, n))
    q = ((3 * r + 5 * c) % 16).astype(np.uint8)
    q[0, :4] = [0, 7, 8, 15]
    q[k // 2, :4] = [15, 8, 7, 0]
    w = QuantizedTensor(packed=jnp.asarray(pack_int4(q)), scale=jnp.ones((2, n), jnp.float16),
                        minimum=None, bits=4, group_size=32)
    eye = jnp.eye(k, dtype=jnp.bfloat16)
    for rows in (slice(0, 4), slice(28, 32), slice(32, 36), slice(60, 64)):
      y = ops.quantized_matmul(eye[rows], w, backend="pallas", kernel="gemv",
                               interpret=self.INTERPRET)
      np.testing.assert_array_equal(np.asarray(y, np.float32), q[rows].astype(np.float32) - 8)


class TestQuantizedGemvKernelInterpret(TestQuantizedGemvKernel):
  INTERPRET = True


@pytest.mark.parametrize("fmt", range(len(FORMATS)))
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_lowers_for_cuda(fmt, m):
  bits, group, symmetric = FORMATS[fmt]
  for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
    x, w, xs = _case(np.random.default_rng(0), bits, group, symmetric, m, 256, 64, dtype)
    text = lowers_for_cuda(lambda x, w, xs: ops.quantized_matmul(
        x, w, x_scale=xs, backend="pallas", kernel="gemv"), x, w, xs)
    assert "__gpu$xla.gpu.triton" in text and "quantized_gemv" in text


@pytest.mark.parametrize("bits,group,has_min,m,k,n", GEMV_KQUANT_LAYOUTS)
def test_gemv_kquant_layouts_lower_for_cuda(bits, group, has_min, m, k, n):
  x, w = _kquant_case(np.random.default_rng(0), bits, group, has_min, m, k, n)
  text = lowers_for_cuda(lambda x, w: ops.quantized_matmul(x.astype(jnp.bfloat16), w,
                                                           backend="pallas", kernel="gemv"), x, w)
  assert "__gpu$xla.gpu.triton" in text and "quantized_gemv" in text


def test_gemv_default_tiling_lowers_for_cuda():
  # 512 columns a program (16 a thread of one warp), K split: the tiling the GPU runs.
  from pallas_kernels.quantized_matmul import GEMV_BLOCK_N, choose_gemv_config
  x, w, _ = _case(np.random.default_rng(5), 4, 32, True, 2, 1024, 1024, jnp.bfloat16)
  assert choose_gemv_config(1024, 1024, w)[0] == GEMV_BLOCK_N == 512
  text = lowers_for_cuda(lambda x, w: ops.quantized_matmul(x, w, backend="pallas",
                                                           kernel="gemv"), x, w)
  assert "quantized_gemv" in text


@pytest.mark.parametrize("kernel", ["dot", "gemv"])
@pytest.mark.parametrize("name,value,want", [
    ("block_n", 0, "a power of two >= 16"), ("block_n", -16, "a power of two >= 16"),
    ("block_n", 48, "a power of two >= 16"), ("block_n", 8, "a power of two >= 16"),
    ("block_n", 16.0, "a power of two >= 16"), ("k_splits", 0, "an int >= 1"),
    ("k_splits", -1, "an int >= 1"), ("k_splits", True, "an int >= 1")])
def test_bad_tilings_are_named_in_one_line(kernel, name, value, want):
  # They fell back to the default (0), failed inside JAX or MLIR (negative), or lowered
  # in interpret mode and failed only when compiled for a GPU (48).
  x, w, _ = _case(np.random.default_rng(6), 4, 32, False, 3, 512, 48, jnp.float32)
  label = "quantized_gemv" if kernel == "gemv" else "quantized_matmul"
  with pytest.raises(ValueError, match=rf"^{label}: {name}={value!r} must be {want}$"):
    ops.quantized_matmul(x, w, backend="pallas", kernel=kernel, interpret=True,
                         **{name: value})


def test_bad_groups_per_iteration_is_named():
  # -1 returned zeros without an error.
  from pallas_kernels.quantized_matmul import quantized_gemv_pallas
  x, w, _ = _case(np.random.default_rng(6), 4, 32, False, 3, 512, 48, jnp.float32)
  for value in (0, -1):
    with pytest.raises(ValueError, match=rf"^quantized_gemv: groups_per_iter={value} must be "
                                         r"an int >= 1$"):
      quantized_gemv_pallas(x, w, groups_per_iter=value, interpret=True)


def test_auto_dispatch_by_rows(monkeypatch):
  # kernel="auto" takes the small-M kernel up to GEMV_MAX_ROWS rows, the dot kernel above.
  x, w, _ = _case(np.random.default_rng(3), 4, 32, True, 4, 128, 32, jnp.bfloat16)
  monkeypatch.setattr(ops.qmm, "GEMV_MAX_ROWS", 2)
  lower = lambda x: lowers_for_cuda(lambda x, w: ops.quantized_matmul(x, w, backend="pallas"),
                                    x, w)
  assert "quantized_gemv" in lower(x[:2]) and "quantized_matmul_q4" not in lower(x[:2])
  assert "quantized_matmul_q4" in lower(x[:3]) and "quantized_gemv" not in lower(x[:3])
  # A block_m is a dot-kernel tiling: auto takes the dot kernel for it.
  text = lowers_for_cuda(lambda x, w: ops.quantized_matmul(x, w, backend="pallas", block_m=16),
                         x[:2], w)
  assert "quantized_matmul_q4" in text


def test_auto_dispatch_leaves_large_m_to_xla_past_the_measured_limit(monkeypatch):
  """Above PALLAS_MAX_ROWS rows `backend="auto"` runs XLA's dequantize + dot (where the
  GPU benchmark measured it faster); an explicit "pallas" keeps the kernels."""
  x, w, _ = _case(np.random.default_rng(4), 4, 32, True, 4, 128, 32, jnp.bfloat16)
  monkeypatch.setattr(ops.qmm, "PALLAS_MAX_ROWS", 2)
  with as_if_on_gpu():
    lower = lambda x, backend: lowers_for_cuda(
        lambda x, w: ops.quantized_matmul(x, w, backend=backend), x, w)
    assert "quantized_matmul_q4" in lower(x[:2], "auto")
    assert "quantized_matmul_q4" not in lower(x[:3], "auto")
    assert "quantized_matmul_q4" in lower(x[:3], "pallas")
  np.testing.assert_allclose(np.asarray(ops.quantized_matmul(x[:3], w, backend="auto")),
                             np.asarray(ops.quantized_matmul(x[:3], w, backend="reference")))


def _dot_operand_dtypes(jaxpr) -> set:
  """Operand dtypes of every dot_general in a jaxpr and the jaxprs nested in it (the
  kernel bodies of pallas_call, loop bodies)."""
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.add(tuple(str(v.aval.dtype) for v in eqn.invars))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found |= _dot_operand_dtypes(inner)
  return found


@pytest.mark.parametrize("fmt", range(len(FORMATS)))
def test_f32_activations_take_bf16_dots_at_f32_accuracy(fmt):
  # A float32 dot in Triton runs on the CUDA cores (1.9 ms a call at M = 64 on an H200);
  # the kernel splits f32 x into three bf16 parts, exact against the codes.
  bits, group, symmetric = FORMATS[fmt]
  rng = np.random.default_rng(fmt)
  _, w, _ = _case(rng, bits, group, symmetric, 16, 256, 64, jnp.float32)
  # Magnitudes over six decades: one or two bf16 parts would lose bits a f32 dot keeps.
  x = jnp.asarray(rng.normal(size=(16, 256)) * 10.0 ** rng.uniform(-3, 3, size=(16, 256)),
                  jnp.float32)
  jaxpr = jax.make_jaxpr(lambda x: ops.quantized_matmul(x, w, backend="pallas"))(x)
  assert _dot_operand_dtypes(jaxpr.jaxpr) == {("bfloat16", "bfloat16")}
  got = ops.quantized_matmul(x, w, backend="pallas", interpret=True)
  want = ops.quantized_matmul(x, w, backend="reference")
  assert got.dtype == jnp.float32
  assert rel_err(got, want) <= 1e-6  # three parts: 3e-7; two: 2-7e-6


@pytest.mark.parametrize("fmt", range(len(FORMATS)))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32])
def test_lowers_for_cuda(fmt, dtype):
  bits, group, symmetric = FORMATS[fmt]
  x, w, xs = _case(np.random.default_rng(0), bits, group, symmetric, 4, 256, 64, dtype)
  text = lowers_for_cuda(
      lambda x, w, xs: ops.quantized_matmul(x, w, x_scale=xs, backend="pallas"), x, w, xs)
  assert "__gpu$xla.gpu.triton" in text and "quantized_matmul" in text


@pytest.mark.parametrize("bits,group,has_min,m,k,n", KQUANT_LAYOUTS[:3])
def test_kquant_layouts_lower_for_cuda(bits, group, has_min, m, k, n):
  x, w = _kquant_case(np.random.default_rng(0), bits, group, has_min, m, k, n)
  text = lowers_for_cuda(lambda x, w: ops.quantized_matmul(x.astype(jnp.bfloat16), w,
                                                           backend="pallas"), x, w)
  assert "__gpu$xla.gpu.triton" in text and "quantized_matmul" in text


class TestValidation:

  def test_k_mismatch(self):
    w = as_jax(quantize(np.ones((64, 16), np.float32)))
    with pytest.raises(ValueError, match=r"x.shape=\(2, 32\).*W.shape=\(64, 16\)"):
      ops.quantized_matmul(jnp.ones((2, 32)), w)

  def test_bad_dtype(self):
    w = as_jax(quantize(np.ones((64, 16), np.float32)))
    with pytest.raises(ValueError, match=r"x.dtype=int32.*\(2, 64\)"):
      ops.quantized_matmul(jnp.ones((2, 64), jnp.int32), w)

  def test_fp8_needs_scale(self):
    w = as_jax(quantize(np.ones((64, 16), np.float32)))
    x = jnp.ones((2, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"x_scale of shape \(2,\)"):
      ops.quantized_matmul(x, w)
    with pytest.raises(ValueError, match=r"x_scale.shape=\(3,\)"):
      ops.quantized_matmul(x, w, x_scale=jnp.ones((3,)))

  def test_bad_weight_fields(self):
    w = as_jax(quantize(np.ones((64, 16), np.float32)))
    bad = QuantizedTensor(packed=w.packed, scale=w.scale[:1], minimum=None, bits=4,
                          group_size=32)
    with pytest.raises(ValueError, match=r"scale shape \(1, 16\)"):
      ops.quantized_matmul(jnp.ones((2, 64)), bad)

  def test_pallas_rejects_untileable_weight(self):
    # K=96, group 32: K//2 = 48 straddles a group; the reference still works.
    w = as_jax(quantize(np.ones((96, 16), np.float32)))
    with pytest.raises(ValueError, match=r"W.shape=\(96, 16\).*straddle"):
      ops.quantized_matmul(jnp.ones((1, 96)), w, backend="pallas", interpret=True)
    assert ops.quantized_matmul(jnp.ones((1, 96)), w, backend="auto").shape == (1, 16)

  def test_gemv_rows_and_kernel_name(self):
    w = as_jax(quantize(np.ones((64, 16), np.float32)))
    with pytest.raises(ValueError, match=r"kernel='gemv' takes M <= 4 rows.*M=5"):
      ops.quantized_matmul(jnp.ones((5, 64)), w, backend="pallas", kernel="gemv",
                           interpret=True)
    with pytest.raises(ValueError, match=r"kernel='gemm'"):
      ops.quantized_matmul(jnp.ones((1, 64)), w, kernel="gemm")

  def test_bad_backend(self):
    w = as_jax(quantize(np.ones((64, 16), np.float32)))
    with pytest.raises(ValueError, match="backend"):
      ops.quantized_matmul(jnp.ones((1, 64)), w, backend="cuda")


@pytest.mark.parametrize("kernel", ["dot", "gemv"])
def test_an_infinite_activation_gives_an_infinite_row_not_nan(kernel):
  # The dot kernel splits f32 activations into bf16 parts (x - hi): inf - inf made the row
  # NaN where the reference, the gemv kernel and numpy give inf.
  k, n = 64, 16
  w = QuantizedTensor(packed=jnp.asarray(pack_int4(np.full((k, n), 12, np.uint8))),
                      scale=jnp.ones((2, n), jnp.float16), minimum=None, bits=4, group_size=32)
  x = np.ones((3, k), np.float32)
  x[1, 5] = np.inf
  x[2, 7] = 3.4e38  # (finite, past bf16's largest: its bf16 part is inf)
  got = np.asarray(ops.quantized_matmul(jnp.asarray(x), w, backend="pallas", interpret=True,
                                        kernel=kernel))
  np.testing.assert_array_equal(got[0], 4.0 * k)
  np.testing.assert_array_equal(got[1:], np.inf)
