"""HF-style checkpoints: `config.json` + `*.safetensors` (single file or sharded index).

Supports the Llama (2 and 3), Mistral, Qwen2, Qwen3, SmolLM and Gemma 3 (text,
`gemma3_text`) families in bf16/f16/f32. Also
writes such a checkpoint (dense f32 weights) from any loaded model, which is
how `scripts/convert_checkpoint.py` exports GGUF models for HF tools.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

from o1jax.checkpoint.errors import CheckpointError, read_json_object
from o1jax.checkpoint.model_config import ModelConfig
from o1jax.checkpoint.params import Params
from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")

# Our per-layer names -> HF names (weights are [out, in] in HF files).
_LAYER_NAMES = {
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}
# Gemma 3's layer norms (HF's Gemma3RMSNorm multiplies by 1 + w: we store the sum).
# Its post_attention_layernorm is the attention output's norm; the MLP's input norm is
# pre_feedforward_layernorm. (It has no q/k/v biases: attention_bias is off.)
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm.weight",
                       "post_attn_norm": "post_attention_layernorm.weight",
                       "post_ffn_norm": "post_feedforward_layernorm.weight"}
_GEMMA3_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _rope(hf: dict) -> tuple[float, dict | None]:
  """(theta, scaling) from config.json: `rope_theta` + `rope_scaling` (transformers 4), or
  one `rope_parameters` dict holding both (transformers 5)."""
  params = hf.get("rope_parameters") or {}
  params = params.get("full_attention", params)  # Gemma 3 (transformers 5): per layer type
  theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
  scaling = hf.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
  if scaling.get("rope_type", scaling.get("type", "default")) == "default":
    return theta, None
  return theta, scaling


def _gemma3(hf: dict, path) -> dict:
  """Gemma 3's ModelConfig switches from a gemma3_text config.json (transformers 4's
  sliding_window_pattern / rope_local_base_freq, or 5's layer_types / rope_parameters)."""
  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    if hf.get(key) is not None:
      raise CheckpointError(f"{path}: {key}={hf[key]} is set; logit soft-capping is not supported")
  act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
  if act not in _GEMMA3_ACTIVATIONS:
    raise CheckpointError(f"{path}: hidden_activation {act!r} is not supported "
                          f"(supported: {', '.join(_GEMMA3_ACTIVATIONS)})")
  n_layers = int(hf["num_hidden_layers"])
  pattern = int(hf.get("sliding_window_pattern") or 6)
  types = hf.get("layer_types")
  if types is not None:  # one name per layer: must be a period-`pattern` interleave
    pattern = next((i + 1 for i, k in enumerate(types) if k == "full_attention"), n_layers + 1)
    want = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)]
    if list(types) != want:
      raise CheckpointError(f"{path}: layer_types {types} is not every {pattern}th layer global "
                            f"(the only interleave supported)")
  params = hf.get("rope_parameters") or {}
  local = params.get("sliding_attention", {}).get("rope_theta", hf.get("rope_local_base_freq",
                                                                        10000.0))
  window = hf.get("sliding_window")
  return dict(scale_embeddings=True, post_norms=True, activation=_GEMMA3_ACTIVATIONS[act],
              query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
              sliding_window=None if window is None else int(window),
              sliding_window_pattern=pattern, rope_local_theta=float(local))


_REQUIRED = object()


def _number(hf: dict, key: str, path, kind=int, default=_REQUIRED):
  """config.json's `key` as `kind` (int or float); absent or null: `default`. A value of
  another type (a string, a bool, 1.5 for a size) is named with its key."""
  value = hf.get(key)
  if value is None:
    if default is _REQUIRED:
      raise CheckpointError(f"{path}: config.json lacks the key {key!r}")
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (
      kind is int and value != int(value)):
    raise CheckpointError(f"{path}: {key}={value!r} is not {'an integer' if kind is int else 'a number'}")
  return kind(value)


def config_from_hf(hf: dict, path) -> ModelConfig:
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise CheckpointError(f"{path}: model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
  try:
    num = lambda key, kind=int, default=_REQUIRED: _number(hf, key, path, kind, default)
    n_heads = num("num_attention_heads")
    d_model = num("hidden_size")
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    rope_theta, rope_scaling = _rope(hf)
    gemma = _gemma3(hf, path) if model_type == "gemma3_text" else {}
    return ModelConfig(**gemma,
        vocab_size=num("vocab_size"), d_model=d_model, n_layers=num("num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=num("num_key_value_heads", default=0) or n_heads,
        head_dim=num("head_dim", default=0) or (d_model // n_heads if n_heads > 0 else 0),
        ffn_dim=num("intermediate_size"), rope_theta=rope_theta,
        rope_scaling=rope_scaling, rms_eps=num("rms_norm_eps", float, 1e-6),
        max_context=num("max_position_embeddings", default=2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", model_type == "gemma3_text")),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        bos_id=hf.get("bos_token_id"), eos_ids=eos_ids, architecture=model_type,
        name=str(hf.get("_name_or_path", "")))
  except KeyError as e:
    raise CheckpointError(f"{path}: config.json lacks the key {e.args[0]!r}") from e
  except CheckpointError:
    raise
  except ValueError as e:  # e.g. an unsupported rope scaling type
    raise CheckpointError(f"{path}: {e}") from e


def _shard_files(directory: pathlib.Path) -> list[pathlib.Path]:
  index = directory / "model.safetensors.index.json"
  if index.is_file():
    weight_map = read_json_object(index).get("weight_map", {})
    files = sorted({directory / f for f in weight_map.values()})
  else:
    files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise CheckpointError(f"{directory}: no *.safetensors files")
  for f in files:
    if not f.is_file():
      raise CheckpointError(f"{directory}: shard {f.name} listed in the index is missing")
  return files


def _read_config(directory: pathlib.Path) -> ModelConfig:
  cfg_file = directory / "config.json"
  if not cfg_file.is_file():
    raise CheckpointError(f"{directory}: config.json is missing")
  return config_from_hf(read_json_object(cfg_file), cfg_file)


_HEADER_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def check_safetensors(directory: str | os.PathLike) -> None:
  """Validates an HF checkpoint without reading its tensors: config.json, and every shard's
  safetensors header (which the library checks against the file's length) and dtypes."""
  from safetensors import safe_open

  directory = pathlib.Path(directory)
  _read_config(directory)
  for shard in _shard_files(directory):
    try:
      with safe_open(str(shard), framework="numpy") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    except Exception as e:
      raise CheckpointError(f"{shard}: cannot be read as safetensors ({e})") from e
    for name, dtype in dtypes.items():
      if dtype not in _HEADER_DTYPES:
        raise CheckpointError(f"{directory}: tensor {name!r} has dtype {dtype}, "
                              f"supported: {', '.join(_FLOAT_DTYPES)}")
  if not (directory / "tokenizer.json").is_file():
    raise CheckpointError(f"{directory}: tokenizer.json is missing")


def load_safetensors(directory: str | os.PathLike) -> tuple[ModelConfig, Params]:
  """Reads an HF checkpoint directory into (config, params) with [in, out] weights."""
  from safetensors import safe_open

  directory = pathlib.Path(directory)
  config = _read_config(directory)
  tensors: dict[str, np.ndarray] = {}
  for shard in _shard_files(directory):
    try:
      with safe_open(str(shard), framework="numpy") as f:
        for name in f.keys():
          tensors[name] = f.get_tensor(name)
    except Exception as e:
      raise CheckpointError(f"{shard}: cannot be read as safetensors ({e})") from e
  for name, t in tensors.items():
    if t.dtype.name not in _FLOAT_DTYPES:
      raise CheckpointError(f"{directory}: tensor {name!r} has dtype {t.dtype.name}, "
                            f"supported: {', '.join(_FLOAT_DTYPES)}")

  def get(name, transpose):
    if name not in tensors:
      raise CheckpointError(f"{directory}: tensor {name!r} is missing")
    t = tensors[name]
    return np.ascontiguousarray(t.T) if transpose else t

  gemma = config.architecture == "gemma3_text"
  # Gemma's RMSNorm weights w act as 1 + w (added in f32, as HF's Gemma3RMSNorm does).
  shift = (lambda w: np.asarray(w, np.float32) + np.float32(1)) if gemma else (lambda w: w)
  layers = []
  for i in range(config.n_layers):
    layer = {}
    for ours, theirs in (_GEMMA3_LAYER_NAMES if gemma else _LAYER_NAMES).items():
      if ours.startswith("b") and not config.attention_bias:
        continue
      if ours.endswith("_norm") and ours.startswith(("q", "k")) and not config.qk_norm:
        continue
      w = get(f"model.layers.{i}.{theirs}", transpose=ours.startswith("w"))
      layer[ours] = shift(w) if ours.endswith("_norm") else w
    layers.append(layer)
  params: Params = {"embed": get("model.embed_tokens.weight", transpose=True), "layers": layers,
                    "final_norm": shift(get("model.norm.weight", transpose=False))}
  if not config.tie_embeddings:
    params["lm_head"] = get("lm_head.weight", transpose=True)
  return config, params


def _dense(w) -> np.ndarray:
  if isinstance(w, QuantizedTensor):
    return np.asarray(dequantize(w))
  return np.asarray(w, np.float32)


def save_safetensors(directory: str | os.PathLike, config: ModelConfig, params: Params,
                     dtype=np.float32) -> None:
  """Writes config.json + model.safetensors (quantized weights dequantized)."""
  from safetensors.numpy import save_file

  if config.post_norms or config.sliding_window is not None:
    raise CheckpointError(f"saving a {config.architecture!r} model as safetensors is not "
                          f"supported (Llama-family layouts only)")
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  out = {"model.embed_tokens.weight": _dense(params["embed"]).T,
         "model.norm.weight": _dense(params["final_norm"])}
  if "lm_head" in params:
    out["lm_head.weight"] = _dense(params["lm_head"]).T
  for i, layer in enumerate(params["layers"]):
    for ours, w in layer.items():
      out[f"model.layers.{i}.{_LAYER_NAMES[ours]}"] = _dense(w).T if ours.startswith("w") else _dense(w)
  save_file({k: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()},
            str(directory / "model.safetensors"))
  hf = {
      "model_type": config.architecture if config.architecture in SUPPORTED_MODEL_TYPES else "llama",
      "vocab_size": config.vocab_size, "hidden_size": config.d_model,
      "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim,
      "intermediate_size": config.ffn_dim, "rope_theta": config.rope_theta,
      "rope_scaling": config.rope_scaling, "rms_norm_eps": config.rms_eps,
      "max_position_embeddings": config.max_context, "tie_word_embeddings": config.tie_embeddings,
      "attention_bias": config.attention_bias, "bos_token_id": config.bos_id,
      "eos_token_id": list(config.eos_ids), "torch_dtype": np.dtype(dtype).name,
      # A GGUF's rope_freqs ({"rope_type": "freq_factors"}) has no HF spelling: our loader
      # reads it back, transformers does not.
      "architectures": [_HF_CLASSES.get(config.architecture, "LlamaForCausalLM")],
  }
  (directory / "config.json").write_text(json.dumps(hf, indent=2))
