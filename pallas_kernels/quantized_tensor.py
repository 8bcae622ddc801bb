"""`QuantizedTensor`: a weight matrix that stays quantized in memory.

Logical shape is ``(K, N)`` = (in_features, out_features), so a linear layer is
``y = x @ W``. Quantization groups run along K (the reduction axis), which is
what GGUF, AWQ and GPTQ all do, and what a fused matmul kernel wants: one scale
per (group of K rows, output column).

Storage (``bits`` and ``group_size`` are static pytree fields):

* 4-bit: ``packed`` uint8 ``[K // 2, N]``. The low nibble of ``packed[i, n]``
  holds ``q[i, n]`` and the high nibble holds ``q[i + K // 2, n]`` ("split
  halves"). A kernel therefore never interleaves nibbles: it multiplies the low
  nibbles by ``x[:, :K/2]`` and the high nibbles by ``x[:, K/2:]``.
  Values: ``w = (q - 8) * scale`` when ``minimum is None`` (Q4_0, symmetric
  AWQ/GPTQ), else ``w = q * scale + minimum`` (Q4_1; an asymmetric zero point z
  is ``minimum = -z * scale``).
* 8-bit: ``packed`` int8 ``[K, N]``, ``w = q * scale`` (Q8_0), or ``w = q * scale +
  minimum`` (codes of 5-/6-bit formats with a per-group minimum, e.g. GGUF Q5_K).

``scale`` and ``minimum`` are ``[K // group_size, N]`` in float16/bfloat16/float32.

On a mesh (``split``, set by ``o1jax.sharding.shard_model``): a column split is a split
of N; a 4-bit row split over n devices packs each block of K / n rows with its own split
halves (``packed`` block d holds rows d*K/n + i and d*K/n + K/(2n) + i), so each device
holds whole codes of exactly its rows, and a device's part is a matrix of this layout.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = (4, 8)


@flax.struct.dataclass
class QuantizedTensor:
  packed: jax.Array  # uint8 [K//2, N] (4-bit) or int8 [K, N] (8-bit)
  scale: jax.Array  # [K // group_size, N]
  minimum: jax.Array | None  # [K // group_size, N] or None (symmetric)
  bits: int = flax.struct.field(pytree_node=False, default=4)
  group_size: int = flax.struct.field(pytree_node=False, default=32)
  # How a mesh's model axis splits the matrix: None (whole on every device),
  # ("columns", n) or ("rows", n). See the module docstring for a 4-bit row split.
  split: tuple[str, int] | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def row_blocks(self) -> int:
    """Blocks of K packed apart (a row split's devices; 1: the whole matrix)."""
    return self.split[1] if self.split is not None and self.split[0] == "rows" else 1

  @property
  def part_shape(self) -> tuple[int, int]:
    """The logical shape of one device's part (the whole shape where no mesh splits it)."""
    k, n = self.shape
    if self.split is None:
      return k, n
    kind, parts = self.split
    return (k // parts, n) if kind == "rows" else (k, n // parts)

  @property
  def shape(self) -> tuple[int, int]:
    rows, cols = self.packed.shape[-2:]
    return (rows * 2 if self.bits == 4 else rows, cols)

  @property
  def ndim(self) -> int:
    return 2

  @property
  def nbytes(self) -> int:
    total = self.packed.size * self.packed.dtype.itemsize
    total += self.scale.size * self.scale.dtype.itemsize
    if self.minimum is not None:
      total += self.minimum.size * self.minimum.dtype.itemsize
    return int(total)

  def validate(self, name: str = "QuantizedTensor") -> "QuantizedTensor":
    """Checks field shapes/dtypes; raises ValueError naming `name`."""
    if self.bits not in SUPPORTED_BITS:
      raise ValueError(f"{name}: bits={self.bits} not in {SUPPORTED_BITS}")
    if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
        or self.group_size < 1:
      raise ValueError(f"{name}: group_size={self.group_size!r} must be an integer >= 1")
    want = np.uint8 if self.bits == 4 else np.int8
    if self.packed.dtype != want:
      raise ValueError(f"{name}: {self.bits}-bit packed must be {np.dtype(want).name}, "
                       f"got {self.packed.dtype}")
    k, n = self.shape
    if k % self.group_size:
      raise ValueError(f"{name}: K={k} is not a multiple of group_size={self.group_size}")
    if self.scale.shape != (k // self.group_size, n):
      raise ValueError(f"{name}: scale shape {self.scale.shape} != {(k // self.group_size, n)}")
    if self.minimum is not None and self.minimum.shape != self.scale.shape:
      raise ValueError(f"{name}: minimum shape {self.minimum.shape} != scale {self.scale.shape}")
    if self.split is not None:
      kind, parts = self.split
      size = k if kind == "rows" else n
      if (kind not in ("rows", "columns") or isinstance(parts, bool)
          or not isinstance(parts, int) or parts < 1 or size % parts):
        raise ValueError(f"{name}: split={self.split!r} must be ('rows' | 'columns', n) with n "
                         f"dividing {(k, n)}")
      if kind == "rows" and (k // parts) % self.group_size:
        raise ValueError(f"{name}: split={self.split!r}: K / {parts} = {k // parts} rows is not "
                         f"a multiple of group_size={self.group_size}")
    return self


def with_split(w: QuantizedTensor, kind: str, parts: int) -> QuantizedTensor:
  """`w` marked as split over `parts` devices by "rows" or "columns" (its 4-bit codes
  repacked per block of rows for a row split; the values are unchanged)."""
  marked = dataclasses.replace(w, split=(kind, parts)).validate(f"QuantizedTensor split by {kind}")
  if w.bits == 4 and marked.row_blocks != w.row_blocks:
    return dataclasses.replace(marked, packed=pack_int4(unpack_int4(w.packed, w.row_blocks),
                                                        blocks=marked.row_blocks))
  return marked


# --- pack / unpack -------------------------------------------------------------


def _format(w: QuantizedTensor) -> tuple:
  """What two matrices must share to be one: codes, groups, scale/minimum dtypes, K."""
  dtype = lambda a: None if a is None else str(a.dtype)
  return (w.bits, w.group_size, dtype(w.packed), dtype(w.scale), dtype(w.minimum),
          w.packed.shape[0], w.split)


def concat_columns(weights: list[QuantizedTensor]) -> QuantizedTensor | None:
  """[W1 | W2 | ...] along N: the same codes, scales and minima, so each column of the
  result is its part's column (codes are packed along K: columns are independent). None
  where the parts differ in format or K (e.g. a Q8_0 wv among Q4_0 weights). (The
  inverse: `o1jax.checkpoint.params.split_columns`.)"""
  if len({_format(w) for w in weights}) != 1:
    return None
  cat = lambda field: (None if getattr(weights[0], field) is None else
                       jnp.concatenate([getattr(w, field) for w in weights], axis=-1))
  return dataclasses.replace(weights[0], packed=cat("packed"), scale=cat("scale"),
                             minimum=cat("minimum"))


def pack_int4(q, blocks: int = 1):
  """[K, N] integer values in 0..15 -> uint8 [K//2, N], split-halves layout (of each
  of `blocks` consecutive blocks of K / blocks rows: a row split's)."""
  xp = jnp if isinstance(q, jax.Array) else np
  k = q.shape[0]
  if k % (2 * blocks):
    raise ValueError(f"pack_int4: K={k} must be a multiple of 2 x {blocks} blocks")
  q = q.astype(xp.uint8).reshape(blocks, k // blocks, *q.shape[1:])
  half = k // blocks // 2
  return (q[:, :half] | (q[:, half:] << 4)).astype(xp.uint8).reshape(k // 2, *q.shape[2:])


def unpack_int4(packed, blocks: int = 1):
  """uint8 [K//2, N] -> uint8 [K, N] values in 0..15 (inverse of pack_int4)."""
  xp = jnp if isinstance(packed, jax.Array) else np
  p = packed.reshape(blocks, packed.shape[0] // blocks, *packed.shape[1:])
  return xp.concatenate([p & 0xF, p >> 4], axis=1).reshape(2 * packed.shape[0],
                                                            *packed.shape[1:])


# --- reference dequantization ----------------------------------------------------


def dequantize(qt: QuantizedTensor, dtype=jnp.float32) -> jax.Array:
  """Full [K, N] weight in `dtype` (f32 arithmetic, matches llama.cpp's dequant)."""
  k, n = qt.shape
  g = qt.group_size
  if qt.bits == 4:
    q = unpack_int4(qt.packed, qt.row_blocks).astype(jnp.float32)
  else:
    q = qt.packed.astype(jnp.float32)
  q = q.reshape(k // g, g, n)
  scale = qt.scale.astype(jnp.float32)[:, None, :]
  if qt.minimum is not None:
    w = q * scale + qt.minimum.astype(jnp.float32)[:, None, :]
  elif qt.bits == 4:
    w = (q - 8.0) * scale
  else:
    w = q * scale
  return w.reshape(k, n).astype(dtype)


def dequantize_columns(qt: QuantizedTensor, columns: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Dequantizes only the given columns: returns [len(columns), K] (rows of W.T).

  Used for embedding lookup from a tied, quantized embedding table stored as
  W[K=d_model, N=vocab]."""
  return dequantize(map_columns(qt, lambda a: jnp.take(a, columns, axis=1)), dtype).T


def map_columns(qt: QuantizedTensor, take) -> QuantizedTensor:
  """`qt` with `take` applied to its codes, scales and minima along N (codes are packed
  along K: columns are independent). A row split's per-device packing is kept; a column
  split is not (a subset of the columns is no longer the split's)."""
  return QuantizedTensor(packed=take(qt.packed), scale=take(qt.scale),
                         minimum=None if qt.minimum is None else take(qt.minimum),
                         bits=qt.bits, group_size=qt.group_size,
                         split=qt.split if qt.row_blocks > 1 else None)


# --- quantizers (tests, AWQ/GPTQ-style conversion of dense checkpoints) -----------


def quantize(w, bits: int = 4, group_size: int = 32, symmetric: bool = True,
             scale_dtype=np.float16) -> QuantizedTensor:
  """Round-to-nearest quantization of a dense [K, N] matrix (numpy, host side)."""
  w = np.asarray(w, np.float32)
  k, n = w.shape
  if k % group_size:
    raise ValueError(f"quantize: K={k} is not a multiple of group_size={group_size}")
  wg = w.reshape(k // group_size, group_size, n)
  if bits == 8:
    amax = np.abs(wg).max(axis=1)
    scale = (amax / 127.0).astype(scale_dtype)
    s = scale.astype(np.float32)[:, None, :]
    q = np.where(s > 0, np.round(wg / np.where(s > 0, s, 1)), 0)
    q = np.clip(q, -127, 127).astype(np.int8).reshape(k, n)
    return QuantizedTensor(packed=q, scale=scale, minimum=None, bits=8, group_size=group_size)
  if bits != 4:
    raise ValueError(f"quantize: bits={bits} not in {SUPPORTED_BITS}")
  if symmetric:
    # Q4_0 convention: the value of largest magnitude maps to -8.
    idx = np.abs(wg).argmax(axis=1)
    signed_max = np.take_along_axis(wg, idx[:, None, :], axis=1)[:, 0, :]
    scale = (signed_max / -8.0).astype(scale_dtype)
    s = scale.astype(np.float32)[:, None, :]
    q = np.where(s != 0, np.round(wg / np.where(s != 0, s, 1)) + 8, 8)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(k, n)
    return QuantizedTensor(packed=pack_int4(q), scale=scale, minimum=None, bits=4,
                           group_size=group_size)
  lo = wg.min(axis=1)
  hi = wg.max(axis=1)
  scale = ((hi - lo) / 15.0).astype(scale_dtype)
  minimum = lo.astype(scale_dtype)
  s = scale.astype(np.float32)[:, None, :]
  m = minimum.astype(np.float32)[:, None, :]
  q = np.where(s > 0, np.round((wg - m) / np.where(s > 0, s, 1)), 0)
  q = np.clip(q, 0, 15).astype(np.uint8).reshape(k, n)
  return QuantizedTensor(packed=pack_int4(q), scale=scale, minimum=minimum, bits=4,
                         group_size=group_size)


def as_jax(qt: QuantizedTensor) -> QuantizedTensor:
  """Moves numpy fields onto the default device."""
  return jax.tree.map(jnp.asarray, qt)
