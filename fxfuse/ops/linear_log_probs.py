"""``fxfuse::linear_log_probs``: fused lm-head projection + per-token log-probabilities (+ entropy), as
torch.library ops, for RL and preference losses (GRPO / PPO / DPO: ``selective_log_softmax`` and
``entropy_from_logits`` without the [N, V] logits).

Order of the logit transforms (TRL's): ``z = softcap(hidden @ weight.T + bias) / temperature`` with
``softcap(x) = c * tanh(x / c)`` — the model (Gemma-2) softcaps, the trainer divides by the temperature.

The call a graph pass inserts (ONE node, returns ``(logp, entropy, is_top1, mean_logits, log_sum_sq_probs)``,
[N] each, fp32 but ``is_top1`` (bool); each output but ``logp`` is an empty [0] tensor unless asked for; the last
three have no gradient: the per-token statistics TRL's trainers read besides the log-probs)::

    torch.ops.fxfuse.linear_log_probs.default(
        hidden,            # [..., D] (flattened to [N, D]); bf16 / fp16 / fp32
        weight,            # [V, D], same dtype as hidden
        index,             # [...] int64 (or int32), numel N; every row is a real token (no ignore_index)
        bias,              # [V] or None
        temperature=1.0,   # float > 0
        softcap=0.0,       # float (0.0 = none)
        return_entropy=False,
        chunk_bytes=0,     # logits-chunk budget in bytes (0 = the default: 256 MiB, at least 1024 tokens)
        return_is_top1=False,            # index is the first argmax of z (SFT's mean_token_accuracy)
        return_mean_logits=False,        # mean of z over the vocabulary (DPO / KTO metrics)
        return_log_sum_sq_probs=False,   # log sum_v p_v^2 (DPO's WPO weighting)
    )

That op is CompositeImplicitAutograd (it reads ``requires_grad`` / grad mode at trace time to decide which
gradients the backward computes); AOTAutograd decomposes it into

* ``fxfuse::linear_log_probs_fwd(hidden, weight, index, bias, temperature, softcap, return_entropy, grad_hidden,
  grad_weight, grad_bias, chunk_bytes, stats) -> (logp [N], entropy [N] or [0], lse [2, N], ez [N] or [0],
  is_top1, mean_logits, log_sum_sq_probs)`` (``stats``: which of the last three to compute)
  (custom_op + register_fake + register_autograd; saved for the backward: lse = the row normaliser as two fp32
  numbers per row, row 0 the max mx of z and row 1 ls = log sum exp(z - mx), so logsumexp = mx + ls (one fp32
  lse loses the log-probs of peaked rows, see :mod:`fxfuse.kernels.linear_log_probs`); ez = E_p[z] - mx), and
* ``fxfuse::linear_log_probs_bwd(grad_logp?, grad_entropy?, hidden, weight, index, bias, lse, ez, temperature,
  softcap, grad_hidden, grad_weight, grad_bias, chunk_bytes) -> (grad_hidden, grad_weight, grad_bias)``
  (recomputes the logits chunk by chunk; arbitrary per-token upstream grads, either may be None).

The public function is :func:`linear_log_probs`; it checks the contract before calling the op, so the same
:class:`~fxfuse.errors.FxFuseContractError` fires in eager and under torch.compile.

``index`` values are range-checked by the forward op (``_lm_head.check_class_indices``): on the CPU an index outside
[0, V) raises an :class:`~fxfuse.errors.FxFuseContractError` naming it and its position; on CUDA, without a host
sync, a device-side assertion with this op's message stops the program (as PyTorch's own gather would).
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..contracts import OpContract
from ._lm_head import (LM_HEAD_DTYPES, check_class_indices, chunk_budget, empty_weight_grads,
                       flatten_and_grad_flags)
from ..kernels import linear_log_probs as K
from ..autocast import register_autocast_casts

__all__ = ["linear_log_probs"]

_OP = "fxfuse::linear_log_probs"


# ================================================================================================ contract
def check_linear_log_probs(hidden, weight, index, bias=None, temperature=1.0, softcap=0.0):
    """The op's contract, one place for the public function, the fake impl and the real impl (the lm-head
    operand checks are shared with the other lm-head ops through ``OpContract.lm_head_operands``)."""
    c = OpContract(_OP, hidden=hidden, weight=weight, index=index, bias=bias)
    c.lm_head_operands("hidden", "weight", "index", "bias", LM_HEAD_DTYPES)
    if not (temperature > 0):
        c.fail(f"temperature must be > 0, got {temperature}")
    if softcap is not None and softcap < 0:
        c.fail(f"softcap must be > 0 (or 0/None for none), got {softcap}")


# ================================================================================================ forward op
@torch.library.custom_op("fxfuse::linear_log_probs_fwd", mutates_args=())
def linear_log_probs_fwd(
    hidden: Tensor, weight: Tensor, index: Tensor, bias: Optional[Tensor], temperature: float, softcap: float,
    return_entropy: bool, grad_hidden: bool, grad_weight: bool, grad_bias: bool, chunk_bytes: int,
    stats: List[bool],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_linear_log_probs(hidden, weight, index, bias, temperature, softcap)
    check_class_indices(_OP, index, weight.shape[0], None, what="index")
    return K.logp_forward(hidden, weight, index.long(), bias, float(temperature), float(softcap),
                          bool(return_entropy), chunk_budget(chunk_bytes, weight), *map(bool, stats),
                          unit_grad=_unit_grad(return_entropy, grad_hidden, grad_weight, grad_bias, bias))


def _unit_grad(return_entropy, grad_hidden, grad_weight, grad_bias, bias) -> bool:
    """A frozen lm-head (LoRA, a reference model's head with trainable hidden states) and log-probs alone: the
    forward also forms d logp / d hidden per unit upstream gradient (two matmuls in all, the backward then only
    scales it by the per-token upstream gradient), where recomputing in the backward takes three. With entropy
    its gradient would need a second such tensor (three matmuls either way): the recompute stays."""
    return bool(grad_hidden) and not grad_weight and not (grad_bias and bias is not None) and not return_entropy


@linear_log_probs_fwd.register_fake
def _(hidden, weight, index, bias, temperature, softcap, return_entropy, grad_hidden, grad_weight, grad_bias,
      chunk_bytes, stats):
    check_linear_log_probs(hidden, weight, index, bias, temperature, softcap)
    N = hidden.shape[0]
    f32 = torch.float32

    def per_token(flag, dtype=f32):
        return hidden.new_empty((N,) if flag else (0,), dtype=dtype)
    logp = per_token(True)
    lse = hidden.new_empty((2, N), dtype=f32)  # row max, log S
    top1, mean, lsq = stats
    unit = _unit_grad(return_entropy, grad_hidden, grad_weight, grad_bias, bias)
    return (logp, per_token(return_entropy), lse, per_token(return_entropy), per_token(top1, torch.bool),
            per_token(mean), per_token(lsq), hidden.new_empty(tuple(hidden.shape) if unit else (0,)))


# ================================================================================================ backward op
@torch.library.custom_op("fxfuse::linear_log_probs_bwd", mutates_args=())
def linear_log_probs_bwd(
    grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], hidden: Tensor, weight: Tensor, index: Tensor,
    bias: Optional[Tensor], lse: Tensor, ez: Tensor, temperature: float, softcap: float, grad_hidden: bool,
    grad_weight: bool, grad_bias: bool, chunk_bytes: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    return K.logp_backward(grad_logp, grad_entropy, hidden, weight, index.long(), bias, lse, ez,
                           float(temperature), float(softcap), grad_hidden, grad_weight, grad_bias,
                           chunk_budget(chunk_bytes, weight))


@linear_log_probs_bwd.register_fake
def _(grad_logp, grad_entropy, hidden, weight, index, bias, lse, ez, temperature, softcap, grad_hidden,
      grad_weight, grad_bias, chunk_bytes):
    return empty_weight_grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias)


# ================================================================================================ autograd
def _setup_context(ctx, inputs, output):
    (hidden, weight, index, bias, temperature, softcap, return_entropy, grad_hidden, grad_weight, grad_bias,
     chunk_bytes, _stats) = inputs
    logp, ent, lse, ez, top1, mean, lsq, unit = output
    ctx.mark_non_differentiable(lse, ez, top1, mean, lsq, unit)
    # An output nobody uses gets a None grad (not a zeros tensor), so its term is skipped in the row kernel.
    ctx.set_materialize_grads(False)
    ctx.args = (float(temperature), float(softcap))
    ctx.flags = (bool(grad_hidden), bool(grad_weight), bool(grad_bias) and bias is not None)
    ctx.entropy = bool(return_entropy)
    ctx.chunk_bytes = chunk_bytes
    ctx.unit = _unit_grad(return_entropy, grad_hidden, grad_weight, grad_bias, bias)
    if ctx.unit:  # the backward is g * unit: neither the hidden states nor the weight are needed again
        ctx.save_for_backward(unit)
    else:
        ctx.save_for_backward(hidden, weight, index, bias, lse, ez)


def _backward(ctx, g_logp, g_ent, *_no_grad):
    if ctx.unit:
        (unit,) = ctx.saved_tensors
        gh = unit.new_zeros(unit.shape) if g_logp is None else \
            (g_logp.reshape(-1, 1).float() * unit.float()).to(unit.dtype)
        return (gh, None, None, None, None, None, None, None, None, None, None, None)
    hidden, weight, index, bias, lse, ez = ctx.saved_tensors
    if not ctx.entropy:
        g_ent = None
    gh, gw, gb = torch.ops.fxfuse.linear_log_probs_bwd(g_logp, g_ent, hidden, weight, index, bias, lse, ez,
                                                        *ctx.args, *ctx.flags, ctx.chunk_bytes)
    fh, fw, fb = ctx.flags
    return (gh if fh else None, gw if fw else None, None, gb if fb else None,
            None, None, None, None, None, None, None, None)


linear_log_probs_fwd.register_autograd(_backward, setup_context=_setup_context)


# ================================================================================================ one-node op
_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(
    "linear_log_probs(Tensor hidden, Tensor weight, Tensor index, Tensor? bias, float temperature=1.0, "
    "float softcap=0.0, bool return_entropy=False, int chunk_bytes=0, bool return_is_top1=False, "
    "bool return_mean_logits=False, bool return_log_sum_sq_probs=False) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _linear_log_probs_composite(hidden, weight, index, bias, temperature=1.0, softcap=0.0, return_entropy=False,
                                chunk_bytes=0, return_is_top1=False, return_mean_logits=False,
                                return_log_sum_sq_probs=False):
    h2, i1, gh, gw, gb = flatten_and_grad_flags(hidden, weight, index, bias)
    logp, ent, _lse, _ez, top1, mean, lsq, _unit = torch.ops.fxfuse.linear_log_probs_fwd(
        h2, weight, i1, bias, float(temperature), float(softcap), bool(return_entropy), gh, gw, gb,
        int(chunk_bytes), [bool(return_is_top1), bool(return_mean_logits), bool(return_log_sum_sq_probs)])
    return logp, ent, top1, mean, lsq


_lib.impl("linear_log_probs", _linear_log_probs_composite, "CompositeImplicitAutograd")
# Under autocast (AMP) the lm-head linear runs in the autocast dtype: so does the op (``fxfuse.autocast``).
register_autocast_casts("linear_log_probs", ("hidden", "weight", "bias"))


# ================================================================================================ public API
def linear_log_probs(hidden: Tensor, weight: Tensor, index: Tensor, *, temperature: float = 1.0,
                     softcap: Optional[float] = None, bias: Optional[Tensor] = None, return_entropy: bool = False,
                     chunk_bytes: Optional[int] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Per-token ``log_softmax(z)[index]`` (and entropy) with ``z = softcap(hidden @ weight.T + bias) /
    temperature``, without materialising the [N, V] logits beyond one chunk.

    Order (TRL's): first the optional softcap ``c * tanh(x / c)`` (Gemma-2 applies it inside the model), then
    the division by ``temperature`` (TRL's trainers divide the model's logits by it).

    hidden [..., D], weight [V, D] (same dtype), index [...] int64 with one token id per hidden row (no
    ignore_index: mask the result afterwards), bias [V] or None. Returns ``logp`` fp32 with ``index``'s shape,
    or ``(logp, entropy)`` with ``return_entropy=True``, entropy = -(softmax(z) * log_softmax(z)).sum(-1).
    Backward accepts arbitrary per-token upstream grads for both (advantages, masks, importance ratios) and
    recomputes the logits chunk by chunk (4 matmuls); with a frozen ``weight`` (and bias) and no entropy, the
    forward forms the hidden states' gradient per unit upstream gradient instead (2 matmuls in all).
    ``chunk_bytes`` bounds the logits chunk (default 256 MiB, at least 1024 tokens).
    """
    check_linear_log_probs(hidden, weight, index, bias, temperature, softcap or 0.0)
    logp, ent = torch.ops.fxfuse.linear_log_probs.default(
        hidden, weight, index, bias, float(temperature), float(softcap or 0.0), bool(return_entropy),
        int(chunk_bytes or 0))[:2]
    logp = logp.view(index.shape)
    if return_entropy:
        return logp, ent.view(index.shape)
    return logp
