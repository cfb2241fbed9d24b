// The mask pre-pass: for masks broadcast over query rows (padding masks such as [B, 1, 1, S]),
// one block per (batch, query head) reads the head's single mask row and writes its
// MaskParams::key_range code, so that the attention kernels skip the keys it drops and, when it
// keeps a prefix of keys with bias 0, read no mask entry at all.
#pragma once

#include "cuda/kernels/attention_common.cuh"

namespace flashv100 {
namespace kern {

constexpr int kMaskKeyRangeThreads = 256;

__global__ void __launch_bounds__(kMaskKeyRangeThreads)
    flash_mask_key_range_kernel(const ForwardParams p, int32_t* key_range) {
  constexpr int kWarps = kMaskKeyRangeThreads / 32;
  static __shared__ int warp_last_kept[kWarps], warp_first_other[kWarps];
  const int64_t b = blockIdx.x / p.shape.heads_q, h = blockIdx.x % p.shape.heads_q;
  MaskParams facts_free = p.mask;
  facts_free.key_range = nullptr;  // read every entry
  const HeadMask mask(facts_free, b, h, p.shape.heads_q);
  const int len_kv = static_cast<int>(p.shape.len_kv);
  // The last key not dropped, and the first key dropped or biased.
  int last_kept = -1, first_other = len_kv;
  for (int j = threadIdx.x; j < len_kv; j += kMaskKeyRangeThreads) {
    const float x = mask.bias(0, j);
    if (x != neg_inf()) last_kept = j;
    if (x != 0.0f) first_other = min(first_other, j);
  }
#pragma unroll
  for (int bit = 16; bit > 0; bit >>= 1) {
    last_kept = max(last_kept, __shfl_xor_sync(0xffffffffu, last_kept, bit));
    first_other = min(first_other, __shfl_xor_sync(0xffffffffu, first_other, bit));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) warp_last_kept[warp] = last_kept, warp_first_other[warp] = first_other;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kWarps; ++w) {
    last_kept = max(last_kept, warp_last_kept[w]);
    first_other = min(first_other, warp_first_other[w]);
  }
  const int end = last_kept + 1;
  key_range[blockIdx.x] = first_other >= end ? end : -end - 1;
}

}  // namespace kern
}  // namespace flashv100
