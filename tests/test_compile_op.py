"""The op under torch.compile: fullgraph and dynamic shapes, forward and backward."""

import pytest
import torch

import torch_flash_v100 as flash
from attention_testing import make_qkv


def _attention_block(q, k, v, mask):
    return flash.attention(q, k, v, attn_mask=mask, is_causal=True).relu().sum(dim=-1)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_equals_eager(dynamic, device):
    torch._dynamo.reset()
    compiled = torch.compile(_attention_block, fullgraph=True, dynamic=dynamic)
    for len_q, len_kv in ((8, 12), (16, 20)):
        q, k, v = make_qkv(2, 2, 2, len_q, len_kv, 16, torch.float32, device, requires_grad=True)
        mask = torch.randn(1, 1, len_q, len_kv, device=device, requires_grad=True)
        eager_out = _attention_block(q, k, v, mask)
        eager_grads = torch.autograd.grad(eager_out.sum(), (q, k, v, mask))
        out = compiled(q, k, v, mask)
        grads = torch.autograd.grad(out.sum(), (q, k, v, mask))
        torch.testing.assert_close(out, eager_out)
        for a, b in zip(grads, eager_grads):
            torch.testing.assert_close(a, b)


def test_compiled_graph_calls_the_fused_ops(device):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes = {"forward": [], "backward": []}

    def recording(kind):
        def compiler(gm, example_inputs):
            codes[kind].append(gm.code)
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=recording("forward"), bw_compiler=recording("backward"))
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, torch.float32, device, requires_grad=True)
    out = torch.compile(_attention_block, backend=backend, fullgraph=True)(q, k, v, None)
    out.sum().backward()
    (forward_code,) = codes["forward"]
    (backward_code,) = codes["backward"]
    assert "flashv100._attention_forward" in forward_code
    assert "flashv100._attention_backward" in backward_code


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 6),
                    reason="torch 2.5's compiled autograd fails on this step (fake mode mismatch in "
                           "Dynamo), with the C++ or a Python autograd formula alike")
def test_compiled_autograd_equals_eager(device):
    # Compiled autograd traces the backward graph too, through the forward ops' C++ autograd
    # formulas (csrc/autograd.cpp: is_traceable) and the backward ops.
    from torch._dynamo.utils import counters

    from torch_flash_v100 import flash_attn_interface as fa

    def step(q, mask):
        out = flash.attention(q, q, q, attn_mask=mask)
        q_bshd = q.transpose(1, 2)
        out_fa = fa.flash_attn_func(q_bshd, q_bshd, q_bshd, causal=True)
        loss = out.square().sum() + out_fa.square().sum()
        loss.backward()
        return loss

    torch._dynamo.reset()
    counters.clear()
    dtype = torch.float16 if device == "cuda" else torch.float32  # the CUDA FA2 path's dtypes
    q = torch.randn(1, 2, 8, 16, device=device, dtype=dtype, requires_grad=True)
    mask = torch.randn(1, 2, 8, 8, device=device, requires_grad=True)
    step(q, mask)
    eager_grads = (q.grad, mask.grad)
    q.grad = mask.grad = None
    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(step, backend="aot_eager")(q, mask)
    assert counters["compiled_autograd"]["captures"] >= 1
    for a, b in zip((q.grad, mask.grad), eager_grads):
        torch.testing.assert_close(a, b)
