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
