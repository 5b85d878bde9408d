"""What every kernel module needs from Triton, defined once.

Triton is optional: every op's CPU path needs none of it, so kernel modules import ``triton``, ``tl`` and
``HAVE_TRITON`` from here and keep their ``@triton.jit`` code under ``if HAVE_TRITON:``. Also here: when a
tensor's op takes its Triton path (:func:`use_triton`), whether the kernels run in Triton's CPU interpreter
(:func:`interpreting`, which tests use to run the kernels without a GPU), and the two tanh forms the softcapped
kernels (attention, lm-head) choose from.
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAVE_TRITON = False

try:  # host-side TMA descriptors (triton >= 3.4; the interpreter runs them too)
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover
    TensorDescriptor = None

try:  # what Triton raises where its compiler fails on a kernel variant (its front end, or ptxas crashing)
    from triton.compiler.errors import CompilationError as _CompilationError
    from triton.runtime.errors import PTXASError as _PTXASError
    COMPILER_ERRORS = (_CompilationError, _PTXASError)
except Exception:  # pragma: no cover - no triton, or one without these errors
    COMPILER_ERRORS = ()

__all__ = ["triton", "tl", "HAVE_TRITON", "interpreting", "use_triton", "tanh_approx", "tanh_exp",
           "tile_descriptor", "tile_addressable", "sm_count", "smem_limit", "dot_pad", "TensorDescriptor",
           "COMPILER_ERRORS"]


@functools.lru_cache(maxsize=None)
def _device_properties(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def _device_of(t) -> torch.device:
    return t if isinstance(t, torch.device) else t.device


def _properties_of(t):
    d = _device_of(t)
    return _device_properties(d.index if d.index is not None else torch.cuda.current_device())


def sm_count(t) -> int:
    """Multiprocessors of CUDA tensor (or device) ``t``'s device (persistent grids size themselves by it); 4
    elsewhere (the interpreter runs programs one after another)."""
    return _properties_of(t).multi_processor_count if _device_of(t).type == "cuda" else 4


def smem_limit(t) -> int:
    """Bytes of shared memory one program may use on CUDA tensor (or device) ``t``'s device (opt-in maximum)."""
    return _properties_of(t).shared_memory_per_block_optin


def dot_pad(n: int) -> int:
    """``n`` rounded up to a power of two of at least 16: a ``tl.dot`` operand's dimensions must be >= 16."""
    return max(16, triton.next_power_of_2(n))


def tile_addressable(t, block_shape) -> bool:
    """Whether the copy engine can load ``block_shape`` tiles of ``t``: its last dim contiguous, every other stride
    and the base 16-byte aligned (e.g. not a head dim that is not a multiple of 8 in bf16), a tile row of at least
    16 bytes, and descriptor support in this Triton."""
    if TensorDescriptor is None or t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    es = t.element_size()
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):  # a broadcast (expanded) dim: not a TMA layout
        return False
    return not any((st * es) % 16 for st in t.stride()[:-1]) and block_shape[-1] * es >= 16


def tile_descriptor(t, block_shape):
    """A TMA tensor descriptor over ``t`` that loads ``block_shape`` tiles (rows past a dim's end read as 0), or
    None where the copy engine cannot address ``t`` (:func:`tile_addressable`). Kernels take the descriptor where
    they get one and fall back to pointer tiles otherwise."""
    if not tile_addressable(t, block_shape):
        return None
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block_shape))


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``, set before triton is imported).
    The interpreter has no inline PTX and never contracts a multiply and an add, so fast paths are off there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t, force: bool = False) -> bool:
    """Whether an op on tensor ``t`` takes its Triton kernel: on CUDA, or anywhere with ``force`` (tests run the
    kernels on CPU tensors through the interpreter). Without Triton, never."""
    return HAVE_TRITON and (t.device.type == "cuda" or force)


if HAVE_TRITON:

    @triton.jit
    def tanh_approx(x):
        """tanh as one MUFU instruction (sm_75+): max relative error ~2^-11, below the bf16 rounding of a logit or
        an attention score. CUDA only, never under the interpreter (no inline PTX there)."""
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def tanh_exp(x):
        """tanh from one exp, ~3e-8 absolute in fp32; runs everywhere, the interpreter included (libdevice does
        not)."""
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x >= 0, t, -t)
else:  # pragma: no cover
    tanh_approx = tanh_exp = None
