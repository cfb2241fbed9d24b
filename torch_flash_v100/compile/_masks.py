"""What the construction of an attention mask (or position bias) proves about it.

An abstract interpreter over the FX nodes that build a mask gives each node a *fact*.  Positions
are those of the tensor's last two dims once broadcast against the scores: ``i`` (dim -2, the
query) and ``j`` (dim -1, the key); ``d = j - i`` numbers the diagonals, and a
:class:`Diagonals` value is a set of them.  The facts:

* :class:`Const`: every element equals a Python constant;
* :class:`LinearIndex`: element = offset + sum of coef * (its index along an axis): ``arange``
  and what is computed from it;
* :class:`DiagonalDistance`: element = ``|d - offset|``;
* :class:`Truth`: a bool-like tensor, true at most on the diagonals ``inside`` and at least on
  ``contains`` (``exact`` when they are the same set);
* :class:`AdditiveMask`: a float mask at most ``bound`` (a large negative value) on the diagonals
  ``masked``, and 0 elsewhere when ``exact``.  Other terms added to a mask are assumed not to be
  hugely positive;
* :class:`PositionBias`: an ALiBi bias, ``coef * per_head * (j or |d - offset|)`` plus values
  constant along each row (which a softmax over the row does not see).

:func:`keep_region` says which diagonals a mask piece keeps (how the pass proves causality and
sliding windows), :func:`position_bias` whether an additive piece is an ALiBi bias.  Only sound
rules are applied; anything unknown yields no fact, so the mask stays a plain mask.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
from torch.fx import Node

from ._fx_nodes import is_number, mutated, ndim, norm, shape, sym_eq, val

# An additive value that removes a position from the softmax (exp underflows to exactly 0).
NEG_THRESHOLD = -1.0e4

_INF = math.inf


class MaskRole(enum.Enum):
    """How a mask piece acts on the scores."""
    ADDITIVE = "additive"  # a float tensor added to the scores
    KEEP = "keep"  # a bool tensor, True keeps (where(cond, scores, fill), SDPA bool masks)
    MASKED = "masked"  # a bool tensor, True removes (masked_fill conditions)


def is_neg(v: Any) -> bool:
    return is_number(v) and (v == -math.inf or v <= NEG_THRESHOLD)


# ---- sets of diagonals ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Diagonals:
    """A set of diagonals d = j - i: sorted, disjoint, non-adjacent closed integer intervals
    ``(lo, hi)``; ``-inf`` / ``inf`` for unbounded ends."""
    intervals: tuple = ()

    @staticmethod
    def of(*intervals) -> "Diagonals":
        spans = sorted((lo, hi) for lo, hi in intervals if lo <= hi)
        merged: list = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return Diagonals(tuple(merged))

    @staticmethod
    def at_most(c) -> "Diagonals":
        return Diagonals.of((-_INF, c))

    @staticmethod
    def at_least(c) -> "Diagonals":
        return Diagonals.of((c, _INF))

    def __and__(self, other: "Diagonals") -> "Diagonals":
        return Diagonals.of(*((max(a, c), min(b, d)) for a, b in self.intervals
                              for c, d in other.intervals))

    def __or__(self, other: "Diagonals") -> "Diagonals":
        return Diagonals.of(*(self.intervals + other.intervals))

    def complement(self) -> "Diagonals":
        out, lo = [], -_INF
        for a, b in self.intervals:
            if a != -_INF:
                out.append((lo, a - 1))
            lo = b + 1
        if lo != _INF:
            out.append((lo, _INF))
        return Diagonals.of(*out)

    def shifted(self, by) -> "Diagonals":
        return Diagonals.of(*((a + by, b + by) for a, b in self.intervals))

    def issubset(self, other: "Diagonals") -> bool:
        return (self & other) == self

    def interval(self) -> Optional[tuple]:
        """(lo, hi) when the set is one interval, else None."""
        return self.intervals[0] if len(self.intervals) == 1 else None


EVERY = Diagonals.of((-_INF, _INF))
NONE = Diagonals()
CAUSAL = Diagonals.at_most(0)


# ---- the facts -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Const:
    """Every element equals ``value`` (a Python number or bool)."""
    value: Any


@dataclass(frozen=True)
class LinearIndex:
    """Element = ``offset`` + sum of ``coef`` * (the element's index along ``axis``) over
    ``terms`` ((axis, coef) pairs, axes counted from the end, no size-1 axis, sorted)."""
    terms: tuple
    offset: int

    def coef(self, axis: int) -> int:
        return dict(self.terms).get(axis, 0)

    def diagonal_offset(self) -> Optional[tuple]:
        """(sign, c) when element = sign * d + c, else None."""
        t = dict(self.terms)
        if set(t) == {-1, -2} and t[-1] == -t[-2] and abs(t[-1]) == 1:
            return t[-1], self.offset
        return None


@dataclass(frozen=True)
class DiagonalDistance:
    """Element = |d - ``offset``|."""
    offset: int


@dataclass(frozen=True)
class Truth:
    """A bool-like tensor: where it is true, d lies in ``inside``; where d lies in ``contains``,
    it is true.  ``is01``: it holds only 0 and 1 (bool, or a cast of one)."""
    inside: Diagonals
    contains: Diagonals
    is01: bool

    @property
    def exact(self) -> bool:
        return self.inside == self.contains


@dataclass(frozen=True)
class AdditiveMask:
    """A float mask: <= ``bound`` (large negative) on the diagonals ``masked``; ``exact``: 0 on
    every other diagonal."""
    masked: Diagonals
    bound: float
    exact: bool


@dataclass(frozen=True)
class PositionBias:
    """``coef * per_head * g + r``: ``g`` = j (``distance_from`` None) or |d - distance_from|,
    ``r`` constant along each row, ``per_head`` a tensor (None: 1) which, viewed as
    ``per_head_shape``, broadcasts from the right against this one (size 1 along j, and along i
    too for the distance).  ALiBi."""
    per_head: Optional[Node]
    coef: float
    distance_from: Optional[int] = None
    per_head_shape: tuple = ()

    def moved(self, src_nd: int, out_nd: int, dim_map: dict,
              whole: Optional[set] = None) -> Optional["PositionBias"]:
        """This bias after a view that moves dim p of the tensor to ``dim_map[p]`` (other dims go
        away; ``whole``: the dims kept whole, None: all): the per-head factor's dims move
        along, and may neither go away nor be cut."""
        if self.per_head is None:
            return self
        new = [1] * out_nd
        for k in range(1, len(self.per_head_shape) + 1):
            size = self.per_head_shape[-k]
            if size == 1:
                continue
            p = src_nd - k
            if p < 0 or p not in dim_map or (whole is not None and p not in whole):
                return None
            new[dim_map[p]] = size
        while new and new[0] == 1:
            new.pop(0)
        return replace(self, per_head_shape=tuple(new))


Fact = Union[Const, LinearIndex, DiagonalDistance, Truth, AdditiveMask, PositionBias]


def _truthy(v: Any) -> Optional[bool]:
    if isinstance(v, bool) or is_number(v):
        return bool(v)
    return None


def _is01(v: Any) -> bool:
    return isinstance(v, bool) or v in (0, 1)


def _number(f) -> bool:
    return isinstance(f, Const) and is_number(f.value)


def _int(f) -> bool:
    return isinstance(f, Const) and isinstance(f.value, int) and not isinstance(f.value, bool)


def _as_truth(f) -> Optional[Truth]:
    """The truthiness of a fact."""
    if isinstance(f, Truth):
        return f
    if isinstance(f, Const):
        t = _truthy(f.value)
        if t is None:
            return None
        return Truth(EVERY, EVERY, _is01(f.value)) if t else Truth(NONE, NONE, True)
    if isinstance(f, AdditiveMask):  # nonzero (<= bound < 0) where masked, 0 elsewhere if exact
        return Truth(f.masked if f.exact else EVERY, f.masked, False)
    return None


def _as_linear(f) -> Optional[LinearIndex]:
    if isinstance(f, LinearIndex):
        return f
    if _int(f):
        return LinearIndex((), f.value)
    return None


def _linear(terms: dict, offset: int) -> Union[LinearIndex, Const]:
    kept = tuple(sorted((a, c) for a, c in terms.items() if c != 0))
    return LinearIndex(kept, offset) if kept else Const(offset)


def _add_linear(a: LinearIndex, b: LinearIndex, sign: int = 1):
    terms = dict(a.terms)
    for ax, c in b.terms:
        terms[ax] = terms.get(ax, 0) + sign * c
    return _linear(terms, a.offset + sign * b.offset)


def _scale_linear(a: LinearIndex, c: int):
    return _linear({ax: k * c for ax, k in a.terms}, a.offset * c)


def _additive(masked: Diagonals, bound, exact: bool) -> Optional[AdditiveMask]:
    """An additive fact, if its masked values stay large negative and it masks something."""
    if not is_neg(bound) or masked == NONE:
        return None
    return AdditiveMask(masked, bound, exact)


def _negated(f):
    if _number(f):
        return Const(-f.value)
    if isinstance(f, LinearIndex):
        return _scale_linear(f, -1)
    if isinstance(f, PositionBias):
        return replace(f, coef=-f.coef)
    return None


def _not(f) -> Optional[Truth]:
    t = _as_truth(f)
    if t is None:
        return None
    return Truth(t.contains.complement(), t.inside.complement(), True)


def _truths(fa, fb) -> Optional[tuple]:
    """Both operands as Truths, None when neither is one. An unknown operand may be true or false
    anywhere: only the other's bound survives."""
    ta, tb = _as_truth(fa), _as_truth(fb)
    if ta is None and tb is None:
        return None
    return ta or Truth(EVERY, NONE, False), tb or Truth(EVERY, NONE, False)


def _and(fa, fb) -> Optional[Fact]:
    for f, g in ((fa, fb), (fb, fa)):
        if isinstance(f, Const) and _truthy(f.value) is False:
            return Const(False)
        if isinstance(f, Const) and _truthy(f.value) is True and _is01(f.value):
            return g
    truths = _truths(fa, fb)
    if truths is None:
        return None
    ta, tb = truths
    both01 = ta.is01 and tb.is01  # bitwise and of other integers can be 0 where both are true
    return Truth(ta.inside & tb.inside, (ta.contains & tb.contains) if both01 else NONE, both01)


def _or(fa, fb) -> Optional[Fact]:
    for f, g in ((fa, fb), (fb, fa)):
        if isinstance(f, Const) and _truthy(f.value) is False:
            return g
    truths = _truths(fa, fb)
    if truths is None:
        return None
    ta, tb = truths
    return Truth(ta.inside | tb.inside, ta.contains | tb.contains, ta.is01 and tb.is01)


def _compare(fa, fb, op: str) -> Optional[Fact]:
    """Fact of ``a op b`` for index tensors (op: le, lt, eq, ne)."""
    if isinstance(fa, Const) and isinstance(fb, Const) and is_number(fa.value) \
            and is_number(fb.value):
        a, b = fa.value, fb.value
        return Const({"le": a <= b, "lt": a < b, "eq": a == b, "ne": a != b}[op])
    if isinstance(fa, DiagonalDistance) and _int(fb) and op in ("le", "lt"):
        c = fb.value - (1 if op == "lt" else 0)  # |d - offset| <= c
        near = Diagonals.of((fa.offset - c, fa.offset + c))
        return Truth(near, near, True)
    if isinstance(fb, DiagonalDistance) and _int(fa) and op in ("le", "lt"):
        c = fa.value + (1 if op == "lt" else 0)  # |d - offset| >= c
        near = Diagonals.of((fb.offset - c + 1, fb.offset + c - 1)).complement()
        return Truth(near, near, True)
    la, lb = _as_linear(fa), _as_linear(fb)
    if la is None or lb is None:
        return None
    diff = _add_linear(lb, la, -1)  # b - a
    if isinstance(diff, Const):
        return None  # a constant comparison of tensors: not a positional fact
    form = diff.diagonal_offset()
    if form is None:
        return None
    sign, c = form  # b - a = sign * d + c
    if op in ("eq", "ne"):
        hit = Diagonals.of((-sign * c, -sign * c))
        hit = hit if op == "eq" else hit.complement()
        return Truth(hit, hit, True)
    least = 1 if op == "lt" else 0  # integers: b - a >= least
    # sign * d >= least - c
    keep = Diagonals.at_least(least - c) if sign == 1 else Diagonals.at_most(c - least)
    return Truth(keep, keep, True)


def _where(fc, fx, fy) -> Optional[Fact]:
    """Fact of where(cond, x, y)."""
    tc = _as_truth(fc)
    if tc is not None and tc.exact and tc.inside in (EVERY, NONE):
        return fx if tc.inside == EVERY else fy  # the condition is the same everywhere
    vx = fx.value if isinstance(fx, Const) else None
    vy = fy.value if isinstance(fy, Const) else None
    if is_neg(vy):  # NEG where cond is false
        return _neg_fill(_as_truth(fc), fx, vy)
    if is_neg(vx):  # NEG where cond is true
        return _neg_fill(_not(fc), fy, vx)
    tx, ty = _truthy(vx), _truthy(vy)
    if tx is True and ty is False:
        if tc is None:
            return None
        return tc if (_is01(vx) and _is01(vy)) else replace(tc, is01=False)
    if tx is False and ty is True:
        nc = _not(fc)
        if nc is None:
            return None
        return nc if (_is01(vx) and _is01(vy)) else replace(nc, is01=False)
    if ty is False:  # cond and x
        return _and(fc, fx)
    if tx is True:  # cond or y
        return _or(fc, fy)
    return None


def _neg_fill(cond: Optional[Truth], kept, fill) -> Optional[AdditiveMask]:
    """where(cond, kept, fill) with a large negative ``fill``."""
    masked = cond.inside.complement() if cond is not None else NONE
    bound = fill
    if isinstance(kept, AdditiveMask):
        masked = masked | kept.masked
        bound = max(bound, kept.bound)
    exact = cond is not None and cond.exact and (
        (isinstance(kept, Const) and kept.value == 0) or
        (isinstance(kept, AdditiveMask) and kept.exact))
    return _additive(masked, bound, exact)


def _float_factor(f) -> Optional[float]:
    return float(f.value) if _number(f) else None


class MaskFacts:
    def __init__(self) -> None:
        self.memo: dict = {}
        self._allow: Optional[Node] = None

    def fact(self, x: Any) -> Optional[Fact]:
        if isinstance(x, bool) or is_number(x):
            return Const(x)
        if not isinstance(x, Node):
            return None
        if x in self.memo:
            return self.memo[x]
        self.memo[x] = None
        if mutated(x, ignore=self._allow):
            return None  # its value changes along the graph: no fact holds everywhere
        try:
            r = self._normalised(x, self._fact(x))
        except Exception:  # a rule met a spelling it does not know: no fact
            r = None
        self.memo[x] = r
        return r

    @staticmethod
    def _normalised(x: Node, f):
        """Index terms on size-1 axes dropped (the index is always 0 there, and such axes are
        the ones that broadcast); bool tensors hold 0/1."""
        if isinstance(f, LinearIndex):
            s = shape(x)
            if s is None:
                return None
            return _linear({a: c for a, c in f.terms
                            if -a <= len(s) and not sym_eq(s[a], 1)}, f.offset)
        if isinstance(f, Truth) and not f.is01:
            v = val(x)
            if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
                return replace(f, is01=True)
        return f

    # ---- helpers -------------------------------------------------------------------------
    @staticmethod
    def _same_last(a: Any, out: Node, dims: int) -> bool:
        sa, so = shape(a), shape(out)
        if sa is None or so is None or len(sa) < dims or len(so) < dims:
            return False
        return all(sym_eq(sa[-k], so[-k]) for k in range(1, dims + 1))

    def _pos(self, f, src, out):
        """A fact of ``src`` that still holds once ``src`` is broadcast to ``out``."""
        if not isinstance(src, Node):
            return f
        if isinstance(f, (Truth, AdditiveMask, DiagonalDistance)) or (
                isinstance(f, PositionBias) and f.distance_from is not None):
            return f if self._same_last(src, out, 2) else None
        if isinstance(f, PositionBias):  # j must stay j; r stays constant along a broadcast row
            return f if self._same_last(src, out, 1) else None
        return f

    # ---- the rules -----------------------------------------------------------------------
    def _fact(self, node: Node):
        op = norm(node)
        if op is None:
            return None
        if op.inplace:
            # x.tril_() & co: the fact of the result follows from x before the mutation (x may be
            # mutated by this node only; it is then not looked at again)
            src = op.args.get("self")
            if not isinstance(src, Node) or mutated(src, ignore=node):
                return None
            self.memo.pop(src, None)
            prev, self._allow = self._allow, node
            try:
                return self._fact_inner(node, op)
            finally:
                self._allow = prev
                self.memo.pop(src, None)
        return self._fact_inner(node, op)

    def _fact_inner(self, node: Node, op):
        n = op.name
        a = op.args
        f = self.fact
        if n in ("ones", "ones_like", "new_ones"):
            return Const(True if a.get("dtype") is torch.bool else 1)
        if n in ("zeros", "zeros_like", "new_zeros"):
            return Const(False if a.get("dtype") is torch.bool else 0)
        if n in ("full", "new_full", "full_like", "fill_", "tensor", "new_tensor"):
            v = a.get({"fill_": "value", "tensor": "data", "new_tensor": "data"}.get(
                n, "fill_value"))
            return Const(v) if (is_number(v) or isinstance(v, bool)) else None
        if n == "arange":
            return self._arange(op)
        if n in ("identity", "to", "cast_float", "cast_half", "cast_bfloat16", "cast_double",
                 "cast_int", "cast_bool", "type", "type_as"):
            return self._cast(node, a.get("self"))
        if n in ("expand", "expand_as"):
            return self._expand(node, a.get("self"))
        if n == "unsqueeze":
            return self._unsqueeze(op)
        if n == "squeeze":
            return self._squeeze(op)
        if n == "reshape":
            return self._reshape(op)
        if n == "getitem":
            return self._getitem(op)
        if n == "neg":
            return _negated(f(a.get("self")))
        if n == "abs":
            return self._abs(f(a.get("self")))
        if n in ("add", "sub"):
            return self._add(node, n, a.get("self"), a.get("other"))
        if n in ("mul", "div"):
            return self._mul(node, n, a.get("self"), a.get("other"))
        if n in ("le", "lt", "ge", "gt", "eq", "ne"):
            x, y = f(a.get("self")), f(a.get("other"))
            if n in ("ge", "gt"):
                x, y, n = y, x, {"ge": "le", "gt": "lt"}[n]
            if n in ("eq", "ne"):
                r = self._truth_equals(x, y, n) or self._truth_equals(y, x, n)
                if r is not None:
                    return r
            return _compare(x, y, n)
        if n in ("and", "or"):
            x, y = a.get("self"), a.get("other")
            fx, fy = self._pos(f(x), x, node), self._pos(f(y), y, node)
            return _and(fx, fy) if n == "and" else _or(fx, fy)
        if n == "not":
            v = val(node)
            if not (isinstance(v, torch.Tensor) and v.dtype == torch.bool):
                return None  # ~x of integers is no logical not
            return _not(f(a.get("self")))
        if n in ("tril", "triu"):
            return self._triangle(n, a.get("self"), a.get("diagonal", 0))
        if n == "where":
            c, x, y = a.get("condition"), a.get("self"), a.get("other")
            return _where(self._pos(f(c), c, node), self._pos(f(x), x, node),
                          self._pos(f(y), y, node))
        if n == "masked_fill":
            x, c, v = a.get("self"), a.get("mask"), a.get("value")
            fv = f(v)
            if not isinstance(fv, Const):
                return None
            return _where(self._pos(f(c), c, node), fv, self._pos(f(x), x, node))
        if n == "diff":
            return self._diff(op)
        if n == "cumsum":
            fs = f(a.get("self"))
            return Const(0) if isinstance(fs, Const) and fs.value in (0, False) else None
        return None

    def _cast(self, node: Node, src):
        fs = self.fact(src)
        vo, vi = val(node), val(src)
        to_bool = isinstance(vo, torch.Tensor) and vo.dtype == torch.bool and not (
            isinstance(vi, torch.Tensor) and vi.dtype == torch.bool)
        if to_bool:
            if isinstance(fs, Const):
                t = _truthy(fs.value)
                return None if t is None else Const(t)
            t = _as_truth(fs)
            return None if t is None else replace(t, is01=True)
        if isinstance(vo, torch.Tensor) and not vo.is_floating_point():
            if isinstance(fs, (AdditiveMask, PositionBias)):
                return None  # float masks do not survive a cast to integers
            if _number(fs) and math.isfinite(fs.value):
                return Const(int(fs.value))
            if _number(fs):
                return None
        return fs

    def _expand(self, node: Node, src):
        fs = self.fact(src)
        if isinstance(fs, LinearIndex):
            si, so = shape(src), shape(node)
            if si is None or so is None or not all(sym_eq(si[ax], so[ax]) for ax, _ in fs.terms):
                return None
            return fs
        return self._pos(fs, src, node)

    def _arange(self, op):
        va = list(op.varargs or [])
        kw = op.args
        # arange(end), arange(start, end[, step]): the index fact needs start and step only
        start, step = 0, 1
        if len(va) >= 2:
            start = va[0]
            if len(va) >= 3:
                step = va[2]
        start = kw.get("start", start)
        step = kw.get("step", step)
        if not (isinstance(start, int) and not isinstance(start, bool)) or step != 1:
            return None
        if ndim(op.node) != 1:
            return None
        return LinearIndex(((-1, 1),), start)

    def _abs(self, fs):
        if _number(fs):
            return Const(abs(fs.value))
        if isinstance(fs, LinearIndex):
            form = fs.diagonal_offset()
            if form is not None:  # |sign * d + c| = |d + sign * c|
                sign, c = form
                return DiagonalDistance(-sign * c)
        return None

    def _add(self, node: Node, name: str, x, y):
        fx, fy = self.fact(x), self.fact(y)
        if name == "sub":
            if isinstance(fx, Const) and fx.value == 1 and isinstance(fy, Truth) and fy.is01:
                return self._pos(_not(fy), y, node)  # 1 - keep
            if isinstance(fx, Truth) and isinstance(fy, Truth) and fx.is01 and fy.is01 and \
                    fy.inside.issubset(fx.contains):
                # 0/1 minus 0/1 that is 1 only where the first is: x and not y
                return _and(self._pos(fx, x, node), self._pos(_not(fy), y, node))
            fy = _negated(fy)
            if fy is None:
                return None
        if fx is None and fy is None:
            return None
        if _number(fx) and _number(fy):
            return Const(fx.value + fy.value)
        lx, ly = _as_linear(fx), _as_linear(fy)
        if lx is not None and ly is not None:
            return _add_linear(lx, ly)
        fx, fy = self._pos(fx, x, node), self._pos(fy, y, node)
        if isinstance(fx, AdditiveMask) and isinstance(fy, AdditiveMask):
            # each <= 0: the sum is <= either bound where either masks, 0 where neither does
            return _additive(fx.masked | fy.masked, max(fx.bound, fy.bound),
                             fx.exact and fy.exact)
        for p, q in ((fx, fy), (fy, fx)):
            if isinstance(p, AdditiveMask):
                if isinstance(q, Const):
                    if not is_number(q.value):
                        return None
                    return _additive(p.masked, p.bound + q.value, p.exact and q.value == 0)
                if q is None:
                    return _additive(p.masked, p.bound, False)
                return None
            if isinstance(p, PositionBias) and _number(q):
                return p  # a constant: the same for every key
        return None

    def _mul(self, node: Node, name: str, x, y):
        fx, fy = self.fact(x), self.fact(y)
        if name == "div":
            c = _float_factor(fy)
            if c is None or c == 0 or math.isinf(c):
                return None
            if isinstance(fx, AdditiveMask):
                return self._pos(_additive(fx.masked, fx.bound / c, fx.exact)
                                 if c > 0 else None, x, node)
            if isinstance(fx, PositionBias):
                return replace(fx, coef=fx.coef / c)
            if isinstance(fx, LinearIndex):
                return self._bias_of(fx, None, 1.0 / c)
            if isinstance(fx, DiagonalDistance):
                return PositionBias(None, 1.0 / c, fx.offset)
            return None
        if _number(fx) and _number(fy):
            return Const(fx.value * fy.value)
        for p, q, src, other in ((fx, fy, x, y), (fy, fx, y, x)):
            if isinstance(q, Const):
                c = q.value
                if isinstance(p, AdditiveMask) and is_number(c) and c > 0:
                    return self._pos(_additive(p.masked, p.bound * c, p.exact), src, node)
                if isinstance(p, Truth) and p.is01 and is_neg(c) and c != -math.inf:
                    # 0/1 times a finite large negative value: NEG where true, 0 where false
                    return self._pos(_additive(p.contains, c, p.exact), src, node)
                if isinstance(p, LinearIndex) and _int(q):
                    return _scale_linear(p, c)
                if isinstance(p, LinearIndex) and is_number(c):
                    return self._bias_of(p, None, float(c))
                if isinstance(p, DiagonalDistance) and is_number(c):
                    return PositionBias(None, float(c), p.offset)
                if isinstance(p, PositionBias) and is_number(c):
                    return replace(p, coef=p.coef * c)
                if c == 1 and not isinstance(c, bool):
                    return p
            elif q is None and isinstance(p, (LinearIndex, DiagonalDistance, PositionBias)):
                bias = p if isinstance(p, PositionBias) else (
                    PositionBias(None, 1.0, p.offset) if isinstance(p, DiagonalDistance)
                    else self._bias_of(p, None, 1.0))
                if bias is None or bias.per_head is not None:
                    return None
                per_head = self._per_head(other, node, bias.distance_from is not None)
                if per_head is None:
                    return None
                return self._pos(replace(bias, per_head=other, per_head_shape=per_head), src,
                                 node)
        tx, ty = _as_truth(fx), _as_truth(fy)
        if tx is not None and ty is not None and not isinstance(fx, AdditiveMask) and \
                not isinstance(fy, AdditiveMask):
            if not (tx.is01 and ty.is01):
                return None
            return _and(self._pos(fx, x, node), self._pos(fy, y, node))
        return None

    @staticmethod
    def _bias_of(lin: LinearIndex, per_head, factor: float) -> Optional[PositionBias]:
        """factor * lin as a position bias: its key coefficient (the rest is constant along
        each row)."""
        col = lin.coef(-1)
        return PositionBias(per_head, factor * col) if col else None

    @staticmethod
    def _per_head(t: Any, out: Node, distance: bool) -> Optional[tuple]:
        """The shape of ``t`` when it can be the per-head factor of the bias ``out``: a float
        tensor of static shape, of size 1 along j (and i, for a distance) against ``out``."""
        tv, so = val(t), shape(out)
        if not (isinstance(t, Node) and isinstance(tv, torch.Tensor) and tv.is_floating_point()
                and so is not None and tv.dim() <= len(so)):
            return None
        st = tuple(tv.shape)
        if not all(isinstance(d, int) for d in st) or any(d != 1 for d in st[-(1 + distance):]):
            return None
        return st

    @staticmethod
    def _truth_equals(ft, fc, name: str):
        """x == 1 / x != 0 (-> x), x == 0 / x != 1 (-> not x) of a truth fact x."""
        if not isinstance(ft, Truth) or not isinstance(fc, Const):
            return None
        t = _truthy(fc.value)
        if t is None or not _is01(fc.value) or (t and not ft.is01):
            return None
        positive = (name == "eq") == t
        r = ft if positive else _not(ft)
        return replace(r, is01=True)

    def _triangle(self, name: str, src, diagonal):
        """tril keeps d <= diagonal, triu keeps d >= diagonal, zeros elsewhere."""
        if not isinstance(diagonal, int):
            return None
        kept = Diagonals.at_most(diagonal) if name == "tril" else Diagonals.at_least(diagonal)
        fs = self.fact(src)
        if isinstance(fs, Const):
            if is_neg(fs.value):
                return _additive(kept, fs.value, True)
            t = _truthy(fs.value)
            if t is None:
                return None
            return Truth(kept, kept, _is01(fs.value)) if t else Const(fs.value)
        t = _as_truth(fs)
        if t is None:
            return Truth(kept, NONE, False)
        return Truth(t.inside & kept, t.contains & kept, t.is01)

    def _diff(self, op):
        """torch.diff(x, dim=d[, prepend=p]) of an index tensor along an axis where it grows by a
        constant step: that step everywhere (with ``p`` one step before x's first element)."""
        x, dim = op.args.get("self"), op.args.get("dim", -1)
        if op.args.get("n", 1) != 1 or op.args.get("append") is not None:
            return None
        nd = ndim(x)
        if nd is None or not isinstance(dim, int):
            return None
        ax = dim - nd if dim >= 0 else dim
        fx = _as_linear(self.fact(x))
        if fx is None:
            return None
        step = fx.coef(ax)
        prepend = op.args.get("prepend")
        if prepend is not None:
            fp, sp = _as_linear(self.fact(prepend)), shape(prepend)
            rest = tuple((a, c) for a, c in fx.terms if a != ax)
            if fp is None or sp is None or len(sp) != nd or not sym_eq(sp[ax], 1) or \
                    fp.terms != rest or fp.offset != fx.offset - step:
                return None
        return Const(step)

    def _unsqueeze(self, op):
        src, dim = op.args.get("self"), op.args.get("dim")
        nd_in = ndim(src)
        if nd_in is None or not isinstance(dim, int):
            return None
        d = dim if dim >= 0 else dim + nd_in + 1
        return self._moved(self.fact(src), nd_in, nd_in + 1,
                           {p: p if p < d else p + 1 for p in range(nd_in)})

    def _squeeze(self, op):
        src, dim = op.args.get("self"), op.args.get("dim")
        si, so = shape(src), shape(op.node)
        if si is None or so is None or not isinstance(dim, int):
            return None
        d = dim if dim >= 0 else dim + len(si)
        if len(so) != len(si) - 1 or not sym_eq(si[d], 1):
            return None
        return self._moved(self.fact(src), len(si), len(so),
                           {p: p if p < d else p - 1 for p in range(len(si)) if p != d})

    @staticmethod
    def _moved(fs, nd_in: int, nd_out: int, dim_map: dict, whole: Optional[set] = None):
        """The fact of a view (``nd_in`` -> ``nd_out`` dims) that moves dim p of its input to
        ``dim_map[p]``, drops the others (``whole``: the dims kept whole, None: all; cut dims
        start at 0) and inserts size-1 dims; positional facts need the last two dims to stay
        last."""
        if fs is None or isinstance(fs, Const):
            return fs
        if isinstance(fs, LinearIndex):
            terms = {}
            for ax, c in fs.terms:
                p = nd_in + ax
                if p not in dim_map or (whole is not None and p not in whole):
                    return None
                terms[dim_map[p] - nd_out] = c
            return _linear(terms, fs.offset)
        last = [nd_in - 1, nd_in - 2]
        needs = 1 if isinstance(fs, PositionBias) and fs.distance_from is None else 2
        if any(p not in dim_map or dim_map[p] - nd_out != p - nd_in for p in last[:needs]):
            return None
        if isinstance(fs, PositionBias):
            return fs.moved(nd_in, nd_out, dim_map, whole)
        return fs

    def _reshape(self, op):
        src = op.args.get("self")
        fs = self.fact(src)
        if fs is None or isinstance(fs, Const):
            return fs
        si, so = shape(src), shape(op.node)
        if si is None or so is None:
            return None
        if isinstance(fs, LinearIndex) and len(fs.terms) == 1:
            ax = fs.terms[0][0]
            n = si[ax]
            others = [i for i, s in enumerate(so) if not sym_eq(s, 1)]
            if all(sym_eq(s, 1) for i, s in enumerate(si) if i != len(si) + ax) and \
                    len(others) == 1 and sym_eq(so[others[0]], n):
                return LinearIndex(((others[0] - len(so), fs.terms[0][1]),), fs.offset)
        # only size-1 dims come or go: element (..., i, j) stays where it is
        non1_in = [p for p, d in enumerate(si) if not sym_eq(d, 1)]
        non1_out = [p for p, d in enumerate(so) if not sym_eq(d, 1)]
        if len(non1_in) == len(non1_out) and all(
                sym_eq(si[a], so[b]) for a, b in zip(non1_in, non1_out)):
            moved = self._moved(fs, len(si), len(so), dict(zip(non1_in, non1_out)))
            if moved is not None or not self._same_last(src, op.node, 2):
                return moved
        if isinstance(fs, (LinearIndex, PositionBias)) and not (
                isinstance(fs, LinearIndex) and all(a >= -2 for a, _ in fs.terms)):
            return None
        # the leading dims reshaped, the last two kept
        return self._pos(fs, src, op.node)

    def _getitem(self, op):
        src, idx = op.args.get("self"), op.args.get("index")
        fs = self.fact(src)
        in_nd = ndim(src)
        out_nd = ndim(op.node)
        if fs is None or in_nd is None or out_nd is None:
            return None
        items = list(idx) if isinstance(idx, tuple) else [idx]
        if any(isinstance(it, Node) for it in items):
            return self._gather(fs, src, items)
        consuming = sum(1 for it in items if it is not None and it is not Ellipsis)
        if Ellipsis in items:
            k = items.index(Ellipsis)
            items = items[:k] + [slice(None)] * (in_nd - consuming) + items[k + 1:]
        else:
            items = items + [slice(None)] * (in_nd - consuming)
        dim_map, starts = {}, {}  # input dim -> output dim, and where a slice of it starts
        out_d = in_d = 0
        for it in items:
            if it is None:
                out_d += 1
            elif isinstance(it, slice):
                s = 0 if it.start is None else it.start
                if it.step not in (None, 1) or not isinstance(s, int) or s < 0:
                    return None
                dim_map[in_d] = out_d
                starts[in_d] = (s, it.stop is None)
                out_d += 1
                in_d += 1
            elif isinstance(it, int) and not isinstance(it, bool):
                in_d += 1
            else:
                return None
        if out_d != out_nd:
            return None
        if isinstance(fs, Const):
            return fs
        if isinstance(fs, LinearIndex):
            moved = self._moved(fs, in_nd, out_nd, dim_map)
            offset = sum(c * starts[in_nd + ax][0] for ax, c in fs.terms
                         if in_nd + ax in starts)
            return _add_linear(_as_linear(moved), LinearIndex((), offset)) \
                if moved is not None else None
        whole = {p for p, (s, open_end) in starts.items() if s == 0 and open_end}
        moved = self._moved(fs, in_nd, out_nd, dim_map, whole)
        if moved is None:
            return None
        # element (i, j) here is (i + r0, j + c0) there: d there = d here + c0 - r0
        by = starts[in_nd - 1][0] - starts.get(in_nd - 2, (0, True))[0]
        if isinstance(moved, Truth):
            return Truth(moved.inside.shifted(-by), moved.contains.shifted(-by), moved.is01)
        if isinstance(moved, AdditiveMask):
            return AdditiveMask(moved.masked.shifted(-by), moved.bound, moved.exact)
        if isinstance(moved, DiagonalDistance):
            return DiagonalDistance(moved.offset - by)
        if isinstance(moved, PositionBias):
            if moved.distance_from is None:
                return moved  # j + c0: c0 * coef * per_head more on every row
            return replace(moved, distance_from=moved.distance_from - by)
        return None

    def _gather(self, fs, src, items):
        """x[t_0, ..., t_{n-1}] with an integer index tensor for every dim of x: element =
        x at (t_0, ..., t_{n-1}) there."""
        in_nd = ndim(src)
        if len(items) != in_nd or not all(isinstance(it, Node) for it in items):
            return None
        for it in items:
            v = val(it)
            if not isinstance(v, torch.Tensor) or v.dtype == torch.bool or \
                    v.is_floating_point():
                return None
        if isinstance(fs, Const):
            return fs
        if not isinstance(fs, LinearIndex):
            return None
        total = Const(fs.offset)
        for ax, c in fs.terms:
            fi = _as_linear(self.fact(items[in_nd + ax]))
            # negative indices count from the end: only indices known to be >= 0
            if fi is None or fi.offset < 0 or any(k < 0 for _, k in fi.terms):
                return None
            total = _add_linear(_as_linear(total), _scale_linear(fi, c))
        return total


# ---- what a mask piece keeps ---------------------------------------------------------------------

@dataclass(frozen=True)
class Keep:
    """The diagonals a mask piece keeps: at most ``inside``; ``exact``: exactly those, with the
    scores unchanged there (0 added, or no fill)."""
    inside: Diagonals
    exact: bool


def keep_region(facts: MaskFacts, node: Any, role: MaskRole,
                factor: Optional[float] = 1.0) -> Optional[Keep]:
    """What a mask piece keeps, or None when nothing is known.

    ``factor``: the positive constant that multiplies an additive piece after it is added
    (None: unknown)."""
    f = facts.fact(node)
    if role is MaskRole.ADDITIVE:
        if isinstance(f, Const) and f.value == 0:
            return Keep(EVERY, True)
        if not isinstance(f, AdditiveMask) or factor is None or not is_neg(f.bound * factor):
            return None
        return Keep(f.masked.complement(), f.exact)
    t = _as_truth(f)
    if t is None:
        return None
    if role is MaskRole.KEEP:
        return Keep(t.inside, t.exact)
    return Keep(t.contains.complement(), t.exact)


def causal_bound(facts: MaskFacts, node: Any, role: MaskRole,
                 factor: Optional[float] = 1.0) -> tuple[bool, bool]:
    """(implies_causal, exactly_causal) for a mask piece."""
    k = keep_region(facts, node, role, factor)
    if k is None:
        return False, False
    return k.inside.issubset(CAUSAL), k.exact and k.inside == CAUSAL


def position_bias(facts: MaskFacts, node: Any) -> Optional[PositionBias]:
    f = facts.fact(node)
    return f if isinstance(f, PositionBias) else None
