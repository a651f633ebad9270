// loraplex native kernels: the batched LoRA math of one (layer, site) in one call (service/adapters/lora/batch.py
// uses it on the CPU when the library is loaded).
//
//   lp_lora_delta  rows grouped by adapter (SGMV-style): per group g, h = x[rows] A_g^T (all the site's modules
//                  side by side along the rank), then per module m out[rows, cols_m] op= h[:, seg_m] Bt_m,g
//                  (+ bias), where op is += or, with a DoRA scale, out = scale * (out + delta)
//
// The tables are the batch's, read where they lie: A [G, R, in] (the shared and the per-slot layouts; any strides,
// rows of A widened into scratch only where they are not contiguous); per module Bt [G, r_m, out_m] (the scaled B^T),
// an optional bias [G, out_m] in the tables' dtype and an optional float32 scale [G, out_m]. Each group's weights are
// read once per call however many rows it has; x and out rows are read and written in place, rows of group -1 are not
// touched.
//
// Isolation: a row's input meets only its own group's weights, so a NaN in one adapter stays in its own rows.
// Batch invariance: each row's sums run in a fixed order (its dot products in lanes of 16 then pairwise, the expand
// over the rank in order) whichever rows share its group, its call or its thread, and whichever table holds A.
// Numerics: the values as stored (bf16 widened by a shift). The shrink keeps h within a few float32 roundings of the
// exact dot product (see dot_pass: float32 FMAs over short blocks summed in double on avx2 / avx512, products in
// double on generic) and rounds it once to float32; bf16 x on bf16 tables sums in pairs instead (pair_rows: exact
// products, float32 sums, as torch's bf16 GEMM accumulates; vdpbf16ps where the CPU has it, the same bits elsewhere).
// The expand sums float32 over the rank in order (no fused multiply-add: -ffp-contract=off, so every instruction set
// gets the same delta from the same h); the delta is added in float32 and rounded once to the output dtype (bf16: to
// nearest even), as torch's `out += delta` does.
// Threads: OpenMP (torch's runtime) over work items, the shrink's (group, 4 rows of A) then the expand's (group,
// module, 256 columns), each prefetching the next item's weights; scratch stays allocated per thread between calls.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dtypes.h"
#include "shares.h"

namespace {

using lp::bf16;
using lp::V16;
using lp::load16;
using lp::store;
using lp::widen;

constexpr int kLanes = 16;
constexpr int64_t kCols = 256;    // output columns of one expand work item
constexpr int64_t kSub = 64;      // of which one pass over the rank accumulates
constexpr int64_t kParallelMacs = 1 << 16;  // below this many multiply-adds one thread does the call


// dot(x[t], a[q]) over n for kRows rows a[q] (float32 or bf16, read in place) and NT tokens x[t] at once (each load
// of a row feeds every token), in 16 lanes: lane l takes k = l, l + 16, ... in turn; the lanes pairwise, then the
// tail; h rounded once to float32. Where there is an FMA (the avx2 and avx512 variants), a lane sums kBlock / 16
// products in float32 by fused multiply-adds (each product exact inside its FMA), then adds that partial sum to its
// double accumulator: h stays within a few float32 roundings of the exact dot product, as near to it as torch's own
// float32 GEMM (a row summed in float32 with products rounded apart measured 3x further from peft's; the table
// streams through at half the instructions of a double product). Without an FMA (generic), each product in double,
// exact there. Either way a token's sum is the same whatever rows and tokens it is computed with; avx2 and avx512
// give the same h (the same lanes and operations), generic rounds elsewhere.
constexpr int kRows = 4;
constexpr int64_t kBlock = 128;

// Lanes in the widest vectors the variant has: kW float32 (kDW double) lanes a vector; kFV (kDV) vectors for 16.
#if defined(__AVX512F__)
constexpr int kW = 16;
constexpr int kPassRows = 4, kPassTokens = 2;  // sums held in registers: 24 of the 32 vector registers
#else
constexpr int kW = 8;
constexpr int kPassRows = 2, kPassTokens = 1;  // 12 of the 16 (generic: what SSE2 can)
#endif
constexpr int kDW = kW / 2, kFV = kLanes / kW, kDV = kLanes / kDW;
using FV = lp::Lanes<kW>::F;
using FH = lp::Lanes<kW / 2>::F;  // half a vector, widened to one of doubles
using DV = double __attribute__((vector_size(4 * kW)));

template <typename W>
inline FV load_f(const W* p) {
  return lp::load_lanes<kW>(p);
}
template <typename W>
inline void store_f(W* p, FV v) {
  lp::store_lanes<kW>(p, v);
}
inline DV widen_d(FH v) {  // exact
#if defined(__AVX512F__)
  return (DV)_mm512_cvtps_pd((__m256)v);  // one instruction (GCC's convertvector takes several)
#elif defined(__AVX2__)
  return (DV)_mm256_cvtps_pd((__m128)v);
#else
  return __builtin_convertvector(v, DV);
#endif
}
#if defined(__AVX512F__)
inline FH low_half(FV v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
inline FH high_half(FV v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
#else
inline FH low_half(FV v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3); }
inline FH high_half(FV v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7); }
#endif

#if defined(__FMA__)
inline FV fma_f(FV x, FV y, FV acc) {
#if defined(__AVX512F__)
  return (FV)_mm512_fmadd_ps((__m512)x, (__m512)y, (__m512)acc);
#else
  return (FV)_mm256_fmadd_ps((__m256)x, (__m256)y, (__m256)acc);
#endif
}
#endif

// Rows a[q0 .. q0 + R) against tokens x[0 .. NT): out[t][q0 + q].
template <int NT, int R, typename W>
inline void dot_pass(const float* const* x, const W* const* a, int64_t n, float (*out)[kRows], int q0) {
  DV acc[NT][R][kDV] = {};
  const int64_t whole = n - n % kLanes;
#if defined(__FMA__)
  for (int64_t i0 = 0; i0 < whole; i0 += kBlock) {  // float32 FMAs over a block, then into double
    const int64_t i1 = std::min(i0 + kBlock, whole);
    FV part[NT][R][kFV] = {};
    for (int64_t i = i0; i < i1; i += kLanes)
      for (int v = 0; v < kFV; ++v) {
        FV xv[NT];
        for (int t = 0; t < NT; ++t) xv[t] = load_f(x[t] + i + v * kW);
        for (int q = 0; q < R; ++q) {
          const FV av = load_f(a[q0 + q] + i + v * kW);
          for (int t = 0; t < NT; ++t) part[t][q][v] = fma_f(xv[t], av, part[t][q][v]);
        }
      }
    for (int t = 0; t < NT; ++t)
      for (int q = 0; q < R; ++q)
        for (int v = 0; v < kFV; ++v) {
          acc[t][q][2 * v] += widen_d(low_half(part[t][q][v]));
          acc[t][q][2 * v + 1] += widen_d(high_half(part[t][q][v]));
        }
  }
#else
  for (int64_t i = 0; i < whole; i += kLanes)  // each product in double (exact), one rounding for its sum
    for (int v = 0; v < kDV; ++v) {
      DV xv[NT];
      for (int t = 0; t < NT; ++t) {
        FH xh;
        std::memcpy(&xh, x[t] + i + v * kDW, sizeof xh);
        xv[t] = widen_d(xh);
      }
      for (int q = 0; q < R; ++q) {
        FH av;
        for (int l = 0; l < kDW; ++l) av[l] = widen(a[q0 + q][i + v * kDW + l]);
        const DV ad = widen_d(av);
        for (int t = 0; t < NT; ++t) acc[t][q][v] += xv[t] * ad;
      }
    }
#endif
  for (int t = 0; t < NT; ++t)
    for (int q = 0; q < R; ++q) {
      double tail = 0.0;
      for (int64_t k = whole; k < n; ++k) tail += (double)x[t][k] * (double)widen(a[q0 + q][k]);
      double lanes[kLanes];
      std::memcpy(lanes, acc[t][q], sizeof lanes);
      for (int w = kLanes / 2; w > 0; w /= 2)  // pairwise
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      out[t][q0 + q] = (float)(lanes[0] + tail);
    }
}

template <int NT, typename W>
inline void dot_rows(const float* const* x, const W* const* a, int64_t n, float (*out)[kRows]) {
  constexpr int kT = NT < kPassTokens ? NT : kPassTokens;
  for (int t0 = 0; t0 < NT; t0 += kT)
    for (int q0 = 0; q0 < kRows; q0 += kPassRows) dot_pass<kT, kPassRows>(x + t0, a, n, out + t0, q0);
}

// bf16 x and bf16 tables: h in pairs, pairs.cpp's order (vdpbf16ps's): lane l of each chunk of 32 inputs adds the
// product of input 2 l + 1, then of 2 l (the last chunk padded with zeros), each product exact in float32, each sum
// rounded; the lanes pairwise (lp::lane_sum). On AVX-512 BF16 one instruction a chunk, a row of A and a token; the
// same arithmetic in lanes elsewhere, so every variant gives the same h (subnormals aside: the instruction flushes
// them). Rows a[q0 .. q0 + R) against tokens x[0 .. NT).
constexpr int64_t kChunk = 32;

template <int NT, int R>
inline void pair_pass_lanes(const bf16* const* x, const bf16* const* a, int64_t n, float (*out)[kRows], int q0) {
  FV acc[NT][R][kFV] = {};  // lanes 16 at a time, kW a vector
  for (int64_t c = 0; c < n; c += kChunk) {
    bf16 pad[NT + R][kChunk] = {};  // the last chunk's inputs, zeros past n
    const bf16* rows[NT + R];  // the chunk of each token, then of each row of A
    for (int i = 0; i < NT + R; ++i) {
      rows[i] = (i < NT ? x[i] : a[q0 + i - NT]) + c;
      if (c + kChunk > n) rows[i] = static_cast<const bf16*>(std::memcpy(pad[i], rows[i], sizeof(bf16) * (n - c)));
    }
    for (int v = 0; v < kFV; ++v) {
      FV xe[NT], xo[NT];
      for (int t = 0; t < NT; ++t) lp::halves_lanes<kW>(rows[t] + 2 * kW * v, xe[t], xo[t]);
      for (int q = 0; q < R; ++q) {
        FV ae, ao;
        lp::halves_lanes<kW>(rows[NT + q] + 2 * kW * v, ae, ao);
        for (int t = 0; t < NT; ++t) {
          lp::pair_madd(acc[t][q][v], xe[t], xo[t], ae, ao);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int q = 0; q < R; ++q) {
      V16 lanes;
      std::memcpy(&lanes, acc[t][q], sizeof lanes);
      out[t][q0 + q] = lp::lane_sum(lanes);
    }
}

#if defined(__AVX512F__)
template <int NT>
LP_BF16_DOT void pair_rows_dot(
    const bf16* const* x, const bf16* const* a, int64_t n, float (*out)[kRows]) {
  __m512 acc[NT][kRows];
  for (int t = 0; t < NT; ++t)
    for (int q = 0; q < kRows; ++q) acc[t][q] = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += kChunk) {
    const __mmask32 keep = c + kChunk <= n ? ~__mmask32{0} : (__mmask32)((1u << (n - c)) - 1);
    __m512bh xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(keep, x[t] + c);
    for (int q = 0; q < kRows; ++q) {
      const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(keep, a[q] + c);
      for (int t = 0; t < NT; ++t) acc[t][q] = _mm512_dpbf16_ps(acc[t][q], xv[t], av);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int q = 0; q < kRows; ++q) {
      V16 lanes;
      std::memcpy(&lanes, &acc[t][q], sizeof lanes);
      out[t][q] = lp::lane_sum(lanes);
    }
}
#endif

template <int NT>
inline void pair_rows(bool dot, const bf16* const* x, const bf16* const* a, int64_t n, float (*out)[kRows]) {
#if defined(__AVX512F__)
  if (dot) return pair_rows_dot<NT>(x, a, n, out);
#endif
  (void)dot;
  constexpr int kT = NT < kPassTokens ? NT : kPassTokens;
  for (int t0 = 0; t0 < NT; t0 += kT)
    for (int q0 = 0; q0 < kRows; q0 += kPassRows) pair_pass_lanes<kT, kPassRows>(x + t0, a, n, out + t0, q0);
}

// Per token t < NT, acc[t] [v0, v0 + NV) = h[t] [rank] @ w [rank, NV kW], w's rows ``ws`` elements apart (float32
// or bf16, read in place): per column the sum over the rank in order, each row of w loaded once for the NT tokens.
// In the variant's own vectors (kW lanes): a column's arithmetic does not depend on them.
constexpr int64_t kColVecs = kCols / kW;

template <int NT, int NV, typename W>
inline void expand_vecs(const float* const* h, const W* w, int64_t ws, int64_t rank, FV (*acc)[kColVecs], int64_t v0) {
  FV part[NT][NV] = {};
  for (int64_t q = 0; q < rank; ++q) {
    FV wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load_f(w + q * ws + v * kW);
    for (int t = 0; t < NT; ++t) {
      const FV hv = FV{} + h[t][q];
      for (int v = 0; v < NV; ++v) part[t][v] += hv * wv[v];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v0 + v] = part[t][v];
}

// expand_vecs over ``nvec`` vectors of columns, kSub at a time.
template <int NT, typename W>
inline void expand_block(const float* const* h, const W* w, int64_t ws, int64_t rank, int64_t nvec,
                         FV (*acc)[kColVecs]) {
  constexpr int kVecs = kSub / kW;
  int64_t v0 = 0;
  for (; v0 + kVecs <= nvec; v0 += kVecs) expand_vecs<NT, kVecs>(h, w + v0 * kW, ws, rank, acc, v0);
  for (; v0 < nvec; ++v0) expand_vecs<NT, 1>(h, w + v0 * kW, ws, rank, acc, v0);
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
  // bf16 x against bf16 tables: h in pairs (pair_rows), x read in place; otherwise float32 lanes (dot_rows), bf16 x
  // widened first.
  constexpr bool kInPairs = std::is_same<X, bf16>::value && std::is_same<W, bf16>::value;
  const bool widen_x = !std::is_same<X, float>::value && !kInPairs, dot = kInPairs && lp::has_bf16_dot();
  const Scratch order_(0, (size_t)active * sizeof(int64_t)), spans_(1, (size_t)active * sizeof(Span));
  const Scratch h_(2, (size_t)tokens * width * sizeof(float));
  const Scratch xf_(3, widen_x ? (size_t)tokens * in * sizeof(float) : 1);
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
  int failed = 0;
  const int64_t quads = (width + kRows - 1) / kRows;  // shrink items per group
  lp::Shares shrink(nspans * quads), expand(nspans * blocks);

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
    shrink.run([&](int64_t item) {
      if (buf == nullptr) return;
      const Span& s = spans[item / quads];
      const int64_t r0 = (item % quads) * kRows, nr = std::min<int64_t>(kRows, width - r0);
      if (a_sk == 1 && item + 1 < nspans * quads) {  // the next item's rows (next in this thread's share)
        const int64_t next_r0 = ((item + 1) % quads) * kRows, rows = std::min<int64_t>(kRows, width - next_r0);
        prefetch(a + spans[(item + 1) / quads].group * a_sg + next_r0 * a_sr, rows * a_sr * (int64_t)sizeof(W));
      }
      const int64_t j1 = (s.first + s.count) * t;
      if constexpr (kInPairs) {
        const bf16* rows[kRows];  // A's rows in place (contiguous), or gathered into buf (strided)
        for (int q = 0; q < kRows; ++q) {  // a short last quad repeats its last row
          rows[q] = a + s.group * a_sg + (r0 + std::min<int64_t>(q, nr - 1)) * a_sr;
          if (a_sk != 1) {
            bf16* row = reinterpret_cast<bf16*>(buf) + q * in;
            for (int64_t k = 0; k < in; ++k) row[k] = rows[q][k * a_sk];
            rows[q] = row;
          }
        }
        for (int64_t j = s.first * t; j < j1; j += 2) {  // tokens in pairs
          const bf16* xs[2] = {x + at(j) * in, j + 1 < j1 ? x + at(j + 1) * in : nullptr};
          float hq[2][kRows];
          j + 1 < j1 ? pair_rows<2>(dot, xs, rows, in, hq) : pair_rows<1>(dot, xs, rows, in, hq);
          for (int64_t u = 0; u < 2 && j + u < j1; ++u)
            for (int64_t q = 0; q < nr; ++q) h[(j + u) * width + r0 + q] = hq[u][q];
        }
        return;
      }
      const W* direct[kRows];  // A's rows in place (contiguous), or widened into buf (strided)
      const float* wide[kRows];
      for (int q = 0; q < kRows; ++q) {  // a short last quad repeats its last row
        const W* src = a + s.group * a_sg + (r0 + std::min<int64_t>(q, nr - 1)) * a_sr;
        direct[q] = src;
        if (a_sk != 1) {
          for (int64_t k = 0; k < in; ++k) buf[q * in + k] = widen(src[k * a_sk]);
          wide[q] = buf + q * in;
        }
      }
      for (int64_t j = s.first * t; j < j1; j += 2) {  // tokens in pairs
        const float* xs[2] = {x_row(j), j + 1 < j1 ? x_row(j + 1) : nullptr};
        float hq[2][kRows];
        if (j + 1 < j1) {
          a_sk == 1 ? dot_rows<2>(xs, direct, in, hq) : dot_rows<2>(xs, wide, in, hq);
        } else {
          a_sk == 1 ? dot_rows<1>(xs, direct, in, hq) : dot_rows<1>(xs, wide, in, hq);
        }
        for (int64_t u = 0; u < 2 && j + u < j1; ++u)
          for (int64_t q = 0; q < nr; ++q) h[(j + u) * width + r0 + q] = hq[u][q];
      }
    });
#pragma omp barrier
    // Expand: one work item per (group, module, block of kCols columns): that block of Bt once for all tokens.
    expand.run([&](int64_t item) {
      if (buf == nullptr) return;
      const Span& s = spans[item / blocks];
      int64_t m = 0, blk = item % blocks;
      while (blk >= (seg[4 * m + 3] + kCols - 1) / kCols) blk -= (seg[4 * m + 3] + kCols - 1) / kCols, ++m;
      const int64_t start = seg[4 * m], rank = seg[4 * m + 1], col = seg[4 * m + 2], n = seg[4 * m + 3];
      const int64_t c0 = blk * kCols, nc = std::min(kCols, n - c0);
      const W* bt = (const W*)bt_[m] + s.group * rank * n + c0;  // Bt[g, j, c0 + c] at bt[j * n + c]
      // Whole vectors of columns are read in place; the last columns (nc % kW) widened into buf [rank][kW], zeros
      // past the last column.
      const int64_t nvec = nc / kW, rest = nc % kW;
      for (int64_t j = 0; j < rank && rest; ++j) {
        const W* tail = bt + j * n + nvec * kW;
        for (int64_t c = 0; c < kW; ++c) buf[j * kW + c] = c < rest ? widen(tail[c]) : 0.0f;
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
      const int64_t j1 = (s.first + s.count) * t;
      for (int64_t j = s.first * t; j < j1; j += 2) {  // tokens in pairs: each vector of Bt loaded once for both
        const int nt = j + 1 < j1 ? 2 : 1;
        const float* hs[2] = {h + j * width + start, h + (j + nt - 1) * width + start};
        FV acc[2][kColVecs];
        if (nt == 2) {
          expand_block<2>(hs, bt, n, rank, nvec, acc);
          if (rest) expand_vecs<2, 1>(hs, (const float*)buf, kW, rank, acc, nvec);
        } else {
          expand_block<1>(hs, bt, n, rank, nvec, acc);
          if (rest) expand_vecs<1, 1>(hs, (const float*)buf, kW, rank, acc, nvec);
        }
        for (int u = 0; u < nt; ++u) {  // the delta (+ bias) added in float32, rounded once to X (or scaled first)
          X* o = out + at(j + u) * out_cols + col + c0;
          for (int64_t v = 0; v < nvec; ++v) {
            const int64_t c = v * kW;
            const FV d = bias == nullptr ? acc[u][v] : acc[u][v] + load_f(bias + c);
            store_f(o + c, sc == nullptr ? load_f(o + c) + d : (load_f(o + c) + d) * load_f(sc + c));
          }
          for (int64_t l = 0; l < rest; ++l) {
            const int64_t c = nvec * kW + l;
            const float d = bias == nullptr ? acc[u][nvec][l] : acc[u][nvec][l] + widen(bias[c]);
            store(o, c, sc == nullptr ? widen(o[c]) + d : (widen(o[c]) + d) * sc[c]);
          }
        }
      }
    });
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
