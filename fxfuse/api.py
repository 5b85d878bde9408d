"""The user-facing entry functions: ``fxfuse.compile`` and the published fusion reports.

``fxfuse.compile``: ``torch.compile(model, backend="fxfuse", ...)`` with the options checked at the call.

Why a wrapper: ``torch.compile`` hands ``options`` to the backend only at the first forward, inside Dynamo, so a
misspelt option would surface in the middle of the first training step (and wrapped in Dynamo's errors). Here
they are checked by :meth:`fxfuse.options.FxFuseOptions.parse` before anything is compiled, and fxfuse's own
options can be given as keyword arguments.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Union

import torch

from . import report_log
from .inductor_hook import installed
from .options import FXFUSE_KEYS, FxFuseOptions, FxFuseOptionsError, did_you_mean, merge_option_kwargs
from .report import FusionReport, RunReport

__all__ = ["compile", "report", "reports", "clear_reports"]

_TORCH_COMPILE_KWARGS = ("mode", "dynamic", "fullgraph", "options", "disable")
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _known_modes():
    try:
        return tuple(torch._inductor.list_mode_options())
    except Exception:
        return _MODES


def compile(model: Optional[Callable] = None, *, mode: Optional[str] = None, dynamic: Optional[bool] = None,
            fullgraph: bool = False, options: Optional[Dict[str, Any]] = None, disable: bool = False,
            **fxfuse_options: Any) -> Union[Callable, Callable[[Callable], Callable]]:
    """``torch.compile(model, backend="fxfuse", mode=..., dynamic=..., fullgraph=..., options=...)``, with every
    option checked now (an :class:`fxfuse.FxFuseError` here, not at the first forward).

    fxfuse's own options (``passes``, ``pass_options``, ``strict``, ``verify``, ``extra_passes``, ``debug_dir``,
    ``compiler``) may be keyword arguments, merged into ``options``::

        model = fxfuse.compile(model, strict=True, pass_options={"linear_cross_entropy": {"chunk_bytes": 1 << 30}})

    ``mode`` together with options (which ``torch.compile`` refuses) is turned into the Inductor settings the
    mode stands for, as the backend would apply them. Without ``model`` it returns a decorator, like
    ``torch.compile``.
    """
    if "backend" in fxfuse_options:
        raise FxFuseOptionsError("fxfuse.compile() always compiles with backend='fxfuse'; for another backend call "
                                 "torch.compile")
    unknown = [k for k in fxfuse_options if k not in FXFUSE_KEYS]
    if unknown:
        k = unknown[0]
        hint = did_you_mean(k, list(FXFUSE_KEYS) + list(_TORCH_COMPILE_KWARGS))
        raise FxFuseOptionsError(f"fxfuse.compile() got an unknown keyword {k!r}" + (f"; {hint}" if hint else "")
                                 + f" (fxfuse's options: {', '.join(FXFUSE_KEYS)}; Inductor settings go in "
                                   f"options={{...}})")
    merged = merge_option_kwargs("fxfuse.compile", options, fxfuse_options)
    if not disable:  # Inductor's per-process key, hashed while the caller goes on to its first step
        from .lowering import prefetch_inductor_cache_keys

        prefetch_inductor_cache_keys()
    if FxFuseOptions.parse(merged).background_compile and not disable:
        from .background_inductor import start_background_compile_process

        start_background_compile_process()  # the compile process imports torch while the caller goes on
    if mode is not None:
        modes = _known_modes()
        if mode not in modes:
            hint = did_you_mean(mode, modes)
            raise FxFuseOptionsError(f"fxfuse.compile(): unknown mode {mode!r}" + (f"; {hint}" if hint else "")
                                     + f" (modes: {', '.join(modes)})")
        if merged:  # torch.compile takes mode or options: spell the mode out as the options it stands for
            merged = {**torch._inductor.list_mode_options(mode), **merged}
            FxFuseOptions.parse(merged)
            mode = None
    kwargs = dict(backend="fxfuse", mode=mode, options=merged or None, dynamic=dynamic, fullgraph=fullgraph,
                  disable=disable)
    if model is None:
        return lambda fn: torch.compile(fn, **kwargs)
    return torch.compile(model, **kwargs)


# ---------------------------------------------------------------------------------------------------- reports
_cache_hits_seen = 0  # AOTAutograd cache hits already warned about
_cache_hits_at_clear = 0  # ... at the last clear_reports(): the run's cached graphs are the hits since


def _aot_cache_hits() -> int:
    """AOTAutograd cache hits in this process under :func:`fxfuse.install` (0 otherwise: with backend="fxfuse" the
    passes run before any cache lookup, so every graph has its report)."""
    try:
        if not installed():
            return 0
        from torch._dynamo.utils import counters

        from . import background_inductor  # its switches hit the cache by design, for graphs with reports

        hits = int(counters["aot_autograd"].get("autograd_cache_hit", 0))
        return hits - background_inductor.aot_cache_hits_of_switches
    except Exception:  # a diagnostic must never break the caller
        return 0


def _warn_about_cached_graphs() -> None:
    """Under :func:`fxfuse.install`, torch (2.13) looks a graph up in AOTAutograd's cache *before* Inductor's pre-grad
    passes: on a hit the cached code (compiled with fxfuse's passes, whose uuid is part of the cache key) runs, but
    fxfuse's passes did not run in this process and left no per-site report. Say so once per new hit."""
    global _cache_hits_seen
    hits = _aot_cache_hits()
    if hits > _cache_hits_seen:
        warnings.warn(f"fxfuse: {hits - _cache_hits_seen} graph(s) compiled since the last call came from AOTAutograd's "
                      "on-disk cache, which torch looks up before Inductor's pre-grad passes: the cached code "
                      "(compiled with fxfuse's passes when it was cached) runs, but the passes did not run in this "
                      "process, so those graphs have no per-site report here. TORCHINDUCTOR_AUTOGRAD_CACHE=0 "
                      "recompiles them and brings the reports back.", stacklevel=3)
        _cache_hits_seen = hits


def report() -> RunReport:
    """The whole run: every graph fxfuse compiled since start-up or the last :func:`clear_reports`, its sites fused,
    skipped and rolled back counted by pass (``print(fxfuse.report())``), the per-graph reports in ``.graphs`` and
    :func:`reports`. Graphs served from torch's compile cache under :func:`fxfuse.install` are counted apart
    (``cached_graphs``): their code is fxfuse's, their sites were reported when they were compiled."""
    _warn_about_cached_graphs()
    return RunReport.of(report_log.published(), max(0, _aot_cache_hits() - _cache_hits_at_clear))


def reports() -> List[FusionReport]:
    """One report per graph since start-up or the last :func:`clear_reports`, oldest first. Under
    :func:`fxfuse.install`, graphs served from AOTAutograd's cache have none (a warning says how many)."""
    _warn_about_cached_graphs()
    return report_log.published()


def clear_reports() -> None:
    """Forget the published reports (and the cache hits counted so far): :func:`report` starts a new run."""
    global _cache_hits_at_clear
    report_log.clear()
    _cache_hits_at_clear = _aot_cache_hits()
