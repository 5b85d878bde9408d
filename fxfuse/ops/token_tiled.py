"""``fxfuse::token_tiled``: a token-wise subgraph run over chunks of tokens, saving only its input (issue 32).

A decoder's MLP (``down(act(gate(x)) * up(x))``, with or without LoRA adapters) holds ``[S, intermediate]``
tensors: at Llama-3.1-8B widths, gate, up, their product and the gradients of each are ~17 ``[S, 4096]`` bf16
tensors of one layer's backward, 34 GiB at 256k tokens. Every token is computed alone, so the same result comes
from running the subgraph over chunks of tokens; this op does that in the forward (no intermediate outlives its
chunk) and again, chunk by chunk, in the backward (the chunk's forward recomputed under autograd, its gradients
taken, the chunk's intermediates freed before the next): the peak holds one chunk's intermediates instead of S
tokens'. The price is one more forward of the subgraph (for an MLP about a third more of its FLOPs).

What a graph pass inserts (``passes/sequence_tiling.py``)::

    y = torch.ops.fxfuse.token_tiled.default(x, params, body_key, chunk)

    x         Tensor [..., din]    the one token tensor the subgraph reads; leading dims are tokens
    params    Tensor[]             everything else it reads (weights, LoRA adapters): no token dimension
    body_key  int                  the subgraph (an fx.GraphModule ``body(x2d, *params) -> y2d``) in this module's
                                   registry (:func:`register_body`): a hash of its code, the same in every process
    chunk     SymInt               tokens per chunk (>= 1); S <= chunk runs one chunk
    -> y [..., dout] contiguous, the body's dtype

The body is plain torch code on ``[tokens, features]`` tensors, so the fake impl runs it on fake tensors for the
output's shape and dtype, and the real impls run it eagerly per chunk (its matmuls are most of its time; Inductor
does not see inside: an opaque op). Its backward is ``fxfuse::token_tiled_backward``; weight gradients accumulate
in fp32 across chunks. Randomness inside the body (dropout) would draw other masks in the recompute: a pass must
not tile a body with dropout in training.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Sequence

import torch
import torch.fx as fx
from torch import Tensor

from ..autocast import register_autocast_casts

__all__ = ["register_body", "token_tiled", "OP_NAME", "BACKWARD_OP_NAME"]

OP_NAME = "fxfuse::token_tiled"
BACKWARD_OP_NAME = "fxfuse::token_tiled_backward"
_BODIES: Dict[int, fx.GraphModule] = {}


def register_body(body: fx.GraphModule) -> int:
    """Keep ``body`` under a key derived from its code (the same key in every process, so Inductor's cached graphs
    that name it stay valid after a restart once the pass has registered it again). Returns the key."""
    key = int(hashlib.sha256(body.code.encode()).hexdigest()[:15], 16)
    _BODIES.setdefault(key, body)
    return key


def _body(key: int) -> fx.GraphModule:
    try:
        return _BODIES[key]
    except KeyError:
        raise RuntimeError(f"{OP_NAME}: no subgraph registered under key {key} (the graph that names it was "
                           "compiled in another process and its pass did not run here)") from None


def _flat(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _chunks(n: int, chunk: int):
    for i in range(0, n, max(int(chunk), 1)):
        yield i, min(i + int(chunk), n)


_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define("token_tiled(Tensor x, Tensor[] params, int body_key, SymInt chunk) -> Tensor")
_lib.define("token_tiled_backward(Tensor grad, Tensor x, Tensor[] params, int body_key, SymInt chunk, "
            "bool[] needs_grad) -> (Tensor, Tensor[])")


def _forward_impl(x: Tensor, params: List[Tensor], body_key: int, chunk: int) -> Tensor:
    body = _body(body_key)
    x2 = _flat(x)
    n = x2.shape[0]
    out = None
    with torch.no_grad():
        for i, j in _chunks(n, chunk):
            y = body(x2[i:j], *params)
            if out is None:
                out = y.new_empty((n,) + tuple(y.shape[1:]))
            out[i:j] = y
        if out is None:  # no tokens: the body's width from an empty run
            out = body(x2[:0], *params).contiguous()
    return out.view(tuple(x.shape[:-1]) + tuple(out.shape[1:]))


def _forward_fake(x: Tensor, params: List[Tensor], body_key: int, chunk: int) -> Tensor:
    y = _body(body_key)(x.new_empty((1, x.shape[-1])), *params)  # one token: its width and dtype, no guard on S
    return x.new_empty(tuple(x.shape[:-1]) + tuple(y.shape[1:]), dtype=y.dtype)


def _backward_impl(grad: Tensor, x: Tensor, params: List[Tensor], body_key: int, chunk: int,
                   needs_grad: List[bool]):
    body = _body(body_key)
    x2, g2 = _flat(x), grad.reshape(-1, grad.shape[-1])
    n = x2.shape[0]
    gx = x2.new_empty(x2.shape)  # contiguous, as the fake impl says (empty_like would copy a permuted x's strides)
    # fp32 accumulators for the parameters' gradients across chunks (bf16 sums of many chunks lose digits)
    acc = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) if need else None
           for p, need in zip(params, needs_grad)]
    leaves = [p.detach().requires_grad_(need) for p, need in zip(params, needs_grad)]
    wanted = [p for p, need in zip(leaves, needs_grad) if need]
    with torch.enable_grad():
        for i, j in _chunks(n, chunk):
            xc = x2[i:j].detach().requires_grad_(True)
            y = body(xc, *leaves)
            grads = torch.autograd.grad(y, [xc] + wanted, g2[i:j], allow_unused=True)
            gx[i:j] = grads[0] if grads[0] is not None else 0
            k = 1
            for a, need in zip(acc, needs_grad):
                if need:
                    if grads[k] is not None:
                        a += grads[k]
                    k += 1
    gparams = [a.to(p.dtype).contiguous() if a is not None else p.new_empty(0) for a, p in zip(acc, params)]
    return gx.view(x.shape), gparams


def _backward_fake(grad, x, params, body_key, chunk, needs_grad):
    # contiguous, as the real impl's (x may be a permuted view)
    return x.new_empty(x.shape), [torch.empty_like(p, memory_format=torch.contiguous_format) if need
                                  else p.new_empty(0) for p, need in zip(params, needs_grad)]


for _dev in ("CPU", "CUDA"):
    _lib.impl("token_tiled", _forward_impl, _dev)
    _lib.impl("token_tiled_backward", _backward_impl, _dev)
torch.library.register_fake(OP_NAME, lib=_lib)(_forward_fake)
torch.library.register_fake(BACKWARD_OP_NAME, lib=_lib)(_backward_fake)


def _setup_context(ctx, inputs, output):
    x, params, body_key, chunk = inputs
    ctx.save_for_backward(x, *params)
    ctx.body_key, ctx.chunk = body_key, chunk
    ctx.needs = [bool(p.requires_grad) for p in params]  # frozen weights (LoRA's base) get no gradient work


def _backward(ctx, grad):
    x, *params = ctx.saved_tensors
    needs = ctx.needs
    gx, gparams = torch.ops.fxfuse.token_tiled_backward(grad.contiguous(), x, params, ctx.body_key, ctx.chunk,
                                                        needs)
    return gx, [g if need else None for g, need in zip(gparams, needs)], None, None


torch.library.register_autograd(OP_NAME, _backward, setup_context=_setup_context, lib=_lib)
# Under autocast the body's projections would run on the autocast dtype; the op runs with autocast off, so it is
# given its inputs cast as autocast casts a projection's (an MLP body: projections and element-wise ops on their
# outputs)
register_autocast_casts("token_tiled", ("x", "params"))


def token_tiled(x: Tensor, params: Sequence[Tensor], body: fx.GraphModule, chunk: int) -> Tensor:
    """``body(x2d, *params)`` over chunks of ``chunk`` tokens of ``x`` [..., din] (see the module docstring)."""
    if chunk < 1:
        raise ValueError(f"{OP_NAME}: chunk must be >= 1 tokens, got {chunk}")
    return torch.ops.fxfuse.token_tiled(x, list(params), register_body(body), chunk)
