"""tanh soft-capping of the scores (Gemma 2): ``cap * tanh(scores / cap)`` with positive constant
factors around the tanh becomes the FlashAttention-2 op's softcap, which caps the scaled
q @ k^T before masking; any other order (a mask or a shift inside the tanh, a tensor factor after
it) is left alone."""

import pytest
import torch
import torch.nn.functional as F

from compile_testing import DEVICE, check, check_not_rewritten, qkv
from test_compile_gqa import repeat_kv

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
DTYPE = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
B, H, L, E = 2, 4, 8, 16
CAP = 5.0  # small against the scores of random inputs: the cap changes them a lot


def _scores(q, k):
    return torch.matmul(q, k.transpose(-2, -1)) * 0.25


def _causal(s):
    i = torch.arange(s.size(-2), device=s.device)[:, None]
    j = torch.arange(s.size(-1), device=s.device)[None, :]
    return j > i


def gemma2(q, k, v):  # transformers' Gemma 2: divide, tanh, multiply, add the mask, fp32 softmax
    s = _scores(q, k)
    s = s / CAP
    s = torch.tanh(s)
    s = s * CAP
    m = torch.zeros(L, L, device=s.device, dtype=s.dtype).masked_fill(
        _causal(s), torch.finfo(s.dtype).min)
    return torch.matmul(F.softmax(s + m, dim=-1, dtype=torch.float32).to(q.dtype), v)


def method_tanh(q, k, v):
    s = CAP * (_scores(q, k) * (1 / CAP)).tanh()
    return F.softmax(s.masked_fill(_causal(s), float("-inf")), dim=-1) @ v


def functional_tanh_no_mask(q, k, v):
    s = F.tanh(torch.matmul(q * 0.25, k.transpose(-2, -1)) / CAP) * CAP
    return F.softmax(s, dim=-1) @ v


def scaled_after(q, k, v):  # 2 * tanh(s / cap) * cap: softcap 2 * cap on scores scaled by 2
    s = torch.tanh(_scores(q, k) / CAP) * CAP * 2.0
    return F.softmax(s.masked_fill(_causal(s), float("-inf")), dim=-1) @ v


def with_window(q, k, v):  # Gemma 2's sliding layers
    s = torch.tanh(_scores(q, k) / CAP) * CAP
    i = torch.arange(L, device=s.device)[:, None]
    j = torch.arange(L, device=s.device)[None, :]
    keep = (j <= i) & (j > i - 3)
    return F.softmax(s.masked_fill(~keep, torch.finfo(s.dtype).min), dim=-1) @ v


def zero_shift_inside(q, k, v):  # + 0 changes nothing
    s = torch.tanh((_scores(q, k) + 0) / CAP) * CAP
    return F.softmax(s, dim=-1) @ v


CASES = {
    # name: (fn, softcap, softmax scale, window)
    "gemma2": (gemma2, CAP, 0.25, (-1, 0)),
    "method_tanh": (method_tanh, CAP, 0.25, (-1, 0)),
    "functional_tanh_no_mask": (functional_tanh_no_mask, CAP, 0.25, (-1, -1)),
    "scaled_after": (scaled_after, 2 * CAP, 0.5, (-1, 0)),
    "zero_shift_inside": (zero_shift_inside, CAP, 0.25, (-1, -1)),
    "with_window": (with_window, CAP, 0.25, (2, 0)),
}


@TRAIN
@DTYPE
@pytest.mark.parametrize("name", list(CASES))
def test_softcap_becomes_softcap(name, dtype, train):
    fn, softcap, scale, window = CASES[name]
    cap = check(fn, qkv(dtype=dtype), train=train)
    (call,) = cap.flash_calls()
    assert call["softcap"] == pytest.approx(softcap)
    assert call["softmax_scale"] == pytest.approx(scale)
    assert (call["window_left"], call["window_right"]) == window


@TRAIN
def test_softcap_gqa(train):
    def fn(q, k, v):
        return gemma2(q, repeat_kv(k, 2), repeat_kv(v, 2))

    (call,) = check(fn, qkv(hk=2), train=train).flash_calls()
    assert call["key"].meta["example_value"].shape[2] == 2


def mask_inside(q, k, v):  # the mask before the tanh: masked scores become -cap, not -inf
    s = _scores(q, k).masked_fill(_causal(_scores(q, k)), -1e9)
    return F.softmax(torch.tanh(s / CAP) * CAP, dim=-1) @ v


def shift_inside(q, k, v):  # tanh(s + 1): no longer the op's cap of the scaled scores
    s = torch.tanh(_scores(q, k) + 1.0) * CAP
    return F.softmax(s, dim=-1) @ v


def tensor_factor_after(q, k, v, c):
    s = torch.tanh(_scores(q, k) / CAP) * c
    return F.softmax(s, dim=-1) @ v


def negative_factor_after(q, k, v):
    s = torch.tanh(_scores(q, k) / CAP) * -CAP
    return F.softmax(s, dim=-1) @ v


def tanh_twice(q, k, v):
    s = torch.tanh(torch.tanh(_scores(q, k) / CAP)) * CAP
    return F.softmax(s, dim=-1) @ v


def with_padding(q, k, v, keep):  # the op has no mask input: soft-capping with padding stays
    s = torch.tanh(_scores(q, k) / CAP) * CAP
    return F.softmax(s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min), -1) @ v


def _pad_keep():
    keep = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
    keep[1, -3:] = False
    return keep


NOT_FUSED = {
    "mask_inside": (mask_inside, lambda: qkv(), "a mask applied before the tanh"),
    "shift_inside": (shift_inside, lambda: qkv(), "a constant added to the scores before"),
    "tensor_factor_after": (tensor_factor_after,
                            lambda: (*qkv(), torch.tensor(CAP, device=DEVICE)),
                            "a tensor factor applied after the tanh"),
    "negative_factor_after": (negative_factor_after, lambda: qkv(),
                              "a non-positive factor after the tanh"),
    "tanh_twice": (tanh_twice, lambda: qkv(), "tanh applied twice"),
    "with_padding": (with_padding, lambda: (*qkv(), _pad_keep()),
                     "tanh soft-capping needs the FlashAttention-2 op, which cannot take this "
                     "site: the mask also holds more than a band of diagonals"),
    "value_head_dim_differs": (gemma2, lambda: qkv(ev=8), "the value head dim differs"),
}


@TRAIN
@pytest.mark.parametrize("name", list(NOT_FUSED))
def test_softcap_left_alone(name, train):
    fn, make, reason = NOT_FUSED[name]
    check_not_rewritten(fn, make(), reason=reason, train=train)
