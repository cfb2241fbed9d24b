"""Fully masked query rows: what eager gives, what the fused graph gives.

* finite large negative values (``finfo.min``, added or filled): eager's softmax sees equal
  scores and averages v over all keys; the fused graph gives exactly that, with eager's
  gradients (through the scores when the values were added, none to q/k when they replaced the
  scores), with and without causal tile skipping, in fp32 and fp16;
* ``-inf`` fills and bool masks: eager gives NaN; the fused op gives 0 (SDPA's convention) and
  zero gradients.
"""

import pytest
import torch
import torch.nn.functional as F

from compile_testing import DEVICE, check, no_grad_input, qkv

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
B, H, L, E = 2, 4, 8, 16


def _left_padding(pad=(3, 8)):
    keep = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
    for b, p in enumerate(pad):
        keep[b, :p] = False  # batch 1: every key padded, every row fully masked
    return keep


def causal_additive(q, k, v, keep):  # HF masking_utils: where(causal & padding, 0, finfo.min)
    i = torch.arange(L, device=q.device)[:, None]
    j = torch.arange(L, device=q.device)[None, :]
    m = torch.where((j <= i) & keep[:, None, None, :], 0.0, torch.finfo(q.dtype).min).to(q.dtype)
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25 + m
    return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def padding_additive(q, k, v, m):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25 + m
    return F.softmax(s, dim=-1) @ v


def causal_filled(q, k, v, keep):  # replaced, not added: no gradient to q/k in masked rows
    i = torch.arange(L, device=q.device)[:, None]
    j = torch.arange(L, device=q.device)[None, :]
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    s = s.masked_fill(~((j <= i) & keep[:, None, None, :]), torch.finfo(s.dtype).min)
    return F.softmax(s, dim=-1) @ v


def padding_filled_inf(q, k, v, keep):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    return F.softmax(s.masked_fill(~keep[:, None, None, :], float("-inf")), dim=-1) @ v


@TRAIN
@pytest.mark.parametrize("fn", [causal_additive, causal_filled], ids=["added", "filled"])
def test_causal_fully_masked_rows_average_all_keys(fn, train):
    cap = check(fn, (*qkv(), _left_padding()), train=train)
    (call,) = cap.attention_calls()
    assert call["is_causal"] and call["attn_mask"] is not None  # the fast path is kept


@TRAIN
@pytest.mark.parametrize("hk", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_grouped_heads(hk, train):
    def gqa(q, k, v, keep):
        k = k.repeat_interleave(H // hk, dim=1)
        v = v.repeat_interleave(H // hk, dim=1)
        return causal_additive(q, k, v, keep)

    cap = check(gqa, (*qkv(hk=hk), _left_padding()), train=train)
    assert cap.attention_calls()[0]["enable_gqa"] == (hk != H)


@TRAIN
def test_fp16_mask_saturates_as_eager(train):
    # eager adds the fp16 finfo.min mask in fp16, which absorbs the scores: a uniform row; the
    # op's fp32 math alone would not
    keep = _left_padding()
    m = torch.zeros(B, 1, 1, L, dtype=torch.float16, device=DEVICE)
    m = no_grad_input(m.masked_fill(~keep[:, None, None, :], torch.finfo(torch.float16).min))
    check(padding_additive, (*qkv(dtype=torch.float16), m), train=train, atol=2e-3, rtol=2e-3)


def test_inf_fill_rows_eager_nan_fused_zero():
    keep = _left_padding()
    q, k, v = qkv()
    eager = padding_filled_inf(q, k, v, keep)
    assert torch.isnan(eager[1]).all()  # eager: NaN where every key is -inf
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    fused = torch.compile(padding_filled_inf, backend=__import__("torch_flash_v100").backend(
        force=True, compiler="aot_eager"), fullgraph=True)(q_, k_, v_, keep)
    assert (fused[1] == 0).all()  # the op: zeros (SDPA's convention)
    torch.testing.assert_close(fused[0], eager[0])
    fused.sum().backward()
    assert torch.isfinite(q_.grad).all() and (q_.grad[1] == 0).all() and (v_.grad[1] == 0).all()
