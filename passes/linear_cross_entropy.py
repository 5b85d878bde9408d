"""Fuse an lm-head projection with the cross-entropy that consumes its logits.

Pattern (any architecture; see ``_logit_chain`` for what may sit between projection and loss)::

    logits = linear(h, W[, b])            # or h @ W.T, matmul(h, W.t()); W may be a tied embedding
    z = f(logits)                         # casts, * c, / c, c * tanh(x / c), views, label-shift slices
    loss = cross_entropy(z.view(-1, V), y, ignore_index=i, reduction=r, label_smoothing=e)
         | nll_loss(log_softmax(z, -1), y, ignore_index=i, reduction=r)

becomes ``loss = fxfuse::linear_cross_entropy(h', W, y, b, i, r, softcap, scale, e, grad_in_forward)`` and the
[tokens x vocab] logits, their fp32 copy and the saved softmax are never materialised. ``/ num_items_in_batch``
and anything else after the loss stays as it is.

Gradient strategy per site: for a scalar loss (mean/sum) the gradients are computed during the forward and the
backward only scales them by the upstream scalar (exact by the chain rule whatever follows the loss), which keeps
the work at the three-matmul floor; per-token losses (reduction ``none``) save the log-sum-exp and recompute.

When the logits are also returned by the graph (HF models return them), the graph returns the hidden states
instead and the caller gets a :class:`fxfuse.lazy.LazyLogits` of the same shape and dtype that computes
``f(h @ W.T + b)`` (with autograd) only if something reads it. Other in-graph users of the logits keep the
projection; the report says so. Not fused, with the reason in the report: class weights, probability targets, a non-2-D loss input
(class dim 1), operands of different dtypes or devices, and any chain op not listed above.

Tensor parallelism: an lm-head whose weight is a DTensor split over the vocabulary (``ColwiseParallel``), whether
its logits stay sharded into a ``loss_parallel()`` cross-entropy or are gathered (``output_layouts=Replicate()``)
first, becomes ``fxfuse::vocab_parallel_cross_entropy`` over the local shards: no rank materialises its [tokens x
vocab / ranks] slice, and a gathered lm-head's [tokens x vocab] all-gather is gone (three O(tokens) all-reduces
instead). A loss that was a DTensor stays one.

Pass options (``pass_options={"linear_cross_entropy": {...}}``): ``logits``: ``"lazy"`` (default) or
``"materialize"`` (return real logits; the projection is then computed for them); ``chunk_bytes``: the op's
logits-chunk budget in bytes (default 256 MiB; larger chunks are faster for big vocabularies, e.g. 1 GiB saves
~8 ms per 8192 tokens on a Gemma-2 head, see benchmarks/lce_notes.md; 16 MiB is the min-memory setting).
"""
from __future__ import annotations

import functools
from typing import List

import torch
import torch.fx as fx

import fxfuse.ops.linear_cross_entropy  # noqa: F401  (registers torch.ops.fxfuse.linear_cross_entropy)
from fxfuse.graph_utils import arg, erase_unused, known_true, node_val, numel_hint, op_kind
from fxfuse.lazy import LazyLogits
from fxfuse.registry import register_pass
from fxfuse.site_errors import target_source

from ._logit_chain import (CHUNK_BYTES_OPTION, LogitChain, chunk_bytes_option, const_operand,
                           insert_vocab_parallel_loss, match_logit_chain)

NAME = "linear_cross_entropy"
_DEFAULTS = {"cross_entropy": dict(weight=None, size_average=None, reduce=None, ignore_index=-100,
                                   reduction="mean", label_smoothing=0.0),
             "nll_loss": dict(weight=None, size_average=None, reduce=None, ignore_index=-100, reduction="mean")}


def _const_args(node: fx.Node, kind: str):
    """The loss's non-tensor arguments, or (None, why) if one is a graph value or unsupported."""
    out = {}
    for name, default in _DEFAULTS[kind].items():
        v = arg(node, name, default)
        if name == "weight" and v is not None:
            return None, "class weights are not fused"
        if isinstance(v, fx.Node):
            return None, f"{name} is a graph value"
        out[name] = v
    if out["weight"] is not None:
        return None, "class weights are not fused"
    if out["size_average"] is not None or out["reduce"] is not None:
        return None, "legacy size_average/reduce arguments"
    if out["reduction"] not in ("mean", "sum", "none"):
        return None, f"reduction={out['reduction']!r}"
    out.setdefault("label_smoothing", 0.0)
    return out, ""


def _loss_input(node: fx.Node, kind: str):
    z = arg(node, "input")
    if kind == "cross_entropy":
        return z, ""
    # nll_loss(log_softmax(z, dim=-1)) is cross_entropy(z)
    if op_kind(z) != "log_softmax":
        return None, "nll_loss input is not log_softmax(...)"
    zv = node_val(z)
    dim = arg(z, "dim")
    if not isinstance(zv, torch.Tensor) or dim not in (-1, zv.dim() - 1):
        return None, "log_softmax not over the last dim"
    if len(z.users) != 1:
        return None, "log_softmax has other users"
    return arg(z, "input"), ""


def _check_shapes(chain: LogitChain, z: fx.Node, target: fx.Node) -> str:
    known = known_true
    zv, tv = node_val(z), node_val(target)
    hv, wv = node_val(chain.hidden), node_val(chain.weight)
    if not all(isinstance(t, torch.Tensor) for t in (zv, tv, hv, wv)):
        return "missing fake values"
    if zv.dim() != 2:
        return f"loss input is {zv.dim()}-D (only [tokens, vocab] inputs are fused; class dim 1 of a K-D input is not)"
    if tv.dim() != 1 or tv.dtype not in (torch.int64, torch.int32):
        return "target is not a 1-D tensor of class indices (probability targets are not fused)"
    vdim = 1 if chain.weight_transposed else 0
    ddim = 1 - vdim
    if not known(wv.shape[vdim] == zv.shape[-1]) or not known(hv.shape[-1] == wv.shape[ddim]):
        return "projection shapes do not line up with the loss input"
    if hv.dtype != wv.dtype:
        return f"hidden is {hv.dtype} but the weight is {wv.dtype}"
    if chain.bias is not None and node_val(chain.bias).dtype != wv.dtype:
        return "bias dtype differs from the weight's"
    if hv.device != wv.device or hv.device != tv.device:
        return "operands on different devices"
    return ""


_ELEMENTWISE = ("cast", "mul", "div", "tanh")


def _make_logits(hidden, weight, bias, *, recipe, weight_transposed, dtype):
    """Rebuild of a substituted logits output: lazy logits at run time; while validating (fake tensors), a tensor
    with exactly the metadata a LazyLogits has (shape, dtype, device, contiguous strides), made without running
    the projection: re-running ``linear`` on fake tensors of a symbolic length can ask for a concrete length (a
    guard, seen on CUDA with torch 2.11), which would specialise the graph."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(hidden, FakeTensor):
        vocab = weight.shape[1] if weight_transposed else weight.shape[0]
        return hidden.new_empty((*hidden.shape[:-1], vocab), dtype=dtype)
    return LazyLogits(hidden, weight, bias, recipe, weight_transposed, dtype)


def _substitute_returned_logits(gm: fx.GraphModule, chain: LogitChain, still: List[fx.Node], ctx) -> List[str]:
    """Where the graph returns a logits tensor of the chain, return lazy logits instead. Returns what was done."""
    done = []
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for i, x in enumerate(chain.nodes):
        if x not in still or out_node not in x.users:
            continue
        if any(op_kind(n) not in _ELEMENTWISE for n in chain.nodes[1:i + 1]):
            continue  # a view/slice of the logits is returned: keep it real
        recipe = [(k, c) for k, c in _recipe_of(chain.nodes[1:i + 1])]
        rebuild = functools.partial(_make_logits, recipe=recipe, weight_transposed=chain.weight_transposed,
                                    dtype=node_val(x).dtype)
        if ctx.substitute_output(gm, x, [chain.hidden, chain.weight, chain.bias], rebuild):
            done.append(x.name)
    return done


def _gathered_weight(w):
    """The whole lm-head weight on every rank: the vocabulary slices all-gathered, in the graph, where every rank runs
    it (a graph function: Dynamo's and AOT's tracing see ``full_tensor``'s redistribute)."""
    return w.full_tensor()


def _substitute_returned_tp_logits(gm: fx.GraphModule, chain: LogitChain, still: List[fx.Node], ctx,
                                   kept: List[str]) -> List[str]:
    """Tensor parallelism: where the graph returns the gathered logits (the local tensor after the logits'
    ``redistribute`` to ``Replicate()`` and ``to_local``, HF's plan), return lazy logits of the local hidden states
    and the whole weight, all-gathered in the graph instead of the logits. Reading them then computes the projection
    on the rank that reads, with no collective: no hang where one rank reads alone, and a gradient through a read
    reaches the rank's weight slice through the all-gather's backward (a local slice). The weight all-gather ([V, D])
    replaces the logits' ([tokens, V]) and the projection: done only where the tokens are at least the hidden width
    (from the example length), where it moves no more data than the logits did; else why not goes to ``kept``.
    Returns what was done."""
    from torch.distributed.tensor import DTensor

    done = []
    g = gm.graph
    out_node = next(n for n in reversed(g.nodes) if n.op == "output")
    hv = node_val(chain.hidden)
    tokens = numel_hint(hv) // max(1, int(hv.shape[-1]))
    for i, x in enumerate(chain.nodes):
        if x not in still or out_node not in x.users or isinstance(node_val(x), DTensor):
            continue
        kinds = [op_kind(n) for n in chain.nodes[1:i + 1]]
        if "to_local" not in kinds or any(k not in _ELEMENTWISE + ("redistribute", "to_local") for k in kinds):
            continue  # a DTensor, or a view / slice of the logits, is returned: keep it real
        if tokens < int(hv.shape[-1]):
            kept.append(f"{x.name}: {tokens} tokens, fewer than the hidden width {int(hv.shape[-1])} (all-gathering "
                        f"the weight for lazy logits would move more than the logits)")
            continue
        recipe = list(_recipe_of(chain.nodes[1:i + 1]))
        with g.inserting_before(out_node):
            h = g.call_method("to_local", (chain.hidden,))
            w = g.call_function(_gathered_weight, (chain.weight,))
        rebuild = functools.partial(_make_logits, recipe=recipe, weight_transposed=False, dtype=node_val(x).dtype)
        if ctx.substitute_output(gm, x, [h, w, None], rebuild):
            done.append(x.name)
        else:
            g.erase_node(w)
            g.erase_node(h)
    return done


def _recipe_of(nodes: List[fx.Node]):
    """The value-changing ops among ``nodes`` (a part of the logit chain), to replay on materialised logits."""
    for n in nodes:
        k = op_kind(n)
        if k in ("mul", "div"):
            yield k, const_operand(n)
        elif k == "tanh":
            yield "tanh", None
        elif k == "cast":
            yield "cast", node_val(n).dtype


def _rewrite_site(gm: fx.GraphModule, node: fx.Node, ctx) -> bool:
    kind = op_kind(node)
    consts, why = _const_args(node, kind)
    if consts is None:
        ctx.skipped(node, kind, why)
        return False
    z, why = _loss_input(node, kind)
    if z is None:
        ctx.skipped(node, kind, why)
        return False
    target = arg(node, "target")
    chain, why = match_logit_chain(z)
    if chain is None:
        ctx.skipped(node, kind, f"no lm-head projection feeds the loss: {why}")
        return False
    why = _check_shapes(chain, z, target)
    if why:
        ctx.skipped(node, kind, why)
        return False

    if chain.vocab_split is not None:
        return _rewrite_vocab_parallel_site(gm, node, kind, consts, z, target, chain, ctx)
    g = gm.graph
    reduction = consts["reduction"]
    grad_in_forward = reduction != "none"
    with g.inserting_before(node):
        h = chain.hidden
        for idx in chain.row_index:
            h = g.call_function(__import__("operator").getitem, (h, idx))
        w = g.call_method("t", (chain.weight,)) if chain.weight_transposed else chain.weight
        fused = g.call_function(
            torch.ops.fxfuse.linear_cross_entropy.default,
            (h, w, target, chain.bias, int(consts["ignore_index"]), reduction, float(chain.softcap),
             float(chain.scale), float(consts["label_smoothing"]), grad_in_forward,
             chunk_bytes_option(ctx)),
        )
        fused.meta["stack_trace"] = node.meta.get("stack_trace")
        fused.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
        out = fused
        loss_dtype = node_val(node).dtype
        if loss_dtype != torch.float32:  # e.g. cross_entropy on bf16 logits returns bf16
            out = g.call_method("to", (fused, loss_dtype))
    node.replace_all_uses_with(out)
    chain_nodes = list(chain.nodes)
    loss_nodes = [node] + ([arg(node, "input")] if kind == "nll_loss" else [])
    g.erase_node(node)
    if kind == "nll_loss":
        g.erase_node(loss_nodes[1])
    erased = erase_unused(g, chain_nodes)
    still = [n for n in chain_nodes if n not in erased]
    lazy = []
    if still and ctx.pass_option("logits", "lazy") == "lazy":
        lazy = _substitute_returned_logits(gm, chain, still, ctx)
        if lazy:
            erased += erase_unused(g, still)
            still = [n for n in still if n not in erased]

    # What is no longer materialised: the chain's tensors that died (and their gradients in the backward) and
    # the softmax-sized buffer the loss saves for its backward.
    zv = node_val(z)
    rows_x_vocab = numel_hint(zv)
    saved = rows_x_vocab * 4
    dead = [n for n in chain_nodes if n not in still]
    for n in dead:
        v = node_val(n)
        if isinstance(v, torch.Tensor) and op_kind(n) not in ("view", "reshape", "flatten", "getitem", "squeeze",
                                                              "unsqueeze"):
            saved += 2 * numel_hint(v) * v.element_size()
    detail = dict(reduction=reduction, softcap=chain.softcap, scale=chain.scale,
                  ignore_index=int(consts["ignore_index"]), label_smoothing=float(consts["label_smoothing"]),
                  grad_in_forward=grad_in_forward, tokens_x_vocab=rows_x_vocab, lazy_logits_outputs=lazy,
                  logits_still_materialised_for=[u.name for n in still for u in n.users if u not in still],
                  target_source=target_source(target))  # a bad class index is told as labels[row, position]
    op = f"{kind} <- {op_kind(chain.projection)} ({'softcap ' + format(chain.softcap, 'g') + ', ' if chain.softcap else ''}" \
         f"scale {chain.scale:g}, reduction {reduction})" + ("; returned logits are lazy" if lazy else "")
    ctx.fused(fused, op, saved_bytes=saved, **detail)
    return True


def _replicated_on(mesh):
    """A graph function making a local loss the replicated DTensor the site returned (the mesh bound inside it, as
    Dynamo binds a ``from_local``'s: a DeviceMesh is no graph constant)."""
    from torch.distributed.tensor import DTensor, Replicate

    def replicated_loss(x):
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)

    return replicated_loss


def _rewrite_vocab_parallel_site(gm: fx.GraphModule, node: fx.Node, kind: str, consts, z: fx.Node,
                                 target: fx.Node, chain: LogitChain, ctx) -> bool:
    """The site over a vocabulary-sharded DTensor lm-head: the op on the local shards (``to_local``), the loss
    wrapped back into a replicated DTensor where the graph's loss was one."""
    from torch.distributed.tensor import DTensor, Replicate

    split = chain.vocab_split
    if float(consts["label_smoothing"]) != 0.0:
        ctx.skipped(node, kind, "label smoothing over a vocabulary-sharded lm-head is not fused")
        return False
    out_val, t_val = node_val(node), node_val(target)
    wrap = isinstance(out_val, DTensor)
    if isinstance(t_val, DTensor) and tuple(t_val.placements) != (Replicate(),):
        ctx.skipped(node, kind, f"targets placed ({', '.join(map(str, t_val.placements))}): only Replicate() is fused")
        return False
    g = gm.graph
    reduction = consts["reduction"]
    with g.inserting_before(node):
        fused = insert_vocab_parallel_loss(g, chain, target, consts["ignore_index"], reduction, ctx)
        fused.meta["stack_trace"] = node.meta.get("stack_trace")
        fused.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
        out = fused
        if out_val.dtype != torch.float32:
            out = g.call_method("to", (out, out_val.dtype))
        if wrap:
            out = g.call_function(_replicated_on(split.mesh), (out,))
    node.replace_all_uses_with(out)
    chain_nodes = list(chain.nodes)
    log_softmax = arg(node, "input") if kind == "nll_loss" else None
    g.erase_node(node)
    if log_softmax is not None:
        g.erase_node(log_softmax)
    erased = erase_unused(g, chain_nodes)
    still = [n for n in chain_nodes if n not in erased]
    lazy, kept = [], []
    if still and ctx.pass_option("logits", "lazy") == "lazy":
        lazy = _substitute_returned_tp_logits(gm, chain, still, ctx, kept)
        if lazy:
            erased += erase_unused(g, still)
            still = [n for n in still if n not in erased]
    rows_x_vocab = numel_hint(node_val(z))
    # at least each rank's fp32 slice of the softmax the loss saves (a gathered lm-head held the whole of it)
    ctx.fused(fused, f"{kind} <- {op_kind(chain.projection)} over a vocabulary split between ranks "
                     f"(tensor parallelism; reduction {reduction})" + ("; returned logits are lazy (the weight "
                                                                        "gathered instead)" if lazy else ""),
              saved_bytes=rows_x_vocab * 4 // split.world, reduction=reduction, softcap=chain.softcap, scale=chain.scale,
              ignore_index=int(consts["ignore_index"]), vocab_parallel=True, group=split.group_name,
              tokens_x_vocab=rows_x_vocab, lazy_logits_outputs=lazy, logits_kept_real_because=kept,
              logits_still_materialised_for=[u.name for n in still for u in n.users if u not in still],
              target_source=target_source(target))
    return True


@register_pass(name=NAME, description="lm-head projection + cross-entropy -> fxfuse::linear_cross_entropy",
               options={"logits": {"choices": ("lazy", "materialize"), "default": "lazy",
                                   "doc": "logits the graph returns: 'lazy' (computed only if read) or "
                                          "'materialize' (real tensors)"},
                        "chunk_bytes": CHUNK_BYTES_OPTION})
def linear_cross_entropy_pass(gm: fx.GraphModule, ctx) -> int:
    count = 0
    for mod in ctx.graph_modules(gm):
        for node in list(mod.graph.nodes):
            if node.op in ("call_function", "call_method") and op_kind(node) in ("cross_entropy", "nll_loss"):
                if _rewrite_site(mod, node, ctx):
                    count += 1
        if count:
            mod.recompile()
    return count
