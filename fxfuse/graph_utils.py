"""The shared normalisation layer passes match on.

Dynamo graphs spell the same computation many ways: ``x.float()`` / ``x.to(torch.float32)`` / ``x.type(...)``;
``torch.mul`` / ``operator.mul`` / ``x.mul``; ``F.linear`` / ``torch._C._nn.linear``; arguments positional or
keyword. Passes should not care. :func:`op_kind` maps a node to one canonical name and :func:`arg` reads an
argument by canonical name wherever the caller put it, so a pass reads like a declarative description of its
pattern. Add spellings here, never in a pass.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

aten = torch.ops.aten

__all__ = [
    "node_val", "op_kind", "arg", "graph_modules", "size_hint", "numel_hint",
    "SHAPE_ONLY_KINDS", "const_number", "known_true", "copy_node_meta", "erase_unused", "flat_nodes", "same_shape",
]

# canonical kind -> parameter names, in positional order (``input`` is ``self`` for method calls)
SCHEMAS: Dict[str, Tuple[str, ...]] = {
    "linear": ("input", "weight", "bias"),
    "matmul": ("input", "other"),
    "mul": ("input", "other"),
    "div": ("input", "other", "rounding_mode"),
    "add": ("input", "other", "alpha"),
    "sub": ("input", "other", "alpha"),
    "neg": ("input",),
    "tanh": ("input",),
    "exp": ("input",),
    "cast": ("input", "dtype"),
    "view": ("input", "size"),
    "reshape": ("input", "shape"),
    "flatten": ("input", "start_dim", "end_dim"),
    "contiguous": ("input",),
    "redistribute": ("input", "device_mesh", "placements"),
    "to_local": ("input",),
    "t": ("input",),
    "transpose": ("input", "dim0", "dim1"),
    "permute": ("input", "dims"),
    "squeeze": ("input", "dim"),
    "unsqueeze": ("input", "dim"),
    "getitem": ("input", "index"),
    "pad": ("input", "pad", "mode", "value"),
    "cross_entropy": ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                      "label_smoothing"),
    "nll_loss": ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction"),
    "log_softmax": ("input", "dim", "_stacklevel", "dtype"),
    "softmax": ("input", "dim", "_stacklevel", "dtype"),
    "logsumexp": ("input", "dim", "keepdim"),
    "stack": ("tensors", "dim"),
    "gather": ("input", "dim", "index", "sparse_grad"),
    "sum": ("input", "dim", "keepdim", "dtype"),
    "mean": ("input", "dim", "keepdim", "dtype"),
    "dropout": ("input", "p", "training", "inplace"),
    "expand": ("input", "size"),
    "masked_fill": ("input", "mask", "value"),
    "where": ("condition", "input", "other"),
    "logical_not": ("input",),
    "invert": ("input",),
    "repeat_interleave": ("input", "repeats", "dim", "output_size"),
    # index arithmetic of attention-mask builders (fxfuse/attention/mask_recipe.py)
    "arange": ("start", "end", "step"),
    "le": ("input", "other"), "lt": ("input", "other"), "ge": ("input", "other"), "gt": ("input", "other"),
    "eq": ("input", "other"), "ne": ("input", "other"),
    "and": ("input", "other"), "or": ("input", "other"),
    "floordiv": ("input", "other"),  # ``//`` (chunked attention's chunk ids)
    "cumsum": ("input", "dim", "dtype"),
    "diff": ("input", "n", "dim", "prepend", "append"),
    "new_ones": ("input", "size"), "new_zeros": ("input", "size"), "ones": ("size",), "zeros": ("size",),
    # per-token loss arithmetic (RL losses over log-probs: passes/log_probs_loss.py)
    "detach": ("input",), "view_as": ("input", "other"),
    "clamp": ("input", "min", "max"), "minimum": ("input", "other"), "maximum": ("input", "other"),
    "min": ("input", "other"), "max": ("input", "other"),  # binary only when ``other`` is a tensor
    "log": ("input",), "log1p": ("input",), "expm1": ("input",), "sigmoid": ("input",), "abs": ("input",),
    "sqrt": ("input",), "pow": ("input", "exponent"),
}

_FUNCTIONS: Dict[Any, str] = {
    torch._C._nn.linear: "linear", F.linear: "linear",
    torch.matmul: "matmul", operator.matmul: "matmul",
    torch.mul: "mul", operator.mul: "mul",
    torch.div: "div", operator.truediv: "div", torch.true_divide: "div",
    torch.add: "add", operator.add: "add",
    torch.sub: "sub", operator.sub: "sub",
    torch.neg: "neg", operator.neg: "neg",
    torch.tanh: "tanh", F.tanh: "tanh", torch.exp: "exp",
    torch.reshape: "reshape", torch.flatten: "flatten",
    torch.t: "t", torch.transpose: "transpose", torch.permute: "permute",
    torch.squeeze: "squeeze", torch.unsqueeze: "unsqueeze",
    operator.getitem: "getitem",
    F.pad: "pad", torch._C._nn.pad: "pad",
    F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss",
    F.log_softmax: "log_softmax", torch.log_softmax: "log_softmax", torch._C._nn.log_softmax
    if hasattr(torch._C._nn, "log_softmax") else F.log_softmax: "log_softmax",
    F.softmax: "softmax", torch.softmax: "softmax",
    torch.logsumexp: "logsumexp", torch.gather: "gather", torch.stack: "stack",
    torch.sum: "sum", torch.mean: "mean",
    F.dropout: "dropout", torch.dropout: "dropout",
    torch.masked_fill: "masked_fill", torch.where: "where", torch.logical_not: "logical_not",
    operator.invert: "invert", torch.bitwise_not: "invert", torch.repeat_interleave: "repeat_interleave",
    torch.arange: "arange",
    torch.le: "le", operator.le: "le", torch.lt: "lt", operator.lt: "lt", torch.ge: "ge", operator.ge: "ge",
    torch.gt: "gt", operator.gt: "gt", torch.eq: "eq", operator.eq: "eq", torch.ne: "ne", operator.ne: "ne",
    operator.and_: "and", torch.logical_and: "and", torch.bitwise_and: "and",
    operator.or_: "or", torch.logical_or: "or", torch.bitwise_or: "or",
    operator.floordiv: "floordiv", torch.floor_divide: "floordiv",
    torch.cumsum: "cumsum", torch.diff: "diff", torch.ones: "ones", torch.zeros: "zeros",
    torch.detach: "detach", torch.clamp: "clamp", torch.clip: "clamp", torch.minimum: "minimum",
    torch.maximum: "maximum", torch.min: "min", torch.max: "max", torch.log: "log", torch.log1p: "log1p",
    torch.expm1: "expm1", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid", torch.abs: "abs", operator.abs: "abs",
    torch.sqrt: "sqrt", torch.pow: "pow", operator.pow: "pow",
}

_METHODS: Dict[str, str] = {
    "matmul": "matmul", "mul": "mul", "div": "div", "true_divide": "div", "add": "add", "sub": "sub",
    "neg": "neg", "tanh": "tanh", "exp": "exp",
    "float": "cast", "half": "cast", "bfloat16": "cast", "double": "cast", "to": "cast", "type": "cast",
    "view": "view", "reshape": "reshape", "flatten": "flatten", "contiguous": "contiguous",
    "t": "t", "transpose": "transpose", "permute": "permute", "squeeze": "squeeze", "unsqueeze": "unsqueeze",
    "log_softmax": "log_softmax", "softmax": "softmax", "logsumexp": "logsumexp", "gather": "gather",
    "sum": "sum", "mean": "mean", "expand": "expand",
    "masked_fill": "masked_fill", "logical_not": "logical_not", "bitwise_not": "invert",
    "repeat_interleave": "repeat_interleave",
    "le": "le", "lt": "lt", "ge": "ge", "gt": "gt", "eq": "eq", "ne": "ne", "__le__": "le", "__lt__": "lt",
    "__ge__": "ge", "__gt__": "gt", "__eq__": "eq", "__ne__": "ne",
    "logical_and": "and", "bitwise_and": "and", "__and__": "and", "logical_or": "or", "bitwise_or": "or",
    "__or__": "or", "floor_divide": "floordiv", "__floordiv__": "floordiv", "cumsum": "cumsum", "diff": "diff",
    "new_ones": "new_ones", "new_zeros": "new_zeros",
    "detach": "detach", "view_as": "view_as", "clamp": "clamp", "clip": "clamp", "minimum": "minimum",
    "maximum": "maximum", "min": "min", "max": "max", "log": "log", "log1p": "log1p", "expm1": "expm1",
    "sigmoid": "sigmoid", "abs": "abs", "sqrt": "sqrt", "pow": "pow",
    "redistribute": "redistribute", "to_local": "to_local",  # DTensor (tensor parallelism)
}

_CAPTURED: Dict[Optional[str], str] = {"prim_redistribute": "redistribute", "prim_to_local": "to_local"}

# ops that move or relabel elements but never change a value
SHAPE_ONLY_KINDS = frozenset({"view", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze"})


def node_val(n: Any) -> Any:
    """The fake value of a node (``meta['val']`` after propagation, else Dynamo's ``example_value``)."""
    if isinstance(n, fx.Node):
        v = n.meta.get("val", None)
        return v if v is not None else n.meta.get("example_value", None)
    return n


def op_kind(n: Any) -> Optional[str]:
    """Canonical name of what ``n`` computes (``'linear'``, ``'cast'``, ``'cross_entropy'``, ...) or None."""
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_function":
        try:
            kind = _FUNCTIONS.get(n.target)
        except TypeError:  # unhashable target
            return None
        # through torch 2.11 Dynamo captures a DTensor's redistribute / to_local as a function made on the fly
        # (its arguments bound inside it): known by name only
        return kind if kind is not None else _CAPTURED.get(getattr(n.target, "__name__", None))
    if n.op == "call_method":
        return _METHODS.get(n.target)
    return None


_MISSING = object()


def arg(n: fx.Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of node ``n`` by its canonical parameter name, positional or keyword."""
    kind = op_kind(n)
    schema = SCHEMAS.get(kind, ())
    if name in n.kwargs:
        return n.kwargs[name]
    if kind == "cast" and name == "dtype":
        return _cast_dtype(n, default)
    if name in schema:
        i = schema.index(name)
        if i < len(n.args):
            if kind in ("view", "reshape", "permute", "expand") and i == 1 and len(n.args) > 2:
                return tuple(n.args[1:])  # x.view(a, b) spelled without a tuple
            return n.args[i]
    return default


def _cast_dtype(n: fx.Node, default: Any) -> Any:
    named = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
    if n.target in named:
        return named[n.target]
    for a in list(n.args[1:]) + list(n.kwargs.values()):
        if isinstance(a, torch.dtype):
            return a
    v = node_val(n)
    return v.dtype if isinstance(v, torch.Tensor) else default


def known_true(pred: Any) -> bool:
    """True only when ``pred`` (a bool or a SymBool) holds for every value of its symbols.

    Adds no guard: a dynamic size that *might* satisfy ``pred`` is not specialised into a recompile guard.
    Matchers and contract checks use this so that only provable facts change what they do.
    """
    if isinstance(pred, bool):
        return pred
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(pred))
    except Exception:
        return False


def const_number(a: Any) -> Optional[float]:
    """``a`` as a Python number if it is a compile-time constant (not a node, not a tensor)."""
    if isinstance(a, bool):
        return None
    if isinstance(a, (int, float)):
        return float(a)
    return None


def same_shape(a, b) -> bool:
    """Two shapes (symbolic sizes allowed) provably equal, without adding a guard."""
    return len(a) == len(b) and all(known_true(x == y) for x, y in zip(a, b))


def flat_nodes(a: Any) -> List[fx.Node]:
    """Every fx.Node inside a node argument (tuples, lists, dicts, nested), in order."""
    out: List[fx.Node] = []
    fx.node.map_arg(a, lambda x: out.append(x) or x)
    return out


def copy_node_meta(dst: fx.Node, src: fx.Node) -> None:
    """Give a node a pass inserted the user-facing provenance of the node it replaces (source line, module path),
    so reports and errors about it point at the user's code."""
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if src.meta.get(key) is not None:
            dst.meta[key] = src.meta[key]


def erase_unused(graph: fx.Graph, nodes: List[fx.Node]) -> List[fx.Node]:
    """Erase the ops among ``nodes`` that have (transitively, within ``nodes``) no users left after a rewrite;
    return the erased ones. Placeholders and attributes are never erased."""
    erased, changed = [], True
    pending = [n for n in nodes if n.graph is graph]
    while changed:
        changed = False
        for n in list(reversed(pending)):
            if not n.users and n.op in ("call_function", "call_method"):
                graph.erase_node(n)
                pending.remove(n)
                erased.append(n)
                changed = True
    return erased


def graph_modules(gm: fx.GraphModule, prefix: str = "") -> Iterator[Tuple[str, fx.GraphModule]]:
    """``gm`` and, depth first, every GraphModule nested in it (activation-checkpoint bodies, ``wrap`` bodies,
    control-flow branches), as (qualified name, module)."""
    yield prefix or "<root>", gm
    for name, child in gm.named_children():
        if isinstance(child, fx.GraphModule):
            yield from graph_modules(child, f"{prefix}.{name}" if prefix else name)


def size_hint(s: Any, fallback: int = 8192) -> int:
    """A concrete value for a possibly symbolic size (its example value), for cost estimates only. An unbacked size
    (data-dependent: unpad_tokens' kept-token count) has no example value: its upper bound where the shape
    environment knows one (the kept tokens are at most the padded batch's B x S), else ``fallback``."""
    if isinstance(s, int):
        return s
    try:
        node = s.node
        hint = node.hint if hasattr(node, "hint") else None
        if hint is not None:
            return int(hint)
        hinted = node.shape_env.size_hint(node.expr, allow_none=True)
        if hinted is not None:
            return int(hinted)
        upper = node.shape_env.bound_sympy(node.expr).upper
        if upper.is_number and upper.is_finite:
            return int(upper)
        hinted = node.shape_env.size_hint(upper, allow_none=True)  # a bound in backed sizes (B * S)
        return int(hinted) if hinted is not None else fallback
    except Exception:
        return fallback


def numel_hint(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape:
        n *= size_hint(s)
    return n
