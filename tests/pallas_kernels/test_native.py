"""The native CPU paged decode attention against the XLA reference it replaces.

Both compute softmax(q.K / sqrt(D)) V in f32 over the same keys, in a
different summation order: outputs (|values| <~ 3) agree to 1e-5."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native
from pallas_kernels.paged_attention import paged_decode_attention_reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only kernel")


def _case(seed, batch, heads, kv_heads, head_dim, block_size, num_blocks, max_blocks):
  rng = np.random.default_rng(seed)
  pool = lambda: jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)),
                             jnp.float32)
  q = jnp.asarray(rng.standard_normal((batch, heads, head_dim)), jnp.float32)
  tables = jnp.asarray(rng.integers(0, num_blocks, size=(batch, max_blocks)), jnp.int32)
  lengths = jnp.asarray(rng.integers(0, max_blocks * block_size + 1, size=batch), jnp.int32)
  return q, pool(), pool(), tables, lengths


def test_builds_where_a_compiler_exists():
  if shutil.which("g++") is None and shutil.which("c++") is None:
    pytest.skip("no C++ compiler: the engine falls back to the XLA path")
  assert native.available(), native.unavailable_reason()


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 32), (6, 2, 128, 16)])
def test_matches_xla_path(heads, kv_heads, head_dim, block_size):
  if not native.available():
    pytest.skip(native.unavailable_reason())
  q, kp, vp, tables, lengths = _case(0, 7, heads, kv_heads, head_dim, block_size, 40, 6)
  # edge rows: nothing visible, one key, more keys than the table holds
  lengths = lengths.at[0].set(0).at[1].set(1).at[2].set(6 * block_size + 50)
  got = jax.jit(native.paged_decode_attention)(q, kp, vp, tables, lengths)
  want = jax.jit(paged_decode_attention_reference)(q, kp, vp, tables, lengths)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  assert not np.asarray(got[0]).any()  # length 0 -> zeros


@pytest.mark.parametrize("window", [1, 5, 16, 37, 10_000])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sliding_window_matches_xla_path(window, dtype):
  """Only the last `window` keys visible (Phi-3's and Gemma 3's local layers): windows
  of one key, within a block, a block's size, across blocks, longer than every row."""
  if not native.available():
    pytest.skip(native.unavailable_reason())
  q, kp, vp, tables, lengths = _case(7, 6, 9, 3, 64, 16, 40, 6)
  kp, vp = kp.astype(dtype), vp.astype(dtype)
  lengths = lengths.at[0].set(0).at[1].set(1).at[2].set(6 * 16 + 50)
  attend = lambda *a: native.paged_decode_attention(*a, sliding_window=window)
  got = jax.jit(attend)(q, kp, vp, tables, lengths)
  want = jax.jit(lambda *a: paged_decode_attention_reference(*a, sliding_window=window))(
      q, kp, vp, tables, lengths)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  assert not np.asarray(got[0]).any()  # length 0 -> zeros
  if window < 50:  # the window binds: not the same as attending to every key
    everything = jax.jit(native.paged_decode_attention)(q, kp, vp, tables, lengths)
    assert np.abs(np.asarray(everything) - np.asarray(got)).max() > 1e-3
  with pytest.raises(ValueError, match=r"sliding_window=0 must be >= 1 or None"):
    native.paged_decode_attention(q, kp, vp, tables, lengths, sliding_window=0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 16), (6, 2, 128)])
def test_bf16_pools_match_xla_path(heads, kv_heads, head_dim):
  """bf16 pools are read as stored (widened to f32 exactly): same keys and values
  as the XLA path gets from the same bf16 pools."""
  if not native.available():
    pytest.skip(native.unavailable_reason())
  q, kp, vp, tables, lengths = _case(4, 5, heads, kv_heads, head_dim, 16, 24, 5)
  kp, vp = kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16)
  lengths = lengths.at[0].set(0).at[1].set(1)
  got = jax.jit(native.paged_decode_attention)(q, kp, vp, tables, lengths)
  want = jax.jit(paged_decode_attention_reference)(q, kp, vp, tables, lengths)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  with pytest.raises(ValueError, match="pools are bfloat16 / float32"):
    native.paged_decode_attention(q, kp, vp.astype(jnp.float32), tables, lengths)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_write_pool_rows_matches_scatter(dtype):
  """In place when XLA can alias the pool, copied when the old pool is still
  needed; rows whose block is out of range are dropped, like mode="drop"."""
  if not native.available():
    pytest.skip(native.unavailable_reason())
  rng = np.random.default_rng(5)
  pool = jnp.asarray(rng.standard_normal((6, 4, 3, 16)), dtype)
  rows = jnp.asarray(rng.standard_normal((5, 3, 16)), dtype)
  block = jnp.asarray([2, 0, 6, 5, 9], jnp.int32)  # 6 and 9: past the pool, dropped
  offset = jnp.asarray([1, 3, 0, 0, 2], jnp.int32)
  want = pool.at[block, offset].set(rows, mode="drop")
  both = jax.jit(lambda p, *a: (native.write_pool_rows(p, *a), p))(pool, rows, block, offset)
  np.testing.assert_array_equal(np.asarray(both[0]), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(both[1]), np.asarray(pool))  # old pool intact
  donated = jax.jit(native.write_pool_rows, donate_argnums=0)(jnp.array(pool), rows, block, offset)
  np.testing.assert_array_equal(np.asarray(donated), np.asarray(want))
  with pytest.raises(ValueError, match="rows"):
    native.write_pool_rows(pool, rows.astype(jnp.float16), block, offset)


def test_row_result_independent_of_batch():
  """A row gives bit-identical output alone and inside a batch of 33 rows."""
  if not native.available():
    pytest.skip(native.unavailable_reason())
  q, kp, vp, tables, lengths = _case(1, 33, 9, 3, 64, 16, 64, 8)
  fn = jax.jit(native.paged_decode_attention)
  batch = np.asarray(fn(q, kp, vp, tables, lengths))
  for row in (0, 17, 32):
    alone = np.asarray(fn(q[row:row + 1], kp, vp, tables[row:row + 1], lengths[row:row + 1]))
    np.testing.assert_array_equal(alone[0], batch[row])


def test_bad_shapes_name_the_arrays():
  if not native.available():
    pytest.skip(native.unavailable_reason())
  q, kp, vp, tables, lengths = _case(2, 3, 9, 3, 64, 16, 8, 2)
  with pytest.raises(ValueError, match=r"q\(3, 9, 64\).*k_pages"):
    native.paged_decode_attention(q, kp[..., :32], vp[..., :32], tables, lengths)
  with pytest.raises(ValueError, match="lengths"):
    native.paged_decode_attention(q, kp, vp, tables, lengths[:2])


def test_concurrent_calls_finish_and_agree():
  """Calls from several threads at once share one 2-thread pool: each call can do
  all its work itself, so none waits for a pool thread another call holds."""
  if not native.available():
    pytest.skip(native.unavailable_reason())
  import threading

  q, kp, vp, tables, lengths = _case(3, 16, 9, 3, 64, 16, 64, 8)
  fn = jax.jit(native.paged_decode_attention)
  want = np.asarray(fn(q, kp, vp, tables, lengths))
  results, errors = [], []

  def worker():
    try:
      for _ in range(20):
        results.append(np.asarray(fn(q, kp, vp, tables, lengths)))
    except Exception as e:  # noqa: BLE001 - reported below
      errors.append(e)

  threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads), "a concurrent call did not finish"
  assert not errors and len(results) == 80
  for r in results:
    np.testing.assert_array_equal(r, want)


def test_int8_matmul_builds_where_the_cpu_has_vnni_or_avx2():
  if shutil.which("g++") is None and shutil.which("c++") is None:
    pytest.skip("no C++ compiler: int8 matmuls use the XLA reference")
  flags = open("/proc/cpuinfo").read().split()
  vnni = all(f in flags for f in ("avx512f", "avx512bw", "avx512_vnni"))
  avx2 = all(f in flags for f in ("avx2", "fma", "f16c"))
  assert native.int8_matmul_build() == ("avx512_vnni" if vnni else "avx2" if avx2 else None), (
      native.unavailable_reason())
  assert native.int8_matmul_available() == (vnni or avx2)
