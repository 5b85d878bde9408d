"""Which compiler lowers a graph after fxfuse's passes: Inductor, unless it would have nothing to generate.

After the passes, some graphs hold only fxfuse's ops and bookkeeping: ``compile_regions``' loss graph is the
lm-head's input sliced, the labels padded and shifted, and ``fxfuse::linear_cross_entropy``. Inductor would spend
seconds of the first step on it (tracing, lowering, code generation, loading, the same again for the backward) to
emit one small kernel for the labels, while the work is the fused op's either way. Such a graph is run through
AOTAutograd as it is (``compiler="aot_eager"``'s lowering): the same ops, the same autograd, no code generation.

"Nothing to generate" is decided from the graph's nodes and the example values Dynamo recorded on them, and only
where it is clear; anything else goes to Inductor. The graph must hold at least one of fxfuse's ops (a graph fxfuse
did not rewrite goes to Inductor, as it would without fxfuse), and every other node must be one of:

* fxfuse's own ops (``torch.ops.fxfuse.*``), which Inductor calls as they are;
* nodes with no tensor output (sizes, Python values) and views (outputs that alias an input: slices, reshapes,
  ``.to`` to the same device and dtype, ``.contiguous()`` of a contiguous tensor);
* integer / bool ops of at most twice the graph's largest integer / bool input plus 1024 elements (label shifting
  and padding: O(tokens), never an S x S mask, which Inductor builds in one fused kernel).

Any floating-point op that is not a view, any submodule or higher-order op (checkpoint bodies, autograd functions),
and any node without an example value keeps Inductor; so does a ``mode`` or an Inductor option the user passed (the
backend checks that). The choice and its reason are in the graph's fusion report (``FusionReport.lowering``).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, List, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from .graph_utils import node_val, numel_hint

__all__ = ["reason_to_skip_inductor", "prefetch_inductor_cache_keys"]
log = logging.getLogger(__name__)

_prefetch_asked = False  # once per process
_prefetch_thread: Optional[threading.Thread] = None  # the hashing thread, where one was started


def _compute_triton_key(triton_key) -> None:
    try:
        triton_key()
    except Exception as e:  # noqa: BLE001  (the first compile computes it again and reports what fails)
        log.debug("prefetching Triton's cache key failed: %r", e)


def prefetch_inductor_cache_keys() -> None:
    """Start computing, on a daemon thread, the per-process part of Inductor's cache keys, once per process, when a
    model is handed to fxfuse (``fxfuse.compile``, ``compile_regions``) and seconds remain before its first graph.
    Inductor's first compile (and AOTAutograd's cache, ``compile_regions``' loss graph included) reads Triton's
    ``triton_key()``: a sha256 over Triton's compiler sources and its ~400 MB shared library, cached per process.
    Rank 0's sampled first steps on the H200 hosts spent 0.4-0.7 s in it (nineteenth session, every impl compiling
    at once). Hashing releases the GIL; a first compile that comes before the thread is done computes the key
    itself, as without this."""
    global _prefetch_thread, _prefetch_asked
    if _prefetch_asked:
        return
    _prefetch_asked = True
    try:
        from triton.runtime.cache import triton_key  # the function Inductor's own triton_key() ends in, lru-cached
    except Exception:  # noqa: BLE001  (no Triton, or another layout: nothing to prefetch)
        return
    _prefetch_thread = threading.Thread(target=_compute_triton_key, args=(triton_key,),
                                        name="fxfuse-inductor-cache-keys", daemon=True)
    _prefetch_thread.start()


def _tensors(value: Any) -> List[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _is_fxfuse_op(target: Any) -> bool:
    return isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and \
        getattr(target, "namespace", None) == "fxfuse"


def _aliases_an_input(out: torch.Tensor, inputs: List[torch.Tensor]) -> bool:
    if out._is_view():
        return True
    return any(out is t for t in inputs)


def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def reason_to_skip_inductor(gm: fx.GraphModule) -> Optional[str]:
    """Why Inductor would have nothing to generate for ``gm`` (see the module docstring), or None if it would."""
    largest_index_input = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            for t in _tensors(node_val(node)):
                if not _is_float(t):
                    largest_index_input = max(largest_index_input, numel_hint(t))
    fused = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            if isinstance(getattr(gm, str(node.target), None), torch.nn.Module):
                return None  # a higher-order op's body
            continue
        if node.op not in ("call_function", "call_method"):
            return None  # a submodule
        if _is_fxfuse_op(node.target):
            fused += 1
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return None
        if "example_value" not in node.meta and "val" not in node.meta:
            return None
        outs = _tensors(node_val(node))
        ins = [t for a in node.all_input_nodes for t in _tensors(node_val(a))]
        for out in outs:
            if _aliases_an_input(out, ins):
                continue
            if _is_float(out) or any(_is_float(t) for t in ins):
                return None  # floating-point work: Inductor's
            if numel_hint(out) > 2 * largest_index_input + 1024:
                return None  # an index tensor larger than any input's few columns more (a mask being built)
    if not fused:
        return None  # nothing of fxfuse's: leave such graphs to Inductor, as without fxfuse
    return (f"nothing left for Inductor after fxfuse's passes ({fused} fxfuse op{'s' if fused > 1 else ''}, views "
            f"and O(tokens) integer ops): run through AOTAutograd as is, no code generation")
