// Quantized weights x int8-quantized activations for the CPU (AVX512-VNNI), as
// an XLA FFI custom call.
//
// XLA's CPU dot reads f32 (or bf16) weights: a decode step streams 540 MB (270 MB)
// of weights for the embedded model, which bounds batch-1 decoding by memory
// bandwidth. Here the weights stay 4-bit (or 8-bit) and each activation row is
// quantized per block of 32 to two int8 levels, so each block's dot product is
// exact integer arithmetic (vpdpbusd) scaled once:
//
//   s = max|x| / 127;  xa = rint(x / s);  xr = rint((x - s xa) / (s / 127))
//   x ~ (s / 127) (127 xa + xr)           (~15 bits; one level, as llama.cpp's
//                                          Q8 activations, moved the embedded
//                                          model's logits 8x more than bf16 does)
//   y[m, n] = sum over blocks b of
//             d[b, n] (s / 127) (127 sum_k q xa + sum_k q xr - zero (127 sum xa + sum xr))
//             + min[b, n] xsum[m, b]                              (asymmetric weights)
//
//   w = (q - zero) d (+ min):  zero 8 (Q4_0), 0 with min (Q4_1), 128 (Q8_0 stored q+128).
//
// Layout (built by `pallas_kernels.vnni_matmul.pack`), per tile of 16 columns:
//   w      u8  [N/16, K/8, 16, 4] (4-bit: byte j of (t, kb, c) = q[8kb+j] | q[8kb+4+j] << 4)
//          u8  [N/16, K/4, 16, 4] (8-bit: byte j of (t, kb, c) = q[4kb+j] + 128)
//          4-bit with a lut (has_lut): a nibble indexes lut u8 [16], the stored values
//          (code + 128, zero 128) of a weight of at most 16 distinct codes (IQ4_NL/XS)
//   scale  f16 [N/16, K/32, 16];  minimum f16 [N/16, K/32, 16] (read when has_min)
//   x      f32 [M, K];            out f32 [M, N]
//
// Paths: AVX512-VNNI (vpdpbusd, 16 columns x up to 4 rows per register tile)
// for fewer than 16 rows; AMX (tdpbsud on 16-row x 16-column tiles, ~3x the
// VNNI throughput at batch 32) from 16 rows on, where the OS grants the tile
// state; on CPUs without AVX-512, AVX2 (vpmaddubsw + vpmaddwd on 4-bit values:
// 8-bit weights as two nibbles, so no 16-bit sum saturates; 8 columns x up to 4
// rows). All produce the same exact block sums and scale them with the same f32
// operations in the same order (the residual as one fused x - xa s, the block sum
// of x in one fixed tree), so they give identical bits.
//
// Determinism: row m's activations are quantized from row m alone, its integer
// block sums are exact, and its f32 accumulation runs over the blocks in order
// whatever the number of rows, the row's position in a row group, or the thread
// that computes the tile: a row's result never depends on the other rows.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "tile_runs.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Built with -march=native: without AVX512-VNNI or AVX2 (+ FMA, F16C) the handler
// only reports that (O1jaxInt8MatmulSupported() lets Python check before calling it:
// 0 none, 1 AVX512-VNNI, 2 AVX2).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define O1JAX_INT8_MATMUL 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define O1JAX_INT8_MATMUL 2
#else
#define O1JAX_INT8_MATMUL 0
#endif

#if O1JAX_INT8_MATMUL == 1 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define O1JAX_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define O1JAX_AMX 0
#endif

extern "C" int O1jaxInt8MatmulSupported() { return O1JAX_INT8_MATMUL; }

namespace {

constexpr int64_t kBlock = 32;  // quantization block along K (weights and activations)
constexpr int64_t kTile = 16;   // output columns per tile (one zmm of f32)

#if O1JAX_INT8_MATMUL

struct Problem {
  int64_t m, k, n, bits, zero;
  bool has_min;
  const uint8_t* w;
  const uint16_t* scale;
  const uint16_t* minimum;
  const uint8_t* lut;  // 4-bit with a lut: the 16 stored values (code + 128) a nibble indexes
  // Quantized activations (filled by the calling thread before the tiles run).
  const int8_t* xa;     // [M, K] coarse level
  const int8_t* xr;     // [M, K] fine level (the rounding residual of xa)
  const float* xs;      // [M, K/32] s / 127: the fine level's step
  const int32_t* xsum;  // [M, K/32] 127 sum xa + sum xr (for `zero`)
  const float* fsum;    // [M, K/32] f32 sum of the block's values (for `min`)
  float* out;
};

// The f32 sum of a block's 32 values in one fixed tree (the order GCC's
// _mm512_reduce_add_ps of x[0..15] + x[16..31] adds in), for every build.
inline float SumBlock(const float* x) {
  float u[16], a[8], b[4];
  for (int i = 0; i < 16; ++i) u[i] = x[i] + x[i + 16];
  for (int i = 0; i < 8; ++i) a[i] = u[i + 8] + u[i];
  for (int i = 0; i < 4; ++i) b[i] = a[i + 4] + a[i];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// A block holding a NaN or an infinity gets a NaN step: its row's outputs are NaN, as
// the reference's (max ignored a NaN and the int conversions wrapped an infinity: a
// NaN row came out finite, an infinite one with wrong signs).
inline float StepOrNan(const float* x, float step) {
  bool finite = true;
  for (int i = 0; i < kBlock; ++i) finite &= std::isfinite(x[i]);
  return finite ? step : std::numeric_limits<float>::quiet_NaN();
}

#if O1JAX_INT8_MATMUL == 1

inline void StoreInt8(const __m512i v, int8_t* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(v));
}

// Row x[0..k) -> two int8 levels per block (see the top). The reference
// (`vnni_matmul.quantize_activations`) does the same f32 operations.
void QuantizeRow(const float* x, int64_t k, int8_t* xa, int8_t* xr, float* xs, int32_t* xsum,
                 float* fsum) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    const __m512 v[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const float step = amax / 127.0f;
    xs[b] = StepOrNan(xb, step / 127.0f);
    fsum[b] = SumBlock(xb);
    __m512i total = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      // cvtps_epi32 rounds to nearest even (the default MXCSR mode), like jnp.round.
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)));
      // x - xa s fused (one rounding), written out so no compiler choice decides it.
      const __m512 r = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), _mm512_set1_ps(step), v[h]);
      __m512i qr = _mm512_cvtps_epi32(_mm512_mul_ps(r, _mm512_set1_ps(inv * 127.0f)));
      qr = _mm512_max_epi32(_mm512_min_epi32(qr, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_mullo_epi32(qa, _mm512_set1_epi32(127)), qr));
      StoreInt8(qa, xa + b * kBlock + 16 * h);
      StoreInt8(qr, xr + b * kBlock + 16 * h);
    }
    xsum[b] = _mm512_reduce_add_epi32(total);
  }
}

inline __m512i Bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 LoadF16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The per-block scaling both paths share: acc += d (s/127) (127 coarse + fine
// - zero xsum) (+ min fsum) for row `row`, block b.
template <bool HAS_MIN>
inline __m512 ScaleBlock(const Problem& p, __m512 acc, __m512i coarse, __m512i fine, __m512 d,
                         __m512 mn, int64_t row, int64_t b) {
  const int64_t rb = row * (p.k / kBlock) + b;
  // 127 coarse + fine (exact integers: any way of computing it gives the same bits)
  __m512i s = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(coarse, 7), coarse), fine);
  if (p.zero != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(int32_t(p.zero) * p.xsum[rb]));
  const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(p.xs[rb]));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), ds, acc);
  if constexpr (HAS_MIN) acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(p.fsum[rb]), acc);
  return acc;
}

// Rows m0..m0+MR of tile t.
template <int MR, int BITS, bool HAS_MIN, bool LUT>
void TileRows(const Problem& p, int64_t t, int64_t m0) {
  const int64_t blocks = p.k / kBlock;
  constexpr int64_t kLoads = BITS == 4 ? 4 : 8;  // 64-byte weight loads per block
  const uint8_t* wt = p.w + t * blocks * kLoads * 64;
  const uint16_t* st = p.scale + t * blocks * kTile;
  const uint16_t* mt = HAS_MIN ? p.minimum + t * blocks * kTile : nullptr;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i lutv = _mm512_setzero_si512();
  if constexpr (LUT) lutv = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.lut)));
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i coarse[MR], fine[MR];
    for (int r = 0; r < MR; ++r) coarse[r] = fine[r] = _mm512_setzero_si512();
    const uint8_t* wb = wt + b * kLoads * 64;
    for (int j = 0; j < kLoads; ++j) {
      const __m512i raw = _mm512_loadu_si512(wb + j * 64);
      if constexpr (BITS == 4) {
        __m512i lo = _mm512_and_si512(raw, low4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        if constexpr (LUT) {  // nibbles -> stored values (u8, exact in vpdpbusd)
          lo = _mm512_shuffle_epi8(lutv, lo);
          hi = _mm512_shuffle_epi8(lutv, hi);
        }
        const int64_t kk = b * kBlock + j * 8;
        for (int r = 0; r < MR; ++r) {
          const int64_t at = (m0 + r) * p.k + kk;
          coarse[r] = _mm512_dpbusd_epi32(coarse[r], lo, Bcast4(p.xa + at));
          coarse[r] = _mm512_dpbusd_epi32(coarse[r], hi, Bcast4(p.xa + at + 4));
          fine[r] = _mm512_dpbusd_epi32(fine[r], lo, Bcast4(p.xr + at));
          fine[r] = _mm512_dpbusd_epi32(fine[r], hi, Bcast4(p.xr + at + 4));
        }
      } else {
        const int64_t kk = b * kBlock + j * 4;
        for (int r = 0; r < MR; ++r) {
          const int64_t at = (m0 + r) * p.k + kk;
          coarse[r] = _mm512_dpbusd_epi32(coarse[r], raw, Bcast4(p.xa + at));
          fine[r] = _mm512_dpbusd_epi32(fine[r], raw, Bcast4(p.xr + at));
        }
      }
    }
    const __m512 d = LoadF16(st + b * kTile);
    __m512 mn = _mm512_setzero_ps();
    if constexpr (HAS_MIN) mn = LoadF16(mt + b * kTile);
    for (int r = 0; r < MR; ++r) acc[r] = ScaleBlock<HAS_MIN>(p, acc[r], coarse[r], fine[r], d, mn, m0 + r, b);
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(p.out + (m0 + r) * p.n + t * kTile, acc[r]);
}

#if O1JAX_AMX

constexpr int64_t kAmxRows = 16;  // rows per AMX tile (activation buffers are padded to it)

// The OS hands out AMX tile state only on request (per process).
bool AmxPermitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers: 0 weights (K=32 x 16 columns: 8 rows of 64 bytes), 1 / 2 the
// coarse / fine activation levels (16 rows x 32 bytes), 3 / 4 and 5 / 6 their
// block sums (16 x 16 int32) for even and odd blocks: the AMX work of one
// block can then overlap the f32 scaling of the previous one.
void ConfigureTiles() {
  TileConfig c;
  c.rows[0] = 8;  c.colsb[0] = 64;
  c.rows[1] = 16; c.colsb[1] = 32;
  c.rows[2] = 16; c.colsb[2] = 32;
  for (int i = 3; i <= 6; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

// Block b's exact sums for rows m0..m0+15 into sums[0] (coarse), sums[1] (fine).
// (GCC's tile intrinsics take literal register numbers, hence the two branches.)
template <int BITS, bool LUT>
inline void AmxBlockSums(const Problem& p, const uint8_t* wb, int64_t m0, int64_t b, bool odd,
                         uint8_t* wbuf, int32_t* sums) {
  if constexpr (BITS == 4) {  // rows 2j / 2j+1: k = 8j..8j+3 / 8j+4..8j+7
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i lutv = _mm512_setzero_si512();
    if constexpr (LUT) lutv = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.lut)));
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(wb + j * 64);
      __m512i lo = _mm512_and_si512(raw, low4);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      if constexpr (LUT) {
        lo = _mm512_shuffle_epi8(lutv, lo);
        hi = _mm512_shuffle_epi8(lutv, hi);
      }
      _mm512_store_si512(wbuf + (2 * j) * 64, lo);
      _mm512_store_si512(wbuf + (2 * j + 1) * 64, hi);
    }
    _tile_loadd(0, wbuf, 64);
  } else {
    _tile_loadd(0, wb, 64);
  }
  _tile_loadd(1, p.xa + m0 * p.k + b * kBlock, p.k);
  _tile_loadd(2, p.xr + m0 * p.k + b * kBlock, p.k);
  int32_t* fine = sums + kAmxRows * kTile;
  if (!odd) {  // signed activations x unsigned weights
    _tile_zero(3);
    _tile_zero(4);
    _tile_dpbsud(3, 1, 0);
    _tile_dpbsud(4, 2, 0);
    _tile_stored(3, sums, 64);
    _tile_stored(4, fine, 64);
  } else {
    _tile_zero(5);
    _tile_zero(6);
    _tile_dpbsud(5, 1, 0);
    _tile_dpbsud(6, 2, 0);
    _tile_stored(5, sums, 64);
    _tile_stored(6, fine, 64);
  }
}

template <int BITS, bool HAS_MIN, bool LUT>
void TileAmx(const Problem& p, int64_t t) {
  const int64_t blocks = p.k / kBlock;
  constexpr int64_t kLoads = BITS == 4 ? 4 : 8;
  const uint8_t* wt = p.w + t * blocks * kLoads * 64;
  const uint16_t* st = p.scale + t * blocks * kTile;
  const uint16_t* mt = HAS_MIN ? p.minimum + t * blocks * kTile : nullptr;
  alignas(64) uint8_t wbuf[2][8 * 64];  // a block's 4-bit weights as bytes (even / odd blocks)
  alignas(64) int32_t sums[2][2 * kAmxRows * kTile];
  for (int64_t m0 = 0; m0 < p.m; m0 += kAmxRows) {
    __m512 acc[kAmxRows];
    for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
    AmxBlockSums<BITS, LUT>(p, wt, m0, 0, false, wbuf[0], sums[0]);
    for (int64_t b = 0; b < blocks; ++b) {
      const int cur = b & 1;
      if (b + 1 < blocks) {  // next block's sums while this one is scaled
        AmxBlockSums<BITS, LUT>(p, wt + (b + 1) * kLoads * 64, m0, b + 1, cur == 0, wbuf[1 - cur],
                           sums[1 - cur]);
      }
      const int32_t* coarse = sums[cur];
      const int32_t* fine = sums[cur] + kAmxRows * kTile;
      const __m512 d = LoadF16(st + b * kTile);
      __m512 mn = _mm512_setzero_ps();
      if constexpr (HAS_MIN) mn = LoadF16(mt + b * kTile);
#pragma GCC unroll 16
      for (int r = 0; r < kAmxRows; ++r) {
        acc[r] = ScaleBlock<HAS_MIN>(p, acc[r], _mm512_load_si512(coarse + r * kTile),
                                     _mm512_load_si512(fine + r * kTile), d, mn, m0 + r, b);
      }
    }
    for (int r = 0; r < kAmxRows && m0 + r < p.m; ++r) {
      _mm512_storeu_ps(p.out + (m0 + r) * p.n + t * kTile, acc[r]);
    }
  }
}

#endif  // O1JAX_AMX

template <int BITS, bool HAS_MIN, bool LUT>
void Tile(const Problem& p, int64_t t) {
  constexpr int kRows = 4;  // rows sharing each weight load
  int64_t m0 = 0;
  for (; m0 + kRows <= p.m; m0 += kRows) TileRows<kRows, BITS, HAS_MIN, LUT>(p, t, m0);
  switch (p.m - m0) {
    case 3: TileRows<3, BITS, HAS_MIN, LUT>(p, t, m0); break;
    case 2: TileRows<2, BITS, HAS_MIN, LUT>(p, t, m0); break;
    case 1: TileRows<1, BITS, HAS_MIN, LUT>(p, t, m0); break;
    default: break;
  }
}

#else  // O1JAX_INT8_MATMUL == 2: AVX2

// As the AVX-512 QuantizeRow, 8 values at a time: the same f32 operations.
void QuantizeRow(const float* x, int64_t k, int8_t* xa, int8_t* xr, float* xs, int32_t* xsum,
                 float* fsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int h = 0; h < 4; ++h) {
      v[h] = _mm256_loadu_ps(xb + 8 * h);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[h]));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float amax = lanes[0];
    for (int i = 1; i < 8; ++i) amax = std::max(amax, lanes[i]);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const float step = amax / 127.0f;
    xs[b] = StepOrNan(xb, step / 127.0f);
    fsum[b] = SumBlock(xb);
    __m256i total = _mm256_setzero_si256();
    for (int h = 0; h < 4; ++h) {
      const __m256i qa = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], _mm256_set1_ps(inv)));
      const __m256 r = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(qa), _mm256_set1_ps(step), v[h]);
      __m256i qr = _mm256_cvtps_epi32(_mm256_mul_ps(r, _mm256_set1_ps(inv * 127.0f)));
      qr = _mm256_max_epi32(_mm256_min_epi32(qr, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
      total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_mullo_epi32(qa, _mm256_set1_epi32(127)), qr));
      alignas(32) int32_t a[8], rr[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(a), qa);
      _mm256_store_si256(reinterpret_cast<__m256i*>(rr), qr);
      for (int i = 0; i < 8; ++i) {
        xa[b * kBlock + 8 * h + i] = int8_t(a[i]);
        xr[b * kBlock + 8 * h + i] = int8_t(rr[i]);
      }
    }
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), total);
    xsum[b] = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
  }
}

inline __m256i Bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Per 32-bit lane: the exact sum of its 4 (unsigned 4-bit weight x signed 8-bit
// activation) products (|pair| <= 2 x 15 x 127: vpmaddubsw cannot saturate).
inline __m256i Dot4(__m256i w4, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w4, x), _mm256_set1_epi16(1));
}

// Rows m0..m0+MR of columns 8h..8h+7 of tile t: the same block sums and scaling as
// the AVX-512 TileRows.
template <int MR, int BITS, bool HAS_MIN, bool LUT>
void HalfTileRows(const Problem& p, int64_t t, int h, int64_t m0) {
  const int64_t blocks = p.k / kBlock;
  constexpr int64_t kLoads = BITS == 4 ? 4 : 8;  // 64-byte weight groups per block
  const uint8_t* wt = p.w + t * blocks * kLoads * 64 + 32 * h;
  const uint16_t* st = p.scale + t * blocks * kTile + 8 * h;
  const uint16_t* mt = HAS_MIN ? p.minimum + t * blocks * kTile + 8 * h : nullptr;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // With a lut: a nibble's stored value (up to 255) as its two 4-bit halves, so that
  // vpmaddubsw still cannot saturate.
  __m256i lut_hi = _mm256_setzero_si256(), lut_lo = _mm256_setzero_si256();
  if constexpr (LUT) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.lut)));
    lut_lo = _mm256_and_si256(lut, low4);
    lut_hi = _mm256_and_si256(_mm256_srli_epi16(lut, 4), low4);
  }
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i coarse[MR], fine[MR];
    for (int r = 0; r < MR; ++r) coarse[r] = fine[r] = _mm256_setzero_si256();
    const uint8_t* wb = wt + b * kLoads * 64;
    for (int j = 0; j < kLoads; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + j * 64));
      const __m256i lo = _mm256_and_si256(raw, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      if constexpr (BITS == 4 && LUT) {  // as below, each value as 16 hi + lo
        const int64_t kk = b * kBlock + j * 8;
        const __m256i lh = _mm256_shuffle_epi8(lut_hi, lo), ll = _mm256_shuffle_epi8(lut_lo, lo);
        const __m256i hh = _mm256_shuffle_epi8(lut_hi, hi), hl = _mm256_shuffle_epi8(lut_lo, hi);
        for (int r = 0; r < MR; ++r) {
          const int64_t at = (m0 + r) * p.k + kk;
          const __m256i a0 = Bcast4(p.xa + at), a1 = Bcast4(p.xa + at + 4);
          const __m256i r0 = Bcast4(p.xr + at), r1 = Bcast4(p.xr + at + 4);
          coarse[r] = _mm256_add_epi32(coarse[r], _mm256_add_epi32(
              _mm256_slli_epi32(_mm256_add_epi32(Dot4(lh, a0), Dot4(hh, a1)), 4),
              _mm256_add_epi32(Dot4(ll, a0), Dot4(hl, a1))));
          fine[r] = _mm256_add_epi32(fine[r], _mm256_add_epi32(
              _mm256_slli_epi32(_mm256_add_epi32(Dot4(lh, r0), Dot4(hh, r1)), 4),
              _mm256_add_epi32(Dot4(ll, r0), Dot4(hl, r1))));
        }
      } else if constexpr (BITS == 4) {  // lo: k = 8j'..8j'+3, hi: 8j'+4..8j'+7
        const int64_t kk = b * kBlock + j * 8;
        for (int r = 0; r < MR; ++r) {
          const int64_t at = (m0 + r) * p.k + kk;
          coarse[r] = _mm256_add_epi32(coarse[r], Dot4(lo, Bcast4(p.xa + at)));
          coarse[r] = _mm256_add_epi32(coarse[r], Dot4(hi, Bcast4(p.xa + at + 4)));
          fine[r] = _mm256_add_epi32(fine[r], Dot4(lo, Bcast4(p.xr + at)));
          fine[r] = _mm256_add_epi32(fine[r], Dot4(hi, Bcast4(p.xr + at + 4)));
        }
      } else {  // byte = 16 hi + lo, both of k = 4j'..4j'+3
        const int64_t kk = b * kBlock + j * 4;
        for (int r = 0; r < MR; ++r) {
          const int64_t at = (m0 + r) * p.k + kk;
          const __m256i xa = Bcast4(p.xa + at), xr = Bcast4(p.xr + at);
          coarse[r] = _mm256_add_epi32(coarse[r], _mm256_add_epi32(
              _mm256_slli_epi32(Dot4(hi, xa), 4), Dot4(lo, xa)));
          fine[r] = _mm256_add_epi32(fine[r], _mm256_add_epi32(
              _mm256_slli_epi32(Dot4(hi, xr), 4), Dot4(lo, xr)));
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(st + b * kTile)));
    __m256 mn = _mm256_setzero_ps();
    if constexpr (HAS_MIN) {
      mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mt + b * kTile)));
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t rb = (m0 + r) * blocks + b;
      __m256i s = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(coarse[r], 7), coarse[r]), fine[r]);
      if (p.zero != 0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(int32_t(p.zero) * p.xsum[rb]));
      const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(p.xs[rb]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), ds, acc[r]);
      if constexpr (HAS_MIN) acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(p.fsum[rb]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(p.out + (m0 + r) * p.n + t * kTile + 8 * h, acc[r]);
}

template <int BITS, bool HAS_MIN, bool LUT>
void Tile(const Problem& p, int64_t t) {
  // Rows sharing each weight load: 4 was ~5-10 % faster than 2 at 32 rows and no slower
  // at 1 and 8 (on a cache-resident matrix set; 1 and 3 no better).
  constexpr int kRows = 4;
  for (int h = 0; h < 2; ++h) {
    int64_t m0 = 0;
    for (; m0 + kRows <= p.m; m0 += kRows) HalfTileRows<kRows, BITS, HAS_MIN, LUT>(p, t, h, m0);
    switch (p.m - m0) {
      case 3: HalfTileRows<3, BITS, HAS_MIN, LUT>(p, t, h, m0); break;
      case 2: HalfTileRows<2, BITS, HAS_MIN, LUT>(p, t, h, m0); break;
      case 1: HalfTileRows<1, BITS, HAS_MIN, LUT>(p, t, h, m0); break;
      default: break;
    }
  }
}

#endif  // O1JAX_INT8_MATMUL == 1 / 2

using TileFn = void (*)(const Problem&, int64_t);

TileFn PickTile(int64_t bits, bool has_min, bool amx, bool lut) {
#if O1JAX_AMX
  if (amx && lut) return has_min ? TileAmx<4, true, true> : TileAmx<4, false, true>;
  if (amx && bits == 4) return has_min ? TileAmx<4, true, false> : TileAmx<4, false, false>;
  if (amx) return has_min ? TileAmx<8, true, false> : TileAmx<8, false, false>;
#endif
  if (lut) return has_min ? Tile<4, true, true> : Tile<4, false, true>;
  if (bits == 4) return has_min ? Tile<4, true, false> : Tile<4, false, false>;
  return has_min ? Tile<8, true, false> : Tile<8, false, false>;
}

struct Work {
  Problem p;
  TileFn tile;
  bool amx;
  std::vector<int8_t> xa, xr;
  std::vector<float> xs, fsum;
  std::vector<int32_t> xsum;
  o1jax::TileRuns runs;
};

void Drain(Work& w) {
  bool configured = false;  // tile configuration is per thread
  w.runs.Drain([&w, &configured](int64_t begin, int64_t end) {
#if O1JAX_AMX
    if (w.amx && !configured) ConfigureTiles();
#endif
    configured = true;
    for (int64_t t = begin; t < end; ++t) w.tile(w.p, t);
  });
#if O1JAX_AMX
  if (w.amx && configured) _tile_release();
#endif
}

#endif  // O1JAX_INT8_MATMUL

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                          ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> minimum,
                          ffi::Buffer<ffi::U8> lut, ffi::ResultBuffer<ffi::F32> out, int64_t bits,
                          int64_t zero, bool has_min, bool has_lut) {
  auto xd = x.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || od.size() != 2 || od[0] != xd[0]) {
    return ffi::Error::InvalidArgument("int8_matmul: x must be [M, K] and out [M, N]");
  }
  const int64_t m = xd[0], k = xd[1], n = od[1];
  if ((bits != 4 && bits != 8) || k % kBlock != 0 || n % kTile != 0 ||
      w.element_count() != k * n / (bits == 4 ? 2 : 1) || scale.element_count() != k / kBlock * n ||
      (has_min && minimum.element_count() != scale.element_count()) ||
      (has_lut && (bits != 4 || lut.element_count() != 16))) {
    return ffi::Error::InvalidArgument("int8_matmul: inconsistent shapes");
  }
  if (m == 0) return ffi::Error::Success();
#if !O1JAX_INT8_MATMUL
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "int8_matmul: this CPU (or build) lacks AVX512-VNNI");
#else
  auto work = std::make_shared<Work>();
  const int64_t blocks = k / kBlock;
#if O1JAX_AMX
  work->amx = m >= 16 && AmxPermitted();
#else
  work->amx = false;
#endif
  // AMX reads whole 16-row tiles: pad the quantized rows with zeros.
  const int64_t rows = work->amx ? (m + 15) / 16 * 16 : m;
  work->xa.assign(rows * k, 0);
  work->xr.assign(rows * k, 0);
  work->xs.assign(rows * blocks, 0.0f);
  work->xsum.assign(rows * blocks, 0);
  work->fsum.assign(rows * blocks, 0.0f);
  const float* xp = x.typed_data();
  for (int64_t r = 0; r < m; ++r) {
    QuantizeRow(xp + r * k, k, work->xa.data() + r * k, work->xr.data() + r * k,
                work->xs.data() + r * blocks, work->xsum.data() + r * blocks,
                work->fsum.data() + r * blocks);
  }
  work->p = Problem{m, k, n, bits, zero, has_min,
                    w.typed_data(), reinterpret_cast<const uint16_t*>(scale.untyped_data()),
                    reinterpret_cast<const uint16_t*>(minimum.untyped_data()), lut.typed_data(),
                    work->xa.data(), work->xr.data(), work->xs.data(), work->xsum.data(),
                    work->fsum.data(), out->typed_data()};
  work->tile = PickTile(bits, has_min, work->amx, has_lut);
  o1jax::RunTiles(pool, work, n / kTile, m * k * n, Drain);
  return ffi::Error::Success();
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(O1jaxInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("zero")
                                  .Attr<bool>("has_min")
                                  .Attr<bool>("has_lut"));
