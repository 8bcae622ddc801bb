"""Building blocks against hand-computed values."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from o1jax.model import layers
from pallas_kernels.quantized_tensor import quantize


def test_rms_norm_hand_case():
  # x = [3, 4]: mean(x^2) = 12.5, rsqrt(12.5 + 0.5) = 1/sqrt(13); weight [1, 2].
  out = layers.rms_norm(jnp.array([[3.0, 4.0]]), jnp.array([1.0, 2.0]), eps=0.5)
  np.testing.assert_allclose(np.asarray(out), [[3 / math.sqrt(13), 8 / math.sqrt(13)]], rtol=1e-6)


def test_rope_rotates_halves_by_position_times_frequency():
  # head_dim 4 -> inv_freq = [1, theta^(-1/2)] = [1, 0.01] for theta = 1e4.
  inv = layers.rope_inv_freq(4, 10000.0)
  np.testing.assert_allclose(np.asarray(inv), [1.0, 0.01], rtol=1e-6)
  x = jnp.array([1.0, 0.0, 0.0, 1.0]).reshape(1, 1, 1, 4)  # pairs (x0, x2) = (1, 0), (x1, x3) = (0, 1)
  at0 = layers.apply_rope(x, *layers.rope_tables(jnp.array([[0]]), 4, 10000.0))
  np.testing.assert_allclose(np.asarray(at0), np.asarray(x), atol=1e-7)  # position 0: identity
  at2 = np.asarray(layers.apply_rope(x, *layers.rope_tables(jnp.array([[2]]), 4, 10000.0)))
  at2 = at2.reshape(4)
  # pair 0 (angle 2): (1, 0) -> (cos 2, sin 2); pair 1 (angle 0.02): (0, 1) -> (-sin .02, cos .02)
  want = [math.cos(2), -math.sin(0.02), math.sin(2), math.cos(0.02)]
  np.testing.assert_allclose(at2, want, rtol=1e-6, atol=1e-7)


def test_partial_rope_rotates_the_leading_dims_and_passes_the_rest():
  # head_dim 6, rotary_dim 4: pairs (x0, x2) and (x1, x3) turn; x4, x5 pass through.
  x = jnp.array([1.0, 0.0, 0.0, 1.0, 5.0, -7.0]).reshape(1, 1, 1, 6)
  got = np.asarray(layers.apply_rope(x, *layers.rope_tables(jnp.array([[2]]), 4, 10000.0)))
  want = [math.cos(2), -math.sin(0.02), math.sin(2), math.cos(0.02), 5.0, -7.0]
  np.testing.assert_allclose(got.reshape(6), want, rtol=1e-6, atol=1e-7)


def test_longrope_short_below_the_original_context_long_from_it_scaled():
  # rotary_dim 4, theta 100: base frequencies [1, 0.1]; short factors [2, 4], long [8, 16].
  scaling = {"rope_type": "longrope", "short_factor": (2.0, 4.0), "long_factor": (8.0, 16.0),
             "original_max_position_embeddings": 10, "attention_factor": 1.5}
  cos, sin = layers.rope_tables(jnp.array([[3, 9, 10, 25]]), 4, 100.0, scaling)
  freqs = {3: (1 / 2, 0.1 / 4), 9: (1 / 2, 0.1 / 4), 10: (1 / 8, 0.1 / 16), 25: (1 / 8, 0.1 / 16)}
  want = np.array([[p * f for f in freqs[p]] for p in (3, 9, 10, 25)])
  np.testing.assert_allclose(np.asarray(cos)[0], 1.5 * np.cos(want), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(sin)[0], 1.5 * np.sin(want), rtol=1e-6, atol=1e-7)


def test_rope_linear_scaling_divides_frequencies():
  plain = layers.rope_inv_freq(8, 500.0)
  scaled = layers.rope_inv_freq(8, 500.0, {"rope_type": "linear", "factor": 4.0})
  np.testing.assert_allclose(np.asarray(scaled), np.asarray(plain) / 4, rtol=1e-6)
  with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
    layers.rope_inv_freq(8, 500.0, {"rope_type": "yarn"})


def test_attention_hand_case_causal_and_gqa():
  # One KV head shared by two query heads (GQA 2), head_dim 1, two positions.
  # keys [1, 0] * sqrt(1) scaling; values [10, 20].
  # query head 0 = 0 at both positions -> uniform over visible keys:
  #   t=0 sees key 0 only -> 10; t=1 sees both -> (10+20)/2 = 15.
  # query head 1 = 2 at t=1: scores [2*1, 2*0] = [2, 0] -> softmax [e^2, 1]/(e^2+1)
  #   -> (10 e^2 + 20)/(e^2 + 1).
  q = jnp.array([[[[0.0], [0.0]], [[0.0], [2.0]]]])  # [B=1, T=2, H=2, D=1]
  k = jnp.array([[[[1.0], [0.0]]]])  # [B=1, KVH=1, S=2, D=1]
  v = jnp.array([[[[10.0], [20.0]]]])
  out = np.asarray(layers.attention(q, k, v, jnp.array([[0, 1]])))[0, :, :, 0]
  e2 = math.exp(2)
  np.testing.assert_allclose(out, [[10, 10], [15, (10 * e2 + 20) / (e2 + 1)]], rtol=1e-6)


def test_attention_row_with_no_visible_key_is_zero():
  q = jnp.ones((1, 1, 1, 2))
  k = v = jnp.ones((1, 1, 3, 2))
  out = layers.attention(q, k, v, jnp.array([[2]]), kv_valid=jnp.zeros((1, 3), bool))
  np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("t, at", [(16, None), (1, 100)], ids=["prefill", "decode"])
def test_attention_rows_do_not_depend_on_the_batch(t, at):
  """A row's output, bit for bit, alone and beside 1, 2 or 7 others (the embedded model's
  heads: 9 query, 3 KV, 64 wide). The contiguous cache's attention (the Generator, the
  controller) gave a row alone other bits (4.8e-7 here, 4e-5 in the model's logits)."""
  from o1jax.compilation_cache import jit
  rng = np.random.default_rng(0)
  q = rng.standard_normal((1, t, 9, 64)).astype(np.float32)
  k, v = (rng.standard_normal((1, 3, 256, 64)).astype(np.float32) for _ in range(2))
  positions = (np.arange(t)[None] if at is None else np.array([[at]])).astype(np.int32)
  attend = jit(layers.attention)
  alone = np.asarray(attend(q, k, v, positions))
  for rows in (2, 3, 8):
    others = [rng.standard_normal((rows - 1,) + x.shape[1:]).astype(np.float32)
              for x in (q, k, v)]
    batch = [np.concatenate([x, o]) for x, o in zip((q, k, v), others)]
    out = attend(*batch, np.repeat(positions, rows, 0))
    np.testing.assert_array_equal(np.asarray(out)[:1], alone)


def test_linear_quantized_equals_dense_of_dequantized():
  rng = np.random.default_rng(0)
  qt = quantize(rng.standard_normal((64, 48)), bits=4, group_size=32, symmetric=False)
  from pallas_kernels.quantized_tensor import as_jax, dequantize

  qt = as_jax(qt)
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  np.testing.assert_array_equal(np.asarray(layers.linear(x, qt, backend="reference")),
                                np.asarray(layers.linear(x, dequantize(qt))))
  bias = jnp.arange(48, dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(layers.linear(x, qt, bias)),
                             np.asarray(layers.linear(x, qt)) + np.arange(48), rtol=1e-6)


def test_embed_quantized_and_dense_tables_agree():
  rng = np.random.default_rng(1)
  table = rng.standard_normal((32, 10)).astype(np.float32)  # [d_model, vocab]
  from pallas_kernels.quantized_tensor import as_jax, dequantize

  qt = as_jax(quantize(table, bits=8, group_size=32))
  ids = jnp.array([[3, 0, 9]])
  dense_rows = layers.embed(dequantize(qt), ids)
  np.testing.assert_array_equal(np.asarray(layers.embed(qt, ids)), np.asarray(dense_rows))
  np.testing.assert_array_equal(np.asarray(dense_rows[0, 0]), np.asarray(dequantize(qt))[:, 3])
