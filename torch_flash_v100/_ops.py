"""Python-side registration of the flashv100 ops: fake (meta) kernels and autograd.

The schemas and the device kernels are registered in C++ (csrc/ops.cpp, csrc/cpu, csrc/cuda).
The public op ``flashv100::attention`` is a composite over ``flashv100::_attention_forward``;
autograd is defined on the latter, and its backward is ``flashv100::_attention_backward``. The
FlashAttention-2 ops ``_flash_forward`` / ``_flash_backward`` have their fake kernels here and
their autograd in ``_flash_ops``.
"""

from __future__ import annotations

import torch

_lib_ops = torch.ops.flashv100


def _lse_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def _allocate_out(query: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    # Mirrors allocate_out in csrc/tensor_params.cpp: out keeps query's memory layout.
    if value.shape[-1] == query.shape[-1]:
        return torch.empty_like(query)
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@torch.library.register_fake("flashv100::_attention_forward")
def _attention_forward_fake(query, key, value, attn_mask, dropout_p, causal_mode, scale):
    out = _allocate_out(query, value)
    lse = query.new_empty(query.shape[:-1], dtype=_lse_dtype(query))
    rng_state = query.new_empty((2,), dtype=torch.int64)
    return out, lse, rng_state


@torch.library.register_fake("flashv100::_attention_backward")
def _attention_backward_fake(grad_out, query, key, value, attn_mask, out, lse, rng_state,
                             dropout_p, causal_mode, scale, mask_requires_grad, deterministic):
    grad_mask = (attn_mask.new_empty(attn_mask.shape) if mask_requires_grad
                 else query.new_empty((0,)))
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), grad_mask)


def _lse_shape(query: torch.Tensor, cu_seqlens_q) -> tuple:
    # Mirrors allocate_flash_lse in csrc/tensor_params.cpp: [B, Hq, Sq], or [Hq, total_q] (varlen).
    if cu_seqlens_q is None:
        return (query.shape[0], query.shape[2], query.shape[1])
    return (query.shape[1], query.shape[0])


@torch.library.register_fake("flashv100::_flash_forward")
def _flash_forward_fake(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                        alibi_slopes):
    out = torch.empty_like(query)
    lse = query.new_empty(_lse_shape(query, cu_seqlens_q), dtype=_lse_dtype(query))
    rng_state = query.new_empty((2,), dtype=torch.int64)
    return out, lse, rng_state


@torch.library.register_fake("flashv100::_flash_backward")
def _flash_backward_fake(grad_out, query, key, value, out, softmax_lse, rng_state, cu_seqlens_q,
                         cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                         window_left, window_right, softcap, alibi_slopes, deterministic):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


@torch.library.register_fake("flashv100::_dropout_mask")
def _dropout_mask_fake(rng_state, batch, heads, len_q, len_kv, dropout_p):
    return rng_state.new_empty((batch, heads, len_q, len_kv), dtype=torch.bool)


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, dropout_p, causal_mode, scale = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse, rng_state)
    ctx.dropout_p = dropout_p
    ctx.causal_mode = causal_mode
    ctx.scale = scale
    ctx.mask_requires_grad = (attn_mask is not None and attn_mask.is_floating_point()
                              and ctx.needs_input_grad[3])


def _backward(ctx, grad_out, _grad_lse, _grad_rng_state):
    query, key, value, attn_mask, out, lse, rng_state = ctx.saved_tensors
    if grad_out.stride(-1) != 1:  # e.g. the expanded gradient of out.sum()
        grad_out = grad_out.contiguous()
    grad_query, grad_key, grad_value, grad_mask = _lib_ops._attention_backward(
        grad_out, query, key, value, attn_mask, out, lse, rng_state, ctx.dropout_p,
        ctx.causal_mode, ctx.scale, ctx.mask_requires_grad,
        torch.are_deterministic_algorithms_enabled())
    return (grad_query, grad_key, grad_value, grad_mask if ctx.mask_requires_grad else None,
            None, None, None)


torch.library.register_autograd(
    "flashv100::_attention_forward", _backward, setup_context=_setup_context)
