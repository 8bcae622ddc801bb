"""The tensor-table check both checkpoint loaders run before reading a weight: the file's
tensors against the ones a config reads (`gguf_loader`, `safetensors_loader`)."""

from __future__ import annotations

import re

from o1jax.checkpoint.errors import CheckpointError


def check_layer_count(where, n_layers: int, n_tensors: int, layers_key: str) -> None:
  """A layer count past the checkpoint's number of tensors (a layer has several) is
  refused before anything is sized by it: the config's per-layer work and the expected
  tensor list took 34 s and 3.5 GB to refuse a count of 10**6 in a 70 KB file."""
  if n_layers > n_tensors:
    raise CheckpointError(f"{where}: {layers_key} is {n_layers}, more layers than the "
                          f"checkpoint has tensors ({n_tensors})")


def check_tensors(where, expected, shapes: dict, n_layers: int, layer_pattern: str, *,
                  layers_key: str, unread_tail: str, shown=lambda shape: shape,
                  check_unread: bool = False, refuse_unread: bool = False, check=None,
                  ignored: str | None = None, model: str = "the model") -> None:
  """Every tensor the model reads is present with the shape the config gives it, and no
  tensor of the file is left unread: a layer count or a bias switch that disagrees with the
  file, or a tensor the model has no place for (an output projection's bias in a Llama
  file), would otherwise load a different model without a word.

  expected: (name, shape, read) of every tensor a file of the config may hold, in read
  order; shapes: {name: shape} of the file's tensors; layer_pattern: a regex whose group 1 is
  a layer tensor's layer index; layers_key: the config key the layer count comes from;
  unread_tail: what follows "is not read" (why); shown: a shape as messages print it;
  check_unread: also check the shape of a tensor present but not read; refuse_unread: refuse
  it, outside the layers too (a store of the model's own tree, whose model reads what is
  there: a tied model's lm_head); check(name, shape):
  the loader's own check of each tensor whose shape matched; ignored: a regex of the names
  of tensors the model knowingly does without (read elsewhere, e.g. into the config, or
  derived: HF's saved rotary inv_freq); model: what a message calls the model."""
  for name, want, read in expected:
    if name not in shapes:
      if read:
        raise CheckpointError(f"{where}: tensor {name!r} is missing")
      continue
    if not (read or check_unread):
      continue
    if shapes[name] != want:
      raise CheckpointError(f"{where}: tensor {name!r} has shape {shown(shapes[name])}, expected "
                            f"{shown(want)}")
    if check is not None:
      check(name, want)
  unread = {name for name, _, read in expected if not read}
  for name in shapes:
    m = re.match(layer_pattern, name)
    if m and int(m.group(1)) >= n_layers:
      raise CheckpointError(f"{where}: tensor {name!r} is past the model's {n_layers} layers "
                            f"({layers_key})")
    if (m or refuse_unread) and name in unread:
      raise CheckpointError(f"{where}: tensor {name!r} is not read{unread_tail}")
  known = {name for name, _, _ in expected}
  for name in shapes:
    if name not in known and not (ignored and re.fullmatch(ignored, name)):
      raise CheckpointError(f"{where}: tensor {name!r} is not one {model} reads, so loading "
                            f"would drop it (an unsupported feature of this checkpoint)")
