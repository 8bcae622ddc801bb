"""f32 weights in column tiles, for the native CPU matmul (`native/f32_matmul.cc`).

XLA's CPU dot of a few rows by a row-major [K, N] f32 weight costs ~2.3x one
row's at 8 rows (it repacks the weight), which makes batched decode steps and
verify calls pay twice a one-row step. Stored as tiles of 32 columns, each tile
one contiguous [K, 32] block, the native kernel streams every weight once for a
group of rows (`pallas_kernels.ops.matmul` dispatches on `TiledF32Weight`).
Same values as the [K, N] array; the products are exact f32 sums in k order,
so a row's result does not depend on the other rows (XLA's f32 dot can differ by
~1e-5 between one row and several).

A Llama built with float32 matmuls stores its matrices this way where the kernel
runs (`pallas_kernels.ops.tiled_f32_preferred`); tensor parallelism unpacks them
(XLA partitions plain arrays).
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

TILE = 32  # columns per tile (two AVX-512 registers of f32)


@flax.struct.dataclass
class TiledF32Weight:
  """A [K, N] f32 weight as tiles: f32 [Np/32, K, 32], tile t holding columns
  32t .. 32t+31; Np = N rounded up to 32 (padding columns are 0)."""

  tiles: jax.Array
  n: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def shape(self) -> tuple[int, int]:
    return (self.tiles.shape[1], self.n)

  @property
  def ndim(self) -> int:
    return 2


def pack(w: jax.Array) -> TiledF32Weight:
  """[K, N] float -> TiledF32Weight (the same values in f32)."""
  if w.ndim != 2:
    raise ValueError(f"f32_matmul.pack: weight must be [K, N], got shape {w.shape}")
  k, n = w.shape
  padded = -(-n // TILE) * TILE
  w = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, padded - n)))
  return TiledF32Weight(tiles=w.reshape(k, padded // TILE, TILE).transpose(1, 0, 2), n=n)


def unpack(w: TiledF32Weight) -> jax.Array:
  """The [K, N] f32 array."""
  t, k, _ = w.tiles.shape
  return w.tiles.transpose(1, 0, 2).reshape(k, t * TILE)[:, :w.n]


def columns(w: TiledF32Weight, ids: jax.Array) -> jax.Array:
  """w[:, ids].T: [len(ids), K] (an embedding lookup in the head layout)."""
  ids = ids.astype(jnp.int32)
  return w.tiles[ids // TILE, :, ids % TILE]


def tiled_matmul_reference(x: jax.Array, w: TiledF32Weight) -> jax.Array:
  """x [M, K] @ w -> f32 [M, N] with XLA's dot (full f32 precision)."""
  return jnp.dot(x.astype(jnp.float32), unpack(w), precision=jax.lax.Precision.HIGHEST)
