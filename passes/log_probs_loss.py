"""Give a fused log-probs site its loss: the lm-head gradient formed in the forward
(``fxfuse::linear_log_probs_loss``).

Runs after ``linear_cross_entropy`` and ``linear_log_probs``, on their ops: log-probs (and entropy), and a
cross-entropy with ``reduction="none"`` (a custom loop's masked or weighted token mean: its per-token loss is the
target's -logp, 0 on ignored rows, so the same op serves it with the cross-entropy's logit transform). Log-probs of a
vocabulary-split lm-head (tensor parallelism, ``fxfuse::vocab_parallel_log_probs``) become
``fxfuse::vocab_parallel_log_probs_loss`` the same way, each chunk's statistics combined across the ranks before
the loss runs on them.

Where the graph also computes the loss from the op's log-probs (and entropy), as an RL step compiled with its
loss does (GRPO / DAPO: ``-min(ratio * A, clip(ratio) * A)``, masked, summed and
divided by the token count; a policy-gradient term minus an entropy bonus), the per-token upstream gradients are
known in the forward, chunk by chunk, if every token's gradient depends on that token's values only. Then the op
can form the lm-head gradient right after each chunk's log-probs: the logits are projected once (3 matmuls with a
trainable head, 2 with a frozen one) instead of once more in the backward.

What the pass proves, on the nodes downstream of the op's log-probs / entropy outputs (the *tail*):

* each is **token-wise** (same shape as the log-probs it reads, element for element: pointwise arithmetic,
  comparisons, ``where``, ``detach``, casts, and reshapes that keep the element order, with anything else it reads
  computed without the log-probs: advantages, masks, old log-probs, clip bounds), or
* **linear** in token-wise values (sums and means over any dims, negation, adding such values, multiplying or
  dividing them by values computed without the log-probs);
* exactly one graph output depends on them with a gradient: a 0-dim loss. Other outputs read them only detached.

Then d loss / d logp_t and d loss / d H_t depend on token t's values alone, and running the tail on the log-probs
written so far (zeros past the chunk) gives the chunk's exactly. Anything else (a sequence-level loss through a
nonlinear function of a sum, as DPO's ``logsigmoid`` of summed log-ratios; a quantile over the entropies; the
op's other statistics read; the loss returned per token) is left as it is, with the reason in the report. Values
the tail reads that the graph computes after the op (the token count) are moved before it when they are pure.

The rewrite: the op becomes ``fxfuse::linear_log_probs_loss(..., tail, tail_tensors, tail_ints)`` (its log-probs and
entropy are now values only), the graph keeps computing the loss's value from them, and the loss output becomes
``loss + carrier``: the op's 0-dim zero whose backward hands the forward's gradients, scaled by the loss's upstream
gradient, to the lm-head. Gradients of the other inputs the loss reads flow through the graph's own ops as before.
"""
from __future__ import annotations

import operator
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

import fxfuse.ops.linear_cross_entropy  # noqa: F401  (registers torch.ops.fxfuse.linear_cross_entropy)
import fxfuse.ops.linear_log_probs  # noqa: F401  (registers torch.ops.fxfuse.linear_log_probs)
import fxfuse.ops.log_probs_loss  # noqa: F401  (registers torch.ops.fxfuse.linear_log_probs_loss)
import fxfuse.ops.vocab_parallel_log_probs  # noqa: F401  (registers the vocabulary-parallel log-probs (loss) ops)
from fxfuse.fx_program import ProgramError, dump_graph
from fxfuse.graph_utils import (SHAPE_ONLY_KINDS, arg, copy_node_meta, flat_nodes, known_true, node_val, op_kind,
                                same_shape)
from fxfuse.registry import register_pass

NAME = "log_probs_loss"

# token-wise: the value at token t reads token t's values (and values computed without the log-probs) only
_POINTWISE = frozenset({
    "mul", "div", "add", "sub", "neg", "exp", "tanh", "cast", "detach", "clamp", "minimum", "maximum", "log",
    "log1p", "expm1", "sigmoid", "abs", "sqrt", "pow", "where", "masked_fill", "lt", "le", "gt", "ge", "eq", "ne",
    "and", "or", "logical_not", "invert",
})
_RESHAPES = SHAPE_ONLY_KINDS | {"view_as"}     # keep the row-major element order: token t stays element t
_NO_GRAD = frozenset({"detach", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "logical_not", "invert"})
_REDUCTIONS = frozenset({"sum", "mean"})
_TOKENWISE, _LINEAR = "token-wise", "linear"


def _is_tensor(n) -> bool:
    return isinstance(node_val(n), torch.Tensor)


def _same_shape(a, b) -> bool:
    va, vb = node_val(a), node_val(b)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and same_shape(va.shape, vb.shape)


def _same_numel(a, b) -> bool:
    va, vb = node_val(a), node_val(b)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and known_true(va.numel() == vb.numel())


def _classify(n: fx.Node, cone_ins: List[fx.Node], state: Dict[fx.Node, str]) -> Tuple[Optional[str], str]:
    """(token-wise | linear | None, why) for a tail node whose inputs in the tail are ``cone_ins``."""
    kind = op_kind(n)
    what = kind or str(n.target)
    if not _is_tensor(n):
        return None, f"{n.name} ({what}) does not give a tensor"
    if kind in ("min", "max") and not (isinstance(arg(n, "other"), fx.Node) and _is_tensor(arg(n, "other"))):
        kind = "reduce-" + kind  # torch.min(x) / x.max(dim): a reduction over tokens, not a binary min
    if all(state[i] == _TOKENWISE for i in cone_ins):
        if kind in _RESHAPES and len(cone_ins) == 1 and _same_numel(n, cone_ins[0]):
            return _TOKENWISE, ""
        if (kind in _POINTWISE or kind in ("min", "max")) and all(_same_shape(n, i) for i in cone_ins):
            return _TOKENWISE, ""
    if kind in _REDUCTIONS | _RESHAPES | {"neg", "cast", "expand"} and len(cone_ins) == 1 \
            and arg(n, "input") is cone_ins[0]:
        return _LINEAR, ""
    if kind in ("add", "sub"):
        return _LINEAR, ""  # a sum of tail values (and of values without the log-probs): linear
    if kind == "mul" and len(cone_ins) == 1 and flat_nodes((n.args, n.kwargs)).count(cone_ins[0]) == 1:
        return _LINEAR, ""
    if kind == "div" and len(cone_ins) == 1 and arg(n, "input") is cone_ins[0] \
            and cone_ins[0] not in flat_nodes(arg(n, "other")) and arg(n, "rounding_mode") is None:
        return _LINEAR, ""
    return None, (f"{n.name} ({what}) is neither token-wise in the log-probs nor linear in token-wise values: "
                  "each token's gradient would depend on other tokens")


class _Tail:
    def __init__(self, roots: Dict[int, fx.Node]):
        self.roots = roots                    # op output index -> the node standing for it (the tail starts there)
        self.nodes: List[fx.Node] = []        # the tail, in graph order
        self.loss: Optional[fx.Node] = None
        self.tensors: List[fx.Node] = []      # what else the tail reads
        self.ints: List[fx.Node] = []


def _find_tail(g: fx.Graph, roots: Dict[int, fx.Node]) -> Tuple[Optional[_Tail], str]:
    t = _Tail(roots)
    order = {n: i for i, n in enumerate(g.nodes)}
    out_node = next(n for n in reversed(g.nodes) if n.op == "output")
    cone: Set[fx.Node] = set(t.roots.values())
    stack = list(cone)
    while stack:
        for u in stack.pop().users:
            if u is not out_node and u not in cone:
                cone.add(u)
                stack.append(u)
    nodes = sorted(cone, key=order.__getitem__)
    # which tail values carry a gradient of the log-probs (structurally: an op not known to stop it passes it on)
    grad: Dict[fx.Node, bool] = {}
    for n in nodes:
        grad[n] = n in t.roots.values() or (op_kind(n) not in _NO_GRAD
                                           and any(grad.get(i, False) for i in n.all_input_nodes))
    losses = {n for n in flat_nodes(out_node.args) if n in cone and grad[n]}
    if not losses:
        return None, "no graph output takes a gradient through the log-probs (the loss is computed elsewhere)"
    if len(losses) > 1:
        return None, "more than one graph output takes a gradient through the log-probs"
    t.loss = losses.pop()
    lv = node_val(t.loss)
    if not isinstance(lv, torch.Tensor) or lv.dim() != 0 or not lv.dtype.is_floating_point:
        return None, f"the output with a gradient through the log-probs is not one loss value ({t.loss.name})"
    # Only what the loss reads must be proven (metrics beside it, detached, may be anything).
    needed: Set[fx.Node] = set()
    stack = [t.loss]
    while stack:
        n = stack.pop()
        if n in cone and n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    t.nodes = [n for n in nodes if n in needed]
    state: Dict[fx.Node, str] = {}
    for n in t.nodes:
        if n in t.roots.values():
            state[n] = _TOKENWISE
            continue
        if n.op not in ("call_function", "call_method"):
            return None, f"{n.name} is a {n.op}"
        cone_ins = [i for i in n.all_input_nodes if i in cone]
        s, why = _classify(n, cone_ins, state)
        if s is None:
            return None, why
        state[n] = s
        for i in n.all_input_nodes:
            if i in cone or i in t.tensors or i in t.ints:
                continue
            v = node_val(i)
            if isinstance(v, torch.Tensor):
                t.tensors.append(i)
            elif isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool):
                t.ints.append(i)
            else:
                return None, f"the loss reads {i.name}, neither a tensor nor an integer"
    if state[t.loss] != _LINEAR:
        return None, "the loss is not a sum over tokens"
    return t, ""


def _tail_program(t: _Tail, cross_entropy: bool = False) -> str:
    """The loss as ``f(logp [N], entropy [N] or [0], *tensors, *ints)``, text for the op. For a cross-entropy site
    the first tensor is ``valid`` (target != ignore_index) and the tail starts from the per-token loss
    ``where(valid, -logp, 0)``."""
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    phs = [g.placeholder("logp"), g.placeholder("entropy")]
    if cross_entropy:
        valid = g.placeholder("valid")
        env[t.roots[0]] = g.call_function(torch.where, (valid, g.call_function(operator.neg, (phs[0],)), 0.0))
    else:
        for i, ph in enumerate(phs):
            if i in t.roots:
                env[t.roots[i]] = ph
    for j, n in enumerate(t.tensors):
        env[n] = g.placeholder(f"tensor{j}")
    for j, n in enumerate(t.ints):
        env[n] = g.placeholder(f"int{j}")
    for n in t.nodes:
        if n not in env:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(env[t.loss])
    g.eliminate_dead_code()
    return dump_graph(g)


def _hoist(g: fx.Graph, op: fx.Node, needed: List[fx.Node]) -> str:
    """Move the values the tail reads that the graph computes after ``op`` (and what they need) before it. They do
    not read the op (the tail's inputs never do), so the order stays topological. '' or why not."""
    order = {n: i for i, n in enumerate(g.nodes)}
    pos = order[op]
    late: Set[fx.Node] = set()
    stack = [n for n in needed if order[n] > pos]
    while stack:
        n = stack.pop()
        if n in late:
            continue
        if n.op not in ("call_function", "call_method") or n.is_impure() or _mutates(n):
            return f"{n.name}, read by the loss, is computed after the op and cannot move ({n.op} {n.target})"
        late.add(n)
        stack.extend(i for i in n.all_input_nodes if order[i] > pos)
    for n in sorted(late, key=order.__getitem__):
        op.prepend(n)
    return ""


def _mutates(n: fx.Node) -> bool:
    name = getattr(n.target, "__name__", str(n.target))
    return (name.endswith("_") and not name.endswith("__")) or "rand" in name or "dropout" in name \
        or "bernoulli" in name


def _needs_grad(*vals) -> bool:
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in vals)


def _value_outputs(op: fx.Node, ctx, what: str, why: str) -> Optional[Dict[int, fx.Node]]:
    """The op's log-probs / entropy readers by output index (0, 1), or None (the site skipped with ``why``) where
    anything else reads the op."""
    roots = {}
    for u in op.users:
        if u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in (0, 1):
            ctx.skipped(op, what, f"left to the backward: {why}")
            return None
        roots[u.args[1]] = u
    return roots


def _rewrite_log_probs(gm: fx.GraphModule, op: fx.Node, ctx) -> bool:
    what = "log-probs loss"
    if len(op.args) > 8 and any(op.args[8:]):
        ctx.skipped(op, what, "the op's other statistics are asked for")
        return False
    hv, wv = node_val(op.args[0]), node_val(op.args[1])
    bv = node_val(op.args[3]) if isinstance(op.args[3], fx.Node) else None
    if not _needs_grad(hv, wv, bv):
        return False  # nothing takes a gradient: nothing to form in the forward
    if not _needs_grad(wv, bv) and not op.args[6]:
        # log-probs alone under a frozen head: the op's own forward already forms d logp / d hidden per unit
        # upstream gradient (one projection, as here) without running the loss per chunk
        ctx.skipped(op, what, "not needed: a frozen head's log-probs already project the logits once")
        return False
    roots = _value_outputs(op, ctx, what, "the op's other statistics are read")
    if roots is None:
        return False
    return _rewrite(gm, op, ctx, what, roots, tuple(op.args[:8]), _needs_grad(wv, bv))


def _rewrite_vocab_parallel(gm: fx.GraphModule, op: fx.Node, ctx) -> bool:
    """``fxfuse::vocab_parallel_log_probs`` (a vocabulary-split lm-head under tensor parallelism) whose loss is in
    the graph: ``fxfuse::vocab_parallel_log_probs_loss``, the ranks combining each chunk's statistics before every
    rank runs the loss on them and forms its slice's gradient (3 matmuls with a trainable head, 2 with a frozen one:
    its recompute path would take 4 / 3)."""
    what = "log-probs loss (vocabulary split between ranks)"
    hv, wv = node_val(op.args[0]), node_val(op.args[1])
    if not _needs_grad(hv, wv):
        return False
    roots = _value_outputs(op, ctx, what, "the op's outputs are read as a whole")
    if roots is None:
        return False
    return _rewrite(gm, op, ctx, what, roots, tuple(op.args[:9]), _needs_grad(wv),
                    loss_op=torch.ops.fxfuse.vocab_parallel_log_probs_loss.default)


def _rewrite_cross_entropy(gm: fx.GraphModule, op: fx.Node, ctx) -> bool:
    """``fxfuse::linear_cross_entropy(..., reduction="none")`` whose per-token losses feed a loss in the graph
    (masked or weighted token means): the per-token loss is ``-logp`` of the target (0 where ignored), so the
    site becomes the log-probs loss op with the cross-entropy's logit transform (z = softcap(scale * x) is
    softcap / scale, then / (1 / scale))."""
    what = "cross-entropy (reduction none) loss"
    h, w, target, bias, ignore_index, reduction, softcap, scale, smoothing = op.args[:9]
    if reduction != "none":
        return False  # mean / sum: the op forms the gradients in the forward already
    hv, wv = node_val(h), node_val(w)
    bv = node_val(bias) if isinstance(bias, fx.Node) else None
    if not _needs_grad(hv, wv, bv):
        return False
    lv = node_val(op)
    if smoothing or not scale > 0 or not isinstance(lv, torch.Tensor) or lv.dim() != 1:
        ctx.skipped(op, what, "left to the backward: label smoothing, a non-positive logit scale or a per-token "
                              "loss that is not one row per token")
        return False
    args = (h, w, None, bias, 1.0 / float(scale), float(softcap) / float(scale) if softcap else 0.0, False,
            op.args[10] if len(op.args) > 10 else 0)
    return _rewrite(gm, op, ctx, what, {0: op}, args, _needs_grad(wv, bv), ce=(target, int(ignore_index)))


def _rewrite(gm: fx.GraphModule, op: fx.Node, ctx, what: str, roots: Dict[int, fx.Node], args: tuple,
             trainable: bool, ce=None, loss_op=None) -> bool:
    g = gm.graph
    t, why = _find_tail(g, roots)
    if t is None:
        ctx.skipped(op, what, f"left to the backward (the logits projected twice): {why}")
        return False
    try:
        program = _tail_program(t, cross_entropy=ce is not None)
    except ProgramError as e:
        ctx.skipped(op, what, f"the loss cannot travel to the op: {e}")
        return False
    why = _hoist(g, op, t.tensors + t.ints)
    if why:
        ctx.skipped(op, what, why)
        return False
    out_node = next(n for n in reversed(g.nodes) if n.op == "output")
    tensors = list(t.tensors)
    with g.inserting_before(op):
        if ce is not None:  # the log-probs op's index: the target, 0 where ignored (its loss is zeroed there)
            target, ignore_index = ce
            flat = g.call_method("reshape", (target, -1))
            valid = g.call_function(operator.ne, (flat, ignore_index))
            index = g.call_function(torch.where, (valid, flat, 0))
            args = args[:2] + (index,) + args[3:]
            tensors = [valid] + tensors
        new = g.call_function(loss_op or torch.ops.fxfuse.linear_log_probs_loss.default,
                              args + (program, tensors, list(t.ints)))
        copy_node_meta(new, op)
        if ce is not None:  # the per-token losses' value, as the cross-entropy gave it (no gradient now)
            logp = g.call_function(operator.getitem, (new, 0))
            per_token = g.call_function(torch.where, (valid, g.call_function(operator.neg, (logp,)), 0.0))
            op.replace_all_uses_with(per_token)
    for i, r in t.roots.items():
        if r is not op:
            r.args = (new, i)
    g.erase_node(op)
    with g.inserting_before(out_node):
        carrier = g.call_function(operator.getitem, (new, 2))
        if node_val(t.loss).dtype != torch.float32:
            carrier = g.call_method("to", (carrier, node_val(t.loss).dtype))
        loss = g.call_function(operator.add, (t.loss, carrier))
        copy_node_meta(loss, t.loss)
    out_node.args = fx.node.map_arg(out_node.args, lambda n: loss if n is t.loss else n)
    ctx.fused(new, f"{what}: lm-head gradient formed in the forward ({len(t.nodes)} loss nodes, "
                   f"{'3' if trainable else '2'} matmuls instead of {'4' if trainable else '3'})",
              entropy=1 in t.roots, loss_inputs=[n.name for n in t.tensors + t.ints])
    return True


@register_pass(name=NAME,
               description="fxfuse::linear_log_probs + a per-token loss in the same graph -> the lm-head gradient "
                           "formed in the forward (fxfuse::linear_log_probs_loss)")
def log_probs_loss_pass(gm: fx.GraphModule, ctx) -> int:
    # The root graph only: its output is what the caller differentiates. A loss inside a checkpointed body would
    # be rerun by the recompute (the gradient matmuls twice), so such sites keep the op's own backward.
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.fxfuse.linear_log_probs.default:
            changed += _rewrite_log_probs(gm, node, ctx)
        elif node.target is torch.ops.fxfuse.linear_cross_entropy.default:
            changed += _rewrite_cross_entropy(gm, node, ctx)
        elif node.target is torch.ops.fxfuse.vocab_parallel_log_probs.default:
            changed += _rewrite_vocab_parallel(gm, node, ctx)
    if changed:
        gm.recompile()
    return changed
