"""matmul_dtype="float8": every decoder-layer product takes its input rows in e4m3 under a
per-row scale; checked against the independent numpy forward pass with the same rounding."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from o1jax import numpy_reference
from o1jax.checkpoint import load_checkpoint
from o1jax.model import KVCache, Llama
from o1jax.testing import tiny_config, write_gguf_checkpoint, write_hf_checkpoint
from pallas_kernels.fp8_activations import FP8_MAX, Fp8ActivationWeight
from pallas_kernels.quantized_tensor import QuantizedTensor

TOKENS = [5, 17, 3, 99, 42, 7, 250, 8, 61, 13, 2, 77]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_fp8") / "tiny.gguf"
  write_gguf_checkpoint(path, tiny_config(max_context=64), seed=11, matrix_type="Q4_1")
  return path


def _logits(model, config):
  tokens = jnp.asarray([TOKENS], jnp.int32)
  starts = jnp.zeros((1,), jnp.int32)
  out, _ = jax.jit(lambda t: model(t, starts, KVCache.zeros(config, 1, 32)))(tokens)
  return np.asarray(out[0])


def _scaled_rows(a):
  """(each row / its scale, clipped to e4m3's range; the scales: row amax / 448)."""
  a = np.asarray(a, np.float32)
  amax = np.abs(a).max(axis=-1, keepdims=True)
  scale = np.where(amax > 0, amax * np.float32(1 / FP8_MAX), 1).astype(np.float32)
  return np.clip(a / scale, -FP8_MAX, FP8_MAX), scale


def _fp8_rows(a):
  """Each row rounded to e4m3 under scale = row amax / 448 (ml_dtypes' rounding)."""
  y, scale = _scaled_rows(a)
  return y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale


def test_layer_matrices_take_fp8_rows_and_the_head_does_not(tiny_path):
  ck = load_checkpoint(tiny_path)
  model = Llama(ck.config, ck.params, matmul_dtype="float8", weight_mode="quantized")
  layer = model.layers[0]
  # (quantized q/k/v and gate/up are one matrix each: FUSED_PARTS)
  for name in ("wqkv", "wo", "w_gate_up", "w_down"):
    w = getattr(layer, name).get_value()
    assert isinstance(w, Fp8ActivationWeight) and isinstance(w.matrix, QuantizedTensor), name
  assert not isinstance(model.head_weight, Fp8ActivationWeight)
  assert layer.attn_norm.get_value().dtype == jnp.float32


def _tie_distance(a) -> np.ndarray:
  """Per row: the smallest distance of a scaled entry to an e4m3 rounding midpoint,
  relative to the entry. Two f32 computations of one row differ by ~1e-6 relative (their
  summation orders): an entry that close to a midpoint may round either way in either."""
  values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  values = np.unique(values[np.isfinite(values)])
  mids = (values[1:] + values[:-1]) / 2
  y, _ = _scaled_rows(a)
  i = np.clip(np.searchsorted(mids, y), 1, len(mids) - 1)
  near = np.minimum(np.abs(y - mids[i - 1]), np.abs(y - mids[i]))
  return (near / np.maximum(np.abs(y), 1e-30)).min(axis=-1)


@pytest.mark.parametrize("weight_mode", ["dense", "quantized"])
def test_matches_numpy_reference_with_fp8_rows(tiny_path, weight_mode):
  ck = load_checkpoint(tiny_path)
  got = _logits(Llama(ck.config, ck.params, matmul_dtype="float8", weight_mode=weight_mode),
                ck.config)
  exact = _logits(Llama(ck.config, ck.params), ck.config)
  ties = []
  want = numpy_reference.gguf_forward(
      tiny_path, TOKENS, layer_inputs=lambda a: (ties.append(_tie_distance(a)), _fp8_rows(a))[1])
  # Compared up to the first position where a layer input sits within 1e-5 of a rounding
  # midpoint: there the two f32 computations may round it apart (seen: 1.4e-6 at
  # position 4, and every later position moved by ~0.3 through attention); a causal
  # model's earlier positions do not see it.
  tied = np.flatnonzero(np.min(ties, axis=0) < 1e-5)
  upto = int(tied[0]) if len(tied) else len(TOKENS)
  assert upto >= 3, upto
  got, exact, want = got[:upto], exact[:upto], want[:upto]
  fp8_effect = np.abs(exact - want).max()
  # The rounding moves the logits (e4m3: 3 mantissa bits) and the model moves them as the
  # reference does, up to f32 summation order (~1e-5, as f32 vs the f32 reference).
  assert fp8_effect > 1e-2 * np.abs(want).max()
  assert np.abs(got - want).max() < 1e-3 * fp8_effect, (np.abs(got - want).max(), fp8_effect)


def test_gemma3_matches_numpy_reference_with_fp8_rows(tmp_path):
  # Gemma 3's extra norms sit around the same four matmul inputs.
  from tests.o1jax.model.test_gemma3 import HF_CONFIG, TOKENS as GEMMA_TOKENS, _hp
  weights = write_hf_checkpoint(tmp_path, HF_CONFIG, seed=4)
  ck = load_checkpoint(tmp_path)

  def logits(model):
    out, _ = model(jnp.asarray(GEMMA_TOKENS)[None], jnp.zeros((1,), jnp.int32),
                   KVCache.zeros(ck.config, 1, len(GEMMA_TOKENS)))
    return np.asarray(out[0])

  got = logits(Llama(ck.config, ck.params, matmul_dtype="float8"))
  exact = logits(Llama(ck.config, ck.params))
  reference = lambda rounding: numpy_reference.gemma3_forward(
      weights, _hp(HF_CONFIG), GEMMA_TOKENS, layer_inputs=rounding)
  want = reference(_fp8_rows)
  # Here some rows sit on e4m3 rounding boundaries: inputs moved by 1e-6 of themselves
  # move the reference's logits by 0.03 on average (0.002 in f64 instead of f32). The
  # model must be as close to the reference as such a perturbation is, and far closer
  # than the unrounded model (0.11 on average).
  rng = np.random.default_rng(0)
  nudged = reference(lambda a: _fp8_rows(
      np.asarray(a, np.float32) * (1 + 1e-6 * rng.standard_normal(np.shape(a))).astype(np.float32)))
  tie_noise = np.abs(nudged - want).mean()
  assert np.abs(got - want).mean() <= 2 * tie_noise + 1e-4 * np.abs(want).max()
  assert np.abs(got - want).mean() < 0.5 * np.abs(exact - want).mean()
