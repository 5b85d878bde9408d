"""Token-wise wide regions (a decoder's MLP) -> ``fxfuse::token_tiled``: run over chunks of tokens, saving only their
input (issue 32; the op: ``fxfuse/ops/token_tiled.py``). Off by default: ``options={"passes": {"sequence_tiling":
True}}``, chunk size ``pass_options={"sequence_tiling": {"chunk_tokens": 8192}}``.

Matched: a projection ``y = linear(h)`` whose input ``h`` is wider than ``y`` (the MLP's down projection) and
everything ``h`` is computed from that is as wide as ``h`` (gate and up projections, the activation, their
product, with or without fxfuse's LoRA ops), back to the one narrower token tensor ``x`` they all read (the
normed hidden states)::

    x ──> gate = linear(x, Wg) ──> act ──┐
     └──> up   = linear(x, Wu) ─────────> mul ──> y = linear(·, Wd)        (wide: [tokens, intermediate])

becomes ``y = token_tiled(x, [Wg, Wu, Wd], body, chunk)`` with the nodes above as ``body``. Every wide node must
be read only inside the region (nothing else keeps an intermediate alive), every other input must be a graph
input without a token dimension (weights, adapters), and nothing inside may draw random numbers (dropout, LoRA
dropout: the backward's recompute would draw other masks). What does not qualify stays as it was, with the reason
in the report. Inside a checkpoint body (HF gradient checkpointing) the region is tiled there too: the layer's
recompute then runs the tiled op, whose backward recomputes chunk by chunk.
"""
from __future__ import annotations

import operator
from typing import List, Optional, Set

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

import fxfuse.ops.lora_linear  # noqa: F401  (registers the LoRA ops this pass recognises)
from fxfuse.graph_utils import arg, node_val, op_kind
from fxfuse.ops.token_tiled import register_body
from fxfuse.registry import register_pass

NAME = "sequence_tiling"
_TILED = torch.ops.fxfuse.token_tiled.default
_LORA = torch.ops.fxfuse.lora_linear.default
_LORA_GROUP = torch.ops.fxfuse.lora_linear_group.default
# token-wise ops a region may hold besides projections: element-wise arithmetic, activations, casts
_ELEMENTWISE_KINDS = {"mul", "add", "sub", "div", "neg", "tanh", "exp", "cast", "getitem"}
_ACTIVATIONS = {F.silu, F.gelu, F.relu, torch.sigmoid, torch.relu, torch.tanh, F.sigmoid if hasattr(F, "sigmoid")
                else torch.sigmoid, torch.nn.functional.mish, torch.nn.functional.hardswish}
_ACTIVATION_METHODS = {"sigmoid", "relu", "tanh"}


class _Refused(Exception):
    pass


class _NotARegion(Exception):
    pass


def _is_projection(n: fx.Node) -> bool:
    return op_kind(n) == "linear" or (n.op == "call_function" and n.target is _LORA)


def _allowed(n: fx.Node) -> bool:
    if n.op == "call_function" and n.target in (_LORA, _LORA_GROUP):
        return True
    if n.op == "call_function" and n.target in _ACTIVATIONS:
        return True
    if n.op == "call_method" and n.target in _ACTIVATION_METHODS:
        return True
    return op_kind(n) in _ELEMENTWISE_KINDS or op_kind(n) == "linear"


def _random(n: fx.Node) -> bool:
    """Whether ``n`` draws random numbers in training: dropout with p > 0, a LoRA op with adapter dropout."""
    if op_kind(n) == "dropout":
        p, training = arg(n, "p", 0.5), arg(n, "training", True)
        return not (isinstance(p, (int, float)) and p == 0) and training is not False
    if n.op == "call_function" and n.target is _LORA:
        return any(p for p in n.args[6])
    if n.op == "call_function" and n.target is _LORA_GROUP:
        return any(p for p in n.args[7])
    return False


def _width(n) -> Optional[int]:
    v = node_val(n)
    if not isinstance(v, torch.Tensor) or v.dim() < 2 or not isinstance(v.shape[-1], int):
        return None
    return v.shape[-1]


def _same_tokens(a, b) -> bool:
    va, vb = node_val(a), node_val(b)
    return (va.dim() == vb.dim() and all(statically_known_true(x == y) for x, y in zip(va.shape[:-1], vb.shape[:-1])))


def _inputs(n: fx.Node) -> List[fx.Node]:
    out: List[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), out.append)
    return out


def _region(y: fx.Node):
    """(x, nodes in graph order ending with y, parameter inputs) of the wide region that ends at projection y."""
    h = y.args[0]
    wide = _width(h)
    if wide is None or _width(y) is None or wide <= _width(y):
        return None  # not a contraction from a wider input: not a region's end
    region: Set[fx.Node] = {y}
    todo, xs = [h], set()

    def refuse(why):
        # only a region that widens its input by a projection (an MLP's gate / up) is one this pass is for: a
        # contraction fed by anything else (k / v projections of a norm's output) is not reported
        if any(m is not y and (_is_projection(m) or m.target is _LORA_GROUP) for m in region):
            raise _Refused(why)
        raise _NotARegion

    while todo:
        n = todo.pop()
        if n in region:
            continue
        if n.op != "call_function" and n.op != "call_method":
            refuse(f"{n} ({n.op}) is read as a token tensor of the wide region")
        w = _width(n)
        if w is not None and w < wide and _same_tokens(n, y) and not isinstance(node_val(n), torch.nn.Parameter):
            xs.add(n)  # the narrower token tensor the region starts from
            continue
        if not _allowed(n):
            refuse(f"{n} ({getattr(n.target, '__name__', n.target)}) is not a token-wise op this pass knows")
        region.add(n)
        for a in _inputs(n):
            if a.op in ("placeholder", "get_attr"):
                continue
            todo.append(a)
    if len(xs) != 1:
        raise _Refused(f"the wide region reads {len(xs)} narrower token tensors ({sorted(map(str, xs))}), not one")
    x = xs.pop()
    order = {n: i for i, n in enumerate(y.graph.nodes)}
    nodes = sorted(region, key=order.__getitem__)
    params: List[fx.Node] = []
    for n in nodes:
        if _random(n):
            raise _Refused(f"{n} draws random numbers (dropout): the backward's recompute would draw others")
        if n is not y and any(u not in region for u in n.users):
            raise _Refused(f"{n} is read outside the region ({[str(u) for u in n.users if u not in region]})")
        for a in _inputs(n):
            if a not in region and a is not x and a not in params:
                if a.op not in ("placeholder", "get_attr"):
                    raise _Refused(f"{n} reads {a}, computed in the graph and not the region's token input")
                params.append(a)
    return x, nodes, params


def _body(x: fx.Node, nodes: List[fx.Node], params: List[fx.Node]) -> fx.GraphModule:
    g = fx.Graph()
    env = {x: g.placeholder("x")}
    for i, p in enumerate(params):
        env[p] = g.placeholder(f"p{i}")
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[nodes[-1]])
    return fx.GraphModule(torch.nn.Module(), g)


@register_pass(name=NAME, enabled_by_default=False,
               description="token-wise wide regions (a decoder's MLP, LoRA included) -> fxfuse::token_tiled over "
                           "chunks of tokens, saving only their input (long sequences)",
               options={"chunk_tokens": {"type": int, "minimum": 1, "default": 8192,
                                         "doc": "tokens per chunk; a sequence no longer runs as one chunk"}})
def sequence_tiling_pass(gm: fx.GraphModule, ctx) -> int:
    chunk = ctx.int_option("chunk_tokens", None, 1, "tokens per chunk")
    done = 0
    for m in ctx.graph_modules(gm):
        g = m.graph
        erased: Set[fx.Node] = set()
        for y in [n for n in g.nodes if _is_projection(n)]:
            if y in erased:
                continue
            try:
                found = _region(y)
            except _NotARegion:
                continue
            except _Refused as e:
                ctx.skipped(y, "tile a token-wise region over chunks of tokens", str(e))
                continue
            if found is None:
                continue
            x, nodes, params = found
            key = register_body(_body(x, nodes, params))
            with g.inserting_before(y):
                t = g.call_function(_TILED, (x, list(params), key, chunk))
            t.meta.update({k: v for k, v in y.meta.items() if k in ("val", "example_value", "stack_trace",
                                                                     "nn_module_stack", "source_fn_stack")})
            y.replace_all_uses_with(t)
            for n in reversed(nodes):
                g.erase_node(n)
            erased.update(nodes)
            widest = max(_width(n) or 0 for n in nodes)
            ctx.fused(t, f"{len(nodes)} token-wise ops ({widest} wide) over chunks of {chunk} tokens",
                      saved_bytes=None, region_ops=len(nodes), chunk_tokens=chunk, widest=widest)
            done += 1
        g.lint()
        m.recompile()
    return done
