"""The reports fxfuse published in this process, newest last (what :func:`fxfuse.report` and
:func:`fxfuse.reports` read). The pass manager publishes one :class:`~fxfuse.report.FusionReport` per graph it
runs on; each is also logged through the ``fxfuse`` logger (INFO: a summary line; WARNING: each rollback; DEBUG:
the table).
"""
from __future__ import annotations

import collections
import logging
from typing import Deque, List, Optional

from .report import FusionReport

log = logging.getLogger("fxfuse")

__all__ = ["publish", "published", "latest", "clear"]

_REPORTS: Deque[FusionReport] = collections.deque(maxlen=256)


def publish(rep: FusionReport) -> None:
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


def published() -> List[FusionReport]:
    return list(_REPORTS)


def latest() -> Optional[FusionReport]:
    return _REPORTS[-1] if _REPORTS else None


def clear() -> None:
    _REPORTS.clear()
