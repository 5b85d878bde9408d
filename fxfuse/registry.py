"""The pass registry: complete by construction.

Built-in passes live one per module in the top-level ``passes/`` folder (installed as ``fxfuse.passes``). Each
module registers its pass with :func:`register_pass` at import. :func:`load_pass_package` imports *every* module
of the package and checks, at import time, that each one registered at least one pass and that no two passes
share a name. A broken pass module is therefore a clear :class:`PassRegistrationError` when ``fxfuse`` is
imported, never a ``KeyError`` the first time a user compiles.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .errors import PassRegistrationError

__all__ = ["PassSpec", "PassOption", "register_pass", "load_pass_package", "registered_passes", "find_pass", "get_pass",
           "user_pass_spec"]


_OPTION_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class PassOption:
    """One option a pass declares: what ``pass_options={"<pass>": {name: value}}`` may set.

    Declared so that :meth:`fxfuse.options.FxFuseOptions.parse` can check every value when the options are given
    (a typo or a wrong type is an error at ``fxfuse.compile`` / the first compile, not a silently ignored key or a
    pass rolled back at compile time), and so that tools can list the options with their defaults.

    ``type``: ``bool``, ``int``, ``float`` or ``str`` (bools must be real bools; an ``int`` option takes no bool or
    float). ``choices``: the only allowed values. ``minimum``: lowest allowed number. ``default``: what the pass
    uses when the option is not given (or given as ``None``). ``doc``: one line for error messages and listings.
    ``shown_default``: how listings (``python -m fxfuse doctor``) show the default where its value alone would
    mislead (a 0 that stands for the op's own default), e.g. ``"0 = 256 MiB"``.
    """

    type: type
    default: Any = None
    doc: str = ""
    choices: Optional[Tuple[Any, ...]] = None
    minimum: Optional[float] = None
    shown_default: str = ""

    def show_default(self) -> str:
        return self.shown_default or repr(self.default)

    @classmethod
    def coerce(cls, pass_name: str, option: str, spec: Any) -> "PassOption":
        """A :class:`PassOption` from what a ``register_pass(options=...)`` call gave: an instance, or a dict with
        the same fields (``type`` may be left out when ``choices`` or ``default`` say it)."""
        if isinstance(spec, PassOption):
            opt = spec
        elif isinstance(spec, Mapping):
            unknown = set(spec) - {"type", "default", "doc", "choices", "minimum", "shown_default"}
            if unknown:
                raise PassRegistrationError(f"pass {pass_name!r} option {option!r}: unknown spec field(s) "
                                            f"{sorted(unknown)}; use type / choices / minimum / default / doc / "
                                            f"shown_default")
            choices = tuple(spec["choices"]) if spec.get("choices") is not None else None
            typ = spec.get("type")
            if typ is None:
                sample = choices[0] if choices else spec.get("default")
                typ = type(sample) if sample is not None else None
            opt = cls(typ, spec.get("default"), spec.get("doc", ""), choices, spec.get("minimum"),
                      spec.get("shown_default", ""))
        else:
            raise PassRegistrationError(f"pass {pass_name!r} option {option!r}: expected a PassOption or a dict "
                                        f"(type / choices / minimum / default / doc), got {spec!r}")
        if not option.isidentifier():
            raise PassRegistrationError(f"pass {pass_name!r}: option name {option!r} must be a Python identifier")
        if opt.type not in _OPTION_TYPES:
            raise PassRegistrationError(f"pass {pass_name!r} option {option!r}: type must be one of "
                                        f"{[t.__name__ for t in _OPTION_TYPES]}, got {opt.type!r}")
        if opt.default is not None and opt.check(opt.default) is not None:
            raise PassRegistrationError(f"pass {pass_name!r} option {option!r}: its default {opt.default!r} is "
                                        f"not a valid value ({opt.check(opt.default)})")
        return opt

    def describe(self) -> str:
        """What a valid value is, in a few words (for error messages)."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.type is bool:
            return "True or False"
        kind = {int: "an int", float: "a number", str: "a string"}[self.type]
        if self.minimum is not None:
            kind += f" >= {self.minimum:g}"
        return kind

    def check(self, value: Any) -> Optional[str]:
        """None if ``value`` is valid, else a short description of what is wrong with it."""
        if self.choices is not None:
            return None if any(value == c and type(value) is type(c) for c in self.choices) else "not a choice"
        if self.type is bool:
            return None if isinstance(value, bool) else "not a bool"
        if self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                return "not an int"
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return "not a number"
        elif not isinstance(value, self.type):
            return f"not a {self.type.__name__}"
        if self.minimum is not None and value < self.minimum:
            return "too small"
        return None


@dataclass(frozen=True)
class PassSpec:
    """A registered graph pass.

    ``fn(gm, ctx) -> int`` rewrites ``gm`` in place (recursing into subgraphs through ``ctx``) and returns the
    number of sites it changed. ``order`` sorts passes; lower runs first (the built-in passes get theirs from the
    explicit list in ``passes/__init__.py``).
    """

    name: str
    fn: Callable
    order: int
    description: str
    module: str
    enabled_by_default: bool = True
    builtin: bool = True
    #: the options this pass reads (``pass_options={name: {option: value}}``), checked when options are parsed
    options: Mapping[str, PassOption] = field(default_factory=dict, hash=False, compare=False)


_REGISTRY: Dict[str, PassSpec] = {}
_MODULE_OF_PASS: Dict[str, str] = {}
_LOADED_PACKAGES: Dict[str, List[PassSpec]] = {}


def register_pass(name: str, *, description: str, order: Optional[int] = None, enabled_by_default: bool = True,
                  options: Optional[Mapping[str, Any]] = None):
    """Decorator: register ``fn(gm: GraphModule, ctx: PassContext) -> int`` as a pass called ``name``.

    ``order``: where it runs (lower first). A pass package that lists its passes in order
    (``load_pass_package(package, order=[...])``, as ``passes/__init__.py`` does) leaves it out.

    ``options`` declares every pass option the pass reads, ``{option name: spec}``, the spec a :class:`PassOption`
    or a dict of its fields, e.g. ``{"max_group": {"type": int, "minimum": 2, "default": 8, "doc": "..."}}``.
    Only declared options can be set through ``pass_options``; their values are checked when the options are
    parsed, and ``ctx.pass_option(name)`` falls back to the declared default.
    """

    if not name or not name.isidentifier():
        raise PassRegistrationError(f"pass name {name!r} must be a Python identifier")
    declared = {k: PassOption.coerce(name, k, v) for k, v in (options or {}).items()}

    def deco(fn: Callable) -> Callable:
        module = getattr(fn, "__module__", "?")
        if name in _REGISTRY and _MODULE_OF_PASS[name] != module:
            raise PassRegistrationError(
                f"two passes are named {name!r}: one in {_MODULE_OF_PASS[name]}, one in {module}"
            )
        _REGISTRY[name] = PassSpec(name, fn, -1 if order is None else order, description, module, enabled_by_default,
                                   options=declared)
        _MODULE_OF_PASS[name] = module
        return fn

    return deco


def load_pass_package(package: str, order: Sequence[str] = ()) -> List[PassSpec]:
    """Import every module of ``package`` and check that each registered at least one pass.

    ``order``: the package's pass names in the order they run; when given it must name every pass the package
    registers, once, and it replaces their ``register_pass(order=...)``. Raises :class:`PassRegistrationError`
    naming the module for an import failure, a module that registers no pass, a duplicate name, a pass missing
    from ``order`` (or one ``order`` names that no module registers), or a pass with no order at all. Returns the
    package's passes sorted by their order.
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
    specs = list({s.name: s for s in specs}.values())
    if order:
        names = [s.name for s in specs]
        missing, unknown = sorted(set(names) - set(order)), sorted(set(order) - set(names))
        if missing or unknown or len(set(order)) != len(order):
            raise PassRegistrationError(
                f"{package}'s pass order must name each of its passes once: "
                + "; ".join(x for x in (f"not in the order: {missing}" if missing else "",
                                        f"in the order but not registered: {unknown}" if unknown else "",
                                        "a name repeats" if len(set(order)) != len(order) else "") if x))
        for s in specs:
            _REGISTRY[s.name] = dataclasses.replace(s, order=list(order).index(s.name))
        specs = [_REGISTRY[s.name] for s in specs]
    unordered = [s.name for s in specs if s.order < 0]
    if unordered:
        raise PassRegistrationError(f"pass(es) {unordered} in {package} have no order: give register_pass(order=...) "
                                    f"or list them in load_pass_package({package!r}, order=[...])")
    specs = sorted(specs, key=lambda s: (s.order, s.name))
    _LOADED_PACKAGES[package] = specs
    return specs


def registered_passes() -> List[PassSpec]:
    """All built-in passes, in the order they run."""
    return sorted(_REGISTRY.values(), key=lambda s: (s.order, s.name))


def find_pass(name: str) -> Optional[PassSpec]:
    """The built-in pass called ``name``, or None (a user's ``extra_passes`` are not registered)."""
    return _REGISTRY.get(name)


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
