// The CPU kernels' thread pool (see thread_pool.h for why it is not OpenMP).
//
// The running job is one 64-bit word, [generation: 16 bits][chunks: 24][next chunk: 24], so a claim is one
// compare-and-swap on it and can never take a chunk of a job that has ended. The job's other fields (fn, n, grain)
// are written before the word and stay valid while any chunk is unfinished, which a claimed chunk is until its
// owner counts it done. A helper spins a short while for the next job (a decode step's kernels come tens of
// microseconds apart), then sleeps on a condition variable.
#include "thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace tandem_pool {
namespace {

constexpr int BITS = 24;
constexpr uint64_t MASK = (uint64_t{1} << BITS) - 1;
constexpr auto SPIN = std::chrono::microseconds(200);  // a helper's wait for the next job before it sleeps

struct Pool {
  std::atomic<uint64_t> job{0};
  std::atomic<int64_t> remaining{0};  // chunks of the running job not finished yet
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t n = 0, grain = 1;
  uint64_t generation = 0;            // the caller's count of jobs
  std::atomic<bool> busy{false};      // a parallel_for is running
  std::atomic<int> num_helpers{0};    // helpers with an index below this one keep running
  std::atomic<int> sleepers{0};
  std::mutex mutex;
  std::condition_variable wake;
  std::vector<std::thread> helpers;
};

// NOTE: never destroyed, so that sleeping helpers never outlive their pool at process exit.
Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

inline uint64_t generation_of(uint64_t word) { return word >> (2 * BITS); }

// Claim the next chunk of the running job; false when it has none left.
bool claim(Pool& p, int64_t& chunk) {
  uint64_t word = p.job.load(std::memory_order_acquire);
  for (;;) {
    const uint64_t next = word & MASK, total = (word >> BITS) & MASK;
    if (next >= total) return false;
    if (p.job.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      chunk = static_cast<int64_t>(next);
      return true;
    }
  }
}

void run_chunks(Pool& p) {
  int64_t chunk;
  while (claim(p, chunk)) {
    const int64_t begin = chunk * p.grain;
    (*p.fn)(begin, std::min(begin + p.grain, p.n));
    p.remaining.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void helper_main(Pool& p, int index) {
  uint64_t seen = generation_of(p.job.load(std::memory_order_acquire));
  for (;;) {
    auto start = std::chrono::steady_clock::now();
    for (int spins = 0; generation_of(p.job.load(std::memory_order_seq_cst)) == seen; ++spins) {
      if (p.num_helpers.load(std::memory_order_acquire) <= index) return;
      _mm_pause();
      if ((spins & 63) == 0 && std::chrono::steady_clock::now() - start > SPIN) {
        std::unique_lock<std::mutex> lock(p.mutex);
        p.sleepers.fetch_add(1, std::memory_order_seq_cst);
        p.wake.wait(lock, [&] {
          return generation_of(p.job.load(std::memory_order_seq_cst)) != seen ||
                 p.num_helpers.load(std::memory_order_acquire) <= index;
        });
        p.sleepers.fetch_sub(1, std::memory_order_seq_cst);
        start = std::chrono::steady_clock::now();
      }
    }
    seen = generation_of(p.job.load(std::memory_order_acquire));
    run_chunks(p);
  }
}

}  // namespace

void set_num_threads(int num_threads) {
  Pool& p = pool();
  const int wanted = std::max(num_threads, 1) - 1;
  if (wanted < static_cast<int>(p.helpers.size())) {
    {
      std::lock_guard<std::mutex> lock(p.mutex);
      p.num_helpers.store(wanted, std::memory_order_release);
    }
    p.wake.notify_all();
    for (size_t i = wanted; i < p.helpers.size(); ++i) p.helpers[i].join();
    p.helpers.resize(wanted);
  }
  p.num_helpers.store(wanted, std::memory_order_release);
  for (int i = static_cast<int>(p.helpers.size()); i < wanted; ++i) {
    try {
      p.helpers.emplace_back(helper_main, std::ref(p), i);
    } catch (const std::system_error& e) {  // (keep the helpers that started; the caller learns why)
      p.num_helpers.store(i, std::memory_order_release);
      throw std::runtime_error("kernel thread pool: started " + std::to_string(i + 1) + " of " +
                               std::to_string(num_threads) + " threads: " + e.what());
    }
  }
}

int num_threads() { return static_cast<int>(pool().helpers.size()) + 1; }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  Pool& p = pool();
  grain = std::max<int64_t>({grain, 1, (n + static_cast<int64_t>(MASK) - 1) / static_cast<int64_t>(MASK)});
  const int64_t chunks = (n + grain - 1) / grain;
  if (p.helpers.empty() || chunks == 1 || p.busy.exchange(true, std::memory_order_acquire)) {
    fn(0, n);  // (one thread, one chunk, or a nested / concurrent call: serially here)
    return;
  }
  p.fn = &fn;
  p.n = n;
  p.grain = grain;
  p.remaining.store(chunks, std::memory_order_relaxed);
  p.generation = (p.generation + 1) & 0xFFFF;
  p.job.store((p.generation << (2 * BITS)) | (static_cast<uint64_t>(chunks) << BITS), std::memory_order_seq_cst);
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(p.mutex);
    p.wake.notify_all();
  }
  run_chunks(p);
  while (p.remaining.load(std::memory_order_acquire) > 0) _mm_pause();
  p.busy.store(false, std::memory_order_release);
}

}  // namespace tandem_pool
