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

#include "dtypes.h"

#ifndef LP_ISA
#define LP_ISA "generic"
#endif

extern "C" {

// Bumped whenever a signature or a layout below changes; the wrapper refuses a library with another version.
int lp_abi_version() { return 5; }
const char* lp_isa() { return LP_ISA; }

}  // extern "C"

namespace {

enum Dtype : int { F32 = 0, BF16 = 1, F16 = 2 };

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

// x [M, K] in ``dtype`` -> float32 [M, K] and per-group sums [M, K / 32].
void widen(const void* x, int dtype, int64_t m, int64_t k, float* xf, float* xsum) {
  for (int64_t i = 0; i < m * k; ++i) xf[i] = load_scalar(x, i, dtype);
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* p = xf + r * k + g * kGroup;
      float s = 0.f;
      for (int j = 0; j < kGroup; ++j) s += p[j];
      xsum[r * groups + g] = s;
    }
  }
}

// x [M, K] in ``dtype`` widened to float32 and its per-group sums (``widen``), freed on every return (no C++
// runtime: built -fno-exceptions, so ``ok()`` says whether the memory was there).
struct Widened {
  float* xf;
  float* xsum;
  Widened(const void* x, int dtype, int64_t m, int64_t k)
      : xf(static_cast<float*>(std::malloc(sizeof(float) * (m * k + 1)))),
        xsum(static_cast<float*>(std::malloc(sizeof(float) * (m * (k / kGroup) + 1)))) {
    if (ok()) widen(x, dtype, m, k, xf, xsum);
  }
  ~Widened() {
    std::free(xf);
    std::free(xsum);
  }
  bool ok() const { return xf != nullptr && xsum != nullptr; }
};

constexpr int kMaxRows = 4;  // rows of x per pass over the weights (held in registers); more take further passes

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
struct Group {  // the 32 values of a group: elements 0..15, 16..31
  Vec v[2];
};
inline Group q4_group(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low = _mm_set1_epi8(0x0f);
  return {{_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low))),
           _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low)))}};
}
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
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
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
inline Vec widen8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
inline Vec widen8s(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }
inline Group q4_group(const uint8_t* qs) {  // each byte zero-extended from memory, then its two nibbles apart
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
  const __m256i low = _mm256_set1_epi32(0x0f);
  return {{_mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, low)),
           _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))}};
}
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
inline Vec vadd(Vec a, Vec b) {
  for (int j = 0; j < 32; ++j) a.f[j] += b.f[j];
  return a;
}
inline float hsum(Vec v) {  // pairwise, as the vector variants reduce their lanes
  for (int w = 16; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) v.f[j] += v.f[j + w];
  return v.f[0];
}
struct Group {
  Vec v[1];
};
inline Group q4_group(const uint8_t* qs) {
  Group g;
  for (int j = 0; j < 16; ++j) {
    g.v[0].f[j] = (float)(qs[j] & 0x0f);
    g.v[0].f[j + 16] = (float)(qs[j] >> 4);
  }
  return g;
}
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

// sum_i a[i] b[i] over n floats, in lanes then across them.
inline float lane_dot(const float* a, const float* b, int64_t n) {
  Vec acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One weight row against R rows of x: acc[r] = sum_g d_g (q_g . x_rg) + sum_g m_g sum(x_rg). qs [G, 16] nibble
// pairs (byte j: q[j] low, q[j + 16] high, as GGUF's block_q4_1 stores them), d and m [G] float32. Even and odd
// groups accumulate apart (two dependency chains, so consecutive groups overlap), summed at the end; the m terms
// are one dot product in lanes after them.
template <int R>
inline void q41_row(const uint8_t* qs, const float* d, const float* m, int64_t groups, const float* xf,
                    const float* xsum, int64_t k, float* acc) {
  Vec even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = vzero();
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    const Group q0 = q4_group(qs + g * 16), q1 = q4_group(qs + (g + 1) * 16);
    const Vec d0 = vset(d[g]), d1 = vset(d[g + 1]);
    for (int r = 0; r < R; ++r) {
      const float* x = xf + r * k + g * kGroup;
      even[r] = vfma(group_dot(q0, x), d0, even[r]);
      odd[r] = vfma(group_dot(q1, x + kGroup), d1, odd[r]);
    }
  }
  if (g < groups) {
    const Group q0 = q4_group(qs + g * 16);
    const Vec d0 = vset(d[g]);
    for (int r = 0; r < R; ++r) even[r] = vfma(group_dot(q0, xf + r * k + g * kGroup), d0, even[r]);
  }
  for (int r = 0; r < R; ++r) acc[r] = hsum(vadd(even[r], odd[r])) + lane_dot(m, xsum + r * groups, groups);
}

inline void q41_rows(const uint8_t* qs, const float* d, const float* m, int64_t groups, const float* xf,
                     const float* xsum, int64_t k, int64_t rows, float* acc) {
  switch (rows) {
    case 1: q41_row<1>(qs, d, m, groups, xf, xsum, k, acc); break;
    case 2: q41_row<2>(qs, d, m, groups, xf, xsum, k, acc); break;
    case 3: q41_row<3>(qs, d, m, groups, xf, xsum, k, acc); break;
    default: q41_row<4>(qs, d, m, groups, xf, xsum, k, acc);
  }
}

constexpr int kVocabBlock = 4;  // vocabulary rows of a Q8_0 table accumulated together (a register each)
constexpr int kVocabAhead = 4;  // blocks ahead whose bytes are requested: each group of the table is its own stream

// Vocabulary rows [v0, v0 + N) of a group-major Q8_0 table (q [G, V, 32] int8, d [G, V] of D) against one row of
// x: acc[v] = sum_g d[g, v] (q[g, v] . x_g). N and the scales' dtype DT fixed at compile time, so the N accumulators
// stay in registers and the scale's conversion is one instruction.
template <int N, int DT>
inline void q8_block(const int8_t* q, const void* d, int64_t groups, int64_t vocab, int64_t v0, const float* x,
                     float* acc) {
  Vec vacc[N];
  for (int v = 0; v < N; ++v) vacc[v] = vzero();
  const bool ahead = v0 + (kVocabAhead + 1) * kVocabBlock <= vocab;
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* qg = q + (g * vocab + v0) * kGroup;
    const int64_t dg = g * vocab + v0;
    const float* xg = x + g * kGroup;
    if (ahead) {
      for (int b = 0; b < kVocabBlock * kGroup; b += 64) __builtin_prefetch(qg + kVocabAhead * kVocabBlock * kGroup + b);
      __builtin_prefetch(static_cast<const char*>(d) + (dg + kVocabAhead * kVocabBlock) * (DT == F32 ? 4 : 2));
    }
    for (int v = 0; v < N; ++v)
      vacc[v] = vfma(group_dot(q8_group(qg + v * kGroup), xg), vset(load_scalar(d, dg + v, DT)), vacc[v]);
  }
  for (int v = 0; v < N; ++v) acc[v] = hsum(vacc[v]);
}

// Rows [v0, end) of the table in blocks of kVocabBlock (the last block one row at a time), scales of dtype DT.
template <int DT>
inline void q8_rows(const int8_t* q, const void* d, int64_t groups, int64_t vocab, int64_t v0, int64_t end,
                    const float* x, void* out, int out_dtype, int64_t out_at) {
  float acc[kVocabBlock];
  for (; v0 < end; v0 += kVocabBlock) {
    const int n = end - v0 < kVocabBlock ? (int)(end - v0) : kVocabBlock;
    if (n == kVocabBlock) {
      q8_block<kVocabBlock, DT>(q, d, groups, vocab, v0, x, acc);
    } else {
      for (int v = 0; v < n; ++v) q8_block<1, DT>(q, d, groups, vocab, v0 + v, x, acc + v);
    }
    for (int v = 0; v < n; ++v) store_scalar(out, out_at + v0 + v, acc[v], out_dtype);
  }
}

// Rows ahead whose bytes are requested while this one computes: the kernel alternates conversion work and loads,
// and on its own the hardware prefetcher keeps too few lines in flight to stream at the memory's bandwidth.
constexpr int64_t kPrefetchRows = 16;

inline void prefetch_row(const uint8_t* qs, const float* d, const float* mn, int64_t groups, int64_t row, int64_t n) {
  if (row >= n) return;
  const char* q = reinterpret_cast<const char*>(qs + row * groups * 16);
  for (int64_t b = 0; b < groups * 16; b += 64) __builtin_prefetch(q + b);
  for (int64_t b = 0; b < groups * 4; b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(d + row * groups) + b);
    __builtin_prefetch(reinterpret_cast<const char*>(mn + row * groups) + b);
  }
}

constexpr int64_t kRowsPerTask = 16;    // Q4_1 output rows per OpenMP work item
constexpr int64_t kVocabPerTask = 256;  // Q8_0 vocabulary rows per work item

}  // namespace

extern "C" {

// out [M, N] (out_dtype, row stride ldo) = x [M, K] (x_dtype, contiguous) @ W^T for N rows of K / 32 groups of
// 4-bit values: W[n, 32 g + j] = d[n, g] * q + m[n, g]; qs [N, K / 2] uint8 (per group 16 bytes, byte j holding
// q[j] in its low nibble and q[j + 16] in its high one), d and m [N, K / 32] float32. Returns 0, -1 on a bad
// argument, -2 when out of memory.
int lp_q4_matmul(const void* x, int x_dtype, const uint8_t* qs, const float* d, const float* mn, int64_t m,
                 int64_t n, int64_t k, void* out, int out_dtype, int64_t ldo) {
  if (m < 0 || n < 0 || k <= 0 || k % kGroup || ldo < n) return -1;
  const int64_t groups = k / kGroup;
  const Widened w(x, x_dtype, m, k);
  if (!w.ok()) return -2;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    float acc[kMaxRows];
    const int64_t n1 = (t + 1) * kRowsPerTask < n ? (t + 1) * kRowsPerTask : n;
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int64_t rows = m - r0 < kMaxRows ? m - r0 : kMaxRows;
      for (int64_t row = t * kRowsPerTask; row < n1; ++row) {
        prefetch_row(qs, d, mn, groups, row + kPrefetchRows, n);
        q41_rows(qs + row * groups * 16, d + row * groups, mn + row * groups, groups, w.xf + r0 * k,
                 w.xsum + r0 * groups, k, rows, acc);
        for (int64_t r = 0; r < rows; ++r) store_scalar(out, (r0 + r) * ldo + row, acc[r], out_dtype);
      }
    }
  }
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
    for (int64_t r = 0; r < m; ++r) {
      const float* x = w.xf + r * k;
      switch (d_dtype) {
        case BF16: q8_rows<BF16>(q, d, groups, vocab, v0, end, x, out, out_dtype, r * ldo); break;
        case F16: q8_rows<F16>(q, d, groups, vocab, v0, end, x, out, out_dtype, r * ldo); break;
        default: q8_rows<F32>(q, d, groups, vocab, v0, end, x, out, out_dtype, r * ldo);
      }
    }
  }
  return 0;
}

}  // extern "C"
