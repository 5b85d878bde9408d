"""What the SDPA passes (``sdpa_causal_mask``, ``sdpa_attention``) share about a ``scaled_dot_product_attention``
call: its targets, reading an argument wherever the caller put it, and rewriting it to ``is_causal=True`` without
the mask."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxfuse.graph_utils import copy_node_meta

__all__ = ["SDPA_TARGETS", "sdpa_arg", "causal_sdpa"]

SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arg(n: fx.Node, name: str, default: Any = None) -> Any:
    i = _SDPA_ARGS.index(name)
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def causal_sdpa(g: fx.Graph, n: fx.Node) -> fx.Node:
    """Insert the same SDPA call with ``attn_mask=None, is_causal=True`` (cuDNN's / flash's causal kernels) before
    ``n``, with its metadata; the caller replaces ``n`` with it."""
    args, kwargs = list(n.args), dict(n.kwargs)
    if len(args) > 3:
        args[3] = None
    else:
        kwargs["attn_mask"] = None
    if len(args) > 5:
        args[5] = True
    else:
        kwargs["is_causal"] = True
    with g.inserting_before(n):
        new = g.call_function(n.target, tuple(args), kwargs)
    new.meta.update(n.meta)
    copy_node_meta(new, n)
    return new
