"""A padded batch's token-wise graph run on its real tokens only: ``[B, S]`` padded rows -> one packed row ``[1, N]``
(issue 31; the investigation and the plan: ``benchmarks/unpad_notes.md``).

HF Trainer's collators pad every batch to its longest row, and every projection, norm, MLP and the lm-head then
work on the padding too. Where the graph's attention masks were read by their recipe (causal [+ window] + key
padding ``attention_mask[b, kv]``: the attention passes ran first) and the loss is fxfuse's lm-head op, this pass:

1. finds the token region from the embedding on (``_token_dims``: every node there acts on each token alone, or
   is an fxfuse attention / loss op; anything else refuses the pass, with the node and why);
2. computes once, at the top of the graph, the flat indices ``idx`` of the tokens to keep (``nonzero``: the one
   host synchronisation of the step; the count ``N`` is an unbacked size, so no length recompiles anything):
   ``attention_mask`` tokens, plus a padding position whose shifted label is used (a left-padded row's first-token
   loss term, which eager predicts from the last pad: kept, so the loss stays eager's), plus, where a site has a
   sliding window, any padding between a row's kept tokens (the window counts columns);
3. gathers what enters the region into the packed layout (the token ids before the embedding, RoPE's cos / sin by
   position ``idx % S``, the shifted labels), and writes every size Dynamo baked into the region with ``B -> 1``,
   ``S -> N``, ``B * S -> N``;
4. re-targets every attention site from key padding to packed documents: each row's kept tokens one document,
   but a kept padding token that sees no key (left padding's last pad) goes after all rows as its own empty
   document, so the rows hold padding only where eager's rows hold it between real tokens; the kept tokens' key
   flags mask that. Positions stay the column index (RoPE as eager);
5. scatters what the graph returns per token (the hidden states behind the lazy logits) back to ``[B, S, ...]``
   with zeros at the positions it dropped: pad positions of the logits read 0.

Values at kept positions equal eager's (the packed row's attention is each row's attention), and so do the loss
and every gradient. Not unpadded (the report says why): attention sites whose fully masked rows average every key
of the padded row (HF eager attention's ``finfo.min`` masks: Llama eager, Gemma-2), where a kept padding query
(left padding) cannot get eager's value from the packed row; a graph whose token-wise part holds an op the
analysis does not know; per-token outputs whose loss is computed in another graph.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, List, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxfuse.attention.conventions import MASKED_ROWS_UNIFORM
from fxfuse.attention.op import document_ranges
from fxfuse.graph_utils import node_val, op_kind
from fxfuse.registry import register_pass

from ._token_dims import B, S, T, token_region

NAME = "unpad_tokens"
_ATTENTION = torch.ops.fxfuse.softcap_attention.default


# ------------------------------------------------------------------------------------------------ traced helpers
# Small functions the rewritten graph calls: AOTAutograd traces through them, so they are plain torch code.
def packed_index(key_valid: torch.Tensor, fill_holes: bool, *targets_and_ignore
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(idx [N] int64, doc_ranges [2, 1, N] int32, key_valid [1, N] bool): the kept tokens of ``key_valid`` [B, S]
    as one packed row. Kept: the tokens it marks, and padding whose shifted label (``targets_and_ignore`` = target
    [B*S], ignore_index, ...) is used. ``nonzero`` is the step's one host synchronisation.

    Each row's kept tokens form one document, in column order, with one exception: a kept padding token with no
    real token before it in its row (a left-padded row's last pad, whose label is the row's first token) sees no
    key at all. It goes after every row, as its own empty document (its start past its index: a dead query), so
    the rows' spans hold no padding and the attention kernels read no key flags (they cost ~20% of a layer's
    attention; benchmarks/unpad_notes.md). What a dead query computes is its own token's alone: its place in the
    row is free, and its key is flagged valid (no query reaches it), so that left padding leaves the key flags all
    True: the kernels then skip reading them. Kept padding after a real token of its row sees that row's keys
    before it: it stays in place, a hole that the key flags mask (rare: labels not masked at padding, or holes
    inside a row).

    With ``fill_holes`` (a sliding window counts columns: kept tokens must be consecutive columns) every position
    between a row's first and last kept token is kept too, and every kept token stays in place.

    At least one token is kept: a batch of padding only keeps its first position (a dead query, or under
    ``fill_holes`` a query whose keys are all flagged), and the count is declared >= 1
    (``torch._constrain_as_size``). Without that bound contiguous strides read ``max(1, N)``, not the ``N`` of
    Inductor's buffers, and Inductor copied the document ranges once per layer to reach the attention op's
    strides."""
    real = key_valid.to(torch.bool)
    rows, cols = key_valid.shape
    keep = real.reshape(-1)
    for i in range(0, len(targets_and_ignore), 2):
        keep = keep | (targets_and_ignore[i].reshape(-1) != targets_and_ignore[i + 1])
    # at least one kept token, so that N >= 1 can be declared (see above)
    keep = keep | ((torch.arange(keep.shape[0], device=keep.device) == 0) & ~keep.any())
    if fill_holes:
        k = keep.view(key_valid.shape).to(torch.int32)
        before = k.cummax(1).values.bool()
        after = k.flip(1).cummax(1).values.flip(1).bool()
        keep = (before & after).reshape(-1)
        dead = torch.zeros_like(keep)
    else:
        seen = real.to(torch.int32).cummax(1).values.bool().reshape(-1)  # a real token at or before this column
        dead = keep & ~seen
    idx = torch.nonzero(keep).reshape(-1)
    torch._constrain_as_size(idx.shape[0], min=1)
    dead = dead.index_select(0, idx)
    order = torch.argsort(dead.to(torch.int8), stable=True)  # rows first, in order; dead queries after them
    idx, dead = idx.index_select(0, order), dead.index_select(0, order)
    pos = torch.arange(idx.shape[0], device=idx.device)
    segment = torch.where(dead, rows + pos, torch.div(idx, cols, rounding_mode="floor"))  # non-decreasing
    docs = document_ranges(segment.unsqueeze(0))
    start = torch.where(dead.unsqueeze(0), (pos + 1).to(docs.dtype).unsqueeze(0), docs[0])
    # a dead token's key is flagged valid: no query reaches it (its own sees nothing, the rows' come before it),
    # and a packed row whose flags are all True runs the attention kernels without reading them
    flags = (real.view(-1).index_select(0, idx) | dead).unsqueeze(0)
    return idx, torch.stack([start, docs[1]]), flags


def gather_rows_positions(x: torch.Tensor, idx: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with dims (dim, dim + 1) = (B, S) -> (1, N): the kept tokens, in order."""
    return x.flatten(dim, dim + 1).index_select(dim, idx).unsqueeze(dim)


def gather_positions(x: torch.Tensor, idx: torch.Tensor, dim: int, cols: int) -> torch.Tensor:
    """``x`` with dim = S (its row dims are broadcast, size 1) -> N: the kept tokens' columns."""
    return x.index_select(dim, torch.remainder(idx, cols))


def gather_flat(x: torch.Tensor, idx: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with dim = B * S -> N."""
    return x.index_select(dim, idx)


def scatter_rows_positions(y: torch.Tensor, idx: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``y`` [1, N, ...] back to [rows, cols, ...], zeros at the positions not kept."""
    flat = y.reshape((y.shape[1],) + tuple(y.shape[2:]))
    out = flat.new_zeros((rows * cols,) + tuple(y.shape[2:])).index_copy(0, idx, flat)
    return out.view((rows, cols) + tuple(y.shape[2:]))


# ------------------------------------------------------------------------------------------------ the pass
class _Skip(Exception):
    pass


def _source(n: fx.Node) -> fx.Node:
    """Through casts / contiguous (the normalisation layer's kinds) to the tensor a mask came from."""
    while op_kind(n) in ("cast", "contiguous"):
        n = n.args[0]
    return n


def _to_hoist(node: fx.Node, before: fx.Node, region: set) -> List[fx.Node]:
    """What must move before ``before`` for ``node`` to be computed there (nothing of the region), in graph order;
    moving them is left to the caller, once every check has passed."""
    order = {n: i for i, n in enumerate(before.graph.nodes)}
    need, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in need or n.op in ("placeholder", "get_attr") or order[n] < order[before]:
            continue
        if n in region:
            raise _Skip(f"the loss target {node} is computed from the token region")
        need.add(n)
        todo.extend(n.all_input_nodes)
    return sorted(need, key=order.__getitem__)


def _allow_dynamic_output_shapes(ctx) -> None:
    """``nonzero``'s size is data-dependent: the compile's ShapeEnv must allow it (Dynamo's
    ``capture_dynamic_output_shape_ops``, here for this graph's compile only). A private setting (``ShapeEnv.settings``,
    a frozen dataclass): tests/test_unpad_tokens.py fails on a torch version that drops it."""
    env = getattr(ctx.fake_mode, "shape_env", None)
    if env is None:
        raise _Skip("no ShapeEnv to give the kept-token count an unbacked size (a graph not from Dynamo)")
    if not env.allow_dynamic_output_shape_ops:
        env.settings = dataclasses.replace(env.settings, allow_dynamic_output_shape_ops=True)


def _call(g: fx.Graph, fn, args, name=None) -> fx.Node:
    n = g.call_function(fn, tuple(args))
    if name:
        n.name = g._graph_namespace.create_name(name, None)
    return n


def _unpad(gm: fx.GraphModule, ctx) -> int:
    g = gm.graph
    if ctx.options.inductor.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs):
        raise _Skip("CUDA graphs (mode='reduce-overhead') cannot capture the kept-token count's host "
                    "synchronisation (nonzero)")
    if ctx.verify is not None:
        raise _Skip("options['verify'] compares every output position with the padded graph's, and the padding "
                    "positions of the returned logits / hidden states change by design (0 where dropped)")
    embs = [n for n in g.nodes if n.op == "call_function" and n.target is F.embedding]
    if len(embs) > 1:
        raise _Skip(f"{len(embs)} embedding lookups in the graph (one, where the tokens enter, is needed)")
    if not embs:  # the embeddings arrive as an input (a graph break after the lookup, e.g. PEFT's input hook)
        embs = [n for n in g.nodes if n.op == "placeholder" and isinstance(node_val(n), torch.Tensor)
                and node_val(n).dim() == 3 and node_val(n).is_floating_point()
                and not isinstance(node_val(n), torch.nn.Parameter)]
        if len(embs) != 1:
            raise _Skip("no embedding lookup, and not one [B, S, D] input the tokens could enter from")
    emb = embs[0]
    r = token_region(gm, emb)
    if not r.ok:
        node, why = r.refused
        raise _Skip(f"the token region ends at {node}: {why}")
    if not r.attention:
        raise _Skip("no attention site in the token region")
    feeds = {}  # body placeholder -> the operand of the checkpoint call that feeds it
    for call, body in r.bodies:
        for ph, a in zip([p for p in body.graph.nodes if p.op == "placeholder"], call.args[1:]):
            feeds[ph] = a

    def outer(n):  # through casts, and from a checkpoint body's input to what feeds it
        n = _source(n)
        while n in feeds:
            n = _source(feeds[n])
        return n

    kvs = set()
    for a in r.attention:
        args = list(a.args) + [None] * (11 - len(a.args))
        if args[3] is not None or args[9] is not None or args[10] is None:
            raise _Skip(f"{a}: not a key-padding recipe (mask tensor, documents, or no padding flags)")
        kvs.add(outer(args[10]))
    if len(kvs) != 1:
        raise _Skip("attention sites read different padding masks")
    kv = kvs.pop()
    kv_val = node_val(kv)
    if kv.graph is not g or kv_val is None or kv_val.dim() != 2 or \
            tuple(kv_val.shape) != tuple(node_val(emb).shape[:2]):
        raise _Skip("the key padding mask is not a [B, S] tensor of the graph, like the tokens")
    if any((list(a.args) + [0] * 9)[8] == MASKED_ROWS_UNIFORM for a in r.attention):
        raise _Skip("the attention sites average every key of a fully masked row (eager attention's finfo.min "
                    "masks): a left-padded row's padding outputs would differ from eager's in the packed row")
    window = any((list(a.args) + [0] * 8)[7] not in (0, None) for a in r.attention)
    for o in r.outputs:
        if any(t in (B, S, T) for t in r.tags[o]) and r.tags[o][:2] != (B, S):
            raise _Skip(f"the graph returns {o} with token dimensions {r.tags[o]}, not [B, S, ...]")
    if not r.losses and any(any(t in (B, S, T) for t in r.tags[o]) for o in r.outputs):
        # which padding positions matter is known only where the labels meet the hidden states
        raise _Skip("the graph returns per-token values and computes no loss from them here (the loss is in "
                    "another graph, after a graph break, or there is none): what reads them may read padding "
                    "positions, which unpadding would change")
    region = set(r.nodes)
    gathers: List[Tuple[fx.Node, tuple]] = list(r.inputs.items())
    for x, tags in gathers:
        if not (T in tags or (B in tags and S in tags and tags.index(S) == tags.index(B) + 1)
                or (S in tags and B not in tags)):
            raise _Skip(f"{x} enters the token region with token dimensions {tags}")

    # -- the kept tokens, once, before the embedding (or before the first computation, the embeddings an input);
    # every check above and here runs before the graph is touched
    at = emb if emb.op != "placeholder" else next(n for n in g.nodes if n.op != "placeholder")
    targets: List[Any] = []
    hoist: List[fx.Node] = []
    for loss in r.losses:
        tgt = loss.args[2]
        ignore = loss.args[4] if len(loss.args) > 4 else loss.kwargs.get("ignore_index", -100)
        if tgt in region or (r.inputs.get(tgt) != (T,)):
            raise _Skip(f"{loss}: its target is not a flat [B * S] tensor from outside the region")
        hoist += [n for n in _to_hoist(tgt, at, region) if n not in hoist]
        targets += [tgt, ignore]
    _allow_dynamic_output_shapes(ctx)
    order = {n: i for i, n in enumerate(g.nodes)}
    for n in sorted(hoist, key=order.__getitem__):
        at.prepend(n)
    packed: Dict[fx.Graph, _Packed] = {}
    with g.inserting_before(at):
        vec = _call(g, packed_index, [kv, window] + targets, "fxfuse_packed")
        top = _Packed(g, _call(g, operator.getitem, [vec, 0], "fxfuse_idx"),
                      _call(g, operator.getitem, [vec, 1], "fxfuse_doc_ranges"),
                      _call(g, operator.getitem, [vec, 2], "fxfuse_key_valid"), kv)
        if emb.op == "placeholder":  # the embeddings themselves: gathered, every use reads the packed row
            entry = _call(g, gather_rows_positions, [emb, top.idx, 0], "fxfuse_embeds")
            emb.replace_all_uses_with(entry, delete_user_cb=lambda u: u is not entry)
        else:  # the token ids before the lookup
            ids = emb.args[0]
            emb.replace_input_with(ids, _call(g, gather_rows_positions, [ids, top.idx, 0], "fxfuse_ids"))
    packed[g] = top
    # checkpoint bodies get the same vectors as new inputs (outer bodies first: a call's graph is done before it)
    todo = list(r.bodies)
    while todo:
        call, body = next((c, b) for c, b in todo if c.graph in packed)
        todo.remove((call, body))
        src = packed[call.graph]
        phs = [p for p in body.graph.nodes if p.op == "placeholder"]
        new, last = [], phs[-1]
        for k in src.vectors():  # in operand order
            with body.graph.inserting_after(last):
                last = body.graph.placeholder(f"fxfuse_unpad_{k}")
            new.append(last)
        call.args = tuple(call.args) + tuple(src.vectors().values())
        packed[body.graph] = _Packed(body.graph, *new)

    # -- what enters the region, gathered where it enters (in the graph of its first region user)
    for x, tags in gathers:
        users = [u for u in x.users if u in region]
        first = min(users, key=lambda u: list(x.graph.nodes).index(u))
        pk = packed[x.graph]
        with x.graph.inserting_before(first):
            if T in tags:
                y = _call(x.graph, gather_flat, [x, pk.idx, tags.index(T)])
            elif B in tags:
                y = _call(x.graph, gather_rows_positions, [x, pk.idx, tags.index(B)])
            else:
                y = _call(x.graph, gather_positions, [x, pk.idx, tags.index(S), pk.cols])
        for u in users:
            u.replace_input_with(x, y)

    # -- baked sizes
    # (a -1 for a feature dimension becomes its value: inferring it would divide by the unbacked N, a guard)
    for n, sizes in r.sizes.items():
        pk = packed[n.graph]
        marker = {B: 1, S: pk.n_tok, T: pk.n_tok}
        shape = node_val(n).shape
        new = tuple(marker[s] if isinstance(s, str) else
                    (shape[i] if s == -1 and isinstance(shape[i], int) else s) for i, s in enumerate(sizes))
        n.args = (n.args[0], new)

    # -- attention sites: key padding -> packed documents
    for a in r.attention:
        pk = packed[a.graph]
        args = list(a.args) + [None] * (11 - len(a.args))
        args[9], args[10] = pk.docs, pk.kv_packed
        a.args = tuple(args[:11])
        a.kwargs = {}

    # -- what leaves the region per token: back to [B, S, ...]
    out = next(n for n in g.nodes if n.op == "output")
    for o in r.outputs:
        if r.tags[o][:2] == (B, S):
            with g.inserting_before(out):
                back = _call(g, scatter_rows_positions, [o, top.idx, top.rows, top.cols])
            out.replace_input_with(o, back)
            ctx.retarget_substitutions(o, back)  # e.g. the lazy logits rebuilt from these hidden states
    # -- projections on the packed [1, N, D] row run as [N, D] matmuls (squeeze / unsqueeze of the static 1): the
    # 3-D matmul's folding path reads the row count as an int in torch 2.11 (seen on the GPU machine: "could not
    # extract specialized integer from data-dependent expression u0"); a 2-D mm takes the unbacked count as is
    for n in r.nodes:
        if n.op == "call_function" and n.target in (F.linear, torch._C._nn.linear) and r.tags[n][:2] == (B, S) \
                and len(r.tags[n]) == 3:
            x, ng = n.args[0], n.graph
            with ng.inserting_before(n):
                x2 = ng.call_method("squeeze", (x, 0))
            n.args = (x2,) + tuple(n.args[1:])
            with ng.inserting_after(n):
                y3 = ng.call_method("unsqueeze", (n, 0))
            n.replace_all_uses_with(y3, delete_user_cb=lambda u: u is not y3)
    for _, body in r.bodies:
        body.graph.lint()
        body.recompile()
        ctx.relayout_subgraph(body)  # it now returns the packed row it is passed
    g.lint()
    gm.recompile()
    ctx.fused(emb, "padded batch -> one packed row of its real tokens (token-wise graph on N tokens)",
              saved_bytes=None, attention_sites=len(r.attention), loss_sites=len(r.losses),
              checkpoint_bodies=len(r.bodies))
    return 1


class _Packed:
    """The packed-row vectors as nodes of one graph (the top graph, or a checkpoint body that receives them)."""

    def __init__(self, graph: fx.Graph, idx: fx.Node, docs: fx.Node, kv_packed: fx.Node, kv: fx.Node):
        self.idx, self.docs, self.kv_packed, self.kv = idx, docs, kv_packed, kv
        order = {n: i for i, n in enumerate(graph.nodes)}
        with graph.inserting_after(max(self.vectors().values(), key=order.__getitem__)):
            self.cols = graph.call_method("size", (kv, 1))
            self.rows = graph.call_method("size", (kv, 0))
            self.n_tok = graph.call_method("size", (idx, 0))

    def vectors(self) -> Dict[str, fx.Node]:
        """What a checkpoint body is passed, by name, in operand order."""
        return {"idx": self.idx, "doc_ranges": self.docs, "key_valid": self.kv_packed, "mask": self.kv}


@register_pass(name=NAME,
               description="padded batch (attention masks read as key padding) -> the token-wise graph on the real "
                           "tokens only, as one packed row of documents; outputs scattered back")
def unpad_tokens_pass(gm: fx.GraphModule, ctx) -> int:
    try:
        return _unpad(gm, ctx)
    except _Skip as e:
        has_padding = any(n.op == "call_function" and n.target is _ATTENTION and
                          (list(n.args) + [None] * 11)[10] is not None
                          for m in ctx.graph_modules(gm) for n in m.graph.nodes)
        if has_padding:  # only a graph with key padding had something to unpad: say why it stays padded
            ctx.skipped(next(iter(gm.graph.nodes)), "unpad a padded batch", str(e))
        return 0
