"""fxfuse's built-in graph passes, one per module (installed as ``fxfuse.passes``).

Each module registers its pass with :func:`fxfuse.register_pass`. Importing this package imports every module
and checks the registry (see :func:`fxfuse.registry.load_pass_package`): a module that fails to import or
registers nothing is a :class:`~fxfuse.errors.PassRegistrationError` here, at import. Modules whose name starts
with ``_`` are helpers shared by passes, not passes.

The order the passes run in is this list, and only this list:
"""
from fxfuse.registry import load_pass_package

PASS_ORDER = (
    # LoRA first: it matches the base linear + adapter chain before anything else rewrites those linears.
    "lora_linear",
    "lora_horizontal",      # groups the fused LoRA ops of one input (q/k/v), so after lora_linear
    # Attention: sdpa_causal_mask proves static-length masks causal by evaluating them and turns them into
    # is_causal before sdpa_attention reads the remaining masks by their recipe; softcap_attention matches the
    # eager (matmul / softmax / matmul) spelling.
    "sdpa_causal_mask",
    "sdpa_attention",
    "softcap_attention",
    # The lm head last: its patterns start at the final hidden state, after every decoder layer.
    "trl_fused_head",       # TRL's own fused head (one node, fxfuse's shim of it) -> linear_log_probs
    "linear_cross_entropy",
    "linear_log_probs",     # log-prob / entropy chains; a cross-entropy loss is linear_cross_entropy's
    "log_probs_loss",       # a per-token loss over those log-probs (or per-token CE) in the same graph: grads in fwd
    "foreign_fused_heads",  # reports another library's fused lm-head (Liger, CCE, Unsloth); rewrites nothing
    # Last: it needs the attention sites read as key padding and the lm-head loss fused.
    "unpad_tokens",         # padded batch -> its real tokens as one packed row
    # After every fusion: it wraps what is left of a layer's MLP (LoRA ops included) as one opaque op.
    "sequence_tiling",      # token-wise wide regions over chunks of tokens (auto: when a layer's MLP would not fit)
    # Last: it changes what checkpointed regions receive, after every pass that reads or rewrites their bodies.
    "checkpoint_offload",   # checkpointed regions' inputs in host memory (offload_activations; auto by default)
)

PASSES = load_pass_package(__name__, order=PASS_ORDER)
