#!/usr/bin/env python3
"""Static gate: compile the device-only kernels with NVRTC and check their resource usage.

CUDA 13 cannot target sm_70, so V100 builds are proven here instead: NVRTC 12.9 (PyPI package
``nvidia-cuda-nvrtc-cu12==12.9.86``) compiles ``csrc/cuda/kernels/nvrtc_gate.cu`` to SASS for each
arch with ``--ptxas-options=-v``. The gate prints registers, spill bytes and static shared memory
per kernel and fails on any spill, on more than 96 KB of shared memory on sm_70, on a compile
error, or when no kernel was compiled at all.

Usage: python scripts/nvrtc_gate.py [--arch sm_70 --arch sm_80] [--source FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GATE_SOURCE = os.path.join(REPO, "csrc", "cuda", "kernels", "nvrtc_gate.cu")
SM70_SMEM_LIMIT = 96 * 1024


@dataclass
class KernelReport:
    name: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    smem_bytes: int = 0


@dataclass
class ArchReport:
    arch: str
    kernels: dict = field(default_factory=dict)
    log: str = ""


def load_nvrtc() -> ctypes.CDLL:
    candidates = []
    try:
        import nvidia.cuda_nvrtc  # type: ignore

        for root in nvidia.cuda_nvrtc.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so.12")))
    except ImportError:
        pass
    candidates.append("libnvrtc.so.12")
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    sys.exit("nvrtc_gate: libnvrtc.so.12 not found; pip install nvidia-cuda-nvrtc-cu12==12.9.86")


def compile_for(nvrtc: ctypes.CDLL, source_path: str, arch: str, include_dir: str,
                extra_options: tuple[str, ...] = ()) -> tuple[int, str, bytes]:
    """NVRTC's status, its log (with ptxas -v) and the CUBIN (empty when compilation failed)."""
    with open(source_path, encoding="utf-8") as f:
        source = f.read().encode()
    program = ctypes.c_void_p()
    status = nvrtc.nvrtcCreateProgram(ctypes.byref(program), source,
                                      os.path.basename(source_path).encode(), 0, None, None)
    if status != 0:
        sys.exit(f"nvrtc_gate: nvrtcCreateProgram failed with status {status}")
    options = [f"--gpu-architecture={arch}", "--ptxas-options=-v", "-std=c++17",
               f"--include-path={include_dir}", "--device-as-default-execution-space",
               "-DFLASHV100_NVRTC_GATE=1", *extra_options]
    option_array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    status = nvrtc.nvrtcCompileProgram(program, len(options), option_array)
    log_size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(log_size))
    log = ctypes.create_string_buffer(log_size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    cubin = b""
    if status == 0:
        cubin_size = ctypes.c_size_t()
        nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(cubin_size))
        buffer = ctypes.create_string_buffer(cubin_size.value)
        nvrtc.nvrtcGetCUBIN(program, buffer)
        cubin = buffer.raw
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace"), cubin


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines())) if out else {n: n for n in names}


def kernel_names(symbols: list[str]) -> dict[str, str]:
    """Demangled names without the namespaces, so that the template arguments (the tile shape
    last) fit a line."""
    return {key: name.replace("flashv100::kern::", "").replace("flashv100::", "")
            for key, name in demangle(symbols).items()}


def parse_ptxas(log: str) -> dict[str, KernelReport]:
    kernels: dict[str, KernelReport] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = kernels.setdefault(m.group(1), KernelReport(m.group(1)))
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
            current = kernels.get(name)  # device functions have properties too; skip them
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current.smem_bytes = int(s.group(1)) if s else 0
    return kernels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="sm_XX (repeatable); default sm_70, sm_80")
    parser.add_argument("--source", default=GATE_SOURCE)
    parser.add_argument("--include", default=os.path.join(REPO, "csrc"))
    parser.add_argument("--log", help="write the full NVRTC logs here")
    args = parser.parse_args()
    archs = args.arch or ["sm_70", "sm_80"]

    nvrtc = load_nvrtc()
    failures: list[str] = []
    full_log = []
    # One thread per arch: ctypes releases the GIL during each NVRTC compile, so they overlap.
    with ThreadPoolExecutor(max_workers=len(archs)) as pool:
        results = list(pool.map(
            lambda arch: compile_for(nvrtc, args.source, arch, args.include), archs))
    for arch, (status, log, _) in zip(archs, results):
        full_log.append(f"==== {arch} ====\n{log}")
        if status != 0:
            print(log)
            failures.append(f"{arch}: compilation failed (nvrtc status {status})")
            continue
        kernels = parse_ptxas(log)
        if not kernels:
            failures.append(f"{arch}: no kernel compiled (the gate would be a no-op)")
            continue
        names = kernel_names(list(kernels))
        print(f"\n{arch}: {len(kernels)} kernels")
        print(f"{'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6} {'smem':>7}  kernel")
        for key, k in sorted(kernels.items(), key=lambda kv: names[kv[0]]):
            print(f"{k.registers:5d} {k.spill_stores:9d} {k.spill_loads:9d} {k.stack_bytes:6d} "
                  f"{k.smem_bytes:7d}  {names[key][:150]}")
            if k.spill_stores or k.spill_loads:
                failures.append(f"{arch}: {names[key]} spills ({k.spill_stores} B stored, "
                                f"{k.spill_loads} B loaded)")
            if arch == "sm_70" and k.smem_bytes > SM70_SMEM_LIMIT:
                failures.append(f"{arch}: {names[key]} uses {k.smem_bytes} B shared memory "
                                f"(> {SM70_SMEM_LIMIT})")
    if args.log:
        with open(args.log, "w", encoding="utf-8") as f:
            f.write("\n".join(full_log))
    if failures:
        print("\nnvrtc_gate: FAILED\n  " + "\n  ".join(failures))
        return 1
    print(f"\nnvrtc_gate: OK ({', '.join(archs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
