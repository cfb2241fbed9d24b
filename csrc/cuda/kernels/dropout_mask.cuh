// The dropout keep mask of philox.h materialized as bool [B, H, L, S] (contiguous), for the
// fallback path and for tests. Seed and offset are read on the device from rng_state = {seed,
// offset}, so the kernel is safe under CUDA graph capture.
#pragma once

#include "common/philox.h"

namespace flashv100 {
namespace kern {

// One thread per group of 4 columns: one Philox call yields the bits of 4 neighbouring elements.
__global__ void __launch_bounds__(256)
    dropout_mask_kernel(const int64_t* rng_state, uint8_t* keep, int64_t rows, int64_t len_q,
                        int64_t len_kv, uint32_t threshold) {
  const int64_t groups_per_row = (len_kv + 3) / 4;
  const uint64_t seed = static_cast<uint64_t>(rng_state[0]);
  const uint64_t offset = static_cast<uint64_t>(rng_state[1]);
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       idx < rows * groups_per_row; idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / groups_per_row, col0 = (idx % groups_per_row) * 4;
    const Philox4 bits = dropout_bits(seed, offset, row / len_q, row % len_q, col0);
#pragma unroll
    for (int x = 0; x < 4; ++x)
      if (col0 + x < len_kv) keep[row * len_kv + col0 + x] = philox_word(bits, x) >= threshold;
  }
}

}  // namespace kern
}  // namespace flashv100
