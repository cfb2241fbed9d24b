"""The semantic attention matcher and rewriter, on torch-level (pre-autograd) FX graphs.

For every softmax node the matcher walks

* backwards from the softmax input through scale (mul/div by constants), additive masks,
  ``masked_fill``/``where`` fills, dtype casts, to the ``q @ k^T`` product (matmul, bmm, einsum, @;
  any transpose/permute of k; scalar factors on q or k are folded into ``scale``), and
* forwards from the softmax output through casts and dropout to the ``p @ v`` product,

then replaces the whole subgraph with one ``flashv100.attention`` call.  Masks are analysed
(:mod:`._masks`) so that a provably lower-triangular mask becomes ``is_causal=True`` (with the mask
kept only when it holds more than the causal part).  ``repeat_kv``-style expand+reshape or
``repeat_interleave`` of k and v becomes ``enable_gqa=True``.  ``F.scaled_dot_product_attention``
calls are rewritten too.  Every softmax considered is logged with the reason when it is not
rewritten.

Because the rewrite happens before autograd (Dynamo graph / Inductor pre-grad pass), AOTAutograd
derives the backward from the fused op itself: ``flashv100._attention_backward``.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Optional

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch.fx import Graph, Node

from ._masks import MaskFacts, causal_bound, is_neg
from ._ops import Op, is_number, mutators, ndim, norm, shape, shapes_eq, sym_eq, val

log = logging.getLogger("torch_flash_v100.compile")

_CASTS = ("to", "cast_float", "cast_half", "cast_bfloat16", "cast_double", "type", "type_as")


#: (site, rewritten, how-or-why) for every site considered since import; tests and reports
#: read it (``history.clear()`` to start afresh).
history: list[tuple[str, bool, str]] = []


class Reject(Exception):
    pass


def _counters():
    from torch._dynamo.utils import counters
    return counters


def _target_op():
    import torch_flash_v100  # noqa: F401  (registers the op)
    return torch.ops.flashv100.attention.default


def _where(node: Node) -> str:
    st = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', st)
    if frames:
        f, line, fn = frames[-1]
        return f"{f.rsplit('/', 1)[-1]}:{line} in {fn}"
    return "<unknown location>"


def device_supported(t: Any, force: bool) -> tuple[bool, str]:
    """The pass targets CUDA devices without a PyTorch flash backend (sm < 80), or any when forced."""
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


class _Emitter:
    """Creates nodes before ``anchor`` and records fake values for them; undoable."""

    def __init__(self, graph: Graph, anchor: Node, key: str):
        self.graph = graph
        self.anchor = anchor
        self.key = key
        self.created: list[Node] = []

    def __call__(self, target, args, kwargs=None) -> Node:
        kwargs = kwargs or {}
        with self.graph.inserting_before(self.anchor):
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
        try:
            if mode is not None:
                # as Dynamo computes fake values: with symbolic shapes some ops need the Python
                # dispatcher's meta kernels (torch 2.8's C++ one for view takes concrete sizes only)
                with mode, enable_python_dispatcher():
                    v = target(*fargs, **fkwargs)
            else:
                v = target(*fargs, **fkwargs)
        except Exception as e:
            raise Reject(f"cannot build {getattr(target, '__name__', target)}: {e}") from e
        n.meta[self.key] = v
        return n

    def undo(self) -> None:
        for n in reversed(self.created):
            if not n.users:
                self.graph.erase_node(n)
        self.created.clear()


def _nd_dim(d: Any, nd: int) -> Optional[int]:
    if not isinstance(d, int):
        return None
    return d + nd if d < 0 else d


def _scalar_factor(o: Any) -> Optional[tuple]:
    """(operand, factor) when node ``o`` multiplies or divides by a non-zero number, else None."""
    if o.name in ("mul", "div") and is_number(o.get("other")) and o.get("other") != 0:
        c = float(o.get("other"))
        return o.get("self"), (c if o.name == "mul" else 1.0 / c)
    if o.name == "mul" and is_number(o.get("self")):
        return o.get("other"), float(o.get("self"))
    return None


def _is_last2_transpose(op, nd: int) -> bool:
    if op is None or op.name != "transpose":
        return False
    d0, d1 = _nd_dim(op.get("dim0"), nd), _nd_dim(op.get("dim1"), nd)
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


def _scalar_of(x: Any) -> Optional[float]:
    return float(x) if is_number(x) else None


def _is_scalar_tensor_node(x: Any) -> bool:
    if not isinstance(x, Node):
        return False
    v = val(x)
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        return True
    if isinstance(v, torch.Tensor):
        return v.dim() == 0
    return False


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


class AttentionRewriter:
    def __init__(self, graph: Graph, force: bool = False):
        self.graph = graph
        self.force = force
        self.facts = MaskFacts()
        self.key = "example_value"
        for n in graph.nodes:
            if "example_value" in n.meta:
                break
            if "val" in n.meta:
                self.key = "val"
                break
        self.erased: set = set()
        self.pos = {n: i for i, n in enumerate(graph.nodes)}
        self.fused = 0
        self.results: list[tuple[str, bool, str]] = []

    # ---------------------------------------------------------------------------------------
    def run(self) -> int:
        for node in list(self.graph.nodes):
            if node in self.erased:
                continue
            op = norm(node)
            if op is None or op.name not in ("softmax", "sdpa"):
                continue
            site = f"{op.name} {node.name} at {_where(node)}"
            try:
                how = self._softmax(op) if op.name == "softmax" else self._sdpa(op)
            except Reject as e:
                self.results.append((site, False, str(e)))
                log.info("flashv100: NOT rewritten: %s: %s", site, e)
                _counters()["flashv100"]["not_fused"] += 1
                continue
            except Exception as e:  # a bug of ours must not break the user's compile
                why = f"internal error in the matcher: {type(e).__name__}: {e}"
                self.results.append((site, False, why))
                log.warning("flashv100: NOT rewritten: %s: %s", site, why, exc_info=True)
                _counters()["flashv100"]["not_fused"] += 1
                continue
            self.fused += 1
            self.results.append((site, True, how))
            _counters()["flashv100"]["fused_attention"] += 1
            log.info("flashv100: rewritten: %s -> %s", site, how)
        return self.fused

    # ---------------------------------------------------------------------------------------
    def _check_device(self, q: Node) -> None:
        ok, why = device_supported(val(q), self.force)
        if not ok:
            raise Reject(why)

    def _softmax(self, sm) -> str:
        node = sm.node
        x = sm.get("self")
        nd = ndim(x)
        if nd is None:
            raise Reject("no shape metadata on the softmax input")
        dim = _nd_dim(sm.get("dim"), nd)
        if dim != nd - 1:
            raise Reject(f"softmax over dim {sm.get('dim')}, not the last dim")

        # ---- forward: softmax -> (casts, dropout) -> p @ v ----
        cur = node
        fwd = [node]
        dropout_p = 0.0
        seen_dropout = False
        pv = None
        pv_kind = None
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
            if uo.name in _CASTS or uo.name == "identity":
                if uo.get("self") is not cur or not _is_float(u):
                    raise Reject(f"probabilities feed {uo.name}")
                fwd.append(u)
                cur = u
                continue
            if uo.name == "dropout" and uo.get("self") is cur and not seen_dropout:
                p = uo.get("p", 0.5)
                training = uo.get("training", True)
                if not is_number(p) or not isinstance(training, bool):
                    raise Reject("dropout with non-constant p/training")
                dropout_p = float(p) if training else 0.0
                seen_dropout = True
                fwd.append(u)
                cur = u
                continue
            if uo.name == "reshape" and uo.get("self") is cur and _last2_kept(cur, u):
                fwd.append(u)
                cur = u
                continue
            if uo.name == "matmul" and uo.get("self") is cur and uo.get("other") is not cur:
                pv, pv_kind = uo, "matmul"
                break
            if uo.name == "einsum" and len(uo.varargs or []) == 2 and uo.varargs[0] is cur \
                    and uo.varargs[1] is not cur:
                pv, pv_kind = uo, "einsum"
                break
            raise Reject(f"probabilities feed {uo.name}, not (casts, dropout, matmul with v)")

        # ---- backward: softmax input -> ... -> q @ k^T ----
        steps: list[tuple] = []
        cur = x
        qk = None
        chain: list[Node] = []
        for _ in range(64):
            chain.append(cur)
            o = norm(cur)
            if o is None:
                raise Reject(f"softmax input comes from {cur.op} {cur.target}, "
                             "not a q @ k^T product")
            if o.name == "matmul" or (o.name == "einsum" and len(o.varargs or []) == 2):
                qk = o
                break
            if o.name == "baddbmm":  # beta * input + alpha * (batch1 @ batch2)
                beta, alpha = o.get("beta", 1), o.get("alpha", 1)
                if not (is_number(beta) and is_number(alpha)):
                    raise Reject("baddbmm with non-constant alpha/beta")
                if beta != 0:
                    steps.append(("add", o.get("self"), float(beta)))
                steps.append(("scale", float(alpha)))
                qk = Op("matmul", {"self": o.get("batch1"), "other": o.get("batch2")}, None,
                        cur)
                break
            if o.name == "reshape" and _last2_kept(o.get("self"), cur):
                steps.append(("reshape", cur))
                cur = o.get("self")
                continue
            if o.name in ("mul", "div"):
                a, b = o.get("self"), o.get("other")
                if is_number(b):
                    if b == 0:
                        raise Reject("division by zero")
                    steps.append(("scale", float(b) if o.name == "mul" else 1.0 / float(b)))
                    cur = a
                elif o.name == "mul" and is_number(a):
                    steps.append(("scale", float(a)))
                    cur = b
                elif _is_scalar_tensor_node(b):
                    steps.append(("scale_node", b, o.name))
                    cur = a
                elif o.name == "mul" and _is_scalar_tensor_node(a):
                    steps.append(("scale_node", a, "mul"))
                    cur = b
                else:
                    raise Reject("scores multiplied by a non-scalar tensor")
                continue
            if o.name in ("add", "sub"):
                a, b = o.get("self"), o.get("other")
                if is_number(b):
                    cur = a  # constant shift: softmax is shift invariant
                    continue
                if o.name == "add" and is_number(a):
                    cur = b
                    continue
                if o.name == "sub":
                    raise Reject("scores minus a tensor")
                if self._reaches_scores(a):
                    steps.append(("add", b))
                    cur = a
                elif self._reaches_scores(b):
                    steps.append(("add", a))
                    cur = b
                else:
                    raise Reject("no q @ k^T product behind the add (the scores come through "
                                 f"unsupported {self._blocker(a) or self._blocker(b)})")
                continue
            if o.name == "masked_fill":
                steps.append(("fill", o.get("mask"), o.get("value")))
                cur = o.get("self")
                continue
            if o.name == "where":
                c, a, b = o.get("condition"), o.get("self"), o.get("other")
                if self._reaches_scores(a):
                    steps.append(("fill_not", c, b))
                    cur = a
                elif self._reaches_scores(b):
                    steps.append(("fill", c, a))
                    cur = b
                else:
                    raise Reject("no q @ k^T product behind the where")
                continue
            if o.name in _CASTS or o.name == "identity":
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
                                                _last2_kept(norm(n).get("self"), n)):
                raise Reject("the mask broadcasts the scores to a larger shape")
            prev = sn

        em = _Emitter(self.graph, pv.node, self.key)
        try:
            return self._finish_softmax(sm, fwd, pv, pv_kind, qk, steps, dropout_p, em)
        except Exception:
            em.undo()
            raise

    def _blocker(self, n: Any, depth: int = 0) -> Optional[str]:
        """The first op on the score path that the matcher does not understand."""
        if depth > 32 or not isinstance(n, Node):
            return None
        o = norm(n)
        if o is None:
            return _desc(n)
        for key in ("self", "other", "condition"):
            a = o.get(key)
            if isinstance(a, Node) and ndim(a) is not None and ndim(a) >= 2:
                return self._blocker(a, depth + 1)
        return None

    def _reaches_scores(self, n: Any, depth: int = 0) -> bool:
        """Whether following the score path from n reaches a matmul/einsum."""
        if depth > 32:
            return False
        o = norm(n)
        if o is None:
            return False
        if o.name == "matmul" or (o.name == "einsum" and len(o.varargs or []) == 2):
            return True
        if o.name in ("mul", "div", "add", "sub"):
            a, b = o.get("self"), o.get("other")
            if isinstance(a, Node) and self._reaches_scores(a, depth + 1):
                return True
            return o.name in ("mul", "add") and isinstance(b, Node) and \
                self._reaches_scores(b, depth + 1)
        if o.name == "baddbmm":
            return True
        if o.name in ("masked_fill", "reshape") or o.name in _CASTS or o.name == "identity":
            return self._reaches_scores(o.get("self"), depth + 1)
        if o.name == "where":
            return any(self._reaches_scores(o.get(k), depth + 1) for k in ("self", "other"))
        return False

    # ---------------------------------------------------------------------------------------
    def _finish_softmax(self, sm, fwd, pv, pv_kind, qk, steps, dropout_p, em) -> str:
        scale = 1.0
        # ---- q and k from the q @ k^T product ----
        if qk.name == "matmul":
            A, B = qk.get("self"), qk.get("other")
            nd = ndim(A)
            if nd is None or ndim(B) != nd or nd < 2:
                raise Reject("q @ k^T operands of different rank (broadcasting matmul)")
            A, s = self._peel_scale(A)
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
            q = A
            if flip:
                k = B
            else:
                bo = norm(B)
                perm = _perm_of(bo) if bo is not None and bo.name == "permute" else None
                if perm is not None and len(perm) == nd:
                    perm[-1], perm[-2] = perm[-2], perm[-1]
                    if perm == list(range(nd)):
                        k = bo.get("self")
                    else:
                        k = em(torch.permute, (bo.get("self"), perm))
                else:
                    k = em(torch.transpose, (B, -2, -1))
        else:
            parsed = _parse_einsum(qk.get("equation"))
            if parsed is None:
                raise Reject(f"einsum {qk.get('equation')!r} is not a q @ k^T contraction")
            xl, yl, out = parsed
            X, Y = qk.varargs
            if len(out) < 2:
                raise Reject("einsum output has fewer than two dims")
            batch, l, s_ = out[:-2], out[-2], out[-1]
            if l in yl and l not in xl:  # einsum(k, q) spelling
                X, Y, xl, yl = Y, X, yl, xl
            common = [c for c in xl if c in yl and c not in out]
            if len(common) != 1:
                raise Reject(f"einsum {qk.get('equation')!r} is not a q @ k^T contraction")
            e = common[0]
            if sorted(xl) != sorted(batch + l + e) or sorted(yl) != sorted(batch + s_ + e):
                raise Reject(f"einsum {qk.get('equation')!r} is not a q @ k^T contraction")
            X, s = self._peel_scale(X)
            scale *= s
            Y, s = self._peel_scale(Y)
            scale *= s
            q = self._permute_to(X, xl, batch + l + e, em)
            k = self._permute_to(Y, yl, batch + s_ + e, em)
        # ---- v from the p @ v product ----
        out_perm = None
        if pv_kind == "matmul":
            v = pv.get("other")
            if ndim(v) != ndim(q):
                raise Reject("p @ v operands of different rank (broadcasting matmul)")
        else:
            parsed = _parse_einsum(pv.get("equation"))
            if parsed is None:
                raise Reject(f"einsum {pv.get('equation')!r} is not a p @ v contraction")
            pl, vl, out = parsed
            if len(pl) != ndim(q):
                raise Reject("einsum p @ v rank mismatch")
            batch, l, s_ = pl[:-2], pl[-2], pl[-1]
            dl = [c for c in vl if c not in pl]
            if len(dl) != 1 or sorted(vl) != sorted(batch + s_ + dl[0]) \
                    or sorted(out) != sorted(batch + l + dl[0]):
                raise Reject(f"einsum {pv.get('equation')!r} is not a p @ v contraction")
            v = self._permute_to(pv.varargs[1], vl, batch + s_ + dl[0], em)
            std = batch + l + dl[0]
            if out != std:
                out_perm = [std.index(c) for c in out]

        # ---- layouts: the op runs in the softmax's layout (leading dims of the scores there) ----
        sb = shape(sm.get("self"))[:-2]
        qb = shape(qk.node)[:-2]
        p_in = pv.get("self") if pv_kind == "matmul" else pv.varargs[0]
        pb = shape(p_in)[:-2]
        if pv_kind == "einsum" and not shapes_eq(pb, sb):
            raise Reject("einsum p @ v after a reshape of the probabilities")
        q = self._relayout(q, qb, sb, em)
        k = self._relayout(k, qb, sb, em)
        v = self._relayout(v, pb, sb, em)

        self._check_device(q)
        qv, kv, vv = val(q), val(k), val(v)
        for t, nm in ((qv, "q"), (kv, "k"), (vv, "v")):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise Reject(f"{nm} is not a floating tensor")
        if not (qv.dtype == kv.dtype == vv.dtype):
            raise Reject(f"q/k/v dtypes differ ({qv.dtype}, {kv.dtype}, {vv.dtype})")
        if not (qv.device == kv.device == vv.device):
            raise Reject("q/k/v on different devices")
        if val(pv.node).dtype != qv.dtype:
            raise Reject(f"attention output dtype {val(pv.node).dtype} differs from q dtype "
                         f"{qv.dtype}")
        if qv.dim() < 2:
            raise Reject("q has fewer than 2 dims")
        gqa_bcast = False
        if not (shapes_eq(qv.shape[:-2], kv.shape[:-2]) and shapes_eq(kv.shape[:-2],
                                                                        vv.shape[:-2])):
            # multi-query attention by broadcasting one k/v head: SDPA's GQA with Hk = 1
            if qv.dim() == 4 and kv.dim() == 4 and vv.dim() == 4 and \
                    shapes_eq(qv.shape[:-3], kv.shape[:-3]) and \
                    shapes_eq(qv.shape[:-3], vv.shape[:-3]) and \
                    sym_eq(kv.shape[-3], 1) and sym_eq(vv.shape[-3], 1):
                gqa_bcast = True
            else:
                raise Reject("q/k/v batch dims differ (broadcasting)")
        if not (sym_eq(qv.shape[-1], kv.shape[-1]) and sym_eq(kv.shape[-2], vv.shape[-2])):
            raise Reject("q/k/v inner dims do not match")
        for n in [sm.node] + fwd:
            vt = val(n)
            if isinstance(vt, torch.Tensor) and vt.dtype != qv.dtype and \
                    vt.dtype not in (torch.float32, torch.float64):
                raise Reject(f"probabilities cast to lower precision {vt.dtype}")
        sm_dtype = sm.get("dtype")
        if sm_dtype is not None and sm_dtype not in (qv.dtype, torch.float32, torch.float64):
            raise Reject(f"softmax in lower precision {sm_dtype}")

        # ---- masks, scale: replay from the product outwards ----
        scores = shape(qk.node)
        add_mask = None
        keep = None
        pieces: list[list] = []  # [node, role, factor applied after it (None: unknown), fill]
        scale_nodes: list[tuple[Node, str]] = []
        ops: list[tuple] = []  # deferred mask emission: (kind, *args)
        cur_b = qb
        for st in reversed(steps):
            kind = st[0]
            if kind == "reshape":
                cur_b = shape(st[1])[:-2]
            elif kind == "scale":
                c = st[1]
                if c <= 0 and (pieces or ops):
                    raise Reject("non-positive scale applied after a mask")
                scale *= c
                for pc in pieces:
                    pc[2] = None if pc[2] is None else pc[2] * c
                if any(o[0] in ("add",) for o in ops):
                    ops.append(("mul_add", c))
            elif kind == "scale_node":
                if any(o[0] == "fill" for o in ops):
                    raise Reject("tensor scale applied after a masked_fill")
                scale_nodes.append((st[1], st[2]))
                for pc in pieces:
                    pc[2] = None
                if any(o[0] == "add" for o in ops):
                    ops.append(("node_add", st[1], st[2]))
            elif kind == "add":
                m = st[1]
                mv = val(m)
                if not isinstance(mv, torch.Tensor) or not mv.is_floating_point():
                    raise Reject("additive mask is not a floating tensor")
                pieces.append([m, "additive", 1.0, None])
                ops.append(("add", m, st[2] if len(st) > 2 else 1.0, cur_b))
            else:  # fill / fill_not: (cond, value); fill: cond True -> masked
                cond, value = st[1], st[2]
                fv = self.facts.fact(value)
                if fv is None or fv[0] != "ALL" or not is_neg(fv[1]):
                    raise Reject("masked_fill/where fills a value that is not a large "
                                 "negative constant")
                cv = val(cond)
                if not isinstance(cv, torch.Tensor) or cv.dtype != torch.bool:
                    raise Reject("fill condition is not a bool tensor")
                pieces.append([cond, "masked" if kind == "fill" else "keep", 1.0, fv[1]])
                ops.append(("fill", cond, kind == "fill", cur_b, fv[1]))

        for p, role, factor, fill in pieces:
            if fill is not None and fill != -math.inf and not (
                    factor is not None and is_neg(fill * factor)):
                raise Reject("a masked_fill value is scaled down until it no longer masks")
        implied = False
        exact = False
        for p, role, factor, fill in pieces:
            ps = shape(p)
            if ps is None or len(ps) < 2 or not (sym_eq(ps[-1], scores[-1]) and
                                                 sym_eq(ps[-2], scores[-2])):
                continue
            imp, ex = causal_bound(self.facts, p, role, factor)
            implied = implied or imp
            exact = exact or (ex and len(pieces) == 1)

        mask = None
        if not exact:
            for o in ops:
                if o[0] == "add":
                    m = self._piece_to(o[1], o[3], sb, em)
                    if o[2] != 1.0:
                        m = em(torch.mul, (m, o[2]))
                    add_mask = m if add_mask is None else em(torch.add, (add_mask, m))
                elif o[0] == "mul_add":
                    if add_mask is not None:
                        add_mask = em(torch.mul, (add_mask, o[1]))
                elif o[0] == "node_add":
                    if add_mask is not None:
                        add_mask = em(torch.mul if o[2] == "mul" else torch.div,
                                      (add_mask, o[1]))
                elif o[4] != -math.inf:
                    # A finite fill (finfo.min, -1e9...): an additive fp32 finfo.min mask, which
                    # saturates like the fill does, so rows with every key masked stay uniform
                    # as in eager (a bool mask would make them zero).
                    cond, masked = o[1], o[2]
                    co = norm(cond)
                    if masked and co is not None and co.name == "not" and \
                            val(co.get("self")) is not None and \
                            val(co.get("self")).dtype == torch.bool:
                        cond, masked = co.get("self"), False
                    cond = self._piece_to(cond, o[3], sb, em)
                    lo = torch.finfo(torch.float32).min
                    m = em(torch.where, (cond, lo, 0.0) if masked else (cond, 0.0, lo))
                    add_mask = m if add_mask is None else em(torch.add, (add_mask, m))
                else:
                    cond, masked = self._piece_to(o[1], o[3], sb, em), o[2]
                    if masked:
                        co = norm(cond)
                        if co is not None and co.name == "not" and \
                                val(co.get("self")) is not None and \
                                val(co.get("self")).dtype == torch.bool:
                            piece = co.get("self")
                        else:
                            piece = em(torch.logical_not, (cond,))
                    else:
                        piece = cond
                    keep = piece if keep is None else em(torch.logical_and, (keep, piece))
            if keep is not None and add_mask is not None:
                mask = em(torch.where, (keep, add_mask, -math.inf))
            else:
                mask = keep if keep is not None else add_mask

        # ---- scale tensors go onto q ----
        for n, how in scale_nodes:
            q = em(torch.mul if how == "mul" else torch.div, (q, n))

        # ---- GQA ----
        if gqa_bcast:
            gqa = True
        else:
            k, v, gqa = self._strip_gqa(k, v)

        result = self._emit_op(em, q, k, v, mask, dropout_p, implied, scale, gqa)
        self._check_no_mutation(em, qk.node, pv.node)
        result = self._relayout(result, sb, pb, em)
        if out_perm is not None:
            result = em(torch.permute, (result, out_perm))
        self._replace(pv.node, result, [sm.node] + fwd)
        desc = [f"scale={scale:.6g}"]
        if implied:
            desc.append("is_causal=True")
        if mask is not None:
            desc.append(f"attn_mask={'bool' if val(mask).dtype == torch.bool else 'float'}")
        if dropout_p:
            desc.append(f"dropout_p={dropout_p}")
        if gqa:
            desc.append("enable_gqa=True")
        return "flashv100.attention(" + ", ".join(desc) + ")"

    def _check_no_mutation(self, em, first: Node, last: Node) -> None:
        """The fused op runs where p @ v ran: every tensor it reads must hold the same value
        there as where the unfused subgraph read it."""
        created = set(em.created)
        refs = set()
        for n in em.created:
            refs.update(a for a in n.all_input_nodes if a not in created)
        hi = self.pos.get(last, -1)
        for r in refs:
            muts = mutators(r)
            if not muts:
                continue
            # where the unfused subgraph first read r: its earliest reader that is no mutator
            readers = [self.pos[u] for u in r.users if u not in muts and u in self.pos]
            lo = min(readers, default=self.pos.get(first, -1))
            for m in muts:
                p = self.pos.get(m)
                if p is not None and lo < p < hi:
                    raise Reject(f"{r.name} is mutated in place ({m.name}) inside the attention")

    @staticmethod
    def _relayout(n: Any, frm, to, em) -> Any:
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

    def _piece_to(self, piece: Any, cur_b, sb, em) -> Any:
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
            import operator
            return em(operator.getitem, (piece, (0,) * len(pbat)))
        if len(pbat) == len(cur_b) and shapes_eq(pbat, cur_b):
            return self._relayout(piece, cur_b, sb, em)
        raise Reject("mask broadcast over part of the batch, applied before a reshape of the "
                     "scores")

    def _peel_scale(self, n: Any) -> tuple[Any, float]:
        s = 1.0
        for _ in range(16):
            o = norm(n)
            if o is None:
                break
            if o.inplace:
                break
            scaled = _scalar_factor(o)
            if scaled is None:
                break
            n, c = scaled
            s *= c
        return n, s

    @staticmethod
    def _permute_to(n, labels: str, want: str, em) -> Any:
        perm = [labels.index(c) for c in want]
        if perm == list(range(len(perm))):
            return n
        return em(torch.permute, (n, perm))

    def _strip_repeat(self, n: Any):
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

    def _strip_gqa(self, k, v):
        sk, sv = self._strip_repeat(k), self._strip_repeat(v)
        if sk is None or sv is None or sk[1] != sv[1] or sk[1] == 1:
            return k, v, False
        return sk[0], sv[0], True

    def _emit_op(self, em, q, k, v, mask, dropout_p, is_causal, scale, gqa) -> Node:
        return em(_target_op(), (q, k, v, mask, float(dropout_p), bool(is_causal)),
                  {"scale": float(scale), "enable_gqa": bool(gqa)})

    def _replace(self, old: Node, new: Node, chain: list) -> None:
        old.replace_all_uses_with(new)
        doomed = [old] + list(reversed(chain))
        work = []
        for n in doomed:
            if not n.users and n not in self.erased:
                work.extend(a for a in n.all_input_nodes)
                self.graph.erase_node(n)
                self.erased.add(n)
        # drop what only the unfused subgraph used (pure ops only)
        while work:
            n = work.pop()
            if n in self.erased or n.users or n.op not in ("call_function", "call_method"):
                continue
            if not _pure(n):
                continue
            work.extend(a for a in n.all_input_nodes)
            self.graph.erase_node(n)
            self.erased.add(n)

    # ---------------------------------------------------------------------------------------
    def _sdpa(self, op) -> str:
        node = op.node
        q, k, v = op.get("query"), op.get("key"), op.get("value")
        mask = op.get("attn_mask")
        dropout_p = op.get("dropout_p", 0.0)
        is_causal = op.get("is_causal", False)
        scale = op.get("scale")
        gqa = op.get("enable_gqa", False)
        if not isinstance(is_causal, bool) or not is_number(dropout_p) or \
                not isinstance(gqa, bool):
            raise Reject("non-constant SDPA arguments")
        self._check_device(q)
        em = _Emitter(self.graph, node, self.key)
        try:
            qv = val(q)
            if scale is None:
                e = qv.shape[-1]
                if not isinstance(e, int):
                    raise Reject("default scale with a dynamic head dim")
                scale = 1.0 / math.sqrt(e)
            elif not is_number(scale):
                q = em(torch.mul, (q, scale))
                scale = 1.0
            causal_note = ""
            if mask is not None and not is_causal:
                mv = val(mask)
                ps, ss = shape(mask), (tuple(qv.shape[-2:-1]) + (val(k).shape[-2],))
                if ps is not None and len(ps) >= 2 and sym_eq(ps[-1], ss[-1]) and \
                        sym_eq(ps[-2], ss[-2]):
                    role = "keep" if mv.dtype == torch.bool else "additive"
                    imp, ex = causal_bound(self.facts, mask, role)
                    if imp:
                        is_causal = True
                        causal_note = " (mask proven causal)"
                        if ex:
                            mask = None
            if not gqa:
                k, v, gqa = self._strip_gqa(k, v)
            new = em(_target_op(), (q, k, v, mask, float(dropout_p), is_causal),
                     {"scale": float(scale), "enable_gqa": gqa})
            self._replace(node, new, [])
        except Exception:
            em.undo()
            raise
        return (f"flashv100.attention(from SDPA, is_causal={is_causal}{causal_note}, "
                f"mask={'yes' if mask is not None else 'no'}, enable_gqa={gqa})")


def _is_insert_at2(index) -> bool:
    if not isinstance(index, tuple):
        return False
    items = list(index)
    if items and items[0] is Ellipsis:
        # x[..., None, :, :]  ->  (Ellipsis, None, slice, slice) inserts at -3 == 2 for 4-D
        return items[1:] == [None, slice(None), slice(None)]
    return (len(items) >= 3 and items[0] == slice(None) and items[1] == slice(None)
            and items[2] is None and all(i == slice(None) or i is Ellipsis for i in items[3:]))


def _desc(n: Any) -> str:
    if not isinstance(n, Node):
        return repr(n)
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _last2_kept(a: Any, b: Any) -> bool:
    sa, sb = shape(a), shape(b)
    return (sa is not None and sb is not None and len(sa) >= 2 and len(sb) >= 2 and
            sym_eq(sa[-1], sb[-1]) and sym_eq(sa[-2], sb[-2]))


def _is_float(n: Node) -> bool:
    v = val(n)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _pure(n: Node) -> bool:
    if n.op == "call_method":
        t = n.target
        if t.endswith("_") and not t.endswith("__"):
            return False
        return norm(n) is not None
    if n.op == "call_function":
        import operator
        if n.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv,
                        operator.iand, operator.ior, operator.setitem):
            return False
        return norm(n) is not None
    return False


def rewrite(graph: Graph, force: bool = False) -> AttentionRewriter:
    """Rewrite every attention subgraph of ``graph`` in place; returns the rewriter (results)."""
    rw = AttentionRewriter(graph, force=force)
    try:
        _target_op()
    except Exception as e:  # the extension failed to load: leave the graph alone
        log.warning("flashv100: the flashv100 ops are unavailable (%s); no rewrite", e)
        return rw
    rw.run()
    history.extend(rw.results)
    del history[:-10000]
    if rw.fused:
        graph.lint()
    return rw
