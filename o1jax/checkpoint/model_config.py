"""Model configuration shared by every checkpoint format (the model layer reads it from here)."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Any


# rope_scaling["rope_type"] values the model computes (layers.rope_inv_freq).
ROPE_SCALING_TYPES = ("linear", "llama3", "freq_factors", "longrope")
# Gated-MLP activations (layers.ACTIVATIONS): SwiGLU for Llama/Qwen, GeGLU (tanh GELU) for Gemma 3.
ACTIVATIONS = ("silu", "gelu_tanh")
# Sizes a model needs to be at least 1 (and that index int32 arrays on the device).
SIZE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
               "max_context")
MAX_SIZE = 2**31 - 1
# The numbers each rope_scaling type is computed from (layers.rope_inv_freq).
_ROPE_SCALING_KEYS = {"linear": ("factor",), "freq_factors": (),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                 "original_max_position_embeddings"),
                      "longrope": ("original_max_position_embeddings", "attention_factor")}
# Per-frequency lists (rotary_dim / 2 floats > 0) of each rope_scaling type.
_ROPE_SCALING_LISTS = {"freq_factors": ("factors",), "longrope": ("short_factor", "long_factor")}


# SmolLM3: every 4th layer has no RoPE. A GGUF does not record it (llama.cpp hard-codes
# the step); transformers' no_rope_layer_interval defaults to it.
SMOLLM3_NOPE_STEP = 4


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM,
  SmolLM3, Phi-3, Gemma 3).

  Architectures differ only in the switches below: attention_bias (Qwen2's q/k/v biases),
  qk_norm (Qwen3's RMSNorm of each q and k head before RoPE), rope_scaling (Llama 3), and
  Gemma 3's: embeddings scaled by sqrt(d_model), post-attention and post-FFN norms, GeGLU,
  scores scaled by 1/sqrt(query_pre_attn_scalar), and local sliding-window layers with
  their own RoPE base between global ones; Phi-3's window on every layer; SmolLM3's
  layers without RoPE (nope_layers). Gemma's RMSNorm multiplies by (1 + w): the loaders
  store that sum as the norm weight (as llama.cpp's GGUFs do), so every norm here is a
  plain RMSNorm."""

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  # None, or a dict like HF's rope_scaling: {"rope_type": "linear", "factor": 2.0} or
  # {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
  #  "original_max_position_embeddings"}, or llama.cpp's per-frequency divisors (a GGUF's
  # rope_freqs tensor): {"rope_type": "freq_factors", "factors": (rotary_dim / 2 floats)},
  # or Phi-3.5/Phi-4's {"rope_type": "longrope", "short_factor", "long_factor" (rotary_dim /
  # 2 divisors each: short below original_max_position_embeddings, long from it),
  # "original_max_position_embeddings", "attention_factor" (cos and sin scaled by it)}.
  rope_scaling: dict[str, Any] | None = None
  # Leading dimensions of each head that RoPE rotates (rotate-half within them); the rest
  # pass through. None: all (head_dim). Phi-4-mini: 96 of 128.
  rotary_dim: int | None = None
  rms_eps: float = 1e-5
  max_context: int = 2048
  tie_embeddings: bool = True
  attention_bias: bool = False  # Qwen2 has q/k/v biases
  qk_norm: bool = False  # Qwen3: RMSNorm (weights [head_dim]) on each q and k head
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  architecture: str = "llama"
  name: str = ""
  # Gemma 3 (the defaults are Llama's):
  scale_embeddings: bool = False  # embedding rows times sqrt(d_model)
  post_norms: bool = False  # RMSNorm of the attention and of the MLP output, before the residual
  activation: str = "silu"  # gate activation of the gated MLP (ACTIVATIONS)
  query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power (None: head_dim)
  # Local layers: a query sees itself and the sliding_window - 1 keys before it. Layer i is
  # global when (i + 1) % sliding_window_pattern == 0 (Gemma 3: 6; 1 = every layer global;
  # 0 = none: every layer local, Phi-3).
  sliding_window: int | None = None
  sliding_window_pattern: int = 1
  rope_local_theta: float | None = None  # RoPE base of local layers, unscaled (None: rope_theta)
  # SmolLM3: layers whose q and k are not rotated (no positional encoding; NoPE).
  nope_layers: tuple[int, ...] = ()

  def __post_init__(self):
    for name in SIZE_FIELDS:  # a 0 would divide by zero here or build an empty model
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
      if getattr(self, name) > MAX_SIZE:
        raise ValueError(f"{name}={getattr(self, name)} must be <= {MAX_SIZE}")
    for name in ("rope_theta", "rms_eps"):  # 0 or inf: NaN logits, not an error, later
      value = getattr(self, name)
      if not math.isfinite(value) or value < 0 or (name == "rope_theta" and value == 0):
        raise ValueError(f"{name}={value} must be a finite number {'>' if name == 'rope_theta' else '>='} 0")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
    for name, ids in (("eos_ids", self.eos_ids), ("bos_id", () if self.bos_id is None else (self.bos_id,))):
      bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
      if bad:  # (an eos id past the vocabulary failed the first request, in the loop)
        raise ValueError(f"{name} {bad[0]} is not a token id (0..{self.vocab_size - 1})")
    if self.rotary_dim is not None and (
        isinstance(self.rotary_dim, bool) or not isinstance(self.rotary_dim, numbers.Integral)
        or self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim):
      raise ValueError(f"rotary_dim={self.rotary_dim!r} must be an even number in 2.."
                       f"{self.head_dim} (head_dim)")
    if self.rotary_dim is None and self.head_dim % 2:  # RoPE turns pairs of dimensions
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs of dims)")
    if self.rope_scaling is not None:  # lists (from JSON) become tuples: configs hash
      scaling = {k: tuple(v) if isinstance(v, list) else v for k, v in self.rope_scaling.items()}
      kind = scaling.get("rope_type", scaling.get("type"))
      if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_SCALING_TYPES)})")
      for key in _ROPE_SCALING_KEYS[kind]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
          raise ValueError(f"rope_scaling[{key!r}]={value!r} must be a finite number > 0 "
                           f"(rope type {kind!r})")
      half = (self.head_dim if self.rotary_dim is None else self.rotary_dim) // 2
      for key in _ROPE_SCALING_LISTS.get(kind, ()):
        value = scaling.get(key)
        if (not isinstance(value, tuple) or len(value) != half
            or any(isinstance(v, bool) or not isinstance(v, (int, float))
                   or not math.isfinite(v) or v <= 0 for v in value)):
          raise ValueError(f"rope_scaling[{key!r}] must be {half} finite numbers > 0 (rotary "
                           f"dims / 2), got {value!r:.200}")
      object.__setattr__(self, "rope_scaling", scaling)
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation {self.activation!r} is not supported "
                       f"(supported: {', '.join(ACTIVATIONS)})")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 (or None)")
    if self.sliding_window_pattern < 0:
      raise ValueError(f"sliding_window_pattern={self.sliding_window_pattern} must be >= 0 "
                       f"(0: every layer local)")
    nope = self.nope_layers
    nope = tuple(nope) if hasattr(nope, "__len__") and not isinstance(nope, (str, bytes)) else nope
    if (not isinstance(nope, tuple)
        or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in nope)
        or any(not 0 <= i < self.n_layers for i in nope) or len(set(nope)) != len(nope)):
      raise ValueError(f"nope_layers={self.nope_layers!r} must be a list of distinct layer indices "
                       f"(0..{self.n_layers - 1})")
    object.__setattr__(self, "nope_layers", tuple(sorted(int(i) for i in nope)))

  def __hash__(self):  # rope_scaling is a dict; hash its items so configs can be jit-static
    items = dataclasses.astuple(dataclasses.replace(self, rope_scaling=None))
    scaling = tuple(sorted((self.rope_scaling or {}).items()))
    return hash((items, scaling))

  @property
  def rope_dim(self) -> int:
    """Leading dimensions of a head that RoPE rotates (rotary_dim, else head_dim)."""
    return self.head_dim if self.rotary_dim is None else self.rotary_dim

  def layer_window(self, layer: int) -> int | None:
    """Keys a query of `layer` sees (itself included), or None for a global layer."""
    pattern = self.sliding_window_pattern
    if self.sliding_window is None or (pattern and (layer + 1) % pattern == 0):
      return None
    return self.sliding_window

  @property
  def group_size(self) -> int:
    """Query heads per KV head."""
    return self.n_heads // self.n_kv_heads

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "ModelConfig":
    data = json.loads(text)
    if not isinstance(data, dict):
      raise ValueError(f"a model config is a JSON object, got {type(data).__name__}")
    data["eos_ids"] = tuple(data.get("eos_ids", ()))
    return cls(**data)
