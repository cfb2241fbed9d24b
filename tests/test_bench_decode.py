"""The decode benchmark's plumbing on the CPU (tiny configurations, one repetition): every
implementation gives a row, the flashv100 ones time their step, the document round-trips through
JSON and Markdown. No timing assertions."""

import json

import torch

from torch_flash_v100.bench import decode
from torch_flash_v100.bench.cli import main as bench_main


def test_decode_rows_and_report(tmp_path):
    configs = decode.decode_configs("cpu")[:3]
    doc = decode.run_decode(configs, "cpu", reps=1, hbm_copy_bytes=1 << 20)
    assert doc["metadata"]["hbm_copy_gbps"] > 0
    assert len(doc["results"]) == len(configs) * len(decode.DECODE_IMPLS)
    by_impl = {}
    for row in doc["results"]:
        by_impl.setdefault(row["impl"], []).append(row)
        assert row["status"] in ("ok", "skipped", "error")
        if row["status"] == "ok":
            assert row["time_us"] > 0 and row["gbps"] > 0 and row["hbm_fraction"] > 0
            assert row["bytes_read"] >= decode.DecodeConfig(**row["config"]).kv_bytes()
    for name in ("flashv100", "flashv100-trusted", "flashv100-paged", "flashv100-paged-trusted",
                 "naive"):
        assert all(r["status"] == "ok" for r in by_impl[name]), by_impl[name]
    path = decode.write(doc, tmp_path / "decode.json")
    assert json.loads(path.read_text())["metadata"]["suite"] == "decode"
    assert "| B1 H4/2 S64 D16 fp32 | flashv100 |" in path.with_suffix(".md").read_text()


def test_decode_configs_cover_the_issue_grid():
    configs = decode.decode_configs("cuda")
    assert {c.B for c in configs} == {1, 8, 32, 128}
    assert {(c.Hq, c.Hkv) for c in configs} == {(32, 8), (32, 32)}
    assert min(c.S for c in configs) == 1024 and max(c.S for c in configs) == 131072
    assert {c.D for c in configs} == {128} and {c.dtype for c in configs} == {"fp16"}


def test_decode_skips_what_exceeds_the_memory_cap():
    cfg = decode.DecodeConfig(1, 4, 2, 256, 16, 16, "fp32")
    doc = decode.run_decode([cfg], "cpu", reps=1, max_kv_bytes=1000, hbm_copy_bytes=1 << 16)
    assert all(r["status"] == "skipped" for r in doc["results"])


def test_bench_cli_runs_the_decode_suite(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(decode, "decode_configs",
                        lambda device: [decode.DecodeConfig(1, 2, 1, 32, 16, 16, "fp32")])
    out = tmp_path / "d.json"
    assert bench_main(["--suite", "decode", "--device", "cpu", "--repetitions", "1",
                       "--no-progress", "--json", str(out), "--impls", "flashv100,naive"]) == 0
    assert "flashv100" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["results"]) == 2


def test_side_by_side_timing_isolates_a_failing_implementation():
    """Implementations sharing a cache are timed in rounds; one that raises gets its error and the
    others their times, each from every round."""
    calls = {"good": 0, "bad": 0}

    def good():
        calls["good"] += 1

    def bad():
        calls["bad"] += 1
        raise RuntimeError("kernel refused")

    times = decode._time_side_by_side({"good": good, "bad": bad}, torch.device("cpu"), 3, None)
    assert isinstance(times["bad"], RuntimeError) and "refused" in str(times["bad"])
    assert isinstance(times["good"], float) and times["good"] >= 0
    assert calls == {"good": 1 + 3, "bad": 1}  # one warm-up each, then 3 rounds of the survivor
