"""Python-side registration of the flashv100 ops: fake (meta) kernels and autograd.

The schemas and the device kernels are registered in C++ (csrc/ops.cpp, csrc/cpu, csrc/cuda).
The public op ``flashv100::attention`` is a composite over ``flashv100::_attention_forward``,
whose autograd formula is in C++ (csrc/autograd.cpp: no Python frame per step) and calls
``flashv100::_attention_backward``. The latter's own autograd formula is here (double backward:
gradient penalties, Hessian-vector products): it differentiates the reference math twice. The
FlashAttention-2 ops ``_flash_forward`` / ``_flash_backward`` have their fake kernels here, the
rest of their autograd in ``_flash_ops``.
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
                        alibi_slopes, deterministic=False):
    out = torch.empty_like(query)
    lse = query.new_empty(_lse_shape(query, cu_seqlens_q), dtype=_lse_dtype(query))
    rng_state = query.new_empty((2,), dtype=torch.int64)
    return out, lse, rng_state


@torch.library.register_fake("flashv100::_flash_backward")
def _flash_backward_fake(grad_out, query, key, value, out, softmax_lse, rng_state, cu_seqlens_q,
                         cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                         window_left, window_right, softcap, alibi_slopes, deterministic):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


@torch.library.register_fake("flashv100::_kvcache_forward")
def _kvcache_forward_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                          cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                          window_left, window_right, softcap, rotary_interleaved, alibi_slopes,
                          num_splits, check_index_values=True, cu_seqlens_q=None,
                          max_seqlen_q=0):
    # Mirrors allocate_kvcache_out/_lse in csrc/tensor_params.cpp; the caches are mutated in place
    # (the schema's alias annotations tell functionalization).
    out = q.new_empty(q.shape)
    lse_shape = ((q.shape[1], q.shape[0]) if cu_seqlens_q is not None
                 else (q.shape[0], q.shape[2], q.shape[1]))
    return out, q.new_empty(lse_shape, dtype=_lse_dtype(q))


@torch.library.register_fake("flashv100::_dropout_mask")
def _dropout_mask_fake(rng_state, batch, heads, len_q, len_kv, dropout_p):
    return rng_state.new_empty((batch, heads, len_q, len_kv), dtype=torch.bool)


def _setup_double_backward(ctx, inputs, output):
    (grad_out, query, key, value, attn_mask, _out, _lse, rng_state, dropout_p, causal_mode, scale,
     mask_requires_grad, _deterministic) = inputs
    ctx.save_for_backward(grad_out, query, key, value, attn_mask, rng_state)
    ctx.dropout_p, ctx.causal_mode, ctx.scale = dropout_p, causal_mode, scale
    ctx.mask_requires_grad = mask_requires_grad


def _double_backward(ctx, grad_grad_query, grad_grad_key, grad_grad_value, grad_grad_mask):
    # The gradients as a function of (grad_out, q, k, v, mask), recomputed with the reference math
    # (O(L * S) memory: second order is rare) and the forward's dropout mask. Their derivatives
    # through out and lse are part of these total derivatives, so out and lse get none.
    from .reference import reference_attention

    grad_out, query, key, value, attn_mask, rng_state = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (grad_out, query, key, value)]
        mask = attn_mask
        if ctx.mask_requires_grad:
            mask = attn_mask.detach().requires_grad_()
        keep = None
        if ctx.dropout_p > 0.0:
            batch, heads, len_q, len_kv = *query.shape[:3], key.shape[2]
            keep = _lib_ops._dropout_mask(rng_state, batch, heads, len_q, len_kv, ctx.dropout_p)
        out = reference_attention(leaves[1], leaves[2], leaves[3], mask, ctx.dropout_p,
                                  scale=ctx.scale, enable_gqa=True, causal_mode=ctx.causal_mode,
                                  dropout_keep=keep)
        wrt = leaves[1:] + ([mask] if ctx.mask_requires_grad else [])
        grads = torch.autograd.grad(out, wrt, leaves[0], create_graph=True)
        outer = [grad_grad_query, grad_grad_key, grad_grad_value, grad_grad_mask][:len(grads)]
        pairs = [(g, o) for g, o in zip(grads, outer) if o is not None]
        wrt_all = leaves + ([mask] if ctx.mask_requires_grad else [])
        second = torch.autograd.grad([g for g, _ in pairs], wrt_all, [o for _, o in pairs],
                                     create_graph=torch.is_grad_enabled(), allow_unused=True)
    grad_grad_out, grad_query, grad_key, grad_value = second[:4]
    grad_mask = second[4] if ctx.mask_requires_grad else None
    return (grad_grad_out, grad_query, grad_key, grad_value, grad_mask, None, None, None, None,
            None, None, None, None)


torch.library.register_autograd(
    "flashv100::_attention_backward", _double_backward, setup_context=_setup_double_backward)
