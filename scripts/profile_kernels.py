#!/usr/bin/env python3
"""One fused forward and backward per configuration, after a warm-up: the workload to run under
Nsight Compute, e.g.

    ncu --clock-control none -k regex:flash --launch-skip 8 --set full \
        python scripts/profile_kernels.py --configs 4,16,4096,128
"""
import argparse
import math

import torch

import torch_flash_v100 as tfv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["4,32,4096,64", "4,16,4096,128"],
                    help="B,H,L,E per configuration (fp16, L == S)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--volta", action="store_true", help="force the Volta atom")
    ap.add_argument("--dropout", type=float, nargs="+", default=[0.0],
                    help="dropout_p values, each run in turn per configuration")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    ops = torch.ops.flashv100
    with tfv.volta_atom(args.volta):
        for spec in args.configs:
            b, h, n, e = (int(x) for x in spec.split(","))
            q, k, v = (torch.randn(b, h, n, e, device="cuda", dtype=torch.float16) for _ in range(3))
            dout = torch.randn_like(q)
            for p in args.dropout:
                for _ in range(args.warmup + 1):
                    out, lse, rng = ops._attention_forward(q, k, v, None, p, int(args.causal),
                                                           1.0 / math.sqrt(e))
                    ops._attention_backward(dout, q, k, v, None, out, lse, rng, p,
                                            int(args.causal), 1.0 / math.sqrt(e), False, False)
                torch.cuda.synchronize()
                print("profiled", spec, f"dropout_p={p}", "causal" if args.causal else "")


if __name__ == "__main__":
    main()
