"""The parameter tree every loader produces, and a flat form for storage.

Tree: {"embed": W[d_model, vocab], "layers": [{name: W}], "final_norm": [d],
"lm_head": W[d_model, vocab] (untied only)}; each W is a dense array or a
`QuantizedTensor`, always in the [in_features, out_features] layout.

The flat form maps "layers.3.wq.packed"-style names to numpy arrays, plus a
JSON-able spec recording which weights are quantized (bits, group size), so
the tree can be rebuilt exactly from any key/value store (orbax, safetensors).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized_tensor import QuantizedTensor, map_columns

Params = dict[str, Any]


def flatten(params: Params) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  arrays: dict[str, np.ndarray] = {}
  spec: dict[str, Any] = {"quantized": {}, "n_layers": len(params["layers"])}

  def put(name, value):
    if isinstance(value, QuantizedTensor):
      if value.split is not None:  # (its codes may be packed per device)
        raise ValueError(f"{name}: a matrix split over a mesh ({value.split}) cannot be "
                         f"stored; store the model's parameters before sharding it")
      spec["quantized"][name] = {"bits": value.bits, "group_size": value.group_size,
                                 "has_minimum": value.minimum is not None}
      arrays[name + ".packed"] = np.asarray(value.packed)
      arrays[name + ".scale"] = np.asarray(value.scale)
      if value.minimum is not None:
        arrays[name + ".minimum"] = np.asarray(value.minimum)
    else:
      arrays[name] = np.asarray(value)

  for key, value in params.items():
    if key == "layers":
      for i, layer in enumerate(value):
        for name, w in layer.items():
          put(f"layers.{i}.{name}", w)
    else:
      put(key, value)
  return arrays, spec


def unflatten(arrays: dict[str, Any], spec: dict[str, Any]) -> Params:
  quantized = spec["quantized"]
  consumed = set()

  def get(name):
    if name in quantized:
      q = quantized[name]
      parts = [name + ".packed", name + ".scale"] + ([name + ".minimum"] if q["has_minimum"] else [])
      consumed.update(parts)
      return QuantizedTensor(packed=arrays[parts[0]], scale=arrays[parts[1]],
                             minimum=arrays[parts[2]] if q["has_minimum"] else None,
                             bits=int(q["bits"]), group_size=int(q["group_size"])).validate(name)
    consumed.add(name)
    return arrays[name]

  names = {k.rsplit(".", 1)[0] if k.rsplit(".", 1)[0] in quantized else k for k in arrays}
  n_layers = spec["n_layers"]
  # (a layer holds at least one array: a count past them built 10**12 dicts first)
  if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 0 <= n_layers <= len(arrays):
    raise ValueError(f"n_layers={n_layers!r} must be an int in [0, {len(arrays)}] (the arrays)")
  params: Params = {"layers": [dict() for _ in range(n_layers)]}
  for name in sorted(names):
    if name.startswith("layers."):
      _, i, wname = name.split(".", 2)
      # The index as `flatten` writes it: int() also read "01", "+1", " 1" and other
      # scripts' digits, and the last of two spellings of one weight replaced the other.
      if not (i.isascii() and i.isdigit() and str(int(i)) == i and int(i) < n_layers):
        raise ValueError(f"array {name!r}: {i!r} is not a layer index in [0, {n_layers})")
      params["layers"][int(i)][wname] = get(name)
    else:
      params[name] = get(name)
  # An array the spec gives no place (a minimum its spec says the matrix has not) or a
  # layer without arrays: the spec and the arrays are of different models.
  unused = sorted(set(arrays) - consumed)
  if unused:
    raise ValueError(f"array {unused[0]!r} is not part of any weight the spec describes")
  empty = next((i for i, layer in enumerate(params["layers"]) if not layer), None)
  if empty is not None:
    raise ValueError(f"layer {empty} of the spec's n_layers={spec['n_layers']} has no arrays")
  return params


def device_array(x) -> jax.Array:
  """`jnp.asarray` without its per-shape copy program (a compile per new shape: ~50 ms
  each, 1.5 s of the embedded model's load): host arrays are transferred as they are."""
  return x if isinstance(x, jax.Array) else jax.device_put(np.asarray(x))


def to_device(params: Params, dtype=None) -> Params:
  """numpy tree -> jax arrays (dense float weights optionally cast to `dtype`)."""
  def move(x):
    x = device_array(x)
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
      x = x.astype(dtype)
    return x

  def move_weight(w):
    if isinstance(w, QuantizedTensor):
      return jax.tree.map(device_array, w)
    return move(w)

  out = {k: move_weight(v) for k, v in params.items() if k != "layers"}
  out["layers"] = [{k: move_weight(v) for k, v in layer.items()} for layer in params["layers"]]
  return out


# Matrices that read the same input, one fused matrix each: Phi-3 stores them so (columns
# q, k, v / gate, up in our [in, out] layout; split at load, the model holds them apart)
# and the model's int8 path fuses them again for its kernel.
FUSED_PARTS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def take_columns(w, index):
  """Columns `index` (a slice or an index array) of a [K, N] weight, dense or quantized
  (codes packed along K, so columns are independent); a device array stays on its device."""
  take = lambda a: (None if a is None else a[..., index] if isinstance(a, jax.Array)
                    else np.ascontiguousarray(np.asarray(a)[..., index]))
  if isinstance(w, QuantizedTensor):
    return map_columns(w, take)
  return take(w)


def split_columns(w, widths):
  """A [K, N] weight cut into consecutive column blocks of `widths`."""
  edges = np.cumsum([0, *widths])
  return [take_columns(w, slice(lo, hi)) for lo, hi in zip(edges[:-1], edges[1:])]


def split_fused(layer: dict, q: int, kv: int, ffn: int) -> dict:
  """A layer's fused matrices (FUSED_PARTS) split in place into the model's names."""
  for fused, parts in FUSED_PARTS.items():
    if fused in layer:
      widths = (q, kv, kv) if fused == "wqkv" else (ffn, ffn)
      layer.update(zip(parts, split_columns(layer.pop(fused), widths)))
  return layer
