"""q @ k^T in every spelling, scale in every place: all rewritten, numerics unchanged."""

import math

import pytest
import torch
import torch.nn.functional as F

from compile_testing import check, qkv

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])


def _sm_v(s, v):
    return F.softmax(s, dim=-1) @ v


def matmul_div(q, k, v):
    return _sm_v(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1)), v)


def at_mul(q, k, v):
    return _sm_v((q @ k.transpose(2, 3)) * 0.125, v)


def method_matmul_swapaxes(q, k, v):
    return torch.softmax(q.matmul(k.swapaxes(-1, -2)).mul(0.3), -1).matmul(v)


def permute_k(q, k, v):
    return _sm_v(torch.matmul(q, k.permute(0, 1, 3, 2)) * 0.25, v)


def scale_on_q(q, k, v):
    return _sm_v(torch.matmul(q * (q.size(-1) ** -0.5), k.transpose(-1, -2)), v)


def scale_on_q_and_k(q, k, v):
    s = q.size(-1) ** -0.25
    return _sm_v(torch.matmul(q * s, k.transpose(-1, -2) * s), v)


def scale_on_k_inside_transpose(q, k, v):
    return _sm_v(torch.matmul(q, (k / 4.0).transpose(-1, -2)), v)


def no_scale(q, k, v):
    return _sm_v(torch.matmul(q, k.transpose(-1, -2)), v)


def tensor_scale(q, k, v, t):
    return _sm_v(torch.matmul(q, k.transpose(-1, -2)) * t, v)


def einsum_bhld(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    return torch.einsum("bhqk,bhkd->bhqd", F.softmax(s, dim=-1), v)


def einsum_blhd(q, k, v):  # [B, S, H, D] inputs, output back in [B, L, H, D]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4
    return torch.einsum("bhqk,bkhd->bqhd", F.softmax(s, dim=-1), v)


def permuted_blhd(q, k, v):  # HF style [B, S, H, D] -> [B, H, S, D]
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    out = _sm_v(torch.matmul(q, k.permute(0, 1, 3, 2)) * 0.25, v)
    return out.transpose(1, 2).reshape(out.size(0), out.size(2), -1)


def bmm_3d(q, k, v):
    b, h, l, e = q.shape
    q3, k3, v3 = (t.reshape(b * h, -1, e) for t in (q, k, v))
    s = torch.bmm(q3, k3.transpose(1, 2)) * 0.25
    return torch.bmm(F.softmax(s, dim=-1), v3).view(b, h, l, e)


CASES = {
    "matmul_div": matmul_div,
    "at_mul": at_mul,
    "method_matmul_swapaxes": method_matmul_swapaxes,
    "permute_k": permute_k,
    "scale_on_q": scale_on_q,
    "scale_on_q_and_k": scale_on_q_and_k,
    "scale_on_k_inside_transpose": scale_on_k_inside_transpose,
    "no_scale": no_scale,
    "einsum_bhld": einsum_bhld,
    "bmm_3d": bmm_3d,
}


@TRAIN
@pytest.mark.parametrize("name", list(CASES))
def test_spelling(name, train):
    cap = check(CASES[name], qkv(), train=train)
    (call,) = cap.attention_calls()
    assert call["attn_mask"] is None and call["is_causal"] is False


@TRAIN
@pytest.mark.parametrize("fn", [einsum_blhd, permuted_blhd], ids=["einsum", "permute"])
def test_blhd_inputs(fn, train):
    check(fn, qkv(layout="blhd"), train=train)


@TRAIN
def test_scale_value_folded(train):
    cap = check(scale_on_q_and_k, qkv(e=16), train=train)
    assert cap.attention_calls()[0]["scale"] == pytest.approx(0.25)
    cap = check(no_scale, qkv(), train=train)
    assert cap.attention_calls()[0]["scale"] == 1.0


@TRAIN
def test_tensor_scale_goes_onto_q(train):
    q, k, v = qkv()
    check(tensor_scale, (q, k, v, torch.tensor(0.3)), train=train)


@TRAIN
def test_cross_attention_shapes(train):
    # L != S, value head dim != query head dim
    check(matmul_div, qkv(l=5, s=11, e=16, ev=8), train=train)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_dynamic_shapes(train):
    check(matmul_div, qkv(l=6, s=10), train=train, dynamic=True)
