"""Launch a ``@triton.jit`` kernel through its compiled binary, skipping the JIT's per-call work.

``kernel[grid](*args, **kwargs)`` binds every argument, asks Triton's specialiser about each one, builds a cache
key from the list, looks the binary up and assembles launch metadata for the profiler hooks, on every call. For
fxfuse's attention kernels (60-odd arguments each, four launches per forward + backward) that is host time the
GPU never sees: at a few thousand tokens the op was bound by it (benchmarks/attention_notes.md, session 5).

:class:`CachedLauncher` keeps the binary Triton compiled, keyed by everything that decides Triton's
specialisation of the arguments, computed here in one pass: each tensor's dtype and 16-byte alignment, each
specialised int's ``== 1`` and ``% 16 == 0``, each int's width (32 or 64 bits), each constexpr's value, a tensor
descriptor's dtype, shape, strides and block, and the launch options. Our key is never coarser than Triton's
(two calls with one key get one specialisation), so a hit can launch the stored binary directly; a miss, any
argument of a kind not listed, a profiler hook, or the interpreter take the ordinary ``kernel[grid]`` path.
This is what Inductor's generated launchers do for its own kernels (they call the compiled binary's ``run``).

``FXFUSE_TRITON_FAST_LAUNCH=0`` turns it off (every launch through the JIT).
"""
from __future__ import annotations

import os

import torch

from .triton_support import HAVE_TRITON, interpreting

__all__ = ["CachedLauncher", "fast_launch_enabled"]

_I32 = (-(2**31), 2**31 - 1)


def fast_launch_enabled() -> bool:
    return HAVE_TRITON and os.environ.get("FXFUSE_TRITON_FAST_LAUNCH", "1") not in ("0", "") and not interpreting()


def _hooks_idle() -> bool:
    """No launch hook installed (a profiler such as proton adds them; then every launch takes the JIT path)."""
    try:
        from triton import knobs
        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except Exception:  # pragma: no cover - triton without knobs
        return False
    return all(h is None or (hasattr(h, "calls") and not h.calls) for h in hooks)


def _raw_stream(device: int) -> int:
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's driver itself calls
    return getter(device) if getter is not None else torch.cuda.current_stream(device).cuda_stream


class _Unkeyable(Exception):
    """An argument whose specialisation this module does not model: launch through the JIT."""


def _int_key(a: int, specialise: bool):
    wide = not (_I32[0] <= a <= _I32[1])
    if specialise:
        return (wide, a == 1, a % 16 == 0)
    return (wide,)


def _desc_key(d):
    base = d.base
    return ("desc", base.dtype, base.data_ptr() % 16 == 0, tuple(d.block_shape), d.padding,
            tuple(int(s) % 16 == 0 for s in d.strides), tuple(int(s) % 16 == 0 for s in d.shape),
            tuple(int(s) == 1 for s in d.shape), any(not (_I32[0] <= int(s) <= _I32[1]) for s in d.shape))


class CachedLauncher:
    """``CachedLauncher(kernel)[grid](*args, **kwargs)``: the same call as ``kernel[grid](...)``, through the stored
    binary where one fits these arguments. ``grid`` must be a tuple (not a callable)."""

    def __init__(self, fn):
        self.fn = fn
        params = getattr(fn, "params", None)  # None under the interpreter (an InterpretedFunction): JIT path only
        self.names = [p.name for p in params] if params is not None else None
        # per parameter: 0 constexpr, 1 specialised, 2 not specialised (do_not_specialize)
        self.kinds = [0 if p.is_constexpr else (2 if p.do_not_specialize else 1) for p in params or ()]
        self.binaries = {}
        self.fast_hits = 0  # launches that skipped the JIT (tests read it)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def _key(self, full, options):
        key = [options]
        for a, kind in zip(full, self.kinds):
            if kind == 0:
                key.append(a)
            elif a is None or isinstance(a, bool):
                key.append(a if a is None else bool)
            elif isinstance(a, torch.Tensor):
                key.append((a.dtype, a.data_ptr() % 16 == 0))
            elif isinstance(a, int):
                key.append(_int_key(a, kind == 1))
            elif isinstance(a, float):
                key.append(float)
            elif type(a).__name__ == "TensorDescriptor":
                key.append(_desc_key(a))
            else:
                raise _Unkeyable(type(a).__name__)
        return tuple(key)

    def run(self, grid, args, kwargs):
        if self.names is None or not fast_launch_enabled() or not isinstance(grid, tuple) or not _hooks_idle():
            return self.fn[grid](*args, **kwargs)
        try:
            full = list(args) + [kwargs[n] for n in self.names[len(args):]]
            options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.names))
            device = torch.cuda.current_device()
            key = (device, self._key(full, options))
        except (KeyError, _Unkeyable, TypeError):
            return self.fn[grid](*args, **kwargs)
        binary = self.binaries.get(key)
        if binary is None:
            binary = self.fn[grid](*args, **kwargs)
            if binary is not None and not hasattr(binary, "result") and hasattr(binary, "packed_metadata"):
                self.binaries[key] = binary
            return binary
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = _raw_stream(device)
        binary.run(g0, g1, g2, stream, binary.function, binary.packed_metadata, None, None, None, *full)
        self.fast_hits += 1
        return binary
