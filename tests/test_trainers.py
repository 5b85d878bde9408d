"""HF Trainer and TRL SFTTrainer with gradient accumulation: the same losses with fxfuse as without."""
from __future__ import annotations

import pytest
import torch

import fxfuse

from _trainer_utils import make_texts, make_tokenizer
from conftest import tiny_causal_lm

AOT = {"compiler": "aot_eager"}


def _hf_trainer_losses(tmp_path, use_fxfuse: bool):
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    tok = make_tokenizer()
    ds = Dataset.from_dict({"text": make_texts()}).map(lambda b: tok(b["text"]), batched=True,
                                                      remove_columns=["text"])
    model = tiny_causal_lm("llama")
    if use_fxfuse:
        model.compile(backend="fxfuse", options=AOT)
    args = TrainingArguments(output_dir=str(tmp_path / ("ff" if use_fxfuse else "ref")), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_hf_trainer_gradient_accumulation(tmp_path):
    ref = _hf_trainer_losses(tmp_path, False)
    torch._dynamo.reset()
    fxfuse.clear_reports()
    got = _hf_trainer_losses(tmp_path, True)
    assert len(ref) == 3 and got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert any(r.fused for r in fxfuse.reports()), [str(r) for r in fxfuse.reports()]


def _sft_losses(tmp_path, use_fxfuse: bool):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tok = make_tokenizer()
    ds = Dataset.from_dict({"text": make_texts(seed=1)})
    model = tiny_causal_lm("qwen2")
    if use_fxfuse:
        model.compile(backend="fxfuse", options=AOT)
    cfg = SFTConfig(output_dir=str(tmp_path / ("sft_ff" if use_fxfuse else "sft_ref")), per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, logging_steps=1, report_to=[],
                    save_strategy="no", use_cpu=True, seed=0, data_seed=0, max_length=32, dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trl_sft_trainer_gradient_accumulation(tmp_path):
    # TRL >= 1.x SFTTrainer patches the model with its own chunked LM head (trl/kernels/chunked_logprob.py), so
    # the compiled graphs hold no logits -> cross-entropy subgraph to fuse. fxfuse must still compile the model
    # and leave every loss unchanged.
    ref = _sft_losses(tmp_path, False)
    torch._dynamo.reset()
    fxfuse.clear_reports()
    got = _sft_losses(tmp_path, True)
    assert len(ref) == 3 and got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    reps = fxfuse.reports()
    assert reps and not any(r.rolled_back for r in reps), [str(r) for r in reps]


def _sft_lora_losses(tmp_path, use_fxfuse: bool):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    tok = make_tokenizer()
    ds = Dataset.from_dict({"text": make_texts(seed=2)})
    model = tiny_causal_lm("llama")
    cfg = SFTConfig(output_dir=str(tmp_path / ("lora_ff" if use_fxfuse else "lora_ref")),
                    per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
                    logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
                    max_length=32, dataloader_num_workers=0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=lora)
    if use_fxfuse:  # compile the PEFT model SFTTrainer built (in place: the trainer keeps its object)
        trainer.model.compile(backend="fxfuse", options=AOT)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trl_sft_trainer_with_peft_config(tmp_path):
    ref = _sft_lora_losses(tmp_path, False)
    torch._dynamo.reset()
    fxfuse.clear_reports()
    got = _sft_lora_losses(tmp_path, True)
    assert len(ref) == 3 and got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    lora_sites = [s for r in fxfuse.reports() for s in r.fused if s.pass_name == "lora_linear"]
    assert len(lora_sites) >= 14, [str(r) for r in fxfuse.reports()]  # 7 projections x 2 layers
