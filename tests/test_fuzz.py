"""Shape fuzzing of the forward and backward against the fp64 reference (hypothesis)."""

import torch
from hypothesis import given, settings, strategies as st

import torch_flash_v100 as flash
from attention_testing import make_qkv, reference_fp64


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), heads_kv=st.integers(1, 3), group=st.integers(1, 3),
       len_q=st.integers(1, 70), len_kv=st.integers(1, 70), dim=st.integers(1, 40),
       dim_v=st.integers(1, 40), is_causal=st.booleans(),
       mask=st.sampled_from([None, "bool", "float"]), layout=st.sampled_from(["bhle", "blhe"]))
def test_fuzz_against_reference(batch, heads_kv, group, len_q, len_kv, dim, dim_v, is_causal,
                                mask, layout):
    g = torch.Generator().manual_seed(len_q * 1000 + len_kv)
    heads_q = heads_kv * group
    q, k, v = make_qkv(batch, heads_q, heads_kv, len_q, len_kv, dim, torch.float64, "cpu",
                       dim_v=dim_v, requires_grad=True, layout=layout, generator=g)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(batch, 1, len_q, len_kv, generator=g) > 0.4
    elif mask == "float":
        attn_mask = torch.randn(1, heads_q, 1, len_kv, generator=g, dtype=torch.float64)
    out = flash.attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)
    ref = reference_fp64(q, k, v, attn_mask, is_causal=is_causal, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    grad_out = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad_out),
                    torch.autograd.grad(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b)


def test_random_sweep_against_reference():
    # torch_flash_v100.fuzz (the GPU script runs it with 2,000 cases per atom): layouts, every
    # mask kind incl. finfo.min padding and fully masked rows, causal modes, dropout with the
    # kernels' keep mask, GQA, scales, deterministic; every output position vs fp64.
    from torch_flash_v100.fuzz import sweep

    summary = sweep("cpu", cases=150, seed=1, max_len=64)
    assert summary["cases"] == {"native": 150}
    assert summary["failures"] == [], summary["failures"][:3]


def test_sweep_detects_a_wrong_kernel(monkeypatch):
    # The sweep must be able to fail: a forward that drops the causal mask is caught.
    import torch_flash_v100.fuzz as fuzz

    real = torch.ops.flashv100._attention_forward

    class Ops:
        def __getattr__(self, name):
            if name == "_attention_forward":
                return lambda q, k, v, m, p, causal, scale: real(q, k, v, m, p, 0, scale)
            return getattr(torch.ops.flashv100, name)

    monkeypatch.setattr(fuzz, "_ops", Ops())
    summary = fuzz.sweep("cpu", cases=40, seed=2, max_len=32)
    assert any(f["case"]["causal_mode"] != 0 for f in summary["failures"])
