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
from attention_testing import assert_fa2_close
from flash_testing import assert_close


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


# (name, layout fields): capacity is a multiple of every page size it is paired with.
LAYOUTS = [
    ("contiguous", dict(capacity=160)),
    ("page16", dict(capacity=160, page_size=16)),
    ("page48", dict(capacity=192, page_size=48)),
    ("page256", dict(capacity=256, page_size=256)),
]

FEATURES = [
    ("decode", Case()),
    ("decode_full", Case(seqlens=["full", 0, 7])),
    ("decode_gqa4", Case(heads_q=8, heads_kv=2, seqlens=[0, 100, "full"])),
    ("decode_gqa8_softcap", Case(heads_q=8, heads_kv=1, softcap=1.5)),
    ("no_append", Case(seqlen_new=0, seqlens=[0, "full", 33])),
    ("chunk_causal", Case(seqlen_q=5, seqlen_new=5, causal=True, heads_q=8, heads_kv=2)),
    ("spec_window", Case(seqlen_q=3, seqlen_new=3, window_size=(4, 0))),
    ("window_left_gqa", Case(heads_q=8, heads_kv=2, window_size=(10, -1))),
    ("rotary_interleaved", Case(seqlen_q=2, seqlen_new=2, rotary_dim=8, causal=True)),
    ("rotary_half", Case(seqlen_q=3, seqlen_new=3, rotary_dim=8, rotary_interleaved=False)),
    ("rotary_full_dim_gqa", Case(heads_q=8, heads_kv=2, rotary_dim=16, rotary_interleaved=False)),
    ("leftpad", Case(seqlen_q=2, seqlen_new=2, leftpad=[0, 5, 40], rotary_dim=8, causal=True)),
    # The last sequence is padding up to the cache's end (leftpad = cache_seqlens = capacity):
    # no key, nothing appended.
    ("leftpad_whole_cache", Case(seqlen_new=0, seqlens=[0, 33, "full"], leftpad=[0, 5, 10**6],
                                 causal=True, heads_q=8, heads_kv=2)),
    ("alibi_h", Case(seqlen_q=2, seqlen_new=2, alibi="h", causal=True)),
    ("alibi_bh_gqa", Case(heads_q=8, heads_kv=2, alibi="bh")),
    ("scale", Case(softmax_scale=0.3, seqlen_q=4, seqlen_new=1)),
    ("splits3", Case(heads_q=8, heads_kv=2, num_splits=3, seqlens=[0, 70, "full"])),
    ("splits1_causal", Case(seqlen_q=4, seqlen_new=4, num_splits=1, causal=True)),
    ("splits5_window", Case(seqlen_q=3, seqlen_new=2, num_splits=5, window_size=(30, 2),
                            leftpad=[3, 0, 9])),
]


def check_case(case: Case, dtype, device="cpu", seed=0):
    """out and softmax_lse at every position, and the whole caches: rows outside the append
    bit-identical, appended rows as the reference wrote them. fp64/fp32 against the fp64 reference
    (flash_testing tolerances); fp16/bf16 FlashAttention-2 style (within twice the error of the
    reference's math in that dtype)."""
    kwargs, lengths = make_inputs(case, dtype, device, seed=seed)
    (out, lse, k_cache, v_cache), (ref_out, ref_lse, ref_k, ref_v) = run_case(kwargs)
    assert out.shape == kwargs["q"].shape and out.dtype == dtype and out.device.type == device
    assert lse.shape == (case.batch, case.heads_q, case.seqlen_q) and lse.dtype in (
        torch.float32, torch.float64)
    out, lse, k_cache, v_cache = (t.cpu() for t in (out, lse, k_cache, v_cache))
    if dtype in (torch.float64, torch.float32):
        assert_close(out, ref_out, "out")
        assert_close(lse, ref_lse, "softmax_lse")
    else:
        _, (base_out, base_lse, _, _) = run_case(kwargs, compute_dtype=dtype)
        assert_fa2_close(out, ref_out, base_out, name="out")
        hidden = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), hidden), "lse: -inf rows differ"
        assert_fa2_close(lse[~hidden], ref_lse[~hidden], base_lse[~hidden].float(), name="lse",
                         atol=1e-3)
    written = appended_rows(kwargs, lengths)
    for name, got, ref, before in (("k_cache", k_cache, ref_k, kwargs["k_cache"].cpu()),
                                   ("v_cache", v_cache, ref_v, kwargs["v_cache"].cpu())):
        assert torch.equal(got[~written], before[~written]), f"{name}: rows outside the append changed"
        if dtype in (torch.float64, torch.float32):
            assert_close(got[written], ref[written], f"{name} (appended rows)")
        else:  # rotated in fp32 here, in fp64 there: one rounding apart
            torch.testing.assert_close(got[written], ref[written], atol=2e-3, rtol=8e-3)
    return kwargs
