"""hypothesis: random combinations of spelling, scale, mask, causality, GQA and shapes."""

import math

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from compile_testing import DEVICE, check  # noqa: E402
from test_compile_gqa import repeat_kv  # noqa: E402


def make_fn(spelling, scale_at, mask_kind, causal, gqa):
    def fn(q, k, v, m):
        if gqa:
            n = q.size(1) // k.size(1)
            k, v = repeat_kv(k, n), repeat_kv(v, n)
        sc = 1.0 / math.sqrt(q.size(-1))
        if scale_at == "q":
            q = q * sc
        if spelling == "matmul":
            s = torch.matmul(q, k.transpose(-2, -1))
        elif spelling == "einsum":
            s = torch.einsum("bhld,bhsd->bhls", q, k)
        else:
            s = q @ k.permute(0, 1, 3, 2)
        if scale_at == "scores":
            s = s / (1.0 / sc)
        if mask_kind == "additive":
            s = s + m
        elif mask_kind == "bool":
            s = s.masked_fill(~(m > 0), torch.finfo(s.dtype).min)
        if causal:
            L, S = s.shape[-2:]
            keep = torch.ones(L, S, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        return F.softmax(s, dim=-1) @ v
    return fn


@settings(max_examples=25, deadline=None, derandomize=True)
@given(spelling=st.sampled_from(["matmul", "einsum", "at_permute"]),
       scale_at=st.sampled_from(["scores", "q", "none"]),
       mask_kind=st.sampled_from(["none", "additive", "bool"]),
       causal=st.booleans(), gqa=st.booleans(), train=st.booleans(),
       b=st.integers(1, 2), hk=st.sampled_from([1, 2]), l=st.integers(1, 9),
       extra_s=st.integers(0, 5), e=st.sampled_from([8, 16]))
def test_fuzz(spelling, scale_at, mask_kind, causal, gqa, train, b, hk, l, extra_s, e):
    h = hk * 2 if gqa else hk
    s = l + extra_s  # S >= L: every causal row keeps a key
    g = torch.Generator().manual_seed(l * 31 + s)
    q = torch.randn(b, h, l, e, generator=g).to(DEVICE)
    k = torch.randn(b, hk, s, e, generator=g).to(DEVICE)
    v = torch.randn(b, hk, s, e, generator=g).to(DEVICE)
    if not gqa:
        k, v = k.expand(b, h, s, e).contiguous(), v.expand(b, h, s, e).contiguous()
    m = torch.randn(b, 1, l, s, generator=g).to(DEVICE)
    if mask_kind == "bool":
        m[..., 0] = 1.0  # keep key 0: no fully masked rows
    m._grad_wanted = False
    cap = check(make_fn(spelling, scale_at, mask_kind, causal, gqa), (q, k, v, m), train=train)
    (call,) = cap.attention_calls()
    assert call["is_causal"] is causal
    assert call["enable_gqa"] is (gqa and h != hk)
