"""``options={"verify": True}``: check rewrites numerically on the compile's first real inputs.

FakeTensor validation proves a rewrite keeps every output's shape, dtype, device and stride; it cannot see a rewrite
that keeps shapes but changes values (a deleted ``silu``, a wrong scale). With ``verify`` the backend runs the graph
as Dynamo gave it once, eagerly, on the real example inputs (forward, and the gradients of every input that
requires grad for a fixed random weighting of the outputs), and again after each pass that changed it; a pass whose
outputs or gradients differ from that reference by more than the dtype's tolerance (norm-relative) is rolled back,
with the worst difference in the report.

It costs a few eager forward + backward runs of the graph at the first compile (not at every step), so it is meant
for people writing or debugging passes and for CI, not for production runs. ``FXFUSE_VERIFY=1`` turns it on for
every compile that does not set the option. The graph is not verified (the report says why) when its inputs are not
real tensors or it draws random numbers (dropout in training: the fused ops draw their masks differently).
Non-parameter inputs are cloned for each run, so a graph that updates buffers in place runs on fresh copies.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from .graph_utils import arg, graph_modules, op_kind

__all__ = ["TOLERANCE", "Reference", "why_not_verifiable", "run_graph", "compare"]
# (substitution_fixer, the outputs callers see of a graph with output substitutions, is in fxfuse.substitution)

#: Norm-relative tolerance of outputs and gradients, by the output's dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}

_RANDOM = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
           torch.bernoulli, torch.multinomial, torch.normal, torch.randperm}
_RANDOM_METHODS = {"bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_", "cauchy_",
                   "log_normal_"}


def why_not_verifiable(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Optional[str]:
    """None if the graph can be verified on these inputs, else why not."""
    from torch._subclasses.fake_tensor import FakeTensor

    if any(isinstance(x, FakeTensor) for x in example_inputs):
        return "the example inputs are fake tensors"
    for _, m in graph_modules(gm):
        for n in m.graph.nodes:
            if n.op == "call_function" and n.target in _RANDOM:
                return f"the graph draws random numbers ({n.target.__name__})"
            if n.op == "call_method" and n.target in _RANDOM_METHODS:
                return f"the graph draws random numbers ({n.target})"
            if op_kind(n) == "dropout":
                p, training = arg(n, "p", 0.5), arg(n, "training", True)
                if training is not False and p not in (0, 0.0):
                    return "the graph has dropout with p > 0 in training (the fused ops draw their masks differently)"
    return None


class Reference:
    """The leaves gradients are taken for, and the fixed output weights, shared by every run."""

    def __init__(self, example_inputs: Sequence[Any], names: Sequence[str] = (), gm: Optional[fx.GraphModule] = None):
        self.inputs = list(example_inputs)
        self.names = list(names)
        # The graph computes at the precision of its lowest-precision floats (bf16 matmuls under autocast return
        # fp32 gradients of fp32 parameters): every comparison gets at least that dtype's tolerance.
        self.min_tolerance = 0.0
        if gm is not None:
            for _, m in graph_modules(gm):
                for n in m.graph.nodes:
                    v = n.meta.get("val", n.meta.get("example_value"))
                    for t in (v if isinstance(v, (tuple, list)) else (v,)):
                        if isinstance(t, torch.Tensor) and t.is_floating_point():
                            self.min_tolerance = max(self.min_tolerance, TOLERANCE.get(t.dtype, 0.0))
        self.grad_idx = [i for i, x in enumerate(self.inputs)
                         if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point()]
        self.weights: Optional[List[Optional[torch.Tensor]]] = None
        self.result: Optional[Tuple[list, list]] = None


def _fresh_inputs(ref: Reference):
    from .graph_utils import size_hint

    out = []
    for i, x in enumerate(ref.inputs):
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            # Dynamo hands symbolic sizes over as SymInts; running the graph on them would guard (specialise the
            # graph to this length). Their example values are what the real tensors have.
            out.append(size_hint(x) if isinstance(x, torch.SymInt) else x.node.hint)
        elif isinstance(x, torch.Tensor):
            y = x.detach()
            if not isinstance(x, torch.nn.Parameter):
                y = y.clone()
            if i in ref.grad_idx:
                y.requires_grad_(True)
            out.append(y)
        else:
            out.append(x)
    return out


def run_graph(gm: fx.GraphModule, ref: Reference, fix_outputs: Callable[[Sequence[Any], list], list]):
    """(outputs, gradients) of one eager run of ``gm`` (outputs passed through ``fix_outputs`` first, which
    rebuilds substituted outputs such as lazy logits)."""
    args = _fresh_inputs(ref)
    devices = sorted({x.device.index for x in args if isinstance(x, torch.Tensor) and x.is_cuda})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        with torch.enable_grad():
            outs = fix_outputs(args, list(gm(*args)))
            flat = [o for o in outs]
            if ref.weights is None:
                g = torch.Generator().manual_seed(1)
                ref.weights = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)
                               if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad else None
                               for o in flat]
            terms = [(o.double() * w).sum() for o, w in zip(flat, ref.weights)
                     if w is not None and isinstance(o, torch.Tensor) and o.requires_grad and o.shape == w.shape]
            leaves = [args[i] for i in ref.grad_idx]
            grads: list = [None] * len(leaves)
            if terms and leaves:
                grads = list(torch.autograd.grad(sum(terms), leaves, allow_unused=True))
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in flat], grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        same_nan = torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isinf(a), torch.isinf(b))
        if not same_nan:
            return float("inf")
        m = torch.isfinite(b)
        a, b = a[m], b[m]
    d = (a - b).norm().item()
    n = b.norm().item()
    return d / n if n > 0 else d


def compare(reference, got, ref: Optional[Reference] = None) -> Tuple[Optional[str], float]:
    """(what differs beyond tolerance or None, the worst tolerance-relative difference seen)."""
    (ro, rg), (go, gg) = reference, got
    worst, problem = 0.0, None
    names = ref.names if ref is not None else []
    leaf = [names[i] if i < len(names) else f"input {i}" for i in (ref.grad_idx if ref is not None else
                                                                     range(len(rg)))]
    pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(go, ro))]
    pairs += [(f"the gradient of {leaf[i]}", a, b) for i, (a, b) in enumerate(zip(gg, rg))]
    for what, a, b in pairs:
        if not isinstance(b, torch.Tensor) or not b.is_floating_point():
            continue
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return f"{what}: {type(a).__name__} {getattr(a, 'shape', '')} instead of {list(b.shape)}", float("inf")
        tol = max(TOLERANCE.get(b.dtype, 1e-3), ref.min_tolerance if ref is not None else 0.0)
        err = _rel(a, b)
        if err / tol > worst:
            worst = err / tol
            if err > tol:
                problem = f"{what} differs from the unfused graph's by {err:.3g} (norm-relative; tolerance {tol:g})"
    return problem, worst
