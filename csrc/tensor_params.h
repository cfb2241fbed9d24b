// ATen tensors -> the plain kernel parameter structs of common/params.h. The one place where
// tensors become pointers and strides; shared by the CPU and CUDA launchers.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/OpMathType.h>

#include <optional>

#include "common/params.h"

namespace flashv100 {

// dropout_p of the internal ops: in [0, 1) (the public op also takes 1, see csrc/ops.cpp).
void check_dropout_p(const char* op, double dropout_p);

// Validates the internal ops' inputs: 4-D query [B, Hq, L, E], key [B, Hkv, S, E], value
// [B, Hkv, S, Ev], last dim contiguous, one dtype and device, Hq % Hkv == 0, a mask whose dims are
// each 1 or full size, causal_mode in {0, 1, 2}, dropout_p in [0, 1). `op` names the caller.
void check_attention_inputs(const char* op, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                            double dropout_p, int64_t causal_mode);

// The backward's extra inputs, as _attention_forward returned them; plus the inputs' checks.
void check_backward_inputs(const char* op, const at::Tensor& grad_out, const at::Tensor& query,
                           const at::Tensor& key, const at::Tensor& value,
                           const std::optional<at::Tensor>& attn_mask, const at::Tensor& out,
                           const at::Tensor& lse, const at::Tensor& rng_state, double dropout_p,
                           int64_t causal_mode, bool mask_requires_grad);

// Output allocation shared by the real kernels of every device (fake kernels mirror it).
// lse is fp32, except fp64 for fp64 inputs (so float64 gradients stay exact).
at::Tensor allocate_out(const at::Tensor& query, const at::Tensor& value);
at::Tensor allocate_lse(const at::Tensor& query);

ForwardParams make_forward_params(const at::Tensor& query, const at::Tensor& key,
                                  const at::Tensor& value,
                                  const std::optional<at::Tensor>& attn_mask,
                                  const at::Tensor& out, const at::Tensor& lse, double scale,
                                  int64_t causal_mode, double dropout_p);

// grad_mask_full: [B, Hq, L, S] buffer for the additive mask's gradient, or undefined; fp32 (what
// BackwardParams::dmask points at) or, on CPU, the accumulation type (passed to the kernel there).
BackwardParams make_backward_params(const at::Tensor& grad_out, const at::Tensor& query,
                                    const at::Tensor& key, const at::Tensor& value,
                                    const std::optional<at::Tensor>& attn_mask,
                                    const at::Tensor& out, const at::Tensor& lse, double scale,
                                    int64_t causal_mode, double dropout_p,
                                    const at::Tensor& grad_query, const at::Tensor& grad_key,
                                    const at::Tensor& grad_value,
                                    const at::Tensor& grad_mask_full, bool deterministic);

// Reduces the full [B, Hq, L, S] mask gradient to the mask's (broadcast) shape and dtype.
at::Tensor reduce_mask_grad(const at::Tensor& grad_mask_full, const at::Tensor& attn_mask);

// The FlashAttention-2 ops' arguments (flashv100::_flash_forward/_flash_backward), checked and
// turned into kernel parameters in one place for every device.
struct FlashArgs {
  const at::Tensor& query;  // [B, Sq, Hq, D], or [total_q, Hq, D] with cu_seqlens
  const at::Tensor& key;    // [B, Sk, Hkv, D], or [total_k, Hkv, D]
  const at::Tensor& value;
  const std::optional<at::Tensor>& cu_seqlens_q;
  const std::optional<at::Tensor>& cu_seqlens_k;
  int64_t max_seqlen_q;
  int64_t max_seqlen_k;
  double dropout_p;
  double softmax_scale;
  bool causal;
  int64_t window_left;
  int64_t window_right;
  double softcap;
  const std::optional<at::Tensor>& alibi_slopes;
  bool varlen() const { return cu_seqlens_q.has_value(); }
};
// Layouts, dtypes, head counts and dims, cu_seqlens (int32 [B + 1] on the tensors' device, from 0,
// non-decreasing, ending at the packed row count, no sequence longer than max_seqlen: their values
// are read, one device-to-host copy on CUDA), window sizes >= -1, softcap >= 0, alibi_slopes fp32
// [Hq] or [B, Hq], dropout_p in [0, 1).
void check_flash_inputs(const char* op, const FlashArgs& args);
// The backward's extra inputs, as _flash_forward returned them (call after check_flash_inputs).
void check_flash_backward_inputs(const char* op, const FlashArgs& args, const at::Tensor& grad_out,
                                 const at::Tensor& out, const at::Tensor& softmax_lse,
                                 const at::Tensor& rng_state);
// fp32 softmax_lse: [B, Hq, Sq], or [Hq, total_q] for varlen (fp64 for fp64 inputs, like
// allocate_lse).
at::Tensor allocate_flash_lse(const FlashArgs& args);
// causal=True is CausalMode::kBottomRight with window right = 0; window sides that cannot hide a
// key (left >= max_seqlen_k, right >= max_seqlen_q) become -1, so they fit WindowParams' int32.
ForwardParams make_flash_forward_params(const FlashArgs& args, const at::Tensor& out,
                                        const at::Tensor& softmax_lse);
BackwardParams make_flash_backward_params(const FlashArgs& args, const at::Tensor& grad_out,
                                          const at::Tensor& out, const at::Tensor& softmax_lse,
                                          const at::Tensor& grad_query, const at::Tensor& grad_key,
                                          const at::Tensor& grad_value, bool deterministic);

// The KV-cache op's arguments (flashv100::_kvcache_forward, flash_attn_with_kvcache).
struct KVCacheArgs {
  const at::Tensor& query;    // [B, Sq, Hq, D], or packed [total_q, Hq, D] with cu_seqlens_q
  const at::Tensor& k_cache;  // [B_cache, S_cache, Hkv, D], or paged [num_pages, page_size, Hkv, D]
  const at::Tensor& v_cache;
  const std::optional<at::Tensor>& k;  // [B, S_new, Hkv, D], appended at cache_seqlens
  const std::optional<at::Tensor>& v;
  const std::optional<at::Tensor>& rotary_cos;  // [seqlen_ro, rotary_dim / 2]
  const std::optional<at::Tensor>& rotary_sin;
  const at::Tensor& cache_seqlens;                   // int32 [B]
  const std::optional<at::Tensor>& cache_batch_idx;  // int32 [B]
  const std::optional<at::Tensor>& cache_leftpad;    // int32 [B]
  const std::optional<at::Tensor>& block_table;      // int32 [B, max_pages]
  double softmax_scale;
  bool causal;
  int64_t window_left;
  int64_t window_right;
  double softcap;
  bool rotary_interleaved;
  const std::optional<at::Tensor>& alibi_slopes;
  int64_t num_splits;
  // Packed queries (flash_attn_varlen_func with block_table): sequence b is rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of query, at most max_seqlen_q of them.
  const std::optional<at::Tensor>& cu_seqlens_q;
  int64_t max_seqlen_q;
  bool paged() const { return block_table.has_value(); }
  bool varlen_q() const { return cu_seqlens_q.has_value(); }
  int64_t batch() const { return varlen_q() ? cu_seqlens_q->numel() - 1 : query.size(0); }
  int64_t len_q() const { return varlen_q() ? max_seqlen_q : query.size(1); }
  int64_t heads_q() const { return query.size(-2); }
  int64_t head_dim() const { return query.size(-1); }
  int64_t seqlen_new() const { return k.has_value() ? k->size(1) : 0; }
  // Rows one sequence's cache holds: S_cache, or max_pages * page_size.
  int64_t capacity() const {
    return paged() ? block_table->size(1) * k_cache.size(1) : k_cache.size(1);
  }
};
// Layouts, dtypes, devices and shapes (page_size a multiple of 16, block_table int32 [B, max_pages]
// with a contiguous last dim, no cache_batch_idx with a paged cache, rotary_dim even and <= D with
// enough cos/sin rows for every position, num_splits in [0, 128]; packed queries only with
// block_table and without new rows, rotary or a split) and, when check_values, the index tensors'
// values, read on the host (one device-to-host copy for all on CUDA): cu_seqlens_q as
// check_cu_seqlens says, 0 <= cache_leftpad <= cache_seqlens, cache_seqlens + S_new <= capacity(),
// cache_batch_idx in [0, B_cache), and the block_table entries of the pages that hold rows
// [leftpad, cache_seqlens + S_new) in [0, num_pages). The CUDA op skips the values while its
// stream captures a CUDA graph, and when its caller asks it to (check_index_values=False).
void check_kvcache_inputs(const char* op, const KVCacheArgs& args, bool check_values);
// out of query's shape and dtype, and softmax_lse [B, Hq, Sq] ([Hq, total_q] for packed queries;
// fp32, fp64 for fp64 inputs).
at::Tensor allocate_kvcache_out(const KVCacheArgs& args);
at::Tensor allocate_kvcache_lse(const KVCacheArgs& args);
// Whether rotary embedding gives query row i position cache_seqlens + i (causal or windowed
// attention, FlashAttention-2's rule) rather than cache_seqlens for every row.
bool kvcache_q_positions_advance(const KVCacheArgs& args);
// The rotation and append step; q_rotated: where the rotated query goes (undefined: no rotary).
KVAppendParams make_kvcache_append_params(const KVCacheArgs& args, const at::Tensor& q_rotated);
// Attention of `query` (args.query or its rotation, same shape) over the updated cache. Single
// query rows of grouped-query attention without window or ALiBi are seen as the Hq / Hkv rows of
// one KV head (FlashAttention-2's seqlen_q * ngroups swap: strides only, no copy). split stays at
// one split: the launchers choose it.
ForwardParams make_kvcache_forward_params(const KVCacheArgs& args, const at::Tensor& query,
                                          const at::Tensor& out, const at::Tensor& softmax_lse);

}  // namespace flashv100
