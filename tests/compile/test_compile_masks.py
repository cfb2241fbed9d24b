"""Masks: additive float masks of any dtype, masked_fill / where with bool masks, broadcast masks,
slices of a larger cached mask."""

import pytest
import torch
import torch.nn.functional as F

from compile_testing import DEVICE, check, no_grad_input, qkv

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
B, H, L, S, E = 2, 4, 8, 8, 16


def _pad_bool(b=B, s=S):
    keep = torch.ones(b, s, dtype=torch.bool, device=DEVICE)
    keep[1, -3:] = False
    return keep


def additive(q, k, v, m):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25 + m
    return F.softmax(s, dim=-1) @ v


def additive_before_scale(q, k, v, m):  # (qk + m) / 4  ->  mask scaled too
    s = (torch.matmul(q, k.transpose(-2, -1)) + m) / 4
    return F.softmax(s, dim=-1) @ v


def masked_fill_not(q, k, v, keep):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    s = s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)
    return F.softmax(s, dim=-1) @ v


def masked_fill_eq0(q, k, v, keep01):  # BERT/DistilBERT style: mask == 0 -> -inf
    s = torch.matmul(q, k.transpose(-2, -1)) / 4
    s = s.masked_fill((keep01 == 0).view(B, 1, 1, S), float("-inf"))
    return F.softmax(s, dim=-1) @ v


def where_keep(q, k, v, keep):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    mask_value = torch.full([], torch.finfo(s.dtype).min, dtype=s.dtype, device=s.device)
    s = torch.where(keep[:, None, None, :], s, mask_value)
    return F.softmax(s, dim=-1) @ v


def cached_mask_slice(q, k, v, big):  # a [1, 1, 64, 64] cached additive mask, sliced
    l, s_ = q.size(-2), k.size(-2)
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25 + big[:, :, :l, :s_]
    return F.softmax(s, dim=-1) @ v


def two_masks(q, k, v, m, keep):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25 + m
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    return F.softmax(s, dim=-1) @ v


@TRAIN
@pytest.mark.parametrize("shape", [(L, S), (B, 1, 1, S), (B, 1, L, S), (B, H, L, S), (1, H, 1, S)],
                         ids=lambda s: "x".join(map(str, s)))
def test_additive_broadcast(shape, train):
    m = no_grad_input(torch.randn(*shape, device=DEVICE))
    cap = check(additive, (*qkv(), m), train=train)
    assert cap.attention_calls()[0]["attn_mask"] is not None


@TRAIN
def test_additive_mask_grad(train):
    # a learnable bias (e.g. T5 relative position bias) gets its gradient through the op
    check(additive, (*qkv(), torch.randn(1, H, L, S, device=DEVICE)), train=train)


def subtracted(q, k, v, m):  # scores - m: the mask negated
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25 - m
    return F.softmax(s, dim=-1) @ v


@TRAIN
def test_subtracted_mask(train):
    cap = check(subtracted, (*qkv(), torch.randn(1, H, L, S, device=DEVICE)), train=train)
    assert cap.attention_calls()[0]["attn_mask"] is not None


@TRAIN
def test_additive_mask_scaled_after(train):
    m = no_grad_input(torch.randn(B, 1, L, S, device=DEVICE))
    check(additive_before_scale, (*qkv(), m), train=train)


@TRAIN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=str)
def test_finfo_min_mask_any_dtype(dtype, train):
    keep = _pad_bool()
    m = torch.zeros(B, 1, 1, S, dtype=dtype, device=DEVICE)
    m = no_grad_input(m.masked_fill(~keep[:, None, None, :], torch.finfo(dtype).min))
    check(additive, (*qkv(), m), train=train)


@TRAIN
def test_bf16_everything(train):
    keep = _pad_bool()
    m = torch.zeros(B, 1, 1, S, dtype=torch.bfloat16, device=DEVICE)
    m = no_grad_input(m.masked_fill(~keep[:, None, None, :], torch.finfo(torch.bfloat16).min))
    check(additive, (*qkv(dtype=torch.bfloat16), m), train=train, atol=2e-2, rtol=2e-2)


@TRAIN
@pytest.mark.parametrize("fn", [masked_fill_not, where_keep], ids=["masked_fill", "where"])
def test_bool_masks(fn, train):
    cap = check(fn, (*qkv(), _pad_bool()), train=train)
    call = cap.attention_calls()[0]
    assert call["attn_mask"] is not None and call["is_causal"] is False


@TRAIN
def test_masked_fill_eq0(train):
    check(masked_fill_eq0, (*qkv(), _pad_bool().long()), train=train)


@TRAIN
def test_cached_mask_slice(train):
    big = torch.randn(1, 1, 64, 64, device=DEVICE)
    check(cached_mask_slice, (*qkv(l=6, s=10), no_grad_input(big)), train=train)


@TRAIN
def test_additive_and_bool(train):
    m = no_grad_input(torch.randn(1, 1, L, S, device=DEVICE))
    check(two_masks, (*qkv(), m, _pad_bool()), train=train)


def plus_bool(q, k, v, flags):  # PyTorch promotion: True adds 1.0 to the score
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25 + flags
    return F.softmax(s, dim=-1) @ v


@TRAIN
@pytest.mark.parametrize("shape", [(B, 1, 1, S), (B, 1, L, S)], ids=lambda s: "x".join(map(str, s)))
def test_scores_plus_bool_is_promoted(shape, train):
    g = torch.Generator().manual_seed(3)
    flags = (torch.rand(*shape, generator=g) < 0.5).to(DEVICE)
    cap = check(plus_bool, (*qkv(), flags), train=train)
    mask = cap.attention_calls()[0]["attn_mask"]
    assert mask is not None and mask.meta["example_value"].is_floating_point()
