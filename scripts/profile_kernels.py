#!/usr/bin/env python3
"""One fused forward and backward per configuration, after a warm-up: the workload to run under
Nsight Compute, e.g.

    ncu --clock-control none -k regex:flash --launch-skip 8 --set full \
        python scripts/profile_kernels.py --configs 4,16,4096,128

--impl sdpa-flash runs PyTorch's flash backend (FlashAttention-2) on the same problems instead,
for side-by-side profiles (its kernels: flash_fwd_kernel<Flash_fwd_kernel_traits...>,
flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel, ...).
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
    ap.add_argument("--impl", choices=["flashv100", "sdpa-flash"], default="flashv100")
    args = ap.parse_args()
    ops = torch.ops.flashv100
    with tfv.volta_atom(args.volta):
        for spec in args.configs:
            b, h, n, e = (int(x) for x in spec.split(","))
            q, k, v = (torch.randn(b, h, n, e, device="cuda", dtype=torch.float16) for _ in range(3))
            dout = torch.randn_like(q)
            for p in args.dropout:
                for _ in range(args.warmup + 1):
                    if args.impl == "sdpa-flash":
                        sdpa_flash_step(q, k, v, dout, p, args.causal)
                        continue
                    out, lse, rng = ops._attention_forward(q, k, v, None, p, int(args.causal),
                                                           1.0 / math.sqrt(e))
                    ops._attention_backward(dout, q, k, v, None, out, lse, rng, p,
                                            int(args.causal), 1.0 / math.sqrt(e), False, False)
                torch.cuda.synchronize()
                print("profiled", args.impl, spec, f"dropout_p={p}",
                      "causal" if args.causal else "")


def sdpa_flash_step(q, k, v, dout, dropout_p: float, causal: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p,
                                                               is_causal=causal)
    out.backward(dout)


if __name__ == "__main__":
    main()
