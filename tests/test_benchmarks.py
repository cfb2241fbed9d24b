"""The benchmark harness on CPU with the tiny and masks suites: JSON structure, tables, plot,
masks and dropout. No timing checks, and nothing depends on the machine's speed or load: every
suite runs with a fixed number of repetitions."""
import argparse
import copy
import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torch_flash_v100.bench import harness, report
from torch_flash_v100.bench.harness import (UNSTABLE_SPREAD, make_attn_mask, padding_lengths,
                                            reference_grads, run_suite, time_fn, unstable_reasons)
from torch_flash_v100.bench.implementations import (IMPL_NAMES, Impl, Unsupported, make_impls,
                                                    naive_attention)
from torch_flash_v100.bench.suites import SUITES, Config, flops_fwd, get_suite
from torch_flash_v100.reference import reference_attention

# Python harness code, several minutes of CPU runs: CI runs it on one torch.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

IMPL_FIELDS = {"fwd_ms", "bwd_ms", "fwdbwd_ms", "tflops_fwd", "tflops_bwd", "tflops_fwdbwd", "mem_mb",
               "mem_fwd_mb", "err_out", "err_dq", "err_dk", "err_dv", "fwd_ms_p20", "fwd_ms_p80", "timer"}


@pytest.fixture(scope="module")
def tiny_doc():
    return run_suite(get_suite("tiny", "cpu"), "cpu", repetitions=3, progress=False, suite="tiny")


def test_suites_match_the_issue():
    seed = get_suite("seed", "cuda")
    assert len(seed) == 34 and sum(c.causal for c in seed) == 17
    keys = {(c.B, c.H, c.L, c.S, c.E) for c in seed}
    for n in (16, 32, 64, 128, 256):
        assert (1, 1, n, n, n) in keys
    for h in (16, 32):
        for d in (16, 32, 64):
            assert (1, h, 1024, 1024, d) in keys
    for k in [(1, 16, 1024, 1024, 128), (1, 32, 2048, 2048, 128), (1, 32, 4096, 4096, 128),
              (1, 16, 1024, 1024, 256), (1, 32, 2048, 2048, 256), (1, 32, 4096, 4096, 256)]:
        assert k in keys
    fa2 = get_suite("fa2", "cuda")
    assert len(fa2) == 24
    assert all(c.B * c.L == 16384 and c.H * c.E == 2048 and c.E in (64, 128) for c in fa2)
    assert sorted({c.L for c in fa2}) == [512, 1024, 2048, 4096, 8192, 16384]
    gqa = get_suite("gqa", "cuda")
    assert all(c.H == 32 and c.Hkv == 8 and c.E == 128 for c in gqa)
    assert sorted({c.L for c in gqa}) == [1024, 2048, 4096, 8192]
    assert {"seed", "fa2", "gqa", "quick", "tiny"} <= set(SUITES)
    assert all(c.dtype == "bf16" for c in get_suite("quick", "cpu", "bf16"))


def test_flops_causal_is_half():
    c = Config(2, 4, 4, 128, 256, 64, False)
    assert flops_fwd(c) == 4 * 2 * 4 * 128 * 256 * 64
    assert flops_fwd(Config(2, 4, 4, 128, 256, 64, True)) == flops_fwd(c) / 2


def test_reference_chunks_agree():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 8, generator=g)
    k, v = torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
    do = torch.randn(2, 4, 9, 8, generator=g)
    whole = reference_grads(q, k, v, do, True, mem_limit_bytes=1 << 40)
    chunked = reference_grads(q, k, v, do, True, mem_limit_bytes=1)  # one kv head per chunk
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    out = naive_attention(qd, kd, vd, is_causal=True)
    out.backward(do.double())
    for a, b in zip((out, qd.grad, kd.grad, vd.grad), whole):
        torch.testing.assert_close(a.detach(), b)


def test_time_fn_structure():
    r = time_fn(lambda: torch.ones(8).sum(), torch.device("cpu"), 0.01)
    assert set(r) >= {"ms", "p20", "p80", "reps", "timer"} and r["reps"] >= 1


def test_time_fn_fixed_repetitions():
    calls = {"fn": 0, "setup": 0}

    def fn():
        calls["fn"] += 1

    def setup():
        calls["setup"] += 1

    r = time_fn(fn, torch.device("cpu"), reps=7, setup=setup)
    assert r["reps"] == 7 and r["timer"] == "perf_counter"
    assert calls == {"fn": 8, "setup": 8}  # one warm-up, then exactly 7 timed
    assert 0 <= r["p20"] <= r["ms"] <= r["p80"]
    with pytest.raises(ValueError, match="exactly one"):
        time_fn(fn, torch.device("cpu"), 0.01, reps=3)
    with pytest.raises(ValueError, match="exactly one"):
        time_fn(fn, torch.device("cpu"))


def test_fixed_repetitions_measure_everything():
    """The suites the tests run: every measurement runs its fixed count of repetitions."""
    doc = run_suite(get_suite("tiny", "cpu"), "cpu", impl_names=["flashv100", "naive"],
                    repetitions=2, progress=False)
    assert doc["metadata"]["repetitions"] == 2 and doc["metadata"]["time_budget_s"] is None
    for ent in doc["results"]:
        for r in ent["impls"].values():
            assert r["status"] == "ok" and r["fwd_reps"] == r["bwd_reps"] == r["fwdbwd_reps"] == 2
    with pytest.raises(ValueError, match="not both"):
        run_suite(get_suite("tiny", "cpu"), "cpu", repetitions=2, time_budget_s=1.0, progress=False)


def test_json_structure(tiny_doc, tmp_path):
    path = report.write_json(tiny_doc, tmp_path / "r" / "tiny.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "torch_flash_v100.bench/1" and doc["suite"] == "tiny"
    md = doc["metadata"]
    for key in ("date", "git_commit", "device", "device_name", "compute_capability", "torch_version",
                "cuda_version", "torch_flash_v100", "method", "elapsed_s"):
        assert key in md, key
    names = [i["name"] for i in doc["implementations"]]
    assert names == IMPL_NAMES
    for i in doc["implementations"]:
        assert i["available"] == (i["skip_reason"] is None)
    # on CPU: no Volta path, and the CUDA-only SDPA backends are skipped with a reason
    unavailable = {i["name"]: i["skip_reason"] for i in doc["implementations"] if not i["available"]}
    assert {"flashv100-volta", "sdpa-efficient", "sdpa-cudnn"} <= set(unavailable)
    assert all(unavailable.values())
    assert len(doc["results"]) == len(get_suite("tiny", "cpu"))
    for ent in doc["results"]:
        assert set(ent["config"]) >= {"B", "H", "Hkv", "L", "S", "E", "causal", "dtype"}
        assert ent["config"]["dtype"] == "fp32"
        assert set(ent["impls"]) == set(names)
        for name in ("flashv100", "sdpa-math", "naive", "naive-fp32softmax"):
            r = ent["impls"][name]
            assert r["status"] == "ok", r
            assert IMPL_FIELDS <= set(r)
            for e in ("err_out", "err_dq", "err_dk", "err_dv"):
                assert 0 <= r[e] < 1e-4, (name, e, r[e])  # fp32 vs fp64
        for name in unavailable:
            assert ent["impls"][name]["status"] == "skipped"
        assert set(ent["speedup"]) >= {"sdpa-math", "naive", "naive-fp32softmax"}
        assert set(ent["speedup"]["naive"]) == {"fwd", "bwd", "fwdbwd"}


def test_markdown_tables(tiny_doc):
    text = report.markdown(tiny_doc)
    assert "| config | flashv100 fwd ms |" in text
    assert "| config | impl | fwd ms | bwd ms | fwd+bwd ms |" in text
    for ent in tiny_doc["results"]:
        assert ent["key"] in text
    assert "Not available on this device" in text and "sdpa-cudnn" in text


def test_plot_written(tiny_doc, tmp_path):
    pytest.importorskip("matplotlib")
    p = report.write_plot(tiny_doc, tmp_path / "tiny.png")
    assert p is not None and p.stat().st_size > 1000
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _sweep_doc(tiny_doc, lengths):
    """tiny_doc's first configuration repeated over ``lengths`` in one plot group."""
    ent = tiny_doc["results"][0]
    results = []
    for n in lengths:
        e = copy.deepcopy(ent)
        e["config"].update(L=n, S=n, group="sweep")
        e["key"] = f"{ent['key']} L={n}"
        results.append(e)
    return dict(tiny_doc, results=results)


def test_small_groups_plot_times_as_bars_sweeps_plot_tflops(tiny_doc):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    assert {report.plot_kind([e]) for e in tiny_doc["results"]} == {"bars"}
    fig = report.build_figure(tiny_doc)
    assert all("ms" in ax.get_ylabel() for ax in fig.axes)
    assert all(ax.patches for ax in fig.axes)  # bars drawn in every panel
    plt.close(fig)
    sweep = _sweep_doc(tiny_doc, [32, 64, 128])
    assert report.plot_kind(sweep["results"]) == "lines"
    assert report.plot_kind(_sweep_doc(tiny_doc, [32, 64])["results"]) == "bars"
    fig = report.build_figure(sweep)
    assert all(ax.get_ylabel() == "TFLOP/s" and ax.get_lines() for ax in fig.axes)
    plt.close(fig)


def test_unstable_reasons():
    stable = {"fwd_ms": 1.0, "fwd_ms_p20": 0.9, "fwd_ms_p80": 1.2, "bwd_ms": 2.0, "bwd_ms_p20": 1.9,
              "bwd_ms_p80": 2.1, "fwdbwd_ms": 3.0, "fwdbwd_ms_p20": 2.9, "fwdbwd_ms_p80": 3.1}
    assert unstable_reasons(stable) == []
    spread = dict(stable, bwd_ms_p80=2.1 * 1.9)
    assert unstable_reasons(spread) == [f"bwd p20-p80 spread {2.1:.1f}x"]
    inverted = dict(stable, fwdbwd_ms=0.5, fwdbwd_ms_p20=0.45, fwdbwd_ms_p80=0.55)
    reasons = unstable_reasons(inverted)
    assert len(reasons) == 2 and all("fwd+bwd" in r and "faster than" in r for r in reasons)
    assert UNSTABLE_SPREAD == 2.0


def test_unstable_rows_are_flagged(tiny_doc, tmp_path):
    for ent in tiny_doc["results"]:  # every measurement says whether it is stable
        assert all(isinstance(r["unstable"], list) for r in ent["impls"].values()
                   if r["status"] == "ok")
    doc = copy.deepcopy(tiny_doc)
    for ent in doc["results"]:
        for r in ent["impls"].values():
            if r["status"] == "ok":
                r["unstable"] = []
    text = report.markdown(doc)
    assert "[!] |" not in text and "#### Unstable measurements" not in text
    ent = doc["results"][0]
    naive = ent["impls"]["naive"]
    naive.update(fwd_ms=1.0, fwd_ms_p20=0.9, fwd_ms_p80=2.7, bwd_ms=2.0, bwd_ms_p20=1.9,
                 bwd_ms_p80=2.1, fwdbwd_ms=1.5, fwdbwd_ms_p20=1.4, fwdbwd_ms_p80=1.6)
    naive["unstable"] = unstable_reasons(naive)
    assert len(naive["unstable"]) == 2  # the fwd spread; fwd+bwd faster than bwd
    text = report.markdown(doc)
    assert f"| {ent['key']} | naive [!] |" in text  # detail table
    assert f"{ent['speedup']['naive']['fwdbwd']:.2f}x [!]" in text  # summary: speedup over naive
    assert "#### Unstable measurements [!]" in text
    reasons = "fwd p20-p80 spread 3.0x; fwd+bwd (1.5 ms) faster than bwd alone"
    assert f"- {ent['key']} / naive: {reasons}" in text
    saved = json.loads(report.write_json(doc, tmp_path / "u.json").read_text())
    assert saved["results"][0]["impls"]["naive"]["unstable"] == naive["unstable"]


def test_failing_impl_is_recorded_and_run_continues():
    def boom(q, k, v, causal, attn_mask=None, dropout_p=0.0):
        raise RuntimeError("kaboom")

    impls = make_impls("cpu", ["flashv100", "naive"])
    impls.insert(1, Impl("broken", boom, "always fails"))
    doc = run_suite(get_suite("tiny", "cpu"), "cpu", impls=impls, repetitions=2, progress=False)
    for ent in doc["results"]:
        assert ent["impls"]["broken"]["status"] == "error"
        assert "kaboom" in ent["impls"]["broken"]["error"]
        assert ent["impls"]["naive"]["status"] == "ok"
    assert "kaboom" in report.markdown(doc)


def test_exhausted_budget_skips_remaining():
    # a zero budget is exhausted from the start, however fast the machine
    doc = run_suite(get_suite("tiny", "cpu"), "cpu", impl_names=["naive"], time_budget_s=0.0, progress=False)
    statuses = [e["impls"]["naive"]["status"] for e in doc["results"]]
    assert "skipped" in statuses


def test_script_runs(tmp_path):
    js, png = tmp_path / "t.json", tmp_path / "t.png"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_attention.py"), "--suite", "tiny",
                        "--device", "cpu", "--impls", "flashv100,naive", "--json", str(js), "--plot", str(png),
                        "--no-progress", "--repetitions", "2"],
                       capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "| config | impl |" in r.stdout
    doc = json.loads(js.read_text())
    assert [i["name"] for i in doc["implementations"]] == ["flashv100", "naive"]
    assert js.with_suffix(".md").exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped" in r.stderr
    else:
        assert png.exists()


def test_e2e_smoke(tmp_path):
    js = tmp_path / "e2e.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_gpt.py"), "--device", "cpu", "--modes", "eager",
                        "--layers", "1", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "2",
                        "--steps", "2", "--check-steps", "1", "--json", str(js)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(js.read_text())
    assert doc["runs"][0]["mode"] == "eager" and len(doc["runs"][0]["losses"]) == 2
    assert "losses match: yes" in r.stdout


# --------------------------------------------------------------------------------------------
# masks and dropout
# --------------------------------------------------------------------------------------------

MASK_IMPLS = ["flashv100", "sdpa-math", "naive"]
# PyTorch's "... not used because" warnings of the refusals these tests provoke on purpose
SDPA_REFUSAL_WARNINGS = pytest.mark.filterwarnings("ignore:.*not used because:UserWarning",
                                                   "ignore:.*do not support:UserWarning")
VARIANTS = ["mask=padding", "dropout=0.1", "mask=padding dropout=0.1"]


@pytest.fixture(scope="module")
def masks_doc():
    return run_suite(get_suite("masks", "cpu"), "cpu", impl_names=MASK_IMPLS, repetitions=2,
                     progress=False, suite="masks")


def test_padding_lengths_spread_and_deterministic():
    pads = padding_lengths(16, 1024)
    assert pads.dtype == torch.int64 and pads.shape == (16,)
    assert int(pads.min()) >= 0 and int(pads.max()) < 256  # at most 25% of S hidden
    assert int(pads.min()) < 1024 // 64 and int(pads.max()) >= 240  # covers the whole 0..25% range
    assert len(set(pads.tolist())) == 16
    assert torch.equal(pads, padding_lengths(16, 1024))


def test_mask_builder_shapes_and_values():
    base = Config(3, 4, 2, 24, 40, 8, False, dtype="fp16")
    assert make_attn_mask(base, "cpu") is None
    keep = make_attn_mask(replace(base, mask="padding"), "cpu")
    assert keep.dtype == torch.bool and keep.shape == (3, 1, 1, 40)
    pads = padding_lengths(3, 40)
    for b in range(3):
        n = 40 - int(pads[b])
        assert keep[b, 0, 0, :n].all() and not keep[b, 0, 0, n:].any()  # the first S - pad_b keys
    add = make_attn_mask(replace(base, mask="padding-additive"), "cpu")
    assert add.dtype == torch.float16 and add.shape == (3, 1, 1, 40)
    assert (add[keep] == 0).all() and torch.isneginf(add[~keep]).all()
    full = make_attn_mask(replace(base, mask="full"), "cpu")
    assert full.dtype == torch.bool and full.shape == (3, 4, 24, 40)
    assert full.any(-1).all() and 0.3 < full.float().mean() < 0.7
    assert torch.equal(full, make_attn_mask(replace(base, mask="full"), "cpu"))
    with pytest.raises(ValueError):
        Config(1, 1, 1, 8, 8, 8, False, mask="paddding")
    with pytest.raises(ValueError):
        Config(1, 1, 1, 8, 8, 8, False, dropout=1.0)


def test_variant_keys_and_json():
    plain = Config(1, 2, 2, 32, 32, 16, False, group="tiny")
    assert plain.key() == "B1 H2 L32 E16" and plain.variant() == ""
    assert "mask" not in plain.to_dict() and "dropout" not in plain.to_dict()  # old JSON unchanged
    v = replace(plain, mask="padding", dropout=0.1)
    assert v.key() == "B1 H2 L32 E16 mask=padding dropout=0.1"
    assert replace(plain, dropout=0.1).key() == "B1 H2 L32 E16 dropout=0.1"
    assert v.to_dict()["mask"] == "padding" and v.to_dict()["dropout"] == 0.1
    assert v.plain() == plain
    for name in ("seed", "fa2", "gqa", "quick", "tiny"):
        assert not any(c.variant() for c in get_suite(name, "cuda"))


def test_masks_suite_shapes():
    cfgs = get_suite("masks", "cuda")
    assert len(cfgs) == 16 and not any(c.causal for c in cfgs)
    assert all(c.B * c.L == 16384 and c.H * c.E == 2048 for c in cfgs)
    assert {(c.L, c.E) for c in cfgs} == {(n, e) for n in (1024, 4096) for e in (64, 128)}
    for cfgs_ in (cfgs, get_suite("masks", "cpu")):
        by_shape = {}
        for c in cfgs_:
            by_shape.setdefault(c.plain().key(), []).append(c.variant())
        assert all(sorted(v) == sorted([""] + VARIANTS) for v in by_shape.values())
    assert all(c.L <= 256 for c in get_suite("masks", "cpu"))


def test_cli_accepts_masks_suite():
    from torch_flash_v100.bench.cli import add_arguments
    from torch_flash_v100 import cli

    assert add_arguments(argparse.ArgumentParser()).parse_args(["--suite", "masks"]).suite == "masks"
    args = cli.build_parser().parse_args(["bench", "--suite", "masks", "--impls", "flashv100,naive"])
    assert args.suite == "masks"


def test_reference_applies_masks_in_chunks():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 9, 8, generator=g)
    k, v = torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
    do = torch.randn(2, 4, 9, 8, generator=g)
    for kind in ("padding", "padding-additive", "full"):
        mask = make_attn_mask(Config(2, 4, 2, 9, 11, 8, False, dtype="fp32", mask=kind), "cpu")
        whole = reference_grads(q, k, v, do, False, mem_limit_bytes=1 << 40, attn_mask=mask)
        chunked = reference_grads(q, k, v, do, False, mem_limit_bytes=1, attn_mask=mask)
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        out = reference_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True)
        out.backward(do.double())
        for a, b, c in zip(whole, chunked, (out, qd.grad, kd.grad, vd.grad)):
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(a, c.detach())
        unmasked = reference_grads(q, k, v, do, False)
        assert (whole[0] - unmasked[0]).abs().max() > 1e-2  # the mask did something


@SDPA_REFUSAL_WARNINGS
def test_every_impl_gets_mask_and_dropout():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g) for _ in range(3))
    mask = make_attn_mask(Config(2, 2, 2, 16, 16, 8, False, mask="full"), "cpu")
    ref = reference_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    for im in make_impls("cpu"):
        if not im.available:
            continue
        with im.context():
            torch.testing.assert_close(im.fn(q, k, v, False, mask).double(), ref, atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"{im.name}: {m}")
            try:
                dropped = im.fn(q, k, v, False, mask, 0.5)
            except Unsupported as e:  # CPU flash: "Both fused kernels do not support non-zero dropout"
                assert im.name == "sdpa-flash" and "dropout" in str(e), (im.name, e)
                continue
            assert not torch.allclose(dropped.double(), ref, atol=1e-3), im.name


def test_masks_suite_json_and_overhead_table(masks_doc, tmp_path):
    doc = json.loads(report.write_json(masks_doc, tmp_path / "masks.json").read_text())
    assert [i["name"] for i in doc["implementations"]] == MASK_IMPLS
    results = {e["key"]: e for e in doc["results"]}
    assert len(results) == len(get_suite("masks", "cpu"))
    for e in doc["results"]:
        for name in MASK_IMPLS:
            assert e["impls"][name]["status"] == "ok", (e["key"], name, e["impls"][name])
    shapes = {c.plain().with_dtype("fp32").key() for c in get_suite("masks", "cpu")}
    rows = doc["overhead"]
    assert {(r["shape"], r["variant"], r["impl"]) for r in rows} == {
        (s, v, n) for s in shapes for v in VARIANTS for n in MASK_IMPLS}
    for r in rows:
        variant, plain = results[f"{r['shape']} {r['variant']}"], results[r["shape"]]
        for ph in ("fwd", "bwd", "fwdbwd"):
            expect = variant["impls"][r["impl"]][f"{ph}_ms"] / plain["impls"][r["impl"]][f"{ph}_ms"]
            assert r[ph] == pytest.approx(expect)
        if r["impl"] != "flashv100":  # flashv100 vs this impl in the same variant
            assert r["speedup"] == variant["speedup"][r["impl"]]
    text = report.markdown(masks_doc)
    assert "#### Overhead of masks and dropout" in text
    assert "| shape | variant | impl | fwd | fwd+bwd | f+b vs flashv100 |" in text
    some = rows[0]
    flag = " [!]" if some["unstable"] else ""
    assert (f"| {some['shape']} | {some['variant']} | {some['impl']} | {some['fwd']:.2f}x{flag} |"
            in text)
    assert "flashv100, largest fwd+bwd overhead" in text


def test_no_overhead_without_variants(tiny_doc):
    assert "overhead" not in tiny_doc
    assert "Overhead" not in report.markdown(tiny_doc)


def test_dropout_skips_accuracy_masks_do_not(masks_doc):
    n_dropout = 0
    for e in masks_doc["results"]:
        dropout = e["config"].get("dropout", 0.0) > 0
        n_dropout += dropout
        assert ("reference" in e) == dropout and ("reference_s" in e) != dropout
        for name in MASK_IMPLS:
            r = e["impls"][name]
            assert r["status"] == "ok"
            errs = [r[f] for f in ("err_out", "err_dq", "err_dk", "err_dv")]
            if dropout:
                assert errs == [None] * 4 and r["accuracy"].startswith("not applicable")
            else:
                assert "accuracy" not in r
                assert all(0 <= x < 1e-4 for x in errs), (e["key"], name, errs)  # masked fp64 reference
    assert n_dropout == 4
    assert "| n/a | n/a | n/a | n/a |" in report.detail_markdown(masks_doc)


def test_impl_ignoring_the_mask_shows_in_errors():
    naive = make_impls("cpu", ["naive"])[0]
    deaf = Impl("deaf", lambda q, k, v, causal, attn_mask=None, dropout_p=0.0: naive.fn(q, k, v, causal),
                "naive without the mask")
    cfg = Config(2, 2, 2, 32, 32, 16, False, mask="padding")
    doc = run_suite([cfg], "cpu", impls=[naive, deaf], repetitions=2, progress=False)
    r = doc["results"][0]["impls"]
    assert r["naive"]["err_out"] < 1e-4 and r["deaf"]["err_out"] > 1e-2


@SDPA_REFUSAL_WARNINGS
def test_refused_mask_or_dropout_is_unsupported_not_a_crash():
    # PyTorch's CPU flash kernel refuses dropout; GQA so that the native-GQA fallback is exercised
    impls = make_impls("cpu", ["flashv100", "sdpa-flash"])
    plain = Config(2, 4, 2, 24, 40, 8, False)
    cfgs = [plain, replace(plain, mask="padding-additive", dropout=0.1), replace(plain, mask="padding-additive")]
    doc = run_suite(cfgs, "cpu", impls=impls, repetitions=2, progress=False)
    ok, refused, after = (e["impls"]["sdpa-flash"] for e in doc["results"])
    assert refused["status"] == "unsupported" and "dropout" in refused["reason"], refused
    assert "Triggered internally" not in refused["reason"]
    assert ok["status"] == after["status"] == "ok"  # a refusal does not disable the backend
    assert all(e["impls"]["flashv100"]["status"] == "ok" for e in doc["results"])
    text = report.markdown(doc)
    assert "sdpa-flash: unsupported: No available kernel" in text
    assert [r.get("status") for r in doc["overhead"] if r["impl"] == "sdpa-flash"] == ["unsupported", None]


def test_commit_from_environment_wins_over_git(monkeypatch):
    """A copied tree names its commit with FLASHV100_COMMIT: stale git metadata must not win."""
    from torch_flash_v100.bench.harness import collect_metadata
    monkeypatch.setenv("FLASHV100_COMMIT", "0123456789abcdef")
    md = collect_metadata(torch.device("cpu"))
    assert md["git_commit"] == "0123456789abcdef" and md["git_dirty"] is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_bench_builds_against_the_kernels(tmp_path):
    """benchmarks/kernel_bench.cu instantiates every kernel variant directly: it must keep
    compiling as the kernels change (it runs only on a GPU)."""
    binary = tmp_path / "kernel_bench"
    build = subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_80", "--expt-relaxed-constexpr",
                            f"-I{ROOT / 'csrc'}", "-o", str(binary),
                            str(ROOT / "benchmarks" / "kernel_bench.cu")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    assert binary.exists()


def test_first_call_clock_starts_after_the_device_is_synchronized(monkeypatch):
    """On a GPU the fp64 reference is still queued when a shape's first implementation starts;
    a clock started before the synchronize timed it too, and the estimate then allowed one cold
    repetition of each phase. Checked by the order of the calls, not by time."""
    events = []
    sync = harness.synchronize
    monkeypatch.setattr(harness, "synchronize", lambda d: (events.append("sync"), sync(d))[1])
    monkeypatch.setattr(harness, "time", SimpleNamespace(
        perf_counter=lambda: (events.append("clock"), time.perf_counter())[1]))
    cfg = get_suite("tiny", "cpu")[0].with_dtype("fp32")
    impl = make_impls("cpu", ["flashv100"])[0]
    r = harness.measure(impl, cfg, harness._make_inputs(cfg, torch.device("cpu")), None,
                        torch.device("cpu"), reps=2)
    assert events[:2] == ["sync", "clock"], events
    assert r["first_fwdbwd_ms"] > 0


def _logging_impl(name, log):
    """naive attention that records each call's implementation name in `log`."""
    naive = make_impls("cpu", ["naive"])[0]

    def fn(q, k, v, causal, attn_mask=None, dropout_p=0.0):
        log.append(name)
        return naive.fn(q, k, v, causal, attn_mask, dropout_p)
    return Impl(name, fn, "naive, logged")


def test_rounds_measure_implementations_in_turn_and_combine_medians():
    log = []
    impls = [_logging_impl("a", log), _logging_impl("b", log)]
    cfg = Config(1, 2, 2, 16, 16, 8, False)
    doc = run_suite([cfg], "cpu", impls=impls, repetitions=2, rounds=3, progress=False)
    runs = [name for i, name in enumerate(log) if i == 0 or log[i - 1] != name]
    assert runs == ["a", "b"] * 3  # in turn, not each implementation's rounds back to back
    assert doc["metadata"]["rounds"] == 3
    assert "3 rounds" in report.markdown(doc)
    for name in ("a", "b"):
        r = doc["results"][0]["impls"][name]
        assert r["status"] == "ok" and r["unstable"] is not None
        for ph in ("fwd", "bwd", "fwdbwd"):
            rounds = r[f"{ph}_ms_rounds"]
            assert len(rounds) == 3 and r[f"{ph}_ms"] == sorted(rounds)[1]
            assert r[f"{ph}_reps"] == 6
            ratio = {"fwd": 1.0, "bwd": 2.5}.get(ph, 3.5)
            assert r[f"tflops_{ph}"] == pytest.approx(
                flops_fwd(cfg) * ratio / (r[f"{ph}_ms"] * 1e-3) / 1e12)


def test_combine_rounds_reports_failures_and_leaves_out_skipped_rounds():
    cfg = Config(1, 1, 1, 16, 16, 8, False)

    def ok(ms):
        return {"status": "ok", "fwd_ms": ms, "fwd_ms_p20": ms * 0.9, "fwd_ms_p80": ms * 1.1,
                "fwd_reps": 5, "err_out": ms}
    skipped = {"status": "skipped", "reason": "suite time budget of 1s exhausted"}
    error = {"status": "error", "error": "boom"}
    both = harness.combine_rounds(cfg, [ok(2.0), skipped, ok(4.0)])
    assert both["fwd_ms"] == 3.0 and both["fwd_ms_rounds"] == [2.0, 4.0]
    assert both["fwd_reps"] == 10 and both["err_out"] == 2.0  # accuracy of the first round
    assert both["fwd_ms_p20"] == pytest.approx(2.7) and "bwd_ms" not in both
    assert harness.combine_rounds(cfg, [ok(2.0), error, ok(4.0)]) == error
    assert harness.combine_rounds(cfg, [skipped, skipped]) == skipped
    assert harness.combine_rounds(cfg, [ok(2.0)]) == ok(2.0)
    with pytest.raises(ValueError, match="rounds"):
        run_suite([cfg], "cpu", impl_names=["naive"], repetitions=1, rounds=0, progress=False)


def test_rounds_argument_is_checked(capsys):
    from torch_flash_v100.bench.cli import main as bench_main
    assert bench_main(["--suite", "tiny", "--device", "cpu", "--rounds", "0"]) == 2
    assert bench_main(["--suite", "decode", "--device", "cpu", "--rounds", "2"]) == 2
    assert "--rounds" in capsys.readouterr().err
