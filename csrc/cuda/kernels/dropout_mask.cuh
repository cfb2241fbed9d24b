// Materialises the dropout keep-mask that the fused kernels apply, for tests and debugging:
// keep[bh, i, j] = philox bits of (bh, i, j) >= threshold (common/philox.h). Device-only.
#pragma once

#include "common/philox.h"

namespace flashv100 {

// One thread per group of four columns (one Philox call) of one row of one (batch, head).
__global__ void dropout_keep_mask_kernel(bool* __restrict__ keep, int64_t rows, int64_t len_q,
                                         int64_t len_kv, uint32_t threshold, uint64_t seed,
                                         uint64_t offset) {
  const int64_t groups_per_row = (len_kv + 3) / 4;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= rows * groups_per_row) return;
  const int64_t row_id = index / groups_per_row;
  const int64_t col = (index % groups_per_row) * 4;
  const Philox4 bits = dropout_bits(seed, offset, row_id / len_q, row_id % len_q, col);
  bool* out = keep + row_id * len_kv;
#pragma unroll
  for (int word = 0; word < 4; ++word) {
    if (col + word < len_kv) out[col + word] = philox_word(bits, word) >= threshold;
  }
}

}  // namespace flashv100
