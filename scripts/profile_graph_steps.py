#!/usr/bin/env python3
"""Forward+backward steps captured once in a CUDA graph and replayed: each step's replay time and
the device time of every kernel and memset in it (torch.profiler), for ours, SDPA efficient and
SDPA flash side by side. Small problems are bound by launches: this shows how many device
operations a step takes and what each costs.

    python scripts/profile_graph_steps.py --shapes 1,1,16,16 1,1,128,128 --causal 0 1
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import torch_flash_v100 as tfv

BACKENDS = {"sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa-flash": SDPBackend.FLASH_ATTENTION}


def step(impl, q, k, v, dout, causal):
    def run():
        if impl == "flashv100":
            out = tfv.attention(q, k, v, is_causal=causal)
        else:
            with sdpa_kernel(BACKENDS[impl]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)
    return run


def graph_of(run):
    for _ in range(3):
        run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def replay_us(graph, reps=200, rounds=5):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps * 1000)
    return sorted(times)[rounds // 2]


def device_ops(graph, reps=20):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    ops = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            ops.setdefault(ev.name, []).append(ev.device_time)
    return [(name, sum(t) / len(t), len(t) // reps) for name, t in ops.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1,1,16,16", "1,1,32,32", "1,1,64,64",
                                                    "1,1,128,128", "1,1,256,256"],
                    help="B,H,L,E (fp16, L == S)")
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--impls", nargs="+", default=["flashv100", "sdpa-efficient", "sdpa-flash"])
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for spec in args.shapes:
        b, h, n, e = (int(x) for x in spec.split(","))
        for causal in args.causal:
            q, k, v = (torch.randn(b, h, n, e, device="cuda", dtype=torch.float16,
                                   requires_grad=True) for _ in range(3))
            dout = torch.randn(b, h, n, e, device="cuda", dtype=torch.float16)
            for impl in args.impls:
                graph = graph_of(step(impl, q, k, v, dout, bool(causal)))
                ops = "; ".join(f"{name[:70]} {us:.1f} us" + (f" x{count}" if count > 1 else "")
                                for name, us, count in device_ops(graph))
                print(f"B{b} H{h} L{n} E{e} causal={causal} {impl}: step {replay_us(graph):.1f} us"
                      f" | {ops}", flush=True)


if __name__ == "__main__":
    main()
