"""unpad_tokens: a padded batch's token-wise graph runs on the kept tokens as one packed row (issue 31).

Tested as users call it (``torch.compile(model, backend="fxfuse")`` on a padded batch with labels): the loss and
every gradient equal eager's on right-, left- and both-ends-padded batches, the logits at real positions equal
eager's and read 0 where a position was dropped; no recompile as the number of real tokens changes; what is not
handled is left padded, with the reason in the report (attention sites that average every key of a fully masked
row: HF eager attention's ``finfo.min`` masks, Llama eager, Gemma-2)."""
from __future__ import annotations

import pytest
import torch

import fxfuse
from conftest import saved_activation_bytes, tiny_causal_lm

pytestmark = pytest.mark.slow  # compiles whole models


def _batch(pad: str, rows: int = 3, cols: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 128, (rows, cols), generator=g)
    am = torch.ones(rows, cols, dtype=torch.long)
    if pad in ("right", "mixed"):
        am[0, cols - 3:] = 0
    if pad in ("left", "mixed"):
        am[1, :4] = 0
    if pad == "mixed":
        am[2, :2] = 0
        am[2, -2:] = 0
    if pad == "one_token":
        am[0, 1:] = 0
    if pad == "empty_row":  # a row of padding only, beside a left-padded one
        am[0] = 0
        am[1, :5] = 0
    if pad in ("hole", "labels_at_pads"):  # padding inside a row; with labels kept at padding positions too
        am[0, 4:6] = 0
        am[1, :3] = 0
        am[2, -4:] = 0
    if pad == "labels_at_pads":  # every padding position whose next label is used is kept, some after real tokens
        return ids, am, ids.clone()
    return ids, am, ids.masked_fill(am == 0, -100)


def _run(model, ids, am, labels, compiled, call=None, leaf=None):
    """One forward + backward, eager or compiled with unpad_tokens; ``call``: more model kwargs (``ids`` None:
    pass ``inputs_embeds`` there); ``leaf``: a non-parameter tensor whose gradient is compared too."""
    opts = {"compiler": "aot_eager"}  # unpad_tokens is on by default
    fn = torch.compile(model, backend="fxfuse", options=opts) if compiled else model
    inputs = {} if ids is None else {"input_ids": ids}
    out = fn(**inputs, attention_mask=am, labels=labels, use_cache=False, **(call or {}))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if leaf is not None:
        grads["<leaf>"], leaf.grad = leaf.grad.clone(), None
    model.zero_grad()
    return out, grads


def _compiled_matches_eager(model, ids, am, labels, grads=True, call=None, leaf=None):
    """Eager, then compiled with unpad_tokens (reports cleared): the loss and (with ``grads``) every gradient
    equal. Returns (eager output, compiled output)."""
    ref, ref_grads = _run(model, ids, am, labels, False, call, leaf)
    fxfuse.clear_reports()
    torch._dynamo.reset()
    out, got = _run(model, ids, am, labels, True, call, leaf)
    assert torch.allclose(out.loss, ref.loss, rtol=1e-6, atol=1e-6), (out.loss, ref.loss)
    for name, g in ref_grads.items() if grads else ():
        assert (got[name] - g).norm() <= 1e-5 * g.norm() + 1e-7, name
    return ref, out


def _unpad_records(kind="fused"):
    rep = fxfuse.report()
    return [r for r in getattr(rep, kind) if r.pass_name == "unpad_tokens"]


@pytest.mark.parametrize("arch,attn,uniform", [
    ("llama", "sdpa", False),    # SDPA with a bool mask: a fully masked row gives zeros
    ("qwen3", "sdpa", False),
    ("llama", "eager", True),    # finfo.min masks: a fully masked row averages every key of the padded row
    ("gemma2", "eager", True),   # + softcap, sliding window
])
@pytest.mark.parametrize("pad", ["right", "left", "mixed", "one_token", "empty_row", "hole", "labels_at_pads"])
def test_padded_batch_equals_eager(arch, attn, uniform, pad):
    ids, am, labels = _batch(pad)
    model = tiny_causal_lm(arch, attn_implementation=attn)
    ref, out = _compiled_matches_eager(model, ids, am, labels)
    real = am.bool()
    logits = out.logits.float()
    assert torch.allclose(logits[real], ref.logits[real], atol=1e-5)
    if uniform:  # left padded, with the reason
        assert not _unpad_records() and "fully masked row" in _unpad_records("skipped")[0].reason
        return
    kept = real.clone()
    kept[:, :-1] |= labels[:, 1:] != -100  # padding positions whose shifted label is used: kept, eager's values
    assert torch.allclose(logits[kept], ref.logits[kept], atol=1e-5)
    assert (logits[~kept] == 0).all()
    assert len(_unpad_records()) == 1, str(fxfuse.report())


def test_no_recompile_as_the_real_token_count_changes():
    """Padded to the longest row, a new length and a new count of real tokens every batch: the graphs compiled
    are those plain torch.compile makes (static, then one with a symbolic length) over 10 batches, every loss
    eager's."""
    from torch._dynamo.utils import counters

    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    g = torch.Generator().manual_seed(1)

    def batches():
        for step in range(10):
            cols = 10 if step < 4 else 12 + step
            lens = torch.randint(1, cols + 1, (3,), generator=g)
            ids = torch.randint(4, 128, (3, cols), generator=g)
            am = (torch.arange(cols)[None] < lens[:, None]).long()
            yield ids, am, ids.masked_fill(am == 0, -100)

    counts = {}
    for unpad in (True, False):
        torch._dynamo.reset()
        counters.clear()
        fxfuse.clear_reports()
        fn = torch.compile(model, backend="fxfuse", options={"compiler": "aot_eager",
                                                             "passes": {"unpad_tokens": unpad}})
        for ids, am, labels in batches():
            out = fn(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
            ref = model(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
            assert torch.allclose(out.loss, ref.loss, rtol=1e-6), (out.loss, ref.loss)
        counts[unpad] = counters["stats"]["unique_graphs"]
        assert bool(_unpad_records()) == unpad
    assert counts[True] == counts[False] == 2, counts


@pytest.mark.parametrize("options,why", [
    ({"passes": {"unpad_tokens": False}}, None),  # the option turns it off: not run, nothing reported
    ({"triton.cudagraphs": True}, "CUDA graphs"),  # mode="reduce-overhead": skipped, with the reason
])
def test_option_turns_it_off(options, why):
    ids, am, labels = _batch("right")
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    fxfuse.clear_reports()
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fxfuse", options={"compiler": "aot_eager", **options})
    out = fn(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
    assert not _unpad_records()
    skipped = _unpad_records("skipped")
    assert (why in skipped[0].reason) if why else not skipped
    assert fxfuse.report().fused  # the other passes ran
    assert torch.allclose(out.loss, model(input_ids=ids, attention_mask=am, labels=labels, use_cache=False).loss)


def test_gradient_checkpointing():
    """HF gradient checkpointing: every decoder layer is a checkpoint body; the packed-row vectors are threaded into
    each body, whose baked sizes and attention sites are rewritten like the graph's: loss and every gradient as
    eager, the recomputation included."""
    ids, am, labels = _batch("mixed")
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ref, out = _compiled_matches_eager(model, ids, am, labels)
    rec = _unpad_records()
    assert rec and rec[0].detail["checkpoint_bodies"] == 2, str(fxfuse.report())


def test_loss_in_another_graph_stays_padded_and_says_why():
    """PEFT under checkpointing hooks the input embeddings and Dynamo breaks the graph before the lm-head: the
    decoder's graph returns hidden states whose padding positions the loss graph may read (a left-padded row's
    first-token label): it stays padded, with the reason."""
    import peft

    ids, am, labels = _batch("mixed")
    model = peft.get_peft_model(tiny_causal_lm("llama", attn_implementation="sdpa"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj", "v_proj"]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _compiled_matches_eager(model, ids, am, labels, grads=False)
    skipped = _unpad_records("skipped")
    assert skipped and "another graph" in skipped[0].reason, str(fxfuse.report())


def test_window_with_a_hole_in_a_row():
    """A sliding window counts columns: padding inside a row (not at its ends) is kept in the packed row, so the
    window spans the same tokens as in the padded one."""
    ids, am, labels = _batch("right", rows=2, cols=12)
    am[1, 5:7] = 0  # a hole in the middle of row 1 (column 5's shifted label is a pad: dropped but for the window)
    labels = ids.masked_fill(am == 0, -100)
    model = tiny_causal_lm("mistral", attn_implementation="sdpa", sliding_window=4)
    ref, out = _compiled_matches_eager(model, ids, am, labels)
    assert _unpad_records(), str(fxfuse.report())
    real = am.bool()
    assert torch.allclose(out.logits.float()[real], ref.logits[real], atol=1e-5)


@pytest.mark.parametrize("num_items", [False, True])
def test_peft_lora_and_num_items_in_batch(num_items):
    """PEFT LoRA on every projection (fused by lora_linear / lora_horizontal, then unpadded), and the Trainer's
    ``num_items_in_batch`` (sum, then divided outside the loss op): loss and every adapter gradient as eager."""
    import peft

    ids, am, labels = _batch("mixed")
    model = peft.get_peft_model(tiny_causal_lm("llama", attn_implementation="sdpa"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    kw = {"num_items_in_batch": (labels[:, 1:] != -100).sum()} if num_items else {}
    _compiled_matches_eager(model, ids, am, labels, call=kw)
    rep = fxfuse.report()
    assert _unpad_records() and [r for r in rep.fused if r.pass_name.startswith("lora")], str(rep)


def test_hf_trainer_with_a_padding_collator(tmp_path):
    """HF Trainer, DataCollatorForLanguageModeling (pads each batch to its longest row, -100 on the pads), gradient
    accumulation (the num_items_in_batch path): every logged loss as without fxfuse, the batches unpadded."""
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from _trainer_utils import assert_losses_unchanged, make_texts, make_tokenizer, train_args

    def make():
        tok = make_tokenizer()
        ds = Dataset.from_dict({"text": make_texts(seed=3)}).map(lambda b: tok(b["text"]), batched=True,
                                                                 remove_columns=["text"])
        return Trainer(model=tiny_causal_lm("llama", attn_implementation="sdpa"),
                       args=TrainingArguments(output_dir=str(tmp_path / "hf"), **train_args(max_steps=3)),
                       train_dataset=ds, data_collator=DataCollatorForLanguageModeling(tok, mlm=False))

    reps = assert_losses_unchanged(make, n_steps=3, rel=1e-5, abs=1e-6)  # unpad_tokens on by default
    assert any(r.pass_name == "unpad_tokens" for rep in reps for r in rep.fused), [str(r) for r in reps]


def test_saved_activations_of_a_padded_batch_are_those_of_the_packed_one():
    """What a compiled forward saves for the backward (tensors through autograd's saved-tensor hooks, parameters
    not counted): documents of 512, 64, 64, 64 tokens right-padded into [4, 512] hold at most 1.3x what the same
    documents packed into one row hold (without unpadding: about 2.9x)."""
    lens = [512, 64, 64, 64]
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(4, 128, (n,), generator=g) for n in lens]
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, t in enumerate(toks):
        ids[i, : len(t)] = t
        am[i, : len(t)] = 1
    padded = dict(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    pids = torch.cat(toks)[None]
    plabels = pids.clone()
    plabels[0, torch.cumsum(torch.tensor([0] + lens[:-1]), 0)] = -100
    packed = dict(input_ids=pids, position_ids=torch.cat([torch.arange(n) for n in lens])[None], labels=plabels)
    model = tiny_causal_lm("llama", attn_implementation="sdpa", max_position_embeddings=1024)

    def saved(batch, unpad):
        torch._dynamo.reset()
        fn = torch.compile(model, backend="fxfuse", options={"compiler": "aot_eager",
                                                             "passes": {"unpad_tokens": unpad}})
        fn(**batch, use_cache=False).loss.backward()  # compiles
        with saved_activation_bytes() as total:
            out = fn(**batch, use_cache=False)
        out.loss.backward()
        model.zero_grad()
        return total[0], out.loss

    unpadded, loss_u = saved(padded, True)
    plain, loss_p = saved(padded, False)
    one_row, loss_1 = saved(packed, False)
    assert torch.allclose(loss_u, loss_p, rtol=1e-6) and torch.allclose(loss_u, loss_1, rtol=1e-5)
    assert unpadded <= 1.3 * one_row, (unpadded, one_row)
    assert plain > 2 * one_row, (plain, one_row)  # the measurement sees the padding when it is there


def test_inputs_embeds_enter_the_packed_row():
    """A caller passing ``inputs_embeds`` (the graph starts after the lookup): the embeddings input is gathered;
    loss and its gradient as eager."""
    ids, am, labels = _batch("mixed", cols=10)
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    _compiled_matches_eager(model, None, am, labels, call={"inputs_embeds": emb}, leaf=emb)
    assert _unpad_records(), str(fxfuse.report())


def test_a_batch_of_padding_only_keeps_one_dead_token():
    """The kept-token count is declared >= 1 (contiguous strides N, not max(1, N): no per-layer copies of the
    packed vectors in Inductor's code), so a batch of padding only keeps its first position, as a dead query: the
    compiled model runs it after a normal batch, without a recompile, and its loss is eager's (NaN: no label)."""
    from fxfuse.passes.unpad_tokens import packed_index

    am = torch.zeros(2, 5, dtype=torch.long)
    idx, docs, kv = packed_index(am, False, torch.full((10,), -100), -100)
    assert idx.tolist() == [0] and docs[0, 0, 0] > 0 and kv.all()  # one token, its start past its index
    idx, _, _ = packed_index(am, True, torch.full((10,), -100), -100)  # the sliding-window form too
    assert idx.tolist() == [0]

    from torch._dynamo.utils import counters

    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    counters.clear()
    fn = torch.compile(model, backend="fxfuse", options={"compiler": "aot_eager"})
    for cols, pad_only in ((10, False), (9, False), (8, True)):
        ids, am, labels = _batch("right", cols=cols)
        if pad_only:
            am.zero_()
            labels.fill_(-100)
        out = fn(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
        ref = model(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
        assert torch.allclose(out.loss, ref.loss, equal_nan=True), (out.loss, ref.loss)
    assert out.loss.isnan() and counters["stats"]["unique_graphs"] == 2
    assert _unpad_records(), str(fxfuse.report())


def test_inductor_is_given_the_mixed_order_reduction_split(monkeypatch):
    """A graph with the unbacked kept-token count gets Inductor's mixed-order reduction split size set (torch 2.11
    failed to pick one from a size hint the count lacks: "Cannot convert symbols to int", on the GPU); a padded
    batch that is not unpadded does not."""
    import torch._inductor.compile_fx as cf

    if not hasattr(torch._inductor.config.triton, "mix_order_reduction_split_size"):
        pytest.skip("this torch has no mixed-order reductions")
    seen = []
    monkeypatch.setattr(cf, "compile_fx", lambda gm, ex, config_patches=None: seen.append(config_patches) or gm)
    ids, am, labels = _batch("right")
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    for unpad in (True, False):
        torch._dynamo.reset()
        fn = torch.compile(model, backend="fxfuse", options={"passes": {"unpad_tokens": unpad}})
        fn(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
        assert seen[-1].get("triton.mix_order_reduction_split_size") == (16 if unpad else None), seen[-1]
