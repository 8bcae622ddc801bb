"""The tensor-table check both checkpoint loaders run before reading a weight: the file's
tensors against the ones a config reads (`gguf_loader`, `safetensors_loader`)."""

from __future__ import annotations

import re

from o1jax.checkpoint.errors import CheckpointError


def check_tensors(where, expected, shapes: dict, n_layers: int, layer_pattern: str, *,
                  layers_key: str, unread_tail: str, shown=lambda shape: shape,
                  check_unread: bool = False, check=None) -> None:
  """Every tensor the model reads is present with the shape the config gives it, and no
  layer tensor is left unread (a layer count or a bias switch that disagrees with the file
  would otherwise load a different model without a word).

  expected: (name, shape, read) of every tensor a file of the config may hold, in read
  order; shapes: {name: shape} of the file's tensors; layer_pattern: a regex whose group 1 is
  a layer tensor's layer index; layers_key: the config key the layer count comes from;
  unread_tail: what follows "is not read" (why); shown: a shape as messages print it;
  check_unread: also check the shape of a tensor present but not read; check(name, shape):
  the loader's own check of each tensor whose shape matched."""
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
    if m and name in unread:
      raise CheckpointError(f"{where}: tensor {name!r} is not read{unread_tail}")
