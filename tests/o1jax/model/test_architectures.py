"""Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm), Llama 3 (RoPE frequency scaling) and
SmolLM3 (layers without RoPE), from safetensors and GGUF, against the independent numpy
reference and HF transformers."""

import jax.numpy as jnp
import numpy as np
import pytest

from o1jax import numpy_reference, testing
from o1jax.checkpoint import CheckpointError, load_checkpoint
from o1jax.model import KVCache, Llama

TOKENS = np.array([5, 17, 42, 99, 200, 7, 3, 250, 11, 64, 128, 9])
# Llama 3's scaling with a 32-position "original context" so that a 32-dim head has
# frequencies of all three kinds: wavelengths 6.3 (kept: < 32 / 4), 11 and 20
# (interpolated: 8..32), 35 and up (divided by 8).
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
ARCHITECTURES = {
    "qwen2": dict(architecture="qwen2", attention_bias=True),
    # head_dim 32 != d_model / n_heads = 16, as in Qwen3 (explicit head_dim)
    "qwen3": dict(architecture="qwen3", qk_norm=True, head_dim=32),
    "llama3": dict(architecture="llama", head_dim=32, rope_scaling=LLAMA3_SCALING),
    # every 4th layer without RoPE (4 layers: the last), 4 query heads per KV head
    "smollm3": dict(architecture="smollm3", n_layers=4, n_kv_heads=1, nope_layers=(3,)),
    # fused q/k/v and gate/up; a window of 5 on every layer (shorter than TOKENS)
    "phi3": dict(architecture="phi3", sliding_window=5, sliding_window_pattern=0),
}


def _config(name):
  return testing.tiny_config(tie_embeddings=False, **ARCHITECTURES[name])


def _hp(config):
  return {"n_layers": config.n_layers, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
          "head_dim": config.head_dim, "theta": config.rope_theta, "eps": config.rms_eps,
          "rope_scaling": config.rope_scaling, "nope_layers": config.nope_layers,
          "window": config.sliding_window if config.sliding_window_pattern == 0 else None}


def _logits(ck):
  model = Llama(ck.config, ck.params)
  logits, _ = model(jnp.asarray(TOKENS)[None], jnp.zeros((1,), jnp.int32),
                    KVCache.zeros(ck.config, 1, len(TOKENS)))
  return np.asarray(logits[0])


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def hf_checkpoint(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  weights = testing.write_hf_checkpoint(directory, _config(request.param), seed=4)
  return request.param, directory, weights


def test_safetensors_matches_numpy_reference(hf_checkpoint):
  name, directory, weights = hf_checkpoint
  ck = load_checkpoint(directory)
  config = _config(name)
  assert (ck.config.attention_bias, ck.config.qk_norm, ck.config.head_dim, ck.config.nope_layers) == (
      config.attention_bias, config.qk_norm, config.head_dim, config.nope_layers)
  assert ck.config.rope_scaling == config.rope_scaling
  ref = numpy_reference.forward(weights, _hp(config), TOKENS, interleaved_rotary=False)
  np.testing.assert_allclose(_logits(ck), ref, atol=2e-4, rtol=0)


def test_safetensors_matches_transformers(hf_checkpoint):
  """HF transformers (torch f32, eager attention) on the same config.json + safetensors."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  name, directory, _ = hf_checkpoint
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32, attn_implementation="eager")
  expected_class = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "llama3": "LlamaForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                    "phi3": "Phi3ForCausalLM"}[name]
  assert type(hf_model).__name__ == expected_class
  with torch.no_grad():
    want = hf_model(torch.tensor(TOKENS)[None]).logits[0].numpy()
  np.testing.assert_allclose(_logits(load_checkpoint(directory)), want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_gguf_matches_numpy_reference_and_safetensors(tmp_path, name):
  """An F32 GGUF of the same weights (as llama.cpp's converter lays them out: Q/K rows
  permuted for Llama only, Llama 3's scaling as a rope_freqs tensor) gives the reference's
  logits, and the safetensors checkpoint's up to rounding."""
  config = _config(name)
  testing.write_gguf_checkpoint(tmp_path / "m.gguf", config, seed=4, matrix_type="F32",
                                embed_type="F32")
  ck = load_checkpoint(tmp_path / "m.gguf")
  assert (ck.config.attention_bias, ck.config.qk_norm, ck.config.nope_layers) == (
      config.attention_bias, config.qk_norm, config.nope_layers)
  if name == "llama3":
    assert ck.config.rope_scaling["rope_type"] == "freq_factors"
  logits = _logits(ck)
  np.testing.assert_allclose(logits, numpy_reference.gguf_forward(tmp_path / "m.gguf", TOKENS),
                             atol=2e-4, rtol=0)
  testing.write_hf_checkpoint(tmp_path / "hf", config, seed=4)
  np.testing.assert_allclose(logits, _logits(load_checkpoint(tmp_path / "hf")), atol=2e-4, rtol=0)


def test_smollm3_layers_without_rope_matter_and_are_read_from_config_json(hf_checkpoint, tmp_path):
  """Rotating the NoPE layer too moves the logits (the switch is live); config.json's
  no_rope_layers and no_rope_layer_interval both set it; bad values are named."""
  import dataclasses
  import json
  from o1jax.checkpoint.safetensors_loader import config_from_hf
  name, directory, _ = hf_checkpoint
  if name != "smollm3":
    pytest.skip("SmolLM3 only")
  ck = load_checkpoint(directory)
  rotated = dataclasses.replace(ck, config=dataclasses.replace(ck.config, nope_layers=()))
  assert np.abs(_logits(ck) - _logits(rotated)).max() > 0.05
  hf = json.loads((directory / "config.json").read_text())
  for changes, want in (({"no_rope_layers": None, "no_rope_layer_interval": 2}, (1, 3)),
                        ({"no_rope_layers": None}, (3,)), ({"no_rope_layers": [0, 1, 1, 0]}, (0, 3))):
    assert config_from_hf({**hf, **changes}, tmp_path).nope_layers == want
  for bad in ([1, 1, 0], [1, 1, 2, 0], "1101"):
    with pytest.raises(CheckpointError, match=r"no_rope_layers=.* must be a list of 4 flags 0 or 1"):
      config_from_hf({**hf, "no_rope_layers": bad}, "config.json")


def test_unsupported_rope_scaling_is_named(tmp_path):
  testing.write_hf_checkpoint(tmp_path, _config("qwen2"))
  cfg = tmp_path / "config.json"
  cfg.write_text(cfg.read_text().replace('"rope_scaling": null',
                                         '"rope_scaling": {"rope_type": "yarn", "factor": 4.0}'))
  with pytest.raises(CheckpointError, match="rope scaling type 'yarn' is not supported"):
    load_checkpoint(tmp_path)


def test_unsupported_architectures_are_named(tmp_path):
  """Both formats refuse an architecture they do not know by name before reading weights."""
  testing.write_gguf_checkpoint(tmp_path / "g.gguf", testing.tiny_config(), architecture="gemma2")
  with pytest.raises(CheckpointError, match="architecture 'gemma2' is not supported"):
    load_checkpoint(tmp_path / "g.gguf")
  testing.write_hf_checkpoint(tmp_path / "hf", testing.tiny_config())
  cfg = tmp_path / "hf" / "config.json"
  cfg.write_text(cfg.read_text().replace('"model_type": "llama"', '"model_type": "gemma2"'))
  with pytest.raises(CheckpointError, match="model_type 'gemma2' is not supported"):
    load_checkpoint(tmp_path / "hf")


@pytest.mark.parametrize("bad", [None, [4], [1, 1], "3", [True], 3])
def test_bad_nope_layers_are_named(bad):
  with pytest.raises(ValueError, match=r"nope_layers=.* must be a list of distinct layer indices \(0\.\.3\)"):
    testing.tiny_config(n_layers=4, nope_layers=bad)
  assert testing.tiny_config(n_layers=4, nope_layers=np.array([3, 1])).nope_layers == (1, 3)


def test_phi3_window_matters_and_what_is_not_built_is_named(hf_checkpoint, tmp_path):
  """The window is live (no window moves the logits); partial rotary (Phi-4-mini) and
  longrope (Phi-3.5, the 128k models) are refused by name in both formats."""
  import dataclasses
  import gguf
  import json
  name, directory, _ = hf_checkpoint
  if name != "phi3":
    pytest.skip("Phi-3 only")
  ck = load_checkpoint(directory)
  assert (ck.config.sliding_window, ck.config.sliding_window_pattern) == (5, 0)
  unwindowed = dataclasses.replace(ck, config=dataclasses.replace(ck.config, sliding_window=None))
  assert np.abs(_logits(ck) - _logits(unwindowed)).max() > 0.05
  hf = json.loads((directory / "config.json").read_text())
  from o1jax.checkpoint.safetensors_loader import config_from_hf
  with pytest.raises(CheckpointError, match=r"partial_rotary_factor=0.75: partial rotary embedding "
                                            r"is not supported"):
    config_from_hf({**hf, "partial_rotary_factor": 0.75}, "config.json")
  longrope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
              "original_max_position_embeddings": 64}
  with pytest.raises(CheckpointError, match=r"rope scaling type 'longrope' is not supported"):
    config_from_hf({**hf, "rope_scaling": longrope}, "config.json")
  # GGUF: a rotary width below head_dim (the key's u32 value patched), longrope's factors.
  path = tmp_path / "m.gguf"
  testing.write_gguf_checkpoint(path, _config("phi3"), seed=4, matrix_type="F32", embed_type="F32")
  data = bytearray(path.read_bytes())
  key = b"phi3.rope.dimension_count"
  at = data.index(key) + len(key) + 4  # then the u32 type tag, then the value
  assert int(np.frombuffer(bytes(data[at:at + 4]), "<u4")[0]) == 16
  data[at:at + 4] = np.array([8], "<u4").tobytes()
  (tmp_path / "partial.gguf").write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match=r"phi3.rope.dimension_count 8 of head_dim 16: partial "
                                            r"rotary embedding is not supported"):
    load_checkpoint(tmp_path / "partial.gguf")
  testing.write_gguf_checkpoint(tmp_path / "long.gguf", _config("phi3"), matrix_type="F32",
                                embed_type="F32",
                                extra_tensors={"rope_factors_long.weight": np.ones(8, np.float32)})
  with pytest.raises(CheckpointError, match=r"tensors \['rope_factors_long.weight'\]: longrope "
                                            r"scaling is not supported"):
    load_checkpoint(tmp_path / "long.gguf")
