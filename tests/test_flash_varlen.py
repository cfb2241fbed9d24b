"""The FlashAttention-2 varlen functions on packed batches against the per-sequence fp64
reference: forward (out, softmax_lse [Hq, total_q], S_dmask) and gradients at every position."""

import pytest
import torch

from torch_flash_v100 import flash_attn_interface as fa
from flash_testing import (assert_close, cu_seqlens, forward_with_rng_state, grads, ops,
                           varlen_qkv, varlen_reference)

# Lengths with empty sequences on either side, seqlen_q != seqlen_k both ways, tile crossings.
LENGTHS = [
    ([0, 5, 1, 40, 17], [3, 0, 9, 33, 17]),
    ([70, 1, 0], [130, 2, 0]),
    ([130], [65]),
    ([0], [0]),
]
FEATURES = [
    ("plain", {}, 4, 4),
    ("causal", dict(causal=True), 4, 2),
    ("window_-1_0", dict(window_size=(-1, 0)), 4, 4),
    ("window_0_0", dict(window_size=(0, 0)), 4, 1),
    ("window_6_-1", dict(window_size=(6, -1)), 4, 4),
    ("causal_window", dict(causal=True, window_size=(12, -1)), 4, 2),
    ("softcap_alibi_h", dict(softcap=0.875, alibi_slopes="h"), 4, 4),
    ("all", dict(window_size=(9, 2), softcap=2.0, alibi_slopes="bh", softmax_scale=0.5), 4, 2),
]


def _slopes(kind, batch, heads_q):
    g = torch.Generator().manual_seed(5)
    if kind == "h":
        return torch.rand(heads_q, generator=g) * 0.5
    return torch.rand(batch, heads_q, generator=g) * 0.5


def _resolve(kwargs, batch, heads_q):
    kwargs = dict(kwargs)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = _slopes(kwargs["alibi_slopes"], batch, heads_q)
    return kwargs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("lens_q,lens_k", LENGTHS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("name,kwargs,heads_q,heads_kv", FEATURES, ids=[f[0] for f in FEATURES])
def test_varlen_matches_reference(name, kwargs, heads_q, heads_kv, lens_q, lens_k, dtype):
    q, k, v = varlen_qkv(lens_q, lens_k, heads_q, heads_kv, 16, dtype, seed=sum(lens_q))
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    kwargs = _resolve(kwargs, len(lens_q), heads_q)
    max_q, max_k = max(lens_q) + 2, max(lens_k)  # an upper bound is enough
    out, lse, probs = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                return_attn_probs=True, **kwargs)
    ref_out, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, **kwargs)
    assert out.shape == q.shape and lse.shape == (heads_q, sum(lens_q))
    assert probs.shape == (len(lens_q), heads_q, max_q, max_k)
    assert_close(out, ref_out, "out")
    assert_close(lse, ref_lse, "softmax_lse")
    # S_dmask rows are normalised probabilities (or zero), zero outside every sequence.
    sums = probs.double().sum(-1)
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        seen = torch.isfinite(ref_lse[:, int(cu_q[b]):int(cu_q[b + 1])])
        torch.testing.assert_close(sums[b, :, :n_q], seen.double(), atol=1e-5, rtol=0)
        assert (probs[b, :, n_q:] == 0).all() and (probs[b, :, :, n_k:] == 0).all()
    grad_out = torch.randn_like(out)
    for n, a, b in zip("qkv", grads(out, (q, k, v), grad_out),
                       grads(ref_out, (q, k, v), grad_out)):
        assert_close(a, b, f"d{n}")


def test_varlen_packed_functions():
    lens = [0, 33, 7, 70]
    cu = cu_seqlens(lens)
    q, k, v = varlen_qkv(lens, lens, 4, 4, 16, torch.float64)
    kwargs = dict(causal=True, window_size=(10, -1), softcap=1.25)
    qkv = torch.stack([q, k, v], dim=1).detach().requires_grad_()
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), **kwargs)
    ref, _ = varlen_reference(*qkv.unbind(1), cu, cu, **kwargs)
    assert_close(out, ref, "qkvpacked out")
    grad_out = torch.randn_like(out)
    assert_close(grads(out, (qkv,), grad_out)[0], grads(ref, (qkv,), grad_out)[0], "dqkv")

    lens_k = [5, 0, 40, 9]
    cu_k = cu_seqlens(lens_k)
    _, k, v = varlen_qkv(lens, lens_k, 4, 2, 16, torch.float64, seed=1)
    kv = torch.stack([k, v], dim=1).detach().requires_grad_()
    out = fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, max(lens), max(lens_k), **kwargs)
    ref, _ = varlen_reference(q, *kv.unbind(1), cu, cu_k, **kwargs)
    assert_close(out, ref, "kvpacked out")
    grad_out = torch.randn_like(out)
    for n, a, b in zip(("dq", "dkv"), grads(out, (q, kv), grad_out), grads(ref, (q, kv), grad_out)):
        assert_close(a, b, n)


@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True, window_size=(8, 2), softcap=1.5,
                                                 alibi_slopes="bh")],
                         ids=["plain", "causal_window_softcap_alibi"])
def test_varlen_dropout_uses_the_exposed_mask(kwargs):
    """Sequence b's keep mask is _dropout_mask(rng_state, B, Hq, max_q, max_k, p)[b, :, :lq, :lk]:
    counters count rows and columns within the sequence."""
    lens_q, lens_k, heads_q, p = [9, 0, 40, 70], [20, 3, 40, 66], 4, 0.25
    q, k, v = varlen_qkv(lens_q, lens_k, heads_q, 2, 16, torch.float64)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    kwargs = _resolve(kwargs, len(lens_q), heads_q)
    max_q, max_k = max(lens_q), max(lens_k)
    window = kwargs.get("window_size", (-1, -1))
    rng_state = forward_with_rng_state(
        q.detach(), k.detach(), v.detach(), cu_q, cu_k, max_q, max_k, p, 0.25,
        kwargs.get("causal", False), window[0], window[1], kwargs.get("softcap", 0.0),
        kwargs.get("alibi_slopes"), seed=11)
    keep = ops._dropout_mask(rng_state, len(lens_q), heads_q, max_q, max_k, p)
    torch.manual_seed(11)
    out, _, probs = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=p,
                                              return_attn_probs=True, **kwargs)
    ref, _ = varlen_reference(q, k, v, cu_q, cu_k, dropout_p=p, dropout_keep=keep, **kwargs)
    assert_close(out, ref, "out")
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        assert torch.equal(torch.signbit(probs[b, :, :n_q, :n_k]), ~keep[b, :, :n_q, :n_k])
    grad_out = torch.randn_like(out)
    for n, a, b in zip("qkv", grads(out, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out)):
        assert_close(a, b, f"d{n}")


def test_varlen_gradcheck():
    lens_q, lens_k = [3, 0, 5], [4, 2, 6]
    q, k, v = varlen_qkv(lens_q, lens_k, 2, 1, 4, torch.float64)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    slopes = torch.tensor([[0.2, 0.5], [0.1, 0.3], [0.4, 0.6]])

    def fn(q, k, v):
        torch.manual_seed(2)
        return fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, dropout_p=0.25, causal=True,
                                         window_size=(2, -1), softcap=1.5, alibi_slopes=slopes)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_varlen_keys_outside_every_window_are_never_read():
    """As the dense test: NaN keys no window of their sequence reaches leave everything exact."""
    lens_q, lens_k = [30, 10], [400, 300]
    q, k, v = varlen_qkv(lens_q, lens_k, 2, 2, 16, torch.float32)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    k_nan, v_nan = k.detach().clone(), v.detach().clone()
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        start = int(cu_k[b])
        k_nan[start:start + n_k - n_q - 16] = float("nan")
        v_nan[start:start + n_k - n_q - 16] = float("nan")
    k_nan.requires_grad_()
    v_nan.requires_grad_()
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out = fa.flash_attn_varlen_func(q, k_nan, v_nan, *args, window_size=(16, 0))
    expected = fa.flash_attn_varlen_func(q, k, v, *args, window_size=(16, 0))
    assert torch.equal(out, expected)
    grad_out = torch.randn_like(out)
    for a, b in zip(grads(out, (q, k_nan, v_nan), grad_out), grads(expected, (q, k, v), grad_out)):
        assert torch.equal(a, b)


def test_block_table_is_not_supported():
    q, k, v = varlen_qkv([4], [4], 2, 2, 8, torch.float32)
    cu = cu_seqlens([4])
    with pytest.raises(NotImplementedError, match="paged KV cache"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, block_table=torch.zeros(1, 1))
