// f32 matmul over weights in a column-tiled layout, as an XLA FFI custom call.
//
// A decode step of a small model is bound by reading its weights. XLA's CPU dot
// streams a row-major [K, N] weight well for one row, but from two rows on its
// GEMM path costs far more: on the embedded model's matrices 8 rows took 2.3x one
// row (measured), so a verify call over 8 positions cost twice a decode step,
// and a batch of 8 rows twice a batch of one. Here each weight is stored as
// column tiles, every tile one contiguous stream, and a group of rows shares
// each load: 8 rows cost ~1.3x one row (XLA: 2.3x; scripts/bench_f32_matmul.py).
//
//   x  f32 [M, K]
//   w  f32 [T, K, 32]  tile t holds columns 32t .. 32t+31 (built by
//                      `pallas_kernels.f32_matmul.pack`; padding columns are 0)
//   out f32 [M, 32 T]
//
// Work: tiles split over threads (tile_runs.h);
// per tile, rows in groups (up to kMaxRows, per build below), each group over
// all of K: the tile (K x 128 bytes) is read from memory by the first group and
// from cache by the others.
//
// Determinism: out[m, n] is fma(x[m, K-1], w[K-1, n], ... fma(x[m, 0], w[0, n], 0)),
// the f32 sum over k in order: a row's result does not depend on the other rows,
// its group, the thread or M. So a verify call's positions, and a batch's rows,
// get the bits a one-row decode step gets.
//
// Three builds of the same sum (so all three give the same bits): AVX-512 (12 rows
// x 2 zmm accumulators), AVX2 + FMA (3 rows x 4 ymm; from 32 rows on 6 rows x 2 ymm,
// half a tile at a time), and a
// portable one for other CPUs with a hardware fused multiply-add (aarch64; x86 with
// FMA but no AVX2), whose column loop the compiler vectorizes. Without any of them
// the kernel reports itself unsupported and XLA's dot runs.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

#include "tile_runs.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512F__)
#define O1JAX_F32_MATMUL 1
#elif defined(__AVX2__) && defined(__FMA__)
#define O1JAX_F32_MATMUL 2
#elif defined(__FMA__) || defined(__aarch64__) || defined(__ARM_FEATURE_FMA)
#define O1JAX_F32_MATMUL 3
#else
#define O1JAX_F32_MATMUL 0
#endif

// 0: unsupported; 1: AVX-512; 2: AVX2 + FMA; 3: portable.
extern "C" int O1jaxF32MatmulSupported() { return O1JAX_F32_MATMUL; }

namespace {

constexpr int64_t kTile = 32;  // columns per tile

#if O1JAX_F32_MATMUL

constexpr int64_t kPrefetch = 8;  // weight rows (of one tile) ahead

struct Problem {
  int64_t m, k, tiles;
  const float* x;
  const float* w;
  float* out;
};

#if O1JAX_F32_MATMUL == 1
constexpr int kMaxRows = 12;  // rows per group: 24 accumulators

// Rows m0 .. m0+R-1 of tile t, over all of K.
template <int R>
void Group(const Problem& p, int64_t m0, int64_t t) {
  const int64_t n = p.tiles * kTile;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const float* w = p.w + t * p.k * kTile;
  const float* x = p.x + m0 * p.k;
  for (int64_t kk = 0; kk < p.k; ++kk) {
    const float* wr = w + kk * kTile;
    _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch * kTile), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch * kTile + 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(wr);
    const __m512 w1 = _mm512_loadu_ps(wr + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * p.k + kk]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = p.out + (m0 + r) * n + t * kTile;
    _mm512_storeu_ps(o, acc[r][0]);
    _mm512_storeu_ps(o + 16, acc[r][1]);
  }
}

#elif O1JAX_F32_MATMUL == 2
// Two row-group shapes, by the number of rows (same sums, so same bits): few rows, 3 rows
// over the whole tile (4 weight loads shared by 3 rows; each row's 4 accumulators hide
// the FMA latency); many rows, 6 rows over half a tile at a time (12 accumulators + 2
// weight registers + a broadcast: 15 of the 16 ymm, where 3 x 4 + 4 + 1 spills).
// Measured (scripts/bench_f32_matmul.py): 3 x 32 0.64-0.93x XLA at 1-8 rows where 6 x 16
// took 0.96-1.54x; 6 x 16 0.83-1.07x at 128-512 where 3 x 32 took 1.01-1.43x; about even
// at 16-32.
constexpr int kMaxRows = 3;        // the few-rows shape
constexpr int kWideRows = 6;       // the many-rows shape
constexpr int64_t kManyRows = 32;  // from this many rows on

template <int R>
void Group(const Problem& p, int64_t m0, int64_t t) {
  const int64_t n = p.tiles * kTile;
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* w = p.w + t * p.k * kTile;
  const float* x = p.x + m0 * p.k;
  for (int64_t kk = 0; kk < p.k; ++kk) {
    const float* wr = w + kk * kTile;
    _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch * kTile), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch * kTile + 16), _MM_HINT_T0);
    __m256 wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = _mm256_loadu_ps(wr + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * p.k + kk]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = p.out + (m0 + r) * n + t * kTile;
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o + 8 * c, acc[r][c]);
  }
}

template <int R>
void WideGroup(const Problem& p, int64_t m0, int64_t t) {
  const int64_t n = p.tiles * kTile;
  const float* x = p.x + m0 * p.k;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* w = p.w + t * p.k * kTile + 16 * h;
    for (int64_t kk = 0; kk < p.k; ++kk) {
      const float* wr = w + kk * kTile;
      _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetch * kTile), _MM_HINT_T0);
      const __m256 w0 = _mm256_loadu_ps(wr), w1 = _mm256_loadu_ps(wr + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(x[r * p.k + kk]);
        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float* o = p.out + (m0 + r) * n + t * kTile + 16 * h;
      _mm256_storeu_ps(o, acc[r][0]);
      _mm256_storeu_ps(o + 8, acc[r][1]);
    }
  }
}

template <int R>
void WideGroupsOf(const Problem& p, int64_t m0, int64_t rows, int64_t t) {
  if constexpr (R > 1) {
    if (rows < R) return WideGroupsOf<R - 1>(p, m0, rows, t);
  }
  WideGroup<R>(p, m0, t);
}

#else
constexpr int kMaxRows = 2;  // rows per group: 64 accumulators (16 NEON / SSE registers)

template <int R>
void Group(const Problem& p, int64_t m0, int64_t t) {
  const int64_t n = p.tiles * kTile;
  float acc[R][kTile] = {};
  const float* w = p.w + t * p.k * kTile;
  const float* x = p.x + m0 * p.k;
  for (int64_t kk = 0; kk < p.k; ++kk) {
    const float* wr = w + kk * kTile;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * p.k + kk];
#pragma omp simd
      for (int c = 0; c < kTile; ++c) acc[r][c] = std::fma(xv, wr[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + kTile, p.out + (m0 + r) * n + t * kTile);
}
#endif

template <int R>
void GroupsOf(const Problem& p, int64_t m0, int64_t rows, int64_t t) {
  if constexpr (R > 1) {
    if (rows < R) return GroupsOf<R - 1>(p, m0, rows, t);
  }
  Group<R>(p, m0, t);
}

// (Splitting K into L1-sized chunks, the group sums carried through the output, was
// measured slower at 32-512 rows with both builds: not done.)
void Tile(const Problem& p, int64_t t) {
#if O1JAX_F32_MATMUL == 2
  if (p.m >= kManyRows) {
    for (int64_t m0 = 0; m0 < p.m; m0 += kWideRows) {
      WideGroupsOf<kWideRows>(p, m0, std::min<int64_t>(kWideRows, p.m - m0), t);
    }
    return;
  }
#endif
  for (int64_t m0 = 0; m0 < p.m; m0 += kMaxRows) {
    GroupsOf<kMaxRows>(p, m0, std::min<int64_t>(kMaxRows, p.m - m0), t);
  }
}

struct Work {
  Problem p;
  o1jax::TileRuns runs;
};

void Drain(Work& w) {
  w.runs.Drain([&w](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) Tile(w.p, t);
  });
}

#endif  // O1JAX_F32_MATMUL

ffi::Error F32MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[1] != xd[1] || wd[2] != kTile ||
      od[0] != xd[0] || od[1] != wd[0] * kTile) {
    return ffi::Error::InvalidArgument(
        "f32_matmul: x must be [M, K], w [T, K, 32] and out [M, 32 T]");
  }
  const int64_t m = xd[0], k = xd[1], tiles = wd[0];
  if (m == 0 || tiles == 0) return ffi::Error::Success();
#if !O1JAX_F32_MATMUL
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "f32_matmul: this CPU (or build) has no fused multiply-add");
#else
  auto work = std::make_shared<Work>();
  work->p = Problem{m, k, tiles, x.typed_data(), w.typed_data(), out->typed_data()};
  o1jax::RunTiles(pool, work, tiles, m * k * tiles * kTile, Drain);
  return ffi::Error::Success();
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(O1jaxF32Matmul, F32MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
