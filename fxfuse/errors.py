"""fxfuse's exception hierarchy and the helpers that point an error at the user's code.

Every error fxfuse raises on purpose is an :class:`FxFuseError`. The messages name the op or pass, the shapes
involved and, where it can be told, the user's source line, because the stack a user sees under
``torch.compile`` is mostly Dynamo's.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Optional

import torch

__all__ = [
    "FxFuseError",
    "FxFuseContractError",
    "FxFusePassError",
    "FxFuseValidationError",
    "FxFuseOptionsError",
    "PassRegistrationError",
    "user_source_line",
    "node_location",
    "raised_through_dynamo",
]


class FxFuseError(RuntimeError):
    """Base class of every error fxfuse raises on purpose."""


class FxFuseContractError(FxFuseError, ValueError):
    """A fused op was called with inputs outside its contract (shape, dtype, device)."""


class FxFusePassError(FxFuseError):
    """A graph pass raised while rewriting (raised only with ``strict=True``; otherwise rolled back)."""


class FxFuseValidationError(FxFuseError):
    """A pass changed what the graph computes (an output's shape, dtype, device or stride)."""


class FxFuseOptionsError(FxFuseError, ValueError):
    """An option fxfuse was given is unknown, misspelt or has a value it cannot mean (raised when the options are
    parsed: at ``fxfuse.compile`` / ``fxfuse.install``, or at the first compile for ``torch.compile``)."""


class PassRegistrationError(FxFuseError, ImportError):
    """The pass registry is incomplete or inconsistent (raised at import, never at first use)."""


_PASSTHROUGH = {}


def raised_through_dynamo(exc: FxFuseError) -> FxFuseError:
    """``exc`` re-typed so that Dynamo lets it reach the user as it is.

    Dynamo wraps what a backend raises in ``BackendCompilerFailed``, so ``except fxfuse.FxFuseError`` around a
    compiled model's first call would not catch fxfuse's ``strict=True`` errors. Exceptions that are also Dynamo's
    ``ShortenTraceback`` are re-raised unwrapped (with Dynamo's own frames dropped from the traceback); the returned
    exception is an instance of a subclass of both ``type(exc)`` and that class, with the same message.
    """
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:  # a torch without it: the error arrives wrapped, as ``BackendCompilerFailed.inner_exception``
        return exc
    cls = type(exc)
    if isinstance(exc, ShortenTraceback):
        return exc
    sub = _PASSTHROUGH.get(cls)
    if sub is None:
        def __init__(self, *args):
            ShortenTraceback.__init__(self, *args, first_useful_frame=None)

        sub = type(cls.__name__, (cls, ShortenTraceback), {"__init__": __init__, "__module__": cls.__module__,
                                                             "__qualname__": cls.__qualname__})
        _PASSTHROUGH[cls] = sub
    return sub(*exc.args)


_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _is_internal(filename: str) -> bool:
    f = os.path.abspath(filename)
    return (
        f.startswith(_PKG_DIR)
        or f.startswith(_TORCH_DIR)
        or "/passes/" in f and "fxfuse" in f
        or f.startswith("<")
    )


def user_source_line() -> Optional[str]:
    """The innermost frame of user code that led here, as ``file:line in fn: code``.

    Under Dynamo the Python stack is the tracer's, so the traced user stack from the tracing context is used
    instead when there is one.
    """
    frames = None
    try:
        from torch._guards import TracingContext

        if TracingContext.try_get() is not None:
            frames = list(TracingContext.extract_stack())
    except Exception:
        frames = None
    if not frames:
        frames = traceback.extract_stack()[:-1]
    for fr in reversed(frames):
        if not _is_internal(fr.filename):
            code = (fr.line or "").strip()
            return f"{fr.filename}:{fr.lineno} in {fr.name}: {code}"
    return None


def node_location(node: Any) -> str:
    """Where an FX node came from in the user's code: last stack-trace frame and the module path."""
    meta = getattr(node, "meta", {}) or {}
    parts = []
    st = meta.get("stack_trace")
    if st:
        lines = [ln.rstrip() for ln in st.strip().splitlines() if ln.strip()]
        # The last 'File ...' line and the code line after it are the innermost user frame.
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].lstrip().startswith("File "):
                frame = lines[i].strip()
                code = lines[i + 1].strip() if i + 1 < len(lines) else ""
                parts.append(f"{frame}: {code}" if code else frame)
                break
    stack = meta.get("nn_module_stack")
    if stack:
        path, cls = list(stack.values())[-1]
        cls_name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].rstrip("'>")
        parts.append(f"module {path} ({cls_name})")
    return "; ".join(parts) if parts else "<no source information>"
