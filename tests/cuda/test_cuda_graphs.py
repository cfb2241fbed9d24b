"""A training step (forward + backward) captured in one CUDA graph, as graph-captured training
loops and the benchmark's graph-replayed fwd+bwd run it."""
from __future__ import annotations

import pytest
import torch

import torch_flash_v100 as tfv
from attention_testing import make_qkv
from torch_flash_v100._measure import cuda_graph_replay
from torch_flash_v100.bench.harness import run_suite
from torch_flash_v100.bench.suites import get_suite

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.cuda]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padding"])
def test_fwd_bwd_replayed_from_a_graph_matches_eager_on_new_inputs(atom, dtype, causal, masked):
    B, H, L, E = 2, 3, 70, 64
    q, k, v = make_qkv(B, H, H, L, L, E, dtype, "cuda", requires_grad=True)
    dout = torch.randn(B, H, L, E, device="cuda", dtype=dtype)
    mask = None
    if masked:  # left padding of batch element 1 (causal: its first 11 rows see no key at all)
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device="cuda")
        mask[1, ..., :11] = False
    captured = {}

    def step():
        out = tfv.attention(q, k, v, attn_mask=mask, is_causal=causal)
        captured["out"] = out
        captured["grads"] = torch.autograd.grad(out, (q, k, v), dout)

    replay = cuda_graph_replay(step)
    for seed in (1, 2):  # new values in the captured input buffers, as a training loop copies in
        gen = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=dtype))
        replay()
        torch.cuda.synchronize()
        out = tfv.attention(q, k, v, attn_mask=mask, is_causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        # Same kernels on the same inputs: bitwise, every position (hidden rows included), except
        # dQ, whose accumulation order across key blocks may differ between runs.
        assert torch.equal(captured["out"], out)
        torch.testing.assert_close(captured["grads"][0], grads[0], atol=2e-3, rtol=1e-2)
        assert torch.equal(captured["grads"][1], grads[1])
        assert torch.equal(captured["grads"][2], grads[2])


def test_benchmark_reports_graph_replayed_fwd_bwd_for_every_implementation():
    doc = run_suite(get_suite("tiny", "cuda"), "cuda", repetitions=3, progress=False, suite="tiny")
    timed = 0
    for ent in doc["results"]:
        for name, r in ent["impls"].items():
            if r["status"] != "ok":
                continue
            assert "graph_error" not in r, (ent["key"], name, r.get("graph_error"))
            assert r["graph_fwdbwd_ms"] > 0 and r["graph_fwdbwd_reps"] == 3
            timed += 1
        assert ent["speedup"] and all(sp["graph_fwdbwd"] for sp in ent["speedup"].values())
    assert timed >= 2

