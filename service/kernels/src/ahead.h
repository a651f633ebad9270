// loraplex native kernels: memory a product requests into the caches for the call after it (a decode step's LoRA
// tables under the product before them: lp_q4_matmul_ahead, lp_pairs_matmul_ahead; src/decode.cpp passes them).
#pragma once

#include <cstdint>

namespace lp {

// Cache lines of other memory (``count`` byte ranges, ``lines`` lines in all) requested a few at a time as a work
// item's inner steps go by (``next``, ``visits`` calls an item at most), so the requests spread over the product
// instead of queueing at once. Work item ``task`` of ``tasks`` takes the same fraction of every range (its
// ``task``-th share of each in turn): the LoRA kernel after the product splits its groups among the threads in order
// too, and lp::Shares gives each thread its static share of the items in order, so each core mostly finds its share
// of the tables in its own caches. ``to_l2``: request the lines into the core's L2 only (memory the next work item
// reads, too large for L1 beside the current one's).
struct Stream {
  Stream(const void* const* ranges_, const int64_t* bytes_, int count_, int64_t lines, int64_t task_, int64_t tasks_,
         int64_t visits, bool to_l2_ = false)
      : ranges(ranges_), bytes(bytes_), count(count_), task(task_), tasks(tasks_),
        per_visit((lines / tasks_ + count_ + visits - 1) / visits), to_l2(to_l2_) {}
  const void* const* ranges;
  const int64_t* bytes;
  int count;
  int64_t task, tasks;
  int64_t per_visit;  // lines to request per call of next
  bool to_l2;
  int range = -1;
  int64_t line = 0, end = 0;  // within ``range``
  void next() {
    for (int64_t i = 0; i < per_visit; ++i, ++line) {
      while (line >= end) {
        if (++range >= count) return;
        const int64_t all = (bytes[range] + 63) / 64;
        line = all * task / tasks, end = all * (task + 1) / tasks;
      }
      const char* at = static_cast<const char*>(ranges[range]) + line * 64;
      if (to_l2)
        __builtin_prefetch(at, 0, 2);
      else
        __builtin_prefetch(at, 0, 3);
    }
  }
};

// The cache lines of ``count`` byte ranges.
inline int64_t lines_of(const int64_t* bytes, int count) {
  int64_t lines = 0;
  for (int i = 0; i < count; ++i) lines += (bytes[i] + 63) / 64;
  return lines;
}

}  // namespace lp
