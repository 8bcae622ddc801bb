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
from typing import Callable, NamedTuple

import numpy as np

from o1jax.checkpoint import gguf_blocks, tensor_table
from o1jax.checkpoint.errors import CheckpointError
from o1jax.checkpoint.model_config import MAX_SIZE, SMOLLM3_NOPE_STEP, ModelConfig
from o1jax.checkpoint.params import FUSED_PARTS, Params, split_fused, take_columns

# GGUF architectures that are Llama-style decoders in our model (ModelConfig's switches).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "smollm3", "phi3")
# llama.cpp rotates these with NEOX RoPE (pairs i, i + d/2, as HF): their converter leaves
# Q/K rows as they are. The others ("normal" RoPE on adjacent pairs) have them permuted.
_ROTATE_HALF_ARCHITECTURES = ("qwen2", "qwen3", "gemma3", "phi3")
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


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one value.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_INTS, _FLOATS, _BOOL = (0, 1, 2, 3, 4, 5, 10, 11), (6, 12), 7
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
               7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
GGML_MAX_DIMS = 4  # llama.cpp's limit on a tensor's dimensions


class _Header:
  """Walks a GGUF header in place (memory-mapped): metadata and the tensor table, no tensor
  data. gguf-py's reader builds an object per vocabulary entry (seconds on a 49152-token
  model); this skips them, for a check a launcher can afford on every run."""

  def __init__(self, buf):
    self.buf, self.size, self.order = buf, len(buf), "<"
    self.arrays = {}  # key -> (item type, length) of each array value

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
      out = [] if keep else None
      for _ in range(count):
        v, off = self.value(item, off, keep)
        if keep:
          out.append(v)
      return out, off
    raise ValueError(f"unknown metadata value type {vtype}")

  def walk(self, keep_tokenizer: bool = False):
    """(metadata: every key's value, arrays as None (`self.arrays` has their item type and
    length) except small ones and, with keep_tokenizer, the tokenizer's, [(tensor name, type
    id, offset, dims)], offset of the tensor data). (Every array read as a list took ~10x
    its bytes: 2 GB for an unused 200 MB one.)"""
    (version,) = self.unpack("I", 4)
    if version & 0xFFFF == 0:  # written on a big-endian machine
      self.order = ">"
      (version,) = self.unpack("I", 4)
    if version not in (2, 3):
      raise ValueError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = self.unpack("QQ", 8)
    if n_kv > self.size or n_tensors > self.size:
      raise ValueError(f"{n_tensors} tensors and {n_kv} metadata keys cannot fit in the file")
    off, meta = 24, {}
    for _ in range(n_kv):
      key, off = self.string(off)
      key = key.decode("utf-8", "replace")
      if key in meta:  # which one a reader takes is arbitrary: refuse, as llama.cpp does
        raise ValueError(f"metadata key {key!r} appears twice")
      (vtype,) = self.unpack("I", off)
      keep = False
      if vtype == _ARRAY:
        self.arrays[key] = self.unpack("IQ", off + 4)
        keep = (self.arrays[key][1] <= SMALL_METADATA_ARRAY
                or (keep_tokenizer and key.startswith("tokenizer.")))
      meta[key], off = self.value(vtype, off + 4, keep)
    tensors = []
    for _ in range(n_tensors):
      name, off = self.string(off)
      name = name.decode("utf-8", "replace")
      (n_dims,) = self.unpack("I", off)
      if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
      dims = self.unpack(f"{n_dims}Q", off + 4)
      ttype, offset = self.unpack("IQ", off + 4 + 8 * n_dims)
      off += 4 + 8 * n_dims + 12
      tensors.append((name, ttype, offset, dims))
    align = meta.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
      raise ValueError(f"general.alignment {align!r} is not a power of two")
    return meta, tensors, off + (-off % align)


def check_gguf(path: str | os.PathLike) -> ModelConfig:
  """Validates a GGUF file without loading it: magic, the header's structure, the tensor
  table (types, extents, overlaps), the architecture and the metadata keys the config needs,
  every tensor's shape against that config, the tokenizer metadata. Raises the
  `CheckpointError` that loading would raise; returns the config."""
  import mmap

  path = pathlib.Path(path)
  _check_file(path)
  size = os.path.getsize(path)
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
    header = _Header(buf)
    try:
      values, table, data_start = header.walk()
    except Exception as e:  # struct.error past the end, or our own ValueErrors
      raise _corrupt(path, e) from e
  tensors = _check_table(path, table, data_start, size, values.get("general.alignment", 32))
  _check_byte_order(path, header.order, tensors)
  meta = _Metadata(path, values, header.arrays)
  dims = {t.name: t.dims for t in tensors}
  config = _config_from_metadata(meta, path, dims)
  _check_tensors(path, config, dims, {t.name: t.qtype.name for t in tensors})
  _check_tokenizer_metadata(meta, config.vocab_size)
  return config


def _check_table(path, table, data_start: int, size: int, align: int) -> list:
  """The tensor table as [(name, qtype, dims, start, n_bytes)], each entry checked before any
  byte of it is mapped: a name given once, a known and supported type, dims >= 1 with rows of
  whole blocks, an aligned offset, an extent inside the file and overlapping no other."""
  import gguf

  out, seen = [], set()
  for name, ttype, offset, dims in table:
    if name in seen:
      raise CheckpointError(f"{path}: tensor {name!r} appears twice in the tensor table")
    seen.add(name)
    try:
      qtype = gguf.GGMLQuantizationType(ttype)
    except ValueError:
      raise CheckpointError(f"{path}: tensor {name!r} has unknown type id {ttype}") from None
    _check_type_name(path, name, qtype.name)
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if min(dims) < 1 or dims[0] % block:
      raise CheckpointError(f"{path}: tensor {name!r} has dimensions {list(dims)}: expected sizes >= 1 "
                            f"and a first one that is a multiple of {qtype.name}'s {block}")
    if offset % align:
      raise CheckpointError(f"{path}: tensor {name!r} starts at data offset {offset}, not a multiple "
                            f"of the alignment {align}")
    n_bytes = math.prod(dims) // block * type_bytes
    _check_extent(path, name, data_start + offset + n_bytes, size)
    out.append(types.SimpleNamespace(name=name, qtype=qtype, dims=tuple(dims),
                                     start=data_start + offset, n_bytes=n_bytes))
  spans = sorted(out, key=lambda t: t.start)
  for a, b in zip(spans, spans[1:]):
    if b.start < a.start + a.n_bytes:  # two tensors would share (and silently alias) bytes
      raise CheckpointError(f"{path}: tensors {a.name!r} and {b.name!r} overlap in the file")
  return out


class _Metadata:
  """GGUF metadata with typed reads: a value of the wrong type or out of range raises a
  `CheckpointError` naming the key, the same from the header check (arrays not read) and
  from the load."""

  def __init__(self, path, values: dict, arrays: dict):
    self.path, self.values, self.arrays = path, values, arrays

  def __contains__(self, key):
    return key in self.values

  def get(self, key, default=None):
    return self.values.get(key, default)

  def _error(self, key, expected: str) -> CheckpointError:
    if key in self.arrays:
      item, count = self.arrays[key]
      got = f"an array of {count} {_TYPE_NAMES.get(item, f'type {item}')}"
    else:
      got = repr(self.values[key])
    return CheckpointError(f"{self.path}: GGUF metadata key {key!r} is {got}, expected {expected}")

  def int(self, key, default=None, *, lo=1, hi=MAX_SIZE, expected=None):
    value = self.values.get(key)
    if value is None and key not in self.arrays:
      return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
      low = isinstance(value, int) and not isinstance(value, bool) and value > hi
      raise self._error(key, expected or (f"an integer <= {hi}" if low else f"an integer >= {lo}"))
    return value

  def number(self, key, default=None, *, positive=True):
    value = self.values.get(key)
    if value is None and key not in self.arrays:
      return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        or value < 0 or (positive and value == 0)):
      raise self._error(key, f"a finite number {'>' if positive else '>='} 0")
    return float(value)

  def _of_type(self, key, default, kind: type, expected: str):
    value = self.values.get(key)
    if value is None and key not in self.arrays:
      return default
    if not isinstance(value, kind):
      raise self._error(key, expected)
    return value

  def string(self, key, default=None):
    return self._of_type(key, default, str, "a string")

  def flag(self, key, default=None):
    return self._of_type(key, default, bool, "a bool")

  def array(self, key, items, what: str) -> int | None:
    """The length of array `key` of item types `items` (None when absent)."""
    if key not in self.values:
      return None
    if key not in self.arrays or self.arrays[key][0] not in items:
      raise self._error(key, f"an array of {what}")
    return self.arrays[key][1]


class _FastReader:
  """The parts of gguf-py's GGUFReader that `load_gguf` uses (typed metadata in `meta`;
  `tensors` with name, tensor_type, shape, n_bytes and data as numpy views of the
  memory-mapped file), read by `_Header`: gguf-py builds numpy objects per vocabulary
  entry, ~30 s for Gemma 3's 262,144 tokens, where this takes ~1 s."""

  def __init__(self, path: pathlib.Path):
    import gguf

    self._map = np.memmap(path, np.uint8, mode="r")
    header = _Header(memoryview(self._map))  # slices of a memmap are slow objects
    try:
      values, table, data_start = header.walk(keep_tokenizer=True)
    except Exception as e:  # struct.error past the end, or our own ValueErrors
      raise _corrupt(path, e) from e
    self.meta = _Metadata(path, values, header.arrays)
    self.tensors = []
    table = _check_table(path, table, data_start, len(self._map), values.get("general.alignment", 32))
    _check_byte_order(path, header.order, table)
    for t in table:
      block, type_bytes = gguf.GGML_QUANT_SIZES[t.qtype]
      raw = self._map[t.start:t.start + t.n_bytes]
      np_dims = tuple(reversed(t.dims))
      if t.qtype.name in _DENSE_DTYPES:
        dtype = np.dtype(_DENSE_DTYPES[t.qtype.name]).newbyteorder(header.order)
        data = raw.view(dtype).reshape(np_dims)
        if header.order != "<":  # (a copy in this machine's order: the model's arrays)
          data = data.astype(dtype.newbyteorder("="))
      else:  # rows of raw blocks, as gguf-py gives them
        data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * type_bytes)
      self.tensors.append(types.SimpleNamespace(
          name=t.name, tensor_type=t.qtype, shape=np.asarray(t.dims), n_elements=math.prod(t.dims),
          n_bytes=t.n_bytes, data_offset=t.start, data=data))


_DENSE_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
# Metadata arrays up to this many items are read by the header check and the load (a
# layer's flags); longer ones only where the tokenizer's (`_Header.walk`).
SMALL_METADATA_ARRAY = 4096


def _check_byte_order(path, order: str, table) -> None:
  """A GGUF written on a big-endian machine ("order" ">") is read when its tensors are dense
  (F32/F16/BF16, swapped at load); quantized blocks hold their scales in the writer's order,
  which the block decoders do not read (llama.cpp refuses such files on little-endian
  machines too)."""
  if order == "<":
    return
  quantized = next((t for t in table if t.qtype.name not in _DENSE_DTYPES), None)
  if quantized is not None:
    raise CheckpointError(f"{path}: a big-endian GGUF with quantized tensors ({quantized.name!r} "
                          f"is {quantized.qtype.name}) is not supported: convert it to "
                          f"little-endian (gguf-py's gguf_convert_endian)")


def _open_fast_reader(path: pathlib.Path):
  _check_file(path)
  try:
    return _FastReader(path)
  except CheckpointError:
    raise
  except ValueError as e:
    raise _corrupt(path, e) from e
  except Exception as e:  # struct.error past the end, unknown type ids
    raise _corrupt(path, e) from e


def _reader_metadata(reader, path) -> _Metadata:
  """`_FastReader`'s typed metadata, or one built from gguf-py's reader's fields."""
  if isinstance(reader, _FastReader):
    return reader.meta
  values, arrays = {}, {}
  for key, f in reader.fields.items():
    value = f.contents()
    values[key] = int(value) if isinstance(value, np.integer) else value
    if f.types and f.types[0] == _ARRAY:
      arrays[key] = (int(f.types[-1]), len(f.data))
  return _Metadata(path, values, arrays)


_REQUIRED_ARCH_KEYS = ("attention.head_count", "embedding_length", "block_count", "feed_forward_length")
_SIZE_KEYS = _REQUIRED_ARCH_KEYS + ("attention.head_count_kv", "attention.key_length", "context_length",
                                   "vocab_size")
# The ids a model stops on (with the tokens named in tokenizer.END_OF_GENERATION_TEXTS).
GGUF_END_OF_GENERATION_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                               "tokenizer.ggml.eom_token_id")
_TOKEN_ID_KEYS = ("tokenizer.ggml.bos_token_id", *GGUF_END_OF_GENERATION_KEYS,
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id")
_TOKENIZER_FLAG_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix")
# The metadata `load_gguf` returns for Tokenizer.from_gguf_metadata.
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                   "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
                   "tokenizer.chat_template") + _TOKEN_ID_KEYS + _TOKENIZER_FLAG_KEYS


def _token_id(meta: _Metadata, key: str, n_tokens: int) -> int | None:
  return meta.int(key, lo=0, hi=n_tokens - 1, expected=f"a token id (0..{n_tokens - 1})")


def _check_architecture(path, arch) -> None:
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(
        f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def _config_from_metadata(meta: _Metadata, path, dims: dict, tensors=None) -> ModelConfig:
  """The model config from metadata, every value type-checked. dims: each tensor's GGUF
  dims (the presence of biases, norms, an output head switch features on); tensors: the
  loaded tensors, for Llama 3's rope_freqs (None in the header check)."""
  arch = meta.get("general.architecture")
  if arch is None:
    raise CheckpointError(f"{path}: GGUF metadata key 'general.architecture' is missing")
  _check_architecture(path, arch)
  for key in _REQUIRED_ARCH_KEYS:
    if f"{arch}.{key}" not in meta:
      raise CheckpointError(f"{path}: GGUF metadata key {arch + '.' + key!r} is missing")
  # Sizes: integers >= 1 (a head count of 0 divides by zero, a context of 0 refuses every
  # prompt) that index int32 arrays.
  size = {key: meta.int(f"{arch}.{key}") for key in _SIZE_KEYS}
  g = lambda key: f"{arch}.{key}"
  n_heads, d_model = size["attention.head_count"], size["embedding_length"]
  tokens = meta.arrays.get("tokenizer.ggml.tokens")
  if tokens is not None and not tokens[1]:  # (before the token ids are checked against it)
    raise CheckpointError(f"{path}: GGUF metadata key 'tokenizer.ggml.tokens' is missing or empty")
  vocab = size["vocab_size"] or (tokens[1] if tokens else 0)
  head_dim = size["attention.key_length"]
  head_from = g("attention.key_length")  # where the head size came from (for messages)
  if head_dim is None:
    head_from = f"{g('embedding_length')} / {g('attention.head_count')}"
    if d_model % n_heads:
      raise CheckpointError(f"{path}: {g('embedding_length')} {d_model} is not a multiple of "
                            f"{g('attention.head_count')} {n_heads}, and {g('attention.key_length')} "
                            f"is not set")
    head_dim = d_model // n_heads
  # What this model's attention and FFN cannot be (each loaded as the plain model before):
  # value heads of another size than the keys', a mixture of experts.
  value_length = meta.int(g("attention.value_length"))
  if value_length is not None and value_length != head_dim:
    raise CheckpointError(f"{path}: {g('attention.value_length')} {value_length} differs from the "
                          f"key heads' {head_dim} ({head_from}); value heads of their own size "
                          f"are not supported")
  experts = meta.int(g("expert_count"), lo=0)
  if experts:
    raise CheckpointError(f"{path}: {g('expert_count')} is {experts}: mixture-of-experts models "
                          f"are not supported")
  n_layers = size["block_count"]
  tensor_table.check_layer_count(path, n_layers, len(dims), g("block_count"))
  rope_scaling = None
  # As llama.cpp: the factor (or its old key, rope.scale_linear) divides the positions,
  # "linear" when no type is given; "none" never scales; other types are refused.
  scaling_type = meta.string(g("rope.scaling.type"))
  factor_key = g("rope.scaling.factor")
  factor_key = factor_key if factor_key in meta else g("rope.scale_linear")
  factor = meta.number(factor_key)
  if scaling_type == "none":
    pass
  elif scaling_type in (None, "linear"):
    if factor is not None and factor != 1.0:
      rope_scaling = {"rope_type": "linear", "factor": factor}
  else:
    raise CheckpointError(f"{path}: rope scaling type {scaling_type!r} is not supported "
                          f"(supported: linear, and Llama 3's rope_freqs tensor)")
  if "rope_freqs.weight" in dims:  # Llama 3: theta_i / factor_i, written by the converter
    if rope_scaling is not None:
      raise CheckpointError(f"{path}: both a rope_freqs tensor and {factor_key}={factor:g}")
    factors = _rope_factors(path, dims, tensors, "rope_freqs.weight", head_dim // 2)
    rope_scaling = {"rope_type": "freq_factors", "factors": factors}
  n_tokens = tokens[1] if tokens else vocab
  token_id = lambda key: _token_id(meta, key, n_tokens)
  eos_ids = tuple(dict.fromkeys(i for i in map(token_id, GGUF_END_OF_GENERATION_KEYS) if i is not None))
  bos = token_id("tokenizer.ggml.bos_token_id")
  switches = {}  # Gemma 3's or Phi-3's ModelConfig fields
  if arch == "gemma3":
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
      if meta.get(g(key)) is not None:
        raise CheckpointError(f"{path}: {arch}.{key} is set; logit soft-capping is not supported")
    window = meta.int(g("attention.sliding_window"))
    if window is None:  # (llama.cpp refuses it too: every Gemma 3 has local layers)
      raise CheckpointError(f"{path}: GGUF metadata key {g('attention.sliding_window')!r} is "
                            f"missing")
    key = g("attention.sliding_window_pattern")
    if key in meta.arrays:  # one bool per layer (True: local)
      if meta.array(key, (_BOOL,), "bools") != n_layers:
        raise CheckpointError(f"{path}: {key} has {meta.arrays[key][1]} entries for {n_layers} layers")
      flags = [bool(x) for x in meta.get(key) or ()]  # (a list of 4,096+ flags is not read)
      pattern = GEMMA3_SLIDING_WINDOW_PATTERN if not flags else next(
          (i + 1 for i, local in enumerate(flags) if not local), n_layers + 1)
      if flags and flags != [(i + 1) % pattern != 0 for i in range(n_layers)]:
        raise CheckpointError(f"{path}: {arch}.attention.sliding_window_pattern {flags} is not "
                              f"one global layer in every {pattern} (the only interleave "
                              f"supported)")
    else:
      pattern = meta.int(key, GEMMA3_SLIDING_WINDOW_PATTERN)
    switches = dict(
        scale_embeddings=True, post_norms=True, activation="gelu_tanh",
        # llama.cpp: 1/sqrt(d_model / heads) for the 62-layer 27B, else 1/sqrt(head_dim)
        query_pre_attn_scalar=float(d_model // n_heads if n_layers == 62 else head_dim),
        sliding_window=window, sliding_window_pattern=pattern,
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA)
  if arch != "phi3":  # only Phi-3's rotary width is read; a narrower one elsewhere is refused
    rot = meta.int(g("rope.dimension_count"))
    if rot is not None and rot != head_dim:
      raise CheckpointError(f"{path}: {g('rope.dimension_count')}={rot} differs from the head "
                            f"size {head_dim} ({head_from}): partial rotary is supported for "
                            f"phi3 only")
  if arch == "phi3":
    switches, longrope = _phi3(meta, path, dims, head_dim, g, tensors)
    if longrope is not None and rope_scaling is not None:
      raise CheckpointError(f"{path}: both longrope factors and rope scaling "
                            f"{rope_scaling['rope_type']!r}")
    rope_scaling = longrope or rope_scaling
  name = meta.get("general.name")
  rope_theta = meta.number(g("rope.freq_base"), 10000.0)  # outside the try: these name their key
  rms_eps = meta.number(g("attention.layer_norm_rms_epsilon"), 1e-5, positive=False)
  try:
    return ModelConfig(**switches,
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=size["attention.head_count_kv"] or n_heads,
        head_dim=head_dim,
        ffn_dim=size["feed_forward_length"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_eps=rms_eps,
        max_context=size["context_length"] or 2048,
        tie_embeddings="output.weight" not in dims,
        attention_bias="blk.0.attn_q.bias" in dims,
        qk_norm="blk.0.attn_q_norm.weight" in dims,
        bos_id=bos,
        eos_ids=eos_ids,
        architecture=arch,
        name=name if isinstance(name, str) else "",
        nope_layers=(tuple(i for i in range(n_layers) if (i + 1) % SMOLLM3_NOPE_STEP == 0)
                     if arch == "smollm3" else ()),
    )
  except ValueError as e:  # sizes that do not fit together, e.g. heads not a multiple of KV heads
    raise CheckpointError(f"{path}: {e}") from None


def _rope_factors(path, dims: dict, tensors, name: str, length: int) -> tuple[float, ...]:
  """A 1-D tensor of per-frequency RoPE divisors (Llama 3's rope_freqs, longrope's
  factors) as floats, its shape checked; ones at the header check (tensors None)."""
  if dims[name] != (length,):
    raise CheckpointError(f"{path}: {name} has shape {dims[name][::-1]}, expected ({length},) "
                          f"(rotary dims / 2)")
  if tensors is None:
    return (1.0,) * length
  if tensors[name].tensor_type.name not in _DENSE_DTYPES:
    raise CheckpointError(f"{path}: tensor {name!r} has type {tensors[name].tensor_type.name}, "
                          f"expected F32, F16 or BF16")
  return tuple(float(f) for f in np.asarray(_dense_from_gguf(tensors[name]), np.float32))


def _phi3(meta: _Metadata, path, dims: dict, head_dim: int, g, tensors) -> tuple[dict, dict | None]:
  """Phi-3's config switches and its rope scaling: a sliding window on every layer (as
  transformers applies the config's sliding_window; llama.cpp ignores it), a partial
  rotary embedding (`rope.dimension_count` of the head: Phi-4-mini's 96 of 128) and
  longrope (Phi-3.5, the 128k models, Phi-4-mini): the `rope_factors_short/long` tensors
  (rotary dims / 2 divisors each), `rope.scaling.attn_factor` (default 1, as llama.cpp)
  and `rope.scaling.original_context_length` (default: the context length), where the
  long factors take over. Returns (switches, rope scaling or None)."""
  rot = meta.int(g("rope.dimension_count"))
  switches = {}
  if rot is not None and (rot % 2 or rot > head_dim):
    raise CheckpointError(f"{path}: {g('rope.dimension_count')}={rot} must be even and at "
                          f"most the head size {head_dim}")
  if rot is not None and rot != head_dim:
    switches["rotary_dim"] = rot
  rot = rot or head_dim
  window = meta.int(g("attention.sliding_window"))
  if window:
    switches.update(sliding_window=window, sliding_window_pattern=0)
  names = ("rope_factors_short.weight", "rope_factors_long.weight")
  present = [n for n in names if n in dims]
  if not present:
    return switches, None
  if len(present) == 1:
    raise CheckpointError(f"{path}: longrope needs both {names[0]!r} and {names[1]!r}, "
                          f"found only {present[0]!r}")
  factors = {name: _rope_factors(path, dims, tensors, name, rot // 2) for name in names}
  original = meta.int(g("rope.scaling.original_context_length")) or meta.int(g("context_length"))
  if not original:
    raise CheckpointError(f"{path}: longrope needs {g('rope.scaling.original_context_length')} "
                          f"or {g('context_length')}")
  scaling = {"rope_type": "longrope", "short_factor": factors[names[0]],
             "long_factor": factors[names[1]], "original_max_position_embeddings": original,
             "attention_factor": meta.number(g("rope.scaling.attn_factor"), 1.0)}
  return switches, scaling


class _Tensor(NamedTuple):
  """One tensor the model reads from a GGUF file."""
  gguf: str  # its name (after "blk.{i}." in a layer)
  dims: tuple  # GGUF dims (ne: input features first), as `_sizes` keys; 1-D: a float vector
  present: Callable[[ModelConfig], bool] = lambda config: True  # the switch that reads it
  heads: str | None = None  # Q/K: the ModelConfig head count llama.cpp permuted its rows by


# Our name -> its tensor, in the order `load_gguf` reads them: each layer's, then the rest.
_LAYER_TENSORS = {
    "attn_norm": _Tensor("attn_norm.weight", ("d",)),
    "wq": _Tensor("attn_q.weight", ("d", "q"), heads="n_heads"),
    "wk": _Tensor("attn_k.weight", ("d", "kv"), heads="n_kv_heads"),
    "wv": _Tensor("attn_v.weight", ("d", "kv")),
    "wo": _Tensor("attn_output.weight", ("q", "d")),
    "ffn_norm": _Tensor("ffn_norm.weight", ("d",)),  # Gemma 3: before the MLP, as here
    "w_gate": _Tensor("ffn_gate.weight", ("d", "f")),
    "w_up": _Tensor("ffn_up.weight", ("d", "f")),
    "w_down": _Tensor("ffn_down.weight", ("f", "d")),
    "bq": _Tensor("attn_q.bias", ("q",), lambda c: c.attention_bias, "n_heads"),
    "bk": _Tensor("attn_k.bias", ("kv",), lambda c: c.attention_bias, "n_kv_heads"),
    "bv": _Tensor("attn_v.bias", ("kv",), lambda c: c.attention_bias),
    # Per head, over head_dim: read as they are from rotate-half files (`load_gguf` refuses others).
    "q_norm": _Tensor("attn_q_norm.weight", ("hd",), lambda c: c.qk_norm),
    "k_norm": _Tensor("attn_k_norm.weight", ("hd",), lambda c: c.qk_norm),
    # Gemma 3; its converter already added Gemma's 1 to every norm.
    "post_attn_norm": _Tensor("post_attention_norm.weight", ("d",), lambda c: c.post_norms),
    "post_ffn_norm": _Tensor("post_ffw_norm.weight", ("d",), lambda c: c.post_norms),
}
_OTHER_TENSORS = {
    "embed": _Tensor("token_embd.weight", ("d", "v")),
    "final_norm": _Tensor("output_norm.weight", ("d",)),
    "lm_head": _Tensor("output.weight", ("d", "v"), lambda c: not c.tie_embeddings),
}


# Tensors read into the config (RoPE's frequency factors) or, like llama.cpp, not at all (an
# old converter's per-layer rotary table).
_CONFIG_TENSORS = (r"rope_freqs\.weight|rope_factors_(long|short)\.weight"
                   r"|blk\.\d+\.attn_rot_embd(\.weight)?")


# Phi-3 stores q, k and v as one matrix and gate and up as one (gate first): read as such,
# then split into the names above (params.split_fused).
_FUSED_LAYER_TENSORS = {
    "wqkv": _Tensor("attn_qkv.weight", ("d", "qkv")),
    "w_gate_up": _Tensor("ffn_up.weight", ("d", "2f")),
}


def _layer_tensors(config: ModelConfig) -> dict:
  if config.architecture != "phi3":
    return _LAYER_TENSORS
  parts = {name for names in FUSED_PARTS.values() for name in names}
  return {**{k: t for k, t in _LAYER_TENSORS.items() if k not in parts}, **_FUSED_LAYER_TENSORS}


def _sizes(config: ModelConfig) -> dict:
  """The sizes `_Tensor.dims` names."""
  hd = config.head_dim
  q, kv = config.n_heads * hd, config.n_kv_heads * hd
  return {"d": config.d_model, "hd": hd, "f": config.ffn_dim, "v": config.vocab_size,
          "q": q, "kv": kv, "qkv": q + 2 * kv, "2f": 2 * config.ffn_dim}


def _expected_tensors(config: ModelConfig) -> list[tuple[str, tuple, bool]]:
  """(name, GGUF dims (ne: input features first), required) of every tensor the model reads,
  in the order `load_gguf` reads them."""
  size = _sizes(config)
  entry = lambda name, t: (name, tuple(size[k] for k in t.dims), t.present(config))
  return ([entry(f"blk.{i}.{t.gguf}", t) for i in range(config.n_layers)
           for t in _layer_tensors(config).values()]
          + [entry(t.gguf, t) for t in _OTHER_TENSORS.values()])


def _check_tensors(path, config: ModelConfig, dims: dict, type_names: dict) -> None:
  """`tensor_table.check_tensors` on a GGUF file: shapes printed in numpy's order (rows
  first), as the model sees them; vectors (norms and biases) must be floats."""
  def dense_vector(name, want):
    if len(want) == 1 and type_names[name] not in _DENSE_DTYPES:
      raise CheckpointError(f"{path}: tensor {name!r} has type {type_names[name]}, expected F32, F16 "
                            f"or BF16 for a vector")

  tensor_table.check_tensors(
      path, _expected_tensors(config), dims, config.n_layers, r"blk\.(\d+)\.",
      layers_key=f"{config.architecture}.block_count",
      unread_tail=": blk.0 has no such tensor, so the model would ignore it",
      shown=lambda shape: shape[::-1], check_unread=True, check=dense_vector,
      ignored=_CONFIG_TENSORS, model=f"a {config.architecture!r} model")


def _check_tokenizer_metadata(meta: _Metadata, vocab_size: int) -> None:
  """The `tokenizer.ggml.*` keys the tokenizer is built from, typed and consistent: a token
  list no longer than the embedding, per-token arrays of its length, ids inside it."""
  path = meta.path
  model = meta.get("tokenizer.ggml.model")
  if model not in SUPPORTED_TOKENIZER_MODELS:
    raise CheckpointError(f"{path}: tokenizer model {model!r} is not supported "
                          f"(supported: gpt2 BPE, llama SentencePiece)")
  n = meta.array("tokenizer.ggml.tokens", (_STRING,), "strings")
  if not n:
    raise CheckpointError(f"{path}: GGUF metadata key 'tokenizer.ggml.tokens' is missing or empty")
  if n > vocab_size:  # ids past the embedding would read other memory, or clamp
    raise CheckpointError(f"{path}: tokenizer.ggml.tokens has {n} tokens, more than the model's "
                          f"vocab_size {vocab_size}")
  for key, items, what in (("tokenizer.ggml.token_type", _INTS, "integers"),
                           ("tokenizer.ggml.scores", _FLOATS, "floats")):
    count = meta.array(key, items, what)
    if count is not None and count != n:
      raise CheckpointError(f"{path}: {key} has {count} entries for {n} tokens")
  meta.array("tokenizer.ggml.merges", (_STRING,), "strings")
  if model == "llama" and "tokenizer.ggml.scores" not in meta:
    raise CheckpointError(f"{path}: a 'llama' tokenizer needs tokenizer.ggml.scores")
  for key in _TOKEN_ID_KEYS:
    _token_id(meta, key, n)
  for key in _TOKENIZER_FLAG_KEYS:
    meta.flag(key)
  pre = meta.string("tokenizer.ggml.pre")
  from o1jax.checkpoint import tokenizer
  if model == "gpt2":
    tokenizer._byte_level_pre(pre, path)  # pylint: disable=protected-access
  template = meta.string("tokenizer.chat_template")
  if template:
    try:
      tokenizer.compile_chat_template(template)
    except ValueError as e:
      raise CheckpointError(f"{path}: {e}") from None


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
  return take_columns(w, perm)


def read_tokenizer_metadata(path: str | os.PathLike) -> dict:
  """The `tokenizer.*` metadata `Tokenizer.from_gguf_metadata` reads, without the tensors
  (the header only: ~1 s for Gemma 3's 262,144 tokens)."""
  meta = _open_fast_reader(pathlib.Path(path)).meta
  # The checks `load_gguf` runs on these keys (a token id past the vocabulary, a per-token
  # array of another length, a flag of another type loaded here without a word).
  n = meta.array("tokenizer.ggml.tokens", (_STRING,), "strings")
  vocab = meta.int(f"{meta.get('general.architecture')}.vocab_size") or n or 0
  _check_tokenizer_metadata(meta, vocab)
  return {key: meta.get(key) for key in _TOKENIZER_KEYS}


def read_tensors(path: str | os.PathLike, names=None) -> dict:
  """Tensors of a GGUF file as stored (no Q/K un-permutation): 2-D weights as
  [K, N] QuantizedTensor or dense array, 1-D tensors as f32 vectors (copies: not views
  of the mapped file)."""
  reader = _open_fast_reader(pathlib.Path(path))
  out = {}
  for t in reader.tensors:
    if names is not None and t.name not in names:
      continue
    _check_type(t, path)
    if len(t.shape) not in (1, 2) or not t.n_elements:
      raise CheckpointError(f"{path}: tensor {t.name!r} has dims {tuple(int(d) for d in t.shape)}"
                            f": a vector or a matrix with elements is expected")
    out[t.name] = _matrix(t) if len(t.shape) == 2 else np.array(_dense_from_gguf(t), np.float32)
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
  meta = _reader_metadata(reader, path)
  dims = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
  config = _config_from_metadata(meta, path, dims, tensors)
  _check_tensors(path, config, dims, {t.name: t.tensor_type.name for t in reader.tensors})
  _check_tokenizer_metadata(meta, config.vocab_size)

  permuted = config.architecture not in _ROTATE_HALF_ARCHITECTURES
  if permuted and config.qk_norm:  # their weights would need a permutation within each head
    raise CheckpointError(f"{path}: q/k norms in a {config.architecture!r} file (permuted "
                          f"Q/K rows) are not supported")

  def read(name, t: _Tensor):  # there: `_check_tensors` checked the same table
    w = tensors[name]
    # (a vector copied: a view of the mapped file changed with the file, or ended the
    # process with SIGBUS once the file was cut)
    w = _matrix(w) if len(t.dims) == 2 else np.array(_dense_from_gguf(w), np.float32)
    if permuted and t.heads:  # Q/K weights and biases: rows back in HF's order
      w = unpermute_columns(w, getattr(config, t.heads), config.head_dim)
    return w

  layers = [{ours: read(f"blk.{i}.{t.gguf}", t) for ours, t in _layer_tensors(config).items()
             if t.present(config)} for i in range(config.n_layers)]
  size = _sizes(config)
  for layer in layers:  # Phi-3's fused matrices, split as the model holds them
    split_fused(layer, size["q"], size["kv"], size["f"])
  other = {ours: read(t.gguf, t) for ours, t in _OTHER_TENSORS.items() if t.present(config)}
  params: Params = {"embed": other.pop("embed"), "layers": layers, **other}  # lm_head: untied only
  return config, params, {key: meta.get(key) for key in _TOKENIZER_KEYS}
