"""The fusion report, as data: what fxfuse's passes did to one compiled graph, for people and for tests.

``str(report)`` is the human-readable table; ``report.records`` are :class:`SiteRecord` objects to assert on.
``fxfuse.report()`` / ``fxfuse.reports()`` (in :mod:`fxfuse.api`) return the published ones
(:mod:`fxfuse.report_log` keeps them).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

__all__ = ["SiteRecord", "FusionReport", "FUSED", "SKIPPED", "ROLLED_BACK", "format_bytes"]

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
                f"{len(self.rolled_back)} rolled back; est. {format_bytes(self.saved_bytes)} saved; "
                f"passes took {self.total_pass_ms:.1f} ms over {self.num_nodes} nodes")

    def __str__(self) -> str:
        lines = [self.summary()]
        if not self.records:
            lines.append("  (no site matched any enabled pass: the graph went to Inductor unchanged)")
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
