"""HF Trainer + accelerate's FSDP2 with fxfuse's passes, one process per device:

    torchrun --nproc_per_node 8 examples/hf_trainer_fsdp2.py                 # a tiny random Llama, as a smoke run
    torchrun --nproc_per_node 8 examples/hf_trainer_fsdp2.py --model meta-llama/Llama-3.2-1B --steps 100

``fxfuse.install()`` puts fxfuse's passes into Inductor, which ``TrainingArguments(torch_compile=True)`` (accelerate's
inductor backend) compiles the model with; accelerate applies FSDP2 (``fully_shard`` per decoder layer and root).
Train with ``use_cache=False`` (set on the config here): HF's KV cache makes each decoder layer's frame recompile
under FSDP2. ``--no-compile`` runs the same thing eagerly (tests compare the two). On a machine without a GPU it
runs on the CPU with gloo. Rank 0 prints one ``RESULT {json}`` line: losses, fused passes, whether FSDP2 wrapped it.
"""
import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

import fxfuse


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model id or path (default: a tiny random Llama)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="/tmp/fxfuse-hf-fsdp2")
    a = ap.parse_args()
    if not a.no_compile:
        fxfuse.install()  # Inductor now runs fxfuse's passes on every graph it compiles
    torch.manual_seed(0)
    if a.model:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        vocab, seq = model.config.vocab_size, 2048
    else:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        vocab, seq = cfg.vocab_size, 16
    model.config.use_cache = False
    layer_cls = type(model.model.layers[0]).__name__
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (t := torch.randint(0, vocab, (seq,), generator=g)), "labels": t.clone()}
            for _ in range(4 * a.steps * int(os.environ.get("WORLD_SIZE", 1)))]  # your dataset and collator here
    args = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=2, max_steps=a.steps, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
        torch_compile=not a.no_compile,  # accelerate's inductor backend, with fxfuse's passes installed
        fsdp="full_shard auto_wrap", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": [layer_cls],
                                "reshard_after_forward": True})
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    if int(os.environ.get("RANK", 0)) == 0:
        from torch.distributed.fsdp import FSDPModule

        print("RESULT", json.dumps({
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "fused": sorted({r.pass_name for rep in fxfuse.reports() for r in rep.fused}),
            "fsdp2": any(isinstance(m, FSDPModule) for m in trainer.model.modules()),
            "wrapped": type(trainer.model_wrapped).__name__}), flush=True)
    # Leave in order: every rank done, the trainer (and the FSDP2 model holding the process group) dropped, then
    # the group destroyed here rather than at interpreter exit, where gloo's teardown can hang.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        del trainer, model
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
