"""Stage 1 of the rewrite: find an attention subgraph around a softmax (graph -> AttentionMatch).

From a softmax over the last dim the matcher walks

* forwards through casts, dropout and reshapes of the leading dims to the ``p @ v`` product, and
* backwards through scale factors, additive masks, ``masked_fill`` / ``where`` fills, tanh
  (soft-capping), casts and reshapes to the ``q @ k^T`` product (``matmul``, ``bmm``, ``@``,
  ``einsum``, ``baddbmm``),

recording what it passes as typed :data:`ScoreStep` values.  Nothing here edits the graph or
decides what the fused call looks like: that is :mod:`._plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch.fx import Node

from ._fx_nodes import Op, is_number, ndim, norm, shape, shapes_eq, sym_eq, val

CASTS = ("to", "cast_float", "cast_half", "cast_bfloat16", "cast_double", "type", "type_as")


class Reject(Exception):
    """The site is left alone; the message says why (it is logged and kept in ``history``)."""


# ---- what lies between the q @ k^T product and the softmax -------------------------------------

@dataclass(frozen=True)
class ReshapeScores:
    """A reshape of the scores' leading (batch) dims; ``node`` is the reshaped value."""
    node: Node


@dataclass(frozen=True)
class ScaleBy:
    """Scores multiplied by a constant."""
    factor: float


@dataclass(frozen=True)
class ScaleByTensor:
    """Scores multiplied (or divided) by a 0-d tensor or a symbolic scalar."""
    node: Node
    divide: bool


@dataclass(frozen=True)
class AddMask:
    """An additive mask: scores + beta * mask, computed in ``dtype``."""
    mask: Any
    beta: float
    dtype: torch.dtype


@dataclass(frozen=True)
class FillMask:
    """Scores replaced by ``value`` where ``cond`` is True (``fill_where_true``, masked_fill) or
    where it is False (``where(cond, scores, value)``)."""
    cond: Any
    value: Any
    fill_where_true: bool


@dataclass(frozen=True)
class Tanh:
    """The scores through tanh (soft-capping: ``cap * tanh(scores / cap)``, the factors around it
    being ``ScaleBy`` steps)."""


ScoreStep = Union[ReshapeScores, ScaleBy, ScaleByTensor, AddMask, FillMask, Tanh]


@dataclass(frozen=True)
class Product:
    """A batched product: ``matmul`` (left @ right) or a two-operand ``einsum``."""
    kind: str  # "matmul" | "einsum"
    node: Node
    left: Any
    right: Any
    equation: Optional[str] = None


@dataclass
class AttentionMatch:
    """softmax(steps(q @ k^T)) -> casts/dropout -> @ v, as found in the graph."""
    softmax: Op
    probs_chain: list[Node]  # the softmax and the nodes between it and the p @ v product
    qk: Product
    pv: Product
    steps: list[ScoreStep] = field(default_factory=list)  # from the softmax back to q @ k^T
    dropout_p: float = 0.0
    score_chain: list[Node] = field(default_factory=list)  # softmax input back to the product


def nd_dim(d: Any, nd: int) -> Optional[int]:
    if not isinstance(d, int):
        return None
    return d + nd if d < 0 else d


def last2_kept(a: Any, b: Any) -> bool:
    sa, sb = shape(a), shape(b)
    return (sa is not None and sb is not None and len(sa) >= 2 and len(sb) >= 2 and
            sym_eq(sa[-1], sb[-1]) and sym_eq(sa[-2], sb[-2]))


def is_float(n: Any) -> bool:
    v = val(n)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _is_scalar_tensor_node(x: Any) -> bool:
    if not isinstance(x, Node):
        return False
    v = val(x)
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        return True
    return isinstance(v, torch.Tensor) and v.dim() == 0


def _is_product(o: Op) -> bool:
    return o.name == "matmul" or (o.name == "einsum" and len(o.varargs or []) == 2)


def _desc(n: Any) -> str:
    if not isinstance(n, Node):
        return repr(n)
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def match_softmax(sm: Op) -> AttentionMatch:
    """The attention around softmax ``sm``, or :class:`Reject`."""
    x = sm.get("self")
    nd = ndim(x)
    if nd is None:
        raise Reject("no shape metadata on the softmax input")
    if nd_dim(sm.get("dim"), nd) != nd - 1:
        raise Reject(f"softmax over dim {sm.get('dim')}, not the last dim")
    probs_chain, pv, dropout_p = _walk_to_pv(sm.node)
    qk, steps, score_chain = _walk_to_qk(x)
    return AttentionMatch(sm, probs_chain, qk, pv, steps, dropout_p, score_chain)


def _walk_to_pv(node: Node) -> tuple[list[Node], Product, float]:
    cur = node
    chain = [node]
    dropout_p = 0.0
    seen_dropout = False
    while True:
        users = list(cur.users)
        if len(users) != 1:
            raise Reject(f"attention probabilities used elsewhere ({len(users)} users of "
                         f"{cur.name})" if users else "softmax result unused")
        u = users[0]
        uo = norm(u)
        if u.op == "output":
            raise Reject("attention probabilities used elsewhere (returned from the graph)")
        if uo is None:
            raise Reject(f"probabilities feed {u.op} {u.target}, not a matmul with v")
        if uo.name in CASTS or uo.name == "identity":
            if uo.get("self") is not cur or not is_float(u):
                raise Reject(f"probabilities feed {uo.name}")
        elif uo.name == "dropout" and uo.get("self") is cur and not seen_dropout:
            p = uo.get("p", 0.5)
            training = uo.get("training", True)
            if not is_number(p) or not isinstance(training, bool):
                raise Reject("dropout with non-constant p/training")
            dropout_p = float(p) if training else 0.0
            seen_dropout = True
        elif uo.name == "reshape" and uo.get("self") is cur and last2_kept(cur, u):
            pass
        elif uo.name == "matmul" and uo.get("self") is cur and uo.get("other") is not cur:
            return chain, Product("matmul", u, cur, uo.get("other")), dropout_p
        elif uo.name == "einsum" and len(uo.varargs or []) == 2 and uo.varargs[0] is cur \
                and uo.varargs[1] is not cur:
            return chain, Product("einsum", u, cur, uo.varargs[1], uo.get("equation")), dropout_p
        else:
            raise Reject(f"probabilities feed {uo.name}, not (casts, dropout, matmul with v)")
        chain.append(u)
        cur = u


def _walk_to_qk(x: Node) -> tuple[Product, list[ScoreStep], list[Node]]:
    steps: list[ScoreStep] = []
    chain: list[Node] = []
    cur = x
    qk = None
    capped = False  # a tanh passed: the scores below it are no longer shift invariant
    for _ in range(64):
        chain.append(cur)
        o = norm(cur)
        if o is None:
            raise Reject(f"softmax input comes from {cur.op} {cur.target}, "
                         "not a q @ k^T product")
        if o.name == "matmul":
            qk = Product("matmul", cur, o.get("self"), o.get("other"))
            break
        if o.name == "einsum" and len(o.varargs or []) == 2:
            qk = Product("einsum", cur, o.varargs[0], o.varargs[1], o.get("equation"))
            break
        if o.name == "baddbmm":  # beta * input + alpha * (batch1 @ batch2)
            beta, alpha = o.get("beta", 1), o.get("alpha", 1)
            if not (is_number(beta) and is_number(alpha)):
                raise Reject("baddbmm with non-constant alpha/beta")
            if beta != 0:
                steps.append(AddMask(o.get("self"), float(beta), val(cur).dtype))
            steps.append(ScaleBy(float(alpha)))
            qk = Product("matmul", cur, o.get("batch1"), o.get("batch2"))
            break
        if o.name == "reshape" and last2_kept(o.get("self"), cur):
            steps.append(ReshapeScores(cur))
            cur = o.get("self")
            continue
        if o.name in ("mul", "div"):
            cur = _scale_step(o, steps)
            continue
        if o.name == "tanh":
            if capped:
                raise Reject("tanh applied twice to the scores")
            steps.append(Tanh())
            capped = True
            cur = o.get("self")
            continue
        if o.name in ("add", "sub"):
            a, b = o.get("self"), o.get("other")
            shift = b if is_number(b) else a if o.name == "add" and is_number(a) else None
            if capped and shift is not None and shift != 0:
                raise Reject("a constant added to the scores before the tanh soft-capping "
                             "(the op caps the scaled q @ k^T itself)")
            if is_number(b):
                cur = a  # constant shift: softmax is shift invariant
                continue
            if o.name == "add" and is_number(a):
                cur = b
                continue
            if o.name == "sub":
                if not reaches_scores(a):
                    raise Reject("a tensor minus the scores" if reaches_scores(b) else
                                 "no q @ k^T product behind the sub")
                steps.append(AddMask(b, -1.0, val(cur).dtype))
                cur = a
                continue
            if reaches_scores(a):
                steps.append(AddMask(b, 1.0, val(cur).dtype))
                cur = a
            elif reaches_scores(b):
                steps.append(AddMask(a, 1.0, val(cur).dtype))
                cur = b
            else:
                raise Reject("no q @ k^T product behind the add (the scores come through "
                             f"unsupported {_blocker(a) or _blocker(b)})")
            continue
        if o.name == "masked_fill":
            steps.append(FillMask(o.get("mask"), o.get("value"), fill_where_true=True))
            cur = o.get("self")
            continue
        if o.name == "where":
            c, a, b = o.get("condition"), o.get("self"), o.get("other")
            if reaches_scores(a):
                steps.append(FillMask(c, b, fill_where_true=False))
                cur = a
            elif reaches_scores(b):
                steps.append(FillMask(c, a, fill_where_true=True))
                cur = b
            else:
                raise Reject("no q @ k^T product behind the where")
            continue
        if o.name in CASTS or o.name == "identity":
            cur = o.get("self")
            continue
        raise Reject(f"unsupported {o.name} between q @ k^T and softmax")
    if qk is None:
        raise Reject("no q @ k^T product found")
    # the scores keep their shape from the product to the softmax (up to reshapes of the
    # leading dims): a mask never broadcasts them to a larger shape
    prev = shape(qk.node)
    for n in reversed(chain):
        sn = shape(n)
        if prev is None or sn is None:
            raise Reject("no shape metadata")
        if not shapes_eq(prev, sn) and not (norm(n).name == "reshape" and
                                            last2_kept(norm(n).get("self"), n)):
            raise Reject("the mask broadcasts the scores to a larger shape")
        prev = sn
    return qk, steps, chain


def _scale_step(o: Op, steps: list) -> Any:
    """Record the mul/div ``o`` of the scores; returns the scores operand."""
    a, b = o.get("self"), o.get("other")
    if is_number(b):
        if b == 0:
            raise Reject("division by zero")
        steps.append(ScaleBy(float(b) if o.name == "mul" else 1.0 / float(b)))
        return a
    if o.name == "mul" and is_number(a):
        steps.append(ScaleBy(float(a)))
        return b
    if _is_scalar_tensor_node(b):
        steps.append(ScaleByTensor(b, divide=o.name == "div"))
        return a
    if o.name == "mul" and _is_scalar_tensor_node(a):
        steps.append(ScaleByTensor(a, divide=False))
        return b
    raise Reject("scores multiplied by a non-scalar tensor")


def _blocker(n: Any, depth: int = 0) -> Optional[str]:
    """The first op on the score path that the matcher does not understand."""
    if depth > 32 or not isinstance(n, Node):
        return None
    o = norm(n)
    if o is None:
        return _desc(n)
    for key in ("self", "other", "condition"):
        a = o.get(key)
        if isinstance(a, Node) and ndim(a) is not None and ndim(a) >= 2:
            return _blocker(a, depth + 1)
    return None


def reaches_scores(n: Any, depth: int = 0) -> bool:
    """Whether following the score path from n reaches a matmul/einsum."""
    if depth > 32:
        return False
    o = norm(n)
    if o is None:
        return False
    if _is_product(o) or o.name == "baddbmm":
        return True
    if o.name in ("mul", "div", "add", "sub"):
        a, b = o.get("self"), o.get("other")
        if isinstance(a, Node) and reaches_scores(a, depth + 1):
            return True
        return o.name in ("mul", "add") and isinstance(b, Node) and reaches_scores(b, depth + 1)
    if o.name in ("masked_fill", "reshape", "tanh") or o.name in CASTS or o.name == "identity":
        return reaches_scores(o.get("self"), depth + 1)
    if o.name == "where":
        return any(reaches_scores(o.get(k), depth + 1) for k in ("self", "other"))
    return False


@dataclass
class SdpaMatch:
    """An ``F.scaled_dot_product_attention`` call with constant options."""
    node: Node
    query: Any
    key: Any
    value: Any
    attn_mask: Any
    dropout_p: float
    is_causal: bool
    scale: Any
    enable_gqa: bool


def match_sdpa(op: Op) -> SdpaMatch:
    dropout_p = op.get("dropout_p", 0.0)
    is_causal = op.get("is_causal", False)
    gqa = op.get("enable_gqa", False)
    if not isinstance(is_causal, bool) or not is_number(dropout_p) or not isinstance(gqa, bool):
        raise Reject("non-constant SDPA arguments")
    return SdpaMatch(op.node, op.get("query"), op.get("key"), op.get("value"),
                     op.get("attn_mask"), float(dropout_p), is_causal, op.get("scale"), gqa)
