"""Fused ops, callable directly (eager or under torch.compile) and inserted into graphs by fxfuse's passes.

Each op is a ``torch.library.custom_op`` in the ``fxfuse::`` namespace (so it shows as such in profiler traces)
with a fake impl, an autograd formula, a Triton path for CUDA and a chunked PyTorch path for CPU, and checks its
contract before running, so a bad call raises :class:`fxfuse.FxFuseContractError` in eager and under compile.

* :func:`linear_cross_entropy` — ``cross_entropy(f(hidden @ weight.T + bias), target)`` without materialising
  the logits (``f``: optional scale and tanh softcap).
* :func:`vocab_parallel_cross_entropy` — the same loss where each rank of a process group holds a slice of the
  weight's vocabulary rows (tensor parallelism): the ranks combine per-row statistics, no rank holds logits.
* :func:`linear_log_probs` — per-token ``log_softmax(z)[index]`` and optional entropy of
  ``z = softcap(hidden @ weight.T + bias) / temperature`` (RL / preference losses), arbitrary per-token upstream
  gradients, logits never materialised.
* :func:`vocab_parallel_log_probs` — the same log-probs and entropy where each rank holds a slice of the weight's
  vocabulary rows (tensor parallelism).
* :func:`lora_linear` — a (frozen) linear layer plus its LoRA adapters, ``x @ W.T + sum_i s_i * dropout_i(x) @
  A_i.T @ B_i.T``, with the dropout masks regenerated from a seed in the backward instead of stored.
* :func:`softcap_attention` — ``softmax(softcap(q @ k.T * scaling) + mask) @ v`` flash-attention style, GQA
  without repeating K/V, causal / sliding window / packed documents / key padding (the mask by recipe, O(S)
  vectors) or a mask tensor; :func:`document_ranges` turns per-token document ids into the op's ``doc_ranges``.
  Defined, with its passes' matching and mask reading, its kernels and references, in :mod:`fxfuse.attention`.

The attention passes also insert ``fxfuse::chunked_causal_attention`` (Llama-4's chunks run by cuDNN's causal
kernels on the chunks as a batch: a dispatch target with no kernel of fxfuse's own), public as
:func:`fxfuse.attention.chunked_causal_attention`.
"""
from .linear_cross_entropy import linear_cross_entropy
from .linear_log_probs import linear_log_probs
from .lora_linear import lora_linear
from .vocab_parallel_cross_entropy import vocab_parallel_cross_entropy
from .vocab_parallel_log_probs import vocab_parallel_log_probs
from fxfuse.attention.op import document_ranges, softcap_attention

__all__ = ["linear_cross_entropy", "linear_log_probs", "lora_linear", "softcap_attention",
           "vocab_parallel_cross_entropy", "vocab_parallel_log_probs"]  # the fused ops
# document_ranges (also importable from here) is the helper that builds softcap_attention's doc_ranges
