"""Which kernel runs an attention site: fxfuse's own (``fxfuse::softcap_attention``) or one torch already ships
(``scaled_dot_product_attention``, whose cuDNN backend torch picks first on Hopper).

torch's kernels handle only part of what the op does: no tanh softcap, no sliding window, no packed documents or
key padding without an S x Skv mask, no attention sinks, and ``is_causal`` aligned top-left (the op aligns
bottom-right; they agree only when S == Skv). Where a site's recipe is one torch handles with the same numerical
contract (plain causal with S == Skv, or no mask at all: no fully masked rows either way; or causal inside
fixed-size chunks from each row's start, Llama-4's chunked layers, which SDPA runs as a batch of chunks:
:mod:`.chunked`), the faster kernel on the GPU in hand runs it. "Faster" is what was measured side by side on the card (:data:`MEASURED`), not a guess:
a GPU or head dim with no measurement keeps fxfuse's kernel, and the fusion report says which kernel ran at each
site and why (``kernel``, ``kernel_reason``).

The choice is made where the site is rewritten (the attention passes) and by the public function
:func:`fxfuse.ops.softcap_attention` for eager calls; the op itself always runs fxfuse's kernels. Override with
the passes' ``kernel`` option (``"auto"`` default, ``"fxfuse"``, ``"sdpa"``: SDPA wherever it can express the
site, measured or not) or the public function's ``kernel`` argument.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = ["KERNELS", "MEASURED", "MEASURED_CHUNKS", "KernelChoice", "sdpa_expressible", "choose_kernel"]

KERNELS = ("auto", "fxfuse", "sdpa")

# (compute capability, head_dim) -> what was measured for a plain causal layer (bf16, 32 q / 8 kv heads, 32k tokens,
# forward + backward) on that card: (SDPA's kernel ms, fxfuse's kernel ms, where the rows are). SDPA is chosen
# where its time is lower. sm_90: H200, torch 2.11 / cuDNN's sm90 flash kernels, triton 3.6.
MEASURED = {
    ((9, 0), 64): (35.6, 48.5, "benchmarks/results/h200-attn-kernels-2026-11-25.jsonl"),
    ((9, 0), 128): (55.3, 76.0, "benchmarks/results/h200-attn-kernels-2026-11-25.jsonl"),
}


# The same for causal attention inside chunks (bf16, 32 q / 8 kv heads, chunks of 8192, 64k tokens, forward +
# backward): fxfuse::chunked_causal_attention (cuDNN's causal kernels on the chunks as a batch) against fxfuse's
# kernel on the chunk ids as documents, in the same call. sm_90: H200, torch 2.11, triton 3.6.
MEASURED_CHUNKS = {
    ((9, 0), 64): (18.27, 21.94, "benchmarks/results/h200-chunked-op-2026-11-28-b.json"),
    ((9, 0), 128): (27.82, 39.81, "benchmarks/results/h200-chunked-op-2026-11-28-d.json"),
}


@dataclass(frozen=True)
class KernelChoice:
    kernel: str  # "fxfuse" | "sdpa"
    reason: str


def sdpa_expressible(*, softcap: float, causal: bool, window: int, has_mask: bool, has_docs: bool,
                     has_key_valid: bool, sinks: bool, head_dim_pads: Tuple[int, int],
                     same_length: bool, chunks: int = 0) -> Tuple[bool, str]:
    """Can ``scaled_dot_product_attention`` (no mask tensor) compute this site with the op's contract? ``chunks``:
    the recipe's chunk tiling (``MaskRecipe.chunk_tiling``), run as SDPA calls on the chunks; its chunk ids are
    then not counted as documents."""
    if chunks and not (causal and same_length):
        return False, "attention chunks without causal (or with S != Skv)"
    if softcap:
        return False, "tanh softcap (SDPA has none)"
    if sinks:
        return False, "attention sinks"
    if window:
        return False, "sliding window (SDPA has no window without a mask tensor)"
    if has_docs or has_key_valid:
        return False, "packed documents / key padding (SDPA would need the S x Skv mask)"
    if has_mask:
        return False, "a mask tensor the recipe reader could not prove"
    if causal and not same_length:
        return False, "causal with S != Skv (SDPA's is_causal aligns top-left, the op bottom-right)"
    if any(head_dim_pads):
        return False, "q/k and v head dims differ"
    return True, ""


def _cudnn_sdpa_usable() -> bool:
    try:
        return bool(torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled())
    except Exception:  # pragma: no cover - older torch without the switch
        return False


def choose_kernel(mode: str, device: torch.device, dtype: torch.dtype, head_dim: int, expressible: bool, why_not: str,
                  capability: Optional[Tuple[int, int]] = None, causal: bool = True,
                  chunks: int = 0) -> KernelChoice:
    """The kernel for a site. ``mode``: "auto" (the measured faster one), "fxfuse", "sdpa" (where expressible).
    ``capability`` defaults to the device's (tests pass one). :data:`MEASURED` holds causal layers: "auto" keeps
    fxfuse's kernel for a site without a causal mask (unmeasured). A chunked site (``chunks``, the chunk size) is
    decided by :data:`MEASURED_CHUNKS`."""
    if mode not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {mode!r}")
    if mode == "fxfuse":
        return KernelChoice("fxfuse", "kernel='fxfuse' requested")
    if not expressible:
        return KernelChoice("fxfuse", f"SDPA cannot run it: {why_not}")
    if mode == "sdpa":
        return KernelChoice("sdpa", "kernel='sdpa' requested")
    if device.type != "cuda":
        return KernelChoice("fxfuse", f"{device.type} device: fxfuse's blockwise path")
    if dtype not in (torch.bfloat16, torch.float16):
        return KernelChoice("fxfuse", f"{dtype}: measured only in bf16 / fp16 (SDPA's fused kernels)")
    if not causal:
        return KernelChoice("fxfuse", "no causal mask: measured only for causal layers")
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    m = (MEASURED_CHUNKS if chunks else MEASURED).get((tuple(capability), int(head_dim)))
    what = f"causal in chunks of {chunks}, as a batch of chunks" if chunks else "plain causal layer"
    if m is None:
        return KernelChoice("fxfuse", f"no side-by-side measurement for sm_{capability[0]}{capability[1]} at "
                                      f"head_dim {head_dim} ({what}): fxfuse's kernel kept")
    if not _cudnn_sdpa_usable():
        return KernelChoice("fxfuse", "cuDNN SDPA is disabled or unavailable here (the measured SDPA kernel)")
    sdpa_ms, ours_ms, where = m
    if sdpa_ms < ours_ms:
        return KernelChoice("sdpa", f"SDPA (cuDNN) measured faster here: {sdpa_ms} vs fxfuse {ours_ms} ms "
                                    f"({what}, {'64k' if chunks else '32k'} tokens, head_dim {head_dim}; {where})")
    return KernelChoice("fxfuse", f"fxfuse measured faster here: {ours_ms} vs SDPA {sdpa_ms} ms ({where})")
