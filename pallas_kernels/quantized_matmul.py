"""Quantized matmul `y = x @ dequant(W)`: XLA reference + fused Pallas kernel.

Backend: the kernel targets the Pallas *Triton* GPU backend (selected by
passing `plt.CompilerParams`; without it recent JAX routes GPU Pallas to Mosaic
GPU). It also runs with `interpret=True` on any platform (tests).

Kernel layout (one program = one [block_m, block_n] output tile and one slice
of K when split-K is on):
  * The loop runs over quantization groups. A 4-bit iteration loads one group
    of packed rows `[g, block_n]` (uint8), which holds two groups of weights
    (low nibble: rows r..r+g, high nibble: rows K/2+r..K/2+r+g) thanks to the
    split-halves layout, so no nibble interleaving is ever needed.
  * The integer codes (exact in bf16/f16) go straight into the MXU/tensor-core
    dot; the per-column group scale is applied to the [block_m, block_n] dot
    result, and Q4_1's `minimum` term is `rowsum(x_group) * minimum`. So the
    dequantized weight never exists, not even per tile in f32.
  * f32 accumulation; split-K partials are summed by the wrapper in f32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.fp8_activations import FP8_DTYPES
from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize

ACT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32) + FP8_DTYPES


# --- reference -------------------------------------------------------------------


def quantized_matmul_reference(x: jax.Array, w: QuantizedTensor,
                               x_scale: jax.Array | None = None,
                               out_dtype=None) -> jax.Array:
  """x: [..., K] -> [..., N]; dequantizes W to f32 and accumulates in f32.

  Exact on CPU (f32 dot at HIGHEST precision). `x_scale` ([...] or [..., 1],
  f32) multiplies each activation row (the FP8 variant: x_real = x * x_scale).
  Output dtype: `out_dtype`, else x's dtype (bf16 for FP8 activations)."""
  if out_dtype is None:
    out_dtype = jnp.bfloat16 if x.dtype in FP8_DTYPES else x.dtype
  wf = dequantize(w, jnp.float32)
  y = jnp.dot(x.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)
  if x_scale is not None:
    y = y * _row_scale(x_scale, x.shape[:-1])
  return y.astype(out_dtype)


def _row_scale(x_scale: jax.Array, lead: tuple[int, ...]) -> jax.Array:
  """[...] or [..., 1] per-row scale -> [..., 1] f32."""
  return x_scale.astype(jnp.float32).reshape(*lead, 1)


# --- kernel ----------------------------------------------------------------------


def _compute_dtype(x_dtype):
  # fp8 e4m3 -> bf16 is exact (more mantissa and range), and 4/8-bit integer
  # codes are exact in bf16/f16, so the dot only rounds where x itself does.
  if x_dtype in FP8_DTYPES:
    return jnp.bfloat16
  return x_dtype


def _dot_codes(x: jax.Array, codes: jax.Array, compute_dtype) -> jax.Array:
  """x [R, G] @ integer codes [G, N] -> f32 [R, N] on the tensor cores.

  f32 x is split into three bf16 parts (hi + mid + lo = x to f32's 24 bits: bf16 keeps
  f32's exponent range and 8 of its bits each) and the codes are exact in bf16, so the
  three bf16 dots with f32 accumulation give the f32 product. A float32 dot in Triton
  at full precision runs on the CUDA cores instead (FMA): measured on an H200, that made
  this kernel 1.9 ms a call at M = 64 on a 576 x 1536 weight
  (docs/measurements/2026-12-04_h200_profile.json)."""
  codes = codes.astype(jnp.float32)  # int -> float via f32 (as Triton converts)
  if compute_dtype != jnp.float32:
    return jnp.dot(x.astype(compute_dtype), codes.astype(compute_dtype),
                   preferred_element_type=jnp.float32)
  c = codes.astype(jnp.bfloat16)
  hi = x.astype(jnp.bfloat16)
  # (inf - inf is NaN: x = inf, or x past bf16's largest finite value)
  rest = jnp.where(jnp.isfinite(hi), x - hi.astype(jnp.float32), 0.0)
  mid = rest.astype(jnp.bfloat16)
  lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
  dot = lambda part: jnp.dot(part, c, preferred_element_type=jnp.float32)
  return (dot(lo) + dot(mid)) + dot(hi)  # small parts first: they round least


def _qmm_kernel(*refs, bits: int, group: int, half_k: int, groups_per_split: int,
                asymmetric: bool, compute_dtype):
  if asymmetric:
    x_ref, p_ref, s_ref, m_ref, o_ref = refs
  else:
    x_ref, p_ref, s_ref, o_ref = refs
    m_ref = None
  # x_ref,  # [block_m, K]
  # p_ref,  # [K//2, block_n] uint8 (4-bit) or [K, block_n] int8 (8-bit)
  # s_ref,  # [K//group, block_n]
  # m_ref,  # [K//group, block_n] (Q4_1 only)
  # o_ref,  # [block_m, block_n] f32 partial sum of this K split
  split = pl.program_id(2)
  block_m, block_n = o_ref.shape
  first = split * groups_per_split
  # Groups in the high nibble start this many scale rows later.
  high_group_offset = half_k // group

  def group_term(xg, codes, gi):
    """dot(x_group, codes) * scale (+ rowsum(x_group) * minimum) for group gi."""
    y = _dot_codes(xg, codes, compute_dtype)
    y = y * s_ref[pl.ds(gi, 1), :].astype(jnp.float32)
    if m_ref is not None:
      rowsum = jnp.sum(xg.astype(jnp.float32), axis=1, keepdims=True)
      y = y + rowsum * m_ref[pl.ds(gi, 1), :].astype(jnp.float32)
    return y

  def body(it, acc):
    gi = first + it
    r0 = pl.multiple_of(gi * group, group)
    if bits == 4:
      # Triton has no 8-bit shifts/masks on some versions: widen first. `& 0xFF`
      # keeps this right even if the widening sign-extends.
      p = p_ref[pl.ds(r0, group), :].astype(jnp.int32) & 0xFF
      lo = p & 0xF
      hi = p >> 4
      if not asymmetric:
        lo = lo - 8
        hi = hi - 8
      x_lo = x_ref[:, pl.ds(r0, group)].astype(compute_dtype)
      x_hi = x_ref[:, pl.ds(half_k + r0, group)].astype(compute_dtype)
      acc += group_term(x_lo, lo, gi)
      acc += group_term(x_hi, hi, gi + high_group_offset)
    else:
      q = p_ref[pl.ds(r0, group), :].astype(jnp.int32)
      xg = x_ref[:, pl.ds(r0, group)].astype(compute_dtype)
      acc += group_term(xg, q, gi)
    return acc

  acc = jnp.zeros((block_m, block_n), jnp.float32)
  acc = jax.lax.fori_loop(0, groups_per_split, body, acc)
  o_ref[...] = acc


def _finish(partial: jax.Array, m: int, x_scale, out_dtype) -> jax.Array:
  """[splits, padded rows, N] f32 partial sums -> [m, N]: summed over the K splits, the
  padding rows cut, times each row's activation scale (FP8), in out_dtype."""
  y = partial[0] if partial.shape[0] == 1 else jnp.sum(partial, axis=0)
  y = y[:m]
  if x_scale is not None:
    y = y * _row_scale(x_scale, (m,))
  return y.astype(out_dtype)


def _largest_pow2_divisor(n: int, cap: int, floor: int = 16) -> int | None:
  b = cap
  while b >= floor:
    if n % b == 0:
      return b
    b //= 2
  return None


def pallas_support_error(k: int, n: int, w: QuantizedTensor) -> str | None:
  """Why the kernel cannot take this weight (None if it can)."""
  g = w.group_size
  if w.bits == 4 and w.row_blocks > 1:
    return (f"split={w.split}: its codes are packed per device (the kernel takes each "
            f"device's part, on a mesh of {w.row_blocks} devices)")
  if g < 16 or g & (g - 1):
    return f"group_size={g} must be a power of two >= 16"
  if w.bits == 4 and (k // 2) % g:
    return (f"4-bit K={k}: K//2={k // 2} must be a multiple of group_size={g} "
            "(a group may not straddle the two nibble halves)")
  if _largest_pow2_divisor(n, 128) is None:
    return f"N={n} must be a multiple of 16"
  return None


def device_part_error(w: QuantizedTensor) -> str | None:
  """Why the kernel cannot take each device's part of a matrix a mesh splits (`w.split`;
  the whole matrix where none does), or None."""
  if w.split is None or w.split[1] == 1:
    return pallas_support_error(*w.shape, w)
  return pallas_support_error(*w.part_shape, dataclasses.replace(w, split=None))


def choose_config(m: int, k: int, n: int, w: QuantizedTensor, *, target_programs: int = 264):
  """Default (block_m, block_n, k_splits) for an [m, k] x [k, n] problem.

  Decode (small m) is bandwidth bound: split K until there are enough programs
  to keep every SM streaming weights (~2 per SM on H100/H200)."""
  block_m = min(64, max(16, pl.next_power_of_2(m)))
  block_n = _largest_pow2_divisor(n, 128)
  loop_groups = (k // 2 if w.bits == 4 else k) // w.group_size
  programs = pl.cdiv(m, block_m) * (n // block_n)
  return block_m, block_n, _split_k(programs, loop_groups, target_programs, most=16)


def _split_k(programs: int, loop_iters: int, target_programs: int, most: int) -> int:
  """K splits (a power of two <= `most` dividing the loop) until `programs` x splits
  reach `target_programs`."""
  k_splits, s = 1, 2
  while s <= most and programs * k_splits < target_programs:
    if loop_iters % s == 0:
      k_splits = s
    s *= 2
  return k_splits


def check_tiling(kernel: str, name: str, value, default: int | None, *, block: bool = False,
                 minimum: int = 16) -> int | None:
  """A tiling override (None: `default`): an int >= 1; a block size also a power of two of
  at least `minimum` (Triton's tiles), named in one line where it is not."""
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1 or (
      block and (value < minimum or value & (value - 1))):
    want = f"a power of two >= {minimum}" if block else "an int >= 1"
    raise ValueError(f"{kernel}: {name}={value!r} must be {want}")
  return int(value)


def quantized_matmul_pallas(x: jax.Array, w: QuantizedTensor, x_scale: jax.Array | None = None,
                            *, out_dtype=None, block_m: int | None = None,
                            block_n: int | None = None, k_splits: int | None = None,
                            num_warps: int = 4, num_stages: int = 3,
                            interpret: bool = False) -> jax.Array:
  """x: [M, K] -> [M, N] with the fused kernel. Inputs assumed validated.

  M is padded to a multiple of block_m here (activations are small)."""
  m, k = x.shape
  _, n = w.shape
  if out_dtype is None:
    out_dtype = jnp.bfloat16 if x.dtype in FP8_DTYPES else x.dtype
  bm, bn, ks = choose_config(m, k, n, w)
  bm = check_tiling("quantized_matmul", "block_m", block_m, bm, block=True)
  bn = check_tiling("quantized_matmul", "block_n", block_n, bn, block=True)
  ks = check_tiling("quantized_matmul", "k_splits", k_splits, ks)
  g = w.group_size
  loop_groups = (k // 2 if w.bits == 4 else k) // g
  if loop_groups % ks:
    raise ValueError(f"quantized_matmul: k_splits={ks} must divide {loop_groups} groups")
  if n % bn:
    raise ValueError(f"quantized_matmul: block_n={bn} must divide N={n}")
  mp = pl.cdiv(m, bm) * bm
  if mp != m:
    x = jnp.pad(x, ((0, mp - m), (0, 0)))
  asymmetric = w.minimum is not None
  kernel = functools.partial(
      _qmm_kernel, bits=w.bits, group=g, half_k=k // 2, groups_per_split=loop_groups // ks,
      asymmetric=asymmetric, compute_dtype=_compute_dtype(x.dtype))
  prow = w.packed.shape[0]
  in_specs = [
      pl.BlockSpec((bm, k), lambda i, j, s: (i, 0)),
      pl.BlockSpec((prow, bn), lambda i, j, s: (0, j)),
      pl.BlockSpec((k // g, bn), lambda i, j, s: (0, j)),
  ]
  args = [x, w.packed, w.scale]
  if asymmetric:
    in_specs.append(pl.BlockSpec((k // g, bn), lambda i, j, s: (0, j)))
    args.append(w.minimum)
  partial = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((ks, mp, n), jnp.float32),
      grid=(mp // bm, n // bn, ks),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"quantized_matmul_q{w.bits}_g{g}",
  )(*args)
  return _finish(partial, m, x_scale, out_dtype)


# --- small-M kernel (decode) -----------------------------------------------------
#
# Backend: Pallas Triton, like the dot kernel above. Mosaic GPU's strengths (wgmma
# tensor-core tiles, TMA bulk copies) serve large tiles; a matrix-vector product
# has no tensor-core work worth the name and its loads are plain coalesced rows. (The
# Triton of JAX 0.11 pipelines none of them: no async copy in its code for an H200,
# where the dot kernel's operands get 18; the loads in flight come from many small
# programs per SM instead.)
#
# Why a second kernel: at M <= 8 the dot kernel pads M to a 16-row tensor-core tile and
# does two tiny dots and a scale per 32-row group; on an H200 it streamed the 4-bit
# weights at 0.6-0.7 TB/s (HBM: 4.8). Here nothing is a dot: each [8, block_n] tile of
# codes is dequantized in registers, multiplied by the rows' activations and summed over
# its 8 rows, then scaled by its group's scale into a [1, block_n] accumulator per row.
#
# The layout is what makes it stream. One warp per program, each thread 16 adjacent
# columns (one 16-byte load per tile row): a tile's rows are all in one thread, so its sum
# over rows needs no other thread, and the big tiles never change layout. (The kernel's
# first form kept [32, block_n] f32 accumulators over 4 warps with x as a [K, rows]
# column; Triton lays a column out with threads along its rows, so every tile went
# through shared memory into that layout: at M = 1, 4 conversions of 16 KB and 8 barriers a loop
# iteration, no async copy; counted by compiling for an H200 without one,
# docs/measurements/2026-12-06_gemv_structure.md.) K is split over programs so that all
# SMs stream at M = 1. Activations are f32 in the kernel (FP8 and bf16 widen exactly).

# Largest M that `backend="auto"` sends to the Pallas kernels; above it XLA's dequantize +
# dot (it fuses the dequantization into the product) runs. None: every M. To be set from
# what `scripts/bench_kernels.py` prints on a GPU ("dispatch: set ..."; not measured yet:
# on 2026-11-30 the dot kernel ran 0.35-0.61x a dense bf16 product at M = 64/256).
PALLAS_MAX_ROWS = None

# Largest M that dispatch sends to this kernel; 0 keeps every M on the dot kernel.
# To be set by hand from what `scripts/tune_qmm.py --kernels dot,gemv` prints on a GPU
# (not measured yet).
GEMV_MAX_ROWS = 0
# The most rows the kernel takes (each row's accumulator and activations live in registers;
# at 8 rows Triton's code for an H200 took minutes to compile).
GEMV_ROW_LIMIT = 4
# Rows of a tile (a thread holds them all: 8 x 16 bytes of codes).
GEMV_SUBTILE = 8
# Columns per program: 16 per thread of its one warp.
GEMV_BLOCK_N = 512
GEMV_WARPS = 1


def _qgemv_kernel(*refs, bits: int, group: int, half_k: int, groups_per_iter: int,
                  iters_per_split: int, asymmetric: bool, sub: int):
  if asymmetric:
    x_ref, p_ref, s_ref, m_ref, o_ref = refs
  else:
    x_ref, p_ref, s_ref, o_ref = refs
    m_ref = None
  # x_ref,   # [rows, K] f32
  # p_ref,   # [K//2, block_n] uint8 (4-bit) or [K, block_n] int8 (8-bit)
  # s_ref, m_ref,  # [K//group, block_n]
  # o_ref,   # [rows, block_n] f32 partial sum of this K split
  rows, block_n = o_ref.shape
  first = pl.program_id(1) * iters_per_split * groups_per_iter
  high_group_offset = half_k // group

  def tile_terms(codes, gi, x_row0, acc):
    """acc[r] += scale * sum over the tile's rows of codes x x[r] (+ min * sum of x[r])."""
    codes = codes.astype(jnp.float32)
    scale = s_ref[pl.ds(gi, 1), :].astype(jnp.float32)
    out = []
    for r, a in enumerate(acc):
      xr = x_ref[pl.ds(r, 1), pl.ds(x_row0, sub)]  # [1, sub]: contiguous, as the codes' rows
      term = jnp.sum(codes * xr.reshape(sub, 1), axis=0, keepdims=True) * scale
      if m_ref is not None:
        term = term + jnp.sum(xr) * m_ref[pl.ds(gi, 1), :].astype(jnp.float32)
      out.append(a + term)
    return tuple(out)

  def body(it, acc):
    for c in range(groups_per_iter):
      gi = first + it * groups_per_iter + c
      for j in range(group // sub):
        r0 = pl.multiple_of(gi * group + j * sub, sub)
        if bits == 4:
          p = p_ref[pl.ds(r0, sub), :].astype(jnp.int32) & 0xFF
          lo = p & 0xF
          hi = p >> 4
          if not asymmetric:
            lo = lo - 8
            hi = hi - 8
          acc = tile_terms(lo, gi, r0, acc)
          acc = tile_terms(hi, gi + high_group_offset, half_k + r0, acc)
        else:
          acc = tile_terms(p_ref[pl.ds(r0, sub), :], gi, r0, acc)
    return acc

  acc = tuple(jnp.zeros((1, block_n), jnp.float32) for _ in range(rows))
  acc = jax.lax.fori_loop(0, iters_per_split, body, acc)
  for r, a in enumerate(acc):
    o_ref[pl.ds(r, 1), :] = a


def choose_gemv_config(k: int, n: int, w: QuantizedTensor, *,
                       target_programs: int = 1056) -> tuple[int, int, int]:
  """Default (block_n, groups_per_iter, k_splits) of the small-M kernel.

  block_n: GEMV_BLOCK_N columns (16 per thread of one warp), or the largest power of two
  dividing N below it; one group per iteration (a 32-row group at 512 columns is 16 KB of
  codes); K is split until ~8 one-warp programs per SM (H100/H200) stream at once."""
  g = w.group_size
  block_n = _largest_pow2_divisor(n, GEMV_BLOCK_N)
  loop_groups = (k // 2 if w.bits == 4 else k) // g
  return block_n, 1, _split_k(n // block_n, loop_groups, target_programs, most=32)


def quantized_gemv_pallas(x: jax.Array, w: QuantizedTensor, x_scale: jax.Array | None = None,
                          *, out_dtype=None, block_n: int | None = None,
                          groups_per_iter: int | None = None, k_splits: int | None = None,
                          num_warps: int = GEMV_WARPS, num_stages: int = 3,
                          interpret: bool = False) -> jax.Array:
  """x: [M, K] -> [M, N] for M <= GEMV_ROW_LIMIT. Inputs assumed validated."""
  m, k = x.shape
  _, n = w.shape
  if m > GEMV_ROW_LIMIT:
    raise ValueError(f"quantized_gemv: M={m} rows > {GEMV_ROW_LIMIT}; use the dot kernel")
  if out_dtype is None:
    out_dtype = jnp.bfloat16 if x.dtype in FP8_DTYPES else x.dtype
  bn, gpi, ks = choose_gemv_config(k, n, w)
  bn = check_tiling("quantized_gemv", "block_n", block_n, bn, block=True)
  ks = check_tiling("quantized_gemv", "k_splits", k_splits, ks)
  gpi = check_tiling("quantized_gemv", "groups_per_iter", groups_per_iter, gpi)
  g = w.group_size
  loop_groups = (k // 2 if w.bits == 4 else k) // g
  if loop_groups % (gpi * ks):
    raise ValueError(f"quantized_gemv: groups_per_iter={gpi} x k_splits={ks} must divide "
                     f"{loop_groups} groups")
  if n % bn:
    raise ValueError(f"quantized_gemv: block_n={bn} must divide N={n}")
  rows = pl.next_power_of_2(m)
  xp = jnp.pad(x.astype(jnp.float32), ((0, rows - m), (0, 0)))
  asymmetric = w.minimum is not None
  kernel = functools.partial(
      _qgemv_kernel, bits=w.bits, group=g, half_k=k // 2, groups_per_iter=gpi,
      iters_per_split=loop_groups // (gpi * ks), asymmetric=asymmetric,
      sub=min(g, GEMV_SUBTILE))
  prow = w.packed.shape[0]
  in_specs = [
      pl.BlockSpec((rows, k), lambda j, s: (0, 0)),
      pl.BlockSpec((prow, bn), lambda j, s: (0, j)),
      pl.BlockSpec((k // g, bn), lambda j, s: (0, j)),
  ]
  args = [xp, w.packed, w.scale]
  if asymmetric:
    in_specs.append(pl.BlockSpec((k // g, bn), lambda j, s: (0, j)))
    args.append(w.minimum)
  partial = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((ks, rows, n), jnp.float32),
      grid=(n // bn, ks),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, rows, bn), lambda j, s: (s, 0, j)),
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"quantized_gemv_q{w.bits}_g{g}",
  )(*args)
  return _finish(partial, m, x_scale, out_dtype)


def flops_and_bytes(m: int, k: int, n: int, w: QuantizedTensor, x_itemsize: int = 2,
                    out_itemsize: int = 2) -> tuple[int, int]:
  """Useful FLOPs and minimum HBM bytes (weights + activations + output)."""
  return 2 * m * k * n, w.nbytes + m * k * x_itemsize + m * n * out_itemsize


__all__ = [
    "ACT_DTYPES", "FP8_DTYPES", "GEMV_MAX_ROWS", "GEMV_ROW_LIMIT", "PALLAS_MAX_ROWS",
    "choose_config",
    "choose_gemv_config", "device_part_error", "flops_and_bytes", "pallas_support_error", "quantized_gemv_pallas",
    "quantized_matmul_pallas", "quantized_matmul_reference",
]
