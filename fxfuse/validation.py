"""FakeTensor validation of rewritten graphs, and rollback.

Before any pass runs, the Dynamo graph is fake-propagated under the compile's own fake mode (symbolic sizes are
kept) and the signature of every graph output is recorded. After each pass the graph is re-propagated and the
outputs compared: shape (symbolically), dtype, device and stride. A pass whose rewrite changes any of them, or
that raises, or whose rewritten graph fails to propagate (for instance because a fused op's fake impl rejected
its inputs), is rolled back to the exact graph it started from.
"""
from __future__ import annotations

import contextlib

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .graph_utils import graph_modules, known_true, node_val

__all__ = ["GraphSnapshot", "OutputSig", "fake_propagate", "output_signature", "compare_signatures"]


class GraphSnapshot:
    """The graphs (and attributes) of ``gm`` and every nested GraphModule, to restore after a failed pass."""

    def __init__(self, gm: fx.GraphModule):
        self.entries = []
        for _, mod in graph_modules(gm):
            g = fx.Graph(owning_module=mod, tracer_cls=mod.graph._tracer_cls)
            val_map: Dict[fx.Node, fx.Node] = {}
            out = g.graph_copy(mod.graph, val_map)
            g.output(out)
            for old, new in val_map.items():
                # Dynamo hangs attributes on nodes themselves (placeholders' _dynamo_source, which AOTAutograd
                # reads); node_copy only copies meta.
                for k, v in old.__dict__.items():
                    if k not in new.__dict__:
                        setattr(new, k, v)
            g._codegen = copy.deepcopy(mod.graph._codegen)
            self.entries.append((mod, g, dict(mod._modules), dict(mod._parameters), dict(mod._buffers),
                                 set(mod.__dict__)))

    def restore(self) -> None:
        for mod, g, modules, params, buffers, attrs in self.entries:
            for k in set(mod.__dict__) - attrs:
                delattr(mod, k)  # constants a pass registered
            mod._modules.clear(); mod._modules.update(modules)
            mod._parameters.clear(); mod._parameters.update(params)
            mod._buffers.clear(); mod._buffers.update(buffers)
            mod.graph = g
            mod.recompile()


@dataclass(frozen=True)
class OutputSig:
    index: int
    kind: str  # "tensor", "sym", "other"
    shape: Tuple[Any, ...] = ()
    stride: Tuple[Any, ...] = ()
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    node: Optional[fx.Node] = None

    def describe(self) -> str:
        if self.kind != "tensor":
            return self.kind
        return (f"[{', '.join(map(str, self.shape))}] {str(self.dtype).replace('torch.', '')} on {self.device}, "
                f"stride ({', '.join(map(str, self.stride))})")


_AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def preserved_autocast_state():
    """Run a graph's nodes (fake propagation) without leaving autocast changed behind.

    Dynamo graphs of code under ``torch.autocast`` hold ``_enter_autocast`` / ``_exit_autocast`` calls, and
    propagating the graph executes them for real. When propagation stops in between (a rewrite that fails
    validation inside an autocast region), the exit never runs: autocast stays on and its nesting counter stays
    raised, and with the counter above 0 autocast never clears its cache of down-cast weights, so later *eager*
    autocast steps silently reuse stale weight copies after the optimizer updated them. Seen with TRL ORPO
    (bf16 autocast on CPU): the next trainer's losses changed from its second step on.
    """
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    saved = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES}
    cache = torch.is_autocast_cache_enabled()
    try:
        yield
    finally:
        now = torch.autocast_increment_nesting() - 1
        torch.autocast_decrement_nesting()
        while now > nesting:
            now = torch.autocast_decrement_nesting()
        while now < nesting:
            now = torch.autocast_increment_nesting()
        for d, (on, dt) in saved.items():
            torch.set_autocast_enabled(d, on)
            torch.set_autocast_dtype(d, dt)
        torch.set_autocast_cache_enabled(cache)
        if nesting == 0:
            torch.clear_autocast_cache()


def fake_propagate(gm: fx.GraphModule, example_inputs: Sequence[Any], fake_mode) -> None:
    """Fill ``meta['val']`` on every node of ``gm`` and of the subgraphs it calls, under ``fake_mode``."""
    with preserved_autocast_state():
        FakeTensorProp(gm, mode=fake_mode).propagate(*example_inputs)
        _propagate_subgraphs(gm, fake_mode)


def _propagate_subgraphs(gm: fx.GraphModule, fake_mode) -> None:
    # A higher-order op call looks like hop(get_attr[body], *operands) (tag_activation_checkpoint, wrap, ...).
    # Give the body's placeholders the operands' fake values and propagate it too, so passes inside see the same
    # symbolic sizes as the outer graph. Bodies we can't line up keep Dynamo's example_value.
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.args:
            continue
        body_ref = node.args[0]
        if not (isinstance(body_ref, fx.Node) and body_ref.op == "get_attr"):
            continue
        body = getattr(gm, body_ref.target, None)
        if not isinstance(body, fx.GraphModule):
            continue
        operands = [node_val(a) if isinstance(a, fx.Node) else a for a in node.args[1:]]
        n_ph = sum(1 for n in body.graph.nodes if n.op == "placeholder")
        if n_ph != len(operands):
            continue
        try:
            with fake_mode:
                FakeTensorProp(body, mode=fake_mode).propagate_dont_convert_inputs(*operands)
        except Exception:
            continue
        _propagate_subgraphs(body, fake_mode)


def output_signature(gm: fx.GraphModule) -> List[OutputSig]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat, _ = torch.utils._pytree.tree_flatten(out.args[0])
    sigs = []
    for i, a in enumerate(flat):
        v = node_val(a)
        if isinstance(v, torch.Tensor):
            sigs.append(OutputSig(i, "tensor", tuple(v.shape), tuple(v.stride()), v.dtype, v.device,
                                  a if isinstance(a, fx.Node) else None))
        elif isinstance(v, torch.SymInt) or isinstance(v, int):
            sigs.append(OutputSig(i, "sym", node=a if isinstance(a, fx.Node) else None))
        else:
            sigs.append(OutputSig(i, "other" if v is not None else "none",
                                  node=a if isinstance(a, fx.Node) else None))
    return sigs


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return known_true(a == b) or str(a) == str(b)


def compare_signatures(before: List[OutputSig], after: List[OutputSig]) -> Optional[Tuple[int, str]]:
    """None when ``after`` computes outputs of the same kind, shape, dtype, device and stride as ``before``;
    otherwise (output index, what differs)."""
    if len(before) != len(after):
        return -1, f"the graph returns {len(after)} values instead of {len(before)}"
    for b, a in zip(before, after):
        if b.kind != a.kind:
            return b.index, f"output {b.index} became a {a.kind} instead of a {b.kind}"
        if b.kind != "tensor":
            continue
        if len(b.shape) != len(a.shape) or not all(_same(x, y) for x, y in zip(b.shape, a.shape)):
            return b.index, "shape changed"
        if b.dtype != a.dtype:
            return b.index, "dtype changed"
        if b.device != a.device:
            return b.index, "device changed"
        # Strides matter where Inductor asserts them and for callers that view the output; only dims of size
        # > 1 carry information.
        for sz, x, y in zip(b.shape, b.stride, a.stride):
            if not _same(sz, 1) and not _same(x, y):
                return b.index, "stride changed"
    return None
