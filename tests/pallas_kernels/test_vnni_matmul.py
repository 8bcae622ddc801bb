"""Quantized weights x int8-quantized activations (`pallas_kernels.vnni_matmul`).

The layout round-trips to the exact dequantized weights; the native kernel
matches the XLA reference (same activation rounding, f32 sums in another order);
both stay within the two-level activation rounding of an exact f32 matmul; and a
row's result is bit-identical whatever other rows share the call."""

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native, ops
from pallas_kernels import vnni_matmul as vm
from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize, quantize
from tests.pallas_kernels.kernel_testing import run_native_build

FORMATS = {"q4_0": dict(bits=4, symmetric=True), "q4_1": dict(bits=4, symmetric=False),
           "q8_0": dict(bits=8)}


def _weight(fmt, k, n, seed=0, group_size=32):
  w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
  return quantize(w, group_size=group_size, **FORMATS[fmt])


def _packed(qt):
  return jax.tree.map(jnp.asarray, vm.pack(qt))


# GGUF IQ4_NL / IQ4_XS: 8-bit codes of 16 levels (ggml's kvalues_iq4nl), scale per 32.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      np.int8)


def _iq4_weight(k, n, seed=0, levels=IQ4_LEVELS, minimum=False):
  rng = np.random.default_rng(seed)
  codes = levels[rng.integers(0, len(levels), (k, n))]
  f16 = lambda a: a.astype(np.float16).astype(np.float32)
  scale = f16(rng.random((k // 32, n)) * 0.01 + 1e-3)
  mn = f16(rng.standard_normal((k // 32, n)) * 0.01) if minimum else None
  return QuantizedTensor(packed=codes, scale=scale, minimum=mn, bits=8, group_size=32)


def _activations(m, k, seed=1):
  x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
  x[0, :32] = 0.0  # an all-zero block
  if m > 1:
    x[1, 5] = 80.0  # an outlier that sets its block's scale
  return x


def _needs_native():
  if not native.int8_matmul_available():
    pytest.skip("native int8 matmul unavailable (no compiler, no AVX512-VNNI / AVX2, or not a CPU)")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,n,group", [(64, 40, 32), (576, 192, 32), (128, 48, 64)])
def test_layout_round_trips_to_the_dequantized_weight(fmt, k, n, group):
  qt = _weight(fmt, k, n, group_size=group)
  w = _packed(qt)
  assert w.shape == (k, n) and w.has_min == (fmt == "q4_1")
  q, scale, minimum = vm.unpack(w)
  deq = (q.astype(jnp.float32) - w.zero).reshape(k // 32, 32, -1) * scale[:, None] + minimum[:, None]
  deq = np.asarray(deq.reshape(k, -1))
  np.testing.assert_array_equal(deq[:, :n], np.asarray(dequantize(qt)))
  assert not deq[:, n:].any()  # padding columns are zero


def test_dense_matrices_become_q8_0():
  w = np.random.default_rng(2).standard_normal((64, 20)).astype(np.float32)
  packed = vm.pack(w)
  assert packed.bits == 8 and packed.zero == 128
  q, scale, _ = vm.unpack(jax.tree.map(jnp.asarray, packed))
  deq = (q.astype(jnp.float32) - 128).reshape(2, 32, -1) * scale[:, None]
  np.testing.assert_array_equal(np.asarray(deq.reshape(64, -1))[:, :20],
                                np.asarray(dequantize(quantize(w, bits=8))))


def test_activation_levels_reconstruct_each_block():
  x = _activations(3, 96)
  xa, xr, xs, xsum, fsum = (np.asarray(a) for a in vm.quantize_activations(jnp.asarray(x)))
  assert np.abs(xa).max() <= 127 and np.abs(xr).max() <= 64
  combined = 127 * xa + xr
  recon = (combined.reshape(3, 3, 32) * xs[..., None]).reshape(3, 96)
  step = np.repeat(xs, 32, axis=1)  # the fine step s / 127 of each value's block
  assert np.all(np.abs(recon - x) <= 0.5 * step + 1e-6 * np.abs(x))
  np.testing.assert_array_equal(xsum, combined.reshape(3, 3, 32).sum(-1))
  np.testing.assert_allclose(fsum, x.reshape(3, 3, 32).sum(-1), rtol=1e-6, atol=1e-6)
  assert not recon[0, :32].any()  # the zero block stays zero


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_is_an_f32_matmul_up_to_activation_rounding(fmt):
  qt = _weight(fmt, 576, 192)
  x = _activations(5, 576)
  got = np.asarray(jax.jit(vm.vnni_matmul_reference)(jnp.asarray(x), _packed(qt)))
  want = x.astype(np.float64) @ np.asarray(dequantize(qt), np.float64)
  # ~15-bit activations: each row's error is a few 1e-5 of its largest output.
  err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
  assert err.max() < 3e-4, err


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", [(1, 576, 192), (5, 1536, 576), (33, 64, 40)])
def test_native_matches_reference(fmt, m, k, n):
  _needs_native()
  qt = _weight(fmt, k, n, seed=m)
  w, x = _packed(qt), jnp.asarray(_activations(m, k, seed=k))
  got = np.asarray(jax.jit(lambda x: ops.int8_matmul(x, w))(x))
  want = np.asarray(jax.jit(lambda x: ops.int8_matmul(x, w, backend="reference"))(x))
  assert got.shape == (m, n)
  # Same integers; the f32 sums over blocks run in another order (and a residual
  # may round one step apart: the kernel computes x - xa*s fused, XLA in two steps).
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_row_does_not_depend_on_the_other_rows(fmt):
  _needs_native()
  w = _packed(_weight(fmt, 576, 1536))
  x = jnp.asarray(_activations(40, 576, seed=7))
  fn = jax.jit(lambda x: ops.int8_matmul(x, w))
  full = np.asarray(fn(x))
  # 1-7 rows: VNNI register tiles of 4 rows plus every remainder size; 32 and 40:
  # AMX tiles of 16 rows where the OS grants AMX (else VNNI again).
  for rows in (1, 2, 3, 5, 7, 32):
    np.testing.assert_array_equal(np.asarray(fn(x[:rows])), full[:rows])
  np.testing.assert_array_equal(np.asarray(fn(x[np.array([9, 3, 9])])), full[[9, 3, 9]])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [6, 20])
def test_nan_and_inf_activations_give_nan_rows_as_the_reference(fmt, m):
  # Before: a NaN row came out finite (max ignored the NaN) and an infinite one with the
  # wrong signs (the int conversion wrapped): a blow-up upstream left no trace.
  _needs_native()
  w = _packed(_weight(fmt, 576, 96))
  x = jnp.asarray(_nonfinite(_activations(m, 576, seed=3)))
  got = np.asarray(jax.jit(lambda x: ops.int8_matmul(x, w))(x))
  want = np.asarray(jax.jit(lambda x: ops.int8_matmul(x, w, backend="reference"))(x))
  assert np.isnan(got[:4]).all() and np.isnan(want[:4]).all()
  assert np.isfinite(got[4:]).all()
  np.testing.assert_allclose(got[4:], want[4:], rtol=0, atol=2e-5 * np.abs(want[4:]).max())


@pytest.mark.parametrize("m", [1, 20])
def test_concatenated_columns_compute_each_part_bit_for_bit(m):
  parts = [_packed(_weight("q4_1", 64, n, seed=n)) for n in (48, 16, 40)]
  fused = vm.concat_columns(parts)
  assert fused.shape == (64, 104)
  x = jnp.asarray(_activations(m, 64, seed=3))
  for backend in ("auto", "reference"):
    whole = np.asarray(jax.jit(lambda x: ops.int8_matmul(x, fused, backend=backend))(x))
    alone = np.concatenate([np.asarray(jax.jit(lambda x, w=w: ops.int8_matmul(
        x, w, backend=backend))(x)) for w in parts], axis=1)
    if backend == "auto" and native.int8_matmul_available():  # the kernel: bit for bit
      np.testing.assert_array_equal(whole, alone)
    else:  # XLA may order the f32 sums over blocks differently for another N
      np.testing.assert_allclose(whole, alone, rtol=0, atol=1e-6 * np.abs(alone).max())
  with pytest.raises(ValueError, match="multiples of 16"):
    vm.concat_columns([parts[2], parts[0]])
  with pytest.raises(ValueError, match="differ in format"):
    vm.concat_columns([parts[0], _packed(_weight("q8_0", 64, 16))])


def test_leading_dims_and_errors():
  w = _packed(_weight("q4_1", 64, 40))
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 64)), jnp.float32)
  y = ops.int8_matmul(x, w)
  assert y.shape == (2, 3, 40)
  np.testing.assert_allclose(np.asarray(y).reshape(6, 40),
                             np.asarray(ops.int8_matmul(x.reshape(6, 64), w)), rtol=0, atol=0)
  with pytest.raises(ValueError, match=r"x.shape=\(2, 3, 64\) does not match W.shape=\(96, 40\)"):
    ops.int8_matmul(x, _packed(_weight("q4_1", 96, 40)))
  with pytest.raises(ValueError, match="layers.3.wq has K=40, not a multiple of 32"):
    vm.pack(np.zeros((40, 16), np.float32), "layers.3.wq")
  with pytest.raises(ValueError, match="w_up has shape"):
    vm.pack(np.zeros((4, 4, 4), np.float32), "w_up")


def test_the_xla_fallback_says_once_that_it_is_slow(monkeypatch, caplog):
  # On a CPU without the native kernel, int8 matmuls still compute (the reference) but
  # the user is told once, with the reason, rather than finding a 10x slowdown.
  monkeypatch.setattr(native, "int8_matmul_available", lambda: False)
  monkeypatch.setattr(ops, "_int8_fallback_warned", False)
  w = _packed(_weight("q4_0", 64, 16))
  x = jnp.asarray(_activations(2, 64))
  with caplog.at_level("WARNING", logger="pallas_kernels.ops"):
    y = ops.int8_matmul(x, w)
    ops.int8_matmul(x, w)
    ops.int8_matmul(x, w, backend="reference")  # asked for explicitly: no warning
  np.testing.assert_array_equal(np.asarray(y), np.asarray(vm.vnni_matmul_reference(x, w)))
  warned = [r.getMessage() for r in caplog.records if "matmul_dtype=int8" in r.getMessage()]
  assert len(warned) == 1 and "XLA reference" in warned[0]


@pytest.mark.parametrize("native_int8, platform, expected", [
    (True, "cpu", "int8"), (False, "cpu", "float32"), (True, "gpu", "bfloat16")])
def test_fastest_matmul_dtype_picks_int8_only_where_the_native_kernel_runs(
    monkeypatch, native_int8, platform, expected):
  monkeypatch.setattr(native, "int8_matmul_available", lambda: native_int8)
  monkeypatch.setattr(ops.jax, "default_backend", lambda: platform)
  assert ops.fastest_matmul_dtype() == expected


# The AVX2 build, in a process of its own (the kernel library loads once per process):
# its name and its products' bits for every format and row-count case below.
_AVX2_BUILD = """
import json, sys, numpy as np, jax, jax.numpy as jnp
from pallas_kernels import native, ops
from tests.pallas_kernels.test_vnni_matmul import _CROSS_BUILD_CASES, _cross_build_case
out = {"build": native.int8_matmul_build(), "results": []}
for case in _CROSS_BUILD_CASES:
  w, x = _cross_build_case(*case)
  y = np.asarray(jax.jit(lambda x: ops.int8_matmul(x, w))(x))
  out["results"].append(y.view(np.uint32).tolist())
print(json.dumps(out))
"""
# Row counts: the AVX2 build's 4-row groups and every remainder; 16 and 20 take AMX tiles
# where this CPU has them. K 1536: many blocks; N 40: a padded last tile. "iq4": 16 levels
# as nibbles with a lut.
_CROSS_BUILD_CASES = [(fmt, m, k, n) for fmt in [*FORMATS, "iq4", "iq4_min"]
                      for m, k, n in [(1, 576, 192), (3, 1536, 64), (6, 64, 40), (20, 576, 96)]]
_CROSS_BUILD_CASES += [("q4_1_nonfinite", 6, 64, 40), ("q8_0_nonfinite", 20, 576, 96)]


def _nonfinite(x):
  """Rows 0-3 with a NaN, +inf, -inf, and a NaN in their last block."""
  x = x.copy()
  x[0, 5], x[1, 5], x[2, 5], x[3, -1] = np.nan, np.inf, -np.inf, np.nan
  return x


def _cross_build_case(fmt, m, k, n):
  fmt, nonfinite = fmt.removesuffix("_nonfinite"), fmt.endswith("_nonfinite")
  weight = (_iq4_weight(k, n, seed=m + k, minimum=fmt == "iq4_min") if fmt.startswith("iq4")
            else _weight(fmt, k, n, seed=m + k))
  x = _activations(m, k, seed=k)
  return _packed(weight), jnp.asarray(_nonfinite(x) if nonfinite else x)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 builds")
def test_the_avx2_build_gives_the_vnni_builds_bits():
  """What a CPU without AVX-512 runs (vpmaddubsw on nibbles instead of vpdpbusd), built
  here with O1JAX_NATIVE_ARCH_FLAGS=-march=haswell: the same exact integer sums and the
  same f32 operations in the same order, so the same bits as this CPU's build."""
  _needs_native()
  other = run_native_build("-march=haswell", {"avx2", "fma", "f16c"}, _AVX2_BUILD)
  assert other["build"] == "avx2"
  for case, bits in zip(_CROSS_BUILD_CASES, other["results"]):
    w, x = _cross_build_case(*case)
    here = np.asarray(jax.jit(lambda x: ops.int8_matmul(x, w))(x))
    np.testing.assert_array_equal(np.asarray(bits, np.uint32).view(np.float32), here,
                                  err_msg=str(case))


def test_sixteen_levels_pack_as_nibbles_with_a_lut():
  """8-bit codes of at most 16 levels (IQ4_NL / IQ4_XS) take half the bytes: 4-bit indices
  into a lut of their stored values. Same values (round trip), and the kernel gives the
  bits the 8-bit layout of the same weight gives, at every row count (VNNI, AMX)."""
  qt = _iq4_weight(576, 200, seed=3)
  w = vm.pack(qt)
  assert w.bits == 4 and w.zero == 128 and len(w.lut) == 16
  wide = vm.widened(w)
  assert wide.bits == 8 and wide.lut is None and wide.packed.nbytes == 2 * w.packed.nbytes
  q, _, _ = vm.unpack(w)
  np.testing.assert_array_equal(np.asarray(q)[:, :200] - 128, np.asarray(qt.packed))
  np.testing.assert_array_equal(np.asarray(vm.unpack(wide)[0]), np.asarray(q))
  few = vm.pack(_iq4_weight(64, 40, levels=IQ4_LEVELS[[2, 9, 15]]))  # 3 levels: lut padded
  assert few.lut[:3] == (-83 + 128, 13 + 128, 113 + 128) and set(few.lut[3:]) == {241}
  assert vm.pack(_weight("q8_0", 64, 40)).lut is None  # a real Q8_0: 8-bit
  _needs_native()
  x = jnp.asarray(_activations(40, 576, seed=5))
  w, wide = (jax.tree.map(jnp.asarray, a) for a in (w, wide))
  for rows in (1, 3, 8, 20, 40):
    got = np.asarray(jax.jit(lambda x: ops.int8_matmul(x, w))(x[:rows]))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(lambda x: ops.int8_matmul(x, wide))(x[:rows])))
  want = np.asarray(ops.int8_matmul(x, w, backend="reference"))
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_concatenated_parts_share_a_lut_or_stay_apart():
  same = [vm.pack(_iq4_weight(64, 32, seed=s)) for s in (1, 2)]
  cat = vm.concat_columns(same)
  assert cat.lut == same[0].lut and cat.bits == 4 and cat.n == 64
  np.testing.assert_array_equal(np.asarray(vm.unpack(cat)[0]),
                                np.concatenate([np.asarray(vm.unpack(w)[0]) for w in same], 1))
  other = vm.pack(_iq4_weight(64, 24, seed=3, levels=IQ4_LEVELS[:8]))
  with pytest.raises(ValueError, match="differ in format"):  # the model keeps them apart
    vm.concat_columns(same + [other])
