// Counter-based dropout randomness shared by the CPU and CUDA kernels, so both devices drop the
// same elements for the same (seed, offset). No ATen.
//
// Philox4x32 with 7 rounds (Salmon et al., SC'11; the round count FlashAttention-2 uses for the
// same purpose, 3 fewer than the default's safety margin). One call yields four 32-bit words,
// i.e. eight 16-bit uniforms: the keep decisions of 8 elements of one attention row, namely the
// columns 32 b + 8 j + 2 t + e (j = 0..3, e = 0..1) of 32-column block b that share t. That is
// exactly what one lane of the sm_80 mma.m16n8k16 accumulator holds of a row across four
// fragments, so the fused kernels use every call whole; any other traversal (CPU, the mask
// kernel) just recomputes the call of each element.
// Column c uses 16-bit half (c & 1) of word (c >> 3) & 3. A 16-bit threshold resolves the drop
// probability to 2^-16 (|error| <= 2^-17 up to p = 1 - 2^-17, e.g. p = 0.1 drops with
// probability 0.100006).
#pragma once

#include "common/fixed_width_types.h"

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define FLASHV100_PHILOX_FN __host__ __device__ __forceinline__
#else
#define FLASHV100_PHILOX_FN inline
#endif

namespace flashv100 {

struct Philox4 {
  uint32_t x, y, z, w;
};

FLASHV100_PHILOX_FN uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // One IMAD.WIDE.U32 either way, but the 64-bit product also makes ptxas add a zero high word
  // to every hi (one wasted integer instruction per multiply).
  *hi = __umulhi(a, b);
  return a * b;
#else
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
#endif
}

FLASHV100_PHILOX_FN Philox4 philox4x32_7(Philox4 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#pragma unroll
#endif
  for (int round = 0; round < 7; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(kMul0, counter.x, &hi0);
    const uint32_t lo1 = mulhilo32(kMul1, counter.z, &hi1);
    counter = Philox4{hi1 ^ counter.y ^ key0, lo1, hi0 ^ counter.w ^ key1, lo0};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// Drop threshold on a 16-bit uniform: keep iff bits >= threshold. round(p * 2^16), at most
// 2^16 - 1 (so that threshold << 16 fits the 32-bit compare of the kernels; p in [0, 1) only
// reaches 2^16 above 1 - 2^-17, where this keeps with probability 2^-16 instead of 0).
FLASHV100_PHILOX_FN uint32_t dropout_threshold(float p) {
  const uint32_t rounded = static_cast<uint32_t>(static_cast<double>(p) * 65536.0 + 0.5);
  return rounded < 65535u ? rounded : 65535u;
}

// The per-run part of every call: the key and the counter word the (seed, offset) pair sets.
struct DropoutStream {
  uint32_t key0, key1, offset_word;
  FLASHV100_PHILOX_FN DropoutStream(uint64_t seed, uint64_t offset)
      : key0(static_cast<uint32_t>(seed)),
        key1(static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32)),
        offset_word(static_cast<uint32_t>(offset)) {}
};

// The Philox call holding the bits of element (row, col) of head `batch_head` (= b * Hq + h).
FLASHV100_PHILOX_FN Philox4 dropout_call(const DropoutStream& stream, uint64_t batch_head,
                                           uint64_t row, uint64_t col) {
  const uint32_t group = static_cast<uint32_t>(((col >> 5) << 2) | ((col >> 1) & 3));
  const Philox4 counter{group, static_cast<uint32_t>(row), static_cast<uint32_t>(batch_head),
                        stream.offset_word};
  return philox4x32_7(counter, stream.key0, stream.key1);
}

// Word `index` (0..3) of a call: the 16-bit uniforms of columns 8 index + 2 t + {0, 1}.
FLASHV100_PHILOX_FN uint32_t philox_word(const Philox4& bits, int index) {
  return index == 0 ? bits.x : index == 1 ? bits.y : index == 2 ? bits.z : bits.w;
}

// The 16-bit uniform of column `col` in its call.
FLASHV100_PHILOX_FN uint32_t dropout_uniform16(const Philox4& bits, uint64_t col) {
  return (philox_word(bits, static_cast<int>((col >> 3) & 3)) >> (16 * (col & 1))) & 0xFFFFu;
}

}  // namespace flashv100
