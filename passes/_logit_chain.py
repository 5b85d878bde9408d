"""Matcher shared by the passes that fuse an lm-head projection with what consumes its logits.

Walking up from a consumer's input (the tensor a cross-entropy or log-softmax reads), it accepts exactly the ops
that keep "row r of the consumer's input = f(hidden row r' @ W.T + b)" for an elementwise ``f`` by constants, and
records them:

* shape-only ops that keep the last (vocabulary) dim: ``view``/``reshape``/``flatten``/``contiguous``/
  ``squeeze``/``unsqueeze`` (row-major order is kept, so rows map to rows);
* ``getitem`` whose index leaves the last dim alone (the label-shift slice ``logits[..., :-1, :]``): since the
  projection is row-wise it is moved onto ``hidden`` instead;
* casts to a float dtype (the kernels compute in fp32);
* ``* c``, ``/ c`` by Python constants and at most one ``tanh`` (softcap ``c * tanh(x / c)``, Granite's divide,
  Cohere's multiply);
* and at the top ``linear(h, W[, b])``, ``matmul(h, W.t())`` / ``h @ W.T`` / ``matmul(h, W.transpose(0, 1))``.

Tensor parallelism: where ``W`` is a DTensor split over the vocabulary (``Shard(0)`` on a 1-D mesh, the lm-head under
``ColwiseParallel``) and ``h`` a replicated DTensor, the logits are a vocabulary-sharded DTensor; the walk also
accepts ``redistribute`` (to ``Replicate()``: the logits' all-gather of a gathered-output lm-head; to ``Shard(-1)``:
nothing) and ``to_local`` after it, and the chain records the split (:class:`VocabSplit`) for the
vocabulary-parallel op. Other DTensor layouts stop the walk with their placements in the reason.

Anything else stops the walk with a reason the pass puts into the fusion report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx

from fxfuse.graph_utils import SHAPE_ONLY_KINDS, arg, const_number, known_true, node_val, op_kind
from fxfuse.kernels import lm_head_rows

__all__ = ["LogitChain", "VocabSplit", "insert_vocab_parallel_loss", "match_logit_chain", "CHUNK_BYTES_OPTION", "chunk_bytes_option", "const_operand",
           "is_last_dim"]


@dataclass
class VocabSplit:
    """The lm-head's weight is split over the vocabulary between the ranks of ``group_name`` (DTensor Shard(0))."""
    group_name: str
    vocab_size: int
    mesh: Any  # the weight's DeviceMesh (to rebuild a DTensor loss)
    world: int  # ranks the vocabulary is split between


@dataclass
class LogitChain:
    hidden: fx.Node                 # [..., D]
    weight: fx.Node                 # [V, D] (or [D, V] with weight_transposed)
    bias: Optional[fx.Node]
    projection: fx.Node             # the linear/matmul node
    nodes: List[fx.Node]            # projection .. consumer input, in graph order
    row_index: List[Any] = field(default_factory=list)  # getitem indices to apply to hidden, in order
    weight_transposed: bool = False  # weight is [D, V]: the pass inserts a .t()
    pre_scale: float = 1.0
    post_scale: float = 1.0
    tanh: bool = False
    vocab_split: Optional[VocabSplit] = None  # tensor parallelism: see VocabSplit

    @property
    def scale(self) -> float:
        return self.pre_scale * self.post_scale

    @property
    def softcap(self) -> float:
        return self.post_scale if self.tanh else 0.0


def const_operand(n: fx.Node) -> Optional[float]:
    """The Python-number operand of a ``mul`` / ``div`` node whose other operand is a tensor (for ``div`` only the
    divisor), else None."""
    a, b = arg(n, "input"), arg(n, "other")
    if isinstance(a, fx.Node) and const_number(b) is not None:
        return const_number(b)
    if op_kind(n) == "mul" and isinstance(b, fx.Node) and const_number(a) is not None:
        return const_number(a)
    return None


def _tensor_input(n: fx.Node) -> Optional[fx.Node]:
    a = arg(n, "input")
    if isinstance(a, fx.Node):
        return a
    b = arg(n, "other")
    return b if isinstance(b, fx.Node) else None


def is_last_dim(n: fx.Node, dim) -> bool:
    """Whether ``dim`` is the last dim of ``n``'s input (for a consumer of logits: the vocabulary dim)."""
    v = node_val(arg(n, "input"))
    return isinstance(v, torch.Tensor) and dim in (-1, v.dim() - 1)


def _keeps_last_dim(n: fx.Node) -> bool:
    src, out = node_val(_tensor_input(n)), node_val(n)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or out.dim() == 0:
        return False
    return known_true(src.shape[-1] == out.shape[-1])


def _index_leaves_last_dim(index: Any, ndim: int) -> bool:
    """``x[index]`` leaves the last dim untouched (basic slicing of leading dims, ``...`` before a full slice)."""
    idx = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) or i is None for i in idx):
        return False  # advanced or new-axis indexing: not handled
    if Ellipsis in idx:
        pos = idx.index(Ellipsis)
        tail = idx[pos + 1:]
        return len(tail) >= 1 and tail[-1] == slice(None, None, None) and all(
            isinstance(i, slice) and i.step in (None, 1) for i in idx if i is not Ellipsis)
    if len(idx) < ndim:
        return all(isinstance(i, slice) and i.step in (None, 1) for i in idx)
    return idx[ndim - 1] == slice(None, None, None) and all(
        isinstance(i, slice) and i.step in (None, 1) for i in idx)


def _weight_of_matmul(n: fx.Node) -> Tuple[Optional[fx.Node], bool]:
    """For ``matmul(h, X)``: (W, False) if X is ``W.t()``/``W.T``/``W.transpose(0, 1)`` of a 2-D W, (X, True) if X
    is itself a 2-D [D, V] tensor."""
    other = arg(n, "other")
    if not isinstance(other, fx.Node):
        return None, False
    k = op_kind(other)
    if k == "t" or (k == "transpose" and {arg(other, "dim0"), arg(other, "dim1")} in ({0, 1}, {-1, -2}, {0, -1},
                                                                                       {-2, 1})):
        w = arg(other, "input")
        wv = node_val(w)
        if isinstance(wv, torch.Tensor) and wv.dim() == 2:
            return w, False
    if other.op == "call_function" and getattr(other.target, "__name__", "") == "getattr" \
            and len(other.args) == 2 and other.args[1] in ("T", "mT"):
        w = other.args[0]
        if isinstance(node_val(w), torch.Tensor) and node_val(w).dim() == 2:
            return w, False
    ov = node_val(other)
    if isinstance(ov, torch.Tensor) and ov.dim() == 2:
        return other, True
    return None, False


def _is_dtensor(v) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without torch.distributed: no DTensor to meet
        return False
    return isinstance(v, DTensor)


def _placements(v) -> str:
    return ", ".join(str(p) for p in v.placements) if _is_dtensor(v) else "a plain tensor"


def _shards_last_dim(v) -> bool:
    from torch.distributed.tensor import Shard

    return _is_dtensor(v) and len(v.placements) == 1 and isinstance(v.placements[0], Shard) \
        and v.placements[0].dim in (-1, v.dim() - 1)


def _vocab_split(h: fx.Node, w: fx.Node) -> Tuple[Optional[VocabSplit], str]:
    """(VocabSplit, "") for a vocabulary-sharded DTensor lm-head weight with a replicated DTensor hidden; (None, "")
    for plain tensors; (None, why) for any other DTensor layout."""
    from torch.distributed.tensor import Replicate, Shard

    hv, wv = node_val(h), node_val(w)
    if not _is_dtensor(wv) and not _is_dtensor(hv):
        return None, ""
    if not (_is_dtensor(wv) and len(wv.placements) == 1 and isinstance(wv.placements[0], Shard)
            and wv.placements[0].dim == 0):
        return None, f"DTensor lm-head weight placed ({_placements(wv)}): only a vocabulary split (Shard(0)) is fused"
    if not (_is_dtensor(hv) and tuple(hv.placements) == (Replicate(),)):
        return None, f"DTensor lm-head with the hidden states placed ({_placements(hv)}): only Replicate() is fused"
    try:
        group_name = wv.device_mesh.get_group().group_name
    except Exception as e:  # noqa: BLE001  (a mesh Dynamo handed over without its process group)
        return None, f"the lm-head weight's device mesh gives no process group ({type(e).__name__}: {e})"
    return VocabSplit(group_name, int(wv.shape[0]), wv.device_mesh, wv.device_mesh.size()), ""


def local_operands(g: fx.Graph, chain: LogitChain, target: fx.Node) -> Tuple[fx.Node, fx.Node, fx.Node]:
    """At ``g``'s insertion point: the local shards a split lm-head's fused op reads, i.e. ``to_local`` of the
    hidden states (the chain's row index applied), of the lm-head weight and of the targets where they are a
    DTensor."""
    import operator

    from torch.distributed.tensor import DTensor

    h = chain.hidden
    for idx in chain.row_index:
        h = g.call_function(operator.getitem, (h, idx))
    h = g.call_method("to_local", (h,))
    w = g.call_method("to_local", (chain.weight,))
    t = g.call_method("to_local", (target,)) if isinstance(node_val(target), DTensor) else target
    return h, w, t


def insert_vocab_parallel_loss(g: fx.Graph, chain: LogitChain, target: fx.Node, ignore_index: int, reduction: str,
                               ctx) -> fx.Node:
    """At ``g``'s insertion point: ``fxfuse::vocab_parallel_cross_entropy`` over the chain's local shards
    (:func:`local_operands`), the chain's softcap and scale. For the passes that fuse a split lm-head."""
    import fxfuse.ops.vocab_parallel_cross_entropy  # noqa: F401  (registers the op)

    h, w, t = local_operands(g, chain, target)
    split = chain.vocab_split
    return g.call_function(torch.ops.fxfuse.vocab_parallel_cross_entropy.default,
                           (h, w, t, split.vocab_size, split.group_name, int(ignore_index), reduction,
                            float(chain.softcap), float(chain.scale), chunk_bytes_option(ctx)))


def match_logit_chain(consumer_input: fx.Node, float_only: bool = True) -> Tuple[Optional[LogitChain], str]:
    """Walk from ``consumer_input`` up to an lm-head projection. Returns (chain, "") or (None, why not)."""
    nodes: List[fx.Node] = []
    row_index: List[Any] = []
    after, before, tanh = 1.0, 1.0, False  # multipliers nearer the loss than the tanh / nearer the projection
    gathered = False  # a redistribute / to_local of vocabulary-sharded logits was walked through
    n = consumer_input
    while True:
        if n.op == "placeholder":
            return None, ("the logits are an input of this graph: the lm-head ran in another graph (a graph break at "
                          "its call, e.g. an FSDP2 unit of its own, as accelerate's [final norm, lm_head] tail unit "
                          "is), so the loss alone is left to Inductor")
        k = op_kind(n)
        if k == "linear":
            h, w, b = arg(n, "input"), arg(n, "weight"), arg(n, "bias")
            if not isinstance(h, fx.Node) or not isinstance(w, fx.Node):
                return None, "linear with non-tensor operands"
            if not isinstance(node_val(w), torch.Tensor) or node_val(w).dim() != 2:
                return None, "linear weight is not 2-D"
            split, why = _vocab_split(h, w)
            if why:
                return None, why
            if split is not None and isinstance(b, fx.Node):
                return None, "vocabulary-sharded lm-head with a bias"
            if gathered and split is None:
                return None, "redistribute / to_local of logits that are not a vocabulary-sharded DTensor"
            nodes.append(n)
            pre, post = (before, after) if tanh else (after, 1.0)
            return LogitChain(h, w, b if isinstance(b, fx.Node) else None, n, nodes[::-1], row_index[::-1],
                              False, pre, post, tanh, split), ""
        if k == "matmul":
            h = arg(n, "input")
            w, transposed = _weight_of_matmul(n)
            if w is None or not isinstance(h, fx.Node):
                return None, "matmul whose right operand is not a 2-D weight (or its transpose)"
            nodes.append(n)
            pre, post = (before, after) if tanh else (after, 1.0)
            return LogitChain(h, w, None, n, nodes[::-1], row_index[::-1], transposed, pre, post, tanh), ""
        if isinstance(n, fx.Node) and n.op == "placeholder":
            return None, (f"the logits are an input of this graph ({n.target}), computed in another one: a graph "
                          "break between the lm-head and the loss (or a compiled loss function given logits)")
        if not isinstance(n, fx.Node) or k is None:
            what = getattr(n, "target", n)
            return None, f"reached {getattr(what, '__name__', what)} before any lm-head projection"
        src = _tensor_input(n)
        if src is None:
            return None, f"{k} has no tensor input"
        if k in ("redistribute", "to_local"):
            # vocabulary-sharded logits gathered (Replicate) or kept sharded: row r is still f(h_r @ W.T)
            from torch.distributed.tensor import Replicate

            v = node_val(src)
            if k == "to_local":  # of gathered logits (whether they were split is checked at the projection)
                if not (_is_dtensor(v) and tuple(v.placements) == (Replicate(),)):
                    return None, (f"to_local of logits placed ({_placements(v)}): the loss reads this rank's "
                                  "slice of the vocabulary only")
            else:
                out = node_val(n)
                if not _shards_last_dim(v):
                    return None, f"redistribute of logits placed ({_placements(v)}), not split over the vocabulary"
                if not (_shards_last_dim(out) or (_is_dtensor(out) and tuple(out.placements) == (Replicate(),))):
                    return None, f"redistribute of the logits to ({_placements(out)})"
            gathered = True
        elif k in SHAPE_ONLY_KINDS:
            if not _keeps_last_dim(n):
                return None, f"{k} changes the vocabulary (last) dim"
        elif k == "getitem":
            v = node_val(src)
            if not isinstance(v, torch.Tensor) or not _index_leaves_last_dim(arg(n, "index"), v.dim()):
                return None, "indexing that touches the vocabulary dim or uses tensors"
            row_index.append(arg(n, "index"))
        elif k == "cast":
            dt = node_val(n).dtype if isinstance(node_val(n), torch.Tensor) else None
            if float_only and dt not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
                return None, f"cast to {dt}"
        elif k in ("mul", "div"):
            c = const_operand(n)
            if c is None or (k == "div" and c == 0.0):
                return None, f"{k} by a tensor (not a compile-time constant)"
            c = c if k == "mul" else 1.0 / c
            if tanh:
                before *= c
            else:
                after *= c
        elif k == "tanh":
            if tanh:
                return None, "two tanh in the logit chain"
            tanh = True
        else:
            return None, f"{k} between the projection and the loss is not an elementwise-by-constant op"
        nodes.append(n)
        n = src


# The lm-head passes' ``chunk_bytes`` option as both declare it: 0 stands for the op's default budget, which the
# kernels read at call time (lm_head_rows.DEFAULT_CHUNK_BYTES, FXFUSE_LCE_CHUNK_BYTES in the environment).
CHUNK_BYTES_OPTION = {"type": int, "minimum": 0, "default": 0,
                      "doc": f"logits-chunk budget in bytes, 0 = the op's default "
                             f"({lm_head_rows.DEFAULT_CHUNK_BYTES >> 20} MiB, at least "
                             f"{lm_head_rows.MIN_DEFAULT_CHUNK_ROWS} tokens)",
                      "shown_default": f"0 = {lm_head_rows.DEFAULT_CHUNK_BYTES >> 20} MiB"}


def chunk_bytes_option(ctx) -> int:
    """The lm-head passes' ``chunk_bytes`` pass option (the fused op's logits-chunk budget; 0 = the op's default),
    checked so that a bad value rolls the pass back with a reason that says what is wrong."""
    return ctx.int_option("chunk_bytes", 0, 0, "bytes; 0 = default 256 MiB")
