"""``fxfuse::linear_cross_entropy``: fused lm-head projection + cross-entropy, as torch.library ops.

The call a graph pass inserts (ONE node, returns the loss; fp32, [] for "mean"/"sum", [N] for "none")::

    torch.ops.fxfuse.linear_cross_entropy.default(
        hidden,            # [..., D] (flattened to [N, D]); bf16 / fp16 / fp32
        weight,            # [V, D], same dtype as hidden (a tied embedding is just a weight)
        target,            # [...] int64, numel N
        bias,              # [V] or None
        ignore_index,      # int   (e.g. -100)
        reduction,         # str   "mean" | "sum" | "none"
        softcap,           # float (0.0 = none): z = softcap * tanh(z / softcap)
        scale,             # float (1.0 = none): z = logits * scale, applied before the softcap
        label_smoothing,   # float, as F.cross_entropy defines it
        grad_in_forward,   # bool: compute the gradients during the forward (valid only when the loss reaches
                           #       a scalar through linear ops; ignored for "none" or when nothing needs grad)
        chunk_bytes=0,     # int, optional: logits-chunk budget in bytes (0 = the default: 256 MiB, at least
                           #       1024 tokens; 16 MiB = MIN_MEMORY_CHUNK_BYTES)
    )

That op is CompositeImplicitAutograd: AOTAutograd decomposes it into the ops that show in profiler traces and in
Inductor's code:

* ``fxfuse::linear_cross_entropy_fwd(hidden, weight, target, bias, ignore_index, reduction, softcap, scale,
  label_smoothing, grad_in_forward, grad_hidden, grad_weight, grad_bias, chunk_bytes)
  -> (loss, lse, grad_hidden, grad_weight, grad_bias)`` (custom_op with register_fake + register_autograd;
  grads are empty [0] tensors unless computed in the forward; ``lse`` is the row normaliser as two fp32 numbers
  per row, [2, N]: row 0 the row max mx of z, row 1 ls = log sum exp(z - mx), so logsumexp = mx + ls. One fp32
  lse would round to ~|lse| * 6e-8, more than the whole loss of a peaked row: see
  :mod:`fxfuse.kernels.linear_cross_entropy`),
* ``fxfuse::linear_cross_entropy_bwd(...)`` (recompute strategy) and
  ``fxfuse::linear_cross_entropy_scale_grads_(...)`` (grad-in-forward strategy: scales the saved gradients by
  the upstream scalar in place, so no second copy of grad_weight is ever allocated).

Why a composite on top of a custom_op: the forward must hand its saved gradients to the backward, so the
autograd-carrying op has to return them; the composite keeps the graph pass's contract at one node returning
the loss, and it reads ``requires_grad`` / grad mode at trace time to decide which gradients to compute.

Limitation of ``grad_in_forward=True``: the backward consumes the saved gradients (scaled in place), so a second
backward through the same graph (``retain_graph=True``) raises; use ``grad_in_forward=False`` there.

The public function is :func:`linear_cross_entropy` (eager and torch.compile); it checks the contract before
calling the op, so the same :class:`~fxfuse.errors.FxFuseContractError` fires in eager and under torch.compile.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..contracts import OpContract
from ._lm_head import (LM_HEAD_DTYPES, check_class_indices, chunk_budget, empty_weight_grads,
                       flatten_and_grad_flags)
from ..errors import FxFuseError
from ..kernels import background_compile
from ..kernels import linear_cross_entropy as K
from ..autocast import register_autocast_casts

__all__ = ["linear_cross_entropy"]

_OP = "fxfuse::linear_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")


# ================================================================================================ contract
def _check_linear_cross_entropy(hidden, weight, target, bias=None, reduction="mean", softcap=0.0,
                                label_smoothing=0.0):
    """The op's contract, one place for the public function, the fake impl and the real impls."""
    c = OpContract(_OP, hidden=hidden, weight=weight, target=target, bias=bias)
    c.lm_head_operands("hidden", "weight", "target", "bias", LM_HEAD_DTYPES)
    if reduction not in _REDUCTIONS:
        c.fail(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if softcap is not None and softcap < 0:
        c.fail(f"softcap must be > 0 (or 0/None for none), got {softcap}")
    if not 0.0 <= label_smoothing <= 1.0:
        c.fail(f"label_smoothing must be in [0, 1], got {label_smoothing}")


# ================================================================================================ forward op
def _fwd_writes(bias, grad_in_forward, grad_hidden, grad_weight, grad_bias) -> Tuple[bool, bool, bool]:
    """Which gradients the forward really writes (real and fake impls must agree)."""
    gb = grad_bias and bias is not None
    any_ = grad_in_forward and (grad_hidden or grad_weight or gb)
    return bool(any_ and grad_hidden), bool(any_ and grad_weight), bool(any_ and gb)


@torch.library.custom_op("fxfuse::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int, reduction: str,
    softcap: float, scale: float, label_smoothing: float, grad_in_forward: bool, grad_hidden: bool,
    grad_weight: bool, grad_bias: bool, chunk_bytes: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_linear_cross_entropy(hidden, weight, target, bias, reduction, softcap, label_smoothing)
    wh, ww, wb = _fwd_writes(bias, grad_in_forward, grad_hidden, grad_weight, grad_bias)
    check_class_indices(_OP, target, weight.shape[0], ignore_index)
    outs = K.lce_forward(hidden, weight, target.long(), bias, ignore_index, reduction, softcap, scale,
                         label_smoothing, grad_in_forward, wh, ww, wb, chunk_budget(chunk_bytes, weight))
    # 0-dim flag saved with gradients computed in the forward: set by the first backward that consumes them.
    consumed = torch.zeros((), dtype=torch.float32, device=hidden.device)
    return (*outs, consumed)


@linear_cross_entropy_fwd.register_fake
def _(hidden, weight, target, bias, ignore_index, reduction, softcap, scale, label_smoothing, grad_in_forward,
      grad_hidden, grad_weight, grad_bias, chunk_bytes):
    _check_linear_cross_entropy(hidden, weight, target, bias, reduction, softcap, label_smoothing)
    N, D = hidden.shape
    V = weight.shape[0]
    wh, ww, wb = _fwd_writes(bias, grad_in_forward, grad_hidden, grad_weight, grad_bias)
    # Traced means a real call is coming: its Triton specialisations start compiling now (on threads)
    background_compile.ask_ahead(K.lce_prewarm, hidden, weight, target, bias, ignore_index, reduction, softcap,
                                 scale, label_smoothing, grad_in_forward, grad_hidden, grad_weight, grad_bias)
    f32 = torch.float32
    loss = hidden.new_empty((N,) if reduction == "none" else (), dtype=f32)
    lse = hidden.new_empty((2, N), dtype=f32)  # row max, log S
    gh = hidden.new_empty((N, D)) if wh else hidden.new_empty(0)
    gw = weight.new_empty((V, D)) if ww else hidden.new_empty(0)
    gb = bias.new_empty((V,)) if wb else hidden.new_empty(0)
    return loss, lse, gh, gw, gb, hidden.new_empty((), dtype=f32)


# ================================================================================================ backward ops
@torch.library.custom_op("fxfuse::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd(
    grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], lse: Tensor,
    ignore_index: int, reduction: str, softcap: float, scale: float, label_smoothing: float, grad_hidden: bool,
    grad_weight: bool, grad_bias: bool, chunk_bytes: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    return K.lce_backward(grad_loss, hidden, weight, target.long(), bias, lse, ignore_index, reduction, softcap,
                          scale, label_smoothing, grad_hidden, grad_weight, grad_bias and bias is not None,
                          chunk_budget(chunk_bytes, weight))


@linear_cross_entropy_bwd.register_fake
def _(grad_loss, hidden, weight, target, bias, lse, ignore_index, reduction, softcap, scale, label_smoothing,
      grad_hidden, grad_weight, grad_bias, chunk_bytes):
    return empty_weight_grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias)


@torch.library.custom_op("fxfuse::linear_cross_entropy_scale_grads_", mutates_args=("grad_hidden", "grad_weight",
                                                                                    "grad_bias", "consumed"))
def linear_cross_entropy_scale_grads_(grad_hidden: Tensor, grad_weight: Tensor, grad_bias: Tensor,
                                      grad_loss: Tensor, consumed: Tensor) -> None:
    # In place, so the backward of the grad-in-forward strategy allocates nothing: the saved gradient becomes
    # the returned one. (An out-of-place multiply would hold two copies of grad_weight, +1 GiB at Llama-3 size.)
    # A second backward through the same forward (retain_graph=True) would scale already-consumed gradients:
    # eager raises in Python (see _backward); a compiled backward has no Python to raise from and no host sync
    # is allowed, so the flag turns the factor into NaN on the device: loud, never silently wrong.
    g = torch.where(consumed > 0, torch.full_like(consumed, float("nan")), grad_loss.to(torch.float32))
    for t in (grad_hidden, grad_weight, grad_bias):
        K.scale_by_device_scalar_(t, g)
    consumed.fill_(1.0)


@linear_cross_entropy_scale_grads_.register_fake
def _(grad_hidden, grad_weight, grad_bias, grad_loss, consumed):
    return None


# ================================================================================================ autograd
def _setup_context(ctx, inputs, output):
    (hidden, weight, target, bias, ignore_index, reduction, softcap, scale, label_smoothing, grad_in_forward,
     grad_hidden, grad_weight, grad_bias, chunk_bytes) = inputs
    loss, lse, gh, gw, gb, consumed = output
    ctx.mark_non_differentiable(lse, gh, gw, gb, consumed)
    # Without this, eager autograd hands the backward a zeros tensor for every unused output: a [V, D] zeros
    # grad_weight-sized buffer plus its fill on each backward (+1.1 GiB and 0.36 ms at Gemma-2 size on the H200;
    # torch.compile never materialises them). Only ``loss`` is differentiable, so its grad is always defined.
    ctx.set_materialize_grads(False)
    wh, ww, wb = _fwd_writes(bias, grad_in_forward, grad_hidden, grad_weight, grad_bias)
    ctx.in_forward = wh or ww or wb
    ctx.args = (ignore_index, reduction, softcap, scale, label_smoothing)
    ctx.flags = (grad_hidden, grad_weight, grad_bias and bias is not None)
    ctx.chunk_bytes = chunk_bytes
    ctx.has_bias = bias is not None
    ctx.consumed = False
    if ctx.in_forward:
        ctx.save_for_backward(gh, gw, gb, consumed)
    else:
        ctx.save_for_backward(hidden, weight, target, bias, lse)


def _backward(ctx, grad_loss, _g_lse, _g_gh, _g_gw, _g_gb, _g_consumed):
    if ctx.in_forward:
        if ctx.consumed:
            raise FxFuseError(
                f"{_OP}: backward ran twice through a grad_in_forward=True call (retain_graph=True?); the "
                "gradients computed in the forward are consumed by the first backward. Call with "
                "grad_in_forward=False to backpropagate more than once.")
        ctx.consumed = True
        gh, gw, gb, consumed = ctx.saved_tensors
        torch.ops.fxfuse.linear_cross_entropy_scale_grads_(gh, gw, gb, grad_loss, consumed)
    else:
        hidden, weight, target, bias, lse = ctx.saved_tensors
        gh, gw, gb = torch.ops.fxfuse.linear_cross_entropy_bwd(grad_loss, hidden, weight, target, bias, lse,
                                                               *ctx.args, *ctx.flags, ctx.chunk_bytes)
    fh, fw, fb = ctx.flags
    return (gh if fh else None, gw if fw else None, None, gb if (fb and ctx.has_bias) else None,
            None, None, None, None, None, None, None, None, None, None)


linear_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)


# ================================================================================================ user-facing op
_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(
    "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index=-100, "
    "str reduction='mean', float softcap=0.0, float scale=1.0, float label_smoothing=0.0, "
    "bool grad_in_forward=True, int chunk_bytes=0) -> Tensor"
)


def _linear_cross_entropy_composite(hidden, weight, target, bias, ignore_index=-100, reduction="mean",
                                    softcap=0.0, scale=1.0, label_smoothing=0.0, grad_in_forward=True,
                                    chunk_bytes=0):
    h2, t1, gh, gw, gb = flatten_and_grad_flags(hidden, weight, target, bias)
    gif = bool(grad_in_forward) and reduction != "none" and (gh or gw or gb)
    return torch.ops.fxfuse.linear_cross_entropy_fwd(
        h2, weight, t1, bias, ignore_index, reduction, float(softcap), float(scale), float(label_smoothing),
        gif, gh, gw, gb, int(chunk_bytes))[0]


_lib.impl("linear_cross_entropy", _linear_cross_entropy_composite, "CompositeImplicitAutograd")
# Under autocast (AMP) the lm-head linear runs in the autocast dtype: so does the op (``fxfuse.autocast``).
register_autocast_casts("linear_cross_entropy", ("hidden", "weight", "bias"))


# ================================================================================================ public API
def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *, bias: Optional[Tensor] = None,
                         ignore_index: int = -100, reduction: str = "mean", softcap: Optional[float] = None,
                         scale: Optional[float] = None, label_smoothing: float = 0.0,
                         grad_in_forward: Optional[bool] = None, chunk_bytes: Optional[int] = None) -> Tensor:
    """``F.cross_entropy(((hidden @ weight.T + bias) * scale) -> softcap, target)`` without the [N, V] logits.

    hidden [..., D], weight [V, D], target [...] (int64). Returns fp32: a scalar for "mean"/"sum", ``target``'s
    shape for "none". ``grad_in_forward`` (default: ``reduction != "none"``) computes the gradients during the
    forward (3 matmuls instead of 4); ``chunk_bytes`` bounds the logits chunk (default 256 MiB, at least 1024
    tokens, see ``fxfuse.kernels.linear_cross_entropy.MIN_MEMORY_CHUNK_BYTES`` for the 16 MiB setting).
    """
    _check_linear_cross_entropy(hidden, weight, target, bias, reduction, softcap or 0.0, label_smoothing)
    gif = (reduction != "none") if grad_in_forward is None else bool(grad_in_forward)
    loss = torch.ops.fxfuse.linear_cross_entropy.default(
        hidden, weight, target, bias, int(ignore_index), reduction, float(softcap or 0.0),
        float(1.0 if scale is None else scale), float(label_smoothing), gif, int(chunk_bytes or 0))
    if reduction == "none":
        loss = loss.view(target.shape)
    return loss
