"""Give ``scaled_dot_product_attention`` ``is_causal=True`` instead of a mask tensor that is provably causal.

Under torch.compile, Hugging Face models build the attention mask in the graph (``masking_utils``: causal
``kv_pos <= q_pos`` from the position ids, a packed-sequence check from their differences, the padding mask
when there is one) and hand SDPA a materialised ``[B, 1, S, S]`` bool tensor, even when nothing was passed but
``input_ids``, because the trace cannot skip the mask the way eager does. With a mask tensor, SDPA's fast kernels
take their arbitrary-mask path: on an H200 (cuDNN, Llama-3.2-1B's 4 x 2048 x 32 heads x 64) forward + backward of
one layer ran 2.0 ms in the whole-model profile against 0.8 ms with ``is_causal=True`` (benchmarks/lora_notes.md).

This pass proves the mask is the causal mask and drops it. The proof is by evaluation, so it holds for any
spelling of the mask: the mask's producer subgraph must read **no graph input** (no padding mask, no
user-supplied position ids, no symbolic size) and consist only of deterministic index arithmetic (arange,
comparisons, cumsum, diff, indexing, broadcasting; the list is ``_PURE_FUNCTIONS`` / ``_PURE_METHODS``); then it is
a constant of this compiled graph, is computed once here (on the CPU), and must equal
``ones(Sq, Skv).tril()`` broadcast over batch and heads (bool True = attend, or additive 0 / <= -65504: the
attention family's masked-value threshold ``fxfuse.attention.conventions.MASKED_BELOW``, which HF's finfo.min fill
meets in every float dtype). Any other mask, a dynamic sequence length, or a mask that is larger than
``max_mask_elements`` (pass option, default 2**28) stays as it is, with the reason in the fusion report. When
Sq != Skv (a KV cache) SDPA's ``is_causal`` aligns top-left while HF aligns bottom-right: only Sq == Skv is
rewritten.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from fxfuse.attention.conventions import MASKED_BELOW
from fxfuse.attention.sdpa_call import SDPA_TARGETS, causal_sdpa, sdpa_arg
from fxfuse.graph_utils import erase_unused, node_val
from fxfuse.registry import register_pass

NAME = "sdpa_causal_mask"

# Deterministic, input-free index arithmetic: what HF's mask builders use (and their obvious relatives).
_PURE_FUNCTIONS = {
    torch.arange, torch.ones, torch.zeros, torch.full, torch.ones_like, torch.zeros_like, torch.full_like,
    torch.tril, torch.triu, torch.diff, torch.cumsum, torch.where, torch.logical_and, torch.logical_or,
    torch.logical_not, torch.logical_xor, torch.bitwise_and, torch.bitwise_or, torch.bitwise_not, torch.eq,
    torch.ne, torch.le, torch.lt, torch.ge, torch.gt, torch.unsqueeze, torch.reshape, torch.broadcast_to,
    torch.masked_fill, torch.clamp, torch.minimum, torch.maximum, torch.abs,
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg, operator.getitem,
    operator.and_, operator.or_, operator.xor, operator.invert, operator.le, operator.lt, operator.ge,
    operator.gt, operator.eq, operator.ne,
}
_PURE_METHODS = {
    "new_ones", "new_zeros", "new_full", "to", "unsqueeze", "squeeze", "expand", "expand_as", "view", "reshape",
    "contiguous", "cumsum", "diff", "le", "lt", "ge", "gt", "eq", "ne", "logical_and", "logical_or",
    "logical_not", "bitwise_and", "bitwise_or", "bitwise_not", "bool", "int", "long", "float", "masked_fill",
    "tril", "triu", "transpose", "permute", "__and__", "__or__", "__invert__", "add", "sub", "mul", "clamp",
}


def _static_len(v: Any, dim: int) -> Optional[int]:
    if not isinstance(v, torch.Tensor):
        return None
    s = v.shape[dim]
    return s if isinstance(s, int) else None


def _producers(mask: fx.Node) -> Tuple[Optional[List[fx.Node]], Optional[str]]:
    """The mask's producer subgraph in graph order, or (None, why it is not a compile-time constant)."""
    seen, order = set(), []
    stack = [(mask, False)]
    while stack:
        n, done = stack.pop()
        if done:
            order.append(n)
            continue
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return None, f"the mask reads the graph input {n.name!r} (a padding mask, position ids or a size)"
        if n.op == "get_attr":
            return None, f"the mask reads the module attribute {n.target!r}"
        pure = (n.op == "call_function" and n.target in _PURE_FUNCTIONS) or \
               (n.op == "call_method" and n.target in _PURE_METHODS)
        if not pure:
            return None, f"the mask is computed with {n.target!r}, which this pass does not evaluate"
        stack.append((n, True))
        for a in n.all_input_nodes:
            stack.append((a, False))
    return order, None


def _evaluate(order: List[fx.Node], out: fx.Node) -> torch.Tensor:
    """Run the producer subgraph on the CPU (devices rewritten; it is index arithmetic) and return the mask."""
    cpu = torch.device("cpu")

    def to_cpu(a):
        if isinstance(a, torch.device):
            return cpu
        if isinstance(a, str) and a.startswith("cuda"):
            return "cpu"
        return a

    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for n in order:
        new = g.node_copy(n, lambda a: env[a])
        new.args = fx.node.map_aggregate(new.args, to_cpu)
        new.kwargs = fx.node.map_aggregate(new.kwargs, to_cpu)
        env[n] = new
    g.output(env[out])
    gm = fx.GraphModule(torch.nn.Module(), g)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        return gm()


def _is_causal(m: torch.Tensor, sq: int, skv: int) -> Tuple[bool, str]:
    if m.dim() < 2 or m.shape[-2:] != (sq, skv):
        return False, f"the mask's last two dims {tuple(m.shape[-2:])} are not (Sq, Skv) = ({sq}, {skv})"
    causal = torch.ones(sq, skv, dtype=torch.bool).tril()
    if m.dtype == torch.bool:
        keep = m
    elif m.is_floating_point():
        if not bool(((m == 0) | (m <= MASKED_BELOW)).all()):
            return False, f"the additive mask has values other than 0 and a hard mask (-inf or <= {MASKED_BELOW:g})"
        keep = m == 0
    else:
        return False, f"mask dtype {m.dtype} is neither bool nor floating"
    if not bool((keep == causal).all()):
        return False, "the mask is not the plain causal mask (padding, packing, a window or a prefix)"
    return True, ""


@register_pass(name=NAME,
               description="scaled_dot_product_attention with a constant causal mask tensor -> is_causal=True",
               options={"max_mask_elements": {"type": int, "minimum": 1, "default": 2 ** 28,
                                              "doc": "largest mask (elements) the pass evaluates to prove it "
                                                     "causal"}})
def sdpa_causal_mask_pass(gm: fx.GraphModule, ctx) -> int:
    count = 0
    limit = ctx.int_option("max_mask_elements", 2 ** 28, 1, "largest mask this pass evaluates")
    for mod in ctx.graph_modules(gm):
        g = mod.graph
        verdicts: Dict[fx.Node, Tuple[bool, str, List[fx.Node]]] = {}  # one evaluation per mask (shared by layers)
        changed = 0
        for n in list(g.nodes):
            if n.op != "call_function" or n.target not in SDPA_TARGETS:
                continue
            mask = sdpa_arg(n, "attn_mask")
            if not isinstance(mask, fx.Node) or sdpa_arg(n, "is_causal", False) is not False:
                continue
            q, k = node_val(sdpa_arg(n, "query")), node_val(sdpa_arg(n, "key"))
            sq, skv = _static_len(q, -2), _static_len(k, -2)
            if sq is None or skv is None:
                ctx.skipped(n, "SDPA causal mask", "the sequence length is symbolic (dynamic shapes): the mask "
                                                   "cannot be evaluated for every length")
                continue
            if sq != skv:
                ctx.skipped(n, "SDPA causal mask", f"Sq {sq} != Skv {skv}: SDPA's is_causal aligns top-left")
                continue
            if mask not in verdicts:
                mv = node_val(mask)
                order, why = _producers(mask)
                if order is not None and isinstance(mv, torch.Tensor) and mv.numel() > limit:
                    order, why = None, f"the mask has {mv.numel()} elements (> max_mask_elements={limit})"
                ok = False
                if order is not None:
                    try:
                        ok, why = _is_causal(_evaluate(order, mask), sq, skv)
                    except Exception as e:  # an op this pass cannot run on the CPU: leave the mask alone
                        ok, why = False, f"evaluating the mask failed: {type(e).__name__}: {e}"[:300]
                verdicts[mask] = (ok, why, order or [])
            ok, why, order = verdicts[mask]
            if not ok:
                ctx.skipped(n, "SDPA causal mask", why)
                continue
            new = causal_sdpa(g, n)
            n.replace_all_uses_with(new)
            g.erase_node(n)
            sv = node_val(mask)
            ctx.fused(new, "SDPA with a constant causal mask -> is_causal=True",
                      saved_bytes=(sv.numel() * sv.element_size()) if isinstance(sv, torch.Tensor) else None,
                      seq_len=sq)
            changed += 1
        if changed:
            for mask, (ok, _w, order) in verdicts.items():
                if ok and mask in g.nodes and not mask.users:
                    erase_unused(g, order)
            g.lint()
            mod.recompile()
        count += changed
    return count
