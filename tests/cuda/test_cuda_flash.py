"""The FlashAttention-2 internal ops (_flash_forward / _flash_backward) on CUDA vs the fp64
reference, on both tensor-core atoms: dense and packed (varlen) batches, bottom-right causal and
sliding windows, softcap, ALiBi, dropout (keep mask from _dropout_mask), GQA, deterministic dQ.

Every test runs with the Volta mma.m8n8k4 atom forced (emulated on newer GPUs: correctness only)
and with the GPU's native atom. Tolerance is FlashAttention-2 style: out, lse, dq, dk and dv at
every position within a small multiple of plain PyTorch math's error in the same dtype, both
measured against fp64.
"""
from __future__ import annotations

import math

import pytest
import torch

from attention_testing import assert_fa2_close

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.cuda]

ops = torch.ops.flashv100
CAUSAL = "causal"  # window spelling of causal=True in the parametrizations


def randn(*shape, dtype, magnitude=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * magnitude).to("cuda", dtype)


def causal_window(window):
    """(causal, window_left, window_right) of a parametrized window."""
    if window == CAUSAL:
        return True, -1, -1
    return False, window[0], window[1]


def run_flash(q, k, v, dout, *, cu_q=None, cu_k=None, max_q=None, max_k=None, dropout_p=0.0,
              scale=None, window=(-1, -1), softcap=0.0, alibi=None, deterministic=False):
    """out, lse, rng_state, dq, dk, dv of the two ops."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    causal, left, right = causal_window(window)
    if cu_q is None:
        max_q, max_k = q.shape[1], k.shape[1]
    out, lse, rng = ops._flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale,
                                       causal, left, right, softcap, alibi)
    dq, dk, dv = ops._flash_backward(dout, q, k, v, out, lse, rng, cu_q, cu_k, max_q, max_k,
                                     dropout_p, scale, causal, left, right, softcap, alibi,
                                     deterministic)
    return out, lse, rng, dq, dk, dv


def reference(q, k, v, dout, compute_dtype, *, scale=None, window=(-1, -1), softcap=0.0,
              alibi=None, dropout_p=0.0, keep=None):
    """out, lse, dq, dk, dv of the dense-batch reference in compute_dtype."""
    from torch_flash_v100.reference import flash_reference_attention

    causal, left, right = causal_window(window)
    leaves = [t.detach().to(compute_dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = flash_reference_attention(
        *leaves, causal=causal, softmax_scale=scale, window_size=(left, right), softcap=softcap,
        alibi_slopes=alibi, dropout_p=dropout_p, dropout_keep=keep, compute_dtype=compute_dtype)
    out.backward(dout.to(compute_dtype))
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def assert_lse_close(lse, lse64, lse_base):
    """-inf exactly where the reference has it (rows that see no key), FA2-close elsewhere."""
    assert lse.dtype == torch.float32
    hidden = torch.isneginf(lse64)
    assert torch.equal(torch.isneginf(lse), hidden), "lse: -inf rows differ from the reference"
    assert_fa2_close(lse[~hidden], lse64[~hidden], lse_base[~hidden], name="lse", atol=1e-3)


NAMES = ["out", "lse", "dq", "dk", "dv"]


def assert_all_close(got, ref64, base):
    for name, actual, r64, b in zip(NAMES, got, ref64, base):
        assert actual.shape == r64.shape, (name, actual.shape, r64.shape)
        if name == "lse":
            assert_lse_close(actual, r64, b)
        else:
            assert_fa2_close(actual, r64, b, name=name)


def check_dense(b, hq, hkv, sq, sk, d, dtype, *, magnitude=1.0, dropout_p=0.0, seed=0, **kw):
    q = randn(b, sq, hq, d, dtype=dtype, magnitude=magnitude, seed=seed)
    k = randn(b, sk, hkv, d, dtype=dtype, magnitude=magnitude, seed=seed + 1)
    v = randn(b, sk, hkv, d, dtype=dtype, seed=seed + 2)
    dout = randn(b, sq, hq, d, dtype=dtype, seed=seed + 3)
    out, lse, rng, dq, dk, dv = run_flash(q, k, v, dout, dropout_p=dropout_p, **kw)
    assert out.dtype == dtype and lse.shape == (b, hq, sq)
    keep = ops._dropout_mask(rng, b, hq, sq, sk, dropout_p) if dropout_p > 0 else None
    kw.pop("deterministic", None)
    ref = dict(kw, dropout_p=dropout_p, keep=keep)
    ref64 = reference(q, k, v, dout, torch.float64, **ref)
    base = reference(q, k, v, dout, dtype, **ref)
    assert_all_close([out, lse, dq, dk, dv], ref64, base)
    return out, lse, rng, dq, dk, dv


WINDOWS = [(-1, -1), CAUSAL, (32, 0), (64, 16), (-1, 7), (5, -1), (0, 0), (300, 300)]
WINDOW_IDS = ["full", "causal", "w32_0", "w64_16", "right7", "left5", "w0_0", "w300_300"]


@pytest.mark.parametrize("head_dim", [32, 40, 64, 72, 96, 128, 136, 160, 192, 256])
def test_head_dims(atom, dtype, head_dim):
    check_dense(2, 2, 1, 113, 203, head_dim, dtype, window=CAUSAL)
    check_dense(1, 2, 2, 203, 113, head_dim, dtype, window=(48, 8), softcap=5.0)


@pytest.mark.parametrize("window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("sq,sk", [(1, 1), (113, 203), (203, 113), (217, 256), (511, 511),
                                   (1, 1023), (1023, 17)])
def test_causal_and_window(atom, sq, sk, window):
    check_dense(1, 2, 2, sq, sk, 64, torch.float16, window=window)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("softcap", [0.0, 1.5, 30.0])
@pytest.mark.parametrize("alibi", [None, "heads", "batch_heads"])
@pytest.mark.parametrize("window", [(-1, -1), CAUSAL, (40, 3)], ids=["full", "causal", "w40_3"])
def test_softcap_and_alibi(atom, dtype, head_dim, softcap, alibi, window):
    b, hq = 2, 4
    slopes = None
    if alibi is not None:
        shape = (hq,) if alibi == "heads" else (b, hq)
        slopes = (torch.rand(shape, generator=torch.Generator().manual_seed(5)) * 0.5).cuda()
    check_dense(b, hq, 2, 97, 161, head_dim, dtype, magnitude=2.0, window=window,
                softcap=softcap, alibi=slopes)


@pytest.mark.parametrize("head_dim", [32, 72, 128, 256])
@pytest.mark.parametrize("window", [(-1, -1), CAUSAL, (24, 24)], ids=["full", "causal", "w24"])
def test_dropout_with_every_modifier(atom, dtype, head_dim, window):
    slopes = torch.linspace(0.05, 0.4, 4, device="cuda")
    check_dense(2, 4, 2, 131, 77, head_dim, dtype, dropout_p=0.17, window=window, softcap=4.0,
                alibi=slopes)
    check_dense(1, 2, 1, 77, 131, head_dim, dtype, dropout_p=0.17, window=window)


@pytest.mark.parametrize("hkv", [1, 2, 8], ids=["mqa", "gqa", "mha"])
def test_gqa_with_window(atom, hkv):
    check_dense(2, 8, hkv, 150, 150, 64, torch.float16, window=(33, 0), softcap=10.0)


def test_long_sequence_small_window(atom):
    """Key tiles outside the band are skipped (forward, dK/dV, dQ); the band's answers stay exact."""
    check_dense(1, 2, 2, 2048, 2048, 64, torch.float16, window=(64, 0))
    check_dense(1, 2, 2, 2048, 2048, 128, torch.float16, window=(96, 32), deterministic=True)


def test_rows_that_see_no_key(atom):
    """Bottom-right causal with Sq > Sk hides the first Sq - Sk rows: out 0, lse -inf, dq 0."""
    out, lse, _, dq, _, _ = check_dense(1, 2, 2, 200, 50, 64, torch.float16, window=CAUSAL)
    assert (out[:, :150] == 0).all() and torch.isneginf(lse[:, :, :150]).all()
    assert (dq[:, :150] == 0).all()


def test_deterministic_backward_is_bitwise_reproducible(atom):
    q = randn(2, 190, 4, 64, dtype=torch.float16)
    k = randn(2, 230, 2, 64, dtype=torch.float16, seed=1)
    v = randn(2, 230, 2, 64, dtype=torch.float16, seed=2)
    dout = randn(2, 190, 4, 64, dtype=torch.float16, seed=3)
    out, lse, rng, *grads = run_flash(q, k, v, dout, window=(50, 10), softcap=3.0, dropout_p=0.1,
                                      deterministic=True)
    again = ops._flash_backward(dout, q, k, v, out, lse, rng, None, None, 190, 230, 0.1, 0.125,
                                False, 50, 10, 3.0, None, True)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("smem_kb", [99, 163], ids=["sm86", "sm80"])
@pytest.mark.parametrize("softcap", [0.0, 4.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_backward_within_smaller_shared_memory(atom, dtype, head_dim, softcap, smem_kb):
    """Shared memory capped at sm_86/89's 99 KB or sm_80's 163 KB per block: the backward runs
    the configurations that fit there (configs.cuh: one query-side buffer, the compact tile
    instead of the wide one); its gradients are the reference's, and the deterministic
    backward's are bitwise those of the uncapped configuration (every sum in the same order)."""
    from torch_flash_v100 import _C

    kw = dict(window=CAUSAL, softcap=softcap)
    uncapped = check_dense(2, 4, 2, 203, 203, head_dim, dtype, deterministic=True, **kw)
    _C.set_smem_limit_override(smem_kb * 1024)
    try:
        check_dense(2, 4, 2, 203, 203, head_dim, dtype, dropout_p=0.1, **kw)
        capped = check_dense(2, 4, 2, 203, 203, head_dim, dtype, deterministic=True, **kw)
    finally:
        _C.set_smem_limit_override(0)
    for name, a, b in zip(["out", "lse", "rng", "dq", "dk", "dv"], uncapped, capped):
        assert torch.equal(a, b), name


# ---- packed (varlen) batches ----

def pack(lengths, heads, d, dtype, seed, magnitude=1.0):
    total = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32,
                      device="cuda")
    return randn(total, heads, d, dtype=dtype, magnitude=magnitude, seed=seed), cu


def check_varlen(lengths_q, lengths_k, hq, hkv, d, dtype, *, dropout_p=0.0, alibi=None,
                 deterministic=False, **kw):
    q, cu_q = pack(lengths_q, hq, d, dtype, 0, magnitude=1.5)
    k, cu_k = pack(lengths_k, hkv, d, dtype, 1, magnitude=1.5)
    v, _ = pack(lengths_k, hkv, d, dtype, 2)
    dout, _ = pack(lengths_q, hq, d, dtype, 3)
    max_q, max_k = max(lengths_q), max(lengths_k)
    out, lse, rng, dq, dk, dv = run_flash(q, k, v, dout, cu_q=cu_q, cu_k=cu_k, max_q=max_q,
                                          max_k=max_k, dropout_p=dropout_p, alibi=alibi,
                                          deterministic=deterministic, **kw)
    assert lse.shape == (hq, q.shape[0])
    batch = len(lengths_q)
    keep = ops._dropout_mask(rng, batch, hq, max_q, max_k, dropout_p) if dropout_p > 0 else None
    ref64 = [torch.zeros_like(t, dtype=torch.float64) for t in (out, lse, dq, dk, dv)]
    base = [torch.zeros_like(t, dtype=dtype) for t in (out, lse, dq, dk, dv)]
    for r in (ref64[1], base[1]):
        r.fill_(-math.inf)
    for bi in range(batch):
        q0, q1, k0, k1 = cu_q[bi].item(), cu_q[bi + 1].item(), cu_k[bi].item(), cu_k[bi + 1].item()
        if q1 == q0 or k1 == k0:
            continue  # no query, or rows that see no key: the zeros and -inf set above
        seq = dict(kw, dropout_p=dropout_p,
                   alibi=None if alibi is None else (alibi if alibi.dim() == 1 else alibi[bi:bi + 1]),
                   keep=None if keep is None else keep[bi:bi + 1, :, :q1 - q0, :k1 - k0])
        args = (q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], dout[q0:q1][None])
        for dst, ct in ((ref64, torch.float64), (base, dtype)):
            o, l, gq, gk, gv = reference(*args, ct, **seq)
            dst[0][q0:q1], dst[1][:, q0:q1], dst[2][q0:q1] = o[0], l[0], gq[0]
            dst[3][k0:k1], dst[4][k0:k1] = gk[0], gv[0]
    assert_all_close([out, lse, dq, dk, dv], ref64, base)
    return out, lse, rng, dq, dk, dv


LENGTHS = [  # (lengths_q, lengths_k): empty sequences, single rows, Sq > Sk and Sq < Sk
    ([0, 5, 1, 113, 64, 0], [7, 0, 1, 17, 203, 0]),
    ([256, 1, 190], [256, 33, 511]),
    ([1], [1]),
]


@pytest.mark.parametrize("lengths", LENGTHS, ids=["mixed", "long", "single"])
@pytest.mark.parametrize("window", [(-1, -1), CAUSAL, (20, 5)], ids=["full", "causal", "w20_5"])
@pytest.mark.parametrize("head_dim", [40, 64, 136])
def test_varlen(atom, dtype, lengths, window, head_dim):
    check_varlen(*lengths, 4, 2, head_dim, dtype, window=window)


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_with_every_feature(atom, dtype, deterministic):
    """window + ALiBi ([B, H]) + softcap + dropout + GQA in one packed batch."""
    lengths_q, lengths_k = [0, 37, 1, 150, 90], [12, 80, 0, 150, 45]
    slopes = torch.rand(len(lengths_q), 4, generator=torch.Generator().manual_seed(3)).cuda()
    check_varlen(lengths_q, lengths_k, 4, 1, 64, dtype, window=(30, 2), softcap=2.5,
                 alibi=slopes * 0.3, dropout_p=0.2, deterministic=deterministic)


def test_varlen_deterministic_bitwise(atom):
    lengths = [45, 0, 300, 7]
    q, cu = pack(lengths, 4, 64, torch.float16, 0)
    k, _ = pack(lengths, 2, 64, torch.float16, 1)
    v, _ = pack(lengths, 2, 64, torch.float16, 2)
    dout, _ = pack(lengths, 4, 64, torch.float16, 3)
    runs = [run_flash(q, k, v, dout, cu_q=cu, cu_k=cu, max_q=300, max_k=300, window=CAUSAL,
                      deterministic=True) for _ in range(2)]
    for a, b in zip(runs[0][3:], runs[1][3:]):
        assert torch.equal(a, b)


def test_unsupported_problems_raise(atom):
    q = randn(1, 16, 2, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="fp16|dtype|cannot run"):
        ops._flash_forward(q, q, q, None, None, 16, 16, 0.0, 0.125, False, -1, -1, 0.0, None)
    q = randn(1, 16, 2, 12, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="head dim"):
        ops._flash_forward(q, q, q, None, None, 16, 16, 0.0, 0.125, False, -1, -1, 0.0, None)
