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
  tensor made in one graph and read in another, which SDPA reads over every tile: 3x the attention time measured
  on the H200 at Llama-3-8B widths and 4096 tokens); with padding or packed documents it builds the mask tensor
  and the blocks' ``sdpa_attention`` runs fxfuse's kernel on it, empty tiles skipped.
* **The root's own code** after that (the lm-head and the loss) is compiled with ``forward`` (not ``__call__``: the
  root's hooks stay eager too); the module running the blocks is a graph break in it, so its last graph holds the
  lm-head + loss, fused by the ``linear_cross_entropy`` pass (with lazy logits).

**An lm-head that is an FSDP2 unit of its own** (accelerate's ``fully_shard([final_norm, lm_head])``, or a lone
``fully_shard(lm_head)``) carries FSDP2's forward hooks, which Dynamo does not trace: they would split the loss graph at
the lm-head's call and hand the loss the materialised logits. The compiled root therefore runs with the lm-head's
FSDP2 hooks held aside (only when every forward hook on it is FSDP2's: any other hook could change what the loss
sees), so the loss graph traces a plain linear and fuses it; the hooks then run eagerly around it, where FSDP2 would
run them: the head's parameters are gathered (``FSDPModule.unshard``, a no-op when an earlier module of its unit
gathered them) once the module running the blocks has returned, and after the compiled code the hooks are called on
the head as if its forward had returned the loss (FSDP2 registers its pre-backward hook there and reshards the unit if
it reshards after forward).

The model is modified in place and returned. ``kwargs`` are :func:`fxfuse.compile`'s (options are checked now).
Calling it twice on the same model is an error; :func:`undo_compile_regions` restores the model.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, List, Optional, Tuple

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
    compiled_root, head = None, None
    if owner is not model:
        compiled_root = fx_compile(model.forward, **compile_kwargs)  # options are checked here, before any change
    compiled_blocks = [fx_compile(b.forward, **compile_kwargs) for b in blocks]
    for b, f in zip(blocks, compiled_blocks):
        b.forward = f  # an instance attribute: the block's __call__ (its hooks) stays eager
    if compiled_root is not None:
        head = _FsdpHead(_output_head(model))
        model.forward = head.around_root(compiled_root)
        # eager, with what it calls; the blocks' compiled forwards compile when called (their own frames)
        owner._call_impl = torch.compiler.disable(owner._call_impl, recursive=True)
        head.gather_after = owner.register_forward_hook(head.after_blocks)  # runs inside that eager call
    prewarm = None
    if compiled_root is not None and head.head is not None:
        ahead = _LossKernelsAhead(model, head.head)
        prewarm = ahead.handle = blocks[0].register_forward_pre_hook(ahead, with_kwargs=True)
    model._fxfuse_regions = (owner if compiled_root is not None else None, originals, head, prewarm)
    return model


class _LossKernelsAhead:
    """A one-shot forward pre-hook on the first block: start compiling the fused lm-head loss's Triton kernels (on
    the warm-up threads, ``kernels/background_compile.py``) for the loss a Hugging Face causal LM computes in
    training, while the blocks are traced and run. The loss graph is traced only after the last block, and its
    row kernel's JIT then held the first step for 0.7-1.5 s (its warm-up from the op's trace started too late:
    8B widths on two H200s). What is assumed: the hidden states' dtype (or autocast's), the head's vocabulary,
    ``ignore_index=-100``, no label smoothing, the config's ``final_logit_softcapping``, the gradient written in
    the forward. A wrong guess costs one compile on a thread; the trace's own warm-up still asks for the real
    launches. Whatever fails here is logged, never raised: it only ever starts a compile early."""

    def __init__(self, model: nn.Module, head: nn.Module):
        self._model, self._head = weakref.ref(model), weakref.ref(head)
        self.handle = None  # this hook's, removed after its first training call

    def __call__(self, block: nn.Module, args: Any, kwargs: Any) -> None:
        model, head = self._model(), self._head()
        if model is None or head is None or not (model.training and torch.is_grad_enabled()):
            return  # an evaluation call: wait for a training one
        self.handle.remove()
        from .kernels import background_compile

        background_compile.ask_ahead(self._ask, model, head, args, kwargs)  # never raises into the forward

    @staticmethod
    def _ask(model: nn.Module, head: nn.Module, args: Any, kwargs: Any) -> None:
        hidden = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        weight = getattr(head, "weight", None)
        if hidden is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return
        from .kernels import linear_cross_entropy as K

        device = hidden.device
        dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype)
        meta = lambda *shape: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
        softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None) or 0.0
        bias = getattr(head, "bias", None)
        K.lce_prewarm(meta(1, weight.shape[1]), meta(*weight.shape), torch.empty(1, dtype=torch.long, device="meta"),
                      None if bias is None else meta(weight.shape[0]), -100, "mean", float(softcap), 1.0, 0.0,
                      True, True, weight.requires_grad, bias is not None and bias.requires_grad, device=device)


def _output_head(model: nn.Module) -> Optional[nn.Module]:
    """HF's ``get_output_embeddings()`` (the lm-head module), or None."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None
    return head if isinstance(head, nn.Module) else None


#: the module attributes that hold forward hooks (``Module._call_impl`` reads them)
_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _is_fsdp2_hook(hook: Callable) -> bool:
    """FSDP2 registers its state's ``_pre_forward`` / ``_post_forward`` (wrapped with ``functools.wraps``, which keeps
    ``__module__``) on every module it shards."""
    return (getattr(hook, "__module__", None) or "").startswith("torch.distributed.fsdp")


class _FsdpHead:
    """Runs the root's compiled code with an FSDP2-sharded lm-head's hooks held aside (see the module docstring)."""

    def __init__(self, head: Optional[nn.Module]):
        # weakly: the model holds this (its forward), and nothing here may keep a sharded model (its process group)
        # alive past the model
        self._head = weakref.ref(head) if head is not None else None
        self.inside_root = False  # the compiled root is running with the head's hooks held
        self.gather_after = None  # the handle of the forward hook on the module that runs the blocks

    @property
    def head(self) -> Optional[nn.Module]:
        return self._head() if self._head is not None else None

    def hooked(self) -> bool:
        """Whether the head has forward hooks, all of them FSDP2's."""
        if self.head is None:
            return False
        hooks = list(self.head._forward_pre_hooks.values()) + list(self.head._forward_hooks.values())
        return bool(hooks) and all(_is_fsdp2_hook(h) for h in hooks)

    @contextlib.contextmanager
    def _hooks_held(self):
        # Held at every call, not only the compiling one: Dynamo does not guard on modules' hooks by default
        # (skip_nnmodule_hook_guards), so the compiled code assumes the hook-free head it traced. Emptied and refilled
        # in place: FSDP2's hook handles point at these dicts.
        held = {name: dict(getattr(self.head, name)) for name in _FORWARD_HOOK_DICTS}
        for name in _FORWARD_HOOK_DICTS:
            getattr(self.head, name).clear()
        try:
            yield
        finally:
            for name, saved in held.items():
                d = getattr(self.head, name)
                added = dict(d)  # registered while held: kept, after FSDP2's
                d.clear()
                d.update(saved)
                d.update(added)

    def _run_hooks(self, output: Any) -> None:
        """The head's hooks, run by ``Module.__call__`` itself around a forward that returns ``output``."""
        head, forward = self.head, self.head.__dict__.get("forward")
        head.forward = lambda *args, **kwargs: output
        try:
            head()
        finally:
            del head.forward
            if forward is not None:
                head.forward = forward

    def around_root(self, compiled_root: Callable) -> Callable:
        @functools.wraps(compiled_root)  # the forward's signature: HF's Trainer keeps only the columns it names
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.hooked():
                return compiled_root(*args, **kwargs)
            with self._hooks_held():
                self.inside_root = True
                try:
                    out = compiled_root(*args, **kwargs)
                finally:
                    self.inside_root = False
            self._run_hooks(_backward_entry(out))
            return out

        return forward

    def after_blocks(self, module: nn.Module, args: Any, output: Any) -> None:
        """A forward hook on the module that runs the blocks: FSDP2's pre-forward of the head would gather its
        unit about now."""
        if self.inside_root:
            self.head.unshard()


def _backward_entry(out: Any) -> Any:
    """What the head's FSDP2 post-forward hook is shown as the head's output: the loss when the root computed one (with
    the loss fused, the backward reaches the head's weight through it, never through logits), else the whole output
    (the logits)."""
    loss = getattr(out, "loss", None) if not isinstance(out, tuple) else None
    return loss if isinstance(loss, torch.Tensor) else out


def undo_compile_regions(model: nn.Module) -> nn.Module:
    """Restore a model :func:`compile_regions` changed."""
    state = getattr(model, "_fxfuse_regions", None)
    if state is None:
        raise FxFuseError("undo_compile_regions: this model was not compiled by regions")
    owner, originals, head, prewarm = state
    if prewarm is not None:
        prewarm.remove()
    if owner is not None:
        owner.__dict__.pop("_call_impl", None)
    if head is not None and head.gather_after is not None:
        head.gather_after.remove()
    for m, forward in originals:
        m.__dict__.pop("forward", None)
        if forward is not None:
            m.forward = forward
    del model._fxfuse_regions
    return model
