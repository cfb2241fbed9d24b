"""Public contract: enable()/disable() with plain torch.compile (Inductor), the "flashv100"
backend, device gating, composition with user passes, dynamic shapes, the FX graph cache."""

import contextlib
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import torch_flash_v100
from torch_flash_v100.compile import FlashV100Pass, history, is_enabled

from compile_testing import DEVICE, qkv, reset

try:
    from torch._inductor.utils import fresh_cache
except ImportError:  # torch < 2.8
    from torch._inductor.utils import fresh_inductor_cache as fresh_cache

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover
    CustomGraphPass = object


def attn(q, k, v, keep):
    s = torch.matmul(q, k.transpose(-2, -1)) / 4.0
    L = s.size(-1)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=s.device))
    s = s.masked_fill(~causal, float("-inf"))
    s = s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)
    return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _inputs(train=False):
    q, k, v = qkv()
    keep = torch.ones(2, 8, dtype=torch.bool, device=DEVICE)
    keep[1, -2:] = False
    if train:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, keep


@pytest.fixture
def enabled():
    assert not is_enabled()
    torch_flash_v100.enable(force=True)
    try:
        yield
    finally:
        torch_flash_v100.disable()
        assert not is_enabled()


def test_enable_inductor_inference_and_training(enabled):
    reset()
    with fresh_cache():
        q, k, v, keep = _inputs(train=True)
        compiled = torch.compile(attn)
        out, (fw_code,) = run_and_get_code(compiled, q, k, v, keep)
        assert counters["flashv100"]["fused_attention"] == 1
        assert "flashv100._attention_forward" in fw_code
        _, (bw_code,) = run_and_get_code(lambda: out.sum().backward())
        assert "flashv100._attention_backward" in bw_code
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ref = attn(q2, k2, v2, keep)
        ref.sum().backward()
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        for a, b in zip((q.grad, k.grad, v.grad), (q2.grad, k2.grad, v2.grad)):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3)


def test_disable_restores_plain_inductor():
    torch_flash_v100.enable(force=True)
    torch_flash_v100.enable(force=True)  # idempotent
    torch_flash_v100.disable()
    torch_flash_v100.disable()  # idempotent
    assert not is_enabled()
    reset()
    with fresh_cache():
        q, k, v, keep = _inputs()
        out, codes = run_and_get_code(torch.compile(attn), q, k, v, keep)
    assert counters["flashv100"]["fused_attention"] == 0
    assert not any("flashv100" in c for c in codes)
    torch.testing.assert_close(out, attn(q, k, v, keep), atol=2e-5, rtol=1e-4)


class _UserPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "user-pass-v1"


def test_enable_chains_user_pass():
    import torch._inductor.config as cfg
    user = _UserPass()
    old = cfg.pre_grad_custom_pass
    cfg.pre_grad_custom_pass = user
    try:
        torch_flash_v100.enable()
        torch_flash_v100.enable(force=True)  # re-enable with another setting: still one wrapper
        p = cfg.pre_grad_custom_pass
        assert isinstance(p, FlashV100Pass) and p.force and p.previous is user
        graph = torch.fx.symbolic_trace(lambda x: x + 1).graph
        p(graph)
        assert user.calls == 1  # the user's pass still runs
        assert p.uuid() is not None and p.uuid() != FlashV100Pass(force=True).uuid()
        torch_flash_v100.disable()
        assert cfg.pre_grad_custom_pass is user
    finally:
        cfg.pre_grad_custom_pass = old


def test_uuid_is_stable():
    assert FlashV100Pass(force=True).uuid() == FlashV100Pass(force=True).uuid()
    assert FlashV100Pass(force=False).uuid() != FlashV100Pass(force=True).uuid()


def test_fx_graph_cache_hit(enabled):
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig
    with fresh_cache(), iconfig.patch(fx_graph_cache=True), \
            fconfig.patch(enable_autograd_cache=True):
        q, k, v, keep = _inputs()
        reset()
        out1, (code1,) = run_and_get_code(torch.compile(attn), q, k, v, keep)
        assert counters["flashv100"]["fused_attention"] == 1
        reset()
        out2, (code2,) = run_and_get_code(torch.compile(attn), q, k, v, keep)
        hits = counters["inductor"]["fxgraph_cache_hit"] + \
            counters["aot_autograd"]["autograd_cache_hit"]
        assert hits >= 1, dict(counters["inductor"])
        assert "flashv100._attention_forward" in code2
        torch.testing.assert_close(out1, out2)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("path", ["enable", "backend"])
def test_warm_cache_counts_and_logs_fused_sites(path, train, monkeypatch, tmp_path, caplog):
    # a new process on a warm cache: Dynamo reset, the FX graph / AOTAutograd caches hit, and the
    # counter, the log and history still say which sites were fused
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    caplog.set_level(logging.INFO, logger="torch_flash_v100.compile")
    if path == "enable":
        torch_flash_v100.enable(force=True)
        compiler = torch.compile
    else:
        be = torch_flash_v100.backend(force=True)

        def compiler(fn):
            return torch.compile(fn, backend=be)
    runs = []
    try:
        with iconfig.patch(fx_graph_cache=True), fconfig.patch(enable_autograd_cache=True):
            for _ in ("cold", "warm"):
                reset()
                caplog.clear()
                q, k, v, keep = _inputs(train)
                out = compiler(attn)(q, k, v, keep)
                if train:
                    out.sum().backward()
                torch.testing.assert_close(out, attn(q, k, v, keep), atol=2e-5, rtol=1e-4)
                logged = [r.getMessage() for r in caplog.records
                          if r.getMessage().startswith("flashv100: rewritten")]
                runs.append((counters["flashv100"]["fused_attention"], len(logged),
                             [h[1] for h in history],
                             counters["inductor"]["fxgraph_cache_hit"]
                             + counters["aot_autograd"]["autograd_cache_hit"]))
    finally:
        if path == "enable":
            torch_flash_v100.disable()
    (cold_fused, cold_logged, cold_history, cold_hits), (fused, logged, hist, hits) = runs
    assert cold_hits == 0 and hits >= 1, runs
    assert cold_fused == fused == 1 and cold_logged == logged == 1, runs
    assert cold_history == hist == [True], runs


def test_enable_runs_pre_grad_passes_on_cache_hits():
    import torch._inductor.config as iconfig
    if not hasattr(iconfig, "pre_grad_pass_timing"):
        pytest.skip("torch < 2.13 always runs pre-grad passes before the cache lookup")
    assert iconfig.pre_grad_pass_timing == "default"
    torch_flash_v100.enable()
    try:
        assert iconfig.pre_grad_pass_timing == "early"
    finally:
        torch_flash_v100.disable()
    assert iconfig.pre_grad_pass_timing == "default"
    with iconfig.patch(pre_grad_pass_timing="late"):  # the user's choice stays
        torch_flash_v100.enable()
        try:
            assert iconfig.pre_grad_pass_timing == "late"
        finally:
            torch_flash_v100.disable()
        assert iconfig.pre_grad_pass_timing == "late"


def test_dynamic_shapes_inductor(enabled):
    reset()
    with fresh_cache():
        compiled = torch.compile(attn, dynamic=True)
        for L in (8, 12):
            q, k, v = qkv(l=L)
            keep = torch.ones(2, L, dtype=torch.bool, device=DEVICE)
            torch.testing.assert_close(compiled(q, k, v, keep), attn(q, k, v, keep),
                                       atol=2e-5, rtol=1e-4)
    assert counters["flashv100"]["fused_attention"] == 1  # one graph for both lengths


def attn_head_dim_scale(q, k, v, keep):
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # symbolic when dynamic
    s = s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)
    return s.softmax(-1) @ v


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_dynamic_shapes_training(compiler):
    # the user-facing backend, as users train with it: one graph for both shapes, gradients
    # equal to eager
    reset()
    with fresh_cache():
        be = torch_flash_v100.backend(force=True, compiler=compiler)
        compiled = torch.compile(attn_head_dim_scale, backend=be, dynamic=True)
        for L, E in ((8, 16), (12, 8)):
            q, k, v = (t.requires_grad_() for t in qkv(l=L, e=E))
            keep = torch.ones(2, L, dtype=torch.bool, device=DEVICE)
            keep[1, -3:] = False
            out = compiled(q, k, v, keep)
            q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
            ref = attn_head_dim_scale(q2, k2, v2, keep)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
            grad_out = torch.randn_like(ref)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            ref_grads = torch.autograd.grad(ref, (q2, k2, v2), grad_out)
            for a, b in zip(grads, ref_grads):
                torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3)
    assert counters["flashv100"]["fused_attention"] == 1


@pytest.mark.skipif(DEVICE != "cpu", reason="device gating is checked on CPU")
def test_backend_by_name_respects_device_gating(caplog):
    caplog.set_level(logging.INFO, logger="torch_flash_v100.compile")
    reset()
    with fresh_cache():
        q, k, v, keep = _inputs()
        out = torch.compile(attn, backend="flashv100")(q, k, v, keep)
    assert counters["flashv100"]["fused_attention"] == 0  # CPU is not targeted by default
    assert any("not targeted" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out, attn(q, k, v, keep), atol=2e-5, rtol=1e-4)


def test_backend_with_options():
    reset()
    q, k, v, keep = _inputs()
    be = torch_flash_v100.backend(force=True, compiler="aot_eager")
    out = torch.compile(attn, backend=be)(q, k, v, keep)
    assert counters["flashv100"]["fused_attention"] == 1
    torch.testing.assert_close(out, attn(q, k, v, keep), atol=2e-5, rtol=1e-4)


def test_backend_force_inductor():
    reset()
    with fresh_cache():
        q, k, v, keep = _inputs()
        out, codes = run_and_get_code(
            torch.compile(attn, backend=torch_flash_v100.backend(force=True)), q, k, v, keep)
    assert counters["flashv100"]["fused_attention"] == 1
    assert any("flashv100._attention_forward" in c for c in codes)
    torch.testing.assert_close(out, attn(q, k, v, keep), atol=2e-5, rtol=1e-4)


def test_activation_checkpointed_attention():
    from torch.utils.checkpoint import checkpoint

    from compile_testing import check

    def fn(q, k, v, keep):
        return checkpoint(attn, q, k, v, keep, use_reentrant=False) * 2

    check(fn, _inputs(), train=True)
