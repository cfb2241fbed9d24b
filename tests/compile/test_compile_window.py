"""Sliding windows: a mask that keeps a band of diagonals (i - left <= j <= i + right, built from
arange comparisons, tril/triu, abs distances, in any mask spelling) becomes the
FlashAttention-2 op's window_size, with no mask; where it holds more (padding) or some query row
would see no key, it stays a mask of flashv100.attention."""

import pytest
import torch
import torch.nn.functional as F

from compile_testing import DEVICE, check, qkv, query_key_positions, scores
from test_compile_gqa import repeat_kv
from torch_flash_v100.compile import history

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
DTYPE = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
B, H, L, E = 2, 4, 8, 16
W = 3  # the window of the Mistral-style masks: the diagonal and the two keys before it


def arange_bool_fill(q, k, v):  # keep i - W < j <= i
    s = scores(q, k)
    i, j = query_key_positions(s)
    keep = (j <= i) & (j > i - W)
    return F.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v


def hf_additive(q, k, v):  # transformers' masks: where(keep, 0, finfo.min), added; fp32 softmax
    s = scores(q, k)
    qi = torch.arange(s.size(-2), device=s.device)[None, None, :, None]
    kj = torch.arange(s.size(-1), device=s.device)[None, None, None, :]
    keep = (kj > qi - W) & (kj <= qi)
    m = torch.where(keep, torch.zeros((), device=s.device, dtype=s.dtype),
                    torch.finfo(s.dtype).min)
    return torch.matmul(F.softmax(s + m, dim=-1, dtype=torch.float32).to(q.dtype), v)


def tril_triu(q, k, v):  # the band as tril(ones) with triu(.., -W + 1)
    s = scores(q, k)
    band = torch.ones(L, L, dtype=torch.bool, device=s.device).tril().triu(-W + 1)
    return F.softmax(s.masked_fill(~band, torch.finfo(s.dtype).min), dim=-1) @ v


def tril_minus_tril(q, k, v):  # causal and not (d <= -W)
    s = scores(q, k)
    ones = torch.ones(L, L, device=s.device)
    band = torch.tril(ones) - torch.tril(ones, diagonal=-W)
    return F.softmax(s.masked_fill(band == 0, float("-inf")), dim=-1) @ v


def two_fills(q, k, v):  # causality and the window as two separate masks
    s = scores(q, k)
    i, j = query_key_positions(s)
    s = s.masked_fill(j > i, float("-inf"))
    s = torch.where(i - j < W, s, torch.finfo(s.dtype).min)
    return F.softmax(s, dim=-1) @ v


def too_far_or_future(q, k, v):  # transformers 4.4x: the masked set as (j > i) | (j <= i - W)
    s = scores(q, k)
    i, j = query_key_positions(s)
    masked = (j > i) | (j <= i - W)
    m = torch.full((L, L), torch.finfo(s.dtype).min, device=s.device, dtype=s.dtype) * masked
    return F.softmax(s + m, dim=-1) @ v


def bidirectional(q, k, v):  # |i - j| <= 2, not causal (transformers' bidirectional overlay)
    s = scores(q, k)
    i, j = query_key_positions(s)
    m = torch.zeros(L, L, device=s.device, dtype=s.dtype)
    m = m.masked_fill((i - j).abs() > 2, torch.finfo(s.dtype).min)
    return F.softmax(s + m, dim=-1) @ v


def looks_ahead(q, k, v):  # j <= i + 1: one key past the diagonal
    s = scores(q, k)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=s.device), diagonal=1)
    return F.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v


def anti_causal(q, k, v):  # masks the lower triangle: j >= i
    s = scores(q, k)
    m = torch.tril(torch.full((L, L), float("-inf"), device=s.device), diagonal=-1)
    return F.softmax(s + m, dim=-1) @ v


def bottom_right(q, k, v):  # L < S, query i at position i + S - L: bottom-right causal
    s = scores(q, k)
    l_, s_ = s.size(-2), s.size(-1)
    qi = torch.arange(s_ - l_, s_, device=s.device)[:, None]
    kj = torch.arange(s_, device=s.device)[None, :]
    return F.softmax(s.masked_fill((kj > qi) | (kj <= qi - W), float("-inf")), dim=-1) @ v


CASES = {
    # name: (fn, shapes, (window_left, window_right), causal)
    "arange_bool_fill": (arange_bool_fill, {}, (W - 1, 0), True),
    "hf_additive": (hf_additive, {}, (W - 1, 0), True),
    "tril_triu": (tril_triu, {}, (W - 1, 0), True),
    "tril_minus_tril": (tril_minus_tril, {}, (W - 1, 0), True),
    "two_fills": (two_fills, {}, (W - 1, 0), True),
    "too_far_or_future": (too_far_or_future, {}, (W - 1, 0), True),
    "bidirectional": (bidirectional, {}, (2, 2), False),
    "looks_ahead": (looks_ahead, {}, (-1, 1), False),
    "anti_causal": (anti_causal, {}, (0, -1), False),
    "bottom_right": (bottom_right, {"l": 4, "s": 8}, (W - 1, 0), True),
}


def _flash_call(cap):
    (call,) = cap.flash_calls()
    assert not cap.attention_calls()
    return call


@TRAIN
@DTYPE
@pytest.mark.parametrize("name", list(CASES))
def test_window_becomes_window_size(name, dtype, train):
    fn, shapes, window, causal = CASES[name]
    cap = check(fn, qkv(dtype=dtype, **shapes), train=train)
    call = _flash_call(cap)
    assert (call["window_left"], call["window_right"]) == window
    assert call["causal"] is causal and call["alibi_slopes"] is None and call["softcap"] == 0.0


@TRAIN
def test_window_gqa(train):
    def fn(q, k, v):
        return arange_bool_fill(q, repeat_kv(k, 2), repeat_kv(v, 2))

    cap = check(fn, qkv(hk=2), train=train)
    call = _flash_call(cap)
    assert call["key"].meta["example_value"].shape[2] == 2  # [B, S, Hkv, E]: no copies


@TRAIN
def test_window_3d_scores(train):
    def fn(q, k, v):  # [B * H, L, E] operands and bmm
        q3, k3, v3 = (t.reshape(B * H, L, E) for t in (q, k, v))
        s = torch.bmm(q3, k3.transpose(1, 2)) * 0.25
        i, j = query_key_positions(s)
        s = s.masked_fill((j > i) | (j <= i - W), float("-inf"))
        return torch.bmm(F.softmax(s, dim=-1), v3).view(B, H, L, E)

    call = _flash_call(check(fn, qkv(), train=train))
    assert (call["window_left"], call["window_right"]) == (W - 1, 0)


@TRAIN
def test_sdpa_bool_window(train):
    def fn(q, k, v):
        i = torch.arange(L, device=q.device)[:, None]
        j = torch.arange(L, device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - W))

    call = _flash_call(check(fn, qkv(), train=train))
    assert (call["window_left"], call["window_right"]) == (W - 1, 0)
    assert call["softmax_scale"] == pytest.approx(E ** -0.5)


@TRAIN
def test_dynamic_lengths(train):
    call = _flash_call(check(arange_bool_fill, qkv(l=10), train=train, dynamic=True))
    assert (call["window_left"], call["window_right"]) == (W - 1, 0)


def test_dropout_is_passed():
    def fn(q, k, v):
        s = scores(q, k)
        i, j = query_key_positions(s)
        p = F.dropout(F.softmax(s.masked_fill((j > i) | (j <= i - W), float("-inf")), -1), 0.3)
        return p @ v

    call = _flash_call(check(fn, qkv(), train=True, compare=False))
    assert call["dropout_p"] == 0.3


# ---- left to flashv100.attention with the mask ------------------------------------------------

def _pad_keep():
    keep = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
    keep[1, -3:] = False  # right padding: every row keeps key 0
    return keep


def window_and_padding(q, k, v, keep):
    s = scores(q, k)
    i, j = query_key_positions(s)
    s = s.masked_fill((j > i) | (j <= i - W), torch.finfo(s.dtype).min)
    s = s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)
    return F.softmax(s, dim=-1) @ v


def window_and_padding_one_mask(q, k, v, keep):  # transformers' padded masks: one tensor
    s = scores(q, k)
    i, j = query_key_positions(s)
    m = ((j <= i) & (j > i - W))[None, None] & keep[:, None, None, :]
    return F.softmax(s + torch.where(m, 0.0, torch.finfo(s.dtype).min), dim=-1) @ v


def widening_window(q, k, v):  # keeps j >= (i - 1) // 2: the width varies with the row
    s = scores(q, k)
    i, j = query_key_positions(s)
    return F.softmax(s.masked_fill((j > i) | (2 * j < i - 1), float("-inf")), dim=-1) @ v


def per_row_widths(q, k, v, widths):  # the window of each row from a tensor
    s = scores(q, k)
    i, j = query_key_positions(s)
    return F.softmax(s.masked_fill((j > i) | (j <= i - widths[:, None]), float("-inf")),
                     dim=-1) @ v


def strictly_before(q, k, v):  # i - 3 <= j < i: row 0 sees no key
    s = scores(q, k)
    i, j = query_key_positions(s)
    return F.softmax(s.masked_fill((j >= i) | (j < i - 3), torch.finfo(s.dtype).min),
                     dim=-1) @ v


KEPT = {
    # name: (fn, args, why (logged when the window was seen but stays a mask), is_causal)
    "window_and_padding": (window_and_padding, lambda: (*qkv(), _pad_keep()),
                           "the window stays a mask: the mask also holds more than a band", True),
    "window_and_padding_one_mask": (window_and_padding_one_mask,
                                    lambda: (*qkv(), _pad_keep()), "", True),
    "widening_window": (widening_window, lambda: qkv(), "", True),
    "per_row_widths": (per_row_widths,
                       lambda: (*qkv(), torch.tensor([1, 2, 3, 1, 2, 3, 4, 8], device=DEVICE)),
                       "", True),
    "strictly_before": (strictly_before, lambda: qkv(), "query rows that see no key", True),
    "value_head_dim_differs": (arange_bool_fill, lambda: qkv(ev=8),
                               "the value head dim differs", True),
}


@TRAIN
@pytest.mark.parametrize("name", list(KEPT))
def test_window_stays_a_mask(name, train):
    fn, make, why, is_causal = KEPT[name]
    cap = check(fn, make(), train=train)
    (call,) = cap.attention_calls()
    assert not cap.flash_calls()
    assert call["attn_mask"] is not None and call["is_causal"] is is_causal
    (site,) = history
    assert why in site[2], site
