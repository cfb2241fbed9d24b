"""The Volta atom's attention kernels run whole on the CPU (no GPU needed):
tests/atoms/volta_kernel_emulation.cpp launches flash_fwd_kernel and the backward kernels
(D pre-pass, dK/dV, dQ by the atomic workspace or the deterministic kernel) as the CUDA launchers
do for a V100, with every block's threads as fibers and mma.m8n8k4 emulated from the PTX fragment
maps (tests/atoms/cuda_host_emulation.h). Every output element is compared with an fp64 reference
written from the definitions (common/params.h), fully hidden rows included, in FlashAttention-2's
tolerance (twice the error of the same math in fp16). Dropout's keep mask is the CPU op's
(flashv100::_dropout_mask: the same Philox stream by construction, common/philox.h)."""

from __future__ import annotations

import math
import subprocess

import numpy as np
import pytest
import torch

from attention_testing import assert_fa2_close
from emulation_testing import build_emulation


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulation("volta_kernel_emulation.cpp",
                           tmp_path_factory.mktemp("emulation") / "volta_kernel_emulation")


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


def run_case(emulator, tmp_path, *, batch=1, heads_q=2, heads_kv=1, len_q=40, len_kv=56,
             head_dim=64, causal=0, window=(-1, -1), softcap=0.0, mask=None, dropout_p=0.0,
             backward=True, deterministic=False, scale=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, len_q, head_dim, generator=g).half()
    k = torch.randn(batch, heads_kv, len_kv, head_dim, generator=g).half()
    v = torch.randn(batch, heads_kv, len_kv, head_dim, generator=g).half()
    dout = torch.randn(batch, heads_q, len_q, head_dim, generator=g).half()
    case = dict(batch=batch, heads_q=heads_q, heads_kv=heads_kv, len_q=len_q, len_kv=len_kv,
                head_dim=head_dim, scale=head_dim ** -0.5 if scale is None else scale,
                causal=causal, window_left=window[0], window_right=window[1], softcap=softcap,
                mask=int(mask is not None), dropout_p=dropout_p, seed=1234 + seed, offset=64,
                backward=int(backward), deterministic=int(deterministic))
    (tmp_path / "case.txt").write_text("".join(f"{k} {v!r}\n" for k, v in case.items()))
    tensors = dict(q=q, k=k, v=v, dout=dout)
    if mask is not None:
        tensors["mask"] = mask.float()
    for name, t in tensors.items():
        t.contiguous().numpy().tofile(tmp_path / name)
    run = subprocess.run([str(emulator), str(tmp_path)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr

    def result(name, like, dtype=np.float16):
        return torch.from_numpy(np.fromfile(tmp_path / name, dtype=dtype)).reshape(like.shape)

    case.update(window=window)
    keep = None
    if dropout_p > 0:
        import torch_flash_v100  # noqa: F401  (registers the ops)
        keep = torch.ops.flashv100._dropout_mask(torch.tensor([case["seed"], case["offset"]]),
                                                 batch, heads_q, len_q, len_kv, dropout_p)
    ref = reference(q, k, v, dout, case, mask, keep, torch.float64)
    low = reference(q, k, v, dout, case, mask, keep, torch.float16)
    out = result("out", q)
    lse = result("lse", q[..., 0], np.float32)
    assert_fa2_close(out, ref[0], low[0], "out")
    # lse: -inf exactly where a row sees no key, else within fp32 rounding of the fp64 value.
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref[1]))
    finite = torch.isfinite(ref[1])
    assert torch.allclose(lse[finite].double(), ref[1][finite], rtol=1e-5, atol=1e-4)
    if backward:
        for name, like, r, l in zip(("dq", "dk", "dv"), (q, k, v), ref[2:], low[2:]):
            assert_fa2_close(result(name, like), r, l, name)


@pytest.mark.parametrize("head_dim", [16, 32, 40, 64, 96, 128, 256])
def test_plain_forward_and_backward(emulator, tmp_path, head_dim):
    run_case(emulator, tmp_path, head_dim=head_dim, len_q=37 if head_dim == 256 else 70,
             len_kv=45 if head_dim == 256 else 90)


@pytest.mark.parametrize("causal", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_causal_both_alignments(emulator, tmp_path, causal, head_dim):
    # len_q > len_kv: bottom-right alignment hides every key from the first rows.
    run_case(emulator, tmp_path, head_dim=head_dim, causal=causal, len_q=100, len_kv=67,
             heads_q=4, heads_kv=2, batch=2)


def test_window_and_softcap(emulator, tmp_path):
    run_case(emulator, tmp_path, head_dim=64, window=(20, 5), softcap=4.0, len_q=90, len_kv=130)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_left_padding_mask_with_hidden_rows(emulator, tmp_path, deterministic, head_dim):
    # Additive mask: a left-padded batch (the first keys of each sequence dropped, rows of padding
    # that see no key at all) plus a random bias elsewhere.
    batch, heads, len_q = 2, 2, 50
    g = torch.Generator().manual_seed(1)
    mask = torch.randn(batch, heads, len_q, len_q, generator=g)
    pad = [0, 13]
    for b, n in enumerate(pad):
        mask[b, :, :, :n] = -math.inf
        mask[b, :, :n, :] = -math.inf
    run_case(emulator, tmp_path, batch=batch, heads_q=heads, heads_kv=heads, len_q=len_q,
             len_kv=len_q, head_dim=head_dim, causal=1, mask=mask, deterministic=deterministic)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dropout_with_and_without_mask(emulator, tmp_path, head_dim):
    mask = torch.randn(1, 2, 60, 75, generator=torch.Generator().manual_seed(2))
    mask[..., 70:] = -math.inf
    run_case(emulator, tmp_path, head_dim=head_dim, len_q=60, len_kv=75, dropout_p=0.2, causal=2)
    run_case(emulator, tmp_path, head_dim=head_dim, len_q=60, len_kv=75, dropout_p=0.2,
             mask=mask, deterministic=True)


def test_gqa_deterministic_dq(emulator, tmp_path):
    run_case(emulator, tmp_path, heads_q=4, heads_kv=1, len_q=80, len_kv=80, head_dim=96,
             causal=2, deterministic=True)


def test_a_broken_kernel_fails(emulator, tmp_path, monkeypatch):
    """The comparison can fail: the same case with the wrong scale given to the kernel only."""
    import test_volta_kernel_emulation as this

    real = this.reference

    def shifted(q, k, v, dout, case, mask, keep, dtype):
        return real(q, k, v, dout, dict(case, scale=case["scale"] * 1.25), mask, keep, dtype)

    monkeypatch.setattr(this, "reference", shifted)
    with pytest.raises(AssertionError):
        run_case(emulator, tmp_path, head_dim=64, backward=False)
