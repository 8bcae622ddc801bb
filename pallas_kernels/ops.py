"""Public ops: validate inputs and pick a backend — the one place that chooses.

`backend="auto"` uses the Pallas kernel on GPU; on a CPU the native kernel where
one is built and fits (paged decode attention over f32/bf16 pools, bf16 pool
writes: `pallas_kernels.native`), else the XLA reference. `"pallas"` forces the
kernel (with `interpret=True` it runs on CPU for tests); `"reference"` forces the
XLA path. Bad shapes/dtypes raise ValueError naming the offending shapes,
whatever the backend."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels import f32_matmul as f32m
from pallas_kernels import fp8_activations as fp8
from pallas_kernels import native
from pallas_kernels import paged_attention as pa
from pallas_kernels import prefill_attention as fa
from pallas_kernels import quantized_matmul as qmm
from pallas_kernels import vnni_matmul as vm
from pallas_kernels.f32_matmul import TiledF32Weight
from pallas_kernels.fp8_activations import Fp8ActivationWeight
from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize_columns
from pallas_kernels.vnni_matmul import VnniWeight

BACKENDS = ("auto", "pallas", "reference")
log = logging.getLogger(__name__)


def resolve_backend(backend: str) -> str:
  """'auto' -> 'pallas' on GPU, 'reference' elsewhere; validates the name."""
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r} not in {BACKENDS}")
  if backend == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "reference"
  return backend


def check_backend_runs_here(backend: str, interpret: bool = False) -> None:
  """A model about to run (not merely be lowered for another platform): the compiled Pallas
  kernels need a GPU; on a CPU JAX refuses them at the first call ("Only interpret mode is
  supported on CPU backend"), which names neither the setting nor what to do."""
  resolve_backend(backend)  # (validates the name)
  if backend == "pallas" and not interpret and _on_cpu():
    raise ValueError("backend='pallas' runs the Pallas kernels compiled for a GPU, and this "
                     "machine has none (a CPU runs them only interpreted, for tests): use "
                     "backend 'auto' (this CPU's native kernels) or 'reference'")


def pallas_block_size_ok(block_size: int) -> bool:
  """Whether the Pallas paged-attention kernels take pages of `block_size` tokens (a power
  of two in [8, 128]); the engine checks its config with this before building a pool."""
  return not block_size & (block_size - 1) and 8 <= block_size <= 128


def pallas_head_dim_ok(head_dim: int) -> bool:
  """Whether the Pallas attention kernels take heads of `head_dim` (a power of two >= 16:
  Triton's tiles)."""
  return head_dim >= 16 and not head_dim & (head_dim - 1)


def _on_cpu() -> bool:
  return jax.default_backend() == "cpu"


def _attention_backend(requested: str, k_pages) -> str:
  """The attention backend: 'auto' takes XLA's attention where the Pallas kernels cannot
  tile the pool (a head_dim that is not a power of two >= 16: Phi-3's 96, 80; a block size
  outside [8, 128]), as `quantized_matmul` takes XLA's product for weights its kernel
  cannot tile (on a GPU every such model failed at its first prefill)."""
  backend = resolve_backend(requested)
  if requested == "auto" and backend == "pallas" and getattr(k_pages, "ndim", 0) == 4:
    _, bs, _, d = k_pages.shape
    if not (pallas_block_size_ok(bs) and pallas_head_dim_ok(d)):
      return "reference"
  return backend


# The mesh axis tensor parallelism splits heads over (o1jax/sharding/tensor_parallel.py).
MODEL_AXIS = "model"


def _model_axis_size() -> int:
  """Devices on the current mesh's `model` axis (1: no mesh, or no such axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty or MODEL_AXIS not in mesh.axis_names else mesh.shape[MODEL_AXIS]


def _per_model_shard(fn, in_specs, out_specs):
  """fn, or fn run per shard of the current mesh's `model` axis: XLA cannot partition
  a native custom call or a Pallas call, and would gather every operand to each device
  around it."""
  if _model_axis_size() == 1:
    return fn
  return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs,
                       out_specs=out_specs, check_vma=False)


_HEADS = P(None, MODEL_AXIS, None)  # q [B, H, D], rows [R, KVH, D]: split by heads
_CHUNK_HEADS = P(None, None, MODEL_AXIS, None)  # a prefill chunk's q [B, T, H, D]
_POOL = P(None, None, MODEL_AXIS, None)  # pools [NB, BS, KVH, D]: split by KV heads


def _scale_spec(scale):
  """FP8 pools' per-token scales [NB, BS, KVH] split with their heads; None: no scales."""
  return None if scale is None else P(None, None, MODEL_AXIS)


def _dtype_name(dtype) -> str:
  return np.dtype(dtype).name


# --- a model's matrices ------------------------------------------------------------

_HIGHEST = jax.lax.Precision.HIGHEST
# A bf16 x bf16 dot with f32 accumulation takes XLA's fast CPU path (AMX /
# AVX512-BF16) only from this many rows: one row runs ~6x slower than f32, and
# two rows round differently from three or more. Fewer rows are zero-padded,
# so a row's result never depends on how many other rows are in the batch.
BF16_MIN_ROWS = 4


# Dense f32 weights up to this size when the XLA reference computes: on a CPU,
# dequantizing every weight on every decode step costs ~10x the matmuls.
DENSE_WEIGHTS_LIMIT_BYTES = 4 << 30


def dense_weights_preferred(backend: str, dense_bytes: int) -> bool:
  """Whether a model should dequantize its 4-/8-bit matrices once at load: where the
  XLA reference computes, a dense f32 dot is faster than dequantizing tile by tile on
  every call, as long as the f32 weights (`dense_bytes`) fit DENSE_WEIGHTS_LIMIT_BYTES.
  The Pallas kernel reads the quantized weights itself."""
  return resolve_backend(backend) == "reference" and dense_bytes <= DENSE_WEIGHTS_LIMIT_BYTES


def matmul(x: jax.Array, w, *, backend: str = "auto", interpret: bool = False) -> jax.Array:
  """x [..., K] @ w [K, N] -> [..., N], by what the weight is (the model prepared it):

  - `VnniWeight`: `int8_matmul` (two int8 levels of x per block of 32; f32 out);
  - `TiledF32Weight`: `tiled_f32_matmul` (f32 math; the native kernel on a CPU);
  - `QuantizedTensor`: `quantized_matmul` (Pallas on GPU, the XLA reference elsewhere);
  - `Fp8ActivationWeight`: `fp8_activation_matmul` (x rounded to e4m3 per row, then
    the wrapped matrix's product);
  - a bf16 array: `bf16_matmul` (x rounded to bf16, f32 accumulation and output);
  - any other array: cast to x's dtype, full precision (exact f32 math for f32 x)."""
  if isinstance(w, Fp8ActivationWeight):
    return fp8_activation_matmul(x, w, backend=backend, interpret=interpret)
  if isinstance(w, VnniWeight):
    return int8_matmul(x, w, backend=backend).astype(x.dtype)
  if isinstance(w, TiledF32Weight):
    return tiled_f32_matmul(x, w, backend=backend).astype(x.dtype)
  if isinstance(w, QuantizedTensor):
    return quantized_matmul(x, w, backend=backend, interpret=interpret)
  resolve_backend(backend)
  if w.dtype == jnp.bfloat16:
    return bf16_matmul(x, w)
  return jnp.dot(x, w.astype(x.dtype), precision=_HIGHEST)


def fp8_activation_matmul(x: jax.Array, w: Fp8ActivationWeight, *, backend: str = "auto",
                          interpret: bool = False) -> jax.Array:
  """x [..., K] rounded to float8_e4m3fn under a per-row scale (`fp8_activations`), times
  the wrapped matrix: a `QuantizedTensor` through `quantized_matmul` (its FP8 input
  path), f32 tiles through `tiled_f32_matmul`, a dense array by an exact-product dot with
  f32 accumulation. Output: x's dtype."""
  inner = w.matrix
  k = inner.shape[0]
  if x.shape[-1] != k:
    raise ValueError(f"fp8_activation_matmul: x.shape={x.shape} does not match "
                     f"W.shape={tuple(inner.shape)}")
  x8, scale = fp8.quantize_rows(x)
  if isinstance(inner, QuantizedTensor):
    y = quantized_matmul(x8, inner, x_scale=scale, out_dtype=jnp.float32, backend=backend,
                         interpret=interpret)
  elif isinstance(inner, TiledF32Weight):  # e4m3 widens exactly to f32
    y = tiled_f32_matmul(x8.astype(jnp.float32), inner, backend=backend) * scale[..., None]
  else:
    resolve_backend(backend)
    y = fp8.dense_matmul(x8, scale, inner)
  return y.astype(x.dtype)


def embedding_rows(table, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Columns `ids` [N] of a [d_model, vocab] weight (the output head's layout), as rows
  [N, d_model] in `dtype`; the weight says how (quantized: those columns dequantized;
  native f32 tiles; dense)."""
  if isinstance(table, QuantizedTensor):
    return dequantize_columns(table, ids, dtype)
  if isinstance(table, TiledF32Weight):
    return f32m.columns(table, ids).astype(dtype)
  return jnp.take(table, ids, axis=1).T.astype(dtype)


def bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., K] (rounded to bf16) @ w [K, N] bf16, accumulated in f32 -> f32 [..., N]."""
  lead, k = x.shape[:-1], x.shape[-1]
  rows = int(np.prod(lead, dtype=np.int64))
  x2 = x.reshape(rows, k).astype(jnp.bfloat16)
  if rows < BF16_MIN_ROWS:
    x2 = jnp.pad(x2, ((0, BF16_MIN_ROWS - rows), (0, 0)))
  y = jnp.dot(x2, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  return y[:rows].reshape(*lead, w.shape[-1])


def tiled_f32_preferred(backend: str = "auto") -> bool:
  """Whether a model with float32 matmuls should store its matrices as `TiledF32Weight`:
  with backend "auto" where the native f32 kernel runs (a CPU with a fused multiply-add,
  kernels built). With AVX-512 it costs 0.97x XLA's dot at one row, 0.55x at 4-16 rows (a
  decode batch, a verify call), 0.61x at 32, 0.83x at 128 and 0.93x at 512 (prefill chunks;
  scripts/bench_f32_matmul.py, docs/measurements/2026-12-02_f32_matmul.md; 1.01-1.05x at
  512 on 2026-12-05); the AVX2 build 0.43-0.96x at 1-16 rows, 0.84-0.98x at 32-128 and
  1.02-1.08x at 512 (docs/measurements/2026-12-05_native_kernels_cpu.md). Used at every row count all the same:
  its rows do not depend on the batch, XLA's do."""
  resolve_backend(backend)
  return backend == "auto" and _on_cpu() and native.f32_matmul_available()


def tiled_f32_matmul(x: jax.Array, w: TiledF32Weight, *, backend: str = "auto") -> jax.Array:
  """x [..., K] @ w -> f32 [..., N]: the native kernel where it runs, else XLA's dot
  on the unpacked weight (backend "reference" forces that)."""
  k, n = w.shape
  if x.shape[-1] != k:
    raise ValueError(f"tiled_f32_matmul: x.shape={x.shape} does not match W.shape={w.shape}")
  resolve_backend(backend)
  lead = x.shape[:-1]
  x2 = x.reshape(-1, k).astype(jnp.float32)
  if backend != "reference" and _on_cpu() and native.f32_matmul_available():
    y = native.f32_matmul(x2, w.tiles)
    y = y if y.shape[-1] == n else y[:, :n]
  else:
    y = f32m.tiled_matmul_reference(x2, w)
  return y.reshape(*lead, n)


def int8_matmul(x: jax.Array, w: VnniWeight, *, backend: str = "auto") -> jax.Array:
  """x [..., K] @ w -> f32 [..., N] (`pallas_kernels.vnni_matmul`): the native kernel
  where it runs (a CPU with AVX512-VNNI (+ AMX) or AVX2, kernels built), else the XLA
  reference; backend "reference" forces the reference."""
  k, n = w.shape
  if x.shape[-1] != k:
    raise ValueError(f"int8_matmul: x.shape={x.shape} does not match W.shape={w.shape}")
  resolve_backend(backend)
  lead = x.shape[:-1]
  x2 = x.reshape(-1, k).astype(jnp.float32)
  if backend != "reference" and _on_cpu() and native.int8_matmul_available():
    y = native.int8_matmul(x2, w.packed, w.scale, w.minimum, bits=w.bits, zero=w.zero,
                           has_min=w.has_min, lut=w.lut)[:, :n]
  else:
    if backend == "auto" and _on_cpu():
      _warn_int8_fallback()
    y = vm.vnni_matmul_reference(x2, w)
  return y.reshape(*lead, n)


def fastest_matmul_dtype() -> str:
  """The Llama `matmul_dtype` that decodes fastest on the default device (what the configs'
  `fast=True` picks): "int8" where the native int8 kernel runs (VNNI/AMX: ~2.5x float32
  decode; AVX2: 2.3x at batch 1, about even at 8,
  docs/measurements/2026-12-05_native_kernels_cpu.md); "float32" on any other CPU, where the
  XLA int8 reference is 4-8x slower than float32 and bf16 (without AVX512-BF16) slower too
  (docs/measurements/2026-12-01_fast_numerics.md); "bfloat16" on accelerators (bf16 tensor
  cores)."""
  if not _on_cpu():
    return "bfloat16"
  return "int8" if native.int8_matmul_available() else "float32"


_int8_fallback_warned = False


def _warn_int8_fallback() -> None:
  """Once per process: int8 matmuls asked for on a CPU where only the slow XLA version runs."""
  global _int8_fallback_warned
  if not _int8_fallback_warned:
    _int8_fallback_warned = True
    why = native.unavailable_reason() or "this CPU has neither AVX512-VNNI nor AVX2"
    log.warning("matmul_dtype=int8 runs the XLA reference here, several times slower than the "
                "native kernel (%s); float32 or bfloat16 matmuls are faster on this machine", why)


# --- quantized matmul --------------------------------------------------------------


def quantized_matmul(x: jax.Array, w: QuantizedTensor, *, backend: str = "auto",
                     interpret: bool = False, x_scale: jax.Array | None = None,
                     out_dtype=None, block_m: int | None = None, block_n: int | None = None,
                     k_splits: int | None = None, kernel: str = "auto") -> jax.Array:
  """y = x @ dequant(W): x [..., K], W logical [K, N] -> [..., N].

  x: bf16/f16/f32, or float8_e4m3fn with `x_scale` ([...] or [..., 1]; the real
  activation row is x * x_scale). Output dtype: `out_dtype`, else x's dtype
  (bf16 for FP8). The Pallas path has two kernels: "dot" (tensor-core tiles) and
  "gemv" (M <= GEMV_ROW_LIMIT rows, no dot); `kernel="auto"` takes "gemv" for
  M <= qmm.GEMV_MAX_ROWS. block_m/block_n/k_splits override the tiling."""
  if kernel not in ("auto", "dot", "gemv"):
    raise ValueError(f"quantized_matmul: kernel={kernel!r} not in ('auto', 'dot', 'gemv')")
  w.validate("quantized_matmul: W")
  k, n = w.shape
  if x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(f"quantized_matmul: x.shape={x.shape} does not match W.shape={w.shape}")
  if x.dtype not in qmm.ACT_DTYPES:
    raise ValueError(f"quantized_matmul: x.dtype={_dtype_name(x.dtype)} (x.shape={x.shape}) "
                     f"not in {[_dtype_name(d) for d in qmm.ACT_DTYPES]}")
  lead = x.shape[:-1]
  if x.dtype in qmm.FP8_DTYPES and x_scale is None:
    raise ValueError(f"quantized_matmul: FP8 x (shape {x.shape}) needs x_scale of shape {lead}")
  if x_scale is not None and x_scale.shape not in (lead, lead + (1,)):
    raise ValueError(f"quantized_matmul: x_scale.shape={x_scale.shape} must be {lead} or "
                     f"{lead + (1,)} for x.shape={x.shape}")
  requested, backend = backend, resolve_backend(backend)
  if backend == "pallas":
    # Split over the mesh, the kernel runs on each device's part (`_per_device_part`); a
    # split for another mesh (or none) is XLA's to partition.
    parts = w.split[1] if w.split is not None else 1
    why = (f"split={w.split} but the mesh's {MODEL_AXIS!r} axis has {_model_axis_size()} "
           f"device(s)" if parts > 1 and parts != _model_axis_size()
           else qmm.device_part_error(w))
    if why is not None and requested == "pallas":
      raise ValueError(f"quantized_matmul (pallas): W.shape={w.shape}: {why}")
    if why is not None:  # auto: shapes the kernel cannot tile stay on XLA
      backend = "reference"
  m = int(np.prod(lead, dtype=np.int64))
  if (backend == "pallas" and requested == "auto" and qmm.PALLAS_MAX_ROWS is not None
      and m > qmm.PALLAS_MAX_ROWS):
    backend = "reference"  # measured faster than the kernels there (bench_kernels.py)
  if backend == "reference":
    return qmm.quantized_matmul_reference(x, w, x_scale, out_dtype)
  x2 = x.reshape(m, k)
  xs2 = None if x_scale is None else x_scale.reshape(m)
  if m == 0:
    dt = out_dtype or (jnp.bfloat16 if x.dtype in qmm.FP8_DTYPES else x.dtype)
    return jnp.zeros(lead + (n,), dt)
  if kernel == "auto":  # (a block_m is a dot-kernel tiling)
    kernel = "gemv" if m <= qmm.GEMV_MAX_ROWS and block_m is None else "dot"
  if kernel == "gemv":
    if m > qmm.GEMV_ROW_LIMIT or block_m is not None:
      raise ValueError(f"quantized_matmul: kernel='gemv' takes M <= {qmm.GEMV_ROW_LIMIT} rows "
                       f"and no block_m (got M={m}, block_m={block_m})")
    run = functools.partial(qmm.quantized_gemv_pallas, block_n=block_n, k_splits=k_splits,
                            interpret=interpret)
  else:
    run = functools.partial(qmm.quantized_matmul_pallas, block_m=block_m, block_n=block_n,
                            k_splits=k_splits, interpret=interpret)
  out_dtype = out_dtype or (jnp.bfloat16 if x.dtype in qmm.FP8_DTYPES else x.dtype)
  return _per_device_part(run, x2, w, xs2, out_dtype).reshape(*lead, n)


def _per_device_part(run, x: jax.Array, w: QuantizedTensor, x_scale, out_dtype) -> jax.Array:
  """run(x, w, x_scale, out_dtype=...) [M, K] -> [M, N], on each device's part of a matrix
  that the mesh splits (`w.split`, o1jax.sharding.shard_model): XLA cannot partition a
  Pallas call, and gathered its operands (the whole matrix) to every device around it.
  Columns: each device its columns of the product. Rows: each device the product of its
  rows with its part of x, summed over the model axis in f32 (the one all-reduce a
  row-parallel product takes)."""
  if w.split is None or w.split[1] == 1:  # (a split for another mesh: refused above)
    return run(x, dataclasses.replace(w, split=None), x_scale, out_dtype=out_dtype)
  kind, _ = w.split
  w_spec = P(MODEL_AXIS, None) if kind == "rows" else P(None, MODEL_AXIS)
  specs = (P(None, MODEL_AXIS) if kind == "rows" else P(),
           jax.tree.map(lambda _: w_spec, w), None if x_scale is None else P())

  def part(x, w, x_scale):
    w = dataclasses.replace(w, split=None)  # a device's part: a whole matrix of its own
    if kind == "columns":
      return run(x, w, x_scale, out_dtype=out_dtype)
    y = run(x, w, x_scale, out_dtype=jnp.float32)
    return jax.lax.psum(y, MODEL_AXIS).astype(out_dtype)

  return _per_model_shard(part, specs, P() if kind == "rows" else P(None, MODEL_AXIS))(
      x, w, x_scale)


# --- paged attention ------------------------------------------------------------------

_Q_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _check_scale(name: str, scale, num_blocks: int, block_size: int, kv_heads: int):
  """Per token [NB, BS, KVH] (the engine's pools), per block and head [NB, KVH], per
  block [NB, 1] or per head [1, KVH] -> [NB, BS, KVH] f32 (or None)."""
  if scale is None:
    return None
  full = (num_blocks, block_size, kv_heads)
  coarse = ((num_blocks, kv_heads), (num_blocks, 1), (1, kv_heads))
  if scale.shape not in (full,) + coarse:
    raise ValueError(f"{name}.shape={scale.shape} must be one of {[full, *coarse]} "
                     f"(num_blocks={num_blocks}, block_size={block_size}, kv_heads={kv_heads})")
  scale = scale.astype(jnp.float32)
  if scale.ndim == 2:
    scale = jnp.broadcast_to(scale, (num_blocks, kv_heads))[:, None, :]
  return jnp.broadcast_to(scale, full)


def _check_cache(op: str, q_dtype, heads: int, head_dim: int, k_pages, v_pages, block_tables,
                 batch: int, k_scale, v_scale, sliding_window, pallas: bool):
  """Shared validation of the paged cache arguments; returns the [NB, BS, KVH] scales."""
  if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
    raise ValueError(f"{op}: k_pages.shape={k_pages.shape} and v_pages.shape={v_pages.shape} "
                     "must both be [num_blocks, block_size, kv_heads, head_dim]")
  nb, bs, kvh, d = k_pages.shape
  if d != head_dim:
    raise ValueError(f"{op}: q head_dim={head_dim} != k_pages.shape={k_pages.shape}[-1]")
  if heads % kvh:
    raise ValueError(f"{op}: q heads={heads} not a multiple of kv_heads={kvh} "
                     f"(k_pages.shape={k_pages.shape})")
  if q_dtype not in _Q_DTYPES:
    raise ValueError(f"{op}: q.dtype={_dtype_name(q_dtype)} not in bf16/f16/f32")
  if k_pages.dtype != v_pages.dtype:
    raise ValueError(f"{op}: k_pages.dtype={_dtype_name(k_pages.dtype)} != "
                     f"v_pages.dtype={_dtype_name(v_pages.dtype)}")
  # Every backend widens the pages it reads to q's dtype: FP8 (scaled), and bf16/f16
  # under f32 q (a bf16 KV pool under an f32 model: exact, half the bytes read).
  narrower = q_dtype == jnp.float32 and k_pages.dtype in (jnp.bfloat16, jnp.float16)
  if k_pages.dtype not in pa.FP8_DTYPES and k_pages.dtype != q_dtype and not narrower:
    raise ValueError(f"{op}: KV dtype {_dtype_name(k_pages.dtype)} (k_pages.shape="
                     f"{k_pages.shape}) must equal q.dtype={_dtype_name(q_dtype)}, be "
                     "float8_e4m3fn, or be bf16/f16 under f32 q")
  if (k_scale is not None or v_scale is not None) and k_pages.dtype not in pa.FP8_DTYPES:
    raise ValueError(f"{op}: k_scale/v_scale are for float8_e4m3fn pools, got "
                     f"{_dtype_name(k_pages.dtype)}")
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(f"{op}: block_tables.shape={block_tables.shape} must be [batch={batch}, "
                     "max_blocks]")
  if not jnp.issubdtype(block_tables.dtype, jnp.integer):
    raise ValueError(f"{op}: block_tables.dtype={_dtype_name(block_tables.dtype)} must be int32")
  if sliding_window is not None and (
      not isinstance(sliding_window, (int, np.integer)) or isinstance(sliding_window, bool)
      or sliding_window < 1):  # (2.5 read as 2 on XLA, a TypeError deep in Pallas)
    raise ValueError(f"{op}: sliding_window={sliding_window!r} must be an int >= 1 or None")
  if pallas:
    if not pallas_block_size_ok(bs):
      raise ValueError(f"{op} (pallas): block_size={bs} (k_pages.shape={k_pages.shape}) must "
                       "be a power of two in [8, 128]")
    if not pallas_head_dim_ok(d):
      raise ValueError(f"{op} (pallas): head_dim={d} (k_pages.shape={k_pages.shape}) must be a "
                       "power of two >= 16")
  ks = _check_scale("k_scale", k_scale, nb, bs, kvh)
  vs = _check_scale("v_scale", v_scale, nb, bs, kvh)
  if (ks is None) != (vs is None):  # one given: the other is 1
    ones = jnp.ones((nb, bs, kvh), jnp.float32)
    ks = ones if ks is None else ks
    vs = ones if vs is None else vs
  return ks, vs


def _check_per_seq(op: str, name: str, arr, batch: int):
  if arr.shape != (batch,) or not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(f"{op}: {name}.shape={arr.shape} dtype={_dtype_name(arr.dtype)} must be "
                     f"int32 [batch={batch}]")


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, lengths: jax.Array, *,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                           sliding_window: int | None = None, sm_scale: float | None = None,
                           backend: str = "auto", interpret: bool = False,
                           block_kv: int | None = None,
                           num_splits: int | None = None) -> jax.Array:
  """One decode step of attention over a paged KV cache.

  q [B, H, D]; k_pages, v_pages [num_blocks, block_size, KVH, D] (H % KVH == 0);
  block_tables [B, max_blocks] int32; lengths [B] int32 (<= max_blocks *
  block_size; 0 -> zeros). FP8 (float8_e4m3fn) pools take k_scale/v_scale of
  shape [num_blocks, block_size, KVH] (a scale per token: the engine's), [num_blocks,
  KVH], per-block [num_blocks, 1] or per-head [1, KVH].
  sliding_window=w: attend to the last w keys. sm_scale defaults to D**-0.5.
  Returns [B, H, D] in q's dtype."""
  op = "paged_decode_attention"
  if q.ndim != 3:
    raise ValueError(f"{op}: q.shape={q.shape} must be [batch, heads, head_dim]")
  b, h, d = q.shape
  requested, backend = backend, _attention_backend(backend, k_pages)
  ks, vs = _check_cache(op, q.dtype, h, d, k_pages, v_pages, block_tables, b, k_scale, v_scale,
                        sliding_window, backend == "pallas")
  _check_per_seq(op, "lengths", lengths, b)
  block_kv = qmm.check_tiling(op, "block_kv", block_kv, None, block=True, minimum=8)
  num_splits = qmm.check_tiling(op, "num_splits", num_splits, None)
  if (requested == "auto" and backend == "reference" and _on_cpu() and ks is None
      and sm_scale is None and k_pages.dtype in native.POOL_DTYPES and native.available()):
    # The native kernel reads the pages in place (the reference gathers them first).
    attend = _per_model_shard(functools.partial(native.paged_decode_attention,
                                                sliding_window=sliding_window),
                              (_HEADS, _POOL, _POOL, P(), P()), _HEADS)
    return attend(q, k_pages, v_pages, block_tables, lengths).astype(q.dtype)
  if backend == "reference":
    return pa.paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths, ks, vs,
                                               sliding_window=sliding_window, sm_scale=sm_scale)
  attend = _per_model_shard(functools.partial(
      pa.paged_decode_attention_pallas, sliding_window=sliding_window, sm_scale=sm_scale,
      block_kv=block_kv, num_splits=num_splits, interpret=interpret),
      (_HEADS, _POOL, _POOL, P(), P(), _scale_spec(ks), _scale_spec(vs)), _HEADS)
  return attend(q, k_pages, v_pages, block_tables, lengths, ks, vs)


def paged_prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            block_tables: jax.Array, starts: jax.Array, chunk_lens: jax.Array, *,
                            k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                            sliding_window: int | None = None, sm_scale: float | None = None,
                            backend: str = "auto", interpret: bool = False,
                            block_q: int | None = None,
                            block_kv: int | None = None) -> jax.Array:
  """Causal attention of a chunk of new queries against the paged cache.

  q [B, T, H, D]: query t of sequence b is at position starts[b] + t and its
  K/V are already in the pages; it attends to keys 0..starts[b]+t (or the last
  `sliding_window`). chunk_lens [B] (<= T): rows t >= chunk_lens[b] return 0.
  starts[b] + chunk_lens[b] must be <= max_blocks * block_size. Cache args as
  in `paged_decode_attention`. Returns [B, T, H, D] in q's dtype."""
  op = "paged_prefill_attention"
  if q.ndim != 4:
    raise ValueError(f"{op}: q.shape={q.shape} must be [batch, chunk, heads, head_dim]")
  b, _, h, d = q.shape
  requested, backend = backend, _attention_backend(backend, k_pages)
  ks, vs = _check_cache(op, q.dtype, h, d, k_pages, v_pages, block_tables, b, k_scale, v_scale,
                        sliding_window, backend == "pallas")
  _check_per_seq(op, "starts", starts, b)
  _check_per_seq(op, "chunk_lens", chunk_lens, b)
  block_q = qmm.check_tiling(op, "block_q", block_q, None, block=True, minimum=8)
  block_kv = qmm.check_tiling(op, "block_kv", block_kv, None, block=True, minimum=8)
  if backend == "reference":
    # auto on a CPU: key blocks up to the chunk's last key, online softmax (1.3-1.5x the
    # engine's prefill of ~1,400-token prompts: docs/measurements/*_prefill_attention.md).
    impl = (fa.paged_prefill_attention_blocked if requested == "auto" and _on_cpu()
            else fa.paged_prefill_attention_reference)
    return impl(q, k_pages, v_pages, block_tables, starts, chunk_lens, ks, vs,
                sliding_window=sliding_window, sm_scale=sm_scale)
  attend = _per_model_shard(functools.partial(
      fa.paged_prefill_attention_pallas, sliding_window=sliding_window, sm_scale=sm_scale,
      block_q=block_q, block_kv=block_kv, interpret=interpret),
      (_CHUNK_HEADS, _POOL, _POOL, P(), P(), P(), _scale_spec(ks), _scale_spec(vs)),
      _CHUNK_HEADS)
  return attend(q, k_pages, v_pages, block_tables, starts, chunk_lens, ks, vs)


# --- KV pool writes ------------------------------------------------------------------


def scatter_rows(pool: jax.Array, index: tuple[jax.Array, ...], rows: jax.Array) -> jax.Array:
  """pool.at[index].set(rows, mode="drop") with XLA: index is a tuple of [R] int arrays,
  the first into axis 0 (out of range: the row is dropped).

  XLA turns a one-row scatter into a dynamic-update-slice that made it copy the
  whole pool (batch-1 decode: 250 ms a step at 256 blocks), so a single row
  gets a dropped twin and stays a scatter, which updates in place."""
  if index[0].shape[0] == 1:
    index = (jnp.concatenate([index[0], jnp.full_like(index[0], pool.shape[0])]),
             *(jnp.concatenate([i, i]) for i in index[1:]))
    rows = jnp.concatenate([rows, rows])
  return pool.at[index].set(rows, mode="drop")


def write_pool_rows(pool: jax.Array, rows: jax.Array, block: jax.Array, offset: jax.Array, *,
                    backend: str = "auto") -> jax.Array:
  """pool.at[block, offset].set(rows, mode="drop"): pool [NB, BS, KVH, D], rows [R, KVH, D]
  (cast to the pool's dtype), block and offset [R] int32 (block >= NB: dropped).

  auto on a CPU with a bf16 pool: the native in-place write, because XLA's CPU
  scatter widens a bf16 pool to f32 and back around the update (two copies of the
  whole pool per write: ~80 ms a step at batch 32); else XLA's scatter."""
  resolve_backend(backend)
  rows = rows.astype(pool.dtype)
  if (backend == "auto" and _on_cpu() and pool.dtype == jnp.bfloat16 and native.available()):
    write = _per_model_shard(native.write_pool_rows, (_POOL, _HEADS, P(), P()), _POOL)
    return write(pool, rows, block.astype(jnp.int32), offset.astype(jnp.int32))
  return scatter_rows(pool, (block, offset), rows)


def write_pool_blocks(pool: jax.Array, dst: jax.Array, blocks: jax.Array, *,
                      backend: str = "auto") -> jax.Array:
  """pool.at[dst].set(blocks, mode="drop") for pool [NB, BS, KVH, D] and blocks
  [N, BS, KVH, D] (dst >= NB: dropped); the same choice as `write_pool_rows` (in the
  controller's decode step the bf16 widening was 91 of 176 ms at 32 rows)."""
  resolve_backend(backend)
  if (backend == "auto" and _on_cpu() and pool.dtype == jnp.bfloat16 and native.available()):
    n, bs = dst.shape[0], pool.shape[1]
    rows = blocks.astype(pool.dtype).reshape(n * bs, *pool.shape[2:])
    write = _per_model_shard(native.write_pool_rows, (_POOL, _HEADS, P(), P()), _POOL)
    return write(pool, rows, jnp.repeat(dst, bs).astype(jnp.int32),
                 jnp.tile(jnp.arange(bs, dtype=jnp.int32), n))
  return scatter_rows(pool, (dst,), blocks.astype(pool.dtype))
