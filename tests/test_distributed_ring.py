"""Ring attention (context parallelism) on CPU: ranks in spawned processes with gloo.

Every case shards one full-sequence problem over the ranks, runs ring attention forward and
backward, gathers the output and the gradients and compares every position with single-process
flashv100 attention on the full sequence and with the fp64 reference.
"""

import itertools
import zlib

import pytest
import torch

from distributed_testing import assert_case_passed, run_cases, run_on_ranks
from torch_flash_v100.distributed.ring import ring_attention

# (dtype, is_causal, layout, heads_q, heads_kv, value dim, scale, grad of out.sum())
CASES = [
    (dtype, causal, layout, hq, hkv, 8, None, False)
    for dtype, causal, layout, (hq, hkv) in itertools.product(
        (torch.float64, torch.float32), (False, True), ("contiguous", "zigzag"),
        ((2, 2), (4, 2)))
] + [
    (torch.float64, True, "zigzag", 3, 1, 5, 0.3, False),    # MQA, Ev != E, explicit scale
    (torch.float64, True, "contiguous", 2, 2, 8, None, True),  # expanded (stride-0) grad_out
    (torch.bfloat16, True, "zigzag", 4, 2, 8, None, False),
    (torch.float16, False, "contiguous", 2, 2, 8, None, False),
]
WORLD3_CASES = [(torch.float64, causal, layout, 4, 2, 8, None, False)
                for causal, layout in itertools.product((False, True), ("contiguous", "zigzag"))]


def case_name(case) -> str:
    dtype, causal, layout, hq, hkv, ev, scale, sum_grad = case
    return (f"{str(dtype).split('.')[-1]}-{'causal' if causal else 'full'}-{layout}-h{hq}x{hkv}"
            f"-ev{ev}" + (f"-scale{scale}" if scale else "") + ("-sum" if sum_grad else ""))


def _tolerances(dtype):
    """(vs single-process flashv100 in the same dtype, vs the fp64 reference)."""
    return {torch.float64: (dict(atol=1e-12, rtol=1e-12), dict(atol=1e-10, rtol=1e-10)),
            torch.float32: (dict(atol=2e-6, rtol=2e-5), dict(atol=1e-5, rtol=1e-4)),
            torch.bfloat16: (dict(atol=3e-2, rtol=3e-2), dict(atol=5e-2, rtol=5e-2)),
            torch.float16: (dict(atol=4e-3, rtol=4e-3), dict(atol=5e-3, rtol=5e-3))}[dtype]


def _check_case(case, world_size, group=None):
    import torch_flash_v100 as flash
    from torch_flash_v100.distributed import shard_sequence, unshard_sequence
    from torch_flash_v100.reference import reference_attention

    dtype, causal, layout, hq, hkv, ev, scale, sum_grad = case
    gqa = hq != hkv
    length = 4 * world_size  # two chunks of two rows per rank in the zigzag layout
    generator = torch.Generator().manual_seed(zlib.crc32(case_name(case).encode()))  # the same on every rank
    shapes = ((2, hq, length, 8), (2, hkv, length, 8), (2, hkv, length, ev))
    full = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    grad = torch.randn(2, hq, length, ev, generator=generator, dtype=torch.float64)

    def forward_backward(fn, inputs, grad_out):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
        if sum_grad:
            out.sum().backward()
        else:
            out.backward(grad_out.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    options = dict(is_causal=causal, scale=scale, enable_gqa=gqa)
    single = forward_backward(lambda *t: flash.attention(*t, **options),
                              [t.to(dtype) for t in full], grad)
    reference = forward_backward(lambda *t: reference_attention(*t, **options), full, grad)
    shards = [shard_sequence(t.to(dtype), 2, group=group, layout=layout) for t in full]
    ring = forward_backward(
        lambda *t: ring_attention(*t, group=group, layout=layout, **options), shards,
        shard_sequence(grad, 2, group=group, layout=layout))
    gathered = [unshard_sequence(t, 2, group=group, layout=layout) for t in ring]

    same_dtype, fp64 = _tolerances(dtype)
    for name, got, want, want64 in zip(("out", "dq", "dk", "dv"), gathered, single, reference):
        assert got.dtype == dtype, (name, got.dtype)
        torch.testing.assert_close(got, want, **same_dtype, msg=lambda m: f"{name} vs flashv100: {m}")
        torch.testing.assert_close(got.double(), want64, **fp64, msg=lambda m: f"{name} vs fp64: {m}")


def _all_cases(rank, world_size):
    """Three ranks: the two-rank cases on the subgroup of ranks 1 and 2 (group ranks differ from
    global ones), then the three-rank cases and a DeviceMesh on all three."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    pair = dist.new_group([1, 2])
    outcomes = {}
    if rank in (1, 2):
        outcomes.update(run_cases({f"2-{case_name(c)}": (lambda c=c: _check_case(c, 2, pair))
                                   for c in CASES}))
    outcomes.update(run_cases({f"3-{case_name(c)}": (lambda c=c: _check_case(c, 3))
                               for c in WORLD3_CASES}))
    mesh = init_device_mesh("cpu", (world_size,))
    outcomes.update(run_cases({"device_mesh": lambda: _check_case(MESH_CASE, 3, group=mesh)}))
    return outcomes


MESH_CASE = (torch.float64, True, "zigzag", 4, 2, 8, None, False)


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_all_cases, 3)


@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_ring_attention_two_ranks(ranks, case):
    assert_case_passed(ranks, f"2-{case_name(case)}")


@pytest.mark.parametrize("case", WORLD3_CASES, ids=case_name)
def test_ring_attention_three_ranks(ranks, case):
    assert_case_passed(ranks, f"3-{case_name(case)}")


def test_ring_attention_on_a_device_mesh(ranks):
    assert_case_passed(ranks, "device_mesh")


@pytest.mark.parametrize("kwargs, message", [
    (dict(attn_mask=torch.ones(4, 4, dtype=torch.bool)), "attn_mask is not supported"),
    (dict(dropout_p=0.1), "dropout_p must be 0"),
    (dict(layout="striped"), "layout must be one of"),
])
def test_ring_attention_refuses_unsupported_arguments(kwargs, message):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=message):
        ring_attention(q, q, q, **kwargs)


@pytest.mark.parametrize("shapes, kwargs, message", [
    (((2, 4, 8), (2, 4, 8), (2, 4, 8)), {}, r"query of shape \[B, H, L, E\]"),
    (((1, 4, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), {}, "pass enable_gqa=True"),
    (((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 6, 8)), {}, "key and value shards differ"),
    (((1, 2, 4, 8), (1, 2, 6, 8), (1, 2, 6, 8)), dict(is_causal=True), "of one length"),
    (((1, 2, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8)), dict(is_causal=True, layout="zigzag"),
     "must be even"),
])
def test_ring_attention_checks_shapes(shapes, kwargs, message):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        ring_attention(q, k, v, **kwargs)


def test_package_import_leaves_dtensor_unimported():
    # torch_flash_v100.distributed (DTensor rules) is opt-in: DTensor's import costs a second.
    import subprocess
    import sys

    code = ("import sys, torch_flash_v100; "
            "assert 'torch.distributed.tensor' not in sys.modules, 'DTensor imported'; "
            "assert 'torch_flash_v100.distributed' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
