"""The FlashAttention-2 varlen functions on packed batches against the per-sequence fp64
reference: forward (out, softmax_lse [Hq, total_q], S_dmask) and gradients at every position;
with block_table (packed queries over a paged KV cache), the forward, opcheck and bad input."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_flash_v100 import flash_attn_interface as fa
from flash_testing import (assert_close, cu_seqlens, forward_with_rng_state, grads, ops,
                           paged_cache, varlen_qkv, varlen_reference)

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


PAGED_FEATURES = [f for f in FEATURES if f[0] in ("plain", "causal", "window_6_-1", "all")]


def _paged_op(q, k_cache, v_cache, cu_q, cu_k, max_q, table, causal=False, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, softmax_scale=None):
    """(out, softmax_lse) of the op under flash_attn_varlen_func(block_table=...)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return ops._kvcache_forward(q, k_cache, v_cache, None, None, None, None, cu_k[1:] - cu_k[:-1],
                                None, None, table, scale, causal, *window_size, softcap, True,
                                alibi_slopes, 1, True, cu_q, max_q)


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("lens_q,lens_k", LENGTHS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("name,kwargs,heads_q,heads_kv", PAGED_FEATURES,
                         ids=[f[0] for f in PAGED_FEATURES])
def test_paged_varlen_matches_reference(name, kwargs, heads_q, heads_kv, lens_q, lens_k,
                                        page_size):
    """block_table: packed queries over shuffled pages (NaN elsewhere, table entries past a
    sequence's pages far outside the cache) equal the per-sequence reference on every row."""
    q, k, v = varlen_qkv(lens_q, lens_k, heads_q, heads_kv, 16, torch.float64, seed=len(lens_q))
    q = q.detach()
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    kwargs = _resolve(kwargs, len(lens_q), heads_q)
    k_cache, v_cache, table = paged_cache(k, v, cu_k, page_size, seed=sum(lens_k))
    max_q = max(lens_q) + 1
    out = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, None,
                                    block_table=table, **kwargs)
    ref_out, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, **kwargs)
    assert out.shape == q.shape
    assert_close(out, ref_out, "out")
    op_out, lse = _paged_op(q, k_cache, v_cache, cu_q, cu_k, max_q, table, **kwargs)
    assert torch.equal(op_out, out) and lse.shape == (heads_q, sum(lens_q))
    assert_close(lse, ref_lse, "softmax_lse")


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 70)), min_size=1,
                        max_size=4),
       page_size=st.sampled_from([16, 32, 48]), group=st.sampled_from([1, 2]),
       window=st.sampled_from([(-1, -1), (5, 0), (9, 3)]), causal=st.booleans(),
       softcap=st.sampled_from([0.0, 1.5]), seed=st.integers(0, 2**16))
def test_fuzz_paged_varlen(lengths, page_size, group, window, causal, softcap, seed):
    """Random packed batches over random pages against the per-sequence reference."""
    lens_q, lens_k = [n for n, _ in lengths], [n for _, n in lengths]
    q, k, v = varlen_qkv(lens_q, lens_k, 2 * group, 2, 8, torch.float64, seed=seed)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    k_cache, v_cache, table = paged_cache(k, v, cu_k, page_size, seed=seed)
    kwargs = dict(causal=causal, window_size=window, softcap=softcap)
    out = fa.flash_attn_varlen_func(q.detach(), k_cache, v_cache, cu_q, cu_k, max(lens_q),
                                    max(lens_k), block_table=table, **kwargs)
    assert_close(out, varlen_reference(q, k, v, cu_q, cu_k, **kwargs)[0], "out")


def test_paged_varlen_opcheck_and_no_backward():
    lens_q, lens_k = [3, 0, 5], [20, 7, 40]
    q, k, v = varlen_qkv(lens_q, lens_k, 4, 2, 8, torch.float32)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    k_cache, v_cache, table = paged_cache(k, v, cu_k, 16)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()  # opcheck compares caches
    table[table > k_cache.shape[0]] = 0
    args = (q.detach(), k_cache, v_cache, None, None, None, None, cu_k[1:] - cu_k[:-1], None,
            None, table, 0.3, True, -1, -1, 0.0, True, None, 1)
    for check_index_values in (True, False):
        torch.library.opcheck(ops._kvcache_forward.default,
                              args + (check_index_values, cu_q, 5),
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor", "test_aot_dispatch_dynamic"))
    out = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 5, 40, block_table=table)
    with pytest.raises(RuntimeError, match="not implemented"):
        out.sum().backward()


def test_paged_varlen_bad_inputs():
    lens_q, lens_k = [3, 5], [20, 40]
    q, k, v = varlen_qkv(lens_q, lens_k, 2, 2, 8, torch.float32)
    q = q.detach()
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    k_cache, v_cache, table = paged_cache(k, v, cu_k, 16)

    def call(**changes):
        args = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=5, max_seqlen_k=40, block_table=table)
        args.update(changes)
        return fa.flash_attn_varlen_func(**args)

    cases = [
        (dict(dropout_p=0.1), "expected dropout_p=0 and return_attn_probs=False"),
        (dict(return_attn_probs=True), "expected dropout_p=0 and return_attn_probs=False"),
        (dict(cu_seqlens_k=cu_k.long()), "expected cu_seqlens_k an int32"),
        (dict(cu_seqlens_k=cu_k[:2]), "expected cu_seqlens_k an int32"),
        (dict(cu_seqlens_k=torch.tensor([0, 20, 10], dtype=torch.int32)),
         r"cache_seqlens\[1\] = -10 \(cu_seqlens_k's difference there\) is negative"),
        (dict(cu_seqlens_k=torch.tensor([0, 20, 90], dtype=torch.int32)),
         r"cache_seqlens\[1\] = 70 with 0 new rows does not fit a cache of 64 rows"),
        (dict(max_seqlen_q=4), "sequence 1 has 5 rows \\(cu_seqlens_q\\), more than max_seqlen_q"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32)),
         r"expected cu_seqlens_q\[-1\] == 8"),
        (dict(cu_seqlens_q=cu_q.long()), "expected cu_seqlens_q of dtype int32"),
        (dict(block_table=table[:1]), r"expected block_table \[B, max_pages\] = \[2"),
        (dict(block_table=torch.where(table == table[1, 1], 99, table)),
         r"block_table\[1, 1\] = 99 is outside"),
        (dict(q=q[None]), r"or \[total_q, Hq, D\] with cu_seqlens_q"),
    ]
    for changes, message in cases:
        with pytest.raises((RuntimeError, ValueError), match=message):
            call(**changes)
    new_rows = q[None, :3]
    with pytest.raises(RuntimeError, match="packed queries .cu_seqlens_q. need block_table"):
        ops._kvcache_forward(q, k_cache, v_cache, new_rows, new_rows, None, None,
                             cu_k[1:] - cu_k[:-1], None, None, table, 0.3, False, -1, -1, 0.0,
                             True, None, 1, True, cu_q, 5)
