"""``fxfuse::chunked_causal_attention``: causal attention inside the fixed-size chunks of every row (Llama-4's chunked
layers: ``attention_chunk_size``), run by SDPA's causal kernels on the chunks, with its own backward.

What a graph pass inserts (the op returns ``(out, lse)``; take element 0)::

    node = graph.call_function(torch.ops.fxfuse.chunked_causal_attention.default, (q, k, v, size, scale))
    out = graph.call_function(operator.getitem, (node, 0))

    q     Tensor [B, Hq, S, D]     bf16 / fp16 / fp32
    k, v  Tensor [B, Hkv, S, D]    same dtype and length as q; Hq % Hkv == 0 (the kv heads before repeat_kv)
    size  int                      the chunk size C: token t attends to keys t' <= t with t' // C == t // C
    scale float                    the factor applied to q @ k^T
    ->  out [B, Hq, S, D] contiguous, q.dtype;  lse [B, Hq, S] fp32 (cuDNN's log-sum-exp where cuDNN ran, for the
        backward; zeros on the other path, whose backward recomputes)

Why an op rather than the same SDPA calls in the graph: how a row splits into chunks depends on its length. The
whole chunks before the last run as one batch of C-token sequences and the last chunk (1 to C tokens) as a second
call; a row of at most C tokens is one plain causal call. Written in the graph at a symbolic length, that choice
and the kernels' own shape checks become guards on the length (a recompile as lengths cross C, or hit a multiple
of it; the passes' validation refuses such a rewrite). Inside the op the lengths are plain integers at run time,
so one graph serves every length, and nothing of size S x S exists anywhere.

Dispatch: CUDA, bf16 / fp16, equal head dims <= 128 (a multiple of 8) and cuDNN's SDPA enabled -> cuDNN's fused
attention forward and backward (``aten._scaled_dot_product_cudnn_attention[_backward]``, which take the kv heads
of GQA as they are); anything else -> ``scaled_dot_product_attention`` per piece on dense tensors, kv heads
repeated, whose backward recomputes the piece's forward under autograd (one more forward). ``FXFUSE_CHUNKED_ATTENTION_IMPL=sdpa`` forces the second path.
A piece cuDNN refuses at run time (an error, such as a cuDNN build with no plan for it) runs the second path from
then on, with one warning per piece shape (:data:`CUDNN_REFUSED`); a CUDA error is raised.
"""
from __future__ import annotations

import os
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fxfuse.autocast import register_autocast_casts
from fxfuse.errors import FxFuseContractError

__all__ = ["OP_NAME", "BACKWARD_OP_NAME", "CUDNN_REFUSED", "chunk_pieces", "chunked_causal_attention", "uses_cudnn"]

OP_NAME = "fxfuse::chunked_causal_attention"
BACKWARD_OP_NAME = "fxfuse::chunked_causal_attention_backward"


def chunk_pieces(S: int, size: int) -> List[Tuple[int, int, int]]:
    """The SDPA calls a row of ``S`` tokens takes: ``(start, chunks, length)``, each a batch of ``chunks``
    sequences of ``length`` tokens from ``start``. One piece when ``S <= size``; else the whole chunks before the
    last one, then the last chunk (never empty)."""
    if S <= size:
        return [(0, 1, S)]
    n = (S - 1) // size
    return [(0, n, size), (n * size, 1, S - n * size)]


def uses_cudnn(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Does this call run cuDNN's fused attention (else SDPA per piece, recomputing in the backward)?"""
    if os.environ.get("FXFUSE_CHUNKED_ATTENTION_IMPL", "auto").lower() == "sdpa":
        return False
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype):
        return False
    D = q.shape[-1]
    if not (k.shape[-1] == v.shape[-1] == D and D <= 128 and D % 8 == 0):
        return False
    try:
        return bool(torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled())
    except Exception:  # pragma: no cover - older torch without the switch
        return False


def _check(q: Tensor, k: Tensor, v: Tensor, size: int) -> None:
    """The contract (also checked on the fake tensors of a pass's rewrite, symbolic lengths included: a size pair
    must be provably equal, which never adds a guard)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true  # (sympy: not at fxfuse's import)

    def same(a, b) -> bool:
        return statically_known_true(a == b)

    def bad(what: str) -> FxFuseContractError:
        return FxFuseContractError(
            f"fxfuse::chunked_causal_attention: {what} (q {list(q.shape)} {q.dtype}, k {list(k.shape)} {k.dtype}, "
            f"v {list(v.shape)} {v.dtype}, chunk size {size})")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise bad("q / k / v must be 4-D [B, H, S, D]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise bad("q / k / v must share one dtype of bf16 / fp16 / fp32")
    if not (q.device == k.device == v.device):
        raise bad("q / k / v on different devices")
    if not all(same(a, b) for a, b in zip(k.shape[:3], v.shape[:3])):
        raise bad("k and v must agree in batch, heads and length")
    if not (same(q.shape[0], k.shape[0]) and same(q.shape[2], k.shape[2])):
        raise bad("k / v must have q's batch and length (S == Skv)")
    if not statically_known_true(q.shape[1] % k.shape[1] == 0):
        raise bad("q's heads must be a multiple of k / v's")
    if not same(q.shape[3], k.shape[3]):
        raise bad("q and k head dims differ")
    if not isinstance(size, int) or size < 1:
        raise bad("the chunk size must be a positive integer")


def _piece(t: Tensor, start: int, n: int, length: int) -> Tensor:
    """Tokens ``[start, start + n * length)`` of ``t`` [B, H, S, D] as ``[B * n, H, length, D]`` (a view when the
    layout allows, e.g. B == 1)."""
    B, H, _, D = t.shape
    return t[:, :, start:start + n * length].reshape(B, H, n, length, D).transpose(1, 2).reshape(B * n, H, length, D)


def _unpiece(t: Tensor, B: int, n: int) -> Tensor:
    """``[B * n, H, length, ...]`` back to ``[B, H, n * length, ...]``."""
    _, H, length = t.shape[:3]
    rest = t.shape[3:]
    return t.reshape(B, n, H, length, *rest).transpose(1, 2).reshape(B, H, n * length, *rest)


def _join(parts: List[Tensor]) -> Tensor:
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=2)


_EMPTY_SEEDS = {}


def _no_dropout_seeds(device: torch.device) -> Tuple[Tensor, Tensor]:
    """cuDNN's backward takes the forward's dropout seed and offset; with dropout 0 it reads neither."""
    if device not in _EMPTY_SEEDS:
        _EMPTY_SEEDS[device] = (torch.zeros((), dtype=torch.long, device=device),
                                torch.zeros((), dtype=torch.long, device=device))
    return _EMPTY_SEEDS[device]


def _sdpa_piece(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """The path without cuDNN: SDPA on dense pieces, the kv heads repeated for GQA (the fused kernels' own GQA
    support varies by backend and dtype; this path is the fallback, kept to the plainest call)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True, scale=scale)


def _dense(t: Tensor) -> Tensor:
    """``t`` as a contiguous [B, H, S, D] tensor (itself when it is one). cuDNN's path cuts its pieces from these, so
    q, k, v, out and dout of a piece share one stride pattern. With q / k / v as views in HF's [B, S, H, D]-strided
    layout and out contiguous, cuDNN's backward gave wrong gradients on the H200 (the bench's check at a row inside
    one chunk: 0.47 from float64 where eager had 0.025); with all five dense they match eager's distance. Already
    contiguous inputs (the usual case at long context, B = 1) cost no copy: their pieces are views."""
    return t.contiguous()


def _cudnn_piece(cudnn: bool, length: int) -> bool:
    """cuDNN runs a piece of more than one token (its fused attention refuses s_q = s_kv = 1: a row of one token
    past a multiple of the chunk size leaves such a last chunk, which the SDPA path runs)."""
    return cudnn and length > 1


#: Piece signatures cuDNN refused at run time -> its error. Such pieces run the SDPA path from then on, forward and
#: backward: a forward that fell back saved no cuDNN statistics, so its backward must recompute (it finds the
#: signature here, added before the forward returned). Filled by :func:`_refused`; tests clear it.
CUDNN_REFUSED = {}


def _piece_signature(qp: Tensor, kp: Tensor) -> tuple:
    return (qp.device, qp.dtype, tuple(qp.shape), tuple(qp.stride()), tuple(kp.shape), tuple(kp.stride()))


def _refused(signature: tuple, err: RuntimeError) -> None:
    """Record cuDNN's refusal of a piece (a cuDNN build without a plan for this shape or layout: an error, not a
    fault) and say so once per signature. A CUDA error (a fault that leaves the context unusable) is raised."""
    if "CUDA error" in str(err):
        raise err
    import warnings

    CUDNN_REFUSED[signature] = str(err)
    warnings.warn(f"fxfuse::chunked_causal_attention: cuDNN refused a piece (q {list(signature[2])}, k "
                  f"{list(signature[4])}, {signature[1]}): {str(err)[:300]}; such pieces run SDPA from now on, "
                  f"their backward recomputing the forward", RuntimeWarning, stacklevel=3)


def _unless_refused(qp: Tensor, kp: Tensor, call, *args):
    """``call(*args)`` (one of cuDNN's two calls on this piece), or None where cuDNN refuses the piece, now (the
    refusal is recorded and said) or before."""
    sig = _piece_signature(qp, kp)
    if sig in CUDNN_REFUSED:
        return None
    try:
        return call(*args)
    except RuntimeError as e:
        _refused(sig, e)
        return None


def _cudnn_attention(qp, kp, vp, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(qp, kp, vp, None, True, 0.0, True, False,
                                                              scale=scale)[:2]


def _cudnn_attention_backward(dop, qp, kp, vp, op_, lp, seed, offset, length, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dop, qp, kp, vp, op_, lp, seed, offset, None, None, None, length, length, 0.0, True, scale=scale)


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, size: int, scale: float) -> Tuple[Tensor, Tensor]:
    _check(q, k, v, size)
    B, H, S, _ = q.shape
    cudnn = uses_cudnn(q, k, v)
    if cudnn:  # one layout for every operand of a piece, forward and backward (see _dense)
        q, k, v = _dense(q), _dense(k), _dense(v)
    outs, lses = [], []
    for start, n, length in chunk_pieces(S, size):
        qp, kp, vp = (_piece(t, start, n, length) for t in (q, k, v))
        got = _unless_refused(qp, kp, _cudnn_attention, qp, kp, vp, scale) if _cudnn_piece(cudnn, length) else None
        if got is not None:
            o, lse = got
            lse = lse.reshape(B * n, H, length)
        else:
            o = _sdpa_piece(qp, kp, vp, scale)
            lse = o.new_zeros((B * n, H, length), dtype=torch.float32)  # not read: that backward recomputes
        outs.append(_unpiece(o, B, n))
        lses.append(_unpiece(lse, B, n))
    return _join(outs), _join(lses)


def _backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, size: int,
                   scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    B, H, S, _ = q.shape
    cudnn = uses_cudnn(q, k, v)
    if cudnn:
        q, k, v, out, dout = (_dense(t) for t in (q, k, v, out, dout))
    grads = ([], [], [])
    for start, n, length in chunk_pieces(S, size):
        qp, kp, vp, dop = (_piece(t, start, n, length) for t in (q, k, v, dout))
        got = None
        if _cudnn_piece(cudnn, length):
            op_ = _piece(out, start, n, length)
            lp = lse[:, :, start:start + n * length].reshape(B, H, n, length).transpose(1, 2)
            lp = lp.reshape(B * n, H, length, 1).contiguous()
            seed, offset = _no_dropout_seeds(q.device)
            got = _unless_refused(qp, kp, _cudnn_attention_backward, dop, qp, kp, vp, op_, lp, seed, offset, length,
                                  scale)
        if got is not None:
            dq, dk, dv = got
        else:  # recompute the piece's forward under autograd (also where cuDNN refused the piece)
            with torch.enable_grad():
                leaves = [t.detach().contiguous().requires_grad_() for t in (qp, kp, vp)]
                o = _sdpa_piece(*leaves, scale)
                dq, dk, dv = torch.autograd.grad(o, leaves, dop.contiguous())
        for acc, g in zip(grads, (dq, dk, dv)):
            acc.append(_unpiece(g, B, n))
    return tuple(_join(g) for g in grads)


_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(f"{OP_NAME.split('::')[1]}(Tensor q, Tensor k, Tensor v, SymInt size, float scale) -> (Tensor, Tensor)")
_lib.define(f"{BACKWARD_OP_NAME.split('::')[1]}(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "SymInt size, float scale) -> (Tensor, Tensor, Tensor)")
_lib.impl(OP_NAME.split("::")[1], _forward_impl, "CompositeExplicitAutograd")
_lib.impl(BACKWARD_OP_NAME.split("::")[1], _backward_impl, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME, lib=_lib)
def _(q, k, v, size, scale):
    _check(q, k, v, size)
    B, H, S, _ = q.shape
    return q.new_empty((B, H, S, v.shape[-1])), q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.register_fake(BACKWARD_OP_NAME, lib=_lib)
def _(dout, q, k, v, out, lse, size, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, size, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (size, scale)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fxfuse.chunked_causal_attention_backward(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None


torch.library.register_autograd(OP_NAME, _backward, setup_context=_setup_context, lib=_lib)
register_autocast_casts("chunked_causal_attention", ("q", "k", "v"))


def chunked_causal_attention(q: Tensor, k: Tensor, v: Tensor, size: int, scale: float = None) -> Tensor:
    """Causal attention inside chunks of ``size`` tokens from each row's start (see the module docstring);
    ``scale`` defaults to ``head_dim ** -0.5``."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return torch.ops.fxfuse.chunked_causal_attention(q, k, v, size, float(scale))[0]
