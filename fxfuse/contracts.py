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
from .graph_utils import known_true

__all__ = ["OpContract", "shape_str"]


def shape_str(t) -> str:
    if isinstance(t, torch.Tensor):
        return "[" + ", ".join(str(s) for s in t.shape) + "]"
    return str(t)


def _provably_ne(a, b) -> bool:
    """True only when a != b holds for every value of the symbols involved (no guard added)."""
    return known_true(a != b)


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
        err = FxFuseContractError(msg)
        err.op = self.op  # a compiled graph's wrapper re-raises it at the fused site (fxfuse.site_errors)
        raise err

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

    def lm_head_operands(self, hidden: str, weight: str, target: str, bias: Optional[str] = None,
                         floats: Iterable[torch.dtype] = (torch.bfloat16, torch.float16, torch.float32)):
        """The contract every fused lm-head op shares: hidden [..., D], weight [V, D], one integer ``target`` per
        hidden row, optional bias [V]; and the classic mistake, logits passed where hidden states belong."""
        h, w, t = self.tensors[hidden], self.tensors[weight], self.tensors[target]
        self.ndim(weight, 2)
        if h.dim() < 1:
            self.fail(f"{hidden} must have a last (hidden-size) dimension, got a {h.dim()}-D tensor")
        D, (V, Dw) = h.shape[-1], w.shape
        if known_true(D == V) and known_true(V != Dw):
            self.fail(
                f"{hidden} {shape_str(h)} looks like logits, not hidden states: its last dimension ({D}) equals "
                f"the vocabulary size {weight}.shape[0] ({V}) of {weight} {shape_str(w)}, not the hidden size "
                f"{weight}.shape[1] ({Dw})",
                hint="pass the hidden states that go into the lm_head projection (the op computes the logits itself)",
            )
        self.dim_eq(hidden, -1, weight, 1,
                    hint=f"{weight} must be [vocab, hidden] (the nn.Linear / lm_head layout), {hidden} [..., hidden]")
        self.dtype_in(hidden, floats)
        self.same_dtype(hidden, weight, *([bias] if bias else []))
        self.dtype_in(target, (torch.int64, torch.int32))
        self.same_device(hidden, weight, target, *([bias] if bias else []))
        n_tokens = 1
        for s in h.shape[:-1]:  # a plain product: torch.Size.numel() on SymInts would specialize N
            n_tokens = n_tokens * s
        if known_true(t.numel() != n_tokens):
            self.fail(f"{target} {shape_str(t)} has {t.numel()} elements but {hidden} {shape_str(h)} has "
                      f"{n_tokens} tokens", hint=f"{target} holds one entry per token (shift labels beforehand)")
        if bias and self.tensors.get(bias) is not None:
            self.ndim(bias, 1)
            self.dim_eq(bias, 0, weight, 0)

    def same_device(self, *names: str):
        ts = [(n, self.tensors[n]) for n in names if self.tensors.get(n) is not None]
        devs = {t.device for _, t in ts}
        if len(devs) > 1:
            self.fail("device mismatch: " + ", ".join(f"{n} on {t.device}" for n, t in ts))
