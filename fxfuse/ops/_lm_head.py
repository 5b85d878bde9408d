"""Pieces shared by the fused lm-head ops (linear + cross-entropy, linear + log-probs)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..kernels import lm_head_rows

#: The dtypes both ops take for hidden, weight and bias.
LM_HEAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def chunk_budget(chunk_bytes: int, weight: Optional[Tensor] = None, vocab_rows: Optional[int] = None) -> int:
    """The ops' ``chunk_bytes`` argument as a logits-chunk budget in bytes: 0 (or less) means the default,
    ``lm_head_rows.DEFAULT_CHUNK_BYTES``, raised to ``MIN_DEFAULT_CHUNK_ROWS`` rows of ``weight``'s vocabulary
    (read at call time), or of ``vocab_rows`` vocabulary entries where given (the vocabulary-parallel ops: the
    largest slice's, so every rank gets the same budget and cuts the same chunks)."""
    if chunk_bytes and chunk_bytes > 0:
        return int(chunk_bytes)
    vocab = weight.shape[0] if vocab_rows is None and weight is not None else (vocab_rows or 0)
    rows = lm_head_rows.MIN_DEFAULT_CHUNK_ROWS * vocab * (weight.element_size() if weight is not None else 0)
    return max(lm_head_rows.DEFAULT_CHUNK_BYTES, rows)


def flatten_and_grad_flags(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor]
                           ) -> Tuple[Tensor, Tensor, bool, bool, bool]:
    """hidden [..., D] -> [N, D] and its per-token ``target`` [...] -> [N], plus which inputs need gradients.

    Called in a CompositeImplicitAutograd body, i.e. at trace time under AOTAutograd: the flags decide which
    gradients the forward/backward custom ops compute, so nothing is computed for frozen weights.
    """
    D = hidden.shape[-1]
    on = torch.is_grad_enabled()
    return (hidden.reshape(-1, D), target.reshape(-1), on and hidden.requires_grad, on and weight.requires_grad,
            on and bias is not None and bias.requires_grad)


def empty_weight_grads(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], grad_hidden: bool,
                       grad_weight: bool, grad_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Fake (shape, dtype, stride) gradients of hidden [N, D], weight [V, D] and bias [V]; [0] when not asked."""
    N, D = hidden.shape
    V = weight.shape[0]
    return (hidden.new_empty((N, D)) if grad_hidden else hidden.new_empty(0),
            weight.new_empty((V, D)) if grad_weight else hidden.new_empty(0),
            bias.new_empty((V,)) if (grad_bias and bias is not None) else hidden.new_empty(0))


def check_class_indices(op: str, target: Tensor, num_classes: int, ignore_index: Optional[int] = None,
                        what: str = "target") -> None:
    """Every entry of ``target`` must be a class index in [0, num_classes) (or ``ignore_index``).

    The fused kernels never index out of bounds with a bad target, they would silently compute the loss of a
    class that does not exist: check it here. On the CPU the first offending value and its position are named at
    once. On CUDA a host sync per step is not acceptable, so the check is a device-side assertion
    (``torch._assert_async``): like PyTorch's own cross-entropy on CUDA, a bad target stops the program with a
    device-side assert, here with this op's message.
    """
    if target.numel() == 0:
        return
    t = target.reshape(-1)
    bad = (t < 0) | (t >= num_classes)
    if ignore_index is not None:
        bad &= t != ignore_index
    allowed = f"0..{num_classes - 1}" + (f" or ignore_index={ignore_index}" if ignore_index is not None else "")
    if t.device.type == "cpu":
        if bool(bad.any()):
            from ..errors import FxFuseContractError, user_source_line

            i = int(bad.nonzero()[0])
            where = user_source_line()
            err = FxFuseContractError(
                f"{op}: {what}[{i}] = {int(t[i])} is not a class index of the {num_classes}-entry vocabulary "
                f"(allowed: {allowed}; {what} is the 1-D class-index tensor the loss reads: the labels flattened, "
                f"after the model's shift if it shifts them)" + (f"\n  at {where}" if where else ""))
            err.op, err.index = op, i  # the compiled graph's wrapper names the user's line and labels[row, pos]
            raise err
    else:
        torch._assert_async(~bad.any(), f"{op}: a {what} entry is outside {allowed} (vocabulary of {num_classes})")
