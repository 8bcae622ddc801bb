"""GGUF (llama.cpp) checkpoints -> (ModelConfig, params, tokenizer).

Quantized tensors stay quantized: Q4_0/Q4_1/Q8_0 blocks are re-laid out into
`QuantizedTensor` ([K, N], groups of 32 along K) without going through f32.

For Llama-style architectures llama.cpp's converter permutes the rows of Q and K
so that rotary embedding can be applied to adjacent pairs; we undo that
permutation (an exact column shuffle of the quantized weight) so every
checkpoint format shares HF's rotate-half layout and gives bit-identical
logits. Qwen2/Qwen3 files keep HF's order (llama.cpp rotates them NEOX-style).
"""

from __future__ import annotations

import math
import os
import pathlib
import types

import numpy as np

from o1jax.checkpoint import gguf_blocks
from o1jax.checkpoint.errors import CheckpointError
from o1jax.checkpoint.model_config import ModelConfig
from o1jax.checkpoint.params import Params
from pallas_kernels.quantized_tensor import QuantizedTensor

# GGUF architectures that are Llama-style decoders in our model (ModelConfig's switches).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
# llama.cpp rotates these with NEOX RoPE (pairs i, i + d/2, as HF): their converter leaves
# Q/K rows as they are. The others ("normal" RoPE on adjacent pairs) have them permuted.
_ROTATE_HALF_ARCHITECTURES = ("qwen2", "qwen3", "gemma3")
# What a Gemma 3 GGUF does not record, as llama.cpp hard-codes it (llama-model.cpp): local
# layers' RoPE base, and every 6th layer global.
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6
# Tokenizer models we build from `tokenizer.ggml.*` (tokenizer.Tokenizer.from_gguf_metadata).
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16") + tuple(gguf_blocks.FORMATS)


def _check_file(path: pathlib.Path) -> None:
  if not path.exists():
    raise CheckpointError(f"{path}: no such file")
  if not path.is_file():
    raise CheckpointError(f"{path}: not a file")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise CheckpointError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")


def _corrupt(path, e: Exception) -> CheckpointError:
  return CheckpointError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})")


def _check_extent(path, name: str, end: int, size: int) -> None:
  if end > size:
    raise CheckpointError(
        f"{path}: truncated GGUF file: tensor {name!r} ends at byte {end} but the file has {size}")


def _open_reader(path: pathlib.Path):
  import gguf  # local import: only GGUF loading needs it

  _check_file(path)
  try:
    reader = gguf.GGUFReader(str(path), "r")
  except Exception as e:  # the reader raises assorted errors on bad bytes
    raise _corrupt(path, e) from e
  size = os.path.getsize(path)
  for t in reader.tensors:
    _check_extent(path, t.name, int(t.data_offset) + int(t.n_bytes), size)
  return reader


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one value.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_HEADER_KEYS = ("general.architecture", "general.alignment", "tokenizer.ggml.model",
                "tokenizer.chat_template")


class _Header:
  """Walks a GGUF header in place (memory-mapped): metadata and the tensor table, no tensor
  data. gguf-py's reader builds an object per vocabulary entry (seconds on a 49152-token
  model); this skips them, for a check a launcher can afford on every run."""

  def __init__(self, buf):
    self.buf, self.size, self.order = buf, len(buf), "<"

  def unpack(self, fmt: str, off: int):
    import struct
    return struct.unpack_from(self.order + fmt, self.buf, off)

  def string(self, off: int) -> tuple[bytes, int]:
    (n,) = self.unpack("Q", off)
    if off + 8 + n > self.size:
      raise ValueError(f"a string at byte {off} runs past the end of the file")
    return bytes(self.buf[off + 8:off + 8 + n]), off + 8 + n

  def value(self, vtype: int, off: int, keep: bool = False):
    """(value or None when skipped, offset after it); keep: read arrays too (as lists)."""
    import struct
    if vtype in _SCALARS:
      return self.unpack(_SCALARS[vtype], off)[0], off + struct.calcsize(_SCALARS[vtype])
    if vtype == _STRING:
      raw, off = self.string(off)
      return raw.decode("utf-8", "replace"), off
    if vtype == _ARRAY:
      item, count = self.unpack("IQ", off)
      off += 12
      if item in _SCALARS:  # fixed size: skip (or read) the whole array at once
        end = off + count * struct.calcsize(_SCALARS[item])
        if end > self.size:
          raise ValueError("an array runs past the end of the file")
        if not keep:
          return None, end
        dtype = np.dtype(self.order + _SCALARS[item])
        return np.frombuffer(self.buf, dtype, count, off).tolist(), end
      if count > self.size:
        raise ValueError(f"an array claims {count} items")
      out = []
      for _ in range(count):
        v, off = self.value(item, off, keep)
        out.append(v)
      return (out if keep else None), off
    raise ValueError(f"unknown metadata value type {vtype}")

  def walk(self, keep_all: bool = False):
    """(metadata of _HEADER_KEYS and the scalars (every key's with keep_all), every key,
    [(tensor name, type id, element count, offset, dims)], offset of the tensor data)."""
    (version,) = self.unpack("I", 4)
    if version & 0xFFFF == 0:  # written on a big-endian machine
      self.order = ">"
      (version,) = self.unpack("I", 4)
    if version not in (2, 3):
      raise ValueError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = self.unpack("QQ", 8)
    if n_kv > self.size or n_tensors > self.size:
      raise ValueError(f"{n_tensors} tensors and {n_kv} metadata keys cannot fit in the file")
    off, meta, keys = 24, {}, set()
    for _ in range(n_kv):
      key, off = self.string(off)
      key = key.decode("utf-8", "replace")
      (vtype,) = self.unpack("I", off)
      value, off = self.value(vtype, off + 4, keep_all)
      keys.add(key)
      if key in _HEADER_KEYS or keep_all or vtype in _SCALARS:  # scalars: sizes, for _check_sizes
        meta[key] = value
    tensors = []
    for _ in range(n_tensors):
      name, off = self.string(off)
      (n_dims,) = self.unpack("I", off)
      if n_dims > 8:
        raise ValueError(f"tensor {name.decode('utf-8', 'replace')!r} claims {n_dims} dimensions")
      dims = self.unpack(f"{n_dims}Q", off + 4)
      ttype, offset = self.unpack("IQ", off + 4 + 8 * n_dims)
      off += 4 + 8 * n_dims + 12
      tensors.append((name.decode("utf-8", "replace"), ttype, math.prod(dims), offset, dims))
    align = int(meta.get("general.alignment") or 32)
    if align <= 0 or align & (align - 1):
      raise ValueError(f"alignment {align} is not a power of two")
    return meta, keys, tensors, off + (-off % align)


def check_gguf(path: str | os.PathLike) -> None:
  """Validates a GGUF file without loading it: magic, the header's structure, every tensor's
  type and extent (a truncated file), the architecture and the metadata keys the config needs,
  the tokenizer model. Raises the `CheckpointError` that loading would raise."""
  import mmap

  import gguf

  path = pathlib.Path(path)
  _check_file(path)
  size = os.path.getsize(path)
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
    try:
      meta, keys, tensors, data_start = _Header(buf).walk()
    except Exception as e:  # struct.error past the end, or our own ValueErrors
      raise _corrupt(path, e) from e
  for name, ttype, n_elements, offset, _ in tensors:
    try:
      qtype = gguf.GGMLQuantizationType(ttype)
    except ValueError:
      raise CheckpointError(f"{path}: tensor {name!r} has unknown type id {ttype}") from None
    _check_type_name(path, name, qtype.name)
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    _check_extent(path, name, data_start + offset + n_elements * type_bytes // block, size)
  arch = meta.get("general.architecture")
  if arch is None:
    raise CheckpointError(f"{path}: GGUF metadata key 'general.architecture' is missing")
  _check_architecture(path, arch)
  for key in _REQUIRED_ARCH_KEYS:
    if f"{arch}.{key}" not in keys:
      raise CheckpointError(f"{path}: GGUF metadata key {arch + '.' + key!r} is missing")
  _check_sizes(path, arch, meta)
  if meta.get("tokenizer.ggml.model") not in SUPPORTED_TOKENIZER_MODELS:
    raise CheckpointError(f"{path}: tokenizer model {meta.get('tokenizer.ggml.model')!r} is not "
                          f"supported (supported: gpt2 BPE, llama SentencePiece)")
  if meta.get("tokenizer.chat_template"):
    from o1jax.checkpoint.tokenizer import compile_chat_template
    try:
      compile_chat_template(str(meta["tokenizer.chat_template"]))
    except ValueError as e:
      raise CheckpointError(f"{path}: {e}") from None


class _Value:
  def __init__(self, value):
    self.value = value

  def contents(self):
    return self.value


class _FastReader:
  """The parts of gguf-py's GGUFReader that `load_gguf` uses (`fields[key].contents()`;
  `tensors` with name, tensor_type, shape, n_bytes and data as numpy views of the
  memory-mapped file), read by `_Header`: gguf-py builds numpy objects per vocabulary
  entry, ~30 s for Gemma 3's 262,144 tokens, where this takes ~1 s."""

  def __init__(self, path: pathlib.Path):
    import gguf

    self._map = np.memmap(path, np.uint8, mode="r")
    header = _Header(memoryview(self._map))  # slices of a memmap are slow objects
    meta, _, table, data_start = header.walk(keep_all=True)
    if header.order != "<":
      raise _BigEndian(path)
    self.fields = {k: _Value(v) for k, v in meta.items()}
    self.tensors = []
    for name, ttype, n_elements, offset, dims in table:
      qtype = gguf.GGMLQuantizationType(ttype)
      block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
      n_bytes = n_elements * type_bytes // block
      start = data_start + offset
      _check_extent(path, name, start + n_bytes, len(self._map))
      raw = self._map[start:start + n_bytes]
      np_dims = tuple(reversed(dims))
      if qtype.name in _DENSE_DTYPES:
        data = raw.view(_DENSE_DTYPES[qtype.name]).reshape(np_dims)
      else:  # rows of raw blocks, as gguf-py gives them
        data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * type_bytes)
      self.tensors.append(types.SimpleNamespace(
          name=name, tensor_type=qtype, shape=np.asarray(dims), n_elements=n_elements,
          n_bytes=n_bytes, data_offset=start, data=data))


_DENSE_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class _BigEndian(Exception):
  """A GGUF written on a big-endian machine: `_FastReader` leaves it to gguf-py's reader."""


def _open_fast_reader(path: pathlib.Path):
  """`_FastReader`, or gguf-py's reader for what it does not read (a big-endian file)."""
  _check_file(path)
  try:
    return _FastReader(path)
  except _BigEndian:
    return _open_reader(path)
  except CheckpointError:
    raise
  except ValueError as e:
    raise _corrupt(path, e) from e
  except Exception as e:  # struct.error past the end, unknown type ids
    raise _corrupt(path, e) from e


def _field(reader, key: str, default=None, *, path=None, required=False):
  f = reader.fields.get(key)
  if f is None:
    if required:
      raise CheckpointError(f"{path}: GGUF metadata key {key!r} is missing")
    return default
  return f.contents()


_REQUIRED_ARCH_KEYS = ("attention.head_count", "embedding_length", "block_count", "feed_forward_length")
_SIZE_KEYS = _REQUIRED_ARCH_KEYS + ("attention.head_count_kv", "attention.key_length", "context_length",
                                   "vocab_size")


def _to_int(value):
  """A metadata value as the header walk gives it (gguf-py's reader: numpy scalars)."""
  return int(value) if isinstance(value, np.integer) else value


def _check_architecture(path, arch) -> None:
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(
        f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def _check_sizes(path, arch: str, meta) -> None:
  """The size keys the model is built from (those present) are integers >= 1: a head count
  of 0 divides by zero, a context of 0 refuses every prompt."""
  for key in _SIZE_KEYS:
    value = meta.get(f"{arch}.{key}")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise CheckpointError(f"{path}: GGUF metadata key {arch + '.' + key!r} is {value!r}, "
                            f"expected an integer >= 1")


def _config_from_metadata(reader, path, tensors) -> ModelConfig:
  arch = _field(reader, "general.architecture", path=path, required=True)
  _check_architecture(path, arch)
  g = lambda k, d=None, req=False: _field(reader, f"{arch}.{k}", d, path=path, required=req)
  _check_sizes(path, arch, {f"{arch}.{k}": _to_int(g(k)) for k in _SIZE_KEYS})
  n_heads = int(g("attention.head_count", req=True))
  d_model = int(g("embedding_length", req=True))
  tokens = _field(reader, "tokenizer.ggml.tokens")
  vocab = int(g("vocab_size", len(tokens) if tokens is not None else 0))
  head_dim = int(g("attention.key_length", d_model // n_heads if n_heads > 0 else 0))
  rope_scaling = None
  scaling_type = g("rope.scaling.type")
  if scaling_type == "linear":
    rope_scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor", 1.0))}
  elif scaling_type not in (None, "none"):
    raise CheckpointError(f"{path}: rope scaling type {scaling_type!r} is not supported "
                          f"(supported: linear, and Llama 3's rope_freqs tensor)")
  if "rope_freqs.weight" in tensors:  # Llama 3: theta_i / factor_i, written by the converter
    if rope_scaling is not None:
      raise CheckpointError(f"{path}: both rope_freqs and rope scaling {scaling_type!r}")
    factors = np.asarray(_dense_from_gguf(tensors["rope_freqs.weight"]), np.float32)
    if factors.shape != (head_dim // 2,):
      raise CheckpointError(f"{path}: rope_freqs.weight has shape {factors.shape}, expected "
                            f"({head_dim // 2},)")
    rope_scaling = {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}
  eos = _field(reader, "tokenizer.ggml.eos_token_id")
  eot = _field(reader, "tokenizer.ggml.eot_token_id")
  eos_ids = tuple(sorted({int(i) for i in (eos, eot) if i is not None}))
  bos = _field(reader, "tokenizer.ggml.bos_token_id")
  gemma = {}
  if arch == "gemma3":
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
      if g(key) is not None:
        raise CheckpointError(f"{path}: {arch}.{key} is set; logit soft-capping is not supported")
    n_layers = int(g("block_count", req=True))
    window = g("attention.sliding_window")
    pattern = g("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if not isinstance(pattern, int):  # one bool per layer (True: local)
      flags = [bool(x) for x in pattern]
      pattern = next((i + 1 for i, local in enumerate(flags) if not local), n_layers + 1)
      if flags != [(i + 1) % pattern != 0 for i in range(n_layers)]:
        raise CheckpointError(f"{path}: {arch}.attention.sliding_window_pattern {flags} is not "
                              f"every {pattern}th layer global (the only interleave supported)")
    gemma = dict(
        scale_embeddings=True, post_norms=True, activation="gelu_tanh",
        # llama.cpp: 1/sqrt(d_model / heads) for the 62-layer 27B, else 1/sqrt(head_dim)
        query_pre_attn_scalar=float(d_model // n_heads if n_layers == 62 else head_dim),
        sliding_window=None if window is None else int(window),
        sliding_window_pattern=int(pattern),
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA)
  return ModelConfig(**gemma,
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
      tie_embeddings="output.weight" not in tensors,
      attention_bias="blk.0.attn_q.bias" in tensors,
      qk_norm="blk.0.attn_q_norm.weight" in tensors,
      bos_id=None if bos is None else int(bos),
      eos_ids=eos_ids,
      architecture=arch,
      name=str(_field(reader, "general.name", "") or ""),
  )


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
  if t.tensor_type.name in gguf_blocks.FORMATS:
    return gguf_blocks.quantized_from_gguf(t.tensor_type.name, np.asarray(t.data))
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
  _check_type_name(path, t.name, t.tensor_type.name)


def _check_type_name(path, name: str, type_name: str) -> None:
  if type_name not in SUPPORTED_TENSOR_TYPES:
    raise CheckpointError(
        f"{path}: tensor {name!r} has type {type_name}, which is not supported "
        f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, Params, dict]:
  """Reads a GGUF file. Returns (config, params, tokenizer metadata).

  params: {"embed": [d_model, vocab], "layers": [{...}] * n_layers,
           "final_norm": [d_model], "lm_head": [d_model, vocab] (untied only)}."""
  path = pathlib.Path(path)
  reader = _open_fast_reader(path)
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

  if config.architecture in _ROTATE_HALF_ARCHITECTURES:
    hf_order = lambda w, n_heads: w
  else:
    hf_order = lambda w, n_heads: unpermute_columns(w, n_heads, config.head_dim)
  layers = []
  for i in range(config.n_layers):
    p = f"blk.{i}."
    layer = {
        "attn_norm": vector(p + "attn_norm.weight"),
        "wq": hf_order(_matrix(get(p + "attn_q.weight")), config.n_heads),
        "wk": hf_order(_matrix(get(p + "attn_k.weight")), config.n_kv_heads),
        "wv": _matrix(get(p + "attn_v.weight")),
        "wo": _matrix(get(p + "attn_output.weight")),
        "ffn_norm": vector(p + "ffn_norm.weight"),  # Gemma 3: before the MLP, as here
        "w_gate": _matrix(get(p + "ffn_gate.weight")),
        "w_up": _matrix(get(p + "ffn_up.weight")),
        "w_down": _matrix(get(p + "ffn_down.weight")),
    }
    if config.attention_bias:
      layer["bq"] = hf_order(vector(p + "attn_q.bias"), config.n_heads)
      layer["bk"] = hf_order(vector(p + "attn_k.bias"), config.n_kv_heads)
      layer["bv"] = vector(p + "attn_v.bias")
    if config.qk_norm:  # per head, over head_dim: no permutation for rotate-half files
      if config.architecture not in _ROTATE_HALF_ARCHITECTURES:
        raise CheckpointError(f"{path}: q/k norms in a {config.architecture!r} file (permuted "
                              f"Q/K rows) are not supported")
      layer["q_norm"] = vector(p + "attn_q_norm.weight")
      layer["k_norm"] = vector(p + "attn_k_norm.weight")
    if config.post_norms:  # Gemma 3; its converter already added Gemma's 1 to every norm
      layer["post_attn_norm"] = vector(p + "post_attention_norm.weight")
      layer["post_ffn_norm"] = vector(p + "post_ffw_norm.weight")
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
          "tokenizer.ggml.add_bos_token", "tokenizer.chat_template", "tokenizer.ggml.scores",
          "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_space_prefix")
  }
  return config, params, tokenizer_meta
