// loraplex native kernels: the work items of a parallel loop, shared so that a thread that starts late does not hold
// the others at the loop's barrier.
#pragma once

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <memory>

namespace lp {

// Items [0, n) of a loop run inside ``#pragma omp parallel``: thread i owns the i-th contiguous share, the one
// schedule(static) gives it, and takes its items from the front in order; a thread done with its own share takes
// items from the back of the others'. Undisturbed, every thread does exactly its static share in order (the lines
// lp::Stream requested into a core's caches are used by that core). A thread that starts late (woken from its wait
// after the others, or briefly interrupted) leaves the tail of its share to them instead of holding them at the
// region's barrier. A thread descheduled for a whole time slice still holds that barrier: fewer threads is the
// thread governor's answer to a busy neighbour. Each item runs exactly once, so results never depend on which
// thread ran it.
class Shares {
 public:
  // ``n`` items split among ``omp_get_max_threads()`` shares; a thread takes up to ``grain`` items at a time (for
  // items short enough that one atomic operation each would show). Call ``run`` from every thread of the region: a
  // team of any size (a share without its thread is taken by the others). A share's bounds are packed in 32 bits
  // each: 2^32 items or more (no product here comes near) run as schedule(static) does.
  explicit Shares(int64_t n, int64_t grain = 1)
      : count_(omp_get_max_threads() < 1 ? 1 : omp_get_max_threads()), grain_(grain < 1 ? 1 : grain), n_(n) {
    slots_.reset(new Slot[count_]);
    for (int i = 0; i < count_ && !wide(); ++i)
      slots_[i].span.store(pack(n * i / count_, n * (i + 1) / count_), std::memory_order_relaxed);
  }

  // Calls ``f(item)`` for items of this thread's share, then for items taken from the others, until none is left.
  template <typename F>
  void run(F&& f) {
    if (wide()) {  // this thread's static share of the team's
      const int64_t t = omp_get_num_threads(), i = omp_get_thread_num(), per = n_ / t, extra = n_ % t;
      const int64_t first = i * per + (i < extra ? i : extra), end = first + per + (i < extra ? 1 : 0);
      for (int64_t item = first; item < end; ++item) f(item);
      return;
    }
    const int me = omp_get_thread_num() % count_;
    int64_t lo, hi;
    while (take(me, true, lo, hi))
      for (int64_t item = lo; item < hi; ++item) f(item);
    for (int k = 1; k < count_; ++k)
      while (take((me + k) % count_, false, lo, hi))
        for (int64_t item = lo; item < hi; ++item) f(item);
  }

 private:
  struct alignas(64) Slot {  // a share's remaining items [front, back), packed in one word
    std::atomic<uint64_t> span{0};
  };
  static uint64_t pack(int64_t front, int64_t back) { return (uint64_t)back << 32 | (uint64_t)front; }
  bool wide() const { return n_ > (int64_t)0xffffffffLL; }

  // Up to ``grain_`` items [lo, hi) of share ``s``, from its front (its owner) or its back (another thread); false
  // when it has none left.
  bool take(int s, bool front, int64_t& lo, int64_t& hi) {
    uint64_t span = slots_[s].span.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t first = (int64_t)(span & 0xffffffffu), last = (int64_t)(span >> 32);
      if (first >= last) return false;
      const int64_t n = last - first < grain_ ? last - first : grain_;
      lo = front ? first : last - n, hi = lo + n;
      const uint64_t rest = front ? pack(first + n, last) : pack(first, last - n);
      if (slots_[s].span.compare_exchange_weak(span, rest, std::memory_order_relaxed)) return true;
    }
  }

  int count_;
  int64_t grain_, n_;
  std::unique_ptr<Slot[]> slots_;
};

}  // namespace lp
