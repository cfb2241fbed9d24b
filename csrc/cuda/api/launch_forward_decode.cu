// Forward launch in the decode tile (kernels/configs.cuh), a translation unit of its own so that
// its kernels compile in parallel with the prefill ones.
#include <c10/cuda/CUDAStream.h>

#include "cuda/api/forward_launch.cuh"

namespace flashv100 {
namespace cuda {

void run_decode_forward(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p) {
  launch_forward<kern::FwdShape::kDecode>(atom, dtype, p);
}

ForwardTiling decode_forward_tiling(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p) {
  return forward_tiling<kern::FwdShape::kDecode>(atom, dtype, p);
}

}  // namespace cuda
}  // namespace flashv100
