"""torch.library.opcheck on every flashv100 op."""

import pytest
import torch

import torch_flash_v100  # noqa: F401
from attention_testing import make_qkv

ops = torch.ops.flashv100
UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _mask(kind, device, requires_grad):
    if kind == "none":
        return None
    if kind == "bool":
        keep = torch.rand(2, 1, 5, 7, device=device) > 0.3
        keep[..., 0] = True
        return keep
    return torch.randn(1, 4, 5, 7, device=device, requires_grad=requires_grad)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("layout", ["bhle", "blhe"])
def test_attention(requires_grad, mask_kind, layout, device):
    q, k, v = make_qkv(2, 4, 2, 5, 7, 16, torch.float32, device, requires_grad=requires_grad,
                       layout=layout)
    mask = _mask(mask_kind, device, requires_grad)
    torch.library.opcheck(ops.attention.default, (q, k, v), {"attn_mask": mask, "enable_gqa": True},
                          test_utils=UTILS)
    torch.library.opcheck(ops.attention.default, (q, k, v),
                          {"is_causal": True, "scale": 0.5, "enable_gqa": True}, test_utils=UTILS)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_attention_forward(requires_grad, mask_kind, device):
    q, k, v = make_qkv(2, 4, 2, 5, 7, 16, torch.float32, device, requires_grad=requires_grad)
    mask = _mask(mask_kind, device, requires_grad)
    for causal_mode in (0, 1, 2):
        torch.library.opcheck(ops._attention_forward.default, (q, k, v, mask, 0.0, causal_mode, 0.25),
                              test_utils=UTILS)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_attention_backward(mask_kind, dtype, device):
    q, k, v = make_qkv(2, 4, 2, 5, 7, 16, dtype, device)
    mask = _mask(mask_kind, device, False)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    out, lse, rng_state = ops._attention_forward(q, k, v, mask, 0.0, 1, 0.25)
    grad_out = torch.randn_like(out)
    mask_grad = mask is not None and mask.is_floating_point()
    torch.library.opcheck(
        ops._attention_backward.default,
        (grad_out, q, k, v, mask, out, lse, rng_state, 0.0, 1, 0.25, mask_grad, False),
        test_utils=UTILS)


def test_dropout_mask(device):
    rng_state = torch.tensor([1234, 0], dtype=torch.int64, device=device)
    torch.library.opcheck(ops._dropout_mask.default, (rng_state, 2, 3, 5, 7, 0.25), test_utils=UTILS)
