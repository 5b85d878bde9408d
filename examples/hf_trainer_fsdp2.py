"""HF Trainer + accelerate's FSDP2 with fxfuse's passes, one process per device:

    torchrun --nproc_per_node 8 examples/hf_trainer_fsdp2.py                 # a tiny random Llama, as a smoke run
    torchrun --nproc_per_node 8 examples/hf_trainer_fsdp2.py --model meta-llama/Llama-3.2-1B --steps 100
    torchrun --nproc_per_node 2 examples/hf_trainer_fsdp2.py --shape 1b --steps 12 --regions   # random 1B widths
    torchrun --nproc_per_node 2 examples/hf_trainer_fsdp2.py --shape 1b --regions --seq 65536 --rows 1 \
        --gradient-checkpointing                                              # one 64k-token row per GPU
    torchrun --nproc_per_node 2 examples/hf_trainer_fsdp2.py --shape 1b --regions --seq 65536 --rows 1 --cp 2
                                                                              # one 64k-token row across both GPUs
    torchrun --nproc_per_node 2 examples/hf_trainer_fsdp2.py --shape 1b --regions --tp 2   # tensor parallelism

``fxfuse.install()`` puts fxfuse's passes into Inductor, which ``TrainingArguments(torch_compile=True)`` (accelerate's
inductor backend) compiles the model with; accelerate applies FSDP2 (``fully_shard`` per decoder layer and root).
Train with ``use_cache=False`` (set on the config here): HF's KV cache makes each decoder layer's frame recompile
under FSDP2. ``--no-compile`` runs the same thing eagerly (tests compare the two); ``--regions`` compiles with
``fxfuse.compile_regions(model)`` instead (each decoder layer once, the base model eager, the lm-head loss fused)
and leaves ``torch_compile`` off; ``--inductor`` is accelerate's plain Inductor compile, for comparison. On a
machine without a GPU it runs on the CPU with gloo. Rank 0 prints one ``RESULT {json}`` line: losses, fused
passes, whether FSDP2 wrapped it, the median step time after the first two steps and the peak GPU memory;
``--seq`` / ``--rows`` set the batch, ``--pad`` right-pads rows of random lengths (HF's attention-mask path),
``--gradient-checkpointing`` is the Trainer's, ``--fsdp-activation-checkpointing`` accelerate's; ``--cp N`` splits each
row's tokens over N GPUs (accelerate's ``ParallelismConfig(cp_size=N)``: torch's context parallelism, ring attention
in SDPA; CUDA only); ``--tp N`` trains tensor-parallel instead of FSDP2: the model loaded with transformers' own
plan (``from_pretrained(tp_plan="auto")``: attention and MLP split by heads / columns, the lm-head over the vocabulary,
its logits gathered) and accelerate's ``ParallelismConfig(tp_size=N)`` (N = the world size; accelerate runs it on
accelerators only); with N below the world size, FSDP2 x TP as transformers (>= 5.24) loads it:
``from_pretrained(distributed_config=DistributedConfig(tp_size=N, fsdp_size=world // N))``, the model sharded over both
at load time and the Trainer leaving it as it is. ``--profile`` (GPU) leaves the last two steps out of the timing and
adds where their time went (GPU time by kernel kind, NCCL time no compute overlaps, the host's top ops;
``benchmarks/trace_summary.py``).
"""
import argparse
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

import fxfuse
from fxfuse.lazy import materialized_at


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model id or path (default: a tiny random Llama)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--shape", choices=("tiny", "1b"), default="tiny",
                    help="without --model: a random Llama, tiny or with Llama-3.2-1B widths (2048 tokens a row)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--regions", action="store_true", help="fxfuse.compile_regions instead of torch_compile")
    ap.add_argument("--inductor", action="store_true", help="torch_compile with Inductor alone (no fxfuse)")
    ap.add_argument("--seq", type=int, default=None,
                    help="tokens a row (default 2048 for --model / --shape 1b, 16 tiny)")
    ap.add_argument("--rows", type=int, default=2, help="rows per device and step")
    ap.add_argument("--pad", action="store_true",
                    help="rows of random lengths (half to all of --seq) right-padded to --seq: attention mask and "
                         "labels -100 on the padding, as a padding collator makes them")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="TrainingArguments(gradient_checkpointing=True): what long rows (64k) need to fit")
    ap.add_argument("--fsdp-activation-checkpointing", action="store_true",
                    help="fsdp_config's activation_checkpointing instead: transformers' advice under FSDP (the "
                         "Trainer's gradient_checkpointing repeats an all-gather in the backward)")
    ap.add_argument("--cp", type=int, default=1,
                    help="context parallelism: each row's tokens split over this many GPUs (accelerate's "
                         "ParallelismConfig(cp_size=N), torch's ring attention in SDPA; needs CUDA and --seq a "
                         "multiple of 2 N)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallelism over N ranks: N = the world size, instead of FSDP2 (transformers' "
                         "tp_plan='auto', accelerate's ParallelismConfig(tp_size=N); needs CUDA); N below it, FSDP2 "
                         "over world / N data ranks x TP over N (transformers >= 5.24's DistributedConfig)")
    ap.add_argument("--lce-chunk-mib", type=int, default=0,
                    help="fxfuse's lm-head loss: the logits-chunk budget in MiB (pass option chunk_bytes; 0 = the "
                         "default 256 MiB). Fewer, larger chunks accumulate the head's weight gradient fewer times")
    ap.add_argument("--passes-off", default="",
                    help="fxfuse passes turned off, comma-separated (e.g. linear_cross_entropy); 'all' runs "
                         "fxfuse's compile path with no pass: regional Inductor, for comparison")
    ap.add_argument("--optim", default="adamw_torch",
                    help="TrainingArguments(optim=...), e.g. adamw_torch_fused. Under --tp, transformers < 5.24 "
                         "steps AdamW parameter by parameter whatever this says (it turns foreach and fused off "
                         "when DTensors and plain tensors mix); 5.24 groups the parameters by mesh instead")
    ap.add_argument("--out", default="/tmp/fxfuse-hf-fsdp2")
    ap.add_argument("--profile", action="store_true",
                    help="profile the last two steps (GPU): where their time goes, in the RESULT line")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if a.cp > 1 and (not torch.cuda.is_available() or world % a.cp):
        # torch's ring attention dispatches the CUDA SDPA kernels only (flash, efficient, cuDNN)
        ap.error(f"--cp {a.cp} needs CUDA and a world size that it divides (world size {world})")
    fsdp_tp = 1 < a.tp < world  # FSDP2 x TP, sharded by transformers at load time
    if a.tp > 1 and (world % a.tp or a.cp > 1):
        ap.error(f"--tp {a.tp} needs a world size that it divides (world size {world}) and no --cp")
    if a.tp > 1 and not torch.cuda.is_available():
        # accelerate's ParallelismConfig refuses CPU ranks (DistributedType.MULTI_CPU); the Trainer hands a model
        # that transformers sharded at load time to accelerate with one too
        ap.error(f"--tp {a.tp} needs CUDA: the Trainer runs tensor parallelism under accelerate, which refuses CPU "
                 f"ranks")
    if fsdp_tp:
        try:
            from transformers.distributed import DistributedConfig
        except ImportError:
            import transformers

            ap.error(f"--tp {a.tp} below the world size ({world}) needs transformers >= 5.24's DistributedConfig "
                     f"(this is {transformers.__version__})")
    # how transformers loads the model: its tensor-parallel plan (accelerate's TP), or FSDP2 x TP at load time
    load_parallel = {"distributed_config": DistributedConfig(
        tp_size=a.tp, fsdp_size=world // a.tp, fsdp_mixed_precision=torch.cuda.is_available())} if fsdp_tp else \
        {"tp_plan": "auto"} if a.tp > 1 else {}
    trainer_compiles = not (a.no_compile or a.regions)
    fxfuse_kw = {"pass_options": {"linear_cross_entropy": {"chunk_bytes": a.lce_chunk_mib << 20}}} if a.lce_chunk_mib else {}
    if a.passes_off:
        fxfuse_kw["passes"] = [] if a.passes_off == "all" else {p: False for p in a.passes_off.split(",")}
    if trainer_compiles and not a.inductor:
        fxfuse.install(**fxfuse_kw)  # Inductor now runs fxfuse's passes on every graph it compiles
    torch.manual_seed(0)
    if a.model:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, **load_parallel)
        vocab, seq = model.config.vocab_size, 2048
    else:
        if a.shape == "1b":
            # tied embeddings, as Llama-3.2-1B; under --tp untied (transformers' plan splits the lm-head only)
            cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=128256, max_position_embeddings=max(8192, a.seq or 0),
                              tie_word_embeddings=a.tp == 1)
            seq = 2048
        else:
            cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=256, tie_word_embeddings=a.tp == 1)
            seq = 16
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
        if a.tp > 1:  # transformers shards a model at load time: the same random weights on every rank, reloaded
            model = _reload_tensor_parallel(model, load_parallel)
        vocab = cfg.vocab_size
    seq = a.seq or seq
    model.config.use_cache = False
    if a.regions:
        fxfuse.compile_regions(model, **fxfuse_kw)  # before the Trainer: accelerate's fully_shard keeps the compiled forwards
    layer_cls = type(model.model.layers[0]).__name__
    g = torch.Generator().manual_seed(0)
    data = []  # your dataset and collator here
    for _ in range(a.rows * a.steps * world):
        t = torch.randint(0, vocab, (seq,), generator=g)
        row = {"input_ids": t, "labels": t.clone()}
        if a.pad:  # right-padded from a random length, as a padding collator leaves a row
            n = int(torch.randint(seq // 2, seq + 1, (), generator=g))
            row["attention_mask"] = (torch.arange(seq) < n).long()
            row["input_ids"] = t.masked_fill(row["attention_mask"] == 0, 0)
            row["labels"] = t.masked_fill(row["attention_mask"] == 0, -100)
        data.append(row)
    real_tokens = sum(int(r["attention_mask"].sum()) if a.pad else seq for r in data) / len(data)
    parallel = {}
    if a.tp > 1 and not fsdp_tp:  # (FSDP2 x TP: the model is sharded already; the Trainer does not wrap it)
        from accelerate import ParallelismConfig

        parallel["parallelism_config"] = ParallelismConfig(tp_size=a.tp)
    elif a.cp > 1:  # the FSDP2 mesh then spans the context-parallel ranks too (accelerate's dp_shard_cp)
        from accelerate import ParallelismConfig

        parallel["parallelism_config"] = ParallelismConfig(dp_shard_size=world // a.cp, cp_size=a.cp)
    args = TrainingArguments(
        **parallel, output_dir=a.out, per_device_train_batch_size=a.rows, max_steps=a.steps, optim=a.optim,
        gradient_checkpointing=a.gradient_checkpointing, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
        torch_compile=trainer_compiles,  # accelerate's inductor backend, with fxfuse's passes installed
        **({} if a.tp > 1 else dict(
            fsdp="full_shard auto_wrap",
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": [layer_cls], "reshard_after_forward": True,
                         "activation_checkpointing": a.fsdp_activation_checkpointing})))
    times, profiled = [], {}
    profile_from = a.steps - 2 if a.profile and torch.cuda.is_available() and a.steps >= 6 else None

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == profile_from:  # the last two steps, left out of the timed ones
                from torch.profiler import ProfilerActivity, profile

                torch.cuda.synchronize()
                profiled["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                           record_shapes=True)
                profiled["prof"].__enter__()

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if profile_from is None or state.global_step <= profile_from:
                times.append(time.perf_counter())
            elif state.global_step == a.steps:
                profiled["prof"].__exit__(None, None, None)

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[StepTimes()])
    trainer.train()
    steps = [t1 - t0 for t0, t1 in zip(times[1:], times[2:])]  # after the first two steps (compiles)
    if int(os.environ.get("RANK", 0)) == 0:
        from torch.distributed.fsdp import FSDPModule

        print("RESULT", json.dumps({
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "fused": sorted({r.pass_name for rep in fxfuse.reports() for r in rep.fused}),
            "graphs": len(fxfuse.reports()),
            # Dynamo's frames compiled (recompiles included) and graph breaks, on this rank
            "frames_compiled": len(torch._dynamo.utils.get_compilation_metrics()),
            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            # fxfuse's post-grad rewrites on this rank (tensor parallelism's all-reduces merged / split)
            "fxfuse_counters": dict(torch._dynamo.utils.counters["fxfuse"]),
            # Inductor's compute / collective reordering as the run left it (install()'s comm_overlap sets it)
            "inductor_comm_reorder": [getattr(p, "__name__", p) for p in
                                      torch._inductor.config.reorder_for_compute_comm_overlap_passes]
            if torch._inductor.config.reorder_for_compute_comm_overlap else None,
            "rolled_back": [f"{r.pass_name}: {r.reason[:160]}" for rep in fxfuse.reports() for r in rep.rolled_back],
            "fsdp2": any(isinstance(m, FSDPModule) for m in trainer.model.modules()),
            "wrapped": type(trainer.model_wrapped).__name__,
            "step_ms": round(sorted(steps)[len(steps) // 2] * 1e3, 1) if steps else None,
            # a tensor-parallel group shares its rows: tokens per GPU are the group's over its size
            "tokens_per_s_per_gpu": round(a.rows * seq / a.cp / a.tp / sorted(steps)[len(steps) // 2]) if steps else None,
            "seq": seq, "cp": a.cp, "tp": a.tp, "optim": a.optim, "lce_chunk_mib": a.lce_chunk_mib or None,
            "passes_off": a.passes_off or None, "rows": a.rows, "padded": a.pad, "real_tokens_per_row": round(real_tokens),
            "gradient_checkpointing": a.gradient_checkpointing,
            "fsdp_activation_checkpointing": a.fsdp_activation_checkpointing,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
            "mode": "eager" if a.no_compile else "regions" if a.regions else "inductor" if a.inductor else "install",
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            # lazy logits (the fused loss's) that something computed after all, by the site that read them
            "lazy_logits_computed_at": dict(materialized_at),
            **({"profile": _profile_summary(profiled["prof"], vocab)} if "prof" in profiled else {})}), flush=True)
    # Leave in order: every rank done, the trainer (and the FSDP2 model holding the process group) dropped, then
    # the group destroyed here rather than at interpreter exit, where gloo's teardown can hang.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        del trainer, model
        dist.destroy_process_group()


def _reload_tensor_parallel(model, load_parallel):
    """``model`` (the same random init on every rank) saved by rank 0 and loaded on every rank as
    ``load_parallel`` says (``tp_plan="auto"``: transformers' own tensor-parallel plan; ``distributed_config``: FSDP2
    x TP): such models are sharded as ``from_pretrained`` loads them."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    path = [tempfile.mkdtemp(prefix="fxfuse-tp-") if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        model.save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    return AutoModelForCausalLM.from_pretrained(path[0], dtype=torch.float32, attn_implementation="sdpa",
                                                **load_parallel)


def _profile_summary(prof, vocab):
    """GPU time by kernel kind (benchmarks/trace_summary.py), the host's top ops by self CPU time and the matmuls
    with a vocabulary-sized operand (the lm-head's: which op launched them, at what shapes), per step."""
    import sys
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from benchmarks.trace_summary import summarize

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        with open(tmp.name) as f:
            out = summarize(json.load(f), steps=2, top=40)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    out["host_top"] = [{"name": e.key[:90], "self_cpu_ms": round(e.self_cpu_time_total / 2e3, 2),
                        "calls": e.count // 2} for e in ops]
    gemms = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")
    out["vocab_matmuls"] = [
        {"name": e.key, "shapes": e.input_shapes, "calls": e.count / 2,
         "device_ms": round(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 2e3, 2)}
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key in gemms and any(vocab in s for s in e.input_shapes if isinstance(s, list))]
    return out


if __name__ == "__main__":
    main()
