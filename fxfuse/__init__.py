"""fxfuse: a torch.compile backend that fuses LLM training graphs, validated, in front of Inductor.

    model = torch.compile(model, backend="fxfuse")
    ...
    print(fxfuse.report())

Public API: :func:`report`, :func:`reports`, :func:`clear_reports`, :func:`debug`, :mod:`fxfuse.ops` (fused ops
callable directly), the error classes, and :func:`register_pass` for pass authors.
"""
from __future__ import annotations

import contextlib

from .errors import (FxFuseContractError, FxFuseError, FxFusePassError, FxFuseValidationError,
                     PassRegistrationError)
from .registry import register_pass, registered_passes
from .report import FusionReport, SiteRecord, clear_reports, report, reports

__version__ = "0.1.0"

__all__ = [
    "report", "reports", "clear_reports", "debug", "ops", "register_pass", "registered_passes",
    "FusionReport", "SiteRecord", "FxFuseError", "FxFuseContractError", "FxFusePassError",
    "FxFuseValidationError", "PassRegistrationError", "__version__",
]


@contextlib.contextmanager
def debug(dump_dir: str):
    """Dump everything about the compiles that happen inside the block: depyf's decompiled bytecode and
    Dynamo/joint/forward/backward graphs, plus fxfuse's before/after graphs, reports and Inductor's output code.

    Wrap the first calls of the compiled model (and its backward), not the ``torch.compile`` line.
    """
    import depyf

    from . import backend as _backend

    prev = _backend._DEFAULT_DEBUG_DIR
    _backend._DEFAULT_DEBUG_DIR = dump_dir
    try:
        with depyf.prepare_debug(dump_dir):
            yield
    finally:
        _backend._DEFAULT_DEBUG_DIR = prev


# Load the built-in passes now: the registry is checked here, at import, not at first compile.
from . import passes as _passes  # noqa: E402,F401
from . import ops  # noqa: E402,F401
