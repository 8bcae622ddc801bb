"""Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm), Llama 3 (RoPE frequency scaling) and
SmolLM3 (layers without RoPE), from safetensors and GGUF, against the independent numpy
reference and HF transformers."""

import math

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
PHI4_LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 8,
                 "attention_factor": 1.25,
                 "short_factor": tuple(1.0 + 0.5 * i for i in range(6)),
                 "long_factor": tuple(2.0 + 3.0 * i for i in range(6))}
ARCHITECTURES = {
    "qwen2": dict(architecture="qwen2", attention_bias=True),
    # head_dim 32 != d_model / n_heads = 16, as in Qwen3 (explicit head_dim)
    "qwen3": dict(architecture="qwen3", qk_norm=True, head_dim=32),
    "llama3": dict(architecture="llama", head_dim=32, rope_scaling=LLAMA3_SCALING),
    # every 4th layer without RoPE (4 layers: the last), 4 query heads per KV head
    "smollm3": dict(architecture="smollm3", n_layers=4, n_kv_heads=1, nope_layers=(3,)),
    # fused q/k/v and gate/up; a window of 5 on every layer (shorter than TOKENS)
    "phi3": dict(architecture="phi3", sliding_window=5, sliding_window_pattern=0),
    # Phi-4-mini's RoPE: 12 of 16 head dims rotate (its 0.75), LongRoPE whose original
    # context (8) TOKENS passes: positions 8.. turn by the long factors
    "phi4": dict(architecture="phi3", rotary_dim=12, rope_scaling=PHI4_LONGROPE),
}


def _config(name):
  return testing.tiny_config(tie_embeddings=False, **ARCHITECTURES[name])


def _hp(config):
  return {"n_layers": config.n_layers, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
          "head_dim": config.head_dim, "theta": config.rope_theta, "eps": config.rms_eps,
          "rope_scaling": config.rope_scaling, "nope_layers": config.nope_layers,
          "window": config.sliding_window if config.sliding_window_pattern == 0 else None,
          "rotary_dim": config.rotary_dim}


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
  """HF transformers (torch f32, eager attention) on the same config.json + safetensors:
  the first 8 tokens in one call, then one token per call on its cache (as `generate`
  decodes: Phi-4's LongRoPE turns the tokens past the original context by the long
  factors; a one-call 12-token prompt would turn them all so)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  name, directory, _ = hf_checkpoint
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32, attn_implementation="eager", pad_token_id=0)
  expected_class = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "llama3": "LlamaForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                    "phi3": "Phi3ForCausalLM", "phi4": "Phi3ForCausalLM"}[name]
  assert type(hf_model).__name__ == expected_class
  with torch.no_grad():
    out = hf_model(torch.tensor(TOKENS[:8])[None], use_cache=True)
    want = [out.logits[0].numpy()]
    for i in range(8, len(TOKENS)):
      out = hf_model(torch.tensor([[TOKENS[i]]]), past_key_values=out.past_key_values,
                     position_ids=torch.tensor([[i]]), use_cache=True)
      want.append(out.logits[0].numpy())
  np.testing.assert_allclose(_logits(load_checkpoint(directory)), np.concatenate(want),
                             atol=2e-4, rtol=0)


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


def test_phi3_window_matters(hf_checkpoint):
  """The window is live: no window moves the logits."""
  import dataclasses
  name, directory, _ = hf_checkpoint
  if name != "phi3":
    pytest.skip("Phi-3 only")
  ck = load_checkpoint(directory)
  assert (ck.config.sliding_window, ck.config.sliding_window_pattern) == (5, 0)
  unwindowed = dataclasses.replace(ck, config=dataclasses.replace(ck.config, sliding_window=None))
  assert np.abs(_logits(ck) - _logits(unwindowed)).max() > 0.05


def test_phi4_partial_rotary_and_longrope_are_live_and_read_from_both_formats(hf_checkpoint,
                                                                              tmp_path):
  """Each of the rotary width, the short and long factors and the attention factor moves
  the logits (long ones only from the original context on); config.json and the GGUF
  give the same config."""
  import dataclasses
  name, directory, _ = hf_checkpoint
  if name != "phi4":
    pytest.skip("Phi-4 RoPE only")
  ck = load_checkpoint(directory)
  assert ck.config.rotary_dim == 12 and ck.config.rope_scaling == PHI4_LONGROPE
  base = _logits(ck)
  scaling = ck.config.rope_scaling
  variants = {"full rotary": dict(rotary_dim=None, rope_scaling=None),
              "short factors": dict(rope_scaling={**scaling, "short_factor": (1.0,) * 6}),
              "long factors": dict(rope_scaling={**scaling, "long_factor": (1.0,) * 6}),
              "attention factor": dict(rope_scaling={**scaling, "attention_factor": 1.0})}
  for what, change in variants.items():
    other = _logits(dataclasses.replace(ck, config=dataclasses.replace(ck.config, **change)))
    moved = np.abs(other - base).max(axis=-1)
    assert moved.max() > 0.01, what
    if what == "long factors":  # positions below the original context do not use them
      assert moved[:8].max() < 1e-6 and moved[8:].min() > 1e-3
  testing.write_gguf_checkpoint(tmp_path / "m.gguf", _config("phi4"), seed=4,
                                matrix_type="F32", embed_type="F32")
  gguf_config = load_checkpoint(tmp_path / "m.gguf").config
  assert (gguf_config.rotary_dim, gguf_config.rope_scaling) == (12, PHI4_LONGROPE)


def test_phi3_rope_settings_from_config_json_and_bad_ones_named(hf_checkpoint):
  """transformers' derivations: original_max_position_embeddings from the top level (else
  max_position_embeddings), attention_factor sqrt(1 + ln(factor) / ln(original)) when not
  given; transformers 5's rope_parameters; bad values are named."""
  import json
  from o1jax.checkpoint.safetensors_loader import config_from_hf
  name, directory, _ = hf_checkpoint
  if name != "phi3":
    pytest.skip("Phi-3 only")
  hf = json.loads((directory / "config.json").read_text())
  longrope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
  c = config_from_hf({**hf, "rope_scaling": longrope, "max_position_embeddings": 128,
                      "original_max_position_embeddings": 8}, "config.json")
  assert c.rope_scaling["original_max_position_embeddings"] == 8
  assert c.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(16) / math.log(8)))
  c = config_from_hf({**hf, "rope_scaling": None, "max_position_embeddings": 128,
                      "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                          "short_factor": [1.0] * 4, "long_factor": [3.0] * 4,
                                          "partial_rotary_factor": 0.5}}, "config.json")
  assert c.rotary_dim == 8 and c.rope_scaling["original_max_position_embeddings"] == 128
  assert "partial_rotary_factor" not in c.rope_scaling
  assert c.rope_scaling["attention_factor"] == 1.0  # factor 1
  assert config_from_hf({**hf, "partial_rotary_factor": 0.75}, "config.json").rotary_dim == 12
  # Phi-4-mini's window (262144) is longer than its context (131072): kept as written (it
  # binds nothing; every attention path, the native CPU kernel too, takes a window).
  c = config_from_hf({**hf, "sliding_window": 262144, "max_position_embeddings": 131072},
                     "config.json")
  assert (c.sliding_window, c.sliding_window_pattern) == (262144, 0)
  with pytest.raises(CheckpointError, match=r"partial_rotary_factor=1.5 must be in \(0, 1\]"):
    config_from_hf({**hf, "partial_rotary_factor": 1.5}, "config.json")
  with pytest.raises(CheckpointError, match=r"rotary_dim=7 must be an even number in 2\.\.16"):
    config_from_hf({**hf, "partial_rotary_factor": 0.4375}, "config.json")
  with pytest.raises(CheckpointError, match=r"rope_scaling\['long_factor'\] must be 8 finite "
                                            r"numbers > 0"):
    config_from_hf({**hf, "rope_scaling": {**longrope, "long_factor": [2.0] * 7}}, "config.json")
  with pytest.raises(CheckpointError, match=r"rope_scaling\['short_factor'\] must be 8 finite"):
    config_from_hf({**hf, "rope_scaling": {**longrope, "short_factor": [1.0] * 7 + [0.0]}},
                   "config.json")


def test_phi3_gguf_longrope_tensors_checked(tmp_path):
  """One factor tensor without the other, or one of the wrong length, is named; a window
  no shorter than the context is read as written."""
  import dataclasses
  wide = dataclasses.replace(_config("phi3"), sliding_window=128)  # = max_context
  testing.write_gguf_checkpoint(tmp_path / "wide.gguf", wide, matrix_type="F32",
                                embed_type="F32")
  assert load_checkpoint(tmp_path / "wide.gguf").config.sliding_window == 128
  one = {"rope_factors_long.weight": np.ones(8, np.float32)}
  testing.write_gguf_checkpoint(tmp_path / "one.gguf", _config("phi3"), matrix_type="F32",
                                embed_type="F32", extra_tensors=one)
  with pytest.raises(CheckpointError, match=r"longrope needs both 'rope_factors_short.weight' "
                                            r"and 'rope_factors_long.weight'"):
    load_checkpoint(tmp_path / "one.gguf")
  short = {"rope_factors_short.weight": np.ones(5, np.float32), **one}
  testing.write_gguf_checkpoint(tmp_path / "short.gguf", _config("phi3"), matrix_type="F32",
                                embed_type="F32", extra_tensors=short)
  with pytest.raises(CheckpointError, match=r"rope_factors_short.weight has shape \(5,\), "
                                            r"expected \(8,\)"):
    load_checkpoint(tmp_path / "short.gguf")


@pytest.mark.parametrize("arch,value,message", [
    ("phi3", 7, r"phi3.rope.dimension_count=7 must be even and at most the head size 16"),
    ("phi3", 32, r"phi3.rope.dimension_count=32 must be even and at most the head size 16"),
    ("llama", 8, r"llama.rope.dimension_count=8 differs from the head size 16 "
                 r"\(llama.embedding_length / llama.attention.head_count\): partial rotary is "
                 r"supported for phi3 only")])
def test_gguf_rotary_width_is_checked(tmp_path, arch, value, message):
  """The key's u32 value patched in a written GGUF."""
  config = testing.tiny_config(architecture=arch, tie_embeddings=False)
  path = tmp_path / "m.gguf"
  testing.write_gguf_checkpoint(path, config, matrix_type="F32", embed_type="F32")
  data = bytearray(path.read_bytes())
  key = f"{arch}.rope.dimension_count".encode()
  at = data.index(key) + len(key) + 4  # then the u32 type tag, then the value
  assert int(np.frombuffer(bytes(data[at:at + 4]), "<u4")[0]) == 16
  data[at:at + 4] = np.array([value], "<u4").tobytes()
  path.write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match=message):
    load_checkpoint(path)
