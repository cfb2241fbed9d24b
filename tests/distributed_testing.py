"""Multi-process tests: a function run on every rank of a process group in spawned processes.

One spawn per test module (its cases run inside one job, each rank reporting which failed): a
spawned process pays torch's import, and CI machines have few cores. CPU tests use gloo; the
2-GPU tests (tests/cuda) use NCCL, one GPU per rank.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Bounds a run whose ranks went out of step (a collective that only some reached) instead of
# hanging the suite: gloo/NCCL then raise on the waiting ranks.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def _entry(rank: int, fn: Callable, world_size: int, backend: str, init_file: str,
           result_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int = 2, *args: Any, backend: str = "gloo") -> List[Any]:
    """``fn(rank, world_size, *args)`` on every rank of a fresh process group; returns each
    rank's result (picklable). ``fn`` must be importable by name (defined at module level)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_entry, args=(fn, world_size, backend, init_file, tmp, args),
                           nprocs=world_size, join=True, start_method="spawn")
        return [torch.load(os.path.join(tmp, f"{rank}.pt")) for rank in range(world_size)]


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
