"""Dropout: seeding, keep-rate statistics, and a backward that uses the forward's mask."""

import math

import pytest
import torch

import torch_flash_v100 as flash
from attention_testing import make_qkv, reference_fp64

ops = torch.ops.flashv100


def test_same_seed_same_result(device):
    q, k, v = make_qkv(2, 2, 2, 33, 40, 16, torch.float32, device)
    torch.manual_seed(7)
    a = flash.attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    b = flash.attention(q, k, v, dropout_p=0.3)
    c = flash.attention(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p, device):
    q, k, v = make_qkv(1, 1, 1, 2, 2, 8, torch.float32, device)
    _, _, rng_state = ops._attention_forward(q, k, v, None, p, 0, 1.0)
    keep = ops._dropout_mask(rng_state, 4, 8, 128, 257, p)
    n = keep.numel()
    rate = keep.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 6 * sigma, (rate, 1 - p, sigma)
    # Columns that share a Philox call must not be correlated: compare neighbours.
    both = (keep[..., :-1] & keep[..., 1:]).double().mean().item()
    assert abs(both - (1 - p) ** 2) < 0.01


def test_zero_dropout_keeps_everything(device):
    rng_state = torch.tensor([3, 0], dtype=torch.int64, device=device)
    assert ops._dropout_mask(rng_state, 1, 2, 3, 5, 0.0).all()


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_forward_and_backward_use_one_mask(is_causal, gqa, device):
    p, scale = 0.25, 0.3
    heads_kv = 1 if gqa else 2
    q, k, v = make_qkv(2, 2, heads_kv, 17, 23, 16, torch.float64, device, requires_grad=True)
    bias = torch.randn(2, 1, 17, 23, dtype=torch.float64, device=device, requires_grad=True)
    causal_mode = 1 if is_causal else 0
    out, _, rng_state = ops._attention_forward(q, k, v, bias, p, causal_mode, scale)
    keep = ops._dropout_mask(rng_state, 2, 2, 17, 23, p)
    ref = reference_fp64(q, k, v, bias, dropout_p=p, is_causal=is_causal, scale=scale,
                         enable_gqa=gqa, dropout_keep=keep)
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    expected = torch.autograd.grad(ref, (q, k, v, bias), grad_out)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b)


def test_dropout_gradcheck_with_fixed_seed(device):
    q, k, v = make_qkv(1, 2, 2, 6, 7, 8, torch.float64, device, requires_grad=True)

    def fn(q, k, v):
        torch.manual_seed(11)
        if device == "cuda":
            torch.cuda.manual_seed(11)
        return flash.attention(q, k, v, dropout_p=0.4)

    assert torch.autograd.gradcheck(fn, (q, k, v))
