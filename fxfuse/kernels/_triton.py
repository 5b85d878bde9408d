"""Triton is optional: every op's CPU path needs none of it. Kernel modules import ``triton``, ``tl`` and
``HAVE_TRITON`` from here so the fallback lives in one place."""
try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["triton", "tl", "HAVE_TRITON"]
