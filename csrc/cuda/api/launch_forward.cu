// Forward launch: the decode tile for problems of few query rows (launch_forward_decode.cu),
// else the prefill tile.
#include <c10/cuda/CUDAStream.h>

#include "cuda/api/forward_launch.cuh"

namespace flashv100 {
namespace cuda {

bool uses_decode_tile(MmaAtom atom, const ForwardParams& p) {
  const int bucket = kern::head_dim_bucket(static_cast<int>(p.shape.head_dim));
  const bool tile = atom == MmaAtom::kVoltaM8N8K4 ? kern::has_decode_tile<kern::VoltaAtom>(bucket)
                                                  : kern::has_decode_tile<kern::AmpereAtom>(bucket);
  return tile && p.shape.len_q <= kern::kDecodeRows && !(p.dropout.p > 0.0f);
}

void run_fused_forward(MmaAtom atom, at::ScalarType dtype, ForwardParams p) {
  const at::Tensor key_range = attach_mask_key_ranges(p);
  if (uses_decode_tile(atom, p)) {
    run_decode_forward(atom, dtype, p);
  } else {
    launch_forward<kern::FwdShape::kPrefill>(atom, dtype, p);
  }
}

ForwardTiling fused_forward_tiling(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p) {
  return uses_decode_tile(atom, p) ? decode_forward_tiling(atom, dtype, p)
                                   : forward_tiling<kern::FwdShape::kPrefill>(atom, dtype, p);
}

}  // namespace cuda
}  // namespace flashv100
