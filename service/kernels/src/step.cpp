// loraplex native kernels: the small ops of a decode step, fused so that a layer pays a few calls instead of thirty
// (service/model/llama.py uses them on a float32 or bfloat16 CPU model when the library is loaded).
//
//   lp_add_rmsnorm       residual add + RMSNorm: x += y, out = x * rsqrt(mean(x^2) + eps) * w
//   lp_silu_mul          SwiGLU's middle: out = silu(gate) * up over the fused [gate; up] projection
//   lp_decode_attention  one query token per row: RoPE on q and k, K/V bounded (finite_kv) and written into the slot
//                        cache at the row's position, then softmax(q k^T / sqrt(D)) v over positions 0..pos (a
//                        draft tree's node: the positions below its root and the nodes it sees)
//   lp_row_top           each row's largest logit and its first column (greedy sampling's argmax and the logits'
//                        finiteness in one pass: torch's max(dim=-1) over a 32-row step's logits took ~1 ms)
//
// Plain C++ in lanes of 16 that the compiler vectorizes for each variant's instruction set (the same -m flags as
// blocks.cpp; built with -ffp-contract=off, so a * b + c * d rounds as torch's separate ops do: RoPE and the cache
// writes are bit-identical to the eager path's). Reductions (norm, scores, softmax) are float32 in another order
// than torch's; SiLU and softmax use a Cephes-style polynomial for exp (about 2 ulp; SiLU 16 lanes at a time, each
// lane the scalar code's value): the results agree with eager within rounding.
// Non-finite inputs stay non-finite in the outputs, so a row that blew up fails on its own logits.
//
// bfloat16 (dtype code 1; 0 is float32): tensors the eager path holds in bf16 are bf16 here too, and every value
// eager torch rounds to bf16 is rounded here at the same point (round to nearest even): RoPE's two products and
// their sum, the K/V written, SiLU before its product, each op's output. Everything else is float32: the residual
// stream (float32 in every model, see Llama.forward), the norm, the scores, the softmax and the sum over V (eager's
// attention rounds its probabilities to bf16 before that sum; this does not). A bf16 score sums exact products of
// the bf16 query and key in pairs, vdpbf16ps's order, on that instruction where the CPU has it (AVX-512 BF16) and
// in the same arithmetic elsewhere, so the variants agree bit for bit (but for subnormals, which it flushes).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dtypes.h"
#include "shares.h"

namespace {

using lp::bf16;
using lp::V16;
using lp::load16;
using lp::store;
using lp::to_bf16;
using lp::widen;

using lp::F32;
using lp::BF16;

// A value as the element type T holds it: float32 unchanged, bf16 rounded (still a float).
template <typename T>
inline float held(float v) {
  if constexpr (sizeof(T) == sizeof(bf16)) return widen(to_bf16(v));
  return v;
}

constexpr int kLanes = 16;
constexpr int64_t kMaxHeadDim = 512;
constexpr float kKvLimit = 65504.0f;  // service.model.kv_cache.KV_LIMIT

inline float bounded(float v) {  // finite_kv: NaN -> 0, everything else clamped to +-KV_LIMIT
  if (v != v) return 0.0f;
  return v < -kKvLimit ? -kKvLimit : (v > kKvLimit ? kKvLimit : v);
}

// e^r for r = xc - n ln 2 (ln 2 in two parts, so r is exact; |r| <= ln 2 / 2): float, or V16 lane by lane.
template <typename F>
inline F exp_reduced(F xc, F n) {
  const F r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3333519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * (r * r) + r + 1.0f;
}

inline float exp_poly(float x) {
  // exp(x) = 2^n e^r with n = round(x / ln 2) and |r| <= ln 2 / 2.
  const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  float y = exp_reduced(xc, n) * scale;
  y = x < -87.0f ? 0.0f : y;
  y = x > 88.0f ? INFINITY : y;
  return x != x ? x : y;
}

// ``exp_poly`` on a register's lanes, each lane through the same operations (floor by truncation, corrected: exact
// on the clamped range), so each lane's value is ``exp_poly``'s; ``exp_poly16`` on 16 lanes, a register at a time.
inline lp::VP exp_poly_part(lp::VP x) {
  using F = lp::VP;
  using I = int32_t __attribute__((vector_size(sizeof(lp::VP))));
  const F zero = {}, lo = zero - 87.0f, hi = zero + 88.0f;
  const F xc = x < lo ? lo : (x > hi ? hi : x);  // a NaN lane stays NaN here and is returned as x below
  const F t = xc * 1.44269504088896341f + 0.5f;
  F n = __builtin_convertvector(__builtin_convertvector(t, I), F);
  n = n > t ? n - 1.0f : n;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof scale);
  F y = exp_reduced(xc, n) * scale;
  y = x < lo ? zero : y;
  y = x > hi ? zero + INFINITY : y;
  return x != x ? x : y;
}
inline V16 exp_poly16(V16 x) { return lp::by_parts(x, exp_poly_part); }

inline float lane_sum(float* acc) {  // pairwise over the lanes
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * widen(b[i + l]);
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * widen(b[i]);
  return lane_sum(acc) + tail;
}

// ``dot`` with n = D (a multiple of kLanes) in dtypes.h's V16, held in the variant's registers: the same lanes,
// products and pairwise sum, so the same value, without a pass through memory for the lane sum.
template <int64_t D, typename T>
inline float dot_fixed(const float* a, const T* b) {
  static_assert(D % kLanes == 0, "whole lanes only");
  V16 acc = {};
  for (int64_t i = 0; i < D; i += kLanes) acc += load16(a + i) * load16(b + i);
  return lp::lane_sum(acc) + 0.0f;  // + dot's (empty) tail
}

// One head rotated (the HF rotate-half convention, as service.model.rope.apply_rope): with the signed sin table,
// out[i] = x[i] cos[i] + x[(i + D/2) mod D] sin[i], each product and the sum held in T as eager torch holds them.
template <typename T>
inline void rope(const T* x, const T* cos, const T* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const int64_t j = i < half ? i + half : i - half;
    out[i] = held<T>(held<T>(widen(x[i]) * widen(cos[i])) + held<T>(widen(x[j]) * widen(sin[i])));
  }
}

constexpr int64_t kParallelElems = 1 << 15;  // below this many elements one thread does an elementwise op

// x [R, N] float32 (in place) += y [R, N] (Y) unless y is null; out [R, N] (O) = x * rsqrt(mean(x^2) + eps) * w [N] (O).
template <typename Y, typename O>
int add_rmsnorm(float* x, const Y* y, const O* w, int64_t rows, int64_t n, float eps, O* out) {
  if (rows < 0 || n <= 0 || !(eps >= 0.0f)) return -1;
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * n;
    if (y != nullptr) {
      const Y* yr = y + r * n;
      for (int64_t i = 0; i < n; ++i) xr[i] += widen(yr[i]);
    }
    // In double: the mean is then float32's best, whatever order torch sums in. Each square is exact in double, so
    // summing in kLanes lanes (then pairwise) moves only the double's last bits, and keeps the adds independent: one
    // chain of double adds, a latency each, took 70 % of this function at 32 rows x 576.
    double lanes[kLanes] = {};
    const int64_t whole = n - n % kLanes;
    for (int64_t i = 0; i < whole; i += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += (double)xr[i + l] * xr[i + l];
    for (int64_t i = whole; i < n; ++i) lanes[i - whole] += (double)xr[i] * xr[i];
    for (int w = kLanes / 2; w > 0; w /= 2)
      for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
    const double squares = lanes[0];
    const float rstd = 1.0f / std::sqrt((float)(squares / (double)n) + eps);
    for (int64_t i = 0; i < n; ++i) store(out + r * n, i, (xr[i] * rstd) * widen(w[i]));
  }
  return 0;
}

// gu [R, 2 I] (gate columns, then up): out [R, I] = silu(gate) * up, silu held in T before the product.
template <typename T>
int silu_mul(const T* gu, int64_t rows, int64_t inter, T* out) {
  if (rows < 0 || inter <= 0) return -1;
#pragma omp parallel for schedule(static) if (rows * inter >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * 2 * inter;
    const T* u = g + inter;
    int64_t i = 0;
    for (; i + kLanes <= inter; i += kLanes) {  // 16 at a time, each lane as the loop below computes it
      const V16 gi = load16(g + i);
      lp::store16(out + r * inter + i, lp::held16<T>(gi / (1.0f + exp_poly16(-gi))) * load16(u + i));
    }
    for (; i < inter; ++i) {
      const float gi = widen(g[i]);
      store(out + r * inter, i, held<T>(gi / (1.0f + exp_poly(-gi))) * widen(u[i]));
    }
  }
  return 0;
}

// The cache positions one query attends to, in order: the first ``lo``, then ``tail``'s (a draft tree's nodes the
// query sees, ascending). A decode step or a chain: all n = pos + 1 in ``lo``, no tail; a tree node: lo = its root's
// position, its marked nodes in the tail. The scores, the softmax total and the sum over V run over the n of them in
// this order, so a tree node whose marked nodes are its ancestors gets the bits a decode step after the same tokens
// gets (that step's positions 0..pos are these keys, in this order).
struct Keys {
  int64_t lo;
  const int64_t* tail;
  int64_t at(int64_t p) const { return p < lo ? p : tail[p - lo]; }
};

// bf16 keys: a score is a sum in pairs (pairs.cpp's order, vdpbf16ps's): lane l of each chunk of 32 adds the
// product of element 2l + 1, then of 2l (the last chunk padded with zeros), the lanes pairwise (lp::lane_sum). The
// query's values are bf16 (RoPE's output is held in bf16), so every product is exact in float32, as in the lane
// order; on AVX-512 BF16 one instruction a chunk, elsewhere the same arithmetic in lanes. D: whole chunks (``attend``
// is built for 64 and 128; other sizes take ``pair_dot_any``).
template <int64_t D>
inline float pair_dot(const V16 (&qe)[D / 32], const V16 (&qo)[D / 32], const bf16* kp) {
  static_assert(D % 32 == 0, "whole chunks only");
  V16 acc = {};
  for (int64_t c = 0; c < D / 32; ++c) {
    V16 ke, ko;
    lp::halves(kp + 32 * c, ke, ko);
    lp::pair_madd(acc, qe[c], qo[c], ke, ko);
  }
  return lp::lane_sum(acc);
}

#if defined(__AVX512F__)
template <int64_t D, int G>
LP_BF16_DOT void scores_dpbf16(
    const bf16 (&qb)[G][D], const bf16* k, Keys keys, int64_t n, float scale, float* s, float* top) {
  static_assert(D % 32 == 0, "whole chunks only");
  __m512bh qv[G][D / 32];
  for (int g = 0; g < G; ++g)
    for (int64_t c = 0; c < D / 32; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(qb[g] + 32 * c);
  for (int64_t p = 0; p < n; ++p) {
    __m512bh kv[D / 32];
    const bf16* kp = k + keys.at(p) * D;
    for (int64_t c = 0; c < D / 32; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kp + 32 * c);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < D / 32; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], kv[c]);
      V16 lanes;
      std::memcpy(&lanes, &acc, sizeof lanes);
      const float score = lp::lane_sum(lanes) * scale;
      s[g * n + p] = score;
      top[g] = score > top[g] ? score : top[g];
    }
  }
}
#endif

// The G heads' scores over the n positions ``keys`` names of bf16 keys k [., D] in pairs (``pair_dot``), times
// ``scale``, into s [G][n]; top[g]: the running maximum.
template <int64_t D, int G>
void scores_in_pairs(const float* q, const bf16* k, Keys keys, int64_t n, float scale, float* s, float* top) {
  bf16 qb[G][D];
  for (int g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) qb[g][i] = lp::to_bf16(q[g * D + i]);  // exact: the values are bf16's
#if defined(__AVX512F__)
  if (lp::has_bf16_dot()) return scores_dpbf16<D, G>(qb, k, keys, n, scale, s, top);
#endif
  V16 qe[G][D / 32], qo[G][D / 32];
  for (int g = 0; g < G; ++g)
    for (int64_t c = 0; c < D / 32; ++c) lp::halves(qb[g] + 32 * c, qe[g][c], qo[g][c]);
  for (int64_t p = 0; p < n; ++p)
    for (int g = 0; g < G; ++g) {
      const float score = pair_dot<D>(qe[g], qo[g], k + keys.at(p) * D) * scale;
      s[g * n + p] = score;
      top[g] = score > top[g] ? score : top[g];
    }
}

// The exponentials' total over n positions: in 16 lanes, then pairwise, then the tail in turn (independent adds,
// not one chain of n additions a latency each).
inline float softmax_total(const float* e, int64_t n) {
  V16 lanes = {};
  int64_t p = 0;
  for (; p + kLanes <= n; p += kLanes) lanes += load16(e + p);
  float t = lp::lane_sum(lanes);
  for (; p < n; ++p) t += e[p];
  return t;
}

// Chunks of 16 elements of a head the sum over V holds per pass, for G heads and C chunks a head: all of them while
// G x C accumulators fit the registers (32 zmm on avx512); on avx2 a V16 takes two of the 16 ymm, so at most 6 at a
// time (more spilled to the stack: SmolLM2's 3 heads x 4 chunks ran 1.5-1.6x slower). Each element's sum is the same.
#if defined(__AVX512F__)
constexpr int64_t kVAccumulators = 32;
#else
constexpr int64_t kVAccumulators = 6;
#endif
constexpr int64_t v_block(int64_t g, int64_t c) {
  int64_t b = c;
  while (b > 1 && (g * b > kVAccumulators || c % b != 0)) --b;
  return b;
}

// Softmax attention of one query token's heads q [G][D] (rotated) over the n positions ``keys`` names of one KV head
// (k, v [., D]): out [G][D] (elements of T). s: scratch for G x n scores. The K and V rows are read once for the G
// heads; each head's sums run in the one-head order (``dot``'s lanes, or for bf16 keys ``pair_dot``'s pairs; then
// positions in turn for the maximum and the sum over V, and ``softmax_total`` for the exponentials' total), so a
// head's result does not depend on G. D and G fixed at compile time keep a head's accumulators in registers (the sum over V in V16
// lanes, each element's products and sums as one float at a time would run them).
template <typename T, int64_t D, int G>
void attend(const float* q, const T* k, const T* v, Keys keys, int64_t n, float scale, float* s, T* out) {
  float top[G];
  for (int g = 0; g < G; ++g) top[g] = -INFINITY;
  if constexpr (sizeof(T) == sizeof(bf16)) {
    scores_in_pairs<D, G>(q, k, keys, n, scale, s, top);
  } else {
    for (int64_t p = 0; p < n; ++p) {
      const T* kp = k + keys.at(p) * D;
      for (int g = 0; g < G; ++g) {
        const float score = dot_fixed<D>(q + g * D, kp) * scale;
        s[g * n + p] = score;
        top[g] = score > top[g] ? score : top[g];
      }
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * n;
    for (int64_t p = 0; p < n; ++p) sg[p] = exp_poly(sg[p] - top[g]);  // no reduction here: vectorized
    total[g] = softmax_total(sg, n);
  }
  constexpr int64_t B = v_block(G, D / kLanes);
  for (int64_t c0 = 0; c0 < D / kLanes; c0 += B) {  // B chunks of 16 elements of every head at a time
    V16 acc[G][B] = {};
    for (int64_t p = 0; p < n; ++p) {
      V16 vv[B];
      const T* vp = v + keys.at(p) * D;
      for (int64_t c = 0; c < B; ++c) vv[c] = load16(vp + (c0 + c) * kLanes);
      for (int g = 0; g < G; ++g) {
        const float w = s[g * n + p];
        for (int64_t c = 0; c < B; ++c) acc[g][c] += w * vv[c];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int64_t c = 0; c < B; ++c) lp::store16(out + g * D + (c0 + c) * kLanes, acc[g][c] / total[g]);
  }
}

// ``pair_dot`` for any (even) head size d: chunks of 32, the last padded with zeros; q as float (bf16 values).
inline float pair_dot_any(const float* q, const bf16* kp, int64_t d) {
  V16 acc = {};
  for (int64_t c = 0; c < d; c += 32) {
    bf16 qb[32] = {}, kb[32] = {};
    const int64_t w = d - c < 32 ? d - c : 32;
    for (int64_t i = 0; i < w; ++i) qb[i] = lp::to_bf16(q[c + i]);
    std::memcpy(kb, kp + c, sizeof(bf16) * w);
    V16 qe, qo, ke, ko;
    lp::halves(qb, qe, qo);
    lp::halves(kb, ke, ko);
    lp::pair_madd(acc, qe, qo, ke, ko);
  }
  return lp::lane_sum(acc);
}

// ``attend`` for any head size up to kMaxHeadDim, one head at a time.
template <typename T>
void attend_any(const float* q, const T* k, const T* v, Keys keys, int64_t d, int64_t n, float scale, float* s,
                T* out) {
  float top = -INFINITY;
  for (int64_t p = 0; p < n; ++p) {
    if constexpr (sizeof(T) == sizeof(bf16))
      s[p] = pair_dot_any(q, k + keys.at(p) * d, d) * scale;
    else
      s[p] = dot(q, k + keys.at(p) * d, d) * scale;
    top = s[p] > top ? s[p] : top;
  }
  for (int64_t p = 0; p < n; ++p) s[p] = exp_poly(s[p] - top);
  const float total = softmax_total(s, n);
  float acc[kMaxHeadDim] = {};
  for (int64_t p = 0; p < n; ++p) {
    const T* vp = v + keys.at(p) * d;
    for (int64_t i = 0; i < d; ++i) acc[i] += s[p] * widen(vp[i]);
  }
  for (int64_t i = 0; i < d; ++i) store(out, i, acc[i] / total);
}

constexpr int64_t kHeadsAtOnce = 4;  // query heads of one KV head attended together (their K / V read once)

// ``attend`` for g (1..kHeadsAtOnce) heads of size D.
template <typename T, int64_t D>
void attend_sized(int64_t g, const float* q, const T* k, const T* v, Keys keys, int64_t n, float scale, float* s,
                  T* out) {
  static_assert(kHeadsAtOnce == 4, "one case per head count");
  switch (g) {
    case 1: return attend<T, D, 1>(q, k, v, keys, n, scale, s, out);
    case 2: return attend<T, D, 2>(q, k, v, keys, n, scale, s, out);
    case 3: return attend<T, D, 3>(q, k, v, keys, n, scale, s, out);
    default: return attend<T, D, 4>(q, k, v, keys, n, scale, s, out);
  }
}

// ``g`` (1..kHeadsAtOnce) heads of head size d: ``attend`` where D is one it is built for, else ``attend_any``.
template <typename T>
void attend_heads(int64_t g, int64_t d, const float* q, const T* k, const T* v, Keys keys, int64_t n, float scale,
                  float* s, T* out) {
  if (d == 64) return attend_sized<T, 64>(g, q, k, v, keys, n, scale, s, out);
  if (d == 128) return attend_sized<T, 128>(g, q, k, v, keys, n, scale, s, out);
  for (int64_t j = 0; j < g; ++j) attend_any(q + j * d, k, v, keys, d, n, scale, s, out + j * d);
}

// A draft tree's arguments (tree non-null; S slots, T tokens a slot): every token of a slot at the position after
// the one before it (node i of a slot at its root's position + i), and every node seeing itself.
inline bool tree_fits(const int64_t* pos, int64_t b, int64_t slots, const uint8_t* tree, int64_t tree_stride) {
  const int64_t tokens = b / slots;
  if (tree_stride != 0 && tree_stride < tokens * tokens) return false;
  for (int64_t r = slots; r < b; ++r)
    if (pos[r] != pos[r - slots] + 1) return false;
  for (int64_t r = 0; r < b; ++r)
    if (tree[r % slots * tree_stride + (r / slots) * (tokens + 1)] == 0) return false;
  return true;
}

template <typename T>
int decode_attention(const T* qkv, const T* cos, const T* sin, const int64_t* pos, int64_t b, int64_t slots,
                     const uint8_t* tree, int64_t tree_stride, int64_t h, int64_t kv, int64_t d, T* k_cache,
                     T* v_cache, int64_t slot_stride, int64_t head_stride, int64_t max_len, float scale, T* out) {
  if (b < 0 || slots < 0 || (b > 0 && (slots == 0 || b % slots))) return -1;  // B = T S rows, token-major
  if (h <= 0 || kv <= 0 || h % kv || d <= 0 || d % 2 || d > kMaxHeadDim || max_len <= 0) return -1;
  if (head_stride < max_len * d || slot_stride < kv * head_stride) return -1;
  for (int64_t r = 0; r < b; ++r)
    if (pos[r] < 0 || pos[r] >= max_len) return -1;
  if (tree != nullptr && b > 0 && !tree_fits(pos, b, slots, tree, tree_stride)) return -1;
  const int64_t tokens = b > 0 ? b / slots : 0, tails = tree != nullptr ? tokens : 0;  // a tree node's tail keys
  const int64_t width = (h + 2 * kv) * d, group = h / kv;
  // Work items: (row, KV head, a chunk of its query heads); one head a chunk when chunks of several would leave
  // threads idle (a row or two: long contexts there are worth splitting).
  int64_t chunk = group < kHeadsAtOnce ? group : kHeadsAtOnce;
  if (b * kv * ((group + chunk - 1) / chunk) < 2 * (int64_t)omp_get_max_threads()) chunk = 1;
  const int64_t chunks = (group + chunk - 1) / chunk;
  int failed = 0;
  lp::Shares shares(b * kv * chunks);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < b * kv; ++t) {
      const int64_t r = t / kv, j = t % kv, at = r % slots * slot_stride + j * head_stride + pos[r] * d;
      float rotated[kMaxHeadDim];
      rope(qkv + r * width + (h + j) * d, cos + r * d, sin + r * d, d, rotated);
      const T* v = qkv + r * width + (h + kv + j) * d;
      for (int64_t i = 0; i < d; ++i) {
        store(k_cache, at + i, bounded(rotated[i]));
        store(v_cache, at + i, bounded(widen(v[i])));
      }
    }  // the implicit barrier: every row's new K/V is in place before any query reads it
    shares.run([&](int64_t t) {
      const int64_t r = t / (kv * chunks), j = t / chunks % kv, c = t % chunks;
      const int64_t head = j * group + c * chunk, heads = group - c * chunk < chunk ? group - c * chunk : chunk;
      const int64_t base = r % slots * slot_stride + j * head_stride;
      float q[kHeadsAtOnce * kMaxHeadDim];
      for (int64_t i = 0; i < heads; ++i)
        rope(qkv + r * width + (head + i) * d, cos + r * d, sin + r * d, d, q + i * d);
      // a tree node: its root's position, then the nodes its row of the tree marks (at most T keys)
      const int64_t node = r / slots, root = pos[r] - node, most = tree != nullptr ? root + tokens : pos[r] + 1;
      int64_t* tail = (int64_t*)std::malloc(sizeof(int64_t) * tails + sizeof(float) * heads * most);
      if (tail == nullptr) {
#pragma omp atomic write
        failed = 1;
        return;
      }
      float* s = (float*)(tail + tails);
      Keys keys{pos[r] + 1, nullptr};
      int64_t n = pos[r] + 1;
      if (tree != nullptr) {
        const uint8_t* marks = tree + r % slots * tree_stride + node * tokens;
        int64_t m = 0;
        for (int64_t u = 0; u < tokens; ++u)
          if (marks[u] != 0) tail[m++] = root + u;
        keys = Keys{root, tail};
        n = root + m;
      }
      attend_heads(heads, d, q, k_cache + base, v_cache + base, keys, n, scale, s, out + r * h * d + head * d);
      std::free(tail);
    });
  }
  return failed ? -2 : 0;
}

// Row x [n] float32: its largest value and the first column holding it, as torch's max(dim=-1) gives them. 16
// lanes, lane l over columns l, l + 16, ... in order, a strictly greater value taking the lane; then the largest of
// the lanes and, among the lanes holding it, the smallest column; the tail after. A row holding NaN gives NaN at its
// first NaN; a row of -inf gives -inf at column 0.
void row_top(const float* x, int64_t n, float* value, int64_t* index) {
  using F = lp::Lanes<kLanes>::F;
  using I = int32_t __attribute__((vector_size(4 * kLanes)));
  F best = F{} - INFINITY;
  I at = I{} - 1, col = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, nan = I{};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes, col += kLanes) {
    F v;
    std::memcpy(&v, x + c, sizeof v);
    const I gt = v > best;
    best = gt ? v : best;
    at = gt ? col : at;
    nan |= v != v;
  }
  float top = -INFINITY;
  int64_t where = -1;
  for (int l = 0; l < kLanes; ++l)
    if (at[l] >= 0 && (best[l] > top || (best[l] == top && at[l] < where))) top = best[l], where = at[l];
  bool has_nan = false;
  for (int l = 0; l < kLanes; ++l) has_nan |= nan[l] != 0;
  for (; c < n; ++c) {
    has_nan |= x[c] != x[c];
    if (x[c] > top) top = x[c], where = c;
  }
  if (has_nan) {
    for (c = 0; x[c] == x[c]; ++c) {
    }
    top = x[c], where = c;
  }
  *value = top;
  *index = where < 0 ? 0 : where;
}

}  // namespace

extern "C" {

// x [R, N] float32 (in place) += y [R, N] unless y is null; out [R, N] = x * rsqrt(mean(x^2) + eps) * w [N]. y, w and
// out are all float32 (dtype 0) or all bfloat16 (dtype 1).
int lp_add_rmsnorm(float* x, const void* y, const void* w, int64_t rows, int64_t n, float eps, void* out, int dtype) {
  if (dtype == F32)
    return add_rmsnorm(x, (const float*)y, (const float*)w, rows, n, eps, (float*)out);
  if (dtype == BF16)
    return add_rmsnorm(x, (const bf16*)y, (const bf16*)w, rows, n, eps, (bf16*)out);
  return -1;
}

// gu [R, 2 I] (gate columns, then up): out [R, I] = gate / (1 + exp(-gate)) * up, both in ``dtype``.
int lp_silu_mul(const void* gu, int64_t rows, int64_t inter, void* out, int dtype) {
  if (dtype == F32) return silu_mul((const float*)gu, rows, inter, (float*)out);
  if (dtype == BF16) return silu_mul((const bf16*)gu, rows, inter, (bf16*)out);
  return -1;
}

// One query token per row b < B: qkv [B, H + 2 KV, D] (q heads, k heads, v heads: the fused projection's output),
// cos and sin [B, D] (the rope tables at each row's RoPE position); row b is in slot b % S of the cache, which holds
// element (s, j, p, i) of K at k_cache[s * slot_stride + j * head_stride + p * D + i] (V likewise), positions
// 0..max_len-1; every tensor but pos and tree in ``dtype``. S = B: one token a slot; B = T S: T tokens a slot,
// token-major (a draft chain at consecutive positions, or a draft tree's nodes). Writes every row's K (rotated) and
// V at p = pos[b], both bounded; then out [B, H * D] = per query head h (KV head h / (H/KV)) softmax of scale *
// q_h . K[p], times V, over p <= pos[b]: for each row what a decode step of its token alone gives. With ``tree``
// (uint8 [S or 1, T, T], slot s's at tree + s * tree_stride; tree_stride 0: one for every slot) the rows of a slot are
// its tree's nodes, node i at its root's position L + i, and attend over p < L and the nodes L + u its row marks
// (tree[i][u] != 0, every node marking itself). Returns 0, -1 on a bad argument, -2 out of memory.
int lp_decode_attention(const void* qkv, const void* cos, const void* sin, const int64_t* pos, int64_t b,
                        int64_t slots, const uint8_t* tree, int64_t tree_stride, int64_t h, int64_t kv, int64_t d,
                        void* k_cache, void* v_cache, int64_t slot_stride, int64_t head_stride, int64_t max_len,
                        float scale, void* out, int dtype) {
  if (dtype == F32)
    return decode_attention((const float*)qkv, (const float*)cos, (const float*)sin, pos, b, slots, tree,
                            tree_stride, h, kv, d, (float*)k_cache, (float*)v_cache, slot_stride, head_stride,
                            max_len, scale, (float*)out);
  if (dtype == BF16)
    return decode_attention((const bf16*)qkv, (const bf16*)cos, (const bf16*)sin, pos, b, slots, tree, tree_stride,
                            h, kv, d, (bf16*)k_cache, (bf16*)v_cache, slot_stride, head_stride, max_len, scale,
                            (bf16*)out);
  return -1;
}

// x [m, n] float32, contiguous: value[r] and index[r] of row r's largest logit (row_top). Returns 0, -1 on a bad
// argument.
int lp_row_top(const float* x, int64_t m, int64_t n, float* value, int64_t* index) {
  if (m < 0 || n <= 0 || n > INT32_MAX - kLanes) return -1;
#pragma omp parallel for schedule(static) if (m * n >= (int64_t(1) << 18))
  for (int64_t r = 0; r < m; ++r) row_top(x + r * n, n, value + r, index + r);
  return 0;
}

}  // extern "C"
