"""``fxfuse::to_host`` / ``fxfuse::to_device``: a tensor moved to pinned host memory and back, inside a compiled
graph, with gradients (issue 32, :mod:`passes.checkpoint_offload`).

Under gradient checkpointing the forward saves each layer's input for the backward's recompute: at 512k tokens and
Llama-3.1-8B widths, 32 ``[S, 4096]`` bf16 tensors, 128 GiB. The checkpoint-offload pass hands each checkpointed
region its input as ``to_host(x)`` and converts it back first thing inside the region with ``to_device``: the
region's saved input is then the host copy, and the recompute in the backward starts by copying it back.

* ``to_host(x)``: a copy of ``x`` in pinned host memory (from torch's caching host allocator, so the blocks of one
  step are reused by the next), written by a non-blocking copy on the current stream: nothing waits for it on the
  host. Only stream-ordered readers touch it (the later ``to_device`` of the same stream); the caching allocator
  keeps the block until the copy is done. On a CPU tensor: a plain copy.
* ``to_device(h, device)``: the copy back (non-blocking from pinned memory).

Each is the other's backward: the gradient of a region's input travels the same way back (two more copies of the
input's size per region in the backward; at long context they are ~1% of a layer's time).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["to_host", "to_device"]

_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define("to_host(Tensor x) -> Tensor")
_lib.define("to_device(Tensor h, Device device) -> Tensor")


def _to_host_impl(x: Tensor) -> Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
    out.copy_(x, non_blocking=x.is_cuda)
    return out


def _to_device_impl(h: Tensor, device: torch.device) -> Tensor:
    if torch.device(device) == h.device:
        return h.clone()
    return h.to(device, non_blocking=h.is_pinned())


for _key in ("CPU", "CUDA"):
    _lib.impl("to_host", _to_host_impl, _key)
    _lib.impl("to_device", _to_device_impl, _key)


@torch.library.register_fake("fxfuse::to_host", lib=_lib)
def _(x):
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.register_fake("fxfuse::to_device", lib=_lib)
def _(h, device):
    return torch.empty(h.shape, dtype=h.dtype, device=device)


def _setup_to_host(ctx, inputs, output):
    ctx.device = inputs[0].device


def _to_host_backward(ctx, grad):
    return torch.ops.fxfuse.to_device(grad, ctx.device)


def _setup_to_device(ctx, inputs, output):
    pass


def _to_device_backward(ctx, grad):
    return torch.ops.fxfuse.to_host(grad), None


torch.library.register_autograd("fxfuse::to_host", _to_host_backward, setup_context=_setup_to_host, lib=_lib)
torch.library.register_autograd("fxfuse::to_device", _to_device_backward, setup_context=_setup_to_device, lib=_lib)


def to_host(x: Tensor) -> Tensor:
    """``x`` copied to (pinned) host memory, differentiable (see the module docstring)."""
    return torch.ops.fxfuse.to_host(x)


def to_device(h: Tensor, device) -> Tensor:
    """``h`` copied to ``device``, differentiable (see the module docstring)."""
    return torch.ops.fxfuse.to_device(h, torch.device(device))
