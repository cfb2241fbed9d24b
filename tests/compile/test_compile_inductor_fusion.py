"""Inductor's own attention fusion runs after the pass: shapes that are not attention (softmax over
another dim, a transposed probability matrix, a 3-D ``bmm`` softmax over dim 1) compiled through
Inductor give eager's values and gradients.

Inductor's patterns ignore the softmax dim (torch 2.13 rewrites ``softmax(q @ k^T, dim=-2) @ v``
into SDPA); the pass computes every softmax it leaves alone over the last dim of a transposed
view, which no pattern matches.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import torch_flash_v100
from torch_flash_v100.compile import history

from compile_testing import DEVICE, qkv, reset

try:
    from torch._inductor.utils import fresh_cache
except ImportError:  # torch < 2.8
    from torch._inductor.utils import fresh_inductor_cache as fresh_cache


def softmax_dim_m2(q, k, v):
    return F.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-2) @ v


def softmax_dim1(q, k, v):  # method spelling, division
    return (torch.matmul(q, k.transpose(-2, -1)) / 4.0).softmax(1).matmul(v)


def softmax_dim_m2_fp32_upcast(q, k, v):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    return F.softmax(s, dim=-2, dtype=torch.float32).to(q.dtype) @ v


def softmax_dim_m2_dropout(q, k, v):  # Inductor's dropout patterns; eval-mode dropout
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    return F.dropout(F.softmax(s, dim=-2), 0.1, training=False) @ v


def softmax_dim_m2_masked(q, k, v):
    s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
    L = s.size(-1)
    s = s + torch.triu(torch.full((L, L), -1e4, device=s.device), 1)
    return F.softmax(s, dim=-2) @ v


def softmax_dim1_bmm(q, k, v):
    s = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2))
    return torch.bmm(F.softmax(s, dim=1), v.flatten(0, 1))


def probs_transposed(q, k, v):  # matmul-softmax-matmul, not attention: p^T @ v
    p = F.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-1)
    return p.transpose(-2, -1) @ v


def returns_dim_m2_weights(q, k, v):  # weights used elsewhere as well
    p = F.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-2)
    return p @ v, p


MODELS = [softmax_dim_m2, softmax_dim1, softmax_dim_m2_fp32_upcast, softmax_dim_m2_dropout,
          softmax_dim_m2_masked, softmax_dim1_bmm, probs_transposed, returns_dim_m2_weights]


def _run(fn, compile_fn, train):
    q, k, v = qkv(h=2, l=8, e=8)
    args_c = [t.clone().requires_grad_(train) for t in (q, k, v)]
    args_e = [t.clone().requires_grad_(train) for t in (q, k, v)]
    out_c = compile_fn(fn)(*args_c)
    out_e = fn(*args_e)
    out_c = out_c if isinstance(out_c, tuple) else (out_c,)
    out_e = out_e if isinstance(out_e, tuple) else (out_e,)
    for a, b in zip(out_c, out_e):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    if train:
        w = [torch.randn_like(o) for o in out_e]
        g_c = torch.autograd.grad(sum((o * x).sum() for o, x in zip(out_c, w)), args_c)
        g_e = torch.autograd.grad(sum((o * x).sum() for o, x in zip(out_e, w)), args_e)
        for a, b in zip(g_c, g_e):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert counters["flashv100"]["fused_attention"] == 0, history
    # the pass shielded the softmax (or there was nothing to shield): Inductor fused nothing
    assert counters["inductor"]["fuse_attention"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("fn", MODELS, ids=[f.__name__ for f in MODELS])
def test_backend_inductor_matches_eager(fn, train):
    reset()
    with fresh_cache():
        _run(fn, lambda f: torch.compile(f, backend=torch_flash_v100.backend(force=True)), train)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("fn", [softmax_dim_m2, softmax_dim1_bmm],
                         ids=["softmax_dim_m2", "softmax_dim1_bmm"])
def test_enable_matches_eager(fn, train):
    reset()
    torch_flash_v100.enable(force=True)
    try:
        with fresh_cache():
            _run(fn, torch.compile, train)
    finally:
        torch_flash_v100.disable()


def test_shielding_is_logged():
    reset()
    with fresh_cache():
        torch.compile(softmax_dim_m2, backend=torch_flash_v100.backend(force=True))(*qkv())
    (site,) = history
    assert not site[1]
    assert "not the last dim" in site[2] and "transposed view" in site[2], site


@pytest.mark.skipif(DEVICE != "cpu", reason="device gating on CPU")
def test_untargeted_device_is_left_alone():
    # without force the pass does not own attention on CPU: the graph goes on unchanged
    reset()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    be = torch_flash_v100.backend(force=False, compiler=keep)
    torch.compile(softmax_dim_m2, backend=be)(*qkv())
    (gm,) = graphs
    assert not any(n.target is torch.transpose for n in gm.graph.nodes), gm.code
