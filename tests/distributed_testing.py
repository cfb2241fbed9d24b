"""Multi-process tests: a function run on every rank of a process group in spawned processes.

One spawn per test module (its cases run inside one job, each rank reporting which failed): a
spawned process pays torch's import, and CI machines have few cores. CPU tests use gloo; the
2-GPU tests (tests/cuda) use NCCL, one GPU per rank.
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import os
import sys
import tempfile
import traceback
import zlib
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Bounds a run whose ranks went out of step (a collective that only some reached) instead of
# hanging the suite: gloo/NCCL then raise on the waiting ranks.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


# A rank still running after this long is taken as hung: it writes its Python stack and exits, so
# that the test fails showing where it stopped instead of stalling the suite.
RANK_TIMEOUT_S = 900


def _entry(rank: int, fn: Callable, world_size: int, backend: str, init_file: str,
           result_dir: str, args: tuple) -> None:
    stack_file = open(os.path.join(result_dir, f"{rank}.stack"), "w")
    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True, file=stack_file)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    status = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(result_dir, f"{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        status = 1
    # Ends the process without tearing the process groups down: torch 2.5's gloo deadlocks there
    # now and then (~ProcessGroupGloo joins a worker thread that frees finished work, which needs
    # the GIL its caller holds). The result or the error is on disk already.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _rank_reports(result_dir: str, world_size: int) -> str:
    """Each rank's traceback, or its stack where it was stopped as hung."""
    reports = []
    for rank in range(world_size):
        for kind in ("error", "stack"):
            path = os.path.join(result_dir, f"{rank}.{kind}")
            text = open(path).read() if os.path.exists(path) else ""
            if text:
                reports.append(f"rank {rank} {kind}:\n{text}")
    return "\n".join(reports)


def run_on_ranks(fn: Callable, world_size: int = 2, *args: Any, backend: str = "gloo") -> List[Any]:
    """``fn(rank, world_size, *args)`` on every rank of a fresh process group; returns each
    rank's result (picklable). ``fn`` must be importable by name (defined at module level)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        try:
            mp.start_processes(_entry, args=(fn, world_size, backend, init_file, tmp, args),
                               nprocs=world_size, join=True, start_method="spawn")
        except mp.ProcessExitedException as exited:
            raise RuntimeError(f"{exited}\n{_rank_reports(tmp, world_size)}") from None
        return [torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=True)
                for rank in range(world_size)]


def run_cases(cases: Dict[str, Callable[[], None]]) -> Dict[str, Optional[str]]:
    """Runs each case (a check that raises on failure) and returns {name: None if it passed, else
    its traceback}. A case must make the same collective calls on every rank before it can fail
    (compare after communicating), so that the ranks stay in step for the next case."""
    outcomes: Dict[str, Optional[str]] = {}
    for name, case in cases.items():
        try:
            case()
            outcomes[name] = None
        except Exception:
            outcomes[name] = traceback.format_exc()
    return outcomes


def assert_case_passed(results: List[Dict[str, Optional[str]]], name: str) -> None:
    """The case ran on some rank and passed on every rank that ran it."""
    assert any(name in outcomes for outcomes in results), f"case {name} ran on no rank"
    errors = [f"rank {rank}:\n{outcomes[name]}" for rank, outcomes in enumerate(results)
              if outcomes.get(name) is not None]
    assert not errors, "\n".join(errors)


# A ring case: (dtype, is_causal, layout, heads_q, heads_kv, value dim, scale, sum): sum means
# the gradient of out.sum() (stride 0) and strided [B, L, H, E]-major shards.
def case_name(case) -> str:
    dtype, causal, layout, hq, hkv, ev, scale, sum_grad = case
    return (f"{str(dtype).split('.')[-1]}-{'causal' if causal else 'full'}-{layout}-h{hq}x{hkv}"
            f"-ev{ev}" + (f"-scale{scale}" if scale else "") + ("-sum" if sum_grad else ""))


def _tolerances(dtype):
    """(vs single-process flashv100 in the same dtype, vs the fp64 reference)."""
    return {torch.float64: (dict(atol=1e-12, rtol=1e-12), dict(atol=1e-10, rtol=1e-10)),
            torch.float32: (dict(atol=2e-6, rtol=2e-5), dict(atol=1e-5, rtol=1e-4)),
            torch.bfloat16: (dict(atol=3e-2, rtol=3e-2), dict(atol=5e-2, rtol=5e-2)),
            torch.float16: (dict(atol=4e-3, rtol=4e-3), dict(atol=5e-3, rtol=5e-3))}[dtype]


def check_ring_case(case, world_size, group=None, device="cpu", rows_per_rank=4):
    """Shards one full-sequence problem (the same on every rank) over the ranks, runs ring
    attention forward and backward, and compares the gathered output and gradients, every
    position, with single-process flashv100 attention and with the fp64 reference."""
    import torch_flash_v100 as flash
    from torch_flash_v100.distributed import ring_attention, shard_sequence, unshard_sequence
    from torch_flash_v100.reference import reference_attention

    dtype, causal, layout, hq, hkv, ev, scale, sum_grad = case
    gqa = hq != hkv
    length = rows_per_rank * world_size  # zigzag: two chunks of rows_per_rank / 2 per rank
    # The same inputs on every rank (str hashes differ between processes).
    generator = torch.Generator().manual_seed(zlib.crc32(case_name(case).encode()))
    shapes = ((2, hq, length, 8), (2, hkv, length, 8), (2, hkv, length, ev))
    full = [torch.randn(s, generator=generator, dtype=torch.float64).to(device)
            for s in shapes]
    grad = torch.randn(2, hq, length, ev, generator=generator,
                       dtype=torch.float64).to(device)

    def forward_backward(fn, inputs, grad_out):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
        if sum_grad:
            out.sum().backward()
        else:
            out.backward(grad_out.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    options = dict(is_causal=causal, scale=scale, enable_gqa=gqa)
    single = forward_backward(lambda *t: flash.attention(*t, **options),
                              [t.to(dtype) for t in full], grad)
    reference = forward_backward(lambda *t: reference_attention(*t, **options), full, grad)
    shards = [shard_sequence(t.to(dtype), 2, group=group, layout=layout) for t in full]
    if sum_grad:  # also strided shards: [B, L, H, E] tensors seen as [B, H, L, E]
        shards = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in shards]
    ring = forward_backward(
        lambda *t: ring_attention(*t, group=group, layout=layout, **options), shards,
        shard_sequence(grad, 2, group=group, layout=layout))
    gathered = [unshard_sequence(t, 2, group=group, layout=layout) for t in ring]

    same_dtype, fp64 = _tolerances(dtype)
    for name, got, want, want64 in zip(("out", "dq", "dk", "dv"), gathered, single, reference):
        assert got.dtype == dtype, (name, got.dtype)
        torch.testing.assert_close(got, want, **same_dtype,
                                   msg=lambda m: f"{name} vs flashv100: {m}")
        torch.testing.assert_close(got.double(), want64, **fp64,
                                   msg=lambda m: f"{name} vs fp64: {m}")


class AttentionBlock(torch.nn.Module):
    """q/k/v projections, causal GQA attention, output projection; heads from the local shape so
    that it runs unsharded, on local shards and on DTensors alike."""

    def __init__(self, d_model=16, heads=4, kv_heads=2):
        super().__init__()
        self.head_dim = d_model // heads
        self.q = torch.nn.Linear(d_model, d_model)
        self.k = torch.nn.Linear(d_model, kv_heads * self.head_dim)
        self.v = torch.nn.Linear(d_model, kv_heads * self.head_dim)
        self.out = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        import torch_flash_v100 as flash

        batch, length, _ = x.shape
        q, k, v = (proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = flash.attention(q, k, v, is_causal=True, enable_gqa=True)
        self.seen_placements = [getattr(t, "placements", None) for t in (q, k, v, y)]
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


def check_tp_block(mesh, use_local_output, device="cpu", dtype=torch.float64, tolerance=1e-12):
    """An attention block under ColwiseParallel (q, k, v) / RowwiseParallel (out) against the
    same block unsharded: output and every parameter's gradient."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(3)
    block = AttentionBlock().to(device, dtype)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    sharded = parallelize_module(copy.deepcopy(block), mesh, {  # shards the same weights
        **{name: ColwiseParallel(use_local_output=use_local_output) for name in "qkv"},
        "out": RowwiseParallel(),
    })
    weight = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    out = block(x)
    (out * weight).sum().backward()
    sharded_out = sharded(x)
    (sharded_out * weight).sum().backward()
    torch.testing.assert_close(sharded_out, out, atol=tolerance, rtol=tolerance)
    if not use_local_output:  # attention ran on head-sharded DTensors, its output sharded alike
        assert sharded.seen_placements == [(Shard(1),)] * 4, sharded.seen_placements
    for (name, p), (_, sp) in zip(block.named_parameters(), sharded.named_parameters()):
        grad = sp.grad.full_tensor() if isinstance(sp.grad, DTensor) else sp.grad
        torch.testing.assert_close(grad, p.grad, atol=tolerance, rtol=tolerance,
                                   msg=lambda m: f"grad of {name}: {m}")
