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
  * Gemma 3 (`gemma3_forward`, HF Gemma3ForCausalLM's names): embeddings times
    sqrt(hidden); RMSNorm times (1 + w) (llama.cpp's GGUF stores 1 + w: norm_offset 0);
    per-head q/k norms; post-attention and post-feed-forward norms before each residual
    add; GeGLU with GELU's tanh form 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)));
    scores times query_pre_attn_scalar^-1/2; layer i is global when (i + 1) % pattern
    == 0 (RoPE base `theta`, `rope_scaling`), else local: RoPE base `local_theta` and a
    query at position i sees keys j with i - window < j <= i.
  * SmolLM3: the layers in `hp["nope_layers"]` do not rotate q and k (no positional
    encoding); every other layer is Llama's.
  * Phi-3: q/k/v and gate/up stored fused (rows q, k, v; gate, up), split here; with
    `hp["window"]`, every layer's query sees itself and the window - 1 keys before it.
  * Partial rotary (Phi-4-mini, `hp["rotary_dim"]` r): only the first r dimensions of a
    head are rotated (its halves of r / 2), the rest pass unchanged.
  * LongRoPE (Phi-3.5, Phi-4-mini; rope_type "longrope"): frequency i of the r rotated
    dims is theta^(-2i / r) divided by short_factor[i] at a position below
    original_max_position_embeddings and by long_factor[i] at or past it (transformers
    for a token decoded at that position), cos and sin times attention_factor.
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


def _longrope_angles(positions, r, hp):
  """[T, r/2] angles of LongRoPE, position by position."""
  scaling = hp["rope_scaling"]
  base = hp["theta"] ** (-np.arange(0, r, 2, dtype=np.float64) / r)
  rows = []
  for p in positions:
    long = p >= scaling["original_max_position_embeddings"]
    factors = np.asarray(scaling["long_factor" if long else "short_factor"], np.float64)
    rows.append(p * base / factors)
  return np.array(rows).reshape(len(positions), r // 2)


def _rotary(x, positions, hp, interleaved):
  """x: [T, heads, D]; the first hp["rotary_dim"] (default D) dims rotate."""
  d = x.shape[-1]
  r = hp.get("rotary_dim") or d
  x, rest = x[..., :r], x[..., r:]
  scaling = hp.get("rope_scaling") or {}
  scale = 1.0
  if scaling.get("rope_type", scaling.get("type")) == "longrope":
    ang = _longrope_angles(positions, r, hp)
    scale = scaling["attention_factor"]
  else:
    ang = positions[:, None].astype(np.float64) * _frequencies(r, hp)  # [T, r/2]
  cos, sin = scale * np.cos(ang)[:, None, :], scale * np.sin(ang)[:, None, :]
  if interleaved:
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
  else:
    out = np.concatenate([x[..., : r // 2] * cos - x[..., r // 2:] * sin,
                          x[..., r // 2:] * cos + x[..., : r // 2] * sin], axis=-1)
  return np.concatenate([out, rest], axis=-1).astype(np.float32)


def forward(weights: dict[str, np.ndarray], hp: dict, tokens, interleaved_rotary: bool,
            layer_inputs=None) -> np.ndarray:
  """Logits [T, vocab] for every position. `weights` use HF names, [out, in].

  layer_inputs: applied to the input rows of every decoder-layer projection (not the
  head), e.g. a rounding of activations to a lower precision."""
  rows_in = layer_inputs or (lambda a: a)
  tokens = np.asarray(tokens)
  t = len(tokens)
  nh, nkv, hd = hp["n_heads"], hp["n_kv_heads"], hp["head_dim"]
  x = weights["model.embed_tokens.weight"][tokens].astype(np.float32)
  pos = np.arange(t)
  causal = np.tril(np.ones((t, t), bool))
  for i in range(hp["n_layers"]):
    p = f"model.layers.{i}."
    h = _rms(x, weights[p + "input_layernorm.weight"], hp["eps"])
    h = rows_in(h)
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
    if i not in hp.get("nope_layers", ()):  # SmolLM3: some layers have no RoPE
      q = _rotary(q, pos, hp, interleaved_rotary)
      k = _rotary(k, pos, hp, interleaved_rotary)
    v = v.reshape(t, nkv, hd)
    rep = nh // nkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    visible = causal
    if hp.get("window"):  # a query sees itself and the window - 1 keys before it
      visible = causal & (pos[None, :] > pos[:, None] - hp["window"])
    s = np.where(visible[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", s, v).reshape(t, nh * hd)
    x = x + rows_in(o) @ weights[p + "self_attn.o_proj.weight"].T
    h = rows_in(_rms(x, weights[p + "post_attention_layernorm.weight"], hp["eps"]))
    g = h @ weights[p + "mlp.gate_proj.weight"].T
    u = h @ weights[p + "mlp.up_proj.weight"].T
    x = x + rows_in((g / (1 + np.exp(-g))) * u) @ weights[p + "mlp.down_proj.weight"].T
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
_GGUF_ROTATE_HALF = ("qwen2", "qwen3", "phi3")


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
  if arch == "phi3" and f"{arch}.attention.sliding_window" in reader.fields:
    hp["window"] = int(f(f"{arch}.attention.sliding_window"))  # every layer (transformers)
  if f"{arch}.rope.dimension_count" in reader.fields:
    hp["rotary_dim"] = int(f(f"{arch}.rope.dimension_count"))
  factor_names = {"rope_factors_short.weight", "rope_factors_long.weight"}
  if arch == "phi3" and factor_names & {t.name for t in reader.tensors}:
    get = lambda key, default: float(f(key)) if key in reader.fields else default
    hp["rope_scaling"] = {
        "rope_type": "longrope",
        "attention_factor": get(f"{arch}.rope.scaling.attn_factor", 1.0),
        "original_max_position_embeddings": get(f"{arch}.rope.scaling.original_context_length",
                                                get(f"{arch}.context_length", 0.0))}
  if arch == "smollm3":  # not in the file: every 4th layer has no RoPE (llama.cpp's step;
    # written here, not imported: this module shares no code with o1jax.checkpoint)
    hp["nope_layers"] = [i for i in range(hp["n_layers"]) if (i + 1) % 4 == 0]
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
    elif name in ("rope_factors_short.weight", "rope_factors_long.weight"):
      hp["rope_scaling"][name.split("_")[2].split(".")[0] + "_factor"] = w
    elif arch == "phi3" and name.endswith((".attn_qkv.weight", ".ffn_up.weight")):
      _, i, rest = name.split(".", 2)  # Phi-3's fused rows: q, k, v / gate, up
      q, kv = hp["n_heads"] * hp["head_dim"], hp["n_kv_heads"] * hp["head_dim"]
      p = f"model.layers.{i}."
      if rest == "attn_qkv.weight":
        for part, rows in zip("qkv", np.split(w, [q, q + kv])):
          weights[p + f"self_attn.{part}_proj.weight"] = rows
      else:
        weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"] = np.split(w, 2)
    else:
      _, i, rest = name.split(".", 2)
      weights[f"model.layers.{i}.{_GGUF_TO_HF[rest]}"] = w
  return weights, hp


def gguf_forward(path, tokens, layer_inputs=None) -> np.ndarray:
  weights, hp = gguf_weights(path)
  return forward(weights, hp, tokens, interleaved_rotary=hp["interleaved_rotary"],
                 layer_inputs=layer_inputs)


def _gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def gemma3_forward(weights: dict[str, np.ndarray], hp: dict, tokens,
                   norm_offset: float = 1.0, layer_inputs=None) -> np.ndarray:
  """Gemma 3 logits [T, vocab] (see the module doc). `weights`: HF names, [out, in];
  norm_offset: added to every norm weight (1 for HF weights, 0 for a GGUF's);
  layer_inputs: as in `forward`."""
  rows_in = layer_inputs or (lambda a: a)
  tokens = np.asarray(tokens)
  t = len(tokens)
  nh, nkv, hd, eps = hp["n_heads"], hp["n_kv_heads"], hp["head_dim"], hp["eps"]
  norm = lambda x, name: _rms(x, weights[name] + norm_offset, eps)
  emb = weights["model.embed_tokens.weight"]
  x = emb[tokens].astype(np.float32) * np.float32(np.sqrt(emb.shape[1]))
  pos = np.arange(t)
  causal = pos[None, :] <= pos[:, None]  # [query, key]
  for i in range(hp["n_layers"]):
    p = f"model.layers.{i}."
    local = (i + 1) % hp["pattern"] != 0
    rope = {"theta": hp["local_theta"]} if local else {"theta": hp["theta"],
                                                        "rope_scaling": hp.get("rope_scaling")}
    visible = causal & (pos[None, :] > pos[:, None] - hp["window"]) if local else causal
    h = rows_in(norm(x, p + "input_layernorm.weight"))
    q = (h @ weights[p + "self_attn.q_proj.weight"].T).reshape(t, nh, hd)
    k = (h @ weights[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, hd)
    v = (h @ weights[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, hd)
    q = _rotary(norm(q, p + "self_attn.q_norm.weight"), pos, rope, False)
    k = _rotary(norm(k, p + "self_attn.k_norm.weight"), pos, rope, False)
    rep = nh // nkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hp["query_pre_attn_scalar"])
    s = np.where(visible[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = rows_in(np.einsum("hts,shd->thd", s, v).reshape(t, nh * hd)) \
        @ weights[p + "self_attn.o_proj.weight"].T
    x = x + norm(o, p + "post_attention_layernorm.weight")
    h = rows_in(norm(x, p + "pre_feedforward_layernorm.weight"))
    g = h @ weights[p + "mlp.gate_proj.weight"].T
    u = h @ weights[p + "mlp.up_proj.weight"].T
    m = rows_in(_gelu_tanh(g) * u) @ weights[p + "mlp.down_proj.weight"].T
    x = x + norm(m, p + "post_feedforward_layernorm.weight")
  x = norm(x, "model.norm.weight")
  head = weights.get("lm_head.weight", emb)
  return (x @ head.T).astype(np.float32)


# A Gemma 3 GGUF's per-layer names -> HF's (its ffn_norm is HF's pre_feedforward_layernorm).
_GEMMA3_GGUF_TO_HF = dict(_GGUF_TO_HF, **{
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight"})


def gemma3_gguf_forward(path, tokens) -> np.ndarray:
  """A Gemma 3 GGUF through `gemma3_forward`, with llama.cpp's constants for what the file
  does not record: local RoPE base 10000, every 6th layer global, scores scaled by
  1/sqrt(head_dim) (llama.cpp's choice for every size but 27B)."""
  import gguf

  reader = gguf.GGUFReader(str(path))
  f = lambda k: reader.fields[k].contents()
  hp = {"n_layers": int(f("gemma3.block_count")), "n_heads": int(f("gemma3.attention.head_count")),
        "n_kv_heads": int(f("gemma3.attention.head_count_kv")),
        "head_dim": int(f("gemma3.attention.key_length")),
        "theta": float(f("gemma3.rope.freq_base")),
        "eps": float(f("gemma3.attention.layer_norm_rms_epsilon")),
        "window": int(f("gemma3.attention.sliding_window")), "pattern": 6, "local_theta": 10000.0}
  hp["query_pre_attn_scalar"] = hp["head_dim"]
  if "gemma3.rope.scaling.type" in reader.fields:
    hp["rope_scaling"] = {"rope_type": f("gemma3.rope.scaling.type"),
                          "factor": float(f("gemma3.rope.scaling.factor"))}
  weights = {}
  for t in reader.tensors:
    w = _dequantize(gguf, np.asarray(t.data), t.tensor_type)
    w = w.reshape(tuple(int(s) for s in reversed(t.shape)))
    if t.name == "token_embd.weight":
      weights["model.embed_tokens.weight"] = w
    elif t.name == "output_norm.weight":
      weights["model.norm.weight"] = w
    elif t.name == "output.weight":
      weights["lm_head.weight"] = w
    else:
      _, i, rest = t.name.split(".", 2)
      weights[f"model.layers.{i}.{_GEMMA3_GGUF_TO_HF[rest]}"] = w
  return gemma3_forward(weights, hp, tokens, norm_offset=0.0)
