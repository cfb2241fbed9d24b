"""flash_attn.layers.rotary's functions (torch_flash_v100.layers.rotary) against the fp64
reference rotation of torch_flash_v100.reference (every position and dim), the same rotation
inside flash_attn_with_kvcache, in-place packed forms, gradients, the module and bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_flash_v100.flash_attn_interface import flash_attn_with_kvcache
from torch_flash_v100.layers.rotary import (RotaryEmbedding, apply_rotary_emb,
                                            apply_rotary_emb_kv_, apply_rotary_emb_qkv_)
from torch_flash_v100.reference import apply_rotary

TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3,
              torch.bfloat16: 2e-2}


def _tables(rows, rotary_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(rows, rotary_dim // 2, generator=g, dtype=torch.float64) * 6.0
    return torch.cos(angles), torch.sin(angles)


def _reference(x, cos, sin, positions_per_sequence, interleaved):
    """apply_rotary (fp64) sequence by sequence: x [B, S, H, D], positions [B][S]."""
    return torch.stack([apply_rotary(x[b].double(), cos, sin, torch.tensor(p), interleaved)
                        for b, p in enumerate(positions_per_sequence)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["zero", "int", "tensor"])
def test_apply_rotary_emb_matches_reference(device, dtype, interleaved, offsets):
    batch, seqlen, heads, dim, rotary_dim = 3, 7, 2, 16, 12
    cos, sin = _tables(20, rotary_dim)
    x = torch.randn(batch, seqlen, heads, dim, dtype=torch.float64).to(dtype)
    per_sequence = {"zero": [0, 0, 0], "int": [5, 5, 5], "tensor": [0, 13, 4]}[offsets]
    seqlen_offsets = {"zero": 0, "int": 5,
                      "tensor": torch.tensor(per_sequence, dtype=torch.int32, device=device)}
    out = apply_rotary_emb(x.to(device), cos.to(device, dtype), sin.to(device, dtype),
                           interleaved=interleaved, seqlen_offsets=seqlen_offsets[offsets])
    expected = _reference(x, cos.to(dtype).double(), sin.to(dtype).double(),
                          [range(o, o + seqlen) for o in per_sequence], interleaved)
    assert out.dtype == dtype and out.shape == x.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)
    assert torch.equal(out[..., rotary_dim:].cpu(), x[..., rotary_dim:])  # not rotated: kept


def test_packed_sequences_take_their_own_positions(device):
    lengths, offsets = [3, 0, 5, 1], [2, 7, 0, 9]
    cos, sin = _tables(12, 8)
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32, device=device)
    x = torch.randn(9, 2, 8, dtype=torch.float64, device=device)
    out = apply_rotary_emb(x, cos.to(device), sin.to(device), cu_seqlens=cu, max_seqlen=5,
                           seqlen_offsets=torch.tensor(offsets, device=device))
    rows = [apply_rotary(x[int(cu[b]):int(cu[b + 1])].cpu(), cos, sin,
                         torch.arange(offsets[b], offsets[b] + n), False)
            for b, n in enumerate(lengths)]
    torch.testing.assert_close(out.cpu(), torch.cat(rows), atol=1e-12, rtol=1e-12)


def test_same_rotation_as_flash_attn_with_kvcache():
    """The kvcache op's in-kernel rotary (interleaved by default) equals rotating q and the new k
    here first, at the cache rows they are appended at."""
    g = torch.Generator().manual_seed(1)
    batch, new, heads, dim, cache_len = 2, 3, 2, 16, 12
    q, k, v = (torch.randn(batch, new, heads, dim, generator=g, dtype=torch.float64)
               for _ in range(3))
    k_cache, v_cache = (torch.randn(batch, cache_len, heads, dim, generator=g,
                                    dtype=torch.float64) for _ in range(2))
    seqlens = torch.tensor([4, 9], dtype=torch.int32)
    cos, sin = _tables(cache_len, 8)
    fused_caches = (k_cache.clone(), v_cache.clone())
    fused = flash_attn_with_kvcache(q, *fused_caches, k, v, rotary_cos=cos, rotary_sin=sin,
                                    cache_seqlens=seqlens, causal=True)
    rotate = dict(interleaved=True, seqlen_offsets=seqlens)
    separate_caches = (k_cache.clone(), v_cache.clone())
    separate = flash_attn_with_kvcache(apply_rotary_emb(q, cos, sin, **rotate), *separate_caches,
                                       apply_rotary_emb(k, cos, sin, **rotate), v,
                                       cache_seqlens=seqlens, causal=True)
    torch.testing.assert_close(fused, separate, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(fused_caches[0], separate_caches[0], atol=1e-12, rtol=1e-12)


def test_in_place_forms(device):
    cos, sin = _tables(10, 8)
    cos, sin = cos.to(device), sin.to(device)
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64, device=device)
    expected = apply_rotary_emb(x, cos, sin, seqlen_offsets=2)
    same = x.clone()
    assert apply_rotary_emb(same, cos, sin, inplace=True, seqlen_offsets=2) is same
    assert torch.equal(same, expected)
    # qkv [B, S, 3, H, D]: q and k rotated, v kept; k may take its own tables (xPos).
    qkv = torch.randn(2, 5, 3, 3, 16, dtype=torch.float64, device=device)
    cos_k, sin_k = (t * 0.5 for t in (cos, sin))
    rotated = apply_rotary_emb_qkv_(qkv.clone(), cos, sin, cos_k, sin_k, seqlen_offsets=1)
    assert torch.equal(rotated[:, :, 0], apply_rotary_emb(qkv[:, :, 0], cos, sin, seqlen_offsets=1))
    assert torch.equal(rotated[:, :, 1],
                       apply_rotary_emb(qkv[:, :, 1], cos_k, sin_k, seqlen_offsets=1))
    assert torch.equal(rotated[:, :, 2], qkv[:, :, 2])
    # GQA qkv [B, S, Hq + 2 Hk, D]
    packed = torch.randn(2, 5, 4 + 2 * 2, 16, dtype=torch.float64, device=device)
    rotated = apply_rotary_emb_qkv_(packed.clone(), cos, sin, num_heads_q=4)
    assert torch.equal(rotated[:, :, :6], apply_rotary_emb(packed[:, :, :6], cos, sin))
    assert torch.equal(rotated[:, :, 6:], packed[:, :, 6:])
    kv = torch.randn(2, 5, 2, 3, 16, dtype=torch.float64, device=device)
    rotated = apply_rotary_emb_kv_(kv.clone(), cos, sin, interleaved=True)
    assert torch.equal(rotated[:, :, 0], apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved=True))
    assert torch.equal(rotated[:, :, 1], kv[:, :, 1])


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradients(interleaved):
    cos, sin = _tables(9, 6)
    x = torch.randn(2, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 5])

    def rotate(t):
        return apply_rotary_emb(t, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)

    torch.autograd.gradcheck(rotate, (x,))
    torch.autograd.gradgradcheck(rotate, (x,))
    # The backward is the rotation by the opposite angles.
    grad_out = torch.randn_like(x)
    (grad,) = torch.autograd.grad(rotate(x), x, grad_out)
    expected = apply_rotary_emb(grad_out, cos, -sin, interleaved=interleaved,
                                seqlen_offsets=offsets)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=1e-12)
    # In place on a non-leaf: gradients flow through the rotated view.
    y = x * 1.0
    z = torch.stack([y, y, y], dim=2)
    rotated = apply_rotary_emb_qkv_(z, cos, sin, interleaved=interleaved)
    (grad,) = torch.autograd.grad(rotated.sum(), x)
    ones = torch.ones_like(x)
    expected = 2 * apply_rotary_emb(ones, cos, -sin, interleaved=interleaved) + ones
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("scale_base", [None, 64.0])
def test_rotary_embedding_module(device, scale_base):
    dim, seqlen, heads = 8, 6, 2
    module = RotaryEmbedding(dim, base=100.0, interleaved=False, scale_base=scale_base,
                             device=device)
    qkv = torch.randn(1, seqlen, 3, heads, 16, dtype=torch.float32, device=device)
    out = module(qkv.clone(), seqlen_offset=3)
    rows = seqlen + 3
    angles = torch.tensor([[p * 100.0 ** (-2 * i / dim) for i in range(dim // 2)]
                           for p in range(rows)], dtype=torch.float64)
    cos, sin = torch.cos(angles), torch.sin(angles)
    cos_k, sin_k = cos, sin
    if scale_base is not None:
        scale = torch.tensor([[((2 * i + 0.4 * dim) / (1.4 * dim)) ** ((p - rows // 2) / scale_base)
                               for i in range(dim // 2)] for p in range(rows)], dtype=torch.float64)
        cos, sin, cos_k, sin_k = cos * scale, sin * scale, cos / scale, sin / scale
    for part, c, s in ((0, cos, sin), (1, cos_k, sin_k)):
        expected = _reference(qkv[:, :, part].cpu(), c, s, [range(3, 3 + seqlen)], False)
        torch.testing.assert_close(out[:, :, part].cpu().double(), expected, atol=1e-5,
                                   rtol=1e-5)
    assert torch.equal(out[:, :, 2], qkv[:, :, 2])
    # q and kv given apart: the same rotation.
    q, kv = module(qkv[:, :, 0].clone(), qkv[:, :, 1:].clone(), seqlen_offset=3)
    assert torch.equal(q, out[:, :, 0]) and torch.equal(kv[:, :, 0], out[:, :, 1])
    fresh = RotaryEmbedding(dim)
    with pytest.raises(ValueError, match="needs max_seqlen"):
        fresh(qkv.cpu(), seqlen_offset=torch.tensor([2]))


def test_bad_input_raises_naming_the_argument(device):
    cos, sin = (t.to(device) for t in _tables(8, 8))
    x = torch.randn(2, 5, 2, 16, device=device)
    with pytest.raises(ValueError, match="positions 4..9 must lie in the cos/sin table's 8 rows"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=4)
    offsets = torch.tensor([0, 4], device=device)
    with pytest.raises(ValueError, match="token positions 0..8 .* 8 rows"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
    with pytest.raises(ValueError, match="one entry per sequence \\(2\\)"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0], device=device))
    with pytest.raises(ValueError, match="rotary_dim .* at most the head dim 4"):
        apply_rotary_emb(x[..., :4], cos, sin)
    with pytest.raises(ValueError, match="cos and sin must be floating"):
        apply_rotary_emb(x, cos, sin[:, :2])
    with pytest.raises(ValueError, match="packed \\[total, nheads, headdim\\]"):
        apply_rotary_emb(x, cos, sin, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    packed = torch.randn(5, 2, 16, device=device)
    with pytest.raises(ValueError, match="rise from 0 to x's 5 tokens"):
        apply_rotary_emb(packed, cos, sin,
                         cu_seqlens=torch.tensor([0, 4], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(torch.randn(1, 5, 6, 16, device=device), cos, sin)
    with pytest.raises(ValueError, match="kv must be"):
        apply_rotary_emb_kv_(torch.randn(1, 5, 3, 2, 16, device=device), cos, sin)
    with pytest.raises(ValueError, match="positive even"):
        RotaryEmbedding(7)
    assert math.isfinite(float(apply_rotary_emb(x, cos, sin).sum()))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=4), heads=st.integers(1, 3),
       half_rotary=st.integers(1, 4), extra_dims=st.integers(0, 4), interleaved=st.booleans(),
       offsets=st.lists(st.integers(0, 5), min_size=4, max_size=4), seed=st.integers(0, 2**16))
def test_fuzz_packed_against_the_reference(lengths, heads, half_rotary, extra_dims, interleaved,
                                           offsets, seed):
    """Random packed batches: each sequence's tokens at its own offset, against the fp64
    reference rotation sequence by sequence."""
    offsets = offsets[:len(lengths)]
    rows = max(n + o for n, o in zip(lengths, offsets)) + 1
    cos, sin = _tables(rows, 2 * half_rotary, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), heads, 2 * half_rotary + extra_dims, generator=g,
                    dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, cu_seqlens=cu,
                           max_seqlen=max(lengths), seqlen_offsets=torch.tensor(offsets))
    expected = [apply_rotary(x[int(cu[b]):int(cu[b + 1])], cos, sin,
                             torch.arange(offsets[b], offsets[b] + n), interleaved)
                for b, n in enumerate(lengths)]
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-12, rtol=1e-12)
