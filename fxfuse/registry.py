"""The pass registry: complete by construction.

Built-in passes live one per module in the top-level ``passes/`` folder (installed as ``fxfuse.passes``). Each
module registers its pass with :func:`register_pass` at import. :func:`load_pass_package` imports *every* module
of the package and checks, at import time, that each one registered at least one pass and that no two passes
share a name. A broken pass module is therefore a clear :class:`PassRegistrationError` when ``fxfuse`` is
imported, never a ``KeyError`` the first time a user compiles.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch

from .errors import PassRegistrationError

__all__ = ["PassSpec", "register_pass", "load_pass_package", "registered_passes", "get_pass"]


@dataclass(frozen=True)
class PassSpec:
    """A registered graph pass.

    ``fn(gm, ctx) -> int`` rewrites ``gm`` in place (recursing into subgraphs through ``ctx``) and returns the
    number of sites it changed. ``order`` sorts passes; lower runs first.
    """

    name: str
    fn: Callable
    order: int
    description: str
    module: str
    enabled_by_default: bool = True
    builtin: bool = True


_REGISTRY: Dict[str, PassSpec] = {}
_MODULE_OF_PASS: Dict[str, str] = {}
_LOADED_PACKAGES: Dict[str, List[PassSpec]] = {}


def register_pass(name: str, *, order: int, description: str, enabled_by_default: bool = True):
    """Decorator: register ``fn(gm: GraphModule, ctx: PassContext) -> int`` as a built-in pass called ``name``."""

    if not name or not name.isidentifier():
        raise PassRegistrationError(f"pass name {name!r} must be a Python identifier")

    def deco(fn: Callable) -> Callable:
        module = getattr(fn, "__module__", "?")
        if name in _REGISTRY and _MODULE_OF_PASS[name] != module:
            raise PassRegistrationError(
                f"two passes are named {name!r}: one in {_MODULE_OF_PASS[name]}, one in {module}"
            )
        _REGISTRY[name] = PassSpec(name, fn, order, description, module, enabled_by_default)
        _MODULE_OF_PASS[name] = module
        return fn

    return deco


def load_pass_package(package: str) -> List[PassSpec]:
    """Import every module of ``package`` and check that each registered at least one pass.

    Raises :class:`PassRegistrationError` naming the module for an import failure, a module that registers no
    pass, or a duplicate name. Returns the package's passes sorted by ``order``.
    """
    if package in _LOADED_PACKAGES:
        return _LOADED_PACKAGES[package]
    pkg = importlib.import_module(package)
    specs: List[PassSpec] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue  # private helpers shared by passes
        modname = f"{package}.{info.name}"
        before = set(_REGISTRY)
        try:
            importlib.import_module(modname)
        except PassRegistrationError as e:
            raise PassRegistrationError(f"fxfuse pass module {modname} failed to register: {e}") from e
        except Exception as e:
            raise PassRegistrationError(
                f"fxfuse pass module {modname} failed to import ({type(e).__name__}: {e}); "
                f"fix or remove it: every module in {package} must register a pass"
            ) from e
        mine = [s for n, s in _REGISTRY.items() if s.module == modname]
        if not mine:
            raise PassRegistrationError(
                f"fxfuse pass module {modname} imported but registered no pass; decorate its entry point with "
                f"@register_pass(name=..., order=..., description=...)"
            )
        specs.extend(s for s in mine if s.name not in before or s.module == modname)
    specs = sorted({s.name: s for s in specs}.values(), key=lambda s: (s.order, s.name))
    _LOADED_PACKAGES[package] = specs
    return specs


def registered_passes() -> List[PassSpec]:
    """All built-in passes, in the order they run."""
    return sorted(_REGISTRY.values(), key=lambda s: (s.order, s.name))


def get_pass(name: str) -> PassSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "<none>"
        raise PassRegistrationError(f"unknown fxfuse pass {name!r}; known passes: {known}") from None


def user_pass_spec(fn: Callable, index: int) -> PassSpec:
    """Wrap a user ``extra_passes`` callable ``fn(gm) -> int`` as a spec (runs after the built-ins)."""
    name = getattr(fn, "__name__", None) or type(fn).__name__ or f"extra_pass_{index}"
    if name == "<lambda>":
        name = f"extra_passes[{index}]<lambda>"

    def run(gm: torch.fx.GraphModule, ctx) -> int:
        # Whatever it returns, the backend validates the graph if it changed; a return that is not an int is the
        # pass's error and rolls it back with that reason.
        n = fn(gm)
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"extra pass {name} returned {n!r}; it must return the number of sites it changed "
                            f"(an int)")
        return n

    return PassSpec(name, run, 10_000 + index, getattr(fn, "__doc__", "") or "user pass",
                    getattr(fn, "__module__", "?"), True, builtin=False)
