// Counter-based dropout randomness shared by the CPU and CUDA kernels, so both devices drop the
// same elements for the same (seed, offset). Philox4x32-10 (Salmon et al., SC'11). No ATen.
#pragma once

#include "common/fixed_width_types.h"

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define FLASHV100_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASHV100_HOST_DEVICE inline
#endif

namespace flashv100 {

struct Philox4 {
  uint32_t x, y, z, w;
};

FLASHV100_HOST_DEVICE uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
}

FLASHV100_HOST_DEVICE Philox4 philox4x32_10(Philox4 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(kMul0, counter.x, &hi0);
    const uint32_t lo1 = mulhilo32(kMul1, counter.z, &hi1);
    counter = Philox4{hi1 ^ counter.y ^ key0, lo1, hi0 ^ counter.w ^ key1, lo0};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// Threshold on a uniform uint32 below which an element is dropped: keep iff bits >= threshold.
FLASHV100_HOST_DEVICE uint32_t dropout_threshold(float p) {
  const double scaled = static_cast<double>(p) * 4294967296.0;
  return scaled >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(scaled);
}

// Random bits for the four columns [4 * (col / 4), 4 * (col / 4) + 4) of one attention row.
// `batch_head` = b * Hq + h. Element c of the row uses word (c % 4) of the result.
FLASHV100_HOST_DEVICE Philox4 dropout_bits(uint64_t seed, uint64_t offset, uint64_t batch_head,
                                           uint64_t row, uint64_t col) {
  const Philox4 counter{static_cast<uint32_t>(col >> 2), static_cast<uint32_t>(row),
                        static_cast<uint32_t>(batch_head), static_cast<uint32_t>(offset)};
  return philox4x32_10(counter, static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32));
}

FLASHV100_HOST_DEVICE uint32_t philox_word(const Philox4& bits, int index) {
  return index == 0 ? bits.x : index == 1 ? bits.y : index == 2 ? bits.z : bits.w;
}

}  // namespace flashv100
