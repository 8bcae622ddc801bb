"""An independent numpy forward pass of a Llama-family model, for tests.

It shares no code with `o1jax.model` or `o1jax.checkpoint`: GGUF tensors are
dequantized by gguf-py's own numpy routines, and rotary embedding is applied
to a Llama GGUF's permuted Q/K weights in the interleaved (pairwise) form, which
is how llama.cpp computes it — whereas the model un-permutes the weights and
rotates halves (Qwen2/Qwen3 GGUFs are rotate-half in llama.cpp too). Whole-
sequence causal attention, no cache, f32 throughout.

Architecture features, each written from its published description:
  * Qwen2: q/k/v projections have biases (present in `weights` -> used).
  * Qwen3: q and k are RMS-normalised per head (weights [head_dim]) before RoPE.
  * Llama 3 RoPE (`hp["rope_scaling"]`, HF's rope_type "llama3"): with wavelength
    2 pi / f, a frequency f is kept where the wavelength is below original_ctx /
    high_freq_factor, divided by `factor` where it is above original_ctx /
    low_freq_factor, and in between interpolated as (1 - a) f / factor + a f with
    a = (original_ctx / wavelength - low) / (high - low). llama.cpp's GGUF instead
    stores a divisor per frequency (rope_freqs; `hp["freq_factors"]`).
"""

from __future__ import annotations

import numpy as np


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _frequencies(d, hp):
  """RoPE frequencies [D/2] (radians per position), float64."""
  freqs = hp["theta"] ** (-np.arange(0, d, 2, dtype=np.float64) / d)
  if hp.get("freq_factors") is not None:
    return freqs / np.asarray(hp["freq_factors"], np.float64)
  scaling = hp.get("rope_scaling")
  if not scaling:
    return freqs
  kind = scaling.get("rope_type", scaling.get("type"))
  factor = scaling["factor"]
  if kind == "linear":
    return freqs / factor
  assert kind == "llama3", kind
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  ctx = scaling["original_max_position_embeddings"]
  out = []
  for f in freqs:
    wavelength = 2 * np.pi / f
    if wavelength < ctx / high:
      out.append(f)
    elif wavelength > ctx / low:
      out.append(f / factor)
    else:
      a = (ctx / wavelength - low) / (high - low)
      out.append((1 - a) * f / factor + a * f)
  return np.array(out)


def _rotary(x, positions, hp, interleaved):
  """x: [T, heads, D]."""
  d = x.shape[-1]
  freqs = _frequencies(d, hp)
  ang = positions[:, None].astype(np.float64) * freqs  # [T, D/2]
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  if interleaved:
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out.astype(np.float32)
  a, b = x[..., : d // 2], x[..., d // 2 :]
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(np.float32)


def forward(weights: dict[str, np.ndarray], hp: dict, tokens, interleaved_rotary: bool) -> np.ndarray:
  """Logits [T, vocab] for every position. `weights` use HF names, [out, in]."""
  tokens = np.asarray(tokens)
  t = len(tokens)
  nh, nkv, hd = hp["n_heads"], hp["n_kv_heads"], hp["head_dim"]
  x = weights["model.embed_tokens.weight"][tokens].astype(np.float32)
  pos = np.arange(t)
  causal = np.tril(np.ones((t, t), bool))
  for i in range(hp["n_layers"]):
    p = f"model.layers.{i}."
    h = _rms(x, weights[p + "input_layernorm.weight"], hp["eps"])
    q = h @ weights[p + "self_attn.q_proj.weight"].T
    k = h @ weights[p + "self_attn.k_proj.weight"].T
    v = h @ weights[p + "self_attn.v_proj.weight"].T
    if p + "self_attn.q_proj.bias" in weights:
      q = q + weights[p + "self_attn.q_proj.bias"]
      k = k + weights[p + "self_attn.k_proj.bias"]
      v = v + weights[p + "self_attn.v_proj.bias"]
    q, k = q.reshape(t, nh, hd), k.reshape(t, nkv, hd)
    if p + "self_attn.q_norm.weight" in weights:  # Qwen3: per head, before RoPE
      q = _rms(q, weights[p + "self_attn.q_norm.weight"], hp["eps"])
      k = _rms(k, weights[p + "self_attn.k_norm.weight"], hp["eps"])
    q = _rotary(q, pos, hp, interleaved_rotary)
    k = _rotary(k, pos, hp, interleaved_rotary)
    v = v.reshape(t, nkv, hd)
    rep = nh // nkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    s = np.where(causal[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", s, v).reshape(t, nh * hd)
    x = x + o @ weights[p + "self_attn.o_proj.weight"].T
    h = _rms(x, weights[p + "post_attention_layernorm.weight"], hp["eps"])
    g = h @ weights[p + "mlp.gate_proj.weight"].T
    u = h @ weights[p + "mlp.up_proj.weight"].T
    x = x + ((g / (1 + np.exp(-g))) * u) @ weights[p + "mlp.down_proj.weight"].T
  x = _rms(x, weights["model.norm.weight"], hp["eps"])
  head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
  return (x @ head.T).astype(np.float32)


_GGUF_TO_HF = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# llama.cpp applies RoPE to adjacent pairs (on permuted Q/K rows) except for these.
_GGUF_ROTATE_HALF = ("qwen2", "qwen3")


def _dequantize(gguf, data, qtype) -> np.ndarray:
  """gguf-py's dequantizer; Q8_K (which it lacks) by its definition: per 256 values an f32
  d, 256 int8 q and 16 int16 sums, w = d * q."""
  if qtype.name != "Q8_K":
    return gguf.quants.dequantize(data, qtype).astype(np.float32)
  blocks = data.reshape(-1, 292)
  d = blocks[:, :4].copy().view(np.float32)
  q = blocks[:, 4:260].copy().view(np.int8).astype(np.float32)
  return (d * q).reshape(*data.shape[:-1], -1)


def gguf_weights(path) -> tuple[dict[str, np.ndarray], dict]:
  """Dequantizes every tensor of a llama GGUF with gguf-py; Q/K stay permuted."""
  import gguf

  reader = gguf.GGUFReader(str(path))
  f = lambda k: reader.fields[k].contents()
  arch = f("general.architecture")
  hp = {"n_layers": int(f(f"{arch}.block_count")), "n_heads": int(f(f"{arch}.attention.head_count")),
        "n_kv_heads": int(f(f"{arch}.attention.head_count_kv")),
        "theta": float(f(f"{arch}.rope.freq_base")),
        "eps": float(f(f"{arch}.attention.layer_norm_rms_epsilon"))}
  hp["head_dim"] = int(f(f"{arch}.attention.key_length")) if f"{arch}.attention.key_length" \
      in reader.fields else int(f(f"{arch}.embedding_length")) // hp["n_heads"]
  hp["interleaved_rotary"] = arch not in _GGUF_ROTATE_HALF
  weights = {}
  for t in reader.tensors:
    w = _dequantize(gguf, np.asarray(t.data), t.tensor_type)
    w = w.reshape(tuple(int(s) for s in reversed(t.shape)))
    name = t.name
    if name == "token_embd.weight":
      weights["model.embed_tokens.weight"] = w
    elif name == "output_norm.weight":
      weights["model.norm.weight"] = w
    elif name == "output.weight":
      weights["lm_head.weight"] = w
    elif name == "rope_freqs.weight":
      hp["freq_factors"] = w
    else:
      _, i, rest = name.split(".", 2)
      weights[f"model.layers.{i}.{_GGUF_TO_HF[rest]}"] = w
  return weights, hp


def gguf_forward(path, tokens) -> np.ndarray:
  weights, hp = gguf_weights(path)
  return forward(weights, hp, tokens, interleaved_rotary=hp["interleaved_rotary"])
