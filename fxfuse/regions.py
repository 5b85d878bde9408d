"""``fxfuse.compile_regions``: compile a model block by block, the way large-scale training compiles.

Whole-model ``torch.compile`` traces everything between the input ids and the loss into a few big graphs: compile
time grows with depth, and FSDP2's per-block hooks (all-gather before a block, reshard after, prefetching) are
traced into the graphs or split them. torchtitan and accelerate's regional compilation instead compile each
repeated block (decoder layer) on its own, with the module hooks left eager, and pay compile time once per
*distinct* block: identical layers share one compiled graph (their parameters are graph inputs).

``compile_regions(model, **kwargs)`` does that with backend fxfuse, in three parts:

* **Blocks** are found by structure, not by architecture name: the ``nn.ModuleList`` of two or more children of one
  class holding the most parameters (HF's ``model.layers``, PEFT-wrapped too). Each block's ``forward`` is compiled
  (its ``__call__``, with FSDP2's hooks, stays eager); identical blocks share one compiled graph (attention and
  LoRA fusions apply inside it).
* **The module that runs the blocks** (HF's base ``LlamaModel``: embeddings, rotary tables, the attention mask, the
  loop, the final norm) runs eagerly around the compiled blocks. Eagerly, HF builds no mask at all for a causal
  batch without padding (the blocks run SDPA's causal kernels: compiled, that mask would be a ``[B, 1, S, S]``
  tensor made in one graph and read in another, which SDPA reads over every tile: 2.3x slower attention measured
  on the H200 at Llama-3-8B widths and 4096 tokens); with padding or packed documents it builds the mask tensor
  and the blocks' ``sdpa_attention`` runs fxfuse's kernel on it, empty tiles skipped.
* **The root's own code** after that (the lm-head and the loss) is compiled with ``forward`` (not ``__call__``: the
  root's hooks stay eager too); the module running the blocks is a graph break in it, so its last graph holds the
  lm-head + loss, fused by the ``linear_cross_entropy`` pass (with lazy logits).

The model is modified in place and returned. ``kwargs`` are :func:`fxfuse.compile`'s (options are checked now).
Calling it twice on the same model is an error; :func:`undo_compile_regions` restores the model.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn

from .errors import FxFuseError

__all__ = ["compile_regions", "undo_compile_regions", "find_repeated_blocks"]


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _block_list(model: nn.Module) -> Tuple[Optional[nn.ModuleList], Optional[nn.Module]]:
    """The ``nn.ModuleList`` of >= 2 same-class modules with the most parameters, and the module holding it."""
    best: Optional[nn.ModuleList] = None
    owner: Optional[nn.Module] = None
    for parent in model.modules():
        for m in parent.children():
            if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1 and _n_params(m) > 0:
                if best is None or _n_params(m) > _n_params(best):
                    best, owner = m, parent
    return best, owner


def find_repeated_blocks(model: nn.Module) -> List[nn.Module]:
    """The children of the ``nn.ModuleList`` of >= 2 same-class modules with the most parameters ([] if none)."""
    best, _ = _block_list(model)
    return list(best) if best is not None else []


def compile_regions(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compile ``model``'s repeated blocks and its root code after them (lm-head + loss) with fxfuse; the module
    that runs the blocks and every module's hooks stay eager.

    See the module docstring. Returns ``model`` (modified in place)."""
    from .api import compile as fx_compile

    if getattr(model, "_fxfuse_regions", None) is not None:
        raise FxFuseError("compile_regions: this model is already compiled by regions (undo_compile_regions first)")
    block_list, owner = _block_list(model)
    if block_list is None:
        raise FxFuseError(f"compile_regions: no repeated blocks in {type(model).__name__} (no nn.ModuleList of two "
                          "or more modules of one class with parameters); compile it whole with fxfuse.compile")
    blocks = list(block_list)
    originals = [(m, m.__dict__.get("forward")) for m in [model] + blocks]  # instance attributes set before us
    compiled_root = None
    if owner is not model:
        compiled_root = fx_compile(model.forward, **compile_kwargs)  # options are checked here, before any change
    compiled_blocks = [fx_compile(b.forward, **compile_kwargs) for b in blocks]
    for b, f in zip(blocks, compiled_blocks):
        b.forward = f  # an instance attribute: the block's __call__ (its hooks) stays eager
    if compiled_root is not None:
        model.forward = compiled_root
        # eager, with what it calls; the blocks' compiled forwards compile when called (their own frames)
        owner._call_impl = torch.compiler.disable(owner._call_impl, recursive=True)
    model._fxfuse_regions = (owner if compiled_root is not None else None, originals)
    return model


def undo_compile_regions(model: nn.Module) -> nn.Module:
    """Restore a model :func:`compile_regions` changed."""
    state = getattr(model, "_fxfuse_regions", None)
    if state is None:
        raise FxFuseError("undo_compile_regions: this model was not compiled by regions")
    owner, originals = state
    if owner is not None:
        owner.__dict__.pop("_call_impl", None)
    for m, forward in originals:
        m.__dict__.pop("forward", None)
        if forward is not None:
            m.forward = forward
    del model._fxfuse_regions
    return model
