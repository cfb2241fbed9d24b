"""scripts/kernel_ab.py: trees prepared from git revisions, and the medians and ratios of a run's
output (kernel_bench's prefill and decode lines)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import kernel_ab  # noqa: E402

RUN = """== tree main round 1: 4 16 4096 128
B4 H16 L4096 E128 plain        fwd 1.600 ms (343 TFLOP/s)  bwd 7.000 ms (198 TFLOP/s), two query buffers 6.800 ms (202 TFLOP/s), wide tile 5.000 ms (273 TFLOP/s)
== tree exp round 1: 4 16 4096 128
B4 H16 L4096 E128 plain        fwd 1.500 ms (366 TFLOP/s)  bwd 7.700 ms (180 TFLOP/s), two query buffers 6.800 ms (202 TFLOP/s), wide tile 4.000 ms (341 TFLOP/s)
== tree main round 1: decode 1 32 8 1024 1
decode B1 H32/8 S1024 D128 splits   1:     26.4 us     159 GB/s (K/V read)
== tree exp round 1: decode 1 32 8 1024 1
decode B1 H32/8 S1024 D128 splits   1:     13.2 us     318 GB/s (K/V read)
== tree main round 2: 4 16 4096 128
B4 H16 L4096 E128 plain        fwd 1.700 ms (323 TFLOP/s)  bwd 7.000 ms (198 TFLOP/s), two query buffers 6.800 ms (202 TFLOP/s), wide tile 5.000 ms (273 TFLOP/s)
== tree exp round 2: 4 16 4096 128
B4 H16 L4096 E128 plain        fwd 1.700 ms (323 TFLOP/s)  bwd 7.700 ms (180 TFLOP/s), two query buffers 6.800 ms (202 TFLOP/s), wide tile 4.000 ms (341 TFLOP/s)
"""


def test_medians_and_ratios_against_the_first_tree():
    names, times = kernel_ab.parse(RUN)
    assert names == ["main", "exp"]
    assert times[("B4 H16 L4096 E128 plain", "fwd")] == {"main": [1.6, 1.7], "exp": [1.5, 1.7]}
    assert set(w for _, w in times) == {"fwd", "bwd", "two query buffers", "wide tile", "step us"}
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[3:-1]
            for line in kernel_ab.summarize(RUN).splitlines() if line.startswith("| B") or
            line.startswith("| decode")}
    assert [c.strip() for c in rows[("B4 H16 L4096 E128 plain", "fwd")]] == ["1.650", "1.600", "0.970"]
    assert [c.strip() for c in rows[("B4 H16 L4096 E128 plain", "bwd")]] == ["7.000", "7.700", "1.100"]
    assert [c.strip() for c in rows[("B4 H16 L4096 E128 plain", "wide tile")]][-1] == "0.800"
    assert [c.strip() for c in rows[("decode B1 H32/8 S1024 D128 splits   1", "step us")]][-1] == "0.500"


def test_paged_decode_lines_are_their_own_rows():
    run = ("== tree main round 1: decode-paged 256 1 32 8 1024 1\n"
           "decode B1 H32/8 S1024 D128 splits   1:     15.0 us     280 GB/s (K/V read)\n"
           "decode paged256 B1 H32/8 S1024 D128 splits   1:     16.0 us     262 GB/s (K/V read)\n"
           "== tree exp round 1: decode-paged 256 1 32 8 1024 1\n"
           "decode B1 H32/8 S1024 D128 splits   1:     15.0 us     280 GB/s (K/V read)\n"
           "decode paged256 B1 H32/8 S1024 D128 splits   1:     12.0 us     350 GB/s (K/V read)\n")
    _, times = kernel_ab.parse(run)
    assert times[("decode paged256 B1 H32/8 S1024 D128 splits   1", "step us")] == {
        "main": [16.0], "exp": [12.0]}
    assert times[("decode B1 H32/8 S1024 D128 splits   1", "step us")] == {
        "main": [15.0], "exp": [15.0]}


def test_no_output_says_so():
    assert kernel_ab.summarize("nvcc: error\n") == "no kernel_bench output found\n"


def test_prepare_writes_each_revision_tree(tmp_path, monkeypatch):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    monkeypatch.setattr(kernel_ab, "TREES", tmp_path)
    kernel_ab.prepare(["HEAD"])
    assert (tmp_path / "HEAD" / "benchmarks" / "kernel_bench.cu").is_file()
    assert (tmp_path / "HEAD" / "csrc" / "cuda" / "kernels" / "flash_bwd.cuh").is_file()
    assert (tmp_path / "order").read_text().split() == ["HEAD"]
