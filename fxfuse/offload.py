"""Activations saved for the backward kept in host memory (issue 32): ``options={"offload_activations": True}``.

At 512k tokens the 32 checkpointed layer inputs of an 8B model are 128 GiB, more than an H200 holds beside the
weights. torch's AOTAutograd can move the tensors its forward graph saves to the CPU and bring them back in the
backward, on a side stream with prefetching (``torch._functorch.config.enable_activation_offloading`` and the
``activation_offload_*`` / ``activation_reload_prefetch`` settings, which act on forward-graph nodes whose meta says
``should_offload``); nothing in torch marks nodes. fxfuse marks them in Inductor's joint graph
(:class:`MarkSavedActivations`, a ``joint_custom_post_pass``): every forward node whose output holds at least
``min_bytes`` (default 16 MiB); the partitioner then offloads those it saves that can be offloaded (not graph
outputs, views or non-contiguous tensors). Under HF gradient checkpointing that is each layer's input: one
``[tokens, hidden]`` tensor per layer, reloaded one layer ahead while the later layer's backward runs.

On a CPU the copies are to the same device (the tests exercise the graph rewrite and the values); on CUDA the side
stream and prefetching are on. A torch without the setting refuses the option with the reason.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["offload_patches", "MarkSavedActivations", "available"]

DEFAULT_MIN_BYTES = 16 * 2**20


def available() -> bool:
    import torch._functorch.config as fc

    return hasattr(fc, "enable_activation_offloading")


def _bytes(v) -> int:
    try:
        n = v.numel()
        n = int(n.node.hint) if isinstance(n, torch.SymInt) and n.node.has_hint() else int(n)
    except Exception:  # an unbacked size without a hint: large enough to matter
        return 2**62
    return n * v.element_size()


class MarkSavedActivations(CustomGraphPass):
    """Inductor joint-graph pass: mark the nodes whose output holds at least ``min_bytes`` as offloadable
    (``should_offload``); the partitioner offloads those of them the forward saves. Chains a user's own joint pass
    first; its uuid (Inductor's and AOTAutograd's cache keys) carries the threshold and the user's pass's."""

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES, existing=None):
        self.min_bytes, self.existing = min_bytes, existing

    def __call__(self, graph: fx.Graph) -> None:
        if self.existing is not None:
            self.existing(graph)
        for n in graph.nodes:
            v = n.meta.get("val")
            if n.op == "call_function" and isinstance(v, torch.Tensor) and v.is_floating_point() \
                    and _bytes(v) >= self.min_bytes:
                n.meta["should_offload"] = True

    def uuid(self):
        inner = self.existing.uuid() if hasattr(self.existing, "uuid") else None
        return ("fxfuse.offload", self.min_bytes, inner)


def offload_patches(device: str, min_bytes: int, inductor_patches: Dict[str, Any]):
    """(Inductor config patches, functorch config patches) that offload saved activations."""
    existing = inductor_patches.get("joint_custom_post_pass", torch._inductor.config.joint_custom_post_pass)
    inductor = {"joint_custom_post_pass": MarkSavedActivations(min_bytes, existing)}
    functorch = {"enable_activation_offloading": True}
    if device == "cuda":
        functorch.update(activation_offload_separate_stream=True, activation_offload_sink_wait=True,
                         activation_reload_prefetch=True)
    # the stream / prefetch settings came after the first version of the feature (torch PRs 167880, 177621):
    # set the ones this torch has
    import torch._functorch.config as fc

    return inductor, {k: v for k, v in functorch.items() if hasattr(fc, k)}
