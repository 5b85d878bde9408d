"""FakeTensor validation of rewritten graphs, and rollback.

Before any pass runs, the Dynamo graph is fake-propagated under the compile's own fake mode (symbolic sizes are
kept) and the signature of every graph output is recorded. After each pass the graph is re-propagated and the
outputs compared: shape (symbolically), dtype, device and stride. A pass whose rewrite changes any of them, or
that raises, or whose rewritten graph fails to propagate (for instance because a fused op's fake impl rejected
its inputs), is rolled back to the exact graph it started from.
"""
from __future__ import annotations

import contextlib

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from .graph_utils import graph_modules, known_true, node_val

__all__ = ["GraphSnapshot", "OutputSig", "NodeState", "PropagationError", "propagate",
           "output_signature", "compare_signatures", "GuardWatch"]


class GraphSnapshot:
    """The graphs (and attributes) of ``gm`` and every nested GraphModule, to restore after a failed pass."""

    def __init__(self, gm: fx.GraphModule):
        self.entries = []
        for _, mod in graph_modules(gm):
            g = fx.Graph(owning_module=mod, tracer_cls=mod.graph._tracer_cls)
            val_map: Dict[fx.Node, fx.Node] = {}
            out = g.graph_copy(mod.graph, val_map)
            g.output(out)
            for old, new in val_map.items():
                # Dynamo hangs attributes on nodes themselves (placeholders' _dynamo_source, which AOTAutograd
                # reads); node_copy only copies meta.
                for k, v in old.__dict__.items():
                    if k not in new.__dict__:
                        setattr(new, k, v)
            g._codegen = copy.deepcopy(mod.graph._codegen)
            self.entries.append((mod, g, dict(mod._modules), dict(mod._parameters), dict(mod._buffers),
                                 set(mod.__dict__)))

    def restore(self) -> None:
        for mod, g, modules, params, buffers, attrs in self.entries:
            for k in set(mod.__dict__) - attrs:
                delattr(mod, k)  # constants a pass registered
            mod._modules.clear(); mod._modules.update(modules)
            mod._parameters.clear(); mod._parameters.update(params)
            mod._buffers.clear(); mod._buffers.update(buffers)
            mod.graph = g
            mod.recompile()


@dataclass(frozen=True)
class OutputSig:
    index: int
    kind: str  # "tensor", "sym", "other"
    shape: Tuple[Any, ...] = ()
    stride: Tuple[Any, ...] = ()
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    node: Optional[fx.Node] = None

    def describe(self) -> str:
        if self.kind != "tensor":
            return self.kind
        return (f"[{', '.join(map(str, self.shape))}] {str(self.dtype).replace('torch.', '')} on {self.device}, "
                f"stride ({', '.join(map(str, self.stride))})")


_AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def preserved_autocast_state():
    """Run a graph's nodes (fake propagation) without leaving autocast changed behind.

    Dynamo graphs of code under ``torch.autocast`` hold ``_enter_autocast`` / ``_exit_autocast`` calls, and
    propagating the graph executes them for real. When propagation stops in between (a rewrite that fails
    validation inside an autocast region), the exit never runs: autocast stays on and its nesting counter stays
    raised, and with the counter above 0 autocast never clears its cache of down-cast weights, so later *eager*
    autocast steps silently reuse stale weight copies after the optimizer updated them. Seen with TRL ORPO
    (bf16 autocast on CPU): the next trainer's losses changed from its second step on.
    """
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    saved = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES}
    cache = torch.is_autocast_cache_enabled()
    try:
        yield
    finally:
        now = torch.autocast_increment_nesting() - 1
        torch.autocast_decrement_nesting()
        while now > nesting:
            now = torch.autocast_decrement_nesting()
        while now < nesting:
            now = torch.autocast_increment_nesting()
        for d, (on, dt) in saved.items():
            torch.set_autocast_enabled(d, on)
            torch.set_autocast_dtype(d, dt)
        torch.set_autocast_cache_enabled(cache)
        if nesting == 0:
            torch.clear_autocast_cache()


# Nodes Dynamo records for context managers and logging: they carry no value, and propagation must execute them
# (in order) so that the nodes after them run under the same grad / autocast state as in the user's code.
_CONTEXT_TARGETS = frozenset({"_set_grad_enabled", "_enter_autocast", "_exit_autocast", "set_grad_enabled"})


def _is_context_node(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") in _CONTEXT_TARGETS


def _value(n: fx.Node) -> Any:
    v = n.meta.get("val", None)
    return v if v is not None else n.meta.get("example_value", None)


class _NodeRunner(fx.Interpreter):
    """Runs single nodes of ``gm`` on fake values (``env`` holds the values of their inputs)."""

    def __init__(self, gm: fx.GraphModule, fake_mode):
        super().__init__(gm, garbage_collect_values=False)
        self.fake_mode = fake_mode

    def get_attr(self, target, args, kwargs):
        v = super().get_attr(target, args, kwargs)
        if isinstance(v, torch.Tensor) and not isinstance(v, torch._subclasses.fake_tensor.FakeTensor):
            v = self.fake_mode.from_tensor(v, static_shapes=True)
        return v


def _same_meta(a: Any, b: Any) -> bool:
    """Do two fake values describe the same thing (shape, dtype, device, stride; structure of tuples)?"""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
            return False
        if not all(_same(x, y) for x, y in zip(a.shape, b.shape)):
            return False
        return all(_same(s, 1) or _same(x, y) for s, x, y in zip(a.shape, a.stride(), b.stride()))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b))
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) and \
            isinstance(b, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return _same(a, b)
    return False


def _same_args(a: Any, b: Any) -> bool:
    """Structural equality of node arguments: nodes and tensors by identity, everything else by ``==``."""
    if isinstance(a, (fx.Node, torch.Tensor)) or isinstance(b, (fx.Node, torch.Tensor)):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_args(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_args(a[k], b[k]) for k in a)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return a is b


class NodeState:
    """What each node of ``gm`` and of its subgraphs computes (op, target, arguments), to tell afterwards which
    nodes a pass created or changed: only those (and what their new values reach) are re-propagated."""

    def __init__(self, gm: fx.GraphModule):
        self.calls = {}
        for _, mod in graph_modules(gm):
            self.calls[mod] = {n: (n.op, n.target, n.args, dict(n.kwargs)) for n in mod.graph.nodes}

    def changed(self, gm: fx.GraphModule) -> bool:
        """Did anything change since: a node added, removed or given other arguments, in any graph module?"""
        mods = [m for _, m in graph_modules(gm)]
        if set(mods) != set(self.calls):
            return True
        for m in mods:
            nodes = list(m.graph.nodes)
            if len(nodes) != len(self.calls[m]) or any(self.dirty(m, n) for n in nodes):
                return True
        return False

    def dirty(self, mod: fx.GraphModule, n: fx.Node) -> bool:
        old = self.calls.get(mod, {}).get(n)
        if old is None:
            return True
        op, target, args, kwargs = old
        same_target = target is n.target or (isinstance(target, str) and target == n.target)
        return not (op == n.op and same_target and _same_args(args, n.args)
                    and _same_args(kwargs, dict(n.kwargs)))


_PROPAGATING: List[Optional[fx.Node]] = [None]  # the node propagate() is running (named in guard reports)


class PropagationError(RuntimeError):
    """Fake propagation failed at ``node`` (``__cause__`` is the error)."""

    def __init__(self, node: Optional[fx.Node], cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.node = node


def propagate(gm: fx.GraphModule, fake_mode, example_inputs: Optional[Sequence[Any]] = None,
              before: Optional[NodeState] = None) -> None:
    """Give every node of ``gm`` (and of its subgraphs) a fake value in ``meta['val']``, re-running as little as
    possible.

    Nodes keep the value Dynamo recorded when it traced them (``example_value``); only nodes that have no value,
    that a pass created or changed since ``before`` was taken, or whose inputs' values changed are run again, under
    ``fake_mode``. Re-running the user's own ops is what used to add shape guards (HF's label shift ``pad`` asked
    for a concrete length and specialised every dynamic graph to one length): Dynamo already traced them, so their
    values are reused as they are. A value equal in shape, dtype, device and stride to the one it replaces stops
    the re-propagation there. Raises :class:`PropagationError` naming the node that failed.
    """
    mods = [m for _, m in graph_modules(gm)]
    fake_mode = values_fake_mode(gm) or fake_mode
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if example_inputs is not None:
        for n, x in zip(phs, example_inputs):
            if _value(n) is None:
                if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.fake_tensor.FakeTensor):
                    x = fake_mode.from_tensor(x)
                n.meta["val"] = x
    callers = {}
    for m in mods:
        for n in m.graph.nodes:
            if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) \
                    and n.args[0].op == "get_attr":
                body = getattr(m, n.args[0].target, None)
                if isinstance(body, fx.GraphModule):
                    callers.setdefault(body, n)
    done = set()

    def propagate_module(m):
        done.add(m)
        runner = _NodeRunner(m, fake_mode)
        changed = set()
        body_ph = iter([])
        if m in callers:  # a subgraph body: placeholders without a value take the caller's operands'
            body_ph = iter(callers[m].args[1:])
        for n in m.graph.nodes:
            if n.op == "output":
                continue
            cur = _value(n)
            if n.op == "placeholder":
                operand = next(body_ph, None)
                # a body's input holds what its operand holds: when a pass changed the operand (a packed row
                # instead of a padded batch), the body's nodes that read it run again
                new = _value(operand) if isinstance(operand, fx.Node) else None
                if new is not None and (cur is None or not _same_meta(cur, new)):
                    if cur is not None:
                        changed.add(n)
                    cur = new
                    n.meta["val"] = cur
                if cur is None and n.op == "placeholder":
                    cur = n.meta.get("val")
                runner.env[n] = cur
                continue
            need = (cur is None or (before is not None and before.dirty(m, n))
                    or any(a in changed for a in n.all_input_nodes))
            if not need and not _is_context_node(n):
                if n.meta.get("val", None) is None:
                    n.meta["val"] = cur
                runner.env[n] = cur
                continue
            _PROPAGATING[0] = n
            try:
                body = _checkpoint_body(m, n)
                if body is not None and body in callers:
                    # A checkpoint region: its value is its body's output. Running the higher-order op instead
                    # re-traces the body at the example sizes, which (torch 2.11) adds guards such as Eq(s27, 23).
                    if body not in done:
                        propagate_module(body)
                    val = fx.node.map_arg(_output_node(body).args[0], _value)
                else:
                    with fake_mode:
                        val = runner.run_node(n)
                    _bind_unbacked(fake_mode, n, val)
            except Exception as e:
                raise PropagationError(n, e) from e
            finally:
                _PROPAGATING[0] = None
            runner.env[n] = val
            if _is_context_node(n):
                continue
            if n.op == "get_attr" and not isinstance(val, torch.Tensor):
                continue  # a subgraph body (Dynamo records no value for it): nothing to propagate
            new = fx.node.map_aggregate(val, lambda x: x)  # tuples stay tuples
            n.meta["val"] = new
            if cur is None or not _same_meta(cur, new):
                changed.add(n)

    with preserved_autocast_state(), torch.set_grad_enabled(torch.is_grad_enabled()), _quiet_fake_tensor_log():
        for m in mods:
            if m not in done:
                propagate_module(m)


def _bind_unbacked(fake_mode, n: fx.Node, val) -> None:
    """A node whose value has a data-dependent size (``nonzero`` in a rewritten graph) creates an unbacked symbol;
    record where it lives in the value (``meta['unbacked_bindings']``, as Dynamo does), so that it is not left
    pending in the ShapeEnv for the next tracer to trip over."""
    env = getattr(fake_mode, "shape_env", None)
    if env is None or not getattr(env, "pending_fresh_unbacked_symbols", None):
        return
    from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

    bindings = compute_unbacked_bindings(env, val)
    if bindings:
        n.meta["unbacked_bindings"] = bindings


# Higher-order ops that return exactly what their body (args[0], a get_attr of a GraphModule) returns.
_BODY_OUTPUT_HOPS = ("tag_activation_checkpoint", "wrap")


def _checkpoint_body(m: fx.GraphModule, n: fx.Node) -> Optional[fx.GraphModule]:
    """The body of ``n`` if ``n`` calls a higher-order op whose value is its body's output, else None."""
    name = getattr(n.target, "_name", None) or getattr(n.target, "__name__", "")
    if n.op != "call_function" or name not in _BODY_OUTPUT_HOPS or not n.args:
        return None
    a = n.args[0]
    if not (isinstance(a, fx.Node) and a.op == "get_attr"):
        return None
    body = getattr(m, a.target, None)
    return body if isinstance(body, fx.GraphModule) else None


def _output_node(m: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(m.graph.nodes) if n.op == "output")


def values_fake_mode(gm: fx.GraphModule):
    """The fake mode of the values already on ``gm``'s nodes (Dynamo's tracing mode), if any.

    Dynamo hands the backend a fresh fake mode over the same shape environment; values recorded while tracing
    belong to the tracing mode, and new nodes must run in the mode of their inputs ("Mixing fake modes NYI")."""
    from torch._subclasses.fake_tensor import FakeTensor

    for n in gm.graph.nodes:
        v = _value(n)
        if isinstance(v, FakeTensor):
            return v.fake_mode
        if n.op not in ("placeholder", "get_attr"):
            break
    for n in gm.graph.nodes:
        v = _value(n)
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    # A broken rewrite makes FakeTensor log the failing meta kernel at ERROR level before raising; fxfuse reports
    # the failure itself, with the pass's name.
    import logging

    ft_log = logging.getLogger("torch._subclasses.fake_tensor")
    old = ft_log.level
    ft_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        ft_log.setLevel(old)


def output_signature(gm: fx.GraphModule) -> List[OutputSig]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat, _ = torch.utils._pytree.tree_flatten(out.args[0])
    sigs = []
    for i, a in enumerate(flat):
        v = node_val(a)
        if isinstance(v, torch.Tensor):
            sigs.append(OutputSig(i, "tensor", tuple(v.shape), tuple(v.stride()), v.dtype, v.device,
                                  a if isinstance(a, fx.Node) else None))
        elif isinstance(v, torch.SymInt) or isinstance(v, int):
            sigs.append(OutputSig(i, "sym", node=a if isinstance(a, fx.Node) else None))
        else:
            sigs.append(OutputSig(i, "other" if v is not None else "none",
                                  node=a if isinstance(a, fx.Node) else None))
    return sigs


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return known_true(a == b) or str(a) == str(b)


def compare_signatures(before: List[OutputSig], after: List[OutputSig]) -> Optional[Tuple[int, str]]:
    """None when ``after`` computes outputs of the same kind, shape, dtype, device and stride as ``before``;
    otherwise (output index, what differs)."""
    if len(before) != len(after):
        return -1, f"the graph returns {len(after)} values instead of {len(before)}"
    for b, a in zip(before, after):
        if b.kind != a.kind:
            return b.index, f"output {b.index} became a {a.kind} instead of a {b.kind}"
        if b.kind != "tensor":
            continue
        if len(b.shape) != len(a.shape) or not all(_same(x, y) for x, y in zip(b.shape, a.shape)):
            return b.index, "shape changed"
        if b.dtype != a.dtype:
            return b.index, "dtype changed"
        if b.device != a.device:
            return b.index, "device changed"
        # Strides matter where Inductor asserts them and for callers that view the output; only dims of size
        # > 1 carry information.
        for sz, x, y in zip(b.shape, b.stride, a.stride):
            if not _same(sz, 1) and not _same(x, y):
                return b.index, "stride changed"
    return None


# ================================================================================================ guard watch
class GuardWatch:
    """Catches every guard fxfuse's own code would put on a symbolic size, and keeps it out of the compile.

    Inside the block the shape environment records no guard (``ShapeEnv.suppress_guards``); each guard that would
    have been added is kept in :attr:`attempts` as (expression, innermost frame outside torch). A guard such as
    ``Eq(s27, 62)`` specialises the graph to one length and makes Dynamo recompile for every new length, so a pass
    (or a fake impl, or validation) that asks for one must be rolled back: the caller does that when
    :attr:`attempts` is not empty, so the graph that reaches Inductor never depends on a value read under
    suppression. Where the installed torch lacks the hook used to observe suppressed guards, guards are left
    enabled and counted instead (the compile stays correct; it may be specialised).

    A bound (``<``, ``<=``, ``>``, ``>=``) or an exclusion (``!=``) that holds at the current sizes, and with any one
    size a step either side, does not tie the graph to one length:
    :meth:`install_bounds` adds such guards for real, so Dynamo checks them on every call (a length outside the bound
    recompiles once, correctly) and the rewrite can stay. This matters under tensor parallelism: a rank's
    sequence-sharded size is a rank-dependent expression (``s - (s + 1) // 2`` on rank 1, ``(s + 1) // 2`` on rank
    0), so only some ranks' propagation asks for ``size >= 1``; rolling back there alone would leave the ranks with
    different collectives (a hang).
    """

    def __init__(self, fake_mode):
        self.shape_env = getattr(fake_mode, "shape_env", None) if fake_mode is not None else None
        self.attempts: List[Tuple[str, str]] = []
        self._exprs: List[Any] = []  # the suppressed guards' expressions, as attempts lists them
        self._cm = None
        self._n0 = 0

    def __enter__(self) -> "GuardWatch":
        se = self.shape_env
        if se is None:
            return self
        self._n0 = len(se.guards)
        orig = getattr(se, "_log_guard", None)
        if orig is not None and hasattr(se, "suppress_guards"):
            attempts, exprs = self.attempts, self._exprs

            def log_guard(prefix, g, *args, **kwargs):
                if "suppressed" in str(prefix):
                    where = _where_outside_torch()
                    n = _PROPAGATING[0]
                    if n is not None:
                        where += f" (fake propagation of %{n.name} = {getattr(n.target, '__name__', n.target)})"
                    attempts.append((str(g), where))
                    exprs.append(g)
                return orig(prefix, g, *args, **kwargs)

            se._log_guard = log_guard  # instance attribute shadows the method while we watch
            self._cm = se.suppress_guards()
            self._cm.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        se = self.shape_env
        if se is None:
            return
        if self._cm is not None:
            self._cm.__exit__(*exc)
            self._cm = None
            se.__dict__.pop("_log_guard", None)
        for g in se.guards[self._n0:]:  # guards that got through anyway (no suppression hook)
            self.attempts.append((str(g.expr), str(getattr(g, "sloc", "")) or "<unknown>"))

    def install_bounds(self) -> bool:
        """After the block: if every guard asked for is a bound or an exclusion, and together they hold at the current
        sizes and with any one size a step either side, add them to the shape environment as real guards, forget
        them and return True; else change nothing and return False."""
        import sympy

        se = self.shape_env
        if se is None or not self.attempts or len(self._exprs) != len(self.attempts):
            return False  # nothing asked, or guards that got through unobserved (no suppression hook)
        # bounds and exclusions (Ne: a size is not some value) hold for whole ranges of lengths; Eq pins one
        bounds = (sympy.GreaterThan, sympy.StrictGreaterThan, sympy.LessThan, sympy.StrictLessThan, sympy.Unequality)
        for e in self._exprs:
            if not isinstance(e, bounds):
                return False  # an equality (one length) or anything else: the caller rolls back
        # together they must hold at the current sizes and with any one size a step either side (2 at least, as
        # Dynamo assumes), else they pin it (s >= 62 and s <= 62) or split lengths by parity: roll back
        points = [dict(se.var_to_val)]
        for sym in set().union(*(e.free_symbols for e in self._exprs)):
            val = se.var_to_val.get(sym)
            if val is None:
                return False  # not a size with a value here (unbacked): nothing to check it by
            points += [{**se.var_to_val, sym: val + d} for d in (-1, 1) if val + d >= 2]
        try:
            if any(e.xreplace(p) is not sympy.true for p in points for e in self._exprs):
                return False
        except (TypeError, ValueError):
            return False
        for e in self._exprs:
            se.evaluate_expr(e)  # outside suppress_guards: a guard Dynamo installs with the compiled graph
        self.attempts.clear()
        self._exprs.clear()
        return True

    def describe(self) -> str:
        first, where = self.attempts[0]
        more = f" (and {len(self.attempts) - 1} more)" if len(self.attempts) > 1 else ""
        return f"it would add the shape guard {first}{more}, asked for at {where}"


def _where_outside_torch() -> str:
    import os
    import traceback

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for fr in reversed(traceback.extract_stack()[:-2]):
        f = os.path.abspath(fr.filename)
        if f.startswith(torch_dir) or fr.filename.startswith("<") or "/sympy/" in f:
            continue
        return f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
    return "<inside torch>"
