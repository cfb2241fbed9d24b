// The static sm_70 gate's translation unit (scripts/nvrtc_gate.py): includes every device-only
// kernel header and instantiates every kernel configuration the launchers can launch, so NVRTC
// reports registers, spills and shared memory for each. Dynamic shared memory is invisible to
// ptxas: each configuration asserts its own budget (configs.cuh: the atom's smallest GPU, 96 KB
// Volta, 99 KB Ampere; the backward's two-buffer configurations, picked by the device, 163 KB).
// Only NVRTC compiles it: in the extension build (nvcc) this translation unit is empty, the
// launchers instantiate the same kernels through kernel dispatch.
#if defined(__CUDACC_RTC__)
#include "cuda/kernels/dropout_mask.cuh"
#include "cuda/kernels/flash_bwd.cuh"
#include "cuda/kernels/flash_fwd.cuh"
#include "cuda/kernels/kvcache.cuh"
#include "cuda/kernels/mask_key_range.cuh"

namespace flashv100 {
namespace kern {

#define FLASHV100_INSTANTIATE_VARIANT(Atom, Elem, D, G)                                      \
  template __global__ void flash_fwd_kernel<Atom, Elem, D, G>(const ForwardParams);          \
  template __global__ void flash_bwd_dkdv_kernel<Atom, Elem, D, G>(                          \
      const BackwardParams, float*, float*, const KvGroupSplit, bool);                       \
  template __global__ void flash_bwd_dkdv_kernel<Atom, Elem, D, G, 1, BwdTileSize::kCompact, \
                                                 true>(                                      \
      const BackwardParams, float*, float*, const KvGroupSplit, bool);                       \
  template __global__ void flash_bwd_dq_kernel<Atom, Elem, D, G>(const BackwardParams,       \
                                                                 const float*);              \
  template __global__ void flash_bwd_dq_convert_kernel<Atom, Elem, D, G>(const BackwardParams, \
                                                                         const float*);
// Paged KV caches: the variants without mask and dropout (forward_launch.cuh).
#define FLASHV100_INSTANTIATE_PAGED(Atom, Elem, D)                                             \
  template __global__ void flash_fwd_kernel<Atom, Elem, D, Variant::kPlain, true>(             \
      const ForwardParams);                                                                    \
  template __global__ void flash_fwd_kernel<Atom, Elem, D, Variant::kMasked, true>(            \
      const ForwardParams);
// The decode tile: the variants without dropout, contiguous and paged (forward_launch.cuh).
#define FLASHV100_INSTANTIATE_DECODE_VARIANT(Atom, Elem, D, G)                                 \
  template __global__ void flash_fwd_kernel<Atom, Elem, D, G, false, FwdShape::kDecode>(       \
      const ForwardParams);                                                                    \
  template __global__ void flash_fwd_kernel<Atom, Elem, D, G, true, FwdShape::kDecode>(        \
      const ForwardParams);
#define FLASHV100_INSTANTIATE_DECODE(Atom, Elem, D)                     \
  FLASHV100_INSTANTIATE_DECODE_VARIANT(Atom, Elem, D, Variant::kPlain)  \
  FLASHV100_INSTANTIATE_DECODE_VARIANT(Atom, Elem, D, Variant::kMasked)
#define FLASHV100_INSTANTIATE_ATTENTION(Atom, Elem, D)            \
  FLASHV100_INSTANTIATE_PAGED(Atom, Elem, D)                      \
  FLASHV100_INSTANTIATE_VARIANT(Atom, Elem, D, Variant::kPlain)   \
  FLASHV100_INSTANTIATE_VARIANT(Atom, Elem, D, Variant::kMasked)  \
  FLASHV100_INSTANTIATE_VARIANT(Atom, Elem, D, Variant::kDropout) \
  FLASHV100_INSTANTIATE_VARIANT(Atom, Elem, D, Variant::kMaskedDropout)

// The Volta atom has no decode tile at head dim 256 (configs.cuh, has_decode_tile).
#define FLASHV100_INSTANTIATE_VOLTA_FP16(D) FLASHV100_INSTANTIATE_ATTENTION(VoltaAtom, Fp16, D)
#define FLASHV100_INSTANTIATE_VOLTA_FP16_DECODE(D) FLASHV100_INSTANTIATE_DECODE(VoltaAtom, Fp16, D)
// cp.async atoms' dK/dV kernels with two query-side buffers (configs.cuh, BwdConfig).
#define FLASHV100_INSTANTIATE_DKDV_TWO_STAGES(Atom, Elem, D, G)                                  \
  template __global__ void flash_bwd_dkdv_kernel<Atom, Elem, D, G, 2>(                           \
      const BackwardParams, float*, float*, const KvGroupSplit, bool);
// The wide backward tiles (configs.cuh, has_wide_bwd_tile).
#define FLASHV100_INSTANTIATE_WIDE_BACKWARD_VARIANT(Elem, D, V)                                 \
  template __global__ void                                                                      \
  flash_bwd_dkdv_kernel<AmpereAtom, Elem, D, V, 2, BwdTileSize::kWide>(                         \
      const BackwardParams, float*, float*, const KvGroupSplit, bool);                          \
  template __global__ void                                                                      \
  flash_bwd_dq_kernel<AmpereAtom, Elem, D, V, BwdTileSize::kWide>(const BackwardParams,         \
                                                                   const float*);               \
  template __global__ void                                                                      \
  flash_bwd_dq_convert_kernel<AmpereAtom, Elem, D, V, BwdTileSize::kWide>(                      \
      const BackwardParams, const float*);
// Its one-key-tile kernel too (configs.cuh, has_direct_wide_bwd_tile).
#define FLASHV100_INSTANTIATE_WIDE_BACKWARD_DIRECT(Elem, D, V)                                  \
  FLASHV100_INSTANTIATE_WIDE_BACKWARD_VARIANT(Elem, D, V)                                       \
  template __global__ void                                                                      \
  flash_bwd_dkdv_kernel<AmpereAtom, Elem, D, V, 2, BwdTileSize::kWide, true>(                   \
      const BackwardParams, float*, float*, const KvGroupSplit, bool);
// The narrow prefill tile (configs.cuh, has_narrow_prefill_tile).
#define FLASHV100_INSTANTIATE_NARROW_PREFILL(Elem, D, V)                                        \
  template __global__ void                                                                      \
  flash_fwd_kernel<AmpereAtom, Elem, D, V, false, FwdShape::kNarrowPrefill>(const ForwardParams);
#define FLASHV100_INSTANTIATE_NARROW_PREFILL_ALL(Elem, D)                 \
  FLASHV100_INSTANTIATE_NARROW_PREFILL(Elem, D, Variant::kPlain)          \
  FLASHV100_INSTANTIATE_NARROW_PREFILL(Elem, D, Variant::kMasked)         \
  FLASHV100_INSTANTIATE_NARROW_PREFILL(Elem, D, Variant::kDropout)        \
  FLASHV100_INSTANTIATE_NARROW_PREFILL(Elem, D, Variant::kMaskedDropout)
#define FLASHV100_INSTANTIATE_AMPERE(Elem, D)                                                   \
  FLASHV100_INSTANTIATE_ATTENTION(AmpereAtom, Elem, D)                                          \
  FLASHV100_INSTANTIATE_DECODE(AmpereAtom, Elem, D)                                             \
  FLASHV100_INSTANTIATE_DKDV_TWO_STAGES(AmpereAtom, Elem, D, Variant::kPlain)                   \
  FLASHV100_INSTANTIATE_DKDV_TWO_STAGES(AmpereAtom, Elem, D, Variant::kMasked)                  \
  FLASHV100_INSTANTIATE_DKDV_TWO_STAGES(AmpereAtom, Elem, D, Variant::kDropout)                 \
  FLASHV100_INSTANTIATE_DKDV_TWO_STAGES(AmpereAtom, Elem, D, Variant::kMaskedDropout)
#define FLASHV100_INSTANTIATE_AMPERE_FP16(D) FLASHV100_INSTANTIATE_AMPERE(Fp16, D)
#define FLASHV100_INSTANTIATE_AMPERE_BF16(D) FLASHV100_INSTANTIATE_AMPERE(Bf16, D)

template __global__ void flash_bwd_dsum_kernel<Fp16, false>(const BackwardParams, float*,
                                                            const DqWorkspaceRows);
template __global__ void flash_bwd_dsum_kernel<Fp16, true>(const BackwardParams, float*,
                                                            const DqWorkspaceRows);
template __global__ void flash_bwd_dkdv_reduce_kernel<Fp16>(const BackwardParams,
                                                            const KvGroupSplit);
template __global__ void kvcache_append_kernel<Fp16>(const KVAppendParams);
template __global__ void split_kv_combine_kernel<Fp16>(const ForwardParams);
FLASHV100_FOR_EACH_HEAD_DIM(FLASHV100_INSTANTIATE_VOLTA_FP16)
FLASHV100_INSTANTIATE_VOLTA_FP16_DECODE(32)
FLASHV100_INSTANTIATE_VOLTA_FP16_DECODE(64)
FLASHV100_INSTANTIATE_VOLTA_FP16_DECODE(128)

// The launcher picks the Ampere atom (and allows bf16) only on sm_80 and newer.
#if __CUDA_ARCH__ >= 800
template __global__ void flash_bwd_dsum_kernel<Bf16, false>(const BackwardParams, float*,
                                                            const DqWorkspaceRows);
template __global__ void flash_bwd_dsum_kernel<Bf16, true>(const BackwardParams, float*,
                                                            const DqWorkspaceRows);
template __global__ void flash_bwd_dkdv_reduce_kernel<Bf16>(const BackwardParams,
                                                            const KvGroupSplit);
template __global__ void kvcache_append_kernel<Bf16>(const KVAppendParams);
template __global__ void split_kv_combine_kernel<Bf16>(const ForwardParams);
FLASHV100_FOR_EACH_HEAD_DIM(FLASHV100_INSTANTIATE_AMPERE_FP16)
FLASHV100_FOR_EACH_HEAD_DIM(FLASHV100_INSTANTIATE_AMPERE_BF16)
FLASHV100_INSTANTIATE_NARROW_PREFILL_ALL(Fp16, 32)
FLASHV100_INSTANTIATE_NARROW_PREFILL_ALL(Bf16, 32)
FLASHV100_INSTANTIATE_NARROW_PREFILL_ALL(Fp16, 64)
FLASHV100_INSTANTIATE_NARROW_PREFILL_ALL(Bf16, 64)
FLASHV100_INSTANTIATE_NARROW_PREFILL(Fp16, 128, Variant::kPlain)
FLASHV100_INSTANTIATE_NARROW_PREFILL(Bf16, 128, Variant::kPlain)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_VARIANT(Fp16, 64, Variant::kPlain)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_VARIANT(Bf16, 64, Variant::kPlain)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_DIRECT(Fp16, 128, Variant::kPlain)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_DIRECT(Fp16, 128, Variant::kDropout)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_DIRECT(Bf16, 128, Variant::kPlain)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_DIRECT(Bf16, 128, Variant::kDropout)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_DIRECT(Fp16, 256, Variant::kPlain)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_VARIANT(Fp16, 256, Variant::kMasked)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_DIRECT(Fp16, 256, Variant::kDropout)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_VARIANT(Fp16, 256, Variant::kMaskedDropout)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_DIRECT(Bf16, 256, Variant::kPlain)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_VARIANT(Bf16, 256, Variant::kMasked)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_DIRECT(Bf16, 256, Variant::kDropout)
FLASHV100_INSTANTIATE_WIDE_BACKWARD_VARIANT(Bf16, 256, Variant::kMaskedDropout)
#endif

}  // namespace kern
}  // namespace flashv100

#endif  // __CUDACC_RTC__
