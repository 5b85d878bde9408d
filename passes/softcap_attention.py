"""Fuse eager attention (with or without a tanh logit softcap) into ``fxfuse::softcap_attention``.

Pattern (Gemma-2 / Gemma-3 eager attention, and any model written the same way; matched by
:mod:`fxfuse.attention.matching`)::

    k_rep, v_rep = repeat_kv(k), repeat_kv(v)     # x[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv*n, S, D),
                                                  # repeat_interleave(x, n, dim=1), or no repeat / plain broadcast
    s = matmul(q, k_rep.transpose(2, 3)) * scaling          # or q * scaling first; scaling a number
    s = cap * tanh(s / cap)                                  # optional softcap
    s = s + mask                                             # optional: additive float mask (a mask[..., :Skv]
                                                             #   prefix slice is fine), masked_fill(~keep, -inf),
                                                             #   where(keep, s, -inf)
    p = softmax(s, dim=-1[, dtype=float32])[.to(q.dtype)]
    p = dropout(p, p_drop, training)                         # only if p_drop == 0 or not training
    out = matmul(p, v_rep)

becomes ``out = fxfuse::softcap_attention(q, k, v, mask, scaling, softcap, False, 0)[0]`` with k / v the kv heads
before the repeat. The [B, Hq, S, Skv] scores, their softcapped / masked / fp32 / cast copies and the probabilities
are never materialised (nor saved for the backward), nor are the repeated k / v.

The mask is read from its recipe when it can be (:mod:`fxfuse.attention.mask_recipe`: HF's additive
``where(keep, 0, finfo.min)`` masks and bool masks built from causal / sliding-window / packed-document / padding
terms, at any length): the op then gets ``causal=True``, the window, ``doc_ranges`` and ``key_valid`` and no mask
tensor, and the mask builders are erased (nothing of size S x Skv anywhere; Gemma-2 / Gemma-3's alternating
window layers each read their own recipe). Any other mask is passed as is (causal=False, window=0): it already
encodes whatever ``masking_utils`` built, so the result is right whatever the mask is; the op's launchers then
classify its tiles empty / full / partial so empty blocks are skipped. The report names the recipe, or why the
mask tensor was kept.

A query row whose every key is masked (left padding: a pad query sees only pad keys) gets what eager gives it,
forward and backward: with HF's finfo.min masks (additive, or masked_fill / where with a finite fill) every score
of the row is absorbed into the fill, so eager averages v uniformly over all keys and still backpropagates
through the raw scores; with a -inf fill eager gives NaN. The op's ``masked_rows`` argument carries which
(``uniform`` / ``nan``, in the report); the loss stays eager's even when such rows keep their labels.

Attention sinks (gpt-oss and relatives: ``c = cat([s, sinks], -1); c = c - c.max(-1, keepdim=True).values;
p = softmax(c)[..., :-1]``, a per-head logit in every row's normaliser) become one more key: q gets a last column
``sink / scaling``, k a zero column plus one extra key that is 1 there, v a zero row (``append_sink_key``), so the
sink's probability joins the normaliser and adds nothing to the output, and its gradient comes back through q's
extra column. It costs one head-dim column (64 -> 65 runs the kernel's 128-wide head-dim tile). A row whose
real keys are all masked keeps the sink: eager's zeros. Not together with a tanh softcap.

Under autocast (AMP: fp32 q / k / v, both matmuls returning bf16 / fp16) the op gets q / k / v cast to that
dtype, as autocast casts them for the matmuls (``autocast_dtype`` in the report).

Which kernel runs the site (:mod:`fxfuse.attention.dispatch`, ``kernel`` / ``kernel_reason`` in the report): where
torch's SDPA can compute it with the op's contract (no softcap, window, documents, key padding, sinks or head-dim
pads; plain causal with S == Skv, or no mask; bf16 / fp16) and was measured faster on the GPU in hand (cuDNN's
causal kernel on Hopper at head dims 64 and 128), the site becomes ``scaled_dot_product_attention(q, k, v,
is_causal=..., scale=scaling, enable_gqa=...)`` on the kv heads; everywhere else fxfuse's op. Pass option
``kernel``: ``"auto"`` (default), ``"fxfuse"``, ``"sdpa"`` (SDPA wherever it can express the site).

Not fused (reason in the fusion report): dropout that may be > 0 in training, scores or probabilities with other
users (``output_attentions``), a scaling that is a graph value with no specialised example value, a mask that is a
slice other than ``[..., :Skv]``, a mask that requires grad, masked_fill with a soft value, softmax not over the
last dim, mismatched dtypes / devices, broadcast batches, head_dim > 256, and ops in the score chain not listed.
"""
from __future__ import annotations

import operator
import torch
import torch.fx as fx
import torch.nn.functional as F

import fxfuse.attention.chunked  # noqa: F401  (registers torch.ops.fxfuse.chunked_causal_attention)
import fxfuse.attention.op  # noqa: F401  (registers torch.ops.fxfuse.softcap_attention)
from fxfuse.attention.dispatch import KERNELS, choose_kernel, sdpa_expressible
from fxfuse.attention.mask_recipe import RecipeInputs, erase_dead_masks, mark_mask, read_mask_recipe
from fxfuse.attention.matching import AttentionSite, append_sink_key, match_attention, pad_head_dims, slice_head_dim
from fxfuse.graph_utils import copy_node_meta, erase_unused, known_true, node_val, numel_hint, op_kind
from fxfuse.registry import register_pass

NAME = "softcap_attention"
_VIEWS = ("view", "reshape", "flatten", "getitem", "squeeze", "unsqueeze", "transpose", "expand", "t", "permute")


def _recipe_of(site: AttentionSite, root: fx.GraphModule):
    """The site's mask read from how it was built, or (None, why the mask tensor is kept)."""
    if site.mask is None:
        return None, ""
    if site.mask_negate:
        return None, "the mask is negated at the site (masked_fill(mask, -inf) of a mask not written as ~keep)"
    if site.sinks is not None:
        return None, "attention sinks append a key the recipe does not describe"
    qv, kv = node_val(site.q), node_val(site.k if site.k is not None else site.k_t)
    skv = kv.shape[2] if site.k is not None else kv.shape[3]
    return read_mask_recipe(site.mask, root, qv.shape[0], qv.shape[2], skv, kind=site.mask_kind)


def _rewrite(gm: fx.GraphModule, site: AttentionSite, ctx, recipe=None, inputs=None, choice=None) -> None:
    g = gm.graph
    with g.inserting_before(site.pv):
        k = site.k
        if k is None:  # scores were q @ k_t with a [B, H, D, Skv] k_t
            k = g.call_method("transpose", (site.k_t, -2, -1))
            copy_node_meta(k, site.qk)
        mask = site.mask
        causal, window, masked_rows, doc_ranges, key_valid = False, 0, site.masked_rows, None, None
        if recipe is not None:  # the mask from its recipe: nothing of size S x Skv reaches the op
            mask, causal, window = None, True, recipe.window
            if choice.kernel != "sdpa":  # SDPA runs plain causal and chunk tilings from their sizes alone
                doc_ranges, key_valid = inputs.vectors(recipe)
            if recipe.fill is not None:  # additive: a -inf fill gives eager's NaN rows, a finite one uniform rows
                masked_rows = 2 if recipe.fill == float("-inf") else 1
        if mask is not None and site.mask_negate:
            mask = g.call_function(torch.logical_not, (mask,))
            copy_node_meta(mask, site.qk)
        q, v = site.q, site.v
        if site.cast_to is not None:  # autocast: cast the operands as autocast cast them for both matmuls
            casts = [g.call_method("to", (t, site.cast_to)) for t in (q, k, v)]
            for c in casts:
                copy_node_meta(c, site.qk)
            q, k, v = casts
        if site.sinks is not None:  # gpt-oss's attention sinks: one more key (see append_sink_key)
            ext = g.call_function(append_sink_key, (q, k, v, mask, site.sinks, site.scaling))
            parts = [g.call_function(operator.getitem, (ext, i)) for i in range(4 if mask is not None else 3)]
            for t in [ext, *parts]:
                copy_node_meta(t, site.qk)
            q, k, v = parts[:3]
            mask = parts[3] if mask is not None else None
        tiling = recipe.chunk_tiling if recipe is not None else None
        if choice.kernel == "sdpa" and tiling:  # causal inside chunks: SDPA on the chunks as a batch
            node = g.call_function(torch.ops.fxfuse.chunked_causal_attention.default, (q, k, v, tiling, site.scaling))
            out = g.call_function(operator.getitem, (node, 0))
            copy_node_meta(out, site.qk)
        elif choice.kernel == "sdpa":  # torch's kernel measured faster for this recipe (fxfuse.attention.dispatch)
            node = out = g.call_function(F.scaled_dot_product_attention, (q, k, v, None, 0.0, causal),
                                         {"scale": site.scaling, "enable_gqa": site.n_rep > 1})
        else:
            q, k, v = pad_head_dims(g, q, k, v, site.pads, site.qk)  # v head_dim != q's (MLA): zero columns
            node = g.call_function(torch.ops.fxfuse.softcap_attention.default,
                                   (q, k, v, mask, site.scaling, site.softcap, causal, window, masked_rows,
                                    doc_ranges, key_valid))
            out = g.call_function(operator.getitem, (node, 0))
            copy_node_meta(out, site.qk)
            out = slice_head_dim(g, out, site.pads, site.v_head_dim, site.qk)
    copy_node_meta(node, site.qk)
    site.pv.replace_all_uses_with(out)
    g.erase_node(site.pv)
    return node


def _kernel_choice(site: AttentionSite, recipe, mode: str):
    """fxfuse's kernel or torch's SDPA for this site (see fxfuse.attention.dispatch)."""
    qv, kv = node_val(site.q), node_val(site.k if site.k is not None else site.k_t)
    skv = kv.shape[2] if site.k is not None else kv.shape[3]
    tiling = recipe.chunk_tiling if recipe is not None else None
    if site.mask is not None and recipe is None:
        ok, why = False, "a mask tensor the recipe reader could not prove"
    else:
        plain = recipe is None or recipe.plain_causal or bool(tiling)
        ok, why = sdpa_expressible(
            softcap=site.softcap, causal=recipe is not None, window=recipe.window if recipe is not None else 0,
            has_mask=False, has_docs=not plain, has_key_valid=not plain, sinks=site.sinks is not None,
            head_dim_pads=tuple(site.pads), same_length=known_true(qv.shape[2] == skv), chunks=tiling or 0)
    head_dim = qv.shape[-1]
    return choose_kernel(mode, qv.device, site.cast_to or qv.dtype, head_dim if isinstance(head_dim, int) else -1,
                         ok, why, causal=recipe is not None, chunks=tiling or 0)


@register_pass(name=NAME,
               description="eager attention (q @ k^T, scale, tanh softcap, mask, softmax, dropout 0, @ v; GQA by "
                           "repeat_kv) -> fxfuse::softcap_attention (or SDPA where measured faster)",
               options={"kernel": {"choices": KERNELS, "default": "auto",
                                   "doc": "auto: the measured faster of fxfuse's kernel and SDPA where SDPA can "
                                           "run the site; fxfuse / sdpa force one"}})
def softcap_attention_pass(gm: fx.GraphModule, ctx) -> int:
    count = 0
    inputs, recipes = RecipeInputs(), []
    for mod in ctx.graph_modules(gm):
        g = mod.graph
        sites = [n for n in g.nodes if n.op in ("call_function", "call_method") and op_kind(n) == "softmax"]
        changed = 0
        for sm in sites:
            if sm.graph is not g or sm not in g.nodes:  # erased by an earlier site (cannot happen; be safe)
                continue
            site, why = match_attention(sm)
            if site is None:
                if why:
                    ctx.skipped(sm, "attention", why)
                continue
            score_numel = numel_hint(node_val(site.qk))
            recipe, no_recipe = _recipe_of(site, gm)
            choice = _kernel_choice(site, recipe, ctx.choice_option("kernel"))
            node = _rewrite(mod, site, ctx, recipe, inputs, choice)
            if recipe is not None:
                mark_mask(recipe)
                recipes.append(recipe)
            erased = erase_unused(g, site.nodes)
            # What is no longer materialised: every erased [B, Hq, S, Skv]-sized tensor (scores, their softcapped /
            # masked / fp32 / cast copies, the probabilities) and the repeated k / v, each once in the forward and
            # once as a saved activation or gradient in the backward.
            saved = 0
            for n in erased:
                v = node_val(n)
                if isinstance(v, torch.Tensor) and (op_kind(n) not in _VIEWS or op_kind(n) == "reshape"):
                    saved += 2 * numel_hint(v) * v.element_size()
            detail = dict(scaling=site.scaling, softcap=site.softcap, mask=site.mask_kind,
                          mask_node=site.mask.name if site.mask is not None else None, n_rep=site.n_rep,
                          causal=recipe is not None, window=recipe.window if recipe is not None else 0,
                          recipe=recipe.describe() if recipe is not None else None,
                          mask_tensor_kept=no_recipe or None, dropout=site.dropout, scores_numel=score_numel,
                          masked_rows=("zeros", "uniform", "nan")[site.masked_rows],
                          autocast_dtype=str(site.cast_to) if site.cast_to is not None else None,
                          head_dim_pads=list(site.pads), sinks=site.sinks.name if site.sinks is not None else None,
                          erased=[n.name for n in erased], kernel=choice.kernel, kernel_reason=choice.reason)
            op = (f"attention ({'softcap ' + format(site.softcap, 'g') + ', ' if site.softcap else ''}"
                  f"scaling {site.scaling:.6g}, "
                  + (f"mask recipe {recipe.describe()}" if recipe is not None else f"{site.mask_kind} mask")
                  + f", GQA {site.n_rep}:1"
                  + (", attention sinks" if site.sinks is not None else "")
                  + (f", head dims q/k +{site.pads[0]} v +{site.pads[1]} zero columns" if any(site.pads) else "")
                  + ((", run by fxfuse::chunked_causal_attention (SDPA on the chunks as a batch)"
                      if recipe is not None and recipe.chunk_tiling else ", run by SDPA")
                     if choice.kernel == "sdpa" else "")
                  + ")")
            ctx.fused(node, op, saved_bytes=saved, **detail)
            changed += 1
        if changed:
            mod.recompile()
        count += changed
    if recipes:
        erase_dead_masks(gm, recipes, inputs)
    return count
