"""Decode benchmark: one new token per sequence against a KV cache (flash_attn_with_kvcache).

    python -m torch_flash_v100 bench --suite decode --device cuda \\
        --json benchmarks/results/decode_h200.json

Per configuration (B sequences, Hq/Hkv heads, a cache of S keys each, head dim D, fp16) and per
implementation: the latency of one decode step and the achieved bandwidth, bytes of K and V read
(2 * B * S * Hkv * D * itemsize) over that time, also as a fraction of the HBM bandwidth measured
in the same run with a device-to-device copy (read + write bytes over time). Every timed call is
preceded by a write of a buffer larger than the L2 cache, so that no step finds the cache there.
On CUDA each step is timed twice: called eagerly (the time between events around the call, which
includes host work the GPU waits for), and captured once in a CUDA graph and replayed (the GPU's
time alone, as a serving loop that replays its decode step sees it). The implementations sharing a
cache are timed side by side: each round times each of them once, and a row gives the median over
the rounds.

Implementations:
- ``flashv100``: flash_attn_with_kvcache on a contiguous cache [B, S_cache, Hkv, D], appending the
  step's key/value at row S - 1 (in place) and attending S keys;
- ``flashv100-paged``: the same on a paged cache (page_size rows per page, pages shuffled);
- ``flashv100-trusted`` / ``flashv100-paged-trusted``: the same with ``check_index_values=False``
  (no device-to-host copies of the index values, as FlashAttention-2);
- ``sdpa-flash`` / ``sdpa-efficient``: scaled_dot_product_attention on the same contiguous cache
  (a [B, Hkv, S, D] view, no copy), without the append (they have no cache); for GQA with
  ``enable_gqa`` where the backend takes it, else on K/V expanded to Hq heads once, outside the
  timing (a cache stored with Hq heads: Hq / Hkv times the bytes, which its GB/s counts);
- ``naive``: eager matmul-softmax-matmul, K/V repeated per call for GQA.

Configurations whose K/V (or expanded K/V) exceed ``max_kv_bytes`` are recorded as skipped.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from torch_flash_v100._measure import cuda_graph_replay
from torch_flash_v100.bench.harness import collect_metadata
from torch_flash_v100.reference import naive_attention

__all__ = ["DecodeConfig", "decode_configs", "run_decode", "markdown", "DECODE_IMPLS"]

DECODE_IMPLS = ["flashv100", "flashv100-trusted", "flashv100-paged", "flashv100-paged-trusted",
                "sdpa-flash", "sdpa-efficient", "naive"]
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class DecodeConfig:
    B: int
    Hq: int
    Hkv: int
    S: int  # keys attended per sequence (the cache holds them, the new one included)
    D: int = 128
    page_size: int = 256
    dtype: str = "fp16"

    def key(self) -> str:
        return f"B{self.B} H{self.Hq}/{self.Hkv} S{self.S} D{self.D} {self.dtype}"

    def itemsize(self) -> int:
        return torch.empty((), dtype=_DTYPES[self.dtype]).element_size()

    def kv_bytes(self, heads: Optional[int] = None) -> int:
        """Bytes of K and V of the cache (with `heads` heads: an expanded cache)."""
        return 2 * self.B * self.S * (heads or self.Hkv) * self.D * self.itemsize()


def decode_configs(device: str) -> List[DecodeConfig]:
    """CUDA: B in {1, 8, 32, 128} x S in 1k..128k x Hq/Hkv in {32/8, 32/32}, D 128, fp16. CPU:
    a tiny set that exercises the plumbing in seconds."""
    if not str(device).startswith("cuda"):
        return [DecodeConfig(b, 4, kv, s, 16, 16, "fp32") for b in (1, 2) for kv in (2, 4)
                for s in (64, 256)]
    return [DecodeConfig(b, 32, kv, s) for kv in (8, 32) for b in (1, 8, 32, 128)
            for s in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)]


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_side_by_side(fns: Dict[str, Callable[[], object]], device: torch.device, reps: int,
                       flush: Optional[torch.Tensor]) -> Dict[str, object]:
    """name -> median seconds of one call (or the exception it raised), the calls taken in turn
    within each of `reps` rounds after one warm-up call each, every call after an L2 flush: drift
    of clocks or memory state over a configuration falls on every implementation alike (measured
    one after the other, the first paged implementation after the cache was built ran 6-13%
    slower than the same CUDA graph measured right after it)."""
    failed: Dict[str, object] = {}
    for name, fn in fns.items():
        try:
            fn()
        except (RuntimeError, torch.OutOfMemoryError) as e:
            failed[name] = e
    times: Dict[str, List[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if name in failed:
                continue
            if flush is not None:
                flush.zero_()
            try:
                if device.type == "cuda":
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end) / 1e3)
                else:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                failed[name] = e
    return {n: failed[n] if n in failed else statistics.median(times[n]) for n in fns}


def measure_hbm_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """Device-to-device copy bandwidth in bytes/s: (read + write) bytes over the median time."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _time_side_by_side({"copy": lambda: dst.copy_(src)}, device, reps, None)["copy"]
    if isinstance(seconds, BaseException):
        raise seconds
    return 2 * src.numel() * src.element_size() / seconds


def _sdpa_call(backend_name: str, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    gqa = q.shape[1] != k.shape[1]

    def call(k_, v_, native_gqa):
        with sdpa_kernel([backend]):
            if native_gqa:
                return F.scaled_dot_product_attention(q, k_, v_, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k_, v_)

    return call, gqa


def _is_paged(impl: str) -> bool:
    return impl.startswith("flashv100-paged")


def _build(cfg: DecodeConfig, device: torch.device, impls: List[str], max_kv_bytes: int,
           seed: int = 0):
    """name -> (callable, bytes read) or (None, reason)."""
    dtype = _DTYPES[cfg.dtype]
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    from torch_flash_v100.flash_attn_interface import flash_attn_with_kvcache

    out: Dict[str, tuple] = {}
    if cfg.kv_bytes() > max_kv_bytes:
        return {n: (None, f"K/V of {cfg.kv_bytes() / 2**30:.1f} GiB exceed the cap") for n in impls}
    q = rnd(cfg.B, 1, cfg.Hq, cfg.D)
    k_new, v_new = rnd(cfg.B, 1, cfg.Hkv, cfg.D), rnd(cfg.B, 1, cfg.Hkv, cfg.D)
    seqlens = torch.full((cfg.B,), cfg.S - 1, dtype=torch.int32, device=device)
    contiguous = paged = None
    if any(not _is_paged(n) for n in impls):
        contiguous = (rnd(cfg.B, cfg.S, cfg.Hkv, cfg.D), rnd(cfg.B, cfg.S, cfg.Hkv, cfg.D))
    if any(_is_paged(n) for n in impls):
        pages = -(-cfg.S // cfg.page_size)
        perm = torch.randperm(cfg.B * pages, generator=torch.Generator().manual_seed(seed))
        paged = (rnd(cfg.B * pages, cfg.page_size, cfg.Hkv, cfg.D),
                 rnd(cfg.B * pages, cfg.page_size, cfg.Hkv, cfg.D),
                 perm.reshape(cfg.B, pages).to(device, torch.int32))
    read = cfg.kv_bytes()
    for name in impls:
        if name.startswith("flashv100"):
            kc, vc, table = paged if _is_paged(name) else (*contiguous, None)
            out[name] = (lambda kc=kc, vc=vc, table=table, check=not name.endswith("-trusted"):
                         flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                                 block_table=table, check_index_values=check),
                         read)
        elif name in ("sdpa-flash", "sdpa-efficient"):
            backend = "FLASH_ATTENTION" if name == "sdpa-flash" else "EFFICIENT_ATTENTION"
            qs = q.transpose(1, 2)
            ks, vs = (t.transpose(1, 2) for t in contiguous)
            try:
                call, gqa = _sdpa_call(backend, qs, ks, vs)
            except (ImportError, AttributeError) as e:
                out[name] = (None, f"SDPA backend unavailable: {e}")
                continue
            entry = None
            if gqa:
                try:
                    call(ks, vs, True)
                    entry = (lambda call=call, ks=ks, vs=vs: call(ks, vs, True), read)
                except (RuntimeError, TypeError):
                    if cfg.kv_bytes() + cfg.kv_bytes(cfg.Hq) > max_kv_bytes:
                        entry = (None, "no native GQA and expanded K/V exceed the cap")
                    else:
                        group = cfg.Hq // cfg.Hkv
                        ke, ve = (t.repeat_interleave(group, dim=1) for t in (ks, vs))
                        entry = (lambda call=call, ke=ke, ve=ve: call(ke, ve, False),
                                 cfg.kv_bytes(cfg.Hq))
            else:
                entry = (lambda call=call, ks=ks, vs=vs: call(ks, vs, False), read)
            if entry[0] is not None:
                try:
                    entry[0]()
                except RuntimeError as e:
                    entry = (None, " ".join(str(e).split())[:300])
            out[name] = entry
        elif name == "naive":
            if cfg.Hq != cfg.Hkv and cfg.kv_bytes() + cfg.kv_bytes(cfg.Hq) > max_kv_bytes:
                out[name] = (None, "repeated K/V exceed the cap")
                continue
            qs = q.transpose(1, 2)
            ks, vs = (t.transpose(1, 2) for t in contiguous)
            out[name] = (lambda qs=qs, ks=ks, vs=vs: naive_attention(qs, ks, vs), read)
        else:
            raise KeyError(f"unknown decode implementation {name!r}; choose from {DECODE_IMPLS}")
    return out


def _error(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _measure_group(cfg: DecodeConfig, built: dict, group: List[str], device: torch.device,
                   reps: int, flush: Optional[torch.Tensor], bandwidth: float) -> List[dict]:
    """One row per implementation of a group sharing a cache: eager calls timed side by side,
    then (CUDA) the calls' graph replays timed side by side."""
    rows = {n: {"config": asdict(cfg), "key": cfg.key(), "impl": n} for n in group}
    for name in group:
        if built[name][0] is None:
            rows[name].update(status="skipped", reason=built[name][1])
    runnable = {n: built[n][0] for n in group if built[n][0] is not None}
    for name, seconds in _time_side_by_side(runnable, device, reps, flush).items():
        if isinstance(seconds, BaseException):
            rows[name].update(status="error", reason=_error(seconds))
            continue
        read = built[name][1]
        rows[name].update(status="ok", time_us=seconds * 1e6, bytes_read=read,
                          gbps=read / seconds / 1e9, hbm_fraction=read / seconds / bandwidth)
    if device.type == "cuda":
        graphs = {}
        for name in (n for n in runnable if rows[n]["status"] == "ok"):
            try:
                graphs[name] = cuda_graph_replay(runnable[name])
            except (RuntimeError, torch.OutOfMemoryError) as e:
                rows[name].update(graph_error=_error(e))
        for name, seconds in _time_side_by_side(graphs, device, reps, flush).items():
            if isinstance(seconds, BaseException):
                rows[name].update(graph_error=_error(seconds))
            else:
                rows[name].update(graph_time_us=seconds * 1e6,
                                  graph_hbm_fraction=built[name][1] / seconds / bandwidth)
    return [rows[n] for n in group]


def run_decode(configs: List[DecodeConfig], device="cuda", *, impls: Optional[List[str]] = None,
               reps: int = 20, max_kv_bytes: Optional[int] = None,
               hbm_copy_bytes: Optional[int] = None, progress: bool = False) -> dict:
    """The result document: metadata (device, measured HBM bandwidth) and one row per
    (configuration, implementation) with status, time_us, gbps, hbm_fraction or the reason."""
    device = torch.device(device)
    impls = impls or DECODE_IMPLS
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        total = props.total_memory
        max_kv_bytes = max_kv_bytes or int(0.4 * total)
        hbm_copy_bytes = hbm_copy_bytes or min(4 << 30, total // 8)
        l2 = getattr(props, "L2_cache_size", 64 << 20)
        flush = torch.empty(max(4 * l2, 256 << 20) // 4, dtype=torch.float32, device=device)
        name = props.name
    else:
        max_kv_bytes = max_kv_bytes or (1 << 30)
        hbm_copy_bytes = hbm_copy_bytes or (64 << 20)
        flush = None
        name = platform.processor() or "cpu"
    bandwidth = measure_hbm_bandwidth(device, hbm_copy_bytes, reps)
    rows = []
    started = time.time()
    for i, cfg in enumerate(configs):
        if progress:
            print(f"[{i + 1}/{len(configs)}] {cfg.key()}", flush=True)
        # The contiguous cache's users, then the paged cache alone: one cache in memory at a time.
        groups = [[n for n in impls if not _is_paged(n)], [n for n in impls if _is_paged(n)]]
        for group in (g for g in groups if g):
            try:
                built = _build(cfg, device, group, max_kv_bytes, seed=i)
            except torch.OutOfMemoryError as e:
                built = {n: (None, f"out of memory: {str(e).splitlines()[0]}") for n in group}
            rows.extend(_measure_group(cfg, built, group, device, reps, flush, bandwidth))
            del built
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {
        "metadata": {"suite": "decode", "device": name, "torch": torch.__version__,
                     "commit": collect_metadata(device)["git_commit"],
                     "hbm_copy_gbps": bandwidth / 1e9, "hbm_copy_bytes": hbm_copy_bytes,
                     "max_kv_bytes": max_kv_bytes, "repetitions": reps,
                     "elapsed_s": time.time() - started},
        "results": rows,
    }


def markdown(doc: dict) -> str:
    meta = doc["metadata"]
    lines = [f"# Decode: one token per sequence against a KV cache ({meta['device']})", "",
             f"torch {meta['torch']}, commit {str(meta.get('commit'))[:10]}; HBM copy bandwidth {meta['hbm_copy_gbps']:.0f} GB/s "
             f"(read + write); median of {meta['repetitions']} steps, L2 flushed before each. "
             "Eager: one call per step (host work included where the GPU waits for it); graph: "
             "the step captured once in a CUDA graph and replayed, as serving loops run it.",
             "", "| configuration | implementation | time (us) | GB/s (K/V read) | of HBM "
             "| graph time (us) | graph: of HBM |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in doc["results"]:
        if r["status"] == "ok":
            graph = (f"{r['graph_time_us']:.1f} | {100 * r['graph_hbm_fraction']:.0f}%"
                     if "graph_time_us" in r else f"{r.get('graph_error', '-')} |")
            lines.append(f"| {r['key']} | {r['impl']} | {r['time_us']:.1f} | {r['gbps']:.0f} | "
                         f"{100 * r['hbm_fraction']:.0f}% | {graph} |")
        else:
            lines.append(f"| {r['key']} | {r['impl']} | {r['status']}: {r.get('reason', '')} "
                         "| | | | |")
    return "\n".join(lines) + "\n"


def write(doc: dict, json_path) -> Path:
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    path.with_suffix(".md").write_text(markdown(doc))
    return path


def run_cli(device: str, json_path=None, impls=None, repetitions=None, progress=True) -> int:
    doc = run_decode(decode_configs(device), device, impls=impls, reps=repetitions or 20,
                     progress=progress)
    print(markdown(doc))
    if json_path:
        print(f"wrote {write(doc, json_path)} and its .md")
    return 0
