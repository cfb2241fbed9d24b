"""ALiBi: an additive bias slope[h] * j or slope[h] * (j - i) under a causal mask, or
-slope[h] * |i - j| with any band, built from arange and a per-head slope tensor or constant,
becomes the FlashAttention-2 op's alibi_slopes (its bias is -slope * |i - j|, which equals the
others up to a constant per row, where they keep keys); any other bias stays an additive mask of
flashv100.attention."""

import pytest
import torch
import torch.nn.functional as F

from compile_testing import DEVICE, check, no_grad_input, qkv, query_key_positions, scores
from torch_flash_v100.compile import history

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
DTYPE = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
B, H, L, E = 2, 4, 8, 16


def _slopes(dtype=torch.float32, h=H):  # BLOOM's and MPT's: 2 ** (-8 * (h + 1) / H)
    return no_grad_input(2.0 ** (-8.0 * torch.arange(1, h + 1, dtype=dtype, device=DEVICE) / h))


def relative_causal(q, k, v, slopes):  # slope * (j - i), causal
    s = scores(q, k)
    i, j = query_key_positions(s)
    s = s + slopes.view(1, -1, 1, 1) * (j - i)
    return F.softmax(s.masked_fill(j > i, torch.finfo(s.dtype).min), dim=-1) @ v


def mpt(q, k, v, slopes):  # transformers' MPT: arange(1 - S, 1) * slopes, cut to the keys
    s = scores(q, k)
    alibi = torch.arange(1 - 64, 1, dtype=torch.int32, device=s.device).view(1, 1, 1, 64)
    alibi = (alibi * slopes.view(1, H, 1, 1)).squeeze(0)
    bias = alibi[:, 0:, 64 - s.size(-1):]
    i, j = query_key_positions(s)
    s = (s + bias).masked_fill(j > i, torch.finfo(s.dtype).min)
    return F.softmax(s.float(), dim=-1).to(v.dtype) @ v


def keys_only_before_scale(q, k, v, slopes):  # Falcon's order: (q @ k^T + bias) * scale
    s = torch.matmul(q, k.transpose(-2, -1))
    s = (s + slopes[:, None, None] * torch.arange(L, device=s.device)) * 0.25
    i, j = query_key_positions(s)
    return F.softmax(s + torch.triu(torch.full((L, L), float("-inf"), device=s.device), 1),
                     dim=-1) @ v


def bloom_3d(q, k, v, slopes):  # BLOOM's layout: baddbmm on [B * H, L, S], a 4-D view, bmm
    q3 = q.reshape(B * H, L, E)
    k3 = k.reshape(B * H, L, E).transpose(1, 2)
    v3 = v.reshape(B * H, L, E)
    alibi = slopes.repeat(B)[:, None, None] * torch.arange(L, device=q.device)
    s = alibi.baddbmm(batch1=q3, batch2=k3, beta=1.0, alpha=0.25).view(B, H, L, L)
    i, j = query_key_positions(s)
    s = s.masked_fill(j > i, torch.finfo(s.dtype).min)
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p.view(B * H, L, L), v3).view(B, H, L, E)


def symmetric(q, k, v, slopes):  # FlashAttention-2's own: -slope * |i - j|, not causal
    s = scores(q, k)
    i, j = query_key_positions(s)
    return F.softmax(s - slopes[:, None, None] * (i - j).abs(), dim=-1) @ v


def symmetric_window(q, k, v, slopes):
    s = scores(q, k)
    i, j = query_key_positions(s)
    s = s - slopes[:, None, None] * torch.abs(j - i)
    return F.softmax(s.masked_fill((i - j).abs() > 2, float("-inf")), dim=-1) @ v


def constant_slope(q, k, v):  # one slope for every head, a Python number
    s = scores(q, k)
    i, j = query_key_positions(s)
    s = s + 0.5 * (j - i)
    return F.softmax(s.masked_fill(j > i, float("-inf")), dim=-1) @ v


def per_batch_and_head(q, k, v, slopes):  # slopes [B, H]
    s = scores(q, k)
    i, j = query_key_positions(s)
    s = s + slopes[:, :, None, None] * j
    return F.softmax(s.masked_fill(j > i, float("-inf")), dim=-1) @ v


CASES = {
    # name: (fn, the slopes input (of a dtype), the op's slopes (from the slopes), causal)
    "relative_causal": (relative_causal, lambda d: _slopes(d), lambda sl: sl, True),
    "mpt": (mpt, lambda d: _slopes(d), lambda sl: sl, True),
    "keys_only_before_scale": (keys_only_before_scale, lambda d: _slopes(d),
                               lambda sl: sl * 0.25, True),
    "bloom_3d": (bloom_3d, lambda d: _slopes(d), lambda sl: sl, True),
    "symmetric": (symmetric, lambda d: _slopes(d), lambda sl: sl, False),
    "symmetric_window": (symmetric_window, lambda d: _slopes(d), lambda sl: sl, False),
    "constant_slope": (constant_slope, None, lambda sl: torch.full((H,), 0.5), True),
    "per_batch_and_head": (per_batch_and_head,
                           lambda d: no_grad_input(torch.rand(B, H, dtype=d, device=DEVICE)),
                           lambda sl: sl, True),
}


@TRAIN
@DTYPE
@pytest.mark.parametrize("name", list(CASES))
def test_alibi_becomes_alibi_slopes(name, dtype, train):
    fn, make_slopes, expected, causal = CASES[name]
    args = qkv(dtype=dtype)
    slopes = make_slopes(dtype) if make_slopes else None
    if slopes is not None:
        args = (*args, slopes)
    cap = check(fn, args, train=train)
    (call,) = cap.flash_calls()
    assert call["causal"] is causal
    op_slopes = call["alibi_slopes"].meta["example_value"]
    assert op_slopes.dtype == torch.float32 and op_slopes.shape in ((B, H), (B * H, 1))


@DTYPE
@pytest.mark.parametrize("name", list(CASES))
def test_alibi_slope_values(name, dtype):
    # the op's slopes, as the rewritten graph computes them, are the model's (times the
    # factors applied to the bias), for every batch and head
    fn, make_slopes, expected, _ = CASES[name]
    args = qkv(dtype=dtype)
    slopes = make_slopes(dtype) if make_slopes else None
    if slopes is not None:
        args = (*args, slopes)
    seen = []
    flash = torch.ops.flashv100._flash_forward

    def spy(*a):
        seen.append(a[13])
        return flash.default(*a)

    from torch_flash_v100.compile import rewrite_module

    def backend(gm, example_inputs):
        rewrite_module(gm, force=True)
        for n in gm.graph.nodes:
            if n.target is flash.default:
                n.target = spy
        gm.recompile()
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (got,) = seen
    want = expected(slopes.float() if slopes is not None else None).to(got.device)
    want = want.expand(B, H) if want.dim() == 1 else want
    torch.testing.assert_close(got.reshape(B, H), want.float(), rtol=1e-6, atol=0)


# ---- left to flashv100.attention as an additive mask --------------------------------------------

def keys_not_causal(q, k, v, slopes):  # slope * j without causality: not the op's ALiBi
    s = scores(q, k)
    return F.softmax(s + slopes[:, None, None] * torch.arange(L, device=s.device), -1) @ v


def per_row_slopes(q, k, v, slopes):  # a slope for every query row: not per head
    s = scores(q, k)
    i, j = query_key_positions(s)
    s = s + slopes.view(1, 1, L, 1) * j
    return F.softmax(s.masked_fill(j > i, float("-inf")), dim=-1) @ v


def quadratic(q, k, v, slopes):  # slope * (j - i) ** 2: not ALiBi
    s = scores(q, k)
    i, j = query_key_positions(s)
    s = s + slopes.view(1, -1, 1, 1) * (j - i) ** 2
    return F.softmax(s.masked_fill(j > i, float("-inf")), dim=-1) @ v


def random_bias(q, k, v, bias):  # T5-style learned position bias
    s = scores(q, k) + bias
    i, j = query_key_positions(s)
    return F.softmax(s.masked_fill(j > i, float("-inf")), dim=-1) @ v


def with_padding(q, k, v, slopes, keep):
    s = scores(q, k)
    i, j = query_key_positions(s)
    s = s + slopes.view(1, -1, 1, 1) * (j - i)
    s = s.masked_fill(j > i, torch.finfo(s.dtype).min)
    return F.softmax(s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min), -1) @ v


def learnable(q, k, v, slopes):
    s = scores(q, k)
    i, j = query_key_positions(s)
    s = s + slopes.view(1, -1, 1, 1) * (j - i)
    return F.softmax(s.masked_fill(j > i, float("-inf")), dim=-1) @ v


def _pad_keep():
    keep = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
    keep[1, -3:] = False
    return keep


KEPT = {
    # name: (fn, extra args, logged why, is_causal)
    "keys_not_causal": (keys_not_causal, lambda: (_slopes(),),
                        "the ALiBi bias stays a mask: an ALiBi bias slope * j on keys right",
                        False),
    "per_row_slopes": (per_row_slopes, lambda: (no_grad_input(torch.rand(L, device=DEVICE)),),
                       "slopes that vary along the query rows", True),
    "quadratic": (quadratic, lambda: (_slopes(),), "", True),
    "random_bias": (random_bias,
                    lambda: (no_grad_input(torch.randn(1, H, L, L, device=DEVICE)),), "", True),
    "with_padding": (with_padding, lambda: (_slopes(), _pad_keep()),
                     "the ALiBi bias stays a mask: the mask also holds more", True),
}


@TRAIN
@pytest.mark.parametrize("name", list(KEPT))
def test_bias_stays_a_mask(name, train):
    fn, extra, why, is_causal = KEPT[name]
    cap = check(fn, (*qkv(), *extra()), train=train)
    (call,) = cap.attention_calls()
    assert not cap.flash_calls()
    assert call["attn_mask"] is not None and call["is_causal"] is is_causal
    (site,) = history
    assert why in site[2], site


def test_learnable_slopes_stay_a_mask():
    # the op gives the slopes no gradient: in training the bias stays a mask, whose gradient
    # reaches the slopes (check compares it with eager's); the mask then carries the causality
    # (see the README's parity rules)
    cap = check(learnable, (*qkv(), torch.rand(H, device=DEVICE)), train=True)
    (call,) = cap.attention_calls()
    assert not cap.flash_calls() and call["attn_mask"] is not None and not call["is_causal"]
    (site,) = history
    assert "learnable ALiBi slopes" in site[2], site
