// Autograd of flashv100::_attention_forward and flashv100::_flash_forward, in C++ so that a
// training step's forward and backward pay a dispatcher call each and no Python frame (a Python
// autograd formula costs ~30 us forward and ~70 us backward of host time, which is the whole run
// time of a small attention on a GPU). Their backwards call _attention_backward / _flash_backward,
// whose own autograd formulas (torch_flash_v100/_ops.py, _flash_ops.py: double backward, or an
// error) record only when the backward runs with create_graph.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace flashv100 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    double, int64_t, double);
using BackwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    double, int64_t, double, bool, bool);

using FlashForwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, c10::SymInt, c10::SymInt, double, double, bool, int64_t,
    int64_t, double, const std::optional<at::Tensor>&, bool);
using FlashBackwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, c10::SymInt, c10::SymInt, double, double, bool, int64_t,
    int64_t, double, const std::optional<at::Tensor>&, bool);

std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Runs a forward op below autograd for `ctx`'s node. Its lse and rng_state are returned for the
// backward, not as differentiable results; their absent gradients stay undefined (materializing
// them would cost two fill launches a step).
template <class Op, class... Args>
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_forward(AutogradContext* ctx, const Op& op,
                                                            const Args&... args) {
  at::Tensor out, lse, rng_state;
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(out, lse, rng_state) = op.call(args...);
  }
  ctx->mark_non_differentiable({lse, rng_state});
  ctx->set_materialize_grads(false);
  return {out, lse, rng_state};
}

// Calls a backward op: through its autograd formula when the backward records a graph
// (create_graph), below autograd otherwise (a no-op formula, but a Python frame).
template <class Call>
auto call_backward(const Call& call) {
  if (at::GradMode::is_enabled()) return call();
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call();
}

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  // Compiled autograd may trace the backward: it only calls an op.
  static constexpr bool is_traceable = true;

  static variable_list forward(AutogradContext* ctx, const at::Tensor& query,
                               const at::Tensor& key, const at::Tensor& value,
                               const std::optional<at::Tensor>& attn_mask, double dropout_p,
                               int64_t causal_mode, double scale) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashv100::_attention_forward", "")
                         .typed<ForwardOp>();
    const bool mask_requires_grad =
        attn_mask.has_value() && attn_mask->is_floating_point() && attn_mask->requires_grad();
    const auto [out, lse, rng_state] =
        call_forward(ctx, op, query, key, value, attn_mask, dropout_p, causal_mode, scale);
    ctx->save_for_backward({query, key, value, attn_mask.value_or(at::Tensor()), out, lse,
                            rng_state});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["causal_mode"] = causal_mode;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["mask_requires_grad"] = mask_requires_grad;
    return {out, lse, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashv100::_attention_backward", "")
                         .typed<BackwardOp>();
    if (!grads[0].defined()) return variable_list(7);  // out took no gradient: all zero
    const variable_list saved = ctx->get_saved_variables();
    const bool mask_requires_grad = ctx->saved_data["mask_requires_grad"].toBool();
    at::Tensor grad_out = grads[0];
    // The kernels read rows of grad_out (the expanded gradient of out.sum() has stride 0).
    if (grad_out.sym_stride(-1) != 1) grad_out = grad_out.contiguous();
    const auto [grad_query, grad_key, grad_value, grad_mask] = call_backward([&] {
      return op.call(grad_out, saved[0], saved[1], saved[2], optional_of(saved[3]), saved[4],
                     saved[5], saved[6], ctx->saved_data["dropout_p"].toDouble(),
                     ctx->saved_data["causal_mode"].toInt(), ctx->saved_data["scale"].toDouble(),
                     mask_requires_grad, at::globalContext().deterministicAlgorithms());
    });
    return {grad_query, grad_key, grad_value,
            mask_requires_grad ? grad_mask : at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// The backward is deterministic when the forward was asked for it (the FlashAttention-2
// functions' `deterministic=True`) or under torch.use_deterministic_algorithms.
struct FlashFunction : public torch::autograd::Function<FlashFunction> {
  static constexpr bool is_traceable = true;

  static variable_list forward(AutogradContext* ctx, const at::Tensor& query,
                               const at::Tensor& key, const at::Tensor& value,
                               const std::optional<at::Tensor>& cu_seqlens_q,
                               const std::optional<at::Tensor>& cu_seqlens_k,
                               c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
                               double dropout_p, double softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right, double softcap,
                               const std::optional<at::Tensor>& alibi_slopes, bool deterministic) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashv100::_flash_forward", "")
                         .typed<FlashForwardOp>();
    const auto [out, lse, rng_state] =
        call_forward(ctx, op, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
                     softcap, alibi_slopes, deterministic);
    ctx->save_for_backward({query, key, value, out, lse, rng_state,
                            cu_seqlens_q.value_or(at::Tensor()),
                            cu_seqlens_k.value_or(at::Tensor()),
                            alibi_slopes.value_or(at::Tensor())});
    ctx->saved_data["max_seqlen_q"] = std::move(max_seqlen_q);
    ctx->saved_data["max_seqlen_k"] = std::move(max_seqlen_k);
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["softmax_scale"] = softmax_scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["deterministic"] = deterministic;
    return {out, lse, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("flashv100::_flash_backward", "")
                         .typed<FlashBackwardOp>();
    if (!grads[0].defined()) return variable_list(15);  // out took no gradient: all zero
    const variable_list saved = ctx->get_saved_variables();
    auto& data = ctx->saved_data;
    // The kernels read rows of grad_out (the expanded gradient of out.sum() has stride 0).
    const at::Tensor grad_out = grads[0].contiguous();
    const auto [grad_query, grad_key, grad_value] = call_backward([&] {
      return op.call(grad_out, saved[0], saved[1], saved[2], saved[3], saved[4], saved[5],
                     optional_of(saved[6]), optional_of(saved[7]), data["max_seqlen_q"].toSymInt(),
                     data["max_seqlen_k"].toSymInt(), data["dropout_p"].toDouble(),
                     data["softmax_scale"].toDouble(), data["causal"].toBool(),
                     data["window_left"].toInt(), data["window_right"].toInt(),
                     data["softcap"].toDouble(), optional_of(saved[8]),
                     data["deterministic"].toBool() ||
                         at::globalContext().deterministicAlgorithms());
    });
    variable_list result(15);
    result[0] = grad_query;
    result[1] = grad_key;
    result[2] = grad_value;
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_autograd(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, double dropout_p, int64_t causal_mode,
    double scale) {
  const variable_list outputs =
      AttentionFunction::apply(query, key, value, attn_mask, dropout_p, causal_mode, scale);
  return {outputs[0], outputs[1], outputs[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_forward_autograd(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, double dropout_p, double softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, bool deterministic) {
  const variable_list outputs = FlashFunction::apply(
      query, key, value, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q),
      std::move(max_seqlen_k), dropout_p, softmax_scale, causal, window_left, window_right,
      softcap, alibi_slopes, deterministic);
  return {outputs[0], outputs[1], outputs[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashv100, Autograd, m) {
  m.impl("_attention_forward", TORCH_FN(attention_forward_autograd));
  m.impl("_flash_forward", TORCH_FN(flash_forward_autograd));
}

}  // namespace flashv100
