"""Options of the fxfuse backend, kept apart from Inductor's.

``torch.compile(model, backend="fxfuse", options={...})`` mixes both kinds in one dict. Keys listed in
:data:`FXFUSE_KEYS` are fxfuse's; every other key must be an Inductor config name (``torch._inductor.config``,
dotted for nested ones such as ``"triton.cudagraphs"``) and is forwarded to Inductor as a config patch together
with the settings of ``mode``. An unknown key is an error rather than silently ignored.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .errors import FxFuseError

__all__ = ["FxFuseOptions", "FXFUSE_KEYS"]

FXFUSE_KEYS = {
    "passes": "dict {pass name: bool} to enable/disable built-in passes, or a list of the only names to run",
    "extra_passes": "list of callables fn(gm: torch.fx.GraphModule) -> int run (and validated) after the built-ins",
    "strict": "bool: raise FxFuseError instead of rolling a failed pass back (default False)",
    "debug_dir": "str: dump the graphs before/after fxfuse's passes, the report and Inductor's output here",
    "pass_options": "dict {pass name: {option: value}} handed to the passes (see each pass's docstring)",
    "compiler": "what lowers the rewritten graph: 'inductor' (default) or 'aot_eager' (AOTAutograd, eager "
                "kernels: for debugging passes and fast tests)",
    "verify": "bool: run the graph before and after each pass once on the first real inputs (forward and "
              "gradients) and roll back a pass that changes values beyond dtype tolerance (default: env "
              "FXFUSE_VERIFY=1, else False; see fxfuse.verify)",
}
COMPILERS = ("inductor", "aot_eager")


@dataclass
class FxFuseOptions:
    passes: Optional[Union[Dict[str, bool], Sequence[str]]] = None
    extra_passes: List[Callable] = field(default_factory=list)
    strict: bool = False
    debug_dir: Optional[str] = None
    pass_options: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    compiler: str = "inductor"
    verify: bool = False
    inductor: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, options: Optional[Dict[str, Any]]) -> "FxFuseOptions":
        options = dict(options or {})
        ours = {k: options.pop(k) for k in list(options) if k in FXFUSE_KEYS}
        unknown = [k for k in options if not _is_inductor_key(k)]
        if unknown:
            raise FxFuseError(
                f"unknown fxfuse/Inductor option(s) {unknown}. fxfuse's options: "
                + "; ".join(f"{k}: {v}" for k, v in FXFUSE_KEYS.items())
                + ". Anything else must be a torch._inductor.config name."
            )
        extra = ours.get("extra_passes") or []
        if callable(extra):
            extra = [extra]
        for p in extra:
            if not callable(p):
                raise FxFuseError(f"extra_passes entries must be callables fn(gm) -> int, got {p!r}")
        passes = ours.get("passes")
        if passes is not None and not isinstance(passes, (dict, list, tuple)):
            raise FxFuseError(f"options['passes'] must be a dict or a list of pass names, got {passes!r}")
        compiler = ours.get("compiler", "inductor")
        if compiler not in COMPILERS:
            raise FxFuseError(f"options['compiler'] must be one of {COMPILERS}, got {compiler!r}")
        verify = ours.get("verify", os.environ.get("FXFUSE_VERIFY", "0") not in ("", "0"))
        return cls(compiler=compiler, passes=passes, extra_passes=list(extra), strict=bool(ours.get("strict", False)),
                   debug_dir=ours.get("debug_dir"), pass_options=dict(ours.get("pass_options") or {}),
                   verify=bool(verify), inductor=options)

    def enabled(self, name: str, default: bool) -> bool:
        if self.passes is None:
            return default
        if isinstance(self.passes, dict):
            return bool(self.passes.get(name, default))
        return name in self.passes

    def check_pass_names(self, known: Sequence[str]) -> None:
        if self.passes is None:
            return
        names = list(self.passes.keys() if isinstance(self.passes, dict) else self.passes)
        bad = [n for n in names if n not in known]
        if bad:
            raise FxFuseError(f"options['passes'] names unknown pass(es) {bad}; built-in passes: {sorted(known)}")


def _is_inductor_key(key: str) -> bool:
    import torch._inductor.config as ic

    try:
        return key in ic.get_config_copy()
    except Exception:
        obj = ic
        for part in key.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
