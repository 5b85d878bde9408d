"""Keep checkpointed regions' inputs in host memory: ``options={"offload_activations": True | bytes}`` (issue 32).

Under gradient checkpointing (HF's ``gradient_checkpointing_enable``, ``torch.utils.checkpoint``) Dynamo gives each
checkpointed decoder layer as a ``tag_activation_checkpoint(body, x, ...)`` call, and AOTAutograd saves the call's
inputs for the backward, where the body is recomputed. The layer input ``x`` is the big one: ``[S, hidden]`` per
layer, 128 GiB for the 32 layers of an 8B model at 512k tokens. This pass hands the region
``fxfuse::to_host(x)`` instead and converts it back as the body's first op (``fxfuse::to_device``,
:mod:`fxfuse.ops.host_offload`): what the forward saves is then the pinned host copy, and the recompute starts by
copying it back. The values and every gradient are unchanged.

Which inputs: floating tensors computed in the graph (not its inputs: parameters and the caller's tensors live on
anyway) of at least the option's bytes (``True``: 16 MiB) that nothing but the region reads (a tensor read elsewhere stays on the GPU anyway: offloading it would only add copies; shared tensors such
as the rotary tables are read by every region). The last ``keep_last`` regions (option, default 1) keep their
inputs: the backward needs them first, before a copy could come back.

Costs: per region one device-to-host copy in the forward and one host-to-device copy at the start of its
recompute, and the same two for the input's gradient (it travels the way the value came). At long context these
are ~1% of a layer's time. Pinned blocks come from torch's caching host allocator and are reused step after step.
"""
from __future__ import annotations

import torch
import torch.fx as fx

import fxfuse.ops.host_offload  # noqa: F401  (registers torch.ops.fxfuse.to_host / to_device)
from fxfuse.graph_utils import node_val
from fxfuse.registry import register_pass

NAME = "checkpoint_offload"


def _is_checkpoint(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "tag_activation_checkpoint"


def _nbytes(v: torch.Tensor) -> int:
    n = v.numel()
    try:
        n = int(n.node.hint) if isinstance(n, torch.SymInt) and n.node.has_hint() else int(n)
    except Exception:  # an unbacked size without a hint: large enough to matter
        return 2**62
    return n * v.element_size()


def _fake_like(ctx, v: torch.Tensor, device) -> torch.Tensor:
    with ctx.fake_mode:
        return torch.empty(v.shape, dtype=v.dtype, device=device)


def _set_val(n: fx.Node, v: torch.Tensor) -> None:
    n.meta["val"] = v
    n.meta["example_value"] = v


@register_pass(name=NAME,
               description="checkpointed regions' inputs kept in pinned host memory between the forward and the "
                           "recompute (offload_activations)",
               options={"keep_last": {"type": int, "minimum": 0, "default": 1,
                                      "doc": "the last regions whose inputs stay on the device (needed first in "
                                             "the backward)"}})
def checkpoint_offload_pass(gm: fx.GraphModule, ctx) -> int:
    min_bytes = ctx.options.offload_min_bytes
    if not min_bytes:
        return 0
    g = gm.graph
    calls = [n for n in g.nodes if _is_checkpoint(n)]
    keep = ctx.int_option("keep_last", 1)
    count = 0
    for i, call in enumerate(calls):
        if i >= len(calls) - keep:
            ctx.skipped(call, "keep a checkpointed region's input in host memory",
                        f"one of the last {keep} regions (keep_last): the backward needs its input first")
            continue
        body_ref = call.args[0]
        body = getattr(gm, body_ref.target, None) if isinstance(body_ref, fx.Node) and body_ref.op == "get_attr" \
            else None
        if not isinstance(body, fx.GraphModule):
            continue
        phs = [p for p in body.graph.nodes if p.op == "placeholder"]
        operands = list(call.args[1:])
        if len(phs) != len(operands):
            ctx.skipped(call, "keep a checkpointed region's input in host memory",
                        "the region's operands do not match its body's inputs")
            continue
        changed = False
        for j, x in enumerate(operands):
            v = node_val(x) if isinstance(x, fx.Node) else None
            if not isinstance(v, torch.Tensor) or not v.is_floating_point() or _nbytes(v) < min_bytes:
                continue
            if x.op != "call_function":  # graph inputs (parameters, buffers, the caller's tensors) live on anyway
                continue
            if set(x.users) != {call}:
                ctx.skipped(call, "keep a checkpointed region's input in host memory",
                            f"{x.name} {list(v.shape)} is read outside the region too (it stays on the device)")
                continue
            with g.inserting_before(call):
                h = g.call_function(torch.ops.fxfuse.to_host.default, (x,))
            _set_val(h, _fake_like(ctx, v, "cpu"))
            operands[j] = h
            p = phs[j]
            with body.graph.inserting_after(phs[-1]):
                back = body.graph.call_function(torch.ops.fxfuse.to_device.default, (p, v.device))
            p.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
            _set_val(back, node_val(p) if isinstance(node_val(p), torch.Tensor) else v)
            _set_val(p, _fake_like(ctx, v, "cpu"))
            ctx.fused(call, f"checkpointed region input {x.name} {[str(s) for s in v.shape]} kept in host memory "
                      "between the forward and the recompute", saved_bytes=_nbytes(v), device=str(v.device))
            changed = True
            count += 1
        if changed:
            call.args = (call.args[0], *operands)
            body.recompile()
    if count:
        gm.recompile()
    return count
