// The forward kernel of a problem in one tile shape (kernels/configs.cuh) and head-dim bucket:
// dispatch over atom, dtype and variant, and the contiguous or paged kernel. Included by the
// launch units that CMakeLists.txt generates, one per tile shape and bucket, which compile apart
// (FLASHV100_INSTANTIATE_FORWARD below); launch_forward.cu picks the unit.
#pragma once

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cuda/api/dispatch.cuh"
#include "cuda/api/launch.h"
#include "cuda/kernels/flash_fwd.cuh"

namespace flashv100 {
namespace cuda {

// Calls f(kernel, Cfg{}, name) with the kernel of shape S that runs p and its configuration.
// Paged KV caches run the kPaged kernels, compiled for the variants a KV cache takes (no mask, no
// dropout); the decode tile takes no dropout and exists where has_decode_tile (uses_decode_tile).
// The prefill shape runs the narrow tile where the wide one would leave SMs idle
// (uses_narrow_prefill_tile).
template <kern::FwdShape S, int kBucket, class F>
void with_forward_kernel(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p, F&& f) {
  constexpr bool kDecode = S == kern::FwdShape::kDecode;
  const bool paged = p.kvcache.block_table != nullptr;
  dispatch_head_dim<kBucket>(atom, dtype, variant_of(p),
                             [&](auto atom_tag, auto elem_tag, auto dim, auto variant) {
    using A = decltype(atom_tag);
    using E = decltype(elem_tag);
    constexpr int D = decltype(dim)::value;
    constexpr kern::Variant V = decltype(variant)::value;
    if constexpr (!kDecode && kern::has_narrow_prefill_tile<A, D, V>()) {
      const int64_t wide_blocks = ceil_div(p.shape.len_q, kern::FwdConfig<A, D, V>::kBlockM) *
                                  p.shape.batch * p.shape.heads_q * p.split.num_splits;
      if (!paged && kern::uses_narrow_prefill_tile(wide_blocks, device_sm_count())) {
        constexpr kern::FwdShape kNarrow = kern::FwdShape::kNarrowPrefill;
        return f(kern::flash_fwd_kernel<A, E, D, V, false, kNarrow>,
                 kern::FwdConfig<A, D, V, kNarrow>{}, "flash_fwd (narrow)");
      }
    }
    if constexpr (kDecode && !kern::has_decode_tile<A>(D)) {
      TORCH_CHECK(false, "flashv100: no decode tile for head dim ", D, " on this atom");
    } else if constexpr (V == kern::Variant::kPlain || V == kern::Variant::kMasked) {
      if (paged) {
        f(kern::flash_fwd_kernel<A, E, D, V, true, S>, kern::FwdConfig<A, D, V, S, true>{},
          kDecode ? "flash_fwd (decode, paged)" : "flash_fwd (paged)");
      } else {
        f(kern::flash_fwd_kernel<A, E, D, V, false, S>, kern::FwdConfig<A, D, V, S>{},
          kDecode ? "flash_fwd (decode)" : "flash_fwd");
      }
    } else if constexpr (!kDecode) {
      TORCH_CHECK(!paged, "flashv100: paged KV caches take neither attn_mask nor dropout");
      f(kern::flash_fwd_kernel<A, E, D, V>, kern::FwdConfig<A, D, V>{}, "flash_fwd");
    } else {
      TORCH_CHECK(false, "flashv100: the decode tile takes no dropout");
    }
  });
}

// The tile shape of the launch units' kDecodeTile (launch.h takes no device header).
template <bool kDecodeTile>
constexpr kern::FwdShape kTileShape = kDecodeTile ? kern::FwdShape::kDecode
                                                  : kern::FwdShape::kPrefill;

// Launches p in the decode (kDecodeTile) or prefill tile on the current stream: one block per
// (query tile, batch * query head, split).
template <bool kDecodeTile, int kBucket>
void launch_forward_head_dim(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  constexpr kern::FwdShape kShape = kTileShape<kDecodeTile>;
  with_forward_kernel<kShape, kBucket>(atom, dtype, p, [&](auto kernel, auto cfg,
                                                          const char* name) {
    using Cfg = decltype(cfg);
    set_smem(kernel, Cfg::kSmemBytes);
    debug_kernel(name, Cfg::kHeadDim, kern::variant_name(variant_of(p)), Cfg::kBlockM,
                 Cfg::kBlockN, Cfg::kThreads, Cfg::kSmemBytes);
    const dim3 grid(ceil_div(p.shape.len_q, Cfg::kBlockM), p.shape.batch * p.shape.heads_q,
                    p.split.num_splits);
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The tiling of p's kernel in that tile, with its resident blocks per SM on the current device
// (asked of the runtime once per kernel and device: decode steps call this every token).
template <bool kDecodeTile, int kBucket>
ForwardTiling forward_tiling_head_dim(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p) {
  ForwardTiling t{};
  constexpr kern::FwdShape kShape = kTileShape<kDecodeTile>;
  with_forward_kernel<kShape, kBucket>(atom, dtype, p, [&](auto kernel, auto cfg, const char*) {
    using Cfg = decltype(cfg);
    const int blocks =
        kernel_fact(reinterpret_cast<const void*>(kernel), KernelFact::kBlocksPerSm, [&] {
          set_smem(kernel, Cfg::kSmemBytes);
          int resident = 0;
          C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
              &resident, kernel, Cfg::kThreads, Cfg::kSmemBytes));
          return std::max(resident, 1);
        });
    t = ForwardTiling{Cfg::kBlockM, Cfg::kBlockN, blocks};
  });
  return t;
}

// The body of a generated forward launch unit: tile shape (true: decode) and bucket.
#define FLASHV100_INSTANTIATE_FORWARD(kDecodeTile, kBucket)                                     \
  template void launch_forward_head_dim<kDecodeTile, kBucket>(MmaAtom, at::ScalarType,         \
                                                              const ForwardParams&);           \
  template ForwardTiling forward_tiling_head_dim<kDecodeTile, kBucket>(MmaAtom, at::ScalarType, \
                                                                       const ForwardParams&);

}  // namespace cuda
}  // namespace flashv100
