"""Softmax in the input dtype or upcast to fp32 and cast back; dropout (functional and module,
training and eval)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from compile_testing import DEVICE, check, qkv

TRAIN = pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])


def upcast_dtype_kwarg(q, k, v):  # HF Llama
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def upcast_float_type_as(q, k, v):  # HF T5
    s = torch.matmul(q, k.transpose(3, 2))
    return torch.matmul(F.softmax(s.float(), dim=-1).type_as(s), v)


def upcast_then_dropout(q, k, v):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    p = nn.functional.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(p, p=0.0, training=True), v)


@TRAIN
@pytest.mark.parametrize("fn", [upcast_dtype_kwarg, upcast_float_type_as, upcast_then_dropout],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_casts(fn, dtype, train):
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    check(fn, qkv(dtype=dtype), train=train, atol=tol, rtol=tol)


class Attn(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
        return self.drop(s.softmax(dim=-1)) @ v


def functional_dropout(q, k, v):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    return F.dropout(F.softmax(s, -1), p=0.25, training=True) @ v


@TRAIN
def test_module_dropout_eval_is_exact(train):
    m = Attn(0.3).eval()
    cap = check(m, qkv(), train=train)
    assert cap.attention_calls()[0]["dropout_p"] == 0.0


@pytest.mark.parametrize("fn,p", [(functional_dropout, 0.25), (Attn(0.5).train(), 0.5)],
                         ids=["functional", "module"])
def test_dropout_training_statistics(fn, p):
    # Eager and the op draw different random numbers: compare statistics, not values.
    q, k, _ = qkv(b=2, h=2, l=64, s=64, e=16)
    v = torch.ones(2, 2, 64, 16, device=DEVICE)
    cap = check(fn, (q, k, v), train=True, compare=False)
    assert cap.attention_calls()[0]["dropout_p"] == p
    out = torch.compile(fn, backend=cap.backend())(q, k, v)
    # with v = 1 every output is (sum of kept probabilities) / (1 - p): mean 1
    assert out.shape == (2, 2, 64, 16)
    assert abs(out.mean().item() - 1.0) < 0.1
    assert out.std().item() > 0.01  # dropout really happened
    # gradients exist and are finite
    q2 = q.clone().requires_grad_()
    torch.compile(fn, backend=cap.backend())(q2, k, v).sum().backward()
    assert torch.isfinite(q2.grad).all()
