"""Two GPUs (NCCL, one GPU per rank): ring attention, tensor-parallel heads, and DDP / FSDP2
training of the small GPT with the flashv100 ops, against one GPU.

Skips unless two CUDA GPUs are visible; with EXPECT_GPUS=2 (scripts/gpu_check.sh on a 2-GPU
machine) a missing GPU fails instead of skipping.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from distributed_testing import (assert_case_passed, case_name, check_ring_case, check_tp_block,
                                 run_cases, run_on_ranks)

pytestmark = pytest.mark.cuda

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
BF16 = GPUS > 0 and torch.cuda.get_device_capability()[0] >= 8  # bf16: native atom only


@pytest.fixture(scope="module", autouse=True)
def two_gpus():  # module scope: checked before the module's jobs start
    if GPUS >= 2:
        return
    expected = int(os.environ.get("EXPECT_GPUS", "0") or 0)
    if expected >= 2:
        pytest.fail(f"EXPECT_GPUS={expected}, but {GPUS} CUDA GPU(s) are visible")
    pytest.skip("needs 2 CUDA GPUs")


RING_CASES = [
    (torch.float16, True, "zigzag", 8, 2, 8, None, False),
    (torch.float16, True, "contiguous", 4, 4, 8, None, False),
    (torch.float16, False, "zigzag", 4, 1, 8, None, True),
] + ([(torch.bfloat16, True, "zigzag", 8, 2, 8, None, False)] if BF16 else [])


def _ring_cases(rank, world_size):
    # 130 rows per rank: several key tiles per block, and a partial one.
    return run_cases({case_name(c): (lambda c=c: check_ring_case(c, world_size, device="cuda",
                                                                 rows_per_rank=130))
                      for c in RING_CASES})


@pytest.fixture(scope="module")
def ring_job():
    return run_on_ranks(_ring_cases, 2, backend="nccl")


@pytest.mark.parametrize("case", RING_CASES, ids=case_name)
def test_ring_attention_two_gpus(ring_job, case):
    assert_case_passed(ring_job, case_name(case))


def _tensor_parallel_cases(rank, world_size):
    import torch_flash_v100 as flash
    import torch_flash_v100.distributed  # noqa: F401  (registers the sharding rules)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cuda", (world_size,))

    def heads_sharded_attention():
        generator = torch.Generator().manual_seed(0)
        full = [torch.randn(s, generator=generator).to("cuda", torch.float16)
                for s in ((2, 8, 256, 64), (2, 2, 256, 64), (2, 2, 256, 64))]
        plain = [t.clone().requires_grad_() for t in full]
        out = flash.attention(*plain, is_causal=True, enable_gqa=True)
        out.sum().backward()
        sharded = [distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in full]
        with CommDebugMode() as comm:
            dout = flash.attention(*sharded, is_causal=True, enable_gqa=True)
        assert comm.get_total_counts() == 0 and tuple(dout.placements) == (Shard(1),)
        dout.sum().backward()
        # Each rank runs the same kernels on its heads: equal to one GPU's result.
        for got, want in zip([dout] + [t.grad for t in sharded], [out] + [t.grad for t in plain]):
            torch.testing.assert_close(got.full_tensor(), want, atol=2e-3, rtol=2e-3)

    return run_cases({
        "heads-sharded-attention": heads_sharded_attention,
        "tp-block-dtensor-attention": lambda: check_tp_block(
            mesh, False, device="cuda", dtype=torch.float16, tolerance=1e-2),
        "tp-block-local-attention": lambda: check_tp_block(
            mesh, True, device="cuda", dtype=torch.float16, tolerance=1e-2),
    })


@pytest.fixture(scope="module")
def tensor_parallel_job():
    if not pytest.importorskip("torch_flash_v100.distributed").dtensor_rules_registered():
        pytest.skip("this torch has no register_sharding")
    return run_on_ranks(_tensor_parallel_cases, 2, backend="nccl")


@pytest.mark.parametrize("case", ["heads-sharded-attention", "tp-block-dtensor-attention",
                                  "tp-block-local-attention"])
def test_tensor_parallel_two_gpus(tensor_parallel_job, case):
    assert_case_passed(tensor_parallel_job, case)


@pytest.mark.parametrize("dtype", ["fp16"] + (["bf16"] if BF16 else []))
def test_ddp_and_fsdp_match_one_gpu(tmp_path, dtype):
    out = tmp_path / "runs.json"
    layers = 4
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "torch_flash_v100.bench.e2e_distributed", "--device", "cuda", "--dtype", dtype,
         "--parallel", "ddp,fsdp", "--regimes", "eager+flashv100,compile+flashv100",
         "--layers", str(layers), "--steps", "5", "--json", str(out)],
        capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and len(doc["runs"]) == 4, doc
    for run in doc["runs"]:
        assert run["op_calls"] == {"_attention_forward": layers, "_attention_backward": layers}
