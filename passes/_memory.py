"""What the memory-driven passes (``sequence_tiling``, ``checkpoint_offload``) share: a tensor's bytes at the
compile's example sizes, and the memory of the device a graph runs on."""
from __future__ import annotations

from typing import Any, Optional

import torch

from fxfuse.graph_utils import node_val, numel_hint


def nbytes(v: Any) -> int:
    """Bytes of tensor ``v`` at the compile's example sizes (graph_utils.size_hint: an unbacked size by its upper
    bound)."""
    return numel_hint(v) * v.element_size()


def device_memory(node: Any) -> Optional[int]:
    """Total memory of the CUDA device ``node``'s value lives on; None elsewhere (a CPU graph)."""
    v = node_val(node)
    dev = v.device if isinstance(v, torch.Tensor) else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(dev).total_memory
    return None


def host_memory_available() -> Optional[int]:
    """Bytes of host memory available now (Linux ``MemAvailable``; None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
