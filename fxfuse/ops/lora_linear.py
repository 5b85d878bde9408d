"""``fxfuse::lora_linear``: a frozen (or trainable) linear layer plus its LoRA adapters in one op, forward and
backward, dropout masks regenerated from a seed instead of stored (PEFT stores ``dropout(x)`` per projection).

The call a graph pass inserts (ONE node)::

    torch.ops.fxfuse.lora_linear.default(
        x,              # [..., din]; bf16 / fp16 / fp32
        weight,         # [dout, din] base weight, same dtype
        bias,           # [dout] or None
        lora_a,         # list of A_i [r_i, din] (PEFT's lora_A[adapter].weight); any float dtype (computed in x's)
        lora_b,         # list of B_i [dout, r_i] (PEFT's lora_B[adapter].weight), A_i's dtype
        scaling,        # list of floats s_i (lora_alpha / r, or / sqrt(r) for rslora)
        dropout_p,      # list of floats p_i in [0, 1); 0 where the adapter has no dropout or in eval mode
    ) -> y [..., dout] = x @ weight.T + bias + sum_i s_i * dropout_i(x) @ A_i.T @ B_i.T

That op is CompositeImplicitAutograd: at trace time it concatenates the adapters (a no-op for one adapter), draws
one seed per adapter with dropout (``torch.randint`` on the device: no host sync, reproducible under
``torch.manual_seed``) and reads ``requires_grad`` to decide which gradients the backward computes (nothing for
the frozen base weight). AOTAutograd then sees

* ``fxfuse::lora_linear_fwd(x2, weight, bias, A, B, seeds, ranks, scalings, dropout_p) -> (y, V)`` with
  ``V = [drop_i(x) @ A_i.T]`` [N, R], the only activation saved besides x (N x r per adapter), and
* ``fxfuse::lora_linear_bwd(gy, x2, weight, A, B, V, seeds, ...) -> (gx, gW, gbias, gA, gB)``.

The public function is :func:`lora_linear`; it checks the contract before calling the op, so the same
:class:`~fxfuse.errors.FxFuseContractError` fires in eager and under torch.compile.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..contracts import OpContract
from ..kernels import lora_linear as K
from ._autocast import register_autocast_casts

__all__ = ["lora_linear", "lora_dropout_keep_mask"]

_OP = "fxfuse::lora_linear"
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


# ================================================================================================ contract
def _check_lora_linear(x, weight, bias, lora_a, lora_b, scaling, dropout_p):
    named = {"x": x, "weight": weight, "bias": bias}
    named.update({f"lora_a[{i}]": a for i, a in enumerate(lora_a)})
    named.update({f"lora_b[{i}]": b for i, b in enumerate(lora_b)})
    c = OpContract(_OP, **named)
    if not (len(lora_a) == len(lora_b) == len(scaling) == len(dropout_p)) or len(lora_a) == 0:
        c.fail(f"one lora_a, lora_b, scaling and dropout_p per adapter (at least one), got {len(lora_a)}, "
               f"{len(lora_b)}, {len(scaling)}, {len(dropout_p)}")
    c.ndim("weight", 2)
    if x.dim() < 1:
        c.fail("x must have a last (in_features) dimension")
    c.dim_eq("x", -1, "weight", 1, hint="weight is [out_features, in_features] (nn.Linear layout)")
    for i in range(len(lora_a)):
        a, b = f"lora_a[{i}]", f"lora_b[{i}]"
        c.ndim(a, 2)
        c.ndim(b, 2)
        c.dim_eq(a, 1, "weight", 1, hint="lora_A.weight is [r, in_features]")
        c.dim_eq(b, 0, "weight", 0, hint="lora_B.weight is [out_features, r]")
        c.dim_eq(a, 0, b, 1, hint="lora_A.weight [r, in] and lora_B.weight [out, r] share the rank r")
        if not (0.0 <= float(dropout_p[i]) < 1.0):
            c.fail(f"dropout_p[{i}] must be in [0, 1), got {dropout_p[i]}")
    c.dtype_in("x", _FLOATS)
    c.same_dtype("x", "weight", "bias")
    for i in range(len(lora_a)):  # adapters may be wider than the base (PEFT's fp32 adapters): computed in x's dtype
        c.dtype_in(f"lora_a[{i}]", _FLOATS)
        c.same_dtype(f"lora_a[{i}]", f"lora_b[{i}]")
    names = [n for n, t in named.items() if t is not None]
    c.same_device(*names)
    if bias is not None:
        c.ndim("bias", 1)
        c.dim_eq("bias", 0, "weight", 0)


# ================================================================================================ fwd / bwd ops
# Defined with the low-level ``torch.library.Library`` API rather than ``torch.library.custom_op``: the op runs
# 113 times per forward and per backward in a LoRA'd 1B model, and custom_op's Python layers (autograd wrapper,
# redispatch, dynamo-disable, alias checks) cost more host time per call than the small k/v-projection kernels
# take on the GPU (benchmarks/lora_notes.md, "host overhead"). Same schema, fake impls and autograd formula.
_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(
    "lora_linear_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor A, Tensor B, Tensor seeds, int[] ranks, "
    "float[] scalings, float[] dropout_p) -> (Tensor, Tensor)"
)
_lib.define(
    "lora_linear_bwd(Tensor gy, Tensor x, Tensor weight, Tensor A, Tensor B, Tensor V, Tensor seeds, int[] ranks, "
    "float[] scalings, float[] dropout_p, bool need_gx, bool need_gw, bool need_gbias, bool need_ga, "
    "bool need_gb) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _lora_linear_fwd_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], A: Tensor, B: Tensor, seeds: Tensor,
                          ranks: List[int], scalings: List[float], dropout_p: List[float]) -> Tuple[Tensor, Tensor]:
    return K.lora_forward(x, weight, bias, A, B, list(ranks), list(scalings), list(dropout_p), seeds)


def _lora_linear_bwd_impl(gy: Tensor, x: Tensor, weight: Tensor, A: Tensor, B: Tensor, V: Tensor, seeds: Tensor,
                          ranks: List[int], scalings: List[float], dropout_p: List[float], need_gx: bool,
                          need_gw: bool, need_gbias: bool, need_ga: bool, need_gb: bool
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return K.lora_backward(gy.contiguous(), x, weight, A, B, V, seeds, list(ranks), list(scalings),
                           list(dropout_p), need_gx, need_gw, need_gbias, need_ga, need_gb)


# One real impl for every device (the kernels pick Triton or PyTorch per tensor), as custom_op registered it.
_lib.impl("lora_linear_fwd", _lora_linear_fwd_impl, "CompositeExplicitAutograd")
_lib.impl("lora_linear_bwd", _lora_linear_bwd_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("fxfuse::lora_linear_fwd", lib=_lib)
def _(x, weight, bias, A, B, seeds, ranks, scalings, dropout_p):
    return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty((x.shape[0], A.shape[0]))


@torch.library.register_fake("fxfuse::lora_linear_bwd", lib=_lib)
def _(gy, x, weight, A, B, V, seeds, ranks, scalings, dropout_p, need_gx, need_gw, need_gbias, need_ga, need_gb):
    e = lambda: x.new_empty(0)  # noqa: E731
    return (x.new_empty(x.shape) if need_gx else e(), weight.new_empty(weight.shape) if need_gw else e(),
            weight.new_empty((weight.shape[0],)) if need_gbias else e(), A.new_empty(A.shape) if need_ga else e(),
            B.new_empty(B.shape) if need_gb else e())


# ================================================================================================ autograd
def _setup_context(ctx, inputs, output):
    x, weight, bias, A, B, seeds, ranks, scalings, dropout_p = inputs
    _y, V = output
    ctx.mark_non_differentiable(V)
    ctx.set_materialize_grads(False)  # no zeros [N, R] grad for the saved activation V (y's is always defined)
    ctx.args = (list(ranks), list(scalings), list(dropout_p))
    ctx.flags = (x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad,
                 A.requires_grad, B.requires_grad)
    # x is needed for grad A (and grad W); with LoRA it is saved anyway, so it is always saved (the fake impl of
    # the backward takes grad x's shape from it).
    ctx.save_for_backward(x, weight, A, B, V, seeds)


def _backward(ctx, gy, _gV):
    x, weight, A, B, V, seeds = ctx.saved_tensors
    gx, gw, gbias, ga, gb = torch.ops.fxfuse.lora_linear_bwd(gy, x, weight, A, B, V, seeds, *ctx.args, *ctx.flags)
    fx, fw, fbias, fa, fb = ctx.flags
    return (gx if fx else None, gw if fw else None, gbias if fbias else None, ga if fa else None,
            gb if fb else None, None, None, None, None)


torch.library.register_autograd("fxfuse::lora_linear_fwd", _backward, setup_context=_setup_context, lib=_lib)


# ================================================================================================ one-node op
_lib.define(
    "lora_linear(Tensor x, Tensor weight, Tensor? bias, Tensor[] lora_a, Tensor[] lora_b, float[] scaling, "
    "float[] dropout_p) -> Tensor"
)


def _lora_linear_composite(x, weight, bias, lora_a, lora_b, scaling, dropout_p):
    din = x.shape[-1]
    x2 = x.reshape(-1, din)
    # Adapters in another dtype (fp32 adapters on a bf16 base) go in as they are: the op runs the matmuls in x's
    # dtype and returns their gradients in theirs (fp32-accumulated). Mixed adapter dtypes share the first one's.
    lora_a = [a if a.dtype == lora_a[0].dtype else a.to(lora_a[0].dtype) for a in lora_a]
    lora_b = [b if b.dtype == lora_a[0].dtype else b.to(lora_a[0].dtype) for b in lora_b]
    A = lora_a[0] if len(lora_a) == 1 else torch.cat(list(lora_a), 0)
    B = lora_b[0] if len(lora_b) == 1 else torch.cat(list(lora_b), 1)
    ranks = [int(a.shape[0]) for a in lora_a]
    ps = [float(p) for p in dropout_p]
    # Without dropout no seed is read: an empty tensor costs no kernel launch on the hot path.
    seeds = (K.draw_seeds(len(ps), x.device) if any(p > 0 for p in ps)
             else torch.empty((0,), dtype=torch.int64, device=x.device))
    y, _V = torch.ops.fxfuse.lora_linear_fwd(x2, weight, bias, A, B, seeds, ranks, [float(s) for s in scaling], ps)
    return y.view(*x.shape[:-1], weight.shape[0])


_lib.impl("lora_linear", _lora_linear_composite, "CompositeImplicitAutograd")
# Under autocast (AMP) the base and adapter linears run in the autocast dtype: so does the op (``_autocast``).
register_autocast_casts("lora_linear", ("x", "weight", "bias", "lora_a", "lora_b"))


# ================================================================================================ public API
def _as_list(t) -> list:
    return list(t) if isinstance(t, (list, tuple)) else [t]


def lora_linear(x: Tensor, weight: Tensor, lora_a: Union[Tensor, Sequence[Tensor]],
                lora_b: Union[Tensor, Sequence[Tensor]], scaling: Union[float, Sequence[float]], *,
                bias: Optional[Tensor] = None, dropout_p: Union[float, Sequence[float]] = 0.0) -> Tensor:
    """``x @ weight.T + bias + sum_i scaling_i * dropout_i(x) @ lora_a_i.T @ lora_b_i.T`` (PEFT's LoRA Linear).

    ``lora_a`` [r, din] / ``lora_b`` [dout, r] (or lists of them, one per active adapter), ``scaling`` and
    ``dropout_p`` a float or one per adapter. Dropout is applied when ``dropout_p > 0`` (pass 0 in eval mode); its
    mask is regenerated from a seed in the backward, never stored. Gradients flow to every input that requires
    them; the frozen base weight costs nothing extra.
    """
    lora_a, lora_b = _as_list(lora_a), _as_list(lora_b)
    n = len(lora_a)
    scaling = [float(s) for s in _as_list(scaling)]
    dropout_p = [float(p) for p in _as_list(dropout_p)]
    if len(scaling) == 1 and n > 1:
        scaling = scaling * n
    if len(dropout_p) == 1 and n > 1:
        dropout_p = dropout_p * n
    _check_lora_linear(x, weight, bias, lora_a, lora_b, scaling, dropout_p)
    return torch.ops.fxfuse.lora_linear.default(x, weight, bias, lora_a, lora_b, scaling, dropout_p)


def lora_dropout_keep_mask(seed: Tensor, n_rows: int, in_features: int, p: float, device) -> Tensor:
    """The bool [n_rows, in_features] keep mask ``fxfuse::lora_linear`` draws for one adapter from ``seed`` on
    ``device``'s path (for references in tests and debugging)."""
    return K.dropout_keep_mask(seed, n_rows, in_features, p, device)
