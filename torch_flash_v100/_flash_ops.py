"""Autograd of the FlashAttention-2 internal ops beyond the C++ formula of ``_flash_forward``
(csrc/autograd.cpp, which also carries the functions' ``deterministic=True`` to the backward):
the error of a double backward. Their fake kernels are in ``_ops``, where the library declares
its Python registrations.

``flashv100::_flash_forward`` / ``flashv100::_flash_backward`` (schemas in csrc/ops.cpp) take
FlashAttention-2 layouts: query [B, Sq, Hq, D] and key/value [B, Sk, Hkv, D], or packed
[total, H, D] with ``cu_seqlens_q/k``. The public functions are in ``flash_attn_interface``.
"""

from __future__ import annotations

import torch


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "flashv100._flash_backward: double backward (gradients of gradients) of the "
        "FlashAttention-2 ops is not supported; torch_flash_v100.attention (SDPA layout) computes "
        "it")


torch.library.register_autograd(
    "flashv100::_flash_backward", _no_double_backward,
    setup_context=lambda ctx, inputs, output: None)
