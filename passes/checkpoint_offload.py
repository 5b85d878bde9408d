"""Keep checkpointed regions' inputs in host memory where the step would not fit otherwise (issue 32).

Under gradient checkpointing (HF's ``gradient_checkpointing_enable``, ``torch.utils.checkpoint``) Dynamo gives each
checkpointed decoder layer as a ``tag_activation_checkpoint(body, x, ...)`` call, and AOTAutograd saves the call's
inputs for the backward, where the body is recomputed. The layer input ``x`` is the big one: ``[S, hidden]`` per
layer, 128 GiB for the 32 layers of an 8B model at 512k tokens. This pass hands the region
``fxfuse::to_host(x)`` instead and converts it back as the body's first op (``fxfuse::to_device``,
:mod:`fxfuse.ops.host_offload`): what the forward saves is then the pinned host copy, and the recompute starts by
copying it back. The values and every gradient are unchanged.

When: ``options={"offload_activations": ...}``. By default (``None``, auto mode) only where the step's predicted peak
would pass ``fill_pct`` (90) percent of the memory budget (the GPU's memory, or the pass option ``memory_budget``
bytes), and then only as many regions as the prediction needs, the earliest first (their inputs come back last);
at lengths that fit nothing changes, and on a CPU without a budget auto mode does nothing. The prediction, from
the graph at the compile's example length: its inputs (weights, and for trainable ones their gradient and two
optimizer moments), every region's input (the checkpoints), and one layer's recompute and backward, ``work_factor``
times the largest region input: 16 where ``sequence_tiling`` tiled the MLPs, 24 where not. On the H200 (8B widths,
LoRA, 256k tokens) that predicts 53.3 / 111 / 69.3 GiB where 52.6 (x8 layers, tiled) / 110.4 (x32, tiled) / 67.6
(x8, untiled) were measured.
A graph compiled with a symbolic length is decided at ``plan_tokens`` tokens (top-level option) where that is
more than its example length: it serves every later length, the longest too.
``True`` or a size in bytes offloads every region that qualifies; ``False`` none. The report gives the prediction
and the budget at every decision.

Which inputs: floating activations (computed in the graph, or handed over from an earlier graph; never parameters
or buffers) of at least the option's bytes (``True``: 16 MiB) that nothing but the region reads (a tensor read
elsewhere stays on the GPU anyway: offloading it would only add copies; shared tensors such as the rotary tables
are read by every region). The last ``keep_last`` regions (option, default 1) keep their
inputs: the backward needs them first, before a copy could come back.

Costs: per region one device-to-host copy in the forward and one host-to-device copy for its recompute, both on
a side stream (:mod:`fxfuse.ops.host_offload`): the forward's copy runs beside the compute, and in the backward
each region's input is copied back while the region after it computes (one region input of device memory more,
which auto mode counts). The forward's own use of the input and the gradient's way back copy nothing: AOTAutograd's
partition leaves ``to_device(to_host(x))`` there, which fxfuse's post-grad step folds to ``x``. The host side is
bounded by ``host_budget`` (default 80% of the host memory available at compile time); pinned blocks come from
torch's caching host allocator and are reused step after step.
"""
from __future__ import annotations

import torch
import torch.fx as fx

import fxfuse.ops.host_offload  # noqa: F401  (registers torch.ops.fxfuse.to_host / to_device)
import fxfuse.ops.token_tiled  # noqa: F401  (sequence_tiling's op, which the peak prediction looks for)
from fxfuse.graph_utils import node_val
from fxfuse.registry import register_pass

from ._memory import device_memory, host_memory_available, nbytes, planned_scale

NAME = "checkpoint_offload"


def _is_checkpoint(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "tag_activation_checkpoint"


def _fake_like(ctx, v: torch.Tensor, device) -> torch.Tensor:
    with ctx.fake_mode:
        return torch.empty(v.shape, dtype=v.dtype, device=device)


def _set_val(n: fx.Node, v: torch.Tensor) -> None:
    n.meta["val"] = v
    n.meta["example_value"] = v


_WHAT = "keep a checkpointed region's input in host memory"


def _is_activation(x: fx.Node) -> bool:
    """Computed in this graph, or a graph input that is neither a parameter nor a buffer: an activation handed over
    from an earlier graph (the first layer's input after PEFT's input hook breaks the graph there)."""
    if x.op == "call_function":
        return True
    if x.op != "placeholder":
        return False
    arg = x.meta.get("grapharg")
    if arg is None:
        return False
    source = getattr(arg, "source", None)
    name = getattr(source, "name", "")
    name = str(name() if callable(name) else name)  # a property in newer torch, a method in older
    if source is None or "ParamBuffer" in repr(source) or "_parameters" in name or "_buffers" in name:
        return False
    try:
        example = arg.example
    except Exception:  # noqa: BLE001  (the real tensor is gone: do not guess)
        return False
    return isinstance(example, torch.Tensor) and not isinstance(example, torch.nn.Parameter)


def _planned_bytes(v: torch.Tensor, ctx) -> int:
    """``v``'s bytes at the tokens the auto mode plans for (``plan_tokens``, where the length is symbolic)."""
    return int(nbytes(v) * planned_scale(v, ctx.options.plan_tokens))


def _candidates(gm: fx.GraphModule, ctx, min_bytes: int):
    """[(call, body, operand index, x)] for every region input that qualifies, regions in graph order; the bytes of
    every region input (the checkpoints, qualifying or not) and the largest; [(call, why)] for the refused."""
    out, refused, ckpt_bytes, largest = [], [], 0, 0
    seen = set()
    for call in [n for n in gm.graph.nodes if _is_checkpoint(n)]:
        body_ref = call.args[0]
        body = getattr(gm, body_ref.target, None) if isinstance(body_ref, fx.Node) and body_ref.op == "get_attr" \
            else None
        if not isinstance(body, fx.GraphModule):
            continue
        phs = [p for p in body.graph.nodes if p.op == "placeholder"]
        if len(phs) != len(call.args) - 1:
            refused.append((call, "the region's operands do not match its body's inputs"))
            continue
        for j, x in enumerate(call.args[1:]):
            v = node_val(x) if isinstance(x, fx.Node) else None
            if not isinstance(v, torch.Tensor) or not v.is_floating_point() or not _is_activation(x):
                continue  # parameters and buffers live on anyway
            b = _planned_bytes(v, ctx)
            if x not in seen:
                seen.add(x)
                ckpt_bytes += b
                largest = max(largest, b)
            if b < min_bytes:
                continue
            if set(x.users) != {call}:
                refused.append((call, f"{x.name} {list(v.shape)} is read outside the region too (it stays on the "
                                      "device)"))
                continue
            out.append((call, body, j, x))
    return out, refused, ckpt_bytes, largest


def _has_tiled_regions(gm: fx.GraphModule) -> bool:
    from fxfuse.graph_utils import graph_modules

    return any(n.op == "call_function" and n.target is torch.ops.fxfuse.token_tiled.default
               for _, m in graph_modules(gm) for n in m.graph.nodes)


def _predicted_peak(gm: fx.GraphModule, ctx, ckpt_bytes: int, largest: int, work_factor: int) -> int:
    """The step's peak as the module docstring says: graph inputs (+3x for trainable parameters), checkpoints, and
    one layer's recompute and backward (work_factor x the largest region input). An activation handed over from an
    earlier graph is counted once, as a checkpoint where it is a region's input (it requires grad, but it has no
    optimizer state)."""
    region_inputs = {a for n in gm.graph.nodes if _is_checkpoint(n) for a in n.args[1:] if isinstance(a, fx.Node)}
    inputs = 0
    for p in gm.graph.nodes:
        v = node_val(p) if p.op == "placeholder" else None
        if not isinstance(v, torch.Tensor):
            continue
        if _is_activation(p):
            inputs += 0 if p in region_inputs and v.is_floating_point() else _planned_bytes(v, ctx)
        else:
            inputs += nbytes(v) * (4 if v.requires_grad else 1)
    return inputs + ckpt_bytes + work_factor * largest


def _offload(gm: fx.GraphModule, ctx, call: fx.Node, body: fx.GraphModule, j: int, x: fx.Node, **detail) -> None:
    g = gm.graph
    v = node_val(x)
    with g.inserting_before(call):
        h = g.call_function(torch.ops.fxfuse.to_host.default, (x, True))
    _set_val(h, _fake_like(ctx, v, "cpu"))
    call.args = tuple(h if i == j + 1 else a for i, a in enumerate(call.args))
    phs = [q for q in body.graph.nodes if q.op == "placeholder"]
    p = phs[j]
    with body.graph.inserting_after(phs[-1]):
        back = body.graph.call_function(torch.ops.fxfuse.to_device.default, (p, v.device))
    p.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
    _set_val(back, node_val(p) if isinstance(node_val(p), torch.Tensor) else v)
    _set_val(p, _fake_like(ctx, v, "cpu"))
    body.recompile()
    ctx.fused(call, f"checkpointed region input {x.name} {[str(s) for s in v.shape]} kept in host memory between "
              "the forward and the recompute", saved_bytes=nbytes(v), device=str(v.device), **detail)


def _within_host_budget(ctx, cands):
    """The chosen region inputs, the earliest first, as many as the host budget holds; the rest refused, said."""
    host = ctx.int_option("host_budget", None, 0, "bytes")
    if not host:
        avail = host_memory_available()
        host = avail * 8 // 10 if avail is not None else None
    if host is None:
        return cands
    kept, total = [], 0
    for c in cands:
        b = _planned_bytes(node_val(c[3]), ctx)
        if total + b > host:
            ctx.skipped(c[0], _WHAT, f"over the host budget: the {len(kept)} earlier region inputs take "
                        f"{total / 2**30:.1f} GiB of {host / 2**30:.1f} GiB (host_budget)", host_budget_bytes=host)
            continue
        kept.append(c)
        total += b
    return kept


@register_pass(name=NAME,
               description="checkpointed regions' inputs kept in pinned host memory between the forward and the "
                           "recompute, where the step would not fit otherwise (offload_activations)",
               options={"min_bytes": {"type": int, "minimum": 0, "default": 0,
                                      "doc": "region inputs smaller than this stay (0: offload_activations' size, "
                                             "16 MiB by default)"},
                        "keep_last": {"type": int, "minimum": 0, "default": 1,
                                      "doc": "the last regions whose inputs stay on the device (needed first in "
                                             "the backward)"},
                        "fill_pct": {"type": int, "minimum": 1, "default": 90,
                                     "doc": "auto mode offloads where the predicted peak passes this percent of "
                                            "the memory budget"},
                        "memory_budget": {"type": int, "minimum": 0, "default": 0,
                                          "doc": "bytes auto mode measures against (0: the GPU's memory; on a CPU, "
                                                 "auto mode then offloads nothing)"},
                        "host_budget": {"type": int, "minimum": 0, "default": 0,
                                        "doc": "pinned host bytes the offloaded inputs may take (0: 80% of the "
                                               "host memory available at compile time)"},
                        "work_factor": {"type": int, "minimum": 0, "default": 0,
                                        "doc": "one layer's recompute + backward, in region inputs (prediction; "
                                               "0: 16 where sequence_tiling tiled the MLPs, else 24)"}})
def checkpoint_offload_pass(gm: fx.GraphModule, ctx) -> int:
    mode = ctx.options.offload_mode
    if mode == "off":
        return 0
    min_bytes = ctx.int_option("min_bytes", None, 0, "bytes") or ctx.options.offload_min_bytes
    cands, refused, ckpt_bytes, largest = _candidates(gm, ctx, min_bytes)
    if not cands and not refused:
        return 0
    detail = {}
    if mode == "auto":
        first = (cands[0][3] if cands else refused[0][0])
        budget = ctx.int_option("memory_budget", None, 0, "bytes") or device_memory(first)
        if budget is None:  # a CPU graph and no budget given: nothing to measure against, nothing said
            return 0
        work = ctx.int_option("work_factor", None, 0, "inputs") or (16 if _has_tiled_regions(gm) else 24)
        predicted = _predicted_peak(gm, ctx, ckpt_bytes, largest, work)
        limit = budget * ctx.int_option("fill_pct", None, 1, "percent") // 100
        detail = dict(predicted_bytes=predicted, budget_bytes=budget, limit_bytes=limit)
        if predicted <= limit:
            ctx.skipped(first, _WHAT, f"not needed: the step's predicted peak, {predicted / 2**30:.1f} GiB, is within "
                        f"{limit / 2**30:.1f} GiB ({limit * 100 // budget}% of the budget)", **detail)
            return 0
    for call, why in refused:
        ctx.skipped(call, _WHAT, why)
    keep = ctx.int_option("keep_last", 1)
    regions = list(dict.fromkeys(c[0] for c in cands))
    kept = set(regions[len(regions) - keep:]) if keep else set()
    for call in kept:
        ctx.skipped(call, _WHAT, f"one of the last {keep} regions (keep_last): the backward needs its input first")
    cands = [c for c in cands if c[0] not in kept]
    if mode == "auto":
        # the backward's reload one region ahead holds one more region input on the device while offloading
        need, chosen = detail["predicted_bytes"] + largest - detail["limit_bytes"], []
        for c in cands:  # the earliest regions first: their inputs are needed last in the backward
            if need <= 0:
                break
            chosen.append(c)
            need -= _planned_bytes(node_val(c[3]), ctx)
        for c in cands[len(chosen):]:
            ctx.skipped(c[0], _WHAT, f"not needed: offloading the {len(chosen)} earlier region inputs brings the "
                        f"predicted peak within {detail['limit_bytes'] / 2**30:.1f} GiB", **detail)
        if need > 0:
            ctx.skipped(cands[-1][0] if cands else first, _WHAT, f"offloading every region that qualifies leaves "
                        f"the predicted peak {need / 2**30:.1f} GiB over the limit", **detail)
        cands = chosen
    cands = _within_host_budget(ctx, cands)
    for call, body, j, x in cands:
        _offload(gm, ctx, call, body, j, x, mode=mode, **detail)
    if cands:
        gm.recompile()
    return len(cands)
