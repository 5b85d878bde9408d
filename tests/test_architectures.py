"""A fixed subset of ``benchmarks/architectures.py``'s table, asserted: tiny random-init models of ten architectures
built generically from their config classes' defaults (the script's builder, ``benchmarks/arch_models.py``), one
training step eagerly and compiled with fxfuse (``benchmarks/arch_runner.py``). Per architecture: loss and every
gradient equal eager's (fp32, relative error <= 2e-5 of each gradient's scale, see ``arch_runner.parity``), the
lm-head loss and attention fused, nothing rolled back.

The subset covers different code paths: SDPA with a padding mask (Llama), eager attention with a tanh softcap and
a final logit softcap (Gemma-2), sliding / full layer types (Gemma-3), a logits divide and attention / residual
multipliers (Granite), multi-query attention as a broadcast of one kv head (Falcon), multi-head latent attention
with a value head_dim of its own plus grouped MoE routing and shared experts (DeepSeek-V3), MoE (Mixtral, Qwen2-MoE
with a shared expert), a hybrid of Mamba, attention and MoE layers (Jamba), eager attention with partial rotary
embeddings and a parallel block (GPT-J), and attention sinks with sliding windows and MoE (gpt-oss).
"""
from __future__ import annotations

import pytest

from benchmarks.arch_models import skip_reason, tiny_config
from benchmarks.arch_runner import run_arch

pytestmark = pytest.mark.slow  # compiles whole models several times, trains, or starts processes

SUBSET = ["llama", "gemma2", "gemma3_text", "granite", "falcon", "deepseek_v3", "mixtral", "qwen2_moe", "jamba",
          "gptj", "gpt_oss"]
MOE = {"deepseek_v3", "mixtral", "qwen2_moe", "jamba", "gpt_oss"}


@pytest.mark.parametrize("name", SUBSET)
def test_one_step_matches_eager_with_lm_head_and_attention_fused(name):
    rec = run_arch(name, coverage=False)
    assert rec["status"] == "ok", rec.get("traceback") or rec
    msg = {k: rec.get(k) for k in ("fused", "skipped", "rolled_back", "why_not", "loss_rel_err",
                                   "grad_max_rel_err", "grad_worst_param", "grads_missing", "notes")}
    assert rec.get("compiler") is None, msg  # compiled with aot_eager, as the table
    assert rec["moe"] == (name in MOE), msg
    assert rec["loss_rel_err"] <= 2e-5, msg
    assert rec["grad_max_rel_err"] <= 2e-5 and not rec["grads_missing"], msg
    assert rec["grads_compared"] > 10, msg
    assert rec["exact"], msg
    assert rec["lm_head_fused"], msg
    assert rec["attention_fused"], msg
    assert not rec["rolled_back"], msg


def test_builder_scales_configs_generically():
    """The tiny configs come from the config classes' own defaults: the usual spellings scaled, per-layer patterns
    cut to one layer of each kind, MoE to few small experts, MLA's head dims keep their relation."""
    cfg, notes = tiny_config("gemma3_text")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.vocab_size == 256 and cfg.intermediate_size == 128
    assert sorted(set(cfg.layer_types)) == ["full_attention", "sliding_attention"] and cfg.num_hidden_layers == 2
    assert cfg.sliding_window == 8
    cfg, _ = tiny_config("mixtral")
    assert cfg.num_local_experts == 4 and cfg.num_experts_per_tok == 2
    cfg, _ = tiny_config("deepseek_v3")
    assert cfg.n_routed_experts == 4 and cfg.num_experts_per_tok <= 2 and cfg.first_k_dense_replace == 1
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (16, 8, 16)
    assert cfg.qk_head_dim == 24  # = nope + rope, as in the default config
    cfg, _ = tiny_config("gpt2")
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size) == (64, 2, 4, 256)
    assert cfg.n_inner is None  # GPT-2's default: None means 4 x n_embd, left as the config class wrote it
    assert cfg.resid_pdrop == cfg.attn_pdrop == cfg.embd_pdrop == 0.0
    assert skip_reason("bart") == "encoder-decoder"
    assert skip_reason("gemma3").startswith("multimodal")
    assert skip_reason("llama") is None
