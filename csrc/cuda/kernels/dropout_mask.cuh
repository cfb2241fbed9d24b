// The dropout keep mask of philox.h materialized as bool [B, H, L, S] (contiguous), for the
// fallback path and for tests. Seed and offset are read on the device from rng_state = {seed,
// offset}, so the kernel is safe under CUDA graph capture.
#pragma once

#include "common/philox.h"

namespace flashv100 {
namespace kern {

// One thread per 8 consecutive columns. Their bits come from four Philox calls (the column
// groups of philox.h); this materialization is for tests and the fallback, not a hot path.
__global__ void __launch_bounds__(256)
    dropout_mask_kernel(const int64_t* rng_state, uint8_t* keep, int64_t rows, int64_t len_q,
                        int64_t len_kv, uint32_t threshold) {
  const int64_t groups_per_row = (len_kv + 7) / 8;
  const uint64_t seed = static_cast<uint64_t>(rng_state[0]);
  const uint64_t offset = static_cast<uint64_t>(rng_state[1]);
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       idx < rows * groups_per_row; idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / groups_per_row, col0 = (idx % groups_per_row) * 8;
#pragma unroll
    for (int x = 0; x < 8; x += 2) {
      const Philox4 bits = dropout_call(seed, offset, row / len_q, row % len_q, col0 + x);
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (col0 + x + e < len_kv)
          keep[row * len_kv + col0 + x + e] = dropout_uniform16(bits, col0 + x + e) >= threshold;
    }
  }
}

}  // namespace kern
}  // namespace flashv100
