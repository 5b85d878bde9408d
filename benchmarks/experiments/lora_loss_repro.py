"""Diagnostic: the anchors' Llama-3.2-1B LoRA step (r16, dropout 0.05, AdamW, same batch every step) under one
backend, printing every step's loss, the fusion report's counts and the CUDA RNG offset after the run, so runs in
fresh processes (cold / warm Inductor caches) can be compared. Run: python3 lora_loss_repro.py IMPL [steps]."""
import hashlib
import json
import os
import sys

import torch

impl = sys.argv[1] if len(sys.argv) > 1 else "fxfuse"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 11
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
import peft  # noqa: E402

import fxfuse  # noqa: E402

cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=True)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").to("cuda")
model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
fwd = model if impl == "eager" else torch.compile(model, backend="fxfuse" if impl == "fxfuse" else "inductor")
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
ids = torch.randint(0, cfg.vocab_size, (4, 2048), device="cuda")
losses = []
for _ in range(steps):
    out = fwd(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(round(out.loss.item(), 5))
rep = fxfuse.reports()
by_pass = {}
for r in rep:
    for f in r.fused:
        k = getattr(f, "pass_name", None) or str(f)[:40]
        by_pass[k] = by_pass.get(k, 0) + 1
cache = f"/tmp/torchinductor_{os.environ.get('USER', 'root')}"
print(json.dumps(dict(section="lora_loss_repro", impl=impl, env_caches=os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES"),
                      lowrank=os.environ.get("FXFUSE_LORA_LOWRANK_GEMM", "1"), losses=losses, graphs=len(rep),
                      fused=sum(len(r.fused) for r in rep), by_pass=by_pass,
                      rng=hashlib.md5(torch.cuda.get_rng_state().numpy().tobytes()).hexdigest()[:8],
                      lora_B_norm=round(sum(p.float().norm().item() ** 2 for n, p in model.named_parameters()
                                            if "lora_B" in n) ** 0.5, 5),
                      lora_A_norm=round(sum(p.float().norm().item() ** 2 for n, p in model.named_parameters()
                                            if "lora_A" in n) ** 0.5, 5))), flush=True)
