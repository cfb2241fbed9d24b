// CUDA implementations of the flashv100 internal ops: checks, device guard, output allocation,
// choice between the fused kernels (atom by compute capability) and the ATen math fallback.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>

#include "cuda/api/launch.h"
#include "kernel_path.h"
#include "tensor_params.h"

namespace flashv100 {
namespace cuda {

bool debug_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("FLASHV100_DEBUG");
    return v != nullptr && std::strcmp(v, "0") != 0 && std::strcmp(v, "") != 0;
  }();
  return enabled;
}

void debug_log(const char* op, const char* path, const char* reason) {
  if (debug_enabled())
    std::fprintf(stderr, "[flashv100] %s: %s%s%s\n", op, path, reason ? ": " : "",
                 reason ? reason : "");
}

void debug_kernel(const char* kernel, int head_dim_bucket, const char* variant, int block_m,
                  int block_n, int threads, int smem_bytes) {
  if (debug_enabled())
    std::fprintf(stderr,
                 "[flashv100]   %s<head dim %d, %s>: tile %d x %d, %d threads, %d B shared\n",
                 kernel, head_dim_bucket, variant, block_m, block_n, threads, smem_bytes);
}

namespace {

MmaAtom atom_of(const at::Tensor& t) {
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, t.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, t.get_device()));
  return mma_atom_for(major, minor);
}

// The internal attention ops' [B, H, L, E] problem.
FusedProblem attention_problem(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value) {
  return FusedProblem{query.scalar_type(),
                      query.size(3),
                      value.size(3),
                      query.size(2),
                      key.size(2),
                      query.size(0) * query.size(1),
                      key.size(0) * key.size(1),
                      query.numel() == 0 || key.numel() == 0};
}

// The FlashAttention-2 ops' problem: [B, S, H, D] or packed [total, H, D]; sequences at most
// max_seqlen_q/k long. Empty problems never reach the kernels (flash_forward_cuda).
FusedProblem flash_problem(const FlashArgs& args) {
  const int64_t batch = args.varlen() ? args.cu_seqlens_q->size(0) - 1 : args.query.size(0);
  return FusedProblem{args.query.scalar_type(),
                      args.query.size(-1),
                      args.value.size(-1),
                      args.max_seqlen_q,
                      args.max_seqlen_k,
                      batch * args.query.size(-2),
                      batch * args.key.size(-2),
                      false};
}

// No query row (nothing to compute) or no key (every row sees nothing: out 0, lse -inf).
bool flash_has_no_query(const FlashArgs& args) { return args.query.numel() == 0; }
bool flash_has_no_key(const FlashArgs& args) { return args.key.numel() == 0; }

// The fused kernels are the only CUDA path of the FlashAttention-2 ops (as in flash_attn, whose
// kernels take fp16/bf16 and head dims that are multiples of 8 up to 256).
void check_flash_fused(const char* op, MmaAtom atom, const FlashArgs& args,
                       std::initializer_list<const at::Tensor*> tensors) {
  const char* reason = fused_unsupported_reason(atom, flash_problem(args), tensors);
  TORCH_CHECK(reason == nullptr, op, ": the CUDA kernels (", mma_atom_name(atom),
              ") cannot run this problem: ", reason, " (query ", args.query.scalar_type(), " ",
              args.query.sizes(), ", value ", args.value.sizes(),
              "); fp16 (and bf16 on sm_80+) with head dims that are multiples of 8 up to 256 and "
              "16-byte aligned rows are supported");
}

std::optional<at::Tensor> contiguous_or_none(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

// The FlashAttention-2 ops' arguments, with contiguous copies of the small index/slope tensors
// the kernels address with unit strides (`args` refers to the copies: not copyable).
struct ContiguousFlashArgs {
  const std::optional<at::Tensor> cu_q, cu_k, slopes;
  const FlashArgs args;

  ContiguousFlashArgs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const std::optional<at::Tensor>& cu_seqlens_q,
                      const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                      int64_t max_seqlen_k, double dropout_p, double softmax_scale, bool causal,
                      int64_t window_left, int64_t window_right, double softcap,
                      const std::optional<at::Tensor>& alibi_slopes)
      : cu_q(contiguous_or_none(cu_seqlens_q)),
        cu_k(contiguous_or_none(cu_seqlens_k)),
        slopes(contiguous_or_none(alibi_slopes)),
        args{query,         key,         value,        cu_q,          cu_k,
             max_seqlen_q,  max_seqlen_k, dropout_p,   softmax_scale, causal,
             window_left,   window_right, softcap,     slopes} {}
  ContiguousFlashArgs(const ContiguousFlashArgs&) = delete;
  ContiguousFlashArgs& operator=(const ContiguousFlashArgs&) = delete;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cuda(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, int64_t causal_mode,
    double scale) {
  constexpr const char* op = "flashv100._attention_forward";
  check_attention_inputs(op, query, key, value, attn_mask, dropout_p, causal_mode);
  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor out = allocate_out(query, value);
  at::Tensor lse = allocate_lse(query);
  ForwardParams params = make_forward_params(query, key, value, attn_mask, out, lse, scale,
                                             causal_mode, dropout_p);
  const MmaAtom atom = atom_of(query);
  const char* reason = fused_unsupported_reason(atom, attention_problem(query, key, value),
                                                {&query, &key, &value, &out});
  at::Tensor rng_state = forward_rng_state(query, dropout_p, params.dropout, reason == nullptr);
  if (reason == nullptr) {
    debug_log(op, mma_atom_name(atom), nullptr);
    run_fused_forward(atom, query.scalar_type(), params);
  } else {
    debug_log(op, "math fallback", reason);
    fallback_forward(query, key, value, attn_mask, dropout_p, causal_mode, scale, rng_state, out,
                     lse);
  }
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const std::optional<at::Tensor>& attn_mask, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& rng_state, double dropout_p, int64_t causal_mode,
    double scale, bool mask_requires_grad, bool deterministic) {
  constexpr const char* op = "flashv100._attention_backward";
  check_backward_inputs(op, grad_out, query, key, value, attn_mask, out, lse, rng_state,
                        dropout_p, causal_mode, mask_requires_grad);
  TORCH_CHECK(rng_state.device() == query.device(), op, ": expected rng_state on ",
              query.device(), " as returned by _attention_forward, got ", rng_state.device());
  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor grad_query = at::empty_like(query), grad_key = at::empty_like(key),
             grad_value = at::empty_like(value);
  at::Tensor grad_mask = at::empty({0}, query.options());
  const MmaAtom atom = atom_of(query);
  const char* reason = fused_unsupported_reason(
      atom, attention_problem(query, key, value),
      {&query, &key, &value, &out, &grad_out, &grad_query, &grad_key, &grad_value});
  if (reason == nullptr && lse.scalar_type() != at::kFloat) reason = "lse is not fp32";
  if (reason == nullptr) {
    debug_log(op, mma_atom_name(atom), deterministic ? "deterministic" : nullptr);
    const at::Tensor lse_c = lse.contiguous();
    // The additive mask's gradient is dS over [B, Hq, L, S]; tiles the kernels skip stay 0.
    const at::Tensor grad_mask_full =
        mask_requires_grad ? at::zeros({query.size(0), query.size(1), query.size(2), key.size(2)},
                                       query.options().dtype(at::kFloat))
                           : at::Tensor();
    BackwardParams params = make_backward_params(
        grad_out, query, key, value, attn_mask, out, lse_c, scale, causal_mode, dropout_p,
        grad_query, grad_key, grad_value, grad_mask_full, deterministic);
    params.fwd.dropout.seed_ptr = rng_state.data_ptr<int64_t>();
    params.fwd.dropout.offset_ptr = rng_state.data_ptr<int64_t>() + 1;
    run_fused_backward(atom, query.scalar_type(), params);
    if (mask_requires_grad) grad_mask = reduce_mask_grad(grad_mask_full, *attn_mask);
  } else {
    debug_log(op, "math fallback", reason);
    const at::Tensor grad_mask_full = fallback_backward(
        grad_out, query, key, value, attn_mask, dropout_p, causal_mode, scale, rng_state,
        mask_requires_grad, grad_query, grad_key, grad_value);
    if (mask_requires_grad) grad_mask = reduce_mask_grad(grad_mask_full, *attn_mask);
  }
  return {grad_query, grad_key, grad_value, grad_mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_forward_cuda(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, double softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, bool /*deterministic: the backward's*/) {
  constexpr const char* op = "flashv100._flash_forward";
  const ContiguousFlashArgs inputs(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                                   window_right, softcap, alibi_slopes);
  const FlashArgs& args = inputs.args;
  check_flash_inputs(op, args);
  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor out = at::empty_like(query);
  at::Tensor lse = allocate_flash_lse(args);
  ForwardParams params = make_flash_forward_params(args, out, lse);
  const bool no_query = flash_has_no_query(args), no_key = flash_has_no_key(args);
  // The forward kernel runs unless there is no query or no key (or check_flash_fused throws).
  at::Tensor rng_state = forward_rng_state(query, dropout_p, params.dropout, !no_query && !no_key);
  if (no_query) return {out, lse, rng_state};
  if (no_key) {
    debug_log(op, "no key", nullptr);
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse, rng_state};
  }
  const MmaAtom atom = atom_of(query);
  check_flash_fused(op, atom, args, {&query, &key, &value, &out});
  debug_log(op, mma_atom_name(atom), args.varlen() ? "varlen" : nullptr);
  run_fused_forward(atom, query.scalar_type(), params);
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& softmax_lse,
    const at::Tensor& rng_state, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    bool deterministic) {
  constexpr const char* op = "flashv100._flash_backward";
  const ContiguousFlashArgs inputs(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                                   window_right, softcap, alibi_slopes);
  const FlashArgs& args = inputs.args;
  check_flash_inputs(op, args);
  check_flash_backward_inputs(op, args, grad_out, out, softmax_lse, rng_state);
  TORCH_CHECK(rng_state.device() == query.device(), op, ": expected rng_state on ",
              query.device(), " as returned by _flash_forward, got ", rng_state.device());
  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor grad_query = at::empty_like(query), grad_key = at::empty_like(key),
             grad_value = at::empty_like(value);
  if (flash_has_no_query(args) || flash_has_no_key(args)) {
    grad_query.zero_();
    grad_key.zero_();
    grad_value.zero_();
    return {grad_query, grad_key, grad_value};
  }
  const MmaAtom atom = atom_of(query);
  check_flash_fused(op, atom, args,
                    {&query, &key, &value, &out, &grad_out, &grad_query, &grad_key, &grad_value});
  debug_log(op, mma_atom_name(atom), deterministic ? "deterministic" : nullptr);
  // The kernels read the lse rows (and write their per-row vectors) contiguously.
  const at::Tensor lse_c = softmax_lse.contiguous();
  BackwardParams params = make_flash_backward_params(args, grad_out, out, lse_c, grad_query,
                                                     grad_key, grad_value, deterministic);
  params.fwd.dropout.seed_ptr = rng_state.data_ptr<int64_t>();
  params.fwd.dropout.offset_ptr = rng_state.data_ptr<int64_t>() + 1;
  run_fused_backward(atom, query.scalar_type(), params);
  return {grad_query, grad_key, grad_value};
}

std::tuple<at::Tensor, at::Tensor> kvcache_forward_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
    bool rotary_interleaved, const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits,
    bool check_index_values, const std::optional<at::Tensor>& cu_seqlens_q,
    int64_t max_seqlen_q) {
  constexpr const char* op = "flashv100._kvcache_forward";
  const std::optional<at::Tensor> slopes = contiguous_or_none(alibi_slopes);
  const KVCacheArgs args{q,           k_cache,         v_cache,       k,
                         v,           rotary_cos,      rotary_sin,    cache_seqlens,
                         cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                         causal,      window_left,     window_right,  softcap,
                         rotary_interleaved, slopes,    num_splits,    cu_seqlens_q,
                         max_seqlen_q};
  const c10::cuda::CUDAGuard guard(q.device());
  // Reading the index values is a device-to-host copy (a synchronisation), which a capturing
  // stream cannot do: a captured decode step trusts them, as a caller that asks to does
  // (documented in flash_attn_with_kvcache).
  const bool capturing =
      c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  check_kvcache_inputs(op, args, /*check_values=*/check_index_values && !capturing);
  at::Tensor out = allocate_kvcache_out(args);
  at::Tensor lse = allocate_kvcache_lse(args);
  const MmaAtom atom = atom_of(q);
  const FusedProblem problem{q.scalar_type(), args.head_dim(), v_cache.size(3), args.len_q(),
                             args.capacity(), args.batch() * args.heads_q(),
                             args.batch() * k_cache.size(2), false};
  const char* reason = fused_unsupported_reason(atom, problem, {&q, &k_cache, &v_cache, &out});
  TORCH_CHECK(reason == nullptr, op, ": the CUDA kernels (", mma_atom_name(atom),
              ") cannot run this problem: ", reason, " (q ", q.scalar_type(), " ", q.sizes(),
              ", k_cache ", k_cache.sizes(), "); fp16 (and bf16 on sm_80+) with head dims that "
              "are multiples of 8 up to 256 and 16-byte aligned rows are supported");
  const at::Tensor q_rotated = rotary_cos.has_value() ? at::empty_like(q) : at::Tensor();
  const KVAppendParams append = make_kvcache_append_params(args, q_rotated);
  if (q.numel() == 0) {
    run_kvcache_append(q.scalar_type(), append);
    return {out, lse};
  }
  ForwardParams params =
      make_kvcache_forward_params(args, q_rotated.defined() ? q_rotated : q, out, lse);
  debug_log(op, mma_atom_name(atom), args.paged() ? "paged" : nullptr);
  run_kvcache_forward(atom, q.scalar_type(), params, append, num_splits, q);
  return {out, lse};
}

at::Tensor dropout_mask_cuda(const at::Tensor& rng_state, int64_t batch, int64_t heads,
                             int64_t len_q, int64_t len_kv, double dropout_p) {
  check_dropout_p("flashv100._dropout_mask", dropout_p);
  TORCH_CHECK(rng_state.numel() == 2 && rng_state.scalar_type() == at::kLong &&
                  rng_state.is_contiguous(),
              "flashv100._dropout_mask: expected rng_state int64[2], got ",
              rng_state.scalar_type(), rng_state.sizes());
  const c10::cuda::CUDAGuard guard(rng_state.device());
  return dropout_keep_mask(rng_state, batch, heads, len_q, len_kv, dropout_p);
}

}  // namespace

TORCH_LIBRARY_IMPL(flashv100, CUDA, m) {
  m.impl("_attention_forward", TORCH_FN(attention_forward_cuda));
  m.impl("_attention_backward", TORCH_FN(attention_backward_cuda));
  m.impl("_flash_forward", TORCH_FN(flash_forward_cuda));
  m.impl("_flash_backward", TORCH_FN(flash_backward_cuda));
  m.impl("_dropout_mask", TORCH_FN(dropout_mask_cuda));
  m.impl("_kvcache_forward", TORCH_FN(kvcache_forward_cuda));
}

}  // namespace cuda
}  // namespace flashv100
