#include "tensor_params.h"

#include <ATen/ATen.h>

#include <array>
#include <utility>
#include <vector>

namespace flashv100 {
namespace {

TensorStrides strides_of(const at::Tensor& t) {
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}

ScalarKind scalar_kind_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return ScalarKind::kHalf;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    case at::kFloat: return ScalarKind::kFloat;
    case at::kDouble: return ScalarKind::kDouble;
    case at::kBool: return ScalarKind::kBool;
    default: TORCH_CHECK(false, "flashv100: unsupported attn_mask dtype ", dtype);
  }
}

MaskParams mask_params_of(const std::optional<at::Tensor>& attn_mask) {
  MaskParams mask;
  if (!attn_mask.has_value()) return mask;
  const at::Tensor& m = *attn_mask;
  mask.ptr = m.data_ptr();
  mask.dtype = scalar_kind_of(m.scalar_type());
  mask.kind = m.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kAdditive;
  // Broadcast dims read the same element: stride 0 whatever the tensor's own stride.
  auto stride_or_zero = [&](int dim) { return m.size(dim) == 1 ? 0 : m.stride(dim); };
  mask.batch_stride = stride_or_zero(0);
  mask.head_stride = stride_or_zero(1);
  mask.row_stride = stride_or_zero(2);
  mask.col_stride = stride_or_zero(3);
  return mask;
}

at::ScalarType lse_dtype_of(const at::Tensor& query) {
  return query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The rules query, key and value share in every layout.
void check_qkv_dtype_and_device(const char* op, const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value) {
  TORCH_CHECK(key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type(),
              op, ": expected query, key and value of one dtype, got ", query.scalar_type(), ", ",
              key.scalar_type(), ", ", value.scalar_type());
  TORCH_CHECK(at::isFloatingType(query.scalar_type()), op,
              ": expected floating-point query, got ", query.scalar_type());
  TORCH_CHECK(key.device() == query.device() && value.device() == query.device(), op,
              ": expected query, key and value on one device, got ", query.device(), ", ",
              key.device(), ", ", value.device());
  for (const auto& [name, t] : {std::pair{"query", &query}, {"key", &key}, {"value", &value}}) {
    TORCH_CHECK(t->size(-1) <= 1 || t->stride(-1) == 1, op, ": expected ", name,
                " with a contiguous last dim (stride 1), got strides ", t->strides(),
                "; pass ", name, ".contiguous()");
  }
}

void check_gqa_heads(const char* op, int64_t heads_q, int64_t heads_kv) {
  TORCH_CHECK(heads_kv > 0 && heads_q % heads_kv == 0, op, ": query heads (", heads_q,
              ") must be a multiple of key/value heads (", heads_kv, ")");
}

// out, grad_out, lse and rng_state of a backward, as the forward returned them.
void check_saved_forward(const char* op, const at::Tensor& query, at::IntArrayRef out_shape,
                         const at::Tensor& out, const at::Tensor& grad_out,
                         at::IntArrayRef lse_shape, const at::Tensor& lse,
                         const at::Tensor& rng_state, const char* forward_op) {
  TORCH_CHECK(out.sizes() == out_shape && out.scalar_type() == query.scalar_type() &&
                  out.device() == query.device(),
              op, ": expected out ", out_shape, " of query's dtype and device, got ", out.sizes(),
              " ", out.scalar_type(), " on ", out.device());
  TORCH_CHECK(grad_out.sizes() == out.sizes() && grad_out.scalar_type() == query.scalar_type() &&
                  grad_out.device() == query.device() &&
                  (grad_out.numel() == 0 || grad_out.stride(-1) == 1),
              op, ": expected grad_out like out ", out.sizes(), " with a contiguous last dim, got ",
              grad_out.sizes(), " ", grad_out.scalar_type(), " on ", grad_out.device());
  const at::ScalarType lse_dtype = lse_dtype_of(query);
  TORCH_CHECK(lse.sizes() == lse_shape && lse.scalar_type() == lse_dtype &&
                  lse.device() == query.device(),
              op, ": expected lse ", lse_shape, " of dtype ", lse_dtype, " as returned by ",
              forward_op, ", got ", lse.sizes(), " ", lse.scalar_type());
  TORCH_CHECK(rng_state.numel() == 2 && rng_state.scalar_type() == at::kLong &&
                  rng_state.is_contiguous(),
              op, ": expected rng_state int64[2] as returned by ", forward_op, ", got ",
              rng_state.scalar_type(), rng_state.sizes());
}

// cu_seqlens' layout: int32 [batch + 1], contiguous, on `device`.
void check_cu_seqlens_layout(const char* op, const char* name, const at::Tensor& cu,
                             const at::Device& device) {
  TORCH_CHECK(cu.scalar_type() == at::kInt, op, ": expected ", name, " of dtype int32, got ",
              cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1 && cu.is_contiguous(), op, ": expected ", name,
              " a contiguous 1-D [batch + 1] tensor, got ", cu.sizes(), " with strides ",
              cu.strides());
  TORCH_CHECK(cu.device() == device, op, ": expected ", name, " on ", device,
              " (query's device), got ", cu.device());
}

// cu_seqlens' values (`count` offsets, on the host) for `rows` packed rows: 0, non-decreasing,
// ending at `rows`, no sequence longer than max_seqlen.
void check_cu_seqlens_values(const char* op, const char* name, const int32_t* offsets,
                             int64_t count, int64_t rows, const char* max_name,
                             int64_t max_seqlen) {
  TORCH_CHECK(offsets[0] == 0, op, ": expected ", name, "[0] == 0, got ", offsets[0]);
  for (int64_t b = 0; b + 1 < count; ++b) {
    const int64_t length = int64_t{offsets[b + 1]} - offsets[b];
    TORCH_CHECK(length >= 0, op, ": expected non-decreasing ", name, ", got ", name, "[", b + 1,
                "] = ", offsets[b + 1], " < ", name, "[", b, "] = ", offsets[b]);
    TORCH_CHECK(length <= max_seqlen, op, ": sequence ", b, " has ", length, " rows (", name,
                "), more than ", max_name, " = ", max_seqlen);
  }
  TORCH_CHECK(offsets[count - 1] == rows, op, ": expected ", name, "[-1] == ", rows,
              " (the packed rows), got ", offsets[count - 1]);
}

// cu_seqlens of `rows` packed rows: its layout, and its values read on the host.
void check_cu_seqlens(const char* op, const char* name, const at::Tensor& cu, int64_t rows,
                      const char* max_name, int64_t max_seqlen, const at::Device& device) {
  check_cu_seqlens_layout(op, name, cu, device);
  const at::Tensor host = cu.device().is_cpu() ? cu : cu.to(at::kCPU);
  check_cu_seqlens_values(op, name, host.data_ptr<int32_t>(), cu.size(0), rows, max_name,
                          max_seqlen);
}

TensorStrides flash_strides_of(const at::Tensor& t, bool varlen) {
  // [B, S, H, D]: (batch, head, row) = (0, 2, 1); packed [total, H, D]: (-, 1, 0).
  return varlen ? TensorStrides{0, t.stride(1), t.stride(0)}
                : TensorStrides{t.stride(0), t.stride(2), t.stride(1)};
}

// window sizes >= -1, softcap >= 0, alibi_slopes fp32 [Hq] or [B, Hq] on `device`.
void check_score_mods(const char* op, int64_t window_left, int64_t window_right, double softcap,
                      const std::optional<at::Tensor>& alibi_slopes, int64_t batch,
                      int64_t heads_q, const at::Device& device) {
  TORCH_CHECK(window_left >= -1 && window_right >= -1, op,
              ": expected window_size entries >= -1 (-1: unbounded), got (", window_left, ", ",
              window_right, ")");
  TORCH_CHECK(softcap >= 0.0, op, ": expected softcap >= 0 (0: off), got ", softcap);
  if (!alibi_slopes.has_value()) return;
  const at::Tensor& slopes = *alibi_slopes;
  TORCH_CHECK(slopes.scalar_type() == at::kFloat, op,
              ": expected alibi_slopes of dtype float32, got ", slopes.scalar_type());
  TORCH_CHECK(slopes.device() == device, op, ": expected alibi_slopes on ", device,
              " (query's device), got ", slopes.device());
  const bool per_head = slopes.dim() == 1 && slopes.size(0) == heads_q;
  const bool per_batch_head =
      slopes.dim() == 2 && slopes.size(0) == batch && slopes.size(1) == heads_q;
  TORCH_CHECK(per_head || per_batch_head, op, ": expected alibi_slopes [Hq] = [", heads_q,
              "] or [B, Hq] = [", batch, ", ", heads_q, "], got ", slopes.sizes());
  TORCH_CHECK(slopes.stride(-1) == 1 || heads_q <= 1, op,
              ": expected alibi_slopes with a contiguous last dim");
}

// A contiguous int32 index tensor of `shape` on `device` (the kernels read it with unit strides).
void check_index_tensor(const char* op, const char* name, const at::Tensor& t,
                        at::IntArrayRef shape, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kInt, op, ": expected ", name, " of dtype int32, got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, op, ": expected ", name, " of shape ", shape, ", got ",
              t.sizes());
  TORCH_CHECK(t.device() == device, op, ": expected ", name, " on ", device,
              " (query's device), got ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": expected a contiguous ", name, ", got strides ",
              t.strides());
}

// The values of int32 index tensors of one device, on the host, each contiguous in its input's
// shape: one device-to-host copy for all of them, since every copy waits for the device's queued
// work. The CPU takes the same path (a copy of a few integers) so that its tests cover it.
std::vector<at::Tensor> host_values(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : tensors) flat.push_back(t.reshape({-1}));
  const at::Tensor all = at::cat(flat).to(at::kCPU);
  std::vector<at::Tensor> values;
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    values.push_back(all.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  return values;
}

// softmax_lse's shape: [B, Hq, Sq] from query [B, Sq, Hq, D], [Hq, total_q] from [total_q, Hq, D].
std::vector<int64_t> flash_lse_shape(const FlashArgs& args) {
  const at::Tensor& q = args.query;
  if (args.varlen()) return {q.size(1), q.size(0)};
  return {q.size(0), q.size(2), q.size(1)};
}

// A window side that cannot hide any key of any row is unbounded (-1).
int32_t effective_window(int64_t size, int64_t unbounded_from) {
  return size < 0 || size >= unbounded_from ? -1 : static_cast<int32_t>(size);
}

// FlashAttention-2's score rules of both FA2 ops: causal as a right window of 0, window sides that
// cannot hide a key (past longest_k on the left, longest_q on the right) unbounded, softcap, ALiBi.
void set_flash_score_rules(ForwardParams& p, bool causal, int64_t window_left,
                           int64_t window_right, int64_t longest_q, int64_t longest_k,
                           double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  p.window.left = effective_window(window_left, longest_k);
  p.window.right = causal ? 0 : effective_window(window_right, longest_q);
  p.causal = p.window.right == 0 ? CausalMode::kBottomRight : CausalMode::kNone;
  p.score_mod.softcap = static_cast<float>(softcap);
  if (alibi_slopes.has_value()) {
    const at::Tensor& slopes = *alibi_slopes;
    p.score_mod.alibi_slopes = slopes.data_ptr<float>();
    p.score_mod.alibi_batch_stride = slopes.dim() == 2 ? slopes.stride(0) : 0;
  }
}

}  // namespace

void check_dropout_p(const char* op, double dropout_p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": expected dropout_p in [0, 1), got ",
              dropout_p);
}

void check_attention_inputs(const char* op, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                            double dropout_p, int64_t causal_mode) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, op,
              ": expected 4-D query, key and value [B, H, L, E], got query ", query.sizes(),
              ", key ", key.sizes(), ", value ", value.sizes());
  check_qkv_dtype_and_device(op, query, key, value);
  const int64_t batch = query.size(0), heads_q = query.size(1), len_q = query.size(2);
  const int64_t heads_kv = key.size(1), len_kv = key.size(2);
  TORCH_CHECK(key.size(0) == batch && value.size(0) == batch, op,
              ": expected key and value batch ", batch, ", got ", key.size(0), " and ",
              value.size(0));
  TORCH_CHECK(value.size(1) == heads_kv && value.size(2) == len_kv, op,
              ": expected value [B, Hkv, S, Ev] to match key ", key.sizes(), ", got ",
              value.sizes());
  TORCH_CHECK(key.size(3) == query.size(3), op, ": expected key head dim ", query.size(3),
              " (query's), got ", key.size(3));
  check_gqa_heads(op, heads_q, heads_kv);
  check_dropout_p(op, dropout_p);
  TORCH_CHECK(causal_mode >= 0 && causal_mode <= 2, op,
              ": expected causal_mode 0 (none), 1 (top-left) or 2 (bottom-right), got ",
              causal_mode);
  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool || at::isFloatingType(m.scalar_type()), op,
                ": expected a bool or floating attn_mask, got ", m.scalar_type());
    TORCH_CHECK(m.device() == query.device(), op, ": expected attn_mask on ", query.device(),
                ", got ", m.device());
    const int64_t full[4] = {batch, heads_q, len_q, len_kv};
    TORCH_CHECK(m.dim() == 4, op, ": expected a 4-D attn_mask, got ", m.sizes());
    for (int d = 0; d < 4; ++d) {
      TORCH_CHECK(m.size(d) == 1 || m.size(d) == full[d], op, ": attn_mask ", m.sizes(),
                  " is not broadcastable to [", batch, ", ", heads_q, ", ", len_q, ", ", len_kv,
                  "]");
    }
  }
}

void check_backward_inputs(const char* op, const at::Tensor& grad_out, const at::Tensor& query,
                           const at::Tensor& key, const at::Tensor& value,
                           const std::optional<at::Tensor>& attn_mask, const at::Tensor& out,
                           const at::Tensor& lse, const at::Tensor& rng_state, double dropout_p,
                           int64_t causal_mode, bool mask_requires_grad) {
  check_attention_inputs(op, query, key, value, attn_mask, dropout_p, causal_mode);
  const std::array<int64_t, 4> out_dims = {query.size(0), query.size(1), query.size(2),
                                           value.size(3)};
  const at::IntArrayRef out_shape(out_dims);
  check_saved_forward(op, query, out_shape, out, grad_out, out_shape.slice(0, 3), lse, rng_state,
                      "_attention_forward");
  TORCH_CHECK(!mask_requires_grad || (attn_mask.has_value() && attn_mask->is_floating_point()),
              op, ": mask_requires_grad needs an additive (floating) attn_mask");
}

at::Tensor allocate_out(const at::Tensor& query, const at::Tensor& value) {
  if (value.size(3) == query.size(3)) return at::empty_like(query);
  return at::empty({query.size(0), query.size(1), query.size(2), value.size(3)}, query.options());
}

at::Tensor allocate_lse(const at::Tensor& query) {
  return at::empty({query.size(0), query.size(1), query.size(2)},
                   query.options().dtype(lse_dtype_of(query)));
}

ForwardParams make_forward_params(const at::Tensor& query, const at::Tensor& key,
                                  const at::Tensor& value,
                                  const std::optional<at::Tensor>& attn_mask,
                                  const at::Tensor& out, const at::Tensor& lse, double scale,
                                  int64_t causal_mode, double dropout_p) {
  ForwardParams p;
  p.shape = AttentionShape{query.size(0), query.size(1), key.size(1), query.size(2),
                           key.size(2),   query.size(3), value.size(3)};
  p.q = query.data_ptr();
  p.k = key.data_ptr();
  p.v = value.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.scalar_type() == at::kFloat ? lse.data_ptr<float>() : nullptr;
  p.lse_layout = LseLayout{lse.stride(0), lse.stride(1)};
  p.q_strides = strides_of(query);
  p.k_strides = strides_of(key);
  p.v_strides = strides_of(value);
  p.out_strides = strides_of(out);
  p.scale = scale;
  p.causal = static_cast<CausalMode>(causal_mode);
  p.mask = mask_params_of(attn_mask);
  p.dropout.p = static_cast<float>(dropout_p);
  return p;
}

BackwardParams make_backward_params(const at::Tensor& grad_out, const at::Tensor& query,
                                    const at::Tensor& key, const at::Tensor& value,
                                    const std::optional<at::Tensor>& attn_mask,
                                    const at::Tensor& out, const at::Tensor& lse, double scale,
                                    int64_t causal_mode, double dropout_p,
                                    const at::Tensor& grad_query, const at::Tensor& grad_key,
                                    const at::Tensor& grad_value,
                                    const at::Tensor& grad_mask_full, bool deterministic) {
  BackwardParams p;
  p.fwd = make_forward_params(query, key, value, attn_mask, out, lse, scale, causal_mode,
                              dropout_p);
  p.dout = grad_out.data_ptr();
  p.dq = grad_query.data_ptr();
  p.dk = grad_key.data_ptr();
  p.dv = grad_value.data_ptr();
  p.dout_strides = strides_of(grad_out);
  p.dq_strides = strides_of(grad_query);
  p.dk_strides = strides_of(grad_key);
  p.dv_strides = strides_of(grad_value);
  p.dmask = grad_mask_full.defined() && grad_mask_full.scalar_type() == at::kFloat
                ? grad_mask_full.data_ptr<float>()
                : nullptr;
  p.deterministic = deterministic;
  return p;
}

at::Tensor reduce_mask_grad(const at::Tensor& grad_mask_full, const at::Tensor& attn_mask) {
  return grad_mask_full.sum_to_size(attn_mask.sizes()).to(attn_mask.scalar_type());
}

void check_flash_inputs(const char* op, const FlashArgs& args) {
  const at::Tensor &query = args.query, &key = args.key, &value = args.value;
  const bool varlen = args.varlen();
  TORCH_CHECK(args.cu_seqlens_k.has_value() == varlen, op,
              ": expected both cu_seqlens_q and cu_seqlens_k, or neither");
  if (varlen) {
    TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, op,
                ": expected packed query [total_q, Hq, D], key and value [total_k, Hkv, D], got "
                "query ", query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  } else {
    TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, op,
                ": expected query [B, Sq, Hq, D], key and value [B, Sk, Hkv, D], got query ",
                query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  }
  check_qkv_dtype_and_device(op, query, key, value);
  const int64_t heads_q = query.size(-2), heads_kv = key.size(-2), dim = query.size(-1);
  TORCH_CHECK(value.sizes().slice(0, value.dim() - 1) == key.sizes().slice(0, key.dim() - 1), op,
              ": expected value ", varlen ? "[total_k, Hkv, D]" : "[B, Sk, Hkv, D]",
              " to match key ", key.sizes(), ", got ", value.sizes());
  TORCH_CHECK(key.size(-1) == dim && value.size(-1) == dim, op,
              ": expected key and value head dim ", dim, " (query's), got ", key.size(-1),
              " and ", value.size(-1));
  check_gqa_heads(op, heads_q, heads_kv);
  check_dropout_p(op, args.dropout_p);
  TORCH_CHECK(args.max_seqlen_q >= 0 && args.max_seqlen_k >= 0, op,
              ": expected max_seqlen_q and max_seqlen_k >= 0, got ", args.max_seqlen_q, " and ",
              args.max_seqlen_k);
  int64_t batch = 0;
  if (varlen) {
    batch = args.cu_seqlens_q->numel() - 1;
    check_cu_seqlens(op, "cu_seqlens_q", *args.cu_seqlens_q, query.size(0), "max_seqlen_q",
                     args.max_seqlen_q, query.device());
    check_cu_seqlens(op, "cu_seqlens_k", *args.cu_seqlens_k, key.size(0), "max_seqlen_k",
                     args.max_seqlen_k, query.device());
    TORCH_CHECK(args.cu_seqlens_k->numel() == batch + 1, op,
                ": expected cu_seqlens_k of cu_seqlens_q's length ", batch + 1, ", got ",
                args.cu_seqlens_k->numel());
  } else {
    batch = query.size(0);
    TORCH_CHECK(key.size(0) == batch, op, ": expected key and value batch ", batch,
                " (query's), got ", key.size(0));
    TORCH_CHECK(args.max_seqlen_q == query.size(1) && args.max_seqlen_k == key.size(1), op,
                ": without cu_seqlens, expected max_seqlen_q = Sq = ", query.size(1),
                " and max_seqlen_k = Sk = ", key.size(1), ", got ", args.max_seqlen_q, " and ",
                args.max_seqlen_k);
  }
  check_score_mods(op, args.window_left, args.window_right, args.softcap, args.alibi_slopes,
                   batch, heads_q, query.device());
}

void check_flash_backward_inputs(const char* op, const FlashArgs& args, const at::Tensor& grad_out,
                                 const at::Tensor& out, const at::Tensor& softmax_lse,
                                 const at::Tensor& rng_state) {
  check_saved_forward(op, args.query, args.query.sizes(), out, grad_out, flash_lse_shape(args),
                      softmax_lse, rng_state, "_flash_forward");
}

at::Tensor allocate_flash_lse(const FlashArgs& args) {
  return at::empty(flash_lse_shape(args), args.query.options().dtype(lse_dtype_of(args.query)));
}

ForwardParams make_flash_forward_params(const FlashArgs& args, const at::Tensor& out,
                                        const at::Tensor& softmax_lse) {
  const at::Tensor &query = args.query, &key = args.key, &value = args.value;
  const bool varlen = args.varlen();
  ForwardParams p;
  p.shape = AttentionShape{varlen ? args.cu_seqlens_q->numel() - 1 : query.size(0),
                           query.size(-2),
                           key.size(-2),
                           args.max_seqlen_q,
                           args.max_seqlen_k,
                           query.size(-1),
                           value.size(-1)};
  p.q = query.data_ptr();
  p.k = key.data_ptr();
  p.v = value.data_ptr();
  p.out = out.data_ptr();
  p.lse = softmax_lse.scalar_type() == at::kFloat ? softmax_lse.data_ptr<float>() : nullptr;
  p.lse_layout = varlen ? LseLayout{0, softmax_lse.stride(0)}
                        : LseLayout{softmax_lse.stride(0), softmax_lse.stride(1)};
  p.q_strides = flash_strides_of(query, varlen);
  p.k_strides = flash_strides_of(key, varlen);
  p.v_strides = flash_strides_of(value, varlen);
  p.out_strides = flash_strides_of(out, varlen);
  p.scale = args.softmax_scale;
  // Key j is hidden from row i iff j < i + shift - left (left >= len_kv: never) or
  // j > i + shift + right (right >= len_q - 1: never).
  set_flash_score_rules(p, args.causal, args.window_left, args.window_right, args.max_seqlen_q,
                        args.max_seqlen_k, args.softcap, args.alibi_slopes);
  if (varlen) {
    p.varlen.cu_seqlens_q = args.cu_seqlens_q->data_ptr<int32_t>();
    p.varlen.cu_seqlens_k = args.cu_seqlens_k->data_ptr<int32_t>();
  }
  p.dropout.p = static_cast<float>(args.dropout_p);
  return p;
}

BackwardParams make_flash_backward_params(const FlashArgs& args, const at::Tensor& grad_out,
                                          const at::Tensor& out, const at::Tensor& softmax_lse,
                                          const at::Tensor& grad_query, const at::Tensor& grad_key,
                                          const at::Tensor& grad_value, bool deterministic) {
  const bool varlen = args.varlen();
  BackwardParams p;
  p.fwd = make_flash_forward_params(args, out, softmax_lse);
  p.dout = grad_out.data_ptr();
  p.dq = grad_query.data_ptr();
  p.dk = grad_key.data_ptr();
  p.dv = grad_value.data_ptr();
  p.dout_strides = flash_strides_of(grad_out, varlen);
  p.dq_strides = flash_strides_of(grad_query, varlen);
  p.dk_strides = flash_strides_of(grad_key, varlen);
  p.dv_strides = flash_strides_of(grad_value, varlen);
  p.deterministic = deterministic;
  return p;
}

}  // namespace flashv100

namespace flashv100 {

void check_kvcache_inputs(const char* op, const KVCacheArgs& args, bool check_values) {
  const at::Tensor &q = args.query, &k_cache = args.k_cache, &v_cache = args.v_cache;
  TORCH_CHECK(q.dim() == (args.varlen_q() ? 3 : 4) && k_cache.dim() == 4 && v_cache.dim() == 4,
              op, ": expected q [B, Sq, Hq, D] (or [total_q, Hq, D] with cu_seqlens_q) and "
              "k_cache, v_cache [B_cache, S_cache, Hkv, D] (or [num_pages, page_size, Hkv, D] "
              "with block_table), got q ", q.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ",
              v_cache.sizes());
  check_qkv_dtype_and_device(op, q, k_cache, v_cache);
  const at::Device device = q.device();
  if (args.varlen_q()) {
    check_cu_seqlens_layout(op, "cu_seqlens_q", *args.cu_seqlens_q, device);
    TORCH_CHECK(args.max_seqlen_q >= 0, op, ": expected max_seqlen_q >= 0, got ",
                args.max_seqlen_q);
    // Packed queries attend to what the cache holds: FlashAttention-2's paged varlen forward.
    TORCH_CHECK(args.paged() && !args.k.has_value() && !args.rotary_cos.has_value() &&
                    args.num_splits <= 1,
                op, ": packed queries (cu_seqlens_q) need block_table, and take no new k/v, no "
                "rotary_cos/rotary_sin and num_splits 0 or 1");
  }
  const int64_t batch = args.batch(), len_q = args.len_q(), heads_q = args.heads_q();
  const int64_t dim = args.head_dim();
  const int64_t heads_kv = k_cache.size(2);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": expected v_cache of k_cache's shape ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  TORCH_CHECK(k_cache.size(3) == dim, op, ": expected k_cache and v_cache head dim ", dim,
              " (q's), got ", k_cache.size(3));
  check_gqa_heads(op, heads_q, heads_kv);
  TORCH_CHECK(batch > 0, op, ": expected a batch of at least one sequence, got q ", q.sizes());
  if (args.paged()) {
    const at::Tensor& table = *args.block_table;
    TORCH_CHECK(table.scalar_type() == at::kInt, op,
                ": expected block_table of dtype int32, got ", table.scalar_type());
    TORCH_CHECK(table.dim() == 2 && table.size(0) == batch && table.size(1) > 0, op,
                ": expected block_table [B, max_pages] = [", batch, ", max_pages >= 1], got ",
                table.sizes());
    TORCH_CHECK(table.device() == device, op, ": expected block_table on ", device,
                " (query's device), got ", table.device());
    TORCH_CHECK(table.stride(1) == 1 || table.size(1) == 1, op,
                ": expected block_table with a contiguous last dim, got strides ",
                table.strides());
    const int64_t page_size = k_cache.size(1);
    TORCH_CHECK(page_size > 0 && page_size % 16 == 0, op,
                ": expected a page size (k_cache.shape[1] with block_table) that is a positive "
                "multiple of 16, got ", page_size);
    TORCH_CHECK(!args.cache_batch_idx.has_value(), op,
                ": cache_batch_idx cannot be combined with block_table (a paged cache addresses "
                "each sequence's pages through its block_table row)");
  } else {
    TORCH_CHECK(args.cache_batch_idx.has_value() || k_cache.size(0) >= batch, op,
                ": expected k_cache with at least B = ", batch,
                " sequences (or a cache_batch_idx), got ", k_cache.sizes());
  }
  check_index_tensor(op, "cache_seqlens", args.cache_seqlens, {batch}, device);
  if (args.cache_batch_idx.has_value())
    check_index_tensor(op, "cache_batch_idx", *args.cache_batch_idx, {batch}, device);
  if (args.cache_leftpad.has_value())
    check_index_tensor(op, "cache_leftpad", *args.cache_leftpad, {batch}, device);
  TORCH_CHECK(args.k.has_value() == args.v.has_value(), op,
              ": expected both k and v (the new keys and values), or neither");
  const int64_t seqlen_new = args.seqlen_new();
  if (args.k.has_value()) {
    const at::Tensor &k = *args.k, &v = *args.v;
    TORCH_CHECK(k.dim() == 4 && k.size(0) == batch && k.size(2) == heads_kv && k.size(3) == dim,
                op, ": expected k [B, S_new, Hkv, D] = [", batch, ", S_new, ", heads_kv, ", ",
                dim, "], got ", k.sizes());
    TORCH_CHECK(v.sizes() == k.sizes(), op, ": expected v of k's shape ", k.sizes(), ", got ",
                v.sizes());
    check_qkv_dtype_and_device(op, q, k, v);
  }
  const int64_t capacity = args.capacity();
  TORCH_CHECK(args.rotary_cos.has_value() == args.rotary_sin.has_value(), op,
              ": expected both rotary_cos and rotary_sin, or neither");
  if (args.rotary_cos.has_value()) {
    const at::Tensor &cos = *args.rotary_cos, &sin = *args.rotary_sin;
    TORCH_CHECK(args.k.has_value(), op,
                ": rotary_cos/rotary_sin need the new k and v (FlashAttention-2 rotates q and the "
                "appended keys)");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) > 0 && 2 * cos.size(1) <= dim, op,
                ": expected rotary_cos [seqlen_ro, rotary_dim / 2] with 0 < rotary_dim <= D = ",
                dim, ", got ", cos.sizes());
    TORCH_CHECK(sin.sizes() == cos.sizes(), op, ": expected rotary_sin of rotary_cos's shape ",
                cos.sizes(), ", got ", sin.sizes());
    for (const auto& [name, t] : {std::pair{"rotary_cos", &cos}, {"rotary_sin", &sin}}) {
      TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device() == device, op,
                  ": expected ", name, " of q's dtype ", q.scalar_type(), " on ", device,
                  ", got ", t->scalar_type(), " on ", t->device());
      TORCH_CHECK(t->is_contiguous(), op, ": expected a contiguous ", name);
    }
    // Positions stay below capacity (new keys) and, for query rows past the new keys, below
    // capacity - S_new + Sq: enough rows for any valid cache_seqlens, values unread.
    const int64_t positions =
        kvcache_q_positions_advance(args) ? std::max(capacity, capacity - seqlen_new + len_q)
                                          : capacity;
    TORCH_CHECK(cos.size(0) >= positions, op, ": expected rotary_cos/rotary_sin with at least ",
                positions, " rows (one per cache position), got ", cos.size(0));
  }
  check_score_mods(op, args.window_left, args.window_right, args.softcap, args.alibi_slopes,
                   batch, heads_q, device);
  TORCH_CHECK(args.num_splits >= 0 && args.num_splits <= 128, op,
              ": expected num_splits in [0, 128] (0: chosen by the kernels), got ",
              args.num_splits);
  if (!check_values) return;

  std::vector<at::Tensor> indices{args.cache_seqlens};
  for (const std::optional<at::Tensor>* index :
       {&args.cache_leftpad, &args.cache_batch_idx, &args.block_table, &args.cu_seqlens_q}) {
    if (index->has_value()) indices.push_back(**index);
  }
  const std::vector<at::Tensor> host = host_values(indices);
  if (args.varlen_q()) {
    check_cu_seqlens_values(op, "cu_seqlens_q", host.back().data_ptr<int32_t>(), batch + 1,
                            q.size(0), "max_seqlen_q", len_q);
  }
  auto next_host = host.begin();
  const int32_t* lens = (next_host++)->data_ptr<int32_t>();
  const int32_t* leftpad =
      args.cache_leftpad.has_value() ? (next_host++)->data_ptr<int32_t>() : nullptr;
  if (args.cache_batch_idx.has_value()) {
    const int32_t* idx = (next_host++)->data_ptr<int32_t>();
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(idx[b] >= 0 && idx[b] < k_cache.size(0), op, ": cache_batch_idx[", b, "] = ",
                  idx[b], " is outside the cache's batch [0, ", k_cache.size(0), ")");
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    // flash_attn_varlen_func passes cu_seqlens_k's differences as cache_seqlens.
    TORCH_CHECK(lens[b] >= 0, op, ": cache_seqlens[", b, "] = ", lens[b],
                args.varlen_q() ? " (cu_seqlens_k's difference there)" : "",
                " is negative: a sequence's keys are never fewer than 0");
    TORCH_CHECK(lens[b] + seqlen_new <= capacity, op, ": cache_seqlens[", b,
                "] = ", lens[b], " with ", seqlen_new, " new rows does not fit a cache of ",
                capacity, " rows per sequence", args.paged() ? " (max_pages * page_size)" : "");
    if (leftpad != nullptr) {
      TORCH_CHECK(leftpad[b] >= 0 && leftpad[b] <= lens[b], op, ": expected 0 <= cache_leftpad[",
                  b, "] <= cache_seqlens[", b, "] = ", lens[b], ", got ", leftpad[b]);
    }
  }
  if (args.paged()) {
    const int64_t page_size = k_cache.size(1), stride = next_host->stride(0);
    const int32_t* table = next_host->data_ptr<int32_t>();
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t first = leftpad != nullptr ? leftpad[b] : 0, end = lens[b] + seqlen_new;
      for (int64_t page = first / page_size; page * page_size < end; ++page) {
        const int32_t entry = table[b * stride + page];
        TORCH_CHECK(entry >= 0 && entry < k_cache.size(0), op, ": block_table[", b, ", ", page,
                    "] = ", entry, " is outside k_cache's ", k_cache.size(0), " pages");
      }
    }
  }
}

at::Tensor allocate_kvcache_out(const KVCacheArgs& args) {
  return at::empty(args.query.sizes(), args.query.options());
}

at::Tensor allocate_kvcache_lse(const KVCacheArgs& args) {
  const at::Tensor& q = args.query;
  const at::TensorOptions options = q.options().dtype(lse_dtype_of(q));
  if (args.varlen_q()) return at::empty({q.size(1), q.size(0)}, options);
  return at::empty({q.size(0), q.size(2), q.size(1)}, options);
}

bool kvcache_q_positions_advance(const KVCacheArgs& args) {
  // FlashAttention-2: local iff a window side below the cache capacity remains.
  const int64_t capacity = args.capacity();
  const auto bounded = [&](int64_t side) { return side >= 0 && side < capacity; };
  return args.causal || bounded(args.window_left) || bounded(args.window_right);
}

namespace {

KVCacheParams kvcache_params_of(const KVCacheArgs& args) {
  KVCacheParams c;
  c.seqlens = args.cache_seqlens.data_ptr<int32_t>();
  if (args.cache_leftpad.has_value()) c.leftpad = args.cache_leftpad->data_ptr<int32_t>();
  if (args.cache_batch_idx.has_value()) c.batch_idx = args.cache_batch_idx->data_ptr<int32_t>();
  if (args.paged()) {
    c.block_table = args.block_table->data_ptr<int32_t>();
    c.block_table_stride = args.block_table->stride(0);
    c.block_table_cols = args.block_table->size(1);
    c.page_size = args.k_cache.size(1);
  }
  c.seqlen_new = args.seqlen_new();
  return c;
}

}  // namespace

KVAppendParams make_kvcache_append_params(const KVCacheArgs& args, const at::Tensor& q_rotated) {
  const at::Tensor& q = args.query;
  KVAppendParams a;
  a.cache = kvcache_params_of(args);
  a.batch = args.batch();
  a.heads_q = args.heads_q();
  a.heads_kv = args.k_cache.size(2);
  a.len_q = args.len_q();
  a.head_dim = args.head_dim();
  a.head_dim_v = args.v_cache.size(3);
  a.k_cache = args.k_cache.data_ptr();
  a.v_cache = args.v_cache.data_ptr();
  a.k_cache_strides = flash_strides_of(args.k_cache, false);
  a.v_cache_strides = flash_strides_of(args.v_cache, false);
  if (args.k.has_value()) {
    a.k_new = args.k->data_ptr();
    a.v_new = args.v->data_ptr();
    a.k_new_strides = flash_strides_of(*args.k, false);
    a.v_new_strides = flash_strides_of(*args.v, false);
  }
  a.q = q.data_ptr();
  a.q_strides = flash_strides_of(q, args.varlen_q());
  if (q_rotated.defined()) {
    a.q_rotated = q_rotated.data_ptr();
    a.q_rotated_strides = flash_strides_of(q_rotated, false);
    a.rotary_cos = args.rotary_cos->data_ptr();
    a.rotary_sin = args.rotary_sin->data_ptr();
    a.rotary_dim = 2 * args.rotary_cos->size(1);
    a.rotary_interleaved = args.rotary_interleaved;
    a.q_positions_advance = kvcache_q_positions_advance(args);
  }
  return a;
}

ForwardParams make_kvcache_forward_params(const KVCacheArgs& args, const at::Tensor& query,
                                          const at::Tensor& out, const at::Tensor& softmax_lse) {
  const bool varlen = args.varlen_q();
  const int64_t batch = args.batch(), len_q = args.len_q(), heads_q = args.heads_q();
  const int64_t heads_kv = args.k_cache.size(2);
  ForwardParams p;
  p.shape = AttentionShape{batch,         heads_q,           heads_kv,          len_q,
                           args.capacity(), args.head_dim(), args.v_cache.size(3)};
  p.q = query.data_ptr();
  p.k = args.k_cache.data_ptr();
  p.v = args.v_cache.data_ptr();
  p.out = out.data_ptr();
  p.lse = softmax_lse.scalar_type() == at::kFloat ? softmax_lse.data_ptr<float>() : nullptr;
  p.lse_layout = varlen ? LseLayout{0, softmax_lse.stride(0)}
                        : LseLayout{softmax_lse.stride(0), softmax_lse.stride(1)};
  p.q_strides = flash_strides_of(query, varlen);
  p.k_strides = flash_strides_of(args.k_cache, false);
  p.v_strides = flash_strides_of(args.v_cache, false);
  p.out_strides = flash_strides_of(out, varlen);
  p.scale = args.softmax_scale;
  set_flash_score_rules(p, args.causal, args.window_left, args.window_right, len_q,
                        args.capacity(), args.softcap, args.alibi_slopes);
  p.kvcache = kvcache_params_of(args);
  // Queries' rows of a packed batch (SequenceSpan: keys from the cache, queries from here).
  if (varlen) p.varlen.cu_seqlens_q = args.cu_seqlens_q->data_ptr<int32_t>();
  // One query row sees every key of [0, len_kv) whatever causal and the right window say; with
  // no left window and no ALiBi (whose distances would change) the g = Hq / Hkv query heads of a
  // KV head become g rows of one head: row r of KV head h is query head h * g + r.
  if (!varlen && len_q == 1 && heads_q > heads_kv && p.window.left < 0 &&
      p.score_mod.alibi_slopes == nullptr) {
    const int64_t group = heads_q / heads_kv;
    p.shape.heads_q = heads_kv;
    p.shape.len_q = group;
    p.q_strides = TensorStrides{query.stride(0), group * query.stride(2), query.stride(2)};
    p.out_strides = TensorStrides{out.stride(0), group * out.stride(2), out.stride(2)};
    p.lse_layout = LseLayout{softmax_lse.stride(0), group * softmax_lse.stride(1)};
    p.window.right = -1;
    p.causal = CausalMode::kNone;
  }
  return p;
}

}  // namespace flashv100
