"""Matcher for eager attention (``softmax(f(q @ k^T)) @ v``) used by the ``softcap_attention`` pass, and the graph
pieces the ``sdpa_attention`` pass shares with it (seeing through ``repeat_kv``, compile-time numbers, head-dim
pads): reading an attention site out of an FX graph, before any mask recipe or op is involved.

Starting at a ``softmax`` over the last dim, it walks

* up the score chain to the ``q @ k^T`` matmul, accepting: ``* c`` / ``/ c`` by compile-time numbers (Python
  constants, or graph values whose example value is a specialised number), at most one ``tanh`` (softcap
  ``c * tanh(x / c)``), float casts, and at most one mask, nearest the softmax: ``+ mask`` (additive float) or
  ``masked_fill(m, -inf)`` / ``where(keep, x, -inf)`` (bool);
* down from the softmax through float casts and ``dropout`` to the ``probs @ v`` matmul;
* through ``repeat_kv`` (``x[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv * n, S, D)``) and
  ``repeat_interleave(x, n, dim=1)`` to the un-repeated k / v.

It returns an :class:`AttentionSite` or a reason. A softmax whose input does not come from a 4-D matmul is not
attention: :func:`match_attention` returns ``(None, None)`` for it and the pass says nothing. A ``masked_fill`` /
``where`` fill is a hard mask when it is -inf or at most :data:`.conventions.MASKED_BELOW` (what the op counts as
masked).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxfuse.graph_utils import arg, const_number, copy_node_meta, known_true, node_val, op_kind, same_shape

from .conventions import MASKED_BELOW, MAX_HEAD_DIM

__all__ = ["AttentionSite", "match_attention", "known_number", "unrepeat_kv", "head_dim_pads", "pad_head_dims",
           "slice_head_dim", "append_sink_key"]

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_SCORE_KINDS = ("mul", "div", "tanh", "cast", "add", "masked_fill", "where")


@dataclass
class AttentionSite:
    softmax: fx.Node
    qk: fx.Node                          # q @ k^T
    pv: fx.Node                          # probs @ v
    q: fx.Node                           # [B, Hq, S, D]
    k: Optional[fx.Node]                 # [B, Hkv, Skv, D] (None: use k_t, which is [B, Hkv, D, Skv])
    k_t: Optional[fx.Node]
    v: fx.Node                           # [B, Hkv, Skv, D]
    scaling: float
    softcap: float
    mask: Optional[fx.Node] = None       # additive float mask or bool mask (True = keep)
    mask_negate: bool = False            # the pass must insert logical_not(mask)
    mask_kind: str = "none"              # "additive" / "bool" / "none"
    dropout: Optional[Tuple[Any, Any]] = None  # (p, training) as read, for the report
    n_rep: int = 1
    nodes: List[fx.Node] = field(default_factory=list)  # nodes the rewrite may leave dead, graph order
    cast_to: Optional[torch.dtype] = None  # autocast: both matmuls ran in this dtype on fp32 inputs
    masked_rows: int = 0                 # what eager gives a fully masked row: 0 n/a (no mask), 1 uniform
                                         # (a finite fill: HF's finfo.min), 2 NaN (a -inf fill)
    pads: Tuple[int, int] = (0, 0)       # zero columns the rewrite appends to q / k and to v (see head_dim_pads)
    v_head_dim: Any = None               # v's head_dim (the output's), when it differs from q's
    sinks: Optional[fx.Node] = None      # attention sinks (gpt-oss): a per-head logit in every row's softmax,
                                         # [B|1, Hq, S|1, 1]; see append_sink_key


def known_number(a: Any) -> Optional[float]:
    """``a`` as a Python number if it is known at compile time: a constant, or a graph value (e.g. ``.item()`` of
    a buffer) whose example value is a plain or specialised (constant-expression) number. None otherwise."""
    c = const_number(a)
    if c is not None or not isinstance(a, fx.Node):
        return c
    for v in (a.meta.get("example_value", None), a.meta.get("val", None)):
        c = const_number(v)
        if c is not None:
            return c
        if isinstance(v, (torch.SymFloat, torch.SymInt)):
            try:
                expr = v.node.expr
                if getattr(expr, "is_number", False):
                    return float(expr)
            except Exception:
                pass
    return None


def _known_bool(a: Any) -> Optional[bool]:
    if isinstance(a, bool):
        return a
    if isinstance(a, fx.Node):
        for v in (a.meta.get("example_value", None), a.meta.get("val", None)):
            if isinstance(v, bool):
                return v
            if isinstance(v, torch.SymBool):
                try:
                    expr = v.node.expr
                    if expr in (True, False) or getattr(expr, "is_Boolean", False):
                        return bool(expr)
                except Exception:
                    pass
    return None


def _tensor(n: Any) -> Optional[torch.Tensor]:
    v = node_val(n)
    return v if isinstance(v, torch.Tensor) else None


def _is_full(s: Any) -> bool:
    return isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def _is_matmul4(n: Any) -> bool:
    v = _tensor(n)
    return op_kind(n) == "matmul" and v is not None and v.dim() == 4


def _scores_operand(n: fx.Node, a: Any, b: Any) -> Tuple[Optional[fx.Node], Any]:
    """Of a binary node's operands, (the one the score chain continues through, the other one)."""
    hits = [x for x in (a, b) if isinstance(x, fx.Node) and _reaches_qk(x)]
    if len(hits) != 1:
        return None, None
    return (a, b) if hits[0] is a else (b, a)


def _reaches_qk(n: fx.Node, depth: int = 12) -> bool:
    """Does a straight score chain lead from ``n`` up to a 4-D matmul?"""
    while depth > 0 and isinstance(n, fx.Node):
        if _is_matmul4(n):
            return True
        k = op_kind(n)
        if k not in _SCORE_KINDS:
            return False
        if k in ("mul", "div", "add"):
            a, b = arg(n, "input"), arg(n, "other")
            cands = [x for x in (a, b) if isinstance(x, fx.Node) and _tensor(x) is not None
                     and _tensor(x).dim() == 4]
            if not cands:
                return False
            if len(cands) == 2:  # either may be the chain
                return any(_reaches_qk(x, depth - 1) for x in cands)
            n = cands[0]
        elif k == "where":
            a, b = arg(n, "input"), arg(n, "other")
            n = a if isinstance(a, fx.Node) and _tensor(a) is not None and _tensor(a).dtype != torch.bool else b
        else:
            n = arg(n, "input")
        depth -= 1
    return False


def _near_qk(n: Any, depth: int = 8) -> bool:
    """Loosely: is there a 4-D matmul a few tensor inputs above ``n``? (decides whether to report a refusal)"""
    frontier = [n] if isinstance(n, fx.Node) else []
    for _ in range(depth):
        nxt = []
        for x in frontier:
            if _is_matmul4(x):
                return True
            nxt += [a for a in x.all_input_nodes if _tensor(a) is not None and _tensor(a).dim() >= 2]
        frontier = nxt
    return False


# ------------------------------------------------------------------------------------------------ repeat_kv
def unrepeat_kv(x: fx.Node) -> Tuple[fx.Node, int, List[fx.Node]]:
    """See through ``repeat_kv`` / ``repeat_interleave(n, dim=1)``: (un-repeated x, n_rep, nodes of the repeat)."""
    xv = _tensor(x)
    if xv is None or xv.dim() != 4:
        return x, 1, []
    k = op_kind(x)
    if k == "repeat_interleave":
        src, reps, dim = arg(x, "input"), arg(x, "repeats"), arg(x, "dim")
        sv = _tensor(src)
        if (isinstance(reps, int) and not isinstance(reps, bool) and reps >= 1 and dim in (1, -3)
                and sv is not None and sv.dim() == 4 and known_true(sv.shape[1] * reps == xv.shape[1])
                and same_shape((sv.shape[0], *sv.shape[2:]), (xv.shape[0], *xv.shape[2:]))):
            return src, reps, [x]
        return x, 1, []
    if k not in ("reshape", "view"):
        return x, 1, []
    e = arg(x, "input")
    if op_kind(e) != "expand":
        return x, 1, []
    u = arg(e, "input")
    src = None
    if op_kind(u) == "getitem":
        idx = arg(u, "index")
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) >= 3 and _is_full(idx[0]) and _is_full(idx[1]) and idx[2] is None \
                and all(_is_full(i) for i in idx[3:]):
            src = arg(u, "input")
    elif op_kind(u) == "unsqueeze" and arg(u, "dim") == 2:
        src = arg(u, "input")
    sv, ev = _tensor(src), _tensor(e)
    if sv is None or ev is None or sv.dim() != 4 or ev.dim() != 5:
        return x, 1, []
    B, Hkv, S, D = sv.shape
    if not (same_shape((ev.shape[0], ev.shape[1], ev.shape[3], ev.shape[4]), (B, Hkv, S, D))
            and same_shape(tuple(xv.shape), (B, Hkv * ev.shape[2], S, D))):
        return x, 1, []
    n = ev.shape[2]
    try:
        n = int(n)
    except Exception:
        return x, 1, []
    return src, n, [u, e, x]


# ------------------------------------------------------------------------------------------- head dims
def head_dim_pads(d_qk: Any, d_v: Any) -> Tuple[Optional[Tuple[int, int]], str]:
    """Zero columns to append to q / k and to v so that both have one head_dim, as the op needs: ``((pad_qk,
    pad_v), "")`` or ``(None, why not)``.

    Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, Kimi, GLM-4-MoE-Lite, ...) has a value head_dim
    smaller than the query/key one (128 vs 192). Zero columns change nothing: q @ k^T is the same with zeros
    appended to both, ``p @ [v, 0] = [p @ v, 0]`` (the output is sliced back), and the zero columns' gradients
    are dropped by the pad's backward. The scale stays the one computed from q's own head_dim. Only static head
    dims (a symbolic one would need a guard)."""
    if not (isinstance(d_qk, int) and isinstance(d_v, int)):
        if known_true(d_qk == d_v):
            if known_true(d_qk > MAX_HEAD_DIM):
                return None, f"head_dim {d_qk} > {MAX_HEAD_DIM}"
            return (0, 0), ""
        return None, "q / k and v head dims are symbolic and not provably equal"
    width = max(d_qk, d_v)
    if width > MAX_HEAD_DIM:
        return None, f"head_dim {width} > {MAX_HEAD_DIM}"
    return (width - d_qk, width - d_v), ""


def pad_head_dims(g: fx.Graph, q: fx.Node, k: fx.Node, v: fx.Node, pads: Tuple[int, int], like: fx.Node):
    """Insert the zero-column pads of :func:`head_dim_pads` (at the graph's insertion point); returns q, k, v."""
    pad_qk, pad_v = pads
    out = []
    for t, p in ((q, pad_qk), (k, pad_qk), (v, pad_v)):
        if p:
            t = g.call_function(F.pad, (t, (0, p)))
            copy_node_meta(t, like)
        out.append(t)
    return tuple(out)


def slice_head_dim(g: fx.Graph, out: fx.Node, pads: Tuple[int, int], d_v: Any, like: fx.Node) -> fx.Node:
    """The op's output without the zero columns appended to v, contiguous like the op's own output (a strided
    view would change the strides a graph output or a later ``.view`` sees)."""
    if not pads[1]:
        return out
    sl = g.call_function(operator.getitem, (out, (Ellipsis, slice(None, int(d_v), None))))
    copy_node_meta(sl, like)
    c = g.call_method("contiguous", (sl,))
    copy_node_meta(c, like)
    return c


# ------------------------------------------------------------------------------------------------ the mask
def _check_mask_slice(mask: fx.Node, skv) -> str:
    """A mask that is a slice must be exactly ``mask[..., :Skv]`` (full leading dims). "" if fine."""
    if op_kind(mask) != "getitem":
        return ""
    base = arg(mask, "input")
    bv, mv = _tensor(base), _tensor(mask)
    if bv is None or mv is None:
        return "mask slice without example values"
    idx = arg(mask, "index")
    idx = idx if isinstance(idx, tuple) else (idx,)
    if Ellipsis in idx:
        pos = idx.index(Ellipsis)
        if idx.count(Ellipsis) != 1 or not all(_is_full(i) for i in idx[:pos]):
            return "mask index is not a prefix slice of the key dim"
        tail = idx[pos + 1:]
        idx = (slice(None),) * (bv.dim() - len(tail)) + tuple(tail)
    if len(idx) != bv.dim() or mv.dim() != bv.dim():
        return "mask index is not a prefix slice of the key dim (it adds, drops or indexes dims)"
    if not all(_is_full(i) for i in idx[:-1]):
        return "mask is sliced along a dim other than the key dim"
    last = idx[-1]
    if not isinstance(last, slice) or last.start not in (None, 0) or last.step not in (None, 1):
        return "mask slice is not a prefix slice [..., :Skv] of the key dim"
    stop = last.stop
    if isinstance(stop, fx.Node):
        stop = node_val(stop)
    if stop is None:
        ok = known_true(bv.shape[-1] == skv)
    elif isinstance(stop, (int, torch.SymInt)) and not isinstance(stop, bool):
        ok = known_true(stop == skv) or (known_true(stop >= bv.shape[-1]) and known_true(bv.shape[-1] == skv))
    else:
        ok = False
    if not ok:
        return "mask slice is not a prefix slice [..., :Skv] of the key dim (its end is not the key length)"
    return ""


def _hard_fill(value: Any) -> bool:
    c = known_number(value)
    return c is not None and (c == -math.inf or c <= MASKED_BELOW)


# ------------------------------------------------------------------------------------------ attention sinks
def _target_name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def _last_dim_arg(n: fx.Node, pos: int, name: str, default=None):
    return n.kwargs[name] if name in n.kwargs else (n.args[pos] if len(n.args) > pos else default)


def _row_max_of(b: Any, x: fx.Node) -> List[fx.Node]:
    """The nodes of ``x.max(dim=-1, keepdim=True).values`` (or ``amax``) if ``b`` is that, else []."""
    if not isinstance(b, fx.Node) or b.op not in ("call_function", "call_method"):
        return []
    nodes = [b]
    if _target_name(b) == "getitem" and len(b.args) == 2 and b.args[1] == 0 and isinstance(b.args[0], fx.Node):
        b = b.args[0]
        nodes.append(b)
        if _target_name(b) != "max":
            return []
    elif _target_name(b) != "amax":
        return []
    if b.op not in ("call_function", "call_method") or not b.args or b.args[0] is not x:
        return []
    if _last_dim_arg(b, 1, "dim") not in (-1, 3, [-1], [3], (-1,), (3,)) or _last_dim_arg(b, 2, "keepdim") is not True:
        return []
    if any(len(m.users) != 1 for m in nodes):
        return []
    return nodes


def _strip_sinks(x: fx.Node, sm: fx.Node) -> Tuple[fx.Node, Optional[fx.Node], List[fx.Node], str]:
    """Peel ``softmax(cat([scores, sinks], -1) - rowmax)`` (gpt-oss's attention sinks; the row-max shift alone is
    a softmax no-op and is peeled too) down to the scores: (scores, sinks or None, peeled nodes, why-not)."""
    peeled: List[fx.Node] = []
    if op_kind(x) == "sub":
        a, b = arg(x, "input"), arg(x, "other")
        maxes = _row_max_of(b, a) if isinstance(a, fx.Node) else []
        if maxes and set(a.users) == {x, maxes[-1]} and len(x.users) == 1:
            peeled += [x] + maxes
            x = a
    if isinstance(x, fx.Node) and x.op == "call_function" and x.target is torch.cat:
        ts, dim = x.args[0] if x.args else x.kwargs.get("tensors"), _last_dim_arg(x, 1, "dim", 0)
        if isinstance(ts, (list, tuple)) and len(ts) == 2 and all(isinstance(t, fx.Node) for t in ts) \
                and dim in (-1, 3) and _reaches_qk(ts[0]):
            sv = _tensor(ts[1])
            if sv is None or sv.dim() != 4 or not known_true(sv.shape[3] == 1) or not sv.dtype.is_floating_point:
                return x, None, peeled, "a column concatenated to the scores that is not one sink logit per row"
            if len(ts[0].users) != 1 or not set(x.users) <= set(peeled) | {sm}:
                return x, None, peeled, "scores with other users besides the sinks' cat"
            return ts[0], ts[1], peeled + [x], ""
    return x, None, peeled, ""


def append_sink_key(q, k, v, mask, sinks, scaling: float):
    """Attention sinks as one more key: each q row gets a last column ``sink / scaling`` (its head's sink logit),
    every real key a 0 there and one extra key a 1 (elsewhere 0) with a zero value. Then
    ``scaling * q'.k'`` is the score for real keys and the sink logit for the extra key, whose probability joins the
    row's normaliser and adds nothing to the output: ``softmax(cat([scores, sink]))[..., :-1] @ v``. The sink's
    gradient flows back through q's extra column. The mask (bool True = keep, or additive) keeps the extra key."""
    B, Hq, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    col = (sinks.to(torch.float32) / scaling).to(q.dtype).expand(B, Hq, S, 1)
    q2 = torch.cat([q, col], dim=-1)
    k2 = torch.cat([k, k.new_zeros(B, Hkv, Skv, 1)], dim=-1)
    sink_key = k.new_zeros(B, Hkv, 1, D + 1)
    sink_key[..., D] = 1
    k2 = torch.cat([k2, sink_key], dim=2)
    v2 = torch.cat([v, v.new_zeros(B, Hkv, 1, v.shape[3])], dim=2)
    if mask is not None:
        keep = torch.ones if mask.dtype == torch.bool else torch.zeros
        mask = torch.cat([mask, keep((*mask.shape[:-1], 1), dtype=mask.dtype, device=mask.device)], dim=-1)
    return q2, k2, v2, mask


# -------------------------------------------------------------------------------------------------- match
def match_attention(sm: fx.Node) -> Tuple[Optional[AttentionSite], Optional[str]]:
    """(site, None) when ``sm`` is a fusable attention softmax; (None, reason) for attention that is not fused;
    (None, None) when ``sm`` is not attention at all."""
    smv = _tensor(sm)
    x = arg(sm, "input")
    if smv is None or smv.dim() != 4 or not isinstance(x, fx.Node):
        return None, None
    dim = arg(sm, "dim")
    if dim not in (-1, 3):
        return None, ("softmax not over the key (last) dim" if _near_qk(x) else None)

    x, sinks, sink_nodes, why = _strip_sinks(x, sm)
    if why:
        return None, why
    scores_v = _tensor(x) if sinks is not None else smv

    # ---- up: softmax input .. q @ k^T
    chain: List[fx.Node] = []
    mask, mask_negate, mask_kind, masked_rows = None, False, "none", 0
    after, before, tanh = 1.0, 1.0, False  # multipliers nearer the softmax than the tanh / nearer the matmul
    seen_scale = False
    n = x
    while not _is_matmul4(n):
        if not isinstance(n, fx.Node):
            return None, None
        k = op_kind(n)
        if k not in _SCORE_KINDS:
            if _near_qk(n):
                tgt = getattr(n.target, "__name__", str(n.target))
                return None, f"{k or tgt} between q @ k^T and softmax is not supported"
            return None, None
        if k in ("add", "masked_fill", "where"):
            if k == "add":
                src, m = _scores_operand(n, arg(n, "input"), arg(n, "other"))
                if src is None:
                    return (None, "score add whose operands cannot be told apart") if _near_qk(n) else (None, None)
                if arg(n, "alpha", 1) not in (1, 1.0):
                    return None, "mask added with alpha"
            elif k == "masked_fill":
                src, m = arg(n, "input"), arg(n, "mask")
                if not isinstance(src, fx.Node) or not _reaches_qk(src):
                    return (None, "masked_fill of something other than the scores") if _near_qk(n) else (None, None)
            else:
                cond, a, b = arg(n, "condition"), arg(n, "input"), arg(n, "other")
                if isinstance(a, fx.Node) and _reaches_qk(a):
                    src, m, fill, negate = a, cond, b, False
                elif isinstance(b, fx.Node) and _reaches_qk(b):
                    src, m, fill, negate = b, cond, a, True
                else:
                    return (None, "where() of something other than the scores") if _near_qk(n) else (None, None)
            if not _reaches_qk(src):
                return (None, None) if not _near_qk(n) else (None, "mask applied to something not from q @ k^T")
            if mask is not None:
                return None, "more than one mask applied to the scores"
            if seen_scale:
                return None, "mask applied before the scaling / softcap (it would be scaled)"
            if not isinstance(m, fx.Node) or _tensor(m) is None:
                return None, "mask is not a tensor"
            mv = _tensor(m)
            if k == "add":
                if not mv.dtype.is_floating_point:
                    return None, f"additive mask of dtype {mv.dtype} (only float masks are additive)"
                # HF's eager masks: 0 / finfo(dtype).min. A fully masked row's scores are all absorbed into the
                # fill: eager's softmax is uniform there (a -inf entry would make it NaN: not HF's masks).
                mask, mask_kind, masked_rows = m, "additive", 1
            else:
                if mv.dtype != torch.bool:
                    return None, f"{k} with a {mv.dtype} condition"
                fill = arg(n, "value") if k == "masked_fill" else fill
                if not _hard_fill(fill):
                    return None, f"{k} value {known_number(fill)!r} is not a hard mask (-inf or <= {MASKED_BELOW:g})"
                # masked_fill(m, -inf): m = True means masked; the op wants True = keep
                negate = True if k == "masked_fill" else negate
                if negate and op_kind(m) in ("logical_not", "invert") and \
                        _tensor(arg(m, "input")) is not None and _tensor(arg(m, "input")).dtype == torch.bool:
                    chain_m = m
                    m, negate = arg(m, "input"), False
                    if len(chain_m.users) == 1:
                        chain.append(chain_m)
                mask, mask_negate, mask_kind = m, negate, "bool"
                masked_rows = 2 if known_number(fill) == -math.inf else 1
            chain.append(n)
            n = src
            continue
        if k == "cast":
            v = _tensor(n)
            if v is None or v.dtype not in _FLOATS:
                return None, f"cast of the scores to {getattr(v, 'dtype', None)}"
            chain.append(n)
            n = arg(n, "input")
            continue
        if k == "tanh":
            if tanh:
                return None, "two tanh in the score chain"
            tanh, seen_scale = True, True
            chain.append(n)
            n = arg(n, "input")
            continue
        # mul / div
        a, b = arg(n, "input"), arg(n, "other")
        if isinstance(a, fx.Node) and _tensor(a) is not None and _reaches_qk(a):
            src, c = a, b
        elif k == "mul" and isinstance(b, fx.Node) and _tensor(b) is not None and _reaches_qk(b):
            src, c = b, a
        else:
            return (None, f"{k} of something other than the scores") if _near_qk(n) else (None, None)
        if isinstance(c, fx.Node) and _tensor(c) is not None:
            return None, f"scores {'multiplied' if k == 'mul' else 'divided'} by a tensor (scaling must be a number)"
        cv = known_number(c)
        if cv is None:
            return None, ("scaling is a graph value whose value is not known at compile time "
                          "(unspecialised SymFloat); not fused")
        if k == "div":
            if cv == 0.0:
                return None, "division of the scores by 0"
            cv = 1.0 / cv
        if tanh:
            before *= cv
        else:
            after *= cv
        seen_scale = True
        chain.append(n)
        n = src
    qk = n
    if tanh:
        softcap, scaling = after, before * after
        if not (softcap > 0 and math.isfinite(softcap)):
            return None, f"softcap {softcap} is not a positive finite number"
    else:
        softcap, scaling = 0.0, after
    if not math.isfinite(scaling) or scaling == 0.0:
        return None, f"scaling {scaling} is not a finite non-zero number"
    for c in chain + [qk]:
        if len(c.users) != 1:
            return None, f"attention scores ({c.name}) have other users besides the softmax"

    # ---- down: softmax .. probs @ v
    dropout = None
    post: List[fx.Node] = []
    cur = sm
    if sinks is not None:
        if tanh:
            return None, "attention sinks together with a tanh softcap"
        drop = next(iter(sm.users)) if len(sm.users) == 1 else None
        idx = drop.args[1] if drop is not None and op_kind(drop) == "getitem" and len(drop.args) == 2 else None
        idx = idx if isinstance(idx, tuple) else (idx,)
        last = idx[-1] if idx else None
        if not (isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1) and last.stop == -1
                and all(i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in idx[:-1])):
            return None, "attention sinks whose column is not dropped ([..., :-1]) right after the softmax"
        post.append(drop)
        cur = drop
    while True:
        if len(cur.users) != 1:
            return None, (f"attention probabilities ({cur.name}) have other users (e.g. output_attentions): "
                          f"{', '.join(u.name for u in cur.users)}")
        u = next(iter(cur.users))
        k = op_kind(u)
        if k == "cast" and arg(u, "input") is cur:
            v = _tensor(u)
            if v is None or v.dtype not in _FLOATS:
                return None, f"cast of the probabilities to {getattr(v, 'dtype', None)}"
        elif k == "dropout" and arg(u, "input") is cur:
            p = arg(u, "p", 0.5)
            training = u.kwargs["train"] if "train" in u.kwargs else arg(u, "training", True)
            pv, tv = known_number(p), _known_bool(training)
            dropout = (pv if pv is not None else p, tv if tv is not None else training)
            if tv is not False and (pv is None or pv != 0.0):
                return None, "attention dropout p>0 in training" + ("" if pv is not None else " (p unknown)")
        elif k == "matmul" and arg(u, "input") is cur and arg(u, "other") is not cur:
            pv_node = u
            break
        else:
            return None, f"softmax result flows into {k or getattr(u.target, '__name__', u.target)}, not @ v"
        post.append(u)
        cur = u

    # ---- q, k, v
    q, kt, v_rep = arg(qk, "input"), arg(qk, "other"), arg(pv_node, "other")
    if not all(isinstance(t, fx.Node) for t in (q, kt, v_rep)):
        return None, "q, k or v is not a tensor"
    pre_q: List[fx.Node] = []
    if op_kind(q) in ("mul", "div") and _tensor(q) is not None:  # q * scaling before the matmul
        a, b = arg(q, "input"), arg(q, "other")
        src, c = (a, b) if isinstance(a, fx.Node) else ((b, a) if op_kind(q) == "mul" else (None, None))
        cv = known_number(c) if not isinstance(c, fx.Node) or _tensor(c) is None else None
        if src is not None and cv is not None and cv != 0.0 and _tensor(src) is not None \
                and same_shape(tuple(_tensor(src).shape), tuple(_tensor(q).shape)):
            scaling *= cv if op_kind(q) == "mul" else 1.0 / cv
            pre_q.append(q)
            q = src
    k_rep, k_t = None, None
    if op_kind(kt) == "transpose" and {arg(kt, "dim0"), arg(kt, "dim1")} in ({2, 3}, {-1, -2}, {2, -1}, {-2, 3}):
        k_rep = arg(kt, "input")
    elif kt.op == "call_function" and getattr(kt.target, "__name__", "") == "getattr" and len(kt.args) == 2 \
            and kt.args[1] == "mT":
        k_rep = kt.args[0]
    else:
        k_t = kt
    qv, vv = _tensor(q), _tensor(v_rep)
    if qv is None or vv is None or qv.dim() != 4 or vv.dim() != 4:
        return None, "q or v is not 4-D [B, H, S, D]"
    if k_rep is not None:
        k0, nk, krep_nodes = unrepeat_kv(k_rep)
        v0, nv, vrep_nodes = unrepeat_kv(v_rep)
        if nk != nv or not known_true(_tensor(k0).shape[1] == _tensor(v0).shape[1]):
            k0, nk, krep_nodes, v0, nv, vrep_nodes = k_rep, 1, [], v_rep, 1, []
    else:
        k0, nk, krep_nodes, v0, nv, vrep_nodes = None, 1, [], v_rep, 1, []
    kv = _tensor(k0) if k0 is not None else _tensor(k_t)
    v0v = _tensor(v0)
    if kv is None or kv.dim() != 4:
        return None, "k is not 4-D [B, H, S, D]"
    B, Hq, S, D = qv.shape
    if k0 is not None:
        Hkv, Skv, Dk = kv.shape[1], kv.shape[2], kv.shape[3]
    else:
        Hkv, Skv, Dk = kv.shape[1], kv.shape[3], kv.shape[2]
    if not (known_true(kv.shape[0] == B) and known_true(v0v.shape[0] == B)):
        return None, "k / v batch is broadcast against q's (not supported by the op)"
    if not (known_true(Dk == D) and known_true(v0v.shape[2] == Skv) and known_true(v0v.shape[1] == Hkv)):
        return None, "q / k head dims or k / v lengths / heads do not line up"
    Dv = v0v.shape[3]
    pads, why = head_dim_pads(D + 1 if sinks is not None else D, Dv)  # a sink adds one q / k column
    if pads is None:
        return None, why + (" (with the sinks' extra column)" if sinks is not None else "")
    if sinks is not None:
        sv = _tensor(sinks)
        if not all(known_true(a == 1) or known_true(a == b) for a, b in zip(sv.shape[:3], (B, Hq, S))):
            return None, "attention sinks that do not broadcast to [B, Hq, S, 1]"
    if not known_true(Hq % Hkv == 0):
        return None, f"q heads ({Hq}) are not a known multiple of kv heads ({Hkv})"
    if not same_shape(tuple(_tensor(qk).shape), (B, Hq, S, Skv)):
        return None, "q @ k^T broadcasts (score shape is not [B, Hq, S, Skv])"
    if not same_shape(tuple(scores_v.shape), (B, Hq, S, Skv)):
        return None, "the mask broadcasts the scores to a larger shape"
    dts = {qv.dtype, kv.dtype, v0v.dtype}
    out = _tensor(pv_node)
    cast_to = None
    low = (torch.bfloat16, torch.float16)
    if (out is not None and out.dtype in low and _tensor(qk).dtype == out.dtype and dts != {out.dtype}
            and dts <= {out.dtype, torch.float32}):
        # Autocast (AMP): q @ k^T and p @ v returned out.dtype from fp32 operands, i.e. autocast ran both matmuls
        # on operands cast to out.dtype. The op gets q / k / v cast the same way (its scores then stay fp32 where
        # eager rounds them to out.dtype: at least as precise).
        cast_to = out.dtype
    elif len(dts) != 1 or qv.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None, f"q / k / v dtypes {sorted(map(str, dts))} (need one of bf16 / fp16 / fp32)"
    if out is None or out.dtype != (cast_to or qv.dtype) or not same_shape(tuple(out.shape), (B, Hq, S, Dv)):
        return None, "probs @ v output is not [B, Hq, S, Dv] in q's dtype"
    if len({t.device for t in (qv, kv, v0v)}) != 1:
        return None, "q / k / v on different devices"
    if mask is not None:
        mv = _tensor(mask)
        if mv.dim() not in (2, 3, 4):
            return None, f"{mv.dim()}-D mask (need 2-D .. 4-D)"
        if mv.device != qv.device:
            return None, "mask on another device"
        if mv.requires_grad:
            return None, "mask requires grad (the op gives the mask no gradient)"
        why = _check_mask_slice(mask, Skv)
        if why:
            return None, why
    nodes = (pre_q + krep_nodes + vrep_nodes + ([kt] if k_rep is not None else []) + [qk] + chain[::-1]
             + sink_nodes[::-1] + [sm] + post)
    site = AttentionSite(sm, qk, pv_node, q, k0, k_t, v0, float(scaling), float(softcap), mask, mask_negate,
                         mask_kind, dropout, int(nk) if k0 is not None else 1, nodes, cast_to, masked_rows,
                         pads, Dv, sinks)
    return site, None
