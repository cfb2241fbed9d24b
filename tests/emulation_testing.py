"""Builds the host-emulation programs of tests/atoms (cuda_host_emulation.h: device kernels as host
code, no GPU needed) with the host C++ compiler ($CXX, default c++)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ATOMS = ROOT / "tests" / "atoms"


def build_emulation(source: str, binary: Path, defines=()) -> Path:
    """Compiles tests/atoms/`source` (with -D`defines`) into `binary`; fails the test with the
    compiler's errors."""
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    build = subprocess.run(
        [*compiler, "-std=c++17", "-O1", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-variable",
         *(f"-D{d}" for d in defines), f"-I{ROOT / 'csrc'}", f"-I{ATOMS}", str(ATOMS / source),
         "-o", str(binary)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return binary
