"""Run fxfuse's passes from inside Inductor, for code that compiles with ``backend="inductor"`` and cannot be told
otherwise.

HF ``TrainingArguments(torch_compile=True)`` makes accelerate call ``torch.compile(model, backend="inductor")``,
and ``torch_compile_backend="fxfuse"`` is refused by accelerate's closed list of backend names. Inductor has one
documented extension point that sees the same graph fxfuse's backend sees (the Dynamo graph, torch IR, before
autograd): ``torch._inductor.config.pre_grad_custom_pass``. :func:`install` puts a
:class:`~torch._inductor.custom_graph_pass.CustomGraphPass` there that runs the backend's own pipeline
(:class:`fxfuse.pass_manager.PassManager`: every enabled pass, validated, rolled back on its own) and publishes
the fusion report as usual (``fxfuse.report()`` / ``fxfuse.reports()``)::

    import fxfuse
    fxfuse.install()                      # or: with fxfuse.install(strict=True): ...
    trainer = Trainer(model, TrainingArguments(torch_compile=True, ...), ...)
    trainer.train()
    print(fxfuse.reports())
    fxfuse.uninstall()

Differences from ``torch.compile(model, backend="fxfuse")``:

* A graph can only be rewritten in place from inside Inductor: outputs cannot be substituted around the
  compiled function. So logits the model returns are always real tensors (``linear_cross_entropy``'s
  ``logits="materialize"``, forced for every pass that declares a ``logits`` option; ``linear_log_probs`` never
  substitutes outputs): the loss is still fused, but the lm-head projection also runs once for the returned logits.
* Only fxfuse's own options apply (Inductor's settings belong to whoever calls ``torch.compile``; ``compiler`` is
  Inductor by construction).
* With Inductor's FX-graph / AOTAutograd caches on, a cache hit skips pre-grad passes (the cached code already
  has the fusions): such a graph gets no new report. The pass's ``uuid()`` is fxfuse's source hash plus its
  options, so an edit of fxfuse or other options is a cache miss.
* Graphs are recognised by the markers Dynamo puts on the module it hands to a backend; graphs split by Dynamo's
  DDP optimizer lack them and are left alone (compile with ``backend="fxfuse"`` there).

The pass composes with a ``pre_grad_custom_pass`` the user set before: both run (theirs first), and
:func:`uninstall` puts theirs back. The same goes for fxfuse's post-partition steps, added to
``post_grad_custom_post_pass`` (the host-offload round trips folded,
:func:`fxfuse.ops.host_offload.fold_round_trips`, and tensor parallelism's all-reduces merged as the
``tp_all_reduce_blocks`` option says, :mod:`fxfuse.comm_overlap`). A torch without this hook is refused with an :class:`FxFuseError`.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch

from . import registry
from .errors import FxFuseError
from .options import FXFUSE_KEYS, FxFuseOptions, FxFuseOptionsError, did_you_mean, merge_option_kwargs
from .pass_manager import PASSES_RAN, PassManager, source_hash

log = logging.getLogger("fxfuse")

__all__ = ["install", "uninstall", "installed", "Installation"]

# options of the backend's own compile path (install() only adds passes to whoever compiles)
_NOT_IN_INSTALLED_MODE = ("compiler", "background_compile")


def _hook_support() -> Optional[str]:
    """None if this torch can run fxfuse from Inductor's pre-grad hook, else why not."""
    import torch._inductor.config as ic

    if not hasattr(ic, "pre_grad_custom_pass"):
        return f"torch {torch.__version__} has no torch._inductor.config.pre_grad_custom_pass"
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch._inductor.custom_graph_pass.CustomGraphPass"
    if not getattr(ic, "use_pre_grad_passes", True):
        return "Inductor's pre-grad passes are off (torch._inductor.config.use_pre_grad_passes = False)"
    return None


def _installed_options(options: Dict[str, Any]) -> FxFuseOptions:
    """Checked options for installed mode: fxfuse's keys only, and materialised logits for every pass that can
    return lazy ones (an output substitution cannot be applied from inside Inductor)."""
    for key in options:
        if key in _NOT_IN_INSTALLED_MODE:
            raise FxFuseOptionsError(f"fxfuse.install(): {key!r} does not apply (Inductor compiles the graph)")
        if key not in FXFUSE_KEYS:
            hint = did_you_mean(key, FXFUSE_KEYS)
            raise FxFuseOptionsError(
                f"fxfuse.install(): unknown option {key!r}" + (f"; {hint}" if hint else "")
                + f"; it takes fxfuse's options ({', '.join(k for k in FXFUSE_KEYS if k not in _NOT_IN_INSTALLED_MODE)})"
                  f"; Inductor's settings are set on torch._inductor.config or by whoever calls torch.compile")
    opts = FxFuseOptions.parse(options)
    for spec in registry.registered_passes():
        logits = spec.options.get("logits")
        if logits is None or not logits.choices or "materialize" not in logits.choices:
            continue
        given = opts.pass_options.get(spec.name, {}).get("logits")
        if given not in (None, "materialize"):
            raise FxFuseOptionsError(
                f"fxfuse.install(): pass_options[{spec.name!r}]['logits'] = {given!r} is not possible from inside "
                f"Inductor (returned logits are always materialised there); use torch.compile(model, "
                f"backend='fxfuse') for lazy logits")
        opts.pass_options.setdefault(spec.name, {})["logits"] = "materialize"
    return opts


def _is_dynamo_graph(gm: Any) -> bool:
    """Whether ``gm`` is the module Dynamo handed to the backend (not an activation-checkpoint or other
    higher-order-op body, which Inductor's pre-grad passes visit separately first; fxfuse's passes recurse into
    those bodies from the root)."""
    return isinstance(gm, torch.fx.GraphModule) and (
        hasattr(gm, "compile_subgraph_reason") or "dynamo_compile_id" in getattr(gm, "meta", {}))


def _make_pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class FxFusePreGradPass(CustomGraphPass):
        """fxfuse's passes as an Inductor pre-grad custom pass (see :mod:`fxfuse.inductor_hook`)."""

        def __init__(self, options: Dict[str, Any], opts: FxFuseOptions, previous: Any = None):
            self.options = dict(options)
            self.opts = opts
            self.previous = previous  # a user pass set before install() on a torch without pass lists: run first

        def __call__(self, graph: torch.fx.Graph) -> None:
            if self.previous is not None:
                self.previous(graph)
            gm = graph.owning_module
            if not _is_dynamo_graph(gm):
                return
            if gm.meta.get(PASSES_RAN):  # compiled through backend="fxfuse": its passes already ran
                return
            run_passes_in_inductor(gm, self.opts)

        def uuid(self) -> Any:
            key = _manager(self.opts).uuid()
            if key is None:
                return None  # a user pass whose code cannot be fingerprinted: no caching
            prev = None
            if self.previous is not None:
                prev = self.previous.uuid() if isinstance(self.previous, CustomGraphPass) else None
                if prev is None:
                    return None
            return ("fxfuse-pre-grad", *key, prev)

        def __reduce__(self):
            return _pickled_as_key, (_cache_key(self),)

    return FxFusePreGradPass


def _cache_key(graph_pass: Any) -> Any:
    """What a pass of this module pickles as: its ``uuid()`` (a fresh object when it has none, so that no two
    compiles share a cache entry)."""
    key = graph_pass.uuid()
    return key if key is not None else ("uncacheable", object().__repr__())


def _pickled_as_key(key: Any) -> Any:
    # Inductors that pickle their config to key the graph cache pickle the installed passes too (torch 2.11 logged
    # "Can't pickle local object '_make_pass_class.<locals>.FxFusePreGradPass'" from its cache on the GPU; 2.13 asks
    # the pass's uuid() instead). A class made inside a function cannot be pickled, so these pickle as their key,
    # which is what a cache key needs; unpickled they are that key, not a pass.
    return key


def _make_fold_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class FxFusePostGradFold(CustomGraphPass):
        """fxfuse's post-partition steps, as an Inductor post-grad pass: the host-offload round trips folded
        (:func:`fxfuse.ops.host_offload.fold_round_trips`) and tensor parallelism's all-reduces merged / split as
        ``tp_all_reduce_blocks`` says (:mod:`fxfuse.comm_overlap`). Under ``backend="fxfuse"`` the backend's own
        post-grad pass does both as well; each is idempotent, so running after this one changes nothing more."""

        def __init__(self, previous: Any = None, tp_all_reduce_blocks: int = 1):
            self.previous = previous  # a user pass set before install() on a torch without pass lists: run first
            self.tp_all_reduce_blocks = tp_all_reduce_blocks

        def __call__(self, graph: torch.fx.Graph) -> None:
            from .comm_overlap import rewrite_tp_all_reduces
            from .ops.host_offload import fold_round_trips

            if self.previous is not None:
                self.previous(graph)
            fold_round_trips(graph)
            rewrite_tp_all_reduces(graph, self.tp_all_reduce_blocks)

        def uuid(self) -> Any:
            prev = None
            if self.previous is not None:
                prev = self.previous.uuid() if isinstance(self.previous, CustomGraphPass) else None
                if prev is None:
                    return None
            return ("fxfuse-post-grad-fold", source_hash(), prev, self.tp_all_reduce_blocks)

        def __reduce__(self):
            return _pickled_as_key, (_cache_key(self),)

    return FxFusePostGradFold


_PASS_CLASS = None


def _pass_class():
    global _PASS_CLASS
    if _PASS_CLASS is None:
        _PASS_CLASS = _make_pass_class()
    return _PASS_CLASS


def run_passes_in_inductor(gm: torch.fx.GraphModule, opts: FxFuseOptions) -> None:
    """fxfuse's pipeline on the Dynamo graph Inductor is about to lower, in place (no output substitution from
    here); example inputs are the placeholders' fake values and the fake mode is the compile's."""
    from torch._guards import TracingContext

    tc = TracingContext.try_get()
    fake_mode = tc.fake_mode if tc is not None else None
    example_inputs = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]
    _manager(opts).run(gm, example_inputs, fake_mode)


def _manager(opts: FxFuseOptions) -> PassManager:
    return PassManager(opts, entry_point="fxfuse.install", can_substitute_outputs=False)


class Installation:
    """What :func:`install` returns: :meth:`uninstall` it, or use it as a context manager (uninstalled on exit)."""

    def __init__(self, hook: Any):
        self.hook = hook

    @property
    def options(self) -> Dict[str, Any]:
        return dict(self.hook.options)

    def uninstall(self) -> bool:
        return uninstall()

    def __enter__(self) -> "Installation":
        return self

    def __exit__(self, *exc) -> None:
        uninstall()

    def __repr__(self) -> str:
        return f"<fxfuse installed in Inductor, options {self.hook.options}>"


_INSTALLED: Optional[Any] = None  # our pass object while installed
_PREVIOUS: Any = None  # what config.pre_grad_custom_pass held before install()
_INSTALLED_POST: Optional[Any] = None  # our post-grad fold while installed
_PREVIOUS_POST: Any = None  # what config.post_grad_custom_post_pass held before install()
_OVERLAP_SET: Dict[str, Any] = {}  # the scheduler settings install() set for comm_overlap: {name: value before}


def _supports_pass_lists() -> bool:
    import torch._inductor.custom_graph_pass as cgp

    return hasattr(cgp, "get_custom_graph_passes")


def install(options: Optional[Dict[str, Any]] = None, **fxfuse_options: Any) -> Installation:
    """Make Inductor (``torch.compile(..., backend="inductor")``, the default) run fxfuse's passes on every graph
    it compiles from now on, until :func:`uninstall`.

    ``options`` / keyword arguments: fxfuse's own options (``passes``, ``pass_options``, ``strict``, ``verify``,
    ``extra_passes``, ``debug_dir``), checked now. Calling it again replaces the options. A pass the user set in
    ``torch._inductor.config.pre_grad_custom_pass`` keeps running, before fxfuse's. Raises :class:`FxFuseError`
    where this torch has no such hook. Returns an :class:`Installation` (also a context manager).
    """
    global _INSTALLED, _PREVIOUS, _INSTALLED_POST, _PREVIOUS_POST
    import torch._inductor.config as ic

    from .ops.trl_fused_head import install_trl_shim

    install_trl_shim()  # TRL's fused lm-head as one node (a no-op without TRL)
    why = _hook_support()
    if why:
        raise FxFuseError(f"fxfuse.install() is not possible here: {why}; compile with torch.compile(model, "
                          f"backend='fxfuse') instead")
    merged = merge_option_kwargs("fxfuse.install", options, fxfuse_options)
    opts = _installed_options(merged)
    cls = _pass_class()
    current = ic.pre_grad_custom_pass
    if _INSTALLED is not None and _contains(current, _INSTALLED):
        _INSTALLED.options, _INSTALLED.opts = merged, opts  # re-install: new options, same place
        if _INSTALLED_POST is not None:
            _INSTALLED_POST.tp_all_reduce_blocks = opts.tp_all_reduce_blocks
        _set_overlap(opts.comm_overlap)
        return Installation(_INSTALLED)
    hook = _place("pre_grad_custom_pass", lambda previous: cls(merged, opts, previous=previous))
    _INSTALLED, _PREVIOUS = hook, current
    if hasattr(ic, "post_grad_custom_post_pass"):
        post_current = ic.post_grad_custom_post_pass
        fold_cls = _make_fold_class()
        _INSTALLED_POST = _place("post_grad_custom_post_pass",
                                 lambda previous: fold_cls(previous, opts.tp_all_reduce_blocks))
        _PREVIOUS_POST = post_current
    _set_overlap(opts.comm_overlap)
    return Installation(hook)


def _set_overlap(on: bool) -> None:
    """``comm_overlap`` under install(): Inductor's compute / collective reordering for every graph it compiles
    (a graph without collectives keeps its order; :mod:`fxfuse.comm_overlap`), unless the user set it; off, what
    install() set is put back."""
    import torch._inductor.config as ic

    from .comm_overlap import overlap_config_patches

    if not on:
        _restore_overlap()
        return
    if _OVERLAP_SET:
        return
    for name, value in overlap_config_patches({}).items():
        _OVERLAP_SET[name] = getattr(ic, name)
        setattr(ic, name, value)


def _restore_overlap() -> None:
    import torch._inductor.config as ic

    for name, before in _OVERLAP_SET.items():
        setattr(ic, name, before)
    _OVERLAP_SET.clear()


def _place(name: str, make: Any) -> Any:
    """Add the pass ``make(previous)`` to Inductor's config ``name`` beside what the user set there: in a list where
    this torch takes lists, else wrapping theirs (it runs it first). Returns the pass."""
    import torch._inductor.config as ic

    current = getattr(ic, name)
    if current is not None and _supports_pass_lists():
        hook = make(None)
        setattr(ic, name, [*current, hook] if isinstance(current, (list, tuple)) else [current, hook])
    else:
        hook = make(current)
        setattr(ic, name, hook)
    return hook


def _contains(config_value: Any, hook: Any) -> bool:
    if isinstance(config_value, (list, tuple)):
        return any(p is hook for p in config_value)
    return config_value is hook


def installed() -> bool:
    """Whether fxfuse's pass is in ``torch._inductor.config.pre_grad_custom_pass`` now."""
    import torch._inductor.config as ic

    return _INSTALLED is not None and _contains(ic.pre_grad_custom_pass, _INSTALLED)


def uninstall() -> bool:
    """Take fxfuse's passes out of Inductor's pre-grad (and post-grad) hooks; a pass the user had set there before
    :func:`install` stays (as it was). Returns whether anything was removed."""
    global _INSTALLED, _PREVIOUS, _INSTALLED_POST, _PREVIOUS_POST

    hook, previous, post, post_previous = _INSTALLED, _PREVIOUS, _INSTALLED_POST, _PREVIOUS_POST
    _INSTALLED = _PREVIOUS = _INSTALLED_POST = _PREVIOUS_POST = None
    _restore_overlap()
    if post is not None:
        _remove("post_grad_custom_post_pass", post, post_previous)
    if hook is None:
        return False
    return _remove("pre_grad_custom_pass", hook, previous)


def _remove(name: str, hook: Any, previous: Any) -> bool:
    import torch._inductor.config as ic

    current = getattr(ic, name)
    if current is hook:
        setattr(ic, name, hook.previous)
        return True
    if isinstance(current, (list, tuple)) and any(p is hook for p in current):
        rest = [p for p in current if p is not hook]
        if previous is not None and not isinstance(previous, (list, tuple)) and rest == [previous]:
            setattr(ic, name, previous)  # exactly what the user had
        else:
            setattr(ic, name, type(current)(rest) if rest else None)
        return True
    log.warning("fxfuse.uninstall(): torch._inductor.config.%s was changed since fxfuse.install() and no longer "
                "holds fxfuse's pass; left as it is", name)
    return False
    current = ic.pre_grad_custom_pass
    if current is hook:
        ic.pre_grad_custom_pass = hook.previous
        return True
    if isinstance(current, (list, tuple)) and any(p is hook for p in current):
        rest = [p for p in current if p is not hook]
        if previous is not None and not isinstance(previous, (list, tuple)) and rest == [previous]:
            ic.pre_grad_custom_pass = previous  # exactly what the user had
        else:
            ic.pre_grad_custom_pass = type(current)(rest) if rest else None
        return True
    log.warning("fxfuse.uninstall(): torch._inductor.config.pre_grad_custom_pass was changed since "
                "fxfuse.install() and no longer holds fxfuse's pass; left as it is")
    return False
