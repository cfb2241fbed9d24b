"""Provably lower-triangular masks become is_causal=True (plus the mask when it holds more); other
bands of diagonals become windows of the FlashAttention-2 op."""

import pytest
import torch
import torch.nn.functional as F

from compile_testing import DEVICE, check, qkv

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
B, H, L, E = 2, 4, 8, 16


def _scores(q, k):
    return torch.matmul(q, k.transpose(-2, -1)) * 0.25


def tril_bool_masked_fill(q, k, v):
    s = _scores(q, k)
    causal = torch.tril(torch.ones(s.size(-2), s.size(-1), dtype=torch.bool, device=s.device))
    return F.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v


def tril_float_eq0(q, k, v):  # nanoGPT: bias = tril(ones(L, L)).view(1, 1, L, L)
    s = _scores(q, k)
    bias = torch.tril(torch.ones(L, L, device=s.device)).view(1, 1, L, L)
    s = s.masked_fill(bias[:, :, :L, :L] == 0, float("-inf"))
    return F.softmax(s, dim=-1) @ v


def triu_additive(q, k, v):
    s = _scores(q, k)
    m = torch.triu(torch.full((L, L), float("-inf"), device=s.device), diagonal=1)
    return F.softmax(s + m, dim=-1) @ v


def triu_finfo_min_method(q, k, v):
    s = _scores(q, k)
    m = torch.full((L, L), torch.finfo(s.dtype).min, device=s.device).triu(1)
    return F.softmax(s + m[None, None], dim=-1) @ v


def arange_where(q, k, v):
    s = _scores(q, k)
    i = torch.arange(s.size(-2), device=s.device)
    j = torch.arange(s.size(-1), device=s.device)
    keep = j[None, :] <= i[:, None]
    return F.softmax(torch.where(keep, s, torch.finfo(s.dtype).min), dim=-1) @ v


def arange_gt_additive(q, k, v):  # i < j -> masked, expressed as a float mask
    s = _scores(q, k)
    i = torch.arange(L, device=s.device).view(L, 1)
    j = torch.arange(L, device=s.device).view(1, L)
    m = torch.zeros(L, L, device=s.device).masked_fill(j > i, float("-inf"))
    return F.softmax(s + m, dim=-1) @ v


def causal_and_padding(q, k, v, keep):  # HF masking_utils style: causal & padding -> where(0, min)
    s = _scores(q, k)
    qi = torch.arange(L, device=s.device)[None, None, :, None]
    kj = torch.arange(L, device=s.device)[None, None, None, :]
    m = (kj <= qi) & keep[:, None, None, :]
    m = torch.where(m.expand(B, -1, L, L), torch.zeros((), device=s.device),
                    torch.finfo(s.dtype).min)
    return F.softmax(s + m, dim=-1) @ v


def sliding_window(q, k, v):  # causal AND within 3 positions: stricter than causal
    s = _scores(q, k)
    qi = torch.arange(L, device=s.device)[:, None]
    kj = torch.arange(L, device=s.device)[None, :]
    keep = (kj <= qi) & (kj > qi - 3)
    return F.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v


@TRAIN
@pytest.mark.parametrize("fn", [tril_bool_masked_fill, tril_float_eq0, triu_additive,
                                triu_finfo_min_method, arange_where, arange_gt_additive],
                         ids=lambda f: f.__name__)
def test_pure_causal(fn, train):
    cap = check(fn, qkv(), train=train)
    (call,) = cap.attention_calls()
    assert call["is_causal"] is True
    assert call["attn_mask"] is None  # the mask is exactly causal: dropped


@TRAIN
def test_causal_plus_padding(train):
    keep = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
    keep[1, -2:] = False  # right padding: every query row keeps key 0
    cap = check(causal_and_padding, (*qkv(), keep), train=train)
    (call,) = cap.attention_calls()
    assert call["is_causal"] is True and call["attn_mask"] is not None


@TRAIN
def test_sliding_window_is_a_window(train):
    # stricter than causal: the FlashAttention-2 op's window (test_compile_window.py)
    cap = check(sliding_window, qkv(), train=train)
    (call,) = cap.flash_calls()
    assert call["causal"] is True and (call["window_left"], call["window_right"]) == (2, 0)


def tril_diag1(q, k, v):  # keeps one position above the diagonal: NOT causal
    s = _scores(q, k)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=s.device), diagonal=1)
    return F.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v


def bottom_right(q, k, v):  # query i sits at absolute position i + (S - L): NOT top-left causal
    s = _scores(q, k)
    l_, s_ = s.size(-2), s.size(-1)
    qi = torch.arange(s_ - l_, s_, device=s.device)[:, None]
    kj = torch.arange(s_, device=s.device)[None, :]
    return F.softmax(s.masked_fill(kj > qi, float("-inf")), dim=-1) @ v


def triu_on_lower(q, k, v):  # masks the lower triangle: anti-causal
    s = _scores(q, k)
    m = torch.tril(torch.full((L, L), float("-inf"), device=s.device), diagonal=-1)
    return F.softmax(s + m, dim=-1) @ v


@TRAIN
@pytest.mark.parametrize("fn,shapes,window", [
    (tril_diag1, {}, (-1, 1)), (bottom_right, {"l": 4, "s": 8}, (-1, 0)),
    (triu_on_lower, {}, (0, -1))], ids=["tril_diag1", "bottom_right", "anti_causal"])
def test_not_top_left_causal(fn, shapes, window, train):
    # never is_causal=True (top-left): each is another band of diagonals, the FlashAttention-2
    # op's window (aligned bottom-right: (-1, 0) is bottom_right's causality)
    cap = check(fn, qkv(**shapes), train=train)
    assert not cap.attention_calls()
    (call,) = cap.flash_calls()
    assert (call["window_left"], call["window_right"]) == window
