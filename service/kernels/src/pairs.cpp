// loraplex native kernels: products with a bfloat16 weight kept in pairs (a bf16 model's projections on a CPU with
// bf16 dot products), any number of rows.
//
//   lp_pairs_matmul  out [M, N] (ldo) = x [M, K] W^T; x bf16, W in pairs, out float32 or bf16
//   lp_pairs_matmul_ahead  the same, requesting other memory into the caches as it goes (ahead.h)
//   lp_bf16_dot      1 where the CPU runs it on its bf16 dot-product instruction (vdpbf16ps), 0 where portable code
//                    does the same arithmetic
//
// The layout (service/model/weights/bf16_pairs.py packs it): W [N, K] as [ceil(N / 16)][ceil(K / 2)][16][2], block
// b holding rows 16 b .. 16 b + 15, pair p of a row its inputs 2 p and 2 p + 1; padding rows and the odd K's last
// input are zeros. One load gives 16 rows' pair p, the operand of one vdpbf16ps against x's pair p broadcast: an
// outer product, no reduction across lanes, each weight block read once for 4 rows of x (torch's GEMM reads a
// row-major bf16 weight at ~110-150 G multiply-adds/s at 16-32 rows on a 2-vCPU Zen 4, this at ~175-210).
//
// Numerics: each output is one float32 sum over the pairs in order; pair p adds the product of inputs 2 p + 1, then
// of 2 p, each sum rounded (the product of two bf16 is exact in float32): the instruction's arithmetic, which the
// portable code repeats (-ffp-contract=off), so every variant gives the same bits, except that the instruction
// flushes subnormal inputs and sums (below 1.2e-38) to zero. The output rounded once to its dtype (bf16: to nearest
// even). A row's result does not depend on M, its place among the rows, or the thread: batch-invariant.
// Threads: OpenMP over (a group of weight blocks, 4 rows of x), the groups split between the threads; a group's
// tiles request the next group's weights into L2 as they go.

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "ahead.h"
#include "dtypes.h"
#include "shares.h"

namespace {

using lp::bf16;
using lp::V16;
using lp::BF16;
using lp::F32;

constexpr int kRows = 16;   // weight rows a block holds: one 16-lane accumulator a row of x
constexpr int kX = 4;       // rows of x a tile holds
constexpr int kGroup = 4;   // weight blocks a tile reads (2 for one row of x: more groups for the threads)
constexpr int64_t kParallelMacs = 1 << 16;  // below this many multiply-adds one thread does the call
constexpr int64_t kAheadBytes = 16384;       // one row of x streams its blocks: each line requested this far ahead
constexpr int64_t kVisitPairs = 16;          // pairs between two requests of other memory (lp::Stream::next)

// The memory a work item requests as it goes: the tables of the call after this one (``tables``) and, at several
// tiles of x a group, its share of the next group's weights (``weights``).
struct Ahead {
  lp::Stream* tables = nullptr;
  lp::Stream* weights = nullptr;
  void next() {
    if (tables != nullptr) tables->next();
    if (weights != nullptr) weights->next();
  }
};

// x's pair p of a row, as the 32 bits of two bf16; ``Last``: an odd K's last input alone (the second half zero).
template <bool Last>
inline uint32_t pair_at(const bf16* row, int64_t p) {
  if (Last) return row[2 * p];
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  uint32_t v;  // one load: the even input in the low half, as the instruction reads a pair
  std::memcpy(&v, row + 2 * p, sizeof v);
  return v;
#else
  return row[2 * p] | (uint32_t)row[2 * p + 1] << 16;
#endif
}

// Portable: pair p of 16 weight rows split into the widened even and odd inputs (a bf16 is the high half of its
// float32), each lane adding its odd product, then its even one.
template <int NX, int NB, bool Last>
inline void lanes_pair(const bf16* const* x, const bf16* w, int64_t block_stride, int64_t p, V16 (&acc)[NX][NB]) {
  V16 we[NB], wo[NB];
  for (int b = 0; b < NB; ++b) lp::halves(w + b * block_stride + p * 2 * kRows, we[b], wo[b]);
  for (int r = 0; r < NX; ++r) {
    const uint32_t v = pair_at<Last>(x[r], p);
    const float xe = lp::widen((bf16)(v & 0xffffu)), xo = lp::widen((bf16)(v >> 16));
    for (int b = 0; b < NB; ++b) lp::pair_madd(acc[r][b], xe, xo, we[b], wo[b]);
  }
}

// A tile's sums into out's rows (n columns, the last block's lanes past n dropped).
template <int NX, int NB, typename O>
inline void store_tile(const V16 (&acc)[NX][NB], int64_t col0, int64_t n, O* const* out) {
  for (int r = 0; r < NX; ++r)
    for (int b = 0; b < NB; ++b) {
      const int64_t col = col0 + b * kRows;
      if (col + kRows <= n) {
        lp::store16(out[r] + col, acc[r][b]);
        continue;
      }
      for (int l = 0; col + l < n; ++l) lp::store(out[r], col + l, acc[r][b][l]);
    }
}

template <int NX, int NB, typename O>
void tile_lanes(const bf16* const* x, int64_t k, const bf16* w, int64_t block_stride, int64_t col0, int64_t n,
                O* const* out, Ahead& ahead) {
  V16 acc[NX][NB] = {};
  for (int64_t p0 = 0; p0 < k / 2; p0 += kVisitPairs) {
    ahead.next();
    const int64_t p1 = std::min(p0 + kVisitPairs, k / 2);
    for (int64_t p = p0; p < p1; ++p) lanes_pair<NX, NB, false>(x, w, block_stride, p, acc);
  }
  if (k % 2) lanes_pair<NX, NB, true>(x, w, block_stride, k / 2, acc);
  store_tile(acc, col0, n, out);
}

#if defined(__AVX512F__)
// The same on vdpbf16ps (built for it alone: the variant's flags lack avx512bf16; run only where the CPU has it).

template <int NX, int NB, bool Last>
LP_BF16_DOT __attribute__((always_inline)) inline void dot_pair(
    const bf16* const* x, const bf16* w, int64_t block_stride, int64_t p, __m512 (&acc)[NX][NB]) {
  __m512bh wv[NB];
  for (int b = 0; b < NB; ++b) {
    const bf16* at = w + b * block_stride + p * 2 * kRows;
    if (NX == 1) __builtin_prefetch(reinterpret_cast<const char*>(at) + kAheadBytes);
    wv[b] = (__m512bh)_mm512_loadu_si512(at);
  }
  for (int r = 0; r < NX; ++r) {
    const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair_at<Last>(x[r], p));
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
  }
}

template <int NX, int NB, typename O>
LP_BF16_DOT void tile_dot(const bf16* const* x, int64_t k, const bf16* w, int64_t block_stride, int64_t col0,
                          int64_t n, O* const* out, Ahead& ahead) {
  __m512 acc[NX][NB];
  for (int r = 0; r < NX; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < k / 2; p0 += kVisitPairs) {
    ahead.next();
    const int64_t p1 = std::min(p0 + kVisitPairs, k / 2);
    for (int64_t p = p0; p < p1; ++p) dot_pair<NX, NB, false>(x, w, block_stride, p, acc);
  }
  if (k % 2) dot_pair<NX, NB, true>(x, w, block_stride, k / 2, acc);
  V16 sums[NX][NB];
  for (int r = 0; r < NX; ++r)
    for (int b = 0; b < NB; ++b) std::memcpy(&sums[r][b], &acc[r][b], sizeof(V16));
  store_tile(sums, col0, n, out);
}

#endif

// One tile: NX rows of x against NB weight blocks, written to out's rows.
template <int NX, int NB, typename O>
void tile(bool dot, const bf16* const* x, int64_t k, const bf16* w, int64_t block_stride, int64_t col0, int64_t n,
          O* const* out, Ahead& ahead) {
#if defined(__AVX512F__)
  if (dot) return tile_dot<NX, NB>(x, k, w, block_stride, col0, n, out, ahead);
#endif
  (void)dot;
  tile_lanes<NX, NB>(x, k, w, block_stride, col0, n, out, ahead);
}

template <int NX, typename O>
void tile_nb(int nb, bool dot, const bf16* const* x, int64_t k, const bf16* w, int64_t stride, int64_t col0,
             int64_t n, O* const* out, Ahead& ahead) {
  switch (nb) {
    case 1: return tile<NX, 1>(dot, x, k, w, stride, col0, n, out, ahead);
    case 2: return tile<NX, 2>(dot, x, k, w, stride, col0, n, out, ahead);
    case 3: return tile<NX, 3>(dot, x, k, w, stride, col0, n, out, ahead);
    default: return tile<NX, 4>(dot, x, k, w, stride, col0, n, out, ahead);
  }
}

template <typename O>
void pairs(const bf16* x, int64_t m, int64_t k, const bf16* w, int64_t n, O* out, int64_t ldo,
           const void* const* tables, const int64_t* table_bytes, int ntables) {
  const int64_t blocks = (n + kRows - 1) / kRows, stride = (k + 1) / 2 * 2 * kRows;  // bf16 a block
  const int64_t per = m == 1 ? 2 : kGroup, groups = (blocks + per - 1) / per, tiles = (m + kX - 1) / kX;
  const bool dot = lp::has_bf16_dot();
  const int64_t lines = lp::lines_of(table_bytes, ntables);
  const int64_t visits = std::max<int64_t>(1, (k / 2 + kVisitPairs - 1) / kVisitPairs);  // of a work item
  lp::Shares shares(groups * tiles);
#pragma omp parallel if (m * n * k >= kParallelMacs)
  shares.run([&](int64_t item) {
    const int64_t g = item / tiles, t = item % tiles, r0 = t * kX, b0 = g * per;
    lp::Stream slice(tables, table_bytes, ntables, lines, item, groups * tiles, visits);
    // Several rows of x: the group's weights are read once from memory and again from the caches for each tile, so
    // each tile requests its share of the next group's into L2 (the hardware prefetchers leave the first tile of a
    // group waiting on memory: ~165 G multiply-adds/s over weights from memory against ~205 from the caches at 32
    // rows on a Zen 4). One row streams its blocks (kAheadBytes) instead.
    const int64_t next_bytes = std::max<int64_t>(0, std::min(per, blocks - b0 - per)) * stride * (int64_t)sizeof(bf16);
    const void* next_w = next_bytes > 0 ? w + (b0 + per) * stride : w;
    lp::Stream next(&next_w, &next_bytes, 1, (next_bytes + 63) / 64, t, tiles, visits, true);
    Ahead ahead;
    ahead.tables = lines > 0 ? &slice : nullptr;
    ahead.weights = m > 1 && next_bytes > 0 ? &next : nullptr;
    const int nx = (int)std::min<int64_t>(kX, m - r0), nb = (int)std::min<int64_t>(per, blocks - b0);
    const bf16* xs[kX];
    O* outs[kX];
    for (int r = 0; r < kX; ++r) {
      xs[r] = x + (r0 + std::min(r, nx - 1)) * k;
      outs[r] = out + (r0 + std::min(r, nx - 1)) * ldo;
    }
    const bf16* wb = w + b0 * stride;
    switch (nx) {
      case 1: tile_nb<1>(nb, dot, xs, k, wb, stride, b0 * kRows, n, outs, ahead); break;
      case 2: tile_nb<2>(nb, dot, xs, k, wb, stride, b0 * kRows, n, outs, ahead); break;
      case 3: tile_nb<3>(nb, dot, xs, k, wb, stride, b0 * kRows, n, outs, ahead); break;
      default: tile_nb<kX>(nb, dot, xs, k, wb, stride, b0 * kRows, n, outs, ahead);
    }
  });
}

}  // namespace

extern "C" {

// lp_pairs_matmul, also requesting the cache lines of ``nahead`` byte ranges (ahead[i], ahead_bytes[i] long) into
// the caches as it goes, each work item its share, a few lines every kVisitPairs pairs: the LoRA tables the next
// call reads (src/decode.cpp) stream in while the cores multiply. Returns 0, or -1 for a bad argument.
int lp_pairs_matmul_ahead(const void* x, const void* w, int64_t m, int64_t n, int64_t k, void* out, int out_dtype,
                          int64_t ldo, const void* const* ahead, const int64_t* ahead_bytes, int nahead) {
  if (m < 0 || n < 0 || k <= 0 || ldo < n || (out_dtype != F32 && out_dtype != BF16) || nahead < 0) return -1;
  if (m == 0 || n == 0) return 0;
  const bf16 *xs = static_cast<const bf16*>(x), *ws = static_cast<const bf16*>(w);
  if (out_dtype == BF16)
    pairs(xs, m, k, ws, n, static_cast<bf16*>(out), ldo, ahead, ahead_bytes, nahead);
  else
    pairs(xs, m, k, ws, n, static_cast<float*>(out), ldo, ahead, ahead_bytes, nahead);
  return 0;
}

// Returns 0, or -1 for a bad argument.
int lp_pairs_matmul(const void* x, const void* w, int64_t m, int64_t n, int64_t k, void* out, int out_dtype,
                    int64_t ldo) {
  return lp_pairs_matmul_ahead(x, w, m, n, k, out, out_dtype, ldo, nullptr, nullptr, 0);
}

int lp_bf16_dot() { return lp::has_bf16_dot() ? 1 : 0; }

}  // extern "C"
