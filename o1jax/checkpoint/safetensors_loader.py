"""HF-style checkpoints: `config.json` + `*.safetensors` (single file or sharded index).

Supports the Llama (2 and 3), Mistral, Qwen2, Qwen3, SmolLM and Gemma 3 (text,
`gemma3_text`) families in bf16/f16/f32. Also
writes such a checkpoint (dense f32 weights) from any loaded model, which is
how `scripts/convert_checkpoint.py` exports GGUF models for HF tools.
"""

from __future__ import annotations

import dataclasses

import json
import math
import os
import pathlib

import numpy as np

from o1jax.checkpoint import tensor_table
from o1jax.checkpoint.errors import CheckpointError, new_checkpoint_dir, read_json_object
from o1jax.checkpoint.model_config import SMOLLM3_NOPE_STEP, ModelConfig
from o1jax.checkpoint.params import FUSED_PARTS, Params, split_fused
from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "smollm3", "phi3")
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
# Phi-3's fused matrices (HF [out, in]: rows q, k, v / gate, up), split at load.
_PHI3_FUSED_NAMES = {"wqkv": "self_attn.qkv_proj.weight", "w_gate_up": "mlp.gate_up_proj.weight"}
# Gemma 3's layer norms (HF's Gemma3RMSNorm multiplies by 1 + w: we store the sum).
# Its post_attention_layernorm is the attention output's norm; the MLP's input norm is
# pre_feedforward_layernorm. (It has no q/k/v biases: attention_bias is off.)
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm.weight",
                       "post_attn_norm": "post_attention_layernorm.weight",
                       "post_ffn_norm": "post_feedforward_layernorm.weight"}
_GEMMA3_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


# transformers' defaults where a model's config class differs from LlamaConfig's (a key
# config.json leaves out takes its class's default there).
_CLASS_DEFAULTS = {
    "gemma3_text": {"rope_theta": 1e6, "sliding_window": 4096, "head_dim": 256,
                    "tie_word_embeddings": True},
    "qwen3": {"head_dim": 128}, "smollm3": {"rope_theta": 2e6, "tie_word_embeddings": True},
    "mistral": {"sliding_window": 4096}, "phi3": {"rms_norm_eps": 1e-5}}


def _default(hf: dict, key: str, value):
  return _CLASS_DEFAULTS.get(hf.get("model_type"), {}).get(key, value)


def _rope(hf: dict, path) -> tuple[float, dict | None]:
  """(theta, scaling) from config.json: `rope_theta` + `rope_scaling` (transformers 4), or
  one `rope_parameters` dict holding both (transformers 5)."""
  params = _object(hf, "rope_parameters", path)
  params = _object(params, "full_attention", path, params)  # Gemma 3 (transformers 5): per layer type
  # (both given: rope_parameters' value, as transformers 5 reads it; the top-level key is
  # only its default there)
  theta = _number(params, "rope_theta", path, float,
                  _number(hf, "rope_theta", path, float, _default(hf, "rope_theta", 10000.0)))
  scaling = _object(hf, "rope_scaling", path) or {k: v for k, v in params.items() if k != "rope_theta"}
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
  if not isinstance(act, str) or act not in _GEMMA3_ACTIVATIONS:
    raise CheckpointError(f"{path}: hidden_activation {act!r} is not supported "
                          f"(supported: {', '.join(_GEMMA3_ACTIVATIONS)})")
  n_layers = _number(hf, "num_hidden_layers", path)
  pattern = _number(hf, "sliding_window_pattern", path, default=0) or 6
  types = hf.get("layer_types")
  if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
    raise CheckpointError(f"{path}: layer_types={types!r} is not a list of strings")
  if types is not None:  # one name per layer: must be a period-`pattern` interleave
    pattern = next((i + 1 for i, k in enumerate(types) if k == "full_attention"), n_layers + 1)
    want = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)]
    if list(types) != want:
      raise CheckpointError(f"{path}: layer_types {types} is not one global layer in every "
                            f"{pattern} (the only interleave supported)")
  local = _object(_object(hf, "rope_parameters", path), "sliding_attention", path)
  local = _number(local, "rope_theta", path, float,
                  _number(hf, "rope_local_base_freq", path, float, 10000.0))
  return dict(scale_embeddings=True, post_norms=True, activation=_GEMMA3_ACTIVATIONS[act],
              query_pre_attn_scalar=_number(hf, "query_pre_attn_scalar", path, float, 0) or 256.0,
              sliding_window=_sliding_window(hf, path), sliding_window_pattern=pattern,
              rope_local_theta=local)


def _sliding_window(hf: dict, path) -> int | None:
  """config.json's sliding_window (absent: the class's default; null or 0: none), for the
  models whose attention applies it (transformers: Mistral and Phi-3 on every layer, Gemma
  3 on its local ones). Qwen 2/3 and SmolLM3 apply theirs only with use_sliding_window,
  from max_window_layers on: refused."""
  if hf.get("model_type") in ("qwen2", "qwen3", "smollm3"):
    if _flag(hf, "use_sliding_window", path, False):
      raise CheckpointError(f"{path}: use_sliding_window=true is not supported (a window from "
                            f"layer max_window_layers on)")
    return None
  if "sliding_window" not in hf:
    return _default(hf, "sliding_window", None)
  return _number(hf, "sliding_window", path, int, None) or None


_REQUIRED = object()


def _number(hf: dict, key: str, path, kind=int, default=_REQUIRED):
  """config.json's `key` as `kind` (int or float); absent or null: `default`. A value of
  another type (a string, a bool, 1.5 for a size) is named with its key."""
  value = hf.get(key)
  if value is None:
    if default is _REQUIRED:
      raise CheckpointError(f"{path}: config.json lacks the key {key!r}")
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
      kind is int and value != int(value)):
    raise CheckpointError(f"{path}: {key}={value!r} is not {'an integer' if kind is int else 'a number'}")
  return kind(value)


def _flag(hf: dict, key: str, path, default: bool) -> bool:
  """config.json's `key` as a bool (absent or null: `default`); "false" is not False."""
  value = hf.get(key)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise CheckpointError(f"{path}: {key}={value!r} is not true or false")
  return value


def _object(hf: dict, key: str, path, default=None) -> dict:
  """config.json's `key` as a dict (absent or null: `default`, else {})."""
  value = hf.get(key)
  if value is None:
    return {} if default is None else default
  if not isinstance(value, dict):
    raise CheckpointError(f"{path}: {key}={value!r} is not an object")
  return value


def _token_ids(hf: dict, key: str, path, vocab_size: int, many: bool) -> tuple[int, ...]:
  """config.json's `key` (an id, null, or with `many` a list of ids) as token ids below
  vocab_size: an id past the embedding would index past it."""
  value = hf.get(key)
  ids = value if many and isinstance(value, list) else [] if value is None else [value]
  if not all(isinstance(i, int) and not isinstance(i, bool) and (vocab_size < 1 or 0 <= i < vocab_size)
             for i in ids):  # (a vocab_size < 1 is named by ModelConfig)
    raise CheckpointError(f"{path}: {key}={value!r} is not a token id (0..{vocab_size - 1})"
                          f"{' or a list of them' if many else ''}")
  return tuple(ids)


def _phi3(hf: dict, path, head_dim: int, scaling: dict | None) -> dict:
  """Phi-3's switches: the config's sliding_window on every layer (as transformers applies
  it), a partial rotary embedding (`partial_rotary_factor`, at the top or in transformers
  5's `rope_parameters`: Phi-4-mini's 0.75) and longrope's numbers as transformers derives
  them: original_max_position_embeddings (the config's, else max_position_embeddings) and
  attention_factor (given, else sqrt(1 + ln(factor) / ln(original)) for factor =
  max_position_embeddings / original > 1, else 1)."""
  params = _object(hf, "rope_parameters", path)
  rotary = _number(hf, "partial_rotary_factor", path, float,
                   _number(params, "partial_rotary_factor", path, float, 1.0))
  out = {}
  if not 0 < rotary <= 1:
    raise CheckpointError(f"{path}: partial_rotary_factor={rotary} must be in (0, 1]")
  if rotary != 1.0:
    out["rotary_dim"] = int(head_dim * rotary)  # as transformers; ModelConfig names an odd one
  window = _sliding_window(hf, path)
  if window:
    out.update(sliding_window=window, sliding_window_pattern=0)
  longest = _number(hf, "max_position_embeddings", path, int, 2048)
  if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
    original = _number(hf, "original_max_position_embeddings", path, int,
                       _number(scaling, "original_max_position_embeddings", path, int, 0))
    factor = longest / original if original else _number(scaling, "factor", path, float, 1.0)
    original = original or longest
    attention = _number(scaling, "attention_factor", path, float, None)  # 0: ModelConfig names it
    if attention is None:
      attention = (math.sqrt(1 + math.log(factor) / math.log(original))
                   if factor > 1 and original > 1 else 1.0)
    out["rope_scaling"] = {**{k: v for k, v in scaling.items()
                              if k not in ("type", "partial_rotary_factor")},
                           "rope_type": "longrope",
                           "original_max_position_embeddings": original,
                           "attention_factor": attention}
  return out


def _nope_layers(hf: dict, path, n_layers: int) -> tuple[int, ...]:
  """SmolLM3's layers without RoPE: `no_rope_layers` (one 1 = rotates / 0 = not per layer),
  else every `no_rope_layer_interval`-th layer (transformers' default: 4)."""
  flags = hf.get("no_rope_layers")
  if flags is None:
    step = _number(hf, "no_rope_layer_interval", path, int, SMOLLM3_NOPE_STEP)
    if step < 1:
      raise CheckpointError(f"{path}: no_rope_layer_interval={step} must be >= 1")
    return tuple(i for i in range(n_layers) if (i + 1) % step == 0)
  if (not isinstance(flags, list) or len(flags) != n_layers
      or any(f not in (0, 1) or isinstance(f, float) for f in flags)):
    raise CheckpointError(f"{path}: no_rope_layers={flags!r} must be a list of {n_layers} "
                          f"flags 0 or 1 (1: the layer uses RoPE)")
  return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def config_from_hf(hf: dict, path, n_tensors: int | None = None) -> ModelConfig:
  """The ModelConfig of a config.json; n_tensors: the checkpoint's tensor count, which
  bounds num_hidden_layers."""
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise CheckpointError(f"{path}: model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
  try:
    num = lambda key, kind=int, default=_REQUIRED: _number(hf, key, path, kind, default)
    if n_tensors is not None:
      tensor_table.check_layer_count(path, num("num_hidden_layers"), n_tensors,
                                     "num_hidden_layers")
    n_heads = num("num_attention_heads")
    d_model = num("hidden_size")
    vocab = num("vocab_size")
    eos_ids = _token_ids(hf, "eos_token_id", path, vocab, many=True)
    bos = _token_ids(hf, "bos_token_id", path, vocab, many=False)
    rope_theta, rope_scaling = _rope(hf, path)
    head_dim = num("head_dim", default=0) or _default(
        hf, "head_dim", d_model // n_heads if n_heads > 0 else 0)
    if model_type != "gemma3_text":  # (Gemma 3's is checked with its other switches)
      act = hf.get("hidden_act", "silu")
      if act != "silu":
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported for model_type "
                              f"{model_type!r} (supported: 'silu')")
    switches = (_gemma3(hf, path) if model_type == "gemma3_text" else
                _phi3(hf, path, head_dim, rope_scaling) if model_type == "phi3" else {})
    window = (_sliding_window(hf, path) if model_type in ("mistral", "qwen2", "qwen3", "smollm3")
              else None)
    if model_type != "phi3":  # (transformers' rotary embedding reads it; only Phi-3 applies it)
      rotary = _number(hf, "partial_rotary_factor", path, float, _number(
          _object(hf, "rope_parameters", path), "partial_rotary_factor", path, float, 1.0))
      if rotary != 1.0:
        raise CheckpointError(f"{path}: partial_rotary_factor={rotary:g} is not supported for "
                              f"model_type {model_type!r} (its attention rotates whole heads)")
    if window:  # every layer, as Phi-3's
      switches.update(sliding_window=window, sliding_window_pattern=0)
    rope_scaling = switches.pop("rope_scaling", rope_scaling)
    nope = _nope_layers(hf, path, num("num_hidden_layers")) if model_type == "smollm3" else ()
    return ModelConfig(**switches, nope_layers=nope,
        vocab_size=vocab, d_model=d_model, n_layers=num("num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=num("num_key_value_heads", default=0) or n_heads,
        head_dim=head_dim,
        ffn_dim=num("intermediate_size"), rope_theta=rope_theta,
        rope_scaling=rope_scaling, rms_eps=num("rms_norm_eps", float, _default(hf, "rms_norm_eps", 1e-6)),
        max_context=num("max_position_embeddings", default=2048),
        tie_embeddings=_flag(hf, "tie_word_embeddings", path,
                             _default(hf, "tie_word_embeddings", False)),
        attention_bias=_flag(hf, "attention_bias", path, model_type == "qwen2"),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        bos_id=bos[0] if bos else None, eos_ids=eos_ids, architecture=model_type,
        name=str(hf.get("_name_or_path", "")))
  except KeyError as e:
    raise CheckpointError(f"{path}: config.json lacks the key {e.args[0]!r}") from e
  except CheckpointError:
    raise
  except ValueError as e:  # e.g. an unsupported rope scaling type
    raise CheckpointError(f"{path}: {e}") from e


def _shard_files(directory: pathlib.Path) -> list[pathlib.Path]:
  index = directory / "model.safetensors.index.json"
  if (directory / "model.safetensors").is_file():
    # As transformers: model.safetensors where there is one, the index's shards otherwise
    # (a directory may also hold another layout's copy, e.g. Mistral's
    # consolidated.safetensors, or an adapter's file)
    files = [directory / "model.safetensors"]
  elif index.is_file():
    weight_map = read_json_object(index).get("weight_map", {})
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index}: weight_map is not an object")
    for name, f in weight_map.items():  # a file name in this directory, nothing else
      if not isinstance(f, str) or pathlib.PurePath(f).name != f or f in ("", ".", ".."):
        raise CheckpointError(f"{index}: weight_map[{name!r}]={f!r} is not the name of a file "
                              f"beside it")
    files = sorted({directory / f for f in weight_map.values()})
  else:
    files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise CheckpointError(f"{directory}: no *.safetensors files")
  for f in files:
    if not f.is_file():
      raise CheckpointError(f"{directory}: shard {f.name} listed in the index is missing")
  return files


def _read_config(directory: pathlib.Path) -> tuple[ModelConfig, dict]:
  """The config and the safetensors headers (`_read_headers`), which bound its layers."""
  cfg_file = directory / "config.json"
  if not cfg_file.is_file():
    raise CheckpointError(f"{directory}: config.json is missing")
  hf = read_json_object(cfg_file)
  headers = _read_headers(directory)
  config = config_from_hf(hf, cfg_file, len(headers))
  # transformers' generate also stops on generation_config.json's eos ids (Gemma 3's
  # <end_of_turn>, Phi-3's <|end|>, Qwen's <|endoftext|>: not config.json's eos_token_id)
  gen_file = directory / "generation_config.json"
  if gen_file.exists():
    more = _token_ids(read_json_object(gen_file), "eos_token_id", gen_file, config.vocab_size,
                      many=True)
    config = dataclasses.replace(config, eos_ids=tuple(dict.fromkeys(config.eos_ids + more)))
  return config, headers


_HEADER_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _read_headers(directory: pathlib.Path) -> dict[str, tuple[pathlib.Path, tuple]]:
  """{tensor name: (shard, shape)} from every shard's header (which the library checks
  against the file's length), without reading tensor data; a dtype we do not load, or a
  name in two shards, is refused here."""
  from safetensors import safe_open

  headers = {}
  for shard in _shard_files(directory):
    try:
      with safe_open(str(shard), framework="numpy") as f:
        entries = [(name, f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
                   for name in f.keys()]
    except Exception as e:  # the library's own messages: keep their first line
      raise CheckpointError(f"{shard}: cannot be read as safetensors ({str(e).splitlines()[0]})") from e
    for name, dtype, shape in entries:
      if dtype not in _HEADER_DTYPES:
        raise CheckpointError(f"{directory}: tensor {name!r} has dtype {dtype}, "
                              f"supported: {', '.join(_FLOAT_DTYPES)}")
      if name in headers:  # which copy is read would depend on the order of the shards
        raise CheckpointError(f"{directory}: tensor {name!r} is in both {headers[name][0].name} "
                              f"and {shard.name}")
      headers[name] = (shard, shape)
  return headers


def expected_tensors(config: ModelConfig, stored: bool = True
                     ) -> list[tuple[int | None, str, str, tuple, bool]]:
  """(layer (None outside layers), our name, HF name, HF shape ([out, in]), read) of every
  tensor an HF checkpoint of `config` may hold, in the order `load_safetensors` reads them.
  stored=False: the model's names, Phi-3's fused matrices split (as orbax stores them)."""
  d, hd, f, v = config.d_model, config.head_dim, config.ffn_dim, config.vocab_size
  q, kv = config.n_heads * hd, config.n_kv_heads * hd
  shapes = {"wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q), "bq": (q,), "bk": (kv,),
            "bv": (kv,), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f), "q_norm": (hd,),
            "k_norm": (hd,), "wqkv": (q + 2 * kv, d), "w_gate_up": (2 * f, d)}
  gemma = config.architecture in ("gemma3_text", "gemma3")  # (a GGUF's config says gemma3)
  names = _GEMMA3_LAYER_NAMES if gemma else _LAYER_NAMES
  if stored and config.architecture == "phi3":
    parts = {name for fused in FUSED_PARTS.values() for name in fused}
    names = {**{k: n for k, n in names.items() if k not in parts}, **_PHI3_FUSED_NAMES}
  out = []
  for i in range(config.n_layers):
    for ours, theirs in names.items():
      read = not ((ours.startswith("b") and not config.attention_bias) or
                  (ours in ("q_norm", "k_norm") and not config.qk_norm))
      out.append((i, ours, f"model.layers.{i}.{theirs}", shapes.get(ours, (d,)), read))
  return out + [(None, "embed", "model.embed_tokens.weight", (v, d), True),
                (None, "final_norm", "model.norm.weight", (d,), True),
                (None, "lm_head", "lm_head.weight", (v, d), not config.tie_embeddings)]


def _check_tensors(directory, config: ModelConfig, headers: dict) -> None:
  """`tensor_table.check_tensors` on an HF checkpoint: a tensor not read (a tied lm_head, a
  bias) is not checked for its shape."""
  tensor_table.check_tensors(
      directory, [(name, want, read) for _, _, name, want, read in expected_tensors(config)],
      {name: shape for name, (_, shape) in headers.items()}, config.n_layers,
      r"model\.layers\.(\d+)\.", layers_key="config.json's num_hidden_layers",
      unread_tail=f" by the model config.json describes (attention_bias={config.attention_bias}, "
                  f"model_type {config.architecture!r})",
      # (transformers < 4.31 saved each layer's rotary table; it is computed from the config)
      ignored=r"model\.(layers\.\d+\.self_attn\.)?rotary_emb(_local)?\.inv_freq",
      model=f"a {config.architecture!r} model")


def check_safetensors(directory: str | os.PathLike) -> ModelConfig:
  """Validates an HF checkpoint without reading its tensors: config.json, every shard's
  safetensors header, and each tensor's dtype and shape against the config. Returns the
  config."""
  directory = pathlib.Path(directory)
  config, headers = _read_config(directory)
  _check_tensors(directory, config, headers)
  if not (directory / "tokenizer.json").is_file():
    raise CheckpointError(f"{directory}: tokenizer.json is missing")
  return config


def load_safetensors(directory: str | os.PathLike) -> tuple[ModelConfig, Params]:
  """Reads an HF checkpoint directory into (config, params) with [in, out] weights."""
  from safetensors import safe_open

  directory = pathlib.Path(directory)
  config, headers = _read_config(directory)
  _check_tensors(directory, config, headers)  # before reading any weight
  tensors: dict[str, np.ndarray] = {}
  for shard in sorted({shard for shard, _ in headers.values()}):
    try:
      with safe_open(str(shard), framework="numpy") as f:
        for name in f.keys():
          tensors[name] = f.get_tensor(name)
    except Exception as e:
      raise CheckpointError(f"{shard}: cannot be read as safetensors ({str(e).splitlines()[0]})") from e

  def get(name, transpose):
    if name not in tensors:
      raise CheckpointError(f"{directory}: tensor {name!r} is missing")
    t = tensors[name]
    return np.ascontiguousarray(t.T) if transpose else t

  gemma = config.architecture == "gemma3_text"
  # Gemma's RMSNorm weights w act as 1 + w (added in f32, as HF's Gemma3RMSNorm does).
  shift = (lambda w: np.asarray(w, np.float32) + np.float32(1)) if gemma else (lambda w: w)
  layers, other = [{} for _ in range(config.n_layers)], {}
  for i, ours, name, want, read in expected_tensors(config):
    if read:
      w = get(name, transpose=len(want) == 2)  # matrices: HF's [out, in] to our [in, out]
      (other if i is None else layers[i])[ours] = shift(w) if ours.endswith("_norm") else w
  hd = config.head_dim
  for layer in layers:  # Phi-3's fused matrices, split as the model holds them
    split_fused(layer, config.n_heads * hd, config.n_kv_heads * hd, config.ffn_dim)
  params: Params = {"embed": other.pop("embed"), "layers": layers, **other}  # lm_head: untied only
  return config, params


def _dense(w) -> np.ndarray:
  if isinstance(w, QuantizedTensor):
    return np.asarray(dequantize(w))
  return np.asarray(w, np.float32)


def save_safetensors(directory: str | os.PathLike, config: ModelConfig, params: Params,
                     dtype=np.float32) -> None:
  """Writes config.json + model.safetensors (quantized weights dequantized)."""
  from safetensors.numpy import save_file

  # (Mistral's window on every layer has its key; a window elsewhere, Gemma's or Phi-3's
  # layouts do not)
  mistral_window = config.architecture == "mistral" and config.sliding_window_pattern == 0
  if config.post_norms or config.architecture == "phi3" or (
      config.sliding_window is not None and not mistral_window):
    raise CheckpointError(f"saving a {config.architecture!r} model as safetensors is not "
                          f"supported (Llama-family layouts only)")
  directory = new_checkpoint_dir(directory)
  out = {"model.embed_tokens.weight": _dense(params["embed"]).T,
         "model.norm.weight": _dense(params["final_norm"])}
  if "lm_head" in params:
    out["lm_head.weight"] = _dense(params["lm_head"]).T
  for i, layer in enumerate(params["layers"]):
    for ours, w in layer.items():
      out[f"model.layers.{i}.{_LAYER_NAMES[ours]}"] = _dense(w).T if ours.startswith("w") else _dense(w)
  weights = directory / "model.safetensors"
  save_file({k: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}, str(weights))
  # safetensors writes its file 0600 (a temporary file, renamed): other users of a shared
  # model folder (a cluster's workers) could read config.json but not the weights.
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(weights, 0o666 & ~umask)
  hf = {
      "model_type": config.architecture if config.architecture in SUPPORTED_MODEL_TYPES else "llama",
      "vocab_size": config.vocab_size, "hidden_size": config.d_model,
      "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim,
      "intermediate_size": config.ffn_dim, "rope_theta": config.rope_theta,
      "rope_scaling": config.rope_scaling, "rms_norm_eps": config.rms_eps,
      "max_position_embeddings": config.max_context, "tie_word_embeddings": config.tie_embeddings,
      "attention_bias": config.attention_bias, "bos_token_id": config.bos_id,
      # (Mistral's class default is a window of 4096: no window is written as null)
      **({"sliding_window": config.sliding_window} if config.architecture == "mistral" else {}),
      **({"no_rope_layers": [int(i not in config.nope_layers) for i in range(config.n_layers)]}
         if config.nope_layers else {}),
      "eos_token_id": list(config.eos_ids), "torch_dtype": np.dtype(dtype).name,
      # A GGUF's rope_freqs ({"rope_type": "freq_factors"}) has no HF spelling: our loader
      # reads it back, transformers does not.
      "architectures": [_HF_CLASSES.get(config.architecture, "LlamaForCausalLM")],
  }
  (directory / "config.json").write_text(json.dumps(hf, indent=2))
