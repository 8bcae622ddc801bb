// Paged decode attention for the CPU, as an XLA FFI custom call.
//
// XLA's CPU backend has no fast gather: the XLA path copies every row's pages
// into a dense [B, L, KVH, D] buffer (~10 GB/s) before the attention math,
// and that copy was ~40% of a batch-32 decode step. This kernel reads the
// pages in place through the block table instead.
//
//   q       [B, H, D]            f32
//   k_pages [NB, BS, KVH, D]     f32 or bf16 (v_pages the same; bf16 values are
//                                widened to f32 exactly, the math stays f32)
//   tables  [B, MB]              s32  logical block j of row b -> physical block
//   lengths [B]                  s32  keys 0..lengths[b]-1 are visible
//   window  attribute            > 0: only the last `window` of them (a sliding window)
//   out     [B, H, D]            f32  (rows with length 0 -> zeros)
//
// Rows (or (row, kv head) pairs for tiny batches) are shared out over XLA's
// intra-op thread pool. Each head's result is computed by one thread in a
// fixed order, so it never depends on the other rows or on the thread count.
//
// Also here: O1jaxWritePoolRows, the in-place write of a step's new K/V rows
// into a bf16 pool (see WritePoolRowsImpl).

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// exp(x) for x <= 0 (softmax after subtracting the max), to ~2 ulp: 2^n * e^r
// with |r| <= ln2/2 and a degree-6 Taylor polynomial. Written out so the loop
// vectorises (glibc's expf is a scalar call here).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);  // e^-87 ~ 1.6e-38: keeps 2^n a normal float
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split in two parts
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// s[0..len) -> exp(s - max s), in place; returns their sum (the softmax's denominator).
inline float SoftmaxWeights(float* s, int64_t len) {
  const float m = *std::max_element(s, s + len);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = ExpNonPositive(s[t] - m);
    sum += s[t];
  }
  return sum;
}

struct Dims {
  int64_t batch, heads, head_dim, num_blocks, block_size, kv_heads, max_blocks;
};

// Pool elements: f32, or bf16 stored as its 16 bits (the top half of an f32).
using Bf16 = uint16_t;

inline float ToF32(float x) { return x; }
inline float ToF32(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Offsets (in floats) inside a pool of a row's positions first..len-1 (its visible
// keys), in order, through its block table.
void RowOffsets(const Dims& d, const int32_t* table, int64_t first, int64_t len,
                std::vector<int64_t>& rows) {
  const int64_t row_stride = d.kv_heads * d.head_dim;  // floats between positions in a block
  rows.resize(len - first);
  for (int64_t p = first; p < len; ++p) {
    const int64_t block = std::clamp<int64_t>(table[p / d.block_size], 0, d.num_blocks - 1);
    rows[p - first] = (block * d.block_size + p % d.block_size) * row_stride;
  }
}

template <typename T>
inline void PrefetchRow(const T* row, int64_t elements) {
  const char* f = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < elements * static_cast<int64_t>(sizeof(T)); c += 64) {
    __builtin_prefetch(f + c);
  }
}

// Attention of row b's G query heads that share kv head kh: scores over the
// row's positions, softmax, weighted V. Each key and value row is loaded once
// for all G heads; the G output rows stay in registers (kD, kG > 0 are
// compile-time sizes; 0 means "read from Dims"). Blocks are scattered in the
// pool, so the next rows are prefetched by hand.
template <typename T, int64_t kD, int64_t kG>
void AttendKvHead(const Dims& d, const float* q, const T* kp, const T* vp, float* out,
                  int64_t b, int64_t kh, int64_t len, const std::vector<int64_t>& rows,
                  std::vector<float>& scores) {
  constexpr int64_t kAhead = 8;
  const int64_t hd = kD > 0 ? kD : d.head_dim;
  const int64_t g = kG > 0 ? kG : d.heads / d.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* qg = q + (b * d.heads + kh * g) * hd;
  float* og = out + (b * d.heads + kh * g) * hd;
  const int64_t head_off = kh * hd;
  scores.resize(g * len);
  float* s = scores.data();
  // 1. s[j, p] = (q_j . k_p) / sqrt(D)
  for (int64_t p = 0; p < len; ++p) {
    const T* k = kp + rows[p] + head_off;
    if (p + kAhead < len) PrefetchRow(kp + rows[p + kAhead] + head_off, hd);
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = qg + j * hd;
      float a = 0.0f;
#pragma omp simd reduction(+ : a)
      for (int64_t i = 0; i < hd; ++i) a += qj[i] * ToF32(k[i]);
      s[j * len + p] = a * scale;
    }
  }
  // 2. softmax weights per head (unnormalised; divided at the end)
  float denom[kG > 0 ? kG : 64];
  for (int64_t j = 0; j < g; ++j) denom[j] = SoftmaxWeights(s + j * len, len);
  // 3. o_j = sum_p s[j, p] v_p / denom_j
  float acc[(kG > 0 ? kG : 64) * (kD > 0 ? kD : 256)];
  std::fill(acc, acc + g * hd, 0.0f);
  for (int64_t p = 0; p < len; ++p) {
    const T* v = vp + rows[p] + head_off;
    if (p + kAhead < len) PrefetchRow(vp + rows[p + kAhead] + head_off, hd);
    for (int64_t j = 0; j < g; ++j) {
      const float w = s[j * len + p];
      float* aj = acc + j * hd;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i) aj[i] += w * ToF32(v[i]);
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    const float inv = 1.0f / denom[j];
    for (int64_t i = 0; i < hd; ++i) og[j * hd + i] = acc[j * hd + i] * inv;
  }
}

#ifdef __AVX512F__
// The sums of 16 vectors' lanes, as one vector: out[p] = sum(v[p]) (a transpose
// tree: ~3 shuffles and adds per vector instead of a full horizontal sum each).
inline __m512 LaneSums16(const __m512* v) {
  __m512 b[8], c[4];
  for (int p = 0; p < 8; ++p) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    b[p] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]),
                         _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
  }
  for (int q = 0; q < 4; ++q) {  // per 128-bit lane: 4 vectors' partial sums
    c[q] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * q], b[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * q], b[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Add the four 128-bit lanes: vectors 4q..4q+3 end up in lane q.
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// AttendKvHead for head_dim 64 with AVX-512 intrinsics: q and the G output rows
// live in registers; scores come 16 positions at a time (per-position partial
// products reduced by LaneSums16). Same math as the generic version; the
// summation order differs (f32 rounding only) and, like it, does not depend on
// the other rows.
// 16 pool elements as f32 lanes.
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const Bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <typename T, int64_t kG>
void AttendKvHead64(const Dims& d, const float* q, const T* kp, const T* vp, float* out,
                    int64_t b, int64_t kh, int64_t len, const std::vector<int64_t>& rows,
                    std::vector<float>& scores) {
  constexpr int64_t kAhead = 8;
  const __m512 scale = _mm512_set1_ps(0.125f);  // 1 / sqrt(64)
  const float* qg = q + (b * d.heads + kh * kG) * 64;
  float* og = out + (b * d.heads + kh * kG) * 64;
  const int64_t head_off = kh * 64;
  const int64_t padded = (len + 15) / 16 * 16;
  scores.resize(kG * padded);
  float* s = scores.data();
  __m512 qv[kG][4];
  for (int64_t j = 0; j < kG; ++j)
    for (int i = 0; i < 4; ++i) qv[j][i] = _mm512_loadu_ps(qg + j * 64 + 16 * i);
  // 1. s[j, p] = (q_j . k_p) / 8, 16 positions at a time
  alignas(64) __m512 part[kG][16];
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - p0);
    for (int64_t t = 0; t < 16; ++t) {
      if (t >= n) {
        for (int64_t j = 0; j < kG; ++j) part[j][t] = _mm512_setzero_ps();
        continue;
      }
      const int64_t p = p0 + t;
      if (p + kAhead < len) PrefetchRow(kp + rows[p + kAhead] + head_off, 64);
      const T* k = kp + rows[p] + head_off;
      const __m512 k0 = Load16(k), k1 = Load16(k + 16), k2 = Load16(k + 32), k3 = Load16(k + 48);
      for (int64_t j = 0; j < kG; ++j) {
        __m512 a = _mm512_mul_ps(qv[j][0], k0);
        a = _mm512_fmadd_ps(qv[j][1], k1, a);
        a = _mm512_fmadd_ps(qv[j][2], k2, a);
        part[j][t] = _mm512_fmadd_ps(qv[j][3], k3, a);
      }
    }
    for (int64_t j = 0; j < kG; ++j) {
      _mm512_storeu_ps(s + j * padded + p0, _mm512_mul_ps(LaneSums16(part[j]), scale));
    }
  }
  // 2. softmax weights per head (unnormalised; divided at the end)
  float denom[kG];
  for (int64_t j = 0; j < kG; ++j) denom[j] = SoftmaxWeights(s + j * padded, len);
  // 3. o_j = sum_p s[j, p] v_p / denom_j
  __m512 acc[kG][4];
  for (int64_t j = 0; j < kG; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < len; ++p) {
    if (p + kAhead < len) PrefetchRow(vp + rows[p + kAhead] + head_off, 64);
    const T* v = vp + rows[p] + head_off;
    const __m512 v0 = Load16(v), v1 = Load16(v + 16), v2 = Load16(v + 32), v3 = Load16(v + 48);
    for (int64_t j = 0; j < kG; ++j) {
      const __m512 w = _mm512_set1_ps(s[j * padded + p]);
      acc[j][0] = _mm512_fmadd_ps(w, v0, acc[j][0]);
      acc[j][1] = _mm512_fmadd_ps(w, v1, acc[j][1]);
      acc[j][2] = _mm512_fmadd_ps(w, v2, acc[j][2]);
      acc[j][3] = _mm512_fmadd_ps(w, v3, acc[j][3]);
    }
  }
  for (int64_t j = 0; j < kG; ++j) {
    const __m512 inv = _mm512_set1_ps(1.0f / denom[j]);
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(og + j * 64 + 16 * i, _mm512_mul_ps(acc[j][i], inv));
  }
}
#endif  // __AVX512F__

using AttendFn = void (*)(const Dims&, const float*, const void*, const void*, float*, int64_t,
                          int64_t, int64_t, const std::vector<int64_t>&, std::vector<float>&);

// AttendKvHead* over pools of element type T, behind the type-erased AttendFn.
template <typename T, void (*F)(const Dims&, const float*, const T*, const T*, float*, int64_t,
                                int64_t, int64_t, const std::vector<int64_t>&,
                                std::vector<float>&)>
void Erased(const Dims& d, const float* q, const void* kp, const void* vp, float* out, int64_t b,
            int64_t kh, int64_t len, const std::vector<int64_t>& rows,
            std::vector<float>& scores) {
  F(d, q, static_cast<const T*>(kp), static_cast<const T*>(vp), out, b, kh, len, rows, scores);
}

// Specialisations for the common (head_dim, group) shapes; the generic one
// handles group <= 64 and head_dim <= 256 (checked by the caller).
template <typename T>
AttendFn PickAttend(int64_t hd, int64_t g) {
#ifdef __AVX512F__
  if (hd == 64) {
    switch (g) {
      case 1: return Erased<T, AttendKvHead64<T, 1>>;
      case 2: return Erased<T, AttendKvHead64<T, 2>>;
      case 3: return Erased<T, AttendKvHead64<T, 3>>;
      case 4: return Erased<T, AttendKvHead64<T, 4>>;
      case 5: return Erased<T, AttendKvHead64<T, 5>>;
      case 6: return Erased<T, AttendKvHead64<T, 6>>;
      case 7: return Erased<T, AttendKvHead64<T, 7>>;
      case 8: return Erased<T, AttendKvHead64<T, 8>>;
    }
  }
#endif
  if (hd == 64 && g == 3) return Erased<T, AttendKvHead<T, 64, 3>>;
  if (hd == 64 && g == 4) return Erased<T, AttendKvHead<T, 64, 4>>;
  if (hd == 128 && g == 4) return Erased<T, AttendKvHead<T, 128, 4>>;
  if (hd == 128 && g == 8) return Erased<T, AttendKvHead<T, 128, 8>>;
  if (hd == 64) return Erased<T, AttendKvHead<T, 64, 0>>;
  if (hd == 128) return Erased<T, AttendKvHead<T, 128, 0>>;
  return Erased<T, AttendKvHead<T, 0, 0>>;
}

// Row b, kv heads [kh_lo, kh_hi). Rows with nothing visible give zeros. A sliding
// window (> 0) leaves the last `window` keys visible.
void AttendRow(const Dims& d, AttendFn attend, const float* q, const void* kp, const void* vp,
               const int32_t* tables, const int32_t* lengths, float* out, int64_t b,
               int64_t kh_lo, int64_t kh_hi, int64_t window, std::vector<float>& scores,
               std::vector<int64_t>& rows) {
  const int64_t g = d.heads / d.kv_heads;
  const int64_t len = std::min<int64_t>(lengths[b], d.max_blocks * d.block_size);
  // The window ends at the row's length even past what its table holds (as the XLA path).
  const int64_t first = window > 0 ? std::max<int64_t>(0, lengths[b] - window) : 0;
  if (len - first <= 0) {
    float* o = out + (b * d.heads + kh_lo * g) * d.head_dim;
    std::fill(o, o + (kh_hi - kh_lo) * g * d.head_dim, 0.0f);
    return;
  }
  RowOffsets(d, tables + b * d.max_blocks, first, len, rows);
  for (int64_t kh = kh_lo; kh < kh_hi; ++kh) {
    attend(d, q, kp, vp, out, b, kh, len - first, rows, scores);
  }
}

// One call's work, shared by the calling thread and the pool tasks it schedules.
// Items (rows, or (row, kv head) pairs for tiny batches) are handed out through
// `next`, so the caller can do all of them itself when the pool is busy (another
// kernel call may hold every pool thread: waiting for a task to start could then
// deadlock). A task that starts after the call returned finds no item left and
// touches only this heap object, which it co-owns.
struct Work {
  Dims d;
  AttendFn attend;
  bool split_heads;
  int64_t items;
  int64_t window;  // > 0: a sliding window of that many keys
  const float* q;
  const void *kp, *vp;
  const int32_t *tables, *lengths;
  float* out;
  std::atomic<int64_t> next{0}, done{0};
};

void Drain(Work& w) {
  std::vector<float> scores;
  std::vector<int64_t> rows;
  for (int64_t it; (it = w.next.fetch_add(1, std::memory_order_relaxed)) < w.items;) {
    const int64_t b = w.split_heads ? it / w.d.kv_heads : it;
    const int64_t lo = w.split_heads ? it % w.d.kv_heads : 0;
    const int64_t hi = w.split_heads ? lo + 1 : w.d.kv_heads;
    AttendRow(w.d, w.attend, w.q, w.kp, w.vp, w.tables, w.lengths, w.out, b, lo, hi, w.window,
              scores, rows);
    w.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PagedDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                    ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                    ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                                    ffi::ResultBuffer<ffi::F32> out, int64_t window) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode_attention: expected q rank 3, pages rank 4, "
                                       "tables rank 2");
  }
  const ffi::DataType dtype = k_pages.element_type();
  if ((dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16) ||
      v_pages.element_type() != dtype) {
    return ffi::Error::InvalidArgument("paged_decode_attention: pages must both be f32 or bf16");
  }
  Dims d{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[1]};
  if (kd[3] != d.head_dim || d.heads % d.kv_heads != 0 || d.head_dim > 256 ||
      d.heads / d.kv_heads > 64 || td[0] != d.batch ||
      lengths.dimensions()[0] != d.batch || v_pages.element_count() != k_pages.element_count()) {
    return ffi::Error::InvalidArgument("paged_decode_attention: inconsistent shapes");
  }
  // Whole rows; with fewer rows than threads, (row, kv head) pairs. Either way a
  // head is computed by one thread in a fixed order (heads are independent).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto work = std::make_shared<Work>();
  work->d = d;
  const int64_t g = d.heads / d.kv_heads;
  work->attend = dtype == ffi::DataType::F32 ? PickAttend<float>(d.head_dim, g)
                                             : PickAttend<Bf16>(d.head_dim, g);
  work->window = window;
  work->split_heads = d.batch < threads;
  work->items = work->split_heads ? d.batch * d.kv_heads : d.batch;
  work->q = q.typed_data();
  work->kp = k_pages.untyped_data();
  work->vp = v_pages.untyped_data();
  work->tables = tables.typed_data();
  work->lengths = lengths.typed_data();
  work->out = out->typed_data();
  for (int64_t t = 1; t < std::min<int64_t>(threads, work->items); ++t) {
    pool.Schedule([work] { Drain(*work); });
  }
  Drain(*work);
  // Items other threads took are still running: the buffers must outlive them.
  while (work->done.load(std::memory_order_acquire) < work->items) std::this_thread::yield();
  return ffi::Error::Success();
}

// Writes rows [R, KVH, D] into a pool [NB, BS, KVH, D] at (block[r], offset[r]);
// rows with block outside [0, NB) are dropped. The pool is updated in place when
// XLA aliases the output to it (the caller asks for that), else copied first.
// XLA's CPU scatter widens a bf16 pool to f32 and back around every update:
// two copies of the whole pool per layer and step.
ffi::Error WritePoolRowsImpl(ffi::AnyBuffer pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> block,
                             ffi::Buffer<ffi::S32> offset, ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pool.dimensions();
  auto rd = rows.dimensions();
  if (pd.size() != 4 || rd.size() != 3 || rows.element_type() != pool.element_type() ||
      out->element_type() != pool.element_type() || rd[1] != pd[2] || rd[2] != pd[3] ||
      block.element_count() != rd[0] || offset.element_count() != rd[0]) {
    return ffi::Error::InvalidArgument("write_pool_rows: inconsistent shapes or dtypes");
  }
  const size_t row_bytes = rows.size_bytes() / std::max<int64_t>(rd[0], 1);
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pool.untyped_data()) std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* b = block.typed_data();
  const int32_t* o = offset.typed_data();
  for (int64_t r = 0; r < rd[0]; ++r) {
    if (b[r] < 0 || b[r] >= pd[0] || o[r] < 0 || o[r] >= pd[1]) continue;
    std::memcpy(dst + (static_cast<int64_t>(b[r]) * pd[1] + o[r]) * row_bytes, src + r * row_bytes,
                row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(O1jaxWritePoolRows, WritePoolRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(O1jaxPagedDecodeAttention, PagedDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window"));
