"""``fxfuse::vocab_parallel_cross_entropy``: the fused lm-head loss when the lm-head's weight is split over the
vocabulary between ranks (tensor parallelism: ``ColwiseParallel`` on the lm-head, Megatron's vocab-parallel
cross-entropy).

Each rank holds the rows ``[start, start + V_local)`` of the [V, D] weight (``torch.chunk`` order, DTensor's
``Shard(0)``) and the whole hidden [N, D] and target [N]. Per rank, the fused row kernels of
:mod:`fxfuse.kernels.linear_cross_entropy` run over its slice only (the [N, V_local] logits never exist); the ranks
then combine three numbers per row:

* the row max ``M = max_r mx_r`` (one all-reduce MAX, fp32: the ranks' maxima are exact kernel values);
* ``S = sum_r exp(mx_r - M + ls_r)`` (one all-reduce SUM in fp64: it keeps a peaked row's ``log S`` ~1e-5 exact,
  where fp32 would round 1 + 1e-5);
* the target logit ``z_y`` (one all-reduce SUM in fp64: exactly one rank holds each target, so it arrives
  unrounded);
* loss = ``(M - z_y) + log S``, exactly 0 - 0 + log S on a row whose target is its max, as the one-rank kernel.

For a scalar loss the gradients are formed in the forward, chunk by chunk: each chunk's statistics are combined
across the ranks (the two all-reduces above, per chunk, on the chunk's rows) before its gradient
``p = exp(z - M - log S)`` minus the one-hot term (only on the rank that holds the target) is formed, so the
logits are computed once: three matmuls, as the one-rank op; the backward scales them by the upstream scalar.
A per-token loss (``reduction="none"``) or ``grad_in_forward=False`` recomputes the logits in the backward
instead (four matmuls). grad_hidden is all-reduced (each rank's is a partial
sum over its vocabulary slice, all-reduced in fp32 and rounded once: DTensor's own loss all-reduces partials already
rounded to bf16); grad_weight stays the rank's slice. What is
communicated is O(N) numbers plus grad_hidden, which the unfused lm-head's backward all-reduces too; the logits'
all-gather of a gathered-output lm-head ([N, V] per rank) is gone.

Collectives run inside the op (the process group is named by ``group_name``), so under torch.compile the op is one
opaque node and the graph around it holds local tensors.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..autocast import register_autocast_casts
from ..contracts import OpContract
from ..kernels import linear_cross_entropy as K
from ..errors import FxFuseError
from ._lm_head import LM_HEAD_DTYPES, check_class_indices, chunk_budget, flatten_and_grad_flags
from . import linear_cross_entropy  # noqa: F401  (registers the scale_grads_ op this backward reuses)

__all__ = ["check_rank_slice", "combine_row_stats", "local_targets", "process_group", "vocab_parallel_cross_entropy",
           "vocab_slice"]

_OP = "fxfuse::vocab_parallel_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")


def process_group(group_name: str):
    """The process group a vocabulary-parallel op is given by name (a graph can carry a string, not a group)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def vocab_slice(vocab_size: int, rank: int, world: int) -> Tuple[int, int]:
    """(start, length) of rank ``rank``'s rows of a [vocab_size, D] weight split in ``world`` parts the way
    ``torch.chunk`` and DTensor's ``Shard(0)`` split it (every part ceil(V / world) rows, the last ones shorter or
    empty)."""
    size = -(-vocab_size // world)
    start = min(rank * size, vocab_size)
    return start, min(size, vocab_size - start)


def _check(hidden, weight, target, vocab_size, reduction, softcap, world=None, rank=None):
    c = OpContract(_OP, hidden=hidden, weight=weight, target=target)
    c.lm_head_operands("hidden", "weight", "target", None, LM_HEAD_DTYPES)
    if reduction not in _REDUCTIONS:
        c.fail(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if softcap < 0:
        c.fail(f"softcap must be > 0 (or 0 for none), got {softcap}")
    if world is not None:
        check_rank_slice(c, weight, vocab_size, rank, world)


def check_rank_slice(c: OpContract, weight: Tensor, vocab_size: int, rank: int, world: int) -> None:
    """The contract every vocabulary-parallel op checks: ``weight`` holds exactly rank ``rank``'s rows of the
    vocabulary, split as torch.chunk / DTensor Shard(0) split it."""
    start, length = vocab_slice(vocab_size, rank, world)
    if weight.shape[0] != length:
        c.fail(f"rank {rank} of {world} holds {weight.shape[0]} vocabulary rows of the weight, but a "
               f"{vocab_size}-entry vocabulary split as torch.chunk / DTensor Shard(0) gives it {length} "
               f"(rows {start}..{start + length - 1})")


def local_targets(target: Tensor, start: int, length: int, ignore_index: int) -> Tensor:
    """The rank's view of the targets: a class it holds as its local row, one it does not as ``length`` (outside
    [0, length): "absent", the row counts without a one-hot term; ``length + 1`` if ``length`` is the ignore_index),
    ignored rows as ``ignore_index``."""
    absent = length if length != ignore_index else length + 1
    held = (target >= start) & (target < start + length)
    local = torch.where(held, target - start, absent)
    return torch.where(target == ignore_index, ignore_index, local)


# ================================================================================================ ops
def combine_row_stats(mx: Tensor, ls: Tensor, pg) -> Tuple[Tensor, Tensor]:
    """The whole vocabulary's row max M and log S = log sum_r exp(mx_r - M + ls_r) from each rank's (mx, ls):
    one all-reduce MAX (fp32: the ranks' maxima are exact kernel values), one SUM in fp64 (a peaked row's
    S = 1 + 1e-5 keeps its 1e-5)."""
    m = mx.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=pg)
    s = torch.exp((mx - m).double() + ls.double())
    dist.all_reduce(s, op=dist.ReduceOp.SUM, group=pg)
    return m, torch.log(s)


def _reduce_rows(m: Tensor, log_s: Tensor, zy: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """The loss from the combined statistics and the target logits: (M - z_y) + log S per row (exactly log S on a
    row whose target is its max), in fp64 until reduced (O(N) work), fp32 out."""
    valid = target != ignore_index
    rows = torch.where(valid, (m.double() - zy.double()) + log_s.double(), 0.0)
    if reduction == "none":
        return rows.float()
    if reduction == "sum":
        return rows.sum().float()
    return (rows.sum() / valid.sum()).float()  # 0/0 = nan when every row is ignored, like torch


def _writes(reduction: str, grad_in_forward: bool, grad_hidden: bool, grad_weight: bool) -> Tuple[bool, bool]:
    """Which gradients the forward computes (real and fake impls must agree): with ``grad_in_forward`` for a
    scalar loss, those asked for."""
    on = grad_in_forward and reduction != "none" and (grad_hidden or grad_weight)
    return bool(on and grad_hidden), bool(on and grad_weight)


@torch.library.custom_op("fxfuse::vocab_parallel_cross_entropy_fwd", mutates_args=())
def vocab_parallel_cross_entropy_fwd(
    hidden: Tensor, weight: Tensor, target: Tensor, vocab_size: int, group_name: str, ignore_index: int,
    reduction: str, softcap: float, scale: float, chunk_bytes: int, grad_in_forward: bool, grad_hidden: bool,
    grad_weight: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    pg = process_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    _check(hidden, weight, target, vocab_size, reduction, softcap, world, rank)
    check_class_indices(_OP, target, vocab_size, ignore_index)
    start, length = vocab_slice(vocab_size, rank, world)
    target = target.long()
    local = local_targets(target, start, length, ignore_index)
    budget = chunk_budget(chunk_bytes, weight, -(-vocab_size // world))  # the same on every rank
    wh, ww = _writes(reduction, grad_in_forward, grad_hidden, grad_weight)
    empty = hidden.new_empty(0)
    if wh or ww:
        # the gradients chunk by chunk in this pass, each chunk's statistics combined across the ranks before its
        # gradient is formed (three matmuls)
        stats, zy, gh, gw = K.lce_forward_split_vocab(
            hidden, weight, local, ignore_index, reduction, softcap, scale, wh, ww, budget,
            lambda mx, ls: combine_row_stats(mx, ls, pg), -(-vocab_size // world))
        if wh:  # each rank's is the part of the sum over its vocabulary slice: summed in fp32, rounded once
            dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=pg)
            gh = gh.to(hidden.dtype)
        m, log_s = stats[0], stats[1]
    else:
        # this rank's row statistics and target logits; the gradients, if any, by recomputation in the backward
        zy, lse, gh, gw, _gb = K.lce_forward(hidden, weight, local, None, ignore_index, "none", softcap, scale, 0.0,
                                             False, False, False, False, budget, target_logit=True)
        m, log_s = combine_row_stats(lse[0], lse[1], pg)
        stats = torch.stack([m, log_s.float()])
        gh, gw = empty, hidden.new_empty(0)
    zy = zy.double()  # exactly one rank holds each target: the sum is that rank's z_y, unrounded
    dist.all_reduce(zy, op=dist.ReduceOp.SUM, group=pg)
    loss = _reduce_rows(m, log_s, zy, target, ignore_index, reduction)
    consumed = torch.zeros((), dtype=torch.float32, device=hidden.device)
    return loss, stats, local, gh, gw, consumed


@vocab_parallel_cross_entropy_fwd.register_fake
def _(hidden, weight, target, vocab_size, group_name, ignore_index, reduction, softcap, scale, chunk_bytes,
      grad_in_forward, grad_hidden, grad_weight):
    _check(hidden, weight, target, vocab_size, reduction, softcap)
    N = hidden.shape[0]
    f32 = torch.float32
    wh, ww = _writes(reduction, grad_in_forward, grad_hidden, grad_weight)
    loss = hidden.new_empty((N,) if reduction == "none" else (), dtype=f32)
    return (loss, hidden.new_empty((2, N), dtype=f32), target.new_empty((N,), dtype=torch.long),
            hidden.new_empty(hidden.shape) if wh else hidden.new_empty(0),
            weight.new_empty(weight.shape) if ww else hidden.new_empty(0), hidden.new_empty((), dtype=f32))


@torch.library.custom_op("fxfuse::vocab_parallel_cross_entropy_bwd", mutates_args=())
def vocab_parallel_cross_entropy_bwd(
    grad_loss: Tensor, hidden: Tensor, weight: Tensor, local_target: Tensor, stats: Tensor, group_name: str,
    ignore_index: int, reduction: str, softcap: float, scale: float, grad_hidden: bool, grad_weight: bool,
    chunk_bytes: int,
) -> Tuple[Tensor, Tensor]:
    gh, gw, _gb = K.lce_backward(grad_loss, hidden, weight, local_target, None, stats, ignore_index, reduction,
                                 softcap, scale, 0.0, grad_hidden, grad_weight, False,
                                 chunk_budget(chunk_bytes, weight), grad_hidden_fp32=True)
    if grad_hidden:  # each rank's is the part of the sum over its vocabulary slice: summed in fp32, rounded once
        dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=process_group(group_name))
        gh = gh.to(hidden.dtype)
    return gh, gw


@vocab_parallel_cross_entropy_bwd.register_fake
def _(grad_loss, hidden, weight, local_target, stats, group_name, ignore_index, reduction, softcap, scale,
      grad_hidden, grad_weight, chunk_bytes):
    return (hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if grad_weight else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    (hidden, weight, target, vocab_size, group_name, ignore_index, reduction, softcap, scale, chunk_bytes,
     grad_in_forward, grad_hidden, grad_weight) = inputs
    _loss, stats, local, gh, gw, consumed = output
    ctx.mark_non_differentiable(stats, local, gh, gw, consumed)
    ctx.set_materialize_grads(False)
    wh, ww = _writes(reduction, grad_in_forward, grad_hidden, grad_weight)
    ctx.in_forward = wh or ww
    ctx.args = (group_name, ignore_index, reduction, softcap, scale)
    ctx.flags = (grad_hidden, grad_weight)
    ctx.chunk_bytes = chunk_bytes
    ctx.consumed = False
    if ctx.in_forward:
        ctx.save_for_backward(gh, gw, consumed)
    else:
        ctx.save_for_backward(hidden, weight, local, stats)


def _backward(ctx, grad_loss, *_unused):
    fh, fw = ctx.flags
    if ctx.in_forward:
        if ctx.consumed:
            raise FxFuseError(
                f"{_OP}: backward ran twice through a call whose gradients were computed in the forward "
                "(retain_graph=True?); call with grad_in_forward=False to backpropagate more than once.")
        ctx.consumed = True
        gh, gw, consumed = ctx.saved_tensors
        # the saved gradients scaled by the upstream scalar in place (the one-rank op's backward op)
        torch.ops.fxfuse.linear_cross_entropy_scale_grads_(gh, gw, gh.new_empty(0), grad_loss, consumed)
    else:
        hidden, weight, local, stats = ctx.saved_tensors
        gh, gw = torch.ops.fxfuse.vocab_parallel_cross_entropy_bwd(grad_loss, hidden, weight, local, stats,
                                                                   *ctx.args, fh, fw, ctx.chunk_bytes)
    return (gh if fh else None, gw if fw else None) + (None,) * 11


vocab_parallel_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)


# ================================================================================================ graph op
# One node returning the loss, as the passes insert it: the hidden and target flattened, and which gradients to
# compute read from requires_grad, at trace time (a CompositeImplicitAutograd body, as the one-rank op's).
_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(
    "vocab_parallel_cross_entropy(Tensor hidden, Tensor weight, Tensor target, int vocab_size, str group_name, "
    "int ignore_index=-100, str reduction='mean', float softcap=0.0, float scale=1.0, int chunk_bytes=0, "
    "bool grad_in_forward=True) -> Tensor")


def _composite(hidden, weight, target, vocab_size, group_name, ignore_index=-100, reduction="mean", softcap=0.0,
               scale=1.0, chunk_bytes=0, grad_in_forward=True):
    h2, t1, gh, gw, _gb = flatten_and_grad_flags(hidden, weight, target, None)
    return torch.ops.fxfuse.vocab_parallel_cross_entropy_fwd(
        h2, weight, t1, vocab_size, group_name, ignore_index, reduction, float(softcap), float(scale),
        int(chunk_bytes), bool(grad_in_forward), gh, gw)[0]


_lib.impl("vocab_parallel_cross_entropy", _composite, "CompositeImplicitAutograd")
# AMP: the lm-head matmul it replaces runs on autocast-dtype operands, so the op does too (without this rule an
# fp32 model under bf16 autocast got fp32 GEMMs over its vocabulary slice: the HF Trainer with accelerate's TP)
register_autocast_casts("vocab_parallel_cross_entropy", ("hidden", "weight"))


# ================================================================================================ public API
def vocab_parallel_cross_entropy(hidden: Tensor, weight_shard: Tensor, target: Tensor, *, vocab_size: int,
                                 group: Optional[dist.ProcessGroup] = None, ignore_index: int = -100,
                                 reduction: str = "mean", softcap: Optional[float] = None,
                                 scale: Optional[float] = None, chunk_bytes: Optional[int] = None,
                                 grad_in_forward: Optional[bool] = None) -> Tensor:
    """``F.cross_entropy(softcap(hidden @ W.T * scale), target)`` where this rank holds only its slice
    ``weight_shard`` of W's vocabulary rows (``torch.chunk(W, world)[rank]``, DTensor's ``Shard(0)``) and every
    rank of ``group`` calls it with the same ``hidden`` [..., D] and ``target`` [...]. Returns the same loss on
    every rank (fp32: a scalar for "mean"/"sum", ``target``'s shape for "none"); grad_hidden is the full gradient
    on every rank, grad of ``weight_shard`` this rank's slice. Neither the [N, V] logits nor a slice of them is
    materialised; see the module docstring for what is communicated. ``grad_in_forward`` (default: for a scalar
    loss) forms the gradients in the forward (three matmuls; the backward only scales them), else the backward
    recomputes the logits (four)."""
    group = group if group is not None else dist.group.WORLD
    loss = torch.ops.fxfuse.vocab_parallel_cross_entropy.default(
        hidden, weight_shard, target, int(vocab_size), group.group_name, int(ignore_index), reduction,
        float(softcap or 0.0), float(1.0 if scale is None else scale), int(chunk_bytes or 0),
        (reduction != "none") if grad_in_forward is None else bool(grad_in_forward))
    return loss.view(target.shape) if reduction == "none" else loss
