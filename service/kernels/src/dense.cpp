// loraplex native kernels: the product of a few rows (a decode step's) with a dense float32 or bfloat16 weight as
// stored, [N, K] row-major: at one to a few rows torch's GEMM reads such a weight at a fraction of the machine's
// bandwidth (bench/README.md), and this is a stream over the weight.
//
//   lp_dense_matmul  out [M, N] (ldo) = x [M, K] W^T; x, W and out float32 or bf16 each
//
// Numerics: each output is one dot product over K in 16 lanes (lane l sums k = l, l + 16, ... in order, each product
// rounded to float32 then added: -ffp-contract=off and dtypes.h's V16, so every variant, generic included, gives the
// same bits), the lanes pairwise, then the K % 16 tail in order, rounded once to the output dtype (bf16: to nearest
// even). A row's result does not depend on M, its place among the rows, or the thread: batch-invariant.
// Threads: OpenMP over the weight's rows (one at a time for one row of x, blocks of kW for more, each block read
// once for every row of x, kX at a time).

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "dtypes.h"

namespace {

using lp::bf16;
using lp::lane_sum;
using lp::load16;
using lp::V16;

using lp::F32;
using lp::BF16;
constexpr int kLanes = 16;
// A pass holds kX * kW accumulators of 16 lanes in registers, beside kW weight loads and one x load: 32 zmm on
// avx512; 16 ymm on avx2, two a V16 (more spill to the stack).
#if defined(__AVX512F__)
constexpr int kW = 4;  // weight rows a pass holds
constexpr int kX = 4;  // rows of x a pass holds
#else
constexpr int kW = 2;
constexpr int kX = 2;
#endif
constexpr int64_t kParallelMacs = 1 << 16;  // below this many multiply-adds one thread does the call
constexpr int64_t kAheadBytes = 16384;      // requested ahead of a pass: past its rows, into the next ones

// NX rows of x (float32) against weight rows [n0, n0 + nw), nw <= W (a short block repeats its first row); each
// weight row requested kAheadBytes ahead once per cache line.
template <int NX, int W, typename T, typename O>
void pass(const float* x, int64_t k, const T* w, int64_t ldw, int64_t n0, int64_t nw, O* out, int64_t ldo) {
  V16 acc[NX][W] = {};
  const T* rows[W];
  for (int j = 0; j < W; ++j) rows[j] = w + (n0 + (j < nw ? j : 0)) * ldw;
  const int64_t body = k - k % kLanes, line = 64 / (int64_t)sizeof(T);
  for (int64_t i = 0; i < body; i += kLanes) {
    V16 wv[W];
    for (int j = 0; j < W; ++j) {
      if (i % line == 0) __builtin_prefetch(reinterpret_cast<const char*>(rows[j] + i) + kAheadBytes);
      wv[j] = load16(rows[j] + i);
    }
    for (int r = 0; r < NX; ++r) {
      const V16 xv = load16(x + r * k + i);
      for (int j = 0; j < W; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < NX; ++r)
    for (int j = 0; j < nw; ++j) {
      float s = lane_sum(acc[r][j]);
      for (int64_t i = body; i < k; ++i) s += x[r * k + i] * lp::widen(rows[j][i]);
      lp::store(out + r * ldo, n0 + j, s);
    }
}

// One row of x reads the weight row after row, one stream per thread (26 GB/s in bf16 on a 2-vCPU EPYC where
// blocks of 4 rows side by side read 19); more rows of x take kW rows at a time, each load serving them all.
template <typename T, typename O>
void dense(const float* x, int64_t m, int64_t k, const T* w, int64_t n, int64_t ldw, O* out, int64_t ldo) {
  const int64_t per = m == 1 ? 1 : kW, blocks = (n + per - 1) / per;
#pragma omp parallel for schedule(static) if (m * n * k >= kParallelMacs)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * per, nw = std::min<int64_t>(per, n - n0);
    if (m == 1) {
      pass<1, 1>(x, k, w, ldw, n0, nw, out, ldo);
      continue;
    }
    for (int64_t r = 0; r < m; r += kX) {
      const float* xr = x + r * k;
      O* o = out + r * ldo;
      switch (std::min<int64_t>(kX, m - r)) {
        case 1: pass<1, kW>(xr, k, w, ldw, n0, nw, o, ldo); break;
        case 2: pass<2, kW>(xr, k, w, ldw, n0, nw, o, ldo); break;
        case 3: pass<3, kW>(xr, k, w, ldw, n0, nw, o, ldo); break;
        default: pass<kX, kW>(xr, k, w, ldw, n0, nw, o, ldo);
      }
    }
  }
}

template <typename T>
void dense_out(const float* x, int64_t m, int64_t k, const T* w, int64_t n, int64_t ldw, void* out, int out_dtype,
               int64_t ldo) {
  if (out_dtype == BF16)
    dense(x, m, k, w, n, ldw, static_cast<bf16*>(out), ldo);
  else
    dense(x, m, k, w, n, ldw, static_cast<float*>(out), ldo);
}

}  // namespace

extern "C" {

// Returns 0, -1 for a bad argument, -2 without memory for widening a bf16 x.
int lp_dense_matmul(const void* x, int x_dtype, const void* w, int w_dtype, int64_t m, int64_t n, int64_t k,
                    int64_t ldw, void* out, int out_dtype, int64_t ldo) {
  const auto known = [](int dtype) { return dtype == F32 || dtype == BF16; };
  if (m < 0 || n < 0 || k <= 0 || ldw < k || ldo < n || !known(x_dtype) || !known(w_dtype) || !known(out_dtype))
    return -1;
  if (m == 0 || n == 0) return 0;
  float* copy = nullptr;
  if (x_dtype == BF16) {
    copy = static_cast<float*>(std::malloc(sizeof(float) * m * k));
    if (copy == nullptr) return -2;
    for (int64_t i = 0; i < m * k; ++i) copy[i] = lp::widen(static_cast<const bf16*>(x)[i]);
  }
  const float* xf = copy != nullptr ? copy : static_cast<const float*>(x);
  if (w_dtype == BF16)
    dense_out(xf, m, k, static_cast<const bf16*>(w), n, ldw, out, out_dtype, ldo);
  else
    dense_out(xf, m, k, static_cast<const float*>(w), n, ldw, out, out_dtype, ldo);
  std::free(copy);
  return 0;
}

}  // extern "C"
