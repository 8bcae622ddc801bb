"""Flax NNX Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM, Gemma 3).

The same forward serves prefill (T new tokens per sequence) and decode (T=1)
against a contiguous KV cache. Layers are unrolled in Python: on CPU that was
up to 3x faster than scanning over stacked layers (see DESIGN.md).
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from o1jax.checkpoint.model_config import ModelConfig
from o1jax.checkpoint.params import FUSED_PARTS, Params, device_array, to_device
from o1jax.model import layers
from pallas_kernels import ops as kernel_ops
from pallas_kernels.f32_matmul import TiledF32Weight, pack as pack_f32
from pallas_kernels.fp8_activations import Fp8ActivationWeight
from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize
from pallas_kernels.quantized_tensor import concat_columns as concat_quantized_columns
from pallas_kernels.vnni_matmul import BLOCK as VNNI_BLOCK, VnniWeight, concat_columns, pack as pack_vnni

WEIGHT_MODES = ("auto", "quantized", "dense")


def _pack_int8_matrices(params: Params) -> Params:
  """Every matrix of `params` (and the output head) in the int8 kernel's layout.

  Quantized weights keep their exact values; dense ones become Q8_0. A tied
  head gets its own packed copy: the embedding lookup keeps the table. The
  q/k/v and gate/up projections are fused into one matrix each where their
  formats agree (same numbers, fewer kernel calls)."""
  is_matrix = lambda w: isinstance(w, QuantizedTensor) or getattr(w, "ndim", 0) == 2
  # A dense matrix whose K is not whole blocks of the kernel's (e.g. 4 heads of 18) keeps
  # its dense product (`ops.matmul` dispatches on the weight), the others take the kernel.
  packs = lambda w: isinstance(w, QuantizedTensor) or w.shape[0] % VNNI_BLOCK == 0
  pack = lambda name, w: (jax.tree.map(device_array, pack_vnni(w, name))
                          if is_matrix(w) and packs(w) else w)
  out = dict(params)
  out["layers"] = []
  for i, layer in enumerate(params["layers"]):
    packed = {name: pack(f"layers.{i}.{name}", w) for name, w in layer.items()}
    for fused, parts in FUSED_PARTS.items():
      try:
        packed[fused] = concat_columns([packed[n] for n in parts], f"layers.{i}.{fused}")
      except ValueError:  # mixed formats (e.g. a Q8_0 wv among Q4 weights): keep them apart
        continue
      for n in parts:
        del packed[n]
    out["layers"].append(packed)
  out["lm_head"] = pack("lm_head", params["lm_head"] if "lm_head" in params else params["embed"])
  return out


def _fuse_quantized_matrices(params: Params) -> Params:
  """q/k/v and gate/up as one quantized matrix each (FUSED_PARTS) where their formats
  agree: one kernel launch for three (two), and wider products that fill more of a GPU
  at decode's one row (SmolLM2's k and v have 192 columns each). The same columns:
  each output column is its part's (its own K loop). Tensor parallelism splits them
  apart again (`o1jax.sharding.shard_model`)."""
  out = dict(params, layers=[])
  for layer in params["layers"]:
    layer = dict(layer)
    for fused, parts in FUSED_PARTS.items():
      weights = [layer.get(name) for name in parts]
      if all(isinstance(w, QuantizedTensor) for w in weights):
        cat = concat_quantized_columns(weights)
        if cat is not None:  # (mixed formats stay apart)
          layer[fused] = cat
          for name in parts:
            del layer[name]
    out["layers"].append(layer)
  return out


# One program per weight shape (op by op, each op compiled apart: 72 compiles, 2.4 s of the
# embedded model's load; 0.5 s so, the same values), shared by every model of a process.
@functools.partial(jax.jit, static_argnames=("dtype", "tiled"))
def _dense_matrix(w, *, dtype, tiled: bool):
  """A weight matrix (dequantized when quantized) in `dtype`, in the native f32 kernel's
  column tiles when `tiled`."""
  if isinstance(w, QuantizedTensor):
    w = dequantize(w)
  w = w.astype(dtype)
  return pack_f32(w) if tiled else w


class Weight(nnx.Param):
  """A dense array or a QuantizedTensor pytree, stored as one parameter."""


def _write(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
  """cache: [B, KVH, S, D]; new: [B, T, KVH, D] written at positions starts[b]..+T."""
  new = new.transpose(0, 2, 1, 3).astype(cache.dtype)
  return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (0, s, 0)))(cache, new, starts)


@flax.struct.dataclass
class KVCache:
  """Contiguous per-layer cache. k[i], v[i]: [batch, kv_heads, max_len, head_dim].

  Any cache type works with the model if it has `attend` with this signature
  (the engine's paged cache does); the model never looks inside it."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  kv_valid: jax.Array | None = None  # optional [B, max_len] mask of attendable slots

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
    shape = (batch, config.n_kv_heads, max_len, config.head_dim)
    return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)),
               v=tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)))

  def check_fits(self, tokens_shape) -> None:
    b, t = tokens_shape
    if t > self.max_len or b != self.batch_size:
      raise ValueError(f"tokens shape {tuple(tokens_shape)} does not fit a KV cache of batch "
                       f"{self.batch_size} and length {self.max_len}")

  def attend(self, layer: int, q, k, v, positions, starts, *, backend: str = "auto",
             interpret: bool = False, window: int | None = None):
    """Writes this step's k/v ([B, T, KVH, D]) at starts[b].., then attends q ([B, T, H, D])
    causally over the cache (a local layer: only the last `window` positions).
    Returns (output [B, T, H, D], updated cache)."""
    k_cache = _write(self.k[layer], k, starts)
    v_cache = _write(self.v[layer], v, starts)
    out = layers.attention(q, k_cache, v_cache, positions, self.kv_valid, window)
    replace = lambda xs, x: xs[:layer] + (x,) + xs[layer + 1:]
    return out, self.replace(k=replace(self.k, k_cache), v=replace(self.v, v_cache))


# A layer's work before and after its attention, each one jitted function: every layer of
# a model calls them with the same shapes, so a program traces and lowers them once rather
# than once per layer (tracing was most of a new process's first calls: ~0.6 s per prefill
# program of the embedded model). XLA inlines the calls: the same program.
_STATIC = ("config", "backend", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _attention_inputs(w: dict, x, rope, *, config: ModelConfig, backend: str,
                      interpret: bool):
  """x [B, T, d] -> rotated q [B, T, H, D], k and v [B, T, KVH, D]. rope: the (cos, sin)
  tables of `layers.rope_tables`, or None."""
  c = config
  kw = dict(backend=backend, interpret=interpret)  # the weights say int8/bf16/f32
  b, t, _ = x.shape
  h = layers.rms_norm(x, w["attn_norm"], c.rms_eps)
  if w["wqkv"] is not None:
    nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    qkv = layers.linear(h, w["wqkv"], **kw)
    q, k, v = qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]
    add = lambda y, bias: y if bias is None else y + bias.astype(y.dtype)
    q, k, v = add(q, w["bq"]), add(k, w["bk"]), add(v, w["bv"])
  else:
    q = layers.linear(h, w["wq"], w["bq"], **kw)
    k = layers.linear(h, w["wk"], w["bk"], **kw)
    v = layers.linear(h, w["wv"], w["bv"], **kw)
  q = q.reshape(b, t, c.n_heads, c.head_dim)
  k = k.reshape(b, t, c.n_kv_heads, c.head_dim)
  v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
  if c.qk_norm:
    q = layers.rms_norm(q, w["q_norm"], c.rms_eps)
    k = layers.rms_norm(k, w["k_norm"], c.rms_eps)
  if rope is not None:  # None: a layer without positional encoding (SmolLM3's NoPE)
    q = layers.apply_rope(q, *rope)
    k = layers.apply_rope(k, *rope)
  if c.query_pre_attn_scalar is not None and c.query_pre_attn_scalar != c.head_dim:
    # Every attention path scales scores by 1/sqrt(head_dim); fold the rest into q.
    q = q * jnp.asarray(math.sqrt(c.head_dim / c.query_pre_attn_scalar), q.dtype)
  return q, k, v


@functools.partial(jax.jit, static_argnames=_STATIC)
def _attention_output_and_mlp(w: dict, x, attn, *, config: ModelConfig, backend: str,
                              interpret: bool):
  """The layer's output [B, T, d] from its input x and the attention [B, T, H, D]."""
  c = config
  kw = dict(backend=backend, interpret=interpret)
  b, t, _ = x.shape
  out = layers.linear(attn.reshape(b, t, -1), w["wo"], **kw)
  if c.post_norms:
    out = layers.rms_norm(out, w["post_attn_norm"], c.rms_eps)
  x = x + out
  h = layers.rms_norm(x, w["ffn_norm"], c.rms_eps)
  if w["w_gate_up"] is not None:
    gate_up = layers.linear(h, w["w_gate_up"], **kw)
    gate, up = gate_up[..., :c.ffn_dim], gate_up[..., c.ffn_dim:]
    out = layers.linear(layers.ACTIVATIONS[c.activation](gate) * up, w["w_down"], **kw)
  else:
    out = layers.gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], c.activation, **kw)
  if c.post_norms:
    out = layers.rms_norm(out, w["post_ffn_norm"], c.rms_eps)
  return x + out


class DecoderLayer(nnx.Module):
  # Its weights: q/k/v and gate/up apart, or fused (int8 and quantized matmuls:
  # FUSED_PARTS); biases
  # (Qwen2), q/k norms (Qwen3) and post norms (Gemma 3) where the config has them.
  WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wqkv", "wo", "bq", "bk", "bv", "q_norm", "k_norm",
             "post_attn_norm", "post_ffn_norm", "ffn_norm", "w_gate", "w_up", "w_gate_up",
             "w_down")
  REQUIRED = ("attn_norm", "wo", "ffn_norm", "w_down")

  def __init__(self, config: ModelConfig, p: dict, *, backend: str, interpret: bool):
    self.config = config
    self.backend = backend
    self.interpret = interpret
    for name in self.WEIGHTS:
      setattr(self, name, Weight(p[name]) if name in p or name in self.REQUIRED else None)

  def __call__(self, x, positions, starts, cache, index: int, rope):
    """x: [B, T, d]; positions: [B, T]; starts: [B]; rope: (cos, sin) tables or None.
    Returns (x, cache)."""
    w = {n: None if getattr(self, n) is None else getattr(self, n).get_value()
         for n in self.WEIGHTS}
    static = dict(config=self.config, backend=self.backend, interpret=self.interpret)
    q, k, v = _attention_inputs(w, x, rope, **static)
    attn, cache = cache.attend(index, q, k, v, positions, starts, backend=self.backend,
                               interpret=self.interpret, window=self.config.layer_window(index))
    return _attention_output_and_mlp(w, x, attn, **static), cache


class Llama(nnx.Module):
  """Decoder-only transformer built from a loaded parameter tree."""

  def __init__(self, config: ModelConfig, params: Params, *, backend: str = "auto",
               interpret: bool = False, dtype=jnp.float32, weight_mode: str = "auto",
               matmul_dtype: str = "float32"):
    """weight_mode: "quantized" keeps QuantizedTensors (the Pallas kernels fuse the
    dequantization; q/k/v and gate/up become one matrix each where their formats agree,
    FUSED_PARTS); "dense" dequantizes once to f32 here (same values, bit for
    bit); "auto" asks `pallas_kernels.ops.dense_weights_preferred` (dense where the
    XLA reference computes and the f32 weights fit its limit), else "quantized".

    matmul_dtype: "float32" (default: exact f32 math, the reference; on a CPU with
    the native f32 kernel the matrices are stored in its column tiles,
    `pallas_kernels.f32_matmul`, same values) or
    "bfloat16": dense matrices are stored in bf16 and every matmul rounds its
    input to bf16 and accumulates in f32 (`pallas_kernels.ops.bf16_matmul`). On CPUs with
    AMX / AVX512-BF16 that runs batched decode ~2x faster; logits move by
    ~1e-2 (like llama.cpp's 8-bit activations). Norms, attention, softmax and
    the KV cache stay f32. A quantized matrix kept quantized (weight_mode
    "quantized", the Pallas path) is unaffected; one dequantized for the dense path
    (weight_mode "auto" on a CPU) is stored in bf16 too (81% of a Q4_0 matrix's values
    move by up to 0.4%: part of the README's bf16 accuracy row).
    "int8" (`pallas_kernels.vnni_matmul`): every matrix stays 4-/8-bit (dense
    ones are quantized to Q8_0) and each matmul quantizes its input rows per
    block of 32 to two int8 levels (~15 bits); the native VNNI/AMX kernel reads
    ~1/4 of the f32 weight bytes (~4x faster batch-1 decoding here), with an
    XLA fallback elsewhere. Logits move ~100x less than bf16's (in KL) on Q4_0/Q8_0
    weights (K-quants are re-encoded for it and move more: README); q/k/v
    and gate/up are fused into one matrix each (FUSED_PARTS).
    "float8" (`pallas_kernels.fp8_activations`): the decoder layers' matmuls round
    their input rows to float8_e4m3fn, each row under its own scale (its largest
    magnitude / 448), and multiply the matrices as float32 mode stores them (quantized
    ones through the quantized kernels' FP8 input path); the output head keeps full
    precision activations, as FP8 serving stacks do."""
    # (a wrong object was a KeyError or AttributeError at its first use)
    if not isinstance(config, ModelConfig):
      raise ValueError(f"config must be the checkpoint's ModelConfig (ck.config), got "
                       f"{type(config).__name__}")
    missing = [k for k in ("embed", "layers", "final_norm")
               if not hasattr(params, "keys") or k not in params]
    if missing:
      raise ValueError(f"params must be the checkpoint's parameters (ck.params): no "
                       f"{missing[0]!r} in a {type(params).__name__}")
    if weight_mode not in WEIGHT_MODES:
      raise ValueError(f"weight_mode={weight_mode!r} not in {WEIGHT_MODES}")
    if matmul_dtype not in layers.MATMUL_DTYPES:
      raise ValueError(f"matmul_dtype={matmul_dtype!r} not in {layers.MATMUL_DTYPES}")
    if weight_mode == "auto":
      n_weights = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
          params, is_leaf=lambda x: isinstance(x, QuantizedTensor)))
      dense = kernel_ops.dense_weights_preferred(backend, n_weights * 4)
      weight_mode = "dense" if dense else "quantized"
    self.weight_mode = weight_mode
    params = to_device(params)
    if matmul_dtype == "int8":
      params = _pack_int8_matrices(params)
    self.matmul_dtype = matmul_dtype
    # The matrices' dtype picks each product (`pallas_kernels.ops.matmul`): bf16 ones a
    # bf16 matmul, others full precision (f16/bf16 checkpoint matrices widened here, the
    # same values a per-call cast gave). Norms and biases stay as loaded.
    matrix_dtype = jnp.bfloat16 if matmul_dtype == "bfloat16" else jnp.float32
    is_matrix = lambda w: (isinstance(w, jax.Array) and w.ndim == 2
                           and jnp.issubdtype(w.dtype, jnp.floating))
    # The native f32 kernel's layout: a few rows cost about one row's weight reads.
    # (float8 too: its products are f32 ones on rounded inputs, and the kernel keeps a
    # row's result independent of the batch, which XLA's dot does not.)
    tiled = matmul_dtype in ("float32", "float8") and kernel_ops.tiled_f32_preferred(backend)

    # One weight at a time, dequantized, cast and packed: the dense copies of every
    # matrix never coexist (done tree by tree, the load peaked at ~2x the f32 weights).
    converts = lambda w: ((weight_mode == "dense" and isinstance(w, QuantizedTensor))
                          or (is_matrix(w) and (tiled or w.dtype != matrix_dtype)))
    params = jax.tree.map(
        lambda w: _dense_matrix(w, dtype=matrix_dtype, tiled=tiled) if converts(w) else w,
        params, is_leaf=lambda x: isinstance(x, (QuantizedTensor, VnniWeight)))
    if weight_mode == "quantized" and matmul_dtype != "int8":
      params = _fuse_quantized_matrices(params)
    if matmul_dtype == "float8":
      fp8_input = lambda w: (Fp8ActivationWeight(w) if isinstance(
          w, (QuantizedTensor, TiledF32Weight)) or is_matrix(w) else w)
      params = dict(params, layers=[
          {name: fp8_input(w) for name, w in layer.items()} for layer in params["layers"]])
    self.config = config
    self.dtype = dtype
    self.embed = Weight(params["embed"])
    self.final_norm = Weight(params["final_norm"])
    self.lm_head = Weight(params["lm_head"]) if "lm_head" in params else None
    self.layers = nnx.List([DecoderLayer(config, p, backend=backend, interpret=interpret)
                            for p in params["layers"]])
    self.backend = backend
    self.interpret = interpret

  def __call__(self, tokens: jax.Array, starts: jax.Array, cache,
               logits_at: jax.Array | None = None):
    """Runs T new tokens per sequence and returns (logits, new cache).

    tokens: [B, T] int32, at absolute positions starts[b] + t.
    logits_at: None -> logits for all T positions [B, T, V]; else [B] int32 index
      into T -> logits for that position only [B, V] (prefill needs just the last).
    cache: a KVCache, or any pytree with the same `attend` / `check_fits` methods."""
    x, cache = self.hidden_states(tokens, starts, cache, logits_at)
    return self.output_logits(x), cache

  def hidden_states(self, tokens: jax.Array, starts: jax.Array, cache,
                    logits_at: jax.Array | None = None, num_layers: int | None = None):
    """The final-normed hidden states ([B, T, d] or [B, d] at logits_at) and the cache.

    num_layers: run only the first layers (an early exit: the final norm and the
    head read layer num_layers' output; the cache is written for those layers only)."""
    c = self.config
    cache.check_fits(tokens.shape)
    positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=starts.dtype)[None, :]
    x = layers.embed(self.embed.get_value(), tokens, self.dtype)
    if c.scale_embeddings:  # Gemma: rows times sqrt(d_model), rounded to f32 as HF does
      x = x * jnp.asarray(np.float32(math.sqrt(c.d_model)), x.dtype)
    # The rotation tables once per call, shared by the layers.
    rope = layers.rope_tables(positions, c.rope_dim, c.rope_theta, c.rope_scaling)
    # Gemma 3's local layers rotate with their own base and no scaling.
    local_rope = (rope if c.rope_local_theta is None
                  else layers.rope_tables(positions, c.rope_dim, c.rope_local_theta))
    for i, layer in enumerate(self.layers[:num_layers]):
      layer_rope = rope if c.layer_window(i) is None else local_rope
      layer_rope = None if i in c.nope_layers else layer_rope
      x, cache = layer(x, positions, starts, cache, i, layer_rope)
    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    return layers.rms_norm(x, self.final_norm.get_value(), c.rms_eps), cache

  @property
  def head_weight(self):
    """The output head [d_model, vocab] (the embedding table when tied)."""
    return (self.lm_head if self.lm_head is not None else self.embed).get_value()

  def output_logits(self, x: jax.Array) -> jax.Array:
    """f32 logits of final-normed hidden states x: [..., d] -> [..., V]."""
    logits = layers.linear(x, self.head_weight, backend=self.backend, interpret=self.interpret)
    return logits.astype(jnp.float32)


def check_llama(model, who: str) -> None:
  """`who` takes a Llama: a checkpoint or another object passed instead was an
  AttributeError, a KeyError or a JAX TypeError at its first use."""
  if not isinstance(model, Llama):
    hint = (" (build it: Llama(ck.config, ck.params))" if hasattr(model, "params")
            and hasattr(model, "config") else "")
    raise ValueError(f"{who} takes an o1jax.model.Llama, got {type(model).__name__}{hint}")
