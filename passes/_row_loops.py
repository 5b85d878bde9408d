"""Fold per-row loops over the logits, as Dynamo unrolls them, back into one batched op (a shared matcher layer).

Trainers loop over the batch to bound peak memory, e.g. TRL's ``selective_log_softmax``::

    for row_logits, row_labels in zip(logits, index):            # bf16 logits
        per_token_logps.append(F.log_softmax(row_logits, -1).gather(-1, row_labels))
    per_token_logps = torch.stack(per_token_logps)
    logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])   # fp32 logits

Dynamo unrolls the loop into ``logits[0], logits[1], ...`` and one chain per row, so a pass looking for
``log_softmax(logits)`` sees B small ones. :func:`fold_row_loops` inserts the batched equivalent beside each
such stack (``log_softmax(X, -1).gather(-1, IDX)`` / ``logsumexp(X, -1)``) and points the stack's users at it;
a pass then matches the batched form as usual. Folding is only worth it when the pass then fuses the site
(the batched form alone would materialise what the loop avoided), so each :class:`RowLoopFold` is either
``finish``ed (the loop's now dead nodes are erased) or ``undo``ne (the graph is as before).

Exact: stacking rows i = 0..B-1 of a last-dim op equals the op on the whole tensor. Only full loops in order
(row i is ``X[i]`` for every i < X.shape[0], B static) with single-use intermediates are folded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.fx as fx

from fxfuse.graph_utils import arg, copy_node_meta, erase_unused, node_val, op_kind

from ._logit_chain import is_last_dim


def _row_of(n: fx.Node, i: int) -> Optional[fx.Node]:
    """X if ``n`` is ``X[i]`` (an int index on dim 0), else None."""
    if op_kind(n) != "getitem" or arg(n, "index") != i or not isinstance(arg(n, "input"), fx.Node):
        return None
    return arg(n, "input")


def _single_use(*nodes: fx.Node) -> bool:
    return all(len(n.users) == 1 for n in nodes)


@dataclass
class RowLoopFold:
    stack: fx.Node                    # the original stack: its users now read ``out``
    out: fx.Node                      # the batched replacement's output
    inserted: List[fx.Node]           # batched nodes, in dependency order
    loop: List[fx.Node] = field(default_factory=list)  # the per-row nodes (erased by finish)
    kind: str = ""

    def folded(self) -> bool:
        """Whether the batched nodes were consumed by a rewrite (the pass erased them)."""
        return any(n.graph is None or n not in n.graph.nodes for n in self.inserted)

    def undo(self, g: fx.Graph) -> None:
        self.out.replace_all_uses_with(self.stack)
        for n in reversed(self.inserted):
            if not n.users:
                g.erase_node(n)

    def finish(self, g: fx.Graph) -> None:
        erase_unused(g, [self.stack] + self.loop)


def _match_stack(st: fx.Node):
    """(kind, X, IDX or None, log_softmax dtype, loop nodes) for a stack of per-row log_softmax+gather or
    logsumexp chains over all rows of one X, else None."""
    rows = arg(st, "tensors")
    if not isinstance(rows, (list, tuple)) or not rows or arg(st, "dim", 0) != 0:
        return None
    kind, X, IDX, dtype, loop = None, None, None, None, []
    for i, r in enumerate(rows):
        k = op_kind(r)
        if k == "gather" and len(r.users) == 1 and is_last_dim(r, arg(r, "dim")):
            lp, idx = arg(r, "input"), arg(r, "index")
            if op_kind(lp) != "log_softmax" or not is_last_dim(lp, arg(lp, "dim")) or not isinstance(idx, fx.Node):
                return None
            x = arg(lp, "input")
            xi, ii = _row_of(x, i), _row_of(idx, i)
            if xi is None or ii is None or not _single_use(lp, x, idx):
                return None
            if kind not in (None, "log_softmax_gather") or (IDX is not None and ii is not IDX):
                return None
            if dtype is not None and arg(lp, "dtype") != dtype:
                return None
            kind, IDX, dtype = "log_softmax_gather", ii, arg(lp, "dtype")
            loop += [r, lp, x, idx]
        elif k == "logsumexp" and len(r.users) == 1 and is_last_dim(r, arg(r, "dim")) and not arg(r, "keepdim", False):
            x = arg(r, "input")
            xi = _row_of(x, i)
            if xi is None or not _single_use(x) or kind not in (None, "logsumexp"):
                return None
            kind = "logsumexp"
            loop += [r, x]
        else:
            return None
        if X is not None and xi is not X:
            return None
        X = xi
    xv = node_val(X)
    if not isinstance(xv, torch.Tensor) or xv.dim() < 2 or not isinstance(xv.shape[0], int) \
            or xv.shape[0] != len(rows):
        return None  # not every row (or a symbolic batch): not the loop's whole tensor
    return kind, X, IDX, dtype, loop


def fold_row_loops(g: fx.Graph) -> List[RowLoopFold]:
    """Insert the batched form of every foldable per-row stack; the caller must ``finish`` or ``undo`` each."""
    folds = []
    for st in [n for n in g.nodes if op_kind(n) == "stack"]:
        m = _match_stack(st)
        if m is None:
            continue
        kind, X, IDX, dtype, loop = m
        with g.inserting_before(st):
            if kind == "log_softmax_gather":
                lp = g.call_function(torch.log_softmax, (X, -1), {"dtype": dtype} if dtype is not None else {})
                out = g.call_function(torch.gather, (lp, -1, IDX))
                inserted = [lp, out]
            else:
                out = g.call_function(torch.logsumexp, (X, -1))
                inserted = [out]
        for n in inserted:
            copy_node_meta(n, st)
        # fake values for the matchers (the backend re-propagates the whole graph after the pass)
        try:
            xv = node_val(X)
            lpv = torch.log_softmax(xv, -1, dtype=dtype) if kind == "log_softmax_gather" else None
            if kind == "log_softmax_gather":
                inserted[0].meta["val"] = lpv
                inserted[1].meta["val"] = torch.gather(lpv, -1, node_val(IDX))
            else:
                inserted[0].meta["val"] = torch.logsumexp(xv, -1)
        except Exception:  # no fake values to compute with: leave the loop alone
            for n in reversed(inserted):
                g.erase_node(n)
            continue
        st.replace_all_uses_with(out)
        folds.append(RowLoopFold(st, out, inserted, loop, kind))
    return folds
