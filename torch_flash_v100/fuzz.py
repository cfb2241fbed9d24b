"""Random-case sweep of the fused kernels against the fp64 reference: a self-test for any install.

    python -m torch_flash_v100.fuzz --device cuda --cases 2000            # both atoms on a GPU
    python -m torch_flash_v100.fuzz --device cpu --cases 300 --json r.json

Each case draws shapes (any lengths, head dims of every bucket, GQA), a memory layout ([B, H, L, E],
transposed [B, L, H, E], rows padded inside a wider buffer), a mask (none, bool, additive broadcast
or full, a padding prefix, HF-style finfo.min padding on the left or right, rows with every key
masked), a causal mode (none, top-left, bottom-right), dropout (checked with the exact keep mask
the kernels applied), a scale and the deterministic flag, and runs the internal forward and
backward ops. Every output position of out, lse, dq, dk, dv and the mask gradient is compared with
the reference in fp64: the error must stay within a small multiple of plain PyTorch math's error in
the inputs' own precision (FlashAttention-2's criterion). Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch

from .reference import reference_attention

_ops = torch.ops.flashv100
_HEAD_DIMS = [8, 16, 24, 32, 40, 48, 64, 72, 96, 104, 128, 136, 160, 192, 224, 256]
_MASKS = ["none", "bool", "additive_broadcast", "additive_full", "padding_prefix",
          "finfo_left_pad", "finfo_right_pad", "all_masked_rows"]


@dataclass
class Case:
    seed: int
    dtype: str
    batch: int
    heads_kv: int
    group: int
    len_q: int
    len_kv: int
    head_dim: int
    layout: str        # "bhle", "blhe" or "padded" (rows inside a wider buffer)
    mask: str
    causal_mode: int   # 0 none, 1 top-left, 2 bottom-right
    dropout_p: float
    scale: float
    deterministic: bool
    mask_grad: bool


def random_case(rng: random.Random, dtypes: List[str], max_len: int) -> Case:
    lengths = [1, 2, 7, 16, 17, 31, 63, 64, 65, 127, 128, 129, 200, 255, 256, 300]
    pick_len = lambda: rng.choice([x for x in lengths if x <= max_len] +  # noqa: E731
                                  [rng.randint(1, max_len)])
    head_dim = rng.choice(_HEAD_DIMS)
    mask = rng.choice(_MASKS)
    return Case(
        seed=rng.randrange(2**31), dtype=rng.choice(dtypes), batch=rng.randint(1, 3),
        heads_kv=rng.randint(1, 3), group=rng.choice([1, 1, 2, 4]), len_q=pick_len(),
        len_kv=pick_len(), head_dim=head_dim, layout=rng.choice(["bhle", "blhe", "padded"]),
        mask=mask, causal_mode=rng.choice([0, 0, 1, 2]),
        dropout_p=rng.choice([0.0, 0.0, 0.0, 0.1, 0.5]),
        scale=rng.choice([1.0 / math.sqrt(head_dim), 1.0 / math.sqrt(head_dim), 0.05, 1.0]),
        deterministic=rng.random() < 0.3,
        mask_grad=mask.startswith("additive") and rng.random() < 0.5)


def _tensor(case: Case, gen, heads: int, length: int, device) -> torch.Tensor:
    shape = (case.batch, heads, length, case.head_dim)
    if case.layout == "blhe":
        t = torch.randn(case.batch, length, heads, case.head_dim, generator=gen).transpose(1, 2)
    elif case.layout == "padded":  # each row inside a row of 8 more elements
        t = torch.randn(*shape[:3], case.head_dim + 8, generator=gen)[..., : case.head_dim]
    else:
        t = torch.randn(*shape, generator=gen)
    dtype = getattr(torch, case.dtype)
    return t.to(device=device, dtype=dtype)  # .to keeps the strides of the layout


def _mask(case: Case, gen, device) -> Optional[torch.Tensor]:
    """Additive masks come in the inputs' dtype, as models build them."""
    b, hq, lq, lk = case.batch, case.heads_kv * case.group, case.len_q, case.len_kv
    kind, dtype = case.mask, getattr(torch, case.dtype)
    if kind == "none":
        return None
    if kind == "bool":
        return (torch.rand(b, 1, lq, lk, generator=gen) > 0.3).to(device)
    if kind == "additive_broadcast":
        return torch.randn(1, hq, 1, lk, generator=gen).to(device, dtype)
    if kind == "additive_full":
        return torch.randn(b, hq, lq, lk, generator=gen).to(device, dtype)
    if kind == "all_masked_rows":  # some query rows see no key at all
        keep = torch.rand(b, 1, lq, lk, generator=gen) > 0.5
        keep[:, :, :: 3] = False
        return keep.to(device)
    real = torch.randint(0, lk + 1, (b,), generator=gen)  # real keys per batch (0: none)
    cols = torch.arange(lk)
    if kind == "padding_prefix":
        return (cols[None, :] < real[:, None]).view(b, 1, 1, lk).to(device)
    keep = cols[None, :] >= (lk - real)[:, None] if kind == "finfo_left_pad" else \
        cols[None, :] < real[:, None]
    bias = torch.zeros(b, 1, 1, lk, dtype=dtype).masked_fill(~keep.view(b, 1, 1, lk),
                                                             torch.finfo(dtype).min)
    return bias.to(device)


def _fa2_error(actual, ref64, baseline) -> tuple:
    error = (actual.double() - ref64).abs().max().item() if actual.numel() else 0.0
    floor = (baseline.double() - ref64).abs().max().item() if baseline.numel() else 0.0
    return error, floor


_ATOL = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def _grads_with_rowsum_of(out, q, k, v, mask, grad_out, keep, dropout_p, case) -> list:
    """dq, dk, dv, dmask in fp64 from the exact probabilities, but with D = rowsum(dO * out) of
    the kernel's own (rounded) out, as every FlashAttention backward computes D."""
    f64 = lambda t: t.detach().double()  # noqa: E731
    qd, kd, vd, do = f64(q), f64(k), f64(v), f64(grad_out)
    group = case.group
    kr, vr = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    m = mask.double() if mask is not None and mask.is_floating_point() else mask
    with torch.no_grad():
        # The probabilities (dropout off), then the softmax backward written out.
        probs = reference_attention(qd, kr, torch.eye(case.len_kv, dtype=torch.float64,
                                                      device=qd.device).expand(
            *kr.shape[:2], case.len_kv, case.len_kv), m, scale=case.scale,
            causal_mode=case.causal_mode)
        z = (keep.double() / (1.0 - dropout_p)) if keep is not None else 1.0
        dp = (do @ vr.transpose(-1, -2)) * z
        d_row = (do * f64(out)).sum(-1, keepdim=True)
        ds = probs * (dp - d_row)
        dq = case.scale * ds @ kr
        dk = (case.scale * ds.transpose(-1, -2) @ qd)
        dv = (probs * z).transpose(-1, -2) @ do
        fold = lambda t: t.view(t.shape[0], -1, group, *t.shape[2:]).sum(2)  # noqa: E731
        dmask = ds.sum_to_size(mask.shape) if case.mask_grad else None
    return [dq, fold(dk), fold(dv)] + ([dmask] if dmask is not None else [])


def run_case(case: Case, device, factor: float = 4.0) -> Optional[str]:
    """None if the case passes, else a description of the first mismatch."""
    gen = torch.Generator().manual_seed(case.seed)
    hq = case.heads_kv * case.group
    q = _tensor(case, gen, hq, case.len_q, device)
    k = _tensor(case, gen, case.heads_kv, case.len_kv, device)
    v = _tensor(case, gen, case.heads_kv, case.len_kv, device)
    mask = _mask(case, gen, device)
    grad_out = torch.randn(case.batch, hq, case.len_q, case.head_dim, generator=gen).to(
        device=device, dtype=q.dtype)
    out, lse, rng_state = _ops._attention_forward(q, k, v, mask, case.dropout_p,
                                                  case.causal_mode, case.scale)
    dq, dk, dv, dmask = _ops._attention_backward(grad_out, q, k, v, mask, out, lse, rng_state,
                                                 case.dropout_p, case.causal_mode, case.scale,
                                                 case.mask_grad, case.deterministic)
    keep = None
    if case.dropout_p > 0:
        keep = _ops._dropout_mask(rng_state, case.batch, hq, case.len_q, case.len_kv,
                                  case.dropout_p)

    # The kernels hold p in fp32: kept entries are scaled by 1 / (1 - fp32(p)).
    dropout_p = torch.tensor(case.dropout_p, dtype=torch.float32).item()

    def reference(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        m = mask
        if m is not None and m.is_floating_point():
            m = m.detach().to(dtype).requires_grad_(case.mask_grad)
        o = reference_attention(*leaves, m, dropout_p, scale=case.scale, enable_gqa=True,
                                causal_mode=case.causal_mode, dropout_keep=keep)
        wrt = leaves + ([m] if case.mask_grad else [])
        grads = torch.autograd.grad(o, wrt, grad_out.to(dtype)) if o.numel() else \
            [torch.zeros_like(t) for t in wrt]
        return [o.detach(), *grads]

    ref64 = reference(torch.float64)
    # The error floors: the same math in the inputs' precision, and the exact gradients with
    # FlashAttention's D = rowsum(dO * out) taken from the rounded output (inherent to the method).
    base = reference(q.dtype)
    rounded_d = _grads_with_rowsum_of(out, q, k, v, mask, grad_out, keep, dropout_p, case)
    names = ["out", "dq", "dk", "dv"] + (["dmask"] if case.mask_grad else [])
    actual = [out, dq, dk, dv] + ([dmask] if case.mask_grad else [])
    rounded_d = [ref64[0]] + rounded_d[: len(names) - 1]
    atol = _ATOL[case.dtype]
    for name, a, r, b, d in zip(names, actual, ref64, base, rounded_d):
        if a.shape != r.shape:
            return f"{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        if not torch.isfinite(a).all():
            return f"{name}: non-finite values"
        error, floor = _fa2_error(a, r, b)
        floor = max(floor, _fa2_error(d, r, d)[0])
        scale = max(1.0, r.abs().max().item()) if r.numel() else 1.0
        if error > factor * floor + atol * scale:
            return f"{name}: error {error:.3e} > {factor} x math error {floor:.3e} + {atol:.1e}"
    return None


def sweep(device: str, cases: int, seed: int = 0, atoms=("native",), max_len: int = 300,
          dtypes: Optional[List[str]] = None) -> dict:
    """Runs `cases` random cases per atom; returns a summary with every failure."""
    from . import volta_atom

    device = torch.device(device)
    failures, counts = [], {}
    for atom in atoms:
        if device.type != "cuda" and atom != "native":
            continue
        allowed = dtypes or (["float16", "bfloat16"] if device.type == "cuda" else
                             ["float32", "float64", "bfloat16"])
        if atom == "volta":
            allowed = [d for d in allowed if d != "bfloat16"]  # no bf16 Volta tensor cores
        rng = random.Random(f"{seed}-{atom}")
        with volta_atom(atom == "volta"):
            for _ in range(cases):
                case = random_case(rng, allowed, max_len)
                try:
                    problem = run_case(case, device)
                except Exception as e:  # noqa: BLE001  (a crash is a failure to report)
                    problem = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if problem is not None:
                    failures.append({"atom": atom, "problem": problem, "case": asdict(case)})
        counts[atom] = cases
    return {"device": str(device), "torch": torch.__version__, "seed": seed, "cases": counts,
            "failures": failures}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", type=int, default=200, help="random cases per atom")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--atoms", default="volta,native",
                        help="on CUDA: volta (forced m8n8k4) and/or native (the GPU's own atom)")
    parser.add_argument("--max-len", type=int, default=300)
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args(argv)
    summary = sweep(args.device, args.cases, args.seed, tuple(args.atoms.split(",")),
                    args.max_len)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    for failure in summary["failures"][:20]:
        print("FAILED", failure["atom"], failure["problem"], json.dumps(failure["case"]))
    total = sum(summary["cases"].values())
    print(f"fuzz on {summary['device']}: {total} cases ({summary['cases']}), "
          f"{len(summary['failures'])} failures")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
