"""attn_mask and dropout in the fused CUDA kernels (issue #6), on both tensor-core atoms."""
from __future__ import annotations

import math

import pytest
import torch

import torch_flash_v100 as tfv
from attention_testing import assert_fa2_close, make_qkv
from torch_flash_v100.reference import reference_attention

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.cuda]

ops = torch.ops.flashv100
B, H, L, S, E = 2, 4, 77, 93, 64
SCALE = 1.0 / math.sqrt(E)


@pytest.fixture(params=[True, False], ids=["volta", "native"])
def atom(request):
    with tfv.volta_atom(request.param):
        yield request.param


def make_mask(shape_class, kind, gen):
    shape = {"padding": (B, 1, 1, S), "rows": (1, 1, L, S), "full": (B, H, L, S),
             "head_bias": (1, H, 1, S), "expanded": (B, 1, 1, S)}[shape_class]
    if kind == "bool":
        mask = torch.rand(shape, generator=gen, device="cuda") < 0.8
        mask[..., 0] = True  # keep every row partly visible here (hidden rows: own test)
    else:
        mask = (torch.randn(shape, generator=gen, device="cuda") * 2).to(getattr(torch, kind))
    if shape_class == "expanded":  # zero strides on H and L
        mask = mask.expand(B, H, L, S)
    return mask


def fused_all(q, k, v, mask, dropout_p, causal_mode, dout, mask_grad, deterministic=False):
    out, lse, rng = ops._attention_forward(q, k, v, mask, dropout_p, causal_mode, SCALE)
    dq, dk, dv, dmask = ops._attention_backward(dout, q, k, v, mask, out, lse, rng, dropout_p,
                                                causal_mode, SCALE, mask_grad, deterministic)
    return out, dq, dk, dv, dmask, rng


def reference_all(q, k, v, mask, dropout_p, causal_mode, dout, keep, dtype, mask_grad):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    m = mask
    if mask is not None and mask.is_floating_point():
        m = mask.detach().to(torch.float64 if dtype == torch.float64 else mask.dtype)
        m.requires_grad_(mask_grad)
    out = reference_attention(*leaves, attn_mask=m, dropout_p=dropout_p, scale=SCALE,
                              causal_mode=causal_mode, enable_gqa=True,
                              dropout_keep=None if keep is None else keep.to(dtype))
    out.backward(dout.to(dtype))
    grads = [t.grad for t in leaves]
    return out.detach(), *grads, (m.grad if mask_grad else None)


def check_against_reference(q, k, v, mask=None, dropout_p=0.0, causal_mode=0, mask_grad=False,
                            check_grads=True, deterministic=False, floor_mask=None):
    """floor_mask: the mask of the low-precision math floor, where `mask` does not fit its dtype."""
    dout = torch.randn_like(q)
    got = fused_all(q, k, v, mask, dropout_p, causal_mode, dout, mask_grad, deterministic)
    keep = None
    if dropout_p > 0:
        keep = ops._dropout_mask(got[-1], q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                                 dropout_p)
    ref64 = reference_all(q, k, v, mask, dropout_p, causal_mode, dout, keep, torch.float64,
                          mask_grad)
    base = reference_all(q, k, v, mask if floor_mask is None else floor_mask, dropout_p,
                         causal_mode, dout, keep, q.dtype, mask_grad)
    names = ["out", "dq", "dk", "dv"] if check_grads else ["out"]
    for name, a, r, bl in zip(names, got[:4], ref64[:4], base[:4]):
        assert_fa2_close(a, r, bl, name=name)
    assert all(torch.isfinite(t).all() for t in got[1:4])
    if mask_grad:
        dmask = got[4]
        assert dmask.shape == mask.shape and dmask.dtype == mask.dtype
        reduced_r = ref64[4].sum_to_size(mask.shape)
        reduced_b = base[4].double().sum_to_size(mask.shape)
        assert_fa2_close(dmask.double(), reduced_r, reduced_b, name="dmask",
                         atol={torch.float64: 1e-8, torch.float32: 1e-4}.get(mask.dtype, 1e-2))
    return got


@pytest.mark.parametrize("shape_class", ["padding", "rows", "full", "head_bias", "expanded"])
@pytest.mark.parametrize("kind", ["bool", "float32", "float16", "bfloat16", "float64"])
def test_mask_shapes_and_dtypes(atom, shape_class, kind):
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = make_qkv(B, H, H // 2, L, S, E, torch.float16, "cuda")
    mask = make_mask(shape_class, kind, gen)
    check_against_reference(q, k, v, mask, causal_mode=2 if kind == "float32" else 0)


@pytest.mark.parametrize("shape_class", ["padding", "full"])
def test_additive_mask_gradient(atom, shape_class):
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = make_qkv(B, H, H, L, S, E, torch.float16, "cuda")
    mask = make_mask(shape_class, "float32", gen)
    check_against_reference(q, k, v, mask, causal_mode=1, mask_grad=True)


def in_range_of(mask, dtype):
    """The floor mask of a math reference in `dtype`: finfo(float32).min is -inf in fp16 and bf16,
    which would hide its rows there; finfo(dtype).min keeps SDPA's uniform average."""
    return mask.clamp_min(torch.finfo(dtype).min)


@pytest.mark.parametrize("kind", ["bool", "neg_inf", "finfo_min"])
def test_fully_masked_rows(atom, kind):
    q, k, v = make_qkv(1, 2, 2, 40, 50, E, torch.float16, "cuda")
    hidden = torch.zeros(1, 1, 40, 1, dtype=torch.bool, device="cuda")
    hidden[:, :, :7] = True
    if kind == "bool":
        mask = (~hidden).expand(1, 1, 40, 50).contiguous()
    else:
        fill = float("-inf") if kind == "neg_inf" else torch.finfo(torch.float32).min
        mask = torch.zeros(1, 1, 40, 50, device="cuda").masked_fill(hidden, fill)
    # finfo.min rows (dO != 0 here): lse = max + log(sum) cannot carry log(sum) next to
    # |max| ~ 3e38 in fp32, so the backward's D pre-pass recounts their normalizer.
    floor_mask = in_range_of(mask, q.dtype) if kind == "finfo_min" else None
    out = check_against_reference(q, k, v, mask, floor_mask=floor_mask)[0]
    if kind != "finfo_min":  # SDPA semantics: hidden rows give 0 (finfo.min: a uniform average)
        assert torch.equal(out[:, :, :7], torch.zeros_like(out[:, :, :7]))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic_dq"])
@pytest.mark.parametrize("causal_mode", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape_class", ["rows", "padding"])
def test_rows_hidden_by_finfo_min_have_uniform_gradients(atom, shape_class, dtype, causal_mode,
                                                         deterministic):
    """Rows whose every visible key carries finfo(float32).min, with dO != 0 on them: output and
    gradients (dmask too) are those of SDPA math's uniform average, with GQA, for both dQ kernels.
    "padding": HuggingFace-style [B, 1, 1, S] masks, batch 1 fully padded."""
    if atom and dtype == torch.bfloat16:
        pytest.skip("bf16 on the Volta atom runs the ATen fallback")
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = make_qkv(B, H, H // 2, L, S, E, dtype, "cuda")
    finfo_min = torch.finfo(torch.float32).min
    if shape_class == "rows":
        mask = torch.rand(B, 1, L, S, generator=gen, device="cuda") * 2 - 1
        mask[0, :, :5] = finfo_min  # hidden rows
        mask[1, :, 30:70] = finfo_min  # across a query tile boundary
        mask[:, :, 5:, 7] = finfo_min  # and a hidden key elsewhere
    else:
        mask = torch.zeros(B, 1, 1, S, device="cuda")
        mask[0, ..., 60:] = finfo_min
        mask[1] = finfo_min
    check_against_reference(q, k, v, mask, causal_mode=causal_mode, mask_grad=True,
                            deterministic=deterministic, floor_mask=in_range_of(mask, dtype))


def test_mask_with_gqa_and_strided_layout(atom):
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = make_qkv(B, H, 1, L, S, E, torch.float16, "cuda", layout="blhe")
    check_against_reference(q, k, v, make_mask("padding", "bool", gen), causal_mode=1)


def prefix_padding_mask(lengths, heads, kind):
    """[B, heads, 1, S] mask keeping the first lengths[b][h] keys: the shape the kernels turn
    into a key range (no per-element reads, tiles past the range skipped)."""
    keep = torch.arange(S, device="cuda") < torch.tensor(lengths, device="cuda")[..., None]
    keep = keep.reshape(len(lengths), heads, 1, S)
    if kind == "bool":
        return keep
    return torch.zeros(keep.shape, device="cuda", dtype=torch.float16).masked_fill(~keep, -math.inf)


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal_mode", [0, 2])
@pytest.mark.parametrize("kv_heads", [H, 1])
def test_prefix_padding_mask(atom, kind, causal_mode, kv_heads):
    # Lengths: all keys, none (hidden rows -> 0), one, and one ending inside a key tile.
    q, k, v = make_qkv(4, H, kv_heads, L, S, E, torch.float16, "cuda")
    mask = prefix_padding_mask([[S], [0], [1], [40]], 1, kind)
    out = check_against_reference(q, k, v, mask, causal_mode=causal_mode)[0]
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_prefix_padding_mask_per_head_with_dropout_and_deterministic_dq(atom):
    lengths = [[S, 17, 64, 3], [80, 0, 33, S]]
    q, k, v = make_qkv(2, H, H // 2, L, S, E, torch.float16, "cuda")
    mask = prefix_padding_mask(lengths, H, "bool")
    check_against_reference(q, k, v, mask, dropout_p=0.2, causal_mode=1)
    dout = torch.randn_like(q)
    out, lse, rng = ops._attention_forward(q, k, v, mask, 0.0, 0, SCALE)
    fast = ops._attention_backward(dout, q, k, v, mask, out, lse, rng, 0.0, 0, SCALE, False, False)
    exact = ops._attention_backward(dout, q, k, v, mask, out, lse, rng, 0.0, 0, SCALE, False, True)
    for a, b in zip(fast[:3], exact[:3]):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-2)


def test_padding_mask_with_holes_and_biases_is_read(atom):
    """Row-broadcast masks that are not a plain prefix: every entry must still be applied."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = make_qkv(B, H, H, L, S, E, torch.float16, "cuda")
    keep = prefix_padding_mask([[70], [S]], 1, "bool")
    holes = keep & (torch.rand(keep.shape, generator=gen, device="cuda") < 0.7)
    holes[..., 0] = True
    check_against_reference(q, k, v, holes)
    bias = torch.randn(keep.shape, generator=gen, device="cuda").masked_fill(~keep, -math.inf)
    check_against_reference(q, k, v, bias, mask_grad=True)


@pytest.mark.parametrize("scale", [-0.125, 0.0])
def test_non_positive_scale(atom, scale):
    q, k, v = make_qkv(B, H, H, L, S, E, torch.float16, "cuda")
    dout = torch.randn_like(q)
    out, lse, rng = ops._attention_forward(q, k, v, None, 0.0, 1, scale)
    grads = ops._attention_backward(dout, q, k, v, None, out, lse, rng, 0.0, 1, scale, False, False)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*leaves, scale=scale, causal_mode=1)
    ref.backward(dout.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)
    for g, leaf in zip(grads[:3], leaves):
        torch.testing.assert_close(g.double(), leaf.grad, atol=2e-2, rtol=0)


@pytest.mark.parametrize("causal_mode", [0, 2])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])  # every tile width: Philox groups
def test_dropout_matches_reference_with_same_keep_mask(atom, causal_mode, head_dim):
    q, k, v = make_qkv(B, H, H // 2, L, S, head_dim, torch.float16, "cuda")
    check_against_reference(q, k, v, dropout_p=0.2, causal_mode=causal_mode)


def test_dropout_with_mask_and_mask_grad(atom):
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = make_qkv(B, H, H, L, S, E, torch.float16, "cuda")
    check_against_reference(q, k, v, make_mask("full", "float32", gen), dropout_p=0.1,
                            causal_mode=1, mask_grad=True)


def test_dropout_reproducible_from_manual_seed(atom):
    q, k, v = make_qkv(1, 2, 2, 64, 64, E, torch.float16, "cuda")

    def run():
        return ops._attention_forward(q, k, v, None, 0.3, 0, SCALE)

    torch.manual_seed(123)
    out1, _, rng1 = run()
    out2, _, rng2 = run()
    torch.manual_seed(123)
    out3, _, rng3 = run()
    assert torch.equal(out1, out3) and torch.equal(rng1, rng3)
    assert not torch.equal(out1, out2)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate(p):
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 1, 1, 8, 8, E, torch.float16, "cuda")
    _, _, rng = ops._attention_forward(q, k, v, None, p, 0, SCALE)
    keep = ops._dropout_mask(rng, 4, 8, 256, 256, p)
    n = keep.numel()
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)


def test_dropout_zero_reports_zero_rng_state(atom):
    q, k, v = make_qkv(1, 2, 2, 16, 16, E, torch.float16, "cuda")
    _, _, rng = ops._attention_forward(q, k, v, None, 0.0, 0, SCALE)
    assert torch.equal(rng.cpu(), torch.zeros(2, dtype=torch.long))


def test_dropout_under_cuda_graph_gives_fresh_masks(atom):
    q, k, v = make_qkv(1, 2, 2, 48, 48, E, torch.float16, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops._attention_forward(q, k, v, None, 0.3, 0, SCALE)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, rng = ops._attention_forward(q, k, v, None, 0.3, 0, SCALE)
    results = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        keep = ops._dropout_mask(rng, 1, 2, 48, 48, 0.3)
        ref = reference_attention(q.double(), k.double(), v.double(), dropout_p=0.3,
                                  dropout_keep=keep.double(), scale=SCALE)
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=1e-2)
        results.append((out.clone(), rng.clone()))
    assert not torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][0], results[1][0])
