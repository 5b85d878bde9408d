"""``fxfuse::vocab_parallel_cross_entropy``: the fused lm-head loss when the lm-head's weight is split over the
vocabulary between ranks (tensor parallelism: ``ColwiseParallel`` on the lm-head, Megatron's vocab-parallel
cross-entropy).

Each rank holds the rows ``[start, start + V_local)`` of the [V, D] weight (``torch.chunk`` order, DTensor's
``Shard(0)``) and the whole hidden [N, D] and target [N]. Per rank, the fused row kernels of
:mod:`fxfuse.kernels.linear_cross_entropy` run over its slice only (the [N, V_local] logits never exist); the ranks
then combine three numbers per row:

* the row max ``M = max_r mx_r`` (one all-reduce MAX, fp32: the ranks' maxima are exact kernel values);
* ``S = sum_r exp(mx_r - M + ls_r)`` and the target logit ``z_y`` (one all-reduce SUM of a [2, N] fp64 tensor:
  exactly one rank holds each target, so its ``z_y`` arrives unrounded, and the fp64 sum keeps a peaked row's
  ``log S`` ~1e-5 exact, where fp32 would round 1 + 1e-5);
* loss = ``(M - z_y) + log S``, exactly 0 - 0 + log S on a row whose target is its max, as the one-rank kernel.

The backward recomputes each rank's logits chunk by chunk from the combined statistics (``p = exp(z - M - log S)``,
the one-hot term only on the rank that holds the target) and all-reduces grad_hidden (each rank's is a partial
sum over its vocabulary slice, all-reduced in fp32 and rounded once: DTensor's own loss all-reduces partials already
rounded to bf16); grad_weight stays the rank's slice. Four matmuls instead of the one-rank op's
three (the gradients cannot be formed in the forward: they need the other ranks' statistics first). What is
communicated is O(N) per row plus grad_hidden, which the unfused lm-head's backward all-reduces too; the logits'
all-gather of a gathered-output lm-head ([N, V] per rank) is gone.

Collectives run inside the op (the process group is named by ``group_name``), so under torch.compile the op is one
opaque node and the graph around it holds local tensors.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..contracts import OpContract
from ..kernels import linear_cross_entropy as K
from ._lm_head import LM_HEAD_DTYPES, check_class_indices, chunk_budget

__all__ = ["vocab_parallel_cross_entropy", "vocab_slice"]

_OP = "fxfuse::vocab_parallel_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")


def _group(group_name: str):
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
        start, length = vocab_slice(vocab_size, rank, world)
        if weight.shape[0] != length:
            c.fail(f"rank {rank} of {world} holds {weight.shape[0]} vocabulary rows of the weight, but a "
                   f"{vocab_size}-entry vocabulary split as torch.chunk / DTensor Shard(0) gives it {length} "
                   f"(rows {start}..{start + length - 1})")


def _local_targets(target: Tensor, start: int, length: int, ignore_index: int) -> Tensor:
    """The rank's view of the targets: a class it holds as its local row, one it does not as ``length`` (outside
    [0, length): "absent", the row counts without a one-hot term; ``length + 1`` if ``length`` is the ignore_index),
    ignored rows as ``ignore_index``."""
    absent = length if length != ignore_index else length + 1
    held = (target >= start) & (target < start + length)
    local = torch.where(held, target - start, absent)
    return torch.where(target == ignore_index, ignore_index, local)


# ================================================================================================ ops
@torch.library.custom_op("fxfuse::vocab_parallel_cross_entropy_fwd", mutates_args=())
def vocab_parallel_cross_entropy_fwd(
    hidden: Tensor, weight: Tensor, target: Tensor, vocab_size: int, group_name: str, ignore_index: int,
    reduction: str, softcap: float, scale: float, chunk_bytes: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    pg = _group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    _check(hidden, weight, target, vocab_size, reduction, softcap, world, rank)
    check_class_indices(_OP, target, vocab_size, ignore_index)
    start, length = vocab_slice(vocab_size, rank, world)
    target = target.long()
    local = _local_targets(target, start, length, ignore_index)
    # this rank's row statistics and target logits (0 where the class is another rank's)
    z_y, lse, _gh, _gw, _gb = K.lce_forward(hidden, weight, local, None, ignore_index, "none", softcap, scale, 0.0,
                                            False, False, False, False, chunk_budget(chunk_bytes, weight),
                                            target_logit=True)
    m = lse[0].clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=pg)
    parts = torch.stack([torch.exp((lse[0] - m).double() + lse[1].double()), z_y.double()])
    dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=pg)
    log_s = torch.log(parts[0])
    valid = target != ignore_index
    rows = torch.where(valid, (m.double() - parts[1]) + log_s, 0.0)  # fp64 until reduced: O(N) work
    if reduction == "none":
        loss = rows.float()
    elif reduction == "sum":
        loss = rows.sum().float()
    else:
        loss = (rows.sum() / valid.sum()).float()  # 0/0 = nan when every row is ignored, like torch
    stats = torch.stack([m, log_s.float()])  # the combined row statistics: max, log S
    return loss, stats, local


@vocab_parallel_cross_entropy_fwd.register_fake
def _(hidden, weight, target, vocab_size, group_name, ignore_index, reduction, softcap, scale, chunk_bytes):
    _check(hidden, weight, target, vocab_size, reduction, softcap)
    N = hidden.shape[0]
    f32 = torch.float32
    loss = hidden.new_empty((N,) if reduction == "none" else (), dtype=f32)
    return loss, hidden.new_empty((2, N), dtype=f32), target.new_empty((N,), dtype=torch.long)


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
        dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=_group(group_name))
        gh = gh.to(hidden.dtype)
    return gh, gw


@vocab_parallel_cross_entropy_bwd.register_fake
def _(grad_loss, hidden, weight, local_target, stats, group_name, ignore_index, reduction, softcap, scale,
      grad_hidden, grad_weight, chunk_bytes):
    return (hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if grad_weight else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, target, vocab_size, group_name, ignore_index, reduction, softcap, scale, chunk_bytes = inputs
    _loss, stats, local = output
    ctx.mark_non_differentiable(stats, local)
    ctx.set_materialize_grads(False)
    ctx.args = (group_name, ignore_index, reduction, softcap, scale)
    ctx.chunk_bytes = chunk_bytes
    ctx.save_for_backward(hidden, weight, local, stats)


def _backward(ctx, grad_loss, _g_stats, _g_local):
    hidden, weight, local, stats = ctx.saved_tensors
    fh, fw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gh, gw = torch.ops.fxfuse.vocab_parallel_cross_entropy_bwd(grad_loss, hidden, weight, local, stats, *ctx.args,
                                                               fh, fw, ctx.chunk_bytes)
    return (gh if fh else None, gw if fw else None) + (None,) * 8


vocab_parallel_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)


# ================================================================================================ graph op
# One node returning the loss, as the passes insert it (the hidden and target flattened inside, at trace time).
_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(
    "vocab_parallel_cross_entropy(Tensor hidden, Tensor weight, Tensor target, int vocab_size, str group_name, "
    "int ignore_index=-100, str reduction='mean', float softcap=0.0, float scale=1.0, int chunk_bytes=0) -> Tensor")


def _composite(hidden, weight, target, vocab_size, group_name, ignore_index=-100, reduction="mean", softcap=0.0,
               scale=1.0, chunk_bytes=0):
    return torch.ops.fxfuse.vocab_parallel_cross_entropy_fwd(
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), vocab_size, group_name, ignore_index,
        reduction, float(softcap), float(scale), int(chunk_bytes))[0]


_lib.impl("vocab_parallel_cross_entropy", _composite, "CompositeImplicitAutograd")


# ================================================================================================ public API
def vocab_parallel_cross_entropy(hidden: Tensor, weight_shard: Tensor, target: Tensor, *, vocab_size: int,
                                 group: Optional[dist.ProcessGroup] = None, ignore_index: int = -100,
                                 reduction: str = "mean", softcap: Optional[float] = None,
                                 scale: Optional[float] = None, chunk_bytes: Optional[int] = None) -> Tensor:
    """``F.cross_entropy(softcap(hidden @ W.T * scale), target)`` where this rank holds only its slice
    ``weight_shard`` of W's vocabulary rows (``torch.chunk(W, world)[rank]``, DTensor's ``Shard(0)``) and every
    rank of ``group`` calls it with the same ``hidden`` [..., D] and ``target`` [...]. Returns the same loss on
    every rank (fp32: a scalar for "mean"/"sum", ``target``'s shape for "none"); grad_hidden is the full gradient
    on every rank, grad of ``weight_shard`` this rank's slice. Neither the [N, V] logits nor a slice of them is
    materialised; see the module docstring for what is communicated."""
    group = group if group is not None else dist.group.WORLD
    loss = torch.ops.fxfuse.vocab_parallel_cross_entropy.default(
        hidden, weight_shard, target, int(vocab_size), group.group_name, int(ignore_index), reduction,
        float(softcap or 0.0), float(1.0 if scale is None else scale), int(chunk_bytes or 0))
    return loss.view(target.shape) if reduction == "none" else loss
