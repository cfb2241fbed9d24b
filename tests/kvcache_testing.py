"""Inputs of flash_attn_with_kvcache for the CPU and CUDA tests: contiguous or paged caches filled
with random rows, cache lengths, left padding, batch permutations, rotary tables; and the run of
one case through the function and the fp64 reference (kvcache_reference), whose results and whole
caches the tests compare."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from torch_flash_v100.flash_attn_interface import flash_attn_with_kvcache
from torch_flash_v100.reference import kvcache_reference


@dataclass
class Case:
    """One problem. capacity: rows per sequence (contiguous S_cache, or pages * page_size).
    seqlens: cache_seqlens per sequence ("full": capacity - seqlen_new)."""
    batch: int = 3
    heads_q: int = 4
    heads_kv: int = 4
    dim: int = 16
    seqlen_q: int = 1
    seqlen_new: int = 1
    capacity: int = 160
    page_size: Optional[int] = None
    seqlens: Optional[list] = None
    leftpad: Optional[list] = None
    batch_idx: bool = False
    rotary_dim: int = 0
    rotary_interleaved: bool = True
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None  # "h": [Hq] slopes, "bh": [B, Hq]
    num_splits: int = 0
    softmax_scale: Optional[float] = None
    extra: dict = field(default_factory=dict)


def _randn(*shape, dtype, device, generator):
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device, dtype)


def make_inputs(case: Case, dtype, device, seed=0):
    """(kwargs of flash_attn_with_kvcache, the cache_seqlens as a list)."""
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, d = case.batch, case.heads_q, case.heads_kv, case.dim
    room = case.capacity - case.seqlen_new
    if case.seqlens is None:
        lengths = [int(torch.randint(0, room + 1, (1,), generator=g)) for _ in range(b)]
    else:
        lengths = [room if s == "full" else s for s in case.seqlens]
    kwargs = {}
    if case.page_size is None:
        cache_batch = b + 2 if case.batch_idx else b
        k_cache = _randn(cache_batch, case.capacity, hkv, d, dtype=dtype, device=device, generator=g)
        if case.batch_idx:
            perm = torch.randperm(cache_batch, generator=g)[:b]
            kwargs["cache_batch_idx"] = perm.to(device, torch.int32)
    else:
        pages = case.capacity // case.page_size
        num_pages = b * pages + 3
        k_cache = _randn(num_pages, case.page_size, hkv, d, dtype=dtype, device=device, generator=g)
        table = torch.randperm(num_pages, generator=g)[:b * pages].reshape(b, pages)
        kwargs["block_table"] = table.to(device, torch.int32)
    v_cache = _randn(*k_cache.shape, dtype=dtype, device=device, generator=g)
    q = _randn(b, case.seqlen_q, hq, d, dtype=dtype, device=device, generator=g)
    if case.seqlen_new > 0:
        kwargs["k"] = _randn(b, case.seqlen_new, hkv, d, dtype=dtype, device=device, generator=g)
        kwargs["v"] = _randn(b, case.seqlen_new, hkv, d, dtype=dtype, device=device, generator=g)
    if case.rotary_dim:
        rows = case.capacity + case.seqlen_q
        angle = torch.rand(rows, case.rotary_dim // 2, generator=g, dtype=torch.float64) * 6.3
        kwargs["rotary_cos"] = angle.cos().to(device, dtype)
        kwargs["rotary_sin"] = angle.sin().to(device, dtype)
        kwargs["rotary_interleaved"] = case.rotary_interleaved
    if case.leftpad is not None:
        kwargs["cache_leftpad"] = torch.tensor(
            [min(p, n) for p, n in zip(case.leftpad, lengths)], dtype=torch.int32, device=device)
    if case.alibi == "h":
        kwargs["alibi_slopes"] = (torch.rand(hq, generator=g) * 0.3).to(device)
    elif case.alibi == "bh":
        kwargs["alibi_slopes"] = (torch.rand(b, hq, generator=g) * 0.3).to(device)
    kwargs.update(q=q, k_cache=k_cache, v_cache=v_cache,
                  cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
                  causal=case.causal, window_size=case.window_size, softcap=case.softcap,
                  num_splits=case.num_splits, softmax_scale=case.softmax_scale, **case.extra)
    return kwargs, lengths


def run_case(kwargs, compute_dtype=torch.float64):
    """((out, lse, k_cache, v_cache) of flash_attn_with_kvcache on copies of the caches,
    the same of the reference in compute_dtype)."""
    mine = dict(kwargs, k_cache=kwargs["k_cache"].clone(), v_cache=kwargs["v_cache"].clone())
    out, lse = flash_attn_with_kvcache(**mine, return_softmax_lse=True)
    ref_kwargs = {key: value for key, value in kwargs.items() if key != "num_splits"}
    ref_kwargs = {key: (value.cpu() if torch.is_tensor(value) else value)
                  for key, value in ref_kwargs.items()}
    q, k_cache, v_cache = (ref_kwargs.pop(n) for n in ("q", "k_cache", "v_cache"))
    k, v = ref_kwargs.pop("k", None), ref_kwargs.pop("v", None)
    reference = kvcache_reference(q, k_cache, v_cache, k, v, compute_dtype=compute_dtype,
                                  **ref_kwargs)
    return (out, lse, mine["k_cache"], mine["v_cache"]), reference


def appended_rows(kwargs, lengths):
    """Bool mask over k_cache's [pages or batch, rows] of the rows the append may write."""
    k_cache = kwargs["k_cache"]
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    seqlen_new = 0 if kwargs.get("k") is None else kwargs["k"].shape[1]
    table = kwargs.get("block_table")
    batch_idx = kwargs.get("cache_batch_idx")
    for b, length in enumerate(lengths):
        rows = torch.arange(length, length + seqlen_new)
        if table is not None:
            page_size = k_cache.shape[1]
            written[table[b].cpu().long()[rows // page_size], rows % page_size] = True
        else:
            written[b if batch_idx is None else int(batch_idx[b]), rows] = True
    return written
