// The CPU kernels' own threads (kernels/cpu/thread_pool.cpp), used by the outer loops of the GEMM and attention
// kernels instead of OpenMP.
//
// Why: a decode step on a small model is about 150 kernel calls of 50-5,000 us each. A fork-join team whose barrier
// waits for every thread loses a whole time slice whenever one of its threads is descheduled, which is the common
// case when the prefill tier shares the machine (2 OpenMP threads measured 0.7-1.6 s per step there,
// docs/performance.md). Here the caller works too and tasks are claimed one at a time from a shared counter: a
// helper that has not woken up yet costs nothing (the caller takes its share), and the caller waits only for a task
// a helper has claimed and not finished.
#pragma once
#include <cstdint>
#include <functional>

namespace tandem_pool {

// Threads that run a parallel_for, the caller included (1: everything runs on the caller). Helpers are started
// or stopped here; the caller's thread count for torch's own ops is not touched.
void set_num_threads(int num_threads);
int num_threads();

// fn(begin, end) over [0, n) in chunks of grain (the last one shorter), spread over the pool; returns when every
// chunk is done. Chunks may run in any order and on any thread; fn must not throw. Not reentrant: a parallel_for
// inside fn, or from a second thread while one runs, runs serially on its caller.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace tandem_pool
