"""Tensor parallelism over a mesh's `model` axis, for the Llama family (Megatron-style).

  mesh = jax.make_mesh((1, 4), ("data", "model"))        # or o1jax.sharding.make_mesh
  engine = Engine(model, tokenizer, config, mesh=mesh)   # same API, same tokens

What each device holds (`param_spec`):
  column-parallel  wq, wk, wv, w_gate, w_up (and bq, bk, bv): the columns of its
                   heads / FFN units, so attention and the gated product run on
                   local heads with no communication;
  row-parallel     wo, w_down: the rows that multiply its local heads / units; the
                   partial products are summed by one all-reduce per matrix;
  replicated       embeddings, norms (and QK-norm weights, per head dim), the head.
The paged KV pools are split by KV heads (`POOL_SPEC`), so a step reads only its
local heads' pages. XLA's SPMD partitioner inserts the two all-reduces per layer
from these input shardings; the kernels that XLA cannot partition (the native CPU
ones) run per shard under `shard_map` (`pallas_kernels.ops`, from the mesh that the
engine sets while it traces).

Quantized weights split the same way: a QuantizedTensor's packed values, scales and
minima are all [rows, N], so a column split is a split of N and a row split one of
whole groups (K / tp must be a multiple of the group size); each matrix records its
split (`QuantizedTensor.split`), a row split's 4-bit codes are packed per device, and
the Pallas kernels (GPU) run on each device's part under `shard_map`.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from o1jax.checkpoint.params import FUSED_PARTS
from o1jax.sharding.topology import repeated_device
from pallas_kernels.ops import MODEL_AXIS  # (the kernels' shard_map splits heads over it)

COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
COLUMN_BIAS = ("bq", "bk", "bv")
ROW = ("wo", "w_down")
FUSED = tuple(FUSED_PARTS)  # int8 matmuls' fused matrices: their columns interleave
POOL_SPEC = P(None, None, MODEL_AXIS, None)  # [num_blocks, block_size, kv_heads, head_dim]
SCALE_SPEC = P(None, None, MODEL_AXIS)  # FP8 pools' scales [num_blocks, block_size, kv_heads]
CONTIGUOUS_SPEC = P(None, MODEL_AXIS, None, None)  # a contiguous cache [batch, kv_heads, S, D]


class ShardingError(ValueError):
  """A model, a mesh or a setting that tensor parallelism cannot split."""


def check_mesh(mesh) -> None:
  """A mesh one model runs on (a one-line ShardingError otherwise): a jax.sharding.Mesh of
  distinct devices with a `model` axis and no other axis over more than one device. (A
  make_mesh(model=2) of 8 devices, data=4, ran the model four times over, each copy on its
  own devices, for nothing; a device listed twice failed in JAX with a bare AssertionError;
  a str or a device list, with an AttributeError.)"""
  if not isinstance(mesh, Mesh):
    raise ShardingError(f"mesh must be a jax.sharding.Mesh with a {MODEL_AXIS!r} axis, got "
                        f"{type(mesh).__name__}")
  if MODEL_AXIS not in mesh.axis_names:
    raise ShardingError(f"mesh axes {tuple(mesh.axis_names)} have no {MODEL_AXIS!r} axis")
  others = [f"{a}={n}" for a, n in mesh.shape.items() if a != MODEL_AXIS and n > 1]
  if others:
    raise ShardingError(f"mesh has {', '.join(others)}: one model runs over the mesh's "
                        f"{MODEL_AXIS!r} axis, and every other axis' devices would hold a copy "
                        f"of it doing the same work; give one group (group_mesh(tp)), or "
                        f"data_parallel=N for replicas (build_engine)")
  if (twice := repeated_device(mesh.devices.flat)) is not None:
    raise ShardingError(f"mesh lists device {twice} twice: each shard needs a device of its own")


def auto_mesh(mesh: Mesh) -> Mesh:
  """The mesh (checked: `check_mesh`) with every axis in Auto mode: XLA's partitioner
  propagates the weights' and pools' shardings through the model (explicit axes would
  ask every op to say how its output is split)."""
  check_mesh(mesh)
  auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
  return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def group_meshes(tp: int, devices=None, topology="auto") -> list[Mesh]:
  """(data=1, model=tp) meshes, one per tensor-parallel group that `make_mesh` places on
  the best links among `devices` (default: all), best first. The groups are chosen from
  all the devices, the rest left out (tp=3 on 8: two groups of 3); cutting the device list
  to a multiple of tp first put a group over SYS next to a free NVLink island."""
  from o1jax.sharding.topology import TopologyError, make_mesh

  devices = list(jax.devices() if devices is None else devices)
  if tp > len(devices):
    raise TopologyError(f"tensor_parallel={tp} needs {tp} devices; this process has "
                        f"{len(devices)}")
  full = make_mesh(model=tp, devices=devices, topology=topology, spare=True)
  return [Mesh(full.devices[i:i + 1], full.axis_names) for i in range(full.devices.shape[0])]


def group_mesh(tp: int, devices=None) -> Mesh:
  """The first of `group_meshes`: where one model split over tp devices runs."""
  return group_meshes(tp, devices)[0]


def tensor_parallel_size(mesh: Mesh | None) -> int:
  return 1 if mesh is None or MODEL_AXIS not in mesh.axis_names else int(mesh.shape[MODEL_AXIS])


def check_heads_split(config, tp: int) -> None:
  """The model's heads, KV heads and FFN units split evenly over `tp` devices (a one-line
  ShardingError naming what does not); a launcher checks this from a checkpoint's header."""
  for name, value in (("n_heads", config.n_heads), ("n_kv_heads", config.n_kv_heads),
                      ("ffn_dim", config.ffn_dim)):
    if value % tp:
      raise ShardingError(f"tensor parallelism {tp}: {config.name or 'the model'}'s "
                          f"{name}={value} is not a multiple of it")


def check_tensor_parallel(config, mesh: Mesh, group_size: int | None = None) -> int:
  """The model axis' size, after checking the model splits evenly over it (one-line
  ShardingError naming what does not)."""
  check_mesh(mesh)
  tp = tensor_parallel_size(mesh)
  check_heads_split(config, tp)
  if group_size:
    for name, k in (("n_heads * head_dim", config.n_heads * config.head_dim),
                    ("ffn_dim", config.ffn_dim)):
      if (k // tp) % group_size:
        raise ShardingError(f"tensor parallelism {tp}: the row-parallel matrices' {name}={k} "
                            f"does not split into whole quantization groups of {group_size}")
  return tp


def _names(path) -> list[str]:
  out = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        out.append(str(getattr(key, attr)))
        break
  return out


def param_spec(path, leaf) -> P:
  """The PartitionSpec of one leaf of a Llama's NNX state, from its path."""
  names = _names(path)
  if any(n in FUSED for n in names):
    raise ShardingError(f"{'.'.join(names)}: fused matrices (matmul_dtype='int8') cannot be "
                        f"split by heads; use float32 or bfloat16 matmuls with a mesh")
  ndim = getattr(leaf, "ndim", 0)
  if any(n in COLUMN or n in ROW for n in names) and ndim != 2:
    # int8 matmuls' VNNI tiles (unfused where q/k/v or gate/up differ in type) were left
    # whole on every device: the model replicated, gathered each step.
    raise ShardingError(f"{'.'.join(names)}: int8 matmul tiles (matmul_dtype='int8') cannot "
                        f"be split by heads; use float32 or bfloat16 matmuls with a mesh")
  if any(n in COLUMN for n in names) and ndim == 2:
    return P(None, MODEL_AXIS)
  if any(n in ROW for n in names) and ndim == 2:
    return P(MODEL_AXIS, None)
  if any(n in COLUMN_BIAS for n in names) and ndim == 1:
    return P(MODEL_AXIS)
  return P()


def _mark_split(w, names: list[str], tp: int, with_split):
  """A quantized matrix with the split `param_spec` gives it (replicated ones unchanged)."""
  if any(n in COLUMN for n in names):
    return with_split(w, "columns", tp)
  if any(n in ROW for n in names):
    return with_split(w, "rows", tp)
  return w


def _check_kernel_part(w, names: list[str]) -> None:
  """backend="pallas": each device's part of a split matrix must be one the kernels tile
  (a ShardingError naming it now, not the kernel's error at the first forward)."""
  from pallas_kernels.quantized_matmul import device_part_error

  why = device_part_error(w) if w.split is not None and w.split[1] > 1 else None
  if why:
    where = '.'.join(name for name in names if name not in ('value', 'matrix'))
    raise ShardingError(f"{where}: tensor parallelism {w.split[1]}: a device's part "
                        f"{w.part_shape} does not "
                        f"suit the Pallas kernel ({why}); use backend 'auto' (XLA's product "
                        f"there) or fewer devices")


def _split_fused_quantized(model):
  """`model` with its fused quantized q/k/v and gate/up matrices (the Llama's, one kernel
  call each on one device) split back into their parts (`split_fused`, as the loaders
  split a checkpoint's): a column split of [q | k | v] would give a device another head's
  columns."""
  from flax import nnx

  from o1jax.checkpoint.params import split_fused
  from o1jax.model.llama import Weight
  from pallas_kernels.fp8_activations import Fp8ActivationWeight
  from pallas_kernels.quantized_tensor import QuantizedTensor

  c = model.config
  # FP8 inputs (matmul_dtype="float8") wrap the fused matrix: split inside, wrap each part
  # (they were refused as int8 tiles).
  inner = lambda w: w.matrix if isinstance(w, Fp8ActivationWeight) else w
  for layer in model.layers:
    values = {name: getattr(layer, name, None) for name in FUSED_PARTS}
    # (int8 matmuls' fused tiles are refused by `param_spec`)
    fused = {name: w.get_value() for name, w in values.items()
             if w is not None and isinstance(inner(w.get_value()), QuantizedTensor)}
    if not fused:
      continue
    for name in fused:
      setattr(layer, name, None)
    parts = split_fused({name: inner(w) for name, w in fused.items()}, c.n_heads * c.head_dim,
                        c.n_kv_heads * c.head_dim, c.ffn_dim)
    fp8 = any(isinstance(w, Fp8ActivationWeight) for w in fused.values())
    for name, value in parts.items():  # (nnx.data: the attribute was None, a static one)
      setattr(layer, name, nnx.data(Weight(Fp8ActivationWeight(value) if fp8 else value)))
  return model


def shard_model(model, mesh: Mesh):
  """The model with every weight placed on the mesh as `param_spec` says (a new module;
  the argument is left as it was)."""
  from flax import nnx

  from pallas_kernels.f32_matmul import TiledF32Weight, unpack as unpack_f32
  from pallas_kernels.quantized_tensor import QuantizedTensor, with_split

  quantized = lambda x: isinstance(x, QuantizedTensor)
  groups = {x.group_size for x in jax.tree.leaves(nnx.state(model), is_leaf=quantized)
            if quantized(x)}
  tp = check_tensor_parallel(model.config, mesh, max(groups) if groups else None)
  graphdef, state = nnx.split(model)
  model = _split_fused_quantized(nnx.merge(graphdef, state))  # (a copy: the argument stays)
  graphdef, state = nnx.split(model)
  # The native f32 kernel's tiles go back to [K, N] arrays: XLA partitions those.
  tiled = lambda x: isinstance(x, TiledF32Weight)
  state = jax.tree.map(lambda x: unpack_f32(x) if tiled(x) else x, state, is_leaf=tiled)
  # Quantized matrices say how they split: the Pallas kernels run on each device's part
  # (pallas_kernels.ops), and a row split's 4-bit codes are packed per device, so a
  # device's rows are its own codes (packed over the whole K, XLA moved codes between
  # devices on every product: 6 all-to-alls a layer at TP=2).
  state = jax.tree_util.tree_map_with_path(
      lambda path, x: _mark_split(x, _names(path), tp, with_split) if quantized(x) else x,
      state, is_leaf=quantized)
  if getattr(model, "backend", "auto") == "pallas":  # (auto: XLA's product where it cannot)
    jax.tree_util.tree_map_with_path(
        lambda path, x: _check_kernel_part(x, _names(path)) if quantized(x) else x,
        state, is_leaf=quantized)
  graphdef, state = nnx.split(nnx.merge(graphdef, state))
  shardings = jax.tree_util.tree_map_with_path(
      lambda path, leaf: NamedSharding(mesh, param_spec(path, leaf)), state)
  return nnx.merge(graphdef, jax.device_put(state, shardings))


def shard_pools(cache, mesh: Mesh):
  """A PagedKVCache with its pools split by KV heads (block tables replicated)."""
  pool = NamedSharding(mesh, POOL_SPEC)
  scale = NamedSharding(mesh, SCALE_SPEC)
  replicated = NamedSharding(mesh, P())
  put = lambda xs, s: None if xs is None else tuple(jax.device_put(x, s) for x in xs)
  return cache.replace(k_pages=put(cache.k_pages, pool), v_pages=put(cache.v_pages, pool),
                       k_scale=put(cache.k_scale, scale), v_scale=put(cache.v_scale, scale),
                       block_tables=jax.device_put(cache.block_tables, replicated),
                       write_lens=jax.device_put(cache.write_lens, replicated))


def shard_contiguous(cache, mesh: Mesh):
  """A contiguous KVCache (k, v [B, KVH, S, D] per layer) split by KV heads."""
  spec = NamedSharding(mesh, CONTIGUOUS_SPEC)
  return cache.replace(k=tuple(jax.device_put(x, spec) for x in cache.k),
                       v=tuple(jax.device_put(x, spec) for x in cache.v))


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute")


class DecodeCollectives:
  """Counts the collective ops in an engine's compiled decode step on a mesh.

  Installed before the engine runs, it records the first decode call's argument shapes
  and shardings (host inputs stay uncommitted); `counts()` then lowers and compiles that
  program once more and counts each collective in its HLO text. The engine is duck-typed
  (its `_decode_jit`, which lowers as a jitted function does, and `mesh`), so this
  package stays a leaf."""

  def __init__(self, engine):
    self._engine = engine
    self._decode = engine._decode_jit
    self._args = None
    engine._decode_jit = self._record

  def _record(self, *args):
    if self._args is None:
      self._args = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if isinstance(
              x.sharding, NamedSharding) else None) if isinstance(x, jax.Array) else x, args)
    return self._decode(*args)

  def counts(self) -> dict[str, int]:
    if self._args is None:
      raise RuntimeError("the engine has not run a decode step yet")
    with jax.set_mesh(self._engine.mesh):
      text = self._decode.lower(*self._args).compile().as_text()
    return {op: text.count(f" {op}(") for op in COLLECTIVES}
