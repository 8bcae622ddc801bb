"""4-/8-bit weights times int8-quantized activations (AVX512-VNNI / AMX, or AVX2, on the CPU).

`pack(w)` lays a `QuantizedTensor` (Q4_0, Q4_1, Q8_0 or any group size that is
a multiple of 32) or a dense [K, N] matrix (quantized to Q8_0 here) out for the
native kernel (`native/int8_matmul.cc`). `pallas_kernels.ops.int8_matmul(x, w)` quantizes each row
of x per block of 32 to two int8 levels (step s = max|x| / 127, then the
rounding residual in steps of s / 127: ~15 bits), takes exact integer dot
products per block and scales them:

  x ~ (s / 127) (127 xa + xr)
  y[m, n] = sum_b d[b, n] (s / 127) (sum_k q[k, n] (127 xa + xr)[m, k] - zero sum_k (127 xa + xr))
            + min[b, n] sum_k x[m, k]

with w = (q - zero) d + min. Weights keep their exact values (scales are stored
as f16, exact for GGUF's). One int8 level per block, as llama.cpp's Q8
activations, moved the embedded model's logits ~8x more than bf16 matmuls do
(outlier channels coarsen their whole block); two levels move them less than
bf16. A row's result depends only on that row (batch-invariant): its own
quantization, exact integer sums, f32 accumulation over the blocks in a fixed
order.

Codes of at most 16 distinct values (GGUF IQ4_NL / IQ4_XS: 16 fixed levels) are packed
as 4-bit indices with a table of the values (`VnniWeight.lut`): half the bytes, and the
same results as the 8-bit layout.

Without the native kernel (no compiler, neither AVX512-VNNI nor AVX2, not a CPU) the XLA reference
below computes the same quantities (same activation rounding; f32 sums in
another order).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize, quantize, unpack_int4

BLOCK = 32  # quantization block along K, for weights and activations
TILE = 16  # output columns per tile of the layout (one AVX-512 register of f32)


@flax.struct.dataclass
class VnniWeight:
  """A [K, N] weight in the native kernel's tiled layout (see int8_matmul.cc).

  packed: uint8 [Np/16, K/8, 16, 4] (4-bit: byte j of (t, kb, c) holds q[8kb+j]
    in its low and q[8kb+4+j] in its high nibble) or [Np/16, K/4, 16, 4]
    (8-bit: q[4kb+j] + 128); Np = N rounded up to 16 (padding columns are 0).
  scale, minimum: float16 [Np/16, K/32, 16] (minimum: zeros when symmetric).
  w[k, n] = (q[k, n] - zero) * scale + minimum.
  lut: for an 8-bit weight of at most 16 distinct codes (GGUF IQ4_NL / IQ4_XS: a nibble
    stands for one of 16 levels), the 16 stored values (code + 128) its nibbles index:
    packed as 4-bit (half the bytes), q[k, n] = lut[nibble]; None otherwise."""

  packed: jax.Array
  scale: jax.Array
  minimum: jax.Array
  bits: int = flax.struct.field(pytree_node=False, default=4)
  zero: int = flax.struct.field(pytree_node=False, default=8)
  has_min: bool = flax.struct.field(pytree_node=False, default=False)
  n: int = flax.struct.field(pytree_node=False, default=0)
  lut: tuple[int, ...] | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def shape(self) -> tuple[int, int]:
    tiles, rows = self.packed.shape[:2]
    return (rows * (8 if self.bits == 4 else 4), self.n)

  @property
  def ndim(self) -> int:
    return 2

  @property
  def nbytes(self) -> int:
    return int(self.packed.nbytes + self.scale.nbytes + (self.minimum.nbytes if self.has_min else 0))


def _tiles(a: np.ndarray, np_cols: int) -> np.ndarray:
  """[R, N] -> [Np/16, R, 16], zero-padding columns up to Np."""
  r, n = a.shape
  a = np.pad(a, ((0, 0), (0, np_cols - n)))
  return np.ascontiguousarray(a.reshape(r, np_cols // TILE, TILE).transpose(1, 0, 2))


def pack(w, name: str = "weight") -> VnniWeight:
  """QuantizedTensor (4-/8-bit) or dense [K, N] -> VnniWeight (host-side numpy).

  The kernel takes one f16 scale (and minimum) per block of 32 along K. Dense matrices
  are quantized to Q8_0 first; so are weights in groups of 16 (GGUF Q2_K/Q3_K/Q6_K:
  two groups' scales cannot share one block); f32 scales (the other K-quants) are
  rounded to f16. Q8_0 moves a value by at most ~1/254 of its block's largest; f16 moves
  a scale or minimum by at most 2^-11 of itself (GGUF Q4_0/Q4_1/Q8_0 scales are f16: kept
  exactly; the accuracy cost is measured by scripts/matmul_accuracy.py --kquant)."""
  if not isinstance(w, QuantizedTensor):
    w = np.asarray(jax.device_get(w), np.float32)
    if w.ndim != 2:
      raise ValueError(f"vnni_matmul.pack: {name} has shape {w.shape}; need a [K, N] matrix")
    if w.shape[0] % BLOCK:
      raise ValueError(f"vnni_matmul.pack: {name} has K={w.shape[0]}, not a multiple of {BLOCK}")
    w = quantize(w, bits=8, group_size=BLOCK)
  w = jax.device_get(w).validate(f"vnni_matmul.pack: {name}")
  if w.group_size % BLOCK:
    if w.shape[0] % BLOCK:
      raise ValueError(f"vnni_matmul.pack: {name} has K={w.shape[0]}, not a multiple of {BLOCK}")
    w = quantize(np.asarray(dequantize(w)), bits=8, group_size=BLOCK)
  k, n = w.shape
  np_cols = -(-n // TILE) * TILE
  repeat = w.group_size // BLOCK  # one scale per 32-row block
  scale = np.repeat(np.asarray(w.scale, np.float32), repeat, axis=0).astype(np.float16)
  has_min = w.minimum is not None
  minimum = (np.repeat(np.asarray(w.minimum, np.float32), repeat, axis=0).astype(np.float16)
             if has_min else np.zeros_like(scale))
  lut = None
  if w.bits == 4:
    nibbles = np.asarray(unpack_int4(np.asarray(w.packed), w.row_blocks), np.uint8)
    zero = 0 if has_min else 8
  else:
    stored = (np.asarray(w.packed, np.int16) + 128).astype(np.uint8)  # [K, N]
    zero = 128
    present = np.flatnonzero(np.bincount(stored.ravel(), minlength=256))
    if len(present) <= 16:  # 16 levels or fewer: 4-bit indices into them
      lut = tuple(int(v) for v in np.pad(present, (0, 16 - len(present)), mode="edge"))
      index = np.zeros(256, np.uint8)
      index[present] = np.arange(len(present), dtype=np.uint8)
      nibbles = index[stored]
  if w.bits == 4 or lut is not None:
    q = nibbles.reshape(k // 8, 2, 4, n)  # (kb, low/high nibble, j, n)
    q = (q[:, 0] | (q[:, 1] << 4)).astype(np.uint8)  # [K/8, 4, N]
  else:
    q = stored.reshape(k // 4, 4, n)
  rows = q.shape[0]
  q = np.pad(q, ((0, 0), (0, 0), (0, np_cols - n)))
  packed = np.ascontiguousarray(
      q.reshape(rows, 4, np_cols // TILE, TILE).transpose(2, 0, 3, 1))  # [T, rows, 16, 4]
  return VnniWeight(packed=packed, scale=_tiles(scale, np_cols), minimum=_tiles(minimum, np_cols),
                    bits=4 if lut is not None else w.bits, zero=zero, has_min=has_min, n=n,
                    lut=lut)


def widened(w: VnniWeight) -> VnniWeight:
  """A 4-bit weight with a lut in the 8-bit layout of the same values (host-side): what
  such weights took before luts (scripts/bench_int8_matmul.py compares the two)."""
  q, _, _ = unpack(w)  # [K, Np] stored values
  q = np.asarray(q, np.uint8)
  k, np_cols = q.shape
  q = q.reshape(k // 4, 4, np_cols)
  packed = np.ascontiguousarray(
      q.reshape(k // 4, 4, np_cols // TILE, TILE).transpose(2, 0, 3, 1))
  return w.replace(packed=packed, bits=8, lut=None)


def concat_columns(weights: list[VnniWeight], name: str = "weights") -> VnniWeight:
  """[W1 | W2 | ...] along N: one call computes every part's columns bit for bit as
  its own call would (columns are independent; x is quantized the same way), with
  one activation quantization and one thread hand-off instead of several. Every
  part but the last must have N a multiple of 16 (no padding columns inside)."""
  first = weights[0]
  for w in weights:
    # (Parts whose luts differ stay apart: each read at 4 bits beats one 8-bit matrix.)
    if (w.bits, w.zero, w.has_min, w.lut) != (first.bits, first.zero, first.has_min, first.lut) \
        or w.packed.shape[1:] != first.packed.shape[1:]:
      raise ValueError(f"vnni_matmul.concat_columns: {name} differ in format or K: "
                       f"{[(w.bits, w.zero, w.has_min, w.lut, w.shape) for w in weights]}")
  if any(w.n % TILE for w in weights[:-1]):
    raise ValueError(f"vnni_matmul.concat_columns: {name}: N {[w.n for w in weights]} must be "
                     f"multiples of {TILE} (but the last)")
  cat = lambda field: jnp.concatenate([getattr(w, field) for w in weights], axis=0)
  return first.replace(packed=cat("packed"), scale=cat("scale"), minimum=cat("minimum"),
                       n=sum(w.n for w in weights))


def unpack(w: VnniWeight) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(q int32 [K, Np] with w = (q - zero) * scale + minimum, scale f32 [K/32, Np],
  minimum f32 [K/32, Np]) from the tiled layout (the reference's view of it)."""
  tiles, rows = w.packed.shape[:2]
  p = jnp.transpose(w.packed, (1, 3, 0, 2)).reshape(rows, 4, tiles * TILE)  # [rows, j, Np]
  if w.bits == 4:
    q = jnp.stack([p & 0xF, p >> 4], axis=1)  # [K/8, 2, 4, Np]
  else:
    q = p
  q = q.reshape(-1, tiles * TILE).astype(jnp.int32)
  if w.lut is not None:
    q = jnp.asarray(w.lut, jnp.int32)[q]
  per_block = lambda a: jnp.transpose(a, (1, 0, 2)).reshape(a.shape[1], -1).astype(jnp.float32)
  return q, per_block(w.scale), per_block(w.minimum)


def quantize_activations(x: jax.Array):
  """x f32 [M, K] -> (xa, xr int32 [M, K] in -127..127, xs f32 [M, K/32] (the fine
  step s / 127), xsum int32 [M, K/32] (sum of 127 xa + xr), fsum f32 [M, K/32]
  (sum of x)) with the kernel's f32 operations: s = max|x| / 127, xa = rint(x *
  (127 / max|x|)), xr = rint((x - xa s) * (127 * 127 / max|x|)) (zeros for a
  zero block); a block holding a NaN or an infinity has a NaN step (its row's outputs
  are NaN)."""
  m, k = x.shape
  xb = x.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
  amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
  inv = jnp.where(amax > 0, jnp.float32(127.0) / jnp.where(amax > 0, amax, 1.0), 0.0)
  step = amax / jnp.float32(127.0)
  xa = jnp.round(xb * inv)
  xr = jnp.clip(jnp.round((xb - xa * step) * (inv * jnp.float32(127.0))), -127, 127)
  xa, xr = xa.astype(jnp.int32), xr.astype(jnp.int32)
  xsum = jnp.sum(127 * xa + xr, axis=-1)
  finite = jnp.all(jnp.isfinite(xb), axis=-1)
  xs = jnp.where(finite, (step / jnp.float32(127.0))[..., 0], jnp.nan)
  return xa.reshape(m, k), xr.reshape(m, k), xs, xsum, jnp.sum(xb, axis=-1)


def vnni_matmul_reference(x: jax.Array, w: VnniWeight) -> jax.Array:
  """XLA version of the kernel: x [M, K] -> f32 [M, N]."""
  m, k = x.shape
  q, scale, minimum = unpack(w)
  xa, xr, xs, xsum, fsum = quantize_activations(x)
  blocks = k // BLOCK
  combined = (127 * xa + xr).reshape(m, blocks, BLOCK)
  isum = jnp.einsum("mbk,bkn->mbn", combined, q.reshape(blocks, BLOCK, -1),
                    preferred_element_type=jnp.int32)
  isum = isum - w.zero * xsum[..., None]
  y = jnp.sum(isum.astype(jnp.float32) * (scale[None] * xs[..., None]), axis=1)
  if w.has_min:
    y = y + jnp.einsum("mb,bn->mn", fsum, minimum, precision=jax.lax.Precision.HIGHEST)
  return y[:, :w.n]
