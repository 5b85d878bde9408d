"""What the memory-driven passes (``sequence_tiling``, ``checkpoint_offload``) share: a tensor's bytes at the
compile's example sizes, and the memory of the device a graph runs on."""
from __future__ import annotations

from typing import Any, Optional

import torch

from fxfuse.graph_utils import node_val


def nbytes(v: Any) -> int:
    """Bytes of tensor ``v`` at its example sizes (a symbolic size by its hint; an unbacked one without a hint
    counts as huge: large enough to matter)."""
    n = v.numel()
    try:
        n = int(n.node.hint) if isinstance(n, torch.SymInt) and n.node.has_hint() else int(n)
    except Exception:  # noqa: BLE001
        return 2**62
    return n * v.element_size()


def device_memory(node: Any) -> Optional[int]:
    """Total memory of the CUDA device ``node``'s value lives on; None elsewhere (a CPU graph)."""
    v = node_val(node)
    dev = v.device if isinstance(v, torch.Tensor) else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(dev).total_memory
    return None
