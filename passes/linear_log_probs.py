"""Fuse an lm-head projection with per-token log-probabilities (and entropy) into ``fxfuse::linear_log_probs``.

Patterns (RL / preference losses written against the logits; ``z`` = the logit chain of ``_logit_chain``: the
projection, label-shift slices, casts, ``/ temperature``, an optional softcap)::

    lp   = log_softmax(z, dim=-1)                       # or z.log_softmax(-1)
    logp = lp.gather(-1, index[..., None])[.squeeze(-1)]    # the chosen tokens' log-probabilities
    ent  = -(lp.exp() * lp).sum(-1)                     # optional, on the same lp: the entropy
           -(softmax(z, -1) * lp).sum(-1)
    logp = z.gather(-1, index[..., None]).squeeze(-1) - logsumexp(z, -1)     # the same log-probs, spelled out
    logp = z.gather(-1, index[..., None]) - logsumexp(z, -1, keepdim=True)   # (or .unsqueeze(-1)), [..., 1]
    ent  = lse - (softmax(z, -1) * z).sum(-1)          # optional, on the same lse = logsumexp(z, -1)
    per-row loops over the batch (TRL's ``selective_log_softmax``), unrolled by Dynamo:
    stack([log_softmax(z[i], -1).gather(-1, index[i]) for i]), stack([logsumexp(z[i], -1) for i])

become one ``fxfuse::linear_log_probs(hidden, weight, index, bias, temperature, softcap, return_entropy)`` call:
the [tokens x vocab] logits, their fp32 copy and the log-softmax are never materialised (nor saved for the
backward); the backward recomputes the logits chunk by chunk and takes any per-token upstream gradient
(advantages, masks, importance ratios). ``z = post * tanh(pre * logits)`` maps onto the op's
``softcap(logits) / temperature`` with ``softcap = 1 / pre`` and ``temperature = 1 / (pre * post)``.

Not fused (reason in the fusion report): a log-softmax with other users (the full distribution is needed), a
gather over another dim or with more than one index per row, a logit chain with anything but the ops above, a
non-positive temperature. Per-row loops are folded back into the batched form (``_row_loops``) only for the
duration of the match: a loop whose batched form is not fused is left exactly as it was (it bounds memory).
TRL's Triton kernel (its ``selective_log_softmax`` on CUDA) is an opaque autograd function, not fused.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

import fxfuse.ops.linear_log_probs  # noqa: F401  (registers torch.ops.fxfuse.linear_log_probs)
from fxfuse.graph_utils import arg, copy_node_meta, erase_unused, known_true, node_val, numel_hint, op_kind
from fxfuse.registry import register_pass

from ._logit_chain import CHUNK_BYTES_OPTION, LogitChain, chunk_bytes_option, is_last_dim, local_operands, \
    match_logit_chain
from ._row_loops import fold_row_loops

NAME = "linear_log_probs"


def _gather_index(g: fx.Node) -> Tuple[Optional[fx.Node], Optional[fx.Node], str]:
    """(index [...], squeeze node or None, why) for ``lp.gather(-1, index[..., None])[.squeeze(-1)]``."""
    if not is_last_dim(g, arg(g, "dim")):
        return None, None, "gather not over the last dim"
    idx = arg(g, "index")
    iv, gv = node_val(idx), node_val(g)
    if not isinstance(iv, torch.Tensor) or not isinstance(gv, torch.Tensor) or iv.dim() < 1:
        return None, None, "gather index has no fake value"
    if not known_true(iv.shape[-1] == 1):
        return None, None, "more than one index per row (top-k gathers are not fused)"
    squeeze = None
    users = list(g.users)
    if len(users) == 1 and op_kind(users[0]) == "squeeze" and arg(users[0], "dim") in (-1, gv.dim() - 1):
        squeeze = users[0]
    return idx, squeeze, ""


def _entropy_site(lp: fx.Node, z: fx.Node, user: fx.Node) -> Optional[List[fx.Node]]:
    """``user`` (a consumer of lp) starts ``-(exp(lp) * lp).sum(-1)`` or ``-(softmax(z) * lp).sum(-1)``: the
    nodes [exp|softmax, mul, sum, neg], else None."""
    if op_kind(user) != "mul":
        return None
    a, b = arg(user, "input"), arg(user, "other")
    p = b if a is lp else (a if b is lp else None)
    if not isinstance(p, fx.Node):
        return None
    is_exp = op_kind(p) == "exp" and arg(p, "input") is lp
    is_softmax = op_kind(p) == "softmax" and arg(p, "input") is z and is_last_dim(p, arg(p, "dim"))
    if not (is_exp or is_softmax) or len(user.users) != 1 or len(p.users) != 1:
        return None
    s = next(iter(user.users))
    if op_kind(s) != "sum" or not is_last_dim(s, arg(s, "dim")) or arg(s, "keepdim", False) or len(s.users) != 1:
        return None
    neg = next(iter(s.users))
    if op_kind(neg) != "neg":
        return None
    return [p, user, s, neg]  # in dependency order (erased in reverse)


def _entropy_from_lse(lse: fx.Node, z: fx.Node, user: fx.Node) -> Optional[List[fx.Node]]:
    """``user`` is ``lse - (softmax(z, -1) * z).sum(-1)`` (the entropy from the logits): the nodes
    [softmax, mul, sum, sub], else None."""
    if op_kind(user) != "sub" or arg(user, "input") is not lse:
        return None
    s = arg(user, "other")
    if op_kind(s) != "sum" or not is_last_dim(s, arg(s, "dim")) or arg(s, "keepdim", False) or len(s.users) != 1:
        return None
    m = arg(s, "input")
    if op_kind(m) != "mul" or len(m.users) != 1:
        return None
    a, b = arg(m, "input"), arg(m, "other")
    p = a if b is z else (b if a is z else None)
    if not (op_kind(p) == "softmax" and arg(p, "input") is z and is_last_dim(p, arg(p, "dim"))
            and len(p.users) == 1 and arg(p, "dtype") is None):
        return None
    return [p, m, s, user]


def _op_scalars(chain: LogitChain) -> Tuple[Optional[Tuple[float, float]], str]:
    """(temperature, softcap) of the op for the chain's ``post * tanh(pre * x)`` or ``scale * x``."""
    if chain.tanh:
        pre, post = chain.pre_scale, chain.post_scale
        if not (pre > 0 and post > 0):
            return None, "softcap chain with a non-positive scale"
        return (1.0 / (pre * post), 1.0 / pre), ""
    if not chain.scale > 0:
        return None, f"non-positive logit scale {chain.scale:g}"
    return (1.0 / chain.scale, 0.0), ""


@dataclass
class _Site:
    anchor: fx.Node                   # the node reports point at
    z: fx.Node                        # the logits the log-softmax reads
    chain: LogitChain
    idx: fx.Node                      # the gather index, [..., 1]
    logp_out: fx.Node                 # replaced by the op's log-probs
    logp_keepdim: bool                # logp_out is [..., 1] (else [...])
    erase: List[fx.Node]              # replaced nodes, erased in this order
    entropy_out: Optional[fx.Node] = None


def _match_log_softmax(lp: fx.Node) -> Tuple[Optional[_Site], str]:
    """``lp = log_softmax(z, -1)``; ``lp.gather(-1, idx)[.squeeze(-1)]`` (+ an entropy on lp)."""
    if not is_last_dim(lp, arg(lp, "dim")):
        return None, "log_softmax not over the last dim"
    z = arg(lp, "input")
    gathers = [u for u in lp.users if op_kind(u) == "gather" and arg(u, "input") is lp]
    entropy = None
    others = [u for u in lp.users if u not in gathers]
    for u in others:
        entropy = entropy or _entropy_site(lp, z, u)
    # lp's users must be exactly one gather plus (optionally) the entropy's mul and exp
    if len(gathers) != 1 or (others and (entropy is None or not set(others) <= set(entropy))):
        if gathers or others:
            return None, "the log-softmax has other users than one gather (and an entropy): the full distribution " \
                         "is needed"
        return None, ""
    gnode = gathers[0]
    idx, squeeze, why = _gather_index(gnode)
    if idx is None:
        return None, why
    out = squeeze if squeeze is not None else gnode
    erase = ([squeeze] if squeeze is not None else []) + [gnode] + (entropy[::-1] if entropy else []) + [lp]
    return _Site(lp, z, None, idx, out, squeeze is None, erase, entropy[-1] if entropy else None), ""


def _match_selected_minus_lse(sub: fx.Node) -> Tuple[Optional[_Site], str]:
    """``z.gather(-1, idx)[.squeeze(-1)] - logsumexp(z, -1[, keepdim])`` (log_softmax(x_i) = x_i - lse(x))."""
    a, b = arg(sub, "input"), arg(sub, "other")
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None, ""
    unsq = None  # logsumexp(z, -1).unsqueeze(-1): the keepdim form written out
    if op_kind(b) == "unsqueeze" and op_kind(arg(b, "input")) == "logsumexp" and len(b.users) == 1:
        inner = arg(b, "input")
        bv = node_val(b)
        if isinstance(bv, torch.Tensor) and arg(b, "dim") in (-1, bv.dim() - 1) and not arg(inner, "keepdim", False):
            unsq, b = b, inner
    if op_kind(b) != "logsumexp":
        return None, ""
    squeeze = a if op_kind(a) == "squeeze" else None
    gnode = arg(a, "input") if squeeze is not None else a
    if op_kind(gnode) != "gather":
        return None, ""
    z = arg(b, "input")
    if arg(gnode, "input") is not z or not is_last_dim(b, arg(b, "dim")):
        return None, "selected logits minus a logsumexp of other logits / over another dim"
    keepdim = bool(arg(b, "keepdim", False)) or unsq is not None
    if keepdim == (squeeze is not None):
        return None, "selected logits and logsumexp shapes do not line up"
    if any(len(n.users) != 1 for n in (a,) + ((gnode,) if squeeze is not None else ())):
        return None, "the selected logits have other users"
    entropy = None
    lse_others = [u for u in b.users if u is not (unsq if unsq is not None else sub)]
    if unsq is not None and len(unsq.users) != 1:
        return None, "the logsumexp has other users"
    if lse_others:
        entropy = _entropy_from_lse(b, z, lse_others[0]) if len(lse_others) == 1 else None
        if entropy is None:
            return None, "the logsumexp has other users (than the log-probs and an entropy)"
    idx, _, why = _gather_index(gnode)
    if idx is None:
        return None, why
    erase = ([sub] + ([squeeze] if squeeze is not None else []) + [gnode] + ([unsq] if unsq is not None else [])
             + (entropy[::-1] if entropy else []) + [b])
    return _Site(sub, z, None, idx, sub, keepdim, erase, entropy[-1] if entropy else None), ""


def _op_outputs(g: fx.Graph, fused: fx.Node, site: _Site, index: fx.Node) -> List[Tuple[fx.Node, fx.Node]]:
    """At the insertion point: (replaced node, its replacement) for the site's log-probs (and entropy), read from
    the fused op's outputs 0 (and 1) in the shapes and dtypes the graph had."""
    outs = [(site.logp_out, 0, site.idx if site.logp_keepdim else index)]
    if site.entropy_out is not None:
        outs.append((site.entropy_out, 1, index))
    repl = []
    for old, i, like in outs:
        new = g.call_method("view_as", (g.call_function(operator.getitem, (fused, i)), like))
        if node_val(old).dtype != torch.float32:
            new = g.call_method("to", (new, node_val(old).dtype))
        repl.append((old, new))
    return repl


def _replace_site(g: fx.Graph, site: _Site, chain: LogitChain, repl) -> List[fx.Node]:
    """Points the site's readers at the op's outputs, erases what the site replaced and what of the logit chain is
    left unused (returned)."""
    for old, new in repl:
        old.replace_all_uses_with(new)
    for n in site.erase:
        g.erase_node(n)
    return erase_unused(g, chain.nodes)


def _rewrite(gm: fx.GraphModule, site: _Site, ctx) -> bool:
    g = gm.graph
    what = "log_softmax + gather" if op_kind(site.anchor) == "log_softmax" else "selected logit - logsumexp"
    chain, why = match_logit_chain(site.z)
    if chain is None:
        ctx.skipped(site.anchor, what, f"no lm-head projection feeds it: {why}")
        return False
    if chain.weight_transposed:
        ctx.skipped(site.anchor, what, "projection by a [D, V] matrix (not an lm-head weight)")
        return False
    if chain.vocab_split is not None:
        return _rewrite_vocab_parallel(gm, site, chain, what, ctx)
    scal, why = _op_scalars(chain)
    if scal is None:
        ctx.skipped(site.anchor, what, why)
        return False
    temperature, softcap = scal
    hv, wv = node_val(chain.hidden), node_val(chain.weight)
    if hv.dtype != wv.dtype or hv.device != wv.device:
        ctx.skipped(site.anchor, what, "hidden and weight dtypes or devices differ")
        return False
    # One insertion point for the op and everything that reads it: the first of the outputs it replaces (their
    # users all come later), which must come after every input of the op (the graph stays topologically sorted).
    order = {n: i for i, n in enumerate(g.nodes)}
    first = min([site.logp_out] + ([site.entropy_out] if site.entropy_out is not None else []),
                key=order.__getitem__)
    inputs = [chain.hidden, chain.weight, site.idx] + ([chain.bias] if chain.bias is not None else [])
    if any(order[i] >= order[first] for i in inputs if isinstance(i, fx.Node)):
        ctx.skipped(site.anchor, what, "the gather index is computed after the outputs it would replace")
        return False
    entropy = site.entropy_out is not None
    with g.inserting_before(first):
        h = chain.hidden
        for ri in chain.row_index:
            h = g.call_function(operator.getitem, (h, ri))
        index = g.call_method("squeeze", (site.idx, -1))
        fused = g.call_function(torch.ops.fxfuse.linear_log_probs.default,
                                (h, chain.weight, index, chain.bias, float(temperature), float(softcap), entropy,
                                 chunk_bytes_option(ctx)))
        copy_node_meta(fused, site.anchor)
        repl = _op_outputs(g, fused, site, index)
    dead = _replace_site(g, site, chain, repl)
    saved = 0
    for n in dead + [x for x in site.erase if op_kind(x) in ("log_softmax", "logsumexp", "exp", "softmax", "mul")]:
        v = node_val(n)
        if isinstance(v, torch.Tensor) and op_kind(n) not in ("view", "reshape", "getitem", "squeeze", "unsqueeze"):
            saved += 2 * numel_hint(v) * v.element_size()
    still = [n.name for n in chain.nodes if n not in dead]
    op = (f"{what}{' + entropy' if entropy else ''} <- {op_kind(chain.projection)} "
          f"(temperature {temperature:g}{', softcap ' + format(softcap, 'g') if softcap else ''})")
    ctx.fused(fused, op, saved_bytes=saved, temperature=temperature, softcap=softcap, entropy=entropy,
              tokens_x_vocab=numel_hint(node_val(site.z)), logits_still_materialised=still)
    return True


def _rewrite_vocab_parallel(gm: fx.GraphModule, site: _Site, chain: LogitChain, what: str, ctx) -> bool:
    """Log-probs (and an entropy) of a vocabulary-sharded DTensor lm-head (tensor parallelism):
    ``fxfuse::vocab_parallel_log_probs`` on the local shards, the ranks combining O(N) row statistics."""
    import fxfuse.ops.vocab_parallel_log_probs  # noqa: F401  (registers the op)
    from torch.distributed.tensor import DTensor

    outs = [site.logp_out] + ([site.entropy_out] if site.entropy_out is not None else [])
    if any(isinstance(node_val(n), DTensor) for n in outs + [site.idx]):
        ctx.skipped(site.anchor, what, "log-probs taken on the sharded logits (DTensor outputs)")
        return False
    scal, why = _op_scalars(chain)
    if scal is None:
        ctx.skipped(site.anchor, what, why)
        return False
    temperature, softcap = scal
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    first = min(outs, key=order.__getitem__)
    if any(order[i] >= order[first] for i in (chain.hidden, chain.weight, site.idx)):
        ctx.skipped(site.anchor, what, "the gather index is computed after the outputs it would replace")
        return False
    split = chain.vocab_split
    entropy = site.entropy_out is not None
    with g.inserting_before(first):
        index = g.call_method("squeeze", (site.idx, -1))
        h, w, t = local_operands(g, chain, index)
        fused = g.call_function(torch.ops.fxfuse.vocab_parallel_log_probs.default,
                                (h, w, t, split.vocab_size, split.group_name, float(temperature), float(softcap),
                                 entropy, chunk_bytes_option(ctx)))
        copy_node_meta(fused, site.anchor)
        repl = _op_outputs(g, fused, site, index)
    dead = _replace_site(g, site, chain, repl)
    ctx.fused(fused, f"{what}{' + entropy' if entropy else ''} <- {op_kind(chain.projection)} over a vocabulary "
                     f"split between ranks (tensor parallelism): vocab_parallel_log_probs",
              saved_bytes=numel_hint(node_val(site.z)) * 4 // split.world, vocab_parallel=True, group=split.group_name,
              temperature=temperature, softcap=softcap, entropy=entropy, tokens_x_vocab=numel_hint(node_val(site.z)),
              logits_still_materialised=[n.name for n in chain.nodes if n not in dead])
    return True


@register_pass(name=NAME,
               description="lm-head projection -> log_softmax -> gather (+ entropy) -> fxfuse::linear_log_probs",
               options={"chunk_bytes": CHUNK_BYTES_OPTION})
def linear_log_probs_pass(gm: fx.GraphModule, ctx) -> int:
    count = 0
    for mod in ctx.graph_modules(gm):
        changed = 0
        folds = fold_row_loops(mod.graph)
        in_loops = {n for f in folds for n in f.loop}
        for node in list(mod.graph.nodes):
            if node in in_loops or node.graph is not mod.graph or node not in mod.graph.nodes:
                continue  # a folded loop's rows (its batched form is matched instead), or erased by a site
            kind = op_kind(node)
            if kind not in ("log_softmax", "sub"):
                continue
            site, why = (_match_log_softmax if kind == "log_softmax" else _match_selected_minus_lse)(node)
            if site is None:
                if why:
                    ctx.skipped(node, "log_softmax + gather" if kind == "log_softmax" else
                                "selected logit - logsumexp", why)
                continue
            if _rewrite(mod, site, ctx):
                changed += 1
        for f in folds:  # keep a fold only where its batched form was fused
            if f.folded():
                f.finish(mod.graph)
            else:
                f.undo(mod.graph)
        if changed:
            mod.recompile()
        count += changed
    return count
