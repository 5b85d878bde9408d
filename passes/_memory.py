"""What the memory-driven passes (``sequence_tiling``, ``checkpoint_offload``) share: a tensor's bytes at the
compile's example sizes, and the memory of the device a graph runs on."""
from __future__ import annotations

from typing import Any, Optional

import torch

from fxfuse.graph_utils import node_val, numel_hint, size_hint


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
    """Bytes of host memory available now: Linux ``MemAvailable`` plus the pinned blocks torch's caching host
    allocator holds free (a recompile mid-training finds the last step's host copies there, cached, not in
    ``MemAvailable``). None where ``/proc/meminfo`` cannot be read."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        return None
    if avail is None:
        return None
    try:
        stats = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
    except Exception:  # noqa: BLE001  (an older torch, or no CUDA runtime: the kernel's figure alone)
        stats = {}
    if "active_bytes.current" in stats:  # owned (handed out + cached) and handed out
        cached_free = stats.get("allocated_bytes.current", 0) - stats["active_bytes.current"]
    else:  # the older names
        cached_free = stats.get("reserved_bytes.current", 0) - stats.get("allocated_bytes.current", 0)
    return avail + max(0, cached_free)


def planned_scale(v: Any, plan_tokens: Optional[int]) -> float:
    """How much larger a token-wise tensor ``v`` (tokens in every dimension but the last) is at ``plan_tokens``
    tokens than at the compile's example sizes: ``plan_tokens / example tokens`` where ``v``'s token count is
    symbolic (the compiled graph serves every length) and ``plan_tokens`` is more, else 1. The memory-driven auto
    modes decide at the longest step the user plans for, not at whichever length Dynamo compiled the graph at."""
    if not plan_tokens or not isinstance(v, torch.Tensor) or v.dim() < 2:
        return 1.0
    dims = v.shape[:-1]
    if all(isinstance(d, int) for d in dims):
        return 1.0
    tokens = 1
    for d in dims:
        tokens *= size_hint(d, fallback=torch._inductor.config.unbacked_symint_fallback)
    return max(1.0, plan_tokens / max(tokens, 1))
