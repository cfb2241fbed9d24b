"""Shared helpers for the attention tests: inputs, the fp64 reference, FA2-style tolerances."""

from __future__ import annotations

import torch

from torch_flash_v100.reference import reference_attention


def make_qkv(batch, heads_q, heads_kv, len_q, len_kv, dim, dtype, device, dim_v=None,
             requires_grad=False, layout="bhle", magnitude=1.0, generator=None):
    """q [B, Hq, L, E], k/v [B, Hkv, S, E]; layout "blhe" gives transposed views of [B, L, H, E]."""
    dim_v = dim if dim_v is None else dim_v

    def make(heads, length, d):
        if layout == "blhe":
            t = torch.randn(batch, length, heads, d, generator=generator, dtype=torch.float64)
            t = (t * magnitude).to(device=device, dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(batch, heads, length, d, generator=generator, dtype=torch.float64)
            t = (t * magnitude).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return make(heads_q, len_q, dim), make(heads_kv, len_kv, dim), make(heads_kv, len_kv, dim_v)


def reference_fp64(query, key, value, attn_mask=None, **kwargs):
    """The reference in float64 on the inputs' values."""
    mask = attn_mask
    if mask is not None and mask.is_floating_point():
        mask = mask.double()
    return reference_attention(query.double(), key.double(), value.double(), mask, **kwargs)


def reference_low_precision(query, key, value, attn_mask=None, **kwargs):
    """The plain math reference in the inputs' own dtype: the error floor a fused kernel is held to."""
    return reference_attention(query, key, value, attn_mask, **kwargs)


def assert_fa2_close(actual, reference_64, baseline, name="out", factor=2.0, atol=None):
    """FlashAttention-2 style: |actual - ref64| <= factor * |baseline - ref64| + atol."""
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    if atol is None:
        atol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3,
                torch.bfloat16: 8e-3}[actual.dtype]
    error = (actual.double() - reference_64).abs().max().item() if actual.numel() else 0.0
    floor = (baseline.double() - reference_64).abs().max().item() if baseline.numel() else 0.0
    assert error <= factor * floor + atol, (
        f"{name}: max error {error:.3e} vs fp64 reference exceeds {factor} x math error "
        f"{floor:.3e} + {atol:.1e}")
