"""Side-by-side attention benchmark: flashv100 vs SDPA backends vs naive attention.

    python -m torch_flash_v100 bench --suite quick
    python -m torch_flash_v100 bench --suite seed --device cuda --json benchmarks/results/seed_h200.json \
        --plot benchmarks/results/seed_h200.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import report
from .harness import DTYPES, run_suite, source_checkout
from .implementations import IMPL_NAMES
from .suites import SUITES, get_suite


def results_dir() -> Path:
    """Where ``--save`` writes: benchmarks/results of a source checkout, else ./bench_results."""
    root = source_checkout()
    return root / "benchmarks" / "results" if root is not None else Path.cwd() / "bench_results"


def best_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    suites = "; ".join(f"{n}: {d}" for n, (d, _, _) in SUITES.items())
    p.add_argument("--suite", default="quick", choices=list(SUITES) + ["decode"],
                   help=f"configuration suite (default quick). {suites}; decode: one token per "
                        "sequence against a KV cache (flash_attn_with_kvcache vs SDPA, latency and "
                        "GB/s; torch_flash_v100.bench.decode)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="input dtype (default fp16 on CUDA, fp32 on CPU)")
    p.add_argument("--impls", default=None,
                   help=f"comma-separated subset of implementations (default all): {','.join(IMPL_NAMES)}")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="write the full result document (with metadata) as JSON; a .md with the tables "
                        "is written next to it")
    p.add_argument("--plot", dest="plot_path", default=None, metavar="PATH",
                   help="write a PNG: TFLOP/s vs sequence length per implementation, or bar "
                        "charts of the times for small groups (needs matplotlib)")
    p.add_argument("--save", action="store_true",
                   help="write JSON, Markdown and PNG to <dir>/<suite>_<device>.*, <dir> = "
                        "benchmarks/results in a source checkout, else ./bench_results")
    p.add_argument("--time-budget", type=float, default=None, metavar="SEC",
                   help="wall-time budget for the whole suite; repetitions adapt to it "
                        "(default: per suite, e.g. 170 s for seed/fa2, 45 s for quick; past 1.1x the rest is skipped)")
    p.add_argument("--repetitions", type=int, default=None, metavar="N",
                   help="instead of a time budget: time every measurement over exactly N "
                        "repetitions (after a warm-up); every measurement runs, whatever the "
                        "machine's speed or load")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="measure each configuration's implementations in turn N times and report "
                        "each phase's median of the rounds' medians, so that clock changes (a "
                        "GPU at its power cap) fall on all alike (default 1; not the decode suite)")
    p.add_argument("--timer", default="auto", choices=["auto", "events", "do_bench"],
                   help="CUDA timer: own CUDA-event loop, triton.testing.do_bench, or auto (default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list suites and their configurations, then exit")
    return p


def run(args) -> int:
    import torch

    device = args.device or best_device()
    if args.list:
        for name, (desc, _, budget) in SUITES.items():
            cfgs = get_suite(name, device, args.dtype)
            print(f"{name} ({len(cfgs)} configs, budget {budget:.0f}s): {desc}")
            for c in cfgs:
                print(f"    {c.key()}")
        return 0
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda requested but CUDA is not available", file=sys.stderr)
        return 2
    if args.rounds < 1 or (args.rounds != 1 and args.suite == "decode"):
        print("error: --rounds needs N >= 1, and the decode suite takes none (each of its steps is "
              "timed in one run)", file=sys.stderr)
        return 2
    if args.suite == "decode":
        from . import decode

        json_path = args.json_path
        if args.save and json_path is None:
            json_path = results_dir() / f"decode_{torch.device(device).type}.json"
        impl_names = [s.strip() for s in args.impls.split(",")] if args.impls else None
        return decode.run_cli(device, json_path, impls=impl_names,
                              repetitions=args.repetitions, progress=not args.no_progress)
    configs = get_suite(args.suite, device, args.dtype)
    repetitions = args.repetitions
    if repetitions is not None:
        if args.time_budget is not None:
            print("error: give --repetitions or --time-budget, not both", file=sys.stderr)
            return 2
        if repetitions < 1 or args.timer == "do_bench":
            print("error: --repetitions needs N >= 1 and a counting timer (not --timer do_bench, "
                  "which measures for a time)", file=sys.stderr)
            return 2
        budget = None
        timing = f"{repetitions} repetition{'s' if repetitions != 1 else ''} per measurement"
    else:
        budget = args.time_budget if args.time_budget is not None else SUITES[args.suite][2]
        timing = f"time budget {budget:.0f}s"
    if args.rounds > 1:
        timing += f", {args.rounds} rounds"
    impl_names = [s.strip() for s in args.impls.split(",")] if args.impls else None
    unknown = [n for n in impl_names or [] if n not in IMPL_NAMES]
    if unknown:
        print(f"error: unknown implementation(s) {', '.join(unknown)}; choose from {', '.join(IMPL_NAMES)}",
              file=sys.stderr)
        return 2
    json_path, plot_path = args.json_path, args.plot_path
    if args.save:
        tag = f"{args.suite}_{torch.device(device).type}"
        json_path = json_path or results_dir() / f"{tag}.json"
        plot_path = plot_path or results_dir() / f"{tag}.png"

    def save_partial(doc):
        if json_path:
            report.write_json(doc, json_path)

    print(f"suite {args.suite}: {len(configs)} configurations on {device} ({timing})",
          file=sys.stderr)
    doc = run_suite(configs, device, impl_names=impl_names, time_budget_s=budget,
                    repetitions=repetitions, progress=not args.no_progress, timer=args.timer,
                    suite=args.suite, rounds=args.rounds, on_config_done=save_partial)
    text = report.markdown(doc)
    print(text)
    if json_path:
        p = report.write_json(doc, json_path)
        md = Path(p).with_suffix(".md")
        md.write_text(text)
        print(f"wrote {p} and {md}", file=sys.stderr)
    if plot_path:
        p = report.write_plot(doc, plot_path)
        if p:
            print(f"wrote {p}", file=sys.stderr)
    n_ok = sum(1 for e in doc["results"] for r in e["impls"].values() if r.get("status") == "ok")
    print(f"done in {doc['metadata']['elapsed_s']:.1f}s: {n_ok} measurements ok", file=sys.stderr)
    return 0


def main(argv=None, prog="python -m torch_flash_v100 bench") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))

