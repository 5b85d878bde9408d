"""Which dimensions of a graph's tensors index tokens, and which nodes act on every token alone: the analysis under
unpadding (issue 31, ``benchmarks/unpad_notes.md``).

To run a padded batch's decoder on its real tokens only, a pass must turn every tensor of the token-wise part of the
graph from the padded layout ``[B, S, ...]`` into one packed row ``[1, N, ...]`` and every size that Dynamo wrote
into the graph (``view(3, 12, -1, 8)``, ``expand(3, 2, 2, 12, 8)``, ``reshape(3, 12, -1)``) into the packed one.
A static graph holds those sizes as bare ints, and an int says nothing about what it counts: in a batch of 4 rows
with 4 key-value heads ``view(4, 12, 4, 8)`` has two 4s. So this module never reads a size's value to decide what
it is. It follows the token dimensions from where the tokens enter (the embedding's ``[B, S, D]`` output) through
every node, by what each op does to its operands' dimensions (broadcasting, transposes, the dimension groups of a
reshape from ``torch.distributed.tensor``'s ``view_groups``, linear layers, reductions over features), and tags
each output dimension ``B`` (rows), ``S`` (positions in a row), ``T`` (the flattened ``(row, position)`` index, as
in ``view(-1)`` before a loss) or nothing.

:func:`token_region` returns the region: the nodes reached from the start through ops known to act on each token
alone, plus the token-mixing ops the unpadding pass knows how to re-target (fxfuse's attention and lm-head loss
ops); the tensors that enter it from the dense side with token dimensions (RoPE's cos / sin, the shifted labels:
they will be gathered); the region's nodes read outside it (to be scattered back); and, for every node that takes
sizes, its size arguments with each token dimension replaced by a marker. Anything it cannot place (an op it does
not know on a token-tagged operand, a token dimension sliced, reduced, concatenated or contracted) ends the
analysis with :class:`TokenRegion.refused` = (node, reason): unpadding is then left off, with that reason.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxfuse.graph_utils import flat_nodes, node_val, size_hint

__all__ = ["B", "S", "T", "TokenRegion", "token_region"]

B, S, T = "B", "S", "T"  # rows, positions in a row, the flattened (row, position) index
TOKEN_TAGS = (B, S, T)
Tags = Tuple[Optional[str], ...]


class _Refuse(Exception):
    pass


@dataclass
class TokenRegion:
    """What :func:`token_region` found. ``tags`` holds the token tags of every region node's output (a tuple per
    tensor; for ops returning several tensors, a list of tuples) and of every boundary input."""
    start: fx.Node
    nodes: List[fx.Node] = field(default_factory=list)
    tags: Dict[fx.Node, Any] = field(default_factory=dict)
    inputs: Dict[fx.Node, Tags] = field(default_factory=dict)      # dense tensors read by the region: gather
    outputs: List[fx.Node] = field(default_factory=list)           # region tensors read outside it: scatter
    sizes: Dict[fx.Node, Tuple[Any, ...]] = field(default_factory=dict)  # size args, token dims as markers
    attention: List[fx.Node] = field(default_factory=list)          # fxfuse attention sites to re-target
    bodies: List[Tuple[fx.Node, fx.GraphModule]] = field(default_factory=list)  # checkpoint calls in the region
    losses: List[fx.Node] = field(default_factory=list)             # fxfuse lm-head loss sites
    refused: Optional[Tuple[fx.Node, str]] = None

    @property
    def ok(self) -> bool:
        return self.refused is None


# ------------------------------------------------------------------------------------------------ op tables
def _op(*names):
    return tuple(getattr(torch.ops.fxfuse, n).default for n in names if hasattr(torch.ops.fxfuse, n))


_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt, torch.tanh,
    torch.sigmoid, torch.exp, torch.abs, torch.where, torch.clamp, torch.relu, torch.nn.functional.silu,
    F.silu, F.gelu, F.relu, F.dropout, torch._C._nn.gelu, torch._C._nn.silu, torch.nn.functional.gelu,
}
_ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "tanh", "sigmoid", "exp", "abs", "clamp",
    "to", "float", "half", "bfloat16", "double", "type_as", "contiguous", "clone", "detach",
    "__add__", "__mul__", "__sub__", "__truediv__", "__radd__", "__rmul__",
}
_REDUCTION_METHODS = {"mean", "sum", "amax", "amin"}
_RESHAPE_METHODS = {"view", "reshape", "flatten", "unsqueeze", "squeeze"}
_BODY_HOPS = ("tag_activation_checkpoint", "wrap")  # higher-order ops whose body the analysis descends into


def _val(n):
    v = node_val(n)
    return v if isinstance(v, torch.Tensor) else None


def _shape(n) -> Tuple[int, ...]:
    v = _val(n)
    if v is None:
        raise _Refuse(f"{n} has no tensor value to read its shape from")
    return tuple(size_hint(s) for s in v.shape)


def _is_token(tag) -> bool:
    return tag in TOKEN_TAGS


# ------------------------------------------------------------------------------------------------ the analysis
class _Analysis:
    def __init__(self, gm: fx.GraphModule, start: fx.Node):
        self.r = TokenRegion(start)
        self.in_region: Dict[fx.Node, bool] = {}
        shape = _shape(start)
        if len(shape) < 2:
            raise _Refuse(f"the start {start} is not [B, S, ...] (shape {list(shape)})")
        self.Bn, self.Sn = shape[0], shape[1]
        self._set(start, (B, S) + (None,) * (len(shape) - 2))
        self.gm = gm
        self.bodies: Dict[int, Any] = {}  # id(body) -> (operand tags it was analysed with, output tags)

    # -- bookkeeping
    def _set(self, n: fx.Node, tags) -> None:
        self.r.tags[n] = tags
        self.r.nodes.append(n)
        self.in_region[n] = True

    def tags_of(self, a: fx.Node) -> Tags:
        t = self.r.tags.get(a)
        if t is None or isinstance(t, list):
            raise _Refuse(f"{a} has no token tags")
        return t

    def _dense(self, a: fx.Node, tags: Tags, user: fx.Node) -> None:
        """``a`` (outside the region) enters it at ``user`` with these token tags: it will be gathered."""
        if not any(_is_token(t) for t in tags):
            return
        old = self.r.inputs.get(a)
        if old is not None and old != tags:
            raise _Refuse(f"{a} enters the token region with two layouts ({old} at one user, {tags} at {user})")
        self.r.inputs[a] = tags

    # -- rules
    def broadcast(self, n: fx.Node, operands: Sequence[Any]) -> Tags:
        out = _shape(n)
        tags: List[Optional[str]] = [None] * len(out)
        for a in operands:  # region operands decide the output's tags
            if isinstance(a, fx.Node) and a in self.in_region:
                at, ash = self.tags_of(a), _shape(a)
                for k in range(1, len(ash) + 1):
                    if _is_token(at[-k]) and ash[-k] == out[-k]:
                        if tags[-k] not in (None, at[-k]):
                            raise _Refuse(f"operands of {n} disagree on dimension {len(out) - k}")
                        tags[-k] = at[-k]
                    elif _is_token(at[-k]):
                        raise _Refuse(f"{n} broadcasts the token dimension {len(ash) - k} of {a}")
        for a in operands:  # dense operands that span a token dimension must be gathered along it
            if isinstance(a, fx.Node) and a not in self.in_region and _val(a) is not None:
                ash = _shape(a)
                at = [None] * len(ash)
                for k in range(1, len(ash) + 1):
                    if _is_token(tags[-k]) and ash[-k] == out[-k] and ash[-k] != 1:
                        at[-k] = tags[-k]
                    elif _is_token(tags[-k]) and ash[-k] != 1:
                        raise _Refuse(f"{a} meets the token dimension of {n} with another size")
                self._dense(a, tuple(at), n)
        return tuple(tags)

    def reshape(self, n: fx.Node, x: fx.Node) -> Tags:
        from torch.distributed.tensor._ops._view_ops import Flatten, InputDim, Singleton, Split, view_groups

        xt, xs, out = self.tags_of(x), _shape(x), _shape(n)

        def source(spec) -> Optional[str]:
            if isinstance(spec, InputDim):
                return xt[spec.input_dim]
            if isinstance(spec, Flatten):
                parts = [source(d) for d in spec.input_dims]
                sizes = [xs[d.input_dim] if isinstance(d, InputDim) else None for d in spec.input_dims]
                tok = [(p, s) for p, s in zip(parts, sizes) if _is_token(p) or s != 1]
                if all(not _is_token(p) for p, _ in tok):
                    return None
                if [p for p, _ in tok] == [B, S]:
                    return T
                if len(tok) == 1:
                    return tok[0][0]
                raise _Refuse(f"{n} flattens a token dimension with feature dimensions")
            if isinstance(spec, Split):
                src = source(spec.input_dim)
                if not _is_token(src):
                    return None
                group = [g for g in spec.group_shape]
                if src == T and group == [self.Bn, self.Sn]:
                    return (B, S)[spec.split_id]
                big = [i for i, g in enumerate(group) if g != 1]
                if len(big) == 1:
                    return src if spec.split_id == big[0] else None
                raise _Refuse(f"{n} splits the token dimension ({src}) into {group}")
            if isinstance(spec, Singleton):
                return None
            raise _Refuse(f"{n}: a reshape dimension {spec} this analysis does not place")

        specs = view_groups(list(xs), list(out))
        tags = tuple(source(s) for s in specs)
        if any(isinstance(t, tuple) for t in tags):
            raise _Refuse(f"{n}: unexpected split")
        return tags

    def sizes_arg(self, n: fx.Node, tags: Tags, first: int) -> None:
        """Record ``n``'s size arguments (from position ``first``) with the token dims as markers."""
        sizes = n.args[first:]
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
            sizes = tuple(sizes[0])
        if len(sizes) != len(tags):
            raise _Refuse(f"{n}: {len(sizes)} sizes for {len(tags)} dimensions")
        self.r.sizes[n] = tuple(t if _is_token(t) and not (isinstance(s, int) and s == -1) else s
                                for s, t in zip(sizes, tags))

    def index(self, n: fx.Node, x: fx.Node, idx) -> Tags:
        xt, xs = self.tags_of(x), _shape(x)
        idx = idx if isinstance(idx, tuple) else (idx,)
        if sum(i is Ellipsis for i in idx) > 1:
            raise _Refuse(f"{n}: two ellipses")
        consumed = sum(1 for i in idx if i is not None and i is not Ellipsis)
        out: List[Optional[str]] = []
        d = 0
        for i in idx:
            if i is Ellipsis:
                for _ in range(len(xs) - consumed):
                    out.append(xt[d])
                    d += 1
            elif i is None:
                out.append(None)
            elif isinstance(i, slice):
                full = i.start in (None, 0) and i.stop is None and i.step in (None, 1)
                if _is_token(xt[d]) and not full:
                    raise _Refuse(f"{n} slices the token dimension {xt[d]} ({i}): it mixes tokens")
                out.append(xt[d])
                d += 1
            elif isinstance(i, int) and not _is_token(xt[d]):
                d += 1
            else:
                raise _Refuse(f"{n} indexes the token dimension {xt[d]} with {i}")
        out.extend(xt[d:])
        return tuple(out)

    def rule(self, n: fx.Node) -> Any:
        t = n.target
        args = n.args
        if n.op == "call_function" and t is operator.getitem:
            src = args[0]
            st = self.r.tags.get(src)
            if isinstance(st, list):  # one output of a multi-output op
                return st[args[1]]
            return self.index(n, src, args[1])
        if (n.op == "call_function" and t in _ELEMENTWISE_FUNCTIONS) or \
                (n.op == "call_method" and t in _ELEMENTWISE_METHODS):
            operands = [args[0]] if t == "type_as" else list(args) + list(n.kwargs.values())
            return self.broadcast(n, [a for a in operands if isinstance(a, fx.Node)])
        if n.op == "call_method" and t in _REDUCTION_METHODS:
            xt = self.tags_of(args[0])
            dims = args[1] if len(args) > 1 else n.kwargs.get("dim")
            keep = n.kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            if dims is None:
                raise _Refuse(f"{n} reduces over every dimension, token dimensions included")
            dims = [d % len(xt) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
            if any(_is_token(xt[d]) for d in dims):
                raise _Refuse(f"{n} reduces over a token dimension")
            return tuple(None if i in dims else x for i, x in enumerate(xt) if keep or i not in dims)
        if n.op == "call_method" and t in _RESHAPE_METHODS or \
                (n.op == "call_function" and t in (torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze)):
            tags = self.reshape(n, args[0])
            if t in ("view", "reshape", torch.reshape):
                self.sizes_arg(n, tags, 1)
            return tags
        if n.op == "call_method" and t == "transpose" or n.op == "call_function" and t is torch.transpose:
            xt = list(self.tags_of(args[0]))
            a, b = args[1] % len(xt), args[2] % len(xt)
            xt[a], xt[b] = xt[b], xt[a]
            return tuple(xt)
        if n.op == "call_method" and t == "permute":
            xt = self.tags_of(args[0])
            dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            return tuple(xt[d % len(xt)] for d in dims)
        if n.op == "call_method" and t == "expand":
            xt, xs, out = self.tags_of(args[0]), _shape(args[0]), _shape(n)
            lead = len(out) - len(xs)
            tags = (None,) * lead + tuple(xt)
            for i, x in enumerate(xs):
                if x == 1 and out[lead + i] != 1 and _is_token(tags[lead + i]):
                    raise _Refuse(f"{n} expands a size-1 token dimension")
            self.sizes_arg(n, tags, 1)
            return tags
        if n.op == "call_function" and t is torch.cat:
            tensors, dim = args[0], (args[1] if len(args) > 1 else n.kwargs.get("dim", 0))
            tags = self.broadcast(n, [a for a in tensors if isinstance(a, fx.Node)])
            if _is_token(tags[dim % len(tags)]):
                raise _Refuse(f"{n} concatenates along a token dimension")
            return tags
        if n.op == "call_function" and t in (F.linear, torch._C._nn.linear):
            xt = self.tags_of(args[0])
            for w in flat_nodes(args[1:]):
                if w in self.in_region:
                    raise _Refuse(f"{n}: a weight computed from the tokens")
            return xt[:-1] + (None,)
        if n.op == "call_function" and t in _op("lora_linear"):
            return self.tags_of(args[0])[:-1] + (None,)
        if n.op == "call_function" and t in _op("lora_linear_group"):
            xt = self.tags_of(args[0])[:-1] + (None,)
            return [xt] * len(_val_list(n))
        if n.op == "call_function" and t in _op("softcap_attention"):
            q, k, v = args[:3]
            want = (B, None, S, None)
            for x in (q, k, v):
                if x not in self.in_region or self.tags_of(x) != want:
                    raise _Refuse(f"{n}: q, k, v must be [B, H, S, D] token tensors of the region")
            self.r.attention.append(n)
            lse_tags = (B, None, S)
            return [want, lse_tags]
        if n.op == "call_function" and t in _op("linear_cross_entropy"):
            h, target = args[0], args[2]
            ht = self.tags_of(h)
            if not any(_is_token(x) for x in ht[:-1]) or _is_token(ht[-1]):
                raise _Refuse(f"{n}: the hidden states' last dimension must be the features")
            tt = (T,) if len(_shape(target)) == 1 else ht[:-1]
            if target in self.in_region:
                if self.tags_of(target) != tt:
                    raise _Refuse(f"{n}: target tags {self.tags_of(target)}")
            else:
                self._dense(target, tt, n)
            self.r.losses.append(n)
            reduction = n.args[5] if len(n.args) > 5 else n.kwargs.get("reduction", "mean")
            return (T,) if reduction == "none" else ()
        if n.op == "call_function" and getattr(t, "__name__", "") in _BODY_HOPS:
            return self.body_call(n)
        raise _Refuse(f"{n} ({n.op} {getattr(t, '__name__', t)}) reads a token tensor and is not known to act "
                      "on each token alone")

    def body_call(self, n: fx.Node) -> list:
        """A checkpoint region (``tag_activation_checkpoint`` / ``wrap``): its body is analysed with its
        placeholders tagged as the operands feeding them; a dense operand the body reads along a token dimension
        enters the region here (it is gathered before the call, so the body receives it packed)."""
        body = getattr(self.gm, n.args[0].target) if n.args[0].op == "get_attr" else None
        if not isinstance(body, fx.GraphModule):
            raise _Refuse(f"{n}: its body is not a GraphModule of this graph")
        operands = list(n.args[1:])
        phs = [p for p in body.graph.nodes if p.op == "placeholder"]
        if len(phs) != len(operands):
            raise _Refuse(f"{n}: {len(operands)} operands for {len(phs)} body inputs")
        seeds = tuple(self.r.tags.get(a) if isinstance(a, fx.Node) and a in self.in_region else None
                      for a in operands)
        known = self.bodies.get(id(body))
        if known is not None:
            if known[0] != seeds:
                raise _Refuse(f"{n}: its body is shared with another call fed other token layouts")
            return known[1]
        for p, a in zip(phs, operands):  # the body's placeholders hold their operands' values
            if p.meta.get("val") is None and isinstance(a, fx.Node) and node_val(a) is not None:
                p.meta["val"] = node_val(a)
        inner = _Analysis.__new__(_Analysis)
        inner.r, inner.in_region, inner.Bn, inner.Sn, inner.gm, inner.bodies = (
            self.r, self.in_region, self.Bn, self.Sn, body, self.bodies)
        for p, tags in zip(phs, seeds):
            if tags is not None:
                inner._set(p, tags)
        before = set(self.r.inputs)
        inner.walk(body.graph.nodes, start=None)
        if self.r.refused is not None:
            raise _Refuse(self.r.refused[1] + f" (in the checkpoint body of {n})")
        for p, a in zip(phs, operands):  # body placeholders read as token tensors: their operands are gathered
            if p in self.r.inputs and p not in before:
                tags = self.r.inputs.pop(p)
                if isinstance(a, fx.Node) and a not in self.in_region:
                    self._dense(a, tags, n)
        out = next(x for x in body.graph.nodes if x.op == "output")
        outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
        out_tags = [self.r.tags.get(o) if isinstance(o, fx.Node) and o in self.in_region else None for o in outs]
        self.r.outputs = [o for o in self.r.outputs if o.graph is not body.graph]  # read by the caller: inside
        self.r.bodies.append((n, body))
        self.bodies[id(body)] = (seeds, out_tags)
        return out_tags

    def walk(self, nodes, start: Optional[fx.Node]) -> None:
        after = start is None
        for n in nodes:
            if n is start:
                after = True
                continue
            if not after:
                continue
            reads = [a for a in flat_nodes((n.args, n.kwargs)) if a in self.in_region]
            if not reads:
                continue
            if n.op == "output":
                self.r.outputs.extend(dict.fromkeys(reads))
                continue
            try:
                tags = self.rule(n)
            except _Refuse as e:
                self.r.refused = (n, str(e))
                return
            if tags is None:  # e.g. a checkpoint body's output that holds no token dimension
                continue
            self._set(n, tags)

    def run(self) -> TokenRegion:
        self.walk(self.gm.graph.nodes, self.r.start)
        return self.r


def _val_list(n: fx.Node) -> list:
    v = node_val(n)
    return list(v) if isinstance(v, (list, tuple)) else []


def token_region(gm: fx.GraphModule, start: fx.Node) -> TokenRegion:
    """The token-wise region of ``gm`` that begins at ``start`` (a ``[B, S, ...]`` tensor where the tokens enter,
    the embedding's output); its nodes need ``meta['val']`` (fake propagation)."""
    try:
        return _Analysis(gm, start).run()
    except _Refuse as e:
        return TokenRegion(start, refused=(start, str(e)))
