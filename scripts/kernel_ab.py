#!/usr/bin/env python3
"""Side-by-side kernel timing of source trees (benchmarks/kernel_bench.cu), in one GPU call.

    python scripts/kernel_ab.py prepare main my-branch      # here: a tree per git revision
    python scripts/kernel_ab.py build                       # optional, here: nvcc without a GPU
    python scripts/kernel_ab.py run "4 16 4096 128" "decode 8 32 8 65536 1 4"   # on the GPU
    python scripts/kernel_ab.py summarize RESULTS           # ratios against the first tree

`prepare` writes each revision's csrc/ and benchmarks/kernel_bench.cu to build/kernel_ab/<name>/
(build/ is ignored by git: carry build/kernel_ab to the GPU machine). `build` compiles each tree's
kernel_bench (nvcc, -arch from KERNEL_AB_ARCH, default sm_90; no GPU needed, so it can run before
the GPU call with an nvcc no newer than the GPU machine's driver takes). `run` builds the trees that
have no kernel_bench yet, in parallel, then runs each shape on every tree in turn, ROUNDS rounds
(default 2), so that clock and thermal drift fall on all trees alike; it writes the raw output and
the summary to $OUT/kernel_ab.txt (or build/kernel_ab/results.txt). The summary gives each timing's
median over the rounds and its ratio to the first tree (< 1: faster than the first).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent
TREES = REPO / "build" / "kernel_ab"
TREE_MARK = "== tree "
# "B4 H16 L4096 E128 plain  fwd 1.605 ms (...)  bwd 6.954 ms (...), two query buffers 6.804 ms"
_PREFILL = re.compile(r"^(B\d+ H\d+ L\d+ E\d+ \S+)\s+(.*)$")
_PREFILL_TIME = re.compile(r"([a-z][a-z ]*?) ([0-9.]+) ms")
# "decode B1 H32/8 S1024 D128 splits   1:     26.4 us     159 GB/s (K/V read)"
_DECODE = re.compile(r"^(decode .* splits\s+\d+):\s+([0-9.]+) us")


def tree_name(rev: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", rev)


def prepare(revs: List[str]) -> None:
    for rev in revs:
        dest = TREES / tree_name(rev)
        if dest.exists():
            subprocess.run(["rm", "-rf", str(dest)], check=True)
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "csrc",
                                  "benchmarks/kernel_bench.cu"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
        print(f"{rev}: {dest}")
    (TREES / "order").write_text("\n".join(tree_name(r) for r in revs) + "\n")


def build(names: List[str], arch: str) -> None:
    procs = []
    for name in names:
        tree = TREES / name
        if (tree / "kernel_bench").exists():  # `prepare` clears a tree: built from its sources
            continue
        cmd = ["nvcc", "-O3", "-std=c++17", f"-arch={arch}", "--expt-relaxed-constexpr",
               "-Icsrc", "-o", "kernel_bench", "benchmarks/kernel_bench.cu"]
        with open(tree / "build.log", "w") as log:  # the child keeps its own descriptor
            procs.append((name, subprocess.Popen(cmd, cwd=tree, stdout=log,
                                                 stderr=subprocess.STDOUT)))
    failed = [name for name, proc in procs if proc.wait() != 0]
    if failed:
        sys.exit(f"kernel_ab: build failed for {', '.join(failed)} (build/kernel_ab/*/build.log)")


def prepared_trees() -> List[str]:
    return (TREES / "order").read_text().split()


def run(shapes: List[str], rounds: int, arch: str) -> str:
    names = prepared_trees()
    build(names, arch)
    out = []
    for r in range(rounds):
        for shape in shapes:
            for name in names:
                res = subprocess.run([str(TREES / name / "kernel_bench"), *shape.split()],
                                     capture_output=True, text=True)
                out.append(f"{TREE_MARK}{name} round {r + 1}: {shape}")
                out.append(res.stdout.rstrip())
                if res.returncode != 0:
                    out.append(f"exit {res.returncode}: {res.stderr.strip()}")
    return "\n".join(out) + "\n"


def parse(text: str) -> Tuple[List[str], Dict[Tuple[str, str], Dict[str, List[float]]]]:
    """Tree names in order of appearance, and {(row, timing): {tree: [times of each round]}}."""
    names: List[str] = []
    times: Dict[Tuple[str, str], Dict[str, List[float]]] = defaultdict(lambda: defaultdict(list))
    tree = None
    for line in text.splitlines():
        if line.startswith(TREE_MARK):
            tree = line[len(TREE_MARK):].split(" round ")[0]
            if tree not in names:
                names.append(tree)
            continue
        if tree is None:
            continue
        m = _DECODE.match(line)
        if m:
            times[(m.group(1), "step us")][tree].append(float(m.group(2)))
            continue
        m = _PREFILL.match(line)
        if m:
            for what, ms in _PREFILL_TIME.findall(m.group(2)):
                times[(m.group(1), what.strip())][tree].append(float(ms))
    return names, times


def summarize(text: str) -> str:
    names, times = parse(text)
    if not names:
        return "no kernel_bench output found\n"
    base = names[0]
    columns = names + [f"{n} / {base}" for n in names[1:]]
    lines = [f"median over rounds; ratio = time / time of {base} (< 1: faster)",
             "| row | timing | " + " | ".join(columns) + " |",
             "|---|---|" + "---:|" * len(columns)]
    for (row, what), per_tree in times.items():
        med = {n: statistics.median(per_tree[n]) for n in names if per_tree.get(n)}
        cells = [f"{med[n]:.3f}" if n in med else "-" for n in names]
        ratios = [f"{med[n] / med[base]:.3f}" if n in med and base in med else "-"
                  for n in names[1:]]
        lines.append(f"| {row} | {what} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="a source tree per git revision")
    p.add_argument("revs", nargs="+")
    b = sub.add_parser("build", help="build every prepared tree's kernel_bench (no GPU needed)")
    r = sub.add_parser("run", help="build and time every prepared tree (GPU)")
    r.add_argument("shapes", nargs="+", help='kernel_bench arguments, e.g. "4 16 4096 128"')
    r.add_argument("--rounds", type=int, default=int(os.environ.get("ROUNDS", 2)))
    s = sub.add_parser("summarize", help="medians and ratios of a results file")
    s.add_argument("results")
    args = parser.parse_args(argv)
    arch = os.environ.get("KERNEL_AB_ARCH", "sm_90")
    if args.cmd == "prepare":
        prepare(args.revs)
    elif args.cmd == "build":
        build(prepared_trees(), arch)
    elif args.cmd == "run":
        raw = run(args.shapes, args.rounds, arch)
        report = raw + "\n" + summarize(raw)
        dest = Path(os.environ["OUT"]) if os.environ.get("OUT") else TREES
        (dest / "kernel_ab.txt").write_text(report)
        print(report)
    else:
        print(summarize(Path(args.results).read_text()), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
