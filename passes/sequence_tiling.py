"""Token-wise wide regions (a decoder's MLP) -> ``fxfuse::token_tiled``: run over chunks of tokens, saving only their
input (issue 32; the op: ``fxfuse/ops/token_tiled.py``).

On by default in ``auto`` mode: a graph's MLPs are tiled when one layer's MLP intermediates and their gradients
(about six ``[tokens, intermediate]`` tensors at the compile's example length, or at ``plan_tokens`` tokens, a
top-level option, where the graph's length is symbolic and that is more) would take more than
``share_pct`` (25) percent of the memory budget (the GPU's memory, or ``memory_budget`` bytes); the report says
what it predicted and against what. ``mode="always"`` tiles every region; ``options={"passes":
{"sequence_tiling": False}}`` turns it off; ``chunk_tokens`` (8192) sets the chunk. On a CPU without a budget
auto mode does nothing. Measured (H200, Llama-3.1-8B widths x8 layers, LoRA r16, HF checkpointing, 256k tokens):
peak 67.55 -> 52.57 GiB, 5923 -> 5866 tok/s.

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

from typing import List, Optional, Set

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

import fxfuse.ops.lora_linear  # noqa: F401  (registers the LoRA ops this pass recognises)
from fxfuse.graph_utils import arg, node_val, op_kind, size_hint
from fxfuse.ops.token_tiled import register_body
from fxfuse.registry import register_pass

from ._memory import device_memory, planned_scale

NAME = "sequence_tiling"
_TILED = torch.ops.fxfuse.token_tiled.default
_LORA = torch.ops.fxfuse.lora_linear.default
_LORA_GROUP = torch.ops.fxfuse.lora_linear_group.default
# token-wise ops a region may hold besides projections: element-wise arithmetic, activations, casts
_ELEMENTWISE_KINDS = {"mul", "add", "sub", "div", "neg", "tanh", "exp", "cast", "getitem"}
# unpad_tokens runs each projection of its packed row [1, N, D] as a 2-D matmul between squeeze(0) / unsqueeze(0):
# inside a body on [tokens, features] chunks those pairs act on the leading size-1 dimension only
_LEADING_ONE = {"squeeze", "unsqueeze"}
_ACTIVATIONS = {F.silu, F.gelu, F.relu, F.sigmoid, F.mish, F.hardswish, torch.sigmoid, torch.relu, torch.tanh}
_ACTIVATION_METHODS = {"sigmoid", "relu", "tanh"}


class _Refused(Exception):
    pass


class _NotARegion(Exception):
    pass


def _is_projection(n: fx.Node) -> bool:
    return op_kind(n) == "linear" or (n.op == "call_function" and n.target is _LORA)


def _widening(n: fx.Node) -> bool:
    """A projection to more features than it reads (an MLP's gate / up; a LoRA group of them)."""
    if n.op == "call_function" and n.target is _LORA_GROUP:
        outs = node_val(n)
        return any(isinstance(o, torch.Tensor) and (_width(n.args[0]) or 0) < o.shape[-1] for o in outs or ())
    return _is_projection(n) and (_width(n.args[0]) or 0) < (_width(n) or 0)


def _allowed(n: fx.Node) -> bool:
    if n.op == "call_function" and n.target in (_LORA, _LORA_GROUP):
        return True
    if n.op == "call_function" and n.target in _ACTIVATIONS:
        return True
    if n.op == "call_method" and n.target in _ACTIVATION_METHODS:
        return True
    if op_kind(n) in _LEADING_ONE:
        return _leading_one(n)
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


def _tokens(v) -> list:
    """A tensor's token dimensions: all but the last, leading size-1 dimensions dropped ([1, N, D] -> [N])."""
    dims = list(v.shape[:-1])
    while dims and statically_known_true(dims[0] == 1):
        dims.pop(0)
    return dims


def _same_tokens(a, b) -> bool:
    ta, tb = _tokens(node_val(a)), _tokens(node_val(b))
    return len(ta) == len(tb) and all(statically_known_true(x == y) for x, y in zip(ta, tb))


def _leading_one(n: fx.Node) -> bool:
    """squeeze(0) / unsqueeze(0): unpad_tokens' 2-D projections on its [1, N, D] row."""
    return n.op in ("call_function", "call_method") and op_kind(n) in _LEADING_ONE \
        and tuple(n.args[1:]) == (0,) and not n.kwargs


def _has_token_dim(p: fx.Node, x: fx.Node) -> bool:
    """Whether graph input ``p`` may have a dimension that indexes tokens (any dimension the size of one of ``x``'s
    token dimensions, other than 1): chunking ``x`` but not ``p`` would pair the wrong rows."""
    v, xv = node_val(p), node_val(x)
    if not isinstance(v, torch.Tensor):
        return False
    return any(not statically_known_true(t == 1) and statically_known_true(d == t)
               for d in v.shape for t in xv.shape[:-1])


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
        if any(m is not y and _widening(m) for m in region):
            raise _Refused(why)
        raise _NotARegion

    while todo:
        n = todo.pop()
        if n in region:
            continue
        w = _width(n)
        if w is not None and w < wide and _same_tokens(n, y) and not isinstance(node_val(n), torch.nn.Parameter):
            xs.add(n)  # the narrower token tensor the region starts from (a graph input where the graph starts)
            continue
        if n.op in ("placeholder", "get_attr"):  # a weight
            continue
        if n.op != "call_function" and n.op != "call_method":
            refuse(f"{n} ({n.op}) is read as a token tensor of the wide region")
        if w is not None and w > wide:
            raise _NotARegion  # wider still: h is not the widest tensor of a region (a residual stream)
        if not _allowed(n):
            refuse(f"{n} ({getattr(n.target, '__name__', n.target)}) is not a token-wise op this pass knows")
        region.add(n)
        todo.extend(_inputs(n))
    # unpad_tokens squeezes the packed row [1, N, D] before each projection: the region starts at the row itself
    roots = set()
    for n in xs:
        while _leading_one(n) and op_kind(n) == "squeeze" and isinstance(n.args[0], fx.Node) \
                and _width(n.args[0]) == _width(n) and _same_tokens(n.args[0], n):
            region.add(n)
            n = n.args[0]
        roots.add(n)
    if len(roots) != 1:
        raise _Refused(f"the wide region reads {len(roots)} narrower token tensors ({sorted(map(str, roots))}), not "
                       "one")
    x = roots.pop()
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
                if _has_token_dim(a, x):
                    raise _Refused(f"{n} reads {a}, an input with a dimension the size of the tokens: chunks of "
                                   f"{x} would not match it")
                params.append(a)
    return x, nodes, params


def _body(x: fx.Node, nodes: List[fx.Node], params: List[fx.Node]) -> fx.GraphModule:
    g = fx.Graph()
    env = {x: g.placeholder("x")}
    for i, p in enumerate(params):
        env[p] = g.placeholder(f"p{i}")
    for n in nodes:
        if _leading_one(n):  # the body works on [tokens, features] chunks: no leading 1 to add or drop
            env[n] = env[n.args[0]]
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[nodes[-1]])
    return fx.GraphModule(torch.nn.Module(), g)


def _tokens_hint(x: fx.Node) -> int:
    """How many tokens ``x`` holds at the compile's example sizes (a symbolic length by its hint; an unbacked count,
    unpad_tokens' kept tokens, by its upper bound B x S, else Inductor's fallback for sizes it cannot know)."""
    n = 1
    for d in node_val(x).shape[:-1]:
        n *= size_hint(d, fallback=torch._inductor.config.unbacked_symint_fallback)
    return n


@register_pass(name=NAME,
               description="token-wise wide regions (a decoder's MLP, LoRA included) -> fxfuse::token_tiled over "
                           "chunks of tokens, saving only their input, where they would hold a large share of "
                           "the device's memory (long sequences)",
               options={"chunk_tokens": {"type": int, "minimum": 1, "default": 8192,
                                         "doc": "tokens per chunk; a sequence no longer runs as one chunk"},
                        "mode": {"type": str, "choices": ("auto", "always"), "default": "auto",
                                 "doc": "auto: tile where one layer's MLP intermediates (and their gradients) "
                                        "would take more than share_pct of the memory budget; always: every "
                                        "region"},
                        "share_pct": {"type": int, "minimum": 0, "default": 25,
                                      "doc": "auto mode's threshold, percent of the memory budget"},
                        "memory_budget": {"type": int, "minimum": 0, "default": 0,
                                          "doc": "bytes auto mode measures against (0: the GPU's memory; on a "
                                                 "CPU, auto mode then tiles nothing)"}})
def sequence_tiling_pass(gm: fx.GraphModule, ctx) -> int:
    chunk = ctx.int_option("chunk_tokens", None, 1, "tokens per chunk")
    mode = ctx.choice_option("mode")
    found = []  # (graph module, y, x, nodes, params)
    for m in ctx.graph_modules(gm):
        claimed: Set[fx.Node] = set()
        for y in [n for n in m.graph.nodes if _is_projection(n)]:
            if y in claimed:
                continue
            try:
                region = _region(y)
            except _NotARegion:
                continue
            except _Refused as e:
                ctx.skipped(y, "tile a token-wise region over chunks of tokens", str(e))
                continue
            if region is not None:
                if region[0] in claimed:  # its input is another region's output: that one is tiled, this not
                    ctx.skipped(y, "tile a token-wise region over chunks of tokens",
                                f"its input {region[0]} is the output of a region tiled already")
                    continue
                claimed.update(region[1])
                found.append((m, y) + region)
    if not found:
        return 0
    # one layer's MLP in the backward: its intermediates (gate, up, their activation and product) and their
    # gradients, about six [tokens, intermediate] tensors
    m0, y0, x0, nodes0, _ = max(found, key=lambda f: _tokens_hint(f[2]) * max(_width(n) or 0 for n in f[3]))
    widest = max(_width(n) or 0 for n in nodes0)
    tokens = int(_tokens_hint(x0) * planned_scale(node_val(x0), ctx.options.plan_tokens))  # plan_tokens
    need = 6 * tokens * widest * node_val(y0).element_size()
    budget = ctx.int_option("memory_budget", None, 0, "bytes") or device_memory(x0)
    share = ctx.int_option("share_pct", None, 0, "percent")
    if mode == "auto":
        if budget is None:  # a CPU graph and no budget given: nothing to measure against, nothing said
            return 0
        why = None
        if need * 100 <= share * budget:
            why = (f"one layer's MLP intermediates and gradients, ~{need / 2**30:.2f} GiB at "
                   f"{tokens} tokens, are within {share}% of the {budget / 2**30:.1f} GiB budget")
        if why is not None:
            ctx.skipped(y0, "tile a token-wise region over chunks of tokens", f"not needed: {why}",
                        predicted_bytes=need, budget_bytes=budget)
            return 0
    done = 0
    for m, y, x, nodes, params in found:
        g = m.graph
        key = register_body(_body(x, nodes, params))
        with g.inserting_before(y):
            if node_val(x).dim() > node_val(y).dim():  # unpad_tokens' [1, N, D] row, projected as [N, D]
                x = g.call_method("squeeze", (x, 0))
            t = g.call_function(_TILED, (x, list(params), key, chunk))
        t.meta.update({k: v for k, v in y.meta.items() if k in ("val", "example_value", "stack_trace",
                                                                 "nn_module_stack", "source_fn_stack")})
        y.replace_all_uses_with(t)
        for n in reversed(nodes):
            g.erase_node(n)
        wide = max(_width(n) or 0 for n in nodes)
        ctx.fused(t, f"{len(nodes)} token-wise ops ({wide} wide) over chunks of {chunk} tokens",
                  saved_bytes=None, region_ops=len(nodes), chunk_tokens=chunk, widest=wide, mode=mode,
                  predicted_bytes=need, budget_bytes=budget)
        done += 1
    for m in {f[0] for f in found}:
        m.graph.lint()
        m.recompile()
    return done
