// Host-side entry points of the CUDA launchers (no kernels here): fused kernels over the plain
// parameter structs, the dropout-mask kernel, and the ATen math fallback.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "common/params.h"
#include "kernel_path.h"

namespace flashv100 {
namespace cuda {

// What decides whether the fused kernels take a problem, whatever the tensors' layout.
struct FusedProblem {
  at::ScalarType dtype;
  int64_t head_dim, head_dim_v;
  int64_t len_q, len_kv;                  // longest sequences
  int64_t batch_heads_q, batch_heads_kv;  // grid rows of the forward and of dK/dV
  bool empty;                             // no query or no key element at all
};

// Why the fused kernels cannot run this problem (nullptr when they can). `tensors` are every
// 16-bit tensor the kernels address (alignment and stride checks).
const char* fused_unsupported_reason(MmaAtom atom, const FusedProblem& problem,
                                     std::initializer_list<const at::Tensor*> tensors);

// Fused kernels on the current stream of the tensors' device (the caller holds a device guard).
void run_fused_forward(MmaAtom atom, at::ScalarType dtype, ForwardParams p);

// The forward's tile: query rows and keys per block, resident blocks per SM on this device.
struct ForwardTiling {
  int block_m, block_n, blocks_per_sm;
};
ForwardTiling fused_forward_tiling(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p);
// Whether p runs in the decode tile (few query rows, no dropout, an atom and head dim that have
// one; kernels/configs.cuh).
bool uses_decode_tile(MmaAtom atom, const ForwardParams& p);
void run_fused_backward(MmaAtom atom, at::ScalarType dtype, BackwardParams p);

// The launch units that CMakeLists.txt generates, one per head-dim bucket (and forward tile), so
// that the kernels compile in parallel: the forward's launch and tiling in the decode
// (kDecodeTile) or prefill tile (forward_launch.cuh), and run_fused_backward's kernels after its
// per-row vectors (dsum: D, then the general variant's row_base and row_log2_norm as p points at
// them; backward_launch.cuh).
template <bool kDecodeTile, int kBucket>
void launch_forward_head_dim(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p);
template <bool kDecodeTile, int kBucket>
ForwardTiling forward_tiling_head_dim(MmaAtom atom, at::ScalarType dtype, const ForwardParams& p);
template <int kBucket>
void launch_backward_head_dim(MmaAtom atom, at::ScalarType dtype, const BackwardParams& p,
                              float* dsum);

// flash_attn_with_kvcache: the rotary/append step (KVAppendParams; run_kvcache_forward's own
// or in the forward kernel, KVNewRows), then the forward over the updated cache with num_splits
// split-KV shares (0: FlashAttention-2's heuristic from the SM count; 1: none) and, when split,
// the combine. `like`: a tensor on the device (for buffers).
void run_kvcache_append(at::ScalarType dtype, const KVAppendParams& append);
void run_kvcache_forward(MmaAtom atom, at::ScalarType dtype, ForwardParams p,
                         const KVAppendParams& append, int64_t num_splits, const at::Tensor& like);
// FlashAttention-2's split count: wave efficiency of batch_heads_mblocks * splits blocks on
// num_sms slots, shares of num_n_blocks key blocks, at most max_splits.
int num_splits_heuristic(int64_t batch_heads_mblocks, int64_t num_sms, int64_t num_n_blocks,
                         int64_t max_splits);

// Runs the mask pre-pass for masks broadcast over query rows and points p.mask.key_range at its
// result (no-op otherwise). The returned buffer must outlive the launches that read it; the
// caching allocator's stream order keeps it valid once they are enqueued.
at::Tensor attach_mask_key_ranges(ForwardParams& p);

// The rng_state [seed, offset] of a forward, for its backward. With dropout it reserves Philox
// randomness from PyTorch's CUDA generator of `like`'s device for one call and fills `dropout`
// (seed/offset values, or device pointers under CUDA graph capture); without, it is zeros. Always
// written on the device, so capture never reads it on the host: by the forward kernel's first
// block where `by_forward_kernel` (dropout.rng_state_out: no launch of its own, and a small step
// is launch bound), else by a one-thread kernel or a memset.
at::Tensor forward_rng_state(const at::Tensor& like, double dropout_p, DropoutParams& dropout,
                             bool by_forward_kernel);
// keep mask [B, H, L, S] (bool) of philox.h for rng_state.
at::Tensor dropout_keep_mask(const at::Tensor& rng_state, int64_t batch, int64_t heads,
                             int64_t len_q, int64_t len_kv, double dropout_p);

// ATen math with the ops' semantics (fp32, or fp64 for fp64 inputs): any dtype, head dim, mask,
// dropout. Writes into the given outputs.
void fallback_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const std::optional<at::Tensor>& attn_mask, double dropout_p,
                      int64_t causal_mode, double scale, const at::Tensor& rng_state,
                      const at::Tensor& out, const at::Tensor& lse);
// Returns grad_mask_full ([B, Hq, L, S] in the compute dtype) when mask_requires_grad.
at::Tensor fallback_backward(const at::Tensor& grad_out, const at::Tensor& query,
                             const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p,
                             int64_t causal_mode, double scale, const at::Tensor& rng_state,
                             bool mask_requires_grad, const at::Tensor& grad_query,
                             const at::Tensor& grad_key, const at::Tensor& grad_value);

// FLASHV100_DEBUG=1: one stderr line per op call saying which path ran and why, and one per
// kernel launch with its tile configuration and dynamic shared memory.
bool debug_enabled();
void debug_log(const char* op, const char* path, const char* reason);
void debug_kernel(const char* kernel, int head_dim_bucket, const char* variant, int block_m,
                  int block_n, int threads, int smem_bytes);

}  // namespace cuda
}  // namespace flashv100
