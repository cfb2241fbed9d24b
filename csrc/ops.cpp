// The flashv100 operator library: schemas and the public composite op. Device kernels register
// themselves in cpu/ and cuda/, the forward's autograd in autograd.cpp; fake kernels and the other
// autograd formulas live in torch_flash_v100/_ops.py and _flash_ops.py.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <utility>

namespace flashv100 {
namespace {

using ForwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    double, int64_t, double);

// [*batch, H, L, E] -> [prod(batch), H, L, E]; 2-D and 3-D inputs gain leading unit dims.
at::Tensor as_4d(const at::Tensor& t) {
  if (t.dim() == 4) return t;
  c10::SymDimVector shape(t.sym_sizes().end() - std::min<int64_t>(t.dim(), 3), t.sym_sizes().end());
  c10::SymInt batch = 1;
  for (int64_t d = 0; d + 3 < t.dim(); ++d) batch *= t.sym_size(d);
  shape.insert(shape.begin(), batch);
  while (shape.size() < 4) shape.insert(shape.begin() + 1, c10::SymInt(1));
  return t.reshape_symint(shape);
}

// The mask as a 4-D tensor whose dims are 1 or full size, without copying where possible.
at::Tensor mask_as_4d(const at::Tensor& mask, const at::Tensor& query, const c10::SymInt& len_kv) {
  c10::SymDimVector target(query.sym_sizes().begin(), query.sym_sizes().end() - 1);
  target.push_back(len_kv);
  TORCH_CHECK(mask.dim() <= static_cast<int64_t>(target.size()),
              "flashv100.attention: attn_mask ", mask.sizes(), " has more dims than the scores ",
              c10::SymIntArrayRef(target));
  const int64_t lead = static_cast<int64_t>(target.size()) - mask.dim();
  for (int64_t d = 0; d < mask.dim(); ++d) {
    const c10::SymInt& size = mask.sym_size(d);
    TORCH_CHECK(size == 1 || size == target[lead + d], "flashv100.attention: attn_mask ",
                mask.sizes(), " is not broadcastable to the attention scores [..., L, S] = ",
                c10::SymIntArrayRef(target));
  }
  if (target.size() == 4) {
    c10::SymDimVector shape(lead, c10::SymInt(1));
    shape.append(mask.sym_sizes().begin(), mask.sym_sizes().end());
    return mask.view_symint(shape);
  }
  // Other ranks: broadcast to the full shape, then fold like the query (may copy).
  return as_4d(mask.expand_symint(target));
}

void check_public_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p,
                         bool enable_gqa) {
  constexpr const char* op = "flashv100.attention";
  for (const auto& [name, t] : {std::pair{"query", &query}, {"key", &key}, {"value", &value}}) {
    TORCH_CHECK(!t->is_nested(), op, ": ", name,
                " is a nested (jagged) tensor, which is not supported; pass padded [..., L, E] "
                "tensors with an attn_mask, or packed sequences to flash_attn_varlen_func");
  }
  TORCH_CHECK(query.dim() >= 2, op, ": expected query [..., L, E] with at least 2 dims, got ",
              query.sizes());
  TORCH_CHECK(key.dim() == query.dim() && value.dim() == query.dim(), op,
              ": expected key and value with query's rank ", query.dim(), ", got key ",
              key.sizes(), " and value ", value.sizes());
  TORCH_CHECK(at::isFloatingType(query.scalar_type()), op,
              ": expected a floating-point query, got ", query.scalar_type());
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), op, ": expected key dtype ",
              query.scalar_type(), " (query's), got ", key.scalar_type());
  TORCH_CHECK(value.scalar_type() == query.scalar_type(), op, ": expected value dtype ",
              query.scalar_type(), " (query's), got ", value.scalar_type());
  TORCH_CHECK(key.device() == query.device(), op, ": expected key on ", query.device(),
              " (query's device), got ", key.device());
  TORCH_CHECK(value.device() == query.device(), op, ": expected value on ", query.device(),
              " (query's device), got ", value.device());
  TORCH_CHECK(key.sym_size(-1) == query.sym_size(-1), op, ": expected key head dim ",
              query.sym_size(-1), " (query's E), got ", key.sym_size(-1));
  TORCH_CHECK(value.sym_size(-2) == key.sym_size(-2), op, ": expected value length ",
              key.sym_size(-2), " (key's S), got ", value.sym_size(-2));
  for (int64_t d = 0; d + 3 < query.dim(); ++d) {
    TORCH_CHECK(key.sym_size(d) == query.sym_size(d) && value.sym_size(d) == query.sym_size(d),
                op, ": expected key and value batch dims ", query.sizes().slice(0, query.dim() - 3),
                " (query's), got key ", key.sizes(), " and value ", value.sizes());
  }
  if (query.dim() >= 3) {
    const auto& heads_q = query.sym_size(-3);
    const auto& heads_k = key.sym_size(-3);
    TORCH_CHECK(value.sym_size(-3) == heads_k, op, ": expected value heads ", heads_k,
                " (key's), got ", value.sym_size(-3));
    if (enable_gqa) {
      TORCH_CHECK(heads_k > 0 && heads_q % heads_k == 0, op, ": with enable_gqa, query heads (",
                  heads_q, ") must be a multiple of key/value heads (", heads_k, ")");
    } else {
      TORCH_CHECK(heads_k == heads_q, op, ": expected key/value heads ", heads_q,
                  " (query's; pass enable_gqa=True for grouped-query attention), got ", heads_k);
    }
  }
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, op, ": expected dropout_p in [0, 1], got ",
              dropout_p);
  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    TORCH_CHECK(!m.is_nested(), op, ": attn_mask is a nested tensor, which is not supported");
    TORCH_CHECK(m.scalar_type() == at::kBool || at::isFloatingType(m.scalar_type()), op,
                ": expected attn_mask of dtype bool (True = attend) or floating (added to the "
                "scores), got ",
                m.scalar_type());
    TORCH_CHECK(m.device() == query.device(), op, ": expected attn_mask on ", query.device(),
                " (query's device), got ", m.device());
  }
}

// The kernels read rows of the last dim as vectors; other layouts are copied, as SDPA does.
at::Tensor with_contiguous_last_dim(const at::Tensor& t) {
  return t.sym_size(-1) <= 1 || t.sym_stride(-1) == 1 ? t : t.contiguous();
}

// SDPA semantics on top of the internal forward op. Composite, so autograd and torch.compile
// see `_attention_forward`, whose autograd formula calls `_attention_backward`. Unlike SDPA it
// also accepts attn_mask together with is_causal (both apply), which the compile pass relies on.
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, bool enable_gqa) {
  check_public_inputs(query, key, value, attn_mask, dropout_p, enable_gqa);
  const double softmax_scale =
      scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
  std::optional<at::Tensor> mask4;
  if (attn_mask.has_value()) mask4 = mask_as_4d(*attn_mask, query, key.sym_size(-2));
  static auto forward = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("flashv100::_attention_forward", "")
                            .typed<ForwardOp>();
  // dropout_p = 1 drops every probability: zeros, and zero gradients, as SDPA's dropout gives
  // (out * 0 keeps the result connected to the inputs; the kernels take p < 1).
  const bool drop_all = dropout_p == 1.0;
  at::Tensor out = std::get<0>(forward.call(
      as_4d(with_contiguous_last_dim(query)), as_4d(with_contiguous_last_dim(key)),
      as_4d(with_contiguous_last_dim(value)), mask4, drop_all ? 0.0 : dropout_p,
      is_causal ? 1 : 0, softmax_scale));
  if (drop_all) out = out * 0;
  // 4-D query: out has its shape already, and a view would add an autograd node to every step.
  if (query.dim() == 4) return out;
  c10::SymDimVector out_shape(query.sym_sizes().begin(), query.sym_sizes().end());
  out_shape.back() = value.sym_size(-1);
  return out.view_symint(out_shape);
}

// torch.autocast: SDPA's policy (lower_precision_fp): floating q, k, v and an additive mask run
// in the autocast dtype of the device (fp64 and bool masks are left alone).
template <c10::DeviceType kDevice>
at::Tensor attention_autocast(const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value,
                              const std::optional<at::Tensor>& attn_mask, double dropout_p,
                              bool is_causal, std::optional<double> scale, bool enable_gqa) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      kDevice == c10::DeviceType::CUDA ? c10::DispatchKey::AutocastCUDA
                                       : c10::DispatchKey::AutocastCPU);
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const auto& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  return attention(cast(query), cast(key), cast(value), cast(attn_mask), dropout_p, is_causal,
                   scale, enable_gqa);
}

}  // namespace

TORCH_LIBRARY(flashv100, m) {
  m.set_python_module("torch_flash_v100._ops");
  m.def(
      "attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "float dropout_p=0.0, bool is_causal=False, *, float? scale=None, bool enable_gqa=False) "
      "-> Tensor",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
      "float dropout_p, int causal_mode, float scale) -> (Tensor out, Tensor lse, "
      "Tensor rng_state)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
      "Tensor? attn_mask, Tensor out, Tensor lse, Tensor rng_state, float dropout_p, "
      "int causal_mode, float scale, bool mask_requires_grad, bool deterministic) -> "
      "(Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_mask)");
  // FlashAttention-2 layouts and semantics (torch_flash_v100.flash_attn_interface): query
  // [B, Sq, Hq, D] and key/value [B, Sk, Hkv, D], or packed [total, H, D] with cu_seqlens_q/k
  // (int32 [B + 1]) and max_seqlen_q/k; bottom-right causal, window (-1: unbounded), softcap
  // (0: off), ALiBi slopes (fp32 [Hq] or [B, Hq]). softmax_lse: fp32 [B, Hq, Sq], or [Hq, total_q]
  // for varlen. Same kernels as _attention_forward (common/params.h). deterministic: the
  // backward its autograd records is (also under torch.use_deterministic_algorithms); the
  // forward always is.
  m.def(
      "_flash_forward(Tensor query, Tensor key, Tensor value, Tensor? cu_seqlens_q, "
      "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, "
      "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
      "Tensor? alibi_slopes, bool deterministic=False) -> (Tensor out, Tensor softmax_lse, "
      "Tensor rng_state)",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "_flash_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor softmax_lse, Tensor rng_state, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, float softmax_scale, "
      "bool causal, int window_left, int window_right, float softcap, Tensor? alibi_slopes, "
      "bool deterministic) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // flash_attn_with_kvcache (FlashAttention-2 v2.8 semantics, torch_flash_v100.flash_attn_interface):
  // appends k/v (rotated k) into k_cache/v_cache in place at rows cache_seqlens, then attends q
  // (rotated) to the rows [cache_leftpad, cache_seqlens + S_new) of each sequence's cache,
  // contiguous [B_cache, S_cache, Hkv, D] (rows of cache_batch_idx[b]) or paged
  // [num_pages, page_size, Hkv, D] through block_table. num_splits: split-KV shares (0: chosen).
  // check_index_values=False: the CUDA op trusts the index tensors' values (no device-to-host
  // copies; the CPU op reads them on the host and checks them always).
  // out [B, Sq, Hq, D], softmax_lse fp32 [B, Hq, Sq]. No backward (as FlashAttention-2).
  // cu_seqlens_q (flash_attn_varlen_func with block_table): q packed [total_q, Hq, D], sequence b
  // its rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]), at most max_seqlen_q; out of q's shape,
  // softmax_lse [Hq, total_q].
  m.def(
      "_kvcache_forward(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
      "Tensor? rotary_cos, Tensor? rotary_sin, Tensor cache_seqlens, Tensor? cache_batch_idx, "
      "Tensor? cache_leftpad, Tensor? block_table, float softmax_scale, bool causal, "
      "int window_left, int window_right, float softcap, bool rotary_interleaved, "
      "Tensor? alibi_slopes, int num_splits, bool check_index_values=True, "
      "Tensor? cu_seqlens_q=None, SymInt max_seqlen_q=0) -> (Tensor out, Tensor softmax_lse)");
  m.def(
      "_dropout_mask(Tensor rng_state, SymInt batch, SymInt heads, SymInt len_q, SymInt len_kv, "
      "float dropout_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashv100, CompositeImplicitAutograd, m) {
  m.impl("attention", TORCH_FN(attention));
}

// No derivative: outputs of inputs that require grad get a node whose backward raises
// ("the derivative for flashv100::_kvcache_forward is not implemented"), never a silent zero.
TORCH_LIBRARY_IMPL(flashv100, Autograd, m) {
  m.impl("_kvcache_forward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(flashv100, AutocastCUDA, m) {
  m.impl("attention", TORCH_FN(attention_autocast<c10::DeviceType::CUDA>));
}

TORCH_LIBRARY_IMPL(flashv100, AutocastCPU, m) {
  m.impl("attention", TORCH_FN(attention_autocast<c10::DeviceType::CPU>));
}

}  // namespace flashv100
