"""``python -m torch_flash_v100`` on CPU: help, info, the demo, bench, explain. No timing checks,
and no time limits: what the commands print does not depend on the machine's speed or load."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd=None):
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a GPU machine
    r = subprocess.run([sys.executable, "-m", "torch_flash_v100", *args], capture_output=True, text=True,
                       cwd=str(cwd or ROOT), env=env)
    return r


def has_hf_backend():
    """Whether the transformers backend can register here (transformers 5 on a torch it runs on)."""
    try:
        from torch_flash_v100.integrations import transformers as backend

        backend.register()
        return True
    except ImportError:
        return False


NEEDS_HF_BACKEND = pytest.mark.skipif(not has_hf_backend(),
                                      reason="the transformers backend cannot register here")


def has_compile():
    try:
        import torch_flash_v100.compile as c
        return hasattr(c, "backend")
    except Exception:
        return False


def test_help():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    for cmd in ("demo", "bench", "info", "explain", "e2e", "hf"):
        assert cmd in r.stdout
    r = run_cli("bench", "--help")
    assert r.returncode == 0 and "--suite" in r.stdout and "--json" in r.stdout and "--plot" in r.stdout


def test_version():
    import torch_flash_v100

    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == torch_flash_v100.__version__


def test_info():
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    assert "kernel path: cpu" in r.stdout
    assert "torch_version" in r.stdout and "SDPA backends" in r.stdout
    import torch_flash_v100

    build = torch_flash_v100.build_info()
    expected = "CUDA kernels: built for sm_" if build["cuda"] else "CUDA kernels: not built"
    assert expected in r.stdout


def test_demo_cpu():
    args = ["demo", "--device", "cpu"] + ([] if has_compile() else ["--no-compile"])
    r = run_cli(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "kernel path: cpu" in out
    assert "accuracy" in out and "flashv100" in out and "SDPA" in out
    assert "speed and memory" in out and "naive" in out
    assert "error:" not in out
    if has_compile():
        assert "attention sites fused by the pass: 2 of 2" in out


def test_no_args_runs_demo():
    from torch_flash_v100 import cli

    p = cli.build_parser()
    assert p.parse_args([]).command is None


def test_bench_tiny(tmp_path):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    r = run_cli("bench", "--suite", "tiny", "--device", "cpu", "--json", str(js), "--plot", str(png),
                "--no-progress", "--repetitions", "2")
    assert r.returncode == 0, r.stderr
    assert "| config | impl |" in r.stdout
    doc = json.loads(js.read_text())
    assert doc["suite"] == "tiny" and doc["metadata"]["device"] == "cpu"
    assert all(e["impls"]["flashv100"]["status"] == "ok" for e in doc["results"])
    pytest.importorskip("matplotlib")
    assert png.exists() and png.stat().st_size > 1000


@pytest.mark.skipif(not has_compile(), reason="torch_flash_v100.compile not available yet")
def test_explain():
    r = run_cli("explain", "--device", "cpu", "--inference")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gpt2-style" in r.stdout and "fused attention sites" in r.stdout


# Runs the CLI in-process, then lists the modules that came from the source tree's benchmarks/.
IMPORTS_FROM_BENCHMARKS = """
import sys
from pathlib import Path

from torch_flash_v100 import cli

folder = Path(sys.argv[1]).resolve() / "benchmarks"
rc = cli.main(sys.argv[2:])
found = sorted(name for name, module in list(sys.modules.items())
               if name.split(".")[0] == "benchmarks"
               or folder in Path(getattr(module, "__file__", None) or "/").resolve().parents)
print("imported from benchmarks/:", found)
sys.exit(rc or bool(found))
"""


@pytest.mark.parametrize("args", [
    ["bench", "--suite", "tiny", "--device", "cpu", "--impls", "flashv100,naive",
     "--repetitions", "1", "--no-progress"],
    ["e2e", "--device", "cpu", "--modes", "eager", "--layers", "1", "--d-model", "32",
     "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "2", "--check-steps", "1"],
    pytest.param(["hf", "--device", "cpu", "--models", "tiny", "--implementations",
                  "flashv100,eager", "--layouts", "packed", "--steps", "1", "--warmup", "0",
                  "--new-tokens", "2", "--gen-reps", "1"], marks=NEEDS_HF_BACKEND),
], ids=["bench", "e2e", "hf"])
def test_cli_imports_nothing_from_the_benchmarks_folder(args, tmp_path):
    """bench and e2e must work from a wheel, which has no benchmarks/ folder (scripts/wheel_smoke.sh
    runs them from one in CI)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", IMPORTS_FROM_BENCHMARKS, str(ROOT), *args],
                       capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "imported from benchmarks/: []" in r.stdout


def test_package_never_edits_sys_path():
    """The package finds its parts by import, never through the source tree's layout."""
    package = ROOT / "torch_flash_v100"
    offenders = [str(f.relative_to(ROOT)) for f in package.rglob("*.py")
                 if "sys.path" in f.read_text() or "import benchmarks" in f.read_text()
                 or "from benchmarks" in f.read_text()]
    assert offenders == []


@NEEDS_HF_BACKEND
def test_hf_benchmark_rows(tmp_path):
    """Every (model, layout, implementation) row is measured, and in fp32 on CPU greedy generation
    with our backend picks the same tokens as eager attention."""
    js = tmp_path / "hf.json"
    r = run_cli("hf", "--device", "cpu", "--models", "tiny", "--steps", "1", "--warmup", "0",
                "--batch", "2", "--seq", "24", "--new-tokens", "3", "--gen-reps", "1",
                "--json", str(js))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(js.read_text())
    assert {(t["layout"], t["implementation"]) for t in doc["train"]} == {
        (layout, impl) for layout in ("padded", "packed") for impl in ("flashv100", "sdpa", "eager")}
    assert all(t["tokens_per_s"] > 0 for t in doc["train"])
    tokens = {g["implementation"]: g["tokens"] for g in doc["generate"]}
    assert tokens["flashv100"] == tokens["eager"] == tokens["sdpa"]
    assert "| tiny | packed | flashv100 |" in r.stdout
