// Backward launches: D = rowsum(dO * O) (and, for the general variant, P's base and log2
// normalizer per row), then dK/dV (+ dQ by atomics, converted afterwards), or dK/dV and a separate
// deterministic dQ kernel; with one key tile, dK/dV and dQ in one kernel (and D, for short
// sequences). All on the current stream.
// The launches of each head-dim bucket compile in their own unit (backward_launch.cuh,
// launch_backward_hdim<D>.cu).
#include <c10/cuda/CUDAFunctions.h>

#include "cuda/api/dispatch.cuh"
#include "cuda/api/launch.h"

namespace flashv100 {
namespace cuda {

void run_fused_backward(MmaAtom atom, at::ScalarType dtype, BackwardParams p) {
  const at::Tensor key_range = attach_mask_key_ranges(p.fwd);
  const AttentionShape& s = p.fwd.shape;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA,
                                                                 c10::cuda::current_device());
  const kern::Variant variant = variant_of(p.fwd);
  const bool general = kern::is_general(variant);
  const int64_t rows = s.batch * s.heads_q * s.len_q;
  // Per query row: D, then for the general variant BackwardParams::row_base and row_log2_norm.
  const at::Tensor row_vectors = at::empty({(general ? 3 : 1) * rows}, f32);
  float* const dsum = row_vectors.data_ptr<float>();
  if (general) {
    p.row_base = dsum + rows;
    p.row_log2_norm = dsum + 2 * rows;
  }
  with_head_dim_bucket(s.head_dim, [&](auto dim) {
    launch_backward_head_dim<decltype(dim)::value>(atom, dtype, p, dsum);
  });
}

}  // namespace cuda
}  // namespace flashv100
