"""Gradients: gradcheck in float64 and low-precision backward vs the fp64 reference."""

import pytest
import torch

import torch_flash_v100 as flash
from attention_testing import (assert_fa2_close, make_qkv, reference_fp64,
                               reference_low_precision)


@pytest.mark.parametrize("is_causal,gqa,mask_kind,layout", [
    (False, False, None, "bhle"),
    (True, False, None, "blhe"),
    (False, True, "float", "bhle"),
    (True, False, "float", "bhle"),
    (False, False, "bool", "blhe"),
    (True, True, "float_broadcast", "bhle"),
])
def test_gradcheck(is_causal, gqa, mask_kind, layout, device):
    heads_kv = 1 if gqa else 2
    q, k, v = make_qkv(2, 2, heads_kv, 7, 9, 8, torch.float64, device, requires_grad=True,
                       layout=layout)
    inputs = [q, k, v]
    if mask_kind == "float":
        inputs.append(torch.randn(2, 2, 7, 9, dtype=torch.float64, device=device, requires_grad=True))
    elif mask_kind == "float_broadcast":
        inputs.append(torch.randn(1, 2, 1, 9, dtype=torch.float64, device=device, requires_grad=True))
    elif mask_kind == "bool":
        keep = torch.rand(2, 1, 7, 9, device=device) > 0.3
        keep[..., 0] = True
        inputs.append(keep)
    else:
        inputs.append(None)

    def fn(q, k, v, mask):
        return flash.attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)

    assert torch.autograd.gradcheck(fn, tuple(inputs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 33, 65, 64), (1, 2, 2, 129, 17, 40)],
                         ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_reference(dtype, is_causal, shape, device):
    batch, heads_q, heads_kv, len_q, len_kv, dim = shape
    gqa = heads_q != heads_kv
    q, k, v = make_qkv(batch, heads_q, heads_kv, len_q, len_kv, dim, dtype, device,
                       requires_grad=True)
    grad_out = torch.randn(batch, heads_q, len_q, dim, device=device, dtype=dtype)
    kwargs = dict(is_causal=is_causal, enable_gqa=gqa)

    def grads(fn, *tensors):
        inputs = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*inputs, **kwargs)
        out.backward(grad_out.to(out.dtype))
        return [t.grad for t in inputs]

    ours = grads(flash.attention, q, k, v)
    ref = grads(reference_fp64, q, k, v)
    base = grads(reference_low_precision, q, k, v)
    for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref, base):
        assert a.dtype == dtype
        assert_fa2_close(a, r, b, name=name)


def test_mask_gradient_broadcast_shape(device):
    q, k, v = make_qkv(2, 3, 3, 5, 6, 8, torch.float32, device, requires_grad=True)
    bias = torch.randn(3, 1, 6, device=device, requires_grad=True)  # [H, 1, S]
    flash.attention(q, k, v, attn_mask=bias).sum().backward()
    expected = torch.autograd.grad(reference_fp64(q, k, v, bias).sum(), bias)[0]
    assert bias.grad.shape == bias.shape
    torch.testing.assert_close(bias.grad.double(), expected.double(), atol=1e-5, rtol=1e-4)


def test_deterministic_backward_is_bitwise_reproducible(device):
    q, k, v = make_qkv(2, 4, 2, 65, 65, 32, torch.float16, device, requires_grad=True)
    results = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            out = flash.attention(q, k, v, is_causal=True, enable_gqa=True)
            results.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mask_shape", [(2, 3, 5, 6), (1, 3, 1, 6)], ids=["full", "broadcast"])
def test_fp64_mask_gradient_is_exact(mask_shape):
    """fp64 inputs: the additive mask's gradient is accumulated in fp64 (an fp32 buffer leaves
    errors around 1e-7), as exact as SDPA's math backend."""
    q, k, v = make_qkv(2, 3, 3, 5, 6, 8, torch.float64, "cpu", requires_grad=True)
    bias = torch.randn(*mask_shape, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    ours = torch.autograd.grad(flash.attention(q, k, v, attn_mask=bias), (q, bias), grad_out)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    expected = torch.autograd.grad(sdpa, (q, bias), grad_out)
    for a, b in zip(ours, expected):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_autograd_formulas_are_native(device):
    # The forward ops' autograd runs in C++ (csrc/autograd.cpp): a training step pays no Python
    # frame per attention call, which on a GPU is the whole run time of a small attention.
    from torch_flash_v100 import flash_attn_interface as fa

    dtype = torch.float16 if device == "cuda" else torch.float32  # the CUDA kernels' dtypes
    q = torch.randn(1, 2, 4, 8, device=device, dtype=dtype, requires_grad=True)
    # 4-D inputs: the C++ node is the output's own grad_fn (no view node to run in every backward)
    assert flash.attention(q, q, q).grad_fn.name() == (
        "torch::autograd::CppNode<flashv100::(anonymous namespace)::AttentionFunction>")
    view = flash.attention(q[0], q[0], q[0]).grad_fn  # 3-D: viewed back from [1, H, L, E]
    assert [n.name() for n, _ in view.next_functions if n is not None] == [
        "torch::autograd::CppNode<flashv100::(anonymous namespace)::AttentionFunction>"]
    out = fa.flash_attn_func(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))
    assert out.grad_fn.name() == (
        "torch::autograd::CppNode<flashv100::(anonymous namespace)::FlashFunction>")
