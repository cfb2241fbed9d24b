#!/usr/bin/env python3
"""One flash_attn_with_kvcache decode step (one new token per sequence, trusted indices) on a
contiguous cache, then on a paged one, and with --sdpa-flash SDPA's FlashAttention-2 step on the
contiguous cache (GQA by enable_gqa, as the decode benchmark calls it): the workload to run under
Nsight Compute, e.g.

    ncu -k regex:flash_fwd --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python scripts/profile_decode.py --batch 8 --keys 65536
"""
import argparse

import torch

from torch_flash_v100.flash_attn_interface import flash_attn_with_kvcache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--keys", type=int, default=65536, help="cache length, the new key included")
    ap.add_argument("--heads", default="32,8", help="query heads,KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--sdpa-flash", action="store_true",
                    help="also one step of SDPA's flash backend on the contiguous cache")
    args = ap.parse_args()
    b, s, d, page = args.batch, args.keys, args.head_dim, args.page_size
    hq, hkv = (int(x) for x in args.heads.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float16, generator=g)

    q, k_new, v_new = randn(b, 1, hq, d), randn(b, 1, hkv, d), randn(b, 1, hkv, d)
    seqlens = torch.full((b,), s - 1, dtype=torch.int32, device="cuda")
    k_cache, v_cache = randn(b, s, hkv, d), randn(b, s, hkv, d)
    flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                            check_index_values=False)
    if args.sdpa_flash:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2),
                                           v_cache.transpose(1, 2), enable_gqa=hq != hkv)
    del k_cache, v_cache
    pages = -(-s // page)
    table = torch.randperm(b * pages, generator=torch.Generator().manual_seed(0))
    k_pages, v_pages = randn(b * pages, page, hkv, d), randn(b * pages, page, hkv, d)
    flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=seqlens,
                            block_table=table.reshape(b, pages).int().cuda(),
                            check_index_values=False)
    torch.cuda.synchronize()
    print("profiled", f"B={b} S={s} heads={hq}/{hkv} D={d} page_size={page}")


if __name__ == "__main__":
    main()
