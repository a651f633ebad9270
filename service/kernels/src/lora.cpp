// loraplex native kernels: the batched LoRA math of one (layer, site) in one call (service/adapters/lora/batch.py
// uses it on the CPU when the library is loaded).
//
//   lp_lora_delta  rows grouped by adapter (SGMV-style): per group g, h = x[rows] A_g^T (all the site's modules
//                  side by side along the rank), then per module m out[rows, cols_m] op= h[:, seg_m] Bt_m,g
//                  (+ bias), where op is += or, with a DoRA scale, out = scale * (out + delta)
//
// The tables are the batch's, read where they lie: A [G, R, in] (the shared and the per-slot layouts; any strides,
// rows of A widened into scratch where they are not contiguous float32); per module Bt [G, r_m, out_m] (the scaled B^T), an optional bias [G, out_m] in the
// tables' dtype and an optional float32 scale [G, out_m]. Each group's weights are read once per call however many
// rows it has; x and out rows are read and written in place, rows of group -1 are not touched.
//
// Isolation: a row's input meets only its own group's weights, so a NaN in one adapter stays in its own rows.
// Batch invariance: each row's sums run in a fixed order (its dot products in lanes of 16 then pairwise, the expand
// over the rank in order) whichever rows share its group, its call or its thread, and whichever table holds A.
// Numerics: the values as stored (bf16 widened by a shift); the shrink sums in double (products of float32 values
// are exact there, so fused and separate multiply-adds agree and every instruction set gets the same h) and rounds h
// once to float32, the expand sums float32 over the rank; the delta is added in float32 and rounded once to the
// output dtype (bf16: to nearest even), as torch's `out += delta` does.
// Threads: OpenMP (torch's runtime) over work items, the shrink's (group, 4 rows of A) then the expand's (group,
// module, 256 columns), each prefetching the next item's weights; scratch stays allocated per thread between calls.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "dtypes.h"

namespace {

using lp::store;
using lp::widen;

constexpr int kLanes = 16;
constexpr int64_t kCols = 256;    // output columns of one expand work item
constexpr int64_t kSub = 64;      // of which one pass over the rank accumulates
constexpr int64_t kParallelMacs = 1 << 16;  // below this many multiply-adds one thread does the call


// The shrink's sums are in double (products of float32 values are exact there): h = x A^T is its float32 value
// rounded once, however long the input, and the same on every instruction set.
inline double lane_sum(double* acc) {  // pairwise over the lanes
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// acc + x * y for doubles holding float32 values: the product is exact in double (24 + 24 bits), so the fused and
// the separate multiply-add round alike and every instruction set gets the same sums.
inline double madd(double acc, double x, double y) {
#if defined(__FMA__)
  return __builtin_fma(x, y, acc);
#else
  return acc + x * y;
#endif
}

// dot(x[t], a[q]) over n for kRows rows a[q] and NT tokens x[t] at once (each conversion of a row feeds every
// token), summed in double: lane l adds k = l, l + 16, ... in turn, then the lanes pairwise, then the tail; each
// token's sum is the same whatever rows and tokens it is computed with.
constexpr int kRows = 4;
template <int NT>
inline void dot_rows(const float* const* x, const float* const* a, int64_t n, float (*out)[kRows]) {
  double acc[NT][kRows][kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      double av[kRows];
      for (int q = 0; q < kRows; ++q) av[q] = a[q][i + l];
      for (int t = 0; t < NT; ++t) {
        const double xv = x[t][i + l];
        for (int q = 0; q < kRows; ++q) acc[t][q][l] = madd(acc[t][q][l], xv, av[q]);
      }
    }
  for (int t = 0; t < NT; ++t)
    for (int q = 0; q < kRows; ++q) {
      double tail = 0.0;
      for (int64_t k = i; k < n; ++k) tail = madd(tail, x[t][k], a[q][k]);
      out[t][q] = (float)(lane_sum(acc[t][q]) + tail);
    }
}

// Asks for [p, p + bytes) ahead of its use: the next work item's weights load while this one computes.
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char*)p + off);
}

// Scratch memory: up to kKeptBytes stays allocated per thread and slot between calls (a decode step's calls then
// allocate nothing: a fresh large malloc is an mmap whose pages fault in on every call); larger requests (long
// prefills) are allocated for the call.
constexpr size_t kKeptBytes = size_t(1) << 22;
struct Kept {
  void* p = nullptr;
  size_t n = 0;
  ~Kept() { std::free(p); }
};
thread_local Kept kept[5];

class Scratch {
 public:
  Scratch(int slot, size_t bytes) {
    if (bytes > kKeptBytes) {
      p_ = owned_ = std::malloc(bytes);
      return;
    }
    Kept& k = kept[slot];
    if (k.n < bytes) {
      std::free(k.p);
      k.p = std::malloc(bytes);
      k.n = k.p == nullptr ? 0 : bytes;
    }
    p_ = k.p;
  }
  ~Scratch() { std::free(owned_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T>
  T* as() const {
    return (T*)p_;
  }

 private:
  void* p_ = nullptr;
  void* owned_ = nullptr;
};

struct Span {  // one group's token rows: order[first .. first + count)
  int64_t group, first, count;
};

template <typename X, typename W>
int lora_delta(const X* x, int64_t b, int64_t t, int64_t in, const int64_t* group, const W* a, int64_t a_sg,
               int64_t a_sr, int64_t a_sk, int64_t width, int64_t nseg, const int64_t* seg, const void* const* bt_,
               const float* const* scale, const void* const* bias_, X* out, int64_t out_cols) {
  // The rows with a group, ordered by group (then row): each group's weights are then read once.
  int64_t active = 0;
  for (int64_t r = 0; r < b; ++r) active += group[r] >= 0;
  if (active == 0) return 0;
  const int64_t tokens = active * t;
  const bool widen_x = !std::is_same<X, float>::value;  // float32 x is read in place
  const Scratch order_(0, (size_t)active * sizeof(int64_t)), spans_(1, (size_t)active * sizeof(Span));
  const Scratch h_(2, (size_t)tokens * width * sizeof(float)), xf_(3, widen_x ? (size_t)tokens * in * sizeof(float) : 1);
  int64_t* order = order_.as<int64_t>();
  Span* spans = spans_.as<Span>();
  float* h = h_.as<float>();  // [tokens, width] in span order
  float* xf = xf_.as<float>();  // bfloat16 x widened, in span order
  if (order == nullptr || spans == nullptr || h == nullptr || xf == nullptr) return -2;
  active = 0;
  for (int64_t r = 0; r < b; ++r)
    if (group[r] >= 0) order[active++] = r;
  std::stable_sort(order, order + active, [group](int64_t p, int64_t q) { return group[p] < group[q]; });
  int64_t nspans = 0;
  for (int64_t i = 0; i < active; ++i) {
    if (i == 0 || group[order[i]] != group[order[i - 1]]) spans[nspans++] = Span{group[order[i]], i, 0};
    spans[nspans - 1].count += 1;
  }
  // Token row j (span order) is element (order[j / t], j % t) of x and out.
  auto at = [&](int64_t j) { return order[j / t] * t + j % t; };
  int64_t rank_sum = 0, blocks = 0;  // blocks: expand work items per group
  for (int64_t m = 0; m < nseg; ++m) rank_sum += seg[4 * m + 1], blocks += (seg[4 * m + 3] + kCols - 1) / kCols;
  const int64_t macs = tokens * (in * width + rank_sum * out_cols / nseg);
  const bool direct = a_sk == 1 && std::is_same<W, float>::value;  // A's rows read in place, else widened to buf
  int failed = 0;

#pragma omp parallel if (macs >= kParallelMacs)
  {
    const Scratch buf_(4, (size_t)std::max(kRows * in, width * kCols) * sizeof(float));
    float* buf = buf_.as<float>();  // rows of A or a block of Bt, widened
    if (buf == nullptr) {
#pragma omp atomic write
      failed = 1;
    }
    if (widen_x) {
#pragma omp for schedule(static)
      for (int64_t j = 0; j < tokens; ++j) {
        const X* src = x + at(j) * in;
        for (int64_t k = 0; k < in; ++k) xf[j * in + k] = widen(src[k]);
      }
    }
    auto x_row = [&](int64_t j) -> const float* {
      return widen_x ? xf + j * in : (const float*)(const void*)(x + at(j) * in);
    };
    // Shrink: one work item per (group, kRows rows of A): those rows once (widened where needed), for each token.
    const int64_t quads = (width + kRows - 1) / kRows;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < nspans * quads; ++item) {
      if (buf == nullptr) continue;
      const Span& s = spans[item / quads];
      const int64_t r0 = (item % quads) * kRows, nr = std::min<int64_t>(kRows, width - r0);
      if (a_sk == 1 && item + 1 < nspans * quads) {  // the next item's rows (within this thread's chunk)
        const int64_t next_r0 = ((item + 1) % quads) * kRows, rows = std::min<int64_t>(kRows, width - next_r0);
        prefetch(a + spans[(item + 1) / quads].group * a_sg + next_r0 * a_sr, rows * a_sr * (int64_t)sizeof(W));
      }
      const float* rows[kRows];
      for (int q = 0; q < kRows; ++q) {  // a short last quad repeats its last row
        const W* src = a + s.group * a_sg + (r0 + std::min<int64_t>(q, nr - 1)) * a_sr;
        if (direct) {
          rows[q] = (const float*)(const void*)src;
        } else {
          for (int64_t k = 0; k < in; ++k) buf[q * in + k] = widen(src[k * a_sk]);
          rows[q] = buf + q * in;
        }
      }
      const int64_t j1 = (s.first + s.count) * t;
      for (int64_t j = s.first * t; j < j1; j += 2) {  // tokens in pairs
        const float* xs[2] = {x_row(j), j + 1 < j1 ? x_row(j + 1) : nullptr};
        float hq[2][kRows];
        if (j + 1 < j1) {
          dot_rows<2>(xs, rows, in, hq);
        } else {
          dot_rows<1>(xs, rows, in, hq);
        }
        for (int64_t u = 0; u < 2 && j + u < j1; ++u)
          for (int64_t q = 0; q < nr; ++q) h[(j + u) * width + r0 + q] = hq[u][q];
      }
    }
    // Expand: one work item per (group, module, block of kCols columns): that block of Bt once for all tokens.
#pragma omp for schedule(static)
    for (int64_t item = 0; item < nspans * blocks; ++item) {
      if (buf == nullptr) continue;
      const Span& s = spans[item / blocks];
      int64_t m = 0, blk = item % blocks;
      while (blk >= (seg[4 * m + 3] + kCols - 1) / kCols) blk -= (seg[4 * m + 3] + kCols - 1) / kCols, ++m;
      const int64_t start = seg[4 * m], rank = seg[4 * m + 1], col = seg[4 * m + 2], n = seg[4 * m + 3];
      const int64_t c0 = blk * kCols, nc = std::min(kCols, n - c0);
      const W* bt = (const W*)bt_[m] + s.group * rank * n + c0;  // Bt[g, j, c0 + c] at bt[j * n + c]
      // The block as float32 rows of kCols: Bt itself, or widened into buf with zeros past the last column.
      const bool in_place = std::is_same<W, float>::value && nc == kCols;
      const float* w0 = in_place ? (const float*)(const void*)bt : buf;
      const int64_t ws = in_place ? n : kCols;
      for (int64_t j = 0; j < rank && !in_place; ++j) {
        for (int64_t c = 0; c < nc; ++c) buf[j * kCols + c] = widen(bt[j * n + c]);
        for (int64_t c = nc; c < kCols; ++c) buf[j * kCols + c] = 0.0f;
      }
      if (item + 1 < nspans * blocks) {  // the next item's block of Bt
        int64_t nm = 0, nblk = (item + 1) % blocks;
        while (nblk >= (seg[4 * nm + 3] + kCols - 1) / kCols) nblk -= (seg[4 * nm + 3] + kCols - 1) / kCols, ++nm;
        const int64_t nn = seg[4 * nm + 3], nrank = seg[4 * nm + 1], nc0 = nblk * kCols;
        const W* next = (const W*)bt_[nm] + spans[(item + 1) / blocks].group * nrank * nn + nc0;
        for (int64_t j = 0; j < nrank; ++j) prefetch(next + j * nn, std::min(kCols, nn - nc0) * (int64_t)sizeof(W));
      }
      const W* bias = bias_[m] == nullptr ? nullptr : (const W*)bias_[m] + s.group * n + c0;
      const float* sc = scale[m] == nullptr ? nullptr : scale[m] + s.group * n + c0;
      for (int64_t j = s.first * t; j < (s.first + s.count) * t; ++j) {
        const float* hj = h + j * width + start;
        float acc[kCols];
        for (int64_t c0s = 0; c0s < kCols; c0s += kSub) {  // kSub columns: accumulators that stay in registers
          float part[kSub] = {};
          for (int64_t q = 0; q < rank; ++q) {
            const float hv = hj[q];
            const float* w = w0 + q * ws + c0s;
            for (int64_t c = 0; c < kSub; ++c) part[c] += hv * w[c];
          }
          for (int64_t c = 0; c < kSub; ++c) acc[c0s + c] = part[c];
        }
        if (bias != nullptr)
          for (int64_t c = 0; c < nc; ++c) acc[c] += widen(bias[c]);
        X* o = out + at(j) * out_cols + col + c0;
        if (sc == nullptr) {
          for (int64_t c = 0; c < nc; ++c) store(o, c, widen(o[c]) + acc[c]);
        } else {
          for (int64_t c = 0; c < nc; ++c) store(o, c, (widen(o[c]) + acc[c]) * sc[c]);
        }
      }
    }
  }
  return failed ? -2 : 0;
}

}  // namespace

extern "C" {

// x [B, T, in] and out [B, T, out_cols] (dtype x_dtype: 0 float32, 1 bfloat16; contiguous); group [B] int64: the
// row's index into the tables' leading axis (< groups), or -1 for a row left alone. A: element (g, r, k) at
// a[g * a_sg + r * a_sr + k * a_sk], r < width; w_dtype (0 / 1) for A, every Bt and bias. Module m < nseg:
// seg[4 m ..] = {start in h, rank r_m, first column in out, out_m}, bt[m] [G, r_m, out_m] contiguous, scale[m]
// (float32 [G, out_m]) and bias[m] ([G, out_m]) or null. Returns 0, -1 on a bad argument, -2 out of memory.
int lp_lora_delta(const void* x, int x_dtype, int64_t b, int64_t t, int64_t in, const int64_t* group, int64_t groups,
                  const void* a, int w_dtype, int64_t a_sg, int64_t a_sr, int64_t a_sk, int64_t width, int64_t nseg,
                  const int64_t* seg, const void* const* bt, const float* const* scale, const void* const* bias,
                  void* out, int64_t out_cols) {
  if (b < 0 || t <= 0 || in <= 0 || width <= 0 || nseg <= 0 || groups <= 0) return -1;
  if ((x_dtype != 0 && x_dtype != 1) || (w_dtype != 0 && w_dtype != 1)) return -1;
  for (int64_t m = 0; m < nseg; ++m) {
    const int64_t start = seg[4 * m], rank = seg[4 * m + 1], col = seg[4 * m + 2], n = seg[4 * m + 3];
    if (start < 0 || rank <= 0 || start + rank > width || col < 0 || n <= 0 || col + n > out_cols) return -1;
    if (bt[m] == nullptr) return -1;
  }
  for (int64_t r = 0; r < b; ++r)
    if (group[r] < -1 || group[r] >= groups) return -1;
  using B16 = uint16_t;
  if (x_dtype == 0 && w_dtype == 0)
    return lora_delta((const float*)x, b, t, in, group, (const float*)a, a_sg, a_sr, a_sk, width, nseg, seg, bt,
                      scale, bias, (float*)out, out_cols);
  if (x_dtype == 0)
    return lora_delta((const float*)x, b, t, in, group, (const B16*)a, a_sg, a_sr, a_sk, width, nseg, seg, bt, scale,
                      bias, (float*)out, out_cols);
  if (w_dtype == 0)
    return lora_delta((const B16*)x, b, t, in, group, (const float*)a, a_sg, a_sr, a_sk, width, nseg, seg, bt, scale,
                      bias, (B16*)out, out_cols);
  return lora_delta((const B16*)x, b, t, in, group, (const B16*)a, a_sg, a_sr, a_sk, width, nseg, seg, bt, scale,
                    bias, (B16*)out, out_cols);
}

}  // extern "C"
