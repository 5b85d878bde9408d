"""Variable-length and packed batches on the GPU: correctness checks, the attention op on packed masks, and whole
training steps with a new length every step (default torch.compile, no ``dynamic=``), fxfuse beside Inductor.

Sections (argv; default all): check unpad attn e2e long (and trainer, on request)
  check  the attention kernels on the GPU against float64: fully masked rows in every ``masked_rows`` mode, packed
         masks, and what CUDA SDPA itself gives a fully masked row with a bool mask (the "zero" mode mirrors it)
  unpad  unpad_tokens on the GPU before timing it: a small Llama / Qwen3 (fp32 and bf16) on right-, left- and
         mixed-padded batches, compiled with fxfuse (Inductor lowering): fused or skipped (with the reason), the
         loss and the gradients against eager's
  trainer HF Trainer + DataCollatorForLanguageModeling(mlm=False) (padded batches) on the e2e data, the model
         compiled in place: TRAINER_IMPLS=fxfuse,fxfuse-nounpad (inductor, eager), TRAINER_STEPS=16
  attn   fwd+bwd of one attention layer over one 8192-token row packed with documents of 128..4096 tokens:
         fxfuse's op with the packed mask, SDPA with the same mask, SDPA is_causal over the whole row (the cost
         without packing), fxfuse causal; Llama-3.2-1B / Llama-3-8B / Gemma-2-2B attention shapes
  e2e    Llama-3.2-1B shape full fine-tune (bf16, AdamW), 24 steps of 8 documents whose lengths are log-normal
         (median 300, sigma 1.0, clipped to [16, 4096]; the same lengths for every implementation), padded
         ([8, longest] + attention mask, pads -100) and packed (one row, position ids restarting per document,
         -100 at document starts): graphs compiled, compile seconds, real (non-pad) tokens/s over the steps that
         compiled nothing, peak memory. E2E_IMPLS=fxfuse,inductor (default; fxfuse-unpad / fxfuse-nounpad: fxfuse
         with / without unpad_tokens; fxfuse-nomix: Inductor's mixed-order reductions off), E2E_LAYOUTS=packed,padded, E2E_STEPS=24, E2E_LAYERS=16,
         E2E_FROM=0 (timed steps start there at the earliest: the same steps for every impl)
  long   Llama-3-8B-shaped layers (LONG_LAYERS, default 4) with PEFT LoRA r16 on all projections and HF gradient
         checkpointing, batch 1 at 16384 then 32768 tokens (the recompile with a symbolic length): both train

Run (device machine): PYTHONPATH=. python3 benchmarks/bench_varlen.py check attn e2e
Writes $OUT/varlen.jsonl. On a machine without a GPU it runs a tiny smoke version.
"""
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import DEV, SMOKE, bench, jsonl_emitter, rel  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.attention.op import softcap_attention  # noqa: E402
from fxfuse.attention.reference import attention_reference  # noqa: E402

emit = jsonl_emitter("varlen.jsonl")


def doc_lengths(n, seed, median=300, sigma=1.0, lo=16, hi=4096):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g))
    return [int(v) for v in x.clamp(lo, hi).round()]


def packed_mask(lengths, device):
    S = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    i = torch.arange(S, device=device)
    return ((doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None]))[None, None]


# ------------------------------------------------------------------------------------------------- check
def sec_check():
    torch.manual_seed(0)
    for dt in (torch.bfloat16, torch.float32):
        for D, cap in ((64, 0.0), (128, 0.0), (256, 50.0)):
            B, Hq, Hkv, S, pad = 2, 8, 4, 1000, 300
            q = torch.randn(B, Hq, S, D, device=DEV, dtype=dt, requires_grad=True)
            k = torch.randn(B, Hkv, S, D, device=DEV, dtype=dt, requires_grad=True)
            v = torch.randn(B, Hkv, S, D, device=DEV, dtype=dt, requires_grad=True)
            do = torch.randn_like(q)
            keep = torch.ones(S, S, device=DEV).tril().bool()[None].repeat(B, 1, 1)
            keep[1, :, :pad] = False  # left padding: 300 fully masked query rows in batch 1
            for mode, name in ((0, "zero"), (1, "uniform")):
                mask = keep[:, None] if mode == 0 else torch.zeros(B, 1, S, S, device=DEV, dtype=dt).masked_fill(
                    ~keep[:, None], torch.finfo(dt).min)
                out = softcap_attention(q, k, v, mask=mask, softcap=cap, masked_rows=name)
                g = torch.autograd.grad(out, (q, k, v), do)
                qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
                ref = attention_reference(qd, kd, vd, mask, D ** -0.5, cap, False, 0, masked_rows=mode)
                gr = torch.autograd.grad(ref, (qd, kd, vd), do.double())
                emit(section="check", what=f"left-padded masked_rows={name}", dtype=str(dt), D=D, softcap=cap,
                     out=rel(out, ref), dq=rel(g[0], gr[0]), dk=rel(g[1], gr[1]), dv=rel(g[2], gr[2]))
    sec_sdpa_dead_rows()
    # packed mask: the op vs SDPA with the same mask
    lens = doc_lengths(20, 1, lo=16, hi=1500)
    m = packed_mask(lens, DEV)
    S = m.shape[-1]
    q = torch.randn(1, 32, S, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, S, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, S, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn_like(q)
    out = softcap_attention(q, k, v, mask=m)
    g = torch.autograd.grad(out, (q, k, v), do)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, enable_gqa=True)
    gr = torch.autograd.grad(ref, (q, k, v), do.float())
    emit(section="check", what="packed mask vs fp32 SDPA", S=S, docs=len(lens), out=rel(out, ref),
         dq=rel(g[0], gr[0]), dk=rel(g[1], gr[1]), dv=rel(g[2], gr[2]))


def sec_heads():
    """Head dims the kernels meet through the passes' zero-column padding (multi-head latent attention: q/k 192,
    v 128 -> both 192) and other non-power-of-two widths: the op vs float64, forward and every gradient; then an
    SDPA call with v's head_dim 128 and q/k's 192 compiled with fxfuse against float64."""
    torch.manual_seed(0)
    for dt in (torch.bfloat16, torch.float32) if os.environ.get("HEADS_OP", "1") == "1" else ():
        for D in (24, 96, 192):
            B, Hq, Hkv, S, pad = 2, 8, 4, 700, 100
            q = torch.randn(B, Hq, S, D, device=DEV, dtype=dt, requires_grad=True)
            k = torch.randn(B, Hkv, S, D, device=DEV, dtype=dt, requires_grad=True)
            v = torch.randn(B, Hkv, S, D, device=DEV, dtype=dt, requires_grad=True)
            do = torch.randn_like(q)
            keep = torch.ones(S, S, device=DEV).tril().bool()[None].repeat(B, 1, 1)
            keep[1, :, :pad] = False
            mask = keep[:, None]
            out = softcap_attention(q, k, v, mask=mask)
            g = torch.autograd.grad(out, (q, k, v), do)
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref = attention_reference(qd, kd, vd, mask, D ** -0.5, 0.0, False, 0, masked_rows=0)
            gr = torch.autograd.grad(ref, (qd, kd, vd), do.double())
            emit(section="heads", what="op", dtype=str(dt), D=D, out=rel(out, ref), dq=rel(g[0], gr[0]),
                 dk=rel(g[1], gr[1]), dv=rel(g[2], gr[2]))
    for dt in (torch.bfloat16, torch.float32):
        B, H, S = 2, 4, 600
        q = torch.randn(B, H, S, 192, device=DEV, dtype=dt, requires_grad=True)
        k = torch.randn(B, H, S, 192, device=DEV, dtype=dt, requires_grad=True)
        v = torch.randn(B, H, S, 128, device=DEV, dtype=dt, requires_grad=True)
        keep = torch.ones(S, S, device=DEV).tril().bool()[None, None].repeat(B, 1, 1, 1)
        keep[1, :, :, S - 50:] = False
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # noqa: E731
        torch._dynamo.reset()
        fxfuse.clear_reports()
        out = torch.compile(fn, backend="fxfuse")(q, k, v)
        do = torch.randn_like(out)
        g = torch.autograd.grad(out, (q, k, v), do)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = fn(qd, kd, vd)
        gr = torch.autograd.grad(ref, (qd, kd, vd), do.double())
        eager = fn(q, k, v)
        ge = torch.autograd.grad(eager, (q, k, v), do)
        fused = [r.pass_name for rep in fxfuse.reports() for r in rep.fused]
        emit(section="heads", what="MLA SDPA q/k 192 v 128 compiled", dtype=str(dt), fused=fused,
             out=rel(out, ref), dq=rel(g[0], gr[0]), dk=rel(g[1], gr[1]), dv=rel(g[2], gr[2]),
             eager_out=rel(eager, ref), eager_dq=rel(ge[0], gr[0]), eager_dk=rel(ge[1], gr[1]),
             eager_dv=rel(ge[2], gr[2]))


def sec_sdpa_dead_rows():
    """What SDPA itself gives a fully masked query row with a bool mask, per backend: zeros, the mean of v over all
    keys, or the unmasked attention (forward and dq of those rows)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    B, H, S, D, dead = 2, 4, 96, 64, 10
    keep = torch.ones(S, S, device=DEV).tril().bool()[None, None].repeat(B, 1, 1, 1)
    keep[:, :, :, :dead] = False  # keys 0..9 masked: query rows 0..9 see no key
    for dt in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(B, H, S, D, device=DEV, dtype=dt, requires_grad=True) for _ in range(3))
        cands = {"zeros": torch.zeros(B, H, dead, D, device=DEV),
                 "mean of v": v.detach().float().mean(2, keepdim=True).expand(B, H, dead, D),
                 "unmasked": F.scaled_dot_product_attention(q.float(), k.float(), v.float())[:, :, :dead].detach()}
        for be in ("default", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
            try:
                ctx = sdpa_kernel([getattr(SDPBackend, be)]) if be != "default" else __import__("contextlib").nullcontext()
                with ctx:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
                    (dq,) = torch.autograd.grad(o[:, :, :dead].float().sum(), (q,), allow_unused=True)
                od = o[:, :, :dead].float()
                emit(section="check", what="SDPA bool mask, fully masked rows", backend=be, dtype=str(dt),
                     nan=bool(torch.isnan(od).any()),
                     closest={n: float((od - c).norm() / c.norm().clamp_min(1e-6)) for n, c in cands.items()},
                     dq_dead_rows_abs=float(dq[:, :, :dead].abs().max()) if dq is not None else None)
            except Exception as e:
                emit(section="check", what="SDPA bool mask, fully masked rows", backend=be, dtype=str(dt),
                     error=f"{type(e).__name__}: {str(e)[:160]}")


def _fused_passes(impl):
    """The passes that fused something in this run's reports (none for a run without fxfuse)."""
    if not impl.startswith("fxfuse"):
        return []
    return sorted({r.pass_name for rep in fxfuse.reports() for r in rep.fused})


def _release():
    """Between runs: compiled code and cached GPU memory dropped, so the next run starts cold and its peak is its own."""
    torch._dynamo.reset()
    if DEV == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------- trainer
def sec_trainer():
    """HF Trainer end to end with its padding collator for causal LMs (DataCollatorForLanguageModeling, mlm=False:
    pads every batch to its longest row, labels -100 at padding), the model compiled in place as the README says;
    real tokens/s over the steps after TRAINER_FROM (default 4) that compiled nothing, peak memory, losses."""
    import transformers as tf

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from _trainer_utils import make_tokenizer

    if SMOKE:
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=500, max_position_embeddings=8192)
        steps, docs = 4, 3
    else:
        cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=8192,
                             num_hidden_layers=int(os.environ.get("E2E_LAYERS", 8)), num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=32768,
                             tie_word_embeddings=True)
        steps, docs = int(os.environ.get("TRAINER_STEPS", 16)), 8
    tok = make_tokenizer(cfg.vocab_size)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(4, cfg.vocab_size, (n,), generator=g).tolist()}
            for s in range(steps) for n in doc_lengths(docs, s)]
    for impl in os.environ.get("TRAINER_IMPLS", "fxfuse,fxfuse-nounpad").split(","):
        try:
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").to(DEV)
            real, padded, times = [], [], []

            class Timer(tf.TrainerCallback):
                def on_step_begin(self, *a, **k):
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                    self.t0 = time.perf_counter()

                def on_step_end(self, *a, **k):
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - self.t0, stats["graphs"]))

            pad = tf.DataCollatorForLanguageModeling(tok, mlm=False)

            def collate(features):  # the real tokens of each batch, counted on the host before it moves
                batch = pad(features)
                real.append(int(batch["attention_mask"].sum()))
                padded.append(batch["attention_mask"].numel())
                return batch

            args = tf.TrainingArguments(output_dir="/tmp/trainer-bench", per_device_train_batch_size=docs,
                                        max_steps=steps, learning_rate=1e-5, logging_steps=1, report_to=[],
                                        save_strategy="no", bf16=DEV == "cuda", use_cpu=DEV != "cuda", seed=0,
                                        data_seed=0, dataloader_num_workers=0, optim="adamw_torch_fused"
                                        if DEV == "cuda" else "adamw_torch")
            trainer = tf.Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                                 callbacks=[Timer()])
            backend, stats = _counting(impl)
            if impl != "eager":
                trainer.model.compile(backend=backend)
            fxfuse.clear_reports()
            if DEV == "cuda":
                torch.cuda.reset_peak_memory_stats()
            trainer.train()
            real_tok = real
            first = int(os.environ.get("TRAINER_FROM", 4))
            timed = [i for i in range(len(times)) if i >= first and times[i][1] == (times[i - 1][1] if i else 0)]
            toks = sum(real_tok[i] for i in timed)
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else float("nan")
            emit(section="trainer", collator="DataCollatorForLanguageModeling(mlm=False)", impl=impl,
                 layers=cfg.num_hidden_layers, steps=steps, graphs=stats["graphs"], timed_steps=timed,
                 real_tokens_per_s=round(toks / sum(times[i][0] for i in timed)) if timed else None,
                 padded_fraction=round(1 - sum(real_tok) / sum(padded), 3),
                 peak_gib=round(peak, 2), loss_first=losses[0] if losses else None,
                 loss_last=losses[-1] if losses else None,
                 fused_passes=_fused_passes(impl))
            del trainer, model
            _release()
        except Exception as e:
            emit(section="trainer", impl=impl, error=f"{type(e).__name__}: {str(e)[:400]}")
            traceback.print_exc()


# ------------------------------------------------------------------------------------------------- unpad
def sec_unpad():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    models = {"llama": (LlamaForCausalLM, LlamaConfig(**common)),
              "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=32))}
    cases = [("llama", torch.float32, pad) for pad in ("right", "left", "mixed")] + [
        ("llama", torch.bfloat16, "mixed"), ("qwen3", torch.float32, "mixed"), ("qwen3", torch.bfloat16, "left")]
    only = os.environ.get("UNPAD_DTYPES")  # e.g. "bfloat16"
    for arch, dt, pad in cases:
        if only and str(dt).split(".")[-1] not in only.split(","):
            continue
        cls, cfg = models[arch]
        try:
            torch.manual_seed(0)
            model = cls._from_config(cfg, attn_implementation="sdpa").to(DEV, dt)
            g = torch.Generator().manual_seed(1)
            B, S = 4, 300 if not SMOKE else 40
            lens = torch.randint(S // 10, S, (B,), generator=g)
            lens[0] = S
            ar = torch.arange(S)
            am = (ar[None] < lens[:, None]) if pad == "right" else (ar[None] >= S - lens[:, None])
            if pad == "mixed":
                am[1::2] = ar[None] < lens[1::2, None]
            am = am.long().to(DEV)
            ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g).to(DEV)
            labels = ids.masked_fill(am == 0, -100)

            def run(fn):
                out = fn(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
                out.loss.backward()
                grads = [p.grad.float().clone() for p in model.parameters()]
                model.zero_grad(set_to_none=True)
                return out, grads

            ref, ref_g = run(model)
            fxfuse.clear_reports()
            torch._dynamo.reset()
            out, got_g = run(torch.compile(model, backend="fxfuse",
                                           options={"passes": {"unpad_tokens": True}}))
            base_g = None
            if dt != torch.float32:  # what compiling costs in accuracy without the pass, for the same batch
                torch._dynamo.reset()
                _, base_g = run(torch.compile(model, backend="fxfuse", options={"passes": {"unpad_tokens": False}}))
            recs = [(kind, r) for rep in fxfuse.reports() for kind in ("fused", "skipped", "rolled_back")
                    for r in getattr(rep, kind) if r.pass_name == "unpad_tokens"]
            real = am.bool()
            emit(section="unpad", arch=arch, dtype=str(dt).split(".")[-1], pad=pad,
                 real_tokens=int(real.sum()), padded_tokens=B * S,
                 unpad=[kind for kind, _ in recs] or ["not reported"],
                 reason=[str(r.reason)[:300] for kind, r in recs if kind != "fused"][:2],
                 loss_eager=round(ref.loss.item(), 5), loss_fxfuse=round(out.loss.item(), 5),
                 logits_rel=rel(out.logits[real], ref.logits[real]),
                 grad_rel_max=max(rel(a, b) for a, b in zip(got_g, ref_g)),
                 grad_rel_max_without_unpad=base_g and max(rel(a, b) for a, b in zip(base_g, ref_g)))
        except Exception as e:
            emit(section="unpad", arch=arch, pad=pad, error=f"{type(e).__name__}: {str(e)[:400]}")
            traceback.print_exc()
        torch._dynamo.reset()


# -------------------------------------------------------------------------------------------------- attn
def sec_attn():
    shapes = {"llama3.2-1b": (32, 8, 64, 0.0), "llama3-8b": (32, 8, 128, 0.0), "gemma2-2b": (8, 4, 256, 50.0)}
    S = 8192 if not SMOKE else 256
    for name, (H, Hkv, D, cap) in shapes.items():
        for dist, lens in (("docs 128..4096 (log-normal, median 300)", None), ("one document (causal)", [S])):
            if lens is None:
                lens = doc_lengths(200, 7, lo=128, hi=4096)
                acc, out_l = 0, []
                for n in lens:  # fill one row of S tokens
                    n = min(n, S - acc)
                    if n <= 0:
                        break
                    out_l.append(n)
                    acc += n
                lens = out_l
            m = packed_mask(lens, DEV)
            torch.manual_seed(0)
            q = torch.randn(1, H, S, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, Hkv, S, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, Hkv, S, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            do = torch.randn_like(q)
            work = sum(n * n for n in lens) / (S * S)
            impls = {
                "fxfuse op, mask tensor": lambda: softcap_attention(q, k, v, mask=m, softcap=cap),
                "fxfuse op, causal=True": lambda: softcap_attention(q, k, v, causal=True, softcap=cap),
            }
            if not cap:
                impls["SDPA, same bool mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                                                         enable_gqa=True)
                impls["SDPA, is_causal over the row"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                                 enable_gqa=True)
            for impl, fn in impls.items():
                try:
                    def step(fn=fn):
                        q.grad = k.grad = v.grad = None
                        fn().backward(do)
                    ms, peak = bench(step)
                    emit(section="attn", shape=name, docs=dist, n_docs=len(lens), S=S, causal_work_fraction=round(work, 4),
                         impl=impl, fwd_bwd_ms=round(ms, 3), peak_gib=round(peak, 3))
                except Exception as e:
                    emit(section="attn", shape=name, docs=dist, impl=impl, error=f"{type(e).__name__}: {str(e)[:200]}")


# --------------------------------------------------------------------------------------------------- e2e
def _counting(backend_name):
    """A backend that counts the graphs it compiles and the seconds spent compiling them."""
    stats = {"graphs": 0, "compile_s": 0.0}
    if backend_name == "fxfuse":
        from fxfuse.backend import fxfuse as inner
    elif backend_name in ("fxfuse-nounpad", "fxfuse-unpad"):
        from fxfuse.backend import fxfuse as full

        def inner(gm, example_inputs, unpad=backend_name == "fxfuse-unpad"):
            return full(gm, example_inputs, options={"passes": {"unpad_tokens": unpad}})
    elif backend_name == "fxfuse-nomix":  # Inductor's mixed-order reductions off (RMSNorm backward unfused)
        from fxfuse.backend import fxfuse as full

        def inner(gm, example_inputs):
            return full(gm, example_inputs, options={"triton.mix_order_reduction": False})
    else:
        from torch._inductor.compile_fx import compile_fx as inner

    def backend(gm, example_inputs):
        stats["graphs"] += 1
        t0 = time.perf_counter()
        try:
            return inner(gm, example_inputs)
        finally:
            stats["compile_s"] += time.perf_counter() - t0

    return backend, stats


def _batches(layout, steps, docs, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    for s in range(steps):
        lens = doc_lengths(docs, seed * 1000 + s)
        toks = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
        if layout == "packed":
            ids = torch.cat(toks)[None]
            pos = torch.cat([torch.arange(n) for n in lens])[None]
            labels = ids.clone()
            starts = torch.cumsum(torch.tensor([0] + lens[:-1]), 0)
            labels[0, starts] = -100
            yield sum(lens), dict(input_ids=ids, position_ids=pos, labels=labels)
        else:
            L = max(lens)
            ids = torch.zeros(len(lens), L, dtype=torch.long)
            am = torch.zeros(len(lens), L, dtype=torch.long)
            for i, t in enumerate(toks):
                ids[i, : len(t)] = t
                am[i, : len(t)] = 1
            labels = ids.masked_fill(am == 0, -100)
            yield sum(lens), dict(input_ids=ids, attention_mask=am, labels=labels)


def _train(model_fn, impl, layout, steps, docs, vocab, seed=0, lora=False):
    torch.manual_seed(0)
    model = model_fn()
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    backend, stats = _counting(impl)
    fwd = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    fxfuse.clear_reports()
    times, toks, losses = [], 0, []
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    jit = _jit_compiles()
    for step_i, (real, batch) in enumerate(_batches(layout, steps, docs, vocab, seed)):
        batch = {k: v.to(DEV) for k, v in batch.items()}
        g0 = stats["graphs"]
        jit["step"] = step_i
        if DEV == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fwd(**batch, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())  # syncs
        dt = time.perf_counter() - t0
        if stats["graphs"] == g0 and step_i >= int(os.environ.get("E2E_FROM", 0)):
            times.append(dt)
            toks += real
            jit["timed"].add(step_i)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else float("nan")
    jit["off"]()
    jit_timed = [f"{st}:{name}" for st, name in jit["log"] if st in jit["timed"]]
    if os.environ.get("E2E_PROFILE") and DEV == "cuda":
        _profile_steps(fwd, opt, batch, f"{impl}-{layout}")
    fused = _fused_passes(impl)
    del model, opt, fwd
    _release()
    return dict(graphs=stats["graphs"], compile_s=round(stats["compile_s"], 1), steps_timed=len(times),
                real_tokens_per_s=round(toks / sum(times)) if times else None,
                step_ms=[round(t * 1e3, 1) for t in times], timed_steps=sorted(jit["timed"]),
                triton_jit_in_timed_steps=jit_timed[:20], peak_gib=round(peak, 2),
                loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4), fused_passes=fused)


def _jit_compiles():
    """Triton JIT compiles (a kernel's first launch with a new specialisation: the divisibility of an integer
    argument or a pointer's alignment) by step, through ``triton.knobs.runtime.jit_cache_hook``: a step that
    compiled no graph may still compile kernels."""
    rec = {"step": -1, "log": [], "timed": set(), "off": lambda: None}
    try:
        import triton

        knobs = triton.knobs.runtime
    except Exception:
        return rec
    prev = knobs.jit_cache_hook

    def hook(*args, **kwargs):
        rec["log"].append((rec["step"], str(kwargs.get("repr", "?")).split("[")[0]))
        return prev(*args, **kwargs) if prev else None

    knobs.jit_cache_hook = hook

    def off():
        knobs.jit_cache_hook = prev

    rec["off"] = off
    return rec


def _profile_steps(fwd, opt, batch, name, n=2):
    """Two more steps on the last batch (compiled already) under torch.profiler: the top CUDA kernels and the host
    time per step, to $OUT/profile-<name>.txt."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        out = fwd(**batch, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"profile-{name}.txt"), "w") as f:
        f.write(f"wall per step (profiled) {wall * 1e3:.1f} ms\n")
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))
        f.write("\n\nby CPU time\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=90))
        f.write("\n\nby self CPU time\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=90))
    # the host's Python by function (what the profiler's op table cannot split: Inductor's wrapper, fxfuse's
    # launchers, Dynamo's guards), n steps under cProfile
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(70)
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(50)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"cprofile-{name}.txt"), "w") as f:
        f.write(f"{n} steps\n" + s.getvalue())


def sec_e2e():
    from transformers import AutoModelForCausalLM, LlamaConfig

    if SMOKE:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=500, max_position_embeddings=8192)
        steps, docs = 4, 3
    else:
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=int(os.environ.get("E2E_LAYERS", 16)), num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=32768,
                          tie_word_embeddings=True)
        steps, docs = int(os.environ.get("E2E_STEPS", 24)), 8
    model_fn = lambda: AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,  # noqa: E731
                                                        attn_implementation="sdpa").to(DEV)
    impls = os.environ.get("E2E_IMPLS", "fxfuse,inductor").split(",")
    for layout in os.environ.get("E2E_LAYOUTS", "packed,padded").split(","):
        for impl in impls:
            try:
                r = _train(model_fn, impl, layout, steps, docs, cfg.vocab_size)
                emit(section="e2e", shape="llama3.2-1b", layers=cfg.num_hidden_layers, tune="full", layout=layout,
                     impl=impl, steps=steps, docs_per_step=docs, **r)
            except Exception as e:
                emit(section="e2e", shape="llama3.2-1b", layout=layout, impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc()


def sec_long():
    from transformers import AutoModelForCausalLM, LlamaConfig
    import peft

    n_layers = int(os.environ.get("LONG_LAYERS", 4))
    if SMOKE:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=500, max_position_embeddings=65536)
        lengths = (256, 512)
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=n_layers, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=65536, rope_theta=500000.0)
        lengths = (16384, 32768)
    for impl in os.environ.get("LONG_IMPLS", "fxfuse,inductor").split(","):
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").to(DEV)
            model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
            backend, stats = _counting(impl)
            fwd = torch.compile(model, backend=backend)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
            fxfuse.clear_reports()
            for S in lengths:
                ids = torch.randint(0, cfg.vocab_size, (1, S), device=DEV)
                labels = ids.clone()
                labels[0, :3] = -100
                if DEV == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                row = {}
                for rep in range(2):
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = fwd(input_ids=ids, labels=labels, use_cache=False)
                    out.loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    loss = out.loss.item()
                    row[f"step{rep}_s"] = round(time.perf_counter() - t0, 2)
                peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else float("nan")
                emit(section="long", shape=f"llama3-8b x{n_layers} layers", tune="lora r16 + checkpointing", impl=impl,
                     seq=S, loss=round(loss, 4), graphs=stats["graphs"], tokens_per_s=round(S / row["step1_s"]),
                     peak_gib=round(peak, 2), **row,
                     fused_passes=_fused_passes(impl))
            del model, opt, fwd
            _release()
        except Exception as e:
            emit(section="long", impl=impl, error=f"{type(e).__name__}: {str(e)[:400]}")
            traceback.print_exc()


if __name__ == "__main__":
    emit(section="env", gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__,
         triton=__import__("triton").__version__, transformers=__import__("transformers").__version__,
         commit=os.environ.get("COMMIT") or os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or "?")
    for sec in sys.argv[1:] or ["check", "attn", "e2e", "long"]:
        try:
            globals()["sec_" + sec]()
        except Exception as e:
            emit(section=sec, error=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
