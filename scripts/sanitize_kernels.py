#!/usr/bin/env python3
"""A few odd shapes through the fused forward and backward on both atoms, in each kernel variant
(plain, dropout alone, a broadcast additive mask plus dropout, a prefix padding mask), and the
FlashAttention-2 ops on packed batches with empty sequences, windows, softcap, ALiBi, dropout and
GQA, flash_attn_with_kvcache (decode tile, paged caches, split-KV and its combine, rotary, left
padding, batch indices, chunked prefill) and packed queries over a paged cache: the workload that
scripts/gpu_check.sh runs under compute-sanitizer (memcheck, racecheck, synccheck, initcheck).
Exits non-zero on a non-finite result; the sanitizer reports memory errors and shared-memory
races itself."""
import argparse
import math
import sys

import torch

import torch_flash_v100 as tfv

SHAPES = [  # (B, Hq, Hkv, L, S, E, causal_mode)
    (1, 2, 1, 1, 7, 8, 0),
    (1, 2, 2, 33, 17, 40, 1),
    (2, 2, 1, 17, 70, 136, 2),
    (1, 1, 1, 65, 33, 256, 1),
    (1, 2, 1, 40, 100, 96, 2),  # keys in one wide backward tile, two compact ones (sm_90)
]


FLASH_CASES = [  # (lengths_q, lengths_k, Hq, Hkv, E, causal, window, softcap, ALiBi, dropout)
    ([0, 9, 1, 70], [5, 0, 1, 33], 2, 1, 40, False, (16, 3), 2.0, True, 0.1),
    ([65, 0, 17], [17, 3, 130], 2, 2, 136, True, (-1, -1), 0.0, True, 0.0),
    ([33, 200], [200, 33], 2, 1, 256, False, (7, -1), 5.0, False, 0.2),
]


def flash_cases() -> int:
    """The FlashAttention-2 ops on packed batches, both atoms, both dQ paths."""
    ops = torch.ops.flashv100
    bad = 0
    for force_volta in (True, False):
        with tfv.volta_atom(force_volta):
            for lq, lk, hq, hkv, d, causal, (left, right), softcap, alibi, p in FLASH_CASES:
                g = torch.Generator(device="cuda").manual_seed(0)
                cu_q = torch.tensor([0] + lq, device="cuda").cumsum(0).int()
                cu_k = torch.tensor([0] + lk, device="cuda").cumsum(0).int()
                q = torch.randn(sum(lq), hq, d, device="cuda", dtype=torch.float16, generator=g)
                k = torch.randn(sum(lk), hkv, d, device="cuda", dtype=torch.float16, generator=g)
                v = torch.randn(sum(lk), hkv, d, device="cuda", dtype=torch.float16, generator=g)
                slopes = torch.rand(len(lq), hq, device="cuda", generator=g) if alibi else None
                scale = 1.0 / math.sqrt(d)
                args = (cu_q, cu_k, max(lq), max(lk), p, scale, causal, left, right, softcap,
                        slopes)
                out, lse, rng = ops._flash_forward(q, k, v, *args)
                dout = torch.randn_like(out)
                for deterministic in (False, True):
                    grads = ops._flash_backward(dout, q, k, v, out, lse, rng, *args,
                                                deterministic)
                    torch.cuda.synchronize()
                    if not all(torch.isfinite(t).all() for t in (out, *grads)):
                        print("non-finite result (flash)", force_volta, (lq, lk, hq, hkv, d))
                        bad += 1
    return bad


KVCACHE_CASES = [  # (B, Hq, Hkv, D, seqlen_q, seqlens, capacity, page_size, splits, extras)
    (3, 8, 2, 128, 1, [0, 37, 300], 320, None, 0, dict(leftpad=[0, 5, 200])),
    (2, 4, 1, 64, 1, [15, 95], 96, 16, 3, dict(rotary=True)),
    (3, 2, 2, 256, 1, [1, 64, 130], 144, 48, 7, {}),
    (2, 8, 8, 40, 5, [0, 60], 80, None, 2, dict(batch_idx=True, rotary=True)),
    (1, 8, 2, 128, 33, [100], 192, 16, 0, dict(window=(31, 0), softcap=3.0)),
    (2, 8, 2, 128, 1, [100, 254], 256, 128, 3, dict(leftpad=[3, 0])),
    # The last sequence is padding up to its pages' end and gets no new key: no key to read.
    (2, 8, 2, 128, 1, [64, 256], 256, 128, 0, dict(leftpad=[0, 256], append=False)),
]


def kvcache_cases() -> int:
    """flash_attn_with_kvcache, both atoms: each step appends one new key/value per sequence
    (unless the case says append=False)."""
    from torch_flash_v100.flash_attn_interface import flash_attn_with_kvcache

    bad = 0
    for force_volta in (True, False):
        with tfv.volta_atom(force_volta):
            for b, hq, hkv, d, lq, lens, cap, page, splits, extra in KVCACHE_CASES:
                g = torch.Generator(device="cuda").manual_seed(0)

                def randn(*shape):
                    return torch.randn(*shape, device="cuda", dtype=torch.float16, generator=g)

                kwargs = dict(cache_seqlens=torch.tensor(lens, device="cuda").int(),
                              causal=True, num_splits=splits,
                              window_size=extra.get("window", (-1, -1)),
                              softcap=extra.get("softcap", 0.0))
                if page is None:
                    rows = b + 1 if extra.get("batch_idx") else b
                    k_cache, v_cache = randn(rows, cap, hkv, d), randn(rows, cap, hkv, d)
                    if extra.get("batch_idx"):
                        kwargs["cache_batch_idx"] = torch.arange(rows - 1, -1, -1, device="cuda")[
                            :b].int()
                else:
                    pages = cap // page
                    k_cache, v_cache = randn(b * pages, page, hkv, d), randn(b * pages, page, hkv, d)
                    kwargs["block_table"] = torch.randperm(
                        b * pages, device="cuda", generator=g).view(b, pages).int()
                if "leftpad" in extra:
                    kwargs["cache_leftpad"] = torch.tensor(extra["leftpad"], device="cuda").int()
                if extra.get("rotary"):
                    angles = torch.rand(cap + lq, d // 4, device="cuda", generator=g)
                    kwargs.update(rotary_cos=angles.cos().half(), rotary_sin=angles.sin().half())
                new_kv = ((randn(b, lq, hkv, d), randn(b, lq, hkv, d))
                          if extra.get("append", True) else (None, None))
                out = flash_attn_with_kvcache(randn(b, lq, hq, d), k_cache, v_cache, *new_kv,
                                              **kwargs)
                torch.cuda.synchronize()
                if not torch.isfinite(out).all():
                    print("non-finite result (kvcache)", force_volta, (b, hq, hkv, d, lq, lens))
                    bad += 1
    return bad


PAGED_VARLEN_CASES = [  # (lengths_q, lengths_k, Hq, Hkv, D, page_size, causal, window)
    ([0, 9, 1, 70], [5, 0, 1, 300], 8, 2, 128, 16, True, (-1, -1)),
    ([1, 1, 40], [700, 33, 40], 4, 4, 64, 48, False, (20, 2)),
]


def paged_varlen_cases() -> int:
    """flash_attn_varlen_func over a paged cache (packed queries), both atoms."""
    from torch_flash_v100.flash_attn_interface import flash_attn_varlen_func

    bad = 0
    for force_volta in (True, False):
        with tfv.volta_atom(force_volta):
            for lq, lk, hq, hkv, d, page, causal, window in PAGED_VARLEN_CASES:
                g = torch.Generator(device="cuda").manual_seed(0)
                pages_of = [-(-n // page) for n in lk]
                num_pages = sum(pages_of) + 1
                k_cache, v_cache = (torch.randn(num_pages, page, hkv, d, device="cuda",
                                                dtype=torch.float16, generator=g)
                                    for _ in range(2))
                order = torch.randperm(num_pages, device="cuda", generator=g).int()
                table = torch.zeros(len(lk), max(pages_of), dtype=torch.int32, device="cuda")
                first = 0
                for b, n in enumerate(pages_of):
                    table[b, :n] = order[first:first + n]
                    first += n
                cu_q = torch.tensor([0] + lq, device="cuda").cumsum(0).int()
                cu_k = torch.tensor([0] + lk, device="cuda").cumsum(0).int()
                q = torch.randn(sum(lq), hq, d, device="cuda", dtype=torch.float16, generator=g)
                out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lq), max(lk),
                                             causal=causal, window_size=window,
                                             block_table=table)
                torch.cuda.synchronize()
                if not torch.isfinite(out).all():
                    print("non-finite result (paged varlen)", force_volta, (lq, lk, hq, d))
                    bad += 1
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=int, default=len(SHAPES),
                        help="run the first N shapes only (initcheck without a kernel filter is slow)")
    args = parser.parse_args()
    ops = torch.ops.flashv100
    bad = 0
    for force_volta in (True, False):
        with tfv.volta_atom(force_volta):
            for b, hq, hkv, lq, lk, d, causal in SHAPES[: args.shapes]:
                g = torch.Generator(device="cuda").manual_seed(0)
                q = torch.randn(b, hq, lq, d, device="cuda", dtype=torch.float16, generator=g)
                k = torch.randn(b, hkv, lk, d, device="cuda", dtype=torch.float16, generator=g)
                v = torch.randn(b, hkv, lk, d, device="cuda", dtype=torch.float16, generator=g)
                scale = 1.0 / math.sqrt(d)
                # plain; dropout; a broadcast additive mask (with gradient) and dropout
                mask = torch.randn(b, 1, 1, lk, device="cuda", generator=g)
                # a padding mask keeping a prefix: the key-range path (no per-element reads)
                prefix = (torch.arange(lk, device="cuda") < (lk + 1) // 2).expand(b, 1, 1, lk)
                for mask_, p in ((None, 0.0), (None, 0.1), (mask, 0.1), (prefix, 0.0)):
                    out, lse, rng = ops._attention_forward(q, k, v, mask_, p, causal, scale)
                    dout = torch.randn_like(out)
                    for deterministic in (False, True):
                        grads = ops._attention_backward(dout, q, k, v, mask_, out, lse, rng, p,
                                                        causal, scale,
                                                        mask_ is not None
                                                        and mask_.is_floating_point(),
                                                        deterministic)
                        torch.cuda.synchronize()
                        if not all(torch.isfinite(t).all() for t in (out, *grads)):
                            print("non-finite result", force_volta, (b, hq, hkv, lq, lk, d, causal))
                            bad += 1
    bad += flash_cases()
    bad += kvcache_cases()
    bad += paged_varlen_cases()
    print("sanitize workload done,", bad, "bad results")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
