// The dropout keep mask of philox.h materialized as bool [B, H, L, S] (contiguous), for the
// fallback path and for tests. Seed and offset are read on the device from rng_state = {seed,
// offset}, so the kernel is safe under CUDA graph capture.
#pragma once

#include "common/philox.h"

namespace flashv100 {
namespace kern {

// One thread per Philox call: row, 32-column block b and column group t, whose 8 uniforms
// decide the columns 32 b + 8 j + 2 t + e (common/philox.h). This materialization is for tests
// and the fallback, not a hot path.
__global__ void __launch_bounds__(256)
    dropout_mask_kernel(const int64_t* rng_state, uint8_t* keep, int64_t rows, int64_t len_q,
                        int64_t len_kv, uint32_t threshold) {
  const int64_t calls_per_row = (len_kv + 31) / 32 * 4;
  const DropoutStream stream(static_cast<uint64_t>(rng_state[0]),
                             static_cast<uint64_t>(rng_state[1]));
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       idx < rows * calls_per_row; idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / calls_per_row, call = idx % calls_per_row;
    const int64_t col0 = (call / 4) * 32 + (call % 4) * 2;  // j = 0, e = 0 of the call
    const Philox4 bits = dropout_call(stream, row / len_q, row % len_q, col0);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t col = col0 + 8 * j + e;
        if (col < len_kv) keep[row * len_kv + col] = dropout_uniform16(bits, col) >= threshold;
      }
  }
}

}  // namespace kern
}  // namespace flashv100
