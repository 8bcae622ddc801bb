"""matmul_dtype="int8": quantized weights kept as they are, int8 activation levels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from o1jax.checkpoint import load_checkpoint
from o1jax.model import KVCache, Llama
from o1jax.testing import tiny_config, write_gguf_checkpoint, write_hf_checkpoint
from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize
from pallas_kernels.vnni_matmul import VnniWeight, unpack


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_int8") / "tiny.gguf"
  write_gguf_checkpoint(path, tiny_config(max_context=64), seed=6, matrix_type="Q4_1")
  return load_checkpoint(path)


def _logits(model, config, tokens):
  starts = jnp.zeros((tokens.shape[0],), jnp.int32)
  out, _ = jax.jit(lambda t: model(t, starts, KVCache.zeros(config, tokens.shape[0], 32)))(tokens)
  return np.asarray(out)


def _tokens(seed=2):
  return jnp.asarray(np.random.default_rng(seed).integers(3, 250, size=(2, 12)), jnp.int32)


def test_int8_keeps_the_quantized_weights_exactly(tiny_gguf):
  model = Llama(tiny_gguf.config, tiny_gguf.params, matmul_dtype="int8")
  wq = tiny_gguf.params["layers"][0]["wq"]
  assert isinstance(wq, QuantizedTensor) and wq.bits == 4
  # q/k/v are fused into one matrix: wq is its first columns
  assert model.layers[0].wq is None and model.layers[0].w_up is None
  packed = model.layers[0].wqkv.get_value()
  assert isinstance(packed, VnniWeight) and isinstance(model.head_weight, VnniWeight)
  config = tiny_gguf.config
  assert packed.shape == (wq.shape[0], (config.n_heads + 2 * config.n_kv_heads) * config.head_dim)
  q, scale, minimum = unpack(packed)
  k = wq.shape[0]
  deq = (q.astype(jnp.float32) - packed.zero).reshape(k // 32, 32, -1) * scale[:, None] \
      + minimum[:, None]
  np.testing.assert_array_equal(np.asarray(deq.reshape(k, -1))[:, :wq.shape[1]],
                                np.asarray(dequantize(wq)))
  assert model.layers[0].attn_norm.get_value().dtype == jnp.float32  # vectors stay as loaded


def test_int8_logits_stay_close_to_f32(tiny_gguf):
  config = tiny_gguf.config
  want = _logits(Llama(config, tiny_gguf.params), config, _tokens())
  got = _logits(Llama(config, tiny_gguf.params, matmul_dtype="int8"), config, _tokens())
  err = np.abs(got - want).max()
  # ~15-bit activations: far inside bf16's 2^-8 (test_bf16_matmul allows 0.03).
  assert 0 < err < 2e-3 * np.abs(want).max(), err


def test_int8_native_and_reference_backends_agree(tiny_gguf):
  config = tiny_gguf.config
  native = _logits(Llama(config, tiny_gguf.params, matmul_dtype="int8"), config, _tokens(3))
  ref = _logits(Llama(config, tiny_gguf.params, matmul_dtype="int8", backend="reference"),
                config, _tokens(3))
  # Same integers up to residual roundings one step apart (x - xa*s fused or
  # not); through two layers that is ~1e-4 of the logits, as far as either is
  # from f32.
  np.testing.assert_allclose(native, ref, rtol=0, atol=3e-4 * np.abs(ref).max())


def test_int8_quantizes_dense_checkpoints_to_q8_0(tmp_path):
  write_hf_checkpoint(tmp_path, tiny_config(max_context=64), seed=7)
  ck = load_checkpoint(tmp_path)
  model = Llama(ck.config, ck.params, matmul_dtype="int8")
  assert model.layers[1].w_down.get_value().bits == 8
  want = _logits(Llama(ck.config, ck.params), ck.config, _tokens(4))
  got = _logits(model, ck.config, _tokens(4))
  # Q8_0 weights (2^-8 of each block's largest weight) dominate the error here.
  assert np.abs(got - want).max() < 0.03 * np.abs(want).max()


def test_int8_keeps_a_matrix_whose_k_is_not_whole_blocks_dense(tmp_path):
  """4 heads of 18: the output projection's K is 72, not whole 32-row blocks (the model
  was refused in int8 mode, which `fast=True` picks on this machine): that matrix keeps
  its dense product, the others take the kernel."""
  config = tiny_config(d_model=64, n_heads=4, n_kv_heads=1, head_dim=18, ffn_dim=128,
                       max_context=64)
  write_hf_checkpoint(tmp_path, config, seed=7)
  ck = load_checkpoint(tmp_path)
  model = Llama(ck.config, ck.params, matmul_dtype="int8")
  layer = model.layers[0]
  assert not isinstance(layer.wo.get_value(), VnniWeight)
  assert isinstance(layer.w_down.get_value(), VnniWeight)
  want = _logits(Llama(ck.config, ck.params), ck.config, _tokens(4))
  got = _logits(model, ck.config, _tokens(4))
  assert np.abs(got - want).max() < 0.03 * np.abs(want).max()
