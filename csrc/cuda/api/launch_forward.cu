// Forward launch: the decode tile for problems of few query rows, else the prefill tile; each tile
// shape and head-dim bucket compiles in a launch unit of its own (forward_launch.cuh).
#include "cuda/api/dispatch.cuh"
#include "cuda/api/launch.h"

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
  const bool decode = uses_decode_tile(atom, p);
  with_head_dim_bucket(p.shape.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    decode ? launch_forward_head_dim<true, D>(atom, dtype, p)
           : launch_forward_head_dim<false, D>(atom, dtype, p);
  });
}

ForwardTiling fused_forward_tiling(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p) {
  const bool decode = uses_decode_tile(atom, p);
  ForwardTiling t{};
  with_head_dim_bucket(p.shape.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    t = decode ? forward_tiling_head_dim<true, D>(atom, dtype, p)
               : forward_tiling_head_dim<false, D>(atom, dtype, p);
  });
  return t;
}

}  // namespace cuda
}  // namespace flashv100
