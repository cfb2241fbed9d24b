"""flash_attn_with_kvcache on the CPU kernels against the fp64 reference (pages gathered, rotary
applied, rows appended): out and softmax_lse at every position and the whole caches after the
append (rows that must not change are bit-identical), over contiguous and paged caches, cache
lengths 0 to full, left padding, batch permutations, GQA, rotary, causal/window/ALiBi/softcap and
forced split-KV; opcheck, torch.compile over a decode step, no backward, bad inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_flash_v100.flash_attn_interface import flash_attn_with_kvcache
from torch_flash_v100.reference import kvcache_reference
from flash_testing import assert_close
from kvcache_testing import FEATURES, LAYOUTS, Case, check_case, make_inputs, run_case

ops = torch.ops.flashv100

@pytest.mark.parametrize("name,case", FEATURES, ids=[f[0] for f in FEATURES])
@pytest.mark.parametrize("layout,fields", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_matches_reference(layout, fields, name, case):
    check_case(dataclasses.replace(case, **fields), torch.float64)


@pytest.mark.parametrize("name", ["decode_gqa4", "chunk_causal", "rotary_half", "splits3",
                                  "leftpad"])
@pytest.mark.parametrize("layout,fields", LAYOUTS[:2], ids=[l[0] for l in LAYOUTS[:2]])
def test_matches_reference_fp32(layout, fields, name):
    case = dict(FEATURES)[name]
    check_case(dataclasses.replace(case, **fields), torch.float32, seed=1)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_batch_idx_permutation(num_splits):
    check_case(Case(batch_idx=True, heads_q=8, heads_kv=2, seqlen_q=2, seqlen_new=2, causal=True,
                    num_splits=num_splits, rotary_dim=8), torch.float64)


@pytest.mark.parametrize("seqlen_q,seqlen_new", [(70, 70), (300, 300), (300, 0), (9, 3)])
def test_long_queries(seqlen_q, seqlen_new):
    # Chunked prefill / speculative decoding: many query rows, causal bottom-right.
    check_case(Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=seqlen_q, seqlen_new=seqlen_new,
                    capacity=448, page_size=64, causal=True, num_splits=3), torch.float64)


def test_every_page_size_multiple_of_16():
    for page_size in (16, 32, 80, 112, 128, 256):
        capacity = page_size * max(2, -(-160 // page_size))
        check_case(Case(batch=2, capacity=capacity, page_size=page_size, seqlen_q=2,
                        seqlen_new=2, causal=True, leftpad=[0, 17], num_splits=2),
                   torch.float64)


def test_int_and_none_cache_seqlens():
    kwargs, _ = make_inputs(Case(seqlen_new=0), torch.float64, "cpu")
    kwargs["k_cache"] = kwargs["k_cache"].clone()
    full = flash_attn_with_kvcache(**dict(kwargs, cache_seqlens=None))
    ref, _, _, _ = kvcache_reference(kwargs["q"], kwargs["k_cache"], kwargs["v_cache"],
                                     cache_seqlens=torch.full((3,), 160, dtype=torch.int32))
    assert_close(full, ref, "out (cache_seqlens=None)")
    kwargs, _ = make_inputs(Case(), torch.float64, "cpu")
    (out, _, k_cache, _), _ = run_case(dict(kwargs, cache_seqlens=5))
    (ref, _, ref_k, _), _ = run_case(dict(kwargs, cache_seqlens=torch.full((3,), 5,
                                                                            dtype=torch.int32)))
    assert torch.equal(out, ref) and torch.equal(k_cache, ref_k)
    assert torch.is_tensor(flash_attn_with_kvcache(**dict(kwargs, k_cache=k_cache.clone())))


def test_split_counts_agree():
    """Every split count gives the same result to rounding (shares of whole key blocks, some
    empty when splits exceed the blocks)."""
    kwargs, _ = make_inputs(Case(heads_q=8, heads_kv=2, seqlens=[0, 64, 150]), torch.float64,
                            "cpu")
    outs = [run_case(dict(kwargs, num_splits=n))[0][:2] for n in (1, 2, 3, 7, 128)]
    for out, lse in outs[1:]:
        assert_close(out, outs[0][0], "out")
        assert_close(lse, outs[0][1], "lse")


def test_opcheck():
    kwargs, _ = make_inputs(Case(heads_q=8, heads_kv=2, seqlen_q=2, seqlen_new=2, rotary_dim=8,
                                 causal=True, page_size=16, num_splits=2), torch.float32, "cpu")
    args = (kwargs["q"], kwargs["k_cache"], kwargs["v_cache"], kwargs["k"], kwargs["v"],
            kwargs["rotary_cos"], kwargs["rotary_sin"], kwargs["cache_seqlens"], None, None,
            kwargs["block_table"], 0.25, True, -1, -1, 0.0, True, None, 2)
    for check_index_values in (True, False):
        torch.library.opcheck(ops._kvcache_forward.default, args + (check_index_values,),
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor", "test_aot_dispatch_dynamic"))


def _decode_step(q, k, v, k_cache, v_cache, cache_seqlens, block_table):
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                  block_table=block_table, causal=True)
    return out * 2.0, cache_seqlens + 1


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_compile_decode_step_matches_eager(paged):
    torch._dynamo.reset()
    case = Case(heads_q=8, heads_kv=2, page_size=16 if paged else None)
    kwargs, _ = make_inputs(case, torch.float32, "cpu")
    compiled = torch.compile(_decode_step, fullgraph=True)
    caches = {name: (kwargs[name].clone(), kwargs[name].clone()) for name in ("k_cache", "v_cache")}
    lengths = (kwargs["cache_seqlens"].clone(), kwargs["cache_seqlens"].clone())
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        q, k, v = (torch.randn(*kwargs[n].shape, generator=g) for n in ("q", "k", "v"))
        results = []
        for i, fn in enumerate((compiled, _decode_step)):
            results.append(fn(q, k, v, caches["k_cache"][i], caches["v_cache"][i], lengths[i],
                              kwargs.get("block_table")))
        lengths = (results[0][1], results[1][1])
        torch.testing.assert_close(results[0][0], results[1][0])
        torch.testing.assert_close(caches["k_cache"][0], caches["k_cache"][1])
        torch.testing.assert_close(caches["v_cache"][0], caches["v_cache"][1])
    assert not torch.equal(caches["k_cache"][0], kwargs["k_cache"])  # appended in place


def test_backward_raises():
    kwargs, _ = make_inputs(Case(), torch.float64, "cpu")
    q = kwargs["q"].requires_grad_()
    out = flash_attn_with_kvcache(**kwargs)
    with pytest.raises(RuntimeError, match="not implemented"):
        out.sum().backward()
    assert q.grad is None


def _bad(kwargs, **changes):
    return dict(kwargs, **changes)


def test_bad_inputs():
    kwargs, _ = make_inputs(Case(page_size=16, rotary_dim=8), torch.float64, "cpu")
    table = kwargs["block_table"]
    cases = [
        (_bad(kwargs, block_table=torch.where(table == table[1, 0], 10_000, table)),
         r"block_table\[1, 0\] = 10000 is outside"),
        (_bad(kwargs, block_table=table - 100), "is outside k_cache's"),
        (_bad(kwargs, cache_seqlens=torch.tensor([0, 160, 3], dtype=torch.int32)),
         r"cache_seqlens\[1\] = 160 with 1 new rows does not fit"),
        (_bad(kwargs, cache_seqlens=torch.tensor([0, -1, 3], dtype=torch.int32)),
         r"cache_seqlens\[1\] = -1"),
        (_bad(kwargs, cache_seqlens=torch.tensor([0, 1, 3])), "cache_seqlens of dtype int32"),
        (_bad(kwargs, k_cache=kwargs["k_cache"].float()), "one dtype"),
        (_bad(kwargs, k_cache=kwargs["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)),
         "contiguous last dim"),
        (_bad(kwargs, k_cache=kwargs["k_cache"][:, :8].contiguous(),
              v_cache=kwargs["v_cache"][:, :8].contiguous()),
         "positive multiple of 16, got 8"),
        (_bad(kwargs, cache_batch_idx=torch.arange(3, dtype=torch.int32)),
         "cache_batch_idx cannot be combined with block_table"),
        (_bad(kwargs, cache_leftpad=torch.tensor([0, 0, 500], dtype=torch.int32)),
         "cache_leftpad"),
        (_bad(kwargs, k=None, v=None), "rotary_cos/rotary_sin need the new k and v"),
        (_bad(kwargs, rotary_cos=kwargs["rotary_cos"][:100], rotary_sin=kwargs["rotary_sin"][:100]),
         "at least 160 rows"),
        (_bad(kwargs, v=None), "both k and v"),
        (_bad(kwargs, num_splits=129), "num_splits in"),
        (_bad(kwargs, block_table=table[:, :3].long()), "block_table of dtype int32"),
    ]
    for bad, message in cases:
        bad = dict(bad, k_cache=bad["k_cache"].clone(), v_cache=bad["v_cache"].clone())
        with pytest.raises((RuntimeError, ValueError), match=message):
            flash_attn_with_kvcache(**bad)
    contiguous, _ = make_inputs(Case(batch_idx=True), torch.float64, "cpu")
    with pytest.raises(RuntimeError, match=r"cache_batch_idx\[0\] = 99 is outside"):
        flash_attn_with_kvcache(**_bad(contiguous, cache_batch_idx=torch.tensor(
            [99, 0, 1], dtype=torch.int32)))
    with pytest.raises(ValueError, match="need cache_seqlens"):
        flash_attn_with_kvcache(**_bad(contiguous, cache_seqlens=None))


def test_cpu_checks_index_values_even_when_trusted():
    """check_index_values=False spares CUDA its host copies; on the CPU the values are on the host
    and checked anyway (never an out-of-bounds access), and valid values give the same result."""
    kwargs, _ = make_inputs(Case(page_size=16), torch.float64, "cpu")
    table = kwargs["block_table"]
    for bad, message in [
        (_bad(kwargs, block_table=table - 100), "is outside k_cache's"),
        (_bad(kwargs, cache_seqlens=torch.tensor([0, 160, 3], dtype=torch.int32)),
         "does not fit"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            flash_attn_with_kvcache(**bad, check_index_values=False)
    caches = [(kwargs["k_cache"].clone(), kwargs["v_cache"].clone()) for _ in range(2)]
    outs = [flash_attn_with_kvcache(**dict(kwargs, k_cache=k, v_cache=v), check_index_values=trust)
            for (k, v), trust in zip(caches, (True, False))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0][0], caches[1][0])


def test_block_table_with_strided_rows():
    """A block_table whose rows are slices of a wider table: the same result as its contiguous
    copy; only the entries of its own columns are checked."""
    kwargs, _ = make_inputs(Case(page_size=16), torch.float64, "cpu")
    table = kwargs["block_table"]
    wide = torch.full((table.shape[0], table.shape[1] + 3), -7, dtype=torch.int32)
    wide[:, :table.shape[1]] = table
    strided = wide[:, :table.shape[1]]
    assert strided.stride(0) > strided.shape[1]
    outs = [flash_attn_with_kvcache(**dict(kwargs, k_cache=kwargs["k_cache"].clone(),
                                           v_cache=kwargs["v_cache"].clone(), block_table=t))
            for t in (table, strided)]
    assert torch.equal(outs[0], outs[1])
    wide[1, 0] = 10_000
    with pytest.raises(RuntimeError, match=r"block_table\[1, 0\] = 10000 is outside"):
        flash_attn_with_kvcache(**dict(kwargs, block_table=strided))
