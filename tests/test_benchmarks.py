"""The benchmark harness on CPU with the tiny suite: JSON structure, tables, plot. No timing checks."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.harness import reference_grads, run_suite, time_fn  # noqa: E402
from benchmarks.implementations import IMPL_NAMES, Impl, make_impls, naive_attention  # noqa: E402
from benchmarks.suites import SUITES, Config, flops_fwd, get_suite  # noqa: E402

IMPL_FIELDS = {"fwd_ms", "bwd_ms", "fwdbwd_ms", "tflops_fwd", "tflops_bwd", "tflops_fwdbwd", "mem_mb",
               "mem_fwd_mb", "err_out", "err_dq", "err_dk", "err_dv", "fwd_ms_p20", "fwd_ms_p80", "timer"}


@pytest.fixture(scope="module")
def tiny_doc():
    return run_suite(get_suite("tiny", "cpu"), "cpu", time_budget_s=None, progress=False, suite="tiny")


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


def test_failing_impl_is_recorded_and_run_continues():
    def boom(q, k, v, causal):
        raise RuntimeError("kaboom")

    impls = make_impls("cpu", ["flashv100", "naive"])
    impls.insert(1, Impl("broken", boom, "always fails"))
    doc = run_suite(get_suite("tiny", "cpu"), "cpu", impls=impls, time_budget_s=None, progress=False)
    for ent in doc["results"]:
        assert ent["impls"]["broken"]["status"] == "error"
        assert "kaboom" in ent["impls"]["broken"]["error"]
        assert ent["impls"]["naive"]["status"] == "ok"
    assert "kaboom" in report.markdown(doc)


def test_exhausted_budget_skips_remaining():
    doc = run_suite(get_suite("tiny", "cpu"), "cpu", impl_names=["naive"], time_budget_s=0.0, progress=False)
    statuses = [e["impls"]["naive"]["status"] for e in doc["results"]]
    assert "skipped" in statuses


def test_script_runs(tmp_path):
    js, png = tmp_path / "t.json", tmp_path / "t.png"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_attention.py"), "--suite", "tiny",
                        "--device", "cpu", "--impls", "flashv100,naive", "--json", str(js), "--plot", str(png),
                        "--no-progress"], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
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
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(js.read_text())
    assert doc["runs"][0]["mode"] == "eager" and len(doc["runs"][0]["losses"]) == 2
    assert "losses match: yes" in r.stdout
