"""``fxfuse::softcap_attention``: Gemma-2 style attention (tanh logit softcap, GQA, causal / sliding window /
mask tensor) as a flash-attention custom op with its own backward.

What a graph pass inserts (the op returns ``(out, lse)``; take element 0)::

    node = graph.call_function(
        torch.ops.fxfuse.softcap_attention.default,
        (q, k, v, mask, scaling, softcap, causal, window, masked_rows, doc_ranges, key_valid))
    out = graph.call_function(operator.getitem, (node, 0))

    q     Tensor [B, Hq, S, Dh]        bf16 / fp16 / fp32, any strides (HF's transpose(1, 2) views are fine)
    k, v  Tensor [B, Hkv, Skv, Dh]     same dtype; Hq % Hkv == 0. Pass the kv heads BEFORE repeat_kv.
    mask  Tensor or None               additive float (values <= -65504 count as masked; HF's finfo.min
                                       padding entries therefore do) or bool (True = keep); broadcastable
                                       to [B, Hq, S, Skv]: 2-D [S, Skv] .. 4-D [B|1, Hq|1, S|1, Skv]. Pass it
                                       already sliced to [..., :Skv] (HF's causal_mask[:, :, :, :k.shape[-2]]).
    scaling float                      the factor applied to q @ k^T (Gemma-2: query_pre_attn_scalar ** -0.5)
    softcap float                      0.0 = no softcap (Gemma-2: attn_logit_softcapping, e.g. 50.0)
    causal  bool                       index-computed causal mask, bottom-right aligned when Skv != S
    window  int                        0 = none; else also keep only qi + (Skv - S) - ki < window (needs causal)
    masked_rows int                    what a fully masked query row gives: 0 zeros (SDPA with a bool mask),
                                       1 eager's uniform average over all keys (a finite fill such as HF's
                                       finfo.min), 2 NaN (a -inf fill); see fxfuse.attention.reference
    doc_ranges Tensor or None          int32/int64 [2, B|1, S]: [start, end) of each token's document (packed
                                       rows): a key is kept only inside its query's document. Documents must be
                                       contiguous runs; needs causal=True and S == Skv. Build it from per-token
                                       document ids with :func:`document_ranges` once per step (all layers share it).
                                       A token whose start lies past its own index attends to nothing (a dead
                                       query, in its own one-token document: unpad_tokens' kept padding)
    key_valid Tensor or None           bool [B|1, Skv]: False = padding key, never attended
    ->  out  [B, Hq, S, Dh] contiguous, q.dtype;   lse [B, Hq, S] fp32 (for the backward; +inf on dead rows)

The *recipe* form (what the attention passes hand over when they can read how the mask was built: causal, window,
``doc_ranges``, ``key_valid``) holds nothing of size S x Skv: the kernels mask from indices and O(S) vectors and
skip every block outside the causal / window / document ranges.
Either give the causal / window structure as scalars (blocks outside it are skipped) or through ``mask`` (on
CUDA its tiles are classified empty / full / partial first, so empty blocks are skipped and the mask is read
only on partial ones: a causal mask tensor costs ~10% more than causal=True), or both (e.g. causal=True plus a
padding mask; the mask is then read in every block the index mask keeps).
Rows whose every key is masked follow ``masked_rows``, forward and backward. Dropout is not supported (a pass must not
rewrite attention with dropout p > 0 in training). The mask gets no gradient (the public function refuses a
mask that requires grad). The backward is ``fxfuse::softcap_attention_backward`` (same scalars, plus dout,
out, lse) -> (dq, dk, dv), contiguous, in the inputs' dtypes.

Dispatch: CUDA tensors -> Triton kernels; anything else -> the blockwise PyTorch path (same semantics, memory
O(block) of scores). ``FXFUSE_ATTENTION_IMPL=triton`` forces the Triton kernels (on CPU only together with
``TRITON_INTERPRET=1``, set before Triton is imported), ``=torch`` forces the PyTorch path.

This module is the op's definition and nothing else: its contract (:func:`check_softcap_attention`), the
``torch.library`` registrations (real and fake impls of the op and its backward, autograd, autocast), the dispatch
above between the kernels' launchers (:mod:`.forward`, :mod:`.backward`) and the PyTorch path (:mod:`.reference`),
the public function :func:`softcap_attention` and :func:`document_ranges`.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from fxfuse.contracts import OpContract
from fxfuse.graph_utils import known_true
from fxfuse.kernels.triton_support import use_triton
from fxfuse.autocast import register_autocast_casts

# The kernel modules whose launchers this op calls (block_map's tile classifiers run inside both; imported here so
# that `python -m fxfuse doctor` finds every kernel the op launches).
from . import backward, block_map, dispatch, forward, reference  # noqa: F401
from .conventions import (BACKWARD_OP_NAME, DTYPES, MASKED_ROWS, MASKED_ROWS_NAN, MASKED_ROWS_UNIFORM,
                          MASKED_ROWS_ZERO, MAX_HEAD_DIM, OP_NAME)

__all__ = ["softcap_attention", "document_ranges", "check_softcap_attention", "OP_NAME", "BACKWARD_OP_NAME"]


# ================================================================================================= contract
def check_softcap_attention(q, k, v, mask, scaling, softcap, causal, window, masked_rows=0, doc_ranges=None,
                            key_valid=None) -> None:
    """The op's contract; raises :class:`~fxfuse.errors.FxFuseContractError`. Symbolic sizes: only a provable
    mismatch raises (the real impl re-checks with concrete sizes)."""
    c = OpContract(OP_NAME, q=q, k=k, v=v, mask=mask, doc_ranges=doc_ranges, key_valid=key_valid)
    for n in ("q", "k", "v"):
        c.ndim(n, 4)
        c.dtype_in(n, DTYPES)
    c.same_dtype("q", "k", "v")
    c.same_device("q", "k", "v", "mask")
    c.dim_eq("q", 0, "k", 0)
    c.dim_eq("k", 0, "v", 0)
    c.dim_eq("k", 1, "v", 1, hint="k and v must have the same number of kv heads")
    c.dim_eq("k", 2, "v", 2, hint="k and v must have the same sequence length")
    c.dim_eq("q", 3, "k", 3, hint="q and k must have the same head_dim")
    c.dim_eq("k", 3, "v", 3, hint="v's head_dim must equal q's and k's")
    B, Hq, S, Dh = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    if known_true(Hq % Hkv != 0):
        c.fail(f"q heads ({Hq}) must be a multiple of kv heads ({Hkv})", "pass k/v before repeat_kv")
    if known_true(Dh > MAX_HEAD_DIM):
        c.fail(f"head_dim {Dh} > {MAX_HEAD_DIM} is not supported")
    if not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        c.fail(f"scaling must be a finite float, got {scaling!r}")
    if softcap is None or softcap < 0 or not math.isfinite(softcap):
        c.fail(f"softcap must be a finite float >= 0 (0 = none), got {softcap!r}")
    if window is None or window < 0:
        c.fail(f"window must be an int >= 0 (0 = none), got {window!r}")
    if window and not causal:
        c.fail("a sliding window is only supported together with causal=True")
    if masked_rows not in (MASKED_ROWS_ZERO, MASKED_ROWS_UNIFORM, MASKED_ROWS_NAN):
        c.fail(f"masked_rows must be 0 (zeros), 1 (uniform) or 2 (NaN), got {masked_rows!r}")
    if doc_ranges is not None:
        c.same_device("q", "doc_ranges")
        if doc_ranges.dtype not in (torch.int32, torch.int64):
            c.fail(f"doc_ranges must be int32 / int64 [2, B|1, S], got {doc_ranges.dtype}")
        c.ndim("doc_ranges", 3)
        if known_true(doc_ranges.shape[0] != 2) or (known_true(doc_ranges.shape[1] != 1)
                                                    and known_true(doc_ranges.shape[1] != B)) \
                or known_true(doc_ranges.shape[2] != S):
            c.fail(f"doc_ranges {list(doc_ranges.shape)} is not [2, B|1, S] = [2, {B}, {S}]",
                   "build it with fxfuse.ops.document_ranges(doc_ids)")
        if not causal:
            c.fail("doc_ranges (packed documents) needs causal=True")
        if known_true(S != Skv):
            c.fail(f"doc_ranges needs S == Skv (got S {S}, Skv {Skv})")
    if key_valid is not None:
        c.same_device("q", "key_valid")
        if key_valid.dtype != torch.bool:
            c.fail(f"key_valid must be bool [B|1, Skv] (True = a real key), got {key_valid.dtype}")
        c.ndim("key_valid", 2)
        if (known_true(key_valid.shape[0] != 1) and known_true(key_valid.shape[0] != B)) \
                or known_true(key_valid.shape[1] != Skv):
            c.fail(f"key_valid {list(key_valid.shape)} is not [B|1, Skv] = [{B}, {Skv}]")
    if mask is not None:
        if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            c.fail(f"mask must be bool (True = keep) or an additive float mask, got {mask.dtype}")
        c.ndim("mask", (2, 3, 4))
        target = (B, Hq, S, Skv)
        names = ("batch", "q heads", "query length S", "key length Skv")
        for i in range(1, mask.dim() + 1):
            md, td = mask.shape[-i], target[-i]
            if known_true(md != 1) and known_true(md != td):
                c.fail(f"mask {list(mask.shape)} does not broadcast to [B, Hq, S, Skv] = {list(target)}: "
                       f"dim {-i} is {md}, expected 1 or {td} ({names[-i]})",
                       "slice the mask to the keys actually attended (mask[..., :Skv]); a per-kv-head mask "
                       "must be repeated to the q heads")


# ================================================================================================ custom ops
def _use_triton(t: Tensor) -> bool:
    """The Triton kernels on CUDA tensors; ``FXFUSE_ATTENTION_IMPL=triton`` forces them on any device (on CPU with
    ``TRITON_INTERPRET=1``), ``=torch`` forces the PyTorch path. Without Triton, always the PyTorch path."""
    mode = os.environ.get("FXFUSE_ATTENTION_IMPL", "auto").lower()
    if mode == "torch":
        return False
    return use_triton(t, force=mode == "triton")


# The two ops are defined with torch.library.Library (define + one impl for every device + register_fake +
# register_autograd) rather than torch.library.custom_op: custom_op's Python layers (autograd wrapper, redispatch,
# dynamo-disable wrapper, output alias checks) cost ~0.5 ms of host time per call on the H200 machine (torch 2.11),
# more than the GPU takes for a layer at 4k tokens (benchmarks/attention_notes.md, session 4). Same schemas as
# custom_op gave them; the impls pick Triton or PyTorch per tensor.
_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(f"{OP_NAME.split('::')[1]}(Tensor q, Tensor k, Tensor v, Tensor? mask, float scaling, float softcap, "
            "bool causal, SymInt window, SymInt masked_rows=0, Tensor? doc_ranges=None, Tensor? key_valid=None) "
            "-> (Tensor, Tensor)")
_lib.define(f"{BACKWARD_OP_NAME.split('::')[1]}(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? mask, "
            "Tensor out, Tensor lse, float scaling, float softcap, bool causal, SymInt window, SymInt masked_rows=0, "
            "Tensor? doc_ranges=None, Tensor? key_valid=None) -> (Tensor, Tensor, Tensor)")


def _layout(t):
    return None if t is None else (t.shape, t.dtype, t.device)


_CHECKED = set()  # signatures (shapes, dtypes, devices, scalars) that passed the contract


def _check_once(q, k, v, mask, scaling, softcap, causal, window, masked_rows, doc_ranges, key_valid) -> None:
    """The contract on real tensors, checked once per signature: it depends on nothing else, and it costs ~30 us
    of host time, a tenth of a layer's forward at a few thousand tokens. (The fake impl checks every trace.)"""
    key = (_layout(q), _layout(k), _layout(v), _layout(mask), scaling, softcap, causal, window, masked_rows,
           _layout(doc_ranges), _layout(key_valid))
    if key in _CHECKED:
        return
    check_softcap_attention(q, k, v, mask, scaling, softcap, causal, window, masked_rows, doc_ranges, key_valid)
    if len(_CHECKED) >= 4096:
        _CHECKED.clear()
    _CHECKED.add(key)


def _softcap_attention_impl(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scaling: float,
                            softcap: float, causal: bool, window: int, masked_rows: int = 0,
                            doc_ranges: Optional[Tensor] = None, key_valid: Optional[Tensor] = None
                            ) -> Tuple[Tensor, Tensor]:
    _check_once(q, k, v, mask, scaling, softcap, causal, window, masked_rows, doc_ranges, key_valid)
    impl = forward.attention_fwd_triton if _use_triton(q) else reference.attention_fwd_torch
    return impl(q, k, v, mask, scaling, softcap, causal, window, masked_rows=masked_rows, doc_ranges=doc_ranges,
                key_valid=key_valid)


def _softcap_attention_backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                                     out: Tensor, lse: Tensor, scaling: float, softcap: float, causal: bool,
                                     window: int, masked_rows: int = 0, doc_ranges: Optional[Tensor] = None,
                                     key_valid: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    impl = backward.attention_bwd_triton if _use_triton(q) else reference.attention_bwd_torch
    return impl(dout, q, k, v, mask, out, lse, scaling, softcap, causal, window, masked_rows=masked_rows,
                doc_ranges=doc_ranges, key_valid=key_valid)


_lib.impl(OP_NAME.split("::")[1], _softcap_attention_impl, "CompositeExplicitAutograd")
_lib.impl(BACKWARD_OP_NAME.split("::")[1], _softcap_attention_backward_impl, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME, lib=_lib)
def _(q, k, v, mask, scaling, softcap, causal, window, masked_rows=0, doc_ranges=None, key_valid=None):
    check_softcap_attention(q, k, v, mask, scaling, softcap, causal, window, masked_rows, doc_ranges, key_valid)
    B, Hq, S, Dh = q.shape
    out = q.new_empty((B, Hq, S, Dh))  # contiguous, like the real impls
    lse = q.new_empty((B, Hq, S), dtype=torch.float32)
    return out, lse


@torch.library.register_fake(BACKWARD_OP_NAME, lib=_lib)
def _(dout, q, k, v, mask, out, lse, scaling, softcap, causal, window, masked_rows=0, doc_ranges=None,
      key_valid=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, scaling, softcap, causal, window, masked_rows, doc_ranges, key_valid = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, out, lse, doc_ranges, key_valid)
    ctx.args = (scaling, softcap, causal, window, masked_rows)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros [B, H, S] grad for the auxiliary lse (out's is always defined)


def _backward(ctx, dout, dlse):
    # lse is an auxiliary output (non-differentiable); its gradient, if any, is ignored.
    q, k, v, mask, out, lse, doc_ranges, key_valid = ctx.saved_tensors
    dq, dk, dv = torch.ops.fxfuse.softcap_attention_backward(dout, q, k, v, mask, out, lse, *ctx.args, doc_ranges,
                                                             key_valid)
    return dq, dk, dv, None, None, None, None, None, None, None, None


class _SoftcapAttentionFunction(torch.autograd.Function):
    """The op's autograd: the forward op below autograd, the backward op in ``backward``."""

    @staticmethod
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = torch.ops.fxfuse.softcap_attention.default(*args)
        _setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


def _autograd_kernel(q, k, v, mask, scaling, softcap, causal, window, masked_rows=0, doc_ranges=None,
                     key_valid=None):
    args = (q, k, v, mask, scaling, softcap, causal, window, masked_rows, doc_ranges, key_valid)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _SoftcapAttentionFunction.apply(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fxfuse.softcap_attention.default(*args)


# The Autograd kernel is registered directly rather than through torch.library.register_autograd, whose generated
# wrapper re-reads the op's schema per call (torch._library.utils.fill_defaults walks ``schema.arguments``, a list
# rebuilt from C++ at every index): ~0.1 ms of host time per call on the H200 machine, a tenth of a layer's
# forward + backward at 4k tokens. Same semantics: the forward op is recorded, its backward op runs in backward
# (AOTAutograd traces both), and nothing is saved when no input requires grad.
if os.environ.get("FXFUSE_ATTENTION_AUTOGRAD", "direct") == "library":
    torch.library.register_autograd(OP_NAME, _backward, setup_context=_setup_context, lib=_lib)
else:
    _lib.impl(OP_NAME.split("::")[1], _autograd_kernel, "Autograd")


# Under autocast the two matmuls this op replaces run on operands cast to the autocast dtype, while the additive
# mask joins fp32 scores: the op casts q, k, v (not the mask) the same way. This also covers graphs whose recorded
# dtypes predate autocast (checkpoint bodies re-traced under the caller's autocast).
register_autocast_casts("softcap_attention", ("q", "k", "v"))


# ============================================================================================ public function
def softcap_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Optional[Tensor] = None,
                      scaling: Optional[float] = None, softcap: Optional[float] = None, causal: bool = False,
                      window: Optional[int] = None, masked_rows: str = "zero", doc_ranges: Optional[Tensor] = None,
                      key_valid: Optional[Tensor] = None, kernel: str = "auto") -> Tensor:
    """Gemma-2 eager attention without materialising scores: ``softmax(cap*tanh(q k^T * scaling / cap) +
    mask) @ v`` with GQA, causal / sliding window and a mask tensor. See the module docstring.

    ``scaling`` defaults to ``head_dim ** -0.5``; ``softcap`` None/0 = none; ``window`` None/0 = none.
    ``doc_ranges`` (from :func:`document_ranges`) restricts each query to its packed document, ``key_valid`` drops
    padding keys: the mask by recipe, nothing of size S x Skv anywhere. ``masked_rows``: what a query row whose every key is masked gives: ``"zero"`` (as SDPA with a bool mask),
    ``"uniform"`` (as eager attention with a finite fill such as HF's ``finfo.min`` masks: the mean of v, with
    eager's gradients) or ``"nan"`` (as eager attention with a -inf fill).

    ``kernel``: ``"auto"`` runs torch's ``scaled_dot_product_attention`` instead where it computes the same thing
    and was measured faster on this GPU (plain causal with S == Skv or no mask, no softcap, bf16 / fp16; see
    :mod:`fxfuse.attention.dispatch`), ``"fxfuse"`` always fxfuse's kernels, ``"sdpa"`` SDPA wherever it can.
    """
    scaling = float(q.shape[-1]) ** -0.5 if scaling is None else float(scaling)
    softcap = float(softcap or 0.0)
    window = int(window or 0)
    causal = bool(causal)
    modes = MASKED_ROWS
    if masked_rows not in modes:
        OpContract(OP_NAME, q=q).fail(f"masked_rows must be one of {tuple(modes)}, got {masked_rows!r}")
    # traced by Dynamo (symbolic sizes): the plain check; eager: once per signature
    check = check_softcap_attention if torch.compiler.is_compiling() else _check_once
    check(q, k, v, mask, scaling, softcap, causal, window, modes[masked_rows], doc_ranges, key_valid)
    if mask is not None and mask.requires_grad:
        OpContract(OP_NAME, mask=mask).fail("mask must not require grad (the op gives it no gradient)")
    if kernel not in dispatch.KERNELS:
        OpContract(OP_NAME, q=q).fail(f"kernel must be one of {dispatch.KERNELS}, got {kernel!r}")
    if kernel != "fxfuse":
        ok, why = dispatch.sdpa_expressible(
            softcap=softcap, causal=causal, window=window, has_mask=mask is not None, has_docs=doc_ranges is not None,
            has_key_valid=key_valid is not None, sinks=False, head_dim_pads=(0, 0),
            same_length=known_true(q.shape[2] == k.shape[2]))
        if dispatch.choose_kernel(kernel, q.device, q.dtype, q.shape[-1], ok, why,
                                  causal=causal).kernel == "sdpa":
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, None, 0.0, causal, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    out, _ = torch.ops.fxfuse.softcap_attention(q, k, v, mask, scaling, softcap, causal, window,
                                                modes[masked_rows], doc_ranges, key_valid)
    return out


def document_ranges(doc_ids: Tensor) -> Tensor:
    """int32 ``[2, B, S]``: the ``[start, end)`` of each token's document, from per-token document ids ``[B, S]``
    that are non-decreasing along each row (e.g. HF's ``(diff(position_ids) != 1).cumsum(-1)``), so that every
    document is one contiguous run. O(B x S log S), no host sync, no slicing of the symbolic length (which would
    add shape guards: a recompile per length); computed once per step and shared by every attention layer,
    forward and backward."""
    if doc_ids.dim() != 2:
        OpContract("fxfuse::document_ranges", doc_ids=doc_ids).fail(
            f"doc_ids must be [B, S], got {list(doc_ids.shape)}")
    ids = doc_ids.contiguous()
    start = torch.searchsorted(ids, ids, right=False, out_int32=True)
    end = torch.searchsorted(ids, ids, right=True, out_int32=True)
    return torch.stack([start, end])
