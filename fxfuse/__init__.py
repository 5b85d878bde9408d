"""fxfuse: a torch.compile backend that fuses LLM training graphs, validated, in front of Inductor.

    model = fxfuse.compile(model, strict=True)         # = torch.compile(model, backend="fxfuse", options=...),
    ...                                                 #   options checked here rather than at the first forward
    print(fxfuse.report())

    model = torch.compile(model, backend="fxfuse")     # the same, options checked at the first forward

    model = fxfuse.compile_regions(model)              # block by block (FSDP2, torchtitan style), hooks eager

    fxfuse.install()                                   # code that compiles with Inductor itself (HF Trainer's
    ...                                                #   TrainingArguments(torch_compile=True)) runs fxfuse too
    fxfuse.uninstall()

Public API: :func:`compile`, :func:`compile_regions`, :func:`install` / :func:`uninstall`, :func:`report`, :func:`reports`,
:func:`clear_reports`, :func:`debug`, :func:`wait_for_background_compiles` / :func:`background_compiles` /
:func:`start_background_compile_process` (the ``background_compile`` option), :mod:`fxfuse.ops` (fused ops callable
directly), the error classes, and :func:`register_pass` for pass authors. ``python -m fxfuse --help`` lists the
command-line tools (demo, report, doctor).
"""
from __future__ import annotations

import contextlib

from .errors import (FxFuseContractError, FxFuseError, FxFuseOptionsError, FxFusePassError, FxFuseValidationError,
                     PassRegistrationError)
from .registry import PassOption, register_pass, registered_passes
from .report import FusionReport, SiteRecord
from .version import __version__

# The fused ops and the built-in passes load now: the pass registry is checked at import, not at the first compile.
# ``fxfuse.passes`` is the top-level passes/ folder, installed under that name by the packaging configuration.
from . import ops  # noqa: E402,F401

try:
    from . import passes  # noqa: E402,F401
except ImportError:
    import importlib.util as _util

    if _util.find_spec(f"{__name__}.passes") is not None:
        raise
    # a source tree put on sys.path without installing it: say how to fix it
    raise ImportError("fxfuse.passes is not installed: the top-level passes/ folder becomes fxfuse.passes through "
                      "the packaging configuration, so install the checkout first (pip install -e .)") from None

from .api import clear_reports, compile, report, reports  # noqa: E402  (compile: fxfuse.compile, not the builtin)
from .inductor_hook import install, uninstall  # noqa: E402
from .regions import compile_regions, undo_compile_regions  # noqa: E402
from .background_inductor import (  # noqa: E402
    background_compiles, start_background_compile_process, wait_for_background_compiles)
from .ops.trl_fused_head import install_trl_shim_on_import as _install_trl_shim  # noqa: E402

# TRL's fused lm-head becomes one graph node instead of a graph break (fxfuse.ops.trl_fused_head): now if TRL's
# trainers are imported, else as soon as they are.
_install_trl_shim()

__all__ = [
    "compile", "compile_regions", "undo_compile_regions", "install", "uninstall", "report", "reports", "clear_reports", "debug", "ops", "register_pass",
    "background_compiles", "start_background_compile_process", "wait_for_background_compiles",
    "registered_passes", "PassOption", "FusionReport", "SiteRecord", "FxFuseError", "FxFuseContractError",
    "FxFusePassError", "FxFuseValidationError", "FxFuseOptionsError", "PassRegistrationError", "__version__",
]


@contextlib.contextmanager
def debug(dump_dir: str):
    """Dump everything about the compiles that happen inside the block: depyf's decompiled bytecode and
    Dynamo/joint/forward/backward graphs, plus fxfuse's before/after graphs, reports and Inductor's output code.

    Wrap the first calls of the compiled model (and its backward), not the ``torch.compile`` line.
    """
    import depyf

    from .pass_manager import default_debug_dir

    with default_debug_dir(dump_dir), depyf.prepare_debug(dump_dir):
        yield


def _register_backend_without_entry_point() -> None:
    """Installed, the ``torch_dynamo_backends`` entry point makes ``backend="fxfuse"`` work with no import. In a
    source tree used without installing there is no entry point, so importing fxfuse registers the name; never
    both (torch asserts on a duplicate name when the entry point loads after an import-time registration)."""
    from importlib.metadata import entry_points

    if "fxfuse" in entry_points(group="torch_dynamo_backends").names:
        return
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "fxfuse" not in _COMPILER_FNS:
        from .backend import fxfuse as _fxfuse

        register_backend(compiler_fn=_fxfuse, name="fxfuse")


_register_backend_without_entry_point()
