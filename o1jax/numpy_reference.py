"""An independent numpy forward pass of a Llama-family model, for tests.

It shares no code with `o1jax.model` or `o1jax.checkpoint`: GGUF tensors are
dequantized by gguf-py's own numpy routines, and rotary embedding is applied
to GGUF's permuted Q/K weights in the interleaved (pairwise) form, which is
how llama.cpp computes it — whereas the model un-permutes the weights and
rotates halves. Whole-sequence causal attention, no cache, f32 throughout.
"""

from __future__ import annotations

import numpy as np


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotary(x, positions, theta, interleaved):
  """x: [T, heads, D]."""
  d = x.shape[-1]
  freqs = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
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
    q = _rotary(q.reshape(t, nh, hd), pos, hp["theta"], interleaved_rotary)
    k = _rotary(k.reshape(t, nkv, hd), pos, hp["theta"], interleaved_rotary)
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
}


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
  hp["head_dim"] = int(f(f"{arch}.embedding_length")) // hp["n_heads"]
  weights = {}
  for t in reader.tensors:
    w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
    w = w.reshape(tuple(int(s) for s in reversed(t.shape)))
    name = t.name
    if name == "token_embd.weight":
      weights["model.embed_tokens.weight"] = w
    elif name == "output_norm.weight":
      weights["model.norm.weight"] = w
    elif name == "output.weight":
      weights["lm_head.weight"] = w
    else:
      _, i, rest = name.split(".", 2)
      weights[f"model.layers.{i}.{_GGUF_TO_HF[rest]}"] = w
  return weights, hp


def gguf_forward(path, tokens) -> np.ndarray:
  weights, hp = gguf_weights(path)
  return forward(weights, hp, tokens, interleaved_rotary=True)
