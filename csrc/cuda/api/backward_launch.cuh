// The backward launches of one head-dim bucket (run_fused_backward's second half): the D
// pre-pass, then dK/dV (+ dQ by atomics into a workspace, converted afterwards) or dK/dV and the
// deterministic dQ kernel; with one key tile, dK/dV and dQ in one kernel (and D, for short
// sequences). Included by the launch units that CMakeLists.txt generates, one per bucket
// (FLASHV100_INSTANTIATE_BACKWARD below), so that the backward kernels compile in parallel.
#pragma once

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/api/dispatch.cuh"
#include "cuda/api/launch.h"
#include "cuda/kernels/flash_bwd.cuh"

namespace flashv100 {
namespace cuda {

template <int kBucket>
void launch_backward_head_dim(MmaAtom atom, at::ScalarType dtype, const BackwardParams& p,
                              float* dsum) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const AttentionShape& s = p.fwd.shape;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA,
                                                                 c10::cuda::current_device());
  dispatch_head_dim<kBucket>(atom, dtype, variant_of(p.fwd),
                            [&](auto atom_tag, auto elem_tag, auto dim, auto variant_tag) {
    using Atom = decltype(atom_tag);
    using Elem = decltype(elem_tag);
    constexpr int D = decltype(dim)::value;
    constexpr kern::Variant V = decltype(variant_tag)::value;
    constexpr bool G = kern::is_general(V);
    // Every kernel of one backward runs with the same configuration (the dQ workspace follows
    // its warp grid): the wide tile and two query-side buffers where the device's shared memory
    // holds them (configs.cuh), else the tile every GPU of the atom holds.
    const auto run = [&](auto stages, auto size, auto dq_direct) {
      constexpr int kStages = decltype(stages)::value;
      constexpr kern::BwdTileSize kSize = decltype(size)::value;
      constexpr bool kDqDirect = decltype(dq_direct)::value;
      using Cfg = kern::BwdConfig<Atom, D, V, kStages, kSize>;
      using DqWorkspace = kern::DqWorkspace<Atom, Cfg>;
      const int64_t key_tiles = ceil_div(s.len_kv, Cfg::kBlockN);
      // dQ: written by the dK/dV kernel (kDqDirect; and D computed there too for short
      // sequences), or by atomics into a workspace that the D pre-pass zeroes (one warp per
      // padded row), or by the deterministic dQ kernel.
      const bool dkdv_row_vectors =
          kDqDirect && kern::dkdv_computes_row_vectors<Cfg>(s.heads_q / s.heads_kv, s.len_q);
      at::Tensor dq_accum;
      kern::DqWorkspaceRows dq_ws{nullptr, s.len_q, 0};
      if (!p.deterministic && !kDqDirect) {
        dq_accum = at::empty({DqWorkspace::floats(s.batch * s.heads_q, s.len_q)}, f32);
        dq_ws = DqWorkspace::rows(dq_accum.data_ptr<float>(), s.len_q);
      }
      if (!dkdv_row_vectors) {
        const int64_t dsum_warps = s.batch * s.heads_q * dq_ws.padded_len_q;
        kern::flash_bwd_dsum_kernel<Elem, G><<<ceil_div(dsum_warps, 4), 128, 0, stream>>>(
            p, dsum, dq_ws);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }

      const auto dkdv = kern::flash_bwd_dkdv_kernel<Atom, Elem, D, V, kStages, kSize, kDqDirect>;
      set_smem(dkdv, Cfg::kSmemBytes);
      debug_kernel("flash_bwd_dkdv", D, kern::variant_name(V), Cfg::kBlockM, Cfg::kBlockN,
                   Cfg::kThreads, Cfg::kSmemBytes);
      const int64_t kv_heads = s.batch * s.heads_kv;
      kern::KvGroupSplit split =
          kern::dkdv_split(s.heads_q / s.heads_kv, key_tiles * kv_heads,
                           kDqDirect ? ceil_div(s.len_q, Cfg::kBlockM) : 0, device_sm_count());
      at::Tensor kv_parts;
      const int64_t slab = kv_heads * s.len_kv * s.head_dim;
      if (split.count > 1) {
        kv_parts = at::empty({2 * split.count * slab}, f32);
        split.dk = kv_parts.data_ptr<float>();
        split.dv = split.dk + split.count * slab;
      }
      const dim3 kv_grid(key_tiles, kv_heads * split.count);
      dkdv<<<kv_grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, dsum, dq_ws.floats, split,
                                                                 dkdv_row_vectors);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (split.count > 1) {
        // A split grid has under kWaves waves of key tiles: far from int's range, which the
        // reduction's thread index takes.
        TORCH_INTERNAL_ASSERT(s.len_kv * s.head_dim / 2 <= INT32_MAX);
        const dim3 reduce_grid(kern::dkdv_reduce_blocks(s.len_kv, s.head_dim), kv_heads);
        kern::flash_bwd_dkdv_reduce_kernel<Elem>
            <<<reduce_grid, kern::kDkdvReduceThreads, 0, stream>>>(p, split);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }

      if constexpr (kDqDirect) return;
      if (p.deterministic) {
        using DqCfg = kern::BwdConfig<Atom, D, V, 1, kSize>;  // one query tile a block
        const auto dq = kern::flash_bwd_dq_kernel<Atom, Elem, D, V, kSize>;
        set_smem(dq, DqCfg::kSmemBytes);
        const dim3 q_grid(ceil_div(s.len_q, Cfg::kBlockM), s.batch * s.heads_q);
        dq<<<q_grid, Cfg::kThreads, DqCfg::kSmemBytes, stream>>>(p, dsum);
      } else {
        const dim3 q_grid(DqWorkspace::query_tiles(s.len_q), s.batch * s.heads_q);
        kern::flash_bwd_dq_convert_kernel<Atom, Elem, D, V, kSize>
            <<<q_grid, Cfg::kThreads, 0, stream>>>(p, dq_ws.floats);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    using One = std::integral_constant<int, 1>;
    using Two = std::integral_constant<int, 2>;
    using CompactTile = std::integral_constant<kern::BwdTileSize, kern::BwdTileSize::kCompact>;
    using WideTile = std::integral_constant<kern::BwdTileSize, kern::BwdTileSize::kWide>;
    using DqDirect = std::true_type;
    using DqApart = std::false_type;
    // Every key in one tile: the dK/dV kernel writes dQ itself (kDqDirect). The compact tile
    // fits every GPU of the atom; the wide one, where the device holds it, takes more keys in
    // one tile (has_direct_wide_bwd_tile).
    if (kern::has_one_key_tile<kern::BwdConfig<Atom, D, V>>(s.len_kv)) {
      return run(One{}, CompactTile{}, DqDirect{});
    }
    const int smem = device_smem_optin();
    if constexpr (kern::has_wide_bwd_tile<Atom, D, V>()) {
      using WideCfg = kern::BwdConfig<Atom, D, V, 2, kern::BwdTileSize::kWide>;
      if (WideCfg::kSmemBytes <= smem) {
        constexpr bool kDirect = kern::has_direct_wide_bwd_tile<Atom, D, V>();
        if (kDirect && kern::has_one_key_tile<WideCfg>(s.len_kv)) {
          return run(Two{}, WideTile{}, std::bool_constant<kDirect>{});
        }
        return run(Two{}, WideTile{}, DqApart{});
      }
    }
    if constexpr (Atom::kAsyncCopy) {
      if (kern::BwdConfig<Atom, D, V, 2>::kSmemBytes <= smem) {
        return run(Two{}, CompactTile{}, DqApart{});
      }
    }
    run(One{}, CompactTile{}, DqApart{});
  });
}

// The body of a generated backward launch unit.
#define FLASHV100_INSTANTIATE_BACKWARD(kBucket)                                                \
  template void launch_backward_head_dim<kBucket>(MmaAtom, at::ScalarType, const BackwardParams&, \
                                                  float*);

}  // namespace cuda
}  // namespace flashv100
