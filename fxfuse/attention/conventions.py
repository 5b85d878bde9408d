"""What every part of the attention family agrees on, defined once: the op's names, the masked-value threshold,
the ``masked_rows`` codes, the dtypes and largest head_dim the kernels take.

The passes decide what they may hand over (a fill that counts as a hard mask, a head_dim the kernels take), the op
checks it (its contract) and the kernels and the PyTorch path implement it (which mask values mask, what a fully
masked row gives): each of those numbers must be the same everywhere, so each is written here and imported by the
others. Plain Python values, no Triton here: the kernels read the threshold as a ``tl.constexpr`` made from
:data:`MASKED_BELOW` (:data:`fxfuse.attention.scores.MASKED_BELOW_C`).
"""
from __future__ import annotations

import torch

__all__ = ["OP_NAME", "BACKWARD_OP_NAME", "MASKED_BELOW", "MASKED_ROWS_ZERO", "MASKED_ROWS_UNIFORM", "MASKED_ROWS_NAN",
           "MASKED_ROWS", "DTYPES", "MAX_HEAD_DIM", "LOG2E", "LN2"]

# The custom op (torch.ops.fxfuse.softcap_attention) and its backward.
OP_NAME = "fxfuse::softcap_attention"
BACKWARD_OP_NAME = "fxfuse::softcap_attention_backward"

# Additive mask values at or below this count as "masked" (= finfo(fp16).min; HF's eager masks use
# finfo(dtype).min, so their padding entries count as masked in every dtype): the kernels and the PyTorch path turn
# them into -inf, the eager-attention matcher and the mask-recipe reader accept a fill at or below it as a hard
# mask, and sdpa_causal_mask accepts it as the masked value of an additive causal mask.
MASKED_BELOW = -65504.0

# What a fully masked query row gives (the op's ``masked_rows``; see fxfuse.attention.reference).
MASKED_ROWS_ZERO, MASKED_ROWS_UNIFORM, MASKED_ROWS_NAN = 0, 1, 2
# The public function's names for them (``softcap_attention(..., masked_rows="uniform")``).
MASKED_ROWS = {"zero": MASKED_ROWS_ZERO, "uniform": MASKED_ROWS_UNIFORM, "nan": MASKED_ROWS_NAN}

# q / k / v dtypes the op takes, and its largest head_dim (the kernels' widest tile; the passes pad a narrower
# value head_dim up to the query/key one, never past this).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256

# Softmax runs in base 2: log2(e) folds into the scores' scale, ln(2) brings the lse back to natural log (the
# kernels write these two as literals).
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
