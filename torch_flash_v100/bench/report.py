"""Markdown tables, JSON and the PNG plot of a benchmark result document."""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional

from .implementations import FLASH

__all__ = ["markdown", "summary_markdown", "detail_markdown", "overhead_markdown", "write_json", "write_plot",
           "header_markdown"]


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
                 "errors = max abs vs fp64 reference (n/a with dropout: random outputs)")
    return "\n".join(lines)


def summary_markdown(doc: Dict[str, Any]) -> str:
    """One row per configuration: flashv100 numbers and its fwd+bwd speedup vs every other impl."""
    impls = [i["name"] for i in doc.get("implementations", []) if i["name"] != FLASH and i.get("available")]
    head = ["config", "flashv100 fwd ms", "fwd+bwd ms", "TF/s f+b", "mem MB"] + [f"vs {n}" for n in impls]
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for ent in doc.get("results", []):
        fl = ent["impls"].get(FLASH, {})
        if fl.get("status") == "ok":
            cells = [_f(fl.get("fwd_ms"), 3), _f(fl.get("fwdbwd_ms"), 3), _f(fl.get("tflops_fwdbwd")),
                     _f(fl.get("mem_mb"), 1)]
        else:
            cells = [fl.get("status", "-"), "-", "-", "-"]
        for n in impls:
            sp = ent.get("speedup", {}).get(n, {}).get("fwdbwd")
            if sp is not None:
                cells.append(f"{sp:.2f}x")
            else:
                cells.append(ent["impls"].get(n, {}).get("status", "-"))
        rows.append("| " + " | ".join([ent["key"]] + cells) + " |")
    return "\n".join(rows)


def detail_markdown(doc: Dict[str, Any]) -> str:
    head = ["config", "impl", "fwd ms", "bwd ms", "fwd+bwd ms", "TF/s fwd", "TF/s f+b", "mem MB",
            "mem fwd MB", "speedup f+b", "err out", "err dq", "err dk", "err dv"]
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    notes: List[str] = []
    for ent in doc.get("results", []):
        for name, r in ent["impls"].items():
            if r.get("status") == "ok":
                sp = ent.get("speedup", {}).get(name, {}).get("fwdbwd")
                cells = [_f(r.get("fwd_ms"), 3), _f(r.get("bwd_ms"), 3), _f(r.get("fwdbwd_ms"), 3),
                         _f(r.get("tflops_fwd")), _f(r.get("tflops_fwdbwd")), _f(r.get("mem_mb"), 1),
                         _f(r.get("mem_fwd_mb"), 1), "ref" if name == FLASH else (f"{sp:.2f}x" if sp else "-")]
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
            rows.append("| " + " | ".join([ent["key"], name] + cells) + " |")
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
            cells = [_x(r.get("fwd")), _x(r.get("fwdbwd")), vs]
            if r["impl"] == FLASH and r.get("fwdbwd") is not None:
                worst[r["variant"]] = max(worst.get(r["variant"], 0.0), r["fwdbwd"])
        rows.append("| " + " | ".join([r["shape"], r["variant"], r["impl"]] + cells) + " |")
    out = "\n".join(rows)
    if worst:
        out += ("\n\nflashv100, largest fwd+bwd overhead over the shapes: "
                + "; ".join(f"{v} {_x(x)}" for v, x in worst.items()))
    return out


def markdown(doc: Dict[str, Any]) -> str:
    parts = [header_markdown(doc), "#### Summary (fwd+bwd speedup of flashv100)", summary_markdown(doc)]
    overhead = overhead_markdown(doc)
    if overhead:
        parts += ["#### Overhead of masks and dropout (time(variant) / time(plain), same implementation; "
                  "f+b vs flashv100 = time(impl) / time(flashv100) in the same variant)", overhead]
    parts += ["#### All implementations", detail_markdown(doc)]
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


def write_plot(doc: Dict[str, Any], path) -> Optional[Path]:
    """TFLOP/s vs the group's x field (sequence length for most suites) per implementation;
    one row of panels per configuration group, columns forward and forward+backward; causal dashed.
    Returns None (and says why on stderr) when matplotlib is missing."""
    import sys

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"plot skipped: matplotlib unavailable ({e}); pip install 'torch-flash-v100[bench]'",
              file=sys.stderr)
        return None
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
    for row, (g, ents) in enumerate(groups.items()):
        xname = ents[0]["config"].get("x", "L") if ents else "L"
        for col, (ph, title) in enumerate((("fwd", "forward"), ("fwdbwd", "forward + backward"))):
            ax = axes[row][col]
            for n in names:
                for causal, ls in ((False, "-"), (True, "--")):
                    pts = sorted((e["config"][xname], e["impls"][n][f"tflops_{ph}"]) for e in ents
                                 if e["config"]["causal"] == causal and e["impls"].get(n, {}).get("status") == "ok"
                                 and e["impls"][n].get(f"tflops_{ph}") is not None)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker="o", ms=3,
                                color=colors[n], label=f"{n}{' causal' if causal else ''}")
            ax.set_title(f"{g}: {title}", fontsize=9)
            ax.set_xlabel({"L": "sequence length L", "E": "head dim E"}.get(xname, xname))
            ax.set_ylabel("TFLOP/s")
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)

    from matplotlib.lines import Line2D

    shown = [n for n in names if any(ln.get_color() == colors[n] for ax in axes.flat for ln in ax.get_lines())]
    handles = [Line2D([], [], color=colors[n], marker="o", ms=3) for n in shown]
    labels = list(shown)
    handles += [Line2D([], [], color="gray", ls="-"), Line2D([], [], color="gray", ls="--")]
    labels += ["non-causal", "causal"]
    H = fig.get_figheight()
    ncol = 5
    legend_rows = (len(labels) + ncol - 1) // ncol
    fig.suptitle(f"suite {doc.get('suite')} on {md.get('device_name')} "
                 f"(torch {md.get('torch_version')}, commit {(md.get('git_commit') or '?')[:10]})",
                 fontsize=10, y=1 - 0.12 / H)
    fig.legend(handles, labels, loc="upper center", ncol=ncol, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.35 / H))
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.45 + 0.2 * legend_rows) / H))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
