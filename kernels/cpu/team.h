// A team of threads that stays awake through a stretch of a decode step (step.cpp).
//
// Each `at::parallel_for` opens an OpenMP region, and qspec's CLI lets idle threads spin only
// briefly (GOMP_SPINCOUNT=1000, docs/PERF.md "Beside a CPU hog"), so every region wakes its
// threads through the kernel: tens of microseconds on a small VM. A decode step of a 30-layer
// model opened 4-8 regions a layer, and on 2 cores a draft step ran no faster on 2 threads
// than on 1 (SmolLM2 at 256 tokens, Zen 4: 11.5-12.2 vs 10.9-14.3 ms). A team opens one region
// for a whole forward over the hierarchical cache (for the stretch between two attentions over
// the full-precision one, whose SDPA runs on the pool), and its threads meet at a spinning
// barrier between the kernels instead.
//
// `Member` is the kernels' parallel_for inside a team: every thread calls it with the same
// range and takes pieces of it as it gets to them; which thread computes an output never
// changes its bits. It does not wait: the caller puts `barrier()` where a later step reads
// what others wrote.
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
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen;)
      if (spins < kSpins)
        ++spins;
      else
        std::this_thread::yield();
  }

 private:
  static constexpr int kSpins = 20000;  // ~10-50 us of loads: longer than a layer's gaps
  int threads_;
  std::atomic<int> arrived_{0}, gen_{0};
};

// What the team's threads share: the barrier, what a `single` threw, and one slot per
// recent parallel_for call for handing out its pieces.
struct Shared {
  explicit Shared(int threads) : barrier(threads) {}
  Barrier barrier;
  std::exception_ptr error;  // (thread 0's only)
  std::atomic<bool> failed{false};
  // slot[call % kCalls]: (call number << 32) | pieces handed out. Threads run the same calls
  // in the same order and meet at a barrier at least every kCalls calls (a verify's q, k and
  // v take at most 9), so a slot is never wanted by two calls at once.
  static constexpr int kCalls = 64;
  std::atomic<uint64_t> slot[kCalls] = {};
};

// One thread's view of the team: its index and what the team shares.
class Member {
 public:
  Member(int id, int size, Shared& shared) : id_(id), size_(size), shared_(shared) {}

  // The kernels' parallel_for(begin, end, grain, fn): pieces of [begin, end) handed out as
  // threads ask, about 4 per thread and none under a 16th of the pool's grain. Dynamic, so that
  // a thread that shares its core with another process (a browser, a build) does less of the
  // work instead of holding up the others at the next barrier. Each call is met by every
  // thread; the first to finish its pieces leaves at once.
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& fn) const {
    const uint64_t call = ++calls_;  // (from 1: an untouched slot reads as call 0)
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int64_t g = std::max<int64_t>(1, grain / kGrainDivisor);
    const int64_t piece = std::max<int64_t>(g, (n + 4 * size_ - 1) / (4 * size_));
    const uint64_t pieces = uint64_t((n + piece - 1) / piece);
    if (size_ == 1 || pieces == 1) {
      if (id_ == 0) fn(begin, end);
      return;
    }
    std::atomic<uint64_t>& slot = shared_.slot[call % Shared::kCalls];
    uint64_t v = slot.load(std::memory_order_acquire);
    for (;;) {
      if (v >> 32 != call) {  // an older call's count: start this call's at 0
        if (!slot.compare_exchange_weak(v, call << 32, std::memory_order_acq_rel)) continue;
        v = call << 32;
      }
      const uint64_t next = v & 0xFFFFFFFFu;
      if (next >= pieces) return;
      if (slot.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) {
        const int64_t b0 = begin + int64_t(next) * piece;
        fn(b0, std::min(end, b0 + piece));
        v = slot.load(std::memory_order_acquire);
      }
    }
  }

  void barrier() const { shared_.barrier.wait(); }

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
        shared_.error = std::current_exception();
        shared_.failed.store(true, std::memory_order_release);
      }
    }
    barrier();
  }

  // whether a `single` threw: what it was to make is not there (the rest of the team's work
  // is skipped; the caller rethrows)
  bool failed() const { return shared_.failed.load(std::memory_order_acquire); }
  int id() const { return id_; }

 private:
  int id_, size_;
  Shared& shared_;
  mutable uint64_t calls_ = 0;  // parallel_for calls this thread has made
};

// body(member) on `threads` threads (one OpenMP region; the team is as large as OpenMP gives),
// then rethrows what a `single` caught.
template <class Body>
void run(int threads, const Body& body) {
  if (threads <= 1 || omp_in_parallel()) {
    Shared shared(1);
    body(Member(0, 1, shared));
    if (shared.error) std::rethrow_exception(shared.error);
    return;
  }
  Shared shared(threads);
#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    shared.barrier.resize(omp_get_num_threads());  // (implicit barrier after: all see the size)
    body(Member(omp_get_thread_num(), omp_get_num_threads(), shared));
  }
  if (shared.error) std::rethrow_exception(shared.error);
}

}  // namespace team
