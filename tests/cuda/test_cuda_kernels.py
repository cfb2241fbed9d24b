"""Fused CUDA kernels (issue #3) on both tensor-core atoms vs the fp64 reference.

Every test runs twice: with the Volta mma.m8n8k4 atom forced (emulated on newer GPUs: correctness
only) and with the native atom of the GPU. Tolerance is FlashAttention-2 style: the error vs fp64
must stay within a small multiple of plain PyTorch math's error in the same dtype.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import torch_flash_v100 as tfv
from attention_testing import assert_fa2_close, make_qkv
from torch_flash_v100.reference import reference_attention

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.cuda]

ops = torch.ops.flashv100


@pytest.fixture(params=[True, False], ids=["volta", "native"])
def atom(request):
    with tfv.volta_atom(request.param):
        yield request.param


def fused(q, k, v, causal_mode=0, scale=None, dout=None, deterministic=False, grads=True):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse, rng = ops._attention_forward(q, k, v, None, 0.0, causal_mode, scale)
    if not grads:
        return out, lse
    dq, dk, dv, _ = ops._attention_backward(dout, q, k, v, None, out, lse, rng, 0.0, causal_mode,
                                            scale, False, deterministic)
    return out, lse, dq, dk, dv


def reference(q, k, v, dout, causal_mode, dtype):
    """(out, dq, dk, dv) of the math reference computed in `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out = reference_attention(*leaves, causal_mode=causal_mode, enable_gqa=True)
    out.backward(dout.to(dtype))
    return (out.detach(), *[t.grad for t in leaves])


def check(q, k, v, causal_mode=0, grads=True, seed=0):
    torch.manual_seed(seed)
    dout = torch.randn(q.shape, device=q.device, dtype=q.dtype)
    got = fused(q, k, v, causal_mode, dout=dout, grads=grads)
    ref64 = reference(q, k, v, dout, causal_mode, torch.float64)
    base = reference(q, k, v, dout, causal_mode, q.dtype)
    names = ["out", "dq", "dk", "dv"] if grads else ["out"]
    results = [got[0]] + (list(got[2:]) if grads else [])
    for name, actual, r64, b in zip(names, results, ref64, base):
        assert actual.shape == r64.shape and actual.dtype == q.dtype, name
        assert_fa2_close(actual, r64, b, name=name)
    return got


def qkv(b, hq, hkv, lq, lk, d, dtype=torch.float16, **kw):
    return make_qkv(b, hq, hkv, lq, lk, d, dtype, "cuda", **kw)


@pytest.mark.parametrize("head_dim", range(8, 257, 8))
def test_every_head_dim(atom, head_dim):
    check(*qkv(2, 2, 2, 67, 45, head_dim), causal_mode=1)


@pytest.mark.parametrize("len_q,len_kv", [
    (1, 1), (7, 7), (33, 33), (127, 127), (1000, 1000), (2049, 2049),
    (1, 2049), (2049, 1), (33, 127), (127, 33), (1000, 7), (7, 1000)])
@pytest.mark.parametrize("causal_mode", [0, 1, 2], ids=["full", "top_left", "bottom_right"])
def test_lengths_and_causal(atom, len_q, len_kv, causal_mode):
    check(*qkv(1, 2, 2, len_q, len_kv, 64), causal_mode=causal_mode)


@pytest.mark.parametrize("head_dim", [40, 128, 256])
def test_odd_lengths_other_head_dims(atom, head_dim):
    check(*qkv(1, 2, 2, 127, 1000, head_dim), causal_mode=2)
    check(*qkv(1, 2, 2, 1000, 127, head_dim), causal_mode=1)


@pytest.mark.parametrize("heads_kv", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("causal_mode", [0, 1])
def test_gqa(atom, heads_kv, causal_mode):
    check(*qkv(2, 8, heads_kv, 130, 97, 64), causal_mode=causal_mode)


# The launcher splits a GQA group over dK/dV blocks where the grid is short of SMs (fp32 parts,
# reduced in a fixed order), and keeps one block per group where it is not: both exact, and dK /
# dV bitwise the same from run to run either way.
@pytest.mark.parametrize("batch, heads_kv, length", [(1, 2, 300), (16, 8, 640)],
                         ids=["split_group", "whole_group"])
def test_gqa_backward_grids(atom, batch, heads_kv, length):
    q, k, v = qkv(batch, 4 * heads_kv, heads_kv, length, length, 64)
    _, _, _, dk, dv = check(q, k, v, causal_mode=1)
    torch.manual_seed(0)  # check()'s output gradient
    dout = torch.randn(q.shape, device=q.device, dtype=q.dtype)
    _, _, _, dk_again, dv_again = fused(q, k, v, 1, dout=dout)
    assert torch.equal(dk, dk_again) and torch.equal(dv, dv_again)


# Where one key tile holds every key and the grid is short of SMs, the launcher also deals each
# block's query tiles out to blocks (KvGroupSplit::row_parts; bottom-right causal: the first
# rows see no key): exact, and dK / dV bitwise the same from run to run.
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_one_key_tile_query_shares(atom, head_dim):
    q, k, v = qkv(1, 4, 2, 700, 50, head_dim)
    _, _, _, dk, dv = check(q, k, v, causal_mode=2)
    torch.manual_seed(0)  # check()'s output gradient
    dout = torch.randn(q.shape, device=q.device, dtype=q.dtype)
    _, _, _, dk_again, dv_again = fused(q, k, v, 2, dout=dout)
    assert torch.equal(dk, dk_again) and torch.equal(dv, dv_again)


# The prefill tile by grid size (uses_narrow_prefill_tile): on sm_80+, 64-row blocks where the
# 128-row tile would leave SMs idle, 128-row ones where its grid fills the GPU. Both exact.
@pytest.mark.parametrize("batch, heads", [(1, 2), (8, 40)], ids=["small_grid", "full_grid"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_prefill_tile_by_grid(atom, batch, heads, head_dim):
    check(*qkv(batch, heads, heads, 200, 200, head_dim), causal_mode=2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
                    reason="the narrow prefill tile is the native sm_80+ atom's")
def test_prefill_tile_choice_by_grid():
    """Which tile runs (FLASHV100_DEBUG's kernel log, read once per process: a child process)."""
    code = (
        "import torch, torch_flash_v100 as tfv\n"
        "for b, h in ((1, 2), (8, 40)):\n"
        "    q = torch.randn(b, h, 200, 64, device='cuda', dtype=torch.float16)\n"
        "    torch.ops.flashv100._attention_forward(q, q, q, None, 0.0, 0, 0.125)\n"
        "    torch.cuda.synchronize()\n"
        "    print('grid done', flush=True)\n")
    env = dict(os.environ, FLASHV100_DEBUG="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    tiles = [line.split("tile ")[1].split(",")[0] for line in res.stderr.splitlines()
             if "flash_fwd" in line and "tile " in line]
    assert tiles == ["64 x 64", "128 x 128"], res.stderr  # the wide plain tile: 128 keys at 64
    assert "flash_fwd (narrow)" in res.stderr


@pytest.mark.parametrize("head_dim", [64, 128])
def test_strided_blhe_layout(atom, head_dim):
    q, k, v = qkv(2, 4, 2, 77, 91, head_dim, layout="blhe")
    assert q.stride(1) == head_dim  # a [B, L, H, E] tensor seen as [B, H, L, E]
    out = check(q, k, v, causal_mode=1)[0]
    assert out.stride() == q.stride()  # empty_like(query) keeps the layout


def test_bf16_native_atom():
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        pytest.skip("bf16 tensor cores need sm_80+")
    with tfv.volta_atom(False):
        check(*qkv(2, 2, 1, 129, 70, 96, dtype=torch.bfloat16), causal_mode=1)


def test_large_magnitude_scores(atom):
    q, k, v = qkv(1, 2, 2, 200, 300, 64, magnitude=12.0)
    scores = (q.double() @ k.double().transpose(-2, -1)) / 8.0
    assert scores.abs().max() >= 100.0
    check(q, k, v, causal_mode=0)


def test_rows_without_visible_keys(atom):
    # Bottom-right alignment with L > S: the first L - S query rows see no key.
    q, k, v = qkv(1, 2, 2, 100, 40, 64)
    dout = torch.randn_like(q)
    out, lse, dq, dk, dv = fused(q, k, v, causal_mode=2, dout=dout)
    assert torch.equal(out[:, :, :60], torch.zeros_like(out[:, :, :60]))
    assert torch.isneginf(lse[:, :, :60]).all() and torch.isfinite(lse[:, :, 60:]).all()
    assert torch.equal(dq[:, :, :60], torch.zeros_like(dq[:, :, :60]))
    check(q, k, v, causal_mode=2)


def test_deterministic_backward_is_bitwise_reproducible(atom):
    q, k, v = qkv(2, 8, 2, 300, 333, 64)
    dout = torch.randn_like(q)
    first = fused(q, k, v, 1, dout=dout, deterministic=True)
    second = fused(q, k, v, 1, dout=dout, deterministic=True)
    for a, b in zip(first[2:], second[2:]):
        assert torch.equal(a, b)
    fast = fused(q, k, v, 1, dout=dout, deterministic=False)
    for a, b in zip(first[2:], fast[2:]):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-2)


def test_public_op_autograd(atom):
    q, k, v = qkv(2, 4, 4, 65, 65, 64, requires_grad=True)
    out = tfv.attention(q, k, v, is_causal=True)
    out.sum().backward()
    ref = reference_attention(*(t.detach().double().requires_grad_() for t in (q, k, v)),
                              is_causal=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=1e-2)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_long_sequence_32k(atom):
    q, k, v = qkv(1, 1, 1, 32768, 32768, 64)
    dout = torch.randn_like(q)
    out, lse, dq, dk, dv = fused(q, k, v, causal_mode=1, dout=dout)
    for t in (out, lse, dq, dk, dv):
        assert torch.isfinite(t).all()
    rows = slice(32768 - 128, 32768)  # the last rows see every key: check them against fp64
    ref = reference_attention(q[:, :, rows].double(), k.double(), v.double(), causal_mode=2)
    torch.testing.assert_close(out[:, :, rows].double(), ref, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("case", ["fp32", "head_dim_12", "value_dim_differs"])
def test_fallback_paths_are_correct(atom, case):
    if case == "fp32":
        q, k, v = qkv(1, 2, 2, 50, 70, 64, dtype=torch.float32)
    elif case == "head_dim_12":
        q, k, v = qkv(1, 2, 2, 50, 70, 12)
    else:
        q, k, v = qkv(1, 2, 2, 50, 70, 64, dim_v=32)
    out, lse, rng = ops._attention_forward(q, k, v, None, 0.0, 1, 0.125)
    ref = reference_attention(q.double(), k.double(), v.double(), causal_mode=1, scale=0.125)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=1e-2)


def test_bf16_on_volta_atom_falls_back():
    with tfv.volta_atom(True):
        q, k, v = qkv(1, 2, 2, 50, 70, 64, dtype=torch.bfloat16)
        out, _, _ = ops._attention_forward(q, k, v, None, 0.0, 0, 0.125)
    ref = reference_attention(q.double(), k.double(), v.double(), scale=0.125)
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("with_mask", [False, True], ids=["plain", "padding_mask"])
def test_second_device(atom, with_mask):
    """Tensors on cuda:1 while cuda:0 is current: every launch and workspace (dQ accumulator,
    D, mask key ranges) must follow the tensors, forward and backward."""
    q, k, v = make_qkv(1, 2, 2, 70, 70, 64, torch.float16, "cuda:1")
    dout = torch.randn_like(q)
    mask = (torch.arange(70, device="cuda:1") < 50).expand(1, 1, 1, 70) if with_mask else None
    with torch.cuda.device(0):
        out, lse, rng = ops._attention_forward(q, k, v, mask, 0.0, 1, 0.125)
        dq, dk, dv, _ = ops._attention_backward(dout, q, k, v, mask, out, lse, rng, 0.0, 1, 0.125,
                                                False, False)
    assert {t.device for t in (out, dq, dk, dv)} == {q.device}
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*leaves, attn_mask=mask, scale=0.125, is_causal=True)
    ref.backward(dout.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=1e-2)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got.double(), leaf.grad, atol=2e-2, rtol=1e-2)


def test_opcheck_cuda_ops(atom):
    q, k, v = qkv(1, 2, 1, 33, 47, 64, requires_grad=True)
    torch.library.opcheck(ops._attention_forward.default, (q, k, v, None, 0.0, 1, 0.125))
    out, lse, rng = ops._attention_forward(q, k, v, None, 0.0, 2, 0.125)
    dout = torch.randn_like(out)
    args = (dout, q.detach(), k.detach(), v.detach(), None, out.detach(), lse, rng, 0.0, 2, 0.125,
            False, True)
    torch.library.opcheck(ops._attention_backward.default, args)
