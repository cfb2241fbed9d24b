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


_U32 = 0xFFFFFFFF


def _philox4x32_7(counter, key):
    """Philox4x32 with 7 rounds (Salmon et al.), written from the paper, not from our header."""
    x, y, z, w = counter
    k0, k1 = key
    for _ in range(7):
        p0, p1 = 0xD2511F53 * x, 0xCD9E8D57 * z
        x, y, z, w = (p1 >> 32) ^ y ^ k0, p1 & _U32, (p0 >> 32) ^ w ^ k1, p0 & _U32
        k0, k1 = (k0 + 0x9E3779B9) & _U32, (k1 + 0xBB67AE85) & _U32
    return x, y, z, w


def _documented_keep(seed, offset, batch_head, row, col, p):
    """The keep decision common/philox.h documents: one call per row, 32-column block and
    (col / 2) % 4; the 16-bit half (col % 2) of word (col / 8) % 4; keep iff
    >= min(round(p * 2^16), 2^16 - 1) with p as the kernels' float32."""
    group = ((col >> 5) << 2) | ((col >> 1) & 3)
    words = _philox4x32_7((group, row, batch_head, offset & _U32),
                          (seed & _U32, (seed >> 32) ^ (offset >> 32)))
    uniform16 = (words[(col >> 3) & 3] >> (16 * (col & 1))) & 0xFFFF
    p32 = float(torch.tensor(p, dtype=torch.float32))
    return uniform16 >= min(int(p32 * 65536.0 + 0.5), 0xFFFF)


def test_mask_matches_documented_philox_stream(device):
    seed, offset, p = 0x1234_5678_9ABC_DEF0, (5 << 32) | 77, 0.3
    B, H, L, S = 2, 2, 3, 70  # columns past two 32-column blocks, a partial third
    rng_state = torch.tensor([seed, offset], dtype=torch.int64, device=device)
    keep = ops._dropout_mask(rng_state, B, H, L, S, p).cpu()
    expected = torch.tensor([[[[_documented_keep(seed, offset, b * H + h, i, j, p)
                                for j in range(S)] for i in range(L)] for h in range(H)]
                             for b in range(B)])
    assert torch.equal(keep, expected)


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
