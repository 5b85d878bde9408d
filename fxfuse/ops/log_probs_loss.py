"""``fxfuse::linear_log_probs_loss``: log-probs (+ entropy) whose loss is known, gradients formed in the forward.

A per-token log-probs loss (GRPO / DAPO / PPO's clipped ratio times the advantage, a policy-gradient term, an
entropy bonus) reaches the lm-head through d loss / d logits = g_logp * (onehot - p) + g_ent * dH / dz, with
per-token upstream gradients g that only the loss knows. ``fxfuse::linear_log_probs`` learns them in the backward,
so it projects the logits twice (forward and backward): 4 matmuls with a trainable head, 3 with a frozen one. When
the pass can see the loss and prove that each token's g depends on that token's log-prob and entropy only (the
loss is a sum of per-token terms, times numbers the log-probs do not change: ``passes/log_probs_loss.py``), the
forward computes g chunk by chunk, right after the chunk's log-probs, by running that loss (the *tail*, a small FX
graph carried as text: :mod:`fxfuse.fx_program`) under autograd on the log-probs written so far, and forms the
gradients there: 3 matmuls with a trainable head, 2 with a frozen one, the logits projected once.

The call the pass inserts (ONE node)::

    torch.ops.fxfuse.linear_log_probs_loss.default(
        hidden, weight, index, bias, temperature, softcap, return_entropy, chunk_bytes,   # as linear_log_probs
        tail,           # str: fxfuse.fx_program text of  f(logp [N], entropy [N] or [0], *tail_tensors,
                        #      *tail_ints) -> the loss (0-dim)
        tail_tensors,   # Tensor[]: what else the loss reads (advantages, masks, old log-probs), as in the graph
        tail_ints,      # SymInt[]: sizes the loss's code reads
    ) -> (logp [N], entropy [N] or [0], carrier [])

``logp`` / ``entropy`` are values only (no gradient): the graph still computes the loss's value from them. The
gradient reaches the lm-head through ``carrier``, a 0-dim fp32 zero the pass adds to the loss: its backward
scales the gradients formed in the forward by the loss's upstream gradient (``loss.backward()``: 1, a scaled loss:
the scale), in place, as ``fxfuse::linear_cross_entropy``'s grad-in-forward path does. Everything else the loss
reads (advantages that require grad, a value head) keeps its gradient through the graph's own ops.
AOTAutograd decomposes the op into ``fxfuse::linear_log_probs_loss_fwd`` (custom_op, fake impl, autograd) and
``fxfuse::linear_cross_entropy_scale_grads_``.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..autocast import register_autocast_casts
from ..errors import FxFuseError
from ..fx_program import load_program
from ..kernels import linear_log_probs as K
from ._lm_head import check_class_indices, chunk_budget, flatten_and_grad_flags
from .linear_log_probs import check_linear_log_probs
from . import linear_cross_entropy as _lce  # noqa: F401  (registers fxfuse::linear_cross_entropy_scale_grads_)

__all__ = ["tail_gradients"]

_OP = "fxfuse::linear_log_probs_loss"


@contextlib.contextmanager
def _autograd_inside_op():
    """Autograd back on inside an op's implementation. torch.library runs an op with an autograd formula below
    the Autograd dispatch keys (they are excluded for the thread), so ``torch.enable_grad()`` alone records
    nothing there; the tail's gradients need it recorded."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for k in ("AutogradFunctionality", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(torch._C.DispatchKey, k))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        yield


def tail_gradients(tail: str, entropy: bool, tensors, ints):
    """The per-chunk callback of :func:`~fxfuse.kernels.linear_log_probs.logp_forward_with_grads`: runs the loss
    on the log-probs (and entropy) written so far and returns the chunk's (d loss / d logp, d loss / d entropy).

    Every row of the buffers goes in, the rows not yet written as zeros: the pass admitted the tail only if each
    token's gradient depends on that token's values alone, so those rows change nothing in the chunk's. The tail's
    other inputs enter detached (their gradients, if any, are the graph's business)."""
    fn = load_program(tail)
    tensors = [t.detach() for t in tensors]

    def grads(s, e, logp, ent):
        with _autograd_inside_op():
            lp = logp.detach().requires_grad_()
            en = ent.detach().requires_grad_(entropy)
            out = fn(lp, en, *tensors, *ints)
            ins = [lp, en] if entropy else [lp]
            if not (isinstance(out, Tensor) and out.requires_grad):
                return None, None
            gs = torch.autograd.grad(out, ins, allow_unused=True)
        g_logp = gs[0][s:e].float() if gs[0] is not None else None
        g_ent = gs[1][s:e].float() if entropy and gs[1] is not None else None
        return g_logp, g_ent

    return grads


# ================================================================================================ forward op
@torch.library.custom_op("fxfuse::linear_log_probs_loss_fwd", mutates_args=())
def linear_log_probs_loss_fwd(
    hidden: Tensor, weight: Tensor, index: Tensor, bias: Optional[Tensor], temperature: float, softcap: float,
    return_entropy: bool, grad_hidden: bool, grad_weight: bool, grad_bias: bool, chunk_bytes: int, tail: str,
    tail_tensors: List[Tensor], tail_ints: List[int],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_linear_log_probs(hidden, weight, index, bias, temperature, softcap)
    check_class_indices(_OP, index, weight.shape[0], None, what="index")
    any_grad = bool(grad_hidden or grad_weight or (grad_bias and bias is not None))
    grads = tail_gradients(tail, bool(return_entropy), tail_tensors, [int(i) for i in tail_ints]) \
        if any_grad else None
    out = K.logp_forward_with_grads(hidden, weight, index.long(), bias, float(temperature), float(softcap),
                                    bool(return_entropy), chunk_budget(chunk_bytes, weight), grads, bool(grad_hidden),
                                    bool(grad_weight), bool(grad_bias))
    logp, ent = out[0], out[1]
    gh, gw, gb = out[7:]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    # carrier: the loss's gradient path (value 0); consumed: set by the backward that scales the gradients
    return logp, ent, torch.zeros((), **f32), gh, gw, gb, torch.zeros((), **f32)


@linear_log_probs_loss_fwd.register_fake
def _(hidden, weight, index, bias, temperature, softcap, return_entropy, grad_hidden, grad_weight, grad_bias,
      chunk_bytes, tail, tail_tensors, tail_ints):
    check_linear_log_probs(hidden, weight, index, bias, temperature, softcap)
    N, D = hidden.shape
    V = weight.shape[0]
    f32 = torch.float32
    gh = hidden.new_empty((N, D)) if grad_hidden else hidden.new_empty(0)
    gw = weight.new_empty((V, D)) if grad_weight else hidden.new_empty(0)
    gb = bias.new_empty((V,)) if (grad_bias and bias is not None) else hidden.new_empty(0)
    return (hidden.new_empty((N,), dtype=f32), hidden.new_empty((N,) if return_entropy else (0,), dtype=f32),
            hidden.new_empty((), dtype=f32), gh, gw, gb, hidden.new_empty((), dtype=f32))


def _setup_context(ctx, inputs, output):
    (hidden, weight, index, bias, temperature, softcap, return_entropy, grad_hidden, grad_weight, grad_bias,
     chunk_bytes, tail, tail_tensors, tail_ints) = inputs
    logp, ent, carrier, gh, gw, gb, consumed = output
    ctx.mark_non_differentiable(logp, ent, gh, gw, gb, consumed)
    ctx.set_materialize_grads(False)  # no [V, D] zeros for the outputs without a gradient
    ctx.flags = (bool(grad_hidden), bool(grad_weight), bool(grad_bias) and bias is not None)
    ctx.consumed = False
    ctx.n_loss_tensors, ctx.no_loss_ints = len(tail_tensors), len(tail_ints) == 0
    ctx.save_for_backward(gh, gw, gb, consumed)


def _backward(ctx, _g_logp, _g_ent, g_carrier, *_no_grad):
    fh, fw, fb = ctx.flags
    # one entry per input: a list of Nones for the tensor list; for the integers None, or [] when there are none
    # (torch.library reads an empty list as a list of tensors)
    rest = (None,) * 8 + ([None] * ctx.n_loss_tensors, [] if ctx.no_loss_ints else None)
    if g_carrier is None:
        return (None,) * 4 + rest
    if ctx.consumed:
        raise FxFuseError(f"{_OP}: backward ran twice through one forward (retain_graph=True?); the gradients "
                          "formed in the forward are consumed by the first backward.")
    ctx.consumed = True
    gh, gw, gb, consumed = ctx.saved_tensors
    torch.ops.fxfuse.linear_cross_entropy_scale_grads_(gh, gw, gb, g_carrier, consumed)
    return (gh if fh else None, gw if fw else None, None, gb if fb else None) + rest


linear_log_probs_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


# ================================================================================================ one-node op
_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(
    "linear_log_probs_loss(Tensor hidden, Tensor weight, Tensor index, Tensor? bias, float temperature, "
    "float softcap, bool return_entropy, int chunk_bytes, str tail, Tensor[] tail_tensors, SymInt[] tail_ints) "
    "-> (Tensor, Tensor, Tensor)"
)


def _linear_log_probs_loss_composite(hidden, weight, index, bias, temperature, softcap, return_entropy,
                                     chunk_bytes, tail, tail_tensors, tail_ints):
    h2, i1, gh, gw, gb = flatten_and_grad_flags(hidden, weight, index, bias)
    logp, ent, carrier = torch.ops.fxfuse.linear_log_probs_loss_fwd(
        h2, weight, i1, bias, float(temperature), float(softcap), bool(return_entropy), gh, gw, gb,
        int(chunk_bytes), tail, list(tail_tensors), list(tail_ints))[:3]
    return logp, ent, carrier


_lib.impl("linear_log_probs_loss", _linear_log_probs_loss_composite, "CompositeImplicitAutograd")
register_autocast_casts("linear_log_probs_loss", ("hidden", "weight", "bias"))
