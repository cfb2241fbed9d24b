// Launcher helpers shared by the forward and backward launch units: the atom x dtype x head-dim
// bucket x variant dispatch, grid arithmetic, facts asked of the runtime once per kernel and
// device (shared-memory opt-in, occupancy, dependent launch).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common/params.h"
#include "cuda/kernels/configs.cuh"
#include "cuda/kernels/mma_atoms.cuh"
#include "kernel_path.h"

namespace flashv100 {
namespace cuda {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <kern::Variant V>
using VariantTag = std::integral_constant<kern::Variant, V>;

// Calls f(std::integral_constant<int, bucket>{}) for the head-dim bucket of head_dim.
template <class F>
void with_head_dim_bucket(int64_t head_dim, F&& f) {
  switch (kern::head_dim_bucket(static_cast<int>(head_dim))) {
#define FLASHV100_CASE(D) \
  case D: f(std::integral_constant<int, D>{}); break;
    FLASHV100_FOR_EACH_HEAD_DIM(FLASHV100_CASE)
#undef FLASHV100_CASE
    default: TORCH_CHECK(false, "flashv100: no kernel for head dim ", head_dim);
  }
}

// Calls f(Atom{}, Elem{}, std::integral_constant<int, D>{}, VariantTag<variant>{}) for the
// compiled kernel of this problem in head-dim bucket D (launch units of one bucket).
template <int D, class F>
void dispatch_head_dim(MmaAtom atom, at::ScalarType dtype, kern::Variant variant, F&& f) {
  auto by_variant = [&](auto atom_tag, auto elem_tag) {
    const std::integral_constant<int, D> dim{};
    switch (variant) {
      case kern::Variant::kPlain:
        f(atom_tag, elem_tag, dim, VariantTag<kern::Variant::kPlain>{});
        break;
      case kern::Variant::kMasked:
        f(atom_tag, elem_tag, dim, VariantTag<kern::Variant::kMasked>{});
        break;
      case kern::Variant::kDropout:
        f(atom_tag, elem_tag, dim, VariantTag<kern::Variant::kDropout>{});
        break;
      case kern::Variant::kMaskedDropout:
        f(atom_tag, elem_tag, dim, VariantTag<kern::Variant::kMaskedDropout>{});
        break;
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

// Masks need the general score math, and so do softcap and ALiBi (score modifiers in natural-log
// units) and a scale that is not positive (the plain math takes row maxima of unscaled scores);
// dropout its own variants. Windows and packed batches run in every variant.
inline kern::Variant variant_of(const ForwardParams& p) {
  const bool general = p.mask.kind != MaskKind::kNone || !(p.scale > 0.0) ||
                       p.score_mod.softcap > 0.0f || p.score_mod.alibi_slopes != nullptr;
  if (p.dropout.p > 0.0f) return general ? kern::Variant::kMaskedDropout : kern::Variant::kDropout;
  return general ? kern::Variant::kMasked : kern::Variant::kPlain;
}

// What the launchers ask the runtime about a kernel on a device (or, kernel null, about the
// device), once: decode steps launch every token and small attentions are host bound (a driver
// call costs ~2 us of host time).
enum class KernelFact {
  kSharedMemoryOptIn,
  kBlocksPerSm,
  kWaitsForPrimaryGrid,
  kDeviceSmemOptIn,
  kDeviceSmCount
};

struct KnownKernelFacts {
  using Key = std::tuple<const void*, int, KernelFact>;  // kernel, device, fact
  std::mutex mutex;
  std::map<Key, int> values;
};
inline KnownKernelFacts& known_kernel_facts() {
  static KnownKernelFacts known;
  return known;
}

// ask() the first time (kernel, current device, fact) comes up, its value every time after.
template <class Ask>
int kernel_fact(const void* kernel, KernelFact fact, Ask&& ask) {
  KnownKernelFacts& known = known_kernel_facts();
  const KnownKernelFacts::Key key{kernel, c10::cuda::current_device(), fact};
  {
    const std::lock_guard<std::mutex> lock(known.mutex);
    const auto found = known.values.find(key);
    if (found != known.values.end()) return found->second;
  }
  const int value = ask();  // unlocked: an answer may ask another fact
  const std::lock_guard<std::mutex> lock(known.mutex);
  return known.values.emplace(key, value).first->second;
}

// Dynamic shared memory a block of the current device can opt into (a fact of the device: no
// kernel), capped by smem_limit_override (kernel_path.h).
inline int device_smem_optin() {
  const int device = kernel_fact(nullptr, KernelFact::kDeviceSmemOptIn, [] {
    int bytes = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                          c10::cuda::current_device()));
    return bytes;
  });
  const int cap = smem_limit_override();
  return cap > 0 && cap < device ? cap : device;
}

// Streaming multiprocessors of the current device.
inline int device_sm_count() {
  return kernel_fact(nullptr, KernelFact::kDeviceSmCount, [] {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                          c10::cuda::current_device()));
    return sms;
  });
}

// Opts a kernel into > 48 KB of dynamic shared memory.
template <class Kernel>
inline void set_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return;
  kernel_fact(reinterpret_cast<const void*>(kernel), KernelFact::kSharedMemoryOptIn, [&] {
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return bytes;
  });
}

}  // namespace cuda
}  // namespace flashv100
