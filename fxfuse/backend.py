"""The ``fxfuse`` torch.compile backend.

::

    Dynamo graph -> fake-propagate -> for each enabled pass: snapshot, rewrite, validate (rollback on failure)
                 -> compile_fx(gm, example_inputs, config_patches=mode + Inductor options)

Registered under the ``torch_dynamo_backends`` entry point, so ``torch.compile(model, backend="fxfuse")``
works without importing fxfuse first.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx as fx

from . import registry
from .errors import FxFusePassError, FxFuseValidationError, node_location
from .graph_utils import graph_modules, node_val
from .options import FxFuseOptions
from .report import FUSED, ROLLED_BACK, SKIPPED, FusionReport, SiteRecord, _publish
from .validation import GraphSnapshot, compare_signatures, fake_propagate, output_signature

log = logging.getLogger("fxfuse")

__all__ = ["fxfuse", "PassContext"]

_DEFAULT_DEBUG_DIR: Optional[str] = None  # set by fxfuse.debug()


class PassContext:
    """What a pass gets besides the graph: where to record sites, its options, and the fake mode."""

    def __init__(self, report: FusionReport, options: FxFuseOptions, fake_mode, pass_name: str = ""):
        self.report = report
        self.options = options
        self.fake_mode = fake_mode
        self.pass_name = pass_name
        self._pending: List[SiteRecord] = []

    # passes call these ----------------------------------------------------------------------------------
    def fused(self, node: fx.Node, op: str, *, saved_bytes: Optional[int] = None, **detail) -> None:
        self._pending.append(SiteRecord(self.pass_name, FUSED, op, "", node_location(node), saved_bytes, detail))

    def skipped(self, node: fx.Node, op: str, reason: str, **detail) -> None:
        self._pending.append(SiteRecord(self.pass_name, SKIPPED, op, reason, node_location(node), None, detail))

    def pass_option(self, key: str, default: Any = None) -> Any:
        return self.options.pass_options.get(self.pass_name, {}).get(key, default)

    def graph_modules(self, gm: fx.GraphModule):
        """``gm`` and every nested subgraph module (a pass must rewrite inside checkpoint bodies too)."""
        return [m for _, m in graph_modules(gm)]


def _node_shapes(gm: fx.GraphModule) -> Dict[fx.Node, tuple]:
    out = {}
    for n in gm.graph.nodes:
        v = node_val(n)
        if isinstance(v, torch.Tensor):
            out[n] = (tuple(v.shape), v.dtype)
    return out


class _TrackingProp:
    """Remembers which node fake propagation was executing when it failed."""

    def __init__(self):
        self.node: Optional[fx.Node] = None


def _propagate_tracking(gm, example_inputs, fake_mode, tracker: _TrackingProp):
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class Prop(FakeTensorProp):
        def run_node(self, n):
            tracker.node = n
            return super().run_node(n)

    # A broken rewrite makes FakeTensor log the failing meta kernel at ERROR level before raising; we report
    # the failure ourselves, with the pass's name, so keep that log quiet while validating.
    ft_log = logging.getLogger("torch._subclasses.fake_tensor")
    old = ft_log.level
    ft_log.setLevel(logging.CRITICAL)
    try:
        Prop(gm, mode=fake_mode).propagate(*example_inputs)
    finally:
        ft_log.setLevel(old)
    tracker.node = None
    from .validation import _propagate_subgraphs

    _propagate_subgraphs(gm, fake_mode)


def _describe_node(n: fx.Node) -> str:
    def show(a):
        if isinstance(a, fx.Node):
            v = node_val(a)
            if isinstance(v, torch.Tensor):
                return f"%{a.name} [{', '.join(map(str, v.shape))}]"
            return f"%{a.name}"
        return repr(a)

    tgt = getattr(n.target, "__name__", str(n.target))
    args = ", ".join([show(a) for a in n.args] + [f"{k}={show(v)}" for k, v in n.kwargs.items()])
    return f"%{n.name} = {tgt}({args})"


def _locate(n: Optional[fx.Node]) -> str:
    """Source location of ``n``, or of the nearest original node around it (nodes a pass creates have none)."""
    if n is None:
        return "<unknown>"
    cands = [n] + [a for a in n.all_input_nodes] + list(n.users)
    for c in cands:
        if c.meta.get("stack_trace") or c.meta.get("nn_module_stack"):
            return node_location(c)
    return "<no source information>"


def _run_pass(gm, spec, ctx: PassContext, example_inputs, fake_mode, baseline) -> int:
    """Run one pass with snapshot, validation and rollback. Returns the sites it changed (0 if rolled back)."""
    snapshot = GraphSnapshot(gm)
    before_shapes = _node_shapes(gm)
    ctx.pass_name = spec.name
    ctx._pending = []
    tracker = _TrackingProp()
    culprit: Optional[fx.Node] = None
    raised = False
    t0 = time.perf_counter()
    try:
        changed = spec.fn(gm, ctx)
        problem = None
        if changed:
            for m in ctx.graph_modules(gm):
                m.graph.lint()
                m.recompile()
            try:
                _propagate_tracking(gm, example_inputs, fake_mode, tracker)
            except Exception as e:
                culprit = tracker.node
                cause = e.__cause__ or e
                problem = (f"the rewritten graph no longer type-checks under FakeTensor at "
                           f"{_describe_node(culprit) if culprit is not None else '?'}: "
                           f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
            if problem is None:
                mismatch = compare_signatures(baseline, output_signature(gm))
                if mismatch is not None:
                    idx, what = mismatch
                    after = output_signature(gm)
                    exp = baseline[idx].describe() if idx >= 0 else f"{len(baseline)} outputs"
                    got = after[idx].describe() if 0 <= idx < len(after) else f"{len(after)} outputs"
                    after_shapes = _node_shapes(gm)
                    culprit = next((n for n in gm.graph.nodes if n in before_shapes and n in after_shapes
                                    and before_shapes[n] != after_shapes[n]), None)
                    culprit = culprit or (after[idx].node if 0 <= idx < len(after) else None)
                    problem = f"graph output {idx}: {what}: expected {exp}, got {got}"
    except Exception as e:
        changed, problem, raised = 0, f"the pass raised {type(e).__name__}: {e}", True
    finally:
        ctx.report.pass_ms[spec.name] = ctx.report.pass_ms.get(spec.name, 0.0) + (time.perf_counter() - t0) * 1e3
    if problem is None:
        if changed and not spec.builtin and not ctx._pending:
            ctx._pending.append(SiteRecord(spec.name, FUSED, f"{changed} site(s) rewritten by a user pass",
                                           "", "", None, {"sites": int(changed)}))
        ctx.report.records.extend(ctx._pending)
        if changed:
            ctx.report.passes_run.append(spec.name)
        return int(changed)

    snapshot.restore()
    fake_propagate(gm, example_inputs, fake_mode)  # meta['val'] as it was, for the next pass
    loc = _locate(culprit)
    ctx.report.records.append(SiteRecord(spec.name, ROLLED_BACK, spec.name, problem, loc))
    msg = (f"fxfuse pass '{spec.name}' was rolled back: {problem}\n  at: {loc}")
    if ctx.options.strict:
        exc = FxFusePassError if raised else FxFuseValidationError
        raise exc(msg + "\n  (strict=True: raising instead of falling back to the unfused graph)")
    log.warning("%s", msg)
    return 0


def _graph_name() -> str:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        if cid is not None:
            return f"graph {cid}"
    except Exception:
        pass
    return "graph"


def _dump(debug_dir: str, name: str, gm: fx.GraphModule) -> None:
    os.makedirs(debug_dir, exist_ok=True)
    with open(os.path.join(debug_dir, name), "w") as f:
        f.write(gm.print_readable(print_output=False, include_stride=True, include_device=True))


def fxfuse(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str] = None,
           options: Optional[Dict[str, Any]] = None):
    """torch.compile backend: fxfuse's passes, validated, in front of Inductor.

    ``mode`` and every Inductor option in ``options`` are forwarded to Inductor; fxfuse's own options are
    described in :mod:`fxfuse.options`.
    """
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx

    opts = FxFuseOptions.parse(options)
    builtins = registry.registered_passes()
    opts.check_pass_names([s.name for s in builtins])
    specs = [s for s in builtins if opts.enabled(s.name, s.enabled_by_default)]
    specs += [registry.user_pass_spec(fn, i) for i, fn in enumerate(opts.extra_passes)]

    rep = FusionReport(graph_name=_graph_name(), num_nodes=len(gm.graph.nodes))
    debug_dir = opts.debug_dir or _DEFAULT_DEBUG_DIR
    tag = rep.graph_name.replace(" ", "_").replace("/", "_")
    if debug_dir:
        _dump(debug_dir, f"{tag}.0_dynamo.py", gm)

    if specs:
        fake_mode = detect_fake_mode(example_inputs)
        t0 = time.perf_counter()
        fake_propagate(gm, example_inputs, fake_mode)
        rep.pass_ms["<fake propagation>"] = (time.perf_counter() - t0) * 1e3
        baseline = output_signature(gm)
        ctx = PassContext(rep, opts, fake_mode)
        for spec in specs:
            _run_pass(gm, spec, ctx, example_inputs, fake_mode, baseline)
    _publish(rep)

    patches: Dict[str, Any] = {}
    if mode is not None and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode))
    patches.update(opts.inductor)
    if debug_dir:
        _dump(debug_dir, f"{tag}.1_after_fxfuse.py", gm)
        with open(os.path.join(debug_dir, f"{tag}.report.txt"), "w") as f:
            f.write(str(rep) + "\n")
        patches.setdefault("trace.enabled", True)
        patches.setdefault("trace.debug_dir", os.path.join(os.path.abspath(debug_dir), "inductor"))
    if opts.compiler == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    return compile_fx(gm, example_inputs, config_patches=patches)
