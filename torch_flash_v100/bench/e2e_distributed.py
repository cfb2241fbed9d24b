"""The small GPT of ``e2e_gpt`` trained data-parallel (DDP and FSDP2), checked against one process.

    torchrun --nproc-per-node 2 -m torch_flash_v100.bench.e2e_distributed              # GPUs, NCCL
    torchrun --nproc-per-node 2 -m torch_flash_v100.bench.e2e_distributed --device cpu  # gloo
    torchrun --nproc-per-node 2 benchmarks/e2e_distributed.py                   # from a checkout

Every rank builds the same model (seed 0) and the same global batches; rank r trains on rows
[r B / W, (r + 1) B / W) of each global batch of B sequences, under

  * ``ddp``   ``torch.nn.parallel.DistributedDataParallel``,
  * ``fsdp``  FSDP2: ``fully_shard`` on every block and on the whole model,

each in the regimes

  * ``eager+flashv100``    the model calls ``torch_flash_v100.attention``,
  * ``compile+flashv100``  the model's matmul-softmax attention under ``torch.compile`` with the
                           flashv100 pass,
  * ``eager``, ``compile`` plain PyTorch, for comparison.

The loss is the mean over every target token of the global batch (each rank back-propagates its
tokens' sum times W / tokens, since DDP and FSDP average gradients over ranks), so a parallel run
computes the same losses as one process training on the whole global batch. Rank 0 first trains
that single-process run (same seed, same batches) for each regime; then every parallel run's
losses are compared with it step by step. Dropout defaults to 0: the ranks draw their own dropout
masks, which no single-process run reproduces. In the flashv100 regimes the last step is profiled
and must have run the flashv100 forward and backward ops once per layer (the pass's "fused sites"
count graphs, and FSDP2 compiles one graph per block that every block reuses); DDP runs on torch
< 2.6 are not profiled (see _PROFILES_DDP). Exit status 1 if any run failed or mismatched.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .e2e_gpt import GPT, make_batches

REGIMES = ["eager", "eager+flashv100", "compile", "compile+flashv100"]
_COUNTED_OPS = ("flashv100::_attention_forward", "flashv100::_attention_backward")
PARALLEL = ["ddp", "fsdp"]
# Torch < 2.6's profiler, stopped after a DDP step on CPU, now and then aborts on a corrupted heap
# (its legacy profiler shows why: DDP's reducer pops record ranges pushed on another thread). DDP
# steps are not profiled there, so their flashv100 op calls are not counted (None).
_PROFILES_DDP = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4, 2.5
    return fully_shard


def _wrap(model, parallel: str, device: torch.device):
    if parallel == "single":
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                       else None)
    if parallel == "fsdp":
        fully_shard = _fully_shard()
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    raise ValueError(f"parallel: expected single or one of {PARALLEL}, got {parallel!r}")


def train(regime: str, parallel: str, args, state: Dict[str, torch.Tensor], batches,
          device: torch.device, rank: int, world: int) -> Dict[str, Any]:
    """Trains ``args.steps`` steps; rank ``rank`` of ``world`` takes its rows of each global
    batch (world 1: the whole batch). Returns the global losses, the same on every rank."""
    torch.manual_seed(1234)
    attention = "flashv100" if regime == "eager+flashv100" else "matmul"
    model = GPT(args.vocab, args.seq, args.d_model, args.heads, args.layers, args.dropout,
                attention).to(device)
    model.load_state_dict(state)
    model.train()
    fn = _wrap(model, parallel, device)
    if regime.startswith("compile"):
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        backend = "inductor"
        if regime == "compile+flashv100":
            import torch_flash_v100

            backend = torch_flash_v100.backend(force=True, compiler=args.compiler)
        elif args.compiler != "inductor":
            backend = args.compiler
        fn = torch.compile(fn, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    autocast_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.dtype)
    rows = args.batch // world
    losses: List[float] = []
    calls: Optional[Dict[str, int]] = None
    for step in range(args.steps):
        torch.manual_seed(10_000 + step)
        idx, pad, tgt = (t[rank * rows:(rank + 1) * rows] for t in batches[step])
        tokens = int((batches[step][2] != -100).sum())  # of the global batch
        # The last step is profiled: which flashv100 ops ran (compiled code calls them too).
        profiled = step == args.steps - 1 and (parallel != "ddp" or _PROFILES_DDP)
        with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profiled
              else contextlib.nullcontext()) as prof:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=autocast_dtype,
                                enabled=autocast_dtype is not None):
                logits = fn(idx, pad)
            loss_sum = F.cross_entropy(logits.float().view(-1, args.vocab), tgt.reshape(-1),
                                       ignore_index=-100, reduction="sum")
            (loss_sum * (world / tokens)).backward()
            opt.step()
        if profiled:
            calls = {e.key.split("::")[1]: e.count for e in prof.key_averages()
                     if e.key in _COUNTED_OPS}
        total = loss_sum.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / tokens)
    op_calls = None
    if calls is not None:
        op_calls = {name: calls.get(name, 0) for name in ("_attention_forward",
                                                          "_attention_backward")}
    result: Dict[str, Any] = {"regime": regime, "parallel": parallel, "losses": losses,
                              "op_calls": op_calls}
    if regime == "compile+flashv100":
        from torch._dynamo.utils import counters

        result["fused_sites"] = int(counters["flashv100"]["fused_attention"])
    return result


def compare(runs: List[Dict[str, Any]], references: Dict[str, Dict[str, Any]], layers: int,
            tolerance: float) -> bool:
    """Marks each run with its largest relative loss difference from the single-process run of
    its regime; a flashv100 regime must also have run the flashv100 forward and backward once per
    layer in its profiled step."""
    ok = True
    for run in runs:
        ref = references.get(run["regime"])
        if "error" in run or ref is None or "error" in ref:
            run["match"] = False
            ok = False
            continue
        run["max_rel_diff"] = max(abs(a - b) / max(1e-6, abs(b))
                                  for a, b in zip(run["losses"], ref["losses"]))
        run["match"] = run["max_rel_diff"] <= tolerance
        if run["regime"].endswith("+flashv100") and run["op_calls"] is not None:
            run["match"] &= all(n == layers for n in run["op_calls"].values())
        ok &= run["match"]
    return ok


def report(runs: List[Dict[str, Any]], references: Dict[str, Dict[str, Any]], world: int,
           tolerance: float) -> str:
    lines = ["", f"| run | losses | max rel diff vs 1 process (tolerance {tolerance:g}) | "
             "flashv100 fwd/bwd calls per step | fused sites |", "|---|---|---:|---:|---:|"]
    for run in list(references.values()) + runs:
        name = (f"{run['regime']}, 1 process" if run["parallel"] == "single"
                else f"{run['regime']}, {run['parallel']} x {world}")
        if "error" in run:
            lines.append(f"| {name} | error: {run['error']} | | | |")
            continue
        diff = f"{run['max_rel_diff']:.1e} {'OK' if run['match'] else 'MISMATCH'}" \
            if "max_rel_diff" in run else "-"
        calls = ("/".join(str(n) for n in run["op_calls"].values())
                 if run["op_calls"] is not None else "not counted")
        lines.append(f"| {name} | {', '.join(f'{x:.5f}' for x in run['losses'])} | {diff} | "
                     f"{calls} | {run.get('fused_sites', '-')} |")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m torch_flash_v100.bench."
                                "e2e_distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda (default when available: cuda:LOCAL_RANK, "
                   "NCCL) or cpu (gloo)")
    p.add_argument("--parallel", default=",".join(PARALLEL), help=f"subset of {PARALLEL}")
    p.add_argument("--regimes", default="eager+flashv100,compile+flashv100",
                   help=f"subset of {REGIMES}")
    p.add_argument("--compiler", default="inductor",
                   help="what runs the graphs after the pass (inductor, aot_eager, ...)")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"],
                   help="autocast dtype (default fp16 on CUDA, fp32 on CPU)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="global batch (sequences)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--tolerance", type=float, default=None,
                   help="relative loss difference allowed (default 1e-4 fp32, 3e-2 fp16/bf16)")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds a collective may wait (ranks out of step after an error)")
    p.add_argument("--json", dest="json_path", default=None, help="rank 0 writes the runs here")
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = a.device.startswith("cuda")
    defaults = dict(layers=4 if cuda else 2, d_model=512 if cuda else 64, heads=8 if cuda else 4,
                    seq=1024 if cuda else 32, batch=16 if cuda else 4, steps=10 if cuda else 3,
                    dtype="fp16" if cuda else "fp32")
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.tolerance is None:
        a.tolerance = 1e-4 if a.dtype == "fp32" else 3e-2
    for name, choices in (("parallel", PARALLEL), ("regimes", REGIMES)):
        chosen = [x.strip() for x in getattr(a, name).split(",") if x.strip()]
        unknown = set(chosen) - set(choices)
        if unknown:
            p.error(f"--{name}: unknown {sorted(unknown)}; choose from {choices}")
        setattr(a, name, chosen)
    return a


def main(argv=None) -> int:
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. `torchrun --nproc-per-node 2 -m "
                         "torch_flash_v100.bench.e2e_distributed`")
    args = parse(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device.startswith("cuda"):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by the {world} ranks")
    torch.manual_seed(0)
    init = GPT(args.vocab, args.seq, args.d_model, args.heads, args.layers, 0.0)
    state = {k: v.to(device) for k, v in init.state_dict().items()}
    batches = make_batches(args.steps, args.batch, args.seq, args.vocab, device)

    def attempt(regime, parallel, rank_, world_):
        try:
            return train(regime, parallel, args, state, batches, device, rank_, world_)
        except Exception as e:
            error = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
            print(f"rank {rank}: {regime} {parallel}: {error}", file=sys.stderr, flush=True)
            return {"regime": regime, "parallel": parallel, "error": error}

    references: Dict[str, Dict[str, Any]] = {}
    if rank == 0:
        print(f"GPT: {args.layers} layers, d={args.d_model}, {args.heads} heads, seq {args.seq}, "
              f"global batch {args.batch}, {args.dtype} on {world} x {device.type}", flush=True)
        for regime in args.regimes:
            print(f"  1 process: {regime} ...", flush=True)
            references[regime] = attempt(regime, "single", 0, 1)
    dist.barrier()
    runs = []
    for parallel in args.parallel:
        for regime in args.regimes:
            if rank == 0:
                print(f"  {parallel} x {world}: {regime} ...", flush=True)
            runs.append(attempt(regime, parallel, rank, world))
            dist.barrier()
    ok = True
    if rank == 0:
        ok = compare(runs, references, args.layers, args.tolerance)
        print(report(runs, references, world, args.tolerance))
        print(f"losses match: {'yes' if ok else 'NO'}")
        if args.json_path:
            doc = {"config": vars(args), "world_size": world, "ok": ok,
                   "references": list(references.values()), "runs": runs}
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_path).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
