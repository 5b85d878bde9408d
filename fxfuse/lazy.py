"""Lazy logits: a tensor that is ``f(hidden @ W.T + b)`` but computes it only if something reads it.

HF causal LMs return the logits next to the loss, so they are a graph output and would force the [tokens x vocab]
projection even after the loss was fused. The linear+CE pass instead lets the graph return the hidden states (the
fused op saves them anyway) and fxfuse hands the caller a :class:`LazyLogits` of the original shape, dtype and
device. Metadata (``shape``, ``dtype``, ``size()``, ...) is answered without computing; any other use
(indexing, ``.float()``, ``argmax``, ``backward`` through it, printing) materialises the logits once, through
ordinary differentiable torch ops, so gradients flow back into the compiled graph through the hidden states.
Read after the weights changed in place (an optimizer step), they raise instead of returning logits of the new
weights: the version counters of the hidden states, weight and bias are recorded at the forward.

What wrappers do to every output each step stays lazy too: a clone (DDP's output sink) or a floating cast on the same
device (FSDP2's ``output_dtype``, accelerate's ``convert_outputs_to_fp32``) gives lazy logits that, if read, read
these and clone or cast them, so gradients and the hooks registered on these go through them.
``materialized_at`` counts where lazy logits were computed after all, by the reader's ``file:line``.

Turn it off with ``pass_options={"linear_cross_entropy": {"logits": "materialize"}}``.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

__all__ = ["LazyLogits", "apply_recipe", "materialized_at"]

log = logging.getLogger(__name__)

# Where lazy logits were computed after all: "file:line in function" of the first caller outside this module and torch's
# Tensor machinery -> count. Each one is an extra [tokens x vocab] projection the fused loss had avoided; the report
# tools and benchmarks read it, and the log (INFO, logger ``fxfuse.lazy``) names each new site once.
materialized_at: "collections.Counter[str]" = collections.Counter()
_HERE = os.path.abspath(__file__)

# Reads that must not materialise: they only look at metadata.
_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.is_floating_point,
    torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.__len__, torch.Tensor.get_device,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.layout.__get__, torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__,
    torch.Tensor.is_sparse.__get__, torch.Tensor.is_quantized.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor._base.__get__, torch.Tensor.is_nested.__get__,  # FSDP2's output checks (a lazy tensor is no view)
    torch.is_floating_point, torch.is_complex, torch.Tensor.is_complex, torch.numel,  # FSDP2's output cast asks
}

# Casting methods kept lazy like ``.to(dtype)``.
_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64, torch.Tensor.half: torch.float16,
          torch.Tensor.bfloat16: torch.bfloat16}


def apply_recipe(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 recipe: Sequence[Tuple[str, Any]], weight_transposed: bool = False) -> torch.Tensor:
    """``f(hidden @ W.T + b)`` with ``f`` the recorded elementwise ops (mul/div by constants, tanh, casts)."""
    x = torch.matmul(hidden, weight) if weight_transposed else F.linear(hidden, weight, bias)
    for op, c in recipe:
        if op == "mul":
            x = x * c
        elif op == "div":
            x = x / c
        elif op == "tanh":
            x = torch.tanh(x)
        elif op == "cast":
            x = x.to(c)
        else:  # pragma: no cover - recipes are built by the pass from a closed set
            raise ValueError(f"unknown recipe op {op!r}")
    return x


class LazyLogits(torch.Tensor):
    """Stands in for logits the caller may never read. See the module docstring."""

    @staticmethod
    def __new__(cls, hidden, weight, bias, recipe, weight_transposed, dtype):
        vocab = weight.shape[1] if weight_transposed else weight.shape[0]
        shape = tuple(hidden.shape[:-1]) + (vocab,)
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=hidden.device,
            requires_grad=bool(torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)))
        r._fx_args = (hidden, weight, bias, tuple(recipe), weight_transposed)
        r._fx_versions = _versions(hidden, weight, bias)
        r._fx_value = None
        r._fx_hooks = []  # backward hooks registered before the logits exist: put on them when they do
        r._fx_source, r._fx_cast = None, None  # a lazy clone / cast: the lazy logits it is of, and the dtype
        return r

    def __init__(self, *args, **kwargs):
        super().__init__()

    def materialize(self) -> torch.Tensor:
        """The real logits (computed on first use, then cached).

        Raises :class:`~fxfuse.errors.FxFuseError` when a tensor they are computed from was modified in place since
        the forward (``optimizer.step()`` updates the lm-head weight): the values would no longer be the ones the
        forward produced."""
        if self._fx_value is None and self._fx_source is not None:
            # A lazy clone or cast reads its source, so the gradient flows through the source's logits and the hooks
            # registered there (FSDP2's root registers its pre-backward hook before it casts) run.
            src = self._fx_source
            value = src.materialize()
            if value._version != src._fx_value_version:
                # The source's logits were changed in place after this copy was made (a copy is only made while
                # its source is unread): a real clone or cast would not see that, so this one is computed anew.
                fresh = LazyLogits(*src._fx_args, src.dtype)
                fresh._fx_versions = src._fx_versions  # still checked against the forward's weights
                value = fresh.materialize()
            with torch._C.DisableTorchFunctionSubclass():
                self._fx_value = value.clone() if self._fx_cast is None else value.to(self._fx_cast)
            self._fx_value_version = self._fx_value._version
            for handle in self._fx_hooks:
                handle.attach(self._fx_value)
        if self._fx_value is None:
            h, w, b, recipe, wt = self._fx_args
            freed = [n for n, t in zip(("hidden states", "lm-head weight", "lm-head bias"), (h, w, b))
                     if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().nbytes() == 0]
            if freed:  # FSDP2 frees a unit's gathered parameters when it reshards (after its forward or backward)
                from .errors import FxFuseError

                raise FxFuseError(
                    "fxfuse: these logits were returned lazily by a model compiled with fxfuse (the fused lm-head "
                    f"loss never computed them) and are computed when first read, but the memory of the "
                    f"{' and '.join(freed)} was freed since that forward (FSDP2 frees an lm-head's gathered weight "
                    "when it reshards it: after the backward, or right after the forward for a unit that reshards "
                    "after forward), so they can no longer be computed. Read them before that (e.g. `logits = "
                    "out.logits.float()` right after the forward), or compile with options={'pass_options': "
                    "{'linear_cross_entropy': {'logits': 'materialize'}}} to always return real logits.")
            if _versions(h, w, b) != self._fx_versions:
                from .errors import FxFuseError

                what = [n for n, a, c in zip(("hidden states", "lm-head weight", "lm-head bias"), self._fx_versions,
                                            _versions(h, w, b)) if a != c]
                raise FxFuseError(
                    "fxfuse: these logits were returned lazily by a model compiled with fxfuse (the fused lm-head "
                    f"loss never computed them) and are computed when first read, but the {' and '.join(what)} "
                    "changed in place since that forward (optimizer.step() or zero_grad on the weights?), so they can "
                    "no longer be the forward's logits. Read them before the optimizer step (e.g. "
                    "`logits = out.logits.float()` right after the forward), or compile with "
                    "options={'pass_options': {'linear_cross_entropy': {'logits': 'materialize'}}} to always "
                    "return real logits.")
            site = _caller_site()
            if site not in materialized_at:
                log.info("fxfuse: lazy logits %s computed (one [tokens x vocab] projection the fused loss had "
                         "avoided), first read at %s", tuple(self.shape), site)
            materialized_at[site] += 1
            with torch._C.DisableTorchFunctionSubclass():
                self._fx_value = apply_recipe(h, w, b, recipe, wt)
            self._fx_value_version = self._fx_value._version  # lazy copies of these check it (in-place changes)
            for handle in self._fx_hooks:
                handle.attach(self._fx_value)
        return self._fx_value

    @property
    def materialized(self) -> bool:
        return self._fx_value is not None

    def __repr__(self, *, tensor_contents=None):
        return f"LazyLogits({self.materialize()!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.register_hook and isinstance(args[0], LazyLogits) and not args[0].materialized:
            # FSDP2's root registers a pre-backward hook on every output that requires grad: that alone must not
            # compute [tokens, vocab] logits nobody reads (it did, one eager lm-head matmul per step). A gradient
            # can only reach these logits once they exist, so the hook goes on them then.
            handle = _DeferredHook(args[1] if len(args) > 1 else kwargs["hook"])
            args[0]._fx_hooks.append(handle)
            return handle
        if type(args[0]) is LazyLogits and not args[0].materialized:
            # What wrappers do to every output each step must not compute logits nobody reads: DDP's output sink
            # clones them (HF Trainer's default find_unused_parameters, a static graph's first step), FSDP2 casts
            # them to its output_dtype (accelerate sets it), accelerate's convert_outputs_to_fp32 calls .float(). A
            # clone or a floating cast of lazy logits is more lazy logits, which if read reads these and copies them.
            if func is torch.Tensor.clone and len(args) == 1 and kwargs.get(
                    "memory_format", torch.preserve_format) in (torch.preserve_format, torch.contiguous_format):
                return args[0]._lazy_copy()
            if func is torch.Tensor.to:
                cast = args[0]._lazy_cast(args[1:], kwargs)
                if cast is not None:
                    return cast
            if func in _CASTS and len(args) == 1 and kwargs.get("memory_format", torch.preserve_format) is \
                    torch.preserve_format:  # accelerate's convert_outputs_to_fp32 calls .float() on bf16 outputs
                dtype = _CASTS[func]
                return args[0] if dtype == args[0].dtype else args[0]._lazy_copy(cast=dtype)
        args, kwargs = tree_map_only(LazyLogits, lambda t: t.materialize(), (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _lazy_copy(self, cast: Optional[torch.dtype] = None) -> "LazyLogits":
        """A clone (``cast`` None) or a cast of these logits, computed from them when (if) it is read."""
        copy = LazyLogits(*self._fx_args, cast or self.dtype)
        copy._fx_source, copy._fx_cast = self, cast
        return copy

    def _lazy_cast(self, args, kwargs) -> Optional["LazyLogits"]:
        """``self.to(...)`` kept lazy when it only changes the floating dtype (or copies); None otherwise."""
        if args and isinstance(args[0], torch.Tensor):
            return None  # .to(other): device and dtype of another tensor, rare on outputs
        copy = kwargs.get("copy", False)
        try:
            device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(
                *args, **{k: v for k, v in kwargs.items() if k != "copy"})
        except (TypeError, RuntimeError):
            return None
        if device is not None and torch.device(device) != self.device:
            return None
        if memory_format not in (None, torch.preserve_format) or (dtype is not None and not dtype.is_floating_point):
            return None
        if dtype is None or dtype == self.dtype:
            return self._lazy_copy() if copy else self
        return self._lazy_copy(cast=dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only by code that skips __torch_function__ (C++ callers): compute the values, no autograd here.
        args, kwargs = tree_map_only(LazyLogits, lambda t: t.materialize().detach(), (args, kwargs or {}))
        return func(*args, **kwargs)


class _DeferredHook:
    """The handle :meth:`LazyLogits.register_hook` returns before the logits exist: ``remove()`` works either way."""

    def __init__(self, hook):
        self.hook, self.handle, self.removed = hook, None, False

    def attach(self, tensor: torch.Tensor) -> None:
        if not self.removed and tensor.requires_grad:
            self.handle = tensor.register_hook(self.hook)

    def remove(self) -> None:
        self.removed = True
        if self.handle is not None:
            self.handle.remove()


def _caller_site() -> str:
    """``file:line in function`` of the innermost frame outside this module and torch's tensor/pytree plumbing."""
    skip = (_HERE, os.path.join("torch", "utils", "_pytree"), os.path.join("torch", "_tensor"),
            os.path.join("torch", "overrides"))
    f = sys._getframe(1)
    while f is not None and any(s in f.f_code.co_filename for s in skip):
        f = f.f_back
    if f is None:
        return "?"
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


def _versions(*ts) -> Tuple[int, ...]:
    """In-place modification counters of the tensors the logits are computed from (-1 for None)."""
    return tuple(t._version if isinstance(t, torch.Tensor) else -1 for t in ts)
