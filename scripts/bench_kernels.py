#!/usr/bin/env python3
"""Short kernel benchmark: fwd and fwd+bwd TFLOP/s of flashv100 (native atom) vs SDPA flash and
SDPA efficient, fp16, B*L = 16k, H*E = 2048. FLOPs: fwd 4*B*H*L*S*E (causal: half), fwd+bwd 3.5x.

    python scripts/bench_kernels.py --json results.json
"""
import argparse
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_flash_v100 as tfv


def timed(fn, reps):
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def impls():
    def flashv100(q, k, v, causal):
        with tfv.volta_atom(False):
            return tfv.attention(q, k, v, is_causal=causal)

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    return {"flashv100": flashv100, "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--lengths", default="1024,4096,16384")
    args = parser.parse_args()
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for dim in (64, 128):
            for causal in (False, True):
                batch, heads = 16384 // length, 2048 // dim
                q, k, v = (torch.randn(batch, heads, length, dim, device="cuda",
                                       dtype=torch.float16, requires_grad=True) for _ in range(3))
                dout = torch.randn_like(q)
                flops = 4.0 * batch * heads * length * length * dim / (2 if causal else 1)
                row = {"B": batch, "H": heads, "L": length, "E": dim, "causal": causal}
                for name, fn in impls().items():
                    try:
                        with torch.no_grad():
                            t_fwd = timed(lambda: fn(q, k, v, causal), args.reps)
                        t_all = timed(lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v),
                                                                  dout), args.reps)
                        row[name] = {"fwd_tflops": flops / t_fwd / 1e12,
                                     "fwd_bwd_tflops": 3.5 * flops / t_all / 1e12}
                    except RuntimeError as e:  # e.g. a backend that refuses the shape
                        row[name] = {"error": str(e).splitlines()[0]}
                rows.append(row)
                cells = [f"{n}: " + (f"{r['fwd_tflops']:6.1f} / {r['fwd_bwd_tflops']:6.1f}"
                                      if "error" not in r else "n/a")
                         for n, r in row.items() if isinstance(r, dict)]
                print(f"L={length:6d} E={dim:3d} causal={causal!s:5}  fwd / fwd+bwd TFLOP/s  "
                      + "  ".join(cells), flush=True)
                del q, k, v, dout
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
