"""Fuse sibling LoRA linears that read the same input into one ``fxfuse::lora_linear_group`` (horizontal fusion).

Runs after ``lora_linear``. A decoder layer's q/k/v projections (and gate/up in the MLP) each read the same
normed hidden states x; after ``lora_linear`` they are separate ``fxfuse::lora_linear`` nodes::

    q = fxfuse::lora_linear(x, Wq, bq, [Aq], [Bq], [s], [p])
    k = fxfuse::lora_linear(x, Wk, bk, [Ak], [Bk], [s], [p])
    v = fxfuse::lora_linear(x, Wv, bv, [Av], [Bv], [s], [p])

which become ``q, k, v = fxfuse::lora_linear_group(x, [Wq, Wk, Wv], [bq, bk, bv], [Aq, Ak, Av], [Bq, Bk, Bv],
[1, 1, 1], [s, s, s], [p, p, p])``. Same math, same dropout masks (each adapter keeps its own seed); what
changes is the work: the dropout kernels read each tile of x once for all three adapters (forward, and backward
for grad A), the low-rank part of grad x is written once, and the three base GEMMs of the backward accumulate
grad x in one buffer in place instead of autograd summing three [N, din] gradients.

Grouped: ``fxfuse::lora_linear`` nodes with the same x node, in graph order. The group node goes where the first
member was, so every input of the later members must already be defined there (parameters and graph inputs
always are); a member whose adapters or base weight are computed later in the graph stays on its own, with the
reason in the fusion report, as does a member whose adapters have another dtype than the group's first.
Pass option ``max_group`` (default 8) caps the projections per group.
"""
from __future__ import annotations

import operator
from typing import Dict, List

import torch
import torch.fx as fx

import fxfuse.ops.lora_linear  # noqa: F401  (registers torch.ops.fxfuse.lora_linear_group)
from fxfuse.graph_utils import copy_node_meta, node_val
from fxfuse.registry import register_pass

NAME = "lora_horizontal"
_LORA = torch.ops.fxfuse.lora_linear.default
_GROUP = torch.ops.fxfuse.lora_linear_group.default


def _inputs_of(n: fx.Node) -> List[fx.Node]:
    """Every graph node ``n`` reads (its x, weight, bias, adapters)."""
    out: List[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), lambda a: out.append(a))
    return out


def _adapter_dtype(n: fx.Node):
    a = n.args[3][0]
    return getattr(node_val(a), "dtype", None)


def _groups(g: fx.Graph, max_group: int, skipped) -> List[List[fx.Node]]:
    pos: Dict[fx.Node, int] = {n: i for i, n in enumerate(g.nodes)}
    by_x: Dict[fx.Node, List[fx.Node]] = {}
    for n in g.nodes:
        if n.op == "call_function" and n.target is _LORA and not n.kwargs and isinstance(n.args[0], fx.Node):
            by_x.setdefault(n.args[0], []).append(n)
    groups = []
    for members in by_x.values():
        if len(members) < 2:
            continue
        head = members[0]
        group = [head]
        for m in members[1:]:
            late = [i for i in _inputs_of(m) if pos[i] >= pos[head]]
            if late:
                skipped(m, f"reads {late[0].name}, which is computed after the sibling projection "
                           f"{head.name} (the group would have to move it)")
            elif _adapter_dtype(m) != _adapter_dtype(head):
                skipped(m, f"adapter dtype {_adapter_dtype(m)} differs from the sibling {head.name}'s "
                           f"({_adapter_dtype(head)})")
            elif len(group) >= max_group:
                skipped(m, f"the group of {head.name} already has max_group={max_group} projections")
            else:
                group.append(m)
        if len(group) > 1:
            groups.append(group)
    return groups


def _module_path(n: fx.Node) -> str:
    """The projection's module path (``model.layers.0.self_attn.q_proj``) for the report, else the node name."""
    stack = n.meta.get("nn_module_stack") or {}
    if stack:
        path = str(list(stack.values())[-1][0])
        # Dynamo spells PEFT's wrapped modules as __dict__['_modules']['base_model']... ; keep the dotted tail
        tail = path.split("]")[-1].lstrip(".")
        return tail[len("model."):] if tail.startswith("model.model.") else (tail or path)
    return n.name


def _rewrite(g: fx.Graph, group: List[fx.Node]) -> fx.Node:
    x = group[0].args[0]
    weights, biases, lora_a, lora_b, counts, scaling, dropout_p = [], [], [], [], [], [], []
    for m in group:
        _x, w, b, a, bb, s, p = m.args
        weights.append(w)
        biases.append(b)
        lora_a += list(a)
        lora_b += list(bb)
        counts.append(len(a))
        scaling += list(s)
        dropout_p += list(p)
    with g.inserting_before(group[0]):
        node = g.call_function(_GROUP, (x, weights, biases, lora_a, lora_b, counts, scaling, dropout_p))
        outs = []
        for j in range(len(group)):
            outs.append(g.call_function(operator.getitem, (node, j)))
    copy_node_meta(node, group[0])
    vals = [node_val(m) for m in group]
    if all(isinstance(v, torch.Tensor) for v in vals):
        node.meta["val"] = vals
    for out, m in zip(outs, group):
        copy_node_meta(out, m)
        if "val" in m.meta:
            out.meta["val"] = m.meta["val"]
        m.replace_all_uses_with(out)
        g.erase_node(m)
    return node


@register_pass(name=NAME,
               description="sibling fxfuse::lora_linear nodes reading the same x (q/k/v, gate/up) -> "
                           "fxfuse::lora_linear_group (one read of x for their dropout kernels, one grad-x buffer)",
               options={"max_group": {"type": int, "minimum": 2, "default": 8,
                                      "doc": "most sibling projections fused into one group"}})
def lora_horizontal_pass(gm: fx.GraphModule, ctx) -> int:
    count = 0
    max_group = ctx.int_option("max_group", 8, 2, "projections per group")
    for mod in ctx.graph_modules(gm):
        g = mod.graph
        groups = _groups(g, max_group, lambda n, why: ctx.skipped(n, "LoRA horizontal group", why))
        for group in groups:
            names = [_module_path(m) for m in group]
            node = _rewrite(g, group)
            ctx.fused(node, f"LoRA sibling group ({len(group)} projections reading one input)",
                      projections=names)
        if groups:
            g.lint()
            mod.recompile()
        count += len(groups)
    return count
