"""Read how an attention mask was built, instead of materialising it.

Under torch.compile, transformers' ``masking_utils`` builds every attention mask in the graph as index arithmetic
broadcast to ``[B, 1, S, Skv]``::

    b, q, kv = arange(B)[:, None, None, None], arange(S)[None, None, :, None], arange(Skv)[None, None, None, :]
    keep = ones((), bool)
    keep = keep & (kv <= q)                                   # causal
    keep = keep & (kv > q - W)                                # sliding window (Mistral, Gemma-2/3, Qwen3, ...)
    keep = keep & (pos[b, kv] <= pos[b, q])                   # causal from position ids (packed rows)
    keep = keep & (doc[b, q] == doc[b, kv])                   # packed documents: doc = (diff(pos) != 1).cumsum(-1)
    keep = keep & ((kv - lp[b]) // C == (q - lp[b]) // C)     # chunked attention (Llama-4), lp = left padding
    keep = keep & attention_mask.bool()[b, kv]                # padding
    mask = where(keep, 0.0, finfo.min)                        # eager attention's additive form

:func:`read_mask_recipe` proves what such a mask is by *abstract interpretation* of its producer subgraph: every
node gets a symbolic value (an integer index form ``cq*q + ckv*kv + c``, a per-token vector ``src[b, q|kv]``, or a
conjunction of atoms), and only a conjunction of atoms the kernel implements becomes a :class:`MaskRecipe`:

* ``causal``    ``kv <= q`` (or ``pos[kv] <= pos[q]`` together with documents built from the same ``pos``: within
                a document positions rise by exactly 1, so the two are the same keys)
* ``window``    ``q - kv < W``
* ``docs``      ``doc[q] == doc[kv]`` with ``doc = cumsum(bool, -1)`` (non-decreasing, so every document is one
                contiguous run: what ``fxfuse::softcap_attention``'s ``doc_ranges`` needs)
* ``chunks``    ``(kv + c - lp[b]) // C == (q + c - lp[b]) // C`` for a constant ``C > 0`` and an optional per-row
                integer ``lp`` (HF's left-padding count): the same as documents with the ids
                ``(t + c - lp[b]) // C``, non-decreasing along the row for any ``lp``, so the recipe builds those
                O(B x S) ids in the graph (:func:`chunk_document_ids`) and the kernel takes them as documents
* ``key_valid`` a bool per-key vector (``attention_mask[b, kv]``)

Anything else (an OR, a negation, a mask that arrives as a graph input, a per-query padding term, index arithmetic
it cannot place, an additive fill above :data:`.conventions.MASKED_BELOW`) is refused with the reason, and the
attention passes keep the mask tensor. Nothing is evaluated: the proof holds for every length, static or symbolic.

A mask that reaches attention through an activation-checkpoint body (HF gradient checkpointing) is read in the
graph that built it; :class:`RecipeInputs` then threads the O(B x S) vectors into the body as new operands.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.fx as fx

from fxfuse.graph_utils import arg, const_number, graph_modules, known_true, node_val, op_kind

from .conventions import MASKED_BELOW
from .op import document_ranges

__all__ = ["MaskRecipe", "read_mask_recipe", "RecipeInputs", "mark_mask", "erase_dead_masks", "HOPS_WITH_BODY",
           "chunk_document_ids", "chunk_and_document_ids"]

_AXES = ("b", "h", "q", "kv")
# Higher-order ops whose first argument is a body GraphModule fed one-to-one by the remaining operands.
HOPS_WITH_BODY = ("tag_activation_checkpoint", "wrap")


class _Refuse(Exception):
    pass


@dataclass(frozen=True)
class _Lin:
    """An integer index expression: sum(coef * index along axis) + const. Axis ``'_'`` is a 1-D arange not yet
    placed in the 4-D broadcast (``length`` is its size)."""
    coefs: Tuple[Tuple[str, int], ...]
    const: int = 0
    length: Any = None
    src: Optional[fx.Node] = None  # the arange node of a (placed) single index, kept through shifts
    start: int = 0                 # that arange's start: the index's value at position t is t + const

    def coef(self, axis: str) -> int:
        return dict(self.coefs).get(axis, 0)

    def plus(self, other: "_Lin", sign: int = 1) -> "_Lin":
        c = dict(self.coefs)
        for a, v in other.coefs:
            c[a] = c.get(a, 0) + sign * v
        if "_" in c and c["_"] != 0:
            raise _Refuse("index arithmetic between an unplaced arange and another index")
        return _Lin(tuple(sorted((a, v) for a, v in c.items() if v)), self.const + sign * other.const)

    def shift(self, k: int) -> "_Lin":
        return _Lin(self.coefs, self.const + k, self.length, self.src, self.start)

    def single_axis(self) -> Optional[str]:
        """``'q'`` or ``'kv'`` if this is ``index + const`` along that axis (coefficient 1), else None."""
        if len(self.coefs) == 1 and self.coefs[0][1] == 1 and self.coefs[0][0] in ("q", "kv"):
            return self.coefs[0][0]
        return None


@dataclass(frozen=True)
class _Vec:
    """``src[b, index]``: a per-token vector ``src`` ([B|1, L]) read at the query or key index of each element."""
    src: fx.Node
    axis: str           # "q" or "kv"
    batch: str          # "b" (row b of src) or "0" (row 0 for every batch row)
    dtype: torch.dtype


@dataclass(frozen=True)
class _Row:
    """``src[b]``: a per-row integer ([B] or [1], e.g. HF's left-padding count) read at each element's batch row."""
    src: fx.Node
    batch: str          # "b" or "0"


@dataclass(frozen=True)
class _Coord:
    """A token's coordinate along one axis (``q`` or ``kv``) plus a constant: ``t + const`` of an arange node
    (``kind='index'``, ``src`` the arange, ``where`` its start) or ``pos[b, t] + const`` of a per-token position
    vector (``kind='pos'``, ``src`` its base node, ``where`` its batch "b" / "0")."""
    axis: str
    kind: str
    src: fx.Node
    where: Any
    const: int

    def same_but_axis(self, other: "_Coord") -> bool:
        """The same function of the token along q as along kv (two aranges are: ``t + const`` either way)."""
        same = (self.kind, self.const) == (other.kind, other.const) and (
            self.kind == "index" or (self.src, self.where) == (other.src, other.where))
        return same and {self.axis, other.axis} == {"q", "kv"}


def _coord(x: Any) -> Optional[_Coord]:
    if isinstance(x, _Lin) and x.single_axis() and x.src is not None:
        return _Coord(x.single_axis(), "index", x.src, x.start, x.const)
    p = _as_plin(x)
    if p is not None and len(p.coefs) == 1 and p.coefs[0][1] == 1 and p.coefs[0][0] in ("q", "kv"):
        return _Coord(p.coefs[0][0], "pos", p.src, p.batch, p.const)
    return None


@dataclass(frozen=True)
class _RLin:
    """``coord + sign * row[b]`` (e.g. ``q - left_padding[b]``)."""
    coord: _Coord
    row: Optional[_Row]
    sign: int

    def shift(self, k: int) -> "_RLin":
        c = self.coord
        return _RLin(_Coord(c.axis, c.kind, c.src, c.where, c.const + k), self.row, self.sign)


@dataclass(frozen=True)
class _Floor:
    """``(coord + sign * row[b]) // size``: a chunk id along one axis."""
    rlin: _RLin
    size: int


@dataclass(frozen=True)
class _PLin:
    """A linear form of one per-token position vector: sum(coef * pos[b, index along axis]) + const."""
    src: fx.Node        # the vector's base node (see _base)
    batch: str
    coefs: Tuple[Tuple[str, int], ...]
    const: int = 0

    def plus(self, other: "_PLin", sign: int = 1) -> "_PLin":
        c = dict(self.coefs)
        for a, v in other.coefs:
            c[a] = c.get(a, 0) + sign * v
        return _PLin(self.src, self.batch, tuple(sorted((a, v) for a, v in c.items() if v)),
                     self.const + sign * other.const)


def _as_plin(x: Any) -> Optional[_PLin]:
    if isinstance(x, _PLin):
        return x
    if isinstance(x, _Vec) and not x.dtype.is_floating_point and x.dtype != torch.bool:
        return _PLin(_base(x.src), x.batch, ((x.axis, 1),), 0)
    return None


@dataclass(frozen=True)
class _Pred:
    """A conjunction of atoms (an empty one is True)."""
    atoms: FrozenSet[tuple]


@dataclass(frozen=True)
class _Additive:
    pred: _Pred
    fill: float


@dataclass
class MaskRecipe:
    """What a mask keeps, as scalars and per-token vectors (nodes of the graph that built the mask)."""
    causal: bool = False
    window: int = 0
    docs: Optional[fx.Node] = None        # [B|1, S] non-decreasing document ids
    key_valid: Optional[fx.Node] = None   # [B|1, Skv] bool
    # chunked attention: (kind "index" or "pos", the arange or position vector node, the arange's start or the
    # positions' batch, the coordinate's constant, the per-row term (_Row) or None, its sign, the chunk size);
    # RecipeInputs builds the document ids chunk_document_ids() gives from them
    chunks: Optional[tuple] = None
    # the chunk of token t is (t + chunk_shift) // C in every row (no per-row term, no documents, positions an
    # arange or indices): what lets SDPA run whole chunks as a batch (:attr:`chunk_tiling`); None otherwise
    chunk_shift: Optional[int] = None
    fill: Optional[float] = None          # additive masks: the value of masked entries (None: a bool mask)
    home: Optional[fx.GraphModule] = None  # the graph module where the vectors live
    route: List[Tuple[fx.Node, fx.GraphModule]] = field(default_factory=list)  # (HOP call, body) home -> site
    route_masks: List[fx.Node] = field(default_factory=list)  # the mask's placeholders in the bodies on the way
    nodes: List[fx.Node] = field(default_factory=list)  # the mask's producer nodes in ``home`` (dead after rewrite)

    def describe(self) -> str:
        parts = ["causal" if self.causal else "bidirectional"]
        if self.window:
            parts.append(f"window {self.window}")
        if self.docs is not None:
            parts.append("documents")
        if self.chunks is not None:
            parts.append(f"chunks of {self.chunks[-1]}")
        if self.key_valid is not None:
            parts.append("key padding")
        return " + ".join(parts)

    @property
    def plain_causal(self) -> bool:
        return self.causal and not self.window and self.docs is None and self.chunks is None and \
            self.key_valid is None

    @property
    def chunk_tiling(self) -> Optional[int]:
        """The chunk size ``C`` when the recipe is causal attention inside chunks ``[0, C), [C, 2C), ...`` of every
        row and nothing else (no window, documents, key padding or per-row shift): causal attention over a batch of
        C-token sequences and a last one of 1..C tokens, which SDPA's causal kernels run
        (:mod:`.chunked`). None for any other recipe."""
        if not (self.causal and self.chunks is not None and self.chunk_shift is not None) or self.window \
                or self.docs is not None or self.key_valid is not None:
            return None
        size = self.chunks[-1]
        return size if self.chunk_shift % size == 0 else None


# --------------------------------------------------------------------------------------------- helpers
def _val(n: Any):
    v = node_val(n)
    return v if isinstance(v, torch.Tensor) else None


def _int(a: Any) -> Optional[int]:
    if isinstance(a, bool):
        return None
    if isinstance(a, int):
        return a
    if isinstance(a, fx.Node) and a.op != "placeholder":
        return None
    v = node_val(a) if isinstance(a, fx.Node) else a
    if isinstance(v, torch.SymInt):
        try:
            if getattr(v.node.expr, "is_number", False):
                return int(v.node.expr)
        except Exception:
            return None
    return None


def _is_full(s: Any) -> bool:
    return isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def _same(a: Any, b: Any) -> bool:
    return known_true(a == b)


def _base(n: fx.Node) -> fx.Node:
    """See through value-preserving wrappers of a per-token vector (expand, contiguous, device moves)."""
    while isinstance(n, fx.Node) and op_kind(n) in ("expand", "contiguous", "cast"):
        src = arg(n, "input")
        sv, nv = _val(src), _val(n)
        if sv is None or nv is None or sv.dtype != nv.dtype:
            break
        n = src
    return n


def _is_zero_tensor(n: Any) -> bool:
    if const_number(n) == 0.0:
        return True
    if isinstance(n, fx.Node) and n.op in ("call_function", "call_method"):
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if name in ("zeros", "new_zeros", "zeros_like"):
            return True
        return name == "tensor" and len(n.args) == 1 and const_number(n.args[0]) == 0.0  # torch.tensor(0.0)
    return False


def _no_row_term(row: Optional[_Row]) -> bool:
    """No per-row term, or one built as zeros (transformers' left-padding count when no attention mask is given)
    and never written in place afterwards."""
    if row is None:
        return True
    n = row.src
    chain = [n]
    while isinstance(n, fx.Node) and op_kind(n) in ("cast", "view", "reshape", "contiguous", "expand"):
        n = arg(n, "input")
        chain.append(n)
    return _is_zero_tensor(n) and not any(_written_in_place(c) for c in chain if isinstance(c, fx.Node))


_VIEW_KINDS = ("getitem", "view", "reshape", "expand", "unsqueeze", "squeeze", "transpose", "permute", "narrow",
               "select", "slice")


def _written_in_place(n: fx.Node) -> bool:
    """Is ``n`` written in place by a user (``t[i] = x``, ``t.add_(...)``, ``copy_``, ...), directly or through a
    view of it?"""
    for u in n.users:
        if u.op not in ("call_function", "call_method") or not u.args or u.args[0] is not n:
            continue
        name = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")
        if u.target is operator.setitem or (name.endswith("_") and not name.endswith("__")):
            return True
        if (u.target is operator.getitem or op_kind(u) in _VIEW_KINDS) and _written_in_place(u):
            return True
    return False


# ---------------------------------------------------------------------------------- the interpreter
class _Reader:
    def __init__(self, B: Any, S: Any, Skv: Any):
        self.B, self.S, self.Skv = B, S, Skv
        self.memo: Dict[fx.Node, Any] = {}
        self.visited: List[fx.Node] = []

    def eval(self, n: Any) -> Any:
        if not isinstance(n, fx.Node):
            if n is True:
                return _Pred(frozenset())
            i = _int(n)
            if i is not None:
                return _Lin((), i)
            raise _Refuse(f"a non-integer constant {n!r} in the mask's index arithmetic")
        if n in self.memo:
            return self.memo[n]
        r = self._eval(n)
        self.memo[n] = r
        self.visited.append(n)
        return r

    # the per-node rules
    def _eval(self, n: fx.Node) -> Any:
        if n.op == "placeholder":
            i = _int(n)
            if i is not None:
                return _Lin((), i)
            raise _Refuse(f"the mask reads the graph input {n.name!r} directly (a user-supplied mask?)")
        k = op_kind(n)
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        v = _val(n)
        if k == "arange":
            return self._arange(n)
        if k in ("new_ones", "ones") or name in ("ones_like",):
            if v is not None and v.dtype == torch.bool:
                return _Pred(frozenset())
            raise _Refuse(f"{name} of dtype {getattr(v, 'dtype', None)} in the mask")
        if k in ("add", "sub"):
            a, b = self.eval(arg(n, "input")), self.eval(arg(n, "other"))
            if arg(n, "alpha", 1) != 1:
                raise _Refuse("index arithmetic with alpha")
            if isinstance(a, _Lin) and isinstance(b, _Lin):
                if not b.coefs:
                    return a.shift(b.const if k == "add" else -b.const)
                if not a.coefs and k == "add":
                    return b.shift(a.const)
                return a.plus(b, 1 if k == "add" else -1)
            if isinstance(b, _Row) and _coord(a) is not None:  # q - lp[b], pos[b, q] - lp[b]
                return _RLin(_coord(a), b, 1 if k == "add" else -1)
            if isinstance(a, _Row) and _coord(b) is not None and k == "add":
                return _RLin(_coord(b), a, 1)
            if isinstance(a, _RLin) and isinstance(b, _Lin) and not b.coefs:
                return a.shift(b.const if k == "add" else -b.const)
            pa, pb = _as_plin(a), _as_plin(b)  # positions: pos[q] - W, pos[q] - pos[kv]
            if pa is not None and isinstance(b, _Lin) and not b.coefs:
                return _PLin(pa.src, pa.batch, pa.coefs, pa.const + (b.const if k == "add" else -b.const))
            if pb is not None and isinstance(a, _Lin) and not a.coefs and k == "add":
                return _PLin(pb.src, pb.batch, pb.coefs, pb.const + a.const)
            if pa is not None and pb is not None and pa.src is pb.src and pa.batch == pb.batch:
                return pa.plus(pb, 1 if k == "add" else -1)
            raise _Refuse(f"{k} of {type(a).__name__} and {type(b).__name__} in the mask")
        if k == "floordiv" or (k == "div" and arg(n, "rounding_mode") == "floor"):
            return self._floordiv(n)
        if k == "getitem":
            return self._getitem(n)
        if k in ("unsqueeze", "view", "reshape", "expand", "contiguous") or name in ("broadcast_to",):
            return self._reshape(n)
        if k == "cast" or (n.op == "call_method" and n.target in ("bool", "int", "long")):
            x = self.eval(n.args[0] if n.op == "call_method" else arg(n, "input"))
            if isinstance(x, _Pred):
                if v is not None and v.dtype != torch.bool:
                    raise _Refuse(f"the mask predicate is cast to {v.dtype}")
                return x
            if isinstance(x, _Lin):
                if v is not None and (v.dtype.is_floating_point or v.dtype == torch.bool):
                    raise _Refuse(f"index arithmetic cast to {v.dtype}")
                return x
            if isinstance(x, _Vec):
                return _Vec(x.src, x.axis, x.batch, v.dtype if v is not None else x.dtype)
            raise _Refuse("cast of an unsupported value")
        if k in ("le", "lt", "ge", "gt", "eq", "ne"):
            return self._compare(n, k)
        if k == "and":
            a, b = self.eval(arg(n, "input")), self.eval(arg(n, "other"))
            a, b = self._as_pred(a), self._as_pred(b)
            return _Pred(a.atoms | b.atoms)
        if k == "or":
            raise _Refuse("the mask ORs two conditions (e.g. a bidirectional prefix or image tokens)")
        if k in ("logical_not", "invert"):
            raise _Refuse("the mask negates a condition")
        if k == "where":
            cond, a, b = arg(n, "condition"), arg(n, "input"), arg(n, "other")
            p = self._as_pred(self.eval(cond))
            fill = const_number(b)
            if not _is_zero_tensor(a) or fill is None:
                raise _Refuse("where() that is not (keep, 0, fill)")
            return _Additive(p, fill)
        raise _Refuse(f"the mask is computed with {name!r}, which the recipe reader does not model")

    def _floordiv(self, n: fx.Node) -> _Floor:
        a, size = self.eval(arg(n, "input")), _int(arg(n, "other"))
        if size is None or size <= 0:
            raise _Refuse("a floor division of the mask's indices by something other than a positive constant")
        if isinstance(a, _RLin):
            return _Floor(a, size)
        if _coord(a) is not None:
            return _Floor(_RLin(_coord(a), None, 0), size)
        raise _Refuse(f"a floor division of a {type(a).__name__} in the mask")

    def _as_pred(self, x: Any) -> _Pred:
        if isinstance(x, _Pred):
            return x
        if isinstance(x, _Vec) and x.dtype == torch.bool:
            if x.axis == "kv":
                return _Pred(frozenset({("key_valid", x.src, x.batch)}))
            raise _Refuse("a per-query padding term (query rows masked by a vector)")
        raise _Refuse(f"a {type(x).__name__} where the mask needs a condition")

    def _arange(self, n: fx.Node) -> _Lin:
        # the length comes from the node's fake value; the start and step must be known integers
        args = list(n.args)
        if "end" in n.kwargs:
            args = [n.kwargs.get("start", 0), n.kwargs["end"]]
        start = args[0] if len(args) >= 2 else 0
        step = args[2] if len(args) >= 3 else n.kwargs.get("step", 1)
        if _int(step) != 1:
            raise _Refuse("arange with a step")
        s0 = _int(start)
        if s0 is None:
            raise _Refuse("arange from a symbolic start (a KV cache offset)")
        v = _val(n)
        length = v.shape[0] if v is not None else None
        return _Lin((("_", 1),), s0, length, n, s0)

    def _place(self, x: _Lin, shape: tuple) -> Any:
        """A 1-D arange viewed into the 4-D broadcast: the one non-1 dim names its axis."""
        if len(shape) != 4:
            raise _Refuse(f"index vector viewed as a {len(shape)}-D tensor (expected the [B, H, S, Skv] layout)")
        dims = [i for i, d in enumerate(shape) if not known_true(d == 1)]
        if not dims:  # a length-1 arange: the constant start
            return _Lin((), x.const)
        if len(dims) != 1 or not _same(shape[dims[0]], x.length):
            raise _Refuse("index vector placed along more than one dim")
        return _Lin(((_AXES[dims[0]], 1),), x.const, None, x.src, x.start)

    def _reshape(self, n: fx.Node) -> Any:
        x = self.eval(arg(n, "input") if op_kind(n) else n.args[0])
        v = _val(n)
        if isinstance(x, _Lin) and x.coef("_"):
            return self._place(x, tuple(v.shape)) if v is not None and v.dim() == 4 else x
        if isinstance(x, (_Pred, _Additive)):
            return x  # broadcasting a condition changes no element's value
        if isinstance(x, _Lin) and v is not None and v.dim() == 4:
            return x
        raise _Refuse(f"{op_kind(n)} of an index vector outside the 4-D layout")

    def _getitem(self, n: fx.Node) -> Any:
        src, idx = n.args[0], n.args[1]
        idx_t = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, fx.Node) for i in idx_t):  # advanced indexing: a per-token vector's gather
            return self._gather(n, src, idx_t)
        x = self.eval(src)
        v = _val(n)
        if isinstance(x, _Lin) and x.coef("_"):
            if not all(i is None or _is_full(i) or i is Ellipsis for i in idx_t):
                raise _Refuse("an arange sliced before use")
            return self._place(x, tuple(v.shape)) if v is not None and v.dim() == 4 else x
        if isinstance(x, (_Pred, _Additive)):
            sv = _val(src)
            if sv is None or v is None or sv.dim() != v.dim() or not all(
                    _same(a, b) for a, b in zip(sv.shape, v.shape)):
                raise _Refuse("the mask is sliced to a smaller shape (not a no-op [..., :Skv] slice)")
            return x
        raise _Refuse("indexing of an unsupported value")

    def _gather(self, n: fx.Node, src: fx.Node, idx: tuple) -> Any:
        sv = _val(src)
        if sv is not None and sv.dim() == 1 and len(idx) == 1:  # a per-row integer: lp[batch_indices]
            bi = self.eval(idx[0])
            if sv.dtype.is_floating_point or sv.dtype == torch.bool:
                raise _Refuse(f"a per-row {sv.dtype} value in the mask's index arithmetic")
            if isinstance(bi, _Lin) and bi.coefs == (("b", 1),) and bi.const == 0 and _same(sv.shape[0], self.B):
                return _Row(src, "b")
            if isinstance(bi, _Lin) and not bi.coefs and bi.const == 0 and _same(sv.shape[0], 1):
                return _Row(src, "0")
            raise _Refuse("a per-row value read at another batch row")
        if sv is None or sv.dim() != 2 or len(idx) != 2:
            raise _Refuse("a gather from something other than a [B, L] per-token tensor")
        bi, ti = self.eval(idx[0]), self.eval(idx[1])
        if not (isinstance(bi, _Lin) and isinstance(ti, _Lin)):
            raise _Refuse("a gather with non-index subscripts")
        if ti.const != 0 or len(ti.coefs) != 1 or ti.coefs[0][0] not in ("q", "kv") or ti.coefs[0][1] != 1:
            raise _Refuse("a per-token vector read at a shifted or mixed index")
        axis = ti.coefs[0][0]
        if not _same(sv.shape[1], self.S if axis == "q" else self.Skv):
            raise _Refuse("a per-token vector whose length is not the sequence length")
        if bi.coefs == (("b", 1),) and bi.const == 0 and _same(sv.shape[0], self.B):
            batch = "b"
        elif not bi.coefs and bi.const == 0 and _same(sv.shape[0], 1):
            batch = "0"
        else:
            raise _Refuse("a per-token vector read at another batch row")
        if src.op == "placeholder" and not isinstance(_val(src), torch.Tensor):
            raise _Refuse("a gather from a non-tensor")
        return _Vec(src, axis, batch, _val(n).dtype if _val(n) is not None else sv.dtype)

    def _compare(self, n: fx.Node, k: str) -> _Pred:
        a, b = self.eval(arg(n, "input")), self.eval(arg(n, "other"))
        if isinstance(a, _Floor) and isinstance(b, _Floor) and k == "eq":
            # chunked attention: the same chunk of the same shifted coordinate along q and along kv
            ra, rb = a.rlin, b.rlin
            if a.size != b.size or ra.sign != rb.sign or ra.row != rb.row or not ra.coord.same_but_axis(rb.coord):
                raise _Refuse("chunk ids of the queries and keys computed differently")
            c = ra.coord
            return _Pred(frozenset({("chunks", (c.kind, c.src, c.where, c.const, ra.row, ra.sign, a.size))}))
        if isinstance(a, _Lin) and isinstance(b, _Lin):
            if k in ("eq", "ne"):
                raise _Refuse("an index equality (other than chunk ids: q // C == kv // C) is not a recipe the "
                              "kernel has")
            d = a.plus(b, -1)  # a - b  (op)  0
            # everything as  e >= 0  over integers
            e = {"ge": d, "gt": d.shift(-1), "le": _neg(d), "lt": _neg(d).shift(-1)}[k]
            return _Pred(frozenset({("index", e.coefs, e.const)}))
        if isinstance(a, _Vec) and isinstance(b, _Vec) and _base(a.src) is _base(b.src) and a.batch == b.batch \
                and k == "eq" and {a.axis, b.axis} == {"q", "kv"}:
            return _Pred(frozenset({("docs", a.src, a.batch)}))
        pa, pb = _as_plin(a), _as_plin(b)
        if pa is not None and pb is not None and pa.src is pb.src and pa.batch == pb.batch and k not in ("eq", "ne"):
            # positions compared (pos[kv] <= pos[q], pos[kv] > pos[q] - W): an index condition on positions
            d = pa.plus(pb, -1)
            e = {"ge": d, "gt": _PLin(d.src, d.batch, d.coefs, d.const - 1), "le": _pneg(d),
                 "lt": _PLin(d.src, d.batch, _pneg(d).coefs, _pneg(d).const - 1)}[k]
            return _Pred(frozenset({("pos_index", e.src, e.batch, e.coefs, e.const)}))
        raise _Refuse(f"a {k} comparison the recipe reader does not model")


def _neg(x: _Lin) -> _Lin:
    return _Lin(tuple((a, -v) for a, v in x.coefs), -x.const)


def _pneg(x: _PLin) -> _PLin:
    return _PLin(x.src, x.batch, tuple((a, -v) for a, v in x.coefs), -x.const)


# ------------------------------------------------------------------------------ document-id proofs
def _cumsum_of_bool(d: fx.Node) -> Optional[fx.Node]:
    """The bool ``x`` if ``d`` is ``x.cumsum(-1)`` (or of x cast to an int), else None: a cumsum of a 0/1 vector
    is non-decreasing, so its equal values are contiguous runs."""
    d = _base(d)
    if op_kind(d) != "cumsum":
        return None
    dim = arg(d, "dim")
    dv = _val(d)
    if dv is None or dim not in (-1, dv.dim() - 1):
        return None
    x = arg(d, "input")
    while isinstance(x, fx.Node) and (op_kind(x) == "cast" or (x.op == "call_method" and x.target in ("int", "long"))):
        xv = _val(x)
        if xv is None or xv.dtype.is_floating_point:
            return None
        x = x.args[0] if x.op == "call_method" else arg(x, "input")
    xv = _val(x)
    return x if xv is not None and xv.dtype == torch.bool else None


def _positions_of(d: fx.Node) -> Optional[fx.Node]:
    """The position vector ``pos`` if ``d`` is ``(diff(pos, dim=-1, prepend=...) != 1).cumsum(-1)``."""
    x = _cumsum_of_bool(d)
    if x is None or op_kind(x) != "ne" or const_number(arg(x, "other")) != 1.0:
        return None
    df = arg(x, "input")
    if op_kind(df) != "diff":
        return None
    pv = _val(arg(df, "input"))
    if arg(df, "n", 1) != 1 or pv is None or arg(df, "dim", -1) not in (-1, pv.dim() - 1) or \
            arg(df, "append") is not None:
        return None
    return arg(df, "input")


def _docs_from_positions(d: fx.Node, pos: fx.Node) -> bool:
    """Is ``d`` = ``(diff(pos, dim=-1, prepend=...) != 1).cumsum(-1)``? Then a new document starts exactly where
    the positions do not rise by one, so inside a document ``pos[j] - pos[i] = j - i``."""
    x = _cumsum_of_bool(d)
    if x is None or op_kind(x) != "ne" or const_number(arg(x, "other")) != 1.0:
        return False
    df = arg(x, "input")
    if op_kind(df) != "diff" or _base(arg(df, "input")) is not _base(pos):
        return False
    nv = arg(df, "n", 1)
    dim = arg(df, "dim", -1)
    pv = _val(arg(df, "input"))
    return nv == 1 and pv is not None and dim in (-1, pv.dim() - 1) and arg(df, "append") is None


def _is_arange(pos: fx.Node, S: Any) -> bool:
    """Are these positions ``arange(S) + c`` (HF's default when no position ids are passed), broadcast?"""
    return _arange_start(pos, S) is not None


def _arange_start(pos: fx.Node, S: Any) -> Optional[int]:
    """``c`` when these positions are ``arange(S) + c`` broadcast, else None."""
    n = pos
    while isinstance(n, fx.Node) and op_kind(n) in ("expand", "contiguous", "unsqueeze", "cast", "view", "reshape"):
        n = arg(n, "input")
    try:
        x = _Reader(None, S, S).eval(n)
    except _Refuse:
        return None
    if isinstance(x, _Lin) and x.coefs == (("_", 1),) and _same(x.length, S):
        return x.const
    return None


# ------------------------------------------------------------------------------------- subgraphs
def _owner(root: fx.GraphModule, g: fx.Graph) -> Optional[fx.GraphModule]:
    for _, m in graph_modules(root):
        if m.graph is g:
            return m
    return None


def _callers(root: fx.GraphModule, body: fx.GraphModule) -> List[Tuple[fx.GraphModule, fx.Node]]:
    out = []
    for _, m in graph_modules(root):
        for n in m.graph.nodes:
            if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
                continue
            ga = n.args[0]
            if ga.op == "get_attr" and getattr(m, ga.target, None) is body:
                out.append((m, n))
    return out


def _hop_name(n: fx.Node) -> str:
    return getattr(n.target, "__name__", str(n.target))


def _resolve(root: fx.GraphModule, mask: fx.Node):
    """Follow a mask that is a subgraph placeholder up to the node that feeds it: (node, its module, route)."""
    route: List[Tuple[fx.Node, fx.GraphModule]] = []
    placeholders: List[fx.Node] = []
    mod = _owner(root, mask.graph)
    while mask.op == "placeholder" and mod is not None and mod is not root:
        callers = _callers(root, mod)
        if len(callers) != 1:
            raise _Refuse(f"the mask enters a subgraph called from {len(callers)} places")
        parent, call = callers[0]
        if _hop_name(call) not in HOPS_WITH_BODY:
            raise _Refuse(f"the mask enters a subgraph of {_hop_name(call)}")
        phs = [p for p in mod.graph.nodes if p.op == "placeholder"]
        if len(phs) != len(call.args) - 1:
            raise _Refuse("a subgraph whose operands do not match its placeholders")
        route.insert(0, (call, mod))
        placeholders.append(mask)
        mask, mod = call.args[1 + phs.index(mask)], parent
        if not isinstance(mask, fx.Node):
            raise _Refuse("the mask operand of a subgraph is not a node")
    return mask, mod, route, placeholders


# ------------------------------------------------------------------------------------------ entry
def read_mask_recipe(mask: fx.Node, root: fx.GraphModule, B: Any, S: Any, Skv: Any,
                     kind: str = "bool") -> Tuple[Optional[MaskRecipe], str]:
    """The :class:`MaskRecipe` of ``mask`` (bool, True = keep; or additive when ``kind == "additive"``) for
    attention with batch ``B``, ``S`` queries and ``Skv`` keys, or ``(None, why not)``."""
    try:
        src, home, route, placeholders = _resolve(root, mask)
        reader = _Reader(B, S, Skv)
        val = reader.eval(src)
        fill = None
        if kind == "additive":
            if not isinstance(val, _Additive):
                raise _Refuse("an additive mask not built as where(keep, 0, fill)")
            fill = val.fill
            if not (fill == -math.inf or fill <= MASKED_BELOW):
                raise _Refuse(f"an additive mask whose fill {fill} is not a hard mask (-inf or <= {MASKED_BELOW:g})")
            val = val.pred
        if not isinstance(val, _Pred):
            raise _Refuse("the mask is not a condition")
        r = MaskRecipe(fill=fill, home=home, route=route, route_masks=placeholders)
        # documents built from positions that are an arange (no position ids passed) are one document
        atoms = [a for a in val.atoms
                 if not (a[0] == "docs" and _positions_of(a[1]) is not None and _is_arange(_positions_of(a[1]), S))]
        pos_atoms = [a for a in atoms if a[0] == "pos_index"]
        if pos_atoms:
            # Conditions on position ids equal the same conditions on indices when positions rise by exactly one
            # between the keys and queries compared: inside a document derived from those positions, or
            # everywhere when the positions are an arange (no position ids passed: one document).
            srcs = {a[1] for a in pos_atoms}
            docs_atoms = [a for a in atoms if a[0] == "docs"]
            if len(srcs) != 1:
                raise _Refuse("conditions on two different position vectors")
            pos = srcs.pop()
            if _is_arange(pos, S):
                atoms = [a for a in atoms if a[0] != "docs" or not _docs_from_positions(a[1], pos)]
            elif not (len(docs_atoms) == 1 and _docs_from_positions(docs_atoms[0][1], pos)):
                raise _Refuse("a condition on position ids without documents derived from the same positions")
            atoms = [("index", a[3], a[4]) if a[0] == "pos_index" else a for a in atoms]
        for atom in atoms:
            tag = atom[0]
            if tag == "index":
                coefs, c = dict(atom[1]), atom[2]
                if coefs == {"q": 1, "kv": -1} and c == 0 and known_true(S == Skv):
                    r.causal = True
                elif coefs == {"q": -1, "kv": 1} and c >= 0:  # kv - q + c >= 0  <=>  q - kv < c + 1
                    w = c + 1
                    r.window = w if not r.window else min(r.window, w)
                else:
                    raise _Refuse(f"an index condition {coefs} + {c} >= 0 that is neither causal nor a window")
            elif tag == "docs":
                if r.docs is not None and _base(r.docs) is not _base(atom[1]):
                    raise _Refuse("two different document-id vectors")
                if _cumsum_of_bool(atom[1]) is None:
                    raise _Refuse("document ids that are not provably contiguous runs (not a cumsum of a bool)")
                r.docs = atom[1]  # [B, S] (batch "b") or [1, S] (batch "0"): the op broadcasts either
            elif tag == "chunks":
                if r.chunks is not None and r.chunks != atom[1]:
                    raise _Refuse("two different chunkings of the sequence")
                r.chunks = atom[1]
            elif tag == "key_valid":
                if r.key_valid is not None and r.key_valid is not atom[1]:
                    raise _Refuse("two key-padding vectors")
                r.key_valid = atom[1]
            else:  # pragma: no cover
                raise _Refuse(f"unknown atom {tag}")
        if r.window and not r.causal:
            raise _Refuse("a sliding window without causal")
        if r.chunks is not None and r.chunks[0] == "pos":
            # chunks of position ids rise along a row where the positions do: when they are an arange, or inside
            # each document derived from them (the ids then combine with the documents': RecipeInputs)
            pos = r.chunks[1]
            start = _arange_start(pos, S)
            if not (start is not None or (r.docs is not None and _docs_from_positions(r.docs, pos))):
                raise _Refuse("attention chunks of position ids without documents derived from the same positions")
            if start is not None and _no_row_term(r.chunks[4]):  # positions t + start: chunk (t + start + c) // C
                r.chunk_shift = start + r.chunks[3]
        elif r.chunks is not None and _no_row_term(r.chunks[4]):  # an index t + c: chunk (t + c) // C
            r.chunk_shift = r.chunks[3]
        if r.docs is not None and not (r.causal and known_true(S == Skv)):
            raise _Refuse("packed documents without causal (or with S != Skv)")
        if r.chunks is not None and not (r.causal and known_true(S == Skv)):
            raise _Refuse("attention chunks without causal (or with S != Skv)")
        if not r.causal:
            raise _Refuse("a mask that is not causal (bidirectional attention keeps the mask tensor)")
        r.nodes = [n for n in home.graph.nodes if n in reader.memo]
        return r, ""
    except _Refuse as e:
        return None, str(e)


class RecipeInputs:
    """Materialises a recipe's vectors where an attention site needs them, once per graph: the ``doc_ranges``
    node (``document_ranges(doc ids)``) in the graph that built the mask, then, for a site inside checkpoint
    bodies, new body placeholders fed by new operands of each HOP call on the way."""

    def __init__(self):
        self._home: Dict[Tuple[int, str], fx.Node] = {}
        self._threaded: Dict[Tuple[int, int], fx.Node] = {}
        self.fed_masks: List[Tuple[fx.GraphModule, fx.Node, fx.Node]] = []  # (body, mask placeholder, HOP call)

    def vectors(self, r: MaskRecipe) -> Tuple[Optional[fx.Node], Optional[fx.Node]]:
        docs = kv = None
        if r.docs is not None and r.chunks is None:
            key = (id(r.docs), "docs")
            if key not in self._home:
                self._home[key] = _insert_after([r.docs], document_ranges, (r.docs,))
            docs = self._home[key]
        if r.chunks is not None:
            kind, src, where, const, row, sign, size = r.chunks
            key = (id(src), where, const, id(row.src) if row else None, sign, size, id(r.docs))
            if key not in self._home:
                rv = row.src if row is not None else None
                shift = const - where if kind == "index" else const  # an arange from `where`; positions as they are
                ids = _insert_after([src] + ([rv] if rv is not None else []), chunk_document_ids,
                                    (src, rv, shift, sign, size))
                if r.docs is not None:  # packed documents too: runs of the same document and chunk
                    ids = _insert_after([ids, r.docs], chunk_and_document_ids, (ids, r.docs))
                self._home[key] = _insert_after([ids], document_ranges, (ids,))
            docs = self._home[key]
        if r.key_valid is not None:
            kv = r.key_valid
        return self._thread(docs, r.route), self._thread(kv, r.route)

    def _thread(self, n: Optional[fx.Node], route) -> Optional[fx.Node]:
        for call, body in route:
            if n is None:
                return None
            key = (id(call), id(n))
            if key not in self._threaded:
                phs = [p for p in body.graph.nodes if p.op == "placeholder"]
                with body.graph.inserting_after(phs[-1]):
                    ph = body.graph.placeholder(f"fxfuse_{n.name}")
                for k in ("val", "example_value"):
                    if k in n.meta:
                        ph.meta[k] = n.meta[k]
                call.args = tuple(call.args) + (n,)
                self._threaded[key] = ph
            n = self._threaded[key]
        return n

    def drop_unused_mask_operands(self, root: fx.GraphModule) -> None:
        """Remove body placeholders nothing reads any more (the S x S mask a body was fed) and their operands,
        innermost first, so the mask is neither passed nor saved for the backward."""
        changed = True
        while changed:
            changed = False
            for _, body in list(graph_modules(root)):
                if body is root:
                    continue
                callers = _callers(root, body)
                if len(callers) != 1 or _hop_name(callers[0][1]) not in HOPS_WITH_BODY:
                    continue
                parent, call = callers[0]
                phs = [p for p in body.graph.nodes if p.op == "placeholder"]
                if len(phs) != len(call.args) - 1:
                    continue
                for i in reversed(range(len(phs))):
                    p = phs[i]
                    if p.users or not _is_mask_operand(p):
                        continue  # only masks a recipe replaced: everything else stays as Dynamo made it
                    body.graph.erase_node(p)
                    args = list(call.args)
                    del args[1 + i]
                    call.args = tuple(args)
                    changed = True
                body.recompile()


_MASK_MARK = "fxfuse_recipe_mask"


def mark_mask(r: MaskRecipe) -> None:
    """Mark the body placeholders a recipe's mask came through (drop_unused_mask_operands removes only those)."""
    for n in r.route_masks:
        n.meta[_MASK_MARK] = True


def erase_dead_masks(root: fx.GraphModule, recipes: List[MaskRecipe], inputs: "RecipeInputs") -> int:
    """After every site of a graph is rewritten: drop the mask operands of bodies, then erase the mask builders
    nothing reads any more. Returns how many nodes were erased."""
    from fxfuse.graph_utils import erase_unused

    inputs.drop_unused_mask_operands(root)
    erased = 0
    homes = {id(r.home): r.home for r in recipes if r.home is not None}
    for m in homes.values():
        mine = {n for r in recipes if r.home is m for n in r.nodes}
        erased += len(erase_unused(m.graph, [n for n in m.graph.nodes if n in mine]))
    for m in {id(r.home): r.home for r in recipes if r.home is not None}.values():
        m.recompile()
    return erased


def _is_mask_operand(n: Any) -> bool:
    return isinstance(n, fx.Node) and bool(n.meta.get(_MASK_MARK))


def chunk_document_ids(index: torch.Tensor, row: Optional[torch.Tensor], shift: int, sign: int,
                       size: int) -> torch.Tensor:
    """``[B|1, S]`` int64 ids ``(index[.., t] + shift + sign * row[b]) // size`` (floor): the chunk of each token,
    as transformers' chunked mask computes it, from a ``[S]`` arange or ``[B|1, S]`` positions (``row`` the
    left-padding count per batch row, or None). Non-decreasing along each row wherever ``index`` rises, for any
    ``row``: each chunk is one contiguous run there, as :func:`.op.document_ranges` needs."""
    x = index.to(torch.int64)
    x = (x.unsqueeze(0) if x.dim() == 1 else x) + shift
    if row is not None:
        x = x + sign * row.to(torch.int64).reshape(-1, 1)
    return torch.div(x, size, rounding_mode="floor")


def chunk_and_document_ids(chunks: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` ids of the runs where both the chunk and the document stay the same: two tokens share one iff they
    share both (each document's chunks rise along it, so a chunk never resumes inside a document)."""
    c, d = torch.broadcast_tensors(chunks, docs.to(chunks.dtype))
    new_chunk = torch.diff(c, dim=-1, prepend=c[..., :1]) != 0
    new_doc = torch.diff(d, dim=-1, prepend=d[..., :1]) != 0
    return (new_chunk | new_doc).to(torch.int64).cumsum(-1)


def _insert_after(after: List[fx.Node], fn, args: tuple) -> fx.Node:
    """A call of ``fn(*args)`` placed after the last of ``after`` in their graph, its fake value computed now (the
    pipeline re-propagates after the pass; the body placeholders it may be threaded into need it at once)."""
    g = after[0].graph
    order = {n: i for i, n in enumerate(g.nodes)}
    with g.inserting_after(max(after, key=order.__getitem__)):
        node = g.call_function(fn, args)
    vals = [node_val(a) if isinstance(a, fx.Node) else a for a in args]
    fake = next((v for v in vals if isinstance(v, torch.Tensor)), None)
    if fake is not None:
        try:
            with _fake_mode_of(fake):
                node.meta["val"] = fn(*vals)
            node.meta["example_value"] = node.meta["val"]
        except Exception:
            pass
    return node


class _fake_mode_of:
    """Enter the fake mode a fake tensor belongs to (to compute a new node's meta value)."""

    def __init__(self, t):
        self.mode = getattr(t, "fake_mode", None)

    def __enter__(self):
        if self.mode is not None:
            self.mode.__enter__()

    def __exit__(self, *a):
        if self.mode is not None:
            self.mode.__exit__(*a)
