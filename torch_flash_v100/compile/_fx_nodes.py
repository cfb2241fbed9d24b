"""Normalisation of torch-level FX nodes (the graphs Dynamo hands to backends).

A Dynamo graph spells one operation many ways: ``torch.matmul(a, b)``, ``a @ b`` (operator.matmul),
``a.matmul(b)`` (call_method), ``torch.bmm``...  :func:`norm` maps a node to a canonical name and
its arguments bound to parameter names, so the matcher reasons about semantics, not spellings.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ["Op", "norm", "val", "shape", "ndim", "is_number", "sym_eq", "shapes_eq", "mutated",
           "mutators", "is_pure"]


class Op:
    """A normalised node: ``name`` plus ``args`` bound by parameter name (``args["self"]`` is the
    main tensor input); ``varargs`` holds a trailing ``*sizes``/``*dims`` list where one exists."""

    __slots__ = ("name", "args", "varargs", "node", "inplace")

    def __init__(self, name: str, args: dict, varargs: Optional[list], node: Node,
                 inplace: bool = False):
        self.name = name
        self.args = args
        self.varargs = varargs
        self.node = node
        self.inplace = inplace

    def get(self, key: str, default: Any = None) -> Any:
        return self.args.get(key, default)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Op({self.name}, {self.args}, {self.varargs})"


# name -> parameter names (positional order). "*" marks varargs (sizes / dims).
_SIG: dict[str, tuple] = {}
_FN: dict[Any, tuple[str, tuple]] = {}
_METHOD: dict[str, tuple[str, tuple]] = {}


def _fn(targets, name, params):
    for t in targets:
        if t is not None:
            _FN[t] = (name, params)


def _m(methods, name, params):
    for m in methods:
        _METHOD[m] = (name, params)


def _g(mod, attr):
    return getattr(mod, attr, None)


_BIN = ("self", "other")
_fn([torch.matmul, operator.matmul, torch.bmm], "matmul", _BIN)
_m(["matmul", "bmm", "__matmul__"], "matmul", _BIN)
_fn([torch.einsum], "einsum", ("equation", "*"))
_fn([torch.baddbmm], "baddbmm", ("self", "batch1", "batch2"))
_m(["baddbmm"], "baddbmm", ("self", "batch1", "batch2"))
_fn([F.softmax], "softmax", ("self", "dim", "_stacklevel", "dtype"))
_fn([torch.softmax, _g(torch.special, "softmax")], "softmax", ("self", "dim", "dtype"))
_m(["softmax"], "softmax", ("self", "dim", "dtype"))
_fn([F.dropout], "dropout", ("self", "p", "training", "inplace"))
_fn([torch.dropout], "dropout", ("self", "p", "training"))
_m(["dropout"], "dropout", ("self", "p", "training"))
_fn([operator.mul, torch.mul, torch.multiply, operator.imul], "mul", _BIN)
_m(["mul", "multiply", "__mul__", "__rmul__", "mul_"], "mul", _BIN)
_fn([operator.truediv, torch.div, torch.true_divide, torch.divide, operator.itruediv], "div", _BIN)
_m(["div", "divide", "true_divide", "__truediv__", "div_"], "div", _BIN)
_fn([operator.add, torch.add, operator.iadd], "add", _BIN)
_m(["add", "__add__", "__radd__", "add_"], "add", _BIN)
_fn([operator.sub, torch.sub, torch.subtract, operator.isub], "sub", _BIN)
_m(["sub", "subtract", "__sub__", "sub_"], "sub", _BIN)
_m(["__rsub__"], "rsub", _BIN)
_fn([operator.neg, torch.neg], "neg", ("self",))
_m(["neg", "__neg__"], "neg", ("self",))
_fn([operator.abs, torch.abs], "abs", ("self",))
_m(["abs", "__abs__"], "abs", ("self",))
_fn([torch.tanh, _g(F, "tanh")], "tanh", ("self",))
_m(["tanh"], "tanh", ("self",))
_fn([torch.where], "where", ("condition", "self", "other"))
_m(["where"], "where_m", ("self", "condition", "other"))
_fn([torch.masked_fill], "masked_fill", ("self", "mask", "value"))
_m(["masked_fill", "masked_fill_"], "masked_fill", ("self", "mask", "value"))
_fn([torch.transpose, torch.swapaxes, torch.swapdims], "transpose", ("self", "dim0", "dim1"))
_m(["transpose", "swapaxes", "swapdims"], "transpose", ("self", "dim0", "dim1"))
_fn([torch.permute], "permute", ("self", "dims"))
_m(["permute"], "permute", ("self", "*"))
_fn([torch.reshape], "reshape", ("self", "shape"))
_m(["view", "reshape"], "reshape", ("self", "*"))
_m(["expand"], "expand", ("self", "*"))
_m(["expand_as"], "expand_as", ("self", "other"))
_fn([torch.broadcast_to], "expand", ("self", "size"))
_fn([torch.unsqueeze], "unsqueeze", ("self", "dim"))
_m(["unsqueeze"], "unsqueeze", ("self", "dim"))
_fn([torch.squeeze], "squeeze", ("self", "dim"))
_m(["squeeze"], "squeeze", ("self", "dim"))
_m(["contiguous"], "identity", ("self", "memory_format"))
_fn([torch.clone], "identity", ("self",))
_m(["clone"], "identity", ("self",))
_m(["to"], "to", ("self", "*"))
_m(["float"], "cast_float", ("self",))
_m(["half"], "cast_half", ("self",))
_m(["bfloat16"], "cast_bfloat16", ("self",))
_m(["double"], "cast_double", ("self",))
_m(["bool"], "cast_bool", ("self",))
_m(["long", "int", "short"], "cast_int", ("self",))
_m(["type"], "type", ("self", "dtype"))
_m(["type_as"], "type_as", ("self", "other"))
_fn([torch.repeat_interleave], "repeat_interleave", ("self", "repeats", "dim", "output_size"))
_m(["repeat_interleave"], "repeat_interleave", ("self", "repeats", "dim", "output_size"))
_fn([torch.tril], "tril", ("self", "diagonal"))
_fn([torch.triu], "triu", ("self", "diagonal"))
_m(["tril", "tril_"], "tril", ("self", "diagonal"))
_m(["triu", "triu_"], "triu", ("self", "diagonal"))
for _name, _ops in {
    "le": [operator.le, torch.le, torch.less_equal],
    "lt": [operator.lt, torch.lt, torch.less],
    "ge": [operator.ge, torch.ge, torch.greater_equal],
    "gt": [operator.gt, torch.gt, torch.greater],
    "eq": [operator.eq, torch.eq],
    "ne": [operator.ne, torch.ne, torch.not_equal],
}.items():
    _fn(_ops, _name, _BIN)
    _m([_name, f"__{_name}__"], _name, _BIN)
_m(["less_equal"], "le", _BIN)
_m(["less"], "lt", _BIN)
_m(["greater_equal"], "ge", _BIN)
_m(["greater"], "gt", _BIN)
_m(["not_equal"], "ne", _BIN)
_fn([operator.and_, torch.logical_and, torch.bitwise_and, operator.iand], "and", _BIN)
_m(["logical_and", "bitwise_and", "__and__", "__iand__", "logical_and_", "bitwise_and_"],
   "and", _BIN)
_fn([operator.or_, torch.logical_or, torch.bitwise_or, operator.ior], "or", _BIN)
_m(["logical_or", "bitwise_or", "__or__", "__ior__"], "or", _BIN)
_fn([operator.invert, torch.logical_not, torch.bitwise_not], "not", ("self",))
_m(["logical_not", "bitwise_not", "__invert__"], "not", ("self",))
_fn([torch.ones, torch.zeros], "const_sized", ("*",))
_fn([torch.full], "full", ("size", "fill_value"))
_fn([torch.ones_like], "ones_like", ("self",))
_fn([torch.zeros_like], "zeros_like", ("self",))
_fn([torch.full_like], "full_like", ("self", "fill_value"))
_m(["new_ones"], "new_ones", ("self", "*"))
_m(["new_zeros"], "new_zeros", ("self", "*"))
_m(["new_full"], "new_full", ("self", "size", "fill_value"))
_m(["fill_"], "fill_", ("self", "value"))
_fn([torch.tensor, torch.scalar_tensor, torch.as_tensor], "tensor", ("data",))
_m(["new_tensor"], "new_tensor", ("self", "data"))
_fn([torch.arange], "arange", ("*",))
_fn([torch.diff], "diff", ("self", "n", "dim", "prepend", "append"))
_m(["diff"], "diff", ("self", "n", "dim", "prepend", "append"))
_fn([torch.cumsum], "cumsum", ("self", "dim"))
_m(["cumsum"], "cumsum", ("self", "dim"))
_fn([operator.getitem], "getitem", ("self", "index"))
_fn([F.scaled_dot_product_attention, _g(torch._C._nn, "scaled_dot_product_attention")], "sdpa",
    ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"))


def norm(node: Any) -> Optional[Op]:
    """Canonical form of ``node`` or None (placeholders, unknown ops, non-nodes)."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_function":
        entry = _FN.get(node.target)
        if entry is None:
            return None
        name, params = entry
        if node.target is torch.ones:
            name = "ones"
        elif node.target is torch.zeros:
            name = "zeros"
    elif node.op == "call_method":
        entry = _METHOD.get(node.target)
        if entry is None:
            return None
        name, params = entry
    elif node.op == "call_module":
        return _norm_module(node)
    else:
        return None
    args: dict = {}
    varargs = None
    pos = list(node.args)
    for i, p in enumerate(params):
        if p == "*":
            rest = pos[i:]
            # foo(*sizes) also accepts foo(sizes) with one list/tuple argument
            if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
                rest = list(rest[0])
            varargs = rest
            break
        if i < len(pos):
            args[p] = pos[i]
    for k, v in node.kwargs.items():
        if k == "input":
            k = "self"
        if k == "train":
            k = "training"
        args[k] = v
    if name in ("ones", "zeros") and varargs is None and "size" in args:
        varargs = list(args["size"])
    elif name == "einsum":
        ops = varargs or []
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        varargs = ops
    elif name == "where_m":
        name = "where"
        args = {"condition": args.get("condition"), "self": args.get("self"),
                "other": args.get("other")}
    elif name == "rsub":  # other - self
        name = "sub"
        args = {"self": args.get("other"), "other": args.get("self")}
    if name in ("add", "sub") and args.get("alpha", 1) != 1:
        return None
    if name == "div" and args.get("rounding_mode") is not None:
        return None
    return Op(name, args, varargs, node, inplace=_is_inplace(node))


def _norm_module(node: Node) -> Optional[Op]:
    gm = node.graph.owning_module
    try:
        mod = gm.get_submodule(node.target) if gm is not None else None
    except AttributeError:
        return None
    if isinstance(mod, torch.nn.Softmax):
        return Op("softmax", {"self": node.args[0] if node.args else node.kwargs.get("input"),
                              "dim": mod.dim}, None, node)
    if isinstance(mod, torch.nn.Dropout):
        return Op("dropout", {"self": node.args[0] if node.args else node.kwargs.get("input"),
                              "p": mod.p, "training": mod.training}, None, node)
    return None


def val(x: Any) -> Any:
    """The example value (a fake tensor, a SymInt, a constant) of a node, or x itself."""
    if isinstance(x, Node):
        meta = x.meta
        if "example_value" in meta:
            return meta["example_value"]
        return meta.get("val")
    return x


def shape(x: Any):
    v = val(x)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def ndim(x: Any) -> Optional[int]:
    v = val(x)
    return v.dim() if isinstance(v, torch.Tensor) else None


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def sym_eq(a: Any, b: Any) -> bool:
    """True when a == b is known without adding a guard (SymInts included)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def shapes_eq(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(
        sym_eq(x, y) for x, y in zip(a, b))


_INPLACE_FNS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.iand,
                operator.ior, operator.ixor, operator.setitem)
_VIEW_METHODS = {"view", "reshape", "expand", "expand_as", "transpose", "permute", "unsqueeze",
                 "squeeze", "t", "narrow", "select", "unflatten", "flatten", "swapaxes",
                 "swapdims", "view_as", "unfold", "split", "chunk", "unbind", "diagonal",
                 "as_strided", "detach", "contiguous", "__getitem__", "mT", "T"}
_VIEW_FNS = {operator.getitem, torch.transpose, torch.permute, torch.reshape, torch.unsqueeze,
             torch.squeeze, torch.narrow, torch.select, torch.swapaxes, torch.swapdims,
             torch.flatten, torch.unflatten, torch.split, torch.chunk, torch.unbind,
             torch.diagonal, torch.as_strided, torch.detach}


def _is_inplace(node: Node) -> bool:
    if node.op == "call_method":
        t = node.target
        return (t.endswith("_") and not t.endswith("__")) or t in (
            "__iadd__", "__isub__", "__imul__", "__itruediv__", "__iand__", "__ior__",
            "__setitem__")
    if node.op == "call_function":
        return node.target in _INPLACE_FNS
    return False


def mutators(node: Any, depth: int = 0) -> list:
    """The nodes that mutate the tensor of ``node`` (or a view of it) in place."""
    out: list = []
    if not isinstance(node, Node) or depth > 8:
        return out
    for u in node.users:
        if _is_inplace(u) and u.args and u.args[0] is node:
            out.append(u)
        is_view = (u.op == "call_method" and u.target in _VIEW_METHODS) or (
            u.op == "call_function" and u.target in _VIEW_FNS)
        if is_view and u.args and u.args[0] is node:
            out.extend(mutators(u, depth + 1))
    return out


def mutated(node: Any, ignore: Optional[Node] = None) -> bool:
    """Whether the tensor of ``node`` (or a view of it) is mutated in place by some node other
    than ``ignore``: then its value at one point of the graph is not its value at another."""
    return any(m is not ignore for m in mutators(node))


def is_pure(n: Node) -> bool:
    """A known op without side effects (dead-node cleanup may erase it)."""
    if n.op == "call_method" or n.op == "call_function":
        return not _is_inplace(n) and norm(n) is not None
    return False
