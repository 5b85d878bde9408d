"""Output substitution: a graph output returned as a value rebuilt outside the compiled graph.

The lm-head pass uses it for logits a model returns but a fused loss no longer needs: the compiled graph returns
the hidden states in that slot, and the wrapper :func:`wrap_substitutions` puts around the compiled function
returns ``LazyLogits(hidden, weight, ...)`` there, materialised only if the caller reads them. Only the Dynamo
backend can do this (from inside Inductor a graph can only be rewritten in place), so the pass manager tells each
pass up front whether its entry point allows it (:attr:`fxfuse.pass_context.PassContext.can_substitute_outputs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence

import torch.fx as fx

from .graph_utils import node_val
from .validation import OutputSig, output_signature

__all__ = ["OutputSubstitution", "effective_signature", "wrap_substitutions", "substitution_fixer"]


@dataclass
class OutputSubstitution:
    """Graph output ``slot`` is returned as ``rebuild(*values of inputs)`` built outside the compiled graph.

    The graph itself returns ``inputs[0]`` in that slot; the other inputs are read from the compiled function's
    arguments (placeholders) or returned as extra trailing outputs. ``rebuild`` must accept fake tensors: the
    pass manager validates the substitution by running it under the compile's fake mode.
    """

    slot: int
    inputs: List[fx.Node]
    rebuild: Callable[..., Any]
    pass_name: str
    placeholder_index: Dict[int, int] = field(default_factory=dict)  # input position -> argument index
    extra_output_index: Dict[int, int] = field(default_factory=dict)  # input position -> flat output index


def effective_signature(gm: fx.GraphModule, subs: List[OutputSubstitution], fake_mode) -> List[OutputSig]:
    """The output signature callers will see: substituted slots rebuilt (under fake), extra outputs dropped."""
    sigs = output_signature(gm)
    if not subs:
        return sigs
    extra = {i for s in subs for i in s.extra_output_index.values()}
    for s in subs:
        vals = [node_val(x) if x is not None else None for x in s.inputs]
        with fake_mode:
            v = s.rebuild(*vals)
        sigs[s.slot] = OutputSig(s.slot, "tensor", tuple(v.shape), tuple(v.stride()), v.dtype, v.device, None)
    return [sig for i, sig in enumerate(sigs) if i not in extra]


def _apply(subs: List[OutputSubstitution], args: Sequence[Any], outs) -> list:
    extra = sorted({i for s in subs for i in s.extra_output_index.values()})
    outs = list(outs)
    for s in subs:
        vals = [outs[s.slot]]
        for j in range(1, len(s.inputs)):
            if s.inputs[j] is None:
                vals.append(None)
            elif j in s.placeholder_index:
                vals.append(args[s.placeholder_index[j]])
            else:
                vals.append(outs[s.extra_output_index[j]])
        outs[s.slot] = s.rebuild(*vals)
    return [o for i, o in enumerate(outs) if i not in extra]


def wrap_substitutions(compiled: Callable, subs: List[OutputSubstitution]) -> Callable:
    """Rebuild substituted outputs around the compiled function (keeping its calling convention)."""
    if not subs:
        return compiled

    # Dynamo calls what a backend returns with positional arguments (the boxed convention is for the compilers
    # nested inside Inductor), so no functools.wraps here: it would copy their _boxed_call marker.
    def run(*args):
        return _apply(subs, args, compiled(*args))

    run.__wrapped__ = compiled
    return run


def substitution_fixer(subs: List[OutputSubstitution]) -> Callable[[Sequence[Any], list], list]:
    """``fix_outputs(args, outs)`` for :func:`fxfuse.verify.run_graph`: what callers see of a graph whose
    outputs ``subs`` rebuild."""
    if not subs:
        return lambda args, outs: outs
    return lambda args, outs: _apply(subs, args, outs)
