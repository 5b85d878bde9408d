"""HF Trainer and TRL SFTTrainer (plain and with a ``peft_config``) with gradient accumulation: the same losses
with fxfuse as without."""
from __future__ import annotations

from _trainer_utils import assert_losses_unchanged, make_texts, make_tokenizer, train_args
from conftest import tiny_causal_lm

ARGS = train_args(max_steps=3)


def test_hf_trainer_gradient_accumulation(tmp_path):
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    def make():
        tok = make_tokenizer()
        ds = Dataset.from_dict({"text": make_texts()}).map(lambda b: tok(b["text"]), batched=True,
                                                          remove_columns=["text"])
        return Trainer(model=tiny_causal_lm("llama"), args=TrainingArguments(output_dir=str(tmp_path / "hf"), **ARGS),
                       train_dataset=ds, data_collator=DataCollatorForLanguageModeling(tok, mlm=False))

    reps = assert_losses_unchanged(make, n_steps=3, rel=1e-4, abs=1e-5)
    assert any(r.fused for r in reps), [str(r) for r in reps]


def test_trl_sft_trainer_gradient_accumulation(tmp_path):
    # TRL >= 1.x SFTTrainer patches the model with its own chunked LM head (trl/kernels/chunked_logprob.py), so
    # the compiled graphs hold no logits -> cross-entropy subgraph to fuse. fxfuse must still compile the model
    # and leave every loss unchanged.
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    def make():
        cfg = SFTConfig(output_dir=str(tmp_path / "sft"), max_length=32, **ARGS)
        return SFTTrainer(model=tiny_causal_lm("qwen2"), args=cfg,
                          train_dataset=Dataset.from_dict({"text": make_texts(seed=1)}),
                          processing_class=make_tokenizer())

    assert_losses_unchanged(make, n_steps=3, rel=1e-4, abs=1e-5)


def test_trl_sft_trainer_with_peft_config(tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def make():
        cfg = SFTConfig(output_dir=str(tmp_path / "sft_lora"), max_length=32, **ARGS)
        return SFTTrainer(model=tiny_causal_lm("llama"), args=cfg,
                          train_dataset=Dataset.from_dict({"text": make_texts(seed=2)}),
                          processing_class=make_tokenizer(), peft_config=lora)

    reps = assert_losses_unchanged(make, n_steps=3, rel=1e-4, abs=1e-5)
    lora_sites = [s for r in reps for s in r.fused if s.pass_name == "lora_linear"]
    assert len(lora_sites) >= 14, [str(r) for r in reps]  # 7 projections x 2 layers
