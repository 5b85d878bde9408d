"""Tensor parallelism's all-reduces: fewer of them, and overlapped with the matmuls that produce them (an Inductor
post-grad step, fxfuse option ``tp_all_reduce_blocks``).

Under tensor parallelism without sequence parallelism (torch's ``RowwiseParallel`` output, transformers'
``rowwise`` plan entries, and in the backward each ``ColwiseParallel`` input's gradient) a layer's output is a
matmul of local shards whose partial sums are all-reduced before anything can read them::

    y = mm(x, w)                   # [N, D], this rank's partial sum
    y = wait_tensor(all_reduce(y)) # the next op waits for the whole all-reduce

The twenty-sixth session's FSDP2 x TP profile (Llama-3-8B widths, two H200s per TP group) has 7 such all-reduces
per layer and step, 37-46 ms of them a step, mostly with the GPU's compute idle. Two rewrites:

* **Summed all-reduces merged** (:func:`merge_summed_all_reduces`): an input that several ColwiseParallel layers
  read (q / k / v, gate / up) gets its gradient as ``all_reduce(g_q) + all_reduce(g_k) + all_reduce(g_v)``, one
  all-reduce of a full [N, D] tensor per layer. ``all_reduce(g_q + g_k + g_v)`` is the same sum in another
  order, with one all-reduce: 7 per layer become 4, and the bytes the backward sends 5 [N, D] tensors become 2.
* **Blocks of rows** (:func:`split_all_reduced_matmuls`): the matmul (or a sum of matmuls of the same rows) whose
  result is all-reduced is split into N blocks of rows; block i's all-reduce runs on the communicator's stream
  while block i + 1's matmul runs on the compute stream::

      y_i = mm(x[r_i : r_i+1], w); h_i = all_reduce(y_i)    for every block, in order
      y = cat([wait_tensor(h_i) for every block])           where the single wait was

  Each row is the same sum of the same partial products (a row of a matmul does not read other rows; the library
  may pick another kernel for fewer rows, so bits can differ as between two batch sizes). Rows are what a
  ``[N, D] -> [..., D]`` reshape keeps in order, so such a reshape between the matmul and the all-reduce is
  allowed. Only a concrete row count of at least N x ``min_rows`` is split (a symbolic length keeps the single
  all-reduce: the number of blocks must be known when the graph is built).

The reduction and group are kept. This runs on AOTAutograd's partitioned graphs (forward and backward), where
DTensor has become plain matmuls and functional collectives. ``tp_all_reduce_blocks`` 1 (the default) merges; N >= 2
merges and splits into N blocks; 0 leaves the graph as traced. On two H200s (Llama-3-8B widths, 16 layers, TP over
both GPUs, the twenty-seventh session) merging took the step from 289.8 to 281.9 ms (112 all-reduces a step became
64); two blocks were no faster (283.8 ms: 128 smaller all-reduces, and 42.6 ms a step of NCCL not covered by
compute against 19.9 at 1), so splitting stays opt-in.

**Scheduling** (option ``comm_overlap``, :func:`overlap_config_patches`): AOTAutograd writes a linear's backward as
its weight gradient, then its input gradient, so a ColwiseParallel input gradient's all-reduce is the last thing
computed before its wait, and the GPU's compute idles for the whole all-reduce::

    dW = mm(x.T, g); dx = mm(g, W); h = all_reduce(dx); wait_tensor(h); norm_backward(dx)

Inductor's ``reorder_compute_for_overlap`` scheduler pass (``config.reorder_for_compute_comm_overlap``) issues each
collective as early as its operand allows and schedules the computation it does not need (here ``dW``) before its
wait. It runs after Inductor's peak-memory reordering, which an FX-level reordering here would not survive: on the
CPU at Llama-like widths that reordering put the weight-gradient matmuls back before the all-reduce. With no
collective in a graph the pass keeps the order as it is, and fxfuse only asks for it where the Dynamo graph holds
DTensors or functional collectives (:func:`may_hold_collectives`). A graph that also holds one of fxfuse's ops that
run collectives inside (the vocabulary-parallel loss) keeps Inductor's order (:func:`runs_collectives_inside`,
checked again on the scheduler's nodes by :func:`reorder_compute_for_overlap_safely`, which ``fxfuse.install()``
relies on).
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Optional

import torch
import torch.fx as fx

__all__ = ["may_hold_collectives", "merge_summed_all_reduces", "overlap_config_patches",
           "reorder_compute_for_overlap_safely", "rewrite_tp_all_reduces", "runs_collectives_inside",
           "split_all_reduced_matmuls"]

log = logging.getLogger("fxfuse")
aten = torch.ops.aten
_ROW_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _collectives():
    c10d = torch.ops._c10d_functional
    return c10d.all_reduce.default, c10d.wait_tensor.default


def _val(n) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is(n, target) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is target


def _reduced(w: fx.Node, ar_op, wait_op):
    """The all-reduce behind ``w`` if ``w`` is ``wait_tensor(all_reduce(x))`` whose all-reduce nothing else reads."""
    if _is(w, wait_op) and _is(w.args[0], ar_op) and len(w.args[0].users) == 1:
        return w.args[0]
    return None


def _plain_add(n: fx.Node) -> bool:
    return _is(n, aten.add.Tensor) and len(n.args) == 2 and n.kwargs.get("alpha", 1) == 1


def _same_shape(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Provably the same shape, symbolic sizes included (no guard is added: the graph is already specialised)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return a is not None and b is not None and a.dim() == b.dim() and statically_known_true(
        sym_eq(tuple(a.shape), tuple(b.shape)))


def _same_reduction(a: fx.Node, b: fx.Node) -> bool:
    va, vb = _val(a.args[0]), _val(b.args[0])
    return (tuple(a.args[1:]) == tuple(b.args[1:]) and a.kwargs == b.kwargs and _same_shape(va, vb)
            and va.dtype == vb.dtype and va.device == vb.device)


def merge_summed_all_reduces(graph: fx.Graph) -> int:
    """``all_reduce(x) + all_reduce(y)`` -> ``all_reduce(x + y)`` (the same group and reduction, "sum"; each
    all-reduced value read only by the sum), also through a chain of sums (``(t + all_reduce(x)) + all_reduce(y)``
    -> ``t + all_reduce(x + y)``): the gradient of an input that several ColwiseParallel layers read (q / k / v,
    gate / up) is one all-reduce of their summed partial gradients instead of one per layer. The same sum, added
    in another order. Returns how many all-reduces were removed."""
    ar_op, wait_op = _collectives()
    fake = None
    merged = 0
    changed = True
    while changed:
        changed = False
        erased = set()
        for add in list(graph.find_nodes(op="call_function", target=aten.add.Tensor)):
            if add in erased or not _plain_add(add):
                continue
            for i in (0, 1):
                w_out, other = add.args[i], add.args[1 - i]
                ar_out = _reduced(w_out, ar_op, wait_op) if isinstance(w_out, fx.Node) and len(w_out.users) == 1 \
                    else None
                if ar_out is None or ar_out.args[1] != "sum":
                    continue
                # other: a wait of its own (rule A), or a sum that holds one (rule B: reassociate)
                rest, w_in = None, None
                if isinstance(other, fx.Node) and len(other.users) == 1 and _reduced(other, ar_op, wait_op) \
                        is not None:
                    w_in = other
                elif isinstance(other, fx.Node) and len(other.users) == 1 and _plain_add(other):
                    for j in (0, 1):
                        c = other.args[j]
                        if isinstance(c, fx.Node) and len(c.users) == 1 and _reduced(c, ar_op, wait_op) is not None:
                            w_in, rest = c, other.args[1 - j]
                            break
                if w_in is None:
                    continue
                ar_in = _reduced(w_in, ar_op, wait_op)
                if not _same_reduction(ar_in, ar_out) or not _same_shape(_val(add), _val(ar_out.args[0])):
                    continue
                fake = fake or _fake_mode([_val(ar_in.args[0])])
                with graph.inserting_before(add):
                    total = graph.call_function(aten.add.Tensor, (ar_in.args[0], ar_out.args[0]))
                    h = graph.call_function(ar_op, (total,) + tuple(ar_out.args[1:]), dict(ar_out.kwargs))
                    w = graph.call_function(wait_op, (h,))
                    new = w if rest is None else graph.call_function(aten.add.Tensor, (rest, w))
                try:
                    with fake:
                        total.meta["val"] = _val(ar_in.args[0]) + _val(ar_out.args[0])
                        h.meta["val"] = torch.empty_like(total.meta["val"])
                        w.meta["val"] = torch.empty_like(total.meta["val"])
                        if rest is not None:
                            new.meta["val"] = _val(add)
                except Exception as e:  # nothing rewired yet: the new nodes go, the sum stays as traced
                    _roll_back(graph, [total, h, w] + ([new] if rest is not None else []), add, e)
                    continue
                add.replace_all_uses_with(new)
                dead = [add, w_out, ar_out] + ([other] if rest is not None else []) + [w_in, ar_in]
                for n in dead:
                    graph.erase_node(n)
                    erased.add(n)
                merged += 1
                changed = True
                break
    return merged


def _fake_mode(vals):
    from torch._guards import detect_fake_mode

    return detect_fake_mode(vals) or contextlib.nullcontext()


def _matmul_terms(x: fx.Node):
    """``x`` as a sum of matmuls, each read only here, each maybe through a row-keeping reshape:
    [(mm, view or None)], or None."""
    if _plain_add(x) and len(x.users) == 1:
        left, right = _matmul_terms(x.args[0]), _matmul_terms(x.args[1])
        return None if left is None or right is None else left + right
    view = None
    if isinstance(x, fx.Node) and x.op == "call_function" and x.target in _ROW_VIEWS and len(x.users) == 1:
        view, x = x, x.args[0]
    if not (_is(x, aten.mm.default) and len(x.users) == 1):
        return None
    return [(x, view)]


def _split_site(ar: fx.Node, wait_op):
    """(terms, wait, rows) if ``ar`` all-reduces a sum of matmuls (module docstring) with a concrete row count
    that nothing else reads, else None."""
    if len(ar.users) != 1 or ar.meta.get("fxfuse_tp_block"):
        return None  # (a block this step made: a second run, fxfuse.install()'s pass then the backend's, keeps it)
    wait = next(iter(ar.users))
    if not _is(wait, wait_op):
        return None
    terms = _matmul_terms(ar.args[0])
    out = _val(ar.args[0])
    if not terms or out is None or not all(isinstance(s, int) for s in out.shape):
        return None  # a symbolic row count: the number of blocks must be known here
    rows = None
    for mm, _view in terms:
        mv, a, b = _val(mm), _val(mm.args[0]), _val(mm.args[1])
        if mv is None or a is None or b is None or not all(isinstance(s, int) for s in mv.shape):
            return None
        # rows keep their order through [N, D] -> [..., D]; every term the same [N, D]
        if mv.shape[1] != out.shape[-1] or mv.shape[0] * mv.shape[1] != out.numel() or rows not in (None, mv.shape[0]):
            return None
        rows = mv.shape[0]
    return terms, wait, rows


def split_all_reduced_matmuls(graph: fx.Graph, blocks: int, min_rows: int = 256) -> int:
    """Split every ``wait_tensor(all_reduce(x))`` where ``x`` is a matmul, or a sum of matmuls of the same rows
    (a row-keeping reshape allowed), into ``blocks`` blocks of rows, each all-reduced as soon as its matmuls are
    done, the waits where the one wait was (module docstring). Returns how many sites were split."""
    if blocks < 2:
        return 0
    ar_op, wait_op = _collectives()
    split = 0
    for ar in list(graph.find_nodes(op="call_function", target=ar_op)):
        site = _split_site(ar, wait_op)
        if site is None:
            continue
        terms, wait, n_rows = site
        if n_rows < blocks * min_rows:
            continue
        step = math.ceil(n_rows / blocks)
        bounds = [(s, min(n_rows, s + step)) for s in range(0, n_rows, step)]
        out_shape = list(_val(ar.args[0]).shape)
        fake = _fake_mode([_val(terms[0][0])])
        made = []  # (node, how to compute its fake value)
        with graph.inserting_before(ar):
            pending = []
            for s, e in bounds:
                total = None
                for mm, _view in terms:
                    x, w = mm.args
                    part = graph.call_function(aten.slice.Tensor, (x, 0, s, e))
                    y = graph.call_function(aten.mm.default, (part, w))
                    made += [(part, lambda v, s=s, e=e: v[0][s:e], (x,)), (y, lambda v: torch.mm(*v), (part, w))]
                    if total is None:
                        total = y
                    else:
                        total = graph.call_function(aten.add.Tensor, (total, y))
                        made.append((total, lambda v: v[0] + v[1], tuple(total.args)))
                h = graph.call_function(ar_op, (total,) + tuple(ar.args[1:]), dict(ar.kwargs))
                h.meta["fxfuse_tp_block"] = True
                made.append((h, lambda v: torch.empty_like(v[0]), (total,)))
                pending.append(h)
        with graph.inserting_before(wait):
            waits = []
            for h in pending:
                waits.append(graph.call_function(wait_op, (h,)))
                made.append((waits[-1], lambda v: torch.empty_like(v[0]), (h,)))
            cat = graph.call_function(aten.cat.default, (waits, 0))
            made.append((cat, lambda v: torch.cat(v, 0), tuple(waits)))
            out = graph.call_function(aten.reshape.default, (cat, out_shape))
            made.append((out, lambda v: v[0].reshape(out_shape), (cat,)))
        try:
            with fake:
                for node, fn, inputs in made:
                    node.meta["val"] = fn([_val(i) for i in inputs])
                    node.meta.setdefault("stack_trace", terms[0][0].meta.get("stack_trace"))
        except Exception as e:  # nothing rewired yet: the new nodes go, the site stays as traced
            _roll_back(graph, [n for n, _fn, _inputs in made], ar, e)
            continue
        wait.replace_all_uses_with(out)
        x = ar.args[0]
        graph.erase_node(wait)
        graph.erase_node(ar)
        _erase_tree(graph, x)
        split += 1
    return split


def _roll_back(graph: fx.Graph, new_nodes, site: fx.Node, error: Exception) -> None:
    """Erase a site's new nodes (read only by each other: nothing was rewired to them yet), last first."""
    for n in reversed(new_nodes):
        graph.erase_node(n)
    log.warning("fxfuse tp_all_reduce_blocks: %s left as traced (%s: %s)", site.name, type(error).__name__, error)


def _erase_tree(graph: fx.Graph, n: fx.Node) -> None:
    """Erase ``n`` and, depth first, the sums / views / matmuls it was made of that nothing else reads."""
    if not isinstance(n, fx.Node) or n.users or n.op != "call_function":
        return
    ins = [a for a in n.args if isinstance(a, fx.Node)]
    graph.erase_node(n)
    for a in ins:
        if a.op == "call_function" and (a.target in _ROW_VIEWS or a.target in (aten.add.Tensor, aten.mm.default)):
            _erase_tree(graph, a)


def rewrite_tp_all_reduces(graph: fx.Graph, blocks: int) -> None:
    """The post-grad step the ``tp_all_reduce_blocks`` option asks for: 0, nothing; 1, summed all-reduces merged;
    N >= 2, merged, then each all-reduced matmul (or sum of matmuls) split into N blocks of rows."""
    if blocks < 1:
        return
    merged = merge_summed_all_reduces(graph)
    split = split_all_reduced_matmuls(graph, blocks) if blocks >= 2 else 0
    # Dynamo's counters, as Inductor counts its own pattern rewrites: tests and benchmarks read what was done
    from torch._dynamo.utils import counters

    counters["fxfuse"]["tp_all_reduces_merged"] += merged
    counters["fxfuse"]["tp_all_reduces_split"] += split
    if merged or split:
        # a post-grad graph has no fusion report: say what was done where the user can see it (logging)
        log.info("fxfuse tp_all_reduce_blocks=%d: %d all-reduces merged into sums, %d all-reduced matmuls split into "
                 "blocks", blocks, merged, split)


def _runs_collectives(op) -> bool:
    """Whether ``op`` (an op overload, or anything else) is one of fxfuse's ops that issue collectives inside: the
    vocabulary-parallel lm-head ops."""
    return getattr(getattr(op, "_schema", None), "name", "").startswith("fxfuse::vocab_parallel_")


def _hides_collectives(snode) -> bool:
    """Whether an Inductor scheduler node runs one of fxfuse's ops that issue collectives inside."""
    nodes = snode.get_nodes() if hasattr(snode, "get_nodes") else [snode]
    return any(_runs_collectives(getattr(getattr(s, "node", None), "op_overload", None)) for s in nodes)


def reorder_compute_for_overlap_safely(snodes):
    """Inductor's ``reorder_compute_for_overlap`` scheduler pass, except on a graph that holds one of fxfuse's ops
    that run collectives inside (:func:`runs_collectives_inside`: the pass would see it as computation and could
    move it across the graph's collectives differently on two ranks). Such a graph keeps its order."""
    import torch._inductor.comms as comms

    if any(_hides_collectives(s) for s in snodes):
        return snodes
    return comms.reorder_compute_for_overlap(snodes)


# Inductor's scheduler settings for compute / collective overlap (module docstring: Scheduling). A module-level
# function pickles by name, so Inductor's FX-graph cache keys on it and hits across processes.
_OVERLAP_PATCHES = {"reorder_for_compute_comm_overlap": True,
                    "reorder_for_compute_comm_overlap_passes": (reorder_compute_for_overlap_safely,)}


def may_hold_collectives(gm: fx.GraphModule, example_inputs) -> bool:
    """Whether a Dynamo graph can hold collectives once AOTAutograd has traced it: it computes on DTensors (tensor
    or sequence parallelism, whose redistributions become functional collectives) or calls functional collectives
    itself. FSDP2's own collectives run in its hooks, outside the compiled graphs."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    if any(isinstance(v, DTensor) for v in example_inputs):
        return True
    for n in gm.graph.nodes:
        if isinstance(n.meta.get("example_value", n.meta.get("val")), DTensor):
            return True
        if n.op == "call_function" and (getattr(n.target, "namespace", None) in ("_c10d_functional", "c10d_functional")
                                        or getattr(n.target, "__module__", "").startswith("torch.distributed")):
            return True
    return False


def runs_collectives_inside(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls one of fxfuse's ops that run collectives inside (the vocabulary-parallel lm-head ops).
    Inductor's scheduler sees such an op as computation and may move it across the graph's own collectives, by
    runtime estimates that can differ between ranks whose shards differ (sequence parallelism at an odd length):
    one rank would then issue the two collectives in the other order and the step would hang. Such graphs keep
    Inductor's default order."""
    from .graph_utils import graph_modules

    return any(n.op == "call_function" and _runs_collectives(n.target)
               for _, m in graph_modules(gm) for n in m.graph.nodes)


def overlap_config_patches(user_patches) -> dict:
    """Inductor config patches for ``comm_overlap``: Inductor's ``reorder_compute_for_overlap`` pass
    (:func:`reorder_compute_for_overlap_safely`), unless the user set either of its settings (in ``user_patches``
    or in ``torch._inductor.config``) or this torch has no such pass."""
    import torch._inductor.comms as comms
    import torch._inductor.config as ic

    if not hasattr(comms, "reorder_compute_for_overlap") or not hasattr(ic, "reorder_for_compute_comm_overlap"):
        return {}
    if any(k in user_patches for k in _OVERLAP_PATCHES) or ic.reorder_for_compute_comm_overlap \
            or ic.reorder_for_compute_comm_overlap_passes:
        return {}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in _OVERLAP_PATCHES.items()}
