"""``fxfuse::vocab_parallel_log_probs``: per-token log-probabilities and entropy of an lm-head whose weight is split
over the vocabulary between ranks (tensor parallelism: ``ColwiseParallel`` on the lm-head), without any rank
holding logits: the RL / preference losses' ``selective_log_softmax`` + ``entropy_from_logits`` of
:mod:`fxfuse.ops.linear_log_probs`, across ranks.

Each rank holds the rows ``[start, start + V_local)`` of the [V, D] weight (``torch.chunk`` order, DTensor's
``Shard(0)``; :func:`~fxfuse.ops.vocab_parallel_cross_entropy.vocab_slice`) and the whole hidden [N, D] and index
[N]. The one-rank row kernels of :mod:`fxfuse.kernels.linear_log_probs` run over the rank's slice, ``z =
softcap(hidden @ W_r.T) / temperature`` chunk by chunk, and leave per row: the slice's max ``mx_r``, ``ls_r = log
sum exp(z - mx_r)``, ``ez_r = E_{p_r}[z] - mx_r`` (the slice's own softmax) and the picked logit ``z_y`` where the
index falls in the slice. The ranks then combine, all O(N):

* ``M = max_r mx_r`` (all-reduce MAX, fp32) and ``log S = log sum_r exp(mx_r - M + ls_r)`` (SUM in fp64);
* one SUM in fp64 of ``z_y - M`` (exactly one rank holds each index, so it arrives unrounded) and, with the
  entropy, of ``w_r (ez_r + mx_r - M)``, ``w_r = exp(mx_r - M + ls_r - log S)`` the slice's share of the softmax
  mass, which sums to ``E_p[z] - M``;
* ``logp = (z_y - M) - log S`` and ``H = log S - (E_p[z] - M)``: two terms >= 0, as the one-rank kernel keeps them
  (no lse - E_p[z] cancellation).

The backward recomputes each rank's logits and runs the one-rank backward row kernel with the combined statistics
(``p = exp(z - M - log S)`` is the whole vocabulary's softmax, ``z - E_p[z]`` the entropy's centre; an index
another rank holds gets no one-hot term): d/dz = g_logp (onehot - p) - g_ent p (z - E_p[z]) for any per-token
upstream gradients (advantages, masks, importance ratios). grad_hidden, each rank's partial sum over its slice, is
all-reduced in fp32 and rounded once; grad_weight is the rank's slice. Four matmuls, as the one-rank op's
recompute path; collectives run inside the op, the process group passed by name.

``fxfuse::vocab_parallel_log_probs_loss`` is the same with the loss known (the ``log_probs_loss`` pass carries it
as a small program, as for :mod:`fxfuse.ops.log_probs_loss` on one GPU): chunk by chunk the ranks combine the chunk's
statistics, every rank runs the loss on the whole-vocabulary log-probs so far for the chunk's per-token upstream
gradients, and each forms its slice's gradient there: three matmuls, the logits projected once. Its ``carrier``
output (a 0-dim zero added to the loss) scales those gradients by the loss's upstream gradient in the backward.
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..autocast import register_autocast_casts
from ..contracts import OpContract
from ..kernels import linear_log_probs as K
from ..errors import FxFuseError
from ._lm_head import LM_HEAD_DTYPES, check_class_indices, chunk_budget, flatten_and_grad_flags
from .log_probs_loss import tail_gradients
from .vocab_parallel_cross_entropy import check_rank_slice, combine_row_stats, local_targets, process_group, \
    vocab_slice

__all__ = ["vocab_parallel_log_probs"]

_OP = "fxfuse::vocab_parallel_log_probs"
#: ``local_targets``' ignore_index where every row is a real token (indices are checked to lie in [0, V))
_NO_IGNORE = -1


def _check(hidden, weight, index, vocab_size, temperature, softcap, world=None, rank=None):
    c = OpContract(_OP, hidden=hidden, weight=weight, index=index)
    c.lm_head_operands("hidden", "weight", "index", None, LM_HEAD_DTYPES)
    if not (temperature > 0):
        c.fail(f"temperature must be > 0, got {temperature}")
    if softcap < 0:
        c.fail(f"softcap must be > 0 (or 0 for none), got {softcap}")
    if world is not None:
        check_rank_slice(c, weight, vocab_size, rank, world)


def _rank_view(hidden, weight, index, vocab_size, group_name, temperature, softcap):
    """Both forward ops' start: the process group, the contract checked for this rank, and the indices as int64,
    as this rank's slice reads them (another rank's: absent) and where this rank holds them."""
    pg = process_group(group_name)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    _check(hidden, weight, index, vocab_size, temperature, softcap, world, rank)
    check_class_indices(_OP, index, vocab_size, None, what="index")
    start, length = vocab_slice(vocab_size, rank, world)
    index = index.long()
    return pg, index, local_targets(index, start, length, _NO_IGNORE), (index >= start) & (index < start + length)


def _combine(lse: Tensor, ez: Optional[Tensor], zy: Tensor, held: Tensor, pg) -> Tuple[Tensor, Tensor, Tensor,
                                                                                       Optional[Tensor]]:
    """(M fp32, log S fp64, z_y - M fp64, E_p[z] - M fp64 or None) over the whole vocabulary from this rank's row
    statistics ``lse`` [2, N] (mx_r, ls_r), ``ez`` [N] (E_{p_r}[z] - mx_r, or None), picked logits ``zy`` [N]
    (valid where ``held``)."""
    m, log_s = combine_row_stats(lse[0], lse[1], pg)
    shift = (lse[0] - m).double()  # mx_r - M <= 0, exact: both are fp32 kernel values
    zym = torch.where(held, zy.double() - m.double(), 0.0)
    if ez is None:
        dist.all_reduce(zym, op=dist.ReduceOp.SUM, group=pg)
        return m, log_s, zym, None
    w = torch.exp(shift + lse[1].double() - log_s)  # this slice's share of the softmax mass
    both = torch.stack([zym, w * (ez.double() + shift)])
    dist.all_reduce(both, op=dist.ReduceOp.SUM, group=pg)
    return m, log_s, both[0], both[1]


@torch.library.custom_op("fxfuse::vocab_parallel_log_probs_fwd", mutates_args=())
def vocab_parallel_log_probs_fwd(
    hidden: Tensor, weight: Tensor, index: Tensor, vocab_size: int, group_name: str, temperature: float,
    softcap: float, return_entropy: bool, chunk_bytes: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    pg, index, local, held = _rank_view(hidden, weight, index, vocab_size, group_name, temperature, softcap)
    zy, _ent, lse, ez = K.logp_forward(hidden, weight, local, None, float(temperature), float(softcap),
                                       bool(return_entropy), chunk_budget(chunk_bytes, weight),
                                       target_logit=True)[:4]
    m, log_s, zym, ezm = _combine(lse, ez if return_entropy else None, zy, held, pg)
    logp = (zym - log_s).float()
    stats = torch.stack([m, log_s.float()])  # the backward's row max and log S
    if return_entropy:
        return logp, (log_s - ezm).float(), stats, ezm.float(), local
    return logp, hidden.new_empty(0, dtype=torch.float32), stats, hidden.new_empty(0, dtype=torch.float32), local


@vocab_parallel_log_probs_fwd.register_fake
def _(hidden, weight, index, vocab_size, group_name, temperature, softcap, return_entropy, chunk_bytes):
    _check(hidden, weight, index, vocab_size, temperature, softcap)
    N = hidden.shape[0]
    f32 = torch.float32
    per_token = hidden.new_empty((N,) if return_entropy else (0,), dtype=f32)
    return (hidden.new_empty((N,), dtype=f32), per_token, hidden.new_empty((2, N), dtype=f32),
            hidden.new_empty((N,) if return_entropy else (0,), dtype=f32), index.new_empty((N,), dtype=torch.long))


@torch.library.custom_op("fxfuse::vocab_parallel_log_probs_bwd", mutates_args=())
def vocab_parallel_log_probs_bwd(
    grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], hidden: Tensor, weight: Tensor,
    local_index: Tensor, stats: Tensor, ez: Tensor, group_name: str, temperature: float, softcap: float,
    grad_hidden: bool, grad_weight: bool, chunk_bytes: int,
) -> Tuple[Tensor, Tensor]:
    gh, gw, _gb = K.logp_backward(grad_logp, grad_entropy, hidden, weight, local_index, None, stats, ez,
                                  float(temperature), float(softcap), grad_hidden, grad_weight, False,
                                  chunk_budget(chunk_bytes, weight), grad_hidden_fp32=True)
    if grad_hidden:  # each rank's is the part of the sum over its vocabulary slice: summed in fp32, rounded once
        dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=process_group(group_name))
        gh = gh.to(hidden.dtype)
    return gh, gw


@vocab_parallel_log_probs_bwd.register_fake
def _(grad_logp, grad_entropy, hidden, weight, local_index, stats, ez, group_name, temperature, softcap, grad_hidden,
      grad_weight, chunk_bytes):
    return (hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if grad_weight else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, _index, _vocab_size, group_name, temperature, softcap, return_entropy, chunk_bytes = inputs
    _logp, _ent, stats, ez, local = output
    ctx.mark_non_differentiable(stats, ez, local)
    ctx.set_materialize_grads(False)  # an output nobody reads gets None: its term is skipped in the row kernel
    ctx.args = (group_name, float(temperature), float(softcap))
    ctx.entropy = bool(return_entropy)
    ctx.chunk_bytes = chunk_bytes
    ctx.save_for_backward(hidden, weight, local, stats, ez)


def _backward(ctx, g_logp, g_ent, *_no_grad):
    hidden, weight, local, stats, ez = ctx.saved_tensors
    fh, fw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gh, gw = torch.ops.fxfuse.vocab_parallel_log_probs_bwd(g_logp, g_ent if ctx.entropy else None, hidden, weight,
                                                           local, stats, ez, *ctx.args, fh, fw, ctx.chunk_bytes)
    return (gh if fh else None, gw if fw else None) + (None,) * 7


vocab_parallel_log_probs_fwd.register_autograd(_backward, setup_context=_setup_context)


# ================================================================================================ graph op
# One node, as the passes insert it: the hidden states and index flattened (a CompositeImplicitAutograd body).
_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(
    "vocab_parallel_log_probs(Tensor hidden, Tensor weight, Tensor index, int vocab_size, str group_name, "
    "float temperature=1.0, float softcap=0.0, bool return_entropy=False, int chunk_bytes=0) -> (Tensor, Tensor)")


def _composite(hidden, weight, index, vocab_size, group_name, temperature=1.0, softcap=0.0, return_entropy=False,
               chunk_bytes=0):
    h2, i1, _gh, _gw, _gb = flatten_and_grad_flags(hidden, weight, index, None)
    logp, ent = torch.ops.fxfuse.vocab_parallel_log_probs_fwd(
        h2, weight, i1, vocab_size, group_name, float(temperature), float(softcap), bool(return_entropy),
        int(chunk_bytes))[:2]
    return logp, ent


_lib.impl("vocab_parallel_log_probs", _composite, "CompositeImplicitAutograd")
register_autocast_casts("vocab_parallel_log_probs", ("hidden", "weight"))  # AMP, as the one-GPU op


# ================================================================================================ with its loss
@torch.library.custom_op("fxfuse::vocab_parallel_log_probs_loss_fwd", mutates_args=())
def vocab_parallel_log_probs_loss_fwd(
    hidden: Tensor, weight: Tensor, index: Tensor, vocab_size: int, group_name: str, temperature: float,
    softcap: float, return_entropy: bool, grad_hidden: bool, grad_weight: bool, chunk_bytes: int, tail: str,
    tail_tensors: List[Tensor], tail_ints: List[int],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    pg, index, local, held = _rank_view(hidden, weight, index, vocab_size, group_name, temperature, softcap)
    world = dist.get_world_size(pg)
    entropy = bool(return_entropy)

    def combine(s, e, zy, lse, ez):
        m, log_s, zym, ezm = _combine(lse, ez, zy, held[s:e], pg)
        stats = torch.stack([m, log_s.float()])
        return ((zym - log_s).float(), (log_s - ezm).float() if entropy else None, stats,
                ezm.float() if entropy else None)

    grads = tail_gradients(tail, entropy, tail_tensors, [int(i) for i in tail_ints])
    chunk_vocab = -(-vocab_size // world)
    logp, ent, gh, gw = K.logp_forward_split_vocab(
        hidden, weight, local, float(temperature), float(softcap), entropy,
        chunk_budget(chunk_bytes, weight, chunk_vocab), combine, chunk_vocab, grads, bool(grad_hidden),
        bool(grad_weight))
    if grad_hidden:  # each rank's is the part of the sum over its vocabulary slice: summed in fp32, rounded once
        dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=pg)
        gh = gh.to(hidden.dtype)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    # carrier: the loss's gradient path (value 0); consumed: set by the backward that scales the gradients
    return logp, ent, torch.zeros((), **f32), gh, gw, torch.zeros((), **f32)


@vocab_parallel_log_probs_loss_fwd.register_fake
def _(hidden, weight, index, vocab_size, group_name, temperature, softcap, return_entropy, grad_hidden, grad_weight,
      chunk_bytes, tail, tail_tensors, tail_ints):
    _check(hidden, weight, index, vocab_size, temperature, softcap)
    N = hidden.shape[0]
    f32 = torch.float32
    return (hidden.new_empty((N,), dtype=f32), hidden.new_empty((N,) if return_entropy else (0,), dtype=f32),
            hidden.new_empty((), dtype=f32),
            hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if grad_weight else hidden.new_empty(0), hidden.new_empty((), dtype=f32))


def _loss_setup_context(ctx, inputs, output):
    grad_hidden, grad_weight, tail_tensors, tail_ints = inputs[8], inputs[9], inputs[12], inputs[13]
    logp, ent, carrier, gh, gw, consumed = output
    ctx.mark_non_differentiable(logp, ent, gh, gw, consumed)
    ctx.set_materialize_grads(False)
    ctx.flags = (bool(grad_hidden), bool(grad_weight))
    ctx.consumed = False
    ctx.n_loss_tensors, ctx.no_loss_ints = len(tail_tensors), len(tail_ints) == 0
    ctx.save_for_backward(gh, gw, consumed)


def _loss_backward(ctx, _g_logp, _g_ent, g_carrier, *_no_grad):
    fh, fw = ctx.flags
    # one entry per input: a list of Nones for the tensor list; for the integers None, or [] when there are none
    # (torch.library reads an empty list as a list of tensors)
    rest = (None,) * 10 + ([None] * ctx.n_loss_tensors, [] if ctx.no_loss_ints else None)
    if g_carrier is None:
        return (None, None) + rest
    if ctx.consumed:
        raise FxFuseError("fxfuse::vocab_parallel_log_probs_loss: backward ran twice through one forward "
                          "(retain_graph=True?); the gradients formed in the forward are consumed by the first one.")
    ctx.consumed = True
    gh, gw, consumed = ctx.saved_tensors
    torch.ops.fxfuse.linear_cross_entropy_scale_grads_(gh, gw, gh.new_empty(0), g_carrier, consumed)
    return (gh if fh else None, gw if fw else None) + rest


vocab_parallel_log_probs_loss_fwd.register_autograd(_loss_backward, setup_context=_loss_setup_context)

_lib.define(
    "vocab_parallel_log_probs_loss(Tensor hidden, Tensor weight, Tensor index, int vocab_size, str group_name, "
    "float temperature, float softcap, bool return_entropy, int chunk_bytes, str tail, Tensor[] tail_tensors, "
    "SymInt[] tail_ints) -> (Tensor, Tensor, Tensor)")


def _loss_composite(hidden, weight, index, vocab_size, group_name, temperature, softcap, return_entropy, chunk_bytes,
                    tail, tail_tensors, tail_ints):
    h2, i1, gh, gw, _gb = flatten_and_grad_flags(hidden, weight, index, None)
    logp, ent, carrier = torch.ops.fxfuse.vocab_parallel_log_probs_loss_fwd(
        h2, weight, i1, vocab_size, group_name, float(temperature), float(softcap), bool(return_entropy), gh, gw,
        int(chunk_bytes), tail, list(tail_tensors), list(tail_ints))[:3]
    return logp, ent, carrier


_lib.impl("vocab_parallel_log_probs_loss", _loss_composite, "CompositeImplicitAutograd")
register_autocast_casts("vocab_parallel_log_probs_loss", ("hidden", "weight"))  # AMP (the tail's tensors stay)


# ================================================================================================ public API
def vocab_parallel_log_probs(hidden: Tensor, weight_shard: Tensor, index: Tensor, *, vocab_size: int,
                             group: Optional[dist.ProcessGroup] = None, temperature: float = 1.0,
                             softcap: Optional[float] = None, return_entropy: bool = False,
                             chunk_bytes: Optional[int] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`fxfuse.ops.linear_log_probs` (``log_softmax(z)[index]``, optionally the entropy, ``z =
    softcap(hidden @ W.T) / temperature``) where this rank holds only its slice ``weight_shard`` of W's vocabulary
    rows (``torch.chunk(W, world)[rank]``, DTensor's ``Shard(0)``) and every rank of ``group`` calls it with the
    same ``hidden`` [..., D] and ``index`` [...] (every row a real token in [0, vocab_size)). Returns the same fp32
    ``logp`` (``index``'s shape) on every rank, or ``(logp, entropy)``; any per-token upstream gradients flow back:
    grad_hidden is the full gradient on every rank, grad of ``weight_shard`` this rank's slice. Neither the [N, V]
    logits nor a slice of them is materialised beyond one chunk; the ranks exchange O(N) row statistics and the
    backward all-reduces grad_hidden."""
    group = group if group is not None else dist.group.WORLD
    logp, ent = torch.ops.fxfuse.vocab_parallel_log_probs.default(
        hidden, weight_shard, index, int(vocab_size), group.group_name, float(temperature), float(softcap or 0.0),
        bool(return_entropy), int(chunk_bytes or 0))
    logp = logp.view(index.shape)
    return (logp, ent.view(index.shape)) if return_entropy else logp
