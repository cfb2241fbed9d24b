// Element types of the fused kernels and their float conversions. Device-only, no CUDA headers:
// 16-bit values travel as raw bits (uint16_t / packed pairs in uint32_t), so the same code builds
// with nvcc and with NVRTC (which has no cuda_fp16.h by default).
#pragma once

#include "common/params.h"

namespace flashv100 {
namespace kern {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define FLASHV100_SM80 1
#else
#define FLASHV100_SM80 0
#endif

struct Fp16 {
  static constexpr bool kIsBf16 = false;
  static __device__ __forceinline__ float to_float(uint16_t bits) {
#if defined(FLASHV100_HOST_EMULATION)
    return emulated_half_to_float(bits);
#else
    float out;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(out) : "h"(bits));
    return out;
#endif
  }
  static __device__ __forceinline__ uint16_t from_float(float x) {
#if defined(FLASHV100_HOST_EMULATION)
    return emulated_float_to_half(x);
#else
    uint16_t out;
    asm("{ .reg .f16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(out) : "f"(x));
    return out;
#endif
  }
};

struct Bf16 {
  static constexpr bool kIsBf16 = true;
  static __device__ __forceinline__ float to_float(uint16_t bits) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  }
  // Round to nearest even; NaN stays NaN. Written in integer math so it also builds for sm_70.
  static __device__ __forceinline__ uint16_t from_float(float x) {
    const uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

template <class Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(Elem::from_float(lo)) |
         (static_cast<uint32_t>(Elem::from_float(hi)) << 16);
}

template <class Elem>
__device__ __forceinline__ float low_float(uint32_t pair) {
  return Elem::to_float(static_cast<uint16_t>(pair & 0xffffu));
}

template <class Elem>
__device__ __forceinline__ float high_float(uint32_t pair) {
  return Elem::to_float(static_cast<uint16_t>(pair >> 16));
}

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

// The base a row's scores are exponentiated against, given its running max: a row that has seen
// no visible key keeps max -inf and uses 0, so that exp(-inf - base) is 0 instead of NaN.
__device__ __forceinline__ float softmax_base(float row_max) {
  return row_max == neg_inf() ? 0.0f : row_max;
}

// The host emulation of the kernels (tests/atoms/cuda_host_emulation.h) takes exact host math.
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(FLASHV100_HOST_EMULATION)
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

__device__ __forceinline__ float fast_log2(float x) {
#if defined(FLASHV100_HOST_EMULATION)
  return log2f(x);
#else
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

__device__ __forceinline__ float fast_rcp(float x) {
#if defined(FLASHV100_HOST_EMULATION)
  return 1.0f / x;
#else
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// tanh(x) = 1 - 2 / (e^2x + 1) to about 1e-7 absolute on every arch (sm_70 has no tanh.approx,
// whose 2^-11 relative error would also move softcapped scores by up to softcap * 2^-11).
__device__ __forceinline__ float fast_tanh(float x) {
  return 1.0f - 2.0f * fast_rcp(fast_exp2(x * (2.0f * kLog2e)) + 1.0f);
}

}  // namespace kern
}  // namespace flashv100
