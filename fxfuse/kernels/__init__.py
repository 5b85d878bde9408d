"""Triton kernels, their launchers, float64 references and the chunked PyTorch paths behind ``fxfuse::`` ops.

One module per fused op; each keeps kernel, launcher and reference side by side (Triton-tutorial style). The
``torch.library`` op definitions that call them live in :mod:`fxfuse.ops`.
"""
