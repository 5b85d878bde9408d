"""Triton kernels, their launchers, float64 references and the chunked PyTorch paths behind the lm-head and LoRA
``fxfuse::`` ops.

One module per fused op; each keeps kernel, launcher and reference side by side (Triton-tutorial style), with the
pieces several kernels share in :mod:`.triton_support` (Triton detection, interpreter check, tanh) and
:mod:`.lm_head_rows` (the online row statistics of both lm-head ops). The ``torch.library`` op definitions that
call them live in :mod:`fxfuse.ops`; the attention kernels live with the rest of attention in
:mod:`fxfuse.attention`.
"""
