"""fxfuse's exception hierarchy and the helpers that point an error at the user's code.

Every error fxfuse raises on purpose is an :class:`FxFuseError`. The messages name the op or pass, the shapes
involved and, where it can be told, the user's source line, because the stack a user sees under
``torch.compile`` is mostly Dynamo's.
"""
from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = [
    "FxFuseError",
    "FxFuseContractError",
    "FxFusePassError",
    "FxFuseValidationError",
    "FxFuseOptionsError",
    "PassRegistrationError",
    "user_source_line",
    "is_internal_frame",
    "node_location",
    "module_path",
    "user_module_path",
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


def is_internal_frame(filename: str) -> bool:
    """A frame of torch, fxfuse or fxfuse's passes (or synthetic code): never "the user's line"."""
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
        if not is_internal_frame(fr.filename):
            code = (fr.line or "").strip()
            return f"{fr.filename}:{fr.lineno} in {fr.name}: {code}"
    return None


_ROOT = re.compile(r"""^(?:L|G)\[(['"])(\w+)\1\]""")
_MODULES_DICT = re.compile(r"""\.__dict__\[(['"])_modules\1\]|\._modules(?=\[)""")
_ITEM = re.compile(r"""\[(['"])([^'"]+)\1\]|\[(\d+)\]""")
_GETATTR = re.compile(r"""getattr\(([^,()]+),\s*(['"])(\w+)\2\)""")


def module_path(dynamo_path: str) -> str:
    """A module path as Dynamo records it in ``nn_module_stack``, written the way the user writes it.

    ``L['self'].__dict__['_modules']['model'].layers[0]`` -> ``model.layers.0``: the compiled module itself
    (``L['self']``) is dropped, a module argument keeps its name (``L['model']`` -> ``model``), Dynamo's
    ``__dict__['_modules']`` lookups and ``['x']`` / ``[0]`` indexing become attribute steps.
    """
    p = dynamo_path.strip()
    while True:  # getattr(getattr(L['self'], 'a'), 'b') -> L['self'].a.b (innermost first)
        q = _GETATTR.sub(lambda m: f"{m.group(1)}.{m.group(3)}", p)
        if q == p:
            break
        p = q
    m = _ROOT.match(p)
    if m:
        p = ("" if m.group(2) == "self" else m.group(2)) + p[m.end():]
    p = _MODULES_DICT.sub("", p)
    p = _ITEM.sub(lambda m: "." + (m.group(2) if m.group(2) is not None else m.group(3)), p)
    return p.strip(".")


def _is_peft_class(cls: Any) -> bool:
    return str(getattr(cls, "__module__", "") or cls).startswith("peft.")


def _class_name(cls: Any) -> str:
    name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].rstrip("'>")
    mod = str(getattr(cls, "__module__", "") or "")
    if mod.startswith("peft.tuners."):  # peft.tuners.lora.layer.Linear -> lora.Linear (not nn.Linear)
        return f"{mod.split('.')[2]}.{name}"
    return name


def user_module_path(nn_module_stack: Dict[str, Any]) -> Tuple[str, Any]:
    """The innermost module of a node's ``nn_module_stack`` as ``(path the user writes, class)``.

    Besides :func:`module_path`, PEFT's wrappers are taken off where the stack shows they are PEFT's: the
    ``base_model.model.`` prefix of a ``PeftModel`` (when peft is loaded; its outer modules are not always in the
    stack) and the ``.base_layer`` a LoRA layer wraps the original linear in. A LoRA'd ``q_proj`` then reads
    ``model.layers.0.self_attn.q_proj``, as in the model the user loaded.
    """
    entries = [(module_path(str(v[0])), v[1]) for v in nn_module_stack.values()
               if isinstance(v, (tuple, list)) and len(v) == 2]
    if not entries:
        return "", None
    path, cls = entries[-1]
    if path.endswith(".base_layer") and len(entries) > 1 and _is_peft_class(entries[-2][1]) \
            and entries[-2][0] == path[:-len(".base_layer")]:
        path, cls = entries[-2]
    peft_in_use = "peft" in sys.modules or any(_is_peft_class(c) for _, c in entries)
    if peft_in_use and (path + ".").startswith("base_model.model."):
        path = path[len("base_model.model."):]
    return path, cls


def node_location(node: Any) -> str:
    """Where an FX node came from in the user's code: last stack-trace frame and the module path (as the user
    writes it, see :func:`user_module_path`)."""
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
        try:
            path, cls = user_module_path(stack)
        except Exception:  # a location is a diagnostic: never let it break a report
            path, cls = str(list(stack.values())[-1][0]), list(stack.values())[-1][1]
        parts.append(f"module {path or '<the compiled module>'} ({_class_name(cls)})")
    return "; ".join(parts) if parts else "<no source information>"
