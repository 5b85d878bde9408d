"""Errors a fused op raises while a compiled graph runs, told at the user's line.

Under ``torch.compile`` a fused op is called from Inductor's generated code, so the innermost "user" frame an op
can find is a line of that file. The backend knows better: when a pass rewrote a site it recorded the site's source
line (the report's ``location``), and for the lm-head loss where the class indices came from (a graph input, through
the model's flatten, shift and pad: :func:`target_source`). :func:`wrap_site_errors` wraps the compiled graph so that
an :class:`~fxfuse.errors.FxFuseContractError` of a fused op names the fused site's line and, for a bad class
index, the batch row and position in the labels the user passed.
"""
from __future__ import annotations

import operator
import os
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.fx as fx

from .errors import FxFuseContractError, is_internal_frame, user_source_line
from .graph_utils import op_kind

__all__ = ["target_source", "wrap_site_errors"]

# ops that keep the flat order of the indices (device / dtype moves included: HF's loss moves labels to the logits'
# device)
_RESHAPES = ("view", "reshape", "flatten", "contiguous", "clone", "_unsafe_view", "to", "cast")


def target_source(target: fx.Node) -> Optional[Dict[str, Any]]:
    """Where the loss's 1-D class indices come from: ``{"input": name, "start": k, "pad": p}`` when they are the
    graph input (placeholder) ``name`` (``[B, S]`` labels) flattened, after an optional right pad of the last dim and a last-dim slice from ``k`` (the
    causal-LM shift: ``pad(labels, (0, 1))[..., 1:]``), so that flat index ``j`` is ``labels[j // S', j % S' + k]``
    with ``S' = S + pad - k``; ``"pad"`` holds the pad. None when the chain is anything else."""
    n, start, pad = target, 0, 0
    for _ in range(16):
        if n.op == "placeholder":
            return {"input": n.name, "start": start, "pad": pad}
        kind = op_kind(n)
        if kind in _RESHAPES:
            n = n.args[0]
        elif n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], tuple) \
                and len(n.args[1]) == 2 and n.args[1][0] in (Ellipsis, slice(None)) \
                and isinstance(n.args[1][1], slice) and n.args[1][1].stop is None \
                and n.args[1][1].step in (None, 1) and start == 0:
            start = int(n.args[1][1].start or 0)
            n = n.args[0]
        elif kind == "pad" and len(n.args) >= 2 and len(n.args[1]) == 2 and n.args[1][0] == 0 and pad == 0:
            pad = int(n.args[1][1])
            n = n.args[0]
        else:
            return None
        if not isinstance(n, fx.Node):
            return None
    return None


def _row_and_position(src: Dict[str, Any], args: Sequence[Any], index: int) -> Optional[str]:
    labels = args[src["input"]] if isinstance(src.get("input"), int) and src["input"] < len(args) else None
    if getattr(labels, "dim", lambda: 0)() != 2:
        return None
    B, S = labels.shape
    width = S + src["pad"] - src["start"]
    if width <= 0 or index >= B * width:
        return None
    row, col = divmod(index, width)
    pos = col + src["start"]
    shift = f" (the loss reads it shifted by {src['start']}: flat index {index} is column {col})" if src["start"] else ""
    return f"labels[{row}, {pos}] of the [{B}, {S}] labels passed in = {int(labels[row, pos])}{shift}"


def _caller_line() -> Optional[str]:
    """The user's line that called the compiled model: the innermost frame of the live stack outside torch, fxfuse
    and installed libraries (transformers' wrappers around ``forward`` included); else :func:`user_source_line`."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        f = os.path.abspath(fr.filename)
        code = (fr.line or "").strip()
        # a frame still on its `def` line is the compiled function itself (Dynamo runs the graph in its place)
        if code.startswith(("def ", "async def ", "@")):
            continue
        if not is_internal_frame(f) and "site-packages" not in f and "dist-packages" not in f:
            return f"{fr.filename}:{fr.lineno} in {fr.name}: {code}"
    return user_source_line()


def wrap_site_errors(compiled: Callable, sites: List[Dict[str, Any]], gm: Optional[fx.GraphModule] = None
                     ) -> Callable:
    """``compiled`` with a fused op's contract errors re-raised at the fused site (``sites``: the pass name, the
    site's ``location`` and, for the lm-head loss, its ``target_source``, whose input is named by placeholder and
    found among ``gm``'s inputs here: a site inside a checkpoint body reads the body's inputs, not the graph's).
    The calling convention is kept (Dynamo calls what a backend returns with positional arguments)."""
    if not sites:
        return compiled
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"] if gm is not None else []
    for s in sites:
        src = s.get("target_source")
        if src:
            s["target_source"] = dict(src, input=names.index(src["input"])) if src["input"] in names else None

    def run(*args):
        try:
            return compiled(*args)
        except FxFuseContractError as e:
            raise _at_site(e, sites, args) from None

    run.__wrapped__ = compiled
    return run


def _at_site(e: FxFuseContractError, sites: List[Dict[str, Any]], args: Sequence[Any]) -> FxFuseContractError:
    op = getattr(e, "op", None)
    if not op:
        return e
    mine = [s for s in sites if op.split("::")[-1].startswith(s["pass"])]
    if not mine:
        return e
    first, _, rest = str(e).partition("\n")
    lines = [first]
    index = getattr(e, "index", None)
    if index is not None and len(mine) == 1 and mine[0].get("target_source"):
        where = _row_and_position(mine[0]["target_source"], args, index)
        if where:
            lines.append(f"  that is {where}")
    if len(mine) == 1:
        lines.append(f"  at the fused site: {mine[0]['location']}")
    else:
        lines.append("  at one of the fused sites: " + "; ".join(s["location"] for s in mine))
    caller = _caller_line()
    if caller:
        lines.append(f"  called from: {caller}")
    for ln in rest.splitlines():  # the op's own detail lines; its "where" is a line of Inductor's generated code
        body = ln.strip()
        for tag in ("at ", "called from: "):
            if body.startswith(tag):
                ln = f"  (raised from the compiled graph: {body[len(tag):]})"
                break
        lines.append(ln)
    err = FxFuseContractError("\n".join(lines))
    err.op, err.index = op, index
    return err.with_traceback(e.__traceback__)
