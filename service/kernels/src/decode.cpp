// loraplex native kernels: a whole decode step in one call, of a float32 model on 4-bit or dense weights or of a
// bfloat16 model on dense weights or weights in pairs.
//
//   lp_decode_stack  every layer of one decode step (one token per row): per layer residual add + RMSNorm, the
//                    fused q/k/v product, RoPE + K/V write + attention, the output product, add + RMSNorm, the
//                    gate/up product, SiLU * up and the down product; then the final add + RMSNorm. Or T tokens
//                    per row at consecutive positions (a prefill, a draft chain or tree to verify): the products over
//                    all T x B rows at once, the attention in one call, each token as its decode step would run
//
// It runs the same entry points the per-op path calls from Python (blocks.cpp's lp_q4_matmul, dense.cpp's
// lp_dense_matmul, pairs.cpp's lp_pairs_matmul, step.cpp's lp_add_rmsnorm, lp_decode_attention and lp_silu_mul)
// in the same order on the same values, in the model's dtype (the residual stream float32, as there), so its output
// is bit-identical to that path's; what it removes is the interpreter between them: about 250 calls a step, each
// paying argument checks, a tensor allocation and a ctypes crossing (about 8 ms of a 20 ms step on an AVX2 EPYC,
// bench/README.md). LoRA rows take lora.cpp's lp_lora_delta after each product, with the tables the per-op path
// would pass. service/model/decode_stack.py decides when it applies (no bias, every projection a Q4Native, a
// Bf16Pairs or a dense weight of the model's dtype below its threshold, adapters only through the compiled LoRA
// tables) and lays out the tables of pointers.

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "dtypes.h"

extern "C" {
int lp_q4_matmul_ahead(const void* x, int x_dtype, const uint8_t* qs, const float* d, const float* mn, int64_t m,
                       int64_t n, int64_t k, void* out, int out_dtype, int64_t ldo, const void* const* ahead,
                       const int64_t* ahead_bytes, int nahead);
int lp_dense_matmul(const void* x, int x_dtype, const void* w, int w_dtype, int64_t m, int64_t n, int64_t k,
                    int64_t ldw, void* out, int out_dtype, int64_t ldo);
int lp_pairs_matmul_ahead(const void* x, const void* w, int64_t m, int64_t n, int64_t k, void* out, int out_dtype,
                          int64_t ldo, const void* const* ahead, const int64_t* ahead_bytes, int nahead);
int lp_add_rmsnorm(float* x, const void* y, const void* w, int64_t rows, int64_t n, float eps, void* out, int dtype);
int lp_silu_mul(const void* gu, int64_t rows, int64_t inter, void* out, int dtype);
int lp_decode_attention(const void* qkv, const void* cos, const void* sin, const int64_t* pos, int64_t b,
                        int64_t slots, const uint8_t* tree, int64_t tree_stride, int64_t h, int64_t kv, int64_t d,
                        void* k_cache, void* v_cache, int64_t slot_stride, int64_t head_stride, int64_t max_len,
                        float scale, void* out, int dtype);
int lp_lora_delta(const void* x, int x_dtype, int64_t b, int64_t t, int64_t in, const int64_t* group, int64_t groups,
                  const void* a, int w_dtype, int64_t a_sg, int64_t a_sr, int64_t a_sk, int64_t width, int64_t nseg,
                  const int64_t* seg, const void* const* bt, const float* const* scale, const void* const* bias,
                  void* out, int64_t out_cols);
}

namespace {

using lp::F32;
using lp::BF16;

// One row of the layer table: the addresses (as integers) of a layer's weights, in this order.
enum Field : int {
  kAttnNorm,  // [hidden] in the model's dtype
  kFfnNorm,   // [hidden]
  // Each projection: Q4 nibble pairs, d, m (see lp_q4_matmul; float32 models), a dense weight [N, K] in the
  // model's dtype, 0, 0, or a bf16 weight in pairs (see lp_pairs_matmul; bf16 models), 0, kPairs.
  kQkvQs, kQkvD, kQkvM,  // [(H + 2 KV) D, hidden]
  kWoQs, kWoD, kWoM,     // [hidden, H D]
  kW13Qs, kW13D, kW13M,  // [2 I, hidden]
  kW2Qs, kW2D, kW2M,     // [hidden, I]
  kFields
};

// One (layer, projection) LoRA table as lp_lora_delta reads it (service.kernels.lora.LoraSite.fields), in this order.
enum LoraField : int { kA, kWDtype, kASg, kASr, kASk, kWidth, kNseg, kSeg, kBt, kScale, kBias, kGroups, kLoraFields };

constexpr int64_t kPairs = 1;  // a projection's third field when its weight is in pairs

template <typename T>
inline const T* at(const int64_t* row, int field) {
  return reinterpret_cast<const T*>(row[field]);
}

constexpr int kMaxAhead = 8;

// The groups [first, last] of a table the rows use (a kept set's table may hold adapters no row has).
struct Used {
  int64_t first, last;
};

// The product of a layer's projection in ``dtype``: a dense weight's (its d field 0, m field 0), a bf16 weight's in
// pairs (d 0, m 1), or a Q4 weight's (float32); the last two requesting into the caches as they compute the LoRA
// tables (``site``, null: none) that the call after it reads: A's extent and each module's Bt over the groups
// ``used``, in the tables' dtype (float32 or bf16).
inline int product(const int64_t* row, int field, const void* x, int dtype, int64_t m, int64_t n, int64_t k, void* out,
                   const int64_t* site, Used used) {
  const bool pairs = row[field + 1] == 0 && row[field + 2] == kPairs;
  if (row[field + 1] == 0 && !pairs)
    return lp_dense_matmul(x, dtype, at<void>(row, field), dtype, m, n, k, k, out, dtype, n);
  if (dtype != (pairs ? BF16 : F32)) return -1;
  const void* ahead[kMaxAhead];
  int64_t bytes[kMaxAhead];
  int nahead = 0;
  if (site != nullptr && site[kNseg] < kMaxAhead && used.first <= used.last && used.last < site[kGroups]) {
    const int64_t es = site[kWDtype] == F32 ? 4 : 2, groups = used.last - used.first + 1;
    ahead[nahead] = at<char>(site, kA) + used.first * site[kASg] * es;
    bytes[nahead++] = ((groups - 1) * site[kASg] + (site[kWidth] - 1) * site[kASr] + (k - 1) * site[kASk] + 1) * es;
    const int64_t* seg = at<int64_t>(site, kSeg);
    const char* const* bt = at<const char*>(site, kBt);
    for (int64_t j = 0; j < site[kNseg]; ++j) {
      const int64_t group_bytes = seg[4 * j + 1] * seg[4 * j + 3] * es;
      ahead[nahead] = bt[j] + used.first * group_bytes;
      bytes[nahead++] = groups * group_bytes;
    }
  }
  if (pairs) return lp_pairs_matmul_ahead(x, at<void>(row, field), m, n, k, out, dtype, n, ahead, bytes, nahead);
  return lp_q4_matmul_ahead(x, F32, at<uint8_t>(row, field), at<float>(row, field + 1), at<float>(row, field + 2), m,
                            n, k, out, F32, n, ahead, bytes, nahead);
}

// Rows [lo, hi) of out [B, n] += their LoRA deltas from x [B, in] (site null: the projection has none), both in
// ``dtype`` (es bytes an element).
inline int lora(const int64_t* site, const char* x, int64_t in, char* out, int64_t n, int64_t lo, int64_t hi,
                const int64_t* group, int dtype, int64_t es) {
  if (site == nullptr || hi <= lo) return 0;
  return lp_lora_delta(x + lo * in * es, dtype, hi - lo, 1, in, group, site[kGroups], at<void>(site, kA),
                       (int)site[kWDtype], site[kASg], site[kASr], site[kASk], site[kWidth], site[kNseg],
                       at<int64_t>(site, kSeg), at<const void*>(site, kBt), at<const float*>(site, kScale),
                       at<const void*>(site, kBias), out + lo * n * es, n);
}

}  // namespace

extern "C" {

int lp_decode_fields() { return kFields; }
int lp_decode_lora_fields() { return kLoraFields; }

// One decode step of B rows, T tokens each, through ``layers`` layers, in ``dtype`` (float32 or bf16: the weights,
// norms, rope tables, cache and out; the residual stream x is float32 in either). x [T, B, hidden] float32
// (token-major: token t of every row, then token t + 1): the embedded tokens on entry, the residual stream (before
// the final add) on return; out [T, B, hidden]: the final-normed hidden states. table [layers, kFields]: each
// layer's weights (Field). dims: hidden, heads, kv heads, head dim, intermediate. cos, sin [T, B, D] and pos [T, B]:
// each token's rope tables and cache position (token t + 1 of a row at its token t's position + 1). Every token's
// K/V is written before any token attends, each to the positions up to its own, so every token's result is the one
// T decode steps in turn would give: the products are batch-invariant. With ``tree`` (lp_decode_attention's: uint8
// [B or 1, T, T], tree_stride elements apart) the T tokens of a row are a draft tree's nodes: each attends to the
// positions below its root and to the nodes it marks, and gets what a decode step after its ancestors would give.
// The cache of layer i holds K of row b, kv head j, position p at kv_base + i * layer_stride + b * slot_stride + j *
// head_stride + p * D, V at that + v_offset (elements). LoRA (sites null: none): sites [layers, 4] the addresses of
// each (layer, projection)'s LoraField row (0: no table), applied to rows [lo, hi) of every token with group
// [hi - lo] (lp_lora_delta's) after the product, as the per-op path's AdapterBatch.add_delta does. Returns 0, or the
// first failing op's code (-1 a bad argument, -2 out of memory).
int lp_decode_stack(float* x, int64_t b, int64_t t, const int64_t* table, int64_t layers, const int64_t* dims,
                    const void* final_norm, float eps, const void* cos, const void* sin, const int64_t* pos,
                    const uint8_t* tree, int64_t tree_stride, void* kv_base, int64_t layer_stride, int64_t v_offset,
                    int64_t slot_stride, int64_t head_stride, int64_t max_len, float scale, void* out,
                    const int64_t* sites, int64_t lo, int64_t hi, const int64_t* group, int dtype) {
  const int64_t hidden = dims[0], heads = dims[1], kv = dims[2], d = dims[3], inter = dims[4];
  if (b <= 0 || t <= 0 || layers <= 0 || hidden <= 0 || heads <= 0 || kv <= 0 || heads % kv || d <= 0 || inter <= 0)
    return -1;
  if (sites != nullptr && (lo < 0 || hi > b || lo > hi || group == nullptr)) return -1;
  if (dtype != F32 && dtype != BF16) return -1;
  const int64_t es = dtype == F32 ? 4 : 2;  // bytes an element
  const int64_t width = (heads + 2 * kv) * d, qcols = heads * d, m = t * b;  // m: rows of every product
  // one scratch block: h [M, hidden], y [M, hidden], qkv [M, width], att [M, H D], gu [M, 2 I], act [M, I]
  const int64_t sizes[] = {hidden, hidden, width, qcols, 2 * inter, inter};
  int64_t total = 0;
  for (int64_t s : sizes) total += m * s;
  char* block = static_cast<char*>(std::malloc(es * total));
  if (block == nullptr) return -2;
  char* h = block;
  char* y = h + m * hidden * es;
  char* qkv = y + m * hidden * es;
  char* att = qkv + m * width * es;
  char* gu = att + m * qcols * es;
  char* act = gu + m * 2 * inter * es;
  // LoRA rows of every token: [lo, (T - 1) B + hi) of the token-major batch, row r's group that of its row r % B
  // (-1, left alone, outside [lo, hi)), so one lp_lora_delta call a product reads each adapter's tables once.
  int64_t lora_hi = hi;
  int64_t* token_groups = nullptr;
  if (sites != nullptr && t > 1 && hi > lo) {
    lora_hi = (t - 1) * b + hi;
    token_groups = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (lora_hi - lo)));
    if (token_groups == nullptr) {
      std::free(block);
      return -2;
    }
    for (int64_t r = lo; r < lora_hi; ++r) token_groups[r - lo] = r % b >= lo && r % b < hi ? group[r % b - lo] : -1;
  }
  const int64_t* lora_group = token_groups != nullptr ? token_groups : group;
  Used used{INT64_MAX, -1};
  for (int64_t r = 0; sites != nullptr && r < hi - lo; ++r)
    if (group[r] >= 0) used.first = std::min(used.first, group[r]), used.last = std::max(used.last, group[r]);
  int rc = 0;
  for (int64_t i = 0; i < layers && rc == 0; ++i) {
    const int64_t* row = table + i * kFields;
    const int64_t* site[4] = {nullptr, nullptr, nullptr, nullptr};  // wqkv, wo, w13, w2
    for (int j = 0; sites != nullptr && j < 4; ++j) site[j] = reinterpret_cast<const int64_t*>(sites[i * 4 + j]);
    char* k_cache = static_cast<char*>(kv_base) + i * layer_stride * es;
    rc = lp_add_rmsnorm(x, i ? y : nullptr, at<void>(row, kAttnNorm), m, hidden, eps, h, dtype);
    if (!rc) rc = product(row, kQkvQs, h, dtype, m, width, hidden, qkv, site[0], used);
    if (!rc) rc = lora(site[0], h, hidden, qkv, width, lo, lora_hi, lora_group, dtype, es);
    if (!rc)  // every token's K/V in place before any token attends, each to its own positions
      rc = lp_decode_attention(qkv, cos, sin, pos, m, b, tree, tree_stride, heads, kv, d, k_cache,
                               k_cache + v_offset * es, slot_stride, head_stride, max_len, scale, att, dtype);
    if (!rc) rc = product(row, kWoQs, att, dtype, m, hidden, qcols, y, site[1], used);
    if (!rc) rc = lora(site[1], att, qcols, y, hidden, lo, lora_hi, lora_group, dtype, es);
    if (!rc) rc = lp_add_rmsnorm(x, y, at<void>(row, kFfnNorm), m, hidden, eps, h, dtype);
    if (!rc) rc = product(row, kW13Qs, h, dtype, m, 2 * inter, hidden, gu, site[2], used);
    if (!rc) rc = lora(site[2], h, hidden, gu, 2 * inter, lo, lora_hi, lora_group, dtype, es);
    if (!rc) rc = lp_silu_mul(gu, m, inter, act, dtype);
    if (!rc) rc = product(row, kW2Qs, act, dtype, m, hidden, inter, y, site[3], used);
    if (!rc) rc = lora(site[3], act, inter, y, hidden, lo, lora_hi, lora_group, dtype, es);
  }
  if (!rc) rc = lp_add_rmsnorm(x, y, final_norm, m, hidden, eps, out, dtype);
  std::free(token_groups);
  std::free(block);
  return rc;
}

}  // extern "C"
