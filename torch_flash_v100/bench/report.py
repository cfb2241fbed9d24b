"""Markdown tables, JSON and the PNG plot of a benchmark result document."""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional

from .implementations import FLASH

__all__ = ["markdown", "summary_markdown", "detail_markdown", "overhead_markdown",
           "unstable_markdown", "write_json", "write_plot", "build_figure", "header_markdown",
           "UNSTABLE_FLAG"]

# Marks cells from an unstable measurement (harness.unstable_reasons); listed below the tables
UNSTABLE_FLAG = "[!]"


def _flag(r: Dict[str, Any]) -> str:
    return f" {UNSTABLE_FLAG}" if r.get("unstable") else ""


def _f(x, nd=2) -> str:
    if x is None:
        return "-"
    try:
        if x != x:  # nan
            return "nan"
    except Exception:
        return str(x)
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:.0f}"
        if x != 0 and abs(x) < 10 ** (-nd):
            return f"{x:.1e}"
        return f"{x:.{nd}f}"
    return str(x)


def _e(x) -> str:
    if x is None:
        return "-"
    if x != x:
        return "nan"
    return f"{x:.1e}"


def header_markdown(doc: Dict[str, Any]) -> str:
    md = doc.get("metadata", {})
    tfv = md.get("torch_flash_v100", {})
    lines = [f"### Attention benchmark: suite `{doc.get('suite')}`", ""]
    cc = md.get("compute_capability")
    lines.append(f"- device: {md.get('device_name')} ({md.get('device')}{', sm ' + cc if cc else ''})")
    lines.append(f"- torch {md.get('torch_version')}, CUDA {md.get('cuda_version')}, "
                 f"torch_flash_v100 {tfv.get('version', tfv.get('error'))}, "
                 f"commit {(md.get('git_commit') or 'unknown')[:12]}{' (dirty)' if md.get('git_dirty') else ''}, "
                 f"{md.get('date')}")
    paths = [f"{i['name']}: {i['kernel_path']}" for i in doc.get("implementations", []) if i.get("kernel_path")]
    if paths:
        lines.append(f"- kernel paths: {'; '.join(paths)}")
    lines.append("- times in ms (median); TF/s with causal counted as half; mem = peak extra MB of one "
                 "fwd+bwd; speedup = time(impl) / time(flashv100), > 1 means flashv100 is faster; "
                 "errors = max abs vs fp64 reference (n/a with dropout: random outputs); "
                 f"{UNSTABLE_FLAG} = an unstable measurement (see the list below the tables)")
    if _has_graph_times(doc):
        lines.append("- graph f+b = forward+backward captured once in a CUDA graph and replayed: "
                     "the kernels' time without a step's host work, which eager fwd+bwd includes "
                     "where the GPU waits for the host (small shapes)")
    reps = md.get("repetitions")
    budget = md.get("time_budget_s")
    lines.append(f"- timing: {reps} repetitions per measurement" if reps else
                 f"- timing: time budget {budget:g} s for the suite" if budget is not None else
                 "- timing: about 0.3 s per measurement")
    if md.get("rounds", 1) > 1:
        lines[-1] += (f"; {md['rounds']} rounds, a configuration's implementations in turn: each "
                      "time the median of the rounds' medians")
    return "\n".join(lines)


def summary_markdown(doc: Dict[str, Any]) -> str:
    """One row per configuration: flashv100 numbers and its fwd+bwd speedup vs every other impl."""
    impls = [i["name"] for i in doc.get("implementations", []) if i["name"] != FLASH and i.get("available")]
    graphed = _has_graph_times(doc)
    phases = ["fwdbwd"] + (["graph_fwdbwd"] if graphed else [])
    head = (["config", "flashv100 fwd ms", "fwd+bwd ms"] + (["graph f+b ms"] if graphed else [])
            + ["TF/s f+b", "mem MB"] + [f"vs {n}" for n in impls]
            + ([f"vs {n} (graph)" for n in impls] if graphed else []))
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for ent in doc.get("results", []):
        fl = ent["impls"].get(FLASH, {})
        if fl.get("status") == "ok":
            cells = ([_f(fl.get("fwd_ms"), 3) + _flag(fl), _f(fl.get("fwdbwd_ms"), 3)]
                     + ([_f(fl.get("graph_fwdbwd_ms"), 3)] if graphed else [])
                     + [_f(fl.get("tflops_fwdbwd")), _f(fl.get("mem_mb"), 1)])
        else:
            cells = [fl.get("status", "-")] + ["-"] * (3 + graphed)
        for ph in phases:
            for n in impls:
                sp = ent.get("speedup", {}).get(n, {}).get(ph)
                if sp is not None:
                    either = fl.get("unstable") or ent["impls"].get(n, {}).get("unstable")
                    cells.append(f"{sp:.2f}x" + _flag({"unstable": either}))
                else:
                    status = ent["impls"].get(n, {}).get("status", "-")
                    cells.append("-" if status == "ok" else status)
        rows.append("| " + " | ".join([ent["key"]] + cells) + " |")
    return "\n".join(rows)


def _has_graph_times(doc: Dict[str, Any]) -> bool:
    return any("graph_fwdbwd_ms" in r for ent in doc.get("results", []) for r in ent["impls"].values())


def detail_markdown(doc: Dict[str, Any]) -> str:
    graphed = _has_graph_times(doc)
    head = (["config", "impl", "fwd ms", "bwd ms", "fwd+bwd ms"] + (["graph f+b ms"] if graphed else [])
            + ["TF/s fwd", "TF/s f+b", "mem MB", "mem fwd MB", "speedup f+b"]
            + (["speedup graph f+b"] if graphed else []) + ["err out", "err dq", "err dk", "err dv"])
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    notes: List[str] = []
    for ent in doc.get("results", []):
        for name, r in ent["impls"].items():
            if r.get("status") == "ok":
                def speedup(ph):
                    sp = ent.get("speedup", {}).get(name, {}).get(ph)
                    return "ref" if name == FLASH else (f"{sp:.2f}x" if sp else "-")

                graph_cell = [_f(r.get("graph_fwdbwd_ms"), 3)]
                if r.get("graph_error"):
                    graph_cell = ["error"]
                    notes.append(f"- {ent['key']} / {name}: graph capture: {r['graph_error']}")
                cells = ([_f(r.get("fwd_ms"), 3), _f(r.get("bwd_ms"), 3), _f(r.get("fwdbwd_ms"), 3)]
                         + (graph_cell if graphed else [])
                         + [_f(r.get("tflops_fwd")), _f(r.get("tflops_fwdbwd")), _f(r.get("mem_mb"), 1),
                            _f(r.get("mem_fwd_mb"), 1), speedup("fwdbwd")]
                         + ([speedup("graph_fwdbwd")] if graphed else []))
                # "accuracy" holds why errors are not applicable (dropout): n/a, not a failure
                cells += [("n/a" if r.get("accuracy") else _e(r.get(e)))
                          for e in ("err_out", "err_dq", "err_dk", "err_dv")]
            elif r.get("status") == "skipped" and r.get("reason") and any(
                    i["name"] == name and not i.get("available") for i in doc.get("implementations", [])):
                continue  # unavailable on this device: listed once below the table
            else:
                msg = r.get("error") or r.get("reason") or ""
                notes.append(f"- {ent['key']} / {name}: {r.get('status')}: {msg}")
                cells = [r.get("status", "?")] + ["-"] * (len(head) - 3)
            rows.append("| " + " | ".join([ent["key"], name + _flag(r)] + cells) + " |")
    out = "\n".join(rows)
    unavailable = [f"- {i['name']}: skipped: {i.get('skip_reason')}" for i in doc.get("implementations", [])
                   if not i.get("available")]
    if unavailable:
        out += "\n\nNot available on this device:\n" + "\n".join(unavailable)
    if notes:
        out += "\n\nErrors and skips:\n" + "\n".join(notes)
    return out


def _x(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def overhead_markdown(doc: Dict[str, Any]) -> str:
    """The cost of each mask/dropout variant: time(variant) / time(same shape, plain) per
    implementation, and flashv100's speedup over the implementation in that same variant.
    Empty for documents without variants."""
    rows_in = doc.get("overhead") or []
    if not rows_in:
        return ""
    head = ["shape", "variant", "impl", "fwd", "fwd+bwd", "f+b vs flashv100"]
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * 3) + "|"]
    worst: "OrderedDict[str, float]" = OrderedDict()  # flashv100's largest f+b overhead per variant
    for r in rows_in:
        if "status" in r:
            cells = [r["status"]] * 2 + ["-"]
        else:
            vs = "ref" if r["impl"] == FLASH else _x((r.get("speedup") or {}).get("fwdbwd"))
            cells = [_x(r.get("fwd")) + _flag(r), _x(r.get("fwdbwd")), vs]
            if r["impl"] == FLASH and r.get("fwdbwd") is not None:
                worst[r["variant"]] = max(worst.get(r["variant"], 0.0), r["fwdbwd"])
        rows.append("| " + " | ".join([r["shape"], r["variant"], r["impl"]] + cells) + " |")
    out = "\n".join(rows)
    if worst:
        out += ("\n\nflashv100, largest fwd+bwd overhead over the shapes: "
                + "; ".join(f"{v} {_x(x)}" for v, x in worst.items()))
    return out


def unstable_markdown(doc: Dict[str, Any]) -> str:
    """One line per unstable measurement and why; empty when there is none."""
    lines = [f"- {ent['key']} / {name}: {'; '.join(r['unstable'])}"
             for ent in doc.get("results", []) for name, r in ent["impls"].items()
             if r.get("unstable")]
    if not lines:
        return ""
    return (f"{len(lines)} measurement(s) marked {UNSTABLE_FLAG}: their times are not reliable "
            "(rerun them on an idle machine, or with more repetitions):\n" + "\n".join(lines))


def markdown(doc: Dict[str, Any]) -> str:
    parts = [header_markdown(doc), "#### Summary (fwd+bwd speedup of flashv100)", summary_markdown(doc)]
    overhead = overhead_markdown(doc)
    if overhead:
        parts += ["#### Overhead of masks and dropout (time(variant) / time(plain), same implementation; "
                  "f+b vs flashv100 = time(impl) / time(flashv100) in the same variant)", overhead]
    parts += ["#### All implementations", detail_markdown(doc)]
    unstable = unstable_markdown(doc)
    if unstable:
        parts += [f"#### Unstable measurements {UNSTABLE_FLAG}", unstable]
    return "\n\n".join(parts) + "\n"


def _clean(x):
    """NaN/inf become null, so that the file is strict JSON."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    return x


def write_json(doc: Dict[str, Any], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_clean(doc), f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


# Groups with fewer distinct x values than this are bar charts of times: a line plot of one or two
# points per implementation shows dots, and TFLOP/s of tiny shapes all sit near 0.
MIN_LINE_POINTS = 3


def plot_kind(ents: List[Dict[str, Any]]) -> str:
    """"lines" (TFLOP/s against the group's x field) or "bars" (median ms per configuration)."""
    xname = ents[0]["config"].get("x", "L") if ents else "L"
    return "lines" if len({e["config"][xname] for e in ents}) >= MIN_LINE_POINTS else "bars"


def write_plot(doc: Dict[str, Any], path) -> Optional[Path]:
    """The figure of :func:`build_figure` as a PNG. Returns None (and says why on stderr) when
    matplotlib is missing."""
    import sys

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"plot skipped: matplotlib unavailable ({e}); pip install 'torch-flash-v100[bench]'",
              file=sys.stderr)
        return None
    fig = build_figure(doc)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_figure(doc: Dict[str, Any]):
    """One row of panels per configuration group, columns forward and forward+backward. Groups
    with a sweep (see plot_kind) plot TFLOP/s against its x field per implementation, causal
    dashed; small groups are bar charts of the median time with p20-p80 whiskers per
    configuration, unstable measurements hatched."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    groups: "OrderedDict[str, List[Dict[str, Any]]]" = OrderedDict()
    for ent in doc.get("results", []):
        groups.setdefault(ent["config"].get("group") or "all", []).append(ent)
    names = [i["name"] for i in doc.get("implementations", []) if i.get("available")]
    if not groups:
        groups["(no results)"] = []
    cmap = plt.get_cmap("tab10")
    colors = {n: cmap(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.6 * len(groups)), squeeze=False)
    md = doc.get("metadata", {})
    shown: set = set()
    kinds = set()
    for row, (g, ents) in enumerate(groups.items()):
        kind = plot_kind(ents)
        kinds.add(kind)
        for col, (ph, title) in enumerate((("fwd", "forward"), ("fwdbwd", "forward + backward"))):
            ax = axes[row][col]
            draw = _plot_lines if kind == "lines" else _plot_bars
            shown |= draw(ax, ents, names, colors, ph)
            ax.set_title(f"{g}: {title}", fontsize=9)
            ax.grid(True, alpha=0.3, axis="y" if kind == "bars" else "both")

    shown_names = [n for n in names if n in shown]
    handles = [Line2D([], [], color=colors[n], marker="o", ms=3) if "bars" not in kinds
               else Patch(color=colors[n]) for n in shown_names]
    labels = list(shown_names)
    if "lines" in kinds:
        handles += [Line2D([], [], color="gray", ls="-"), Line2D([], [], color="gray", ls="--")]
        labels += ["non-causal", "causal"]
    if "bars" in kinds:
        handles.append(Patch(facecolor="white", edgecolor="gray", hatch="//"))
        labels.append(f"unstable {UNSTABLE_FLAG}")
    H = fig.get_figheight()
    ncol = 5
    legend_rows = (len(labels) + ncol - 1) // ncol
    fig.suptitle(f"suite {doc.get('suite')} on {md.get('device_name')} "
                 f"(torch {md.get('torch_version')}, commit {(md.get('git_commit') or '?')[:10]})",
                 fontsize=10, y=1 - 0.12 / H)
    fig.legend(handles, labels, loc="upper center", ncol=ncol, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.35 / H))
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.45 + 0.2 * legend_rows) / H))
    return fig


def _ok(ent: Dict[str, Any], name: str, field: str) -> bool:
    r = ent["impls"].get(name, {})
    return r.get("status") == "ok" and r.get(field) is not None


def _plot_lines(ax, ents, names, colors, ph) -> set:
    xname = ents[0]["config"].get("x", "L")
    shown = set()
    for n in names:
        for causal, ls in ((False, "-"), (True, "--")):
            pts = sorted((e["config"][xname], e["impls"][n][f"tflops_{ph}"]) for e in ents
                         if e["config"]["causal"] == causal and _ok(e, n, f"tflops_{ph}"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker="o", ms=3,
                        color=colors[n], label=f"{n}{' causal' if causal else ''}")
                shown.add(n)
    ax.set_xlabel({"L": "sequence length L", "E": "head dim E"}.get(xname, xname))
    ax.set_ylabel("TFLOP/s")
    ax.set_xscale("log", base=2)
    return shown


def _plot_bars(ax, ents, names, colors, ph) -> set:
    drawn = [n for n in names if any(_ok(e, n, f"{ph}_ms") for e in ents)]
    width = min(0.25, 0.8 / max(1, len(drawn)))
    times = []
    for j, n in enumerate(drawn):
        for i, e in enumerate(ents):
            if not _ok(e, n, f"{ph}_ms"):
                continue
            r = e["impls"][n]
            ms = r[f"{ph}_ms"]
            lo, hi = r.get(f"{ph}_ms_p20", ms), r.get(f"{ph}_ms_p80", ms)
            ax.bar(i + (j - (len(drawn) - 1) / 2) * width, ms, width, color=colors[n],
                   yerr=[[max(0.0, ms - lo)], [max(0.0, hi - ms)]], capsize=2,
                   hatch="//" if r.get("unstable") else None, edgecolor="white")
            times.append(ms)
    ax.set_xticks(range(len(ents)))
    ax.set_xticklabels([e["key"] for e in ents], fontsize=7)
    ax.set_ylabel("time ms (median, p20-p80)")
    if times and min(times) > 0 and max(times) / min(times) > 30:
        ax.set_yscale("log")
    return set(drawn)
