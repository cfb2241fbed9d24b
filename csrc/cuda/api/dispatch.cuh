// Launcher helpers shared by the forward and backward launch units: the atom x dtype x head-dim
// bucket x variant dispatch, grid arithmetic, dynamic shared memory opt-in.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <type_traits>

#include "common/params.h"
#include "cuda/kernels/configs.cuh"
#include "cuda/kernels/mma_atoms.cuh"
#include "kernel_path.h"

namespace flashv100 {
namespace cuda {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Calls f(Atom{}, Elem{}, std::integral_constant<int, bucket>{}, std::bool_constant<general>{})
// for the compiled kernel variant of this problem.
template <class F>
void dispatch(MmaAtom atom, at::ScalarType dtype, int64_t head_dim, bool general, F&& f) {
  auto by_head_dim = [&](auto atom_tag, auto elem_tag, auto general_tag) {
    switch (kern::head_dim_bucket(static_cast<int>(head_dim))) {
#define FLASHV100_CASE(D) \
  case D: f(atom_tag, elem_tag, std::integral_constant<int, D>{}, general_tag); break;
      FLASHV100_FOR_EACH_HEAD_DIM(FLASHV100_CASE)
#undef FLASHV100_CASE
      default: TORCH_CHECK(false, "flashv100: no kernel for head dim ", head_dim);
    }
  };
  auto by_variant = [&](auto atom_tag, auto elem_tag) {
    if (general) {
      by_head_dim(atom_tag, elem_tag, std::true_type{});
    } else {
      by_head_dim(atom_tag, elem_tag, std::false_type{});
    }
  };
  if (atom == MmaAtom::kVoltaM8N8K4) {
    by_variant(kern::VoltaAtom{}, kern::Fp16{});
  } else if (dtype == at::kHalf) {
    by_variant(kern::AmpereAtom{}, kern::Fp16{});
  } else {
    by_variant(kern::AmpereAtom{}, kern::Bf16{});
  }
}

// Masks and dropout need the general kernel variant, and so does a scale that is not positive
// (the plain variant takes row maxima of unscaled scores).
inline bool is_general(const ForwardParams& p) {
  return p.mask.kind != MaskKind::kNone || p.dropout.p > 0.0f || !(p.scale > 0.0);
}

// Opts a kernel into > 48 KB of dynamic shared memory (once per kernel and device is enough, but
// the call is cheap; do it per launch to stay correct across devices).
template <class Kernel>
inline void set_smem(Kernel kernel, int bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

}  // namespace cuda
}  // namespace flashv100
