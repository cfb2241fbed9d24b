"""The FlashAttention-2 functions on [B, S, H, D] tensors against the fp64 reference: forward
(out, softmax_lse, S_dmask) and gradients at every position, for every feature and combinations."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_flash_v100 as flash
from torch_flash_v100 import flash_attn_interface as fa
from torch_flash_v100.reference import flash_reference_attention
from flash_testing import assert_close, dense_qkv, forward_with_rng_state, grads, ops

# (name, kwargs, heads_q, heads_kv). Lengths below cross the CPU kernels' 32 x 64 tiles.
FEATURES = [
    ("plain", {}, 4, 4),
    ("causal", dict(causal=True), 4, 4),
    ("window_-1_0", dict(window_size=(-1, 0)), 4, 4),
    ("window_0_0", dict(window_size=(0, 0)), 4, 4),
    ("window_5_-1", dict(window_size=(5, -1)), 4, 4),
    ("window_-1_3", dict(window_size=(-1, 3)), 4, 4),
    ("window_17_9", dict(window_size=(17, 9)), 4, 4),
    ("causal_window_9", dict(causal=True, window_size=(9, 4)), 4, 4),
    ("softcap", dict(softcap=0.75), 4, 4),
    ("alibi_h", dict(alibi_slopes="h"), 4, 4),
    ("alibi_bh", dict(alibi_slopes="bh", causal=True), 4, 4),
    ("scale", dict(softmax_scale=0.3), 4, 4),
    ("gqa", dict(causal=True), 4, 2),
    ("mqa", dict(window_size=(6, 2)), 4, 1),
    ("all", dict(window_size=(20, 3), softcap=2.5, alibi_slopes="bh", softmax_scale=0.4), 4, 2),
]
SHAPES = [(1, 1), (7, 13), (13, 7), (70, 150), (150, 70)]


def _resolve(kwargs, batch, heads_q):
    kwargs = dict(kwargs)
    g = torch.Generator().manual_seed(7)
    if kwargs.get("alibi_slopes") == "h":
        kwargs["alibi_slopes"] = torch.rand(heads_q, generator=g) * 0.5
    elif kwargs.get("alibi_slopes") == "bh":
        kwargs["alibi_slopes"] = torch.rand(batch, heads_q, generator=g) * 0.5
    return kwargs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("len_q,len_kv", SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize("name,kwargs,heads_q,heads_kv", FEATURES, ids=[f[0] for f in FEATURES])
def test_flash_attn_func_matches_reference(name, kwargs, heads_q, heads_kv, len_q, len_kv, dtype):
    batch = 2
    q, k, v = dense_qkv(batch, len_q, len_kv, heads_q, heads_kv, 16, dtype, seed=len_q + len_kv)
    kwargs = _resolve(kwargs, batch, heads_q)
    out, lse, probs = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    ref_out, ref_lse = flash_reference_attention(q, k, v, **kwargs)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == (batch, heads_q, len_q)
    assert_close(out, ref_out, "out")
    assert_close(lse, ref_lse, "softmax_lse")
    finite_lse = ref_lse.detach().masked_fill(torch.isneginf(ref_lse), 0.0)[..., None]
    ref_probs = torch.exp(_ref_scores(q, k, kwargs) - finite_lse)
    assert_close(probs, ref_probs, "S_dmask")
    grad_out = torch.randn_like(out)
    for n, a, b in zip("qkv", grads(out, (q, k, v), grad_out), grads(ref_out, (q, k, v), grad_out)):
        assert_close(a, b, f"d{n}")


def _ref_scores(q, k, kwargs):
    from torch_flash_v100.reference import flash_scores

    scale = kwargs.get("softmax_scale") or q.shape[-1] ** -0.5
    return flash_scores(q.double(), k.double(), softmax_scale=scale,
                        causal=kwargs.get("causal", False),
                        window_size=kwargs.get("window_size", (-1, -1)),
                        softcap=kwargs.get("softcap", 0.0),
                        alibi_slopes=kwargs.get("alibi_slopes")).detach()


def test_rows_without_keys_give_zero_and_minus_inf():
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see nothing (FA2 bottom
    # right), and an empty window on the right of keys hides everything there too.
    q, k, v = dense_qkv(1, 9, 4, 2, 2, 8, torch.float64)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert (out[:, :5] == 0).all() and torch.isneginf(lse[..., :5]).all()
    assert torch.isfinite(lse[..., 5:]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, :5] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_packed_functions_match_unpacked(dtype):
    q, k, v = dense_qkv(2, 37, 37, 4, 4, 16, dtype)
    kwargs = dict(causal=True, window_size=(11, 0), softcap=1.5)
    qkv = torch.stack([q, k, v], dim=2).detach().requires_grad_()
    out = fa.flash_attn_qkvpacked_func(qkv, **kwargs)
    ref, _ = flash_reference_attention(*qkv.unbind(2), **kwargs)
    assert_close(out, ref, "qkvpacked out")
    grad_out = torch.randn_like(out)
    (dqkv,) = grads(out, (qkv,), grad_out)
    (ref_dqkv,) = grads(ref, (qkv,), grad_out)
    assert dqkv.shape == qkv.shape
    assert_close(dqkv, ref_dqkv, "dqkv")

    q, k, v = dense_qkv(2, 21, 45, 4, 2, 16, dtype)
    kv = torch.stack([k, v], dim=2).detach().requires_grad_()
    out = fa.flash_attn_kvpacked_func(q, kv, **kwargs)
    ref, _ = flash_reference_attention(q, *kv.unbind(2), **kwargs)
    assert_close(out, ref, "kvpacked out")
    grad_out = torch.randn_like(out)
    for n, a, b in zip(("dq", "dkv"), grads(out, (q, kv), grad_out), grads(ref, (q, kv), grad_out)):
        assert_close(a, b, n)


@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True, window_size=(10, 0)),
                                    dict(window_size=(7, 7), softcap=1.0, alibi_slopes="h")],
                         ids=["plain", "causal_window", "window_softcap_alibi"])
def test_dropout_uses_the_exposed_mask(kwargs):
    batch, heads_q, heads_kv, len_q, len_kv, p = 2, 4, 2, 45, 70, 0.25  # exact in fp32
    q, k, v = dense_qkv(batch, len_q, len_kv, heads_q, heads_kv, 16, torch.float64)
    kwargs = _resolve(kwargs, batch, heads_q)
    scale = q.shape[-1] ** -0.5
    window = kwargs.get("window_size", (-1, -1))
    rng_state = forward_with_rng_state(
        q.detach(), k.detach(), v.detach(), None, None, len_q, len_kv, p, scale,
        kwargs.get("causal", False), window[0], window[1], kwargs.get("softcap", 0.0),
        kwargs.get("alibi_slopes"), seed=99)
    keep = ops._dropout_mask(rng_state, batch, heads_q, len_q, len_kv, p)
    assert 0.65 < keep.double().mean() < 0.85
    torch.manual_seed(99)
    out, _, probs = fa.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **kwargs)
    ref, _ = flash_reference_attention(q, k, v, dropout_p=p, dropout_keep=keep, **kwargs)
    assert_close(out, ref, "out")
    assert torch.equal(torch.signbit(probs), ~keep)  # S_dmask: dropped entries negated
    grad_out = torch.randn_like(out)
    for n, a, b in zip("qkv", grads(out, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out)):
        assert_close(a, b, f"d{n}")


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(causal=True),
    dict(window_size=(2, 1), softcap=0.8),
    dict(alibi_slopes=torch.tensor([[0.3, 0.1], [0.2, 0.7]]), causal=True, softcap=1.5),
], ids=["plain", "causal", "window_softcap", "alibi_softcap"])
def test_gradcheck(kwargs):
    q, k, v = dense_qkv(2, 5, 7, 2, 1, 4, torch.float64)

    def fn(q, k, v):
        return fa.flash_attn_func(q, k, v, **kwargs)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_dropout_fixed_seed():
    q, k, v = dense_qkv(1, 6, 9, 2, 2, 4, torch.float64)

    def fn(q, k, v):
        torch.manual_seed(3)  # one keep mask for every evaluation
        return fa.flash_attn_func(q, k, v, dropout_p=0.4, window_size=(3, 1))

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window_size=(24, 8), softcap=5.0,
                                                             alibi_slopes="bh")],
                         ids=["causal", "window_softcap_alibi"])
def test_low_precision_fa2_tolerances(dtype, kwargs):
    """FlashAttention-2's criterion: error vs fp64 at most twice that of the same math in dtype."""
    batch, heads_q = 2, 4
    q, k, v = dense_qkv(batch, 67, 131, heads_q, 2, 32, dtype)
    kwargs = _resolve(kwargs, batch, heads_q)
    out = fa.flash_attn_func(q, k, v, **kwargs)
    ref, _ = flash_reference_attention(q, k, v, **kwargs)
    base, _ = flash_reference_attention(q, k, v, compute_dtype=dtype, **kwargs)
    grad_out = torch.randn_like(out)
    pairs = [("out", out, ref, base)] + [
        (f"d{n}", a, r, b) for n, a, r, b in zip(
            "qkv", grads(out, (q, k, v), grad_out), grads(ref, (q, k, v), grad_out.double()),
            grads(base, (q, k, v), grad_out))]
    atol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for name, actual, exact, low in pairs:
        assert actual.dtype == dtype and torch.isfinite(actual).all()
        error = (actual.double() - exact).abs().max().item()
        floor = (low.double() - exact).abs().max().item()
        assert error <= 2 * floor + atol, f"{name}: {error:.3e} > 2 x {floor:.3e} + {atol}"


def test_deterministic_backward_is_bitwise_reproducible():
    q, k, v = dense_qkv(2, 80, 100, 4, 2, 16, torch.float32)
    results = []
    for _ in range(2):
        out = fa.flash_attn_func(q, k, v, causal=True, window_size=(30, 0), deterministic=True)
        results.append(grads(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


class _FlashBackwardCalls(TorchDispatchMode):
    """Records the `deterministic` argument of every flashv100._flash_backward call."""

    def __init__(self):
        super().__init__()
        self.deterministic = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.flashv100._flash_backward.default:
            self.deterministic.append(args[18])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("deterministic, global_flag", [(False, False), (True, False),
                                                        (False, True)])
def test_deterministic_reaches_the_backward(varlen, deterministic, global_flag):
    q, k, v = dense_qkv(2, 9, 9, 2, 2, 8, torch.float32)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(global_flag)
    try:
        if varlen:
            cu = torch.tensor([0, 9, 18], dtype=torch.int32)
            out = fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu,
                                            cu, 9, 9, deterministic=deterministic)
        else:
            out = fa.flash_attn_func(q, k, v, deterministic=deterministic)
        with _FlashBackwardCalls() as calls:
            out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert calls.deterministic == [deterministic or global_flag]


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_keys_outside_every_window_are_never_read(dropout_p):
    """NaN in K and V wherever no row's window reaches (whole key tiles): a kernel that multiplies
    any of them (as a tensor-core kernel does for every element of a tile it visits, P = 0
    included) returns NaN. Query rows see keys [Sk - Sq + i - 20, Sk - Sq + i]."""
    len_q, len_kv = 40, 600
    q, k, v = dense_qkv(1, len_q, len_kv, 2, 2, 16, torch.float32)
    hidden = slice(0, len_kv - len_q - 20)
    k_nan, v_nan = k.detach().clone(), v.detach().clone()
    k_nan[:, hidden] = float("nan")
    v_nan[:, hidden] = float("nan")
    k_nan.requires_grad_()
    v_nan.requires_grad_()
    torch.manual_seed(0)
    out = fa.flash_attn_func(q, k_nan, v_nan, dropout_p=dropout_p, window_size=(20, 0))
    torch.manual_seed(0)
    expected = fa.flash_attn_func(q, k, v, dropout_p=dropout_p, window_size=(20, 0))
    assert torch.equal(out, expected)
    grad_out = torch.randn_like(out)
    dq, dk, dv = grads(out, (q, k_nan, v_nan), grad_out)
    ref_dq, ref_dk, ref_dv = grads(expected, (q, k, v), grad_out)
    assert torch.equal(dq, ref_dq) and torch.equal(dk, ref_dk) and torch.equal(dv, ref_dv)
    assert (dk[:, hidden] == 0).all() and (dv[:, hidden] == 0).all()


def test_exported_from_package():
    for name in fa.__all__:
        assert getattr(flash, name) is getattr(fa, name)
        assert name in flash.__all__
        assert "Arguments" in getattr(fa, name).__doc__


@pytest.mark.parametrize("deterministic", [False, True])
def test_double_backward_raises_instead_of_returning_zeros(deterministic):
    q, k, v = dense_qkv(1, 5, 5, 2, 2, 8, torch.float64)
    out = fa.flash_attn_func(q, k, v, deterministic=deterministic)
    (dq,) = torch.autograd.grad(out.pow(2).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward|once_differentiable"):
        dq.pow(2).sum().backward()
