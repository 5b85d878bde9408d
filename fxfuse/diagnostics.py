"""How fxfuse says where and what: a node as one line, the source line nearest a node, the line that raised, the
compile's name, and the warning for a frame about to reach Dynamo's recompile limit.

Used by the pass manager for rollback messages and the report; nothing here may break a compile (the recompile
check swallows its own errors).
"""
from __future__ import annotations

import logging
import os
import traceback
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx

from .errors import node_location
from .graph_utils import node_val

log = logging.getLogger("fxfuse")

__all__ = ["describe_node", "locate", "raise_site", "graph_name", "warn_near_recompile_limit", "NO_INPUT_CHANGE"]


def describe_node(n: fx.Node) -> str:
    """``%name = target(%arg [shape], ...)``: a node with its arguments' shapes."""
    def show(a):
        if isinstance(a, fx.Node):
            v = node_val(a)
            if isinstance(v, torch.Tensor):
                return f"%{a.name} [{', '.join(map(str, v.shape))}]"
            return f"%{a.name}"
        return repr(a)

    tgt = getattr(n.target, "__name__", str(n.target))
    args = ", ".join([show(a) for a in n.args] + [f"{k}={show(v)}" for k, v in n.kwargs.items()])
    return f"%{n.name} = {tgt}({args})"


def locate(n: Optional[fx.Node]) -> str:
    """Source location of ``n``, or of the nearest original node around it (nodes a pass creates have none)."""
    if n is None:
        return "<unknown>"
    cands = [n] + [a for a in n.all_input_nodes] + list(n.users)
    for c in cands:
        if c.meta.get("stack_trace") or c.meta.get("nn_module_stack"):
            return node_location(c)
    return "<no source information>"


def raise_site(e: BaseException) -> str:
    """Where an exception was raised, as the innermost frame outside torch (a pass's own line)."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        if not os.path.abspath(fr.filename).startswith(torch_dir):
            return f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
    return "<inside torch>"


def graph_name() -> str:
    """``graph <compile id>`` of the compile in progress (``graph`` outside Dynamo)."""
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        if cid is not None:
            return f"graph {cid}"
    except Exception:
        pass
    return "graph"


#: the recompile warning's text when no input shape or dtype changed. The case seen in practice: an HF model called
#: in training without use_cache=False builds a KV cache; under FSDP2 every decoder layer is its own frame, and
#: Dynamo guards each layer's compile on that layer's cache state, so the frame recompiles once per layer.
NO_INPUT_CHANGE = ("no input shape or dtype (a guard on a value or a global; e.g. an HF model called in training "
                   "without use_cache=False, whose KV cache makes each decoder layer's frame recompile under FSDP2)")

# frame id -> description of each compile's inputs; for the recompile-limit warning
_FRAME_COMPILES: Dict[Any, List[Dict[str, str]]] = {}


def _describe_inputs(gm: fx.GraphModule, example_inputs) -> Dict[str, str]:
    out = {}
    for n, x in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
        v = node_val(n)
        if isinstance(v, torch.Tensor):
            out[n.name] = f"{str(v.dtype).replace('torch.', '')}[{', '.join(map(str, v.shape))}]"
        elif isinstance(v, (int, float, torch.SymInt, torch.SymFloat)):
            out[n.name] = f"{type(x).__name__} {v}"
    return out


def warn_near_recompile_limit(gm: fx.GraphModule, example_inputs, name: str) -> None:
    """Once per frame, when fxfuse compiles a frame for the last time Dynamo allows: say so, and what changed
    since the previous compile of that frame (from then on new inputs run that frame eagerly, without fxfuse or
    Inductor)."""
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        if cid is None or getattr(cid, "frame_id", None) is None:
            return
        limit = int(getattr(torch._dynamo.config, "recompile_limit",
                            getattr(torch._dynamo.config, "cache_size_limit", 8)))
        frame, n = cid.frame_id, int(cid.frame_compile_id or 0)
        seen = _FRAME_COMPILES.setdefault(frame, [])
        now = _describe_inputs(gm, example_inputs)
        seen.append(now)
        if n + 1 != limit:
            return
        prev = seen[-2] if len(seen) > 1 else {}
        diff = [f"{k}: {prev.get(k, '<absent>')} -> {v}" for k, v in now.items() if prev.get(k) != v]
        diff += [f"{k}: {v} -> <absent>" for k, v in prev.items() if k not in now]
        warnings.warn(
            f"fxfuse: frame {frame} ({name}) has now been compiled {n + 1} times, Dynamo's recompile_limit "
            f"(torch._dynamo.config.recompile_limit = {limit}); new inputs that fail its guards will run this frame "
            f"eagerly, without fxfuse or Inductor. Changed since its previous compile: "
            f"{'; '.join(diff[:6]) or NO_INPUT_CHANGE}. "
            f"TORCH_LOGS=recompiles shows Dynamo's reasons.", stacklevel=2)
    except Exception:  # a diagnostic must never break the compile
        log.debug("recompile-limit check failed", exc_info=True)
