"""The tiled f32 weight and the native f32 matmul, against f64 numpy products."""

import json
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import f32_matmul as f32m
from pallas_kernels import native, ops
from tests.pallas_kernels.kernel_testing import run_native_build

needs_native = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not native.f32_matmul_available(),
    reason="the native f32 matmul needs a CPU with a fused multiply-add and a C++ compiler")


def _weights(k, n, seed=0):
  rng = np.random.default_rng(seed)
  return rng.standard_normal((k, n)).astype(np.float32)


@pytest.mark.parametrize("k,n", [(576, 192), (64, 100), (7, 33), (1, 1)])
def test_pack_round_trips_and_pads_with_zeros(k, n):
  w = _weights(k, n)
  tw = f32m.pack(jnp.asarray(w))
  assert tw.shape == (k, n) and tw.tiles.shape == (-(-n // 32), k, 32)
  np.testing.assert_array_equal(np.asarray(f32m.unpack(tw)), w)
  padding = np.asarray(tw.tiles).transpose(1, 0, 2).reshape(k, -1)[:, n:]
  assert not padding.any()
  ids = jnp.asarray([0, n - 1, n // 2, 0], jnp.int32)
  np.testing.assert_array_equal(np.asarray(f32m.columns(tw, ids)), w[:, np.asarray(ids)].T)


@needs_native
@pytest.mark.parametrize("m", [1, 2, 7, 8, 12, 13, 25, 64])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (37, 70), (3, 32)])
def test_native_matches_a_float64_product(m, k, n):
  rng = np.random.default_rng(m * 1000 + k)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = _weights(k, n, seed=m)
  got = np.asarray(jax.jit(ops.tiled_f32_matmul)(jnp.asarray(x), f32m.pack(jnp.asarray(w))))
  want = x.astype(np.float64) @ w.astype(np.float64)
  # f32 accumulation over K terms of size ~1: error ~ sqrt(K) * 2^-24 * |terms|
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * k)
  assert got.shape == (m, n)


@needs_native
def test_native_row_does_not_depend_on_the_other_rows():
  """Row r alone, or among 1-64 others at any position, gives the same bits: a
  verify call's positions and a batch's rows get a one-row step's logits."""
  rng = np.random.default_rng(3)
  w = f32m.pack(jnp.asarray(_weights(576, 1536)))
  x = jnp.asarray(rng.standard_normal((64, 576)).astype(np.float32))
  mm = jax.jit(ops.tiled_f32_matmul)
  alone = np.stack([np.asarray(mm(x[i:i + 1], w))[0] for i in (0, 5, 11, 12, 63)])
  for m in (2, 8, 12, 13, 24, 64):
    rows = [i for i in (0, 5, 11, 12, 63) if i < m]
    got = np.asarray(mm(x[:m], w))[rows]
    np.testing.assert_array_equal(got, alone[:len(rows)])


@needs_native
def test_reference_backend_and_leading_dims():
  """backend="reference" runs XLA's dot on the unpacked weight (same values to f32
  rounding); [..., K] inputs keep their leading dims; a bad K names both shapes."""
  rng = np.random.default_rng(4)
  w = _weights(96, 64)
  x = rng.standard_normal((2, 3, 96)).astype(np.float32)
  tw = f32m.pack(jnp.asarray(w))
  native_y = np.asarray(ops.matmul(jnp.asarray(x), tw))
  ref_y = np.asarray(ops.matmul(jnp.asarray(x), tw, backend="reference"))
  assert native_y.shape == ref_y.shape == (2, 3, 64)
  np.testing.assert_allclose(native_y, ref_y, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"x.shape=\(2, 95\).*W.shape=\(96, 64\)"):
    ops.matmul(jnp.zeros((2, 95)), tw)
  with pytest.raises(ValueError, match=r"tiles\(2, 96, 16\)"):
    native.f32_matmul(jnp.zeros((1, 96)), jnp.zeros((2, 96, 16)))


def test_only_auto_on_a_cpu_with_the_kernel_prefers_tiles():
  assert not ops.tiled_f32_preferred("reference")
  assert not ops.tiled_f32_preferred("pallas")
  expected = jax.default_backend() == "cpu" and native.f32_matmul_available()
  assert ops.tiled_f32_preferred("auto") == expected


# Another build of the kernel, in a process of its own (the library loads once per process):
# prints its name and its products' bits for the cases below.
_OTHER_BUILD = """
import json, sys, numpy as np, jax, jax.numpy as jnp
from pallas_kernels import f32_matmul as f32m, native, ops
out = {"build": native.f32_matmul_build(), "results": []}
for m, k, n in json.loads(sys.argv[1]):
  rng = np.random.default_rng(m * 1000 + k)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  y = np.asarray(jax.jit(ops.tiled_f32_matmul)(jnp.asarray(x), f32m.pack(jnp.asarray(w))))
  out["results"].append(y.view(np.uint32).tolist())
print(json.dumps(out))
"""
# (the AVX2 build: 3-row groups below 32 rows, 6-row half-tile groups from 32 on, every remainder)
_CASES = [(1, 576, 1536), (2, 37, 70), (3, 576, 192), (4, 1536, 64), (7, 3, 32), (13, 576, 96),
          (31, 64, 40), (32, 37, 70), (35, 576, 96), (40, 37, 70)]


@needs_native
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 builds")
@pytest.mark.parametrize("arch,build,needs", [
    ("-march=haswell", "avx2", {"avx2", "fma"}),
    ("-march=x86-64-v2 -mfma", "portable", {"sse4_2", "fma"}),
])
def test_every_build_gives_the_same_bits(arch, build, needs):
  """What a CPU without AVX-512 runs (the AVX2 build; the portable one, as on aarch64),
  built here with O1JAX_NATIVE_ARCH_FLAGS: the same in-order fused sums, so the same bits
  as this CPU's build, at every row count (rows alone or together: see above)."""
  other = run_native_build(arch, needs, _OTHER_BUILD, json.dumps(_CASES))
  assert other["build"] == build
  for (m, k, n), bits in zip(_CASES, other["results"]):
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    here = np.asarray(jax.jit(ops.tiled_f32_matmul)(jnp.asarray(x), f32m.pack(jnp.asarray(w))))
    np.testing.assert_array_equal(np.asarray(bits, np.uint32).view(np.float32), here)
