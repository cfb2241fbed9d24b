"""The Volta atom's fragment loads and mma layouts, on the CPU: tests/atoms/volta_warp_emulation.cpp
runs the device warp GEMM as one warp of the host emulation (tests/atoms/cuda_host_emulation.h: 32
fibers as the lanes, mma.m8n8k4 emulated from the PTX fragment layouts) for every operand storage,
and demands exact results (no GPU needed)."""

import subprocess

from emulation_testing import build_emulation


def test_volta_warp_gemm_matches_the_ptx_fragment_layouts(tmp_path):
    binary = build_emulation("volta_warp_emulation.cpp", tmp_path / "volta_warp_emulation")
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all 28 cases exact" in run.stdout
