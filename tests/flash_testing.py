"""Shared helpers for the FlashAttention-2 API tests: inputs, the per-sequence fp64 reference of
packed batches, the exposed dropout masks, comparisons of every output position."""

from __future__ import annotations

import torch

from torch_flash_v100.reference import flash_reference_attention

ops = torch.ops.flashv100

# Absolute / relative tolerances of fp64 and fp32 results against the fp64 reference.
TOLERANCES = {torch.float64: (1e-10, 1e-8), torch.float32: (2e-5, 2e-4)}


def randn(*shape, dtype=torch.float64, generator=None, requires_grad=True):
    t = torch.randn(*shape, dtype=torch.float64, generator=generator).to(dtype)
    return t.requires_grad_(requires_grad)


def dense_qkv(batch, len_q, len_kv, heads_q, heads_kv, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (randn(batch, len_q, heads_q, dim, dtype=dtype, generator=g),
            randn(batch, len_kv, heads_kv, dim, dtype=dtype, generator=g),
            randn(batch, len_kv, heads_kv, dim, dtype=dtype, generator=g))


def cu_seqlens(lengths):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(),
                        dtype=torch.int32)


def varlen_qkv(lens_q, lens_k, heads_q, heads_kv, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (randn(sum(lens_q), heads_q, dim, dtype=dtype, generator=g),
            randn(sum(lens_k), heads_kv, dim, dtype=dtype, generator=g),
            randn(sum(lens_k), heads_kv, dim, dtype=dtype, generator=g))


def varlen_reference(q, k, v, cu_q, cu_k, *, alibi_slopes=None, dropout_keep=None, **kwargs):
    """flash_reference_attention per sequence (B = 1) of a packed batch: (out [total_q, Hq, D],
    lse [Hq, total_q]) in fp64. dropout_keep: [B, Hq, max_q, max_k] (the _dropout_mask layout)."""
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        keep = None
        if dropout_keep is not None:
            keep = dropout_keep[b:b + 1, :, :rows.stop - rows.start, :keys.stop - keys.start]
        out, lse = flash_reference_attention(q[None, rows], k[None, keys], v[None, keys],
                                             alibi_slopes=slopes, dropout_keep=keep, **kwargs)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def forward_with_rng_state(*args, seed=1234):
    """_flash_forward's rng_state for the next call's draws after torch.manual_seed(seed): the
    caller reseeds the same way and the public function then uses the same dropout stream."""
    torch.manual_seed(seed)
    return ops._flash_forward(*args)[2]


def assert_close(actual, expected, name):
    """Every position, -inf included; fp64/fp32 tolerances of TOLERANCES."""
    atol, rtol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{name}: {m}")


def grads(outputs, inputs, grad_out):
    return torch.autograd.grad(outputs, inputs, grad_out, allow_unused=True,
                               materialize_grads=True)


def paged_cache(k, v, cu_k, page_size, seed=0):
    """Packed keys/values [total_k, Hkv, D] (sequence b: rows cu_k[b]:cu_k[b + 1]) moved into
    shuffled pages of a paged cache whose other rows are NaN: (k_cache, v_cache, block_table
    int32 [B, max_pages]). A sequence's table entries past its pages hold a page index far
    outside the cache: neither those nor the NaN rows may ever be read."""
    lens = (cu_k[1:] - cu_k[:-1]).tolist()
    pages_of = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_of) + 3
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    shape = (num_pages, page_size, *k.shape[1:])
    k_cache = torch.full(shape, float("nan"), dtype=k.dtype)
    v_cache = torch.full(shape, float("nan"), dtype=v.dtype)
    table = torch.full((len(lens), max(pages_of) + 1), 1 << 30, dtype=torch.int32)
    for b, n in enumerate(lens):
        for i in range(pages_of[b]):
            page, rows = order.pop(), slice(int(cu_k[b]) + i * page_size,
                                            int(cu_k[b]) + min(n, (i + 1) * page_size))
            table[b, i] = page
            k_cache[page, :rows.stop - rows.start] = k.detach()[rows]
            v_cache[page, :rows.stop - rows.start] = v.detach()[rows]
    return k_cache, v_cache, table
