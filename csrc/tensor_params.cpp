#include "tensor_params.h"

#include <ATen/ATen.h>

#include <array>
#include <utility>

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

}  // namespace

void check_attention_inputs(const char* op, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                            double dropout_p, int64_t causal_mode) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, op,
              ": expected 4-D query, key and value [B, H, L, E], got query ", query.sizes(),
              ", key ", key.sizes(), ", value ", value.sizes());
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
    TORCH_CHECK(t->size(3) <= 1 || t->stride(3) == 1, op, ": expected ", name,
                " with a contiguous last dim (stride 1), got strides ", t->strides(),
                "; pass ", name, ".contiguous()");
  }
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
  TORCH_CHECK(heads_kv > 0 && heads_q % heads_kv == 0, op, ": query heads (", heads_q,
              ") must be a multiple of key/value heads (", heads_kv, ")");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": expected dropout_p in [0, 1), got ",
              dropout_p);
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
  TORCH_CHECK(lse.sizes() == out_shape.slice(0, 3) && lse.scalar_type() == lse_dtype &&
                  lse.device() == query.device(),
              op, ": expected lse [B, Hq, L] of dtype ", lse_dtype,
              " as returned by _attention_forward, got ", lse.sizes(), " ", lse.scalar_type());
  TORCH_CHECK(rng_state.numel() == 2 && rng_state.scalar_type() == at::kLong &&
                  rng_state.is_contiguous(),
              op, ": expected rng_state int64[2] as returned by _attention_forward, got ",
              rng_state.scalar_type(), rng_state.sizes());
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
  p.dmask = grad_mask_full.defined() ? grad_mask_full.data_ptr<float>() : nullptr;
  p.deterministic = deterministic;
  return p;
}

at::Tensor reduce_mask_grad(const at::Tensor& grad_mask_full, const at::Tensor& attn_mask) {
  return grad_mask_full.sum_to_size(attn_mask.sizes()).to(attn_mask.scalar_type());
}

}  // namespace flashv100
