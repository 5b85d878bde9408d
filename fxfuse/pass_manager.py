"""The one pipeline every entry point runs: :class:`PassManager`.

::

    Dynamo graph ──> fake-propagate (no pass runs if that alone would add a shape guard)
                 ──> for each pass, in order:  snapshot ─> pass(gm, ctx) ─> lint + re-propagate what changed
                                              ─> outputs still the same? no new guard? [verify: same numbers?]
                                              ─> keep its records, or restore the snapshot and record why
                 ──> publish the FusionReport, dump graphs (debug_dir) ──> the entry point lowers the graph

The entry points are thin adapters around it (vLLM's ``PostGradPassManager`` plays the same role there):

* :func:`fxfuse.backend.fxfuse`, the Dynamo backend (``torch.compile(model, backend="fxfuse")``,
  :func:`fxfuse.compile`, :func:`fxfuse.compile_regions`): can rebuild outputs outside the graph, then calls
  Inductor with :meth:`PassManager.post_grad_pass`;
* :mod:`fxfuse.inductor_hook` (:func:`fxfuse.install`): runs the manager from Inductor's pre-grad hook, where a
  graph can only be rewritten in place; its ``uuid()`` is :meth:`PassManager.uuid`.

The manager owns the pass order (built-in passes by their registered ``order``, then the user's
``extra_passes``), the per-pass snapshot / validate / verify / rollback loop, the whole-graph rollback when
fxfuse's own analysis fails, the report, the debug dumps and the cache key. Nothing in fxfuse's analysis may
break a user's compile: anything unexpected restores the graph as Dynamo gave it and is reported; ``strict=True``
raises instead.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch.fx as fx

from . import registry, report_log
from .comm_overlap import runs_collectives_inside
from .diagnostics import describe_node, graph_name, locate, raise_site, warn_near_recompile_limit
from .errors import FxFuseError, FxFusePassError, FxFuseValidationError, raised_through_dynamo
from .graph_utils import graph_modules
from .options import FxFuseOptions
from .pass_context import PassContext
from .registry import PassSpec
from .report import FUSED, ROLLED_BACK, SKIPPED, FusionReport, SiteRecord
from .substitution import OutputSubstitution, effective_signature, substitution_fixer
from .version import __version__
from .validation import (GraphSnapshot, GuardWatch, NodeState, PropagationError, compare_signatures,
                         output_signature, propagate, values_fake_mode)

log = logging.getLogger("fxfuse")

__all__ = ["PassManager", "PASSES_RAN", "source_hash", "default_debug_dir", "callable_fingerprint"]

#: ``GraphModule.meta`` key: fxfuse's passes already ran on this graph (the Dynamo backend sets it, so the
#: Inductor hook of :func:`fxfuse.install` does not run them a second time on the graph it then lowers).
PASSES_RAN = "fxfuse_passes_ran"

_debug_dir: Optional[str] = None  # fxfuse.debug()'s directory, for compiles that set no debug_dir option


@contextlib.contextmanager
def default_debug_dir(path: str) -> Iterator[None]:
    """Dump every compile inside the block to ``path`` (unless its options name another ``debug_dir``)."""
    global _debug_dir
    prev, _debug_dir = _debug_dir, path
    try:
        yield
    finally:
        _debug_dir = prev


_source_hash: Optional[str] = None


def source_hash() -> str:
    """fxfuse's version and a hash of every source file of the package and of its passes (computed once)."""
    global _source_hash
    if _source_hash is None:
        import importlib.util

        passes = importlib.util.find_spec(f"{__package__}.passes")
        h = hashlib.sha256(__version__.encode())
        for root in [os.path.dirname(os.path.abspath(__file__))] + list(passes.submodule_search_locations or []):
            for dirpath, dirnames, files in sorted(os.walk(root)):
                dirnames.sort()
                for f in sorted(files):
                    if f.endswith(".py"):
                        path = os.path.join(dirpath, f)
                        h.update(os.path.relpath(path, root).encode())
                        with open(path, "rb") as fh:
                            h.update(fh.read())
        _source_hash = h.hexdigest()
    return _source_hash


def callable_fingerprint(fn: Any) -> Optional[str]:
    """A stable description of a user pass's code (for the cache key), or None if it cannot be told."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    if code is None:
        return None
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_consts).encode())
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}:{h.hexdigest()}"


class _Unsound(FxFuseError):
    """fxfuse cannot analyse this graph without changing how it is compiled."""


class PassManager:
    """fxfuse's passes, in order, each validated and rolled back on its own (see the module docstring).

    ``entry_point`` names the caller in messages; ``can_substitute_outputs`` is what the entry point allows (the
    passes learn it through :attr:`PassContext.can_substitute_outputs`).
    """

    def __init__(self, options: FxFuseOptions, *, entry_point: str = "backend", can_substitute_outputs: bool = True):
        self.options = options
        self.entry_point = entry_point
        self.can_substitute_outputs = can_substitute_outputs

    # -- what runs -----------------------------------------------------------------------------------------
    @property
    def passes(self) -> List[PassSpec]:
        """The enabled built-in passes in their order, then the user's ``extra_passes``."""
        opts = self.options
        specs = [s for s in registry.registered_passes() if opts.enabled(s.name, s.enabled_by_default)]
        return specs + [registry.user_pass_spec(fn, i) for i, fn in enumerate(opts.extra_passes)]

    @property
    def debug_dir(self) -> Optional[str]:
        return self.options.debug_dir or _debug_dir

    def uuid(self) -> Optional[Tuple[Any, ...]]:
        """What the graphs this manager produces depend on besides the input graph: fxfuse's sources, the options
        the passes read and the user passes' code. None when a user pass's code cannot be fingerprinted (then
        nothing may be cached). Inductor's FX-graph and AOTAutograd caches key on it through the custom passes'
        ``uuid()`` (the ``CustomGraphPass`` contract)."""
        extra = [callable_fingerprint(fn) for fn in self.options.extra_passes]
        if any(e is None for e in extra):
            return None
        o = self.options
        return ("fxfuse", source_hash(), self.can_substitute_outputs, repr(o.passes),
                repr(sorted((k, sorted(v.items())) for k, v in o.pass_options.items())), o.strict, o.verify,
                self.debug_dir, o.offload_mode, o.offload_min_bytes, o.plan_tokens, o.tp_all_reduce_blocks,
                tuple(extra))

    def post_grad_pass(self, existing: Any):
        """fxfuse's Inductor post-grad pass, for the Dynamo backend: it folds the host-offload round trips that
        AOTAutograd's partition leaves (:func:`fxfuse.ops.host_offload.fold_round_trips`), merges and splits
        tensor parallelism's all-reduces where ``tp_all_reduce_blocks`` asks (:mod:`fxfuse.comm_overlap`), and its ``uuid()``
        carries :meth:`uuid`.

        Inductor's FX-graph cache and AOTAutograd's cache key on the graph, and fxfuse's graphs name ``fxfuse::``
        ops, not their code: the ops' decompositions, autograd formulas and fake impls are baked into what they
        cache. A custom pass's ``uuid()`` is part of both keys, so this one makes an upgrade or a local edit of
        fxfuse a cache miss. A user's own post-grad pass keeps running first, its uuid combined with ours; a raw
        callable there disables caching (uuid None), as it would without fxfuse."""
        from torch._inductor.custom_graph_pass import CustomGraphPass

        from .comm_overlap import rewrite_tp_all_reduces
        from .ops.host_offload import fold_round_trips

        blocks = self.options.tp_all_reduce_blocks
        # what was there: nothing, one pass, or (a torch with pass lists) several, fxfuse.install()'s among them
        before = list(existing) if isinstance(existing, (list, tuple)) else [] if existing is None else [existing]
        key = self.uuid() if all(isinstance(p, CustomGraphPass) for p in before) else None

        class FxFusePostGrad(CustomGraphPass):
            # what fxfuse.background_inductor's compile child rebuilds it from
            fxfuse_key, user_passes, tp_all_reduce_blocks = key, before, blocks

            def __call__(self, graph):
                for p in before:
                    p(graph)
                fold_round_trips(graph)  # idempotent: a second run (install()'s fold ran first) changes nothing
                rewrite_tp_all_reduces(graph, blocks)  # blocks 0: nothing

            def uuid(self):
                if key is None:
                    return None
                return key + tuple(p.uuid() for p in before)

        return FxFusePostGrad()

    # -- the run -------------------------------------------------------------------------------------------
    def run(self, gm: fx.GraphModule, example_inputs: Sequence[Any], fake_mode=None
            ) -> Tuple[FusionReport, List[OutputSubstitution]]:
        """Run the passes on ``gm`` in place; publish and return the report, and the output substitutions the
        entry point must apply around the compiled graph (always [] where it cannot substitute)."""
        rep = FusionReport(graph_name=graph_name(), num_nodes=len(gm.graph.nodes))
        debug_dir = self.debug_dir
        tag = rep.graph_name.replace(" ", "_").replace("/", "_")
        if debug_dir:
            _dump(debug_dir, f"{tag}.0_dynamo.py", gm)
        subs: List[OutputSubstitution] = []
        specs = self.passes
        if specs:
            subs = self._run_all(gm, example_inputs, specs, rep, fake_mode)
        gm.meta[PASSES_RAN] = True
        warn_near_recompile_limit(gm, example_inputs, rep.graph_name)
        report_log.publish(rep)
        if debug_dir:
            _dump(debug_dir, f"{tag}.1_after_fxfuse.py", gm)
            with open(os.path.join(debug_dir, f"{tag}.report.txt"), "w") as f:
                f.write(str(rep) + "\n")
            with open(os.path.join(debug_dir, f"{tag}.report.json"), "w") as f:  # for `python -m fxfuse report`
                json.dump(rep.to_dict(), f)
        return rep, subs

    def _run_all(self, gm, example_inputs, specs: List[PassSpec], rep: FusionReport, fake_mode):
        """Every pass, each validated and rolled back on its own; anything unexpected restores the whole graph."""
        opts = self.options
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
            if watch.attempts and not watch.install_bounds():
                raise _Unsound(f"fake propagation of the graph as Dynamo gave it would add a shape guard: "
                               f"{watch.describe()}; no pass ran")
            ctx = PassContext(rep, opts, fake_mode, root=gm, can_substitute_outputs=self.can_substitute_outputs)
            baselines = {m: output_signature(m) for _, m in graph_modules(gm)}
            ctx.verify = _verify_reference(gm, example_inputs, rep) if opts.verify else None
            for spec in specs:
                self._run_one(gm, spec, ctx, fake_mode, baselines)
            return ctx.substitutions
        except FxFuseError as e:
            if opts.strict and not isinstance(e, _Unsound):
                raise raised_through_dynamo(e) from None
            problem, loc = str(e), "<fxfuse>"
        except Exception as e:
            problem = f"fxfuse's own analysis failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            node = getattr(e, "node", None)
            loc = locate(node) if node is not None else raise_site(e)
            if isinstance(e, PropagationError) and node is not None:
                problem += f" at {describe_node(node)}"
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

    def _run_one(self, gm, spec: PassSpec, ctx: PassContext, fake_mode, baselines) -> int:
        """One pass with snapshot, validation and rollback. Returns the sites it changed (0 if rolled back).

        Validation runs whenever the graph changed, whatever the pass returned; a pass that raises, returns something
        other than an int, breaks fake propagation, changes an output, or would add a guard on a symbolic size is
        rolled back to the exact graph it started from.
        """
        snapshot = GraphSnapshot(gm)
        before = NodeState(gm)
        ctx.begin(spec.name)
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
                    raise TypeError(f"pass {spec.name!r} returned {changed!r}; a pass must return the number of "
                                    f"sites it changed (an int)")
                problem = None
                graph_changed = before.changed(gm)
                if graph_changed or changed or ctx.pending_substitutions:
                    problem, culprit = _check(gm, ctx, fake_mode, before, baselines)
                    if problem is None and ctx.verify is not None:
                        problem = _verify(gm, ctx, spec.name)
                        if problem is not None:  # point at the first node the pass created or changed
                            culprit = next((n for _, m in graph_modules(gm) for n in m.graph.nodes
                                            if n.op != "output" and before.dirty(m, n)), None)
            except Exception as e:
                changed, raised = 0, True
                problem = f"the pass raised {type(e).__name__}: {e}"
                loc = raise_site(e)
            finally:
                ctx.report.pass_ms[spec.name] = ctx.report.pass_ms.get(spec.name, 0.0) + \
                    (time.perf_counter() - t0) * 1e3
        # a bound that holds now (size >= 1 of a rank's sequence shard) is installed as a guard; anything else
        # (an equality: one length) rolls back
        if problem is None and watch.attempts and not watch.install_bounds():
            problem = ("the rewrite specialised a symbolic size, which would recompile the model for every new "
                       f"length: {watch.describe()}")
        if problem is None:
            if (changed or graph_changed) and not spec.builtin and not ctx.pending_records:
                what = (f"{changed} site(s) rewritten by a user pass" if changed else
                        "the graph was changed by a user pass that returned 0")
                ctx.pending_records.append(SiteRecord(spec.name, FUSED, what, "", "", None, {"sites": int(changed)}))
            for m in ctx.relayouts:  # their new layout is the baseline for the passes after this one
                baselines[m] = output_signature(m)
            ctx.commit()
            if changed:
                ctx.report.passes_run.append(spec.name)
            return int(changed)

        if runs_collectives_inside(gm):
            # fxfuse decides on each rank's graph alone; a rank where this rewrite stayed now runs other collectives
            # than this one (the twenty-seventh session's hang: a guard only rank 1's shapes asked for)
            problem += ("; the rewrite ran collectives of its own (a vocabulary-parallel op): if another rank kept it, "
                        "the ranks' collectives differ and the step hangs or fails with a size mismatch")
        snapshot.restore()  # restored nodes carry the values they had before the pass
        loc = loc or locate(culprit)
        ctx.report.records.append(SiteRecord(spec.name, ROLLED_BACK, spec.name, problem, loc))
        msg = f"fxfuse pass '{spec.name}' was rolled back: {problem}\n  at: {loc}"
        if self.options.strict:
            exc = FxFusePassError if raised else FxFuseValidationError
            raise raised_through_dynamo(exc(msg + "\n  (strict=True: raising instead of falling back to the unfused "
                                                  "graph)"))
        log.warning("%s", msg)
        return 0


def _check(gm, ctx: PassContext, fake_mode, before: NodeState, baselines) -> Tuple[Optional[str], Optional[fx.Node]]:
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
                f"{describe_node(culprit) if culprit is not None else '?'}: "
                f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"), culprit
    try:
        effective = effective_signature(gm, ctx.all_substitutions(), fake_mode)
    except Exception as e:
        return f"an output substitution does not rebuild under FakeTensor: {type(e).__name__}: {e}", None
    live = dict(graph_modules(gm)).values()
    for m, base in baselines.items():
        if m is not gm and (m not in live or m in ctx.relayouts):
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


def _verify(gm, ctx: PassContext, name: str) -> Optional[str]:
    """``verify``: compare the rewritten graph's outputs and gradients with the unfused graph's."""
    from .verify import compare, run_graph

    try:
        got = run_graph(gm, ctx.verify, substitution_fixer(ctx.all_substitutions()))
    except Exception as e:
        return f"verify: the rewritten graph failed to run eagerly ({type(e).__name__}: {e})"
    problem, worst = compare(ctx.verify.result, got, ctx.verify)
    ctx.report.verified[name] = round(worst, 4)
    return f"verify: {problem}" if problem else None


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


def _dump(debug_dir: str, name: str, gm: fx.GraphModule) -> None:
    os.makedirs(debug_dir, exist_ok=True)
    with open(os.path.join(debug_dir, name), "w") as f:
        f.write(gm.print_readable(print_output=False, include_stride=True, include_device=True))
