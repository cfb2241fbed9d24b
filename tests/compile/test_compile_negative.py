"""Never rewrite when the result would differ: nothing rewritten, results unchanged, reason logged."""

import logging

import pytest
import torch
import torch.nn.functional as F

from compile_testing import DEVICE, check_not_rewritten, qkv

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])


def returns_weights(q, k, v):
    p = F.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-1)
    return p @ v, p


def weights_used_twice(q, k, v):
    p = F.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-1)
    return (p @ v) + p.sum()


def softmax_other_dim(q, k, v):
    return F.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-2) @ v


def softmax_dim1_3d(q, k, v):
    s = torch.bmm(q[0], k[0].transpose(1, 2))
    return torch.bmm(F.softmax(s, dim=1), v[0])


def mask_enlarges_scores(q, k, v, m):  # q is [H, L, E], mask [B, H, L, S]: broadcasts UP
    s = torch.matmul(q[0], k[0].transpose(-2, -1)) * 0.25 + m
    return F.softmax(s, dim=-1) @ v[0]


def non_scalar_multiplier(q, k, v, w):
    s = torch.matmul(q, k.transpose(-2, -1)) * w  # per-position weights, not a scale
    return F.softmax(s, dim=-1) @ v


def fill_with_zero(q, k, v, keep):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    s = s.masked_fill(~keep, 0.0)  # sets scores to 0: not a mask
    return F.softmax(s, dim=-1) @ v


def softcap_of_masked(q, k, v, m):  # a mask inside the tanh: see test_compile_softcap.py
    s = torch.tanh((torch.matmul(q, k.transpose(-2, -1)) + m) / 30.0) * 30.0
    return F.softmax(s, dim=-1) @ v


def probs_transposed(q, k, v):
    p = F.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-1)
    return p.transpose(-2, -1) @ v


def not_attention(x, w, v):  # softmax of something that is not a product
    return F.softmax(x + w, dim=-1) @ v.transpose(-1, -2)


def head_mask(q, k, v, hm):  # probabilities re-weighted per head (HF head_mask)
    p = F.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-1) * hm
    return p @ v


CASES = {
    "returns_weights": (returns_weights, lambda: qkv(), "used elsewhere"),
    "weights_used_twice": (weights_used_twice, lambda: qkv(), "used elsewhere"),
    "softmax_other_dim": (softmax_other_dim, lambda: qkv(), "not the last dim"),
    "softmax_dim1_3d": (softmax_dim1_3d, lambda: qkv(), "not the last dim"),
    "mask_enlarges_scores": (mask_enlarges_scores,
                             lambda: (*qkv(), torch.randn(2, 4, 8, 8, device=DEVICE)),
                             "broadcasts the scores"),
    "non_scalar_multiplier": (non_scalar_multiplier,
                              lambda: (*qkv(), torch.rand(8, 8, device=DEVICE)),
                              "non-scalar"),
    "fill_with_zero": (fill_with_zero,
                       lambda: (*qkv(), torch.rand(8, 8, device=DEVICE) > 0.3),
                       "large negative"),
    "softcap_of_masked": (softcap_of_masked,
                          lambda: (*qkv(), torch.randn(8, 8, device=DEVICE)),
                          "a mask applied before the tanh"),
    "probs_transposed": (probs_transposed, lambda: qkv(), "not (casts, dropout, matmul"),
    "not_attention": (not_attention, lambda: qkv(), "q @ k^T product"),
    "head_mask": (head_mask, lambda: (*qkv(), torch.rand(1, 4, 1, 1, device=DEVICE)),
                  "probabilities feed mul"),
}


@TRAIN
@pytest.mark.parametrize("name", list(CASES))
def test_not_rewritten(name, train):
    fn, make, reason = CASES[name]
    check_not_rewritten(fn, make(), reason=reason, train=train)


@pytest.mark.skipif(DEVICE != "cpu", reason="device gating on CPU")
def test_cpu_not_targeted_without_force():
    def fn(q, k, v):
        return F.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-1) @ v

    check_not_rewritten(fn, qkv(), reason="not targeted", force=False)
    check_not_rewritten(F.scaled_dot_product_attention, qkv(), reason="not targeted",
                        force=False)


def test_reasons_are_logged(caplog):
    caplog.set_level(logging.INFO, logger="torch_flash_v100.compile")
    check_not_rewritten(returns_weights, qkv(), reason="used elsewhere")
    msgs = [r.getMessage() for r in caplog.records if r.name == "torch_flash_v100.compile"]
    assert any("NOT rewritten" in m and "used elsewhere" in m for m in msgs), msgs
    assert any("test_compile_negative.py" in m for m in msgs), msgs  # user code location


def k_mutated_inside(q, k, v):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    k.mul_(2.0)  # k changes between q @ k^T and p @ v: the fused op would read the new k
    return F.softmax(s, dim=-1) @ v, k


def test_mutation_inside_attention_not_rewritten():
    check_not_rewritten(k_mutated_inside, qkv(), reason="mutated in place")


def test_inplace_mask_building_still_causal():
    from compile_testing import check

    def fn(q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
        m = torch.full((8, 8), float("-inf"), device=s.device).triu_(1)
        return F.softmax(s + m, dim=-1) @ v

    cap = check(fn, qkv(), train=False)
    (call,) = cap.attention_calls()
    assert call["is_causal"] is True and call["attn_mask"] is None


def test_mutated_mask_not_proven_causal():
    from compile_testing import check

    def fn(q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
        keep = torch.ones(8, 8, dtype=torch.bool, device=s.device).tril()
        keep[3, 5] = True  # no longer lower triangular
        return F.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v

    cap = check(fn, qkv(), train=False)
    (call,) = cap.attention_calls()
    assert call["is_causal"] is False and call["attn_mask"] is not None


def test_weak_mask_scaled_down_is_not_causal():
    # (scores + m) * 1e-3 with m = -1e4 above the diagonal: eager's masked weights are exp(-10),
    # not zero, so the mask must not become is_causal
    from compile_testing import check

    def fn(q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1))
        m = torch.triu(torch.full((8, 8), -1e4, device=s.device), diagonal=1)
        return F.softmax((s + m) * 1e-3, dim=-1) @ v

    cap = check(fn, qkv(), train=False)
    (call,) = cap.attention_calls()
    assert call["is_causal"] is False and call["attn_mask"] is not None


def test_fill_scaled_down_not_rewritten():
    def fn(q, k, v, keep):
        s = torch.matmul(q, k.transpose(-2, -1)).masked_fill(~keep, -1e4)
        return F.softmax(s * 1e-3, dim=-1) @ v

    check_not_rewritten(fn, (*qkv(), torch.rand(8, 8, device=DEVICE) > 0.3),
                        reason="no longer masks")
