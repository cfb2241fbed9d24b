"""``python -m torch_flash_v100``: a short demo, and the ``bench``, ``info``, ``explain``, ``e2e`` tools.

With no arguments it runs the demo on the best available device (CUDA if present, else CPU):
build info and the kernel path, the op against SDPA and an fp64 reference, a small model compiled
with the flashv100 pass (how many attention sites were fused), and a small side-by-side
speed/memory table. It takes about a minute on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._measure import peak_memory_mb, time_fn
from .reference import naive_attention

EPILOG = """\
examples:
  python -m torch_flash_v100                      # the demo (best device; CPU if no GPU)
  python -m torch_flash_v100 info                 # build, device and kernel-path information
  python -m torch_flash_v100 explain              # attention sites of demo models, fused or why not
  python -m torch_flash_v100 bench --suite quick  # side-by-side benchmark
  python -m torch_flash_v100 bench --suite seed --device cuda \\
      --json benchmarks/results/seed.json --plot benchmarks/results/seed.png
  python -m torch_flash_v100 e2e --steps 5        # small GPT: eager vs torch.compile vs the pass
  python -m torch_flash_v100 hf --models tiny     # transformers Llama: our backend vs sdpa vs eager
"""

COMPILE_LOGGER = "torch_flash_v100.compile"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------

def _p(*a, **k):
    print(*a, **k, flush=True)


def _section(title: str):
    _p("")
    _p(f"== {title} " + "=" * max(0, 72 - len(title)))


def best_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _device(arg: Optional[str]) -> torch.device:
    d = torch.device(arg) if arg else best_device()
    if d.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: CUDA requested but torch.cuda.is_available() is False")
    return d


def _dtype(arg: Optional[str], device: torch.device) -> torch.dtype:
    if arg:
        return DTYPES[arg]
    return torch.float16 if device.type == "cuda" else torch.float32


def _dname(dt: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dt, str(dt))


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in head]] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(head))]
    out = []
    for j, r in enumerate(cells):
        out.append("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)))
        if j == 0:
            out.append("  ".join("-" * x for x in w))
    return "\n".join(out)


def _load_package():
    import torch_flash_v100 as tfv

    return tfv


def _load_compile():
    """The torch.compile integration: (module, None) or (None, why)."""
    try:
        mod = importlib.import_module("torch_flash_v100.compile")
    except Exception as e:
        return None, f"torch_flash_v100.compile is not available ({type(e).__name__}: {e})"
    if not hasattr(mod, "backend"):
        return None, "torch_flash_v100.compile has no backend() (incomplete build?)"
    return mod, None


def _time_ms(fn: Callable[[], Any], device: torch.device, budget_s: float = 0.5,
             setup: Optional[Callable[[], None]] = None) -> float:
    """Median ms over the repetitions that fit ``budget_s``."""
    return time_fn(fn, device, budget_s, setup=setup, max_reps=50)["ms"]


# ------------------------------------------------------------------------------------------------
# demo models (eager attention as real models write it)
# ------------------------------------------------------------------------------------------------

class GPTAttention(nn.Module):
    """GPT-2 style: causal + padding mask by masked_fill, softmax, dropout, matmul."""

    def __init__(self, d: int = 64, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.dh))
        keep = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if pad_mask is not None:  # [B, T] True = real token
            keep = keep & pad_mask[:, None, None, :]
        att = att.masked_fill(~keep, float("-inf"))
        att = torch.softmax(att, dim=-1)
        att = self.drop(att)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class BertAttention(nn.Module):
    """BERT style: additive padding mask (1 - mask) * -10000, division by sqrt(d)."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, pad_mask):
        B, T, C = x.shape
        sh = lambda t: t.view(B, T, self.h, self.dh).transpose(1, 2)  # noqa: E731
        q, k, v = sh(self.q(x)), sh(self.k(x)), sh(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dh)
        ext = (1.0 - pad_mask[:, None, None, :].to(x.dtype)) * -10000.0
        probs = F.softmax(scores + ext, dim=-1)
        return self.o(torch.matmul(probs, v).transpose(1, 2).reshape(B, T, C))


class LlamaAttention(nn.Module):
    """LLaMA style: GQA through repeat_kv, causal additive mask, softmax in fp32."""

    def __init__(self, d: int = 64, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.h, self.kvh, self.dh = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.dh, bias=False)
        self.v = nn.Linear(d, kv_heads * self.dh, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.h, self.dh).transpose(1, 2)
        k = self.k(x).view(B, T, self.kvh, self.dh).transpose(1, 2)
        v = self.v(x).view(B, T, self.kvh, self.dh).transpose(1, 2)
        n_rep = self.h // self.kvh
        k = k[:, :, None].expand(B, self.kvh, n_rep, T, self.dh).reshape(B, self.h, T, self.dh)
        v = v[:, :, None].expand(B, self.kvh, n_rep, T, self.dh).reshape(B, self.h, T, self.dh)
        w = torch.matmul(q, k.transpose(2, 3)) * self.dh ** -0.5
        causal = torch.full((T, T), torch.finfo(x.dtype).min, device=x.device).triu(1)
        w = w + causal
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o(torch.matmul(w, v).transpose(1, 2).reshape(B, T, C))


class SDPAAttention(nn.Module):
    """A module that already calls F.scaled_dot_product_attention (causal)."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class ClassifierHead(nn.Module):
    """A softmax that is not attention (the pass must leave it alone)."""

    def __init__(self, d: int = 64, classes: int = 10):
        super().__init__()
        self.fc = nn.Linear(d, classes)

    def forward(self, x, pad_mask=None):
        return torch.softmax(self.fc(x), dim=-1)


class DemoGPT(nn.Module):
    """Two pre-norm GPT blocks with eager attention: two attention sites."""

    def __init__(self, vocab: int = 128, d: int = 64, heads: int = 4, layers: int = 2, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "ln1": nn.LayerNorm(d), "attn": GPTAttention(d, heads, dropout),
                "ln2": nn.LayerNorm(d), "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)),
            }))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, pad_mask=None):
        x = self.emb(idx)
        for b in self.blocks:
            x = x + b["attn"](b["ln1"](x), pad_mask)
            x = x + b["mlp"](b["ln2"](x))
        return self.head(self.ln(x))


EXPLAIN_MODELS: Dict[str, Callable[[], nn.Module]] = {
    "gpt2-style (masked_fill causal+padding, dropout)": lambda: GPTAttention(dropout=0.1),
    "bert-style (additive padding mask, / sqrt(d))": BertAttention,
    "llama-style (repeat_kv GQA, fp32 softmax, additive causal)": LlamaAttention,
    "sdpa call (is_causal=True)": SDPAAttention,
    "classifier softmax (not attention)": ClassifierHead,
}


# ------------------------------------------------------------------------------------------------
# compile helpers
# ------------------------------------------------------------------------------------------------

class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records: List[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def messages(self) -> List[str]:
        out = []
        for r in self.records:
            try:
                out.append(r.getMessage())
            except Exception:
                out.append(str(r.msg))
        return out


@contextlib.contextmanager
def capture_compile_log():
    log = logging.getLogger(COMPILE_LOGGER)
    h = _Capture()
    old = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(h)
    try:
        yield h
    finally:
        log.removeHandler(h)
        log.setLevel(old)


def _fused_counter() -> int:
    from torch._dynamo.utils import counters

    return int(counters["flashv100"]["fused_attention"])


def _reset_counters():
    from torch._dynamo.utils import counters

    counters.clear()
    torch._dynamo.reset()


def compile_with_pass(model: nn.Module, cmod, compiler: str = "inductor") -> nn.Module:
    """torch.compile with the flashv100 pass, forced on (so it also rewrites on CPU / non-V100),
    then ``compiler`` ("inductor", "aot_eager", "eager": the pass runs before autograd either way)."""
    be = cmod.backend(force=True, compiler=compiler)
    return torch.compile(model, backend=be)


# ------------------------------------------------------------------------------------------------
# info
# ------------------------------------------------------------------------------------------------

def _sdpa_backends(device: torch.device) -> Dict[str, str]:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:
        return {"all": f"unavailable ({e})"}
    out = {}
    dt = torch.float16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 2, 16, 64, device=device, dtype=dt)
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        b = getattr(SDPBackend, name, None)
        if b is None:
            out[name] = "not in this torch"
            continue
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with sdpa_kernel([b]):
                    F.scaled_dot_product_attention(q, q, q)
            out[name] = "available"
        except Exception:
            out[name] = "not available on this device"
    return out


def _opt_version(mod: str) -> str:
    try:
        m = importlib.import_module(mod)
        return getattr(m, "__version__", "installed")
    except Exception:
        return "not installed"


def _compiled_archs(build: Dict[str, Any]) -> List[str]:
    """The sm numbers ("70", "80", ...) this build has CUDA kernels for."""
    return [a for a in str(build.get("cuda_archs") or "").replace(" ", ";").split(";") if a]


def cmd_info(args) -> int:
    tfv = _load_package()
    _p(f"torch-flash-v100 {getattr(tfv, '__version__', '?')}  ({Path(tfv.__file__).parent})")
    _section("build")
    build = tfv.build_info()
    archs = _compiled_archs(build)
    if archs:
        _p(f"  CUDA kernels: built for {', '.join(f'sm_{a}' for a in archs)} "
           f"(CUDA {build['cuda_version']})")
    else:
        _p("  CUDA kernels: not built (CPU kernels only; `pip install -v` shows CMake's reason)")
    note = tfv._cuda_kernels_missing_note(build)
    if note:
        _p(f"  WARNING: {note}")
    for k, v in build.items():
        _p(f"  {k}: {v}")
    _section("runtime")
    _p(f"  python {platform.python_version()} on {platform.platform()}")
    _p(f"  torch {torch.__version__} (CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()})")
    _p(f"  cpu threads: {torch.get_num_threads()} (os cpus: {os.cpu_count()})")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    try:
        _p(f"  force_volta_atom: {tfv.force_volta_atom()}  (set_force_volta_atom / FLASHV100_FORCE_VOLTA=1)")
    except Exception as e:
        _p(f"  force_volta_atom: unknown ({e})")
    _section("devices and kernel paths")
    for d in devices:
        name = "cpu"
        if d.type == "cuda":
            p = torch.cuda.get_device_properties(d)
            name = f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
        try:
            kp = tfv.kernel_path(d)
        except Exception as e:
            kp = f"error: {e}"
        line = f"  {d}: {name}\n      kernel path: {kp}"
        if d.type == "cuda" and archs:
            sm = "%d%d" % torch.cuda.get_device_capability(d)
            if sm not in archs:
                line += (f"\n      note: sm_{sm} is not among the compiled archs (only a +PTX "
                         f"arch below it can run here); rebuild with "
                         f"TORCH_CUDA_ARCH_LIST={sm[:-1]}.{sm[-1]}")
        if d.type == "cuda":
            try:
                with tfv.volta_atom(True):
                    line += f"; forced Volta: {tfv.kernel_path(d)}"
            except Exception:
                pass
        _p(line)
        _p("      SDPA backends: " + ", ".join(f"{k.lower()}: {v}" for k, v in _sdpa_backends(d).items()))
    _section("integrations and optional dependencies")
    cmod, why = _load_compile()
    status = "available (dynamo backend 'flashv100')" if cmod else why
    _p(f"  torch.compile pass: {status}")
    for m in ("matplotlib", "tqdm", "triton"):
        _p(f"  {m}: {_opt_version(m)}")
    return 0


# ------------------------------------------------------------------------------------------------
# explain
# ------------------------------------------------------------------------------------------------

def explain_models(device: torch.device, training: bool, models: Optional[Dict[str, Callable[[], nn.Module]]] = None,
                   T: int = 16, B: int = 2, d: int = 64, compiler: str = "eager",
                   compare_inductor: bool = False) -> List[Dict[str, Any]]:
    """Compile each demo model with the pass; return per model: fused count and the pass's log."""
    cmod, why = _load_compile()
    if cmod is None:
        raise RuntimeError(why)
    results = []
    for name, make in (models or EXPLAIN_MODELS).items():
        torch.manual_seed(0)
        m = make().to(device)
        m.train(training)
        x = torch.randn(B, T, d, device=device, requires_grad=training)
        pad = torch.ones(B, T, dtype=torch.bool, device=device)
        pad[1, T - 3:] = False
        _reset_counters()
        entry: Dict[str, Any] = {"model": name}
        with capture_compile_log() as cap:
            try:
                cm = compile_with_pass(m, cmod, compiler)
                if training:
                    cm(x, pad).sum().backward()
                else:
                    with torch.no_grad():
                        cm(x, pad)
                entry["error"] = None
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        entry["fused"] = _fused_counter()
        entry["log"] = cap.messages()
        if compare_inductor:
            entry["inductor_fused"] = _inductor_fusions(make, device, training, x, pad)
        results.append(entry)
    return results


def _inductor_fusions(make, device, training, x, pad):
    """How many attention sites plain torch.compile (Inductor's own SDPA patterns) fuses."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    m = make().to(device)
    m.train(training)
    _reset_counters()
    try:
        cm = torch.compile(m)
        if training:
            cm(x, pad).sum().backward()
        else:
            with torch.no_grad():
                cm(x, pad)
    except Exception as e:
        return f"error: {type(e).__name__}"
    return int(counters["inductor"]["fuse_attention"])


def cmd_explain(args) -> int:
    device = _device(args.device)
    cmod, why = _load_compile()
    if cmod is None:
        _p(f"explain needs the torch.compile integration: {why}")
        return 1
    training = not args.inference
    _p(f"Attention sites of demo models compiled with the flashv100 pass on {device} "
       f"({'training: joint forward+backward graph' if training else 'inference'})")
    _p(f"(the pass logs one line per softmax site to the logger {COMPILE_LOGGER!r})")
    results = explain_models(device, training, compiler=args.compiler, compare_inductor=args.compare_inductor)
    for r in results:
        _section(r["model"])
        if r["error"]:
            _p(f"  compile/run failed: {r['error']}")
        _p(f"  fused attention sites: {r['fused']}"
           + (f"   (plain torch.compile: counters['inductor']['fuse_attention'] = {r['inductor_fused']})" if "inductor_fused" in r else ""))
        if r["log"]:
            for msg in r["log"]:
                _p(f"  - {msg}")
        else:
            _p("  - (the pass logged nothing for this model)")
    fused = sum(r["fused"] for r in results)
    sites = sum(len(r["log"]) for r in results)
    _p("")
    _p(f"summary: {fused} of {sites} softmax/SDPA sites rewritten to flashv100.attention "
       f"across {len(results)} models ({sum(1 for r in results if r['error'])} failed to compile)")
    return 0


# ------------------------------------------------------------------------------------------------
# the demo
# ------------------------------------------------------------------------------------------------

def _max_err(x, ref) -> float:
    return float((x.detach().double() - ref).abs().max())


def demo_accuracy(tfv, device: torch.device, dtype: torch.dtype) -> List[List[Any]]:
    rows = []
    cases = [
        ("causal B2 H8 L256 E64", dict(B=2, H=8, Hkv=8, L=256, S=256, E=64), dict(is_causal=True)),
        ("GQA 8/2 + padding mask, L200 S300 E40", dict(B=2, H=8, Hkv=2, L=200, S=300, E=40), dict(mask=True)),
    ]
    g = torch.Generator().manual_seed(0)
    for title, s, kw in cases:
        q = torch.randn(s["B"], s["H"], s["L"], s["E"], generator=g).to(device, dtype)
        k = torch.randn(s["B"], s["Hkv"], s["S"], s["E"], generator=g).to(device, dtype)
        v = torch.randn(s["B"], s["Hkv"], s["S"], s["E"], generator=g).to(device, dtype)
        do = torch.randn(s["B"], s["H"], s["L"], s["E"], generator=g).to(device, dtype)
        mask = None
        if kw.get("mask"):
            mask = torch.ones(s["B"], 1, 1, s["S"], dtype=torch.bool, device=device)
            mask[1, ..., s["S"] - 57:] = False
        causal = kw.get("is_causal", False)
        gqa = s["H"] != s["Hkv"]

        def grads(fn, cast=None):
            ins = [t.detach().clone() if cast is None else t.detach().to(cast) for t in (q, k, v)]
            for t in ins:
                t.requires_grad_()
            out = fn(*ins)
            out.backward(do if cast is None else do.to(cast))
            return out.detach(), ins[0].grad, ins[1].grad, ins[2].grad

        ref = grads(lambda a, b, c: tfv.reference_attention(a, b, c, attn_mask=mask, is_causal=causal,
                                                            enable_gqa=gqa), cast=torch.float64)
        impls = [
            ("flashv100", lambda a, b, c: tfv.attention(a, b, c, attn_mask=mask, is_causal=causal, enable_gqa=gqa)),
            ("SDPA", lambda a, b, c: _sdpa(a, b, c, mask, causal)),
            (f"naive {_dname(dtype)}", lambda a, b, c: naive_attention(a, b, c, mask, causal)),
        ]
        for name, fn in impls:
            try:
                got = grads(fn)
                rows.append([title, name] + [f"{_max_err(x, r):.1e}" for x, r in zip(got, ref)])
            except Exception as e:
                rows.append([title, name, f"error: {type(e).__name__}: {str(e)[:60]}", "", "", ""])
    return rows


def _accuracy_verdict(rows: List[List[Any]], dtype: torch.dtype) -> str:
    """FlashAttention-2-style check: flashv100's error vs fp64 within 2x (+ a small floor) of the
    error of plain PyTorch math (the naive row) in the same dtype."""
    floor = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-3)
    verdicts = []
    for case in dict.fromkeys(r[0] for r in rows):
        by = {r[1]: r for r in rows if r[0] == case}
        fl = by.get("flashv100")
        nv = next((r for n, r in by.items() if n.startswith("naive")), None)
        try:
            ok = all(float(a) <= 2 * float(b) + floor for a, b in zip(fl[2:], nv[2:]))
        except (TypeError, ValueError):
            ok = False
        verdicts.append(f"{case}: {'OK' if ok else 'CHECK'}")
    return ("  flashv100 error within 2x of eager PyTorch math in the same dtype: " + "; ".join(verdicts))


def _sdpa(q, k, v, mask, causal):
    if q.size(-3) != k.size(-3):
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        except TypeError:  # torch without enable_gqa
            r = q.size(-3) // k.size(-3)
            k, v = k.repeat_interleave(r, -3), v.repeat_interleave(r, -3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def demo_compile(device: torch.device, steps: int = 2, compiler: str = "inductor") -> Dict[str, Any]:
    """Train a 2-layer GPT with eager attention for a few steps, eager vs compiled with the pass."""
    cmod, why = _load_compile()
    if cmod is None:
        return {"error": why}
    torch.manual_seed(0)
    T, B = (128, 8) if device.type == "cuda" else (64, 4)
    eager = DemoGPT(layers=2).to(device)
    comp = DemoGPT(layers=2).to(device)
    comp.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 128, (B, T), device=device)
    pad = torch.ones(B, T, dtype=torch.bool, device=device)
    pad[0, T - 10:] = False
    _reset_counters()
    res: Dict[str, Any] = {"sites": 2}
    with capture_compile_log() as cap:
        cm = compile_with_pass(comp, cmod, compiler)
        opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
        opt_c = torch.optim.SGD(comp.parameters(), lr=0.1)
        losses_e, losses_c = [], []
        t0 = time.perf_counter()
        for i in range(steps):
            for model, fn, opt, losses in ((eager, eager, opt_e, losses_e), (comp, cm, opt_c, losses_c)):
                opt.zero_grad(set_to_none=True)
                logits = fn(idx, pad)
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, 128), idx[:, 1:].reshape(-1))
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
            if i == 0:
                res["first_step_s"] = time.perf_counter() - t0
    res["fused"] = _fused_counter()
    res["log"] = cap.messages()
    res["losses_eager"], res["losses_pass"] = losses_e, losses_c
    res["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses_e, losses_c))
    return res


def demo_speed(tfv, device: torch.device, dtype: torch.dtype, budget_s: float) -> Tuple[str, List[List[Any]]]:
    if device.type == "cuda":
        B, H, L, E = 4, 16, 2048, 64
    else:
        B, H, L, E = 1, 4, 512, 64
    causal = True
    title = f"B{B} H{H} L{L} E{E} causal {_dname(dtype)} on {device}"
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, L, E, generator=g).to(device, dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    fl = 4.0 * B * H * L * L * E / 2  # causal: half

    def zero():
        q.grad = k.grad = v.grad = None

    impls = [
        ("flashv100", lambda: tfv.attention(q, k, v, is_causal=causal)),
        ("SDPA (default backend)", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
        (f"naive {_dname(dtype)}", lambda: naive_attention(q, k, v, is_causal=causal)),
        ("naive, fp32 softmax", lambda: naive_attention(q, k, v, is_causal=causal, fp32_softmax=True)),
    ]
    rows = []
    base = None
    per = budget_s / (2 * len(impls))
    for name, fn in impls:
        try:
            zero()
            mem = peak_memory_mb(lambda: fn().backward(do), device)
            zero()
            fwd = _time_ms(fn, device, per)
            fb = _time_ms(lambda: fn().backward(do), device, per, setup=zero)
            zero()
            if base is None:
                base = fb
            rows.append([name, f"{fwd:.2f}", f"{fb:.2f}", f"{fl * 3.5 / (fb * 1e-3) / 1e9:.2f}" if fb else "-",
                         "-" if mem is None else f"{mem:.1f}", f"{fb / base:.2f}x"])
        except Exception as e:
            rows.append([name, f"error: {type(e).__name__}", "", "", "", ""])
    return title, rows


def cmd_demo(args) -> int:
    t_start = time.perf_counter()
    tfv = _load_package()
    device = _device(args.device)
    note = None
    if device.type == "cuda" and str(tfv.kernel_path(device)).startswith("unavailable") and not args.device:
        note = f"CUDA device found but {tfv.kernel_path(device)}: the demo runs on the CPU"
        device = torch.device("cpu")
    dtype = _dtype(args.dtype, device)
    _p(f"torch-flash-v100 {tfv.__version__}: FlashAttention-2-class fused attention for V100 (sm_70)")
    if note:
        _p(f"  note: {note}")
    _p("  torch_flash_v100.attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, "
       "enable_gqa=False)\n  = torch.nn.functional.scaled_dot_product_attention semantics, differentiable")

    _section("1. build and device")
    bi = tfv.build_info()
    _p(f"  built against torch {bi.get('torch_version')} | CUDA {bi.get('cuda_version') or 'none'} | "
       f"archs {bi.get('cuda_archs') or 'none'} | running on torch {torch.__version__}")
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        dev = f"{p.name} (sm_{p.major}{p.minor})"
    else:
        dev = f"CPU ({torch.get_num_threads()} threads)" + ("" if torch.cuda.is_available() else "; no CUDA GPU found")
    _p(f"  device: {device} = {dev}, dtype {_dname(dtype)}")
    _p(f"  kernel path: {tfv.kernel_path(device)}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) != (7, 0):
        with tfv.volta_atom(True):
            _p(f"  (forced Volta path for testing on this GPU: {tfv.kernel_path(device)}; "
               f"set_force_volta_atom(True) or FLASHV100_FORCE_VOLTA=1)")

    _section("2. accuracy: max abs error vs the fp64 reference (out, dq, dk, dv)")
    rows = demo_accuracy(tfv, device, dtype)
    _p(_table(["case", "impl", "out", "dq", "dk", "dv"], rows))
    _p(_accuracy_verdict(rows, dtype))

    _section("3. torch.compile: a 2-layer GPT with eager attention, trained 2 steps with the pass")
    if args.no_compile:
        _p("  skipped (--no-compile)")
    else:
        t0 = time.perf_counter()
        compiler = args.compiler or ("inductor" if device.type == "cuda" else "aot_eager")
        _p(f"  torch.compile(model, backend=torch_flash_v100.backend(force=True, compiler={compiler!r}))")
        r = demo_compile(device, compiler=compiler)
        if "error" in r:
            _p(f"  skipped: {r['error']}")
        else:
            _p(f"  attention sites fused by the pass: {r['fused']} of {r['sites']} "
               f"(counters['flashv100']['fused_attention'])")
            for msg in r["log"][:8]:
                _p(f"    {msg}")
            _p(f"  losses eager:     {', '.join(f'{x:.4f}' for x in r['losses_eager'])}")
            _p(f"  losses with pass: {', '.join(f'{x:.4f}' for x in r['losses_pass'])}"
               f"  (max diff {r['max_loss_diff']:.1e})")
            _p(f"  compile + 2 steps: {time.perf_counter() - t0:.1f}s")

    _section("4. speed and memory, side by side")
    _p("  mem = peak extra MB of one fwd+bwd; flashv100 speedup = time(impl) / time(flashv100), fwd+bwd")
    elapsed = time.perf_counter() - t_start
    budget = max(4.0, min(20.0, args.budget - elapsed - 5.0))
    title, rows = demo_speed(tfv, device, dtype, budget)
    _p(f"  {title}")
    _p(_table(["impl", "fwd ms", "fwd+bwd ms", "GFLOP/s f+b", "mem MB", "flashv100 speedup"], rows))
    if device.type == "cpu":
        _p("  (CPU kernels are for correctness and CI; the point of this project is the V100 GPU)")
    _p("")
    _p(f"done in {time.perf_counter() - t_start:.1f}s. Next: `python -m torch_flash_v100 bench --suite quick`, "
       "`python -m torch_flash_v100 explain`, `python -m torch_flash_v100 info`")
    return 0


# ------------------------------------------------------------------------------------------------
# bench / e2e
# ------------------------------------------------------------------------------------------------

def cmd_bench(args) -> int:
    from .bench import cli as bench_cli

    return bench_cli.run(args)


def cmd_e2e(args) -> int:
    from .bench import e2e_gpt

    return e2e_gpt.main(args.rest, prog="python -m torch_flash_v100 e2e")


def cmd_hf(args) -> int:
    from .bench import e2e_hf

    return e2e_hf.main(args.rest, prog="python -m torch_flash_v100 hf")


# ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_flash_v100",
        description="torch-flash-v100: FlashAttention-2-class fused attention for NVIDIA V100 (sm_70). "
                    "Without a command: a short demo on the best available device (about a minute on a CPU).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser("demo", help="the short demo (the default command)",
                       description="Build info and kernel path; the op vs SDPA and an fp64 reference; a small "
                                   "GPT compiled with the flashv100 pass (fused sites); a speed/memory table.")
    _demo_args(d)

    b = sub.add_parser("bench", help="side-by-side benchmark suites",
                       description="flashv100 vs SDPA backends vs naive attention: time, TFLOP/s, memory, "
                                   "errors vs fp64; Markdown to stdout, optional JSON and PNG.")
    from .bench.cli import add_arguments as add_bench_arguments

    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("info", help="build, device, kernel-path and dependency information")
    i.set_defaults(func=cmd_info)

    x = sub.add_parser("explain", help="attention sites of demo models and whether the pass fuses each",
                       description="Compiles small models with typical eager attention code (GPT-2, BERT, LLaMA "
                                   "styles, an SDPA call, a non-attention softmax) with the flashv100 pass and "
                                   "prints, per softmax site, whether it was fused and why not.")
    x.add_argument("--device", default=None, help="cpu or cuda (default: best available)")
    x.add_argument("--inference", action="store_true", help="inference graphs (default: training)")
    x.add_argument("--compiler", default="eager", choices=["eager", "aot_eager", "inductor"],
                   help="what compiles the graph after the pass (default eager: the pass's decisions "
                        "do not depend on it, and it is the fastest)")
    x.add_argument("--compare-inductor", action="store_true",
                   help="also compile each model with plain torch.compile and report how many sites "
                        "Inductor's own attention patterns fuse (slow on CPU: C++ compilation)")
    x.set_defaults(func=cmd_explain)

    e = sub.add_parser("e2e", help="end-to-end small GPT: eager vs torch.compile vs torch.compile + pass",
                       description="Runs torch_flash_v100.bench.e2e_gpt; arguments are passed on "
                                   "(try: e2e --help).", add_help=False)
    e.add_argument("rest", nargs=argparse.REMAINDER)
    e.set_defaults(func=cmd_e2e)

    h = sub.add_parser("hf", help="transformers Llama-style model: flashv100 backend vs sdpa vs eager",
                       description="Runs torch_flash_v100.bench.e2e_hf (training tokens/s, padded and "
                                   "packed; generate tokens/s); arguments are passed on (try: hf --help).",
                       add_help=False)
    h.add_argument("rest", nargs=argparse.REMAINDER)
    h.set_defaults(func=cmd_hf)
    return p


def _demo_args(d: argparse.ArgumentParser):
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    d.add_argument("--dtype", default=None, choices=list(DTYPES), help="default fp16 on CUDA, fp32 on CPU")
    d.add_argument("--no-compile", action="store_true", help="skip the torch.compile part")
    d.add_argument("--compiler", default=None, choices=["eager", "aot_eager", "inductor"],
                   help="backend after the pass (default: inductor on CUDA, aot_eager on CPU, where "
                        "Inductor's C++ compilation alone would take about a minute)")
    d.add_argument("--budget", type=float, default=60.0, help="target seconds for the whole demo (default 60)")
    d.set_defaults(func=cmd_demo)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "e2e":  # everything after `e2e` belongs to bench.e2e_gpt
        return int(cmd_e2e(argparse.Namespace(rest=argv[1:])) or 0)
    if argv and argv[0] == "hf":  # everything after `hf` belongs to bench.e2e_hf
        return int(cmd_hf(argparse.Namespace(rest=argv[1:])) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        tfv = _load_package()
        _p(tfv.__version__)
        return 0
    if args.command is None:
        d = argparse.ArgumentParser()
        _demo_args(d)
        args = d.parse_args([])
    return int(args.func(args) or 0)
