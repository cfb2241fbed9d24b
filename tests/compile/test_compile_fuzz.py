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


def make_band_fn(lo, hi, spelling, softcap, alibi):
    """Attention keeping the diagonals lo <= j - i <= hi (None: unbounded) with a finite fill
    (eager then averages rows with no key over all keys), optionally soft-capped and with
    FlashAttention-2's ALiBi bias -slope * |i + S - L - j|."""
    def fn(q, k, v, slopes):
        s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
        if softcap:
            s = torch.tanh(s / 4.0) * 4.0
        i = torch.arange(s.size(-2), device=s.device)[:, None]
        j = torch.arange(s.size(-1), device=s.device)[None, :]
        if alibi:
            s = s - slopes.view(1, -1, 1, 1) * (i + (s.size(-1) - s.size(-2)) - j).abs()
        low = torch.finfo(s.dtype).min
        if spelling == "tril_triu":
            keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device)
            keep = keep.tril(hi if hi is not None else s.size(-1)).triu(
                lo if lo is not None else -s.size(-2))
            return F.softmax(s.masked_fill(~keep, low), dim=-1) @ v
        if spelling == "two_fills":
            if hi is not None:
                s = s.masked_fill(j - i > hi, low)
            if lo is not None:
                s = torch.where(j - i >= lo, s, low)
            return F.softmax(s, dim=-1) @ v
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device)
        if hi is not None:
            keep = keep & (j <= i + hi)
        if lo is not None:
            keep = keep & (i + lo <= j)
        if spelling == "additive":
            return F.softmax(s + torch.where(keep, 0.0, low), dim=-1) @ v
        return F.softmax(s.masked_fill(~keep, low), dim=-1) @ v
    return fn


@settings(max_examples=40, deadline=None, derandomize=True)
@given(l=st.integers(1, 9), s=st.integers(1, 9), lo=st.one_of(st.none(), st.integers(-9, 3)),
       width=st.one_of(st.none(), st.integers(0, 9)),
       spelling=st.sampled_from(["bool", "additive", "tril_triu", "two_fills"]),
       softcap=st.booleans(), alibi=st.booleans(), train=st.booleans())
def test_fuzz_bands(l, s, lo, width, spelling, softcap, alibi, train):
    # every band, spelling and length: equal to eager everywhere, rows with no key included;
    # soft-capping only where the op can take the band (every row sees a key, bottom-right
    # aligned; with one query or key the masks compare an index with a constant, which the pass
    # does not read as a band), as it is left alone otherwise
    hi = None if width is None else (lo or 0) + width
    shift = s - l
    if softcap and not ((hi is None or hi >= max(0, shift)) and
                        (lo is None or lo <= min(0, shift)) and min(l, s) > 1):
        return
    g = torch.Generator().manual_seed(l * 31 + s)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g).to(DEVICE) for n in (l, s, s))
    slopes = torch.rand(2, generator=g).to(DEVICE)
    slopes._grad_wanted = False
    cap = check(make_band_fn(lo, hi, spelling, softcap, alibi), (q, k, v, slopes), train=train)
    if softcap:
        assert cap.flash_calls()
