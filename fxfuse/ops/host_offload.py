"""``fxfuse::to_host`` / ``fxfuse::to_device``: a tensor moved to pinned host memory and back, inside a compiled
graph, with gradients (issue 32, :mod:`passes.checkpoint_offload`).

Under gradient checkpointing the forward saves each layer's input for the backward's recompute: at 512k tokens and
Llama-3.1-8B widths, 32 ``[S, 4096]`` bf16 tensors, 128 GiB. The checkpoint-offload pass hands each checkpointed
region its input as ``to_host(x, saved=True)`` and converts it back first thing inside the region with
``to_device``: the region's saved input is then the host copy, and the recompute in the backward starts by copying
it back.

* ``to_host(x, saved)``: a copy of ``x`` in pinned host memory (from torch's caching host allocator, so the blocks
  of one step are reused by the next), written on a side stream (one per device) that first waits for the compute
  stream: the compute stream goes on at once. ``x`` is recorded on the side stream, so its block is not reused
  before the copy has read it; the pinned block keeps an event of the copy in the host allocator. ``saved`` marks
  a tensor the backward will reload: those are remembered in forward order (weakly) for the prefetch below.
* ``to_device(h, device)``: the copy back, also on the side stream (so it follows ``h``'s own copy), the compute
  stream waiting for it. Inside a backward (the autograd engine running) it then starts the copy of the saved
  tensor offloaded just before ``h``, which the backward's next region reloads: that region finds it on the device,
  copied while the current one computed (one region input of extra device memory).

Each is the other's backward: the gradient of a region's input travels the same way back. In a compiled graph
the two copies that meet without anything between them, ``to_device(to_host(t))`` (the forward's own use of the
region input, the gradient's way back), are folded to ``t`` after AOTAutograd's partition
(:func:`fold_round_trips`): the forward then only writes the host copy and the backward only reads it.
On a CPU tensor both are plain copies.
"""
from __future__ import annotations

import weakref
from typing import Dict, List

import torch
import torch.fx as fx
from torch import Tensor

__all__ = ["to_host", "to_device", "fold_round_trips"]

_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define("to_host(Tensor x, bool saved=False) -> Tensor")
_lib.define("to_device(Tensor h, Device device) -> Tensor")
# declared as writing h so that no graph drops it (it returns nothing); it only orders the compute stream
_lib.define("wait_host_copy(Tensor(a!) h, Tensor x) -> ()")


class _CopyEngine:
    """One device's side stream, the saved host copies in forward order and the one prefetched reload."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.saved: List[weakref.ref] = []  # host copies marked saved, forward order; dead ones pruned
        from torch.utils.weak import WeakIdKeyDictionary

        self.prefetched = WeakIdKeyDictionary()  # host copy -> (device tensor, event of its copy)
        self.copies = WeakIdKeyDictionary()  # host copy -> event of the copy that wrote it

    def to_host(self, x: Tensor, saved: bool) -> Tensor:
        compute = torch.cuda.current_stream(x.device)
        self.stream.wait_stream(compute)  # x is written
        with torch.cuda.stream(self.stream):
            out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
            out.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.copies[out] = done
        x.record_stream(self.stream)  # x's block, once freed, is not handed out before the copy has read it
        if saved:
            self.saved = [r for r in self.saved if r() is not None]
            self.saved.append(weakref.ref(out))
        return out

    def wait_host_copy(self, h: Tensor, x: Tensor) -> None:
        done = self.copies.pop(h, None)
        if done is not None:
            torch.cuda.current_stream(x.device).wait_event(done)

    def _copy_in(self, h: Tensor, device: torch.device):
        compute = torch.cuda.current_stream(device)
        out = torch.empty(h.shape, dtype=h.dtype, device=device)  # a compute-stream block
        self.stream.wait_stream(compute)  # its last reader there is done
        with torch.cuda.stream(self.stream):
            out.copy_(h, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        out.record_stream(self.stream)  # freed unread (a prefetch never used): not reused before the copy ends
        return out, done

    def to_device(self, h: Tensor, device: torch.device) -> Tensor:
        entry = self.prefetched.pop(h, None)
        out, done = entry if entry is not None else self._copy_in(h, device)
        torch.cuda.current_stream(device).wait_event(done)
        if torch._C._current_graph_task_id() != -1:  # in a backward: the next region's input, one ahead
            self._prefetch_before(h, device)
        return out

    def _prefetch_before(self, h: Tensor, device: torch.device) -> None:
        alive = [t for t in (r() for r in self.saved) if t is not None]
        i = next((k for k, t in enumerate(alive) if t is h), None)
        if not i:  # not a saved copy, or the first one: nothing before it
            return
        prev = alive[i - 1]
        if prev not in self.prefetched:
            self.prefetched[prev] = self._copy_in(prev, device)


_ENGINES: Dict[torch.device, _CopyEngine] = {}


def _engine(device) -> _CopyEngine:
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    if device not in _ENGINES:
        _ENGINES[device] = _CopyEngine(device)
    return _ENGINES[device]


def _to_host_impl(x: Tensor, saved: bool = False) -> Tensor:
    if x.is_cuda:
        return _engine(x.device).to_host(x, saved)
    return x.clone(memory_format=torch.contiguous_format)


def _to_device_impl(h: Tensor, device: torch.device) -> Tensor:
    device = torch.device(device)
    if device == h.device:
        return h.clone(memory_format=torch.contiguous_format)
    if device.type == "cuda" and h.is_pinned():
        return _engine(device).to_device(h, device)
    return h.to(device)


def _wait_host_copy_impl(h: Tensor, x: Tensor) -> None:
    if x.is_cuda:
        _engine(x.device).wait_host_copy(h, x)


for _key in ("CPU", "CUDA"):
    _lib.impl("to_host", _to_host_impl, _key)
    _lib.impl("to_device", _to_device_impl, _key)
    _lib.impl("wait_host_copy", _wait_host_copy_impl, _key)


@torch.library.register_fake("fxfuse::wait_host_copy", lib=_lib)
def _(h, x):
    return None


@torch.library.register_fake("fxfuse::to_host", lib=_lib)
def _(x, saved=False):
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.register_fake("fxfuse::to_device", lib=_lib)
def _(h, device):
    return torch.empty(h.shape, dtype=h.dtype, device=device)


def _setup_to_host(ctx, inputs, output):
    ctx.device = inputs[0].device


def _to_host_backward(ctx, grad):
    return torch.ops.fxfuse.to_device(grad, ctx.device), None


def _setup_to_device(ctx, inputs, output):
    pass


def _to_device_backward(ctx, grad):
    return torch.ops.fxfuse.to_host(grad), None


torch.library.register_autograd("fxfuse::to_host", _to_host_backward, setup_context=_setup_to_host, lib=_lib)
torch.library.register_autograd("fxfuse::to_device", _to_device_backward, setup_context=_setup_to_device, lib=_lib)


def to_host(x: Tensor, saved: bool = False) -> Tensor:
    """``x`` copied to (pinned) host memory, differentiable (see the module docstring)."""
    return torch.ops.fxfuse.to_host(x, saved)


def to_device(h: Tensor, device) -> Tensor:
    """``h`` copied to ``device``, differentiable (see the module docstring)."""
    return torch.ops.fxfuse.to_device(h, torch.device(device))


def fold_round_trips(graph: fx.Graph) -> int:
    """``to_device(to_host(t), d)`` -> ``t`` where ``t`` is a contiguous tensor on ``d`` of the same shape and dtype:
    the values are equal, and the copies were only there because one function (a checkpointed region's body) serves
    both the forward, which has ``t``, and the recompute, which has only the host copy. Run on AOTAutograd's
    partitioned graphs (the forward keeps ``to_host`` as a saved output; the gradient's way back loses both copies).

    Then every ``to_host(t)`` left gets ``wait_host_copy(h, t)`` after ``t``'s last reader: the copy runs on a side
    stream, and a compiler may hand ``t``'s memory to a later kernel of the compute stream as soon as ``t`` is
    dead (Inductor reuses buffers without freeing them), so the compute stream waits for the copy there, where it
    has long finished at the lengths that offload. Returns how many round trips were folded."""
    from torch._prims_common import is_contiguous
    from torch.fx.experimental.symbolic_shapes import statically_known_true as _known, sym_eq

    to_host_op, to_device_op = torch.ops.fxfuse.to_host.default, torch.ops.fxfuse.to_device.default
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not to_device_op:
            continue
        src = node.args[0]
        if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is to_host_op):
            continue
        t = src.args[0]
        tv, v = (t.meta.get("val") if isinstance(t, fx.Node) else None), node.meta.get("val")
        if not (isinstance(tv, Tensor) and isinstance(v, Tensor)) or tv.device != v.device \
                or tv.dtype != v.dtype or not _known(sym_eq(tuple(tv.shape), tuple(v.shape))) \
                or not _known(is_contiguous(tv)):
            continue
        node.replace_all_uses_with(t)
        graph.erase_node(node)
        if not src.users:
            graph.erase_node(src)
        folded += 1
    _order_host_copies(graph, to_host_op)
    return folded


def _order_host_copies(graph: fx.Graph, to_host_op) -> None:
    wait_op = torch.ops.fxfuse.wait_host_copy.default
    if any(n.op == "call_function" and n.target is wait_op for n in graph.nodes):
        return  # done already (a graph this ran on before)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for h in [n for n in graph.nodes if n.op == "call_function" and n.target is to_host_op]:
        t = h.args[0]
        if not isinstance(t, fx.Node):
            continue
        last = max(t.users, key=order.__getitem__)
        if last.op == "output":  # lives on past the graph: freed through the allocator, which record_stream guards
            continue
        with graph.inserting_after(last):
            graph.call_function(wait_op, (h, t))
