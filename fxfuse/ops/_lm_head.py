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
