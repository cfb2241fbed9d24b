// Forward launch: one block per (query tile, batch * query head, split), on the current stream.
// Paged KV caches run the kPaged kernels, compiled for the variants a KV cache takes (no mask, no
// dropout).
#include <c10/cuda/CUDAStream.h>

#include "cuda/api/dispatch.cuh"
#include "cuda/api/launch.h"
#include "cuda/kernels/flash_fwd.cuh"

namespace flashv100 {
namespace cuda {

void run_fused_forward(MmaAtom atom, at::ScalarType dtype, ForwardParams p) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor key_range = attach_mask_key_ranges(p);
  dispatch(atom, dtype, p.shape.head_dim, variant_of(p),
           [&](auto atom_tag, auto elem_tag, auto dim, auto variant) {
    constexpr int D = decltype(dim)::value;
    constexpr kern::Variant V = decltype(variant)::value;
    using Cfg = kern::FwdConfig<decltype(atom_tag), D, V>;
    const auto launch = [&](auto kernel, const char* name) {
      set_smem(kernel, Cfg::kSmemBytes);
      debug_kernel(name, D, kern::variant_name(V), Cfg::kBlockM, Cfg::kBlockN, Cfg::kThreads,
                   Cfg::kSmemBytes);
      const dim3 grid(ceil_div(p.shape.len_q, Cfg::kBlockM), p.shape.batch * p.shape.heads_q,
                      p.split.num_splits);
      kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (p.kvcache.block_table == nullptr) {
      launch(kern::flash_fwd_kernel<decltype(atom_tag), decltype(elem_tag), D, V>, "flash_fwd");
    } else if constexpr (V == kern::Variant::kPlain || V == kern::Variant::kMasked) {
      launch(kern::flash_fwd_kernel<decltype(atom_tag), decltype(elem_tag), D, V, true>,
             "flash_fwd (paged)");
    } else {
      TORCH_CHECK(false, "flashv100: paged KV caches take neither attn_mask nor dropout");
    }
  });
}

}  // namespace cuda
}  // namespace flashv100
