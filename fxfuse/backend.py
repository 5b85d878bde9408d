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
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from . import registry
from .errors import FxFuseError, FxFusePassError, FxFuseValidationError, node_location, raised_through_dynamo
from .graph_utils import graph_modules, node_val
from .options import FxFuseOptions
from .report import FUSED, ROLLED_BACK, SKIPPED, FusionReport, SiteRecord, _publish
from .validation import (GraphSnapshot, GuardWatch, NodeState, PropagationError, compare_signatures,
                         output_signature, propagate)

log = logging.getLogger("fxfuse")

__all__ = ["fxfuse", "PassContext"]

_DEFAULT_DEBUG_DIR: Optional[str] = None  # set by fxfuse.debug()
PASSES_RAN = "fxfuse_passes_ran"  # GraphModule.meta key: fxfuse's passes already ran on this graph


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
        self.verify = None  # verify.Reference when options["verify"]

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
        """The value of this pass's option ``key``: the user's (already checked by ``FxFuseOptions.parse``), else
        ``default``, else the default the pass declared in ``register_pass(options=...)``."""
        v = self.options.pass_options.get(self.pass_name, {}).get(key)
        if v is not None:
            return v
        return default if default is not None else self._declared_default(key)

    def _declared_default(self, key: str) -> Any:
        spec = registry._REGISTRY.get(self.pass_name)
        opt = spec.options.get(key) if spec is not None else None
        return opt.default if opt is not None else None

    def int_option(self, key: str, default: Optional[int] = None, minimum: int = 0, what: str = "") -> int:
        """An int pass option >= ``minimum`` (None = ``default``, or the declared default); anything else raises, so
        the pass is rolled back with a reason that names the option (``what`` says what it means). Parsed options
        never get here with a bad value; options built by hand (tests, tools) still do."""
        v = self.pass_option(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            kind = "a non-negative int" if minimum == 0 else f"an int >= {minimum}"
            raise FxFusePassError(f"pass_options[{self.pass_name!r}][{key!r}] must be {kind}"
                                  + (f" ({what})" if what else "") + f", got {v!r}")
        return v

    def choice_option(self, key: str, default: Optional[str] = None, choices: Sequence[str] = ()) -> str:
        """A pass option that must be one of ``choices`` (default: the declared choices); anything else raises (the
        pass is rolled back)."""
        v = self.pass_option(key, default)
        if not choices:
            spec = registry._REGISTRY.get(self.pass_name)
            opt = spec.options.get(key) if spec is not None else None
            choices = tuple(opt.choices or ()) if opt is not None else ()
        if v not in choices:
            raise FxFusePassError(f"pass_options[{self.pass_name!r}][{key!r}] must be one of {tuple(choices)}, "
                                  f"got {v!r}")
        return v

    def graph_modules(self, gm: fx.GraphModule):
        """``gm`` and every nested subgraph module (a pass must rewrite inside checkpoint bodies too)."""
        return [m for _, m in graph_modules(gm)]


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


def _raise_site(e: BaseException) -> str:
    """Where an exception was raised, as the innermost frame outside torch (a pass's own line)."""
    import traceback

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    frames = traceback.extract_tb(e.__traceback__)
    for fr in reversed(frames):
        if not os.path.abspath(fr.filename).startswith(torch_dir):
            return f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
    return "<inside torch>"


def _signatures(gm: fx.GraphModule) -> Dict[fx.GraphModule, list]:
    """Output signature of ``gm`` and of every subgraph it calls (a rewrite inside a checkpoint body must keep
    the body's outputs as they were)."""
    return {m: output_signature(m) for _, m in graph_modules(gm)}


def _check_pass(gm, ctx: PassContext, fake_mode, before: NodeState, baselines) -> Tuple[Optional[str], Optional[fx.Node]]:
    """Re-propagate what the pass changed and compare every graph's outputs. (problem, culprit) or (None, None)."""
    for m in ctx.graph_modules(gm):
        m.graph.lint()
        m.recompile()
    try:
        propagate(gm, fake_mode, before=before)
    except PropagationError as e:
        culprit = e.node
        cause = e.__cause__ or e
        return (f"the rewritten graph no longer type-checks under FakeTensor at "
                f"{_describe_node(culprit) if culprit is not None else '?'}: "
                f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"), culprit
    try:
        effective = _effective_signature(gm, ctx.substitutions + ctx._pending_subs, fake_mode)
    except Exception as e:
        return f"an output substitution does not rebuild under FakeTensor: {type(e).__name__}: {e}", None
    for m, base in baselines.items():
        if m is not gm and m not in dict(graph_modules(gm)).values():
            continue
        after = effective if m is gm else output_signature(m)
        mismatch = compare_signatures(base, after)
        if mismatch is None:
            continue
        idx, what = mismatch
        exp = base[idx].describe() if idx >= 0 else f"{len(base)} outputs"
        got = after[idx].describe() if 0 <= idx < len(after) else f"{len(after)} outputs"
        culprit = after[idx].node if 0 <= idx < len(after) else None
        where = "graph output" if m is gm else "subgraph output"
        return f"{where} {idx}: {what}: expected {exp}, got {got}", culprit
    return None, None


def _verify_pass(gm, ctx: PassContext, name: str) -> Optional[str]:
    """``verify``: compare the rewritten graph's outputs and gradients with the unfused graph's."""
    from .verify import compare, run_graph, substitution_fixer

    try:
        got = run_graph(gm, ctx.verify, substitution_fixer(ctx.substitutions + ctx._pending_subs))
    except Exception as e:
        return f"verify: the rewritten graph failed to run eagerly ({type(e).__name__}: {e})"
    problem, worst = compare(ctx.verify.result, got, ctx.verify)
    ctx.report.verified[name] = round(worst, 4)
    return f"verify: {problem}" if problem else None


def _run_pass(gm, spec, ctx: PassContext, fake_mode, baselines) -> int:
    """Run one pass with snapshot, validation and rollback. Returns the sites it changed (0 if rolled back).

    Validation runs whenever the graph changed, whatever the pass returned; a pass that raises, returns something
    other than an int, breaks fake propagation, changes an output, or would add a guard on a symbolic size is
    rolled back to the exact graph it started from.
    """
    snapshot = GraphSnapshot(gm)
    before = NodeState(gm)
    ctx.pass_name = spec.name
    ctx._pending = []
    ctx._pending_subs = []
    culprit: Optional[fx.Node] = None
    raised = False
    loc = None
    changed = 0
    graph_changed = False
    t0 = time.perf_counter()
    with GuardWatch(fake_mode) as watch:
        try:
            changed = spec.fn(gm, ctx)
            if isinstance(changed, bool) or not isinstance(changed, int):
                raise TypeError(f"pass {spec.name!r} returned {changed!r}; a pass must return the number of sites "
                                f"it changed (an int)")
            problem = None
            graph_changed = before.changed(gm)
            if graph_changed or changed or ctx._pending_subs:
                problem, culprit = _check_pass(gm, ctx, fake_mode, before, baselines)
                if problem is None and getattr(ctx, "verify", None) is not None:
                    problem = _verify_pass(gm, ctx, spec.name)
                    if problem is not None:  # point at the first node the pass created or changed
                        culprit = next((n for _, m in graph_modules(gm) for n in m.graph.nodes
                                        if n.op != "output" and before.dirty(m, n)), None)
        except Exception as e:
            changed, raised = 0, True
            problem = f"the pass raised {type(e).__name__}: {e}"
            loc = _raise_site(e)
        finally:
            ctx.report.pass_ms[spec.name] = ctx.report.pass_ms.get(spec.name, 0.0) + \
                (time.perf_counter() - t0) * 1e3
    if problem is None and watch.attempts:
        problem = ("the rewrite specialised a symbolic size, which would recompile the model for every new "
                   f"length: {watch.describe()}")
    if problem is None:
        if (changed or graph_changed) and not spec.builtin and not ctx._pending:
            what = (f"{changed} site(s) rewritten by a user pass" if changed else
                    "the graph was changed by a user pass that returned 0")
            ctx._pending.append(SiteRecord(spec.name, FUSED, what, "", "", None, {"sites": int(changed)}))
        ctx.report.records.extend(ctx._pending)
        ctx.substitutions.extend(ctx._pending_subs)
        if changed:
            ctx.report.passes_run.append(spec.name)
        return int(changed)

    snapshot.restore()  # restored nodes carry the values they had before the pass
    loc = loc or _locate(culprit)
    ctx.report.records.append(SiteRecord(spec.name, ROLLED_BACK, spec.name, problem, loc))
    msg = f"fxfuse pass '{spec.name}' was rolled back: {problem}\n  at: {loc}"
    if ctx.options.strict:
        exc = FxFusePassError if raised else FxFuseValidationError
        raise raised_through_dynamo(exc(msg + "\n  (strict=True: raising instead of falling back to the unfused graph)"))
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


def _run_passes(gm, example_inputs, specs, opts: FxFuseOptions, rep: FusionReport, fake_mode):
    """Every enabled pass, each validated and rolled back on its own. Nothing in fxfuse's own analysis may break
    the user's compile: anything unexpected restores the graph as Dynamo gave it (Inductor then lowers it
    unchanged) and is reported; ``strict=True`` raises instead."""
    from .validation import values_fake_mode

    fake_mode = values_fake_mode(gm) or fake_mode  # new nodes run in the mode of the values Dynamo recorded
    if fake_mode is None:  # a graph handed over outside Dynamo (tests, tools): static fake values
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()
    pristine = GraphSnapshot(gm)
    t0 = time.perf_counter()
    try:
        with GuardWatch(fake_mode) as watch:
            propagate(gm, fake_mode, example_inputs)
        rep.pass_ms["<fake propagation>"] = (time.perf_counter() - t0) * 1e3
        if watch.attempts:
            raise _Unsound(f"fake propagation of the graph as Dynamo gave it would add a shape guard: "
                           f"{watch.describe()}; no pass ran")
        ctx = PassContext(rep, opts, fake_mode, root=gm)
        baselines = _signatures(gm)
        ctx.verify = _verify_reference(gm, example_inputs, rep) if opts.verify else None
        for spec in specs:
            _run_pass(gm, spec, ctx, fake_mode, baselines)
        return ctx.substitutions
    except FxFuseError as e:
        if opts.strict and not isinstance(e, _Unsound):
            raise raised_through_dynamo(e) from None
        problem, loc = str(e), "<fxfuse>"
    except Exception as e:
        problem = f"fxfuse's own analysis failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        node = getattr(e, "node", None)
        loc = _locate(node) if node is not None else _raise_site(e)
        if isinstance(e, PropagationError) and node is not None:
            problem += f" at {_describe_node(node)}"
    pristine.restore()
    for r in rep.records:
        if r.status == FUSED:
            r.status, r.reason = ROLLED_BACK, "undone with the whole graph: " + problem
    rep.records.append(SiteRecord("<fxfuse>", ROLLED_BACK, "every pass", problem, loc))
    msg = f"fxfuse left this graph unfused: {problem}\n  at: {loc}"
    if opts.strict:
        raise raised_through_dynamo(FxFuseError(msg + "\n  (strict=True: raising instead of compiling the graph "
                                                      "unfused)"))
    log.warning("%s", msg)
    return []


def _verify_reference(gm, example_inputs, rep: FusionReport):
    """``verify``: the unfused graph's outputs and gradients on the real first inputs (None if it cannot be
    verified; the report says why)."""
    from .verify import Reference, run_graph, why_not_verifiable

    why = why_not_verifiable(gm, example_inputs)
    if why is None:
        try:
            ref = Reference(example_inputs, [n.name for n in gm.graph.nodes if n.op == "placeholder"], gm)
            ref.result = run_graph(gm, ref, lambda args, outs: outs)
            return ref
        except Exception as e:
            why = f"the unfused graph did not run eagerly on the example inputs ({type(e).__name__}: {e})"
    rep.records.append(SiteRecord("<verify>", SKIPPED, "numeric verification", why, ""))
    return None


class _Unsound(FxFuseError):
    """fxfuse cannot analyse this graph without changing how it is compiled."""


# frame id -> (compiles seen, description of each compile's inputs); for the recompile-limit warning
_FRAME_COMPILES: Dict[Any, List[str]] = {}


def _describe_inputs(gm: fx.GraphModule, example_inputs) -> Dict[str, str]:
    out = {}
    for n, x in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
        v = node_val(n)
        if isinstance(v, torch.Tensor):
            out[n.name] = f"{str(v.dtype).replace('torch.', '')}[{', '.join(map(str, v.shape))}]"
        elif isinstance(v, (int, float, torch.SymInt, torch.SymFloat)):
            out[n.name] = f"{type(x).__name__} {v}"
    return out


def _warn_near_recompile_limit(gm: fx.GraphModule, example_inputs, rep: FusionReport) -> None:
    """Once per frame, when fxfuse compiles a frame for the last time Dynamo allows: say so, and what changed
    since the previous compile of that frame (from then on new inputs run that frame eagerly, without fxfuse or
    Inductor)."""
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        if cid is None or getattr(cid, "frame_id", None) is None:
            return
        limit = int(getattr(torch._dynamo.config, "recompile_limit",
                            getattr(torch._dynamo.config, "cache_size_limit", 8)))
        frame, n = cid.frame_id, int(cid.frame_compile_id or 0)
        seen = _FRAME_COMPILES.setdefault(frame, [])
        now = _describe_inputs(gm, example_inputs)
        seen.append(now)
        if n + 1 != limit:
            return
        prev = seen[-2] if len(seen) > 1 else {}
        diff = [f"{k}: {prev.get(k, '<absent>')} -> {v}" for k, v in now.items() if prev.get(k) != v]
        diff += [f"{k}: {v} -> <absent>" for k, v in prev.items() if k not in now]
        code = getattr(gm, "_fxfuse_frame_name", None) or rep.graph_name
        warnings.warn(
            f"fxfuse: frame {frame} ({code}) has now been compiled {n + 1} times, Dynamo's recompile_limit "
            f"(torch._dynamo.config.recompile_limit = {limit}); new inputs that fail its guards will run this frame "
            f"eagerly, without fxfuse or Inductor. Changed since its previous compile: "
            f"{'; '.join(diff[:6]) or _NO_INPUT_CHANGE}. "
            f"TORCH_LOGS=recompiles shows Dynamo's reasons.", stacklevel=2)
    except Exception:  # a diagnostic must never break the compile
        log.debug("recompile-limit check failed", exc_info=True)


#: the recompile warning's text when no input shape or dtype changed. The case seen in practice: an HF model called
#: in training without use_cache=False builds a KV cache; under FSDP2 every decoder layer is its own frame, and
#: Dynamo guards each layer's compile on that layer's cache state, so the frame recompiles once per layer.
_NO_INPUT_CHANGE = ("no input shape or dtype (a guard on a value or a global; e.g. an HF model called in training "
                    "without use_cache=False, whose KV cache makes each decoder layer's frame recompile under FSDP2)")

_SOURCE_HASH: Optional[str] = None


def source_hash() -> str:
    """fxfuse's version and a hash of every source file of the package and of its passes (computed once)."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        import hashlib

        from . import __version__, passes as _passes_pkg

        h = hashlib.sha256(__version__.encode())
        roots = [os.path.dirname(os.path.abspath(__file__))] + list(getattr(_passes_pkg, "__path__", []))
        for root in roots:
            for dirpath, dirnames, files in sorted(os.walk(root)):
                dirnames.sort()
                for f in sorted(files):
                    if f.endswith(".py"):
                        path = os.path.join(dirpath, f)
                        h.update(os.path.relpath(path, root).encode())
                        with open(path, "rb") as fh:
                            h.update(fh.read())
        _SOURCE_HASH = h.hexdigest()
    return _SOURCE_HASH


def _cache_key_pass(existing: Any):
    """A no-op Inductor post-grad pass whose ``uuid()`` is fxfuse's :func:`source_hash`.

    Inductor's FX-graph cache and AOTAutograd's cache key on the graph, and fxfuse's graphs name ``fxfuse::`` ops,
    not their code: the composite ops' decompositions, autograd formulas and fake impls are baked into what they
    cache. Custom passes' ``uuid()`` are part of both keys (the ``CustomGraphPass`` contract), so this one makes an
    upgrade or a local edit of fxfuse a cache miss. A user's own post-grad pass keeps running first, its uuid
    combined with ours; a raw callable there already disables caching and is left as it is (None = no change)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    if existing is not None and not isinstance(existing, CustomGraphPass):
        return None

    class FxFuseCacheKey(CustomGraphPass):
        def __call__(self, graph):
            if existing is not None:
                existing(graph)

        def uuid(self):
            return ("fxfuse", source_hash(), existing.uuid() if existing is not None else None)

    return FxFuseCacheKey()


def fxfuse(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str] = None,
           options: Optional[Dict[str, Any]] = None):
    """torch.compile backend: fxfuse's passes, validated, in front of Inductor.

    ``mode`` and every Inductor option in ``options`` are forwarded to Inductor; fxfuse's own options are
    described in :mod:`fxfuse.options`.
    """
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx

    try:
        opts = FxFuseOptions.parse(options)
    except FxFuseError as e:  # reach the user as it is, not wrapped in Dynamo's BackendCompilerFailed
        raise raised_through_dynamo(e) from None
    builtins = registry.registered_passes()
    specs = [s for s in builtins if opts.enabled(s.name, s.enabled_by_default)]
    specs += [registry.user_pass_spec(fn, i) for i, fn in enumerate(opts.extra_passes)]

    rep = FusionReport(graph_name=_graph_name(), num_nodes=len(gm.graph.nodes))
    debug_dir = opts.debug_dir or _DEFAULT_DEBUG_DIR
    tag = rep.graph_name.replace(" ", "_").replace("/", "_")
    if debug_dir:
        _dump(debug_dir, f"{tag}.0_dynamo.py", gm)

    subs: List[OutputSubstitution] = []
    if specs:
        subs = _run_passes(gm, example_inputs, specs, opts, rep, detect_fake_mode(example_inputs))
    _warn_near_recompile_limit(gm, example_inputs, rep)
    _publish(rep)

    patches: Dict[str, Any] = {}
    if mode is not None and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode))
    patches.update(opts.inductor)
    key_pass = _cache_key_pass(patches.get("post_grad_custom_post_pass",
                                           torch._inductor.config.post_grad_custom_post_pass))
    if key_pass is not None:
        patches["post_grad_custom_post_pass"] = key_pass
    if debug_dir:
        _dump(debug_dir, f"{tag}.1_after_fxfuse.py", gm)
        with open(os.path.join(debug_dir, f"{tag}.report.txt"), "w") as f:
            f.write(str(rep) + "\n")
        patches.setdefault("trace.enabled", True)
        patches.setdefault("trace.debug_dir", os.path.join(os.path.abspath(debug_dir), "inductor"))
    # fxfuse.install() also runs the passes from inside Inductor (pre-grad hook); this graph has had them already
    gm.meta[PASSES_RAN] = True
    if opts.compiler == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        compiled = aot_eager(gm, example_inputs)
    else:
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    return _wrap_substitutions(compiled, subs)
