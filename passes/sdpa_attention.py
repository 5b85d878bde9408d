"""Run ``scaled_dot_product_attention`` given a bool mask tensor from the mask's recipe, or through fxfuse's
flash-attention op.

Under torch.compile, Hugging Face models hand SDPA a materialised ``[B, 1, S, Skv]`` bool mask: causal from the
position ids, a packed-sequence term (documents of a ``DataCollatorWithFlattening`` / TRL ``padding_free`` row
attend only within themselves), a sliding window and the padding mask. At 64k tokens that mask is 4 GiB and SDPA's
kernels take their arbitrary-mask path over every tile. This pass first reads how the mask was built
(:mod:`fxfuse.attention.mask_recipe`, proven for every length, static or symbolic):

* a plain causal recipe -> the same SDPA call with ``is_causal=True`` and no mask (cuDNN's causal kernel);
* causal inside chunks that tile every row from its start (Llama-4's chunked layers on unpadded rows) ->
  ``fxfuse::chunked_causal_attention(q, k, v, C, c)``: SDPA's causal kernels on the chunks as a batch, where the
  dispatch measured it faster than fxfuse's kernel (:mod:`fxfuse.attention.dispatch`) or ``kernel="sdpa"``;
* causal + window / documents / key padding -> ``fxfuse::softcap_attention(q, k, v, None, c, 0.0, True, window,
  0, doc_ranges, key_valid)``: the kernels mask from indices and O(B x S) vectors (``doc_ranges`` built once per
  step and shared by every layer) and skip every block outside the ranges; the mask builders become dead and are
  erased, so nothing of size S x Skv is computed, saved for the backward or passed to a kernel;
* a mask the reader cannot prove (an OR, a negation, a user-supplied 4-D mask; the reason is in the report's
  ``mask_tensor_kept``) -> the op given the mask tensor as is, ``causal=False``: right whatever the mask is, its
  tiles classified empty / full / partial so empty ones are skipped, 64-bit addressed at any size.

Pattern::

    k_rep, v_rep = repeat_kv(k), repeat_kv(v)        # or enable_gqa=True with the kv heads themselves
    out = scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=keep, dropout_p=0.0, is_causal=False,
                                       scale=c)      # keep: bool, True = attend, broadcastable to [B, H, S, Skv]

A query row with no key to attend gets SDPA's answer (zeros, from torch's safe softmax). Constant masks at static
lengths are ``sdpa_causal_mask``'s (it runs first and proves them causal by evaluation).

Under autocast (AMP) SDPA casts q / k / v to the autocast dtype: the rewrite inserts the same casts.

Not fused (reason in the fusion report): an additive float mask (SDPA's result for a row of -inf differs from a
row of finfo.min, which the kernel would have to tell apart), dropout that may be > 0, ``is_causal`` together with
a mask, a ``scale`` that is a graph value, q / k / v dtypes other than one of bf16 / fp16 / fp32, head_dim > 256,
and k / v heads that do not divide q's (one k / v head broadcast over q's heads without ``enable_gqa``, as
Falcon's multi-query attention passes it, is fused as GQA). A value head_dim that differs from the query/key one (multi-head latent
attention: DeepSeek-V2/V3, MiniCPM3, Kimi, ...) is fused with zero columns appended to the narrower side and the
output sliced back (``head_dim_pads`` in the report).

Pass options (``pass_options={"sdpa_attention": {...}}``): ``kernel``: ``"auto"`` (default), ``"fxfuse"`` (run
plain causal and chunked recipes through fxfuse's kernel instead of SDPA's causal kernels) or ``"sdpa"`` (chunked
recipes by SDPA wherever it can run them, measured or not). Each site's report entry names the
kernel and why (``kernel``, ``kernel_reason``; see :mod:`fxfuse.attention.dispatch`).
"""
from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

import torch
import torch.fx as fx

import fxfuse.attention.chunked  # noqa: F401  (registers torch.ops.fxfuse.chunked_causal_attention)
import fxfuse.attention.op  # noqa: F401  (registers torch.ops.fxfuse.softcap_attention)
from fxfuse.attention.conventions import DTYPES
from fxfuse.attention.dispatch import KernelChoice, choose_kernel, sdpa_expressible
from fxfuse.attention.mask_recipe import RecipeInputs, erase_dead_masks, mark_mask, read_mask_recipe
from fxfuse.attention.matching import head_dim_pads, known_number, pad_head_dims, slice_head_dim, unrepeat_kv
from fxfuse.attention.sdpa_call import SDPA_TARGETS, causal_sdpa, sdpa_arg
from fxfuse.graph_utils import copy_node_meta, erase_unused, known_true, node_val
from fxfuse.registry import register_pass

NAME = "sdpa_attention"


def _tensor(n: Any) -> Optional[torch.Tensor]:
    v = node_val(n)
    return v if isinstance(v, torch.Tensor) else None


def _match(n: fx.Node) -> Tuple[Optional[dict], str]:
    """The rewrite's operands, or (None, why not)."""
    mask = sdpa_arg(n, "attn_mask")
    if not isinstance(mask, fx.Node):
        return None, ""  # no mask tensor: SDPA's own kernels are the fast path
    mv = _tensor(mask)
    if mv is None:
        return None, "the mask has no fake value"
    if mv.dtype != torch.bool:
        return None, (f"additive {mv.dtype} mask: SDPA gives a row of -inf and a row of finfo.min different "
                      "results, which the fused kernel cannot tell apart")
    if mv.requires_grad:
        return None, "the mask requires grad"
    if sdpa_arg(n, "is_causal", False) is not False:
        return None, "is_causal together with a mask"
    p = known_number(sdpa_arg(n, "dropout_p", 0.0))
    if p is None or p != 0.0:
        return None, f"dropout_p {sdpa_arg(n, 'dropout_p', 0.0)!r} may be > 0"
    scale = sdpa_arg(n, "scale", None)
    if scale is not None:
        scale = known_number(scale)
        if scale is None:
            return None, "scale is a graph value not known at compile time"
    q, k_rep, v_rep = (sdpa_arg(n, a) for a in ("query", "key", "value"))
    qv, kv_, vv_ = _tensor(q), _tensor(k_rep), _tensor(v_rep)
    if qv is None or kv_ is None or vv_ is None or qv.dim() != 4 or kv_.dim() != 4 or vv_.dim() != 4:
        return None, "q / k / v are not 4-D [B, H, S, D]"
    gqa = sdpa_arg(n, "enable_gqa", False)
    if gqa not in (True, False):
        return None, "enable_gqa is a graph value"
    k, nk, krep = unrepeat_kv(k_rep)
    v, nv, vrep = unrepeat_kv(v_rep)
    if nk != nv or not known_true(_tensor(k).shape[1] == _tensor(v).shape[1]):
        k, v, krep, vrep = k_rep, v_rep, [], []
    kv, vv = _tensor(k), _tensor(v)
    B, Hq, S, D = qv.shape
    if not known_true(Hq % kv.shape[1] == 0):
        return None, f"q heads ({Hq}) are not a known multiple of kv heads ({kv.shape[1]})"
    broadcast_kv = not gqa and krep == [] and not known_true(kv.shape[1] == Hq)
    if broadcast_kv and not (known_true(kv.shape[1] == 1) and known_true(vv.shape[1] == 1)):
        return None, "k / v have fewer heads than q without enable_gqa"
    # one k / v head broadcast over q's heads (multi-query attention written as a broadcast, Falcon's) is GQA with
    # every q head in one group: the op's own GQA indexing gives each q head that k / v head
    if not (known_true(kv.shape[0] == B) and known_true(vv.shape[0] == B)):
        return None, "k / v batch is broadcast against q's"
    if not (known_true(kv.shape[3] == D) and known_true(vv.shape[2] == kv.shape[2])):
        return None, "q / k head dims or k / v lengths do not line up"
    pads, why = head_dim_pads(D, vv.shape[3])  # multi-head latent attention: v's head_dim < q's
    if pads is None:
        return None, why
    dts = {qv.dtype, kv.dtype, vv.dtype}
    out = _tensor(n)
    cast_to = None
    if (out is not None and out.dtype in (torch.bfloat16, torch.float16) and dts != {out.dtype}
            and dts <= {out.dtype, torch.float32}):
        # Autocast (AMP): SDPA ran on q / k / v cast to its output dtype (RoPE's fp32 cos / sin leave q and k in
        # fp32 under a bf16 autocast). The op gets the same casts, explicitly.
        cast_to = out.dtype
    elif len(dts) != 1 or qv.dtype not in DTYPES:
        return None, f"q / k / v dtypes {sorted(map(str, dts))}"
    if len({qv.device, kv.device, vv.device, mv.device}) != 1:
        return None, "q / k / v / mask on different devices"
    if mv.dim() not in (2, 3, 4):
        return None, f"{mv.dim()}-D mask"
    target = (B, Hq, S, kv.shape[2])
    for i in range(1, mv.dim() + 1):
        if not (known_true(mv.shape[-i] == 1) or known_true(mv.shape[-i] == target[-i])):
            return None, f"the mask {list(mv.shape)} does not provably broadcast to [B, H, S, Skv] {list(target)}"
    if mv.dim() == 4 and not known_true(mv.shape[1] == 1) and not known_true(mv.shape[1] == Hq):
        return None, "a per-kv-head mask"
    scale = float(D) ** -0.5 if scale is None and isinstance(D, int) else scale
    if scale is None:
        return None, "default scale with a symbolic head_dim"
    n_rep = Hq if broadcast_kv else max(nk, 1)
    return dict(q=q, k=k, v=v, mask=mask, scale=float(scale), n_rep=n_rep, repeat_nodes=krep + vrep,
                cast_to=cast_to, pads=pads, v_head_dim=vv.shape[3], shape=(B, S, kv.shape[2])), ""


def _chunks_choice(m: dict, recipe, mode: str) -> Optional[KernelChoice]:
    """For a recipe of causal attention inside chunks from each row's start: SDPA on the chunks as a batch or
    fxfuse's kernel on the chunk ids (see fxfuse.attention.dispatch); None for any other recipe."""
    size = recipe.chunk_tiling if recipe is not None else None
    if not size:
        return None
    qv = node_val(m["q"])
    B, S, Skv = m["shape"]
    ok, why = sdpa_expressible(softcap=0.0, causal=True, window=0, has_mask=False, has_docs=False,
                               has_key_valid=False, sinks=False, head_dim_pads=tuple(m["pads"]),
                               same_length=known_true(S == Skv), chunks=size)
    head_dim = qv.shape[-1]
    return choose_kernel(mode, qv.device, m["cast_to"] or qv.dtype, head_dim if isinstance(head_dim, int) else -1,
                         ok, why, chunks=size)


@register_pass(name=NAME,
               description="scaled_dot_product_attention with a bool mask tensor (packed / padded / dynamic-length "
                           "batches): the mask read from its recipe -> is_causal=True or fxfuse::softcap_attention "
                           "with no S x S tensor; other masks -> the op with the mask tensor, empty tiles skipped",
               options={"kernel": {"choices": ("auto", "fxfuse", "sdpa"), "default": "auto",
                                   "doc": "auto: plain causal recipes run SDPA's causal kernels (measured faster), "
                                          "chunked ones SDPA on the chunks where measured faster, the rest "
                                          "fxfuse's; fxfuse: fxfuse's kernel for plain causal and chunks too; "
                                          "sdpa: SDPA for chunked recipes wherever it can run them"}})
def sdpa_attention_pass(gm: fx.GraphModule, ctx) -> int:
    count = 0
    inputs, recipes = RecipeInputs(), []
    for mod in ctx.graph_modules(gm):
        g = mod.graph
        changed = 0
        for n in list(g.nodes):
            if n.op != "call_function" or n.target not in SDPA_TARGETS:
                continue
            m, why = _match(n)
            if m is None:
                if why:
                    ctx.skipped(n, "SDPA with a mask", why)
                continue
            recipe, no_recipe = read_mask_recipe(m["mask"], gm, *m["shape"], kind="bool")
            choice = _chunks_choice(m, recipe, ctx.choice_option("kernel"))
            if choice is not None and choice.kernel == "sdpa":
                # causal inside chunks from each row's start (Llama-4): SDPA's causal kernels on the chunks
                with g.inserting_before(n):
                    q, k, v = m["q"], m["k"], m["v"]  # k / v: the kv heads before repeat_kv (the op takes GQA)
                    if m["cast_to"] is not None:  # autocast: SDPA's own casts, explicit
                        q, k, v = (g.call_method("to", (t, m["cast_to"])) for t in (q, k, v))
                        for t in (q, k, v):
                            copy_node_meta(t, n)
                    node = g.call_function(torch.ops.fxfuse.chunked_causal_attention.default,
                                           (q, k, v, recipe.chunk_tiling, m["scale"]))
                    new = g.call_function(operator.getitem, (node, 0))
                copy_node_meta(node, n)
                copy_node_meta(new, n)
                n.replace_all_uses_with(new)
                g.erase_node(n)
                erase_unused(g, m["repeat_nodes"])
                mark_mask(recipe)
                recipes.append(recipe)
                ctx.fused(node, f"SDPA with a chunked causal mask tensor -> fxfuse::chunked_causal_attention: SDPA's "
                                f"causal kernels on the chunks as a batch (mask read from its recipe, GQA "
                                f"{m['n_rep']}:1)", recipe=recipe.describe(), kernel="sdpa",
                          kernel_reason=choice.reason, n_rep=m["n_rep"])
                changed += 1
                continue
            if recipe is not None and recipe.plain_causal and ctx.choice_option("kernel") != "fxfuse":
                # a causal mask at any length (HF materialises it at symbolic lengths): SDPA's own causal kernels
                new = causal_sdpa(g, n)
                n.replace_all_uses_with(new)
                g.erase_node(n)
                mark_mask(recipe)
                recipes.append(recipe)
                ctx.fused(new, "SDPA with a causal mask tensor -> is_causal=True (mask read from its recipe)",
                          recipe=recipe.describe(), kernel="sdpa",
                          kernel_reason="plain causal: torch's causal SDPA kernels (cuDNN first on Hopper); "
                                        "kernel='fxfuse' runs fxfuse's instead")
                changed += 1
                continue
            doc_ranges = key_valid = None
            if recipe is not None:
                doc_ranges, key_valid = inputs.vectors(recipe)
            with g.inserting_before(n):
                q, k, v = m["q"], m["k"], m["v"]
                if m["cast_to"] is not None:
                    q, k, v = (g.call_method("to", (t, m["cast_to"])) for t in (q, k, v))
                    for t in (q, k, v):
                        copy_node_meta(t, n)
                q, k, v = pad_head_dims(g, q, k, v, m["pads"], n)  # v head_dim != q's (MLA): zero columns
                if recipe is not None:  # nothing of size S x Skv: causal / window / documents / padding vectors
                    op_args = (q, k, v, None, m["scale"], 0.0, True, recipe.window, 0, doc_ranges, key_valid)
                else:
                    op_args = (q, k, v, m["mask"], m["scale"], 0.0, False, 0, 0)
                node = g.call_function(torch.ops.fxfuse.softcap_attention.default, op_args)
                out = g.call_function(operator.getitem, (node, 0))
                copy_node_meta(out, n)
                out = slice_head_dim(g, out, m["pads"], m["v_head_dim"], n)
            copy_node_meta(node, n)
            n.replace_all_uses_with(out)
            g.erase_node(n)
            erased = erase_unused(g, m["repeat_nodes"])
            if recipe is not None:
                mark_mask(recipe)
                recipes.append(recipe)
            mv = node_val(m["mask"])
            reason = "SDPA would need the mask tensor"
            if recipe is not None and recipe.plain_causal:
                reason = "kernel='fxfuse' requested"
            elif choice is not None:
                reason = choice.reason
            pad_note = (f", head dims q/k +{m['pads'][0]} v +{m['pads'][1]} zero columns" if any(m["pads"]) else "")
            how = f"mask recipe {recipe.describe()}" if recipe is not None else "mask tensor"
            ctx.fused(node, f"SDPA with a bool mask -> fused attention ({how}, GQA {m['n_rep']}:1, "
                      f"scale {m['scale']:.6g}{pad_note})", head_dim_pads=list(m["pads"]),
                      recipe=recipe.describe() if recipe is not None else None,
                      mask_tensor_kept=None if recipe is not None else no_recipe,
                      mask_shape=[str(s) for s in mv.shape], n_rep=m["n_rep"], masked_rows="zeros",
                      autocast_dtype=str(m["cast_to"]) if m["cast_to"] is not None else None,
                      erased=[e.name for e in erased], kernel="fxfuse", kernel_reason=reason)
            changed += 1
        if changed:
            mod.recompile()
        count += changed
    if recipes:
        erase_dead_masks(gm, recipes, inputs)
    return count
