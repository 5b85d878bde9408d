"""Triton specialisations compiled on a background thread ahead of their first launch.

A Triton kernel JIT-compiles each new specialisation (dtypes, constexprs, the divisibility of its integer arguments)
at its first launch, on the launching thread, while the GPU waits: ~0.6-0.8 s each for the low-rank GEMM on the H100
/ H200 hosts, then builds its launcher stub with gcc (on a cold cache) and loads the module. Where a launcher can
tell earlier which specialisation a later launch will need (LoRA's forward knows the shapes of its backward's grad
x), it hands the launch to :func:`start`: ``JITFunction.warmup`` runs it on a small thread pool (LLVM and ptxas
release the GIL, so the compile overlaps the caller's work), and the launch itself calls :func:`wait_for` first,
which waits for a compile of its key still in flight instead of compiling the same kernel a second time beside it.

``FXFUSE_TRITON_PREWARM=0`` turns it off (benchmarks measure both). A warm-up that fails is only logged: the launch
compiles again and reports a real failure there. A forked child (a DataLoader worker) forgets the parent's
warm-ups, whose threads it does not have.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Optional

import torch

__all__ = ["ENABLED", "can_start", "start", "ask_ahead", "in_flight", "wait_for"]
log = logging.getLogger(__name__)

ENABLED = os.environ.get("FXFUSE_TRITON_PREWARM", "1") != "0"
_pending: Dict[tuple, Future] = {}  # (kernel, key) -> the compile still in flight
_started: set = set()  # (kernel, key) ever started in this process
_pool: Optional[ThreadPoolExecutor] = None
_lock = threading.Lock()


def _forget_after_fork() -> None:
    global _pool, _lock
    _pool, _lock = None, threading.Lock()
    _pending.clear()
    _started.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_after_fork)


def _compile(kernel, device: torch.device, grid, args, consts) -> None:
    try:
        with torch.cuda.device(device):  # Triton keys its kernel cache by the thread's current device
            compiled = kernel.warmup(*args, grid=grid, **consts)
            # What the first launch would do next, here too: build the launcher stub (a C file compiled with gcc
            # on a cold cache, ~0.2-0.4 s a signature on the H200 hosts) and load the module on the GPU
            init = getattr(compiled, "_init_handles", None)
            if callable(init):
                init()
    except Exception as e:
        log.debug("background compile of %s failed: %r", getattr(kernel, "__name__", kernel), e)


def can_start(device: torch.device) -> bool:
    """Whether a warm-up for a launch on ``device`` would start anything: on, and a CUDA device this process has
    (fake CUDA tensors can be traced on a machine without one)."""
    return ENABLED and device.type == "cuda" and torch.cuda.is_available()


def ask_ahead(prewarm, *args: Any, **kwargs: Any) -> None:
    """Call a launcher's warm-up (``prewarm(*args, **kwargs)``) from a fake impl or a hook: whatever fails is
    logged, never raised, since a warm-up only ever starts a compile early and must not break the trace."""
    try:
        prewarm(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        log.debug("no warm-up from %s: %r", getattr(prewarm, "__qualname__", prewarm), e)


def start(kernel, key: Any, device: torch.device, grid, args, consts: dict) -> Optional[Future]:
    """Compile ``kernel``'s specialisation for the launch ``kernel[grid](*args, **consts)`` on a background thread,
    once per ``(kernel, key)`` in this process; ``key`` names the specialisation as the launcher computes it for
    :func:`wait_for`. The arguments may be stand-ins of the real launch's (only what Triton specialises on must
    match). Returns the compile's future, or None where nothing was started (off, not CUDA, already started)."""
    if not can_start(device):
        return None
    global _pool
    k = (kernel, key)
    with _lock:
        if k in _started:
            return None
        _started.add(k)
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fxfuse-triton-warmup")
        fut = _pool.submit(_compile, kernel, device, grid, args, consts)
        _pending[k] = fut
    fut.add_done_callback(lambda f, k=k: _pending.pop(k, None))
    return fut


def in_flight() -> bool:
    """Whether any background compile is still running: launchers skip computing their key when none is."""
    return bool(_pending)


def wait_for(kernel, key: Any) -> None:
    """Before launching ``kernel`` with the specialisation ``key``: wait for a background compile of it still in
    flight. A dictionary check when none is (every launch after the first few)."""
    if _pending:
        fut = _pending.get((kernel, key))
        if fut is not None:
            fut.result()
