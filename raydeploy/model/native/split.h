// Work split over the CPU client's threads, shared by the native kernels (small_matmul.cc,
// decode_attention.cc).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <immintrin.h>
#include <memory>
#include <mutex>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Work split over the CPU client's threads: part(u0, u1) over `units` units in `parts` pieces, claimed one at a
// time by this thread and by tasks on XLA's intra-op pool. The caller runs every piece no task has claimed and
// waits only for pieces running on other threads: XLA runs independent custom calls on the pool's threads at
// once, so a caller that waited for its own tasks to start could wait on a pool whose threads all wait too.
struct SplitState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t parts = 0;
  std::function<void(int64_t)> piece;
  std::mutex mu;
  std::condition_variable cv;
};

inline void RunPieces(const std::shared_ptr<SplitState>& st) {
  for (;;) {
    const int64_t p = st->next.fetch_add(1);
    if (p >= st->parts) return;
    st->piece(p);
    if (st->done.fetch_add(1) + 1 == st->parts) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->cv.notify_all();
    }
  }
}

// The caller, done with its own pieces, spins this many pauses (tens of microseconds) before it sleeps: the
// other threads' pieces end about when its own do, and a futex wake-up in a guest VM costs tens of microseconds.
constexpr int kSpins = 1 << 16;

template <typename F>
void Split(ffi::ThreadPool& pool, int64_t units, F part) {
  int64_t parts = pool.num_threads();
  if (parts > units) parts = units;
  if (parts <= 1) {
    part(0, units);
    return;
  }
  auto st = std::make_shared<SplitState>();
  st->parts = parts;
  st->piece = [&part, units, parts](int64_t p) { part(units * p / parts, units * (p + 1) / parts); };
  for (int64_t p = 1; p < parts; ++p) pool.Schedule([st] { RunPieces(st); });  // a late task finds nothing left
  RunPieces(st);
  for (int spin = 0; spin < kSpins && st->done.load(std::memory_order_acquire) != st->parts; ++spin) _mm_pause();
  if (st->done.load(std::memory_order_acquire) == st->parts) return;
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == st->parts; });
}

// Eight sums in one vector: lane i is the sum of a_i's eight lanes.
inline __m256 Sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// f(std::integral_constant<int, n>{}) for n = count clamped to 1..8: a run-time row or vector count (at most 8 by
// construction) as the template argument of a register-blocked kernel.
template <typename F>
inline void UpTo8(int64_t count, F&& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace
