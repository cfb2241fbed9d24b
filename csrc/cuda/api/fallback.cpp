// The correct-for-everything CUDA path: attention as ATen math in fp32 (fp64 for fp64 inputs),
// with the ops' semantics (GQA, bool/additive masks, both causal alignments, dropout with the
// Philox keep mask of common/philox.h, fully masked rows -> 0). Materializes [B, Hq, L, S]; used
// only for what the fused kernels do not cover.
#include <ATen/ATen.h>

#include "cuda/api/launch.h"

namespace flashv100 {
namespace cuda {
namespace {

at::ScalarType compute_type(const at::Tensor& query) {
  return query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// [B, Hkv, S, E] -> [B, Hq, S, E] (repeat each kv head over its query-head group).
at::Tensor expand_heads(const at::Tensor& t, int64_t heads_q) {
  const int64_t group = heads_q / t.size(1);
  return group == 1 ? t : t.repeat_interleave(group, 1);
}

// [B, Hq, S, E] -> [B, Hkv, S, E] (sum over each group), the adjoint of expand_heads.
at::Tensor reduce_heads(const at::Tensor& t, int64_t heads_kv) {
  const int64_t group = t.size(1) / heads_kv;
  if (group == 1) return t;
  return t.view({t.size(0), heads_kv, group, t.size(2), t.size(3)}).sum(2);
}

struct Probs {
  at::Tensor probs;   // softmax, 0 on rows with no visible key
  at::Tensor lse;     // -inf on those rows
  at::Tensor factor;  // dropout keep / (1 - p), or undefined
};

Probs softmax_probs(const at::Tensor& q, const at::Tensor& k,
                    const std::optional<at::Tensor>& attn_mask, double dropout_p,
                    int64_t causal_mode, double scale, const at::Tensor& rng_state) {
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  const int64_t len_q = q.size(2), len_kv = k.size(2);
  if (attn_mask.has_value()) {
    if (attn_mask->scalar_type() == at::kBool) {
      scores = scores.masked_fill(attn_mask->logical_not(), -INFINITY);
    } else {
      scores = scores + attn_mask->to(scores.scalar_type());
    }
  }
  if (causal_mode != 0) {
    const int64_t shift = causal_mode == 2 ? len_kv - len_q : 0;
    const auto idx = at::TensorOptions().dtype(at::kLong).device(q.device());
    const at::Tensor rows = at::arange(len_q, idx).unsqueeze(1);
    const at::Tensor cols = at::arange(len_kv, idx).unsqueeze(0);
    scores = scores.masked_fill(cols > rows + shift, -INFINITY);
  }
  Probs r;
  if (len_kv == 0) {  // no key at all: amax has no identity, every row is empty
    r.probs = scores;
    r.lse = at::full({q.size(0), q.size(1), len_q}, -INFINITY, scores.options());
    return r;
  }
  // Normalize by the sum, not by exp(lse): with huge biases (finfo.min on a whole row) log(sum)
  // vanishes next to the max in lse, and the row must still average (as SDPA math does).
  const at::Tensor row_max = scores.amax(-1, true);
  const at::Tensor empty_row = row_max.isneginf();
  const at::Tensor exps = at::exp(scores - row_max.masked_fill(empty_row, 0.0));
  const at::Tensor sums = exps.sum(-1, true);
  r.probs = (exps / sums).masked_fill(empty_row, 0.0);
  r.lse = (row_max + sums.log()).squeeze(-1);
  if (dropout_p > 0.0) {
    const at::Tensor keep = dropout_keep_mask(rng_state, q.size(0), q.size(1), len_q, len_kv,
                                              dropout_p);
    r.factor = keep.to(scores.scalar_type()) * (1.0 / (1.0 - dropout_p));
  }
  return r;
}

}  // namespace

void fallback_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const std::optional<at::Tensor>& attn_mask, double dropout_p,
                      int64_t causal_mode, double scale, const at::Tensor& rng_state,
                      const at::Tensor& out, const at::Tensor& lse) {
  const at::ScalarType ct = compute_type(query);
  const int64_t heads_q = query.size(1);
  const at::Tensor q = query.to(ct), k = expand_heads(key.to(ct), heads_q),
                   v = expand_heads(value.to(ct), heads_q);
  const Probs p = softmax_probs(q, k, attn_mask, dropout_p, causal_mode, scale, rng_state);
  const at::Tensor probs = p.factor.defined() ? p.probs * p.factor : p.probs;
  out.copy_(at::matmul(probs, v));
  lse.copy_(p.lse);
}

at::Tensor fallback_backward(const at::Tensor& grad_out, const at::Tensor& query,
                             const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p,
                             int64_t causal_mode, double scale, const at::Tensor& rng_state,
                             bool mask_requires_grad, const at::Tensor& grad_query,
                             const at::Tensor& grad_key, const at::Tensor& grad_value) {
  const at::ScalarType ct = compute_type(query);
  const int64_t heads_q = query.size(1), heads_kv = key.size(1);
  const at::Tensor q = query.to(ct), k = expand_heads(key.to(ct), heads_q),
                   v = expand_heads(value.to(ct), heads_q), dout = grad_out.to(ct);
  const Probs p = softmax_probs(q, k, attn_mask, dropout_p, causal_mode, scale, rng_state);
  const at::Tensor dropped = p.factor.defined() ? p.probs * p.factor : p.probs;
  grad_value.copy_(reduce_heads(at::matmul(dropped.transpose(-2, -1), dout), heads_kv));
  at::Tensor dprobs = at::matmul(dout, v.transpose(-2, -1));
  if (p.factor.defined()) dprobs = dprobs * p.factor;
  // Softmax backward; dscores is also the gradient of an additive mask.
  const at::Tensor dscores = p.probs * (dprobs - (dprobs * p.probs).sum(-1, true));
  grad_query.copy_(at::matmul(dscores, k) * scale);
  grad_key.copy_(reduce_heads(at::matmul(dscores.transpose(-2, -1), q) * scale, heads_kv));
  return mask_requires_grad ? dscores : at::Tensor();
}

}  // namespace cuda
}  // namespace flashv100
