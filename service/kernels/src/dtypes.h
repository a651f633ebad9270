// loraplex native kernels: the element types the sources share, float32 and bfloat16 (its 16 bits as uint16_t).
// bf16 widens to float32 exactly (a shift) and is made from float32 by rounding to nearest even; NaN stays NaN.
// V16: 16 float32 lanes, one zmm (a GCC vector type) on avx512, two ymm or four xmm parts elsewhere (a struct of
// register-wide GCC vectors: below): built with -ffp-contract=off, a lane's products and sums round alike on every
// instruction set.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lp {

using bf16 = uint16_t;

// The dtype codes the entry points take (service/kernels/checks.py DTYPE_CODES).
enum Dtype : int { F32 = 0, BF16 = 1, F16 = 2 };

inline float widen(float v) { return v; }
inline float widen(bf16 h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline bf16 to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40);  // a quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (bf16)(bits >> 16);
}

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(bf16* p, int64_t i, float v) { p[i] = to_bf16(v); }

// N float32 lanes (4, 8 or 16) and the unsigned lanes a bf16 load widens through (GCC ignores a vector_size that
// depends on a template parameter, hence one specialization per width).
template <int N>
struct Lanes;
template <>
struct Lanes<4> {
  using F = float __attribute__((vector_size(16)));
  using H = uint16_t __attribute__((vector_size(8)));
  using W = uint32_t __attribute__((vector_size(16)));
};
template <>
struct Lanes<8> {
  using F = float __attribute__((vector_size(32)));
  using H = uint16_t __attribute__((vector_size(16)));
  using W = uint32_t __attribute__((vector_size(32)));
};
template <>
struct Lanes<16> {
  using F = float __attribute__((vector_size(64)));
  using H = uint16_t __attribute__((vector_size(32)));
  using W = uint32_t __attribute__((vector_size(64)));
};

// N lanes from p (bf16: widened by the shift).
template <int N>
inline typename Lanes<N>::F load_lanes(const float* p) {
  typename Lanes<N>::F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int N>
inline typename Lanes<N>::F load_lanes(const bf16* p) {
#if defined(__AVX512F__)
  if constexpr (N == 16) {  // one widening load and the shift (GCC's convertvector splits the load in halves)
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
    typename Lanes<N>::F v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
#endif
  typename Lanes<N>::H h;
  std::memcpy(&h, p, sizeof h);
  const typename Lanes<N>::W bits = __builtin_convertvector(h, typename Lanes<N>::W) << 16;
  typename Lanes<N>::F v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
// The register width of the variant, in float32 lanes: 16 (one zmm), 8 (one ymm), 4 (SSE2's xmm, NEON's q).
#if defined(__AVX512F__)
constexpr int kPart = 16;
#elif defined(__AVX__)
constexpr int kPart = 8;
#else
constexpr int kPart = 4;
#endif
using VP = Lanes<kPart>::F;

// N lanes rounded to bf16 as to_bf16 rounds each (to nearest even, NaN kept quiet): the bf16 bits in the low half
// of each 32-bit lane.
template <int N>
inline typename Lanes<N>::W bf16_bits(typename Lanes<N>::F v) {
  using U = typename Lanes<N>::W;
  U bits;
  std::memcpy(&bits, &v, sizeof bits);
  const U nan = (U)((bits & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
  const U near = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, quiet = (bits >> 16) | 0x40u;
  return (quiet & nan) | (near & ~nan);
}

// N values stored from p: float32 as they are, bf16 each rounded as lp::store rounds.
template <int N>
inline void store_lanes(float* p, typename Lanes<N>::F v) {
  std::memcpy(p, &v, sizeof v);
}
template <int N>
inline void store_lanes(bf16* p, typename Lanes<N>::F v) {
  const typename Lanes<N>::H h = __builtin_convertvector(bf16_bits<N>(v), typename Lanes<N>::H);
  std::memcpy(p, &h, sizeof h);
}

#if defined(__AVX512F__)
using V16 = Lanes<16>::F;
inline V16 load16(const float* p) { return load_lanes<16>(p); }
inline V16 load16(const bf16* p) { return load_lanes<16>(p); }
inline void store16(float* p, V16 v) { store_lanes<16>(p, v); }
inline void store16(bf16* p, V16 v) { store_lanes<16>(p, v); }
#else
// Without AVX-512 no register holds a 64-byte GCC vector: GCC gives such a type no machine mode and keeps every
// one in memory, each operation a round trip through the stack (the avx2 variant ran the dense kernel, the decode
// attention and the LoRA kernel 2-5x slower than the avx512 one on the same Zen 4). So here V16 is the 16 lanes as
// 16 / kPart register-wide parts, part i holding lanes i kPart .. i kPart + kPart - 1; every operation is the same
// one lane by lane, so each lane's value is the avx512 variant's.
struct V16 {
  static constexpr int kParts = 16 / kPart;
  VP p[kParts];
  float operator[](int l) const { return p[l / kPart][l % kPart]; }
};
#define LP_V16_OP(op)                                                                          \
  inline V16 operator op(V16 a, V16 b) {                                                     \
    for (int i = 0; i < V16::kParts; ++i) a.p[i] = a.p[i] op b.p[i];                         \
    return a;                                                                                \
  }                                                                                          \
  inline V16 operator op(V16 a, float b) {                                                   \
    for (int i = 0; i < V16::kParts; ++i) a.p[i] = a.p[i] op b;                              \
    return a;                                                                                \
  }                                                                                          \
  inline V16 operator op(float a, V16 b) {                                                   \
    for (int i = 0; i < V16::kParts; ++i) b.p[i] = a op b.p[i];                              \
    return b;                                                                                \
  }                                                                                          \
  inline V16& operator op##=(V16& a, V16 b) { return a = a op b; }                           \
  inline V16& operator op##=(V16& a, float b) { return a = a op b; }
LP_V16_OP(+)
LP_V16_OP(-)
LP_V16_OP(*)
LP_V16_OP(/)
#undef LP_V16_OP
inline V16 operator-(V16 a) {
  for (int i = 0; i < V16::kParts; ++i) a.p[i] = -a.p[i];
  return a;
}
// Loads and stores a part at a time: one 64-byte memcpy became four 16-byte moves through the stack, then read back
// 32 bytes at a time (a store-forwarding stall on every load).
template <typename T>  // float or bf16
inline V16 load16(const T* p) {
  V16 v;
  for (int i = 0; i < V16::kParts; ++i) v.p[i] = load_lanes<kPart>(p + i * kPart);
  return v;
}
template <typename T>
inline void store16(T* p, V16 v) {
  for (int i = 0; i < V16::kParts; ++i) store_lanes<kPart>(p + i * kPart, v.p[i]);
}
#endif

// f applied to each register-wide part of v (f: VP -> VP, lane by lane): a lane-wise function written once for
// the variant's registers.
template <typename Fn>
inline V16 by_parts(V16 v, Fn f) {
#if defined(__AVX512F__)
  return f(v);
#else
  for (int i = 0; i < V16::kParts; ++i) v.p[i] = f(v.p[i]);
  return v;
#endif
}

// 16 values as T holds them: float32 unchanged, bf16 rounded (widened back: still float32 lanes).
template <typename T>
inline V16 held16(V16 v) {
  if constexpr (sizeof(T) == sizeof(bf16)) {
    return by_parts(v, [](VP part) {
      const Lanes<kPart>::W bits = bf16_bits<kPart>(part) << 16;
      VP out;
      std::memcpy(&out, &bits, sizeof out);
      return out;
    });
  }
  return v;
}

// The even and odd elements of 2 N bf16, widened (a bf16 is the high half of its float32): the operands of the bf16
// pair order (pairs.cpp) in portable code, N lanes at a time.
template <int N>
inline void halves_lanes(const bf16* p, typename Lanes<N>::F& even, typename Lanes<N>::F& odd) {
  using U = typename Lanes<N>::W;
  U u;
  std::memcpy(&u, p, sizeof u);
  const U e = u << 16, o = u & 0xffff0000u;
  std::memcpy(&even, &e, sizeof even);
  std::memcpy(&odd, &o, sizeof odd);
}
inline void halves(const bf16* p, V16& even, V16& odd) {
#if defined(__AVX512F__)
  halves_lanes<16>(p, even, odd);
#else
  for (int i = 0; i < V16::kParts; ++i) halves_lanes<kPart>(p + 2 * kPart * i, even.p[i], odd.p[i]);
#endif
}

// One pair of inputs into acc in the bf16 pair order (vdpbf16ps's arithmetic, which pairs.cpp, step.cpp's bf16
// scores and lora.cpp's bf16 shrink share): the odd inputs' product added first, then the even ones', each product
// of two bf16 exact in float32 and each sum rounded. F: V16 or another lanes type; X: F, or a float for every lane.
template <typename F, typename X>
inline void pair_madd(F& acc, X xe, X xo, F we, F wo) {
  acc += xo * wo;
  acc += xe * we;
}

// Whether this CPU has vdpbf16ps (AVX-512 BF16); the avx512 variant calls it only behind this check (its flags
// lack avx512bf16: functions that use it carry the target themselves, LP_BF16_DOT). False in the other variants.
#define LP_BF16_DOT __attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f")))
inline bool has_bf16_dot() {
#if defined(__AVX512F__)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// The 16 lanes summed pairwise in a fixed order: lane l + 8, then + 4, + 2, + 1.
inline float lane_sum(V16 acc) {
  using V2 = float __attribute__((vector_size(8)));
#if defined(__AVX512F__)
  const Lanes<8>::F h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                         __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
#elif defined(__AVX__)
  const Lanes<8>::F h8 = acc.p[0] + acc.p[1];
#endif
#if defined(__AVX512F__) || defined(__AVX__)
  const Lanes<4>::F h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
#else
  const Lanes<4>::F h4 = (acc.p[0] + acc.p[2]) + (acc.p[1] + acc.p[3]);  // lanes l + 8 first, then + 4
#endif
  const V2 h2 = __builtin_shufflevector(h4, h4, 0, 1) + __builtin_shufflevector(h4, h4, 2, 3);
  return h2[0] + h2[1];
}

}  // namespace lp
