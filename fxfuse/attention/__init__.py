"""The attention family: eager / SDPA attention in a traced graph -> ``fxfuse::softcap_attention`` (flash attention
with a tanh softcap, GQA, causal / sliding window / packed documents / key padding, or any mask tensor).

The flow, one concern per module::

    passes/softcap_attention.py, passes/sdpa_attention.py, passes/sdpa_causal_mask.py   (the passes themselves)
      |  matching.py     read an attention site out of an FX graph: softmax(f(q @ k^T)) @ v, repeat_kv undone,
      |                  scaling / softcap / mask / dropout / sinks, head-dim pads
      |  sdpa_call.py    a scaled_dot_product_attention call: targets, arguments, the is_causal rewrite
      |  mask_recipe.py  how the mask was built (abstract interpretation of HF's mask builders) -> MaskRecipe:
      |                  causal, window, packed documents, key padding, or why the mask tensor is kept
      v
    op.py            the custom op: contract, torch.library registrations (fake impl, autograd, autocast), the
      |              dispatch below, the public softcap_attention() and document_ranges()
      +--> forward.py    the forward Triton kernel and its launcher
      +--> backward.py   the backward Triton kernels (dQ, dK/dV, the fully masked rows') and their launcher
      |      both use:   scores.py     the score tile (softcap, masks) as Triton device functions
      |                  block_map.py  which tiles a kernel visits (index / document ranges, a mask tensor's
      |                                tile classes)
      |                  launching.py  tile configs and fallbacks, kernel-variant switches, shared arguments
      +--> reference.py  the float64 reference and the blockwise PyTorch path (CPU / no Triton)

    chunked.py       fxfuse::chunked_causal_attention: causal attention inside fixed-size chunks (Llama-4), run by
                     SDPA's causal kernels (cuDNN's forward and backward on the GPU) on the chunks as a batch, for
                     recipes whose chunks tile every row from its start (MaskRecipe.chunk_tiling)

    conventions.py   what all of the above agree on, defined once: the op's names, the masked-value threshold
                     (MASKED_BELOW), the masked_rows codes, the dtypes and largest head_dim

The passes import from here only public names. This package's ``__init__`` imports only the op (which registers
``torch.ops.fxfuse.softcap_attention`` and its backward) and the chunked op; ``fxfuse.ops`` re-exports
softcap_attention and document_ranges (the chunked op runs no kernel of fxfuse's own: it stays here).
"""
from .chunked import chunked_causal_attention
from .op import document_ranges, softcap_attention

__all__ = ["softcap_attention", "document_ranges", "chunked_causal_attention"]
