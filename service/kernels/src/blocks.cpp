// loraplex native kernels: matrix products over GGUF-style weight blocks, for the few rows of a decode step.
//
// One source, compiled once per instruction set (service/kernels/native.py picks the flags; never -march=native):
//   LP_ISA "avx512"  -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c
//   LP_ISA "avx2"    -mavx2 -mfma -mf16c
//   LP_ISA "generic" no flags (x86-64 baseline, aarch64, ...): plain C++ the compiler may vectorize
// The wrapper (service/kernels/native.py) loads the variant matching torch's CPU capability, so forcing
// ATEN_CPU_CAPABILITY=default / avx2 runs the generic / avx2 code too.
//
// Numerics: every product is float32 with float32 accumulation over exact inputs (fp16 scales converted exactly,
// bf16 / fp16 activations widened exactly); only the output is rounded, once, to the output dtype (round to nearest
// even). The weights are never requantized and the products never use quantized activations: the greedy argmax's
// int8 screen (lp_q8_top, at the end) only rules logits out, with a rigorous bound, and computes the rest exactly.
//
// Threads: OpenMP over output rows, sharing torch's runtime (libgomp.so.1 is loaded once per process), so
// torch.set_num_threads governs these kernels too.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ahead.h"
#include "dtypes.h"
#include "shares.h"

#ifndef LP_ISA
#define LP_ISA "generic"
#endif

extern "C" {

// Bumped whenever a signature or a layout below changes; the wrapper refuses a library with another version.
int lp_abi_version() { return 13; }
const char* lp_isa() { return LP_ISA; }

}  // extern "C"

namespace {

using lp::F32;
using lp::Stream;
using lp::BF16;
using lp::F16;

constexpr int kGroup = 32;

inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint16_t f32_to_f16(float f) {  // round to nearest even (F. Giesen's float_to_half_fast3_rtne)
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  const uint32_t f32_inf = 255u << 23, f16_max = (127u + 16u) << 23, denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint16_t o;
  if (x >= f16_max) {
    o = x > f32_inf ? 0x7e00 : 0x7c00;  // nan, or overflow to inf
  } else if (x < (113u << 23)) {  // subnormal or zero: let the float adder round
    float fx, magic;
    std::memcpy(&fx, &x, 4);
    std::memcpy(&magic, &denorm_magic, 4);
    fx += magic;
    uint32_t bits;
    std::memcpy(&bits, &fx, 4);
    o = (uint16_t)(bits - denorm_magic);
  } else {
    const uint32_t odd = (x >> 13) & 1;
    x += ((15u - 127u) << 23) + 0xfffu + odd;
    o = (uint16_t)(x >> 13);
  }
  return o | (uint16_t)(sign >> 16);
#endif
}

inline float load_scalar(const void* p, int64_t i, int dtype) {
  switch (dtype) {
    case BF16: return lp::widen(static_cast<const lp::bf16*>(p)[i]);
    case F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

inline void store_scalar(void* p, int64_t i, float v, int dtype) {
  switch (dtype) {
    case BF16: static_cast<lp::bf16*>(p)[i] = lp::to_bf16(v); break;
    case F16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

// x [M, K] in ``dtype`` -> float32 xf [M, K] (unless x is float32: read in place) and per-group sums [M, K / 32].
void widen(const void* x, int dtype, int64_t m, int64_t k, float* xf, float* xsum) {
  if (dtype != F32)
    for (int64_t i = 0; i < m * k; ++i) xf[i] = load_scalar(x, i, dtype);
  const float* xs = dtype == F32 ? static_cast<const float*>(x) : xf;
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* p = xs + r * k + g * kGroup;
      float s = 0.f;
      for (int j = 0; j < kGroup; ++j) s += p[j];
      xsum[r * groups + g] = s;
    }
  }
}

// x [M, K] in ``dtype`` as float32 (``xf``: x itself when float32, else a widened copy) and its per-group sums
// (``widen``), freed on every return (no C++ runtime: built -fno-exceptions, so ``ok()`` says whether the memory was
// there).
struct Widened {
  float* copy;
  float* xsum;
  const float* xf;
  Widened(const void* x, int dtype, int64_t m, int64_t k)
      : copy(dtype == F32 ? nullptr : static_cast<float*>(std::malloc(sizeof(float) * (m * k + 1)))),
        xsum(static_cast<float*>(std::malloc(sizeof(float) * (m * (k / kGroup) + 1)))),
        xf(dtype == F32 ? static_cast<const float*>(x) : copy) {
    if (ok()) widen(x, dtype, m, k, copy, xsum);
  }
  ~Widened() {
    std::free(copy);
    std::free(xsum);
  }
  bool ok() const { return xf != nullptr && xsum != nullptr; }
};

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
struct Group {  // the 32 values of a group: elements 0..15, 16..31
  Vec v[2];
};
inline Group q8_group(const int8_t* q) {
  return {{_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))),
           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))))}};
}
#elif defined(__AVX2__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
struct Group {  // elements 0..7, 8..15, 16..23, 24..31
  Vec v[4];
};
inline Vec widen8s(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }
inline Vec widen8s_at(const int8_t* q) { return widen8s(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))); }
inline Group q8_group(const int8_t* q) {  // vpmovsxbd from memory: no shuffle to reach the upper bytes
  return {{widen8s_at(q), widen8s_at(q + 8), widen8s_at(q + 16), widen8s_at(q + 24)}};
}
#else
// Plain C++ in 16-byte vectors (SSE2 / NEON registers), four lanes as the other variants use eight or sixteen.
using F4 = lp::Lanes<4>::F;
using I4 = int32_t __attribute__((vector_size(16)));
using S8 = int16_t __attribute__((vector_size(16)));
using B16 = int8_t __attribute__((vector_size(16)));
using Vec = F4;
constexpr int kLanes = 4;
inline Vec vzero() { return Vec{}; }
inline Vec vload(const float* p) { return lp::load_lanes<4>(p); }
inline Vec vset(float x) { return Vec{} + x; }
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline Vec vfma(Vec a, Vec b, Vec c) { return c + a * b; }  // a product, then a sum (no FMA in baseline x86-64)
inline float hsum(Vec v) { return (v[0] + v[2]) + (v[1] + v[3]); }  // pairwise, as the vector variants
struct Group {
  Vec v[8];
};
// Four int16 lanes sign-extended to int32, as floats: each interleaved with itself, then shifted down (SSE2's
// punpcklwd / psrad; NEON's zip).
inline F4 widen4(S8 w, bool upper) {
  const S8 twice = upper ? __builtin_shufflevector(w, w, 4, 4, 5, 5, 6, 6, 7, 7)
                         : __builtin_shufflevector(w, w, 0, 0, 1, 1, 2, 2, 3, 3);
  return __builtin_convertvector((I4)twice >> 16, F4);
}
inline Group q8_group(const int8_t* q) {  // 32 int8 values as floats, in order
  Group g;
  for (int h = 0; h < 2; ++h) {
    B16 b;
    std::memcpy(&b, q + 16 * h, sizeof b);
    const S8 lo = (S8)__builtin_shufflevector(b, b, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7) >> 8;
    const S8 hi = (S8)__builtin_shufflevector(b, b, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15) >> 8;
    g.v[4 * h] = widen4(lo, false);
    g.v[4 * h + 1] = widen4(lo, true);
    g.v[4 * h + 2] = widen4(hi, false);
    g.v[4 * h + 3] = widen4(hi, true);
  }
  return g;
}
#endif

constexpr int kParts = kGroup / kLanes;  // vectors per group

// q . x over one group, as a vector (its lanes summed later).
inline Vec group_dot(const Group& q, const float* x) {
  Vec dot = vmul(q.v[0], vload(x));
  for (int p = 1; p < kParts; ++p) dot = vfma(q.v[p], vload(x + p * kLanes), dot);
  return dot;
}

// --- 16 weight rows side by side: one lane per row ------------------------------------------------------------
//
// The 4-bit kernel keeps 16 weight rows ("a tile") in the lanes of its accumulators and walks the inputs in order,
// each input broadcast against the 16 rows' values: one multiply-add per input and row, no horizontal sum, and a
// tile's dequantized values serve every row of x held in registers. A lane computes its row's product alone, in the
// same order whatever the number of x rows, the ISA or the lanes beside it, so results are batch-invariant and
// equal across the vector variants (the generic one rounds a product and a sum apart: no FMA in baseline x86-64).

constexpr int kTile = 16;

#if defined(__AVX512F__)
struct Lanes {
  __m512 v;
};
inline Lanes lzero() { return {_mm512_setzero_ps()}; }
inline Lanes lload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void lstore(float* p, Lanes a) { _mm512_storeu_ps(p, a.v); }
inline Lanes lfma(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Lanes lfma_x(Lanes a, const float* x, Lanes c) { return {_mm512_fmadd_ps(a.v, _mm512_set1_ps(*x), c.v)}; }
// 16 bytes, byte i holding row i's values at inputs 2p (low nibble) and 2p + 1 (high) -> the two as floats.
inline void q4_pair(const uint8_t* b, Lanes& even, Lanes& odd) {
  const __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  even.v = _mm512_cvtepi32_ps(_mm512_and_si512(i, _mm512_set1_epi32(0x0f)));
  odd.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(i, 4));
}
#elif defined(__AVX2__)
struct Lanes {  // rows 0..7, 8..15
  __m256 lo, hi;
};
inline Lanes lzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes lload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void lstore(float* p, Lanes a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Lanes lfma(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Lanes lfma_x(Lanes a, const float* x, Lanes c) {
  const __m256 b = _mm256_broadcast_ss(x);
  return {_mm256_fmadd_ps(a.lo, b, c.lo), _mm256_fmadd_ps(a.hi, b, c.hi)};
}
inline void q4_pair(const uint8_t* b, Lanes& even, Lanes& odd) {  // each byte zero-extended from memory
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8)));
  const __m256i low = _mm256_set1_epi32(0x0f);
  even = {_mm256_cvtepi32_ps(_mm256_and_si256(lo, low)), _mm256_cvtepi32_ps(_mm256_and_si256(hi, low))};
  odd = {_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4))};
}
#else
constexpr int kQuads = kTile / 4;  // F4s (the generic Vec above: a register of SSE2 / NEON) a tile's lanes take
// Quad j holds rows j, j + 4, j + 8, j + 12: byte j of each 32-bit word of a tile's 16 bytes, so the nibbles come out
// with lane-wise shifts and masks (no byte shuffles, which baseline x86-64 lacks). Loads and stores transpose the
// rows in and out of that order; each lane's arithmetic is its row's, as in the other variants.
struct Lanes {
  F4 v[kQuads];
};
inline Lanes transpose(F4 a0, F4 a1, F4 a2, F4 a3) {  // 4 x 4; its own inverse
  const F4 t0 = __builtin_shufflevector(a0, a1, 0, 4, 1, 5), t1 = __builtin_shufflevector(a2, a3, 0, 4, 1, 5);
  const F4 t2 = __builtin_shufflevector(a0, a1, 2, 6, 3, 7), t3 = __builtin_shufflevector(a2, a3, 2, 6, 3, 7);
  return {{__builtin_shufflevector(t0, t1, 0, 1, 4, 5), __builtin_shufflevector(t0, t1, 2, 3, 6, 7),
           __builtin_shufflevector(t2, t3, 0, 1, 4, 5), __builtin_shufflevector(t2, t3, 2, 3, 6, 7)}};
}
inline Lanes lzero() { return Lanes{}; }
inline Lanes lload(const float* p) { return transpose(vload(p), vload(p + 4), vload(p + 8), vload(p + 12)); }
inline void lstore(float* p, Lanes a) {
  const Lanes rows = transpose(a.v[0], a.v[1], a.v[2], a.v[3]);
  for (int j = 0; j < kQuads; ++j) std::memcpy(p + 4 * j, &rows.v[j], sizeof rows.v[j]);
}
inline Lanes lfma(Lanes a, Lanes b, Lanes c) {  // a product, then a sum (no FMA in baseline x86-64)
  for (int j = 0; j < kQuads; ++j) c.v[j] += a.v[j] * b.v[j];
  return c;
}
inline Lanes lfma_x(Lanes a, const float* x, Lanes c) {
  const F4 b = F4{} + *x;
  for (int j = 0; j < kQuads; ++j) c.v[j] += a.v[j] * b;
  return c;
}
inline void q4_pair(const uint8_t* b, Lanes& even, Lanes& odd) {
  I4 w;
  std::memcpy(&w, b, sizeof w);
  for (int j = 0; j < kQuads; ++j) {
    even.v[j] = __builtin_convertvector((w >> (8 * j)) & 0x0f, F4);
    odd.v[j] = __builtin_convertvector((w >> (8 * j + 4)) & 0x0f, F4);
  }
}
#endif

// Bytes of one (tile, group): 16 input pairs x 16 rows. Its scales d, m: 16 float32 each.
constexpr int64_t kTileGroupBytes = kGroup / 2 * kTile;
constexpr int64_t kAheadGroups = 4;  // how far ahead of the group being read its bytes are requested
constexpr int64_t kAheadBytes = kAheadGroups * kTileGroupBytes;

// One tile (16 weight rows) against R rows of x. Tile layout (see lp_q4_matmul): qs [G, 16, 16] bytes, d and m
// [G, 16]. Every lane: s = sum_j q_j x_j over a group in input order (from zero, one multiply-add each), then
// acc = d s + acc, acc = m xsum_g + acc; out [R][16]. (Two tiles at once at one row measured slower on an AVX2
// EPYC: more streams for the prefetchers, and the dependency chains were not the bound.)
template <int R>
inline void q4_tile(const uint8_t* qs, const float* d, const float* mn, int64_t groups, const float* xf,
                    const float* xsum, int64_t k, float* out, Stream* stream) {
  Lanes acc[R];
  for (int r = 0; r < R; ++r) acc[r] = lzero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* q = qs + g * kTileGroupBytes;
    for (int b = 0; b < kTileGroupBytes; b += 64) __builtin_prefetch(q + kAheadBytes + b);
    if (stream != nullptr) stream->next();
    __builtin_prefetch(d + (g + kAheadGroups) * kTile);
    __builtin_prefetch(mn + (g + kAheadGroups) * kTile);
    Lanes s[R];
    for (int r = 0; r < R; ++r) s[r] = lzero();
    const float* xg = xf + g * kGroup;
    for (int p = 0; p < kGroup / 2; ++p) {
      Lanes even, odd;
      q4_pair(q + p * kTile, even, odd);
      for (int r = 0; r < R; ++r) {
        s[r] = lfma_x(even, xg + r * k + 2 * p, s[r]);
        s[r] = lfma_x(odd, xg + r * k + 2 * p + 1, s[r]);
      }
    }
    const Lanes dv = lload(d + g * kTile), mv = lload(mn + g * kTile);
    for (int r = 0; r < R; ++r) {
      acc[r] = lfma(dv, s[r], acc[r]);
      acc[r] = lfma_x(mv, xsum + r * groups + g, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) lstore(out + r * kTile, acc[r]);
}
#if defined(__AVX512F__)
constexpr int kPassRows = 8;  // rows of x per pass over a tile (their sums held in registers)
#else
constexpr int kPassRows = 4;
#endif
constexpr int64_t kTilesPerTask = 2;  // tiles per OpenMP work item
constexpr int64_t kGrainTiles = 16;   // tiles a thread takes at once at one pass (lp::Shares' grain)

// ``rows`` (1..kPassRows) rows of x against one tile: q4_tile with the count fixed.
inline void q4_pass(int rows, const uint8_t* qs, const float* d, const float* mn, int64_t groups, const float* xf,
                    const float* xsum, int64_t k, float* out, Stream* stream) {
  switch (rows) {
    case 1: q4_tile<1>(qs, d, mn, groups, xf, xsum, k, out, stream); break;
    case 2: q4_tile<2>(qs, d, mn, groups, xf, xsum, k, out, stream); break;
    case 3: q4_tile<3>(qs, d, mn, groups, xf, xsum, k, out, stream); break;
#if defined(__AVX512F__)
    case 4: q4_tile<4>(qs, d, mn, groups, xf, xsum, k, out, stream); break;
    case 5: q4_tile<5>(qs, d, mn, groups, xf, xsum, k, out, stream); break;
    case 6: q4_tile<6>(qs, d, mn, groups, xf, xsum, k, out, stream); break;
    case 7: q4_tile<7>(qs, d, mn, groups, xf, xsum, k, out, stream); break;
#endif
    default: q4_tile<kPassRows>(qs, d, mn, groups, xf, xsum, k, out, stream);
  }
}

constexpr int kVocabAhead = 16;  // vocabulary rows ahead whose bytes are requested: each group is its own stream

// Vocabulary rows [v0, v0 + N) of a group-major Q8_0 table (q [G, V, 32] int8, d [G, V] of D) against R rows of x
// (row stride k): acc[r][v] = sum_g d[g, v] (q[g, v] . x_rg). A pair's operations are the same whatever N and R (a
// group's dot product in lanes, scaled into its accumulator, the lanes summed at the end), so the logits do not
// depend on the batch. N, R and the scales' dtype DT fixed at compile time: the accumulators stay in registers and
// a group's values, converted once, serve the R rows.
template <int N, int R, int DT>
inline void q8_block(const int8_t* q, const void* d, int64_t groups, int64_t vocab, int64_t v0, const float* x,
                     int64_t k, float* acc) {
  Vec vacc[N][R];
  for (int v = 0; v < N; ++v)
    for (int r = 0; r < R; ++r) vacc[v][r] = vzero();
  const bool ahead = v0 + kVocabAhead + N <= vocab;
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* qg = q + (g * vocab + v0) * kGroup;
    const int64_t dg = g * vocab + v0;
    const float* xg = x + g * kGroup;
    if (ahead) {
      for (int b = 0; b < N * kGroup; b += 64) __builtin_prefetch(qg + kVocabAhead * kGroup + b);
      __builtin_prefetch(static_cast<const char*>(d) + (dg + kVocabAhead) * (DT == F32 ? 4 : 2));
    }
    for (int v = 0; v < N; ++v) {
      const Group grp = q8_group(qg + v * kGroup);
      const Vec dv = vset(load_scalar(d, dg + v, DT));
      for (int r = 0; r < R; ++r) vacc[v][r] = vfma(group_dot(grp, xg + r * k), dv, vacc[v][r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < N; ++v) acc[r * N + v] = hsum(vacc[v][r]);
}

constexpr int kVocabBlock = 4;  // vocabulary rows a block against one row of x
#if defined(__AVX512F__)
constexpr int kHeadRows = 8;  // rows of x a pass against a block of kHeadBlock vocabulary rows (their sums in
#else                         // registers: 32 vector registers on AVX-512, 16 on AVX2); fewer rows take
constexpr int kHeadRows = 4;  // kVocabBlock-row blocks one row at a time
#endif
constexpr int kHeadBlock = 2;

// Rows [v0, end) of the table against R rows of x (row stride k) in blocks of N (the last, partial block one
// vocabulary row at a time), stored into out from element out_at on (rows ldo apart).
template <int N, int R, int DT>
inline void q8_span(const int8_t* q, const void* d, int64_t groups, int64_t vocab, int64_t v0, int64_t end,
                    const float* x, int64_t k, void* out, int out_dtype, int64_t out_at, int64_t ldo) {
  float acc[N * R];
  for (int64_t v = v0; v < end; v += N) {
    const int n = end - v < N ? (int)(end - v) : N;
    if (n == N) {
      q8_block<N, R, DT>(q, d, groups, vocab, v, x, k, acc);
    } else {
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < n; ++i) q8_block<1, 1, DT>(q, d, groups, vocab, v + i, x + r * k, k, acc + r * N + i);
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < n; ++i) store_scalar(out, out_at + r * ldo + v + i, acc[r * N + i], out_dtype);
  }
}

// Rows [v0, end) of the table (scales of dtype DT) against ``rows`` rows of x, kHeadRows at a time, then 4, then
// one by one.
template <int DT>
inline void q8_rows(const int8_t* q, const void* d, int64_t groups, int64_t vocab, int64_t v0, int64_t end,
                    const float* x, int64_t k, int64_t rows, void* out, int out_dtype, int64_t ldo) {
  int64_t r = 0;
  for (; r + kHeadRows <= rows; r += kHeadRows)
    q8_span<kHeadBlock, kHeadRows, DT>(q, d, groups, vocab, v0, end, x + r * k, k, out, out_dtype, r * ldo, ldo);
  for (; kHeadRows > 4 && r + 4 <= rows; r += 4)
    q8_span<kHeadBlock, 4, DT>(q, d, groups, vocab, v0, end, x + r * k, k, out, out_dtype, r * ldo, ldo);
  for (; r < rows; ++r)
    q8_span<kVocabBlock, 1, DT>(q, d, groups, vocab, v0, end, x + r * k, k, out, out_dtype, r * ldo, ldo);
}

constexpr int64_t kVocabPerTask = 256;  // Q8_0 vocabulary rows per work item

}  // namespace

extern "C" {

int lp_q4_matmul_ahead(const void* x, int x_dtype, const uint8_t* qs, const float* d, const float* mn, int64_t m,
                       int64_t n, int64_t k, void* out, int out_dtype, int64_t ldo, const void* const* ahead,
                       const int64_t* ahead_bytes, int nahead);

// out [M, N] (out_dtype, row stride ldo) = x [M, K] (x_dtype, contiguous) @ W^T for N rows of K / 32 groups of
// 4-bit values, W[n, 32 g + j] = d[n, g] * q + m[n, g], stored in tiles of 16 rows (N rounded up; rows past N are
// zeros and not written): tile t's bytes qs[t] [G, 16, 16], byte (g, p, i) holding row 16 t + i's q at input 32 g +
// 2 p in its low nibble and at 32 g + 2 p + 1 in its high one; d[t], m[t] [G, 16] float32. Returns 0, -1 on a bad
// argument, -2 when out of memory.
int lp_q4_matmul(const void* x, int x_dtype, const uint8_t* qs, const float* d, const float* mn, int64_t m,
                 int64_t n, int64_t k, void* out, int out_dtype, int64_t ldo) {
  return lp_q4_matmul_ahead(x, x_dtype, qs, d, mn, m, n, k, out, out_dtype, ldo, nullptr, nullptr, 0);
}

// lp_q4_matmul, also requesting the cache lines of ``nahead`` byte ranges (ahead[i], ahead_bytes[i] long) into the
// caches as it goes, each work item its share, a few lines per group of a tile: the memory the next call will read
// (a decode step's LoRA tables, service/kernels/src/decode.cpp) streams in while this product computes, the cores
// busy multiplying and the memory idle.
int lp_q4_matmul_ahead(const void* x, int x_dtype, const uint8_t* qs, const float* d, const float* mn, int64_t m,
                       int64_t n, int64_t k, void* out, int out_dtype, int64_t ldo, const void* const* ahead,
                       const int64_t* ahead_bytes, int nahead) {
  if (m < 0 || n < 0 || k <= 0 || k % kGroup || ldo < n || nahead < 0) return -1;
  const int64_t groups = k / kGroup, tiles = (n + kTile - 1) / kTile;
  const Widened w(x, x_dtype, m, k);
  if (!w.ok()) return -2;
  const int64_t tasks = (tiles + kTilesPerTask - 1) / kTilesPerTask, passes = (m + kPassRows - 1) / kPassRows;
  const int64_t lines = lp::lines_of(ahead_bytes, nahead);  // cache lines to request, all ranges together
  const int64_t visits = (tiles * passes + tasks - 1) / tasks * groups;  // group visits of a work item, at most
  lp::Shares shares(tasks, kGrainTiles / kTilesPerTask / passes);  // a grain below 1 takes one task at a time
#pragma omp parallel
  shares.run([&](int64_t task) {
    float acc[kPassRows * kTile];
    const int64_t t1 = (task + 1) * kTilesPerTask < tiles ? (task + 1) * kTilesPerTask : tiles;
    Stream slice(ahead, ahead_bytes, nahead, lines, task, tasks, visits);
    Stream* stream = lines > 0 ? &slice : nullptr;
    for (int64_t r0 = 0; r0 < m; r0 += kPassRows) {
      const int rows = m - r0 < kPassRows ? (int)(m - r0) : kPassRows;
      for (int64_t t = task * kTilesPerTask; t < t1; ++t) {
        q4_pass(rows, qs + t * groups * kTileGroupBytes, d + t * groups * kTile, mn + t * groups * kTile, groups,
                w.xf + r0 * k, w.xsum + r0 * groups, k, acc, stream);
        const int64_t lanes = n - t * kTile < kTile ? n - t * kTile : kTile;
        for (int r = 0; r < rows; ++r)
          for (int64_t i = 0; i < lanes; ++i)
            store_scalar(out, (r0 + r) * ldo + t * kTile + i, acc[r * kTile + i], out_dtype);
      }
    }
  });
  return 0;
}

// out [M, V] (out_dtype, row stride ldo) = x [M, K] @ T^T for a group-major Q8_0 table: q [K / 32, V, 32] int8,
// d [K / 32, V] in d_dtype; T[v, 32 g + j] = d[g, v] * q[g, v, j]. Returns 0, -1 on a bad argument, -2 out of memory.
int lp_q8_matmul(const void* x, int x_dtype, const int8_t* q, const void* d, int d_dtype, int64_t m, int64_t vocab,
                 int64_t k, void* out, int out_dtype, int64_t ldo) {
  if (m < 0 || vocab < 0 || k <= 0 || k % kGroup || ldo < vocab) return -1;
  const int64_t groups = k / kGroup;
  const Widened w(x, x_dtype, m, k);
  if (!w.ok()) return -2;
  const int64_t tasks = (vocab + kVocabPerTask - 1) / kVocabPerTask;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t v0 = t * kVocabPerTask, end = (t + 1) * kVocabPerTask < vocab ? (t + 1) * kVocabPerTask : vocab;
    switch (d_dtype) {
      case BF16: q8_rows<BF16>(q, d, groups, vocab, v0, end, w.xf, k, m, out, out_dtype, ldo); break;
      case F16: q8_rows<F16>(q, d, groups, vocab, v0, end, w.xf, k, m, out, out_dtype, ldo); break;
      default: q8_rows<F32>(q, d, groups, vocab, v0, end, w.xf, k, m, out, out_dtype, ldo);
    }
  }
  return 0;
}

}  // extern "C"

// --- the argmax of a Q8_0 head's logits, screened in int8 ------------------------------------------------------
//
// A greedy decode step needs of each row's logits z = T x only the largest and its index. lp_q8_top finds them
// without computing every logit exactly: each group of x is quantized to int8 p (one scale t_g a group, shared by
// the rows), the table's int8 values multiply it with VNNI dot products, and z_hat = sum_g d t_g (q . p) comes with
// a bound E >= |fl(z) - z_hat|, fl(z) being lp_q8_matmul's value:
//   E_v = sum_g c[g, v] e_g,  c = |d| ||q||_2 (the caller's, rounded up),
//   e_g = (||x_g - t_g p_g||_2 + g1 ||x_g||_2 + g2 127 sqrt(32) t_g) (1 + 2^-10)
// by Cauchy-Schwarz: the quantization of x, then float32's rounding in lp_q8_matmul (g1 covers its longest chain of
// products and sums) and in z_hat's own sums (g2), and 2^-20 (|z_hat| + E) more for the rounding of z_hat +- E. A
// row's candidates are the v with z_hat + E >= L = max_u (z_hat - E): every other v has fl(z_v) < L <= the largest
// fl(z), so the argmax is among them. The candidates' logits are computed exactly (q8_block, the bits of
// lp_q8_matmul), the largest wins, the first on a tie, as lp_row_top. A row with a non-finite value, one far larger
// than the others, a non-finite bound or more than ``cap`` candidates is not screened (found 0): the caller
// computes it in full.
//
// The screen reads the table's int8 values from a copy laid out for VNNI, ``qs`` [G, V / 16, 8, 16, 4] uint8 (q +
// 128; the last V % 16 rows are read from q): for group g and block b of 16 rows, slice j holds bytes 4 j .. 4 j + 3
// of each of the 16 rows, so one vpdpbusd against x's bytes 4 j .. 4 j + 3 (broadcast) adds a four-byte dot product
// into each row's own lane, and eight of them leave each row's group dot in its lane: no horizontal sums, one scale
// vector a block.

namespace {

constexpr int kScreenRows = 4;  // rows of x a pass
constexpr int kLaneRows = 16;   // table rows a block: one a lane
// A bound E above this says the logits' terms may sum past float32's range (E >= g1 sum |terms|, g1 >= 2^-20):
// such a row is computed in full, where its infinities show.
constexpr float kBoundLimit = 1e30f;
constexpr float kOutlier = 16.f;  // a row whose largest magnitude is past this times the rows' median: in full

#if defined(__AVX512F__)
inline bool has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
}

template <int DT>
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const void* d, int64_t i) {
  if (DT == F32) return _mm512_loadu_ps(static_cast<const float*>(d) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(d) + i));
  if (DT == F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Blocks [b0, b0 + NB) of 16 table rows against R rows of p (x's int8 values, row stride k; ``base``: -128 times
// each group's sum of p, [R][G]): upper bounds z_hat + E into up (row stride vocab), the largest z_hat - E into
// low[r]. vpdpbusd adds (q + 128) p over four bytes a lane into -128 sum(p): each lane holds its exact sum of q p.
template <int NB, int R, int DT>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"))) void screen_block(
    const uint8_t* qs, const void* d, const float* c, int64_t groups, int64_t vocab, int64_t b0, const int8_t* p,
    const int32_t* base, int64_t k, const float* t, const float* e, float* up, float* low) {
  const int64_t blocks = vocab / kLaneRows, v0 = b0 * kLaneRows;
  __m512 acc[NB][R];
  for (int n = 0; n < NB; ++n)
    for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[NB][R];
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < NB; ++n) dot[n][r] = _mm512_set1_epi32(base[r * groups + g]);
    const uint8_t* wg = qs + (g * blocks + b0) * (8 * 64);
    for (int j = 0; j < 8; ++j) {
      __m512i w[NB];
      for (int n = 0; n < NB; ++n) w[n] = _mm512_loadu_si512(wg + (n * 8 + j) * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i x4 = _mm512_set1_epi32(four_bytes(p + r * k + g * kGroup + 4 * j));
        for (int n = 0; n < NB; ++n) dot[n][r] = _mm512_dpbusd_epi32(dot[n][r], w[n], x4);
      }
    }
    for (int n = 0; n < NB; ++n) {
      const __m512 scale = _mm512_mul_ps(load16<DT>(d, g * vocab + v0 + n * kLaneRows), _mm512_set1_ps(t[g]));
      for (int r = 0; r < R; ++r) acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[n][r]), scale, acc[n][r]);
    }
  }
  const __m512 tiny = _mm512_set1_ps(0x1p-20f), limit = _mm512_set1_ps(kBoundLimit), inf = _mm512_set1_ps(INFINITY);
  for (int n = 0; n < NB; ++n)
    for (int r = 0; r < R; ++r) {
      __m512 bound = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g)
        bound = _mm512_fmadd_ps(_mm512_loadu_ps(c + g * vocab + v0 + n * kLaneRows), _mm512_set1_ps(e[r * groups + g]),
                                bound);
      const __m512 z = acc[n][r];
      const __m512 b = _mm512_fmadd_ps(tiny, _mm512_add_ps(_mm512_abs_ps(z), bound), bound);
      const __mmask16 over = _mm512_cmp_ps_mask(bound, limit, _CMP_NLE_UQ);  // past the limit, or NaN: in full
      _mm512_storeu_ps(up + r * vocab + v0 + n * kLaneRows, _mm512_mask_blend_ps(over, _mm512_add_ps(z, b), inf));
      low[r] = std::fmax(low[r], _mm512_reduce_max_ps(_mm512_sub_ps(z, b)));
    }
}

// The same for one table row (from q) and one row of p, in scalar code: the vocabulary's last V % 16 rows.
template <int DT>
inline void screen_one(const int8_t* q, const void* d, const float* c, int64_t groups, int64_t vocab, int64_t v,
                       const int8_t* p, const float* t, const float* e, float* up, float* low) {
  float z = 0.f, b0 = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* qg = q + (g * vocab + v) * kGroup;
    int32_t dot = 0;
    for (int j = 0; j < kGroup; ++j) dot += (int32_t)p[g * kGroup + j] * (int32_t)qg[j];
    z = std::fma(load_scalar(d, g * vocab + v, DT) * t[g], (float)dot, z);
    b0 = std::fma(c[g * vocab + v], e[g], b0);
  }
  const float b = b0 + 0x1p-20f * (std::fabs(z) + b0);
  up[v] = b0 <= kBoundLimit ? z + b : INFINITY;
  *low = std::fmax(*low, z - b);
}

// Table rows [v0, end) (v0 a multiple of 16) against R rows of p: pairs of 16-row blocks, a last single block, then
// the rows past the last whole block one by one.
template <int R, int DT>
void screen_span(const int8_t* q, const uint8_t* qs, const void* d, const float* c, int64_t groups, int64_t vocab,
                 int64_t v0, int64_t end, const int8_t* p, const int32_t* base, int64_t k, const float* t,
                 const float* e, float* up, float* low) {
  const int64_t b1 = std::min(end, vocab / kLaneRows * kLaneRows) / kLaneRows;
  int64_t b = v0 / kLaneRows;
  for (; b + 2 <= b1; b += 2) screen_block<2, R, DT>(qs, d, c, groups, vocab, b, p, base, k, t, e, up, low);
  if (b < b1) screen_block<1, R, DT>(qs, d, c, groups, vocab, b++, p, base, k, t, e, up, low);
  for (int64_t v = std::max(v0, b1 * kLaneRows); v < end; ++v)
    for (int r = 0; r < R; ++r)
      screen_one<DT>(q, d, c, groups, vocab, v, p + r * k, t, e + r * groups, up + r * vocab, low + r);
}

template <int DT>
void screen_rows(const int8_t* q, const uint8_t* qs, const void* d, const float* c, int64_t groups, int64_t vocab,
                 int64_t v0, int64_t end, const int8_t* p, const int32_t* base, int64_t k, int64_t m, const float* t,
                 const float* e, float* up, float* low) {
  int64_t r = 0;
  for (; r + kScreenRows <= m; r += kScreenRows)
    screen_span<kScreenRows, DT>(q, qs, d, c, groups, vocab, v0, end, p + r * k, base + r * groups, k, t,
                                 e + r * groups, up + r * vocab, low + r);
  for (; r < m; ++r)
    screen_span<1, DT>(q, qs, d, c, groups, vocab, v0, end, p + r * k, base + r * groups, k, t, e + r * groups,
                       up + r * vocab, low + r);
}
#endif

// ok[r]: row r takes part in the screen: every value finite, and its largest magnitude at most kOutlier times the
// rows' median (the groups' scales are shared: one row far larger than the others would leave them no resolution,
// so it is computed in full instead). ``amax``: scratch, 2 m floats.
void screen_rows_ok(const float* xf, int64_t m, int64_t k, bool* ok, float* amax) {
  for (int64_t r = 0; r < m; ++r) {
    float top = 0.f;
    for (int64_t i = 0; i < k; ++i) {
      const float x = xf[r * k + i];
      top = std::isnan(x) ? INFINITY : std::fmax(top, std::fabs(x));
    }
    amax[r] = top;
  }
  float* sorted = amax + m;
  std::memcpy(sorted, amax, sizeof(float) * m);
  std::nth_element(sorted, sorted + m / 2, sorted + m);
  const float limit = sorted[m / 2] * kOutlier;
  for (int64_t r = 0; r < m; ++r) ok[r] = amax[r] <= 3.4e38f && amax[r] <= limit;
}

// x's int8 values into p, -128 times each group's sum of them into base, a scale per group shared by the rows
// marked ok into t, and each row's e_g (see above) into e; a row not ok gets zeros.
void screen_quantize(const float* xf, int64_t m, int64_t k, const bool* ok, int8_t* p, int32_t* base, float* t,
                     float* e) {
  const int64_t groups = k / kGroup;
  const double g1 = (2.0 * k + 4.0 * groups + 64.0) * 0x1p-24, g2 = (4.0 * groups + 64.0) * 0x1p-24;
  for (int64_t g = 0; g < groups; ++g) {
    float amax = 0.f;
    for (int64_t r = 0; r < m; ++r)
      for (int j = 0; ok[r] && j < kGroup; ++j) amax = std::fmax(amax, std::fabs(xf[r * k + g * kGroup + j]));
    t[g] = amax / 127.f;
    for (int64_t r = 0; r < m; ++r) {
      double dx2 = 0.0, x2 = 0.0;
      int32_t sum = 0;
      for (int j = 0; j < kGroup; ++j) {
        const float x = xf[r * k + g * kGroup + j];
        long v = ok[r] && t[g] > 0.f ? std::lrint(x / t[g]) : 0;
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        p[r * k + g * kGroup + j] = (int8_t)v;
        sum += (int32_t)v;
        const double dx = (double)x - (double)t[g] * (double)v;
        dx2 += dx * dx;
        x2 += (double)x * (double)x;
      }
      base[r * groups + g] = -128 * sum;
      const double bound = (std::sqrt(dx2) + g1 * std::sqrt(x2) + g2 * 127.0 * std::sqrt(32.0) * t[g]) * (1 + 0x1p-10);
      e[r * groups + g] = ok[r] ? std::nextafter((float)bound, INFINITY) : 0.f;
    }
  }
}

}  // namespace

extern "C" {

// 1 when lp_q8_top can screen on this CPU (this variant built with AVX-512, the CPU with VNNI), else 0.
int lp_q8_top_supported() {
#if defined(__AVX512F__)
  return has_vnni() ? 1 : 0;
#else
  return 0;
#endif
}

// For each row r of x [M, K] (x_dtype) against a group-major Q8_0 table (q [K / 32, V, 32] int8, its VNNI copy qs
// [K / 32, V / 16, 8, 16, 4] uint8 (see above), d [K / 32, V] in d_dtype, c [K / 32, V] float32 >= |d| ||q||_2):
// the largest of lp_q8_matmul's float32 logits into values[r] and its first index into index[r], and found[r] =
// the candidates computed exactly (0: not screened, see above; the caller computes that row in full). ``up`` is
// scratch, M * V float32. Returns 0, -1 on a bad argument, -2 when out of memory, -3 when this CPU cannot screen
// (lp_q8_top_supported).
int lp_q8_top(const void* x, int x_dtype, const int8_t* q, const uint8_t* qs, const void* d, int d_dtype,
              const float* c, int64_t m, int64_t vocab, int64_t k, int64_t cap, float* up, float* values,
              int64_t* index, int32_t* found) {
  if (m < 0 || vocab < 1 || k <= 0 || k % kGroup || cap < 1 || x_dtype < F32 || x_dtype > F16 || d_dtype < F32 ||
      d_dtype > F16)
    return -1;
#if defined(__AVX512F__)
  if (!has_vnni()) return -3;
  if (m == 0) return 0;
  const int64_t groups = k / kGroup, tasks = (vocab + kVocabPerTask - 1) / kVocabPerTask;
  const Widened w(x, x_dtype, m, k);
  int8_t* p = static_cast<int8_t*>(std::malloc(m * k));
  int32_t* base = static_cast<int32_t*>(std::malloc(sizeof(int32_t) * m * groups));
  float* t = static_cast<float*>(std::malloc(sizeof(float) * groups));
  float* e = static_cast<float*>(std::malloc(sizeof(float) * m * (groups < 2 ? 2 : groups)));
  float* low = static_cast<float*>(std::malloc(sizeof(float) * m * tasks));
  bool* ok = static_cast<bool*>(std::malloc(m));
  int rc = 0;
  if (!w.ok() || !p || !base || !t || !e || !low || !ok) {
    rc = -2;
  } else {
    screen_rows_ok(w.xf, m, k, ok, e);  // e: scratch here
    screen_quantize(w.xf, m, k, ok, p, base, t, e);
    for (int64_t i = 0; i < m * tasks; ++i) low[i] = -INFINITY;
    lp::Shares shares(tasks);
#pragma omp parallel
    shares.run([&](int64_t task) {
      const int64_t v0 = task * kVocabPerTask, end = std::min<int64_t>(v0 + kVocabPerTask, vocab);
      float* lows = low + task * m;
      switch (d_dtype) {
        case BF16: screen_rows<BF16>(q, qs, d, c, groups, vocab, v0, end, p, base, k, m, t, e, up, lows); break;
        case F16: screen_rows<F16>(q, qs, d, c, groups, vocab, v0, end, p, base, k, m, t, e, up, lows); break;
        default: screen_rows<F32>(q, qs, d, c, groups, vocab, v0, end, p, base, k, m, t, e, up, lows);
      }
    });
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      float floor = -INFINITY;
      for (int64_t i = 0; i < tasks; ++i) floor = std::fmax(floor, low[i * m + r]);
      const float* row = up + r * vocab;
      int64_t n = 0, wild = 0;
      for (int64_t v = 0; v < vocab; ++v) {  // branch-free: vectorized
        wild += !(std::fabs(row[v]) <= 3.4e38f);
        n += row[v] >= floor;
      }
      found[r] = 0;
      if (!ok[r] || !(std::fabs(floor) <= 3.4e38f) || wild || n > cap) continue;
      float best = -INFINITY;
      int64_t at = -1;
      for (int64_t v = 0; v < vocab; ++v) {
        if (!(row[v] >= floor)) continue;
        float z;
        switch (d_dtype) {
          case BF16: q8_block<1, 1, BF16>(q, d, groups, vocab, v, w.xf + r * k, k, &z); break;
          case F16: q8_block<1, 1, F16>(q, d, groups, vocab, v, w.xf + r * k, k, &z); break;
          default: q8_block<1, 1, F32>(q, d, groups, vocab, v, w.xf + r * k, k, &z);
        }
        if (!(std::fabs(z) <= 3.4e38f)) {
          at = -1;
          break;
        }
        if (at < 0 || z > best) best = z, at = v;
      }
      if (at < 0) continue;
      values[r] = best;
      index[r] = at;
      found[r] = (int32_t)n;
    }
  }
  std::free(p);
  std::free(base);
  std::free(t);
  std::free(e);
  std::free(low);
  std::free(ok);
  return rc;
#else
  (void)x, (void)q, (void)qs, (void)d, (void)c, (void)up, (void)values, (void)index, (void)found;
  return -3;
#endif
}

}  // extern "C"
