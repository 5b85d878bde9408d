"""``fxfuse.compile_regions``: compile a model block by block, the way large-scale training compiles.

Whole-model ``torch.compile`` traces everything between the input ids and the loss into a few big graphs: compile
time grows with depth, and FSDP2's per-block hooks (all-gather before a block, reshard after, prefetching) are
traced into the graphs or split them. torchtitan and accelerate's regional compilation instead compile each
repeated block (decoder layer) on its own, with the module hooks left eager, and pay compile time once per
*distinct* block: identical layers share one compiled graph (their parameters are graph inputs).

``compile_regions(model, **kwargs)`` does that with backend fxfuse:

* **Blocks** are found by structure, not by architecture name: the ``nn.ModuleList`` of two or more children of one
  class holding the most parameters (HF's ``model.layers``, PEFT-wrapped too). Each block's ``_call_impl`` is marked
  ``torch.compiler.disable(..., recursive=False)``: the traced root stops at the block's call (its hooks, e.g.
  FSDP2's, run eagerly), and the block's ``forward`` frame is compiled on its own, once for all identical blocks
  (attention and LoRA fusions apply inside it).
* **The root's own code** (embeddings and mask before the blocks; the final norm, lm-head and loss after them) is
  compiled with ``forward`` (not ``__call__``: the root's hooks stay eager too). It breaks at every block call, so
  it becomes small graphs; the last one holds the lm-head + loss, fused by the ``linear_cross_entropy`` pass (with
  lazy logits). The breaks cost a guard check per block per step, no recompiles.

The model is modified in place and returned. ``kwargs`` are :func:`fxfuse.compile`'s (options are checked now).
Calling it twice on the same model is an error; :func:`undo_compile_regions` restores the model.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.nn as nn

from .errors import FxFuseError

__all__ = ["compile_regions", "undo_compile_regions", "find_repeated_blocks"]


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def find_repeated_blocks(model: nn.Module) -> List[nn.Module]:
    """The children of the ``nn.ModuleList`` of >= 2 same-class modules with the most parameters ([] if none)."""
    best: Optional[nn.ModuleList] = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1 and _n_params(m) > 0:
            if best is None or _n_params(m) > _n_params(best):
                best = m
    return list(best) if best is not None else []


def compile_regions(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compile ``model``'s repeated blocks and its root code (lm-head + loss included) with fxfuse, hooks eager.

    See the module docstring. Returns ``model`` (modified in place)."""
    from .api import compile as fx_compile

    if getattr(model, "_fxfuse_regions", None) is not None:
        raise FxFuseError("compile_regions: this model is already compiled by regions (undo_compile_regions first)")
    blocks = find_repeated_blocks(model)
    if not blocks:
        raise FxFuseError(f"compile_regions: no repeated blocks in {type(model).__name__} (no nn.ModuleList of two "
                          "or more modules of one class with parameters); compile it whole with fxfuse.compile")
    root_forward = model.forward
    model.forward = fx_compile(root_forward, **compile_kwargs)  # options are checked here, before any change
    for b in blocks:
        # an instance attribute shadows nn.Module._call_impl for this block only
        b._call_impl = torch.compiler.disable(b._call_impl, recursive=False)
    model._fxfuse_regions = (root_forward, blocks)
    return model


def undo_compile_regions(model: nn.Module) -> nn.Module:
    """Restore a model :func:`compile_regions` changed."""
    state = getattr(model, "_fxfuse_regions", None)
    if state is None:
        raise FxFuseError("undo_compile_regions: this model was not compiled by regions")
    root_forward, blocks = state
    for b in blocks:
        b.__dict__.pop("_call_impl", None)
    model.__dict__.pop("forward", None)
    if model.forward != root_forward:  # forward was an instance attribute before compile_regions
        model.forward = root_forward
    del model._fxfuse_regions
    return model
