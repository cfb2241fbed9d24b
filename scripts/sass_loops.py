#!/usr/bin/env python3
"""Static instruction mix of each kernel's main loop, from the SASS of the NVRTC build.

No V100 is at hand, and on newer GPUs the Volta atom runs emulated, so its speed cannot be
measured there; its SASS can be read. This compiles the static gate's translation unit
(``csrc/cuda/kernels/nvrtc_gate.cu``, as ``scripts/nvrtc_gate.py`` does), disassembles it with
``cuobjdump -sass`` and, per kernel, finds the loop that issues the most tensor-core instructions
(the key/value or query tile loop). Its instructions are counted per iteration, each weighted by
the trip counts of the counted loops around it inside the main loop (a register stepped by an
immediate and compared with an immediate, assumed to start at 0; loops not of that form count
once and are marked ``?``).

The report gives, per iteration of the main loop: instructions, tensor-core instructions (MMA),
shared / global memory instructions, barriers, and the issue ceiling: the fraction of the tensor
pipe's peak reachable when one instruction issues per cycle per scheduler, min(1, MMA * cycles
per MMA / instructions). Cycles per MMA, per scheduler, from the peak rates: sm_70 HMMA.884 (a
quarter of an m8n8k4 with fp32 accumulation) 2 (V100: 8 tensor cores of 64 FMA per cycle per
SM); sm_80 HMMA.16816 8 (A100: 1024 dense fp16 FMA per cycle per SM). It is an upper bound: it
ignores latency, bank conflicts and memory.

It also gives the shared-memory ceiling: shared memory returns (or takes) 128 bytes per cycle per
SM, one 32-bit register of a warp's 32 lanes (sm_70-sm_75; NVIDIA's answer in the developer
forum thread "Unexpected shared memory bank conflict", 77228; sm_80 the same 128 bytes), so an
instruction moving n registers per lane takes at least n cycles of it ("wavefronts": LDS/STS 1,
.64 2, .128 4; LDSM .x1/.x2/.x4 1/2/4), whatever its addresses: a Volta fragment load (LDS.64,
lanes n and n ^ 8 or n ^ 4 sharing each 8 bytes) takes 2, like an unshared one. With four
schedulers an SM runs four warps' iterations in MMA * cycles per MMA cycles, against 4 *
wavefronts cycles of shared memory: ceiling min(1, MMA * cycles per MMA / (4 * wavefronts)), a
lower bound on shared-memory time (bank conflicts add to it).

sm_70 needs a cuobjdump that still reads sm_70 (CUDA 12.x; 13.x refuses it): --cuobjdump PATH or
$CUOBJDUMP, else the one on PATH. Triton's wheels carry one (triton/backends/nvidia/bin).

Usage: python scripts/sass_loops.py [--arch sm_70] [--kernel REGEX] [--sass FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nvrtc_gate  # noqa: E402

CYCLES_PER_MMA = {"sm_70": ("HMMA.884", 2), "sm_80": ("HMMA.16816", 8)}
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?(U?P\w+)\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
CLASSES = {
    "lds": ("LDS", "LDSM"), "sts": ("STS",), "ldg": ("LDG", "LDGSTS"),
    "stg/red": ("STG", "RED", "ATOM", "ATOMG"), "bar": ("BAR",), "shfl": ("SHFL",),
    "fp": ("FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "FSETP", "FSEL", "HADD2", "HMUL2", "HFMA2",
           "F2F", "F2FP"),
    "branch": ("BRA", "BSSY", "BSYNC", "WARPSYNC", "VOTE", "NOP", "BMOV", "DEPBAR"),
}
CLASS_OF = {op: name for name, ops in CLASSES.items() for op in ops}
SCHEDULERS_PER_SM = 4
WAVEFRONTS = "~wavefronts"  # a mix's shared-memory cycles: not an instruction class


def smem_wavefronts(opcode: str) -> int:
    """Cycles of the SM's 128-byte shared-memory data path an access takes at least: the 32-bit
    registers it moves per lane (0 for instructions that are not shared-memory accesses)."""
    parts = opcode.split(".")
    if parts[0] == "LDSM":
        return {"2": 2, "4": 4}.get(parts[-1], 1)
    if parts[0] not in ("LDS", "STS"):
        return 0
    return 4 if "128" in parts else 2 if "64" in parts else 1


def instructions(mix: collections.Counter) -> int:
    return sum(v for k, v in mix.items() if k != WAVEFRONTS)


@dataclass
class Instruction:
    address: int
    guard: str | None  # the predicate register that guards it
    opcode: str
    operands: str


@dataclass
class Loop:
    start: int  # the branch target
    end: int    # the backward branch
    trips: int | None = None

    def holds(self, address: int) -> bool:
        return self.start <= address <= self.end


def parse_functions(sass: str) -> dict[str, list[Instruction]]:
    functions = {}
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        functions[name] = [Instruction(int(m.group(1), 16), m.group(2), m.group(3), m.group(4))
                           for m in INSTRUCTION.finditer(chunk)]
    return functions


def counted_trips(body: list[Instruction], branch: Instruction) -> int | None:
    """Trips of a loop whose branch tests a counter stepped by an immediate against an
    immediate bound (ISETP.GE, the counter assumed to start at 0)."""
    tests = [i for i in body if i.opcode.startswith("ISETP.GE")
             and re.match(rf"\s*{branch.guard}, PT, ", i.operands)]
    if branch.guard is None or not tests:
        return None
    m = re.fullmatch(r"\s*P\d, PT, (R\d+)(?:\.reuse)?, (0x[0-9a-f]+), PT\s*", tests[-1].operands)
    if not m:
        return None
    for ins in body:
        counter = m.group(1)
        step = re.fullmatch(rf"\s*{counter}, {counter}(?:\.reuse)?, (0x[0-9a-f]+)(?:, RZ)?\s*",
                            ins.operands)
        if ins.opcode == "IADD3" and step:
            return -(-int(m.group(2), 16) // int(step.group(1), 16))
    return None


def loops_of(code: list[Instruction]) -> list[Loop]:
    loops, branches = [], []
    for ins in code:
        target = re.search(r"0x([0-9a-f]+)", ins.operands)
        if ins.opcode.split(".")[0] == "BRA" and target and int(target.group(1), 16) <= ins.address:
            loops.append(Loop(int(target.group(1), 16), ins.address))
            branches.append(ins)
    for loop, branch in zip(loops, branches):
        # The loop's own counter: instructions of the loops nested in it do not count.
        nested = [lp for lp in loops
                  if lp is not loop and loop.holds(lp.start) and loop.holds(lp.end)]
        loop.trips = counted_trips([i for i in code if loop.holds(i.address)
                                    and not any(lp.holds(i.address) for lp in nested)], branch)
    return loops


def branch_target(ins: Instruction) -> int | None:
    target = re.search(r"0x([0-9a-f]+)", ins.operands)
    return int(target.group(1), 16) if ins.opcode.split(".")[0] == "BRA" and target else None


def weighted_mix(code: list[Instruction], outer: Loop, loops: list[Loop], mma: str, fewest: bool):
    """Instruction classes of one iteration of `outer` along the path through its body that
    issues the most MMA and, of those, the fewest (or the most) instructions; the counted loops
    inside are unrolled. The fewest: every branch that only adds work (masking, bounds checks, a
    rescale, the next tile's loads) skips it; the most: it never does. A steady-state interior
    tile lies between the two."""
    inner = [lp for lp in loops if lp is not outer and outer.holds(lp.start)
             and outer.holds(lp.end)]
    body = [i for i in code if outer.holds(i.address)]
    leaders = {body[0].address}
    for n, ins in enumerate(body):
        target = branch_target(ins)
        if target is not None or ins.opcode in ("EXIT", "RET"):
            if target is not None and outer.holds(target):
                leaders.add(target)
            if n + 1 < len(body):
                leaders.add(body[n + 1].address)
    blocks = []
    for ins in body:
        if ins.address in leaders:
            blocks.append([])
        blocks[-1].append(ins)

    def mix_of(block):
        mix = collections.Counter()
        for ins in block:
            weight = 1
            for lp in inner:
                if lp.holds(ins.address):
                    weight *= lp.trips or 1
            kind = ("mma" if ins.opcode.startswith(mma)
                    else CLASS_OF.get(ins.opcode.split(".")[0], "int/other"))
            mix[kind] += weight
            mix[WAVEFRONTS] += weight * smem_wavefronts(ins.opcode)
        return mix

    def better(a, b):  # more MMA, then fewer (or more) instructions
        sign = -1 if fewest else 1
        return b is None or ((a["mma"], sign * instructions(a))
                             > (b["mma"], sign * instructions(b)))

    entering = {body[0].address: collections.Counter()}
    for n, block in enumerate(blocks):
        if block[0].address not in entering:
            continue
        leaving = entering[block[0].address] + mix_of(block)
        last = block[-1]
        if last.address == outer.end:
            return leaving, inner
        successors = []
        target = branch_target(last)
        if target is not None and target > last.address and outer.holds(target):
            successors.append(target)
        # A branch without a guard and without a predicate operand ("BRA P5, 0x...") always jumps.
        unconditional = (target is not None and last.guard is None
                         and "P" not in last.operands.split("0x")[0])
        if last.opcode not in ("EXIT", "RET") and not unconditional and n + 1 < len(blocks):
            successors.append(blocks[n + 1][0].address)
        for address in successors:
            if better(leaving, entering.get(address)):
                entering[address] = leaving
    return collections.Counter(), inner


def report(name: str, code: list[Instruction], arch: str) -> str | None:
    mma, cycles = CYCLES_PER_MMA[arch]
    loops = loops_of(code)
    best = None
    for loop in loops:
        mix, inner = weighted_mix(code, loop, loops, mma, fewest=True)
        if mix["mma"] and (best is None or mix["mma"] > best[1]["mma"]):
            best = (loop, mix, inner)
    if best is None:
        return None
    loop, fewest, inner = best
    most, _ = weighted_mix(code, loop, loops, mma, fewest=False)
    low, high = instructions(fewest), instructions(most)
    trips = ", ".join(f"{lp.start:#x}-{lp.end:#x} x{lp.trips or '?'}" for lp in inner) or "none"
    parts = ", ".join(f"{k} {v}" for k, v in fewest.most_common() if k != WAVEFRONTS)
    ceiling = [100 * min(1.0, fewest["mma"] * cycles / n) for n in (high, low)]
    waves = sorted((fewest[WAVEFRONTS], most[WAVEFRONTS]))
    smem = [100 * min(1.0, fewest["mma"] * cycles / (SCHEDULERS_PER_SM * w)) if w else 100.0
            for w in reversed(waves)]
    return (f"{name}\n  main loop {loop.start:#x}-{loop.end:#x} (inner loops: {trips})\n"
            f"  per iteration, fewest: {low} instructions: {parts}\n"
            f"  {fewest['mma']} MMA; {low / fewest['mma']:.2f}-{high / fewest['mma']:.2f} "
            f"instructions per MMA (fewest-most); issue ceiling {ceiling[0]:.0f}-{ceiling[1]:.0f}% "
            f"of the tensor pipe\n"
            f"  shared memory: {waves[0]}-{waves[1]} wavefronts, "
            f"{waves[0] / fewest['mma']:.2f}-{waves[1] / fewest['mma']:.2f} per MMA; "
            f"shared-memory ceiling {smem[0]:.0f}-{smem[1]:.0f}% of the tensor pipe")


def sass_of(arch: str, source: str, cuobjdump: str) -> str:
    status, log, cubin = nvrtc_gate.compile_for(nvrtc_gate.load_nvrtc(), source, arch,
                                                os.path.join(nvrtc_gate.REPO, "csrc"))
    if status != 0:
        sys.exit(f"sass_loops: NVRTC failed for {arch}:\n{log}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"sass_loops: {cuobjdump} failed: {run.stderr.strip()}")
    return run.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_70", choices=sorted(CYCLES_PER_MMA))
    parser.add_argument("--source", default=nvrtc_gate.GATE_SOURCE)
    parser.add_argument("--kernel", default="", help="regex over the demangled kernel names")
    parser.add_argument("--sass", help="read this cuobjdump -sass output instead of compiling")
    parser.add_argument("--save-sass", help="also write the disassembly here")
    parser.add_argument("--cuobjdump",
                        default=os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump"))
    args = parser.parse_args()
    if args.sass:
        with open(args.sass, encoding="utf-8") as f:
            sass = f.read()
    else:
        if not args.cuobjdump:
            sys.exit("sass_loops: no cuobjdump (--cuobjdump PATH or $CUOBJDUMP)")
        sass = sass_of(args.arch, args.source, args.cuobjdump)
        if args.save_sass:
            with open(args.save_sass, "w", encoding="utf-8") as f:
                f.write(sass)
    functions = parse_functions(sass)
    names = nvrtc_gate.kernel_names(list(functions))
    shown = 0
    for key in sorted(functions, key=lambda k: names[k]):
        name = names[key]
        if not re.search(args.kernel, name):
            continue
        text = report(name, functions[key], args.arch)
        if text:
            print(text)
            shown += 1
    if not shown:
        print("sass_loops: no kernel with a tensor-core loop matched", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
