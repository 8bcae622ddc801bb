"""float32 matmuls on a CPU with the native f32 kernel: matrices stored as column
tiles (`pallas_kernels.f32_matmul`), the same model as XLA's dot on [K, N] arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from o1jax.checkpoint import load_checkpoint
from o1jax.model import KVCache, Llama
from o1jax.testing import tiny_config, write_gguf_checkpoint
from pallas_kernels import native
from pallas_kernels.f32_matmul import TiledF32Weight, unpack
from pallas_kernels.quantized_tensor import dequantize

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not native.f32_matmul_available(),
    reason="tiles are used where the native f32 matmul runs (a CPU with a fused multiply-add)")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_f32_tiles") / "tiny.gguf"
  write_gguf_checkpoint(path, tiny_config(max_context=64), seed=8, matrix_type="Q4_1")
  return load_checkpoint(path)


def _run(model, config, tokens):
  starts = jnp.zeros((tokens.shape[0],), jnp.int32)
  out, _ = jax.jit(lambda t: model(t, starts, KVCache.zeros(config, tokens.shape[0], 32)))(tokens)
  return np.asarray(out)


def test_matrices_are_tiles_with_the_checkpoint_values(tiny_gguf):
  model = Llama(tiny_gguf.config, tiny_gguf.params)
  wq = model.layers[0].wq.get_value()
  assert isinstance(wq, TiledF32Weight) and isinstance(model.head_weight, TiledF32Weight)
  np.testing.assert_array_equal(np.asarray(unpack(wq)),
                                np.asarray(dequantize(tiny_gguf.params["layers"][0]["wq"])))
  assert model.layers[0].attn_norm.get_value().dtype == jnp.float32  # vectors stay as loaded
  ref = Llama(tiny_gguf.config, tiny_gguf.params, backend="reference")
  assert not isinstance(ref.layers[0].wq.get_value(), TiledF32Weight)  # XLA's dot there


def test_logits_match_the_xla_model(tiny_gguf):
  config = tiny_gguf.config
  tokens = jnp.asarray(np.random.default_rng(5).integers(3, 250, size=(3, 12)), jnp.int32)
  tiled = _run(Llama(config, tiny_gguf.params), config, tokens)
  xla = _run(Llama(config, tiny_gguf.params, backend="reference"), config, tokens)
  # Both exact f32 products, summed in another order.
  np.testing.assert_allclose(tiled, xla, rtol=0, atol=1e-5 * np.abs(xla).max())
  assert (tiled.argmax(-1) == xla.argmax(-1)).all()
