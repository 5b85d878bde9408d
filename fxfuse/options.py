"""Options of the fxfuse backend, kept apart from Inductor's, and checked as soon as they are given.

``torch.compile(model, backend="fxfuse", options={...})`` mixes both kinds in one dict. Keys listed in
:data:`FXFUSE_KEYS` are fxfuse's; every other key must be an Inductor config name (``torch._inductor.config``,
dotted for nested ones such as ``"triton.cudagraphs"``) and is forwarded to Inductor as a config patch together
with the settings of ``mode``.

:meth:`FxFuseOptions.parse` checks every key and value: fxfuse's keys by type and choices (a bool must be a real
``bool``: ``"false"`` is truthy), ``passes`` against the registered pass names, and ``pass_options`` against the
options each pass declares in its ``@register_pass(options=...)``. A mistake is an :class:`FxFuseOptionsError`
with a short message and, for a misspelt name, a "did you mean" suggestion. Why here and not in the passes: under
``torch.compile`` the options are only read at the first forward, inside Dynamo, and a pass that meets a bad
value can only roll itself back, so a typo would silently mean "not fused" or "the default".
:func:`fxfuse.compile` calls :meth:`FxFuseOptions.parse` at the call, so mistakes raise there.
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union


from .errors import FxFuseOptionsError

__all__ = ["FxFuseOptions", "FxFuseOptionsError", "FXFUSE_KEYS", "did_you_mean"]

FXFUSE_KEYS = {
    "passes": "dict {pass name: bool} to enable/disable built-in passes, or a list of the only names to run",
    "extra_passes": "list of callables fn(gm: torch.fx.GraphModule) -> int run (and validated) after the built-ins",
    "strict": "bool: raise FxFuseError instead of rolling a failed pass back (default False)",
    "debug_dir": "str: dump the graphs before/after fxfuse's passes, the report and Inductor's output here",
    "pass_options": "dict {pass name: {option: value}} handed to the passes (see each pass's docstring)",
    "compiler": "what lowers the rewritten graph: 'auto' (default: Inductor, except a graph left with nothing for "
                "it to generate after fxfuse's passes, only fxfuse ops, views and label bookkeeping, which runs "
                "through AOTAutograd as is; see fxfuse.lowering), 'inductor' (every graph) or 'aot_eager' "
                "(AOTAutograd, eager kernels: for debugging passes and fast tests)",
    "offload_activations": "None (default: auto, where the step's predicted peak would not fit the GPU), a bool, or an "
                           "int (bytes): keep the inputs of checkpointed regions (each layer's input under gradient "
                           "checkpointing) of at least that many bytes (True: 16 MiB) in pinned host memory between "
                           "the forward and the recompute (pass checkpoint_offload)",
    "plan_tokens": "int: the most tokens a step (batch x length) will hold; where a graph is compiled with a "
                   "symbolic length, sequence_tiling and checkpoint_offload decide their auto modes at this many "
                   "tokens instead of the compile's example length (default: the example length)",
    "background_compile": "bool: run each graph through AOTAutograd alone (fxfuse's fused ops, the rest eager) while "
                          "a compile process fills Inductor's caches with it, then compile it here from those caches "
                          "and switch; graphs with symbolic sizes compile at once (default False; see "
                          "fxfuse.background_inductor)",
    "tp_all_reduce_blocks": "int: tensor parallelism's all-reduces in Inductor graphs (see fxfuse.comm_overlap). 0: "
                            "as traced; 1 (default): all-reduces that are only summed become one all-reduce of "
                            "the sum (a ColwiseParallel input's gradient: q / k / v, gate / up); N >= 2: that, and "
                            "each all-reduced matmul split into N blocks of rows, each all-reduced while the next "
                            "block's matmul runs",
    "comm_overlap": "bool: in graphs with collectives (tensor parallelism's), Inductor's scheduler issues each "
                    "collective as soon as its operand is computed and runs the computation it does not need (a "
                    "backward's weight-gradient matmuls) before its wait (Inductor's reorder_compute_for_overlap; "
                    "default True; Inductor options of your own for it win; see fxfuse.comm_overlap)",
    "verify": "bool: run the graph before and after each pass once on the first real inputs (forward and "
              "gradients) and roll back a pass that changes values beyond dtype tolerance (default: env "
              "FXFUSE_VERIFY=1, else False; see fxfuse.verify)",
}
COMPILERS = ("auto", "inductor", "aot_eager")
DEFAULT_OFFLOAD_MIN_BYTES = 16 * 2**20  # offload_activations=True: region inputs of at least 16 MiB


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'?"`` for the known name closest to ``name``, or ``""``.

    Besides difflib's closeness, another capitalisation, an abbreviation made of a name's initials (``"lce"`` for
    ``linear_cross_entropy``) and a unique prefix count as close: pass names are long and people shorten them.
    """
    known = [str(k) for k in known]
    name = str(name)
    hits = [k for k in known if k.lower() == name.lower()]
    hits = hits or difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not hits:
        low = name.lower()
        hits = [k for k in known if "_" in k and "".join(p[0] for p in k.split("_") if p) == low]
    if not hits and len(name) >= 3:
        hits = [k for k in known if k.startswith(name)]
        hits = hits if len(hits) == 1 else []
    return f"did you mean {hits[0]!r}?" if hits else ""


def merge_option_kwargs(where: str, options: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` (a dict or None) and keyword options merged, as ``fxfuse.compile`` and ``fxfuse.install`` take
    them; a key given both ways, or ``options`` that is not a dict, is the caller's error (``where`` names the
    entry point)."""
    if options is not None and not isinstance(options, dict):
        raise FxFuseOptionsError(f"{where}(options=...) must be a dict, got {options!r}")
    both = sorted(set(options or {}) & set(kwargs))
    if both:
        raise FxFuseOptionsError(f"{where}(): {both[0]!r} given twice (in options and as a keyword)")
    return {**(options or {}), **kwargs}


def _kind(value: Any) -> str:
    name = type(value).__name__
    return f"{value!r} ({'an' if name[0] in 'aeiou' else 'a'} {name})"


def _join(*parts: str) -> str:
    """Message parts joined with "; " (a space after a question), empty ones left out."""
    out = ""
    for p in (p for p in parts if p):
        out += ("" if not out else " " if out.endswith("?") else "; ") + p
    return out


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt])i?b?\s*$", re.IGNORECASE)


def _size_hint(value: Any) -> str:
    """For a byte count written as a string ("1GB", "256 MiB"): the int to write instead."""
    m = _SIZE.match(value) if isinstance(value, str) else None
    if not m:
        return ""
    shift = {"k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]
    n = float(m.group(1))
    spelled = f"{m.group(1)} << {shift}" if n.is_integer() else str(int(n * (1 << shift)))
    return f"write {spelled} for {m.group(1)} {m.group(2).upper()}iB"


def _check_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise FxFuseOptionsError(f"options[{key!r}] must be True or False, got {_kind(value)}")
    return value


@dataclass
class FxFuseOptions:
    passes: Optional[Union[Dict[str, bool], Sequence[str]]] = None
    extra_passes: List[Callable] = field(default_factory=list)
    strict: bool = False
    debug_dir: Optional[str] = None
    pass_options: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    compiler: str = "auto"
    verify: bool = False
    inductor: Dict[str, Any] = field(default_factory=dict)
    offload_min_bytes: int = DEFAULT_OFFLOAD_MIN_BYTES  # region inputs at least this large are candidates
    offload_mode: str = "auto"  # auto (as the predicted peak needs), always, off
    plan_tokens: Optional[int] = None  # auto modes of a symbolic-length graph decide at this many tokens
    background_compile: bool = False  # AOTAutograd alone until a compile process has filled Inductor's caches
    tp_all_reduce_blocks: int = 1  # 0 off, 1 merge summed all-reduces, N >= 2 also N blocks (fxfuse.comm_overlap)
    comm_overlap: bool = True  # Inductor's reorder_compute_for_overlap in graphs with collectives (comm_overlap)

    @classmethod
    def parse(cls, options: Optional[Dict[str, Any]]) -> "FxFuseOptions":
        """Check every key and value of ``options`` (see the module docstring); raise :class:`FxFuseOptionsError`
        on the first mistake. ``pass_options`` come back with ``None`` values dropped (= the declared default)."""
        if options is not None and not isinstance(options, dict):
            raise FxFuseOptionsError(f"options must be a dict, got {_kind(options)}")
        options = dict(options or {})
        for k in options:
            if not isinstance(k, str):
                raise FxFuseOptionsError(f"option names are strings, got {_kind(k)}")
        ours = {k: options.pop(k) for k in list(options) if k in FXFUSE_KEYS}
        unknown = [k for k in options if not _is_inductor_key(k)]
        if unknown:
            k = unknown[0]
            hint = did_you_mean(k, FXFUSE_KEYS) or did_you_mean(k, _inductor_keys())
            raise FxFuseOptionsError(_join(
                f"unknown option {k!r}", hint, f"fxfuse's options are {', '.join(FXFUSE_KEYS)}; anything else must "
                f"be a torch._inductor.config name"))

        extra = ours.get("extra_passes") or []
        if callable(extra):
            extra = [extra]
        if not isinstance(extra, (list, tuple)):
            raise FxFuseOptionsError(f"options['extra_passes'] must be a list of callables fn(gm) -> int, got "
                                     f"{_kind(extra)}")
        for p in extra:
            if not callable(p):
                raise FxFuseOptionsError(f"options['extra_passes'] entries must be callables fn(gm) -> int, got "
                                         f"{_kind(p)}")

        known = _pass_names()
        passes = ours.get("passes")
        if passes is not None:
            passes = _check_passes(passes, known)

        strict = _check_bool("strict", ours.get("strict", False))
        env_verify = os.environ.get("FXFUSE_VERIFY", "0") not in ("", "0")
        verify = _check_bool("verify", ours["verify"]) if ours.get("verify") is not None else env_verify

        compiler = ours.get("compiler", "auto")
        if compiler not in COMPILERS:
            raise FxFuseOptionsError(_join(f"options['compiler'] must be one of {', '.join(map(repr, COMPILERS))}, "
                                           f"got {_kind(compiler)}", did_you_mean(compiler, COMPILERS)))

        debug_dir = ours.get("debug_dir")
        if debug_dir is not None:
            if not isinstance(debug_dir, (str, os.PathLike)):
                raise FxFuseOptionsError(f"options['debug_dir'] must be a path (str), got {_kind(debug_dir)}")
            debug_dir = os.fspath(debug_dir)

        pass_options = _check_pass_options(ours.get("pass_options"), known)
        offload = ours.get("offload_activations", None)
        offload_mode, offload_bytes = "always", DEFAULT_OFFLOAD_MIN_BYTES
        if offload is None:
            offload_mode = "auto"
        elif offload is False:
            offload_mode = "off"
        elif offload is True:
            pass
        elif not isinstance(offload, int) or offload < 1:
            raise FxFuseOptionsError(f"options['offload_activations'] must be None (auto), True, False or a number "
                                     f"of bytes >= 1, got {_kind(offload)}")
        else:
            offload_bytes = offload
        plan_tokens = ours.get("plan_tokens")
        if plan_tokens is not None and (isinstance(plan_tokens, bool) or not isinstance(plan_tokens, int)
                                        or plan_tokens < 1):
            raise FxFuseOptionsError(f"options['plan_tokens'] must be a number of tokens >= 1 (batch x length), "
                                     f"got {_kind(plan_tokens)}")
        background = _check_bool("background_compile", ours.get("background_compile", False))
        blocks = ours.get("tp_all_reduce_blocks", 1)
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise FxFuseOptionsError(f"options['tp_all_reduce_blocks'] must be 0 (off), 1 (merge summed all-reduces) "
                                     f"or a number of blocks >= 2, got {_kind(blocks)}")
        return cls(compiler=compiler, passes=passes, extra_passes=list(extra), strict=strict, debug_dir=debug_dir,
                   pass_options=pass_options, verify=verify, inductor=options, offload_min_bytes=offload_bytes,
                   offload_mode=offload_mode, plan_tokens=plan_tokens, background_compile=background,
                   tp_all_reduce_blocks=blocks,
                   comm_overlap=_check_bool("comm_overlap", ours.get("comm_overlap", True)))

    def enabled(self, name: str, default: bool) -> bool:
        if self.passes is None:
            return default
        if isinstance(self.passes, dict):
            return bool(self.passes.get(name, default))
        return name in self.passes

def _pass_names() -> Dict[str, Any]:
    """Registered passes by name (their specs carry the declared options)."""
    from . import registry

    return {s.name: s for s in registry.registered_passes()}


def _check_passes(passes: Any, known: Dict[str, Any]):
    if isinstance(passes, str):
        raise FxFuseOptionsError(f"options['passes'] must be a dict {{name: bool}} or a list of pass names, got the "
                                 f"string {passes!r}; write [{passes!r}] to run only that pass")
    if not isinstance(passes, (dict, list, tuple)):
        raise FxFuseOptionsError(f"options['passes'] must be a dict {{name: bool}} or a list of pass names, got "
                                 f"{_kind(passes)}")
    for name in passes:
        if name not in known:
            raise FxFuseOptionsError(_join(f"options['passes'] names unknown pass {name!r}",
                                           did_you_mean(name, known), f"known passes: {', '.join(known)}"))
        if isinstance(passes, dict) and not isinstance(passes[name], bool):
            raise FxFuseOptionsError(f"options['passes'][{name!r}] must be True or False, got {_kind(passes[name])}")
    return dict(passes) if isinstance(passes, dict) else list(passes)


def _check_pass_options(pass_options: Any, known: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    if pass_options is None:
        return {}
    if not isinstance(pass_options, dict):
        raise FxFuseOptionsError(f"options['pass_options'] must be a dict {{pass name: {{option: value}}}}, got "
                                 f"{_kind(pass_options)}")
    out: Dict[str, Dict[str, Any]] = {}
    for name, given in pass_options.items():
        where = f"pass_options[{name!r}]"
        if name not in known:
            raise FxFuseOptionsError(_join(f"{where}: unknown pass {name!r}", did_you_mean(name, known),
                                           f"known passes: {', '.join(known)}"))
        if given is None:
            continue
        if not isinstance(given, dict):
            raise FxFuseOptionsError(f"{where} must be a dict {{option: value}}, got {_kind(given)}")
        declared = known[name].options
        checked = {}
        for key, value in given.items():
            if key not in declared:
                listing = (f"{name}'s options: {', '.join(declared)}" if declared else f"{name} takes no options")
                raise FxFuseOptionsError(_join(f"{where}: unknown option {key!r}", did_you_mean(key, declared),
                                               listing))
            if value is None:  # None = the pass's default
                continue
            spec = declared[key]
            if spec.check(value) is not None:
                hint = (did_you_mean(value, [str(c) for c in spec.choices]) if spec.choices and isinstance(value, str)
                        else _size_hint(value) if spec.type is int else "")
                doc = f" ({spec.doc})" if spec.doc and not spec.choices else ""
                raise FxFuseOptionsError(_join(f"{where}[{key!r}] must be {spec.describe()}{doc}, got "
                                               f"{_kind(value)}", hint))
            checked[key] = value
        out[name] = checked
    return out


_INDUCTOR_KEYS: Optional[List[str]] = None


def _inductor_keys() -> List[str]:
    global _INDUCTOR_KEYS
    if _INDUCTOR_KEYS is None:
        import torch._inductor.config as ic

        try:
            _INDUCTOR_KEYS = list(ic.get_config_copy())
        except Exception:
            _INDUCTOR_KEYS = []
    return _INDUCTOR_KEYS


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
