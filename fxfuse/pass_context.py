"""What a pass gets besides the graph: :class:`PassContext`, the pass-author API.

A pass is ``fn(gm, ctx) -> int`` (see :func:`fxfuse.register_pass`). Through ``ctx`` it records what it did at
each site (:meth:`PassContext.fused` / :meth:`PassContext.skipped`, which become the fusion report's rows), reads
its options (:meth:`PassContext.pass_option` and the checked forms), walks subgraphs
(:meth:`PassContext.graph_modules`) and, where the entry point allows it, returns a graph output rebuilt outside
the compiled graph (:meth:`PassContext.substitute_output`). The pass manager (:mod:`fxfuse.pass_manager`) owns the
context: records and substitutions a pass made are kept only when its rewrite validates.
"""
from __future__ import annotations

import dataclasses

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch.fx as fx

from . import registry
from .errors import FxFusePassError, node_location
from .graph_utils import graph_modules
from .options import FxFuseOptions
from .report import FUSED, SKIPPED, FusionReport, SiteRecord
from .substitution import OutputSubstitution

__all__ = ["PassContext"]


class PassContext:
    """What a pass gets besides the graph: where to record sites, its options, and the fake mode.

    ``can_substitute_outputs`` says whether the entry point that compiles this graph can rebuild outputs outside
    it (the Dynamo backend can; Inductor's pre-grad hook cannot): where it is False, :meth:`substitute_output`
    substitutes nothing and the pass keeps the real value.
    """

    def __init__(self, report: FusionReport, options: FxFuseOptions, fake_mode, pass_name: str = "",
                 root: Optional[fx.GraphModule] = None, can_substitute_outputs: bool = True):
        self.report = report
        self.options = options
        self.fake_mode = fake_mode
        self.pass_name = pass_name
        self.root = root
        self.can_substitute_outputs = can_substitute_outputs
        self.pending_records: List[SiteRecord] = []  # this pass's records, kept if its rewrite validates
        self.pending_substitutions: List[OutputSubstitution] = []  # likewise
        self.pending_retargets: List[Tuple[fx.Node, fx.Node]] = []  # likewise (see retarget_substitutions)
        self.relayouts: List[fx.GraphModule] = []  # this pass's subgraphs whose outputs change layout
        self.substitutions: List[OutputSubstitution] = []  # kept from passes that validated
        self.verify = None  # verify.Reference when options["verify"]

    def begin(self, pass_name: str) -> None:
        """The pass manager starts ``pass_name``: nothing pending."""
        self.pass_name = pass_name
        self.pending_records = []
        self.pending_substitutions = []
        self.pending_retargets = []
        self.relayouts = []

    def commit(self) -> None:
        """The pass validated: keep what it recorded."""
        self.report.records.extend(self.pending_records)
        self.substitutions = self._retargeted(self.substitutions) + self.pending_substitutions
        self.pending_retargets = []

    def all_substitutions(self) -> List[OutputSubstitution]:
        return self._retargeted(self.substitutions) + self.pending_substitutions

    def retarget_substitutions(self, old: fx.Node, new: fx.Node) -> None:
        """An earlier pass's substitution reads ``old``, which this pass replaces by ``new`` in the graph's
        outputs (e.g. hidden states scattered back to the padded layout): read ``new`` instead, if this pass
        validates (a rolled-back pass leaves the substitutions as they were)."""
        self.pending_retargets.append((old, new))

    def relayout_subgraph(self, body: fx.GraphModule) -> None:
        """This pass changes the layout of what subgraph ``body`` returns (a checkpoint body that now returns the
        packed row its caller passes it): its outputs are not compared with their old shapes, and the new ones
        become its baseline if the pass validates. The root graph's outputs are always compared."""
        self.relayouts.append(body)

    def _retargeted(self, subs: List[OutputSubstitution]) -> List[OutputSubstitution]:
        if not self.pending_retargets:
            return list(subs)
        swap = dict(self.pending_retargets)
        return [dataclasses.replace(s, inputs=[swap.get(x, x) for x in s.inputs]) for s in subs]

    def substitute_output(self, gm: fx.GraphModule, node: fx.Node, inputs: List[fx.Node],
                          rebuild: Callable[..., Any]) -> int:
        """Return ``rebuild(inputs...)`` in place of ``node`` wherever the root graph returns it, so ``node`` need
        not be computed in the graph. Returns how many output slots were substituted (0 if ``node`` is not a
        root-graph output, ``gm`` is a subgraph, or the entry point cannot substitute outputs)."""
        if gm is not self.root or not self.can_substitute_outputs:
            return 0
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else None
        if flat is None:
            return 0
        slots = [i for i, a in enumerate(flat) if a is node]
        if not slots:
            return 0
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for slot in slots:
            sub = OutputSubstitution(slot, list(inputs), rebuild, self.pass_name)
            flat[slot] = inputs[0]
            for j, x in enumerate(inputs[1:], start=1):
                if x is None:
                    continue
                if x.op == "placeholder":
                    sub.placeholder_index[j] = phs.index(x)
                else:
                    sub.extra_output_index[j] = len(flat)
                    flat.append(x)
            self.pending_substitutions.append(sub)
        out.args = (type(out.args[0])(flat),)
        return len(slots)

    # passes call these ----------------------------------------------------------------------------------
    def fused(self, node: fx.Node, op: str, *, saved_bytes: Optional[int] = None, **detail) -> None:
        self.pending_records.append(SiteRecord(self.pass_name, FUSED, op, "", node_location(node), saved_bytes,
                                               detail))

    def skipped(self, node: fx.Node, op: str, reason: str, **detail) -> None:
        self.pending_records.append(SiteRecord(self.pass_name, SKIPPED, op, reason, node_location(node), None,
                                               detail))

    def pass_option(self, key: str, default: Any = None) -> Any:
        """The value of this pass's option ``key``: the user's (already checked by ``FxFuseOptions.parse``), else
        ``default``, else the default the pass declared in ``register_pass(options=...)``."""
        v = self.options.pass_options.get(self.pass_name, {}).get(key)
        if v is not None:
            return v
        if default is not None:
            return default
        opt = self._declared(key)
        return opt.default if opt is not None else None

    def _declared(self, key: str):
        spec = registry.find_pass(self.pass_name)
        return spec.options.get(key) if spec is not None else None

    def int_option(self, key: str, default: Optional[int] = None, minimum: int = 0, what: str = "") -> int:
        """An int pass option >= ``minimum`` (None = ``default``, or the declared default); anything else raises, so
        the pass is rolled back with a reason that names the option (``what`` says what it means). Parsed options
        never get here with a bad value; options built by hand (tests, tools) still do."""
        v = self.pass_option(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            kind = "a non-negative int" if minimum == 0 else f"an int >= {minimum}"
            raise FxFusePassError(f"pass_options[{self.pass_name!r}][{key!r}] must be {kind}"
                                  + (f" ({what})" if what else "") + f", got {v!r}")
        return v

    def choice_option(self, key: str, default: Optional[str] = None, choices: Sequence[str] = ()) -> str:
        """A pass option that must be one of ``choices`` (default: the declared choices); anything else raises (the
        pass is rolled back)."""
        v = self.pass_option(key, default)
        if not choices:
            opt = self._declared(key)
            choices = tuple(opt.choices or ()) if opt is not None else ()
        if v not in choices:
            raise FxFusePassError(f"pass_options[{self.pass_name!r}][{key!r}] must be one of {tuple(choices)}, "
                                  f"got {v!r}")
        return v

    def graph_modules(self, gm: fx.GraphModule):
        """``gm`` and every nested subgraph module (a pass must rewrite inside checkpoint bodies too)."""
        return [m for _, m in graph_modules(gm)]
