"""FlashAttention-2 features side by side: what fusing a sliding window, packed variable-length
batches, softcap and ALiBi into the kernels saves over expressing the same attention with a dense
mask or bias through SDPA (or our own SDPA-layout op).

    python benchmarks/bench_flash_features.py --json out.json     # CUDA; --tiny for a CPU smoke run

Every case times forward and forward+backward of each implementation in one process, reports
milliseconds, effective TFLOP/s (only the (query, key) pairs the attention actually sees count:
4 * E FLOPs per pair forward, 2.5x that for the backward) and the ratio to the fused FlashAttention-2
function, plus the peak memory of the forward. The metadata names device, torch and commit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import torch_flash_v100 as tfv
from torch_flash_v100._measure import peak_memory_mb, time_fn
from torch_flash_v100.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

BWD_FLOP_RATIO = 2.5
# Marks an implementation that computes a different attention, timed only to show the work saved.
WORK_ONLY = " (work reference)"


@dataclass
class Case:
    name: str
    visible_pairs: int  # (query, key) pairs the attention sees, summed over batch and heads
    head_dim: int
    # name -> forward returning a differentiable out, all in the fused function's layout; the
    # first is the fused FlashAttention-2 function the others are compared with
    impls: Dict[str, Callable[[], torch.Tensor]]
    inputs: List[torch.Tensor]  # leaves whose .grad the backward fills


def _leaf(*shape, device, dtype):
    return torch.randn(*shape, device=device, dtype=dtype).mul_(0.5).requires_grad_()


def _window_case(B, H, L, E, window, device, dtype) -> Case:
    q, k, v = (_leaf(B, L, H, E, device=device, dtype=dtype) for _ in range(3))
    i = torch.arange(L, device=device)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - window)  # [L, S] causal band
    pairs = int(keep.sum()) * B * H
    sdpa_layout = lambda t: t.transpose(1, 2)  # noqa: E731
    additive = torch.zeros(L, L, device=device, dtype=dtype).masked_fill_(~keep, float("-inf"))
    impls = {
        "fa2 window": lambda: flash_attn_func(q, k, v, causal=True, window_size=(window, 0)),
        "fa2 causal, no window" + WORK_ONLY: lambda: flash_attn_func(q, k, v, causal=True),
        "flashv100 dense mask": lambda: sdpa_layout(tfv.attention(
            sdpa_layout(q), sdpa_layout(k), sdpa_layout(v), attn_mask=keep)),
    }
    if device.type == "cuda":
        impls["sdpa-efficient dense mask"] = lambda: sdpa_layout(_sdpa(
            "EFFICIENT_ATTENTION", sdpa_layout(q), sdpa_layout(k), sdpa_layout(v), additive))
    if L <= 4096:
        impls["sdpa-math dense mask"] = lambda: sdpa_layout(_sdpa(
            "MATH", sdpa_layout(q), sdpa_layout(k), sdpa_layout(v), additive))
    return Case(f"window {window} causal B{B} H{H} L{L} E{E}", pairs, E, impls, [q, k, v])


def _varlen_case(H, E, lengths, device, dtype) -> Case:
    total, longest = sum(lengths), max(lengths)
    q, k, v = (_leaf(total, H, E, device=device, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device=device, dtype=torch.int32)
    pairs = sum(n * (n + 1) // 2 for n in lengths) * H
    # Padded [B, H, L, E] views built inside the timed region: padding is part of that path's cost.
    index = torch.cat([torch.arange(n, device=device) + b * longest for b, n in enumerate(lengths)])

    def padded(t):
        out = t.new_zeros(len(lengths) * longest, H, E).index_copy(0, index, t)
        return out.view(len(lengths), longest, H, E).transpose(1, 2)

    j = torch.arange(longest, device=device)
    key_keep = j[None, :] < torch.tensor(lengths, device=device)[:, None]  # [B, S]
    mask = key_keep[:, None, None, :] & (j[None, :] <= j[:, None])[None, None]  # [B, 1, L, S]
    # Rows past a sequence's end see no key under this mask; SDPA's efficient kernel needs a
    # finite additive mask for them, so they keep key 0 (their output is discarded anyway).
    mask = mask | (j == 0)[None, None, None, :]
    additive = torch.zeros(mask.shape, device=device, dtype=dtype).masked_fill_(~mask, float("-inf"))

    def unpad(out):
        return out.transpose(1, 2).reshape(-1, H, E).index_select(0, index)

    impls = {
        "fa2 varlen": lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True),
        "flashv100 padded + mask": lambda: unpad(
            tfv.attention(padded(q), padded(k), padded(v), attn_mask=mask)),
    }
    if device.type == "cuda":
        impls["sdpa-efficient padded + mask"] = lambda: unpad(
            _sdpa("EFFICIENT_ATTENTION", padded(q), padded(k), padded(v), additive))
    name = f"varlen causal H{H} E{E} {len(lengths)} seqs, {total} tokens (longest {longest})"
    return Case(name, pairs, E, impls, [q, k, v])


def _score_mod_case(B, H, L, E, device, dtype, kind) -> Case:
    q, k, v = (_leaf(B, L, H, E, device=device, dtype=dtype) for _ in range(3))
    pairs = L * (L + 1) // 2 * B * H
    scale = 1.0 / math.sqrt(E)
    i = torch.arange(L, device=device)
    causal = i[None, :] <= i[:, None]
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device=device)
    t = lambda x: x.transpose(1, 2)  # noqa: E731

    if kind == "softcap":
        fused = lambda: flash_attn_func(q, k, v, causal=True, softcap=30.0)  # noqa: E731

        def eager():  # what Gemma 2's eager attention does
            s = torch.matmul(t(q), t(k).transpose(-1, -2)) * scale
            s = torch.tanh(s / 30.0) * 30.0
            s = s.masked_fill(~causal, float("-inf"))
            return t(torch.matmul(torch.softmax(s.float(), -1).to(dtype), t(v)))

        impls = {"fa2 softcap": fused, "eager softcap": eager}
    else:
        fused = lambda: flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)  # noqa: E731
        bias = (-slopes[:, None, None] * (i[:, None] - i[None, :]).abs()).masked_fill(
            ~causal, float("-inf")).to(dtype)  # [H, L, S], materialized as BLOOM/MPT do
        impls = {"fa2 alibi": fused,
                 "flashv100 dense bias": lambda: t(tfv.attention(t(q), t(k), t(v), attn_mask=bias))}
        if device.type == "cuda":
            impls["sdpa-efficient dense bias"] = lambda: t(_sdpa(
                "EFFICIENT_ATTENTION", t(q), t(k), t(v), bias))
    return Case(f"{kind} causal B{B} H{H} L{L} E{E}", pairs, E, impls, [q, k, v])


def _sdpa(backend: str, q, k, v, mask):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def cases(device: torch.device, tiny: bool) -> List[Case]:
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if tiny:
        return [_window_case(1, 2, 64, 16, 16, device, dtype),
                _varlen_case(2, 16, [5, 40, 17], device, dtype),
                _score_mod_case(1, 2, 48, 16, device, dtype, "softcap"),
                _score_mod_case(1, 2, 48, 16, device, dtype, "alibi")]
    # B * L = 16k tokens (one sequence from 16k on), windows of 512 and 4096 keys.
    out = [_window_case(max(1, 16384 // n), 16, n, 64, w, device, dtype)
           for w in (512, 4096) for n in (4096, 8192, 16384, 32768)]
    lengths = [int(x) for x in torch.randint(128, 4096, (16,), generator=torch.Generator().manual_seed(0))]
    out.append(_varlen_case(16, 64, lengths, device, dtype))
    out += [_score_mod_case(2, 16, 4096, 64, device, dtype, kind) for kind in ("softcap", "alibi")]
    return out


def _commit() -> str:
    if os.environ.get("FLASHV100_COMMIT"):
        return os.environ["FLASHV100_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except Exception:
        return "unknown"


def measure(case: Case, device: torch.device, budget_s: float) -> List[dict]:
    rows = []
    with torch.no_grad():
        expected = next(iter(case.impls.values()))().float()
    for name, fwd in case.impls.items():
        row: dict = {"case": case.name, "impl": name}
        try:
            with torch.no_grad():  # the same attention, or the comparison means nothing
                row["max_abs_diff"] = (fwd().float() - expected).abs().max().item()
            def fwd_bwd():
                for x in case.inputs:
                    x.grad = None
                fwd().float().sum().backward()

            with torch.no_grad():
                row["fwd_ms"] = time_fn(fwd, device, budget_s)["ms"]
            row["fwd_bwd_ms"] = time_fn(fwd_bwd, device, budget_s)["ms"]
            with torch.no_grad():
                row["fwd_peak_mb"] = peak_memory_mb(fwd, device)
        except Exception as e:  # an implementation refusing a shape is recorded, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            continue
        flops = 4.0 * case.head_dim * case.visible_pairs
        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = flops * (1 + BWD_FLOP_RATIO) / row["fwd_bwd_ms"] / 1e9
        rows.append(row)
    fused = rows[0] if "error" not in rows[0] else None
    for r in rows:
        if fused is not None and "error" not in r:
            r["fwd_vs_fa2"] = r["fwd_ms"] / fused["fwd_ms"]
            r["fwd_bwd_vs_fa2"] = r["fwd_bwd_ms"] / fused["fwd_bwd_ms"]
    return rows


def markdown(rows: List[dict]) -> str:
    lines = ["| case | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
             "time / fa2 (fwd, fwd+bwd) | fwd peak MB | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['impl']} | {r['error']} |||||||")
            continue
        ratio = f"{r.get('fwd_vs_fa2', float('nan')):.2f}x, {r.get('fwd_bwd_vs_fa2', float('nan')):.2f}x"
        peak = r["fwd_peak_mb"]
        lines.append(f"| {r['case']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.1f} | "
                     f"{r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.1f} | {ratio} | "
                     f"{'-' if peak is None else f'{peak:.0f}'} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run, seconds)")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per measurement")
    p.add_argument("--json", dest="json_path", default=None, help="write rows and metadata here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "commit": _commit(),
            "atom": "volta m8n8k4 (forced)" if tfv.force_volta_atom() else "native"}
    rows: List[dict] = []
    for case in cases(device, args.tiny):
        rows += measure(case, device, args.budget)
    print(json.dumps(meta))
    print(markdown(rows))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    # An implementation that errors, or computes something else than the fused function, fails.
    tolerance = 2e-2 if device.type == "cuda" else 1e-4
    bad = [r for r in rows if "error" in r
           or (not r["impl"].endswith(WORK_ONLY) and r["max_abs_diff"] > tolerance)]
    for r in bad:
        print(f"FAILED: {r['case']} / {r['impl']}: {r.get('error', r.get('max_abs_diff'))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
