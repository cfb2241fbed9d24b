#!/usr/bin/env python3
"""Host work of a small forward+backward, where it bounds the step: wall time per step of
``torch_flash_v100.attention`` and of SDPA (its default backend) on the same tensors, then each
one's ``torch.profiler`` table of CPU time (ATen ops, autograd nodes, CUDA runtime calls).

    python scripts/profile_host.py --shape 1,1,16,16
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import torch_flash_v100 as tfv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="1,1,16,16", help="B,H,L,E (fp16, L == S)")
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per implementation")
    ap.add_argument("--profiled-steps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_host.py needs a CUDA GPU")
    shape = tuple(int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.half, requires_grad=True)
               for _ in range(3))
    grad_out = torch.ones(shape, device="cuda", dtype=torch.half)
    impls = [("flashv100", tfv.attention), ("sdpa", F.scaled_dot_product_attention)]

    def step(fn):
        torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)

    for name, fn in impls:
        for _ in range(300):
            step(fn)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(fn)
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - start) / args.steps * 1e6
        print(f"{name} fwd+bwd {args.shape}: {per_step:.1f} us/step")
    for name, fn in impls:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled_steps):
                step(fn)
            torch.cuda.synchronize()
        print(f"== {name} ({args.profiled_steps} steps)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22,
                                        max_name_column_width=70))


if __name__ == "__main__":
    main()
