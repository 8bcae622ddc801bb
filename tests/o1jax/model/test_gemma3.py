"""Gemma 3 from safetensors and GGUF against the independent numpy reference
(`numpy_reference.gemma3_forward`) and, when installed, HF transformers.

The tiny model has 6 layers: layers 0-4 are local (window 4, RoPE base 1e4), layer 5
global (base 1e6), so 12 tokens reach well past the window."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from o1jax import numpy_reference, testing
from o1jax.checkpoint import CheckpointError, load_checkpoint
from o1jax.model import KVCache, Llama

TOKENS = np.array([5, 17, 42, 99, 200, 7, 3, 250, 11, 64, 128, 9])
# query_pre_attn_scalar != head_dim (as Gemma 3 27B) and linear scaling on the global
# layer (as Gemma 3 4B and up): both must show in the logits.
HF_CONFIG = testing.tiny_gemma3_config(query_pre_attn_scalar=24.0,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0})
# What a GGUF records: llama.cpp scores by 1/sqrt(head_dim) for every size but 27B.
GGUF_CONFIG = dataclasses.replace(HF_CONFIG, query_pre_attn_scalar=32.0)


def _hp(config):
  return {"n_layers": config.n_layers, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
          "head_dim": config.head_dim, "theta": config.rope_theta, "eps": config.rms_eps,
          "rope_scaling": config.rope_scaling, "local_theta": config.rope_local_theta,
          "window": config.sliding_window, "pattern": config.sliding_window_pattern,
          "query_pre_attn_scalar": config.query_pre_attn_scalar}


def _logits(config, params, tokens=TOKENS):
  model = Llama(config, params)
  logits, _ = model(jnp.asarray(tokens)[None], jnp.zeros((1,), jnp.int32),
                    KVCache.zeros(config, 1, len(tokens)))
  return np.asarray(logits[0])


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
  directory = tmp_path_factory.mktemp("gemma3")
  weights = testing.write_hf_checkpoint(directory, HF_CONFIG, seed=4)
  return directory, weights


def test_safetensors_matches_numpy_reference(hf_checkpoint):
  directory, weights = hf_checkpoint
  ck = load_checkpoint(directory)
  c = ck.config
  assert (c.architecture, c.sliding_window, c.sliding_window_pattern, c.rope_local_theta,
          c.query_pre_attn_scalar, c.activation) == ("gemma3_text", 4, 6, 1e4, 24.0, "gelu_tanh")
  assert [c.layer_window(i) for i in range(6)] == [4, 4, 4, 4, 4, None]
  ref = numpy_reference.gemma3_forward(weights, _hp(HF_CONFIG), TOKENS)
  np.testing.assert_allclose(_logits(c, ck.params), ref, atol=2e-4, rtol=0)


def test_each_gemma_feature_changes_the_logits(hf_checkpoint):
  """The reference agreement above is not vacuous: dropping any one feature moves the
  logits far beyond its tolerance (positions past the window for the window itself)."""
  directory, weights = hf_checkpoint
  ck = load_checkpoint(directory)
  ref = numpy_reference.gemma3_forward(weights, _hp(HF_CONFIG), TOKENS)
  # a window wider than the sequence: local layers keep their RoPE base but see every key
  wide = dict(sliding_window=len(TOKENS))
  for change in (wide, dict(rope_local_theta=None),
                 dict(query_pre_attn_scalar=None), dict(activation="silu"),
                 dict(scale_embeddings=False), dict(rope_scaling=None)):
    logits = _logits(dataclasses.replace(ck.config, **change), ck.params)
    assert np.abs(logits - ref).max() > 1e-2, change
  no_window = _logits(dataclasses.replace(ck.config, **wide), ck.params)
  # a window of 4: positions 0..3 see every earlier key either way
  np.testing.assert_allclose(no_window[:4], ref[:4], atol=2e-4, rtol=0)


def test_token_by_token_decode_matches_the_full_forward(hf_checkpoint):
  """The contiguous cache applies the window per query: one token per call gives the
  full forward's logits at every position."""
  ck = load_checkpoint(hf_checkpoint[0])
  model = Llama(ck.config, ck.params)
  cache = KVCache.zeros(ck.config, 1, len(TOKENS))
  rows = []
  for i, tok in enumerate(TOKENS):
    logits, cache = model(jnp.asarray([[tok]]), jnp.asarray([i], jnp.int32), cache)
    rows.append(np.asarray(logits[0, 0]))
  np.testing.assert_allclose(np.stack(rows), _logits(ck.config, ck.params), atol=2e-4, rtol=0)


@pytest.mark.parametrize("matrix_type", ["F32", "Q8_0"])
def test_gguf_matches_numpy_reference_and_safetensors(tmp_path, matrix_type):
  """A GGUF written as llama.cpp's converter writes Gemma 3 (norms stored as 1 + w, Q/K
  rows unpermuted, no pattern or local base in the metadata) against the reference run on
  gguf-py's dequantization of the same file; the F32 file also against safetensors."""
  testing.write_gguf_checkpoint(tmp_path / "m.gguf", GGUF_CONFIG, seed=4, matrix_type=matrix_type,
                                embed_type=matrix_type)
  ck = load_checkpoint(tmp_path / "m.gguf")
  c = ck.config
  assert (c.architecture, c.sliding_window, c.sliding_window_pattern, c.rope_local_theta,
          c.query_pre_attn_scalar, c.rope_scaling) == ("gemma3", 4, 6, 1e4, 32.0,
                                                       {"rope_type": "linear", "factor": 2.0})
  logits = _logits(c, ck.params)
  np.testing.assert_allclose(logits, numpy_reference.gemma3_gguf_forward(tmp_path / "m.gguf",
                                                                         TOKENS),
                             atol=2e-4, rtol=0)
  if matrix_type == "F32":
    testing.write_hf_checkpoint(tmp_path / "hf", GGUF_CONFIG, seed=4)
    hf = load_checkpoint(tmp_path / "hf")
    np.testing.assert_allclose(logits, _logits(hf.config, hf.params), atol=2e-4, rtol=0)


def test_safetensors_matches_transformers(hf_checkpoint):
  """HF transformers' Gemma3ForCausalLM (torch f32, eager attention) on the same files."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  directory, _ = hf_checkpoint
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32, attn_implementation="eager")
  assert type(hf_model).__name__ == "Gemma3ForCausalLM"
  with torch.no_grad():
    want = hf_model(torch.tensor(TOKENS)[None]).logits[0].numpy()
  ck = load_checkpoint(directory)
  np.testing.assert_allclose(_logits(ck.config, ck.params), want, atol=2e-4, rtol=0)


def test_unsupported_gemma_variants_are_named(tmp_path):
  testing.write_hf_checkpoint(tmp_path, HF_CONFIG)
  cfg = tmp_path / "config.json"
  text = cfg.read_text()
  cfg.write_text(text.replace('"final_logit_softcapping": null', '"final_logit_softcapping": 30.0'))
  with pytest.raises(CheckpointError, match="final_logit_softcapping=30.0 is set; logit "
                                            "soft-capping is not supported"):
    load_checkpoint(tmp_path)
  cfg.write_text(text.replace('"hidden_activation": "gelu_pytorch_tanh"',
                              '"hidden_activation": "relu"'))
  with pytest.raises(CheckpointError, match="hidden_activation 'relu' is not supported"):
    load_checkpoint(tmp_path)
  types = ["sliding_attention", "full_attention"] * 3
  cfg.write_text(text[:-1] + ', "layer_types": ' + str(types).replace("'", '"') + "}")
  ck = load_checkpoint(tmp_path)  # every 2nd layer global: a pattern of 2
  assert ck.config.sliding_window_pattern == 2
  types[0] = "full_attention"
  cfg.write_text(text[:-1] + ', "layer_types": ' + str(types).replace("'", '"') + "}")
  with pytest.raises(CheckpointError, match="is not one global layer in every 1 "):
    load_checkpoint(tmp_path)
