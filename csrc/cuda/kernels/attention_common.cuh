// Per-block problem geometry shared by the forward and backward kernels: which batch/head a block
// works on, where its tensors start, and which keys each query row may see (causal alignment).
#pragma once

#include "common/philox.h"
#include "cuda/kernels/configs.cuh"

namespace flashv100 {
namespace kern {

__device__ __forceinline__ const uint16_t* head_ptr(const void* base, const TensorStrides& st,
                                                    int64_t b, int64_t h, int64_t row) {
  return static_cast<const uint16_t*>(base) + b * st.batch + h * st.head + row * st.row;
}
__device__ __forceinline__ uint16_t* head_ptr(void* base, const TensorStrides& st, int64_t b,
                                              int64_t h, int64_t row) {
  return static_cast<uint16_t*>(base) + b * st.batch + h * st.head + row * st.row;
}

// Key j is visible from query i iff j < len_kv and (no causality or j <= i + shift).
struct Visibility {
  int len_q, len_kv;
  bool causal;
  int shift;  // 0 for top-left, len_kv - len_q for bottom-right

  __device__ __forceinline__ explicit Visibility(const ForwardParams& p)
      : len_q(static_cast<int>(p.shape.len_q)),
        len_kv(static_cast<int>(p.shape.len_kv)),
        causal(p.causal != CausalMode::kNone),
        shift(p.causal == CausalMode::kBottomRight ? len_kv - len_q : 0) {}

  __device__ __forceinline__ bool visible(int i, int j) const {
    return j < len_kv && (!causal || j <= i + shift);
  }
  // Keys [0, key_end) can be visible from some query row in [row_begin, row_end).
  __device__ __forceinline__ int key_end(int row_end) const {
    const int last_row = min(row_end, len_q) - 1;
    return causal ? max(0, min(len_kv, last_row + shift + 1)) : len_kv;
  }
  // First query row that can see some key in [key_begin, ...).
  __device__ __forceinline__ int row_begin(int key_begin) const {
    return causal ? max(0, key_begin - shift) : 0;
  }
  // Does the (rows x keys) tile need per-element masking?
  __device__ __forceinline__ bool tile_needs_mask(int row0, int key0, int key_count) const {
    return key0 + key_count > len_kv || (causal && key0 + key_count - 1 > row0 + shift);
  }
};

// attn_mask of one (batch, head) as an additive bias in natural-log units: bool masks read as 0
// (keep) or -inf (drop). Broadcast dims have stride 0; any float dtype is read and widened here.
struct HeadMask {
  const char* base = nullptr;  // nullptr: no mask
  ScalarKind dtype = ScalarKind::kBool;
  int64_t row_stride = 0, col_stride = 0;

  __device__ __forceinline__ HeadMask(const MaskParams& m, int64_t b, int64_t h) {
    if (m.kind == MaskKind::kNone) return;
    const int64_t elem = m.dtype == ScalarKind::kDouble  ? 8
                         : m.dtype == ScalarKind::kFloat ? 4
                         : m.dtype == ScalarKind::kBool  ? 1
                                                         : 2;
    base = static_cast<const char*>(m.ptr) + (b * m.batch_stride + h * m.head_stride) * elem;
    dtype = m.dtype;
    row_stride = m.row_stride;
    col_stride = m.col_stride;
  }
  __device__ __forceinline__ bool present() const { return base != nullptr; }

  __device__ __forceinline__ float bias(int i, int j) const {
    const int64_t idx = i * row_stride + j * col_stride;
    if (dtype == ScalarKind::kBool) return reinterpret_cast<const uint8_t*>(base)[idx] ? 0.0f : neg_inf();
    if (dtype == ScalarKind::kHalf) return Fp16::to_float(reinterpret_cast<const uint16_t*>(base)[idx]);
    if (dtype == ScalarKind::kBFloat16) return Bf16::to_float(reinterpret_cast<const uint16_t*>(base)[idx]);
    if (dtype == ScalarKind::kFloat) return reinterpret_cast<const float*>(base)[idx];
    return static_cast<float>(reinterpret_cast<const double*>(base)[idx]);
  }
};

// Dropout on attention probabilities with the Philox keep bits of common/philox.h. Seed and offset
// come from device memory when the launcher passes pointers (CUDA graph capture, and the backward
// reading the forward's rng_state).
struct Dropout {
  bool enabled;
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;
  float inv_keep = 1.0f;

  __device__ __forceinline__ explicit Dropout(const DropoutParams& d) : enabled(d.p > 0.0f) {
    if (!enabled) return;
    seed = d.seed_ptr != nullptr ? static_cast<uint64_t>(*d.seed_ptr) : d.seed;
    offset = d.offset_ptr != nullptr ? static_cast<uint64_t>(*d.offset_ptr) + d.offset_intragraph
                                     : d.offset;
    threshold = dropout_threshold(d.p);
    inv_keep = 1.0f / (1.0f - d.p);
  }
  // Multipliers (0 or 1 / (1 - p)) of elements (row, col) and (row, col + 1); col is even, so both
  // come from one Philox call.
  __device__ __forceinline__ void factors(int64_t batch_head, int row, int col, float& f0,
                                          float& f1) const {
    const Philox4 bits = dropout_bits(seed, offset, batch_head, row, col);
    f0 = philox_word(bits, col & 3) >= threshold ? inv_keep : 0.0f;
    f1 = philox_word(bits, (col & 3) + 1) >= threshold ? inv_keep : 0.0f;
  }
};

}  // namespace kern
}  // namespace flashv100
