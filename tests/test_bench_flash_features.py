"""benchmarks/bench_flash_features.py at tiny size on CPU: every implementation runs, computes the
same attention as the fused FlashAttention-2 function, and the JSON carries the metadata. Nothing
here depends on how long anything takes: the budget only bounds the repetitions."""
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from torch_flash_v100._measure import time_fn

ROOT = Path(__file__).resolve().parents[1]


def test_time_fn_runs_a_minimum_of_repetitions_whatever_the_budget():
    calls = []
    result = time_fn(lambda: calls.append(1), torch.device("cpu"), 0.0)
    assert result["reps"] >= 1 and len(calls) == result["reps"] + 1  # + the warm-up call


def test_flash_features_benchmark_tiny(tmp_path):
    out = tmp_path / "features.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_flash_features.py"), "--tiny",
                        "--device", "cpu", "--budget", "0.01", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert {"device", "torch", "commit", "atom"} <= set(doc["meta"])
    cases = {row["case"] for row in doc["rows"]}
    assert len(cases) == 4
    for case in cases:
        rows = [row for row in doc["rows"] if row["case"] == case]
        assert rows[0]["impl"].startswith("fa2") and len(rows) >= 2
        for row in rows:
            assert "error" not in row
            assert math.isfinite(row["fwd_ms"]) and math.isfinite(row["fwd_bwd_ms"])
            if not row["impl"].endswith("(work reference)"):
                assert row["max_abs_diff"] < 1e-4, row
