"""End-to-end: a small GPT with eager attention trained under three regimes.

    python -m torch_flash_v100 e2e                  # best device, default sizes
    python -m torch_flash_v100 e2e --steps 10 --json benchmarks/results/e2e.json

The model writes attention the way many real models do: ``q @ k^T * scale``, a causal + padding
mask applied with ``masked_fill``, ``softmax``, ``dropout``, ``@ v``. It is trained for a few steps
(same initial weights, same batches) as

  * ``eager``            plain PyTorch,
  * ``compile``          ``torch.compile`` (Inductor, with its own attention patterns),
  * ``compile+flashv100`` ``torch.compile`` with the flashv100 pass (``torch_flash_v100.backend``).

Reported: median step time (after warm-up steps; the first step's time, which includes
compilation, separately), peak memory, how many attention sites the pass fused, and the losses.
Dropout makes runs differ by their random masks, so the "losses match" check trains a second time
with dropout 0 and compares the loss curves of all regimes to eager.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_flash_v100._measure import peak_memory_mb

MODES = ["eager", "compile", "compile+flashv100"]
ATTENTIONS = ("matmul", "flashv100")


class Attention(nn.Module):
    """``attention="matmul"``: written out as models do (what the compile pass fuses);
    ``"flashv100"``: calls ``torch_flash_v100.attention`` (the same math and parameters)."""

    def __init__(self, d, heads, dropout, attention="matmul"):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention: expected one of {ATTENTIONS}, got {attention!r}")
        self.attention = attention
        self.h, self.dh = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x, keep):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        if self.attention == "flashv100":
            import torch_flash_v100

            p = self.attn_drop.p if self.training else 0.0
            y = torch_flash_v100.attention(q, k, v, attn_mask=keep, dropout_p=p)
            return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.dh))
        att = att.masked_fill(~keep, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, d, heads, dropout, attention="matmul"):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout, attention)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x, keep):
        x = x + self.attn(self.ln1(x), keep)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq, d, heads, layers, dropout, attention="matmul"):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout, attention) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, pad_mask):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        # causal & key padding: [B, 1, T, T], True = attend
        keep = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()[None, None] & pad_mask[:, None, None, :]
        for b in self.blocks:
            x = b(x, keep)
        return self.head(self.ln(x))


def make_batches(n, B, T, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, vocab, (B, T), generator=g)
        lens = torch.randint(T // 2, T + 1, (B,), generator=g)
        lens[0] = T
        pad = torch.arange(T)[None, :] < lens[:, None]
        tgt = torch.roll(idx, -1, dims=1)
        tgt[:, -1] = -100
        tgt[~pad] = -100
        out.append((idx.to(device), pad.to(device), tgt.to(device)))
    return out


def _peak_cpu_mb(fn) -> Optional[float]:
    return peak_memory_mb(fn, torch.device("cpu"))


def train(mode: str, args, state: Dict[str, torch.Tensor], batches, dropout: float, steps: int,
          device: torch.device, measure_memory: bool = True) -> Dict[str, Any]:
    torch.manual_seed(1234)
    model = GPT(args.vocab, args.seq, args.d_model, args.heads, args.layers, dropout).to(device)
    model.load_state_dict(state)
    model.train()
    res: Dict[str, Any] = {"mode": mode, "dropout": dropout}
    if mode == "eager":
        fn = model
    elif mode == "compile":
        torch._dynamo.reset()
        fn = torch.compile(model)
    else:
        import torch_flash_v100
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        be = torch_flash_v100.backend(force=not args.no_force)
        fn = torch.compile(model, backend=be)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    autocast = (torch.autocast(device.type, dtype=torch.float16 if args.dtype == "fp16" else torch.bfloat16)
                if args.dtype in ("fp16", "bf16") else None)

    def step(i):
        idx, pad, tgt = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        if autocast is not None:
            with autocast:
                logits = fn(idx, pad)
        else:
            logits = fn(idx, pad)
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), tgt.view(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        return loss

    losses: List[float] = []
    times: List[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for i in range(steps):
        torch.manual_seed(10_000 + i)  # same dropout seed per step (masks still differ across regimes)
        t0 = time.perf_counter()
        loss = step(i)
        losses.append(float(loss.detach()))  # syncs
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    res["losses"] = losses
    res["first_step_s"] = times[0]
    steady = times[args.warmup_steps:] or times[-1:]
    res["step_ms"] = statistics.median(steady) * 1e3
    res["step_ms_min"] = min(steady) * 1e3
    res["steady_steps"] = len(steady)
    if device.type == "cuda":
        res["peak_mem_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    elif measure_memory:
        res["peak_mem_mb"] = _peak_cpu_mb(lambda: step(steps))
    if mode == "compile+flashv100":
        from torch._dynamo.utils import counters

        res["fused_sites"] = int(counters["flashv100"]["fused_attention"])
        res["attention_sites"] = args.layers
    return res


def best_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse(argv=None, prog="python -m torch_flash_v100 e2e"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"],
                   help="autocast dtype (default fp16 on CUDA, fp32 on CPU)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=None, help="training steps per regime")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps excluded from the step time")
    p.add_argument("--check-steps", type=int, default=3, help="steps of the dropout-0 loss check (0: skip)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--no-force", action="store_true",
                   help="use the pass's default policy instead of forcing it on this device")
    p.add_argument("--json", dest="json_path", default=None)
    a = p.parse_args(argv)
    a.device = a.device or best_device()
    cuda = a.device.startswith("cuda")
    defaults = dict(layers=4 if cuda else 2, d_model=512 if cuda else 128, heads=8 if cuda else 4,
                    seq=1024 if cuda else 128, batch=16 if cuda else 4, steps=10 if cuda else 5,
                    dtype="fp16" if cuda else "fp32")
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def main(argv=None, prog="python -m torch_flash_v100 e2e") -> int:
    args = parse(argv, prog)
    device = torch.device(args.device)
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    if "compile+flashv100" in modes:
        try:
            import torch_flash_v100

            torch_flash_v100.backend  # noqa: B018
        except Exception as e:
            print(f"compile+flashv100 skipped: the torch.compile integration is unavailable ({e})", file=sys.stderr)
            modes.remove("compile+flashv100")
    torch.manual_seed(0)
    init = GPT(args.vocab, args.seq, args.d_model, args.heads, args.layers, args.dropout)
    state = {k: v.to(device) for k, v in init.state_dict().items()}
    batches = make_batches(max(args.steps, args.check_steps) + 1, args.batch, args.seq, args.vocab, device)
    n_params = sum(p.numel() for p in init.parameters())
    print(f"GPT: {args.layers} layers, d={args.d_model}, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
          f"{n_params / 1e6:.1f}M params, dropout {args.dropout}, {args.dtype} on {device}", flush=True)
    doc: Dict[str, Any] = {"config": vars(args), "runs": [], "check": []}
    try:
        from .harness import collect_metadata

        doc["metadata"] = collect_metadata(device)
    except Exception:
        doc["metadata"] = {"torch_version": torch.__version__, "device": str(device)}
    for m in modes:
        print(f"  training {m} ({args.steps} steps) ...", flush=True)
        try:
            doc["runs"].append(train(m, args, state, batches, args.dropout, args.steps, device))
        except Exception as e:
            doc["runs"].append({"mode": m, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"})
    if args.check_steps > 0:
        for m in modes:
            print(f"  loss check {m} (dropout 0, {args.check_steps} steps) ...", flush=True)
            try:
                doc["check"].append(train(m, args, state, batches, 0.0, args.check_steps, device,
                                          measure_memory=False))
            except Exception as e:
                doc["check"].append({"mode": m, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"})
    print(report(doc, args))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {args.json_path}", file=sys.stderr)
    ok = all("error" not in r for r in doc["runs"] + doc["check"]) and doc.get("losses_match", True)
    return 0 if ok else 1


def report(doc, args) -> str:
    lines = ["", "| regime | step ms (median) | first step s (incl. compile) | peak mem MB | fused sites | losses |",
             "|---|---:|---:|---:|---:|---|"]
    eager = next((r for r in doc["runs"] if r.get("mode") == "eager" and "error" not in r), None)
    for r in doc["runs"]:
        if "error" in r:
            lines.append(f"| {r['mode']} | error: {r['error']} | | | | |")
            continue
        mem = r.get("peak_mem_mb")
        fused = f"{r['fused_sites']} / {r['attention_sites']}" if "fused_sites" in r else "-"
        sp = f" ({eager['step_ms'] / r['step_ms']:.2f}x eager)" if eager and r is not eager else ""
        lines.append(f"| {r['mode']} | {r['step_ms']:.1f}{sp} | {r['first_step_s']:.1f} | "
                     f"{'-' if mem is None else f'{mem:.0f}'} | {fused} | "
                     f"{', '.join(f'{x:.4f}' for x in r['losses'])} |")
    if doc["check"]:
        ref = next((r for r in doc["check"] if r.get("mode") == "eager" and "error" not in r), None)
        tol = 1e-3 if args.dtype == "fp32" else 3e-2
        lines += ["", f"Loss check (dropout 0, same weights and batches; tolerance {tol:g} relative to eager):"]
        match = True
        for r in doc["check"]:
            if "error" in r:
                lines.append(f"- {r['mode']}: error: {r['error']}")
                match = False
                continue
            if ref is None:
                lines.append(f"- {r['mode']}: {r['losses']} (no eager reference)")
                continue
            d = max(abs(a - b) / max(1e-6, abs(b)) for a, b in zip(r["losses"], ref["losses"]))
            ok = d <= tol
            match &= ok
            r["max_rel_loss_diff_vs_eager"] = d
            lines.append(f"- {r['mode']}: losses {', '.join(f'{x:.5f}' for x in r['losses'])}; "
                         f"max rel diff vs eager {d:.1e} {'OK' if ok else 'MISMATCH'}")
        doc["losses_match"] = match
        lines.append(f"losses match: {'yes' if match else 'NO'}")
    return "\n".join(lines)

