"""The fusion report, as data: what fxfuse's passes did to one compiled graph (:class:`FusionReport`) and to a
whole run (:class:`RunReport`: every graph since the last clear), for people and for tests.

``str(report)`` is the human-readable table; ``report.records`` are :class:`SiteRecord` objects to assert on.
``fxfuse.report()`` (the run) / ``fxfuse.reports()`` (one per graph) in :mod:`fxfuse.api` return the published
ones (:mod:`fxfuse.report_log` keeps them).
"""
from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

__all__ = ["SiteRecord", "FusionReport", "RunReport", "FUSED", "SKIPPED", "ROLLED_BACK", "format_bytes"]

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


def format_bytes(n: Optional[int]) -> str:
    """``1.5 MiB``-style size (``-`` for None)."""
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
    #: what lowered the graph after the passes: "inductor", "aot_eager" (the option), or "aot_eager: <why>" where
    #: compiler="auto" found nothing left for Inductor to generate (fxfuse.lowering); "" before lowering / installed
    lowering: str = ""

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
                    verified=dict(self.verified), lowering=self.lowering,
                    saved_bytes=self.saved_bytes)

    @classmethod
    def from_dict(cls, d: dict) -> "FusionReport":
        """The report :meth:`to_dict` gave (``debug_dir`` keeps one per graph as ``*.report.json``)."""
        return cls(graph_name=d["graph_name"], records=[SiteRecord(**r) for r in d.get("records", [])],
                   pass_ms=dict(d.get("pass_ms", {})), passes_run=list(d.get("passes_run", [])),
                   num_nodes=int(d.get("num_nodes", 0)), verified=dict(d.get("verified", {})),
                   lowering=str(d.get("lowering", "")))

    def summary(self) -> str:
        return (f"fxfuse {self.graph_name}: {len(self.fused)} fused, {len(self.skipped)} skipped, "
                f"{len(self.rolled_back)} rolled back; est. {format_bytes(self.saved_bytes)} saved; "
                f"passes took {self.total_pass_ms:.1f} ms over {self.num_nodes} nodes")

    def __str__(self) -> str:
        lines = [self.summary()]
        if not self.records:
            lines.append("  (no site matched any enabled pass: the graph went to Inductor unchanged)")
        if self.lowering.startswith("aot_eager: "):
            lines.append(f"  lowered without Inductor: {self.lowering[len('aot_eager: '):]}")
        elif self.lowering.startswith("inductor from a background") or self.lowering.startswith("inductor, at once"):
            lines.append(f"  lowered by {self.lowering}")
        if self.verified:
            lines.append("  verified against the unfused graph (worst difference / tolerance): " +
                         ", ".join(f"{k} {v:.2g}" for k, v in self.verified.items()))
        for r in self.records:
            saved = f", saves ~{format_bytes(r.saved_bytes)}" if r.saved_bytes else ""
            lines.append(f"  [{r.status}] {r.pass_name}: {r.op}{saved}")
            if r.reason:
                lines.append(f"      why: {r.reason}")
            if r.location:
                lines.append(f"      at:  {r.location}")
        return "\n".join(lines)

    __repr__ = summary


@dataclass
class RunReport(FusionReport):
    """Every graph fxfuse compiled since the last :func:`fxfuse.clear_reports` as one report: the sites of all
    graphs (``records``, ``fused``, ... as on a graph's report), counted by pass in ``str()``; the per-graph reports
    in ``graphs``. ``cached_graphs``: graphs torch served from its compile cache under :func:`fxfuse.install`
    (their code was compiled with fxfuse's passes when it was cached; their sites were reported then, not in this
    process)."""

    graphs: List[FusionReport] = field(default_factory=list)
    cached_graphs: int = 0

    @classmethod
    def of(cls, graphs: List[FusionReport], cached_graphs: int = 0) -> "RunReport":
        run = cls(graph_name="run", graphs=list(graphs), cached_graphs=cached_graphs)
        for g in graphs:
            run.records.extend(g.records)
            for k, ms in g.pass_ms.items():
                run.pass_ms[k] = run.pass_ms.get(k, 0.0) + ms
            run.passes_run.extend(p for p in g.passes_run if p not in run.passes_run)
            run.num_nodes += g.num_nodes
            for k, v in g.verified.items():
                run.verified[k] = max(v, run.verified.get(k, v))
        return run

    def by_pass(self) -> Dict[str, Dict[str, int]]:
        """{pass: {status: sites}} over the run."""
        out: Dict[str, Dict[str, int]] = {}
        for r in self.records:
            out.setdefault(r.pass_name, collections.Counter())[r.status] += 1
        return {k: dict(v) for k, v in out.items()}

    def to_dict(self) -> dict:
        d = super().to_dict()
        d.update(graphs=[g.to_dict() for g in self.graphs], cached_graphs=self.cached_graphs, by_pass=self.by_pass())
        return d

    def summary(self) -> str:
        n, c = len(self.graphs), self.cached_graphs
        if not n and not c:
            return "fxfuse run: nothing compiled with fxfuse since the last clear"
        parts = []
        if n or not c:
            parts.append(f"{n} graph{'s' if n != 1 else ''} compiled: {len(self.fused)} fused, {len(self.skipped)} "
                         f"skipped, {len(self.rolled_back)} rolled back; est. {format_bytes(self.saved_bytes)} saved; "
                         f"passes took {self.total_pass_ms:.1f} ms")
        if c:
            parts.append(f"{c} graph{'s' if c != 1 else ''} from torch's compile cache: compiled with fxfuse's passes "
                         f"when cached (their sites were reported then; TORCHINDUCTOR_AUTOGRAD_CACHE=0 recompiles and "
                         f"reports them)")
        return "fxfuse run: " + "; ".join(parts)

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.records:
            lines.append("  by pass:")
            for name, counts in sorted(self.by_pass().items()):
                parts = [f"{counts[st]} {st.replace('_', ' ')}" for st in (FUSED, SKIPPED, ROLLED_BACK) if counts.get(st)]
                lines.append(f"    {name}: {', '.join(parts)}")
                reasons = collections.Counter(r.reason for r in self.records
                                              if r.pass_name == name and r.status != FUSED and r.reason)
                for why, k in reasons.most_common(3):
                    lines.append(f"      {k} x {why}")
        for r in self.rolled_back:  # few, and each one is a rewrite fxfuse undid: always in full
            lines.append(f"  [{r.status}] {r.pass_name}: {r.op}")
            if r.reason:
                lines.append(f"      why: {r.reason}")
            if r.location:
                lines.append(f"      at:  {r.location}")
        if self.graphs:
            lines.append("  graphs (per-site detail: fxfuse.reports()):")
            lines.extend(f"    {g.summary()}" for g in self.graphs)
        return "\n".join(lines)

    __repr__ = summary
