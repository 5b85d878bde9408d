"""Fused ops, callable directly (eager or under torch.compile) and inserted into graphs by fxfuse's passes.

Each op is a ``torch.library.custom_op`` in the ``fxfuse::`` namespace (so it shows as such in profiler traces)
with a fake impl, an autograd formula, a Triton path for CUDA and a chunked PyTorch path for CPU.
"""
__all__: list = []
