"""Lazy logits: a tensor that is ``f(hidden @ W.T + b)`` but computes it only if something reads it.

HF causal LMs return the logits next to the loss, so they are a graph output and would force the [tokens x vocab]
projection even after the loss was fused. The linear+CE pass instead lets the graph return the hidden states (the
fused op saves them anyway) and fxfuse hands the caller a :class:`LazyLogits` of the original shape, dtype and
device. Metadata (``shape``, ``dtype``, ``size()``, ...) is answered without computing; any other use
(indexing, ``.float()``, ``argmax``, ``backward`` through it, printing) materialises the logits once, through
ordinary differentiable torch ops, so gradients flow back into the compiled graph through the hidden states.

Turn it off with ``pass_options={"linear_cross_entropy": {"logits": "materialize"}}``.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

__all__ = ["LazyLogits", "apply_recipe", "is_lazy"]

# Reads that must not materialise: they only look at metadata.
_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.is_floating_point,
    torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.__len__, torch.Tensor.get_device,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.layout.__get__, torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__,
    torch.Tensor.is_sparse.__get__, torch.Tensor.is_quantized.__get__, torch.Tensor.is_meta.__get__,
}


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
        r._fx_value = None
        return r

    def __init__(self, *args, **kwargs):
        super().__init__()

    def materialize(self) -> torch.Tensor:
        """The real logits (computed on first use, then cached)."""
        if self._fx_value is None:
            h, w, b, recipe, wt = self._fx_args
            with torch._C.DisableTorchFunctionSubclass():
                self._fx_value = apply_recipe(h, w, b, recipe, wt)
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
        args, kwargs = tree_map_only(LazyLogits, lambda t: t.materialize(), (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only by code that skips __torch_function__ (C++ callers): compute the values, no autograd here.
        args, kwargs = tree_map_only(LazyLogits, lambda t: t.materialize().detach(), (args, kwargs or {}))
        return func(*args, **kwargs)


def is_lazy(t: Any) -> bool:
    return isinstance(t, LazyLogits)
