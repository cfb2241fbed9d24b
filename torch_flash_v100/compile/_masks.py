"""Proving that an attention mask is (at least) causal.

An abstract interpreter over the FX nodes that build a mask.  Each node gets a *fact*:

* ``("ALL", v)``: every element equals the Python constant ``v``;
* ``("IDX", axis, off)``: element value = (index along ``axis``) + ``off``; ``axis`` counts from
  the end (-1 = key position j, -2 = query position i once broadcast against the scores);
* ``("L", c, exact, is01)``: truthiness fact, ``true => j - i <= c`` (``exact``: iff);
* ``("U", c, exact, is01)``: truthiness fact, ``j - i > c => true`` (``exact``: iff);
* ``("N", c, exact, bound)``: additive fact, ``j - i > c => value <= bound <= NEG`` (``exact``:
  and 0 elsewhere).  Other terms added to a mask are assumed not to be hugely positive;

``is01`` says the tensor only holds 0/1 (bool or a cast of one), which ``1 - x`` and ``x == 0``
need.  A mask proves causal when its keep region lies inside ``j <= i`` (``c <= 0``).  Only
sound rules are applied; anything unknown yields no fact, so the mask stays a plain mask.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Optional

import torch
from torch.fx import Node

from ._fx_nodes import is_number, mutated, ndim, norm, shape, sym_eq

# An additive value that removes a position from the softmax (exp underflows to exactly 0).
NEG_THRESHOLD = -1.0e4


class MaskRole(enum.Enum):
    """How a mask piece acts on the scores."""
    ADDITIVE = "N"  # a float tensor added to the scores
    KEEP = "L"  # a bool tensor, True keeps (where(cond, scores, fill), SDPA bool masks)
    MASKED = "U"  # a bool tensor, True removes (masked_fill conditions)


def is_neg(v: Any) -> bool:
    return is_number(v) and (v == -math.inf or v <= NEG_THRESHOLD)


def _truthy(v: Any) -> Optional[bool]:
    if isinstance(v, bool) or is_number(v):
        return bool(v)
    return None


def _is01(v: Any) -> bool:
    return isinstance(v, bool) or v in (0, 1)


def _neg_fill_fact(fc, triangle: str, f_kept, v_fill, v_kept):
    """Fact of where() that puts the large negative ``v_fill`` where the other branch is not taken.

    ``triangle`` ("L" or "U") is the condition fact under which the kept branch is selected;
    where(cond, x, NEG) passes ("L", x's fact, NEG, x's value), where(cond, NEG, y) the mirror.
    """
    cands, bound = [], v_fill
    if fc and fc[0] == triangle:
        cands.append(fc[1])
    if f_kept and f_kept[0] == "N":
        cands.append(f_kept[1])
        bound = max(bound, f_kept[3])
    if not cands:
        return None
    exact = bool(fc and fc[0] == triangle and fc[2] and v_kept == 0 and len(cands) == 1)
    return ("N", min(cands), exact, bound)


class MaskFacts:
    def __init__(self) -> None:
        self.memo: dict = {}
        self._allow: Optional[Node] = None

    def fact(self, x: Any):
        if isinstance(x, bool) or is_number(x):
            return ("ALL", x)
        if not isinstance(x, Node):
            return None
        if x in self.memo:
            return self.memo[x]
        self.memo[x] = None
        if mutated(x, ignore=self._allow):
            return None  # its value changes along the graph: no fact holds everywhere
        try:
            r = self._fact(x)
        except Exception:  # a rule met a spelling it does not know: no fact
            r = None
        self.memo[x] = r
        return r

    # ---- helpers -------------------------------------------------------------------------
    @staticmethod
    def _last2_same(a: Any, out: Node) -> bool:
        sa, so = shape(a), shape(out)
        if sa is None or so is None or len(sa) < 2 or len(so) < 2:
            return False
        return sym_eq(sa[-1], so[-1]) and sym_eq(sa[-2], so[-2])

    def _pos(self, f, src, out):
        """A positional fact (L/U/N) of ``src`` survives into ``out`` if not broadcast."""
        if f is None or f[0] not in ("L", "U", "N"):
            return f
        if isinstance(src, Node) and not self._last2_same(src, out):
            return None
        return f

    @staticmethod
    def _not(f):
        if f is None:
            return None
        if f[0] == "ALL":
            t = _truthy(f[1])
            return None if t is None else ("ALL", not t)
        if f[0] == "L":
            return ("U", f[1], f[2], True)
        if f[0] == "U":
            return ("L", f[1], f[2], True)
        return None

    @staticmethod
    def _and(fa, fb):
        for f, g in ((fa, fb), (fb, fa)):
            if f is not None and f[0] == "ALL":
                t = _truthy(f[1])
                if t is False:
                    return ("ALL", False)
                if t is True and _is01(f[1]):
                    return g
        if fa is None or fb is None:
            for f in (fa, fb):
                if f is not None and f[0] == "L":
                    return ("L", f[1], False, False)
            return None
        if fa[0] == "L" and fb[0] == "L":
            return ("L", min(fa[1], fb[1]), fa[2] and fb[2], fa[3] and fb[3])
        if fa[0] == "U" and fb[0] == "U":
            return ("U", max(fa[1], fb[1]), False, fa[3] and fb[3])
        for f in (fa, fb):
            if f[0] == "L":
                return ("L", f[1], False, False)
        return None

    @staticmethod
    def _or(fa, fb):
        for f, g in ((fa, fb), (fb, fa)):
            if f is not None and f[0] == "ALL" and _truthy(f[1]) is False:
                return g
        if fa is None or fb is None:
            for f in (fa, fb):
                if f is not None and f[0] == "U":
                    return ("U", f[1], False, False)
            return None
        if fa[0] == "L" and fb[0] == "L":
            return ("L", max(fa[1], fb[1]), fa[2] and fb[2], fa[3] and fb[3])
        if fa[0] == "U" and fb[0] == "U":
            return ("U", min(fa[1], fb[1]), fa[2] and fb[2], fa[3] and fb[3])
        for f in (fa, fb):
            if f[0] == "U":
                return ("U", f[1], False, False)
        return None

    @staticmethod
    def _cmp_le(fa, fb, strict: bool):
        """Fact of ``a <= b`` (``a < b`` when strict) for index tensors."""
        if fa is None or fb is None or fa[0] != "IDX" or fb[0] != "IDX":
            return None
        # integers: a < b  <=>  a <= b - 1
        ob = fb[2] - (1 if strict else 0)
        if fa[1] == -1 and fb[1] == -2:  # j + oa <= i + ob  <=>  j - i <= ob - oa
            return ("L", ob - fa[2], True, True)
        if fa[1] == -2 and fb[1] == -1:  # i + oa <= j + ob  <=>  j - i > oa - ob - 1
            return ("U", fa[2] - ob - 1, True, True)
        return None

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
            return ("ALL", True if a.get("dtype") is torch.bool else 1)
        if n in ("zeros", "zeros_like", "new_zeros"):
            return ("ALL", False if a.get("dtype") is torch.bool else 0)
        if n in ("full", "new_full", "full_like"):
            v = a.get("fill_value")
            return ("ALL", v) if (is_number(v) or isinstance(v, bool)) else None
        if n == "fill_":
            v = a.get("value")
            return ("ALL", v) if (is_number(v) or isinstance(v, bool)) else None
        if n in ("tensor", "new_tensor"):
            v = a.get("data")
            return ("ALL", v) if (is_number(v) or isinstance(v, bool)) else None
        if n == "arange":
            return self._arange(op)
        if n in ("identity", "to", "cast_float", "cast_half", "cast_bfloat16", "cast_double",
                 "cast_int", "cast_bool", "type", "type_as"):
            src = a.get("self")
            fs = f(src)
            if fs is not None and fs[0] in ("L", "U") and n == "cast_bool":
                return (fs[0], fs[1], fs[2], True)
            return fs
        if n in ("expand", "expand_as"):
            src = a.get("self")
            fs = f(src)
            if fs is None:
                return None
            if fs[0] == "IDX":
                si, so = shape(src), shape(node)
                if si is None or so is None or not sym_eq(si[fs[1]], so[fs[1]]):
                    return None
                return fs
            return self._pos(fs, src, node)
        if n == "unsqueeze":
            return self._unsqueeze(op)
        if n == "reshape":
            return self._reshape(op)
        if n == "getitem":
            return self._getitem(op)
        if n in ("add", "sub"):
            x, y = a.get("self"), a.get("other")
            fx, fy = f(x), f(y)
            if fx is None and fy is None:
                return None
            if n == "sub":
                if fx and fx[0] == "ALL" and fx[1] == 1 and fy and fy[0] in ("L", "U") \
                        and fy[3]:
                    return self._pos(self._not(fy), y, node)
                if fy and fy[0] == "ALL" and is_number(fy[1]):
                    fy = ("ALL", -fy[1])
                else:
                    return None
            if fx and fy and fx[0] == "ALL" and fy[0] == "ALL" \
                    and is_number(fx[1]) and is_number(fy[1]):
                return ("ALL", fx[1] + fy[1])
            for p, q in ((fx, fy), (fy, fx)):
                if p and p[0] == "IDX" and q and q[0] == "ALL" and isinstance(q[1], int) \
                        and not isinstance(q[1], bool):
                    return ("IDX", p[1], p[2] + q[1])
            fx, fy = self._pos(fx, x, node), self._pos(fy, y, node)
            if fx and fy and fx[0] == "N" and fy[0] == "N":
                return ("N", min(fx[1], fy[1]), False, max(fx[3], fy[3]))
            for p, q in ((fx, fy), (fy, fx)):
                if p and p[0] == "N":
                    bound = p[3]
                    if q is not None and q[0] == "ALL":
                        if not is_number(q[1]):
                            return None
                        bound = bound + q[1]
                    return _n(p[1], p[2] and q is not None and q == ("ALL", 0), bound)
            return None
        if n in ("mul", "div"):
            x, y = a.get("self"), a.get("other")
            fx, fy = f(x), f(y)
            if n == "div":
                if fx and fx[0] == "N" and fy and fy[0] == "ALL" and is_number(fy[1]) \
                        and fy[1] > 0 and not math.isinf(fy[1]):
                    return self._pos(_n(fx[1], fx[2], fx[3] / fy[1]), x, node)
                return None
            for p, q, src in ((fx, fy, x), (fy, fx, y)):
                if q is None or q[0] != "ALL":
                    continue
                if p and p[0] == "N" and is_number(q[1]) and q[1] > 0:
                    return self._pos(_n(p[1], p[2], p[3] * q[1]), src, node)
                if p and p[0] == "U" and p[3] and is_neg(q[1]) and q[1] != -math.inf:
                    return self._pos(("N", p[1], p[2], q[1]), src, node)
                if q[1] == 1 and not isinstance(q[1], bool):
                    return p
            if fx and fy and fx[0] in ("L", "U", "ALL") and fy[0] in ("L", "U", "ALL"):
                if (fx[0] != "ALL" and not fx[3]) or (fy[0] != "ALL" and not fy[3]):
                    return None
                return self._pos(self._pos(self._and(fx, fy), x, node), y, node)
            return None
        if n in ("le", "lt", "ge", "gt"):
            x, y = a.get("self"), a.get("other")
            fx, fy = f(x), f(y)
            if n in ("ge", "gt"):
                fx, fy = fy, fx
            return self._cmp_le(fx, fy, strict=n in ("lt", "gt"))
        if n in ("eq", "ne"):
            x, y = a.get("self"), a.get("other")
            fx, fy = f(x), f(y)
            if fy is not None and fy[0] in ("L", "U"):
                fx, fy, x = fy, fx, y
            if fx is None or fx[0] not in ("L", "U") or fy is None or fy[0] != "ALL":
                return None
            t = _truthy(fy[1])
            if t is None or not _is01(fy[1]):
                return None
            if t and not fx[3]:
                return None
            positive = (n == "eq") == t  # x == 1 / x != 0  -> x;  x == 0 / x != 1 -> not x
            r = fx if positive else self._not(fx)
            return self._pos((r[0], r[1], r[2], True), x, node)
        if n in ("and", "or"):
            x, y = a.get("self"), a.get("other")
            fx = self._pos(f(x), x, node)
            fy = self._pos(f(y), y, node)
            return self._and(fx, fy) if n == "and" else self._or(fx, fy)
        if n == "not":
            return self._not(f(a.get("self")))
        if n in ("tril", "triu"):
            d = a.get("diagonal", 0)
            if not isinstance(d, int):
                return None
            fs = f(a.get("self"))
            if n == "tril":
                if fs and fs[0] == "ALL" and _truthy(fs[1]):
                    return ("L", d, True, _is01(fs[1]))
                if fs and fs[0] == "L":
                    return ("L", min(d, fs[1]), False, fs[3])
                return ("L", d, False, False)
            if fs and fs[0] == "ALL":
                if is_neg(fs[1]):
                    return ("N", d - 1, True, fs[1])
                if _truthy(fs[1]):
                    return ("U", d - 1, True, _is01(fs[1]))
            return None
        if n == "where":
            c, x, y = a.get("condition"), a.get("self"), a.get("other")
            fc = self._pos(f(c), c, node)
            fx = self._pos(f(x), x, node)
            fy = self._pos(f(y), y, node)
            return self._where(fc, fx, fy)
        if n == "masked_fill":
            x, c, v = a.get("self"), a.get("mask"), a.get("value")
            fx = self._pos(f(x), x, node)
            fc = self._pos(f(c), c, node)
            fv = f(v)
            if fv is None or fv[0] != "ALL":
                return None
            return self._where(fc, fv, fx)
        return None

    def _where(self, fc, fx, fy):
        """Fact of where(cond, x, y)."""
        vx = fx[1] if fx and fx[0] == "ALL" else None
        vy = fy[1] if fy and fy[0] == "ALL" else None
        # additive masks
        if is_neg(vy):  # NEG where cond is false
            return _neg_fill_fact(fc, "L", fx, vy, vx)
        if is_neg(vx):  # NEG where cond is true
            return _neg_fill_fact(fc, "U", fy, vx, vy)
        # truthiness
        tx, ty = _truthy(vx), _truthy(vy)
        if tx is True and ty is False:
            return fc if (_is01(vx) and _is01(vy)) else self._weak(fc)
        if tx is False and ty is True:
            return self._not(fc) if (_is01(vx) and _is01(vy)) else self._weak(self._not(fc))
        if ty is False:  # cond and x
            return self._and(fc, fx)
        if tx is True:  # cond or y
            return self._or(fc, fy)
        return None

    @staticmethod
    def _weak(f):
        if f is None or f[0] not in ("L", "U"):
            return f
        return (f[0], f[1], f[2], False)

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
        return ("IDX", -1, start)

    def _unsqueeze(self, op):
        src, dim = op.args.get("self"), op.args.get("dim")
        fs = self.fact(src)
        nd = ndim(op.node)
        if fs is None or nd is None or not isinstance(dim, int):
            return None
        if fs[0] == "ALL":
            return fs
        d = dim if dim >= 0 else dim + nd
        if fs[0] == "IDX":
            ax = fs[1] + nd  # position in output if inserted before it
            if d > ax - 1:  # inserted after the axis -> axis-from-end shifts
                return ("IDX", fs[1] - 1, fs[2])
            return fs
        if d >= nd - 2:
            return None
        return fs

    def _reshape(self, op):
        src = op.args.get("self")
        fs = self.fact(src)
        if fs is None:
            return None
        if fs[0] == "ALL":
            return fs
        si, so = shape(src), shape(op.node)
        if si is None or so is None:
            return None
        if fs[0] == "IDX":
            n = si[fs[1]]
            others = [i for i, s in enumerate(so) if not sym_eq(s, 1)]
            if len(si) == 1 or all(sym_eq(s, 1) for i, s in enumerate(si)
                                   if i != len(si) + fs[1]):
                if len(others) == 1 and sym_eq(so[others[0]], n):
                    return ("IDX", others[0] - len(so), fs[2])
            return None
        return self._pos(fs, src, op.node)

    def _getitem(self, op):
        src, idx = op.args.get("self"), op.args.get("index")
        fs = self.fact(src)
        in_nd = ndim(src)
        out_nd = ndim(op.node)
        if fs is None or in_nd is None or out_nd is None:
            return None
        items = list(idx) if isinstance(idx, tuple) else [idx]
        consuming = sum(1 for it in items if it is not None and it is not Ellipsis)
        if Ellipsis in items:
            k = items.index(Ellipsis)
            items = items[:k] + [slice(None)] * (in_nd - consuming) + items[k + 1:]
        else:
            items = items + [slice(None)] * (in_nd - consuming)
        mapping = {}  # input dim -> (output dim, slice)
        out_d = in_d = 0
        for it in items:
            if it is None:
                out_d += 1
            elif isinstance(it, slice):
                mapping[in_d] = (out_d, it)
                out_d += 1
                in_d += 1
            elif isinstance(it, int) and not isinstance(it, bool):
                in_d += 1
            else:
                return None  # advanced (tensor) indexing
        if out_d != out_nd:
            return None
        if fs[0] == "ALL":
            return fs

        def start_of(sl):
            if sl.step not in (None, 1):
                return None
            s = 0 if sl.start is None else sl.start
            return s if isinstance(s, int) and s >= 0 else None

        if fs[0] == "IDX":
            ax = in_nd + fs[1]
            if ax not in mapping:
                return None
            o, sl = mapping[ax]
            s = start_of(sl)
            if s is None:
                return None
            return ("IDX", o - out_nd, fs[2] + s)
        r, c = in_nd - 2, in_nd - 1
        if r not in mapping or c not in mapping:
            return None
        (orow, srow), (ocol, scol) = mapping[r], mapping[c]
        if orow != out_nd - 2 or ocol != out_nd - 1:
            return None
        r0, c0 = start_of(srow), start_of(scol)
        if r0 is None or c0 is None:
            return None
        # original j' - i' <= c with i' = i + r0, j' = j + c0  ->  j - i <= c + r0 - c0
        return (fs[0], fs[1] + r0 - c0) + tuple(fs[2:])


def _n(c, exact, bound):
    """An additive fact, if its masked values stay large negative."""
    return ("N", c, exact, bound) if is_neg(bound) else None


def causal_bound(facts: MaskFacts, node: Any, role: MaskRole, factor: Optional[float] = 1.0):
    """(implies_causal, exactly_causal) for a mask piece.

    ``factor``: the positive constant that multiplies an additive piece after it is added
    (None: unknown).
    """
    f = facts.fact(node)
    kind = role.value  # the fact that proves a causal bound for this role
    if f is None or f[0] != kind:
        return False, False
    if kind == "N" and (factor is None or not is_neg(f[3] * factor)):
        return False, False
    return f[1] <= 0, bool(f[2]) and f[1] == 0
