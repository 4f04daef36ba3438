// A team of threads that stays awake through a stretch of a decode step (step.cpp).
//
// Each `at::parallel_for` opens an OpenMP region, and qspec's CLI lets idle threads spin only
// briefly (GOMP_SPINCOUNT=1000, docs/PERF.md "Beside a CPU hog"), so every region wakes its
// threads through the kernel: tens of microseconds on a small VM. A decode step of a 30-layer
// model opened 4-8 regions a layer, and on 2 cores a draft step ran no faster on 2 threads
// than on 1 (SmolLM2 at 256 tokens, Zen 4: 11.5-12.2 vs 10.9-14.3 ms). A team opens one region
// for the stretch between two attentions (a layer's output projection and MLP, then the next
// layer's norm, q/k/v and RoPE) and its threads meet at a spinning barrier between the
// kernels instead.
//
// `TeamFor` is the kernels' parallel_for inside a team: every thread calls it with the same
// range and takes its own static share, as at::parallel_for splits a range (the same pieces
// for the same number of threads); which thread computes an output never changes its bits.
// It does not wait: the caller puts `barrier()` where a later step reads what others wrote.
#pragma once
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>

namespace team {

// Waking costs nothing inside a team, so a kernel's range is split down to a 16th of the
// grain that keeps small matrices on one thread of the pool (isa.h grain_rows: 256 KB).
constexpr int64_t kGrainDivisor = 16;

// A sense-reversing barrier for a few threads: spin on one counter, then yield the core
// (a busy machine: the waiting thread gives way instead of burning its slice).
class Barrier {
 public:
  explicit Barrier(int threads) : threads_(threads) {}
  void resize(int threads) { threads_ = threads; }  // (before any thread waits)
  void wait() {
    if (threads_ == 1) return;
    const int gen = gen_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins)
      if (spins > kSpins) std::this_thread::yield();
  }

 private:
  static constexpr int kSpins = 20000;  // ~10-50 us of loads: longer than a layer's gaps
  int threads_;
  std::atomic<int> arrived_{0}, gen_{0};
};

// What a `single` threw, kept for the caller; `failed` for the other threads.
struct Failure {
  std::exception_ptr error;       // (thread 0's only)
  std::atomic<bool> failed{false};
};

// One thread's view of the team: its index, the team size and the shared barrier.
class Member {
 public:
  Member(int id, int size, Barrier& barrier, Failure& failure)
      : id_(id), size_(size), barrier_(barrier), failure_(failure) {}

  // the kernels' parallel_for(begin, end, grain, fn): this thread's share of [begin, end)
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& fn) const {
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int64_t g = std::max<int64_t>(1, grain / kGrainDivisor);
    const int64_t parts = std::min<int64_t>(size_, (n + g - 1) / g);
    const int64_t chunk = (n + parts - 1) / parts;
    const int64_t b0 = begin + id_ * chunk, b1 = std::min(end, b0 + chunk);
    if (id_ < parts && b0 < b1) fn(b0, b1);
  }

  void barrier() const { barrier_.wait(); }

  // fn() on thread 0 (the caller's thread: ATen ops run where they would outside the team),
  // then a barrier. An exception is kept for the caller and later `single`s are skipped, so
  // every thread still meets every barrier (the kernels between them only read and write
  // buffers allocated before the team started; what a `single` makes, check `failed` first).
  template <class F>
  void single(const F& fn) const {
    if (id_ == 0 && !failed()) {
      try {
        fn();
      } catch (...) {
        failure_.error = std::current_exception();
        failure_.failed.store(true, std::memory_order_release);
      }
    }
    barrier();
  }

  // whether a `single` threw: what it was to make is not there (the rest of the team's work
  // is skipped; the caller rethrows)
  bool failed() const { return failure_.failed.load(std::memory_order_acquire); }
  int id() const { return id_; }

 private:
  int id_, size_;
  Barrier& barrier_;
  Failure& failure_;
};

// body(member) on `threads` threads (one OpenMP region; the team is as large as OpenMP gives),
// then rethrows what a `single` caught.
template <class Body>
void run(int threads, const Body& body) {
  Failure failure;
  if (threads <= 1 || omp_in_parallel()) {
    Barrier barrier(1);
    body(Member(0, 1, barrier, failure));
  } else {
    Barrier barrier(threads);
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
      barrier.resize(omp_get_num_threads());  // (implicit barrier after: all see the size)
      body(Member(omp_get_thread_num(), omp_get_num_threads(), barrier, failure));
    }
  }
  if (failure.error) std::rethrow_exception(failure.error);
}

}  // namespace team
