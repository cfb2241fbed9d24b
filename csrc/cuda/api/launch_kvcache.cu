// Launches of the KV-cache kernels (kernels/kvcache.cuh) and the split-KV driver around the
// forward launch: split count, partial buffers, combine. On the current stream, no host sync.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda/api/dispatch.cuh"
#include "cuda/api/launch.h"
#include "cuda/kernels/kvcache.cuh"

namespace flashv100 {
namespace cuda {
namespace {

template <class F>
void by_elem(at::ScalarType dtype, F&& f) {
  if (dtype == at::kHalf) {
    f(kern::Fp16{});
  } else {
    f(kern::Bf16{});
  }
}

}  // namespace

int num_splits_heuristic(int64_t batch_heads_mblocks, int64_t num_sms, int64_t num_n_blocks,
                         int64_t max_splits) {
  // FlashAttention-2's: enough blocks to almost fill the GPU need no split; else the fewest
  // splits within 85% of the best wave efficiency, skipping counts that give the same share size.
  if (batch_heads_mblocks >= 0.8 * num_sms) return 1;
  max_splits = std::min({max_splits, num_sms, num_n_blocks});
  const auto ceil = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const auto eligible = [&](int64_t s) {
    return s == 1 || ceil(num_n_blocks, s) != ceil(num_n_blocks, s - 1);
  };
  std::vector<double> efficiency(std::max<int64_t>(max_splits, 0) + 1, 0.0);
  double best = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) {
    if (!eligible(s)) continue;
    const double waves = static_cast<double>(batch_heads_mblocks * s) / num_sms;
    efficiency[s] = waves / std::ceil(waves);
    best = std::max(best, efficiency[s]);
  }
  for (int64_t s = 1; s <= max_splits; ++s)
    if (eligible(s) && efficiency[s] >= 0.85 * best) return static_cast<int>(s);
  return 1;
}

#if CUDART_VERSION >= 12030
namespace {

// Whether `kernel` may launch programmatically dependent on the kernel before it (kvcache.cuh,
// wait_for_primary_grid): the GPU is sm_90+ and the code it runs was built for sm_90+ (else the
// kernel has no wait). Graph capture of such launches needs CUDA 12.3.
bool waits_for_primary_grid(const void* kernel) {
  return kernel_fact(kernel, KernelFact::kWaitsForPrimaryGrid, [&] {
           int major = 0;
           C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                                 c10::cuda::current_device()));
           cudaFuncAttributes attributes = {};
           C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
           return major >= 9 && attributes.binaryVersion >= 90 ? 1 : 0;
         }) != 0;
}

}  // namespace
#endif

void run_kvcache_append(at::ScalarType dtype, const KVAppendParams& a) {
  const int64_t q_count = a.q_rotated != nullptr ? a.batch * a.len_q * a.heads_q * a.head_dim : 0;
  const int64_t kv_count =
      a.k_new != nullptr ? a.batch * a.cache.seqlen_new * a.heads_kv * a.head_dim : 0;
  const int64_t total = q_count + 2 * kv_count;
  if (total == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  by_elem(dtype, [&](auto elem) {
    const auto kernel = kern::kvcache_append_kernel<decltype(elem)>;
    debug_kernel("kvcache_append", 0, "elementwise", 1, 1, kern::kAppendThreads, 0);
    kernel<<<ceil_div(total, kern::kAppendThreads), kern::kAppendThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

namespace {

// The forward kernel appends the new rows itself (KVNewRows; a launch fewer per decode step) where
// each (sequence, KV head) is one block per key share: one query tile of the decode tile per KV
// head (GQA packed into rows, or Hq = Hkv), a head dim it appends at, and no rotary (q takes the
// append kernel's pass).
bool appends_in_forward(MmaAtom atom, const ForwardParams& p, const ForwardTiling& tile,
                        const KVAppendParams& append) {
  if (append.k_new == nullptr || append.q_rotated != nullptr || !uses_decode_tile(atom, p) ||
      !kern::decode_tile_appends(kern::head_dim_bucket(static_cast<int>(p.shape.head_dim))))
    return false;
  return p.shape.heads_q == p.shape.heads_kv && p.shape.len_q <= tile.block_m;
}

}  // namespace

void run_kvcache_forward(MmaAtom atom, at::ScalarType dtype, ForwardParams p,
                         const KVAppendParams& append, int64_t num_splits,
                         const at::Tensor& like) {
  const AttentionShape& sh = p.shape;
  const ForwardTiling tile = fused_forward_tiling(atom, dtype, p);
  if (appends_in_forward(atom, p, tile, append)) {
    p.append = KVNewRows{append.k_new,           append.v_new,   append.k_new_strides,
                         append.v_new_strides,   append.k_cache, append.v_cache};
  } else {
    run_kvcache_append(dtype, append);
  }
  // Packed queries take no split: the partial buffers and the combine address dense rows.
  if (p.varlen.cu_seqlens_q != nullptr) num_splits = 1;
  if (num_splits == 0) {
    // FlashAttention-2's heuristic over the tile that runs: its query blocks, its key tiles, and
    // as many slots per SM as blocks of it fit there, at most two. The decode tile fits three,
    // but a one-wave grid sized to three slots per SM leaves SMs unevenly loaded (B = 1, 32/8
    // heads: 43 splits = 344 blocks on 132 SMs), and this memory-bound step waits for the most
    // loaded ones: 33 splits ran 5-6% faster at 64k-128k keys on the H200. A share holds at least
    // two key tiles (FlashAttention-2's 128 keys at head dim 128, 256 at 64): one-tile shares
    // cost more in block prologue and combine than they spread (B = 1, 32/8 heads, one step,
    // kernel_bench: 8 splits 14.2 us against 16 at 14.7 us at 1k keys, 16 splits 16.5 us
    // against 32 at 18.8 us at 2k).
    num_splits = num_splits_heuristic(sh.batch * sh.heads_q * ceil_div(sh.len_q, tile.block_m),
                                      std::min<int64_t>(tile.blocks_per_sm, 2) * device_sm_count(),
                                      ceil_div(sh.len_kv, 2 * tile.block_n), kern::kMaxSplits);
  }
  p.split.num_splits = static_cast<int32_t>(std::max<int64_t>(1, num_splits));
  if (p.split.num_splits == 1) {
    run_fused_forward(atom, dtype, p);
    return;
  }
  // Released to the caching allocator after enqueueing; its stream order keeps them valid.
  const int64_t rows = sh.batch * sh.heads_q * sh.len_q;
  const at::Tensor lse_accum = at::empty({p.split.num_splits, rows}, like.options().dtype(at::kFloat));
  const at::Tensor out_accum =
      at::empty({p.split.num_splits, rows, sh.head_dim_v}, like.options().dtype(at::kFloat));
  p.split.lse_accum = lse_accum.data_ptr<float>();
  p.split.out_accum = out_accum.data_ptr<float>();
  run_fused_forward(atom, dtype, p);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  by_elem(dtype, [&](auto elem) {
    const auto kernel = kern::split_kv_combine_kernel<decltype(elem)>;
    debug_kernel("split_kv_combine", static_cast<int>(sh.head_dim_v), "splits",
                 p.split.num_splits, 1, kern::kCombineWarps * 32, 0);
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(ceil_div(rows, kern::kCombineWarps)));
    config.blockDim = dim3(kern::kCombineWarps * 32);
    config.stream = stream;
#if CUDART_VERSION >= 12030
    cudaLaunchAttribute dependent;
    dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    dependent.val.programmaticStreamSerializationAllowed = 1;
    if (waits_for_primary_grid(reinterpret_cast<const void*>(kernel))) {
      config.attrs = &dependent;
      config.numAttrs = 1;
    }
#endif
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  });
}

}  // namespace cuda
}  // namespace flashv100
