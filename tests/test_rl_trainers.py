"""TRL's RL and preference trainers (GRPO, DPO, ORPO) on a tiny random-init policy on CPU, with gradient
accumulation and batches without a ``labels`` key: the per-step losses with the model compiled by fxfuse equal
the unfused run (to bf16 noise where the trainer runs under bf16 autocast, see AUTOCAST_REL).

TRL 1.16 computes GRPO's and DPO's log-probs with its own chunked lm-head (``fused_lm_head=True`` /
``trl/kernels/chunked_logprob.py``): fxfuse's shim makes it one graph node, and the ``trl_fused_head`` pass
rewrites it to ``fxfuse::linear_log_probs`` with the outputs each trainer reads (the tests check the report's
site); ORPO computes its loss from the logits (the logit-chain passes). The integration is one line
after building the trainer: ``trainer.model.compile(backend="fxfuse")`` (in place, so the trainer keeps its
object; accelerate rejects ``torch_compile_backend="fxfuse"``)."""
from __future__ import annotations

import copy

import pytest

from _trainer_utils import assert_losses_unchanged, make_texts, make_tokenizer, train_args
from conftest import tiny_causal_lm

pytestmark = pytest.mark.slow  # compiles whole models several times, trains, or starts processes

COMMON = train_args(max_steps=2)


def _preference_data():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": make_texts(16, seed=3), "chosen": make_texts(16, seed=4),
                              "rejected": make_texts(16, seed=5)})


# DPO and ORPO default to bf16=True, i.e. CPU bf16 autocast: the fused attention keeps its scores in fp32 where
# eager autocast rounds them to bf16 (8-bit mantissa), so their losses agree to bf16 noise (seen: 2e-5 .. 5e-5
# relative), not to fp32 rounding.
AUTOCAST_REL = 2e-4


def _assert_unchanged(make_trainer, allow_rollback=False, rel=1e-5):
    return assert_losses_unchanged(make_trainer, n_steps=2, rel=rel, abs=1e-6, allow_rollback=allow_rollback)


def _trl_heads_fused(reps, outputs):
    """Every TRL head site was rewritten, and one of them read ``outputs`` (the policy's; a reference model reads
    only log-probs)."""
    heads = [s for r in reps for s in r.records if s.pass_name == "trl_fused_head"]
    assert heads and all(s.status == "fused" for s in heads), [str(r) for r in reps]
    assert any(sorted(s.detail["outputs"]) == sorted(outputs) for s in heads), [s.detail for s in heads]


def test_dpo_trainer(tmp_path):
    from trl import DPOConfig, DPOTrainer

    def make():
        model = tiny_causal_lm("llama")
        cfg = DPOConfig(output_dir=str(tmp_path / "dpo"), max_length=32, **COMMON)
        return DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=cfg, train_dataset=_preference_data(),
                          processing_class=make_tokenizer())

    reps = _assert_unchanged(make, rel=AUTOCAST_REL)
    _trl_heads_fused(reps, ["log_probs", "entropy", "mean_logits", "is_top1"])


def test_orpo_trainer(tmp_path):
    orpo = pytest.importorskip("trl.experimental.orpo")

    def make():
        cfg = orpo.ORPOConfig(output_dir=str(tmp_path / "orpo"), max_length=32, **COMMON)
        return orpo.ORPOTrainer(model=tiny_causal_lm("llama"), args=cfg, train_dataset=_preference_data(),
                                processing_class=make_tokenizer())

    # ORPO's policy runs under CPU bf16 autocast with gradient checkpointing: inside the checkpoint bodies q / k
    # are fp32 and v is bf16 when re-traced under the caller's autocast. The op's autocast rule casts q / k / v as
    # autocast casts the matmuls' operands, so the attention is fused there (it used to be rolled back).
    reps = _assert_unchanged(make, rel=AUTOCAST_REL)
    fused = [f for r in reps for f in r.fused if f.pass_name == "softcap_attention"]
    assert fused, [str(r) for r in reps]


def test_grpo_trainer(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def make():
        cfg = GRPOConfig(output_dir=str(tmp_path / "grpo"), num_generations=4, max_completion_length=8, **COMMON)
        return GRPOTrainer(model=tiny_causal_lm("llama"), reward_funcs=reward_len, args=cfg,
                           train_dataset=Dataset.from_dict({"prompt": make_texts(8, seed=6)}),
                           processing_class=make_tokenizer())

    reps = _assert_unchanged(make)
    _trl_heads_fused(reps, ["log_probs", "entropy"])
