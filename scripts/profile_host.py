#!/usr/bin/env python3
"""Host work of small attention steps, where it bounds the step: microseconds per call of each
phase (forward, forward without grad, backward on a retained graph, forward+backward with
``backward()`` and with ``torch.autograd.grad``) of ``torch_flash_v100.attention`` next to SDPA's
backends on the same tensors, then optionally each one's ``torch.profiler`` table of CPU time (ATen
ops, autograd nodes, CUDA runtime calls) for forward+backward.

Calls are timed back to back with one synchronize at the end: where the host is slower than the
GPU (small shapes) the time per call is the host's. Every implementation runs under its own
context only (SDPA: ``sdpa_kernel``), nothing else (no hooks) around either.

    python scripts/profile_host.py --shapes 1,1,16,16 1,1,128,128 --profile
"""
import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import torch_flash_v100 as tfv

IMPLS = {
    "flashv100": (tfv.attention, contextlib.nullcontext),
    "sdpa-efficient": (F.scaled_dot_product_attention,
                       lambda: sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)),
    "sdpa-flash": (F.scaled_dot_product_attention, lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
}


def phases(fn, q, k, v, grad_out, causal):
    leaves = (q, k, v)

    def clear():
        q.grad = k.grad = v.grad = None

    def fwd():
        fn(q, k, v, is_causal=causal)

    def fwd_nograd():
        with torch.no_grad():
            fn(q, k, v, is_causal=causal)

    retained = fn(q, k, v, is_causal=causal)

    def bwd_retained():
        retained.backward(grad_out, retain_graph=True)
        clear()

    def fwdbwd_backward():
        fn(q, k, v, is_causal=causal).backward(grad_out)
        clear()

    def fwdbwd_grad():
        torch.autograd.grad(fn(q, k, v, is_causal=causal), leaves, grad_out)

    return {"fwd": fwd, "fwd no grad": fwd_nograd, "bwd (retained graph)": bwd_retained,
            "fwd+bwd backward()": fwdbwd_backward, "fwd+bwd autograd.grad": fwdbwd_grad}


def per_call_us(call, steps: int) -> float:
    for _ in range(max(20, steps // 10)):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["1,1,16,16", "1,1,128,128"],
                    help="B,H,L,E each (fp16, L == S)")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--steps", type=int, default=1000, help="timed calls per phase")
    ap.add_argument("--profile", action="store_true",
                    help="also print each implementation's torch.profiler table of forward+backward")
    ap.add_argument("--profiled-steps", type=int, default=100)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_host.py needs a CUDA GPU")
    names = args.impls.split(",")
    for spec in args.shapes:
        shape = tuple(int(x) for x in spec.split(","))
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.half, requires_grad=True)
                   for _ in range(3))
        grad_out = torch.randn(shape, device="cuda", dtype=torch.half)
        rows = {}
        for name in names:
            fn, context = IMPLS[name]
            with context():
                rows[name] = {phase: per_call_us(call, args.steps)
                              for phase, call in phases(fn, q, k, v, grad_out, args.causal).items()}
        print(f"== {spec}{' causal' if args.causal else ''}: us per call (host-bound: host time)")
        print(f"{'phase':24s}" + "".join(f"{n:>16s}" for n in names))
        for phase in next(iter(rows.values())):
            print(f"{phase:24s}" + "".join(f"{rows[n][phase]:16.1f}" for n in names))
        if args.profile:
            for name in names:
                fn, context = IMPLS[name]
                step = phases(fn, q, k, v, grad_out, args.causal)["fwd+bwd backward()"]
                with context():
                    step()
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        for _ in range(args.profiled_steps):
                            step()
                        torch.cuda.synchronize()
                print(f"== {spec} {name}: fwd+bwd, {args.profiled_steps} steps")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                                max_name_column_width=70))


if __name__ == "__main__":
    main()
