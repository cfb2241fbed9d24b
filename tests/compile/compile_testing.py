"""Shared helpers for the torch.compile pass tests (CPU, force=True).

``check(fn, args, train=...)`` compiles ``fn`` with ``torch_flash_v100.backend(force=True)`` over
AOTAutograd set up as the "aot_eager" backend (and Inductor) set it up, with graph-capturing
compilers (cheap: no Inductor codegen), and asserts:
the counter, the fused ops in the forward graph (``flashv100.attention``, or the
FlashAttention-2 op for windows, soft-capping and ALiBi) and their backward ops in the backward
graph, with no unfused softmax left, and eager-vs-compiled equality of outputs and gradients.
"""

from __future__ import annotations

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import torch_flash_v100
from torch_flash_v100.compile import history

try:
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
except ImportError:  # pragma: no cover
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

ATTN = torch.ops.flashv100.attention.default
FLASH = torch.ops.flashv100._flash_forward.default
FLASH_ARGS = ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
              "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_left",
              "window_right", "softcap", "alibi_slopes")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Capture:
    """A torch.compile backend: ``torch_flash_v100.backend(force)`` -> AOTAutograd, keeping the
    graphs (Dynamo's after the rewrite, AOTAutograd's forward and backward)."""

    def __init__(self, force: bool = True):
        self.force = force
        self.dynamo: list[torch.fx.GraphModule] = []
        self.fw: list[torch.fx.GraphModule] = []
        self.bw: list[torch.fx.GraphModule] = []

    def backend(self):
        def fw(gm, ex):
            self.fw.append(gm)
            return make_boxed_func(gm.forward)

        def bw(gm, ex):
            self.bw.append(gm)
            return make_boxed_func(gm.forward)

        # aot_eager's settings; Inductor partitions with min-cut too (the default partitioner is
        # not what users run, and some torch versions fail on dynamic shapes in it)
        aot = aot_autograd(fw_compiler=fw, bw_compiler=bw,
                           partition_fn=min_cut_rematerialization_partition,
                           keep_inference_input_mutations=True)

        def keep_rewritten(gm, example_inputs):
            self.dynamo.extend(m for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
            return aot(gm, example_inputs)

        return torch_flash_v100.backend(force=self.force, compiler=keep_rewritten)

    def attention_calls(self) -> list[dict]:
        """The flashv100.attention calls in the rewritten Dynamo graphs, arguments by name."""
        calls = []
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        for gm in self.dynamo:
            for n in gm.graph.nodes:
                if n.op == "call_function" and n.target is ATTN:
                    d = dict(zip(names, n.args))
                    d.update(n.kwargs)
                    d.setdefault("attn_mask", None)
                    d.setdefault("dropout_p", 0.0)
                    d.setdefault("is_causal", False)
                    d.setdefault("enable_gqa", False)
                    d["node"] = n
                    calls.append(d)
        return calls

    def flash_calls(self) -> list[dict]:
        """The FlashAttention-2 op calls in the rewritten Dynamo graphs, arguments by name."""
        return [dict(zip(FLASH_ARGS, n.args), node=n) for gm in self.dynamo
                for n in gm.graph.nodes if n.op == "call_function" and n.target is FLASH]

    def fused_calls(self) -> int:
        return len(self.attention_calls()) + len(self.flash_calls())

    def fw_code(self) -> str:
        return "\n".join(gm.code for gm in self.fw)

    def bw_code(self) -> str:
        return "\n".join(gm.code for gm in self.bw)


def reset():
    torch._dynamo.reset()
    counters.clear()
    history.clear()


def _clone(args, train):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            c = a.detach().clone()
            if train and c.is_floating_point() and getattr(a, "_grad_wanted", True):
                c.requires_grad_(True)
            out.append(c)
        else:
            out.append(a)
    return out


def no_grad_input(t: torch.Tensor) -> torch.Tensor:
    """Mark a test input (e.g. a float mask) as not needing a gradient in training checks."""
    t._grad_wanted = False
    return t


def _flat(o):
    if isinstance(o, torch.Tensor):
        return [o]
    if isinstance(o, (tuple, list)):
        return [t for x in o for t in _flat(x)]
    return []


def check(fn, args, *, train: bool, fused: int = 1, dynamic: bool = False,
          atol: float = 2e-5, rtol: float = 1e-4, compare: bool = True) -> Capture:
    """Compile ``fn`` and check rewrite + numerics; returns the Capture for further asserts."""
    reset()
    cap = Capture()
    args_c = _clone(args, train)
    args_e = _clone(args, train)
    compiled = torch.compile(fn, backend=cap.backend(), dynamic=dynamic, fullgraph=True)
    torch.manual_seed(0)
    out_c = compiled(*args_c)
    torch.manual_seed(0)
    out_e = fn(*args_e)
    got = counters["flashv100"]["fused_attention"]
    assert got == fused, f"fused {got} sites, expected {fused}: {history}"
    assert cap.fused_calls() == fused
    fw = cap.fw_code()
    assert forward_ops(fw) == fused, fw
    if fused:
        assert "_softmax" not in fw, fw
    oc, oe = _flat(out_c), _flat(out_e)
    if compare:
        for a, b in zip(oc, oe):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    if train:
        inputs_c = [a for a in args_c if isinstance(a, torch.Tensor) and a.requires_grad]
        inputs_e = [a for a in args_e if isinstance(a, torch.Tensor) and a.requires_grad]
        grads_out = [torch.randn_like(o) for o in oe]
        gc = torch.autograd.grad(oc, inputs_c, grads_out, allow_unused=True)
        ge = torch.autograd.grad(oe, inputs_e, grads_out, allow_unused=True)
        bw = cap.bw_code()
        assert backward_ops(bw) == fused, bw
        if fused:
            assert "_softmax_backward_data" not in bw, bw
        if compare:
            for a, b in zip(gc, ge):
                if a is None or b is None:
                    assert a is None and b is None
                    continue
                torch.testing.assert_close(a, b, atol=atol * 10, rtol=rtol * 10)
    return cap


def forward_ops(code: str) -> int:
    """The fused forward ops in AOTAutograd's forward graph code."""
    return code.count("flashv100._attention_forward") + code.count("flashv100._flash_forward")


def backward_ops(code: str) -> int:
    return code.count("flashv100._attention_backward") + code.count("flashv100._flash_backward")


def check_not_rewritten(fn, args, *, reason: str, train: bool = False, force: bool = True):
    """Nothing rewritten, results unchanged, and the logged reason contains ``reason``."""
    reset()
    cap = Capture(force=force)
    args_c = _clone(args, train)
    args_e = _clone(args, train)
    out_c = torch.compile(fn, backend=cap.backend(), fullgraph=True)(*args_c)
    out_e = fn(*args_e)
    assert counters["flashv100"]["fused_attention"] == 0, history
    assert not cap.fused_calls()
    assert "flashv100" not in cap.fw_code()
    for a, b in zip(_flat(out_c), _flat(out_e)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    reasons = [h[2] for h in history if not h[1]]
    assert reasons, "no site was considered"
    assert any(reason in r for r in reasons), reasons
    return cap


def scores(q, k):
    """q @ k^T scaled by 0.25: the scores of the hand-written attention test models."""
    return torch.matmul(q, k.transpose(-2, -1)) * 0.25


def query_key_positions(s):
    """Column of query indices i and row of key indices j of scores s, for mask spellings."""
    i = torch.arange(s.size(-2), device=s.device)[:, None]
    j = torch.arange(s.size(-1), device=s.device)[None, :]
    return i, j


def assert_parameter_grads_close(out_c, out_e, params, grad_out):
    """The gradients of every parameter through the compiled and the eager output, relative to
    the gradient's scale: tiny random models have ill-conditioned layer norms (DeiT's
    zero-initialised tokens give 1e6-sized gradients)."""
    gc = torch.autograd.grad(out_c, params, grad_out, allow_unused=True)
    ge = torch.autograd.grad(out_e, params, grad_out, allow_unused=True)
    for a, b in zip(gc, ge):
        if a is not None and b is not None:
            scale = max(b.abs().max().item(), 1.0)
            torch.testing.assert_close(a, b, atol=5e-4 * scale, rtol=1e-3)


def qkv(b=2, h=4, l=8, s=None, e=16, ev=None, hk=None, dtype=torch.float32, layout="bhld",
        seed=0):
    """Random q, k, v; layout "bhld" ([B, H, L, E]) or "blhd" ([B, L, H, E])."""
    g = torch.Generator().manual_seed(seed)
    s = s or l
    hk = hk or h
    ev = ev or e

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(DEVICE, dtype)

    if layout == "bhld":
        return r(b, h, l, e), r(b, hk, s, e), r(b, hk, s, ev)
    return r(b, l, h, e), r(b, s, hk, e), r(b, s, hk, ev)
