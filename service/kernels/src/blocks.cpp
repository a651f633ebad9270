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
// even). The weights are never requantized and activations are never quantized.
//
// Threads: OpenMP over output rows, sharing torch's runtime (libgomp.so.1 is loaded once per process), so
// torch.set_num_threads governs these kernels too.

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
int lp_abi_version() { return 11; }
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
// Plain C++: one "vector" is a whole group of 32 floats; the compiler vectorizes what the target allows.
struct Vec {
  float f[32];
};
constexpr int kLanes = 32;
inline Vec vzero() { return Vec{}; }
inline Vec vload(const float* p) {
  Vec v;
  std::memcpy(v.f, p, sizeof v.f);
  return v;
}
inline Vec vset(float x) {
  Vec v;
  for (float& f : v.f) f = x;
  return v;
}
inline Vec vmul(Vec a, Vec b) {
  for (int j = 0; j < 32; ++j) a.f[j] *= b.f[j];
  return a;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int j = 0; j < 32; ++j) c.f[j] += a.f[j] * b.f[j];
  return c;
}
inline float hsum(Vec v) {  // pairwise, as the vector variants reduce their lanes
  for (int w = 16; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) v.f[j] += v.f[j + w];
  return v.f[0];
}
struct Group {
  Vec v[1];
};
inline Group q8_group(const int8_t* q) {
  Group g;
  for (int j = 0; j < 32; ++j) g.v[0].f[j] = (float)q[j];
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
struct Lanes {
  float f[kTile];
};
inline Lanes lzero() { return Lanes{}; }
inline Lanes lload(const float* p) {
  Lanes a;
  std::memcpy(a.f, p, sizeof a.f);
  return a;
}
inline void lstore(float* p, Lanes a) { std::memcpy(p, a.f, sizeof a.f); }
inline Lanes lfma(Lanes a, Lanes b, Lanes c) {
  for (int j = 0; j < kTile; ++j) c.f[j] += a.f[j] * b.f[j];
  return c;
}
inline Lanes lfma_x(Lanes a, const float* x, Lanes c) {
  const float b = *x;
  for (int j = 0; j < kTile; ++j) c.f[j] += a.f[j] * b;
  return c;
}
inline void q4_pair(const uint8_t* b, Lanes& even, Lanes& odd) {
  for (int j = 0; j < kTile; ++j) {
    even.f[j] = (float)(b[j] & 0x0f);
    odd.f[j] = (float)(b[j] >> 4);
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
