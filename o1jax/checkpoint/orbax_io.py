"""Orbax checkpoints of (param tree, model config, tokenizer).

Layout of a converted checkpoint directory:
  params/             orbax PyTree checkpoint of the flat parameter arrays
  o1jax_model.json    {"config": ModelConfig, "param_spec": quantization spec,
                       "checksums": {array name: CRC-32 of its bytes}}
  tokenizer/          tokenizer.json + tokenizer_config.json
Quantized weights are stored quantized, so loading skips all GGUF parsing and
re-layout work. Orbax stores incompressible arrays (quantized codes) as raw bytes
with no checksum, so a flipped byte restored silently as another model; the manifest
carries a CRC-32 per array (~2.5 GB/s on one core) that every load checks.
Checkpoints written before it (no "checksums") load unchecked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
import os
import pathlib
import re
import sys
import zlib

import numpy as np

from o1jax.checkpoint.errors import CheckpointError, new_checkpoint_dir
from o1jax.checkpoint.model_config import ModelConfig
from o1jax.checkpoint.params import Params, flatten, unflatten
from o1jax.checkpoint.tokenizer import Tokenizer

MANIFEST = "o1jax_model.json"


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
  return (pathlib.Path(path) / MANIFEST).is_file()


def save_orbax(directory: str | os.PathLike, config: ModelConfig, params: Params,
               tokenizer: Tokenizer) -> None:
  import orbax.checkpoint as ocp

  directory = new_checkpoint_dir(directory)
  arrays, spec = flatten(params)
  # Orbax treats dots in keys as nothing special, but keep keys path-safe anyway.
  with ocp.PyTreeCheckpointer() as ckpt:
    ckpt.save(directory / "params", {k.replace(".", "/"): v for k, v in arrays.items()})
  tokenizer.save(directory / "tokenizer")
  # The manifest last: it makes the directory a checkpoint (a save stopped before it left
  # one that loaded without tokenizer_config.json: no BOS, the ChatML fallback template).
  manifest = {"config": json.loads(config.to_json()), "param_spec": spec,
              "checksums": {k: _checksum(v) for k, v in arrays.items()}}
  manifest_tmp = directory / (MANIFEST + ".tmp")
  manifest_tmp.write_text(json.dumps(manifest, indent=2))
  os.replace(manifest_tmp, directory / MANIFEST)


def _read_manifest(directory: pathlib.Path) -> tuple[dict, ModelConfig]:
  if not is_orbax_checkpoint(directory):
    raise CheckpointError(f"{directory}: not an o1jax orbax checkpoint ({MANIFEST} is missing)")
  try:
    manifest = json.loads((directory / MANIFEST).read_text())
    config = ModelConfig.from_json(json.dumps(manifest["config"]))
    manifest["param_spec"]  # pylint: disable=pointless-statement
  except (ValueError, TypeError, KeyError) as e:
    raise CheckpointError(f"{directory / MANIFEST}: not a valid manifest "
                          f"({type(e).__name__}: {e}); expected keys config and param_spec") from e
  return manifest, config


def _check_tokenizer_files(directory: pathlib.Path) -> None:
  # (save_orbax writes both: without the config a copy loaded with no BOS and the ChatML
  # fallback template)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    if not (directory / "tokenizer" / name).is_file():
      raise CheckpointError(f"{directory / 'tokenizer'}: {name} is missing")


def check_orbax(directory: str | os.PathLike) -> ModelConfig:
  """Validates an orbax checkpoint's manifest, layout and array shapes (from orbax's
  metadata: ~10 ms) without restoring its arrays; returns the config."""
  import jax
  import orbax.checkpoint as ocp

  directory = pathlib.Path(directory).absolute()
  manifest, config = _read_manifest(directory)
  params = directory / "params"
  if not params.is_dir() or not any(params.iterdir()):
    raise CheckpointError(f"{params}: missing or empty (the parameter arrays)")
  _check_tokenizer_files(directory)
  try:
    with ocp.PyTreeCheckpointer() as ckpt:
      tree = ckpt.metadata(params).item_metadata
  except Exception as e:
    raise CheckpointError(f"{params}: cannot be read ({e})") from e
  shapes = lambda node: (jax.ShapeDtypeStruct(tuple(node.shape), node.dtype)
                         if hasattr(node, "shape") else node)
  arrays = _flat(tree, shapes)
  _checksum_table(directory, manifest, arrays)  # its format and names; the values need the data
  _params_from(directory, manifest, config, arrays)
  return config


def load_orbax(directory: str | os.PathLike) -> tuple[ModelConfig, Params, Tokenizer]:
  import orbax.checkpoint as ocp

  directory = pathlib.Path(directory).absolute()
  manifest, config = _read_manifest(directory)
  _check_tokenizer_files(directory)
  _drop_stray_read_callbacks()
  try:
    with ocp.PyTreeCheckpointer() as ckpt:
      restored = ckpt.restore(directory / "params")
  except Exception as e:
    raise CheckpointError(f"{directory / 'params'}: cannot be restored ({e})") from e
  arrays = _flat(restored, np.asarray)
  _check_checksums(directory, manifest, arrays)
  params = _params_from(directory, manifest, config, arrays)
  return config, params, Tokenizer.load(directory / "tokenizer")


def _checksum(array) -> str:
  """CRC-32 of an array's bytes (C order), as 8 hex digits."""
  data = np.ascontiguousarray(array)
  return f"{zlib.crc32(memoryview(data.reshape(-1).view(np.uint8))) & 0xFFFFFFFF:08x}"


def _checksum_table(directory: pathlib.Path, manifest: dict, names) -> dict[str, str] | None:
  """The manifest's checksums (lower case) checked against the array names, or None for
  a checkpoint written before them. Raises on a malformed table (format only: no data)."""
  if "checksums" not in manifest:
    return None
  sums = manifest["checksums"]
  where = directory / MANIFEST
  if not isinstance(sums, Mapping):
    raise CheckpointError(f"{where}: checksums must be an object of array name -> 8 hex digits, "
                          f"got {type(sums).__name__}")
  for name, value in sums.items():
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-fA-F]{8}", value):
      raise CheckpointError(f"{where}: checksums[{name!r}]={value!r} is not a CRC-32 (8 hex digits)")
  for name in sorted(set(sums) ^ set(names)):
    place = "the manifest's checksums" if name in sums else f"{directory / 'params'}"
    raise CheckpointError(f"{directory / 'params'}: array {name!r} is only in {place} "
                          f"(the arrays and the manifest are from different checkpoints)")
  return {name: value.lower() for name, value in sums.items()}


def _check_checksums(directory: pathlib.Path, manifest: dict, arrays: dict) -> None:
  """Each restored array against the CRC-32 the manifest saved with it."""
  sums = _checksum_table(directory, manifest, arrays)
  if sums is None:  # written before checksums: nothing to check against
    return
  for name, array in arrays.items():
    got = _checksum(array)
    if got != sums[name]:
      raise CheckpointError(f"{directory / 'params'}: array {name!r} does not match the "
                            f"checksum saved with it (CRC-32 {got}, saved {sums[name]}): its "
                            f"files are corrupt; convert the checkpoint again")


def _is_stray_read_callback(unraisable) -> bool:
  """asyncio's 'Event loop is closed', raised where a callback was handed to a closed loop."""
  if not (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == "Event loop is closed"):
    return False
  tb = unraisable.exc_traceback
  frames = []
  while tb is not None:
    frames.append(tb.tb_frame.f_code.co_name)
    tb = tb.tb_next
  return "call_soon_threadsafe" in frames


def _drop_stray_read_callbacks() -> None:
  """A failed restore closes orbax's event loop while its other reads are still in
  flight; each of them then completes into the closed loop and Python prints its
  'Event loop is closed' traceback (an unraisable exception, from another thread, at
  any time around the one-line error, even before it is raised). Installed before a
  restore, for the process: drops exactly those; the rest goes to the hook that was
  in place."""
  previous = sys.unraisablehook
  if getattr(previous, "drops_stray_read_callbacks", False):
    return

  def hook(unraisable):
    if not _is_stray_read_callback(unraisable):
      previous(unraisable)

  hook.drops_stray_read_callbacks = True
  sys.unraisablehook = hook


def _flat(tree, leaf) -> dict:
  """{dotted name: leaf(value)} of a restored (or metadata) tree (keys saved with '/')."""
  out = {}

  def collect(prefix, node):
    if isinstance(node, Mapping) or (hasattr(node, "items") and not hasattr(node, "shape")):
      # (orbax's metadata tree is dict-like without being a Mapping)
      for k, v in node.items():
        collect(f"{prefix}.{k}" if prefix else str(k), v)
    else:
      out[prefix.replace("/", ".")] = leaf(node)

  collect("", tree)
  return out


def _params_from(directory: pathlib.Path, manifest: dict, config: ModelConfig,
                 arrays: dict) -> Params:
  """The param tree of `arrays` (or of their shapes) as the manifest lays it out, checked
  against the manifest's config."""
  from o1jax.checkpoint import tensor_table

  tensor_table.check_layer_count(directory, config.n_layers, len(arrays),
                                 f"{MANIFEST}'s n_layers")
  try:
    params = unflatten(arrays, manifest["param_spec"])
  except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:  # spec and arrays disagree
    raise CheckpointError(f"{directory / MANIFEST}: param_spec does not match the arrays in "
                          f"{directory / 'params'} ({type(e).__name__}: {e})") from e
  _check_shapes(directory, config, params)
  return params


def _check_shapes(directory: pathlib.Path, config: ModelConfig, params: Params) -> None:
  """The restored arrays against the manifest's config, as the other loaders check theirs
  (`tensor_table.check_tensors`): a config that disagrees with its arrays (an edited
  manifest, arrays of another model) loaded, to fail inside the model's first call."""
  from o1jax.checkpoint import safetensors_loader, tensor_table

  shapes = {k: tuple(v.shape) for k, v in params.items() if k != "layers"}
  for i, layer in enumerate(params["layers"]):
    shapes.update({f"layers.{i}.{k}": tuple(v.shape) for k, v in layer.items()})
  # The tensors an HF checkpoint of the config holds, under our names and in our
  # [in_features, out_features] layout (HF's shapes reversed).
  expected = [(ours if layer is None else f"layers.{layer}.{ours}", shape[::-1], read)
              for layer, ours, _, shape, read in safetensors_loader.expected_tensors(config,
                                                                                     stored=False)]
  tensor_table.check_tensors(
      directory, expected, shapes, config.n_layers, r"layers\.(\d+)\.",
      layers_key=f"{MANIFEST}'s n_layers", refuse_unread=True,
      unread_tail=f" by the model {MANIFEST} describes (attention_bias={config.attention_bias}, "
                  f"qk_norm={config.qk_norm}, tie_embeddings={config.tie_embeddings})")
  _check_dtypes(directory, params)


def _check_dtypes(directory: pathlib.Path, params: Params) -> None:
  """Dense weights, scales and minimums are floats (a complex or an int array loaded, its
  imaginary part or nothing dropped; the codes' dtypes `QuantizedTensor.validate` checks)."""
  import jax.numpy as jnp
  from pallas_kernels.quantized_tensor import QuantizedTensor

  named = [(k, v) for k, v in params.items() if k != "layers"]
  named += [(f"layers.{i}.{k}", v) for i, layer in enumerate(params["layers"])
            for k, v in layer.items()]
  for name, w in named:
    parts = ([(name + ".scale", w.scale), (name + ".minimum", w.minimum)]
             if isinstance(w, QuantizedTensor) else [(name, w)])
    for part, array in parts:
      if array is not None and not jnp.issubdtype(array.dtype, jnp.floating):
        raise CheckpointError(f"{directory / 'params'}: array {part!r} is {array.dtype}, "
                              f"expected a float dtype")
