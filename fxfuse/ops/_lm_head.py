"""Pieces shared by the fused lm-head ops (linear + cross-entropy, linear + log-probs)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


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
