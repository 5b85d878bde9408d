"""Fuse PEFT LoRA linears into ``fxfuse::lora_linear``.

Pattern (peft ``lora.Linear.forward``, vanilla LoRA; one ``+ delta`` per active adapter)::

    result = linear(x, W[, b])
    result = result + linear(linear(dropout(x, p, training), A_1), B_1) * s_1     # dropout may be absent
    result = result + linear(linear(dropout(x, p, training), A_2), B_2) * s_2     # more adapters: a chain
    ...

becomes ``result = fxfuse::lora_linear(x, W, b, [A_1, ...], [B_1, ...], [s_1, ...], [p_1, ...])``: one op whose
forward adds the low-rank product inside the base GEMM's epilogue and whose backward regenerates the dropout
masks from a seed, so neither ``dropout(x)`` nor its mask is saved per projection (PEFT saves both).

Matched spellings (through the normalisation layer): ``F.linear`` / ``torch._C._nn.linear``, ``delta * s`` /
``s * delta``, ``result + delta`` / ``delta + result``, ``F.dropout`` with constant p / training (p is 0 when not
training), ``* s`` with s a Python number (PEFT bakes ``lora_alpha / r`` or rslora's ``/ sqrt(r)`` in as a float).

Adapters in a wider dtype than the base layer (PEFT's default: fp32 adapters on a bf16 model; it casts x up, runs
the adapter matmuls in fp32 and casts the sum back) are computed in the base dtype with fp32 accumulation, like
autocast would: the adapter weights are cast down for the matmuls (a tiny [r, d] copy) and their gradients come
back in fp32. The LoRA term then differs from PEFT's by bf16 rounding of its operands (y is bf16 either way). Pass
option ``mixed_dtype="skip"`` leaves such layers to Inductor instead.

Not fused (reason in the fusion report): a bias on lora_B (``lora_bias=True``), a scaling that
is a graph value, dropout with a non-constant p or training flag, intermediate results with other users, x that
differs between the base layer and the adapter. DoRA and mixed-adapter batches take other code paths in PEFT
(no such chain appears), so they are never matched and run as traced.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

import fxfuse.ops.lora_linear  # noqa: F401  (registers torch.ops.fxfuse.lora_linear)
from fxfuse.graph_utils import arg, copy_node_meta, const_number, node_val, numel_hint, op_kind
from fxfuse.registry import register_pass

NAME = "lora_linear"


@dataclass
class _Delta:
    """One adapter's ``linear(linear(dropout(x), A), B) * s``."""

    x: fx.Node                        # the base layer's input (before PEFT's cast to the adapter dtype)
    A: fx.Node
    B: fx.Node
    scaling: float
    dropout_p: float
    nodes: List[fx.Node] = field(default_factory=list)  # mul, up, down[, dropout]: erased after the rewrite
    cast: Optional[fx.Node] = None    # x.to(adapter dtype), erased once nothing else reads it


@dataclass
class _Site:
    base: fx.Node                     # linear(x, W, b)
    adds: List[fx.Node]               # the chain of ``result + delta`` nodes, in order
    deltas: List[_Delta]


def _single_user(n: fx.Node) -> bool:
    return len(n.users) == 1


def _same_dtype(*nodes) -> bool:
    dts = {getattr(node_val(n), "dtype", None) for n in nodes}
    return len(dts) == 1 and None not in dts


def _parse_delta(n) -> Tuple[Optional[_Delta], Optional[str]]:
    """``n`` as one adapter's scaled low-rank product, or (None, reason); reason None = not LoRA-shaped at all."""
    if not isinstance(n, fx.Node) or op_kind(n) != "mul":
        return None, None
    a, b = arg(n, "input"), arg(n, "other")
    up, s = (a, b) if isinstance(a, fx.Node) else (b, a)
    if not isinstance(up, fx.Node) or op_kind(up) != "linear":
        return None, None
    down = arg(up, "input")
    if not isinstance(down, fx.Node) or op_kind(down) != "linear":
        return None, None
    # From here on the chain is LoRA-shaped: a refusal is worth a reason in the report.
    if const_number(s) is None:
        return None, "the LoRA scaling is not a Python number"
    if arg(up, "bias") is not None or arg(down, "bias") is not None:
        return None, "a bias on lora_A / lora_B (lora_bias=True) is not fused"
    if not (_single_user(up) and _single_user(down)):
        return None, "a LoRA intermediate (lora_A or lora_B output) has other users"
    xd = arg(down, "input")
    nodes = [n, up, down]
    p = 0.0
    x = xd
    if isinstance(xd, fx.Node) and op_kind(xd) == "dropout":
        pa, training, inplace = arg(xd, "p", 0.5), arg(xd, "training", True), arg(xd, "inplace", False)
        if const_number(pa) is None or not isinstance(training, bool) or inplace is not False:
            return None, "LoRA dropout with a non-constant p / training flag or inplace=True"
        if not _single_user(xd):
            return None, "the LoRA dropout output has other users"
        p = float(pa) if training else 0.0
        x = arg(xd, "input")
        nodes.append(xd)
    A, B = arg(down, "weight"), arg(up, "weight")
    if not _same_dtype(A, B):
        return None, "lora_A and lora_B dtypes differ"
    cast = None
    if isinstance(x, fx.Node) and op_kind(x) == "cast":  # PEFT's x.to(adapter dtype) (fp32 adapters, bf16 base)
        if not _same_dtype(x, A):
            return None, "x is cast to a dtype other than the adapter's"
        cast, x = x, arg(x, "input")
    elif not _same_dtype(x, A):
        return None, "x and the adapter weights have different dtypes and no cast between them"
    if not (0.0 <= p < 1.0):
        return None, f"LoRA dropout p={p} outside [0, 1)"
    return _Delta(x=x, A=A, B=B, scaling=float(s), dropout_p=p, nodes=nodes, cast=cast), None


def _match_chain(base: fx.Node, mixed_dtype: str) -> Tuple[Optional[_Site], Optional[str]]:
    """Follow ``base`` through its chain of ``+ delta`` adds (one per active adapter)."""
    x = arg(base, "input")
    adds, deltas = [], []
    cur, why = base, None
    while _single_user(cur):
        add = next(iter(cur.users))
        if op_kind(add) != "add" or arg(add, "alpha", 1) != 1:
            break
        a, b = arg(add, "input"), arg(add, "other")
        other = b if a is cur else a
        if other is cur:
            break
        delta, why = _parse_delta(other)
        if delta is None:
            break
        if delta.x is not x and not (op_kind(delta.x) == "cast" and arg(delta.x, "input") is x):
            # (a second adapter reads PEFT's already-cast x: a cast of the base input is the same input)
            why = "the adapter reads a different input than the base layer"
            break
        if delta.cast is not None and op_kind(delta.x) == "cast":
            delta.x = x
        if not _same_dtype(x, delta.A) and mixed_dtype != "base":
            why = "adapter dtype differs from the base layer's (pass option mixed_dtype='skip')"
            break
        adds.append(add)
        deltas.append(delta)
        cur = add
    if not deltas:
        return None, why
    if not _same_dtype(x, arg(base, "weight")):
        return None, "the base layer's input and weight dtypes differ"
    # ``why`` is set when a later adapter of the chain was refused: the ones before it are still fused.
    return _Site(base=base, adds=adds, deltas=deltas), why


def _rewrite(g: fx.Graph, site: _Site) -> fx.Node:
    last = site.adds[-1]
    d = site.deltas
    with g.inserting_before(last):
        node = g.call_function(
            torch.ops.fxfuse.lora_linear.default,
            (arg(site.base, "input"), arg(site.base, "weight"), arg(site.base, "bias"),
             [x.A for x in d], [x.B for x in d], [x.scaling for x in d], [x.dropout_p for x in d]))
    copy_node_meta(node, site.base)
    # With adapters in a wider dtype than the base (PEFT's fp32 adapters on a bf16 model) the adds promote to the
    # adapter dtype and PEFT casts the sum back with ``result.to(base dtype)``: the op's output (base dtype) takes
    # the place of that cast; any other consumer gets an explicit cast to the add's dtype.
    out_dt, base_dt = getattr(node_val(last), "dtype", None), getattr(node_val(site.base), "dtype", None)
    replaced = last
    if out_dt != base_dt:
        users = list(last.users)
        if len(users) == 1 and op_kind(users[0]) == "cast" and getattr(node_val(users[0]), "dtype", None) == base_dt:
            replaced = users[0]
        else:
            with g.inserting_after(node):
                cast = g.call_method("to", (node, out_dt))
            copy_node_meta(cast, site.base)
            last.replace_all_uses_with(cast)
            replaced = None
    if replaced is not None:
        replaced.replace_all_uses_with(node)
        if replaced is not last:
            g.erase_node(replaced)
    for add in reversed(site.adds):
        g.erase_node(add)
    g.erase_node(site.base)
    for delta in d:
        for n in delta.nodes:
            g.erase_node(n)
    for delta in d:
        if delta.cast is not None and delta.cast in g.nodes and not delta.cast.users:
            g.erase_node(delta.cast)
    return node


@register_pass(name=NAME,
               description="PEFT LoRA: linear(x, W) + linear(linear(dropout(x), A), B) * s (per adapter) -> "
                           "fxfuse::lora_linear (no stored dropout(x))",
               options={"mixed_dtype": {"choices": ("base", "skip"), "default": "base",
                                        "doc": "adapters wider than the base layer: 'base' computes them in the "
                                               "base dtype, 'skip' leaves such layers to Inductor"}})
def lora_linear_pass(gm: fx.GraphModule, ctx) -> int:
    count = 0
    for mod in ctx.graph_modules(gm):
        g = mod.graph
        bases = [n for n in g.nodes if n.op in ("call_function", "call_method") and op_kind(n) == "linear"]
        changed = 0
        mixed = ctx.choice_option("mixed_dtype", "base", ("base", "skip"))
        for base in bases:
            if base not in g.nodes:  # erased as part of an earlier site
                continue
            site, why = _match_chain(base, mixed)
            if why:
                ctx.skipped(base, "LoRA linear", why + (" (the adapters before it in the chain are fused)"
                                                        if site is not None else ""))
            if site is None:
                continue
            xv = node_val(arg(base, "input"))
            n_tok = numel_hint(xv) // max(1, int(xv.shape[-1])) if isinstance(xv, torch.Tensor) else 0
            # PEFT saves dropout(x) (x's size) and the mask (1 byte per element) per adapter with dropout; the
            # fused op saves x (shared with the sibling projections) and V [N, R] (also saved by PEFT).
            saved = 0
            if isinstance(xv, torch.Tensor):
                saved = sum(numel_hint(xv) * (xv.element_size() + 1) for d in site.deltas if d.dropout_p > 0)
            ranks = [int(node_val(d.A).shape[0]) if isinstance(node_val(d.A), torch.Tensor) else -1
                     for d in site.deltas]
            adapter_dt = str(getattr(node_val(site.deltas[0].A), "dtype", "")).replace("torch.", "")
            base_dt = str(getattr(xv, "dtype", "")).replace("torch.", "")
            base_name = site.base.name
            node = _rewrite(g, site)
            ps = [d.dropout_p for d in site.deltas]
            ctx.fused(node, f"LoRA linear ({len(site.deltas)} adapter{'s' if len(site.deltas) > 1 else ''}, "
                      f"r {'/'.join(map(str, ranks))}, dropout {'/'.join(format(p, 'g') for p in ps)}"
                      + (f", {adapter_dt} adapters computed in {base_dt}" if adapter_dt != base_dt else "") + ")",
                      saved_bytes=saved, ranks=ranks, adapter_dtype=adapter_dt, compute_dtype=base_dt, scalings=[d.scaling for d in site.deltas], dropout_p=ps,
                      tokens=n_tok, base=base_name)
            changed += 1
        if changed:
            g.lint()
            mod.recompile()
        count += changed
    return count
