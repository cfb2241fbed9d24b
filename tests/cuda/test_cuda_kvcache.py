"""flash_attn_with_kvcache on CUDA against the fp64 reference, on both tensor-core atoms (the Volta
mma.m8n8k4 atom forced, emulated on newer GPUs, and the native one): contiguous and paged caches
(page sizes 16..256), cache lengths 0 to full, left padding, batch permutations, GQA 1/4/8 (the
seqlen_q * ngroups view for decoding), seqlen_q 1..300, more new rows than query rows (appended
by the forward kernel itself, across split shares), rotary (both styles, rotary_dim < D),
causal/window/ALiBi/softcap, split-KV forced (1, 3, 7) and chosen (0); the whole caches after the
in-place append; block tables with strided rows; bad index values; a decode step captured once in
a CUDA graph and replayed with new cache_seqlens values; packed queries over a paged cache
(flash_attn_varlen_func with block_table).

Tolerances: out and lse FlashAttention-2 style (kvcache_testing.check_case); appended cache rows
within one rounding of the reference's, other rows bit-identical.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_flash_v100 import flash_attn_interface as fa
from torch_flash_v100.flash_attn_interface import flash_attn_with_kvcache
from attention_testing import assert_fa2_close
from flash_testing import cu_seqlens, paged_cache, varlen_qkv, varlen_reference
from kvcache_testing import FEATURES, LAYOUTS, Case, check_case, make_inputs, run_case

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.cuda]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name,case", FEATURES, ids=[f[0] for f in FEATURES])
@pytest.mark.parametrize("layout,fields", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_matches_reference(atom, dtype, layout, fields, name, case, head_dim):
    check_case(dataclasses.replace(case, dim=head_dim, **fields), dtype, "cuda")


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_head_dims(atom, dtype, head_dim):
    check_case(Case(dim=head_dim, heads_q=8, heads_kv=2, seqlen_q=3, seqlen_new=3, causal=True,
                    page_size=32, capacity=320, rotary_dim=16, num_splits=3), dtype, "cuda")


@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_batch_idx_permutation(atom, num_splits):
    check_case(Case(batch_idx=True, dim=128, heads_q=8, heads_kv=2, seqlen_q=2, seqlen_new=2,
                    causal=True, num_splits=num_splits, rotary_dim=32), torch.float16, "cuda")


@pytest.mark.parametrize("group", [1, 4, 8], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("page_size", [None, 16, 64, 256], ids=["contiguous", "p16", "p64", "p256"])
@pytest.mark.parametrize("num_splits", [1, 7, 0])
def test_long_cache_decode(atom, group, page_size, num_splits):
    """Decoding over caches of a few thousand rows of very different lengths per sequence."""
    check_case(Case(batch=4, heads_q=8, heads_kv=8 // group, dim=128, capacity=4096,
                    page_size=page_size, seqlens=[0, 1, 2049, "full"], num_splits=num_splits,
                    rotary_dim=64, rotary_interleaved=False), torch.float16, "cuda")


@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (2, 2), (17, 17), (64, 64), (129, 1),
                                                 (300, 300)])
@pytest.mark.parametrize("page_size", [None, 48], ids=["contiguous", "p48"])
def test_query_lengths(atom, dtype, seqlen_q, seqlen_new, page_size):
    check_case(Case(batch=2, heads_q=8, heads_kv=2, dim=64, seqlen_q=seqlen_q,
                    seqlen_new=seqlen_new, capacity=960, page_size=page_size, causal=True,
                    leftpad=[0, 13], num_splits=3), dtype, "cuda")


@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "p16"])
@pytest.mark.parametrize("heads_q,window", [(8, (-1, -1)), (2, (3, 0))], ids=["gqa4", "mha_window"])
def test_new_rows_across_key_shares(atom, page_size, num_splits, heads_q, window):
    """Where the forward kernel appends the new rows itself (one query tile per KV head, no
    rotary): more new rows than query rows, over several key tiles and split shares, some outside
    the query's window, after left padding; the whole caches are compared."""
    check_case(Case(batch=3, heads_q=heads_q, heads_kv=2, dim=128, seqlen_q=1, seqlen_new=100,
                    capacity=512, page_size=page_size, seqlens=[0, 150, "full"],
                    leftpad=[0, 7, 30], window_size=window, num_splits=num_splits),
               torch.float16, "cuda")


def test_split_counts_agree(atom):
    kwargs, _ = make_inputs(Case(batch=2, heads_q=8, heads_kv=2, dim=128, capacity=2048,
                                 page_size=16, seqlens=[5, 2047]), torch.float16, "cuda")
    results = [run_case(dict(kwargs, num_splits=n))[0][:2] for n in (1, 2, 5, 64, 128, 0)]
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, results[0][1], atol=1e-4, rtol=1e-5)


def test_split_kv_is_deterministic(atom):
    kwargs, _ = make_inputs(Case(batch=2, heads_q=8, heads_kv=2, dim=128, capacity=4096,
                                 seqlens=[100, 4000], seqlen_new=0, num_splits=9),
                            torch.float16, "cuda")
    first = flash_attn_with_kvcache(**kwargs, return_softmax_lse=True)
    for _ in range(3):
        again = flash_attn_with_kvcache(**kwargs, return_softmax_lse=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("page_size", [16, 256])
def test_block_table_with_strided_rows(atom, page_size):
    """A block_table whose rows are slices of a wider table (stride(0) > its columns): bitwise the
    result of its contiguous copy. The kernels address each row by the table's row stride and
    prefetch only the row's own columns."""
    kwargs, _ = make_inputs(Case(batch=3, heads_q=8, heads_kv=2, dim=128, capacity=1024,
                                 page_size=page_size, seqlens=[5, 700, "full"], seqlen_new=1,
                                 num_splits=3), torch.float16, "cuda")
    table = kwargs["block_table"]
    wide = torch.full((table.shape[0], table.shape[1] + 37), -7, dtype=torch.int32,
                      device="cuda")
    wide[:, :table.shape[1]] = table
    strided = wide[:, :table.shape[1]]
    assert strided.stride(0) > strided.shape[1]
    results = []
    for t in (table, strided):
        caches = kwargs["k_cache"].clone(), kwargs["v_cache"].clone()
        out, lse = flash_attn_with_kvcache(**dict(kwargs, k_cache=caches[0], v_cache=caches[1],
                                                  block_table=t), return_softmax_lse=True)
        results.append((out, lse, *caches))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bad_index_values_raise(atom):
    kwargs, _ = make_inputs(Case(dim=64, page_size=16), torch.float16, "cuda")
    table = kwargs["block_table"]
    with pytest.raises(RuntimeError, match="is outside k_cache's"):
        flash_attn_with_kvcache(**dict(kwargs, block_table=table + 1000))
    with pytest.raises(RuntimeError, match="does not fit a cache"):
        flash_attn_with_kvcache(**dict(kwargs, cache_seqlens=torch.full_like(
            kwargs["cache_seqlens"], 160)))
    with pytest.raises(RuntimeError, match="cannot run this problem"):
        flash_attn_with_kvcache(**dict(kwargs, q=kwargs["q"].float(),
                                       k_cache=kwargs["k_cache"].float(),
                                       v_cache=kwargs["v_cache"].float(), k=kwargs["k"].float(),
                                       v=kwargs["v"].float()))
    torch.cuda.synchronize()


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
def test_cuda_graph_decode_step(atom, page_size, num_splits):
    """One decode step (append + attention) captured once, replayed with new q/k/v and new
    cache_seqlens values; each replay matches an eager step on a copy of the caches."""
    case = Case(batch=3, heads_q=8, heads_kv=2, dim=128, capacity=512, page_size=page_size,
                rotary_dim=32, causal=True, num_splits=num_splits)
    kwargs, _ = make_inputs(case, torch.float16, "cuda")
    static = {n: kwargs[n] for n in ("q", "k", "v", "cache_seqlens")}
    k_cache, v_cache = kwargs["k_cache"], kwargs["v_cache"]
    call = dict(kwargs, k_cache=k_cache, v_cache=v_cache, return_softmax_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        flash_attn_with_kvcache(**dict(call, k_cache=k_cache.clone(), v_cache=v_cache.clone()))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_attn_with_kvcache(**call)

    g = torch.Generator().manual_seed(3)
    for step, lengths in enumerate(([0, 7, 511], [300, 1, 2], [17, 250, 100], [511, 511, 0])):
        for name in ("q", "k", "v"):
            static[name].copy_(torch.randn(static[name].shape, generator=g).half())
        static["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        eager_k, eager_v = k_cache.clone(), v_cache.clone()
        expected = flash_attn_with_kvcache(**dict(call, k_cache=eager_k, v_cache=eager_v))
        before = dict(kwargs, k_cache=k_cache.clone(), v_cache=v_cache.clone())
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected[0], msg=f"step {step}: out")
        torch.testing.assert_close(lse, expected[1], msg=f"step {step}: lse")
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v), f"step {step}"
        # and the eager step itself is right
        (ref_out, *_), (r_out, *_) = run_case(before)
        torch.testing.assert_close(ref_out.cpu().double(), r_out, atol=2e-2, rtol=0)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
def test_trusted_indices_make_no_host_sync(atom, page_size):
    """check_index_values=False: a decode step (append, split-KV attention, combine) queues its
    work without a device-to-host copy (sync debug mode raises on one) and gives the checked
    call's result."""
    case = Case(batch=3, heads_q=8, heads_kv=2, dim=128, capacity=512, page_size=page_size,
                leftpad=[0, 5, 40], causal=True, num_splits=0)
    kwargs, _ = make_inputs(case, torch.float16, "cuda")
    caches = [(kwargs["k_cache"].clone(), kwargs["v_cache"].clone()) for _ in range(2)]
    checked = flash_attn_with_kvcache(**dict(kwargs, k_cache=caches[0][0], v_cache=caches[0][1]))
    flash_attn_with_kvcache(**dict(kwargs, k_cache=caches[1][0].clone(),
                                   v_cache=caches[1][1].clone()), check_index_values=False)
    torch.cuda.synchronize()  # the warm-up above set the kernels up (occupancy, shared memory)
    torch.cuda.set_sync_debug_mode("error")
    try:
        trusted = flash_attn_with_kvcache(**dict(kwargs, k_cache=caches[1][0],
                                                 v_cache=caches[1][1]), check_index_values=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(trusted, checked)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])


# (lens_q, lens_k): decode rows next to a prefill chunk, sequences without queries or keys, key
# tiles crossing pages, more queries than keys.
PAGED_VARLEN_LENGTHS = [([1, 200, 0, 1, 37], [900, 230, 5, 1, 0]), ([130, 64], [64, 1000])]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("lens_q,lens_k", PAGED_VARLEN_LENGTHS, ids=["mixed", "two"])
@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window_size=(100, 3), softcap=2.0,
                                                            alibi_slopes="h")],
                         ids=["causal", "window_softcap_alibi"])
def test_paged_varlen(atom, dtype, head_dim, page_size, lens_q, lens_k, kwargs):
    """flash_attn_varlen_func with block_table: packed queries over shuffled pages (NaN rows and
    out-of-range table entries past each sequence's keys) against the fp64 reference, within
    twice the error of the same kernels' dense varlen path, out and softmax_lse at every row."""
    heads_q, heads_kv = 8, 2
    q, k, v = (t.detach() for t in varlen_qkv(lens_q, lens_k, heads_q, heads_kv, head_dim,
                                              torch.float64, seed=head_dim + page_size))
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    if kwargs.get("alibi_slopes") == "h":
        kwargs = dict(kwargs, alibi_slopes=torch.rand(heads_q, generator=torch.Generator()
                                                      .manual_seed(1)) * 0.1)
    ref_out, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, **kwargs)
    k_cache, v_cache, table = paged_cache(k, v, cu_k, page_size)
    dev = {name: t.cuda() if t.dtype == torch.int32 else t.to("cuda", dtype) for name, t in
           dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, table=table, cu_q=cu_q,
                cu_k=cu_k).items()}
    cuda_kwargs = {n: (t.cuda() if torch.is_tensor(t) else t) for n, t in kwargs.items()}
    max_q, max_k = max(lens_q), max(lens_k)
    out, lse, _ = fa.flash_attn_varlen_func(dev["q"], dev["k"], dev["v"], dev["cu_q"], dev["cu_k"],
                                            max_q, max_k, return_attn_probs=True, **cuda_kwargs)
    paged = fa.flash_attn_varlen_func(dev["q"], dev["k_cache"], dev["v_cache"], dev["cu_q"],
                                      dev["cu_k"], max_q, max_k, block_table=dev["table"],
                                      **cuda_kwargs)
    scale = head_dim ** -0.5
    window = kwargs.get("window_size", (-1, -1))
    paged_op, paged_lse = torch.ops.flashv100._kvcache_forward(
        dev["q"], dev["k_cache"], dev["v_cache"], None, None, None, None,
        dev["cu_k"][1:] - dev["cu_k"][:-1], None, None, dev["table"], scale,
        kwargs.get("causal", False), *window, kwargs.get("softcap", 0.0), True,
        cuda_kwargs.get("alibi_slopes"), 1, True, dev["cu_q"], max_q)
    torch.cuda.synchronize()
    assert torch.equal(paged_op, paged)
    assert_fa2_close(paged.cpu(), ref_out, out.cpu(), name="out")
    hidden = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(paged_lse.cpu()), hidden), "lse: -inf rows differ"
    assert_fa2_close(paged_lse.cpu()[~hidden], ref_lse[~hidden], lse.cpu()[~hidden], name="lse",
                     atol=1e-3)
