// Per-block problem geometry shared by the forward and backward kernels: which batch/head a block
// works on, where its tensors start, and which keys each query row may see (causal alignment).
#pragma once

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

}  // namespace kern
}  // namespace flashv100
