// loraplex native kernels: the element types the sources share, float32 and bfloat16 (its 16 bits as uint16_t).
// bf16 widens to float32 exactly (a shift) and is made from float32 by rounding to nearest even; NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>

namespace lp {

using bf16 = uint16_t;

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

}  // namespace lp
