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
:func:`clear_reports`, :func:`debug`, :mod:`fxfuse.ops` (fused ops callable directly), the error classes, and
:func:`register_pass` for pass authors. ``python -m fxfuse --help`` lists the command-line tools (demo, report,
doctor).
"""
from __future__ import annotations

import contextlib

from .errors import (FxFuseContractError, FxFuseError, FxFuseOptionsError, FxFusePassError, FxFuseValidationError,
                     PassRegistrationError)
from .registry import PassOption, register_pass, registered_passes
from .report import FusionReport, SiteRecord, clear_reports, report, reports

__version__ = "0.1.0"

__all__ = [
    "compile", "compile_regions", "install", "uninstall", "report", "reports", "clear_reports", "debug", "ops", "register_pass",
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

    from . import backend as _backend

    prev = _backend._DEFAULT_DEBUG_DIR
    _backend._DEFAULT_DEBUG_DIR = dump_dir
    try:
        with depyf.prepare_debug(dump_dir):
            yield
    finally:
        _backend._DEFAULT_DEBUG_DIR = prev


def _import_passes():
    """Import ``fxfuse.passes``. Installed, it is a subpackage; in a source checkout used without installing
    (``PYTHONPATH=.``), the top-level ``passes/`` folder is loaded under that name."""
    import importlib
    import importlib.util
    import os
    import sys

    try:
        return importlib.import_module(f"{__name__}.passes")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.passes":
            raise
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "passes")
    spec = importlib.util.spec_from_file_location(f"{__name__}.passes", os.path.join(src, "__init__.py"),
                                                  submodule_search_locations=[src])
    if spec is None:
        raise PassRegistrationError(f"fxfuse.passes is not installed and {src} does not exist")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# Load the built-in passes now: the registry is checked here, at import, not at first compile.
from . import ops  # noqa: E402,F401
_passes = _import_passes()
passes = _passes

from .api import compile  # noqa: E402  (shadows the builtin inside this package only as fxfuse.compile)
from .inductor_hook import install, uninstall  # noqa: E402
from .regions import compile_regions, undo_compile_regions  # noqa: E402


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
