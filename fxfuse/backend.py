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

from .errors import FxFuseError, raised_through_dynamo
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
    patches["post_grad_custom_post_pass"] = manager.post_grad_pass(
        patches.get("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass))
    if manager.debug_dir:
        import os

        patches.setdefault("trace.enabled", True)
        patches.setdefault("trace.debug_dir", os.path.join(os.path.abspath(manager.debug_dir), "inductor"))
    # compiler="auto": Inductor, unless the rewritten graph left it nothing to generate (fxfuse.lowering); a mode or
    # Inductor options the user gave ask for Inductor
    skip = (reason_to_skip_inductor(gm) if opts.compiler == "auto" and mode in (None, "default") and not opts.inductor
            else None)
    rep.lowering = f"aot_eager: {skip}" if skip else ("aot_eager" if opts.compiler == "aot_eager" else "inductor")
    if opts.compiler == "aot_eager" or skip:
        compiled = _aot_eager(gm, example_inputs)
    else:
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    return wrap_site_errors(wrap_substitutions(compiled, subs), sites, gm)


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    """AOTAutograd with no compiler (the ``compiler="aot_eager"`` option): the partitioned graphs run as they are,
    after the one post-partition step fxfuse needs in every mode (the host-offload round trips folded)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.debugging import aot_eager

    from .ops.host_offload import fold_round_trips

    def run_as_is(g: fx.GraphModule, _example):
        fold_round_trips(g.graph)
        g.recompile()  # also where nothing was folded: the host copies' waits may have been added
        return make_boxed_func(g.forward)

    return aot_eager(gm, example_inputs, fw_compiler=run_as_is, bw_compiler=run_as_is)


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
