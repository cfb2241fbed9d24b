"""Autograd of the FlashAttention-2 internal ops beyond the C++ formula of ``_flash_forward``
(csrc/autograd.cpp): the functions' ``deterministic=True`` and the error of a double backward.
Their fake kernels are in ``_ops``, where the library declares its Python registrations.

``flashv100::_flash_forward`` / ``flashv100::_flash_backward`` (schemas in csrc/ops.cpp) take
FlashAttention-2 layouts: query [B, Sq, Hq, D] and key/value [B, Sk, Hkv, D], or packed
[total, H, D] with ``cu_seqlens_q/k``. The public functions are in ``flash_attn_interface``.
"""

from __future__ import annotations

import torch

_lib_ops = torch.ops.flashv100


class DeterministicFlashAttention(torch.autograd.Function):
    """``_flash_forward`` with a deterministic backward: the FlashAttention-2 functions'
    ``deterministic=True``, which the op's own autograd formula cannot see (it reads only the
    global deterministic flag)."""

    @staticmethod
    def forward(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                alibi_slopes):
        return _lib_ops._flash_forward(query, key, value, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                       causal, window_left, window_right, softcap, alibi_slopes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
         softmax_scale, causal, window_left, window_right, softcap, alibi_slopes) = inputs
        out, softmax_lse, rng_state = output
        ctx.save_for_backward(query, key, value, out, softmax_lse, rng_state, cu_seqlens_q,
                              cu_seqlens_k, alibi_slopes)
        ctx.options = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                       window_right, softcap)
        ctx.mark_non_differentiable(softmax_lse, rng_state)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse, _grad_rng_state):
        (query, key, value, out, softmax_lse, rng_state, cu_seqlens_q, cu_seqlens_k,
         alibi_slopes) = ctx.saved_tensors
        # The kernels read rows of grad_out (the expanded gradient of out.sum() has stride 0). No
        # stride test: Dynamo traces this backward and older ones refuse strides.
        grad_query, grad_key, grad_value = _lib_ops._flash_backward(
            grad_out.contiguous(), query, key, value, out, softmax_lse, rng_state, cu_seqlens_q,
            cu_seqlens_k, *ctx.options, alibi_slopes, True)
        return (grad_query, grad_key, grad_value) + (None,) * 11


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "flashv100._flash_backward: double backward (gradients of gradients) of the "
        "FlashAttention-2 ops is not supported; torch_flash_v100.attention (SDPA layout) computes "
        "it")


torch.library.register_autograd(
    "flashv100::_flash_backward", _no_double_backward,
    setup_context=lambda ctx, inputs, output: None)
