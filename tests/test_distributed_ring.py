"""Ring attention (context parallelism) on CPU: ranks in spawned processes with gloo.

Every case shards one full-sequence problem over the ranks, runs ring attention forward and
backward, gathers the output and the gradients and compares every position with single-process
flashv100 attention on the full sequence and with the fp64 reference.
"""

import itertools

import pytest
import torch

from distributed_testing import (assert_case_passed, case_name, check_ring_case, run_cases,
                                 run_on_ranks)
from torch_flash_v100.distributed.ring import ring_attention

# (dtype, is_causal, layout, heads_q, heads_kv, value dim, scale, sum: see distributed_testing.case_name)
CASES = [
    (dtype, causal, layout, hq, hkv, 8, None, False)
    for dtype, causal, layout, (hq, hkv) in itertools.product(
        (torch.float64, torch.float32), (False, True), ("contiguous", "zigzag"),
        ((2, 2), (4, 2)))
] + [
    (torch.float64, True, "zigzag", 3, 1, 5, 0.3, False),    # MQA, Ev != E, explicit scale
    (torch.float64, True, "contiguous", 2, 2, 8, None, True),  # strided shards and grad_out
    (torch.bfloat16, True, "zigzag", 4, 2, 8, None, False),
    (torch.float16, False, "contiguous", 2, 2, 8, None, False),
]
WORLD3_CASES = [(torch.float64, causal, layout, 4, 2, 8, None, False)
                for causal, layout in itertools.product((False, True), ("contiguous", "zigzag"))]


def _all_cases(rank, world_size):
    """Three ranks: the two-rank cases on the subgroup of ranks 1 and 2 (group ranks differ from
    global ones), then the three-rank cases and a DeviceMesh on all three."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    pair = dist.new_group([1, 2])
    outcomes = {}
    if rank in (1, 2):
        outcomes.update(run_cases({f"2-{case_name(c)}": (lambda c=c: check_ring_case(c, 2, pair))
                                   for c in CASES}))
    outcomes.update(run_cases({f"3-{case_name(c)}": (lambda c=c: check_ring_case(c, 3))
                               for c in WORLD3_CASES}))
    mesh = init_device_mesh("cpu", (world_size,))
    outcomes.update(run_cases({"device_mesh": lambda: check_ring_case(MESH_CASE, 3, group=mesh)}))
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
