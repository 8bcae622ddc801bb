// Paged decode attention for the CPU, as an XLA FFI custom call.
//
// XLA's CPU backend has no fast gather: the XLA path copies every row's pages
// into a dense [B, L, KVH, D] buffer (~10 GB/s) before the attention math,
// and that copy was ~40% of a batch-32 decode step. This kernel reads the
// pages in place through the block table instead.
//
//   q       [B, H, D]            f32
//   k_pages [NB, BS, KVH, D]     f32 (v_pages the same)
//   tables  [B, MB]              s32  logical block j of row b -> physical block
//   lengths [B]                  s32  keys 0..lengths[b]-1 are visible
//   out     [B, H, D]            f32  (rows with length 0 -> zeros)
//
// Rows (or (row, kv head) pairs for tiny batches) are shared out over XLA's
// intra-op thread pool. Each head's result is computed by one thread in a
// fixed order, so it never depends on the other rows or on the thread count.

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

struct Dims {
  int64_t batch, heads, head_dim, num_blocks, block_size, kv_heads, max_blocks;
};

// Offsets (in floats) of a row's positions inside a pool, through its block table.
void RowOffsets(const Dims& d, const int32_t* table, int64_t len, std::vector<int64_t>& rows) {
  const int64_t row_stride = d.kv_heads * d.head_dim;  // floats between positions in a block
  rows.resize(len);
  for (int64_t p = 0; p < len; ++p) {
    const int64_t block = std::clamp<int64_t>(table[p / d.block_size], 0, d.num_blocks - 1);
    rows[p] = (block * d.block_size + p % d.block_size) * row_stride;
  }
}

inline void PrefetchRow(const float* row, int64_t floats) {
  const char* f = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < floats * 4; c += 64) __builtin_prefetch(f + c);
}

// Attention of row b's G query heads that share kv head kh: scores over the
// row's positions, softmax, weighted V. Each key and value row is loaded once
// for all G heads; the G output rows stay in registers (kD, kG > 0 are
// compile-time sizes; 0 means "read from Dims"). Blocks are scattered in the
// pool, so the next rows are prefetched by hand.
template <int64_t kD, int64_t kG>
void AttendKvHead(const Dims& d, const float* q, const float* kp, const float* vp, float* out,
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
    const float* k = kp + rows[p] + head_off;
    if (p + kAhead < len) PrefetchRow(kp + rows[p + kAhead] + head_off, hd);
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = qg + j * hd;
      float a = 0.0f;
#pragma omp simd reduction(+ : a)
      for (int64_t i = 0; i < hd; ++i) a += qj[i] * k[i];
      s[j * len + p] = a * scale;
    }
  }
  // 2. softmax weights per head (unnormalised; divided at the end)
  float denom[kG > 0 ? kG : 64];
  for (int64_t j = 0; j < g; ++j) {
    float* sj = s + j * len;
    const float m = *std::max_element(sj, sj + len);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sj[t] = ExpNonPositive(sj[t] - m);
      sum += sj[t];
    }
    denom[j] = sum;
  }
  // 3. o_j = sum_p s[j, p] v_p / denom_j
  float acc[(kG > 0 ? kG : 64) * (kD > 0 ? kD : 256)];
  std::fill(acc, acc + g * hd, 0.0f);
  for (int64_t p = 0; p < len; ++p) {
    const float* v = vp + rows[p] + head_off;
    if (p + kAhead < len) PrefetchRow(vp + rows[p + kAhead] + head_off, hd);
    for (int64_t j = 0; j < g; ++j) {
      const float w = s[j * len + p];
      float* aj = acc + j * hd;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i) aj[i] += w * v[i];
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    const float inv = 1.0f / denom[j];
    for (int64_t i = 0; i < hd; ++i) og[j * hd + i] = acc[j * hd + i] * inv;
  }
}

using AttendFn = void (*)(const Dims&, const float*, const float*, const float*, float*, int64_t,
                          int64_t, int64_t, const std::vector<int64_t>&, std::vector<float>&);

// Specialisations for the common (head_dim, group) shapes; the generic one
// handles group <= 64 and head_dim <= 256 (checked by the caller).
AttendFn PickAttend(int64_t hd, int64_t g) {
  if (hd == 64 && g == 3) return AttendKvHead<64, 3>;
  if (hd == 64 && g == 4) return AttendKvHead<64, 4>;
  if (hd == 128 && g == 4) return AttendKvHead<128, 4>;
  if (hd == 128 && g == 8) return AttendKvHead<128, 8>;
  if (hd == 64) return AttendKvHead<64, 0>;
  if (hd == 128) return AttendKvHead<128, 0>;
  return AttendKvHead<0, 0>;
}

// Row b, kv heads [kh_lo, kh_hi). Rows with nothing visible give zeros.
void AttendRow(const Dims& d, AttendFn attend, const float* q, const float* kp, const float* vp,
               const int32_t* tables, const int32_t* lengths, float* out, int64_t b,
               int64_t kh_lo, int64_t kh_hi, std::vector<float>& scores,
               std::vector<int64_t>& rows) {
  const int64_t g = d.heads / d.kv_heads;
  const int64_t len = std::min<int64_t>(lengths[b], d.max_blocks * d.block_size);
  if (len <= 0) {
    float* o = out + (b * d.heads + kh_lo * g) * d.head_dim;
    std::fill(o, o + (kh_hi - kh_lo) * g * d.head_dim, 0.0f);
    return;
  }
  RowOffsets(d, tables + b * d.max_blocks, len, rows);
  for (int64_t kh = kh_lo; kh < kh_hi; ++kh) attend(d, q, kp, vp, out, b, kh, len, rows, scores);
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
  const float *q, *kp, *vp;
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
    AttendRow(w.d, w.attend, w.q, w.kp, w.vp, w.tables, w.lengths, w.out, b, lo, hi, scores, rows);
    w.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PagedDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                    ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                                    ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                                    ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode_attention: expected q rank 3, pages rank 4, "
                                       "tables rank 2");
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
  work->attend = PickAttend(d.head_dim, d.heads / d.kv_heads);
  work->split_heads = d.batch < threads;
  work->items = work->split_heads ? d.batch * d.kv_heads : d.batch;
  work->q = q.typed_data();
  work->kp = k_pages.typed_data();
  work->vp = v_pages.typed_data();
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(O1jaxPagedDecodeAttention, PagedDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
