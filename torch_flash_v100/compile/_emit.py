"""Stage 3 of the rewrite: graph edits (FusedCall -> nodes), undo, dead-node cleanup.

:func:`emit` builds the nodes of one fused call before its anchor (the p @ v product or SDPA
call), with fake values computed as Dynamo computes them, checks that no input is mutated in
place inside the attention, points the anchor's users at the result and erases what only the
unfused subgraph used.  On any failure the created nodes are removed again (:meth:`Emitter.undo`).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch.fx import Graph, Node

from ._fx_nodes import Op, is_pure, mutators, ndim, norm, shape, shapes_eq, sym_eq, val
from ._match import Reject, nd_dim
from ._plan import (AddTerm, AlibiSlopes, FillTerm, FusedCall, GivenMask, SaturatedRows,
                    ScaleAdded, ScaleAddedByTensor)


def target_op():
    import torch_flash_v100  # noqa: F401  (registers the op)
    return torch.ops.flashv100.attention.default


def flash_op():
    """The FlashAttention-2 op (its autograd is registered by ``torch_flash_v100``)."""
    import torch_flash_v100  # noqa: F401
    return torch.ops.flashv100._flash_forward.default


class Emitter:
    """Creates nodes before ``anchor`` and records fake values for them; undoable.  A target
    that is a string is a method of the first argument."""

    def __init__(self, graph: Graph, anchor: Node, key: str):
        self.graph = graph
        self.anchor = anchor
        self.key = key
        self.created: list[Node] = []

    def __call__(self, target, args, kwargs=None) -> Node:
        kwargs = kwargs or {}
        with self.graph.inserting_before(self.anchor):
            if isinstance(target, str):
                n = self.graph.call_method(target, tuple(args), kwargs)
            else:
                n = self.graph.call_function(target, tuple(args), kwargs)
        self.created.append(n)
        n.meta.update({k: v for k, v in self.anchor.meta.items()
                       if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
        fargs = torch.fx.node.map_arg(tuple(args), val)
        fkwargs = torch.fx.node.map_arg(kwargs, val)
        mode = None
        for a in torch.utils._pytree.tree_leaves((fargs, fkwargs)):
            mode = getattr(a, "fake_mode", None)
            if mode is not None:
                break
        fn = target
        if isinstance(target, str):
            fn = getattr(fargs[0], target)
            fargs = fargs[1:]
        try:
            if mode is not None:
                # as Dynamo computes fake values: with symbolic shapes some ops need the Python
                # dispatcher's meta kernels (torch 2.8's C++ one for view takes concrete sizes only)
                with mode, enable_python_dispatcher():
                    v = fn(*fargs, **fkwargs)
            else:
                v = fn(*fargs, **fkwargs)
        except Exception as e:
            raise Reject(f"cannot build {getattr(target, '__name__', target)}: {e}") from e
        n.meta[self.key] = v
        return n

    def undo(self) -> None:
        for n in reversed(self.created):
            if not n.users:
                self.graph.erase_node(n)
        self.created.clear()


def relayout(n: Any, frm, to, em: Emitter) -> Any:
    """Reshape the leading (batch) dims of n from ``frm`` to ``to`` (same element count)."""
    if shapes_eq(frm, to):
        return n
    if not frm or not to:
        raise Reject("scores reshaped to or from a 2-D layout")
    sizes = [d if isinstance(d, int) else None for d in to]
    if sizes.count(None) > 1:
        raise Reject("reshape of the scores with several dynamic leading dims")
    sizes = [-1 if d is None else d for d in sizes]
    x = n
    if len(frm) > 1:
        x = em(torch.flatten, (x, 0, len(frm) - 1))
    if len(to) > 1:
        x = em(torch.unflatten, (x, 0, tuple(sizes)))
    return x


def _piece_to(piece: Any, cur_b, sb, em: Emitter) -> Any:
    """A mask piece applied to the scores in layout ``cur_b``, expressed in layout ``sb``."""
    if shapes_eq(cur_b, sb):
        return piece
    ps = shape(piece)
    if ps is None:
        raise Reject("mask without shape metadata")
    pbat = ps[:-2]
    if len(ps) <= 2:
        return piece
    if all(sym_eq(d, 1) for d in pbat):
        return em(operator.getitem, (piece, (0,) * len(pbat)))
    if len(pbat) == len(cur_b) and shapes_eq(pbat, cur_b):
        return relayout(piece, cur_b, sb, em)
    raise Reject("mask broadcast over part of the batch, applied before a reshape of the "
                 "scores")


def _negated_bool(cond: Any) -> Optional[Any]:
    """x when ``cond`` is ``~x`` of a bool tensor x, else None."""
    co = norm(cond)
    if co is not None and co.name == "not":
        x = val(co.get("self"))
        if x is not None and x.dtype == torch.bool:
            return co.get("self")
    return None


def _emit_mask(call: FusedCall, em: Emitter) -> Optional[Node]:
    """The mask of the fused call: additive terms summed (fp32 ``finfo.min`` for finite fills),
    bool terms and-ed, both combined as where(keep, additive, -inf)."""
    sb = call.mask_layout
    add_mask = keep = None
    for t in call.mask_terms:
        if isinstance(t, GivenMask):
            return t.mask
        if isinstance(t, AddTerm):
            m = _piece_to(t.mask, t.layout, sb, em)
            if t.promoted_bool:
                m = em(torch.where, (m, 1.0, 0.0))
            if t.beta != 1.0:
                m = em(torch.mul, (m, t.beta))
            add_mask = m if add_mask is None else em(torch.add, (add_mask, m))
        elif isinstance(t, ScaleAdded):
            if add_mask is not None:
                add_mask = em(torch.mul, (add_mask, t.factor))
        elif isinstance(t, ScaleAddedByTensor):
            if add_mask is not None:
                add_mask = em(torch.div if t.divide else torch.mul, (add_mask, t.node))
        elif t.value != -math.inf:
            # A finite fill (finfo.min, -1e9...): an additive fp32 finfo.min mask, which
            # saturates like the fill does, so rows with every key masked stay uniform
            # as in eager (a bool mask would make them zero).
            cond, filled_where_true = t.cond, t.fill_where_true
            inner = _negated_bool(cond) if filled_where_true else None
            if inner is not None:
                cond, filled_where_true = inner, False
            cond = _piece_to(cond, t.layout, sb, em)
            lo = torch.finfo(torch.float32).min
            m = em(torch.where, (cond, lo, 0.0) if filled_where_true else (cond, 0.0, lo))
            add_mask = m if add_mask is None else em(torch.add, (add_mask, m))
        else:
            assert isinstance(t, FillTerm)
            cond = _piece_to(t.cond, t.layout, sb, em)
            if t.fill_where_true:
                piece = _negated_bool(cond)
                if piece is None:
                    piece = em(torch.logical_not, (cond,))
            else:
                piece = cond
            keep = piece if keep is None else em(torch.logical_and, (keep, piece))
    if keep is not None and add_mask is not None:
        return em(torch.where, (keep, add_mask, -math.inf))
    return keep if keep is not None else add_mask


def _operands(call: FusedCall, em: Emitter) -> list:
    """q, k, v in the op's layout: permutations first, then the layouts."""
    out = []
    for o in (call.q, call.k, call.v):
        x = o.source
        if o.transpose_last2:
            x = em(torch.transpose, (x, -2, -1))
        if o.permute is not None:
            x = em(torch.permute, (x, list(o.permute)))
        out.append(x)
    for i, o in enumerate((call.q, call.k, call.v)):
        if o.layout is not None:
            out[i] = relayout(out[i], o.layout[0], o.layout[1], em)
    return out


def emit(call: FusedCall, graph: Graph, key: str, erased: set, pos: dict) -> tuple[Node, Any]:
    """Build ``call`` before its anchor, replace the anchor by it, erase the dead subgraph;
    returns the result and the mask passed to the op."""
    em = Emitter(graph, call.anchor, key)
    try:
        q, k, v = _operands(call, em)
        mask = _emit_mask(call, em) if call.flash is None else None
        for n, divide in call.q_scale_tensors:
            q = em(torch.div if divide else torch.mul, (q, n))
        if call.flash is not None:
            result = _flash_call(call, q, k, v, em)
        else:
            result = em(target_op(), (q, k, v, mask, float(call.dropout_p),
                                      bool(call.is_causal)),
                        {"scale": float(call.scale), "enable_gqa": bool(call.enable_gqa)})
        if call.saturated_rows is not None and mask is not None:
            result = _average_saturated_rows(call.saturated_rows, q, k, v, mask, call.scale,
                                             result, em)
        if call.read_from is not None:  # an SDPA call reads its inputs where it stands
            _check_no_mutation(em, call.read_from, call.anchor, pos)
        if call.result_layout is not None:
            result = relayout(result, call.result_layout[0], call.result_layout[1], em)
        if call.result_permute is not None:
            result = em(torch.permute, (result, call.result_permute))
    except Exception:
        em.undo()
        raise
    _replace(graph, call.anchor, result, call.dead, erased)
    return result, mask


def _flash_call(call: FusedCall, q, k, v, em: Emitter) -> Node:
    """The FlashAttention-2 op on q, k, v of the op's layout ([N, L, E] or [B, H, L, E]), which
    it takes as [B, L, H, E] views; the result back in the op's layout."""
    rules, lead = call.flash, len(call.mask_layout)
    slopes = _slopes_tensor(rules.alibi, q, call.mask_layout, em) \
        if rules.alibi is not None else None
    qf, kf, vf = (_to_flash_layout(x, lead, em) for x in (q, k, v))
    res = em(flash_op(), (qf, kf, vf, None, None, _size(qf, 1, em), _size(kf, 1, em),
                          float(call.dropout_p), float(call.scale), rules.window_right == 0,
                          rules.window_left, rules.window_right, float(rules.softcap), slopes))
    out = em(torch.transpose, (em(operator.getitem, (res, 0)), 1, 2))
    return em(torch.squeeze, (out, 1)) if lead == 1 else out


def _to_flash_layout(x, lead: int, em: Emitter):
    if lead == 1:
        x = em(torch.unsqueeze, (x, 1))
    x = em(torch.transpose, (x, 1, 2))
    v = val(x)
    if not (sym_eq(v.shape[-1], 1) or sym_eq(v.stride(-1), 1)):
        x = em("contiguous", (x,))  # the op reads rows of the last dim as vectors
    return x


def _size(x, dim: int, em: Emitter):
    n = shape(x)[dim]
    return n if isinstance(n, int) else em(torch.ops.aten.sym_size.int, (x, dim))


def _slopes_tensor(alibi: AlibiSlopes, q, layout: tuple, em: Emitter) -> Node:
    """The op's fp32 slopes, [B, H] (or [N, 1] for 3-D scores): ``alibi.factor * per_head``
    broadcast over the leading dims of the scores where the bias was added, then laid out as
    the op's (those of q)."""
    zeros = em(torch.zeros_like, (em(operator.getitem, (q, (Ellipsis, 0, 0))),),
               {"dtype": torch.float32})
    zeros = relayout(zeros, layout, alibi.layout, em)
    if alibi.per_head is None:
        slopes = em(torch.add, (zeros, alibi.factor))
    else:
        per_head = em(torch.reshape, (alibi.per_head, alibi.per_head_shape))
        per_head = em("to", (per_head, torch.float32))
        slopes = em(torch.add, (zeros, per_head))
        if alibi.factor != 1.0:
            slopes = em(torch.mul, (slopes, alibi.factor))
    slopes = relayout(slopes, alibi.layout, layout, em)
    return em(torch.unsqueeze, (slopes, -1)) if len(layout) == 1 else slopes


def _average_saturated_rows(rule: SaturatedRows, q, k, v, mask, scale: float, out,
                            em: Emitter) -> Node:
    """``out`` with the rows that ``mask`` masks everywhere by one saturating value replaced by
    eager's result there: the average of v over all keys.

    Their gradient is eager's too.  With additive masks eager's softmax backward runs at the
    uniform row p = 1/S: dS_ij = (g_i . (v_j - v_mean)) / S, which is the gradient of
    scale * q_i @ Cov(k, v), Cov = (k - k_mean)^T (v - v_mean) / S (v's gradient comes from the
    average alone, so v is detached there); that term is added with value zero (c - c.detach()).
    Memory: two reductions of the mask over keys, [.., L, 1], and per head an E x Ev matrix.
    """
    mmax = em(torch.amax, (mask, -1, True))
    mmin = em(torch.amin, (mask, -1, True))
    full = em(torch.logical_and, (em(torch.eq, (mmin, mmax)),
                                  em(torch.le, (mmax, rule.threshold))))
    full = em(torch.logical_and, (full, em(torch.isfinite, (mmax,))))
    qs, ks = shape(q), shape(k)
    heads_q, heads_kv = (qs[-3], ks[-3]) if len(qs) >= 3 else (1, 1)
    grouped = not sym_eq(heads_q, heads_kv)
    if grouped and not (isinstance(heads_q, int) and isinstance(heads_kv, int)):
        raise Reject("symbolic head counts with GQA and a mask that can mask whole rows")
    v_mean = em(torch.mean, (v, -2, True))  # [..., Hkv, 1, Ev]
    group = heads_q // heads_kv if grouped else 1
    if not rule.grad_through_scores:
        fixed = em(torch.repeat_interleave, (v_mean, group, -3)) if grouped else v_mean
        return em(torch.where, (full, fixed, out))
    keys = ks[-2]
    k_centred = em(torch.sub, (k, em(torch.mean, (k, -2, True))))
    v_detached = em(torch.detach, (v,))
    v_centred = em(torch.sub, (v_detached, em(torch.mean, (v_detached, -2, True))))
    cov = em(torch.matmul, (em(torch.transpose, (k_centred, -2, -1)), v_centred))
    if isinstance(keys, int):
        cov = em(torch.div, (cov, float(keys)))
    else:  # 1 / S from the keys themselves: a symbolic length has no constant
        ones = em(torch.ones_like, (em(operator.getitem, (k, (Ellipsis, slice(0, 1)))),))
        cov = em(torch.div, (cov, em(torch.sum, (ones, -2, True))))
    q_scaled = em(torch.mul, (q, float(scale)))
    if grouped:  # [..., Hkv, group, L, E] against [..., Hkv, 1, E, Ev]
        q_scaled = em(torch.unflatten, (q_scaled, -3, (heads_kv, group)))
        cov = em(torch.unsqueeze, (cov, -3))
        v_mean = em(torch.unsqueeze, (v_mean, -3))
    c = em(torch.matmul, (q_scaled, cov))
    fixed = em(torch.add, (v_mean, em(torch.sub, (c, em(torch.detach, (c,))))))
    if grouped:
        fixed = em(torch.flatten, (fixed, -4, -3))
    return em(torch.where, (full, fixed, out))


def _check_no_mutation(em: Emitter, first: Node, last: Node, pos: dict) -> None:
    """The fused op runs where p @ v ran: every tensor it reads must hold the same value
    there as where the unfused subgraph read it."""
    created = set(em.created)
    refs = set()
    for n in em.created:
        refs.update(a for a in n.all_input_nodes if a not in created)
    hi = pos.get(last, -1)
    for r in refs:
        muts = mutators(r)
        if not muts:
            continue
        # where the unfused subgraph first read r: its earliest reader that is no mutator
        readers = [pos[u] for u in r.users if u not in muts and u in pos]
        lo = min(readers, default=pos.get(first, -1))
        for m in muts:
            p = pos.get(m)
            if p is not None and lo < p < hi:
                raise Reject(f"{r.name} is mutated in place ({m.name}) inside the attention")


def _replace(graph: Graph, old: Node, new: Node, chain: list, erased: set) -> None:
    old.replace_all_uses_with(new)
    doomed = [old] + list(reversed(chain))
    work = []
    for n in doomed:
        if not n.users and n not in erased:
            work.extend(n.all_input_nodes)
            graph.erase_node(n)
            erased.add(n)
    # drop what only the unfused subgraph used (pure ops only)
    while work:
        n = work.pop()
        if n in erased or n.users or not is_pure(n):
            continue
        work.extend(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)


def softmax_to_last_dim(sm: Op, graph: Graph, key: str, erased: set, pos: dict) -> bool:
    """Rewrite ``softmax(x, d)`` over a dim ``d`` that is not the last as
    ``softmax(x.transpose(d, -1), -1).transpose(d, -1)``: the same values and gradients.

    Inductor's attention patterns (``torch/_inductor/fx_passes/fuse_attention.py``) ignore the
    softmax's dim, so they rewrite ``softmax(q @ k^T, dim=-2) @ v`` into SDPA (wrong values and
    gradients in torch 2.13); with a transpose between the scores and the softmax no pattern
    matches.  Returns whether the graph changed.
    """
    nd = ndim(sm.get("self"))
    d = nd_dim(sm.get("dim"), nd) if nd is not None else None
    if d is None or d == nd - 1:
        return False
    em = Emitter(graph, sm.node, key)
    try:
        xt = em(torch.transpose, (sm.get("self"), d, nd - 1))
        dtype = sm.get("dtype")
        p = em(torch.softmax, (xt, nd - 1), {"dtype": dtype} if dtype is not None else {})
        out = em(torch.transpose, (p, d, nd - 1))
    except Reject:
        em.undo()
        return False
    sm.node.replace_all_uses_with(out)
    graph.erase_node(sm.node)
    erased.add(sm.node)
    for n in em.created:
        pos[n] = pos.get(sm.node, -1)
    return True
