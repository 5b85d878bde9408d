"""Replay a kernel launcher's Triton launches through their compiled binaries, skipping the Python around them.

A launcher such as :func:`fxfuse.attention.forward.attention_fwd_triton` spends most of its host time on work
that depends only on the shapes, strides, dtypes and scalars of the call: tile configs, strides, 64-bit address
checks, grids, and Triton's own per-launch binding and specialisation of 60-odd arguments. On the H200 machine
that was ~0.1 ms per forward and ~0.3 ms per backward of Python (benchmarks/attention_notes.md, session 5),
against a few microseconds of GPU work per kernel at a few thousand tokens.

So a launcher records its launches once (:class:`Recorder`: the ordinary ``kernel[grid](...)`` call, which
compiles where needed, and the binary it returned), and stores them as a :class:`Replay` under a key of
everything that decided them (the launcher builds the key; :class:`PlanCache`). A later call with the same key
allocates its outputs and hands over only its tensors ("roles": q, k, v, out, ...); each recorded argument that
*was* one of the recording call's role tensors is replaced by the new one, every other argument stays as
recorded, and the binary is launched directly (what Inductor's generated launchers do for its own kernels).
Triton specialises pointer arguments on 16-byte alignment, so the roles' alignment is part of the key.
Scratch tensors a launcher allocates between its launches (a mask tensor's block ranges, written by one launch and
read by the next) are recorded as their shape and dtype (:meth:`Recorder.scratch`); a replay allocates its own.

Replays are off under the interpreter, with a launch hook installed (profilers), or with
``FXFUSE_TRITON_FAST_LAUNCH=0``: then every launch goes through the JIT.
"""
from __future__ import annotations

import contextlib
import os

import torch

from .triton_support import HAVE_TRITON, interpreting

__all__ = ["Recorder", "Replay", "PlanCache", "fast_launch_enabled", "rebase_descriptor"]

try:
    from triton import knobs as _knobs
except Exception:  # pragma: no cover - triton without knobs (older) or none: no replays
    _knobs = None


def fast_launch_enabled() -> bool:
    return (_knobs is not None and os.environ.get("FXFUSE_TRITON_FAST_LAUNCH", "1") not in ("0", "")
            and not interpreting())


def _hooks_idle() -> bool:
    """No launch hook installed (a profiler such as proton adds them; then every launch takes the JIT path)."""
    hooks = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    return all(h is None or (hasattr(h, "calls") and not h.calls) for h in hooks)


def _raw_stream(device: int) -> int:
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's driver itself calls
    return getter(device) if getter is not None else torch.cuda.current_stream(device).cuda_stream


def _alignment(roles) -> int:
    """Bit i set where role i is a tensor whose data is 16-byte aligned (a tensor descriptor's base is one of
    the roles too, so its own alignment is already in the key)."""
    mask = 0
    bit = 1
    for t in roles:
        if t is not None and isinstance(t, torch.Tensor) and t.data_ptr() % 16 == 0:
            mask |= bit
        bit <<= 1
    return mask


def rebase_descriptor(desc, t):
    """``desc`` (a host TensorDescriptor) over tensor ``t`` of the same shape and strides, without the
    constructor's checks (the recording call ran them on a tensor laid out the same way)."""
    d = object.__new__(type(desc))
    d.__dict__.update(desc.__dict__)
    d.base = t
    return d


class Recorder:
    """Launches ``fn[grid](*args, **kwargs)`` and keeps what it needs to replay them."""

    def __init__(self):
        self.calls = []
        self.scratches = []  # tensors allocated for these launches alone (a replay allocates its own)

    def launch(self, fn, grid, args, kwargs):
        binary = fn[grid](*args, **kwargs)
        self.calls.append((fn, grid, args, kwargs, binary))
        return binary

    def scratch(self, shape, dtype, device):
        """``torch.empty(shape)`` for the launches to come; a replay allocates the same afresh (every tensor
        argument of a replayable launch is a role or a scratch)."""
        t = torch.empty(shape, dtype=dtype, device=device)
        self.scratches.append(t)
        return t

    @contextlib.contextmanager
    def attempt(self):
        """Launches that stand or fall together: if one raises (a config that does not fit, retried with
        another), the ones before it are forgotten too."""
        n, m = len(self.calls), len(self.scratches)
        try:
            yield
        except BaseException:
            del self.calls[n:]
            del self.scratches[m:]
            raise


class _ReplayedCall:
    __slots__ = ("binary", "grid", "template", "slots")  # slots: (argument position, role index)

    def __init__(self, binary, grid, template, slots):
        self.binary, self.grid, self.template, self.slots = binary, grid, template, slots


class Replay:
    """The recorded launches, launched again with new role tensors (:meth:`__call__`)."""

    def __init__(self, calls, aliases=(), scratches=()):
        self.calls = calls
        self.aliases = aliases
        self.scratches = scratches  # (shape, dtype) of each scratch tensor, role index len(roles) + j
        self.launches = 0  # tests read it

    @classmethod
    def of(cls, recorder, roles):
        """None where a launch cannot be replayed: an argument tensor that is neither a role nor a scratch, a
        callable grid, or a binary that is not a plain compiled kernel."""
        ids = {}
        aliases = []  # (i, j): role i was the very tensor of role j < i (a dummy, or k passed as v)
        for i, t in enumerate(roles):
            if t is not None:
                if id(t) in ids:
                    aliases.append((i, ids[id(t)]))
                else:
                    ids[id(t)] = i
        for j, t in enumerate(recorder.scratches):
            ids[id(t)] = len(roles) + j
        calls = []
        for fn, grid, args, kwargs, binary in recorder.calls:
            params = getattr(fn, "params", None)
            if (params is None or binary is None or hasattr(binary, "result")
                    or not hasattr(binary, "packed_metadata") or not isinstance(grid, tuple)):
                return None
            names = [p.name for p in params]
            try:
                template = list(args) + [kwargs[n] for n in names[len(args):]]
            except KeyError:  # a parameter left to its default: not modelled
                return None
            slots = []
            for pos, a in enumerate(template):
                if isinstance(a, torch.Tensor) or type(a).__name__ == "TensorDescriptor":
                    if id(a) not in ids:
                        return None
                    slots.append((pos, ids[id(a)]))
                    template[pos] = None  # the recording call's tensors are not kept alive
            g = tuple(grid) + (1,) * (3 - len(grid))
            calls.append(_ReplayedCall(binary, g, template, tuple(slots)))
        return cls(calls, tuple(aliases), tuple((tuple(t.shape), t.dtype) for t in recorder.scratches))

    def __call__(self, roles, device) -> bool:
        """Launch; False (nothing launched) where roles that were one tensor when recorded are not now: each
        argument slot then reads one role, so the caller must take its ordinary path."""
        for i, j in self.aliases:
            if roles[i] is not roles[j]:
                return False
        if self.scratches:  # freed on return: the caching allocator reuses them only after these launches
            dev = torch.device("cuda", device) if isinstance(device, int) else device
            roles = tuple(roles) + tuple(torch.empty(s, dtype=d, device=dev) for s, d in self.scratches)
        stream = _raw_stream(device)
        for c in self.calls:
            full = c.template[:]
            for pos, i in c.slots:
                full[pos] = roles[i]
            b = c.binary
            b.run(c.grid[0], c.grid[1], c.grid[2], stream, b.function, b.packed_metadata, None, None, None, *full)
        self.launches += 1
        return True


class PlanCache:
    """Replays by (launcher's key, the roles' alignment)."""

    def __init__(self, max_entries=256):
        self.replays = {}
        self.max_entries = max_entries

    def lookup(self, key, roles):
        if key is None or not fast_launch_enabled() or not _hooks_idle():
            return None
        return self.replays.get((key, _alignment(roles)))

    def store(self, key, roles, recorder):
        if key is None or not fast_launch_enabled():
            return
        replay = Replay.of(recorder, roles)
        if replay is not None:
            if len(self.replays) >= self.max_entries:  # many distinct shapes: start over rather than grow
                self.replays.clear()
            self.replays[(key, _alignment(roles))] = replay
