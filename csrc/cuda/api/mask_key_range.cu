// Launches the mask pre-pass (kernels/mask_key_range.cuh) where it applies.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/api/launch.h"
#include "cuda/kernels/mask_key_range.cuh"

namespace flashv100 {
namespace cuda {

at::Tensor attach_mask_key_ranges(ForwardParams& p) {
  if (p.mask.kind == MaskKind::kNone || p.mask.row_stride != 0) return at::Tensor();
  const int64_t heads = p.shape.batch * p.shape.heads_q;
  at::Tensor key_range = at::empty(
      {heads}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, c10::cuda::current_device()));
  kern::flash_mask_key_range_kernel<<<heads, kern::kMaskKeyRangeThreads, 0,
                                c10::cuda::getCurrentCUDAStream()>>>(p,
                                                                     key_range.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  p.mask.key_range = key_range.data_ptr<int32_t>();
  return key_range;
}

}  // namespace cuda
}  // namespace flashv100
