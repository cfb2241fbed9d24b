"""Calls to F.scaled_dot_product_attention are rewritten too (mask analysed, repeat_kv dropped)."""

import pytest
import torch
import torch.nn.functional as F

from compile_testing import DEVICE, check, qkv
from test_compile_gqa import repeat_kv

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])


def sdpa_plain(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_causal_scale(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)


def sdpa_mask(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def sdpa_tril_mask(q, k, v):
    L, S = q.size(-2), k.size(-2)
    m = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def sdpa_repeat_kv(q, k, v):
    n = q.size(1) // k.size(1)
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), is_causal=True)


def sdpa_enable_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@TRAIN
@pytest.mark.parametrize("fn", [sdpa_plain, sdpa_causal_scale], ids=lambda f: f.__name__)
def test_sdpa(fn, train):
    check(fn, qkv(), train=train)


@TRAIN
def test_sdpa_mask(train):
    check(sdpa_mask, (*qkv(), torch.randn(2, 1, 8, 8, device=DEVICE)), train=train)


@TRAIN
def test_sdpa_tril_mask_becomes_causal(train):
    cap = check(sdpa_tril_mask, qkv(), train=train)
    (call,) = cap.attention_calls()
    assert call["is_causal"] is True and call["attn_mask"] is None


@TRAIN
@pytest.mark.parametrize("fn", [sdpa_repeat_kv, sdpa_enable_gqa], ids=lambda f: f.__name__)
def test_sdpa_gqa(fn, train):
    cap = check(fn, qkv(h=4, hk=2), train=train)
    assert cap.attention_calls()[0]["enable_gqa"] is True
