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
// Rows (or (row, kv head) pairs for tiny batches) are split over XLA's
// intra-op thread pool. Each head's result is computed by one thread in a
// fixed order, so it never depends on the other rows or on the thread count.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// Attention of row b for kv heads [kh_lo, kh_hi): for each query head, scores
// over the row's positions, softmax, weighted V. Loops run head-major so the
// query (and the output accumulator) stay in registers; a kv head's keys of
// one row (len * D floats) stay in L2 across the G query heads that read them.
template <int64_t kHeadDim>
void AttendRow(const Dims& d, const float* q, const float* kp, const float* vp,
               const int32_t* tables, const int32_t* lengths, float* out, int64_t b,
               int64_t kh_lo, int64_t kh_hi, std::vector<float>& scores,
               std::vector<int64_t>& rows) {
  // kHeadDim > 0: the compiler sees the trip count and unrolls the dot loops.
  const int64_t g = d.heads / d.kv_heads, hd = kHeadDim > 0 ? kHeadDim : d.head_dim;
  const int64_t len = std::min<int64_t>(lengths[b], d.max_blocks * d.block_size);
  float* o = out + (b * d.heads + kh_lo * g) * hd;
  std::fill(o, o + (kh_hi - kh_lo) * g * hd, 0.0f);
  if (len <= 0) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int32_t* table = tables + b * d.max_blocks;
  const int64_t row_stride = d.kv_heads * hd;  // floats between positions in a block
  // Offset (in floats) of position p's row inside a pool, through the block table.
  rows.resize(len);
  for (int64_t p = 0; p < len; ++p) {
    const int64_t block = std::clamp<int64_t>(table[p / d.block_size], 0, d.num_blocks - 1);
    rows[p] = (block * d.block_size + p % d.block_size) * row_stride;
  }
  auto at = [&](const float* pool, int64_t p, int64_t kh) {
    return pool + rows[p] + kh * hd;
  };
  scores.resize(len);
  float* s = scores.data();
  for (int64_t kh = kh_lo; kh < kh_hi; ++kh) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t h = kh * g + j;
      const float* qh = q + (b * d.heads + h) * hd;
      // 1. scores, four positions at a time (independent accumulators)
      int64_t p = 0;
      for (; p + 4 <= len; p += 4) {
        const float *k0 = at(kp, p, kh), *k1 = at(kp, p + 1, kh), *k2 = at(kp, p + 2, kh),
                    *k3 = at(kp, p + 3, kh);
        if (p + 12 < len) {  // the next rows' keys: blocks are scattered, prefetchers miss them
          for (int64_t a = 8; a < 12; ++a) {
            const char* f = reinterpret_cast<const char*>(at(kp, p + a, kh));
            for (int64_t c = 0; c < hd * 4; c += 64) __builtin_prefetch(f + c);
          }
        }
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t i = 0; i < hd; ++i) {
          a0 += qh[i] * k0[i];
          a1 += qh[i] * k1[i];
          a2 += qh[i] * k2[i];
          a3 += qh[i] * k3[i];
        }
        s[p] = a0 * scale;
        s[p + 1] = a1 * scale;
        s[p + 2] = a2 * scale;
        s[p + 3] = a3 * scale;
      }
      for (; p < len; ++p) {
        const float* k = at(kp, p, kh);
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (int64_t i = 0; i < hd; ++i) a += qh[i] * k[i];
        s[p] = a * scale;
      }
      // 2. softmax weights (unnormalised; divided at the end)
      const float m = *std::max_element(s, s + len);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < len; ++t) {
        s[t] = ExpNonPositive(s[t] - m);
        sum += s[t];
      }
      // 3. out_h = sum_p s[p] v_p / sum
      float* oh = o + (h - kh_lo * g) * hd;
      for (int64_t t = 0; t < len; ++t) {
        const float w = s[t];
        const float* v = at(vp, t, kh);
        if (t + 8 < len) {
          const char* f = reinterpret_cast<const char*>(at(vp, t + 8, kh));
          for (int64_t c = 0; c < hd * 4; c += 64) __builtin_prefetch(f + c);
        }
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) oh[i] += w * v[i];
      }
      const float inv = 1.0f / sum;
      for (int64_t i = 0; i < hd; ++i) oh[i] *= inv;
    }
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
  if (kd[3] != d.head_dim || d.heads % d.kv_heads != 0 || td[0] != d.batch ||
      lengths.dimensions()[0] != d.batch || v_pages.element_count() != k_pages.element_count()) {
    return ffi::Error::InvalidArgument("paged_decode_attention: inconsistent shapes");
  }
  // Work items: whole rows; with fewer rows than threads, (row, kv head) pairs.
  // An item's arithmetic is the same either way (heads are independent).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const bool split_heads = d.batch < threads;
  const int64_t items = split_heads ? d.batch * d.kv_heads : d.batch;
  const float* qp = q.typed_data();
  const float* kp = k_pages.typed_data();
  const float* vp = v_pages.typed_data();
  const int32_t* tp = tables.typed_data();
  const int32_t* lp = lengths.typed_data();
  float* op = out->typed_data();

  // Contiguous chunks of items, one per worker; the caller thread takes the first.
  const int64_t workers = std::min<int64_t>(threads, items);
  std::atomic<int64_t> pending(workers - 1);
  auto run_chunk = [&](int64_t w) {
    std::vector<float> scores;
    std::vector<int64_t> rows;
    const int64_t lo = items * w / workers, hi = items * (w + 1) / workers;
    auto attend = d.head_dim == 64    ? AttendRow<64>
                  : d.head_dim == 128 ? AttendRow<128>
                  : d.head_dim == 32  ? AttendRow<32>
                                      : AttendRow<0>;
    for (int64_t it = lo; it < hi; ++it) {
      if (split_heads) {
        const int64_t kh = it % d.kv_heads;
        attend(d, qp, kp, vp, tp, lp, op, it / d.kv_heads, kh, kh + 1, scores, rows);
      } else {
        attend(d, qp, kp, vp, tp, lp, op, it, 0, d.kv_heads, scores, rows);
      }
    }
  };
  for (int64_t w = 1; w < workers; ++w) {
    pool.Schedule([&, w] {
      run_chunk(w);
      pending.fetch_sub(1, std::memory_order_release);
    });
  }
  run_chunk(0);
  while (pending.load(std::memory_order_acquire) > 0) std::this_thread::yield();
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
