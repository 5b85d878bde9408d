"""Contract checks shared by every ``fxfuse::`` op.

Each op states its contract once, as a function of its inputs, and calls it from its fake impl *and* its real
impls, so the same :class:`~fxfuse.errors.FxFuseContractError` fires in eager mode, under ``torch.compile``
(where the fake impl runs during tracing) and when a graph pass inserts the op (where validation catches it and
rolls the rewrite back).

Checks work on symbolic sizes: comparisons use ``guard_or_false``-style helpers so that a dynamic dimension
that *might* match is not turned into a recompile guard; only a provable mismatch raises.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from .errors import FxFuseContractError, user_source_line

__all__ = ["OpContract", "shape_str"]


def shape_str(t) -> str:
    if isinstance(t, torch.Tensor):
        return "[" + ", ".join(str(s) for s in t.shape) + "]"
    return str(t)


def _provably_ne(a, b) -> bool:
    """True only when a != b holds for every value of the symbols involved (no guard added)."""
    if isinstance(a, int) and isinstance(b, int):
        return a != b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return statically_known_true(a != b)
    except Exception:
        return False


class OpContract:
    """Collects the checks of one call of one op and raises one clear error.

    Usage (inside a fake impl or a real impl)::

        c = OpContract("fxfuse::linear_cross_entropy", hidden=hidden, weight=weight)
        c.ndim("hidden", 2)
        c.dim_eq("hidden", -1, "weight", 1, hint=...)
    """

    def __init__(self, op: str, **tensors):
        self.op = op
        self.tensors = tensors

    def fail(self, what: str, hint: Optional[str] = None):
        shapes = ", ".join(
            f"{k}: {shape_str(v)} {str(v.dtype).replace('torch.', '')} on {v.device}"
            for k, v in self.tensors.items()
            if isinstance(v, torch.Tensor)
        )
        msg = f"{self.op}: {what}\n  inputs: {shapes}"
        if hint:
            msg += f"\n  hint: {hint}"
        src = user_source_line()
        if src:
            msg += f"\n  called from: {src}"
        raise FxFuseContractError(msg)

    # -- checks ------------------------------------------------------------------------------------------------
    def ndim(self, name: str, allowed: int | Sequence[int]):
        t = self.tensors[name]
        allowed = (allowed,) if isinstance(allowed, int) else tuple(allowed)
        if t.dim() not in allowed:
            want = " or ".join(f"{a}-D" for a in allowed)
            self.fail(f"{name} must be {want}, got {t.dim()}-D {shape_str(t)}")

    def dim_eq(self, a: str, da: int, b: str, db: int, hint: Optional[str] = None):
        ta, tb = self.tensors[a], self.tensors[b]
        sa, sb = ta.shape[da], tb.shape[db]
        if _provably_ne(sa, sb):
            self.fail(f"{a}.shape[{da}] ({sa}) must equal {b}.shape[{db}] ({sb}): "
                      f"{a} {shape_str(ta)} vs {b} {shape_str(tb)}", hint)

    def numel_eq(self, a: str, b: str, hint: Optional[str] = None):
        ta, tb = self.tensors[a], self.tensors[b]
        if _provably_ne(ta.numel(), tb.numel()):
            self.fail(f"{a} {shape_str(ta)} and {b} {shape_str(tb)} must have the same number of elements", hint)

    def same_dtype(self, *names: str):
        ts = [(n, self.tensors[n]) for n in names if self.tensors.get(n) is not None]
        dts = {t.dtype for _, t in ts}
        if len(dts) > 1:
            self.fail("dtype mismatch: " + ", ".join(f"{n} is {t.dtype}" for n, t in ts))

    def dtype_in(self, name: str, dtypes: Iterable[torch.dtype]):
        t = self.tensors[name]
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            self.fail(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")

    def same_device(self, *names: str):
        ts = [(n, self.tensors[n]) for n in names if self.tensors.get(n) is not None]
        devs = {t.device for _, t in ts}
        if len(devs) > 1:
            self.fail("device mismatch: " + ", ".join(f"{n} on {t.device}" for n, t in ts))
