"""Where SDPA accepts something, the op accepts it too and gives SDPA's answer: double backward,
dropout_p = 1, any last-dim stride, empty tensors, torch.autocast; what it cannot take (nested
tensors) fails with a message naming the argument."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_flash_v100 as flash
from attention_testing import make_qkv


def sdpa_math(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def test_double_backward_matches_sdpa_math(device):
    # The example: a gradient penalty through attention(q, q, q).
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64, device=device, requires_grad=True)

    def penalty_grad(fn):
        q.grad = None
        (g,) = torch.autograd.grad(fn(q, q, q).pow(2).sum(), q, create_graph=True)
        g.pow(2).sum().backward()
        return q.grad.clone()

    ours, ref = penalty_grad(flash.attention), penalty_grad(sdpa_math)
    assert ref.abs().sum() > 1.0
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", ["plain", "causal_gqa", "mask", "bool_mask"])
def test_gradgradcheck(case, device):
    gqa = case == "causal_gqa"
    q, k, v = make_qkv(1, 2, 1 if gqa else 2, 4, 6, 8, torch.float64, device, requires_grad=True)
    inputs = [q, k, v]
    kwargs = dict(is_causal=case == "causal_gqa", enable_gqa=gqa)
    if case == "mask":
        inputs.append(torch.randn(1, 2, 4, 6, dtype=torch.float64, device=device,
                                  requires_grad=True))
    elif case == "bool_mask":
        keep = torch.rand(1, 1, 4, 6, device=device) > 0.4
        keep[..., 0] = True
        kwargs["attn_mask"] = keep

    def fn(*tensors):
        if case == "mask":
            return flash.attention(*tensors[:3], attn_mask=tensors[3], **kwargs)
        return flash.attention(*tensors, **kwargs)

    assert torch.autograd.gradgradcheck(fn, tuple(inputs))


def test_double_backward_with_dropout_uses_the_forward_mask(device):
    # Second-order gradients of one dropout draw: the same as the reference math with the keep
    # mask that draw used (the forward's rng_state).
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8, torch.float64, device, requires_grad=True)
    out, lse, rng_state = torch.ops.flashv100._attention_forward(q, k, v, None, 0.3, 0, 0.5)
    (g,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    (hvp,) = torch.autograd.grad(g.pow(2).sum(), k)
    keep = torch.ops.flashv100._dropout_mask(rng_state, 1, 2, 6, 6, 0.3)
    ref_out = flash.reference_attention(q, k, v, dropout_p=0.3, scale=0.5, dropout_keep=keep)
    (ref_g,) = torch.autograd.grad(ref_out.pow(2).sum(), q, create_graph=True)
    (ref_hvp,) = torch.autograd.grad(ref_g.pow(2).sum(), k)
    # The kernels scale kept entries by 1 / (1 - p) with p held in fp32: 1e-8 relative.
    torch.testing.assert_close(hvp, ref_hvp, rtol=1e-6, atol=1e-9)


def test_dropout_one_gives_zeros_and_zero_gradients(device):
    q, k, v = make_qkv(2, 2, 2, 5, 7, 8, torch.float32, device, requires_grad=True)
    mask = torch.randn(2, 2, 5, 7, device=device, requires_grad=True)
    out = flash.attention(q, k, v, attn_mask=mask, dropout_p=1.0)
    assert out.shape == (2, 2, 5, 8) and (out == 0).all()
    out.sum().backward()
    for t in (q, k, v, mask):
        assert t.grad is not None and (t.grad == 0).all()


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_dropout_outside_unit_interval_is_rejected(p, device):
    q, k, v = make_qkv(1, 1, 1, 3, 3, 8, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"dropout_p in \[0, 1\]"):
        flash.attention(q, k, v, dropout_p=p)


def test_strided_last_dim_is_copied_like_sdpa(device):
    # [B, H, E, L] storage read as [B, H, L, E]: last-dim stride L.
    q, k, v = (torch.randn(2, 2, 8, 6, device=device).transpose(-1, -2).requires_grad_()
               for _ in range(3))
    assert q.stride(-1) != 1
    ours = flash.attention(q, k, v, is_causal=True)
    ref = sdpa_math(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(ours.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_internal_op_names_the_strided_tensor(device):
    q, k, v = make_qkv(1, 1, 1, 4, 4, 8, torch.float32, device)
    k_strided = torch.randn(1, 1, 8, 4, device=device).transpose(-1, -2)
    with pytest.raises(RuntimeError, match=r"expected key with a contiguous last dim.*"
                                           r"key\.contiguous\(\)"):
        torch.ops.flashv100._attention_forward(q, k_strided, v, None, 0.0, 0, 1.0)


@pytest.mark.parametrize("shape", [(0, 2, 4, 4), (2, 2, 0, 4), (2, 2, 4, 0)],
                         ids=["batch0", "queries0", "keys0"])
def test_empty_tensors_forward_and_backward(shape, device):
    batch, heads, len_q, len_kv = shape
    q = torch.randn(batch, heads, len_q, 8, device=device, requires_grad=True)
    k = torch.randn(batch, heads, len_kv, 8, device=device, requires_grad=True)
    v = torch.randn(batch, heads, len_kv, 8, device=device, requires_grad=True)
    out = flash.attention(q, k, v)
    ref = sdpa_math(q, k, v)
    assert out.shape == ref.shape
    if len_kv > 0:
        torch.testing.assert_close(out, ref)
    else:  # no key at all: zeros (SDPA math gives NaN there)
        assert (out == 0).all()
    out.sum().backward()  # the expanded gradient of sum() is stride 0 and, when empty, stays so
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and torch.isfinite(t.grad).all()


def _autocast_device_dtypes():
    cases = [("cpu", torch.bfloat16)]
    if torch.cuda.is_available():
        cases += [("cuda", torch.float16), ("cuda", torch.bfloat16)]
    return cases


@pytest.mark.parametrize("device_type,dtype", _autocast_device_dtypes(),
                         ids=lambda x: str(x).replace("torch.", ""))
def test_autocast_runs_in_the_autocast_dtype_like_sdpa(device_type, dtype):
    q, k, v = make_qkv(2, 4, 2, 9, 11, 16, torch.float32, device_type, requires_grad=True)
    mask = torch.randn(2, 1, 9, 11, device=device_type)
    k_mixed = k.detach().to(dtype).requires_grad_()  # mixed dtypes: SDPA casts all of them
    with torch.autocast(device_type, dtype=dtype):
        ours = flash.attention(q, k_mixed, v, attn_mask=mask, enable_gqa=True)
        ref = sdpa_math(q, k_mixed, v, attn_mask=mask, enable_gqa=True)
    assert ours.dtype == ref.dtype == dtype
    expected = flash.attention(q.to(dtype), k_mixed, v.to(dtype), attn_mask=mask.to(dtype),
                               enable_gqa=True)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    ours.float().sum().backward()
    assert q.grad.dtype == torch.float32 and k_mixed.grad.dtype == dtype


def test_autocast_leaves_float64_alone():
    q, k, v = make_qkv(1, 2, 2, 4, 4, 8, torch.float64, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flash.attention(q, k, v).dtype == torch.float64


def test_nested_tensors_fail_with_a_clear_message():
    nt = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged)
    with pytest.raises(RuntimeError, match="query is a nested .jagged. tensor"):
        flash.attention(nt, nt, nt)


def test_float64_mask_gradient_is_exact(device):
    # The additive mask's gradient is computed and returned in fp64, like q/k/v's.
    q, k, v = make_qkv(2, 2, 2, 6, 9, 8, torch.float64, device, requires_grad=True)
    mask = torch.randn(2, 1, 6, 9, dtype=torch.float64, device=device, requires_grad=True)
    (ours,) = torch.autograd.grad(flash.attention(q, k, v, attn_mask=mask).sum(), mask)
    (ref,) = torch.autograd.grad(sdpa_math(q, k, v, attn_mask=mask).sum(), mask)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
