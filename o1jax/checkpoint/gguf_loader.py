"""GGUF (llama.cpp) checkpoints -> (ModelConfig, params, tokenizer).

Quantized tensors stay quantized: Q4_0/Q4_1/Q8_0 blocks are re-laid out into
`QuantizedTensor` ([K, N], groups of 32 along K) without going through f32.

llama.cpp's converter permutes the rows of Q and K so that rotary embedding can
be applied to adjacent pairs; we undo that permutation (an exact column
shuffle of the quantized weight) so every checkpoint format shares HF's
rotate-half layout and gives bit-identical logits.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from o1jax.checkpoint.errors import CheckpointError
from o1jax.checkpoint.params import Params
from o1jax.model.config import ModelConfig
from pallas_kernels.quantized_tensor import QuantizedTensor, pack_int4

# GGUF architectures that are plain Llama-style decoders in our model.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
_BLOCK = 32  # elements per Q4_0/Q4_1/Q8_0 block


def _open_reader(path: pathlib.Path):
  import gguf  # local import: only GGUF loading needs it

  if not path.exists():
    raise CheckpointError(f"{path}: no such file")
  if not path.is_file():
    raise CheckpointError(f"{path}: not a file")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise CheckpointError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
  try:
    reader = gguf.GGUFReader(str(path), "r")
  except Exception as e:  # the reader raises assorted errors on bad bytes
    raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
  size = os.path.getsize(path)
  for t in reader.tensors:
    end = int(t.data_offset) + int(t.n_bytes)
    if end > size:
      raise CheckpointError(
          f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte {end} but the file has {size}")
  return reader


def _field(reader, key: str, default=None, *, path=None, required=False):
  f = reader.fields.get(key)
  if f is None:
    if required:
      raise CheckpointError(f"{path}: GGUF metadata key {key!r} is missing")
    return default
  return f.contents()


def read_metadata(path: str | os.PathLike) -> dict:
  """All metadata key/values of a GGUF file (large arrays included)."""
  reader = _open_reader(pathlib.Path(path))
  return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _config_from_metadata(reader, path, tensor_names) -> ModelConfig:
  arch = _field(reader, "general.architecture", path=path, required=True)
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(
        f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
  g = lambda k, d=None, req=False: _field(reader, f"{arch}.{k}", d, path=path, required=req)
  n_heads = int(g("attention.head_count", req=True))
  d_model = int(g("embedding_length", req=True))
  tokens = _field(reader, "tokenizer.ggml.tokens")
  vocab = int(g("vocab_size", len(tokens) if tokens is not None else 0))
  head_dim = int(g("attention.key_length", d_model // n_heads))
  rope_scaling = None
  scaling_type = g("rope.scaling.type")
  if scaling_type == "linear":
    rope_scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor", 1.0))}
  elif scaling_type not in (None, "none"):
    raise CheckpointError(f"{path}: rope scaling type {scaling_type!r} is not supported")
  eos = _field(reader, "tokenizer.ggml.eos_token_id")
  eot = _field(reader, "tokenizer.ggml.eot_token_id")
  eos_ids = tuple(sorted({int(i) for i in (eos, eot) if i is not None}))
  bos = _field(reader, "tokenizer.ggml.bos_token_id")
  return ModelConfig(
      vocab_size=vocab,
      d_model=d_model,
      n_layers=int(g("block_count", req=True)),
      n_heads=n_heads,
      n_kv_heads=int(g("attention.head_count_kv", n_heads)),
      head_dim=head_dim,
      ffn_dim=int(g("feed_forward_length", req=True)),
      rope_theta=float(g("rope.freq_base", 10000.0)),
      rope_scaling=rope_scaling,
      rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
      max_context=int(g("context_length", 2048)),
      tie_embeddings="output.weight" not in tensor_names,
      attention_bias="blk.0.attn_q.bias" in tensor_names,
      bos_id=None if bos is None else int(bos),
      eos_ids=eos_ids,
      architecture=arch,
      name=str(_field(reader, "general.name", "") or ""),
  )


def _blocks(t, nbytes_per_block):
  """Raw bytes of a quantized tensor as [rows, blocks_per_row, bytes_per_block]."""
  data = np.asarray(t.data)
  rows = data.shape[0]
  return data.reshape(rows, -1, nbytes_per_block)


def _f16(b):
  return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _quantized_from_gguf(t) -> QuantizedTensor:
  """A 2-D GGUF tensor (rows = N outputs, each of K inputs) -> QuantizedTensor [K, N]."""
  kind = t.tensor_type.name
  if kind == "Q8_0":
    b = _blocks(t, 34)  # f16 d, 32 x int8
    scale = _f16(b[..., 0:2])  # [N, K/32]
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(b.shape[0], -1)  # [N, K]
    return QuantizedTensor(packed=np.ascontiguousarray(q.T), scale=np.ascontiguousarray(scale.T),
                           minimum=None, bits=8, group_size=_BLOCK)
  if kind == "Q4_0":
    b = _blocks(t, 18)  # f16 d, 16 bytes of nibbles
    scale, minimum, qs = _f16(b[..., 0:2]), None, b[..., 2:]
  elif kind == "Q4_1":
    b = _blocks(t, 20)  # f16 d, f16 m, 16 bytes of nibbles
    scale, minimum, qs = _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:]
  else:
    raise AssertionError(kind)
  # Within a block, byte j holds element j (low nibble) and element j + 16 (high).
  q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(b.shape[0], -1)  # [N, K]
  return QuantizedTensor(
      packed=pack_int4(np.ascontiguousarray(q.T)),
      scale=np.ascontiguousarray(scale.T),
      minimum=None if minimum is None else np.ascontiguousarray(minimum.T),
      bits=4, group_size=_BLOCK)


def _dense_from_gguf(t) -> np.ndarray:
  """F32/F16/BF16 tensor in numpy's row-major order (GGUF's ne reversed)."""
  data = np.asarray(t.data)
  if t.tensor_type.name == "BF16":
    raw = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
    data = raw.view(np.float32)
  shape = tuple(int(s) for s in reversed(t.shape))
  return data.reshape(shape)


def _matrix(t):
  """A GGUF weight (rows = outputs) as our [K, N] layout: quantized or dense."""
  if t.tensor_type.name in ("Q8_0", "Q4_0", "Q4_1"):
    return _quantized_from_gguf(t)
  return np.ascontiguousarray(_dense_from_gguf(t).T)


def unpermute_columns(w, n_heads: int, head_dim: int):
  """Undo llama.cpp's Q/K row permutation on a [K, N = n_heads*head_dim] weight.

  GGUF output row h*hd + 2*i + j holds HF row h*hd + j*hd/2 + i."""
  perm = np.arange(n_heads * head_dim).reshape(n_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)
  if isinstance(w, QuantizedTensor):
    take = lambda a: None if a is None else np.ascontiguousarray(np.asarray(a)[..., perm])
    return QuantizedTensor(packed=take(w.packed), scale=take(w.scale), minimum=take(w.minimum),
                           bits=w.bits, group_size=w.group_size)
  return np.ascontiguousarray(np.asarray(w)[..., perm])


def read_tensors(path: str | os.PathLike, names=None) -> dict:
  """Tensors of a GGUF file as stored (no Q/K un-permutation): 2-D weights as
  [K, N] QuantizedTensor or dense array, 1-D tensors as f32 vectors."""
  reader = _open_reader(pathlib.Path(path))
  out = {}
  for t in reader.tensors:
    if names is not None and t.name not in names:
      continue
    _check_type(t, path)
    out[t.name] = _matrix(t) if len(t.shape) == 2 else np.asarray(_dense_from_gguf(t), np.float32)
  return out


def _check_type(t, path):
  if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
    raise CheckpointError(
        f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which is not supported "
        f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, Params, dict]:
  """Reads a GGUF file. Returns (config, params, tokenizer metadata).

  params: {"embed": [d_model, vocab], "layers": [{...}] * n_layers,
           "final_norm": [d_model], "lm_head": [d_model, vocab] (untied only)}."""
  path = pathlib.Path(path)
  reader = _open_reader(path)
  tensors = {t.name: t for t in reader.tensors}
  for t in reader.tensors:
    _check_type(t, path)
  config = _config_from_metadata(reader, path, tensors)

  def get(name):
    if name not in tensors:
      raise CheckpointError(f"{path}: tensor {name!r} is missing")
    return tensors[name]

  def vector(name):
    return np.asarray(_dense_from_gguf(get(name)), np.float32)

  layers = []
  for i in range(config.n_layers):
    p = f"blk.{i}."
    layer = {
        "attn_norm": vector(p + "attn_norm.weight"),
        "wq": unpermute_columns(_matrix(get(p + "attn_q.weight")), config.n_heads, config.head_dim),
        "wk": unpermute_columns(_matrix(get(p + "attn_k.weight")), config.n_kv_heads, config.head_dim),
        "wv": _matrix(get(p + "attn_v.weight")),
        "wo": _matrix(get(p + "attn_output.weight")),
        "ffn_norm": vector(p + "ffn_norm.weight"),
        "w_gate": _matrix(get(p + "ffn_gate.weight")),
        "w_up": _matrix(get(p + "ffn_up.weight")),
        "w_down": _matrix(get(p + "ffn_down.weight")),
    }
    if config.attention_bias:
      layer["bq"] = unpermute_columns(vector(p + "attn_q.bias"), config.n_heads, config.head_dim)
      layer["bk"] = unpermute_columns(vector(p + "attn_k.bias"), config.n_kv_heads, config.head_dim)
      layer["bv"] = vector(p + "attn_v.bias")
    layers.append(layer)
  params: Params = {
      "embed": _matrix(get("token_embd.weight")),
      "layers": layers,
      "final_norm": vector("output_norm.weight"),
  }
  if not config.tie_embeddings:
    params["lm_head"] = _matrix(get("output.weight"))
  embed_shape = params["embed"].shape
  if embed_shape != (config.d_model, config.vocab_size):
    raise CheckpointError(f"{path}: token_embd.weight has shape {embed_shape[::-1]}, expected "
                          f"({config.vocab_size}, {config.d_model})")

  tokenizer_meta = {
      k: _field(reader, k) for k in (
          "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
          "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
          "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
          "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")
  }
  return config, params, tokenizer_meta
