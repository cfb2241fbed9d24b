"""The FlashAttention-2 internal ops: opcheck (dense and varlen), torch.compile of the public
functions, bad-input errors, and a hypothesis fuzz of shapes and options against the reference."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_flash_v100 import flash_attn_interface as fa
from torch_flash_v100.reference import flash_reference_attention
from flash_testing import (assert_close, cu_seqlens, dense_qkv, forward_with_rng_state, grads,
                           ops, varlen_qkv, varlen_reference)

UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
SLOPES = torch.tensor([0.25, 0.5, 0.125, 1.0])


def _forward_args(varlen, requires_grad, dtype=torch.float32, **options):
    """_flash_forward's arguments: GQA, a window, softcap and ALiBi unless overridden."""
    opts = dict(dropout_p=0.0, scale=0.25, causal=False, window=(5, 2), softcap=1.5,
                alibi=SLOPES)
    opts.update(options)
    if varlen:
        lens_q, lens_k = [3, 0, 9], [5, 2, 7]
        q, k, v = varlen_qkv(lens_q, lens_k, 4, 2, 8, dtype)
        extra = (cu_seqlens(lens_q), cu_seqlens(lens_k), 9, 7)
    else:
        q, k, v = dense_qkv(2, 6, 9, 4, 2, 8, dtype)
        extra = (None, None, 6, 9)
    q, k, v = (t.detach().requires_grad_(requires_grad) for t in (q, k, v))
    return (q, k, v, *extra, opts["dropout_p"], opts["scale"], opts["causal"], opts["window"][0],
            opts["window"][1], opts["softcap"], opts["alibi"])


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_opcheck_flash_forward(varlen, requires_grad):
    for options in (dict(), dict(causal=True, window=(-1, -1), softcap=0.0, alibi=None)):
        args = _forward_args(varlen, requires_grad, **options)
        torch.library.opcheck(ops._flash_forward.default, args, test_utils=UTILS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_opcheck_flash_backward(varlen, dtype):
    args = _forward_args(varlen, False, dtype=dtype, dropout_p=0.25)
    out, lse, rng_state = ops._flash_forward(*args)
    q, k, v, *rest = args
    torch.library.opcheck(ops._flash_backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, rng_state, *rest, False),
                          test_utils=UTILS)


def test_compile_flash_attn_func_fullgraph():
    torch._dynamo.reset()
    compiled = torch.compile(fa.flash_attn_func, fullgraph=True)
    q, k, v = dense_qkv(2, 20, 33, 4, 2, 16, torch.float32)
    kwargs = dict(causal=True, window_size=(9, 0), softcap=2.0, alibi_slopes=SLOPES)
    out = compiled(q, k, v, **kwargs)
    expected = fa.flash_attn_func(q, k, v, **kwargs)
    torch.testing.assert_close(out, expected)
    grad_out = torch.randn_like(out)
    for a, b in zip(grads(out, (q, k, v), grad_out), grads(expected, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b)


def test_compile_flash_attn_varlen_func_fullgraph_without_recompiles():
    """Fake kernels give lse [Hq, total_q]; new lengths inside cu_seqlens reuse the graph."""
    torch._dynamo.reset()

    def attention_and_lse(q, k, v, cu_q, cu_k):
        out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, causal=True,
                                                window_size=(7, -1), return_attn_probs=True)
        return out * 2, lse + 1

    compiled = torch.compile(attention_and_lse, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lens_q, lens_k in (([3, 20, 17], [10, 15, 15]), ([30, 0, 10], [1, 39, 0])):
            q, k, v = varlen_qkv(lens_q, lens_k, 4, 2, 16, torch.float32)
            cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
            out, lse = compiled(q, k, v, cu_q, cu_k)
            ref_out, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, causal=True,
                                                window_size=(7, -1))
            assert lse.shape == (4, 40)
            assert_close(out, 2 * ref_out, "out")
            assert_close(lse, ref_lse + 1, "lse")
            grad_out = torch.randn_like(out)
            for a, b in zip(grads(out, (q, k, v), grad_out),
                            grads(2 * ref_out, (q, k, v), grad_out)):
                assert_close(a, b, "grad")


def _dense(**overrides):
    q, k, v = dense_qkv(2, 6, 9, 4, 2, 8, torch.float32, seed=0)
    args = dict(q=q, k=k, v=v)
    args.update(overrides)
    return args


def _varlen(**overrides):
    q, k, v = varlen_qkv([3, 5], [4, 6], 4, 2, 8, torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens([3, 5]), cu_seqlens_k=cu_seqlens([4, 6]),
                max_seqlen_q=5, max_seqlen_k=6)
    args.update(overrides)
    return args


DENSE_ERRORS = [
    ("dtype mix", _dense(k=torch.randn(2, 9, 2, 8, dtype=torch.float64)), {}, "one dtype"),
    ("integer", _dense(q=torch.ones(2, 6, 4, 8, dtype=torch.int32),
                       k=torch.ones(2, 9, 2, 8, dtype=torch.int32),
                       v=torch.ones(2, 9, 2, 8, dtype=torch.int32)), {}, "floating-point query"),
    ("rank", _dense(q=torch.randn(6, 4, 8)), {}, r"query \[B, Sq, Hq, D\]"),
    ("strided last dim", _dense(q=torch.randn(2, 6, 4, 16)[..., ::2]), {}, "contiguous last dim"),
    ("head dim", _dense(v=torch.randn(2, 9, 2, 4)), {}, "head dim 8"),
    ("value shape", _dense(v=torch.randn(2, 8, 2, 8)), {}, "expected value"),
    ("batch", _dense(k=torch.randn(3, 9, 2, 8), v=torch.randn(3, 9, 2, 8)), {}, "batch 2"),
    ("gqa", _dense(k=torch.randn(2, 9, 3, 8), v=torch.randn(2, 9, 3, 8)), {},
     "multiple of key/value heads"),
    ("dropout", _dense(), dict(dropout_p=1.0), r"dropout_p in \[0, 1\)"),
    ("window", _dense(), dict(window_size=(-2, 0)), "window_size entries >= -1"),
    ("window right", _dense(), dict(window_size=(3, -5)), "window_size entries >= -1"),
    ("softcap", _dense(), dict(softcap=-1.0), "softcap >= 0"),
    ("alibi dtype", _dense(), dict(alibi_slopes=SLOPES.double()), "alibi_slopes of dtype float32"),
    ("alibi shape", _dense(), dict(alibi_slopes=torch.rand(3)), r"alibi_slopes \[Hq\]"),
    ("alibi batch", _dense(), dict(alibi_slopes=torch.rand(3, 4)), r"\[B, Hq\] = \[2, 4\]"),
]
VARLEN_ERRORS = [
    ("cu int64", _varlen(cu_seqlens_q=torch.tensor([0, 3, 8])), "cu_seqlens_q of dtype int32"),
    ("cu 2-D", _varlen(cu_seqlens_k=cu_seqlens([4, 6])[None]), "cu_seqlens_k a contiguous 1-D"),
    ("cu strided", _varlen(cu_seqlens_q=torch.tensor([0, 9, 3, 9, 8, 9], dtype=torch.int32)[::2]),
     "contiguous 1-D"),
    ("cu start", _varlen(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32)),
     r"cu_seqlens_q\[0\] == 0"),
    ("cu decreasing", _varlen(cu_seqlens_k=torch.tensor([0, 6, 4, 10], dtype=torch.int32),
                              cu_seqlens_q=torch.tensor([0, 3, 3, 8], dtype=torch.int32)),
     "non-decreasing cu_seqlens_k"),
    ("cu end", _varlen(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32)),
     r"cu_seqlens_q\[-1\] == 8"),
    ("cu lengths", _varlen(cu_seqlens_k=cu_seqlens([4, 3, 3])), "cu_seqlens_q's length"),
    ("max_seqlen", _varlen(max_seqlen_q=4), "sequence 1 has 5 rows .* max_seqlen_q = 4"),
    ("max_seqlen negative", _varlen(max_seqlen_k=-1), "max_seqlen_k >= 0"),
    ("rank", _varlen(q=torch.randn(1, 8, 4, 8)), r"packed query \[total_q, Hq, D\]"),
    ("alibi batch", _varlen(alibi_slopes=torch.rand(3, 4)), r"\[B, Hq\] = \[2, 4\]"),
]


@pytest.mark.parametrize("name,args,kwargs,message", DENSE_ERRORS, ids=[c[0] for c in DENSE_ERRORS])
def test_dense_bad_input_raises(name, args, kwargs, message):
    with pytest.raises(RuntimeError, match=message):
        fa.flash_attn_func(**args, **kwargs)


@pytest.mark.parametrize("name,args,message", VARLEN_ERRORS, ids=[c[0] for c in VARLEN_ERRORS])
def test_varlen_bad_input_raises(name, args, message):
    with pytest.raises(RuntimeError, match=message):
        fa.flash_attn_varlen_func(**args)


def test_internal_op_checks():
    q, k, v = dense_qkv(1, 4, 4, 2, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match="max_seqlen_q = Sq = 4"):
        ops._flash_forward(q, k, v, None, None, 5, 4, 0.0, 1.0, False, -1, -1, 0.0, None)
    with pytest.raises(RuntimeError, match="both cu_seqlens_q and cu_seqlens_k"):
        ops._flash_forward(q[0], k[0], v[0], cu_seqlens([4]), None, 4, 4, 0.0, 1.0, False, -1,
                           -1, 0.0, None)
    out, lse, rng_state = ops._flash_forward(q, k, v, None, None, 4, 4, 0.0, 1.0, False, -1, -1,
                                             0.0, None)
    with pytest.raises(RuntimeError, match=r"expected lse \[1, 2, 4\]"):
        ops._flash_backward(torch.ones_like(out), q, k, v, out, lse[0], rng_state, None, None, 4,
                            4, 0.0, 1.0, False, -1, -1, 0.0, None, False)
    with pytest.raises(ValueError, match="window_size"):
        fa.flash_attn_func(q, k, v, window_size=(1, 2, 3))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1,
                        max_size=3),
       heads_kv=st.integers(1, 2), group=st.integers(1, 3), dim=st.integers(1, 24),
       varlen=st.booleans(), causal=st.booleans(), left=st.integers(-1, 40),
       right=st.integers(-1, 40), softcap=st.sampled_from([0.0, 0.5, 4.0]),
       alibi=st.sampled_from([None, "h", "bh"]), dropout=st.sampled_from([0.0, 0.25]),
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_fuzz_against_reference(lengths, heads_kv, group, dim, varlen, causal, left, right,
                                softcap, alibi, dropout, dtype):
    heads_q, batch = heads_kv * group, len(lengths)
    lens_q, lens_k = [n for n, _ in lengths], [n for _, n in lengths]
    if not varlen:  # one length pair for the whole batch
        lens_q, lens_k = [lens_q[0]] * batch, [lens_k[0]] * batch
    g = torch.Generator().manual_seed(sum(lens_q) * 131 + sum(lens_k))
    slopes = (None if alibi is None else
              torch.rand(heads_q, generator=g) if alibi == "h" else
              torch.rand(batch, heads_q, generator=g))
    kwargs = dict(causal=causal, window_size=(left, right), softcap=softcap, alibi_slopes=slopes)
    max_q, max_k = max(lens_q), max(lens_k)
    q, k, v = varlen_qkv(lens_q, lens_k, heads_q, heads_kv, dim, dtype, seed=dim)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    keep = None
    if dropout > 0:
        rng_state = forward_with_rng_state(
            q.detach(), k.detach(), v.detach(), cu_q, cu_k, max_q, max_k, dropout,
            dim ** -0.5, causal, left, right, softcap, slopes, seed=5)
        keep = ops._dropout_mask(rng_state, batch, heads_q, max_q, max_k, dropout)
    torch.manual_seed(5)
    if varlen:
        out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout,
                                        **kwargs)
    else:
        def dense(t, n):
            return t.view(batch, n, *t.shape[1:])

        out = fa.flash_attn_func(dense(q, lens_q[0]), dense(k, lens_k[0]), dense(v, lens_k[0]),
                                 dropout_p=dropout, **kwargs).flatten(0, 1)
    ref, _ = varlen_reference(q, k, v, cu_q, cu_k, dropout_p=dropout, dropout_keep=keep,
                              **kwargs)
    assert_close(out, ref, "out")
    grad_out = torch.randn_like(out)
    for n, a, b in zip("qkv", grads(out, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out)):
        assert_close(a, b, f"d{n}")


@pytest.mark.parametrize("through", ["op", "function"])
def test_double_backward_raises(through):
    # Never a silent zero: a gradient of a gradient raises, through the op's own autograd formula
    # and through the public functions.
    args = _forward_args(False, True, dtype=torch.float64)
    q, k, v = args[:3]
    if through == "op":
        out = ops._flash_forward(*args)[0]
    else:
        out = fa.flash_attn_func(q, k, v, softmax_scale=0.25, window_size=(5, 2), softcap=1.5,
                                 alibi_slopes=SLOPES)
    (g,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward|differentiable"):
        g.pow(2).sum().backward()
