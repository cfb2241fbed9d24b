"""The Volta atom's fragment loads and mma layouts, on the CPU: tests/atoms/volta_warp_emulation.cpp
runs the device warp GEMM with 32 host threads as the lanes and mma.m8n8k4 emulated from the PTX
fragment layouts, for every operand storage, and demands exact results (no GPU needed)."""

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "atoms" / "volta_warp_emulation.cpp"


def test_volta_warp_gemm_matches_the_ptx_fragment_layouts(tmp_path):
    binary = tmp_path / "volta_warp_emulation"
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    build = subprocess.run(
        [*compiler, "-std=c++17", "-O1", "-pthread", "-Wall", "-Wno-unknown-pragmas",
         "-Wno-unused-variable", f"-I{ROOT / 'csrc'}", str(SOURCE), "-o", str(binary)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all 28 cases exact" in run.stdout
