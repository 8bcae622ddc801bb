"""FP8 activations: per-row e4m3 rounding and the products of `Fp8ActivationWeight`,
checked against ml_dtypes' own e4m3 rounding and float64 products in numpy."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.pallas_kernels.kernel_testing import lowers_for_cuda, rel_err
from pallas_kernels import ops
from pallas_kernels.fp8_activations import FP8_MAX, Fp8ActivationWeight, quantize_rows
from pallas_kernels.quantized_tensor import as_jax, dequantize, quantize


def _rows(rng, m, k):
  # Rows of very different magnitudes, one with an outlier channel, one all zero, and
  # (last) one so small that amax / 448 would flush to zero.
  x = rng.normal(size=(m, k)) * np.logspace(-20, 20, m)[:, None]
  x[1, 3] = 1e4 * np.abs(x[1]).max()
  x[2] = 0.0
  # (normal f32 values: XLA's CPU code flushes subnormal inputs to zero, numpy does not)
  x[-1] = rng.choice([-1, 1], size=k) * rng.uniform(1, 2, size=k) * 1e-37
  return x.astype(np.float32)


def _numpy_fp8(x: np.ndarray):
  """Independent reference: scale = row amax / 448 (at least the smallest normal f32),
  values rounded by ml_dtypes."""
  amax = np.abs(x).max(axis=-1)
  scale = np.where(amax > 0, np.maximum(amax * np.float32(1 / FP8_MAX),
                                        np.finfo(np.float32).tiny), 1).astype(np.float32)
  q = np.clip(x / scale[:, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
  return q, scale


def test_quantize_rows_matches_ml_dtypes_rounding():
  x = _rows(np.random.default_rng(0), 7, 64)
  x8, scale = quantize_rows(jnp.asarray(x))
  want_q, want_scale = _numpy_fp8(x)
  assert x8.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(scale), want_scale)
  np.testing.assert_array_equal(np.asarray(x8).view(np.uint8), want_q.view(np.uint8))
  back = np.asarray(x8, np.float32) * np.asarray(scale)[:, None]
  assert np.isfinite(back).all()
  # Each row's largest entry lands on +-448 exactly; normal values within e4m3's 2^-4.
  np.testing.assert_array_equal(np.abs(np.asarray(x8, np.float32)).max(axis=1)[:6],
                                [FP8_MAX, FP8_MAX, 0, FP8_MAX, FP8_MAX, FP8_MAX])
  assert np.abs(np.asarray(x8, np.float32))[6].max() > 0  # the tiny row is not lost (or NaN)
  normal = np.abs(x) >= 2.0 ** -6 * np.asarray(scale)[:, None]
  assert np.all(np.abs(back - x)[normal] <= 2.0 ** -4 * np.abs(x)[normal])
  assert np.all(back[2] == 0) and float(scale[2]) == 1.0


def test_rounding_never_overflows_to_nan():
  # amax / (amax / 448) can exceed 448 by an ulp in f32; e4m3fn has no inf, so an
  # unclipped overflow would become NaN.
  rng = np.random.default_rng(1)
  x = (rng.uniform(0.5, 1.0, size=(512, 16)) * np.float32(3.0) ** rng.integers(-30, 30, (512, 1)))
  x8, _ = quantize_rows(jnp.asarray(x, jnp.float32))
  assert not np.isnan(np.asarray(x8, np.float32)).any()


def _reference_product(x, w_dense):
  q, scale = _numpy_fp8(x)
  return (q.astype(np.float64) @ np.asarray(w_dense, np.float64)) * scale[:, None]


@pytest.mark.parametrize("matrix", ["f32", "bf16", "q4_0", "q4_1", "q8_0"])
def test_products_match_numpy(matrix):
  rng = np.random.default_rng(2)
  x = rng.normal(size=(5, 128)).astype(np.float32)
  w = rng.normal(size=(128, 48)).astype(np.float32)
  if matrix in ("f32", "bf16"):
    inner = jnp.asarray(w, jnp.float32 if matrix == "f32" else jnp.bfloat16)
    dense = np.asarray(inner, np.float32)
  else:
    inner = as_jax(quantize(w, bits=8 if matrix == "q8_0" else 4, group_size=32,
                            symmetric=matrix != "q4_1"))
    dense = np.asarray(dequantize(inner))
  got = ops.matmul(jnp.asarray(x), Fp8ActivationWeight(inner))
  assert got.dtype == jnp.float32 and got.shape == (5, 48)
  assert rel_err(got, _reference_product(x, dense)) < 1e-6


@pytest.mark.parametrize("kernel", ["dot", "gemv"])
def test_pallas_kernels_take_the_fp8_rows(kernel, monkeypatch):
  # The quantized kernels (interpret mode) against the same numpy product: the FP8 rows
  # reach them with their scales. Their dots round to bf16 outputs: rel 1e-2.
  monkeypatch.setattr(ops.qmm, "GEMV_MAX_ROWS", ops.qmm.GEMV_ROW_LIMIT if kernel == "gemv" else 0)
  rng = np.random.default_rng(3)
  x = rng.normal(size=(3, 128)).astype(np.float32)
  inner = as_jax(quantize(rng.normal(size=(128, 32)), bits=4, group_size=32, symmetric=False))
  got = ops.matmul(jnp.asarray(x, jnp.bfloat16), Fp8ActivationWeight(inner), backend="pallas",
                   interpret=True)
  want = _reference_product(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32),
                            np.asarray(dequantize(inner)))
  assert got.dtype == jnp.bfloat16 and rel_err(got, want) < 1e-2


def test_lowers_for_cuda_with_fp8_rows():
  inner = as_jax(quantize(np.random.default_rng(4).normal(size=(256, 64)), bits=4,
                          group_size=32))
  text = lowers_for_cuda(lambda x, w: ops.matmul(x, w, backend="pallas"),
                         jnp.ones((4, 256), jnp.bfloat16), Fp8ActivationWeight(inner))
  assert "__gpu$xla.gpu.triton" in text and "f8E4M3FN" in text


def test_shape_mismatch_names_both_shapes():
  w = Fp8ActivationWeight(jnp.ones((64, 16)))
  with pytest.raises(ValueError, match=r"fp8_activation_matmul: x.shape=\(2, 32\).*\(64, 16\)"):
    ops.matmul(jnp.ones((2, 32)), w)
