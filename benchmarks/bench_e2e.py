"""Whole-model training steps on the GPU, mirroring ../shared/anchors/anchors_gpu.py sec_e2e (same shapes, steps,
timing and peak-memory method), for fxfuse variants the anchor script does not cover:

* ``fxfuse``             logits unused (they come back lazily and are never computed);
* ``fxfuse+read-logits`` a metric reads the logits every step (token accuracy under no_grad): they materialise;
* ``fxfuse-materialize`` pass option ``logits="materialize"`` (real logits returned from the graph);
* ``lora-<impl>``        PEFT LoRA r16 / alpha 32 / dropout 0.05 on every projection (the anchors' LoRA rows).

Writes JSON lines to $OUT/e2e_fxfuse.jsonl. Run: python3 benchmarks/bench_e2e.py [impl,...] [shape] [B], shape one of
llama (default), gemma2, and the held-out fixed-length steps: mistral-8l (2x4096), phi3-16l (4x2048), qwen3-1.7b
(4x2048).
(``eager`` and ``inductor`` are accepted too, for runs the anchor script does not cover.)
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import jsonl_emitter  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")


emit = jsonl_emitter("e2e_fxfuse.jsonl")


def _mistral():  # Mistral-7B-v0.1 widths (its config's defaults: sliding window 4096, 32k vocabulary), 8 layers
    from transformers import MistralConfig
    return MistralConfig(num_hidden_layers=8), 2, 4096, "mistral-7b shape x8 layers"


def _phi3():  # Phi-3-mini widths (hidden 3072, 32 heads, fused qkv / gate_up projections), 16 layers
    from transformers import Phi3Config
    return Phi3Config(num_hidden_layers=16, pad_token_id=0), 4, 2048, "phi-3-mini shape x16 layers"


def _qwen3():  # Qwen3-1.7B
    from transformers import Qwen3Config
    return (Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                        max_position_embeddings=8192), 4, 2048, "qwen3-1.7b shape")


#: shape name -> (config, rows, length, label): the held-out-style fixed-length steps of issue 33
HELD_OUT = {"mistral-8l": _mistral, "phi3-16l": _phi3, "qwen3-1.7b": _qwen3}


def build(impl, shape="llama", B=None):
    """(compiled step callable, model, optimizer, input ids, config) for one impl, as the anchors build it."""
    import fxfuse  # noqa: F401  (registers the backend when run from a source tree)
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

    dev = "cuda"
    if shape == "gemma2":  # the anchors' Gemma-2-2B shape, eager attention (transformers refuses sdpa + softcap)
        cfg = Gemma2Config(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=256, vocab_size=256000, sliding_window=4096,
                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        B0, S, attn, name = 1, 4096, "eager", "gemma2-2b shape"
    elif shape in HELD_OUT:  # issue 33's fixed-length steps: held-out architectures at their real widths
        cfg, B0, S, name = HELD_OUT[shape]()
        attn = "sdpa"
    else:
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                          tie_word_embeddings=True)
        B0, S, attn, name = 4, 2048, "sdpa", "llama3.2-1b shape"
    B = int(B) if B else B0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn).to(dev)
    opts = {"pass_options": {"linear_cross_entropy": {"logits": "materialize"}}} if "materialize" in impl else None
    base_impl = impl
    if impl.startswith("lora-"):  # the anchors' PEFT setup: LoRA r16 on every projection, frozen base
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        base_impl = impl[len("lora-"):]
    if base_impl == "eager":
        fwd = model
    elif base_impl == "inductor":
        fwd = torch.compile(model)
    else:
        fwd = torch.compile(model, backend="fxfuse", options=opts)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    ids = torch.randint(0, cfg.vocab_size, (B, S), device=dev)
    return fwd, model, opt, ids, (cfg, name, B, S)


def main():
    import fxfuse

    shape = sys.argv[2] if len(sys.argv) > 2 else "llama"
    impls = (sys.argv[1] if len(sys.argv) > 1 else "fxfuse,fxfuse+read-logits,fxfuse-materialize").split(",")
    for impl in impls:
      name, B, S = "?", 0, 0
      try:
        fwd, model, opt, ids, (cfg, name, B, S) = build(impl, shape, sys.argv[3] if len(sys.argv) > 3 else None)
        acc = []

        def step():
            out = fwd(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if "read-logits" in impl:
                with torch.no_grad():
                    acc.append((out.logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean())
            return out.loss

        t0 = time.perf_counter()
        l0 = step().item()
        first = time.perf_counter() - t0
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        n = 8
        t0 = time.perf_counter()
        for _ in range(n):
            loss = step()
        loss = loss.item()
        dt = (time.perf_counter() - t0) / n
        peak = torch.cuda.max_memory_allocated() / 2**30
        rep = fxfuse.reports()
        emit(section="e2e", shape=f"{name} {B}x{S}", impl=impl, tokens_per_s=round(B * S / dt),
             step_ms=round(dt * 1e3, 1), peak_gib=round(peak, 2), first_step_s=round(first, 1), loss0=round(l0, 4),
             loss_last=round(loss, 4), fused=sum(len(r.fused) for r in rep),
             pass_ms=round(sum(r.total_pass_ms for r in rep), 1))
        del model, opt, fwd
      except Exception as e:  # an OOM is a result too
        emit(section="e2e", shape=f"{name} {B}x{S}", impl=impl, error=f"{type(e).__name__}: {str(e)[:200]}")
      torch._dynamo.reset()
      fxfuse.clear_reports()
      torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
