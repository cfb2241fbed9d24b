"""Stage 2 of the rewrite: decide the fused call (AttentionMatch -> FusedCall).

Pure: reads the graph and the example values, creates no node.  A :class:`FusedCall` says which
tensors feed ``flashv100.attention`` and how each is brought to the op's layout
(:class:`Operand`), the total ``scale``, the mask as an ordered list of :data:`MaskTerm` values,
whether the mask is proven causal, GQA, dropout, and how the result goes back to the model's
layout; or, when a window, soft-capping or an ALiBi bias express the whole mask, the
FlashAttention-2 op's :class:`FlashRules` instead of the mask.  :mod:`._emit` turns it into
nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch.fx import Node

from ._fx_nodes import is_number, ndim, norm, shape, shapes_eq, sym_eq, val
from ._masks import (CAUSAL, EVERY, AdditiveMask, Const, MaskFacts, MaskRole, causal_bound,
                     is_neg, keep_region, position_bias)
from ._match import (AddMask, AttentionMatch, FillMask, Product, Reject, ReshapeScores,
                     ScaleBy, ScaleByTensor, SdpaMatch, Tanh, nd_dim)


@dataclass(frozen=True)
class Operand:
    """A tensor of the fused call: ``source``, then a permutation (or a swap of the last two
    dims), then its leading dims reshaped from ``layout[0]`` to ``layout[1]``."""
    source: Any
    permute: Optional[tuple] = None
    transpose_last2: bool = False
    layout: Optional[tuple] = None  # (from, to) leading dims

    def shape(self) -> Optional[tuple]:
        s = shape(self.source)
        if s is None:
            return None
        if self.transpose_last2:
            s = s[:-2] + (s[-1], s[-2])
        if self.permute is not None:
            s = tuple(s[p] for p in self.permute)
        if self.layout is not None:
            s = tuple(self.layout[1]) + s[-2:]
        return s

    def relaid(self, frm, to) -> "Operand":
        if shapes_eq(frm, to):
            return self
        return Operand(self.source, self.permute, self.transpose_last2, (frm, to))

    @property
    def plain(self) -> bool:
        return self.permute is None and not self.transpose_last2 and self.layout is None


# ---- the mask, as an ordered program over the scores' layouts ----------------------------------

@dataclass(frozen=True)
class AddTerm:
    """Add ``beta * mask`` (a float tensor in scores layout ``layout``) to the additive mask;
    eager adds it to scores of ``dtype``."""
    mask: Any
    beta: float
    layout: tuple
    dtype: torch.dtype
    promoted_bool: bool = False  # a bool tensor: adds 1.0 where True


@dataclass(frozen=True)
class ScaleAdded:
    """Multiply the additive mask built so far (a scale applied to the scores after it)."""
    factor: float


@dataclass(frozen=True)
class ScaleAddedByTensor:
    node: Node
    divide: bool


@dataclass(frozen=True)
class FillTerm:
    """Scores replaced by the large negative constant ``value`` where the bool ``cond`` is True
    (``fill_where_true``) or False."""
    cond: Any
    fill_where_true: bool
    value: float
    layout: tuple


@dataclass(frozen=True)
class GivenMask:
    """An SDPA call's own ``attn_mask``, passed on unchanged."""
    mask: Any


MaskTerm = Union[AddTerm, ScaleAdded, ScaleAddedByTensor, FillTerm, GivenMask]


@dataclass(frozen=True)
class SaturatedRows:
    """Rows whose every key is masked by one finite large negative value (left padding under a
    ``finfo.min`` mask): eager's softmax sees equal scores there and averages v over *all* keys.
    The op alone would not (causal tile skipping hides the keys past the diagonal; its fp32
    math does not saturate a fp16/bf16 mask), so the emitted graph replaces those rows by the
    average.  ``grad_through_scores``: the saturating values were added to the scores (their
    gradient reaches q and k through the softmax Jacobian at the uniform row, as in eager);
    False when a fill replaced the scores (no gradient to q and k, as in eager)."""
    grad_through_scores: bool
    threshold: float  # a row is saturated when all its mask values are equal and <= this


@dataclass(frozen=True)
class AlibiSlopes:
    """The ALiBi slopes of a site: ``factor * per_head`` for each (batch, head) of the scores'
    leading dims ``layout`` (where the bias is added), ``per_head`` (None: 1) viewed as
    ``per_head_shape`` broadcasting against them from the right."""
    per_head: Optional[Node]
    per_head_shape: tuple
    factor: float
    layout: tuple


@dataclass(frozen=True)
class FlashRules:
    """A site computed by the FlashAttention-2 op (``flashv100::_flash_forward``, which takes no
    mask): its window (-1: unbounded; right 0: causal, aligned bottom-right), softcap (0: off)
    and ALiBi slopes express the whole mask."""
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi: Optional[AlibiSlopes] = None


@dataclass
class FusedCall:
    """One fused call replacing ``anchor`` (the p @ v product or SDPA call):
    ``flashv100.attention``, or the FlashAttention-2 op where ``flash`` is set."""
    anchor: Node
    q: Operand
    k: Operand
    v: Operand
    scale: float
    is_causal: bool
    enable_gqa: bool
    dropout_p: float
    mask_terms: list = field(default_factory=list)  # empty: no mask
    mask_layout: tuple = ()  # leading dims of the scores in the op's layout
    q_scale_tensors: list = field(default_factory=list)  # [(node, divide)] multiplied onto q
    result_layout: Optional[tuple] = None  # (from, to) leading dims of the result
    result_permute: Optional[list] = None
    dead: list = field(default_factory=list)  # nodes of the unfused subgraph, erased after
    read_from: Optional[Node] = None  # where the unfused subgraph starts reading its inputs
    causal_note: str = ""
    origin: str = "softmax"  # "softmax" | "sdpa"
    saturated_rows: Optional[SaturatedRows] = None
    flash: Optional[FlashRules] = None
    note: str = ""  # why a window or ALiBi bias stays a mask


def device_supported(t: Any, force: bool) -> tuple[bool, str]:
    """The pass targets CUDA devices without a PyTorch flash backend (sm < 80), or any when
    forced."""
    if force:
        return True, ""
    if not isinstance(t, torch.Tensor):
        return False, "no tensor metadata"
    dev = t.device
    if dev.type != "cuda":
        return False, f"device {dev.type} is not targeted (pass force=True to rewrite anyway)"
    try:
        cap = torch.cuda.get_device_capability(dev)
    except Exception as e:  # pragma: no cover - no driver
        return False, f"cannot query the capability of {dev}: {e}"
    if cap >= (8, 0):
        return False, (f"{dev} has compute capability {cap[0]}.{cap[1]} (PyTorch's own flash "
                       "backend applies; pass force=True to rewrite anyway)")
    return True, ""


def _check_device(x: Any, force: bool) -> None:
    ok, why = device_supported(val(x), force)
    if not ok:
        raise Reject(why)


def _scalar_factor(o: Any) -> Optional[tuple]:
    """(operand, factor) when ``o`` multiplies or divides by a non-zero number, else None."""
    if o.name in ("mul", "div") and is_number(o.get("other")) and o.get("other") != 0:
        c = float(o.get("other"))
        return o.get("self"), (c if o.name == "mul" else 1.0 / c)
    if o.name == "mul" and is_number(o.get("self")):
        return o.get("other"), float(o.get("self"))
    return None


def _peel_scale(n: Any) -> tuple[Any, float]:
    s = 1.0
    for _ in range(16):
        o = norm(n)
        if o is None or o.inplace:
            break
        scaled = _scalar_factor(o)
        if scaled is None:
            break
        n, c = scaled
        s *= c
    return n, s


def _is_last2_transpose(op, nd: int) -> bool:
    if op is None or op.name != "transpose":
        return False
    d0, d1 = nd_dim(op.get("dim0"), nd), nd_dim(op.get("dim1"), nd)
    return d0 is not None and {d0, d1} == {nd - 2, nd - 1}


def _perm_of(op) -> Optional[list]:
    dims = op.varargs if op.varargs is not None else op.get("dims")
    if dims is None:
        return None
    dims = list(dims)
    if not all(isinstance(d, int) for d in dims):
        return None
    nd = len(dims)
    return [d + nd if d < 0 else d for d in dims]


def _parse_einsum(eq: Any):
    if not isinstance(eq, str) or "->" not in eq or "." in eq:
        return None
    lhs, out = eq.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ins) != 2:
        return None
    for s in ins + [out]:
        if len(set(s)) != len(s):
            return None
    return ins[0], ins[1], out


def _permuted(n: Any, labels: str, want: str) -> Operand:
    perm = [labels.index(c) for c in want]
    return Operand(n) if perm == list(range(len(perm))) else Operand(n, permute=tuple(perm))


def _q_and_k(qk: Product) -> tuple[Operand, Operand, float]:
    """q and k (in [..., L, E] / [..., S, E]) from the q @ k^T product, with its scale."""
    scale = 1.0
    if qk.kind == "matmul":
        A, B = qk.left, qk.right
        nd = ndim(A)
        if nd is None or ndim(B) != nd or nd < 2:
            raise Reject("q @ k^T operands of different rank (broadcasting matmul)")
        A, s = _peel_scale(A)
        scale *= s
        flip = False
        for _ in range(16):
            o = norm(B)
            if o is None or o.inplace:
                break
            scaled = _scalar_factor(o)
            if scaled is not None:
                B, c = scaled
                scale *= c
            elif _is_last2_transpose(o, nd):
                flip = not flip
                B = o.get("self")
            elif o.name == "identity":
                B = o.get("self")
            else:
                break
        if flip:
            return Operand(A), Operand(B), scale
        bo = norm(B)
        perm = _perm_of(bo) if bo is not None and bo.name == "permute" else None
        if perm is not None and len(perm) == nd:
            perm[-1], perm[-2] = perm[-2], perm[-1]
            if perm == list(range(nd)):
                return Operand(A), Operand(bo.get("self")), scale
            return Operand(A), Operand(bo.get("self"), permute=tuple(perm)), scale
        return Operand(A), Operand(B, transpose_last2=True), scale
    parsed = _parse_einsum(qk.equation)
    if parsed is None:
        raise Reject(f"einsum {qk.equation!r} is not a q @ k^T contraction")
    xl, yl, out = parsed
    X, Y = qk.left, qk.right
    if len(out) < 2:
        raise Reject("einsum output has fewer than two dims")
    batch, l, s_ = out[:-2], out[-2], out[-1]
    if l in yl and l not in xl:  # einsum(k, q) spelling
        X, Y, xl, yl = Y, X, yl, xl
    common = [c for c in xl if c in yl and c not in out]
    if len(common) != 1:
        raise Reject(f"einsum {qk.equation!r} is not a q @ k^T contraction")
    e = common[0]
    if sorted(xl) != sorted(batch + l + e) or sorted(yl) != sorted(batch + s_ + e):
        raise Reject(f"einsum {qk.equation!r} is not a q @ k^T contraction")
    X, s = _peel_scale(X)
    scale *= s
    Y, s = _peel_scale(Y)
    scale *= s
    return _permuted(X, xl, batch + l + e), _permuted(Y, yl, batch + s_ + e), scale


def _v(pv: Product, q_nd: Optional[int]) -> tuple[Operand, Optional[list]]:
    """v (in [..., S, Ev]) from the p @ v product, and the permutation of the result back."""
    if pv.kind == "matmul":
        if ndim(pv.right) != q_nd:
            raise Reject("p @ v operands of different rank (broadcasting matmul)")
        return Operand(pv.right), None
    parsed = _parse_einsum(pv.equation)
    if parsed is None:
        raise Reject(f"einsum {pv.equation!r} is not a p @ v contraction")
    pl, vl, out = parsed
    if len(pl) != q_nd:
        raise Reject("einsum p @ v rank mismatch")
    batch, l, s_ = pl[:-2], pl[-2], pl[-1]
    dl = [c for c in vl if c not in pl]
    if len(dl) != 1 or sorted(vl) != sorted(batch + s_ + dl[0]) \
            or sorted(out) != sorted(batch + l + dl[0]):
        raise Reject(f"einsum {pv.equation!r} is not a p @ v contraction")
    std = batch + l + dl[0]
    return _permuted(pv.right, vl, batch + s_ + dl[0]), (
        [std.index(c) for c in out] if out != std else None)


def _check_operands(q: Operand, k: Operand, v: Operand, m: AttentionMatch, out: Node) -> bool:
    """Dtype/device/shape rules of the op; returns whether k/v broadcast one head (MQA)."""
    qv, kv, vv = val(q.source), val(k.source), val(v.source)
    for t, nm in ((qv, "q"), (kv, "k"), (vv, "v")):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise Reject(f"{nm} is not a floating tensor")
    if not (qv.dtype == kv.dtype == vv.dtype):
        raise Reject(f"q/k/v dtypes differ ({qv.dtype}, {kv.dtype}, {vv.dtype})")
    if not (qv.device == kv.device == vv.device):
        raise Reject("q/k/v on different devices")
    if val(out).dtype != qv.dtype:
        raise Reject(f"attention output dtype {val(out).dtype} differs from q dtype "
                     f"{qv.dtype}")
    qs, ks, vs = q.shape(), k.shape(), v.shape()
    if len(qs) < 2:
        raise Reject("q has fewer than 2 dims")
    mqa = False
    if not (shapes_eq(qs[:-2], ks[:-2]) and shapes_eq(ks[:-2], vs[:-2])):
        # multi-query attention by broadcasting one k/v head: SDPA's GQA with Hk = 1
        if len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and \
                shapes_eq(qs[:-3], ks[:-3]) and shapes_eq(qs[:-3], vs[:-3]) and \
                sym_eq(ks[-3], 1) and sym_eq(vs[-3], 1):
            mqa = True
        else:
            raise Reject("q/k/v batch dims differ (broadcasting)")
    if not (sym_eq(qs[-1], ks[-1]) and sym_eq(ks[-2], vs[-2])):
        raise Reject("q/k/v inner dims do not match")
    for n in m.probs_chain:
        vt = val(n)
        if isinstance(vt, torch.Tensor) and vt.dtype != qv.dtype and \
                vt.dtype not in (torch.float32, torch.float64):
            raise Reject(f"probabilities cast to lower precision {vt.dtype}")
    sm_dtype = m.softmax.get("dtype")
    if sm_dtype is not None and sm_dtype not in (qv.dtype, torch.float32, torch.float64):
        raise Reject(f"softmax in lower precision {sm_dtype}")
    return mqa


@dataclass
class _MaskPiece:
    """A mask piece for the causal and window proofs: the tensor, how it masks, the positive
    factor applied to it after it meets the scores (None: unknown), the fill value of fills, the
    scores' leading dims where it applies."""
    node: Any
    role: MaskRole
    factor: Optional[float]
    fill: Optional[float] = None
    layout: tuple = ()


def plan_softmax(m: AttentionMatch, facts: MaskFacts, force: bool) -> FusedCall:
    q, k, scale = _q_and_k(m.qk)
    v, out_perm = _v(m.pv, ndim(q.source))

    # the op runs in the softmax's layout (the leading dims of the scores there)
    sb = shape(m.softmax.get("self"))[:-2]
    qb = shape(m.qk.node)[:-2]
    pb = shape(m.pv.left)[:-2]
    if m.pv.kind == "einsum" and not shapes_eq(pb, sb):
        raise Reject("einsum p @ v after a reshape of the probabilities")
    q, k, v = q.relaid(qb, sb), k.relaid(qb, sb), v.relaid(pb, sb)
    _check_device(q.source, force)
    mqa = _check_operands(q, k, v, m, m.pv.node)

    # masks and scale: replayed from the product outwards
    scores = shape(m.qk.node)
    scores_dtype = val(m.softmax.get("self")).dtype
    pieces: list[_MaskPiece] = []
    terms: list = []
    q_scale_tensors: list = []
    softcap = None  # after a tanh: the factors applied to tanh's output (the op's softcap)
    cur_b = qb
    for st in reversed(m.steps):
        if isinstance(st, ReshapeScores):
            cur_b = shape(st.node)[:-2]
        elif isinstance(st, Tanh):
            if pieces or terms:
                raise Reject("a mask applied before the tanh soft-capping (the op caps the "
                             "scores before masking them)")
            softcap = 1.0
        elif isinstance(st, ScaleBy):
            c = st.factor
            if c <= 0 and (pieces or terms):
                raise Reject("non-positive scale applied after a mask")
            if softcap is not None:
                if c <= 0:
                    raise Reject("a non-positive factor after the tanh soft-capping")
                softcap *= c
            scale *= c
            for pc in pieces:
                pc.factor = None if pc.factor is None else pc.factor * c
            if any(isinstance(t, AddTerm) for t in terms):
                terms.append(ScaleAdded(c))
        elif isinstance(st, ScaleByTensor):
            if softcap is not None:
                raise Reject("a tensor factor applied after the tanh soft-capping (the op's "
                             "softcap is a constant)")
            if any(isinstance(t, FillTerm) for t in terms):
                raise Reject("tensor scale applied after a masked_fill")
            q_scale_tensors.append((st.node, st.divide))
            for pc in pieces:
                pc.factor = None
            if any(isinstance(t, AddTerm) for t in terms):
                terms.append(ScaleAddedByTensor(st.node, st.divide))
        elif isinstance(st, AddMask):
            mv = val(st.mask)
            if isinstance(mv, torch.Tensor) and mv.dtype == torch.bool:
                # PyTorch promotes it: 0/1 added to the scores, never an attend mask
                terms.append(AddTerm(st.mask, st.beta, cur_b, st.dtype, promoted_bool=True))
                continue
            if not isinstance(mv, torch.Tensor) or not mv.is_floating_point():
                raise Reject("additive mask is not a floating or bool tensor")
            pieces.append(_MaskPiece(st.mask, MaskRole.ADDITIVE, st.beta, layout=cur_b))
            terms.append(AddTerm(st.mask, st.beta, cur_b, st.dtype))
        else:
            assert isinstance(st, FillMask)
            fv = facts.fact(st.value)
            if not isinstance(fv, Const) or not is_neg(fv.value):
                raise Reject("masked_fill/where fills a value that is not a large "
                             "negative constant")
            cv = val(st.cond)
            if not isinstance(cv, torch.Tensor) or cv.dtype != torch.bool:
                raise Reject("fill condition is not a bool tensor")
            role = MaskRole.MASKED if st.fill_where_true else MaskRole.KEEP
            pieces.append(_MaskPiece(st.cond, role, 1.0, fv.value, cur_b))
            terms.append(FillTerm(st.cond, st.fill_where_true, fv.value, cur_b))

    for pc in pieces:
        if pc.fill is not None and pc.fill != -math.inf and not (
                pc.factor is not None and is_neg(pc.fill * pc.factor)):
            raise Reject("a masked_fill value is scaled down until it no longer masks")
    implied = exact = False
    for pc in pieces:
        if not _positional(pc, scores):
            continue
        imp, ex = causal_bound(facts, pc.node, pc.role, pc.factor)
        if imp and pc.role is MaskRole.ADDITIVE and not _saturates(facts, pc, scores_dtype):
            # rows masked everywhere are then not uniform in eager, and causal tile skipping
            # would change them: the mask carries the causality itself
            continue
        implied = implied or imp
        exact = exact or (ex and len(pieces) == 1)

    gqa = mqa
    if not gqa:
        k, v, gqa = _strip_gqa(k, v)
    call = FusedCall(
        anchor=m.pv.node, q=q, k=k, v=v, scale=scale, is_causal=implied, enable_gqa=gqa,
        dropout_p=m.dropout_p, mask_terms=terms, mask_layout=sb,
        q_scale_tensors=q_scale_tensors, result_layout=(sb, pb), result_permute=out_perm,
        dead=m.probs_chain, read_from=m.qk.node)
    rules, why = _flash_rules(facts, pieces, terms, scores, scores_dtype, sb, q, v,
                              softcap or 0.0)
    if rules is not None:
        call.mask_terms, call.is_causal, call.flash = [], False, rules
        return call
    if softcap is not None:
        raise Reject(f"tanh soft-capping needs the FlashAttention-2 op, which cannot take "
                     f"this site: {why}")
    call.note = why
    if exact:
        call.mask_terms = []
    call.is_causal, call.saturated_rows = _saturated_rows(call.mask_terms, implied)
    return call


def _positional(pc: _MaskPiece, scores: tuple) -> bool:
    """Whether a piece spans the scores' last two dims (its facts then speak of them)."""
    ps = shape(pc.node)
    return ps is not None and len(ps) >= 2 and sym_eq(ps[-1], scores[-1]) and \
        sym_eq(ps[-2], scores[-2])


def _flash_rules(facts: MaskFacts, pieces: list, terms: list, scores: tuple,
                 dtype: torch.dtype, layout: tuple, q: Operand, v: Operand,
                 softcap: float) -> tuple[Optional[FlashRules], str]:
    """The FlashAttention-2 op's rules for a mask program, when they express it exactly and
    the site needs them (a window other than causal, an ALiBi bias, soft-capping); else None
    and why not ("" when nothing calls for them).

    Every piece must be an exact band of diagonals (their intersection one interval) or the
    one ALiBi bias; every query row must see a key (the op gives 0 where eager's finite masks
    give an average over all keys)."""
    alibi_pieces, plain, band = [], 0, EVERY
    for pc in pieces:
        bias = position_bias(facts, pc.node) if pc.role is MaskRole.ADDITIVE else None
        if bias is not None:
            alibi_pieces.append((pc, bias))
            continue
        keep = keep_region(facts, pc.node, pc.role, pc.factor) if _positional(pc, scores) \
            else None
        if keep is None or not keep.exact or _requires_grad(pc.node) or (
                pc.role is MaskRole.ADDITIVE and keep.inside != EVERY and
                not _saturates(facts, pc, dtype)):
            plain += 1
        else:
            band = band & keep.inside
    if not (softcap or alibi_pieces or band not in (EVERY, CAUSAL)):
        return None, ""
    what = "window" if band not in (EVERY, CAUSAL) else "ALiBi bias" if alibi_pieces else ""
    stays = f"the {what} stays a mask: " if what and not softcap else ""
    if plain or any(isinstance(t, AddTerm) and t.promoted_bool for t in terms):
        return None, (f"{stays}the mask also holds more than a band of diagonals (e.g. "
                      "padding), which the FlashAttention-2 op cannot take")
    if len(alibi_pieces) > 1:
        return None, f"{stays}two position biases"
    if len(layout) not in (1, 2):
        return None, f"{stays}{len(layout) + 2}-D scores (the FlashAttention-2 op takes 3-D " \
                     "or 4-D)"
    if not sym_eq(q.shape()[-1], v.shape()[-1]):
        return None, f"{stays}the value head dim differs from the query's (the " \
                     "FlashAttention-2 op takes one head dim)"
    len_q, len_k = scores[-2], scores[-1]
    if isinstance(len_q, int) and isinstance(len_k, int):
        shift = len_k - len_q
    elif sym_eq(len_q, len_k):
        shift = 0
    else:
        return None, f"{stays}query and key lengths that may differ (symbolic)"
    span = band.interval()
    if span is None:
        return None, f"{stays}the mask keeps no single band of diagonals"
    lo, hi = span
    if hi < 0 or lo > shift:
        return None, f"{stays}query rows that see no key (eager's fully masked rows are not " \
                     "the op's)"
    if hi < shift:
        return None, f"{stays}a band that ends left of the bottom-right diagonal (the op's " \
                     "windows are aligned bottom-right)"
    slopes = None
    if alibi_pieces:
        (pc, bias), = alibi_pieces
        slopes, why = _alibi_slopes(pc, bias, shift, hi)
        if slopes is None:
            return None, f"{stays}{why}"
    return FlashRules(window_left=-1 if lo == -math.inf else shift - lo,
                      window_right=-1 if hi == math.inf else hi - shift, softcap=softcap,
                      alibi=slopes), ""


def _alibi_slopes(pc: _MaskPiece, bias, shift: int, hi) -> tuple[Optional[AlibiSlopes], str]:
    """The op's slopes for an ALiBi piece kept on the diagonals <= ``hi``: its bias is
    -slope * |d - shift| there, equal to the piece up to a constant per row."""
    if pc.factor is None:
        return None, "an ALiBi bias scaled by a tensor"
    if _requires_grad(bias.per_head):
        return None, "learnable ALiBi slopes (the op gives them no gradient)"
    lead = list(bias.per_head_shape[:-2])
    while lead and lead[0] == 1:
        lead.pop(0)
    if any(d != 1 for d in bias.per_head_shape[-2:]) or len(lead) > len(pc.layout):
        return None, "ALiBi slopes that vary along the query rows"
    coef = bias.coef * pc.factor
    if bias.distance_from is None:
        if hi > shift:
            return None, ("an ALiBi bias slope * j on keys right of the diagonal (the op's "
                          "ALiBi is -slope * |i - j|: equal only for causal attention)")
        factor = coef
    else:
        if bias.distance_from != shift and hi > min(bias.distance_from, shift):
            return None, "an ALiBi distance |i - j + c| centred off the op's diagonal"
        factor = -coef
    return AlibiSlopes(bias.per_head, tuple(lead), factor, pc.layout), ""


def _saturated_rows(terms: list, is_causal: bool) -> tuple[bool, Optional[SaturatedRows]]:
    """(is_causal, SaturatedRows or None) for a mask program: where the op's own handling of
    rows masked everywhere by a finite value would differ from eager's.

    Additive fp32/fp64 masks need nothing without causality (the op adds them in fp32 and
    saturates as eager does).  Causal tile skipping, fills (which eager's gradient does not go
    through) and masks added to fp16/bf16 scores (which eager saturates, fp32 does not) do.  A
    mask that requires grad keeps its gradient exact on those rows only without the fast path:
    it then carries the causality itself."""
    adds = [t for t in terms if isinstance(t, AddTerm)]
    fills = [t for t in terms if isinstance(t, FillTerm) and t.value != -math.inf]
    if not adds and not fills:
        return is_causal, None  # no mask, or bool masks only: -inf semantics, see the README
    if is_causal and any(_requires_grad(t.mask) for t in adds):
        is_causal = False
    low = any(t.dtype in (torch.float16, torch.bfloat16) for t in adds)
    if not (is_causal or fills or low):
        return is_causal, None
    if any(_requires_grad(t.mask) for t in adds):
        raise Reject("a mask that requires grad, with fully masked rows the op would compute "
                     "differently from eager (fills or a low-precision additive mask)")
    return is_causal, SaturatedRows(not fills, max([saturation(t.dtype) for t in adds] +
                                                   [saturation(torch.float32)] * bool(fills)))


def saturation(dtype: torch.dtype) -> float:
    """Mask values at or below this (the top binade of ``dtype``) absorb any attention score
    added to them in ``dtype``: s + m rounds to m."""
    return torch.finfo(dtype).min / 2


def _saturates(facts: MaskFacts, pc: _MaskPiece, dtype: torch.dtype) -> bool:
    """Whether the values an additive piece puts where it masks absorb the scores."""
    f = facts.fact(pc.node)
    return isinstance(f, AdditiveMask) and pc.factor is not None and \
        f.bound * pc.factor <= saturation(dtype)


def _requires_grad(x: Any) -> bool:
    v = val(x)
    return isinstance(v, torch.Tensor) and v.requires_grad


def plan_sdpa(m: SdpaMatch, facts: MaskFacts, force: bool) -> FusedCall:
    _check_device(m.query, force)
    qv = val(m.query)
    scale, q_scale_tensors = m.scale, []
    if scale is None:
        e = qv.shape[-1]
        if not isinstance(e, int):
            raise Reject("default scale with a dynamic head dim")
        scale = 1.0 / math.sqrt(e)
    elif not is_number(scale):
        q_scale_tensors = [(scale, False)]
        scale = 1.0
    mask, is_causal, note = m.attn_mask, m.is_causal, ""
    k, v, gqa = Operand(m.key), Operand(m.value), m.enable_gqa
    if not gqa:
        k, v, gqa = _strip_gqa(k, v)
    call = FusedCall(
        anchor=m.node, q=Operand(m.query), k=k, v=v, scale=float(scale), is_causal=is_causal,
        enable_gqa=gqa, dropout_p=m.dropout_p, mask_layout=tuple(qv.shape[:-2]),
        q_scale_tensors=q_scale_tensors, origin="sdpa")
    if mask is not None and not is_causal:
        mv = val(mask)
        role = MaskRole.KEEP if mv.dtype == torch.bool else MaskRole.ADDITIVE
        piece = _MaskPiece(mask, role, 1.0, layout=call.mask_layout)
        scores = tuple(qv.shape[-2:-1]) + (val(m.key).shape[-2],)
        rules, call.note = _flash_rules(
            facts, [piece], [], scores, mv.dtype if mv.is_floating_point() else torch.float32,
            call.mask_layout, call.q, call.v, 0.0)
        if rules is not None:
            call.flash = rules
            return call
        if _positional(piece, scores):
            imp, ex = causal_bound(facts, mask, role)
            if imp and role is MaskRole.ADDITIVE and not _saturates(facts, piece, torch.float32):
                imp = False  # see plan_softmax
            if imp:
                is_causal = True
                note = " (mask proven causal)"
                if ex:
                    mask = None
    saturated = None
    if note and mask is not None and val(mask).is_floating_point():
        # eager SDPA averages rows masked everywhere by a finite value over all keys
        if _requires_grad(mask):
            is_causal, note = m.is_causal, ""
        else:
            saturated = SaturatedRows(True, saturation(torch.float32))
    call.is_causal, call.causal_note, call.saturated_rows = is_causal, note, saturated
    call.mask_terms = [GivenMask(mask)] if mask is not None else []
    return call


def _is_insert_at2(index) -> bool:
    if not isinstance(index, tuple):
        return False
    items = list(index)
    if items and items[0] is Ellipsis:
        # x[..., None, :, :]  ->  (Ellipsis, None, slice, slice) inserts at -3 == 2 for 4-D
        return items[1:] == [None, slice(None), slice(None)]
    return (len(items) >= 3 and items[0] == slice(None) and items[1] == slice(None)
            and items[2] is None and all(i == slice(None) or i is Ellipsis for i in items[3:]))


def _strip_repeat(n: Any):
    """(source, repeats) when n is repeat_kv(source) / repeat_interleave(source, r, dim=1)."""
    nv = val(n)
    if not isinstance(n, Node) or not isinstance(nv, torch.Tensor) or nv.dim() != 4:
        return None
    o = norm(n)
    while o is not None and o.name == "identity":
        n = o.get("self")
        o = norm(n)
    if o is None:
        return None
    src = None
    if o.name == "repeat_interleave":
        r, d = o.get("repeats"), o.get("dim")
        if isinstance(r, int) and d in (1, -3):
            src = o.get("self")
    elif o.name == "reshape":
        e = norm(o.get("self"))
        if e is not None and e.name == "expand":
            u = norm(e.get("self"))
            if u is not None and (
                    (u.name == "unsqueeze" and u.get("dim") in (2, -3)) or
                    (u.name == "getitem" and _is_insert_at2(u.get("index")))):
                src = u.get("self")
    if src is None:
        return None
    sv = val(src)
    if not isinstance(sv, torch.Tensor) or sv.dim() != 4:
        return None
    hq, hk = nv.shape[1], sv.shape[1]
    if not (isinstance(hq, int) and isinstance(hk, int)) or hk == 0 or hq % hk:
        return None
    if not (sym_eq(nv.shape[0], sv.shape[0]) and sym_eq(nv.shape[2], sv.shape[2]) and
            sym_eq(nv.shape[3], sv.shape[3])):
        return None
    return src, hq // hk


def _strip_gqa(k: Operand, v: Operand) -> tuple[Operand, Operand, bool]:
    """``repeat_kv``-style copies of k and v dropped: ``enable_gqa=True`` on their sources."""
    if not (k.plain and v.plain):
        return k, v, False
    sk, sv = _strip_repeat(k.source), _strip_repeat(v.source)
    if sk is None or sv is None or sk[1] != sv[1] or sk[1] == 1:
        return k, v, False
    return Operand(sk[0]), Operand(sv[0]), True
