"""One entry point for every checkpoint format."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax.numpy as jnp
import numpy as np

from o1jax.checkpoint import gguf_loader, orbax_io, safetensors_loader
from o1jax.checkpoint.embedded import NAMED_MODELS, resolve_source
from o1jax.checkpoint.errors import CheckpointError
from o1jax.checkpoint.model_config import ModelConfig
from o1jax.checkpoint.params import Params
from o1jax.checkpoint.tokenizer import Tokenizer

EMBEDDED = "embedded"


@dataclasses.dataclass
class LoadedCheckpoint:
  config: ModelConfig
  params: Params  # numpy tree; see o1jax.checkpoint.params
  tokenizer: Tokenizer
  source: str
  format: str  # "gguf" | "safetensors" | "orbax"


def detect_format(path: pathlib.Path) -> str:
  if path.is_file():
    with open(path, "rb") as f:
      if f.read(4) == b"GGUF":
        return "gguf"
    raise CheckpointError(f"{path}: not a GGUF file, and not a checkpoint directory")
  if path.is_dir():
    if orbax_io.is_orbax_checkpoint(path):
      return "orbax"
    if (path / "config.json").is_file():
      return "safetensors"
    raise CheckpointError(f"{path}: directory holds neither {orbax_io.MANIFEST} (orbax) "
                          f"nor config.json (HF safetensors)")
  if path.exists():  # a device, a pipe, a socket
    raise CheckpointError(f"{path}: not a regular file or a directory")
  named = ("" if len(path.parts) > 1 or path.suffix else
           f" (and not a named model: {', '.join(NAMED_MODELS)})")  # (a name mistyped)
  raise CheckpointError(f"{path}: no such file or directory{named}")


def check_checkpoint(source: str | os.PathLike = EMBEDDED) -> ModelConfig:
  """Cheap validation of what `load_checkpoint(source)` would read, without reading weights:
  GGUF: the header walked in place (magic, tensor table, types, extents, architecture, sizes,
  tokenizer); HF: config.json, every shard's safetensors header and the tokenizer files;
  orbax: the manifest and the layout. Raises the `CheckpointError` loading would raise
  (missing, random bytes, truncated, unsupported); returns the model's config. For
  launchers, before any worker loads it."""
  path = resolve_source(source)
  fmt = detect_format(path)
  if fmt == "gguf":
    return gguf_loader.check_gguf(path)
  if fmt == "orbax":
    return orbax_io.check_orbax(path)
  config = safetensors_loader.check_safetensors(path)
  # tokenizer.json and tokenizer_config.json parse (a GGUF's are metadata), and fit the model
  _check_vocab(path, config, Tokenizer.load(path))
  return config


def _check_vocab(path, config: ModelConfig, tokenizer: Tokenizer) -> None:
  """The tokenizer's ids index the embedding: a token past its rows would read a clamped
  (wrong) row on the device, not fail. Fewer tokens than rows is common (padded vocabularies)."""
  if tokenizer.vocab_size > config.vocab_size:
    raise CheckpointError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, more than the "
                          f"model's vocab_size {config.vocab_size}")
  for name, ids in (("bos", [] if tokenizer.bos_id is None else [tokenizer.bos_id]),
                    ("eos", tokenizer.eos_ids)):
    if any(not 0 <= i < config.vocab_size for i in ids):
      raise CheckpointError(f"{path}: the tokenizer's {name} token ids {list(ids)} are not all below "
                            f"the model's vocab_size {config.vocab_size}")


# IEEE-style float types: the sign is the top bit, NaN and inf the largest magnitudes.
_SIGN_TOP_FLOATS = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")


def _non_finite(array, chunk: int = 1 << 22) -> int:
  """NaN and inf values in a float array. For IEEE-style types a value is non-finite iff
  its bits without the sign reach +inf's (NaN's where the type has no inf): one max over
  the bits per chunk, ~3x faster than np.isfinite on bf16 (an 8B bf16 model: ~3 s),
  counted only if found. Other float types (fnuz, float4/6: NaN elsewhere or absent)
  go through np.isfinite on an f32 copy."""
  if array is None or not jnp.issubdtype(array.dtype, jnp.floating):
    return 0
  flat = np.asarray(array).reshape(-1)
  if flat.dtype.name not in _SIGN_TOP_FLOATS:
    return sum(int(np.count_nonzero(~np.isfinite(flat[i:i + chunk].astype(np.float32))))
               for i in range(0, flat.size, chunk))
  as_bits = np.dtype(f"u{flat.dtype.itemsize}")
  limit = int(np.array(np.inf).astype(flat.dtype).view(as_bits))
  magnitude = (1 << (8 * flat.dtype.itemsize - 1)) - 1
  bits = flat.view(as_bits)
  if not any(int(np.max(bits[i:i + chunk] & magnitude)) >= limit
             for i in range(0, flat.size, chunk)):
    return 0
  return sum(int(np.count_nonzero((bits[i:i + chunk] & magnitude) >= limit))
             for i in range(0, flat.size, chunk))


def _check_finite(path, params: Params) -> None:
  """Every float a weight is made of (dense values; quantized scales and minimums) is
  finite: a NaN or inf (a corrupted byte, a diverged fine-tune) loaded, and every logit
  that touched it was NaN, sampled as the last token id without an error."""
  named = [(k, v) for k, v in params.items() if k != "layers"]
  named += [(f"layers.{i}.{k}", v) for i, layer in enumerate(params["layers"])
            for k, v in layer.items()]
  for name, value in named:
    fields = ({"scales": value.scale, "minimums": value.minimum} if hasattr(value, "packed")
              else {"values": value})
    for field, array in fields.items():
      bad = _non_finite(array)
      if bad:
        raise CheckpointError(f"{path}: tensor {name!r} has {bad} non-finite {field} (NaN or "
                              f"inf) of {np.size(array)}: the file is corrupt, or the model's "
                              f"training diverged")


def load_tokenizer(source: str | os.PathLike = EMBEDDED) -> Tokenizer:
  """The tokenizer of a checkpoint (as `load_checkpoint` builds it), without its weights."""
  path = resolve_source(source)
  fmt = detect_format(path)
  if fmt == "gguf":
    return Tokenizer.from_gguf_metadata(gguf_loader.read_tokenizer_metadata(path), path)
  return Tokenizer.load(path / "tokenizer" if fmt == "orbax" else path)


def load_checkpoint(source: str | os.PathLike = EMBEDDED) -> LoadedCheckpoint:
  """Loads a named model ("embedded": the shipped SmolLM2-135M GGUF; "gemma3-270m";
  see `embedded.NAMED_MODELS`), a .gguf file, an HF safetensors directory or an o1jax
  orbax directory."""
  path = resolve_source(source)
  fmt = detect_format(path)
  if fmt == "gguf":
    config, params, meta = gguf_loader.load_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(meta, path)
  elif fmt == "orbax":
    config, params, tokenizer = orbax_io.load_orbax(path)
  else:
    config, params = safetensors_loader.load_safetensors(path)
    tokenizer = Tokenizer.load(path)
  if not tokenizer.eos_ids and config.eos_ids:
    tokenizer.eos_ids = config.eos_ids
  _check_vocab(path, config, tokenizer)
  _check_finite(path, params)
  return LoadedCheckpoint(config=config, params=params, tokenizer=tokenizer, source=str(path), format=fmt)
