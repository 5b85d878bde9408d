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
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

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


@dataclass
class OutputSubstitution:
    """Graph output ``slot`` is returned as ``rebuild(*values of inputs)`` built outside the compiled graph.

    The graph itself returns ``inputs[0]`` in that slot; the other inputs are read from the compiled function's
    arguments (placeholders) or returned as extra trailing outputs. ``rebuild`` must accept fake tensors: the
    backend validates the substitution by running it under the compile's fake mode.
    """

    slot: int
    inputs: List[fx.Node]
    rebuild: Callable[..., Any]
    pass_name: str
    placeholder_index: Dict[int, int] = field(default_factory=dict)  # input position -> argument index
    extra_output_index: Dict[int, int] = field(default_factory=dict)  # input position -> flat output index


class PassContext:
    """What a pass gets besides the graph: where to record sites, its options, and the fake mode."""

    def __init__(self, report: FusionReport, options: FxFuseOptions, fake_mode, pass_name: str = "",
                 root: Optional[fx.GraphModule] = None):
        self.report = report
        self.options = options
        self.fake_mode = fake_mode
        self.pass_name = pass_name
        self.root = root
        self._pending: List[SiteRecord] = []
        self._pending_subs: List[OutputSubstitution] = []
        self.substitutions: List[OutputSubstitution] = []

    def substitute_output(self, gm: fx.GraphModule, node: fx.Node, inputs: List[fx.Node],
                          rebuild: Callable[..., Any]) -> int:
        """Return ``rebuild(inputs...)`` in place of ``node`` wherever the root graph returns it, so ``node`` need
        not be computed in the graph. Returns how many output slots were substituted (0 if ``node`` is not a
        root-graph output or ``gm`` is a subgraph)."""
        if gm is not self.root:
            return 0
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else None
        if flat is None:
            return 0
        slots = [i for i, a in enumerate(flat) if a is node]
        if not slots:
            return 0
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for slot in slots:
            sub = OutputSubstitution(slot, list(inputs), rebuild, self.pass_name)
            flat[slot] = inputs[0]
            for j, x in enumerate(inputs[1:], start=1):
                if x is None:
                    continue
                if x.op == "placeholder":
                    sub.placeholder_index[j] = phs.index(x)
                else:
                    sub.extra_output_index[j] = len(flat)
                    flat.append(x)
            self._pending_subs.append(sub)
        out.args = (type(out.args[0])(flat),)
        return len(slots)

    # passes call these ----------------------------------------------------------------------------------
    def fused(self, node: fx.Node, op: str, *, saved_bytes: Optional[int] = None, **detail) -> None:
        self._pending.append(SiteRecord(self.pass_name, FUSED, op, "", node_location(node), saved_bytes, detail))

    def skipped(self, node: fx.Node, op: str, reason: str, **detail) -> None:
        self._pending.append(SiteRecord(self.pass_name, SKIPPED, op, reason, node_location(node), None, detail))

    def pass_option(self, key: str, default: Any = None) -> Any:
        return self.options.pass_options.get(self.pass_name, {}).get(key, default)

    def int_option(self, key: str, default: int, minimum: int, what: str = "") -> int:
        """An int pass option >= ``minimum`` (None = ``default``); anything else raises, so the pass is rolled
        back with a reason that names the option (``what`` says what it means)."""
        v = self.pass_option(key, default)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            kind = "a non-negative int" if minimum == 0 else f"an int >= {minimum}"
            raise FxFusePassError(f"pass_options[{self.pass_name!r}][{key!r}] must be {kind}"
                                  + (f" ({what})" if what else "") + f", got {v!r}")
        return v

    def choice_option(self, key: str, default: str, choices: Sequence[str]) -> str:
        """A pass option that must be one of ``choices``; anything else raises (the pass is rolled back)."""
        v = self.pass_option(key, default)
        if v not in choices:
            raise FxFusePassError(f"pass_options[{self.pass_name!r}][{key!r}] must be one of {tuple(choices)}, "
                                  f"got {v!r}")
        return v

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
    from .validation import _propagate_subgraphs, preserved_autocast_state

    try:
        with preserved_autocast_state():
            Prop(gm, mode=fake_mode).propagate(*example_inputs)
            tracker.node = None
            _propagate_subgraphs(gm, fake_mode)
    finally:
        ft_log.setLevel(old)


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
    ctx._pending_subs = []
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
                try:
                    effective = _effective_signature(gm, ctx.substitutions + ctx._pending_subs, fake_mode)
                except Exception as e:
                    effective = None
                    problem = (f"an output substitution does not rebuild under FakeTensor: "
                               f"{type(e).__name__}: {e}")
            if problem is None:
                mismatch = compare_signatures(baseline, effective)
                if mismatch is not None:
                    idx, what = mismatch
                    after = effective
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
        ctx.substitutions.extend(ctx._pending_subs)
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


def _effective_signature(gm: fx.GraphModule, subs: List[OutputSubstitution], fake_mode):
    """The output signature callers will see: substituted slots rebuilt (under fake), extra outputs dropped."""
    from .validation import OutputSig

    sigs = output_signature(gm)
    if not subs:
        return sigs
    extra = {i for s in subs for i in s.extra_output_index.values()}
    for s in subs:
        vals = [node_val(x) if x is not None else None for x in s.inputs]
        with fake_mode:
            v = s.rebuild(*vals)
        sigs[s.slot] = OutputSig(s.slot, "tensor", tuple(v.shape), tuple(v.stride()), v.dtype, v.device, None)
    return [sig for i, sig in enumerate(sigs) if i not in extra]


def _wrap_substitutions(compiled: Callable, subs: List[OutputSubstitution]) -> Callable:
    """Rebuild substituted outputs around the compiled function (keeping its calling convention)."""
    if not subs:
        return compiled
    extra = sorted({i for s in subs for i in s.extra_output_index.values()})

    def fix(args: Sequence[Any], outs):
        outs = list(outs)
        for s in subs:
            vals = [outs[s.slot]]
            for j in range(1, len(s.inputs)):
                if s.inputs[j] is None:
                    vals.append(None)
                elif j in s.placeholder_index:
                    vals.append(args[s.placeholder_index[j]])
                else:
                    vals.append(outs[s.extra_output_index[j]])
            outs[s.slot] = s.rebuild(*vals)
        return [o for i, o in enumerate(outs) if i not in extra]

    # Dynamo calls what a backend returns with positional arguments (the boxed convention is for the compilers
    # nested inside Inductor), so no functools.wraps here: it would copy their _boxed_call marker.
    def run(*args):
        return fix(args, compiled(*args))

    run.__wrapped__ = compiled
    return run


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

    subs: List[OutputSubstitution] = []
    if specs:
        fake_mode = detect_fake_mode(example_inputs)
        t0 = time.perf_counter()
        fake_propagate(gm, example_inputs, fake_mode)
        rep.pass_ms["<fake propagation>"] = (time.perf_counter() - t0) * 1e3
        baseline = output_signature(gm)
        ctx = PassContext(rep, opts, fake_mode, root=gm)
        for spec in specs:
            _run_pass(gm, spec, ctx, example_inputs, fake_mode, baseline)
        subs = ctx.substitutions
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

        compiled = aot_eager(gm, example_inputs)
    else:
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    return _wrap_substitutions(compiled, subs)
