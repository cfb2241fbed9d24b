"""Forward numerics of flashv100.attention vs the fp64 reference and vs SDPA."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import torch_flash_v100 as flash
from attention_testing import (assert_fa2_close, make_qkv, reference_fp64,
                               reference_low_precision)
from torch_flash_v100.reference import reference_attention

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# (B, Hq, Hkv, L, S, E)
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 3, 3, 17, 17, 32),
    (1, 2, 2, 129, 65, 64),
    (2, 2, 1, 17, 129, 40),
    (1, 4, 2, 33, 33, 128),
    (1, 1, 1, 7, 31, 256),
]


def _mask(kind, batch, heads, len_q, len_kv, dtype, device):
    g = torch.Generator().manual_seed(1)
    if kind == "none":
        return None
    if kind == "bool_padding":  # [B, 1, 1, S], keeps at least the first key
        keep = torch.rand(batch, 1, 1, len_kv, generator=g) > 0.3
        keep[..., 0] = True
        return keep.to(device)
    if kind == "bool_full":  # [B, H, L, S]
        keep = torch.rand(batch, heads, len_q, len_kv, generator=g) > 0.5
        return keep.to(device)
    if kind == "float_heads":  # [1, H, L, S] additive
        return torch.randn(1, heads, len_q, len_kv, generator=g, dtype=torch.float64).to(device, dtype)
    if kind == "float_2d":  # [L, S] additive with finfo.min entries
        bias = torch.randn(len_q, len_kv, generator=g, dtype=torch.float64)
        bias[:, 1::3] = torch.finfo(dtype).min
        return bias.to(device, dtype)
    raise ValueError(kind)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_reference(shape, dtype, is_causal, device):
    batch, heads_q, heads_kv, len_q, len_kv, dim = shape
    q, k, v = make_qkv(batch, heads_q, heads_kv, len_q, len_kv, dim, dtype, device)
    gqa = heads_q != heads_kv
    out = flash.attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    assert out.shape == (batch, heads_q, len_q, dim) and out.dtype == dtype
    ref = reference_fp64(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    base = reference_low_precision(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    assert_fa2_close(out, ref, base)


@pytest.mark.parametrize("mask_kind", ["bool_padding", "bool_full", "float_heads", "float_2d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_masks_match_reference(mask_kind, dtype, is_causal, device):
    batch, heads, len_q, len_kv, dim = 2, 3, 33, 47, 24
    q, k, v = make_qkv(batch, heads, heads, len_q, len_kv, dim, dtype, device)
    mask = _mask(mask_kind, batch, heads, len_q, len_kv, dtype, device)
    out = flash.attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    ref = reference_fp64(q, k, v, mask, is_causal=is_causal)
    base = reference_low_precision(q, k, v, mask, is_causal=is_causal)
    assert_fa2_close(out, ref, base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal,mask_kind,scale,gqa", [
    (False, "none", None, False), (True, "none", 0.3, False), (False, "bool_full", None, False),
    (False, "float_heads", 1.7, False), (True, "none", None, True), (False, "bool_padding", None, True),
])
def test_matches_sdpa(dtype, is_causal, mask_kind, scale, gqa, device):
    batch, heads_q, len_q, len_kv, dim = 2, 4, 19, 33, 64
    heads_kv = 2 if gqa else heads_q
    q, k, v = make_qkv(batch, heads_q, heads_kv, len_q, len_kv, dim, dtype, device)
    mask = _mask(mask_kind, batch, heads_q, len_q, len_kv, dtype, device)
    kwargs = dict(attn_mask=mask, is_causal=is_causal, scale=scale)
    if gqa:
        kwargs["enable_gqa"] = True
    out = flash.attention(q, k, v, **kwargs)
    sdpa = F.scaled_dot_product_attention(q, k, v, **kwargs)
    ref = reference_fp64(q, k, v, mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    assert_fa2_close(out, ref, sdpa)


@pytest.mark.parametrize("rank", [2, 3, 5])
def test_other_ranks(rank, device):
    lead = {2: (), 3: (3,), 5: (2, 3, 2)}[rank]
    q = torch.randn(*lead, 9, 16, device=device)
    k = torch.randn(*lead, 11, 16, device=device)
    v = torch.randn(*lead, 11, 8, device=device)  # value head dim may differ, as in SDPA
    mask = torch.randn(11, device=device)  # broadcast over everything but the key dim
    out = flash.attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_blhe_strided_inputs(device):
    q, k, v = make_qkv(2, 4, 4, 37, 29, 32, torch.float32, device, layout="blhe")
    assert not q.is_contiguous()
    out = flash.attention(q, k, v)
    assert out.stride() == q.stride()  # out keeps the [B, L, H, E] memory layout
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_fully_masked_rows_are_zero(device):
    q, k, v = make_qkv(1, 2, 2, 5, 6, 16, torch.float32, device)
    keep = torch.ones(1, 2, 5, 6, dtype=torch.bool, device=device)
    keep[:, :, 2] = False
    bias = torch.zeros(1, 2, 5, 6, device=device)
    bias[:, :, 3] = float("-inf")
    for mask in (keep, bias):
        out = flash.attention(q, k, v, attn_mask=mask)
        assert torch.isfinite(out).all()
        assert (out[:, :, 2 if mask.dtype == torch.bool else 3] == 0).all()
        ref = reference_fp64(q, k, v, mask)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bottom_right_causal(device):
    forward = torch.ops.flashv100._attention_forward
    for len_q, len_kv in itertools.product([5, 13], [5, 13]):
        q, k, v = make_qkv(1, 2, 2, len_q, len_kv, 16, torch.float32, device)
        out, lse, _ = forward(q, k, v, None, 0.0, 2, 0.25)
        ref = reference_fp64(q, k, v, scale=0.25, causal_mode=2)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        if len_q > len_kv:  # the first rows see no key at all
            assert torch.isneginf(lse[:, :, : len_q - len_kv]).all()


def test_lse(device):
    q, k, v = make_qkv(2, 2, 2, 9, 12, 16, torch.float64, device)
    _, lse, _ = torch.ops.flashv100._attention_forward(q, k, v, None, 0.0, 0, 0.5)
    expected = torch.logsumexp((q @ k.transpose(-1, -2)) * 0.5, dim=-1)
    torch.testing.assert_close(lse, expected)


def test_large_magnitude_stays_finite(device):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, torch.float16, device, magnitude=4.0)
    out = flash.attention(q, k, v, scale=1.0)  # scores of several hundred
    ref = reference_fp64(q, k, v, scale=1.0)
    base = reference_low_precision(q, k, v, scale=1.0)
    assert torch.isfinite(out).all()
    assert_fa2_close(out, ref, base)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_row_max_rising_across_key_tiles(dtype, is_causal, device):
    # Scores that climb along the keys in steps both below and above the kernels' lazy-rescale
    # threshold (a tile's max passing the running max by more than 2^8 in P), falling back now
    # and then: every key tile size sees both the skipped and the taken rescale.
    g = torch.Generator().manual_seed(7)
    len_q, len_kv, dim = 48, 300, 64
    steps = torch.tensor([0.02, 0.3, 4.5, 6.5, -3.0], dtype=torch.float64)
    climb = steps[torch.randint(0, len(steps), (len_kv,), generator=g)].cumsum(0)
    k = torch.randn(2, 2, len_kv, dim, generator=g, dtype=torch.float64) * 0.3
    k[..., 0] = climb
    q = torch.randn(2, 2, len_q, dim, generator=g, dtype=torch.float64) * 0.3
    q[..., 0] = torch.linspace(0.5, 1.5, len_q, dtype=torch.float64)
    v = torch.randn(2, 2, len_kv, dim, generator=g, dtype=torch.float64)
    q, k, v = (t.to(device, dtype) for t in (q, k, v))
    out, lse, _ = torch.ops.flashv100._attention_forward(q, k, v, None, 0.0, int(is_causal), 1.0)
    ref = reference_fp64(q, k, v, is_causal=is_causal, scale=1.0)
    base = reference_low_precision(q, k, v, is_causal=is_causal, scale=1.0)
    assert_fa2_close(out, ref, base)
    scores = q.double() @ k.double().transpose(-1, -2)
    if is_causal:
        scores = scores.masked_fill(torch.ones(len_q, len_kv, dtype=torch.bool,
                                               device=device).triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, dim=-1), atol=1e-3, rtol=1e-4)


def test_empty_key_sequence_gives_zeros(device):
    q = torch.randn(1, 1, 3, 8, device=device)
    k = torch.randn(1, 1, 0, 8, device=device)
    out = flash.attention(q, k, k)
    assert out.shape == q.shape and (out == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_causal", [False, True])
def test_rows_hidden_by_finfo_min_have_uniform_gradients_cpu(dtype, is_causal):
    """Rows whose every key carries finfo(float32).min: forward and gradients are those of the
    uniform average SDPA math gives (a P rebuilt from lse alone would be off by the key count,
    because log(sum) vanishes next to |max| in lse)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 12, 16, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 2, 20, 16, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 2, 20, 16, generator=gen, dtype=dtype, requires_grad=True)
    mask = torch.rand(1, 1, 12, 20, generator=gen) * 2 - 1
    mask[:, :, :5] = torch.finfo(torch.float32).min  # hidden rows
    mask[:, :, 5:, 7] = torch.finfo(torch.float32).min  # and a hidden key elsewhere
    mask.requires_grad_(True)
    out = flash.attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    dout = torch.randn(out.shape, generator=gen, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v, mask), dout)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, mask)]
    ref = reference_attention(*leaves[:3], attn_mask=leaves[3], is_causal=is_causal)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for name, got, want in zip(("dq", "dk", "dv", "dmask"), grads, ref_grads):
        t = max(tol, 1e-5) if name == "dmask" else tol  # the mask (and its gradient) is fp32
        torch.testing.assert_close(got.double(), want, atol=t, rtol=t,
                                   msg=lambda m, name=name: f"{name}: {m}")

