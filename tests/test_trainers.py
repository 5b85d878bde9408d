"""HF Trainer and TRL SFTTrainer (plain and with a ``peft_config``) with gradient accumulation: the same losses
with fxfuse as without."""
from __future__ import annotations

import pytest

from _trainer_utils import assert_losses_unchanged, make_texts, make_tokenizer, train_args
from conftest import tiny_causal_lm

pytestmark = pytest.mark.slow  # compiles whole models several times, trains, or starts processes

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
    # TRL >= 1.x SFTTrainer patches the model with its own chunked LM head (trl/kernels/chunked_logprob.py): no
    # logits -> cross-entropy subgraph. fxfuse's shim makes TRL's head one graph node, which the trl_fused_head pass
    # rewrites to fxfuse's op with the outputs SFT reads (log-probs, entropy, is_top1 for mean_token_accuracy).
    # fp32: the token accuracy counts argmax hits, and under TRL's CPU default (bf16 autocast) a near-tie in the
    # random model's logits flips with any change of rounding upstream (TRL's own kernel in a compiled graph too).
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    def make():
        cfg = SFTConfig(output_dir=str(tmp_path / "sft"), max_length=32, bf16=False, **ARGS)
        return SFTTrainer(model=tiny_causal_lm("qwen2"), args=cfg,
                          train_dataset=Dataset.from_dict({"text": make_texts(seed=1)}),
                          processing_class=make_tokenizer())

    reps = assert_losses_unchanged(make, n_steps=3, rel=1e-5, abs=1e-6,
                                   keys=("loss", "mean_token_accuracy", "entropy"))
    heads = [s for r in reps for s in r.records if s.pass_name == "trl_fused_head"]
    assert heads and all(s.status == "fused" and sorted(s.detail["outputs"]) == ["entropy", "is_top1", "log_probs"]
                         for s in heads), [str(r) for r in reps]


def test_trl_sft_trainer_with_peft_config(tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def make():
        cfg = SFTConfig(output_dir=str(tmp_path / "sft_lora"), max_length=32, **ARGS)
        # one decoder layer: Dynamo's tracing of each layer was most of the test's time (its 7 projections are
        # what the adapters cover)
        return SFTTrainer(model=tiny_causal_lm("llama", num_hidden_layers=1), args=cfg,
                          train_dataset=Dataset.from_dict({"text": make_texts(seed=2)}),
                          processing_class=make_tokenizer(), peft_config=lora)

    reps = assert_losses_unchanged(make, n_steps=3, rel=1e-4, abs=1e-5)
    lora_sites = [s for r in reps for s in r.fused if s.pass_name == "lora_linear"]
    assert len(lora_sites) >= 7, [str(r) for r in reps]  # 7 projections x 1 layer


def test_hf_trainer_padded_batches_of_new_lengths_compile_like_dynamo(tmp_path):
    """DataCollatorWithPadding pads each batch to its longest example: a new length almost every step. fxfuse
    compiles no more graphs than the same compile without its passes, and the losses do not change."""
    import torch
    import torch._dynamo.testing
    from datasets import Dataset
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    import fxfuse
    from fxfuse.backend import fxfuse as fx_backend

    tok = make_tokenizer()
    texts = [" ".join(f"w{(i * 7 + j) % 100}" for j in range(4 + 3 * i)) for i in range(16)]  # 16 lengths

    def tokenize(b):
        enc = tok(b["text"])
        enc["labels"] = [list(x) for x in enc["input_ids"]]
        return enc

    ds = Dataset.from_dict({"text": texts}).map(tokenize, batched=True, remove_columns=["text"])

    class PadLabels(DataCollatorWithPadding):
        def __call__(self, feats):
            labels = [f.pop("labels") for f in feats]
            out = super().__call__(feats)
            n = out["input_ids"].shape[1]
            out["labels"] = torch.tensor([l + [-100] * (n - len(l)) for l in labels])
            return out

    def run(backend):
        model = tiny_causal_lm("llama", attn_implementation="sdpa")
        args = TrainingArguments(output_dir=str(tmp_path / "pad"), per_device_train_batch_size=2, max_steps=8,
                                 learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                 use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=PadLabels(tok))
        cnt = None
        if backend is not None:
            cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
            trainer.model.compile(backend=cnt)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], cnt.frame_count if cnt else 0

    import pytest

    ref, _ = run(None)
    torch._dynamo.reset()
    _, base = run("aot_eager")
    torch._dynamo.reset()
    fxfuse.clear_reports()
    got, n = run(lambda gm, ex: fx_backend(gm, ex, options={"compiler": "aot_eager"}))
    assert n == base, (n, base)
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5), (got, ref)
    assert {"sdpa_attention", "linear_cross_entropy"} <= {r.pass_name for r in fxfuse.report().fused}


def test_trl_sft_padding_free(tmp_path):
    """TRL's padding-free SFT packs a batch into one row (position ids restart per example, no attention mask):
    the losses with fxfuse equal the uncompiled run's, and the packed attention is fused."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    def make():
        cfg = SFTConfig(output_dir=str(tmp_path / "sft_pf"), max_length=64, padding_free=True, packing=True,
                        packing_strategy="bfd", **ARGS)
        return SFTTrainer(model=tiny_causal_lm("llama", attn_implementation="sdpa"), args=cfg,
                          train_dataset=Dataset.from_dict({"text": make_texts(seed=3)}),
                          processing_class=make_tokenizer())

    reps = assert_losses_unchanged(make, n_steps=3, rel=1e-4, abs=1e-5)
    assert any(s.pass_name == "sdpa_attention" for r in reps for s in r.fused), [str(r) for r in reps]
