"""matmul_dtype="bfloat16": bf16 inputs, f32 accumulation, batch-invariant rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from o1jax.checkpoint import load_checkpoint
from o1jax.model import KVCache, Llama
from pallas_kernels import ops as kernel_ops
from o1jax.testing import tiny_config, write_hf_checkpoint


def _bf16_as_f64(a):
  return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def test_bf16_dot_is_bf16_inputs_with_f32_accumulation():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 3, 576)).astype(np.float32)
  w = jnp.asarray(rng.standard_normal((576, 200)), jnp.bfloat16)
  got = np.asarray(kernel_ops.bf16_matmul(jnp.asarray(x), w))
  want = _bf16_as_f64(x) @ _bf16_as_f64(w)  # exact products of the rounded inputs
  assert got.dtype == np.float32 and got.shape == (5, 3, 200)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (64, 48)])
def test_bf16_dot_row_does_not_depend_on_row_count(k, n):
  """XLA's bf16 dot rounds 2 rows differently from 3+: padding keeps rows identical."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((33, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  fn = jax.jit(kernel_ops.bf16_matmul)
  full = np.asarray(fn(x, w))
  for rows in (1, 2, 3, 5, 32):
    np.testing.assert_array_equal(np.asarray(fn(x[:rows], w)), full[:rows])


@pytest.fixture(scope="module")
def tiny_ck(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_bf16")
  write_hf_checkpoint(path, tiny_config(max_context=64), seed=5)
  return load_checkpoint(path)


def test_llama_bf16_stores_matrices_in_bf16_and_stays_close_to_f32(tiny_ck):
  f32 = Llama(tiny_ck.config, tiny_ck.params)
  bf16 = Llama(tiny_ck.config, tiny_ck.params, matmul_dtype="bfloat16")
  layer = bf16.layers[0]
  assert layer.wq.get_value().dtype == jnp.bfloat16 and bf16.head_weight.dtype == jnp.bfloat16
  assert layer.attn_norm.get_value().dtype == jnp.float32  # vectors stay as loaded
  tokens = jnp.asarray(np.random.default_rng(2).integers(3, 250, size=(2, 12)), jnp.int32)
  starts = jnp.zeros((2,), jnp.int32)
  want, _ = f32(tokens, starts, KVCache.zeros(tiny_ck.config, 2, 32))
  got, _ = bf16(tokens, starts, KVCache.zeros(tiny_ck.config, 2, 32))
  want, got = np.asarray(want), np.asarray(got)
  # bf16 keeps 8 significant bits: each matmul moves values by <~ 2^-8 relative.
  scale = np.abs(want).max()
  assert np.abs(got - want).max() < 0.03 * scale
  assert np.abs(got - want).max() > 0  # it really is a different computation


def test_matmul_dtype_is_validated(tiny_ck):
  with pytest.raises(ValueError, match="matmul_dtype='float16'"):
    Llama(tiny_ck.config, tiny_ck.params, matmul_dtype="float16")
