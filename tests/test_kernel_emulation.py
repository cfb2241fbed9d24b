"""The attention kernels of both atoms run whole on the CPU (no GPU needed):
tests/atoms/kernel_emulation.cpp launches flash_fwd_kernel (prefill or decode tile) and the backward
kernels (D pre-pass, dK/dV, dQ by the atomic workspace or the deterministic kernel; one or two
query-side buffers, the compact or the wide tile) as the CUDA launchers do, with every block's
threads as fibers and the tensor-core instructions emulated from the PTX fragment maps
(tests/atoms/cuda_host_emulation.h): the Volta atom as a V100 runs it, the Ampere atom as sm_80+
GPUs do. Every output element is compared with an fp64 reference written from the definitions
(common/params.h), fully hidden rows included, in FlashAttention-2's tolerance (twice the error of
the same math in fp16 / bf16). Dropout's keep mask is the CPU op's (flashv100::_dropout_mask: the
same Philox stream by construction, common/philox.h)."""

from __future__ import annotations

import math
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from attention_testing import assert_fa2_close
from emulation_testing import build_emulation

# The device code on the host: the same on every torch (CI runs it on one).
pytestmark = pytest.mark.slow

ATOMS = ["VoltaAtom", "AmpereAtom"]


@pytest.fixture(scope="module")
def emulators(tmp_path_factory):
    """(atom, head-dim bucket) -> the emulation binary, built on first use."""
    root = tmp_path_factory.mktemp("emulation")
    built = {}

    def get(atom, bucket):
        if (atom, bucket) not in built:
            built[atom, bucket] = build_emulation(
                "kernel_emulation.cpp", root / f"{atom}_{bucket}",
                (f"EMULATED_ATOM={atom}", f"EMULATED_HEAD_DIM={bucket}"))
        return built[atom, bucket]

    return get


def visible_keys(len_q, len_kv, causal, window):
    """Bool [Lq, Lkv] from common/params.h: shift 0 (top-left causal) or len_kv - len_q; causal:
    j <= i + shift; window right: j <= i + shift + right; window left: j >= i + shift - left."""
    left, right = window
    shift = 0 if causal == 1 else len_kv - len_q
    rows = torch.arange(len_q)[:, None]
    cols = torch.arange(len_kv)[None, :]
    keep = torch.ones(len_q, len_kv, dtype=torch.bool)
    if causal:
        keep &= cols <= rows + shift
    if right >= 0:
        keep &= cols <= rows + shift + right
    if left >= 0:
        keep &= cols >= rows + shift - left
    return keep


def reference(q, k, v, dout, case, mask, keep, dtype):
    """out, lse and (q, k, v) gradients computed in `dtype` (softcap, then the mask's bias; P
    dropped where `keep` is False and scaled by 1 / (1 - p) elsewhere)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * case["scale"]
    if case["softcap"] > 0:
        scores = case["softcap"] * torch.tanh(scores / case["softcap"])
    if mask is not None:
        scores = scores + mask.to(dtype)
    visible = visible_keys(q.shape[2], k.shape[2], case["causal"], case["window"])
    scores = scores.masked_fill(~visible, -math.inf)
    row_max = scores.amax(-1, keepdim=True).detach()
    hidden = torch.isneginf(row_max)
    exp = torch.exp(scores - row_max.masked_fill(hidden, 0.0))
    total = exp.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    probs = (exp / total).masked_fill(hidden, 0.0)
    lse = (row_max + torch.log(total)).masked_fill(hidden, -math.inf).squeeze(-1)
    if keep is not None:
        probs = probs * keep / (1.0 - case["dropout_p"])
    out = probs @ v.repeat_interleave(group, 1)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def bucket_of(head_dim):
    return 32 if head_dim <= 32 else 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def emulate(emulators, tmp_path, atom, head_dim, case, tensors):
    """Writes the case (case.txt) and its tensors (16-bit ones as raw bits, the others as they
    are) to tmp_path and runs the (atom, bucket) emulation on them; returns read(name, shape,
    dtype), a tensor the run wrote."""
    (tmp_path / "case.txt").write_text("".join(f"{k} {v!r}\n" for k, v in case.items()))
    for name, t in tensors.items():
        if t.element_size() == 2:
            t = t.view(torch.int16)
        t.contiguous().numpy().tofile(tmp_path / name)
    run = subprocess.run([str(emulators(atom, bucket_of(head_dim))), str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr

    def read(name, shape, dtype):
        if dtype == torch.float32:
            return torch.from_numpy(np.fromfile(tmp_path / name, dtype=np.float32)).reshape(shape)
        raw = torch.from_numpy(np.fromfile(tmp_path / name, dtype=np.int16))
        return raw.view(dtype).reshape(shape)

    return read


def assert_lse_close(lse, reference_lse, atol):
    """-inf exactly where a row sees no key, else within atol of the fp64 value."""
    assert torch.equal(torch.isneginf(lse), torch.isneginf(reference_lse))
    finite = torch.isfinite(reference_lse)
    assert torch.allclose(lse[finite].double(), reference_lse[finite], rtol=1e-5, atol=atol)


def run_case(emulators, tmp_path, *, atom, batch=1, heads_q=2, heads_kv=1, len_q=40, len_kv=56,
             head_dim=64, bf16=False, causal=0, window=(-1, -1), softcap=0.0, mask=None,
             dropout_p=0.0, decode_tile=False, narrow_tile=False, backward=True,
             deterministic=False, bwd_stages=1, bwd_wide=False, kv_group_parts=1, kv_row_parts=1,
             scale=None, seed=0):
    dtype = torch.bfloat16 if bf16 else torch.float16
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, len_q, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, heads_kv, len_kv, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, heads_kv, len_kv, head_dim, generator=g).to(dtype)
    dout = torch.randn(batch, heads_q, len_q, head_dim, generator=g).to(dtype)
    case = dict(batch=batch, heads_q=heads_q, heads_kv=heads_kv, len_q=len_q, len_kv=len_kv,
                head_dim=head_dim, bf16=int(bf16), scale=head_dim ** -0.5 if scale is None else scale,
                causal=causal, window_left=window[0], window_right=window[1], softcap=softcap,
                mask=int(mask is not None), dropout_p=dropout_p, seed=1234 + seed, offset=64,
                decode_tile=int(decode_tile), narrow_tile=int(narrow_tile),
                backward=int(backward),
                deterministic=int(deterministic), bwd_stages=bwd_stages, bwd_wide=int(bwd_wide),
                kv_group_parts=kv_group_parts, kv_row_parts=kv_row_parts)
    tensors = dict(q=q, k=k, v=v, dout=dout)
    if mask is not None:
        tensors["mask"] = mask.float()
    read = emulate(emulators, tmp_path, atom, head_dim, case, tensors)
    case.update(window=window)
    keep = None
    if dropout_p > 0:
        import torch_flash_v100  # noqa: F401  (registers the ops)
        keep = torch.ops.flashv100._dropout_mask(torch.tensor([case["seed"], case["offset"]]),
                                                 batch, heads_q, len_q, len_kv, dropout_p)
    ref = reference(q, k, v, dout, case, mask, keep, torch.float64)
    low = reference(q, k, v, dout, case, mask, keep, dtype)
    assert_fa2_close(read("out", q.shape, dtype), ref[0], low[0], "out")
    assert_lse_close(read("lse", q.shape[:3], torch.float32), ref[1], atol=1e-4)
    if backward:
        for name, like, r, l in zip(("dq", "dk", "dv"), (q, k, v), ref[2:], low[2:]):
            assert_fa2_close(read(name, like.shape, dtype), r, l, name)


@pytest.mark.parametrize("head_dim", [16, 32, 40, 64, 96, 128, 256])
@pytest.mark.parametrize("atom", ATOMS)
def test_every_head_dim(emulators, tmp_path, atom, head_dim):
    run_case(emulators, tmp_path, atom=atom, head_dim=head_dim,
             len_q=37 if head_dim == 256 else 70, len_kv=45 if head_dim == 256 else 90)


@pytest.mark.parametrize("causal", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("atom", ATOMS)
def test_causal_both_alignments(emulators, tmp_path, atom, causal, head_dim):
    # len_q > len_kv: bottom-right alignment hides every key from the first rows.
    run_case(emulators, tmp_path, atom=atom, head_dim=head_dim, causal=causal, len_q=100,
             len_kv=67, heads_q=4, heads_kv=2, batch=2)


# Head dims 128 and 256: the Volta backward's dP warps take softcap's factor from P in shared
# memory (kSplitScores), in the dK/dV and the deterministic dQ kernels.
@pytest.mark.parametrize("head_dim, deterministic", [(64, False), (128, True), (256, False)])
@pytest.mark.parametrize("atom", ATOMS)
def test_window_and_softcap(emulators, tmp_path, atom, head_dim, deterministic):
    small = head_dim == 256
    run_case(emulators, tmp_path, atom=atom, head_dim=head_dim, window=(20, 5), softcap=4.0,
             len_q=40 if small else 90, len_kv=60 if small else 130, deterministic=deterministic)


def left_padding_mask(batch, heads, length, pad, seed=1):
    """Additive [B, H, L, L]: random bias, the first pad[b] keys of sequence b dropped and its
    first pad[b] rows seeing no key at all (left padding)."""
    mask = torch.randn(batch, heads, length, length, generator=torch.Generator().manual_seed(seed))
    for b, n in enumerate(pad):
        mask[b, :, :, :n] = -math.inf
        mask[b, :, :n, :] = -math.inf
    return mask


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("atom", ATOMS)
def test_left_padding_mask_with_hidden_rows(emulators, tmp_path, atom, deterministic, head_dim):
    run_case(emulators, tmp_path, atom=atom, batch=2, heads_q=2, heads_kv=2, len_q=50, len_kv=50,
             head_dim=head_dim, causal=1, mask=left_padding_mask(2, 2, 50, [0, 13]),
             deterministic=deterministic)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("atom", ATOMS)
def test_dropout_with_and_without_mask(emulators, tmp_path, atom, head_dim):
    mask = torch.randn(1, 2, 60, 75, generator=torch.Generator().manual_seed(2))
    mask[..., 70:] = -math.inf
    run_case(emulators, tmp_path, atom=atom, head_dim=head_dim, len_q=60, len_kv=75,
             dropout_p=0.2, causal=2)
    run_case(emulators, tmp_path, atom=atom, head_dim=head_dim, len_q=60, len_kv=75,
             dropout_p=0.2, mask=mask, deterministic=True)


@pytest.mark.parametrize("atom", ATOMS)
def test_gqa_deterministic_dq(emulators, tmp_path, atom):
    run_case(emulators, tmp_path, atom=atom, heads_q=4, heads_kv=1, len_q=80, len_kv=80,
             head_dim=96, causal=2, deterministic=True)


# A GQA group split over dK/dV blocks (kern::KvGroupSplit, what the launcher does for grids
# short of SMs): each part's heads, the fp32 slabs and their reduction, with padded heads whose
# mask hides whole key tiles and bottom-right causal bands.
@pytest.mark.parametrize("head_dim, parts, variant", [
    (64, 2, "plain"), (64, 4, "mask"), (128, 4, "plain"), (128, 2, "dropout"),
    (256, 2, "mask")])
@pytest.mark.parametrize("atom", ATOMS)
def test_gqa_group_split(emulators, tmp_path, atom, head_dim, parts, variant):
    length = 70 if head_dim == 256 else 140
    mask = None
    if variant == "mask":
        mask = left_padding_mask(2, 8, length, [0, 75 if head_dim < 256 else 40])
    run_case(emulators, tmp_path, atom=atom, batch=2, heads_q=8, heads_kv=2,
             len_q=length if mask is not None else length - 9, len_kv=length, head_dim=head_dim, causal=2, mask=mask,
             dropout_p=0.15 if variant == "dropout" else 0.0, kv_group_parts=parts,
             deterministic=head_dim == 128)


# One key tile's query tiles shared out over blocks (KvGroupSplit::row_parts, what the launcher
# does for a short sequence's few heads), with GQA parts too: each share's dQ rows, the rows no
# share visits (dQ = 0, bottom-right causal bands), shares left empty, D computed in the kernel
# (short query ranges) or by the pre-pass, and the slabs' reduction.
@pytest.mark.parametrize("head_dim, variant, len_q, len_kv, parts, row_parts, wide", [
    (64, "plain", 120, 40, 1, 2, False), (64, "mask", 140, 64, 2, 2, False),
    (128, "dropout", 200, 50, 1, 4, False), (256, "plain", 100, 30, 1, 3, False),
    (128, "plain", 300, 128, 1, 3, True), (64, "dropout", 260, 100, 2, 2, True)])
@pytest.mark.parametrize("atom", ATOMS)
def test_one_key_tile_row_split(emulators, tmp_path, atom, head_dim, variant, len_q, len_kv,
                                parts, row_parts, wide):
    if wide and atom == "VoltaAtom":
        pytest.skip("the wide tiles are the m16n8k16 atom's")
    mask = None
    if variant == "mask":
        mask = left_padding_mask(2, 4, len_q, [0, 9])[..., :len_kv].contiguous()
    run_case(emulators, tmp_path, atom=atom, batch=2 if mask is not None else 1, heads_q=4,
             heads_kv=2, len_q=len_q, len_kv=len_kv, head_dim=head_dim, causal=2, mask=mask,
             dropout_p=0.15 if variant == "dropout" else 0.0, kv_group_parts=parts,
             kv_row_parts=row_parts, bwd_stages=2 if wide else 1, bwd_wide=wide)


# The launcher's split of the dK/dV grid (kern::dkdv_split): GQA parts dividing the group up to 4
# waves, then, with one key tile (query_tiles > 0), query shares up to one block per SM, none of
# them left empty by split_share. (group, blocks, query tiles, SMs) -> (parts, row shares).
@pytest.mark.parametrize("args, expected", [
    ((1, 1, 2, 132), (2, 2)),  # one head, L = 128 at the wide tile
    ((1, 512, 2, 132), (1, 1)),  # a grid that fills the GPU
    ((1, 1, 0, 132), (1, 1)),  # several key tiles: no shares
    ((6, 100, 0, 132), (6, 1)),  # group parts 1, 2, 3, 6 (4 and 5 do not divide it)
    ((1, 1, 5, 4), (3, 3)),  # 4 shares of 5 tiles would leave one empty: 3 of 2, 2, 1
    ((2, 1, 3, 132), (6, 3)),  # both
])
def test_dkdv_split_rule(emulators, args, expected):
    run = subprocess.run([str(emulators("AmpereAtom", 64)), "dkdv_split", *map(str, args)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert tuple(int(x) for x in run.stdout.split()) == expected


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16(emulators, tmp_path, head_dim):
    run_case(emulators, tmp_path, atom="AmpereAtom", head_dim=head_dim, bf16=True, causal=2,
             mask=left_padding_mask(1, 2, 60, [9]), len_q=60, len_kv=60, heads_kv=2)


# The backward configurations sm_80 / sm_90 pick by their shared memory (backward_launch.cuh):
# two query-side buffers, and the wide tiles where the variant has one.
@pytest.mark.parametrize("head_dim, variant, wide", [
    (32, "plain", False), (64, "mask", False), (128, "dropout", False), (256, "plain", False),
    (64, "plain", True), (128, "plain", True), (128, "dropout", True), (256, "plain", True),
    (256, "mask", True), (256, "dropout", True)])
def test_backward_configurations(emulators, tmp_path, head_dim, variant, wide):
    length = 70 if head_dim == 256 else 150
    mask = left_padding_mask(1, 2, length, [21]) if variant == "mask" else None
    run_case(emulators, tmp_path, atom="AmpereAtom", head_dim=head_dim, len_q=length,
             len_kv=length, heads_kv=2, causal=1, mask=mask,
             dropout_p=0.15 if variant == "dropout" else 0.0, bwd_stages=2, bwd_wide=wide)


# Keys that fill one tile of the wide tile but two of the compact one (head dims 128 and 256):
# dK/dV and dQ in one kernel of the wide tile, with D computed there or by the pre-pass (the
# masked variant at head dim 256 keeps the dQ workspace: has_direct_wide_bwd_tile).
@pytest.mark.parametrize("head_dim, variant, len_q, len_kv, parts", [
    (128, "plain", 9, 128, 1), (128, "dropout", 100, 77, 2), (256, "plain", 64, 64, 1),
    (256, "mask", 50, 50, 1), (256, "dropout", 5, 33, 2)])
def test_wide_tile_one_key_tile(emulators, tmp_path, head_dim, variant, len_q, len_kv, parts):
    mask = left_padding_mask(1, 4, len_kv, [7]) if variant == "mask" else None
    run_case(emulators, tmp_path, atom="AmpereAtom", head_dim=head_dim, len_q=len_q,
             len_kv=len_kv, heads_q=4, heads_kv=2, causal=2, mask=mask, kv_group_parts=parts,
             dropout_p=0.15 if variant == "dropout" else 0.0, bwd_stages=2, bwd_wide=True)


# The prefill tile of grids too small for the 128-row tile: the narrow tile (query tiles of 64
# rows, a partial last one) where the variant has one, else the wide tile (128, mask).
@pytest.mark.parametrize("head_dim, variant", [
    (32, "mask+dropout"), (64, "plain"), (64, "mask"), (64, "dropout"), (128, "plain"),
    (128, "mask")])
def test_narrow_prefill_tile(emulators, tmp_path, head_dim, variant):
    length = 150
    mask = left_padding_mask(1, 2, length, [21]) if "mask" in variant else None
    run_case(emulators, tmp_path, atom="AmpereAtom", head_dim=head_dim, narrow_tile=True,
             len_q=length, len_kv=length, heads_kv=2, causal=2, mask=mask,
             dropout_p=0.15 if "dropout" in variant else 0.0)


@pytest.mark.parametrize("len_q, causal, heads_q, heads_kv", [
    (1, 0, 4, 1), (5, 2, 2, 2), (32, 2, 4, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("atom", ATOMS)
def test_decode_tile(emulators, tmp_path, atom, head_dim, len_q, causal, heads_q, heads_kv):
    run_case(emulators, tmp_path, atom=atom, head_dim=head_dim, decode_tile=True, len_q=len_q,
             len_kv=150, causal=causal, heads_q=heads_q, heads_kv=heads_kv, backward=False)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(atom=st.sampled_from(ATOMS), head_dim=st.sampled_from([8, 24, 40, 64, 72, 120, 128, 200]),
       len_q=st.integers(1, 100), len_kv=st.integers(1, 100), heads_kv=st.integers(1, 2),
       group=st.sampled_from([1, 3]), causal=st.sampled_from([0, 1, 2]),
       mask=st.sampled_from([None, "padding", "bias"]), dropout=st.booleans(),
       deterministic=st.booleans(), data=st.data())
def test_fuzz_shapes_and_options(emulators, tmp_path_factory, atom, head_dim, len_q, len_kv,
                                 heads_kv, group, causal, mask, dropout, deterministic, data):
    """Random shapes and options, in the tile the launchers pick (the decode tile for at most 32
    query rows without dropout, else the prefill tile of a small grid)."""
    batch, heads_q = 2, heads_kv * group
    g = torch.Generator().manual_seed(len_q * 1000 + len_kv)
    bias = None
    if mask is not None:
        bias = torch.randn(batch, heads_q, len_q, len_kv, generator=g)
        if mask == "padding":  # left padding of sequence 1, some of its rows hidden
            pad = data.draw(st.integers(0, min(len_q, len_kv)), label="pad")
            bias[1, :, :, :pad] = -math.inf
            bias[1, :, :pad, :] = -math.inf
    decode = len_q <= 32 and not dropout and not (atom == "VoltaAtom" and head_dim > 128)
    run_case(emulators, tmp_path_factory.mktemp("fuzz"), atom=atom, batch=batch,
             heads_q=heads_q, heads_kv=heads_kv, len_q=len_q, len_kv=len_kv, head_dim=head_dim,
             causal=causal, mask=bias, dropout_p=0.15 if dropout else 0.0, decode_tile=decode,
             narrow_tile=not decode, deterministic=deterministic, seed=len_q + len_kv)


def test_a_broken_kernel_fails(emulators, tmp_path, monkeypatch):
    """The comparison can fail: the same case with the wrong scale given to the kernel only."""
    import test_kernel_emulation as this

    real = this.reference

    def shifted(q, k, v, dout, case, mask, keep, dtype):
        return real(q, k, v, dout, dict(case, scale=case["scale"] * 1.25), mask, keep, dtype)

    monkeypatch.setattr(this, "reference", shifted)
    with pytest.raises(AssertionError):
        run_case(emulators, tmp_path, atom="VoltaAtom", head_dim=64, backward=False)


def run_kvcache_case(emulators, tmp_path, *, atom, batch=3, heads_q=4, heads_kv=2, len_q=1,
                     head_dim=64, cache_rows=96, seqlens=(0, 37, 90), seqlen_new=1,
                     page_size=0, leftpad=None, batch_idx=None, causal=True, window=(-1, -1),
                     softcap=0.0, rotary_dim=0, rotary_interleaved=True, num_splits=1,
                     decode_tile=True, append_in_kernel=False, pack_gqa=False, seed=0):
    """flash_attn_with_kvcache's kernels (the append, the forward over a contiguous or paged
    cache, the split-KV combine) against kvcache_reference: out, lse and both caches after the
    append, every row."""
    from torch_flash_v100.reference import kvcache_reference

    dtype = torch.float16
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    q = rnd(batch, len_q, heads_q, head_dim)
    k_new, v_new = rnd(batch, seqlen_new, heads_kv, head_dim), rnd(batch, seqlen_new, heads_kv, head_dim)
    block_table = None
    if page_size:
        max_blocks = -(-cache_rows // page_size)
        pages = batch * max_blocks + 2
        perm = torch.randperm(pages, generator=g)[: batch * max_blocks]
        block_table = perm.reshape(batch, max_blocks).to(torch.int32)
        cache_shape = (pages, page_size, heads_kv, head_dim)
    else:
        cache_shape = (batch + 1 if batch_idx is not None else batch, cache_rows, heads_kv, head_dim)
    k_cache, v_cache = rnd(*cache_shape), rnd(*cache_shape)
    seqlens_t = torch.tensor(seqlens, dtype=torch.int32)
    cos = sin = None
    seqlen_ro = cache_rows + len_q
    if rotary_dim:
        angle = torch.rand(seqlen_ro, rotary_dim // 2, generator=g) * 6.0
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    # FlashAttention-2's rules (set_flash_score_rules): causal is a right window of 0, aligned
    # bottom-right.
    right = 0 if causal else window[1]
    case = dict(kvcache=1, batch=batch, heads_q=heads_q, heads_kv=heads_kv, len_q=len_q,
                len_kv=0, head_dim=head_dim, bf16=0, scale=head_dim ** -0.5,
                causal=2 if right == 0 else 0, window_left=window[0], window_right=right,
                softcap=softcap, mask=0, dropout_p=0.0, seed=0, offset=0,
                decode_tile=int(decode_tile), backward=0, deterministic=0, bwd_stages=1,
                bwd_wide=0, cache_batch=cache_shape[0], cache_rows=cache_shape[1],
                paged=int(bool(page_size)), max_blocks=0 if block_table is None else block_table.shape[1],
                seqlen_new=seqlen_new, leftpad=int(leftpad is not None),
                batch_idx=int(batch_idx is not None), rotary_dim=rotary_dim,
                rotary_interleaved=int(rotary_interleaved), seqlen_ro=seqlen_ro,
                num_splits=num_splits, append_in_kernel=int(append_in_kernel),
                pack_gqa=int(pack_gqa))
    tensors = dict(q=q.transpose(1, 2), k=k_cache, v=v_cache, k_new=k_new, v_new=v_new)
    if rotary_dim:
        tensors.update(cos=cos, sin=sin)
    index = dict(seqlens=seqlens_t, leftpad=leftpad, batch_idx=batch_idx, block_table=block_table)
    tensors.update({name: torch.as_tensor(t, dtype=torch.int32) for name, t in index.items()
                    if t is not None})
    read = emulate(emulators, tmp_path, atom, head_dim, case, tensors)
    kwargs = dict(cache_seqlens=seqlens_t, rotary_cos=cos, rotary_sin=sin,
                  cache_batch_idx=None if batch_idx is None else torch.tensor(batch_idx),
                  cache_leftpad=None if leftpad is None else torch.tensor(leftpad),
                  block_table=block_table, causal=causal, window_size=window, softcap=softcap,
                  rotary_interleaved=rotary_interleaved)
    ref = kvcache_reference(q, k_cache, v_cache, k_new, v_new, **kwargs)
    low = kvcache_reference(q, k_cache, v_cache, k_new, v_new, compute_dtype=torch.float32, **kwargs)
    out = read("out", q.transpose(1, 2).shape, dtype).transpose(1, 2)
    assert_fa2_close(out, ref[0], low[0].to(dtype), "out")
    assert_lse_close(read("lse", ref[1].shape, torch.float32), ref[1], atol=1e-3)
    # The caches: appended rows as the reference stores them (rotated keys within one fp16
    # rounding of it: fp32 against fp64 rotation), every other row untouched.
    for name, expected in (("k_cache", ref[2]), ("v_cache", ref[3])):
        got = read(name, expected.shape, dtype)
        assert torch.allclose(got.float(), expected.float(), rtol=2e-3, atol=2e-3), name
        untouched = expected == (k_cache if name == "k_cache" else v_cache)
        assert torch.equal(got[untouched], expected[untouched]), name


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("atom", ATOMS)
def test_kvcache_decode_gqa_packed_append_in_kernel(emulators, tmp_path, atom, head_dim,
                                                     num_splits):
    run_kvcache_case(emulators, tmp_path, atom=atom, head_dim=head_dim, pack_gqa=True,
                     append_in_kernel=True, num_splits=num_splits, seqlens=(0, 37, 95))


@pytest.mark.parametrize("page_size", [16, 48])
@pytest.mark.parametrize("atom", ATOMS)
def test_kvcache_paged_speculative_rows(emulators, tmp_path, atom, page_size):
    run_kvcache_case(emulators, tmp_path, atom=atom, page_size=page_size, len_q=3, seqlen_new=3,
                     seqlens=(5, 60, 93), leftpad=[0, 7, 40], num_splits=2)


@pytest.mark.parametrize("atom", ATOMS)
def test_kvcache_paged_splits_past_32_pages(emulators, tmp_path, atom):
    # 36 pages of one key tile each: a split's first pages come from the lanes' copy of the
    # table's first 32 entries (TableHead), or from memory where they lie past it (the last
    # split of the longest sequence).
    run_kvcache_case(emulators, tmp_path, atom=atom, head_dim=128, page_size=64, cache_rows=2304,
                     seqlens=(3, 1500, 2303), num_splits=12)


@pytest.mark.parametrize("interleaved, page_size", [(True, 0), (False, 0), (True, 64)])
@pytest.mark.parametrize("atom", ATOMS)
def test_kvcache_rotary_prefill_chunk(emulators, tmp_path, atom, interleaved, page_size):
    # 40 query rows: the prefill tile (paged or not); the append kernel rotates q and the new
    # keys.
    run_kvcache_case(emulators, tmp_path, atom=atom, head_dim=128, len_q=40, seqlen_new=40,
                     cache_rows=128, seqlens=(0, 50, 88), rotary_dim=64,
                     rotary_interleaved=interleaved, page_size=page_size, decode_tile=False,
                     num_splits=2)


@pytest.mark.parametrize("atom", ATOMS)
def test_kvcache_batch_idx_window_softcap(emulators, tmp_path, atom):
    run_kvcache_case(emulators, tmp_path, atom=atom, heads_q=2, heads_kv=2, len_q=4,
                     seqlen_new=2, batch_idx=[2, 0, 3], causal=False, window=(30, 3),
                     softcap=5.0, seqlens=(10, 70, 94))


@pytest.mark.parametrize("decode_tile", [False, True], ids=["prefill_tile", "decode_tile"])
@pytest.mark.parametrize("atom", ATOMS)
def test_kvcache_paged_packed_queries(emulators, tmp_path, atom, decode_tile):
    """flash_attn_varlen_func with block_table: packed queries (an empty sequence, one without
    keys, tiles crossing pages) over shuffled 16-row pages whose other rows are NaN, causal, GQA,
    against the per-sequence reference at every row."""
    from flash_testing import cu_seqlens, paged_cache, varlen_reference

    lens_q, lens_k = ([3, 0, 2, 5] if decode_tile else [40, 0, 1, 70]), [50, 7, 0, 90]
    heads_q, heads_kv, d = 4, 2, 64
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(n), h, d, generator=g, dtype=torch.float64)
               for n, h in ((lens_q, heads_q), (lens_k, heads_kv), (lens_k, heads_kv)))
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    k_cache, v_cache, table = paged_cache(k, v, cu_k, 16)
    case = dict(kvcache=1, batch=len(lens_q), heads_q=heads_q, heads_kv=heads_kv,
                len_q=max(lens_q), total_q=sum(lens_q), len_kv=0, head_dim=d, bf16=0,
                scale=d ** -0.5, causal=2, window_left=-1, window_right=0, softcap=0.0, mask=0,
                dropout_p=0.0, seed=0, offset=0, decode_tile=int(decode_tile), backward=0,
                deterministic=0, bwd_stages=1, bwd_wide=0, cache_batch=k_cache.shape[0],
                cache_rows=16, paged=1, max_blocks=table.shape[1], seqlen_new=0, leftpad=0,
                batch_idx=0, rotary_dim=0, rotary_interleaved=1, seqlen_ro=0, num_splits=1,
                append_in_kernel=0, pack_gqa=0)
    tensors = dict(q=q.half(), k=k_cache.half(), v=v_cache.half(), seqlens=cu_k[1:] - cu_k[:-1],
                   block_table=table, cu_seqlens_q=cu_q)
    read = emulate(emulators, tmp_path, atom, d, case, tensors)
    ref_out, ref_lse = varlen_reference(q.half().double(), k.half().double(), v.half().double(),
                                        cu_q, cu_k, causal=True)
    assert_fa2_close(read("out", q.shape, torch.float16), ref_out, ref_out.half(), "out")
    assert_lse_close(read("lse", ref_lse.shape, torch.float32), ref_lse, atol=1e-3)
