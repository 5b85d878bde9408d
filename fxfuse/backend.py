"""The ``fxfuse`` torch.compile backend: a thin adapter from Dynamo to the pass manager and Inductor.

::

    Dynamo graph -> PassManager.run (every enabled pass, validated, rolled back on its own; the report)
                 -> compile_fx(gm, example_inputs, config_patches=mode + Inductor options + fxfuse's cache key)
                    (AOTAutograd alone where the passes left Inductor nothing to generate: fxfuse.lowering)
                 -> the compiled function, with substituted outputs (lazy logits) rebuilt around it

Registered under the ``torch_dynamo_backends`` entry point, so ``torch.compile(model, backend="fxfuse")``
works without importing fxfuse first.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx as fx

from .background_inductor import (CannotCompileInBackground, compile_in_background,
                                  reason_not_to_compile_in_background)
from .comm_overlap import may_hold_collectives, overlap_config_patches, runs_collectives_inside
from .errors import FxFuseError, raised_through_dynamo
from .graph_utils import node_val
from .lowering import reason_to_skip_inductor
from .options import FxFuseOptions
from .pass_manager import PassManager
from .site_errors import wrap_site_errors
from .substitution import wrap_substitutions

__all__ = ["fxfuse"]


def fxfuse(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str] = None,
           options: Optional[Dict[str, Any]] = None):
    """torch.compile backend: fxfuse's passes, validated, in front of Inductor.

    ``mode`` and every Inductor option in ``options`` are forwarded to Inductor; fxfuse's own options are
    described in :mod:`fxfuse.options`.
    """
    from torch._guards import detect_fake_mode

    from .ops.trl_fused_head import install_trl_shim
    from torch._inductor.compile_fx import compile_fx

    try:
        opts = FxFuseOptions.parse(options)
    except FxFuseError as e:  # reach the user as it is, not wrapped in Dynamo's BackendCompilerFailed
        raise raised_through_dynamo(e) from None
    # TRL imported after fxfuse: its fused lm-head becomes one node from the next trace on (Dynamo guards on the
    # global the shim replaces, so the frame that broke at it recompiles once)
    install_trl_shim()
    manager = PassManager(opts, entry_point="backend", can_substitute_outputs=True)
    rep, subs = manager.run(gm, example_inputs, detect_fake_mode(example_inputs))
    # a fused op's contract error at run time is told at the site's source line (see fxfuse.site_errors)
    sites = [{"pass": r.pass_name, "location": r.location, "target_source": r.detail.get("target_source")}
             for r in rep.fused]

    patches: Dict[str, Any] = {}
    if mode is not None and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode))
    patches.update(opts.inductor)
    patches.update(_data_dependent_size_patches(gm, patches))
    overlap_note = ""
    if opts.comm_overlap and may_hold_collectives(gm, example_inputs):
        if runs_collectives_inside(gm):  # a vocabulary-parallel op: the ranks' collective order must not move
            overlap_note = ("; comm_overlap off for this graph: a vocabulary-parallel op runs collectives the "
                            "scheduler cannot see")
        else:
            overlap = overlap_config_patches(patches)  # collectives overlapped (fxfuse.comm_overlap: Scheduling)
            patches.update(overlap)
            if overlap:  # counted beside the all-reduce rewrites (Dynamo's counters; benchmarks put them in rows)
                torch._dynamo.utils.counters["fxfuse"]["comm_overlap_graphs"] += 1
    patches["post_grad_custom_post_pass"] = manager.post_grad_pass(
        patches.get("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass))
    if manager.debug_dir:
        import os

        patches.setdefault("trace.enabled", True)
        patches.setdefault("trace.debug_dir", os.path.join(os.path.abspath(manager.debug_dir), "inductor"))
    # compiler="auto": Inductor, unless the rewritten graph left it nothing to generate (fxfuse.lowering); a mode or
    # Inductor options the user gave ask for Inductor
    skip, failed = None, ""
    if opts.compiler == "auto" and mode in (None, "default") and not opts.inductor:
        try:
            skip = reason_to_skip_inductor(gm)
        except Exception as e:  # a graph the rule cannot read is Inductor's, as it would be without the rule
            failed = f" (the lowering check could not read this graph: {type(e).__name__}: {str(e)[:160]})"
    rep.lowering = (f"aot_eager: {skip}" if skip else "aot_eager" if opts.compiler == "aot_eager"
                    else "inductor" + failed)
    compiled = None
    if opts.compiler == "aot_eager" or skip:
        compiled = _aot_eager(gm, example_inputs)
    elif opts.background_compile:  # AOTAutograd alone until a compile process has filled Inductor's caches
        why_not = reason_not_to_compile_in_background(gm, example_inputs)
        if why_not is None:
            try:
                compiled = compile_in_background(gm, example_inputs, patches, _aot_eager, name=rep.graph_name)
                rep.lowering = "inductor from a background compile (AOTAutograd alone until it is cached)"
            except CannotCompileInBackground as e:
                why_not = str(e)
        if why_not is not None:
            rep.lowering = f"inductor, at once: {why_not}"
    if compiled is None:
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    if overlap_note and rep.lowering.startswith("inductor"):
        rep.lowering += overlap_note
    return wrap_site_errors(wrap_substitutions(compiled, subs), sites, gm)


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    """AOTAutograd with no compiler (``compiler="aot_eager"``, graphs ``"auto"`` finds nothing in for Inductor, and
    the first calls of a graph compiled in the background): the partitioned graphs run as they are, after the
    post-partition steps fxfuse needs in every mode (the host-offload round trips folded; fxfuse's own in-place ops
    allowed to write in place, :func:`_mutate_in_place`)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.debugging import aot_eager

    from .ops.host_offload import fold_round_trips

    def run_as_is(g: fx.GraphModule, _example, backward=False):
        fold_round_trips(g.graph)
        _mutate_in_place(g.graph, backward)
        g.recompile()  # also where nothing was folded: the host copies' waits may have been added
        return make_boxed_func(g.forward)

    return aot_eager(gm, example_inputs, fw_compiler=run_as_is,
                     bw_compiler=lambda g, example: run_as_is(g, example, backward=True))


def _donated_backward_inputs(graph: fx.Graph) -> set:
    """The backward graph's inputs AOTAutograd donated (saved tensors no one reads after this backward: it refuses
    ``retain_graph=True`` for such a graph), as placeholder nodes; empty outside a backward compile."""
    try:
        from torch._inductor.utils import get_donated_idxs
        idxs = get_donated_idxs() or ()
    except Exception:  # pragma: no cover - a torch without donated buffers
        return set()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return {placeholders[i] for i in idxs if i < len(placeholders)}


def _mutate_in_place(graph: fx.Graph, backward: bool) -> None:
    """Let fxfuse's mutating ops write into their buffers where no one can tell.

    AOTAutograd functionalizes an in-place custom op into ``auto_functionalized_v2``, which run as it is clones every
    buffer the op writes first. The lm-head loss's backward is such an op (``linear_cross_entropy_scale_grads_``
    scales the gradients its forward computed): the clone is a second copy of the lm-head weight's gradient at
    the start of the backward (1 GiB at Llama-3-8B's head; Inductor's code clones it too, then frees the saved one).
    A buffer is written in place only where no one can see the difference: an intermediate that is no view (of an
    input or anything else) and whose one user is this op, or (``backward``) a backward input AOTAutograd donated
    whose one user is this op. Other ops' nodes are left as they are."""
    af2 = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
    if af2 is None:  # pragma: no cover
        return
    donated = None
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not af2 or not node.args:
            continue
        op = node.args[0]
        if getattr(op, "namespace", None) != "fxfuse":
            continue
        if donated is None:
            donated = _donated_backward_inputs(graph) if backward else set()
        bases = node.kwargs.get("_all_bases", [])
        keep = tuple(i for i, b in enumerate(bases) if not (isinstance(b, fx.Node) and len(b.users) == 1 and (
            b in donated or (b.op == "call_function" and _owns_its_storage(b)))))
        if keep != tuple(range(len(bases))):
            node.kwargs = {**node.kwargs, "_only_clone_these_bases": keep}


def _owns_its_storage(node: fx.Node) -> bool:
    val = node_val(node)
    return isinstance(val, torch.Tensor) and not val._is_view()


def _data_dependent_size_patches(gm: fx.GraphModule, patches: Dict[str, Any]) -> Dict[str, Any]:
    """Inductor settings a graph with a data-dependent (unbacked) size needs: unpad_tokens' kept-token count.

    torch 2.11's Inductor picks the split of a mixed-order reduction (an RMSNorm backward's row and column sums
    fused) from a size hint that an unbacked count does not have, and fails ("Cannot convert symbols to int"; seen
    on the H200 machine; torch 2.13 falls back to a default hint). Given the split, it asks for no hint: 16, what
    its heuristic picks for fewer than ~33k tokens on a 132-SM card. The user's own setting wins."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    key = "triton.mix_order_reduction_split_size"
    if key in patches or not hasattr(torch._inductor.config.triton, key.split(".")[1]):
        return {}
    if getattr(torch._inductor.config.triton, key.split(".")[1]) is not None:
        return {}
    for m in gm.modules():
        if isinstance(m, fx.GraphModule) and any(free_unbacked_symbols(n.meta.get("val"))
                                                 for n in m.graph.nodes if n.op == "call_function"):
            return {key: 16}
    return {}
