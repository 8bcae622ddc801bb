// Output tiles of a native matmul spread over XLA's CPU thread pool.
//
// Runs of tiles are handed out through a counter, so the calling thread does them
// all when the pool is busy (waiting for a pool task to start could deadlock, as in
// the paged attention kernel). Pool tasks co-own the work object: one that starts
// after the call returned finds no run left and touches nothing else.

#ifndef O1JAX_NATIVE_TILE_RUNS_H_
#define O1JAX_NATIVE_TILE_RUNS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace o1jax {

struct TileRuns {
  int64_t tiles = 0, per_run = 1, runs = 0;
  std::atomic<int64_t> next{0}, done{0};

  // Claims runs until none is left, calling run(begin, end) on each.
  template <class Fn>
  void Drain(Fn&& run) {
    for (int64_t r; (r = next.fetch_add(1, std::memory_order_relaxed)) < runs;) {
      run(r * per_run, std::min(tiles, (r + 1) * per_run));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs `tiles` tiles of `work` (which holds a TileRuns `runs`), `drain(work)`
// on the calling thread and on up to threads - 1 pool tasks, about 4 runs per
// thread. Products under ~256K multiply-adds (`multiply_adds`) stay on the
// calling thread: handing work to the pool costs more than it saves (measured
// with 2 threads). Returns when every run is done.
template <class Work, class DrainFn>
void RunTiles(xla::ffi::ThreadPool& pool, std::shared_ptr<Work> work, int64_t tiles,
              int64_t multiply_adds, DrainFn drain) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const bool parallel = threads > 1 && multiply_adds >= (int64_t{1} << 18) && tiles > 1;
  TileRuns& runs = work->runs;
  const int64_t want = parallel ? threads * 4 : 1;
  runs.tiles = tiles;
  runs.per_run = std::max<int64_t>(1, (tiles + want - 1) / want);
  runs.runs = (tiles + runs.per_run - 1) / runs.per_run;
  if (parallel) {
    for (int64_t t = 1; t < std::min<int64_t>(threads, runs.runs); ++t) {
      pool.Schedule([work, drain] { drain(*work); });
    }
  }
  drain(*work);
  while (runs.done.load(std::memory_order_acquire) < runs.runs) std::this_thread::yield();
}

}  // namespace o1jax

#endif  // O1JAX_NATIVE_TILE_RUNS_H_
