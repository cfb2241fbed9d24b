"""Timing and peak-memory measurement shared by the benchmarks and the demo."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_graph_replay(fn: Callable[[], Any], warmup: int = 2) -> Callable[[], None]:
    """``fn`` captured once in a CUDA graph: its replay, which launches fn's kernels with no host
    work per launch (as a serving or graph-captured training loop runs a step). The warm-up calls
    run on a side stream, as capturing autograd requires (the engine's first backward sets up
    state that must not be captured). The graph keeps its memory until the replay is dropped."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _triton_do_bench():
    try:
        from triton.testing import do_bench  # type: ignore
        return do_bench
    except Exception:
        return None


def time_fn(fn: Callable[[], Any], device: torch.device, budget_s: Optional[float] = None, *,
            reps: Optional[int] = None, setup: Optional[Callable[[], None]] = None,
            estimate_ms: Optional[float] = None, max_reps: int = 200,
            timer: str = "auto") -> Dict[str, Any]:
    """Median / p20 / p80 milliseconds of ``fn``: exactly ``reps`` timed repetitions after one
    warm-up call, or as many repetitions as fit ``budget_s`` (give one of the two).

    ``setup`` runs before every repetition outside the timed region. ``estimate_ms`` (the time of
    one earlier call) lets slow functions skip the extra warm-up call under a budget.
    ``triton.testing.do_bench`` measures for a time, not a count: only under a budget.
    """
    if (budget_s is None) == (reps is None):
        raise ValueError("time_fn: give exactly one of budget_s and reps")
    device = torch.device(device)
    if reps is not None:
        if reps < 1:
            raise ValueError(f"time_fn: reps must be at least 1, got {reps}")
        if setup:
            setup()
        fn()  # warm-up
        synchronize(device)
        return _timed_loop(fn, device, reps, setup)
    do_bench = _triton_do_bench() if (device.type == "cuda" and timer in ("auto", "do_bench")) else None
    if estimate_ms is None or estimate_ms < 50 or estimate_ms < 0.5 * budget_s * 1e3:
        # warm-up call, which also gives the estimate (skipped only for slow calls on a tight budget)
        if setup:
            setup()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        estimate_ms = (time.perf_counter() - t0) * 1e3
    estimate_ms = max(estimate_ms, 1e-3)
    reps = int(max(1, min(max_reps, (budget_s * 1e3) // estimate_ms)))
    if do_bench is not None and (timer == "do_bench" or reps >= 20):
        try:
            qs = do_bench(fn, warmup=max(1, int(min(25, 0.2 * budget_s * 1e3))),
                          rep=max(1, int(0.8 * budget_s * 1e3)), quantiles=[0.5, 0.2, 0.8],
                          grad_to_none=None if setup is None else _GradNone(setup))
            med, p20, p80 = (float(x) for x in qs)
            return {"ms": med, "p20": p20, "p80": p80, "reps": None, "timer": "triton.do_bench"}
        except Exception:
            pass  # API differences across Triton versions: fall back to the own loop
    return _timed_loop(fn, device, reps, setup)


def _timed_loop(fn: Callable[[], Any], device: torch.device, reps: int,
                setup: Optional[Callable[[], None]]) -> Dict[str, Any]:
    times: List[float] = []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if setup:
                setup()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        name = "cuda-events"
    else:
        for _ in range(reps):
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        name = "perf_counter"
    return {"ms": _quantile(times, 0.5), "p20": _quantile(times, 0.2), "p80": _quantile(times, 0.8),
            "reps": reps, "timer": name}


class _GradNone(list):
    """do_bench's grad_to_none wants tensors; we pass a list whose iteration runs ``setup``."""

    def __init__(self, setup):
        super().__init__()
        self._setup = setup

    def __iter__(self):
        self._setup()
        return iter(())


class _mute_fd2:
    """Silences file descriptor 2 (C++ logging) for a moment; Python exceptions are unaffected."""

    def __enter__(self):
        try:
            sys.stderr.flush()
            self._saved = os.dup(2)
            self._null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(self._null, 2)
        except Exception:
            self._saved = None
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            os.dup2(self._saved, 2)
            os.close(self._saved)
            os.close(self._null)
        return False


def _cpu_peak_from_profiler(prof) -> Optional[int]:
    try:
        tree = prof.profiler.kineto_results.experimental_event_tree()
    except Exception:
        return None
    allocs = []
    stack = list(tree)
    while stack:
        node = stack.pop()
        size = getattr(getattr(node, "extra_fields", None), "alloc_size", None)
        if node.name == "[memory]" and size is not None:
            allocs.append((node.start_time_ns, int(size)))
        stack.extend(node.children)
    allocs.sort()
    current = peak = 0
    for _, size in allocs:
        current += size
        peak = max(peak, current)
    return peak


def peak_memory_mb(fn: Callable[[], Any], device: torch.device) -> Optional[float]:
    """Peak memory (MB) that ``fn`` allocates above what is allocated before it.

    CUDA: the ``torch.cuda.max_memory_allocated`` delta. CPU: the running sum of the allocator's
    alloc/free events recorded by ``torch.profiler(profile_memory=True)``; None where unavailable
    (memory a kernel takes outside PyTorch's allocator is not seen).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    try:
        from torch.profiler import ProfilerActivity, profile
    except Exception:
        fn()
        return None
    # fd 2 muted: some builds print profiler_start/stop lines and "memory block of unknown size"
    # warnings from C++; Python exceptions still propagate.
    with _mute_fd2():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    peak = _cpu_peak_from_profiler(prof)
    return None if peak is None else peak / 2**20
