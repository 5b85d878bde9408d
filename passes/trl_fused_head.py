"""TRL's fused lm-head (``fxfuse::trl_chunked_logprob``, the node fxfuse's shim gives TRL's
``ChunkedLogProbFunction``; see :mod:`fxfuse.ops.trl_fused_head`) -> ``fxfuse::linear_log_probs``.

TRL's trainers run the lm-head through their own chunked kernel (``model(..., fused_lm_head=True)``): per-token
log-probs of the targets, and, as the trainer asks, the entropy (GRPO, SFT's metrics), ``log sum p^2`` (DPO's
WPO weighting), the mean logit (DPO / KTO metrics) and whether the target is the argmax (SFT's
``mean_token_accuracy``). fxfuse's op computes every one of them (same transform: ``z = softcap(logit_scale * x) /
T`` is ``softcap_{c/s}(x) / (T / s)`` for a scale s > 0; the same first-maximum rule for ``is_top1``), so the node
is rewritten wherever the dtypes and scalars allow: fxfuse's op holds one logits chunk (0.245 GiB at the
Llama-3-8B head) where TRL's kernel holds fp32 gradient accumulators (2.33 GiB), at about its speed (H200 rows in
``benchmarks/results/h200-trl-head-*.jsonl``). Where it cannot be rewritten, TRL's kernel stays (inside the graph,
no graph break), and the report says why.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

import fxfuse.ops.linear_log_probs  # noqa: F401  (registers torch.ops.fxfuse.linear_log_probs)
from fxfuse.graph_utils import copy_node_meta, node_val, numel_hint
from fxfuse.ops.trl_fused_head import OPTIONAL_OUTPUTS
from fxfuse.registry import register_pass

from ._logit_chain import CHUNK_BYTES_OPTION, chunk_bytes_option

NAME = "trl_fused_head"
_OUTPUT_NAMES = ("log_probs",) + OPTIONAL_OUTPUTS  # getitem index -> what it is (5: log_z, internal)
# TRL's output index -> fxfuse::linear_log_probs's (logp, entropy, is_top1, mean_logits, log_sum_sq_probs)
_TO_FXFUSE = {0: 0, 1: 1, 2: 4, 3: 3, 4: 2}


def _is_trl_node(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in (torch.ops.fxfuse.trl_chunked_logprob,
                                                    torch.ops.fxfuse.trl_chunked_logprob.default)


def _args(n: fx.Node):
    names = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size", "softcap", "logit_scale", "outputs",
             "compute_dtype")
    vals = dict(zip(names, n.args))
    vals.update(n.kwargs)
    return vals


def _rewrite(g: fx.Graph, node: fx.Node, ctx) -> bool:
    what = "TRL fused lm-head (ChunkedLogProbFunction)"
    a = _args(node)
    getitems = {}
    for u in list(node.users):
        if u.op != "call_function" or u.target is not operator.getitem:
            ctx.skipped(node, what, "TRL's kernel kept: its result is used whole, not output by output")
            return False
        getitems.setdefault(u.args[1], []).append(u)
    used = sorted(i for i, us in getitems.items() if any(x.users for x in us))
    if any(i not in _TO_FXFUSE for i in used):
        ctx.skipped(node, what, "TRL's kernel kept: the graph reads its internal log_z output",
                    outputs=[_OUTPUT_NAMES[i] if i < len(_OUTPUT_NAMES) else "log_z" for i in used])
        return False
    hv, wv = node_val(a["hidden"]), node_val(a["weight"])
    if not isinstance(hv, torch.Tensor) or not isinstance(wv, torch.Tensor):
        ctx.skipped(node, what, "TRL's kernel kept: no fake values for hidden / weight")
        return False
    cdt = a["compute_dtype"]
    if hv.dtype != wv.dtype or hv.dtype != cdt:
        # fxfuse's op computes in the inputs' dtype (the autocast dtype under autocast, where hidden and weight
        # are cast to it as they enter the op); TRL casts inside its kernel, e.g. a bf16 weight to fp32
        # (cast_lm_head_to_fp32) or fp32 inputs to bf16 under autocast
        autocast_ok = hv.dtype == wv.dtype and cdt in (torch.bfloat16, torch.float16) and hv.dtype == torch.float32
        if not autocast_ok:
            ctx.skipped(node, what, f"TRL's kernel kept: hidden {hv.dtype} / weight {wv.dtype} / compute dtype {cdt} "
                                    "differ (fxfuse's op takes one dtype)")
            return False
    scale, temperature, softcap = float(a["logit_scale"]), float(a["temperature"]), a["softcap"]
    if not (scale > 0 and temperature > 0) or (softcap is not None and not softcap > 0):
        ctx.skipped(node, what, f"TRL's kernel kept: logit_scale {scale:g}, temperature {temperature:g}, softcap "
                                f"{softcap} (fxfuse's op needs them > 0)")
        return False
    entropy = 1 in used
    op_temperature = temperature / scale
    op_softcap = 0.0 if softcap is None else float(softcap) / scale
    with g.inserting_before(node):
        fused = g.call_function(torch.ops.fxfuse.linear_log_probs.default,
                                (a["hidden"], a["weight"], a["targets"], a["bias"], op_temperature, op_softcap,
                                 entropy, chunk_bytes_option(ctx), 4 in used, 3 in used, 2 in used))
        copy_node_meta(fused, node)
    for i, us in getitems.items():
        for u in us:
            if u.users:
                with g.inserting_before(u):
                    new = g.call_function(operator.getitem, (fused, _TO_FXFUSE[i]))
                    copy_node_meta(new, u)
                u.replace_all_uses_with(new)
            g.erase_node(u)
    g.erase_node(node)
    n, v = numel_hint(hv) // max(1, hv.shape[-1]) if hv.dim() else 0, wv.shape[0]
    outputs = [_OUTPUT_NAMES[i] for i in used]
    ctx.fused(fused, f"{what} -> fxfuse::linear_log_probs ({' + '.join(outputs) or 'nothing read'}; "
                     f"temperature {temperature:g}, logit_scale {scale:g}"
                     f"{', softcap ' + format(softcap, 'g') if softcap else ''})",
              saved_bytes=None, tokens_x_vocab=f"{n} x {v}", entropy=entropy, outputs=outputs)
    return True


@register_pass(name=NAME,
               description="TRL's fused lm-head node (fxfuse's shim of ChunkedLogProbFunction) -> "
                           "fxfuse::linear_log_probs (log-probs, entropy, is_top1, mean logits, log sum p^2)",
               options={"chunk_bytes": CHUNK_BYTES_OPTION})
def trl_fused_head_pass(gm: fx.GraphModule, ctx) -> int:
    count = 0
    for mod in ctx.graph_modules(gm):
        changed = 0
        for node in list(mod.graph.nodes):
            if _is_trl_node(node) and _rewrite(mod.graph, node, ctx):
                changed += 1
        if changed:
            mod.recompile()
        count += changed
    return count
