"""Tensor parallelism on CPU (two ranks, gloo): DTensor sharding rules of the flashv100 ops.

Head-sharded (and batch-sharded) DTensors must run the ops locally: no communication, outputs
sharded like the inputs, and output and gradients equal to the unsharded computation (compared
in full, with the fp64 reference too); a tiny attention block under ColwiseParallel /
RowwiseParallel must match the unsharded block, output and every parameter's gradient.
"""

import pytest
import torch

pytest.importorskip("torch.distributed.tensor.parallel")
if not pytest.importorskip("torch_flash_v100.distributed").dtensor_rules_registered():
    pytest.skip("this torch has no torch.distributed.tensor.experimental.register_sharding",
                allow_module_level=True)

from distributed_testing import (  # noqa: E402
    assert_case_passed, check_tp_block, run_cases, run_on_ranks)

FP64 = dict(atol=1e-12, rtol=1e-12)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _compare_sharded_run(fn, inputs, placements, mesh, expect_no_comm=True, out_placement=None,
                         reference=None, constants=()):
    """Runs ``fn(*inputs, *constants)`` on plain tensors and on DTensors of ``placements``
    (constants: (tensor, placement) pairs, not differentiated), forward and backward of
    out * weight, and compares out and every gradient in full."""
    from torch.distributed.tensor import distribute_tensor

    try:
        from torch.distributed.tensor.debug import CommDebugMode
    except ImportError:  # torch 2.5
        from torch.distributed._tensor.debug import CommDebugMode

    plain = _leaves(*inputs)
    out = fn(*plain, *(t for t, _ in constants))
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * weight).sum().backward()

    sharded = [distribute_tensor(t.detach(), mesh, [p]).requires_grad_()
               for t, p in zip(inputs, placements)]
    sharded_constants = [distribute_tensor(t, mesh, [p]) for t, p in constants]
    with CommDebugMode() as comm:
        dout = fn(*sharded, *sharded_constants)
        forward_comms = comm.get_total_counts()
        (dout * distribute_tensor(weight, mesh, dout.placements)).sum().backward()
    total_comms = comm.get_total_counts()
    gathered = [dout.full_tensor()] + [t.grad.full_tensor() for t in sharded]
    wanted = [out.detach()] + [t.grad for t in plain]
    for name, got, want in zip(("out", *(f"grad {i}" for i in range(len(inputs)))), gathered,
                               wanted):
        torch.testing.assert_close(got, want, **FP64, msg=lambda m: f"{name}: {m}")
    if reference is not None:
        ref_leaves = _leaves(*inputs)
        ref_out = reference(*ref_leaves, *(t for t, _ in constants))
        (ref_out * weight).sum().backward()
        for got, want in zip(gathered, [ref_out.detach()] + [t.grad for t in ref_leaves]):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    if out_placement is not None:
        assert tuple(dout.placements) == (out_placement,), dout.placements
    if expect_no_comm:
        # The ops ran on local shards; what communicates is the loss's sum (one all-reduce).
        assert forward_comms == 0, comm.get_comm_counts()
        assert total_comms <= 1, comm.get_comm_counts()


def _sdpa_cases(mesh, generator):
    import torch_flash_v100 as flash
    from torch.distributed.tensor import Replicate, Shard
    from torch_flash_v100.reference import reference_attention

    def randn(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    q, k, v = randn(2, 4, 8, 8), randn(2, 2, 8, 8), randn(2, 2, 8, 6)
    causal_gqa = lambda *t: flash.attention(*t, is_causal=True, enable_gqa=True)  # noqa: E731
    reference = lambda *t: reference_attention(*t, is_causal=True, enable_gqa=True)  # noqa: E731
    mask_heads = randn(2, 1, 8, 8)
    mask_full = randn(2, 4, 8, 8)
    with_mask = lambda *t: flash.attention(*t[:3], attn_mask=t[3], enable_gqa=True)  # noqa: E731
    ref_mask = lambda *t: reference_attention(*t[:3], attn_mask=t[3], enable_gqa=True)  # noqa: E731
    mqa_q, mqa_kv = randn(2, 4, 8, 8), randn(2, 1, 8, 8)
    return {
        "heads-causal-gqa": lambda: _compare_sharded_run(
            causal_gqa, (q, k, v), [Shard(1)] * 3, mesh, out_placement=Shard(1),
            reference=reference),
        "batch-causal-gqa": lambda: _compare_sharded_run(
            causal_gqa, (q, k, v), [Shard(0)] * 3, mesh, out_placement=Shard(0),
            reference=reference),
        # A mask broadcast over heads stays replicated; its gradient is a partial sum.
        "heads-mask-broadcast-over-heads": lambda: _compare_sharded_run(
            with_mask, (q, k, v, mask_heads), [Shard(1)] * 3 + [Replicate()], mesh,
            out_placement=Shard(1), reference=ref_mask),
        "heads-mask-per-head": lambda: _compare_sharded_run(
            with_mask, (q, k, v, mask_full), [Shard(1)] * 4, mesh, out_placement=Shard(1),
            reference=ref_mask),
        # One key/value head cannot be split over two ranks: DTensor redistributes.
        "mqa-heads-redistributed": lambda: _compare_sharded_run(
            lambda *t: flash.attention(*t, enable_gqa=True), (mqa_q, mqa_kv, mqa_kv),
            [Shard(1)] * 3, mesh, expect_no_comm=False,
            reference=lambda *t: reference_attention(*t, enable_gqa=True)),
        # Sequence-sharded inputs are redistributed to a rule the ops have.
        "sequence-sharded-redistributed": lambda: _compare_sharded_run(
            causal_gqa, (q, k, v), [Shard(2)] * 3, mesh, expect_no_comm=False,
            reference=reference),
    }


def _flash_cases(mesh, generator):
    from torch.distributed.tensor import Replicate, Shard
    from torch_flash_v100.flash_attn_interface import flash_attn_func, flash_attn_varlen_func
    from torch_flash_v100.reference import flash_reference_attention

    def randn(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    q, k, v = randn(2, 8, 4, 8), randn(2, 8, 2, 8), randn(2, 8, 2, 8)
    options = dict(causal=True, window_size=(3, 1), softcap=5.0)
    slopes = torch.rand(4, generator=generator)
    cu_seqlens = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    packed = [randn(12, 4, 8), randn(12, 2, 8), randn(12, 2, 8)]

    def with_slopes(q, k, v, alibi_slopes):
        return flash_attn_func(q, k, v, alibi_slopes=alibi_slopes, **options)

    def varlen(q, k, v, cu):
        return flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)

    def reference(*t):
        return flash_reference_attention(*t, **options)[0]

    return {
        "fa2-heads-window-softcap": lambda: _compare_sharded_run(
            lambda *t: flash_attn_func(*t, **options), (q, k, v), [Shard(2)] * 3, mesh,
            out_placement=Shard(2), reference=reference),
        "fa2-batch-window-softcap": lambda: _compare_sharded_run(
            lambda *t: flash_attn_func(*t, **options), (q, k, v), [Shard(0)] * 3, mesh,
            out_placement=Shard(0), reference=reference),
        "fa2-heads-alibi": lambda: _compare_sharded_run(
            with_slopes, (q, k, v), [Shard(2)] * 3, mesh, out_placement=Shard(2),
            constants=[(slopes, Shard(0))],
            reference=lambda *t: flash_reference_attention(*t[:3], alibi_slopes=t[3],
                                                           **options)[0]),
        "fa2-varlen-heads": lambda: _compare_sharded_run(
            varlen, packed, [Shard(1)] * 3, mesh, out_placement=Shard(1),
            constants=[(cu_seqlens, Replicate())]),
    }


def _all_cases(rank, world_size):
    import torch_flash_v100.distributed  # noqa: F401  (registers the sharding rules)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(0)  # the same inputs on every rank
    cases = {**_sdpa_cases(mesh, generator), **_flash_cases(mesh, generator)}
    cases["tp-block-dtensor-attention"] = lambda: check_tp_block(mesh, use_local_output=False)
    cases["tp-block-local-attention"] = lambda: check_tp_block(mesh, use_local_output=True)
    return run_cases(cases)


CASES = ["heads-causal-gqa", "batch-causal-gqa", "heads-mask-broadcast-over-heads",
         "heads-mask-per-head", "mqa-heads-redistributed", "sequence-sharded-redistributed",
         "fa2-heads-window-softcap", "fa2-batch-window-softcap", "fa2-heads-alibi",
         "fa2-varlen-heads", "tp-block-dtensor-attention", "tp-block-local-attention"]


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_all_cases, 2)


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel(ranks, case):
    assert_case_passed(ranks, case)


def test_every_case_is_listed(ranks):
    assert set(ranks[0]) == set(CASES)
