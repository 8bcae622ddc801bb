"""Model configuration shared by every checkpoint format (the model layer reads it from here)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


# rope_scaling["rope_type"] values the model computes (layers.rope_inv_freq).
ROPE_SCALING_TYPES = ("linear", "llama3", "freq_factors")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM).

  Architectures differ only in the switches below: attention_bias (Qwen2's q/k/v biases),
  qk_norm (Qwen3's RMSNorm of each q and k head before RoPE) and rope_scaling (Llama 3)."""

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
  # rope_freqs tensor): {"rope_type": "freq_factors", "factors": (head_dim / 2 floats)}.
  rope_scaling: dict[str, Any] | None = None
  rms_eps: float = 1e-5
  max_context: int = 2048
  tie_embeddings: bool = True
  attention_bias: bool = False  # Qwen2 has q/k/v biases
  qk_norm: bool = False  # Qwen3: RMSNorm (weights [head_dim]) on each q and k head
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  architecture: str = "llama"
  name: str = ""

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
    if self.rope_scaling is not None:  # lists (from JSON) become tuples: configs hash
      scaling = {k: tuple(v) if isinstance(v, list) else v for k, v in self.rope_scaling.items()}
      kind = scaling.get("rope_type", scaling.get("type"))
      if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_SCALING_TYPES)})")
      object.__setattr__(self, "rope_scaling", scaling)

  def __hash__(self):  # rope_scaling is a dict; hash its items so configs can be jit-static
    items = dataclasses.astuple(dataclasses.replace(self, rope_scaling=None))
    scaling = tuple(sorted((self.rope_scaling or {}).items()))
    return hash((items, scaling))

  @property
  def group_size(self) -> int:
    """Query heads per KV head."""
    return self.n_heads // self.n_kv_heads

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "ModelConfig":
    data = json.loads(text)
    data["eos_ids"] = tuple(data.get("eos_ids", ()))
    return cls(**data)
