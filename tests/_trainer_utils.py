"""A tokenizer and a dataset made in-process, so trainers run on CPU with nothing downloaded."""
from __future__ import annotations

import random


def make_tokenizer(vocab_size: int = 128):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(vocab_size - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def make_texts(n: int = 16, vocab_size: int = 128, seed: int = 0):
    rnd = random.Random(seed)
    return [" ".join(f"w{rnd.randrange(vocab_size - 4)}" for _ in range(rnd.randrange(5, 14))) for _ in range(n)]


def train_args(max_steps: int) -> dict:
    """The arguments every trainer test shares: CPU, batch 4 with 2 accumulation steps, a loss logged per step."""
    return dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=max_steps, learning_rate=1e-3,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
                dataloader_num_workers=0)


def trainer_losses(make_trainer, use_fxfuse: bool, keys=("loss",), options=None):
    """Train a freshly built trainer (its model compiled in place by fxfuse, or not) and return the logged losses
    (with more ``keys``: those logged values too, in step order).
    Compiling ``trainer.model`` after building the trainer is the documented integration: the trainer keeps its
    object, and any PEFT wrapping the trainer did is already there."""
    trainer = make_trainer()
    if use_fxfuse:
        trainer.model.compile(backend="fxfuse", options={"compiler": "aot_eager", **(options or {})})
    trainer.train()
    return [h[k] for h in trainer.state.log_history if "loss" in h for k in keys]


def assert_losses_unchanged(make_trainer, n_steps: int, rel: float, abs: float, allow_rollback: bool = False,
                            keys=("loss",), options=None):
    """The per-step losses (and the other logged ``keys``) with fxfuse equal the unfused run's; returns fxfuse's
    reports. A rollback (if allowed) must say why."""
    import pytest
    import torch

    import fxfuse

    ref = trainer_losses(make_trainer, False, keys)
    torch._dynamo.reset()
    fxfuse.clear_reports()
    got = trainer_losses(make_trainer, True, keys, options)
    assert len(ref) == n_steps * len(keys) and got == pytest.approx(ref, rel=rel, abs=abs), (keys, got, ref)
    reps = fxfuse.reports()
    assert reps, "nothing was compiled"
    rolled = [s for r in reps for s in r.rolled_back]
    assert allow_rollback or not rolled, [str(r) for r in reps]
    assert all(s.reason for s in rolled)
    return reps
