"""GGUF block formats -> `QuantizedTensor`, one unpack function per format.

Every format llama.cpp writes for weights is, per group of 16 or 32 values along K,
``w = scale * q + minimum`` (or ``(q - 8) * scale`` for Q4_0) with small integer codes q.
An unpack function reads a tensor's raw blocks into those three arrays, and
`to_quantized_tensor` lays them out for the kernels; adding a format is a new unpack
function and a `FORMATS` entry, never a new kernel.

  format  bytes/256  stored as (bits, group, scale dtype)      codes
  Q4_0      144      4-bit, 32, f16                            0..15, w = (q - 8) d
  Q4_1      160      4-bit, 32, f16 (+ f16 min)                0..15
  Q8_0      272      8-bit, 32, f16                            -128..127
  Q5_0      176      8-bit, 32, f16                            -16..15
  Q5_1      192      8-bit, 32, f16 (+ f16 min)                0..31
  Q2_K       84      4-bit, 16, f32 (+ f32 min)                0..3
  Q3_K      110      8-bit, 16, f32                            -4..3
  Q4_K      144      4-bit, 32, f32 (+ f32 min)                0..15
  Q5_K      176      8-bit, 32, f32 (+ f32 min)                0..31
  Q6_K      210      8-bit, 16, f32                            -32..31
  Q8_K      292      8-bit, 256, f32                           -128..127
  IQ4_NL    144      8-bit, 32, f16                            IQ4_VALUES
  IQ4_XS    136      8-bit, 32, f32                            IQ4_VALUES
  IQ3_S     110      8-bit, 32, f32                            +-1..15 (grid)
  IQ3_XXS    98      8-bit, 32, f32                            +-4..62 (grid)
  IQ2_S      82      8-bit, 16, f32                            +-8, 25, 43 (grid)
  IQ2_XS     74      8-bit, 16, f32                            +-8, 25, 43 (grid)
  IQ2_XXS    66      8-bit, 32, f32                            +-8, 25, 43 (grid)
  IQ1_M      56      8-bit, 16, f32                            +-1, 7, 9 (grid, x 8)
  IQ1_S      50      8-bit, 32, f32                            +-1, 7, 9 (grid, x 8)

The K-quants hold a two-level scale: an f16 super-block scale d (and dmin) times a 4-
or 6-bit integer per group. Their product has up to 11 + 8 significant bits, so it is
exact in f32 (24) but not in f16 (11): stored as f32, the dequantized values are the same
bits as gguf-py's and llama.cpp's (scale * q rounded once, minus the exact min product).
5- and 6-bit codes have no packed 5/6-bit layout in the kernels; they take the int8 one.
The IQ formats are non-linear: a nibble indexes a table of 16 integers (IQ4_VALUES), or an
index picks 4 or 8 values at once from a fixed grid of small integers (IQ1-IQ3, with sign
bits), times a per-group scale; the integers are the codes, so they too take the int8
layout: 8.5-10 bits per weight with the scales, 1.9x (IQ4_NL) to 5.8x (IQ1_S) the file. IQ1's values are grid +- 1/8: codes 8 grid +- 1
under a scale divided by 8 (exact). The grids are gguf-py's tables (the format's data).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import numpy as np

from pallas_kernels.quantized_tensor import QuantizedTensor, pack_int4

QK_K = 256  # elements per K-quant super-block
# The 16 levels a nibble of IQ4_NL / IQ4_XS stands for (ggml's kvalues_iq4nl).
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      np.int8)


class Codes(NamedTuple):
  """One tensor's unpacked blocks, rows = GGUF rows (outputs N), K along the last axis.

  w[r, k] = scale[r, k // group] * q[r, k] + minimum[r, k // group]
  (4-bit without minimum: (q - 8) * scale)."""

  q: np.ndarray  # [N, K] uint8 (4-bit: 0..15) or int8 (8-bit)
  scale: np.ndarray  # [N, K // group]
  minimum: np.ndarray | None  # [N, K // group] or None
  bits: int
  group: int


@dataclasses.dataclass(frozen=True)
class BlockFormat:
  block: int  # elements per block
  nbytes: int  # bytes per block
  unpack: Callable[[np.ndarray], Codes]  # blocks [N, blocks per row, nbytes] -> Codes


def _f16(b: np.ndarray) -> np.ndarray:
  """[..., 2] bytes -> [...] float16."""
  return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _f16_as_f32(b: np.ndarray) -> np.ndarray:
  return _f16(b).astype(np.float32)


def _rows(a: np.ndarray) -> np.ndarray:
  """[N, blocks, ...] -> [N, blocks * ...] (per-row values in K order)."""
  return a.reshape(a.shape[0], -1)


def _low_high(b: np.ndarray) -> np.ndarray:
  """Bytes [..., n] -> [..., 2, n]: low nibbles, then high nibbles."""
  return np.stack([b & 0xF, b >> 4], axis=-2)


def _bit_planes(b: np.ndarray, width: int) -> np.ndarray:
  """Bytes [..., n] -> [..., 8 // width, n]: fields of `width` bits, lowest first."""
  shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
  return (b[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


# --- the 32-element formats ------------------------------------------------------


def _unpack_q8_0(b):  # f16 d, 32 x int8
  q = np.ascontiguousarray(b[..., 2:]).view(np.int8)
  return Codes(_rows(q), _f16(b[..., 0:2]), None, bits=8, group=32)


def _unpack_q4_0(b):  # f16 d, 16 bytes: byte j holds element j (low) and j + 16 (high)
  return Codes(_rows(_low_high(b[..., 2:])), _f16(b[..., 0:2]), None, bits=4, group=32)


def _unpack_q4_1(b):  # f16 d, f16 m, 16 bytes as Q4_0
  return Codes(_rows(_low_high(b[..., 4:])), _f16(b[..., 0:2]), _f16(b[..., 2:4]), bits=4,
               group=32)


def _high_bits(b: np.ndarray) -> np.ndarray:
  """Q5_0/Q5_1's 4 bytes qh (a little-endian uint32) [..., 4] -> bit 4 of element j [..., 32]."""
  return np.unpackbits(b, axis=-1, bitorder="little")


def _unpack_q5_0(b):  # f16 d, 4 bytes qh, 16 bytes as Q4_0; w = (q - 16) d
  q = _rows(_low_high(b[..., 6:22])) | (_rows(_high_bits(b[..., 2:6])) << 4)
  return Codes((q.astype(np.int16) - 16).astype(np.int8), _f16(b[..., 0:2]), None, bits=8,
               group=32)


def _unpack_q5_1(b):  # f16 d, f16 m, 4 bytes qh, 16 bytes as Q4_0; w = q d + m
  q = _rows(_low_high(b[..., 8:24])) | (_rows(_high_bits(b[..., 4:8])) << 4)
  return Codes(q.astype(np.int8), _f16(b[..., 0:2]), _f16(b[..., 2:4]), bits=8, group=32)


# --- K-quants: 256-element super-blocks --------------------------------------------


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K/Q5_K's 12 scale bytes [..., 12] -> 6-bit (scales, mins), each [..., 8].

  Bytes 0-3: scales 0-3 (low 6 bits); 4-7: mins 0-3; 8-11: scales 4-7 (low nibble) and
  mins 4-7 (high nibble), whose top 2 bits sit in the top bits of bytes 0-3 / 4-7."""
  lo_sc, lo_m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
  sc = np.concatenate([lo_sc & 63, (hi & 0xF) | ((lo_sc >> 6) << 4)], axis=-1)
  mn = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
  return sc, mn


def _two_level(d, dmin, sc, mn):
  """Per-group f32 scale d * sc and minimum -(dmin * m): each product is exact in f32."""
  scale = d[..., None] * sc.astype(np.float32)
  minimum = None if dmin is None else -(dmin[..., None] * mn.astype(np.float32))
  return _rows(scale), None if minimum is None else _rows(minimum)


def _unpack_q4_k(b):
  """f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles: 32-byte chunk c holds
  sub-block 2c in its low and 2c + 1 in its high nibbles. w = d sc q - dmin m."""
  d, dmin = _f16_as_f32(b[..., 0:2]), _f16_as_f32(b[..., 2:4])
  sc, mn = _scale_min_k4(b[..., 4:16])
  q = _low_high(b[..., 16:144].reshape(*b.shape[:-1], 4, 32))  # [N, nb, chunk, lo/hi, 32]
  scale, minimum = _two_level(d, dmin, sc, mn)
  return Codes(_rows(q), scale, minimum, bits=4, group=32)


def _unpack_q5_k(b):
  """Q4_K's layout plus 32 bytes qh whose bit i of byte j is bit 4 of sub-block i's
  element j: codes 0..31, w = d sc q - dmin m."""
  d, dmin = _f16_as_f32(b[..., 0:2]), _f16_as_f32(b[..., 2:4])
  sc, mn = _scale_min_k4(b[..., 4:16])
  low = _low_high(b[..., 48:176].reshape(*b.shape[:-1], 4, 32)).reshape(*b.shape[:-1], 8, 32)
  high = _bit_planes(b[..., 16:48], 1)  # [N, nb, 8 sub-blocks, 32]
  q = (low | (high << 4)).astype(np.int8)
  scale, minimum = _two_level(d, dmin, sc, mn)
  return Codes(_rows(q), scale, minimum, bits=8, group=32)


def _unpack_q6_k(b):
  """128 bytes ql, 64 bytes qh, 16 int8 scales, f16 d; two halves of 128 elements.
  In half h, quarter j (32 elements): low 4 bits from ql[64h + 32 (j % 2) + l] (low
  nibble for j < 2, high for j >= 2), top 2 bits from bits 2j of qh[32h + l].
  w = d sc (q - 32), one scale per 16 elements."""
  lead = b.shape[:-1]
  ql = _low_high(b[..., 0:128].reshape(*lead, 2, 64)).reshape(*lead, 2, 4, 32)
  qh = _bit_planes(b[..., 128:192].reshape(*lead, 2, 32), 2)  # [N, nb, half, j, 32]
  q = ((ql | (qh << 4)).astype(np.int16) - 32).astype(np.int8)
  sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
  scale, _ = _two_level(_f16_as_f32(b[..., 208:210]), None, sc, None)
  return Codes(_rows(q), scale, None, bits=8, group=16)


def _unpack_q3_k(b):
  """32 bytes hmask, 64 bytes qs, 12 scale bytes, f16 d. Element e = 128h + 32j + l:
  low 2 bits = bits 2j of qs[32h + l], and 4 is subtracted unless bit e // 32 of
  hmask[l] is set (codes -4..3). 16 6-bit scales (minus 32): low nibbles of bytes 0-7
  then their high nibbles; top 2 bits of scale i in bits 2 (i // 4) of byte 8 + i % 4.
  w = d (sc - 32) q, one scale per 16 elements."""
  lead = b.shape[:-1]
  low = _bit_planes(b[..., 32:96].reshape(*lead, 2, 32), 2).reshape(*lead, 8, 32)
  high = _bit_planes(b[..., 0:32], 1)  # [N, nb, 8, 32]
  q = low.astype(np.int8) - np.where(high == 0, 4, 0).astype(np.int8)
  s = b[..., 96:108]
  low_sc = _low_high(s[..., 0:8]).reshape(*lead, 16)
  high_sc = _bit_planes(s[..., 8:12], 2).reshape(*lead, 16)
  sc = (low_sc | (high_sc << 4)).astype(np.int16) - 32
  scale, _ = _two_level(_f16_as_f32(b[..., 108:110]), None, sc, None)
  return Codes(_rows(q), scale, None, bits=8, group=16)


def _unpack_q2_k(b):
  """16 scale bytes (low nibble scale, high nibble min, per 16 elements), 64 bytes qs,
  f16 d, f16 dmin. Element 128h + 32j + l = bits 2j of qs[32h + l].
  w = d sc q - dmin m."""
  lead = b.shape[:-1]
  q = _bit_planes(b[..., 16:80].reshape(*lead, 2, 32), 2)
  s = b[..., 0:16]
  scale, minimum = _two_level(_f16_as_f32(b[..., 80:82]), _f16_as_f32(b[..., 82:84]),
                              s & 0xF, s >> 4)
  return Codes(_rows(q), scale, minimum, bits=4, group=16)


def _unpack_q8_k(b):
  """f32 d, 256 x int8, 16 int16 block sums (llama.cpp's own bookkeeping; unused).
  w = d q."""
  d = np.ascontiguousarray(b[..., 0:4]).view(np.float32)  # [N, nb, 1]
  q = np.ascontiguousarray(b[..., 4:260]).view(np.int8)
  return Codes(_rows(q), _rows(d), None, bits=8, group=QK_K)


# --- IQ4: non-linear 4-bit levels ----------------------------------------------------


def _unpack_iq4_nl(b):
  """f16 d, 16 bytes of nibbles laid out as Q4_0's; w = d IQ4_VALUES[nibble]."""
  return Codes(_rows(IQ4_VALUES[_low_high(b[..., 2:18])]), _f16(b[..., 0:2]), None, bits=8,
               group=32)


def _unpack_iq4_xs(b):
  """f16 d, 2 bytes scales_h, 4 bytes scales_l, 128 bytes of nibbles: sub-block i (32
  elements) has the 6-bit scale ls = nibble i of scales_l (low nibble first) + bits 2i of
  scales_h (a little-endian uint16) << 4, and its 16 bytes laid out as Q4_0's.
  w = d (ls - 32) IQ4_VALUES[nibble]."""
  lead = b.shape[:-1]
  low_sc = np.swapaxes(_low_high(b[..., 4:8]), -1, -2).reshape(*lead, 8)
  high_sc = np.swapaxes(_bit_planes(b[..., 2:4], 2), -1, -2).reshape(*lead, 8)
  sc = (low_sc | (high_sc << 4)).astype(np.int16) - 32
  q = IQ4_VALUES[_low_high(b[..., 8:136].reshape(*lead, 8, 16))]
  scale, _ = _two_level(_f16_as_f32(b[..., 0:2]), None, sc, None)
  return Codes(_rows(q), scale, None, bits=8, group=32)


# --- IQ1-IQ3: values from a grid of small integers -------------------------------------


@functools.cache
def _grid(kind: str) -> np.ndarray:
  """The format's grid [entries, 4 or 8] as int8 (gguf-py holds ggml's tables)."""
  import gguf

  cls = getattr(gguf.quants, kind)
  cls.init_grid()
  return np.asarray(cls.grid, np.float32).reshape(cls.grid_shape).astype(np.int8)


# 7 sign bits -> 8 (the 8th makes the number of minus signs even), as ggml's ksigns_iq2xs.
_EVEN_SIGNS = np.array([i | ((bin(i).count("1") & 1) << 7) for i in range(128)], np.uint8)


def _sign_bits(b: np.ndarray) -> np.ndarray:
  """Bytes [...] -> [..., 8] of +1 / -1 (bit i set: element i negative)."""
  return 1 - 2 * _bit_planes(b[..., None], 1)[..., 0].astype(np.int8)


def _u32(b: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(b).view("<u4")


def _u16(b: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(b).view("<u2")


def _grid_codes(kind: str, index: np.ndarray, signs: np.ndarray) -> np.ndarray:
  """Grid rows at `index` [...] -> [..., n] int8, times signs [..., n] (+-1)."""
  return _grid(kind)[index] * signs


def _half_step_scale(d, ls, step):
  """d (ls + 1/2) step: ggml's IQ2/IQ3_XXS sub-block scale (exact in f32)."""
  return d[..., None] * (np.float32(0.5) + ls.astype(np.float32)) * np.float32(step)


def _unpack_iq2_xxs(b):
  """f16 d, then per 32 elements two little-endian uint32: the first holds 4 grid
  indices (a byte each, 8 values each), the second 4 x 7 sign bits (bits 7j; the 8th
  sign from parity) and a 4-bit scale ls in its top bits. w = d (ls + 1/2) / 4 g s."""
  lead = b.shape[:-1]
  words = _u32(b[..., 2:66]).reshape(*lead, 8, 2)
  index = b[..., 2:66].reshape(*lead, 8, 8)[..., 0:4]  # the first word's bytes
  sign_idx = (words[..., 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F
  q = _grid_codes("IQ2_XXS", index, _sign_bits(_EVEN_SIGNS[sign_idx]))
  scale = _half_step_scale(_f16_as_f32(b[..., 0:2]), words[..., 1] >> 28, 0.25)
  return Codes(_rows(q), _rows(scale), None, bits=8, group=32)


def _unpack_iq2_xs(b):
  """f16 d, 32 little-endian uint16 (grid index: low 9 bits; 7 sign bits above), 8
  bytes of 4-bit scales (low nibble first), one per 16 elements.
  w = d (ls + 1/2) / 4 g s."""
  lead = b.shape[:-1]
  qs = _u16(b[..., 2:66])
  q = _grid_codes("IQ2_XS", qs & 511, _sign_bits(_EVEN_SIGNS[qs >> 9]))
  ls = np.swapaxes(_low_high(b[..., 66:74]), -1, -2).reshape(*lead, 16)
  scale = _half_step_scale(_f16_as_f32(b[..., 0:2]), ls, 0.25)
  return Codes(_rows(q), _rows(scale), None, bits=8, group=16)


def _unpack_iq2_s(b):
  """f16 d, 32 bytes of grid index low bits, 32 bytes of explicit sign bits (one byte
  per 8 elements), 8 bytes whose 2-bit fields (lowest first) are the indices' bits 8-9,
  8 bytes of 4-bit scales per 16 elements. w = d (ls + 1/2) / 4 g s."""
  lead = b.shape[:-1]
  high = _bit_planes(b[..., 66:74], 2)  # [..., 4 fields, 8 bytes]
  index = b[..., 2:34].astype(np.uint16) | (np.swapaxes(high, -1, -2).reshape(*lead, 32)
                                           .astype(np.uint16) << 8)
  q = _grid_codes("IQ2_S", index, _sign_bits(b[..., 34:66]))
  ls = np.swapaxes(_low_high(b[..., 74:82]), -1, -2).reshape(*lead, 16)
  scale = _half_step_scale(_f16_as_f32(b[..., 0:2]), ls, 0.25)
  return Codes(_rows(q), _rows(scale), None, bits=8, group=16)


def _unpack_iq3_xxs(b):
  """f16 d, 64 bytes of grid indices (4 values each), then per 32 elements a
  little-endian uint32 of 4 x 7 sign bits (parity completes each 8) and a 4-bit scale ls
  in its top bits. w = d (ls + 1/2) / 2 g s."""
  lead = b.shape[:-1]
  words = _u32(b[..., 66:98])  # [..., 8]
  sign_idx = (words[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F  # [..., 8, 4]
  signs = _sign_bits(_EVEN_SIGNS[sign_idx]).reshape(*lead, 64, 4)
  q = _grid_codes("IQ3_XXS", b[..., 2:66], signs)
  scale = _half_step_scale(_f16_as_f32(b[..., 0:2]), words >> 28, 0.5)
  return Codes(_rows(q), _rows(scale), None, bits=8, group=32)


def _unpack_iq3_s(b):
  """f16 d, 64 bytes of grid index low bits (4 values each), 8 bytes whose bit i of
  byte j is bit 8 of index 8j + i, 32 bytes of explicit sign bits, 4 bytes of 4-bit scales
  (low nibble first) per 32 elements. w = d (2 ls + 1) g s."""
  lead = b.shape[:-1]
  high = np.swapaxes(_bit_planes(b[..., 66:74], 1), -1, -2).reshape(*lead, 64)
  index = b[..., 2:66].astype(np.uint16) | (high.astype(np.uint16) << 8)
  signs = _sign_bits(b[..., 74:106]).reshape(*lead, 64, 4)
  q = _grid_codes("IQ3_S", index, signs)
  ls = np.swapaxes(_low_high(b[..., 106:110]), -1, -2).reshape(*lead, 8)
  scale = _f16_as_f32(b[..., 0:2])[..., None] * (1 + 2 * ls.astype(np.float32))
  return Codes(_rows(q), _rows(scale), None, bits=8, group=32)


def _iq1_codes(index, minus):
  """Grid rows (values -1, 0, 1) at `index` plus +-1/8 (minus: -), times 8: int8."""
  return 8 * _grid("IQ1_S")[index] + np.where(minus, -1, 1)[..., None].astype(np.int8)


def _unpack_iq1_s(b):
  """f16 d, 32 bytes of grid index low bits (8 values each), then per 32 elements a
  little-endian uint16: 4 x 3 bits of index bits 8-10, a 3-bit scale ls (bits 12-14), and
  the sign of the shift (bit 15). w = d (2 ls + 1) (g +- 1/8)."""
  lead = b.shape[:-1]
  qh = _u16(b[..., 34:50])  # [..., 8]
  high = (qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7  # [..., 8, 4]
  index = b[..., 2:34].reshape(*lead, 8, 4).astype(np.uint16) | (high << 8)
  q = _iq1_codes(index, np.broadcast_to((qh >> 15)[..., None] > 0, index.shape))
  scale = _f16_as_f32(b[..., 0:2])[..., None] * (2 * ((qh >> 12) & 7).astype(np.float32) + 1) / 8
  return Codes(_rows(q), _rows(scale), None, bits=8, group=32)


def _unpack_iq1_m(b):
  """32 bytes of grid index low bits (8 values each), 16 bytes of nibbles (low first),
  one per index: bits 0-2 its bits 8-10, bit 3 the sign of the shift; then 4 little-endian
  uint16 holding 3-bit scales ls (bits 0-11, per 16 elements) and, in their top nibbles
  (first word lowest), the f16 d. w = d (2 ls + 1) (g +- 1/8)."""
  lead = b.shape[:-1]
  nib = np.swapaxes(_low_high(b[..., 32:48]), -1, -2).reshape(*lead, 32)
  index = b[..., 0:32].astype(np.uint16) | ((nib & 7).astype(np.uint16) << 8)
  q = _iq1_codes(index, (nib & 8) > 0)
  words = _u16(b[..., 48:56])  # [..., 4]
  d_bits = np.bitwise_or.reduce((words >> 12) << np.array([0, 4, 8, 12], np.uint16), axis=-1)
  d = np.ascontiguousarray(d_bits.astype(np.uint16)).view(np.float16).astype(np.float32)
  ls = ((words[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(*lead, 16)
  scale = d[..., None] * (2 * ls.astype(np.float32) + 1) / 8
  return Codes(_rows(q), _rows(scale), None, bits=8, group=16)


FORMATS: dict[str, BlockFormat] = {
    "Q4_0": BlockFormat(32, 18, _unpack_q4_0),
    "Q4_1": BlockFormat(32, 20, _unpack_q4_1),
    "Q8_0": BlockFormat(32, 34, _unpack_q8_0),
    "Q5_0": BlockFormat(32, 22, _unpack_q5_0),
    "Q5_1": BlockFormat(32, 24, _unpack_q5_1),
    "Q2_K": BlockFormat(QK_K, 84, _unpack_q2_k),
    "Q3_K": BlockFormat(QK_K, 110, _unpack_q3_k),
    "Q4_K": BlockFormat(QK_K, 144, _unpack_q4_k),
    "Q5_K": BlockFormat(QK_K, 176, _unpack_q5_k),
    "Q6_K": BlockFormat(QK_K, 210, _unpack_q6_k),
    "Q8_K": BlockFormat(QK_K, 292, _unpack_q8_k),
    "IQ4_NL": BlockFormat(32, 18, _unpack_iq4_nl),
    "IQ4_XS": BlockFormat(QK_K, 136, _unpack_iq4_xs),
    "IQ3_S": BlockFormat(QK_K, 110, _unpack_iq3_s),
    "IQ3_XXS": BlockFormat(QK_K, 98, _unpack_iq3_xxs),
    "IQ2_S": BlockFormat(QK_K, 82, _unpack_iq2_s),
    "IQ2_XS": BlockFormat(QK_K, 74, _unpack_iq2_xs),
    "IQ2_XXS": BlockFormat(QK_K, 66, _unpack_iq2_xxs),
    "IQ1_M": BlockFormat(QK_K, 56, _unpack_iq1_m),
    "IQ1_S": BlockFormat(QK_K, 50, _unpack_iq1_s),
}


def unpack_blocks(kind: str, raw: np.ndarray) -> Codes:
  """Raw bytes of a 2-D tensor ([N, K / block * nbytes] uint8) -> Codes."""
  fmt = FORMATS[kind]
  raw = np.asarray(raw, np.uint8)
  return fmt.unpack(raw.reshape(raw.shape[0], -1, fmt.nbytes))


def to_quantized_tensor(codes: Codes) -> QuantizedTensor:
  """Codes (rows = N) -> QuantizedTensor [K, N] (transposed; 4-bit codes packed)."""
  t = lambda a: None if a is None else np.ascontiguousarray(a.T)
  q = t(codes.q)
  packed = pack_int4(q) if codes.bits == 4 else q.astype(np.int8)
  return QuantizedTensor(packed=packed, scale=t(codes.scale), minimum=t(codes.minimum),
                         bits=codes.bits, group_size=codes.group)


def quantized_from_gguf(kind: str, raw: np.ndarray) -> QuantizedTensor:
  """A GGUF tensor's raw blocks ([N rows, bytes]) -> QuantizedTensor [K, N]."""
  return to_quantized_tensor(unpack_blocks(kind, raw))
