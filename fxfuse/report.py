"""The fusion report: what fxfuse's passes did to each compiled graph, for people and for tests.

``fxfuse.report()`` returns the :class:`FusionReport` of the most recent graph fxfuse compiled;
``fxfuse.reports()`` every report since the process started (or since :func:`clear_reports`). ``str(report)``
is the human-readable table; ``report.records`` are :class:`SiteRecord` objects to assert on. Each report is also
logged through the ``fxfuse`` logger (INFO: a summary line; DEBUG: the table).
"""
from __future__ import annotations

import collections
import logging
from dataclasses import asdict, dataclass, field
from typing import Deque, Dict, List, Optional

log = logging.getLogger("fxfuse")

__all__ = ["SiteRecord", "FusionReport", "report", "reports", "clear_reports"]

FUSED, SKIPPED, ROLLED_BACK = "fused", "skipped", "rolled_back"


@dataclass
class SiteRecord:
    """One site a pass looked at.

    status: ``fused`` (rewritten), ``skipped`` (matched in part, left to Inductor; ``reason`` says why) or
    ``rolled_back`` (the pass's rewrite was undone by validation or because it raised).
    """

    pass_name: str
    status: str
    op: str
    reason: str = ""
    location: str = ""
    saved_bytes: Optional[int] = None
    detail: Dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass
class FusionReport:
    graph_name: str
    records: List[SiteRecord] = field(default_factory=list)
    pass_ms: Dict[str, float] = field(default_factory=dict)
    passes_run: List[str] = field(default_factory=list)
    num_nodes: int = 0
    #: ``verify``: per pass, its worst output / gradient difference from the unfused graph, as a fraction of the
    #: tolerance (rolled-back passes are in ``rolled_back``)
    verified: Dict[str, float] = field(default_factory=dict)

    # -- views tests and tools use -------------------------------------------------------------------------
    @property
    def fused(self) -> List[SiteRecord]:
        return [r for r in self.records if r.status == FUSED]

    @property
    def skipped(self) -> List[SiteRecord]:
        return [r for r in self.records if r.status == SKIPPED]

    @property
    def rolled_back(self) -> List[SiteRecord]:
        return [r for r in self.records if r.status == ROLLED_BACK]

    @property
    def saved_bytes(self) -> int:
        return sum(r.saved_bytes or 0 for r in self.fused)

    @property
    def total_pass_ms(self) -> float:
        return sum(self.pass_ms.values())

    def to_dict(self) -> dict:
        return dict(graph_name=self.graph_name, records=[r.to_dict() for r in self.records],
                    pass_ms=dict(self.pass_ms), passes_run=list(self.passes_run), num_nodes=self.num_nodes,
                    verified=dict(self.verified),
                    saved_bytes=self.saved_bytes)

    def summary(self) -> str:
        return (f"fxfuse {self.graph_name}: {len(self.fused)} fused, {len(self.skipped)} skipped, "
                f"{len(self.rolled_back)} rolled back; est. {_fmt_bytes(self.saved_bytes)} saved; "
                f"passes took {self.total_pass_ms:.1f} ms over {self.num_nodes} nodes")

    def __str__(self) -> str:
        lines = [self.summary()]
        if not self.records:
            lines.append("  (no site matched any enabled pass: the graph went to Inductor unchanged)")
        if self.verified:
            lines.append("  verified against the unfused graph (worst difference / tolerance): " +
                         ", ".join(f"{k} {v:.2g}" for k, v in self.verified.items()))
        for r in self.records:
            saved = f", saves ~{_fmt_bytes(r.saved_bytes)}" if r.saved_bytes else ""
            lines.append(f"  [{r.status}] {r.pass_name}: {r.op}{saved}")
            if r.reason:
                lines.append(f"      why: {r.reason}")
            if r.location:
                lines.append(f"      at:  {r.location}")
        return "\n".join(lines)

    __repr__ = summary


_REPORTS: Deque[FusionReport] = collections.deque(maxlen=256)


def _publish(rep: FusionReport) -> None:
    # Several backend calls can share a compile id (DDP's graph splitting hands each bucket's submodule over
    # separately; after torch._dynamo.reset() ids start again at 0/0): every call keeps its own report, named
    # apart.
    same = sum(1 for r in _REPORTS if r.graph_name.split(" #")[0] == rep.graph_name)
    if same:
        rep.graph_name = f"{rep.graph_name} #{same + 1}"
    _REPORTS.append(rep)
    log.info("%s", rep.summary())
    for r in rep.rolled_back:
        log.warning("fxfuse rolled back %s: %s (%s)", r.pass_name, r.reason, r.location)
    log.debug("%s", rep)


_CACHE_HITS_SEEN = 0


def _warn_about_cached_graphs() -> None:
    """Under :func:`fxfuse.install`, torch (2.13) looks a graph up in AOTAutograd's cache *before* Inductor's pre-grad
    passes: on a hit the cached code (fused, as compiled when the cache was filled, and keyed on fxfuse's pass uuid)
    runs, but fxfuse's pass did not run in this process and left no report. Say so instead of showing an empty or
    partial list as if nothing had been fused."""
    global _CACHE_HITS_SEEN
    try:
        from .inductor_hook import installed

        if not installed():
            return
        from torch._dynamo.utils import counters

        hits = int(counters["aot_autograd"].get("autograd_cache_hit", 0))
    except Exception:  # a diagnostic must never break the caller
        return
    if hits > _CACHE_HITS_SEEN:
        import warnings

        warnings.warn(f"fxfuse: {hits - _CACHE_HITS_SEEN} graph(s) compiled since the last call came from AOTAutograd's "
                      "on-disk cache, which torch looks up before Inductor's pre-grad passes: the cached code (fused as "
                      "when it was cached) runs, but fxfuse's passes did not run in this process, so their reports "
                      "are missing here. TORCHINDUCTOR_AUTOGRAD_CACHE=0 recompiles them and brings the reports back.",
                      stacklevel=3)
        _CACHE_HITS_SEEN = hits


def report() -> FusionReport:
    """The report of the most recent graph fxfuse compiled (an empty report if none yet)."""
    _warn_about_cached_graphs()
    if not _REPORTS:
        return FusionReport(graph_name="<nothing compiled with fxfuse yet>")
    return _REPORTS[-1]


def reports() -> List[FusionReport]:
    """Every report since start-up or the last :func:`clear_reports`, oldest first. Under :func:`fxfuse.install`,
    graphs served from AOTAutograd's cache have none (a warning says how many)."""
    _warn_about_cached_graphs()
    return list(_REPORTS)


def clear_reports() -> None:
    _REPORTS.clear()
