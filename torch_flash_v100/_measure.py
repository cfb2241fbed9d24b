"""Peak-memory measurement shared by the benchmarks and the demo."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import torch


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
