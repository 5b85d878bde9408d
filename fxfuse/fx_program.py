"""A small FX graph carried as an op argument: its Python source plus the names its code needs.

A fused op that must run a piece of the user's graph inside its own loop (``fxfuse::linear_log_probs_loss`` runs
the loss tail of a log-probs site once per token chunk, for the chunk's upstream gradients) cannot take a
callable: torch.library schemas take tensors, numbers and strings. So the pass hands the op the piece as text,
``dump_graph(graph) -> str``, and the op turns it back into a function with ``load_program(text)`` (cached per
text). Text survives what an in-process registry would not: AOTAutograd's and Inductor's caches key the compiled
code on the op's arguments, and a process that loads them from disk gets the program with them.

Only graphs of ``placeholder`` / ``call_function`` / ``call_method`` / ``output`` nodes, whose generated code
needs no globals but modules (``torch``, ``operator``, ``math``) and FX's own names (``inf``, ``nan``,
``device``), are accepted: :func:`dump_graph` raises :class:`ProgramError` otherwise and round-trips the text
through :func:`load_program` before returning it, so an argument FX prints but cannot read back (a function object
as an argument) is refused where the pass can still leave the graph alone.
"""
from __future__ import annotations

import functools
import importlib
import json
import math
import types
from typing import Callable

import torch
import torch.fx as fx

__all__ = ["ProgramError", "dump_graph", "load_program"]

# names FX's code generator adds for constants it prints (inf / nan floats, devices, None's type)
_FX_NAMES = {"inf": math.inf, "nan": math.nan, "device": torch.device, "NoneType": type(None)}


class ProgramError(ValueError):
    """A graph that cannot travel as text (the pass leaves its site alone and says why)."""


def dump_graph(graph: fx.Graph) -> str:
    """The graph as text for :func:`load_program`: its ``forward(self, *placeholders)`` source and the modules its
    code refers to by name."""
    for n in graph.nodes:
        if n.op not in ("placeholder", "call_function", "call_method", "output"):
            raise ProgramError(f"node {n.name} is a {n.op}")
    code = graph.python_code(root_module="self")
    modules = {}
    for name, obj in code.globals.items():
        if name in _FX_NAMES or name in ("fx_pytree", "pytree"):  # FX adds the pytree modules to every program
            continue
        if not isinstance(obj, types.ModuleType):
            raise ProgramError(f"the code needs {name} = {obj!r}, which is not a module")
        modules[name] = obj.__name__
    text = json.dumps({"src": code.src, "modules": modules}, sort_keys=True)
    try:
        load_program(text)
    except Exception as e:  # e.g. a function object printed as <built-in function mul>
        raise ProgramError(f"the generated code does not load back: {type(e).__name__}: {e}") from None
    return text


@functools.lru_cache(maxsize=256)
def load_program(text: str) -> Callable:
    """The function ``f(*placeholders)`` of a :func:`dump_graph` text (compiled once per text)."""
    spec = json.loads(text)
    env = dict(_FX_NAMES)
    env.update({name: importlib.import_module(mod) for name, mod in spec["modules"].items()})
    exec(compile(spec["src"], "<fxfuse program>", "exec"), env)  # noqa: S102  (text made by dump_graph)
    forward = env["forward"]
    return functools.partial(forward, None)
