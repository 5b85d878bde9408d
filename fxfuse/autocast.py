"""Autocast rules for fxfuse's ops: what eager autocast does to the ops a fused op replaces.

Under ``torch.autocast`` (AMP: an fp32 model trained in bf16 / fp16) ``linear`` and ``matmul`` run on operands
cast to the autocast dtype. A custom op gets no such casts by default (autocast falls through), so a fused op
handed fp32 hidden states and weights would compute in fp32: slower than eager AMP on a GPU, and typed
differently from the graph it replaced. :func:`register_autocast_casts` gives an op the autocast rule of the
matmuls it replaces: the named floating-point arguments (tensors or lists of tensors) on the autocast device are
cast to the current autocast dtype (fp64 is left alone, as autocast leaves it), everything else (masks, targets,
scalars) is passed through, then the op runs with autocast off. Unlike ``torch.library.register_autocast`` the
dtype is the one autocast is running with (bf16 or fp16), not fixed at registration.
"""
from __future__ import annotations

from typing import Sequence

import torch

_LIB = torch.library.Library("fxfuse", "FRAGMENT")
_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def _cast(a, device: str, dtype: torch.dtype):
    if isinstance(a, torch.Tensor):
        if a.device.type == device and a.dtype in _ELIGIBLE and a.dtype != dtype:
            return a.to(dtype)
        return a
    if isinstance(a, (list, tuple)):
        return type(a)(_cast(x, device, dtype) for x in a)
    return a


def register_autocast_casts(op_name: str, cast_args: Sequence[str]) -> None:
    """Register, for CPU and CUDA autocast, a kernel of ``fxfuse::<op_name>`` (its default overload) that casts
    the arguments named in ``cast_args`` to the autocast dtype and calls the op with autocast off."""
    op = getattr(torch.ops.fxfuse, op_name).default
    names = [a.name for a in op._schema.arguments]
    which = frozenset(names.index(n) for n in cast_args)
    which_kw = frozenset(cast_args)
    for device in ("cpu", "cuda"):
        if not torch._C._is_autocast_available(device):
            continue
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device)
        key = getattr(torch._C.DispatchKey, key_name)

        def kernel(*args, _device=device, _key=key, **kwargs):
            dtype = torch.get_autocast_dtype(_device)
            args = [_cast(a, _device, dtype) if i in which else a for i, a in enumerate(args)]
            kwargs = {k: (_cast(a, _device, dtype) if k in which_kw else a) for k, a in kwargs.items()}
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return op(*args, **kwargs)

        _LIB.impl(op_name, kernel, key_name)
