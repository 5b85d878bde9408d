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

Sibling projections that read the same x (q/k/v, gate/up; PEFT gives each its own adapters and dropout) can be one
node too (horizontal fusion, ``passes/lora_horizontal.py``)::

    torch.ops.fxfuse.lora_linear_group.default(
        x, weights, biases (None allowed), lora_a, lora_b,   # adapters of projection 0 first, then 1, ...
        counts,         # adapters per projection
        scaling, dropout_p,
    ) -> [y_j]  (the same as one lora_linear per projection, masks included: each adapter keeps its own seed)

so x is read once per tile for all their dropout masks and adapter products, and grad x is accumulated in one
buffer (no sum of three [N, din] gradients).

Both are CompositeImplicitAutograd: at trace time they concatenate the adapters (a no-op for one adapter), draw
one seed per adapter with dropout (``torch.randint`` on the device: no host sync, reproducible under
``torch.manual_seed``) and read ``requires_grad`` to decide which gradients the backward computes (nothing for
the frozen base weight). AOTAutograd then sees

* ``fxfuse::lora_linear_fwd(x2, weights, biases, bias_of, A, Bs, seeds, ranks, counts, scalings, dropout_p)
  -> ([y_j], V)`` with ``V = [s_i * drop_i(x) @ A_i.T]`` [N, R], the only activation saved besides x (N x r per
  adapter), and
* ``fxfuse::lora_linear_bwd([gy_j], x2, weights, A, Bs, V, seeds, ...) -> (gx, [gW_j], [gbias_j], gA, [gB_j])``.

The public functions are :func:`lora_linear` and :func:`lora_linear_group`; they check the contract before calling the op, so the same
:class:`~fxfuse.errors.FxFuseContractError` fires in eager and under torch.compile.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..contracts import OpContract
from ..kernels import background_compile
from ..kernels import lora_linear as K
from ..autocast import register_autocast_casts

__all__ = ["lora_linear", "lora_linear_group", "lora_dropout_keep_mask"]

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
# once per adapted projection (or sibling group) per forward and per backward, and custom_op's Python layers
# (autograd wrapper, redispatch, dynamo-disable, alias checks) cost more host time per call than the small
# k/v-projection kernels take on the GPU (benchmarks/lora_notes.md, "host overhead"). Same schema, fake impls and
# autograd formula.
#
# One op pair serves a single LoRA layer and a group of sibling projections that read the same x (q/k/v,
# gate/up): ``weights`` has one entry per projection, ``counts[j]`` adapters belong to projection j (consecutive
# in A, ranks, scalings, dropout_p, seeds), ``Bs[j]`` is projection j's B block and ``biases`` holds the biases
# that exist, ``bias_of[j]`` their index (-1: no bias). (A ``Tensor?[]`` of biases would be simpler, but
# autograd's tensor-list support cannot return a gradient for some of its entries and not others.)
_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(
    "lora_linear_fwd(Tensor x, Tensor[] weights, Tensor[] biases, int[] bias_of, Tensor A, Tensor[] Bs, "
    "Tensor seeds, int[] ranks, int[] counts, float[] scalings, float[] dropout_p) -> (Tensor[], Tensor)"
)
_lib.define(
    "lora_linear_bwd(Tensor[] gys, Tensor x, Tensor[] weights, Tensor A, Tensor[] Bs, Tensor V, Tensor seeds, "
    "int[] ranks, int[] counts, float[] scalings, float[] dropout_p, bool need_gx, bool need_gw, "
    "bool need_gbias, bool need_ga, bool need_gb) -> (Tensor, Tensor[], Tensor[], Tensor, Tensor[])"
)


def _lora_linear_fwd_impl(x: Tensor, weights: List[Tensor], biases: List[Tensor], bias_of: List[int], A: Tensor,
                          Bs: List[Tensor], seeds: Tensor, ranks: List[int], counts: List[int],
                          scalings: List[float], dropout_p: List[float]) -> Tuple[List[Tensor], Tensor]:
    bias_list = [biases[k] if k >= 0 else None for k in bias_of]
    return K.lora_forward(x, list(weights), bias_list, A, list(Bs), seeds, list(ranks), list(counts),
                          list(scalings), list(dropout_p))


def _lora_linear_bwd_impl(gys: List[Tensor], x: Tensor, weights: List[Tensor], A: Tensor, Bs: List[Tensor],
                          V: Tensor, seeds: Tensor, ranks: List[int], counts: List[int], scalings: List[float],
                          dropout_p: List[float], need_gx: bool, need_gw: bool, need_gbias: bool, need_ga: bool,
                          need_gb: bool):
    return K.lora_backward([g.contiguous() for g in gys], x, list(weights), A, list(Bs), V, seeds, list(ranks),
                           list(counts), list(scalings), list(dropout_p), need_gx, need_gw, need_gbias, need_ga,
                           need_gb)


# One real impl for every device (the kernels pick Triton or PyTorch per tensor), as custom_op registered it.
_lib.impl("lora_linear_fwd", _lora_linear_fwd_impl, "CompositeExplicitAutograd")
_lib.impl("lora_linear_bwd", _lora_linear_bwd_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("fxfuse::lora_linear_fwd", lib=_lib)
def _(x, weights, biases, bias_of, A, Bs, seeds, ranks, counts, scalings, dropout_p):
    # Traced means a real call is coming: its Triton specialisations start compiling now (on threads)
    background_compile.ask_ahead(K.prewarm, x, weights, [biases[k] if k >= 0 else None for k in bias_of], A, Bs,
                                 ranks, counts, dropout_p)
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights], x.new_empty((x.shape[0], A.shape[0]))


@torch.library.register_fake("fxfuse::lora_linear_bwd", lib=_lib)
def _(gys, x, weights, A, Bs, V, seeds, ranks, counts, scalings, dropout_p, need_gx, need_gw, need_gbias, need_ga,
      need_gb):
    return (x.new_empty(x.shape) if need_gx else x.new_empty(0),
            [w.new_empty(w.shape) for w in weights] if need_gw else [],
            [w.new_empty((w.shape[0],)) for w in weights] if need_gbias else [],
            A.new_empty(A.shape) if need_ga else A.new_empty(0),
            [B.new_empty(B.shape) for B in Bs] if need_gb else [])


# ================================================================================================ autograd
def _setup_context(ctx, inputs, output):
    x, weights, biases, bias_of, A, Bs, seeds, ranks, counts, scalings, dropout_p = inputs
    _ys, V = output
    ctx.mark_non_differentiable(V)
    ctx.set_materialize_grads(False)  # no zeros [N, R] grad for the saved activation V
    ctx.args = (list(ranks), list(counts), list(scalings), list(dropout_p))
    ctx.bias_of = list(bias_of)
    ctx.n_bias = len(biases)
    ctx.flags = (x.requires_grad, any(w.requires_grad for w in weights), any(b.requires_grad for b in biases),
                 A.requires_grad, any(B.requires_grad for B in Bs))
    # x is needed for grad A (and grad W); with LoRA it is saved anyway, so it is always saved (the fake impl of
    # the backward takes grad x's shape from it).
    ctx.save_for_backward(x, A, V, seeds, *weights, *Bs)
    ctx.n_proj = len(weights)


def _backward(ctx, gys, _gV):
    x, A, V, seeds, *rest = ctx.saved_tensors
    weights, Bs = rest[:ctx.n_proj], rest[ctx.n_proj:]
    # A projection whose output is unused in the loss gets no gradient (materialize_grads is off): zeros, so the
    # fused backward keeps one shape (rare: every projection of a layer normally feeds the loss).
    gys = [g if g is not None else x.new_zeros((x.shape[0], w.shape[0])) for g, w in zip(gys, weights)]
    gx, gws, gbiases, ga, gbs = torch.ops.fxfuse.lora_linear_bwd(gys, x, weights, A, Bs, V, seeds, *ctx.args,
                                                                 *ctx.flags)
    fx, fw, fbias, fa, fb = ctx.flags
    # Tensor-list inputs get a list of gradients (None entries allowed), whatever needs grad.
    gb_inputs = [None] * ctx.n_bias
    if fbias:
        for j, k in enumerate(ctx.bias_of):
            if k >= 0:
                gb_inputs[k] = gbiases[j]
    n = ctx.n_proj
    return (gx if fx else None, list(gws) if fw else [None] * n, gb_inputs, None, ga if fa else None,
            list(gbs) if fb else [None] * n, None, None, None, None, None)


torch.library.register_autograd("fxfuse::lora_linear_fwd", _backward, setup_context=_setup_context, lib=_lib)


# ================================================================================================ one-node ops
_lib.define(
    "lora_linear(Tensor x, Tensor weight, Tensor? bias, Tensor[] lora_a, Tensor[] lora_b, float[] scaling, "
    "float[] dropout_p) -> Tensor"
)
_lib.define(
    "lora_linear_group(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor[] lora_a, Tensor[] lora_b, "
    "int[] counts, float[] scaling, float[] dropout_p) -> Tensor[]"
)


def _lora_linear_group_composite(x, weights, biases, lora_a, lora_b, counts, scaling, dropout_p):
    din = x.shape[-1]
    x2 = x.reshape(-1, din)
    # Adapters in another dtype (fp32 adapters on a bf16 base) go in as they are: the op runs the matmuls in x's
    # dtype and returns their gradients in theirs (fp32-accumulated). Mixed adapter dtypes share the first one's.
    adt = lora_a[0].dtype
    lora_a = [a if a.dtype == adt else a.to(adt) for a in lora_a]
    lora_b = [b if b.dtype == adt else b.to(adt) for b in lora_b]
    A = lora_a[0] if len(lora_a) == 1 else torch.cat(list(lora_a), 0)
    Bs, i = [], 0
    for c in counts:
        Bs.append(lora_b[i] if c == 1 else torch.cat(list(lora_b[i:i + c]), 1))
        i += c
    ranks = [int(a.shape[0]) for a in lora_a]
    ps = [float(p) for p in dropout_p]
    present = [b for b in biases if b is not None]
    bias_of, k = [], 0
    for b in biases:
        bias_of.append(k if b is not None else -1)
        k += b is not None
    # Without dropout no seed is read: an empty tensor costs no kernel launch on the hot path.
    seeds = (K.draw_seeds(len(ps), x.device) if any(p > 0 for p in ps)
             else torch.empty((0,), dtype=torch.int64, device=x.device))
    ys, _V = torch.ops.fxfuse.lora_linear_fwd(x2, list(weights), present, bias_of, A, Bs, seeds, ranks,
                                              [int(c) for c in counts], [float(s) for s in scaling], ps)
    return [y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, weights)]


def _lora_linear_composite(x, weight, bias, lora_a, lora_b, scaling, dropout_p):
    return _lora_linear_group_composite(x, [weight], [bias], lora_a, lora_b, [len(lora_a)], scaling,
                                        dropout_p)[0]


_lib.impl("lora_linear", _lora_linear_composite, "CompositeImplicitAutograd")
_lib.impl("lora_linear_group", _lora_linear_group_composite, "CompositeImplicitAutograd")
# Under autocast (AMP) the base and adapter linears run in the autocast dtype: so does the op (``fxfuse.autocast``).
register_autocast_casts("lora_linear", ("x", "weight", "bias", "lora_a", "lora_b"))
register_autocast_casts("lora_linear_group", ("x", "weights", "biases", "lora_a", "lora_b"))


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


def lora_linear_group(x: Tensor, weights: Sequence[Tensor], lora_a: Sequence[Sequence[Tensor]],
                      lora_b: Sequence[Sequence[Tensor]], scaling: Sequence[Sequence[float]], *,
                      biases: Optional[Sequence[Optional[Tensor]]] = None,
                      dropout_p: Optional[Sequence[Sequence[float]]] = None) -> List[Tensor]:
    """Several LoRA linears that read the same ``x`` (q/k/v, gate/up): ``[lora_linear(x, weights[j], lora_a[j],
    lora_b[j], scaling[j], bias=biases[j], dropout_p=dropout_p[j]) for j]``, masks included, computed together
    (x read once per tile by the dropout kernels, grad x accumulated in one buffer). Per projection j:
    ``lora_a[j]`` / ``lora_b[j]`` / ``scaling[j]`` / ``dropout_p[j]`` are lists, one entry per adapter."""
    n = len(weights)
    biases = list(biases) if biases is not None else [None] * n
    dropout_p = [list(p) for p in dropout_p] if dropout_p is not None else [[0.0] * len(a) for a in lora_a]
    if not (len(lora_a) == len(lora_b) == len(scaling) == len(dropout_p) == len(biases) == n) or n == 0:
        OpContract(_OP + "_group", x=x).fail(
            f"one weight, bias and lora_a / lora_b / scaling / dropout_p list per projection, got {n}, "
            f"{len(biases)}, {len(lora_a)}, {len(lora_b)}, {len(scaling)}, {len(dropout_p)}")
    for j in range(n):
        _check_lora_linear(x, weights[j], biases[j], list(lora_a[j]), list(lora_b[j]),
                           [float(s) for s in scaling[j]], [float(p) for p in dropout_p[j]])
    return torch.ops.fxfuse.lora_linear_group.default(
        x, list(weights), biases, [a for aa in lora_a for a in aa], [b for bb in lora_b for b in bb],
        [len(a) for a in lora_a], [float(s) for ss in scaling for s in ss], [float(p) for pp in dropout_p for p in pp])


def lora_dropout_keep_mask(seed: Tensor, n_rows: int, in_features: int, p: float, device) -> Tensor:
    """The bool [n_rows, in_features] keep mask ``fxfuse::lora_linear`` draws for one adapter from ``seed`` on
    ``device``'s path (for references in tests and debugging)."""
    return K.dropout_keep_mask(seed, n_rows, in_features, p, device)
