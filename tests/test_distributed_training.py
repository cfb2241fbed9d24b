"""DDP and FSDP2 training of the small GPT with the flashv100 ops, on CPU: a torchrun job of two
gloo ranks whose losses must match a single-process run on the same global batches, step by step
(torch_flash_v100.bench.e2e_distributed checks and reports; this test reads its JSON).

torch.compile runs with the flashv100 pass and aot_eager after it: Inductor's CPU code generation
of the model's graphs takes minutes on a CI machine (the flashv100 op in the graph is the same).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from torch_flash_v100.bench import e2e_distributed

LAYERS = 2
# FSDP2 on CPU needs gloo's reduce-scatter; checked with torch 2.13 (older versions: DDP only).
TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
PARALLEL = ["ddp", "fsdp"] if TORCH >= (2, 13) else ["ddp"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "runs.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "torch_flash_v100.bench.e2e_distributed", "--device", "cpu",
         "--parallel", ",".join(PARALLEL), "--regimes", "eager+flashv100,compile+flashv100",
         "--compiler", "aot_eager", "--layers", str(LAYERS), "--steps", "3", "--timeout", "300",
         "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_job_succeeds(job):
    proc, doc = job
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert doc["ok"] and doc["world_size"] == 2


@pytest.mark.parametrize("parallel", PARALLEL)
@pytest.mark.parametrize("regime", ["eager+flashv100", "compile+flashv100"])
def test_losses_match_one_process(job, parallel, regime):
    _, doc = job
    ref = next(r for r in doc["references"] if r["regime"] == regime)
    run = next(r for r in doc["runs"] if r["regime"] == regime and r["parallel"] == parallel)
    assert "error" not in run and "error" not in ref, (run, ref)
    assert len(run["losses"]) == len(ref["losses"]) == 3
    for step, (got, want) in enumerate(zip(run["losses"], ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    # Every layer's attention ran the flashv100 ops, forward and backward (eager and compiled).
    assert ref["op_calls"] == {"_attention_forward": LAYERS, "_attention_backward": LAYERS}
    if parallel == "ddp" and not e2e_distributed._PROFILES_DDP:
        assert run["op_calls"] is None  # torch < 2.6: DDP steps are not profiled
    else:
        assert run["op_calls"] == ref["op_calls"]


def test_refuses_to_run_without_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="launch with torchrun"):
        e2e_distributed.main([])


def test_rejects_unknown_choices():
    with pytest.raises(SystemExit):
        e2e_distributed.parse(["--parallel", "pipeline"])
