"""The 8B LoRA long-context ladder: Llama-3.1-8B shape (hidden 4096, 32 layers, 32 / 8 heads, MLP 14336, vocab
128256, rope theta 500000), random init on the GPU in bf16, PEFT LoRA r16 / alpha 32 / dropout 0 on q, k, v, o,
gate, up, down, HF gradient checkpointing (non-reentrant), use_cache=False, batch 1, labels = input ids, AdamW on
the LoRA parameters, torch.compile(model, backend=impl) for impl in --impl (fxfuse, inductor), one row per
(impl, length), each in its own subprocess with a timeout: an OOM, a crash or a hang is a row, never a lost run.

Per row: first_step_s (compile included), compile_s (inside the backend) and graphs compiled, step_s of every
step, tokens_per_s over the steps after the first, peak_gib (torch.cuda.max_memory_allocated over all steps; the
16 GiB of weights included) with peak_first_step_gib / peak_steady_gib apart, loss of every step, fxfuse's fused
sites per pass and its skip reasons. An OOM row holds the OutOfMemoryError message, the phase (build, step i
forward / backward / optimizer) and the peak reached.

--eager-check S (default 16384; 0 = off): the same model (same seed, same weights: weights_sq_sum in every row)
run in eager at S, one step: its loss and LoRA gradients against those the fxfuse (and inductor) rows at S saved
from their first step (loss_abs_diff, grad_rel = |g - g_eager| / |g_eager| over all LoRA gradients,
grad_max_rel per tensor). If no fxfuse row at S ran, the eager child compiles the same model with fxfuse itself.
--packed N: N equal packed documents per row (position_ids restarting per document, no attention mask, the label
of each document's first token -100) instead of one document.

Run (device machine, repository root, one H200):
    python3 benchmarks/bench_longctx_lora.py --impl fxfuse,inductor --lengths 16384,32768,65536,131072,262144
is the whole ladder, ~35-50 min: more than one device command (10 min). Split it over calls, each with --budget
(what does not fit becomes a 'skipped' row, never a lost one) and its own --out, then merge (no GPU needed):
    B="python3 benchmarks/bench_longctx_lora.py --budget 560"; R=benchmarks/results/longctx-lora-h200
    $B --impl fxfuse --lengths 16384,32768 --out $R-a.json                      (eager check at 16k included)
    $B --impl fxfuse --lengths 65536,131072 --eager-check 0 --out $R-b.json
    $B --impl fxfuse --lengths 262144 --steps 1 --eager-check 0 --out $R-c.json
    $B --impl inductor --lengths 16384,32768,65536 --eager-check 0 --out $R-d.json
    $B --impl inductor --lengths 131072,262144 --eager-check 0 --out $R-e.json
    python3 benchmarks/bench_longctx_lora.py --merge $R-a.json,$R-b.json,$R-c.json,$R-d.json,$R-e.json
Rows go to benchmarks/results/<--out> (default longctx-lora-h200.json) and $OUT/<--out>, a PNG beside them if
matplotlib imports; child logs to $OUT/logs. --tiny: a 2-layer hidden-64 Llama on CPU at 64 and 96 tokens, trained
with backend fxfuse (--impl fxfuse,inductor adds Inductor), ~1.5 min with warm compile caches, ~3.5 min cold.
A child alone: --one fxfuse,16384 (or eager,16384).
"""
import argparse
import glob
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # fxfuse from the source tree
sys.path.insert(0, HERE)
import bench_longctx_attention as common  # noqa: E402  (driver helpers: child processes, versions, JSON, merge)

ROW_TAG = common.ROW_TAG
IMPLS = ("fxfuse", "inductor")  # the default; "fxfuse-tiled" / "fxfuse-untiled" (sequence_tiling always / off)
KNOWN_IMPLS = IMPLS + ("fxfuse-tiled", "fxfuse-untiled", "fxfuse-offload")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EPILOG = """
Times on one H200 (estimates from the 8B-widths x4-layer rows and the attention anchor, not measured at 32 layers):
the first step compiles the 32-layer graph (~1.5-3 min, once per child); a step then takes ~3 s at 16k, ~8 s at
32k, ~25 s at 64k, ~50-85 s at 128k, ~3-5 min at 262k (attention grows as S^2: beyond 32k fxfuse runs its own
attention kernel, ~280 TFLOP/s). Inductor materialises the [S, S] mask and the [S, 128256] logits: expect OOM
rows from ~128k. One device command is at most 10 min: split the ladder over calls (--append collects them).
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", "--impls", dest="impl", default=None,
                   help="comma list of fxfuse, inductor (default both; --tiny fxfuse)")
    p.add_argument("--lengths", default=None, help="comma list (default 16384,...,262144; --tiny 64,96)")
    p.add_argument("--steps", type=int, default=3, help="steps per (impl, length); the first includes compiling")
    p.add_argument("--eager-check", type=int, default=None, metavar="S",
                   help="eager one-step loss and LoRA grads at S vs fxfuse's (default 16384; --tiny 64; 0 = off)")
    p.add_argument("--packed", type=int, default=0, metavar="N", help="N packed documents per row (0 = one)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny 2)")
    p.add_argument("--lr", type=float, default=None, help="AdamW lr (default 1e-4; --tiny 1e-2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds per child")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole driver (0 = none); children get what is left, later rows are "
                        "recorded as skipped once it is spent")
    p.add_argument("--alloc-conf", default="expandable_segments:True",
                   help="PYTORCH_CUDA_ALLOC_CONF for the children unless set already ('' = torch's default)")
    p.add_argument("--out", default=None, help="result file name in benchmarks/results (or a path with a /); "
                                               "default longctx-lora-h200.json, --tiny /tmp/longctx-lora-tiny.json")
    p.add_argument("--append", action="store_true", help="keep the rows of an existing --out file (a new row "
                                                         "replaces one with the same impl, S, packed)")
    p.add_argument("--merge", default=None, help="comma list of result JSONs to merge into --out, then plot")
    p.add_argument("--replot", default=None, help="redraw the PNG of an existing result JSON and exit")
    p.add_argument("--tiny", action="store_true", help="2-layer hidden-64 Llama, CPU-friendly smoke run")
    p.add_argument("--one", default=None, help="child mode: impl,S (impl: fxfuse, inductor or eager)")
    p.add_argument("--save-grads", default=None, help=argparse.SUPPRESS)  # child: where to save step-0 LoRA grads
    p.add_argument("--grads-dir", default=None, help=argparse.SUPPRESS)  # eager child: where the others saved theirs
    a = p.parse_args(argv)
    a.impl = [s for s in (a.impl or ("fxfuse" if a.tiny else ",".join(IMPLS))).split(",") if s]
    for x in a.impl:
        if x not in KNOWN_IMPLS:
            p.error(f"unknown impl {x!r}; known: {KNOWN_IMPLS}")
    default_lengths = "64,96" if a.tiny else "16384,32768,65536,131072,262144"
    a.lengths = [int(s) for s in (a.lengths or default_lengths).split(",") if s]
    a.eager_check = (64 if a.tiny else 16384) if a.eager_check is None else a.eager_check
    a.layers = a.layers or (2 if a.tiny else 32)
    a.lr = a.lr or (1e-2 if a.tiny else 1e-4)
    if a.steps < 1:
        p.error("--steps must be >= 1")
    return a


# ================================================================================================ child: one row
def config(args, S):
    from transformers import LlamaConfig

    if args.tiny:
        return LlamaConfig(hidden_size=64, intermediate_size=224, num_hidden_layers=args.layers,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512, rope_theta=500000.0,
                           max_position_embeddings=max(4096, S), tie_word_embeddings=False)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                       rms_norm_eps=1e-5, max_position_embeddings=max(131072, S), tie_word_embeddings=False)


def build(args, S, dev, row):
    """The seeded model on ``dev`` (initialised there, in bf16), LoRA-wrapped, checkpointing on."""
    import torch
    import peft
    from transformers import AutoModelForCausalLM

    cfg = config(args, S)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        model.config.use_cache = False
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                           target_modules=LORA_TARGETS))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _sync(dev)
    row["build_s"] = round(time.perf_counter() - t0, 2)
    trainable = [p for p in model.parameters() if p.requires_grad]
    row["trainable_params"] = sum(p.numel() for p in trainable)
    row["params"] = sum(p.numel() for p in model.parameters())
    row["lora_dtype"] = str(trainable[0].dtype).replace("torch.", "")
    row["base_dtype"] = str(model.get_base_model().model.embed_tokens.weight.dtype).replace("torch.", "")
    assert {p.device.type for p in model.parameters()} == {dev}, "parameters not all on " + dev
    with torch.no_grad():  # identifies the weights across processes (same seed -> same value)
        sq = sum(float(torch.linalg.vector_norm(p, dtype=torch.float32) ** 2) for p in model.parameters())
    row["weights_sq_sum"] = float(f"{sq:.9g}")
    if dev == "cuda":
        row["weights_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    return model, cfg


def batch(args, S, vocab, dev):
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, vocab, (1, S), generator=g)
    labels = ids.clone()
    b = dict(input_ids=ids, labels=labels)
    if args.packed and args.packed > 1:
        n = args.packed
        lens = [S // n] * n
        lens[-1] += S - sum(lens)
        b["position_ids"] = torch.cat([torch.arange(m) for m in lens])[None]
        starts = torch.cumsum(torch.tensor([0] + lens[:-1]), 0)
        labels[0, starts[1:]] = -100  # no label across a document boundary
    return {k: v.to(dev) for k, v in b.items()}


def _sync(dev):
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def counting_backend(impl):
    """The backend ``impl`` (what torch.compile(backend=impl) runs), counting graphs and seconds in it."""
    stats = {"graphs": 0, "compile_s": 0.0}
    if impl == "fxfuse":
        import fxfuse  # noqa: F401  (registers the backend and its passes)
        from fxfuse.backend import fxfuse as inner
    elif impl == "fxfuse-tiled":  # sequence_tiling always: each MLP over chunks of TILE_TOKENS (8192) tokens
        from fxfuse.backend import fxfuse as full

        def inner(gm, example_inputs):
            return full(gm, example_inputs, options={"pass_options": {"sequence_tiling": {
                "mode": "always", "chunk_tokens": int(os.environ.get("TILE_TOKENS", 8192))}}})
    elif impl == "fxfuse-offload":  # the default + every checkpointed layer input in host memory (checkpoint_offload)
        from fxfuse.backend import fxfuse as full

        def inner(gm, example_inputs):
            return full(gm, example_inputs, options={"offload_activations": True})
    elif impl == "fxfuse-untiled":  # sequence_tiling off (the default, auto, tiles at long lengths on its own)
        from fxfuse.backend import fxfuse as full

        def inner(gm, example_inputs):
            return full(gm, example_inputs, options={"passes": {"sequence_tiling": False}})
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


def _host_memory():
    """Host memory of this process: peak resident set, and the pinned allocator's peak (offloaded activations)."""
    import resource

    out = {"host_max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    try:
        stats = torch.cuda.host_memory_stats()
        peak = stats.get("allocated_bytes.current", None) if "allocated_bytes.peak" not in stats else \
            stats["allocated_bytes.peak"]
        if peak is not None:
            out["host_pinned_peak_gib"] = round(peak / 2**30, 2)
    except Exception:  # a torch without host allocator stats
        pass
    return out


def fxfuse_summary(row):
    import fxfuse

    fused, skipped, ops = {}, {}, {}
    for rep in fxfuse.reports():
        for r in rep.fused:
            fused[r.pass_name] = fused.get(r.pass_name, 0) + 1
            if "attention" in r.pass_name or "causal" in r.pass_name:
                key = f"{r.pass_name}: {r.op[:200]}"
                ops[key] = ops.get(key, 0) + 1
        for r in rep.skipped + rep.rolled_back:
            key = f"{r.pass_name} [{r.status}]: {r.reason[:160]}"
            skipped[key] = skipped.get(key, 0) + 1
    row["fused"] = fused
    row["attention_sites"] = ops  # how each attention site was fused (mask tensor or recipe)
    row["not_fused"] = dict(sorted(skipped.items(), key=lambda kv: -kv[1])[:8])


def lora_grads(model):
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def compare_grads(g, ref):
    """|g - ref| / |ref| over every LoRA gradient, the worst per tensor (tensors whose ref is 0: max |g|)."""
    num = den = 0.0
    worst, zero_ref_max = 0.0, 0.0
    missing = sorted(set(ref) ^ set(g))
    for n, r in ref.items():
        if n not in g:
            continue
        d = float((g[n] - r).norm()) ** 2
        rn = float(r.norm()) ** 2
        num, den = num + d, den + rn
        if rn > 0:
            worst = max(worst, (d / rn) ** 0.5)
        else:
            zero_ref_max = max(zero_ref_max, float(g[n].abs().max()))
    return dict(grad_rel=float(f"{(num / max(den, 1e-30)) ** 0.5:.3e}"), grad_max_rel=float(f"{worst:.3e}"),
                grad_zero_ref_max_abs=zero_ref_max, grad_tensors=len(ref), grad_missing=missing[:5],
                grad_norm=float(f"{den ** 0.5:.6g}"))


def emit(row):
    print(ROW_TAG + json.dumps(row), flush=True)


def oom_fields(e, dev):
    import torch

    f = dict(error="OOM", error_msg=str(e)[:700])
    if dev == "cuda":
        f["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        f["gpu_total_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return f


def is_oom(e):
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def train(model, fwd, b, steps, lr, dev, row, save_to=None, impl=""):
    """``steps`` AdamW steps of fwd(**b).loss; timings, losses and peaks into ``row`` (printed after each step)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, foreach=True)
    S = b["input_ids"].shape[1]
    row.update(step_s=[], losses=[])
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        row["phase"] = f"step {i} forward" + (" (compiling)" if i == 0 and fwd is not model else "")
        loss = fwd(**b).loss  # the model's output object (and any logits it holds) dropped here, as trainers do
        row["phase"] = f"step {i} backward" + (" (compiling)" if i == 0 and fwd is not model else "")
        if i == 0:
            emit(row)  # a hang or kill in the first backward still says where
        loss.backward()
        if i == 0 and save_to:
            g = lora_grads(model)
            row["phase"] = "step 0 saving grads"
        row["phase"] = f"step {i} optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.item()
        del loss
        _sync(dev)
        row["step_s"].append(round(time.perf_counter() - t0, 3))
        row["losses"].append(round(lv, 5))
        if i == 0:
            row["first_step_s"] = row["step_s"][0]
            row["loss_first"] = lv
            if save_to:
                torch.save(dict(impl=impl, loss=lv, grads=g, weights_sq_sum=row.get("weights_sq_sum")), save_to)
                del g
            if dev == "cuda":
                row["peak_first_step_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                torch.cuda.reset_peak_memory_stats()
        elif dev == "cuda":
            row["peak_steady_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["phase"] = f"step {i} done"
        emit(row)
    if steps > 1:
        row["tokens_per_s"] = round(S * (steps - 1) / sum(row["step_s"][1:]), 1)
        row["steady_step_s"] = round(sum(row["step_s"][1:]) / (steps - 1), 3)
    row["loss_last"] = row["losses"][-1]
    if dev == "cuda":
        row["peak_gib"] = max(row.get("peak_first_step_gib", 0), row.get("peak_steady_gib", 0))
        row["reserved_peak_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        row.update(_host_memory())
    del opt


def child(args):
    import torch

    warnings.filterwarnings("ignore")
    impl, S = args.one.split(",")
    S = int(S)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    row = dict(impl=impl, S=S, packed=args.packed or 1, layers=args.layers, device=dev,
               shape="tiny llama (hidden 64)" if args.tiny else "llama-3.1-8b", lora="r16 a32 d0, 7 projections",
               steps=args.steps, phase="build")
    try:
        model, cfg = build(args, S, dev, row)
        b = batch(args, S, cfg.vocab_size, dev)
        if impl == "eager":
            eager_check(args, model, b, dev, row, S)
        else:
            backend, stats = counting_backend(impl)
            if impl.startswith("fxfuse"):
                import fxfuse

                fxfuse.clear_reports()
            fwd = torch.compile(model, backend=backend)
            row["phase"] = "step 0 forward (compiling)"
            emit(row)  # a child killed from here on still leaves its phase and build facts
            try:
                train(model, fwd, b, args.steps, args.lr, dev, row, save_to=args.save_grads, impl=impl)
            finally:
                row["graphs"] = stats["graphs"]
                row["compile_s"] = round(stats["compile_s"], 1)
                if impl.startswith("fxfuse"):
                    fxfuse_summary(row)
        row["phase"] = "done"
    except Exception as e:  # noqa: BLE001
        if is_oom(e):
            row.update(oom_fields(e, dev))
        else:
            row.update(error=type(e).__name__, error_msg=str(e)[:700], traceback=traceback.format_exc()[-1200:])
            if dev == "cuda":
                try:
                    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                except Exception:  # noqa: BLE001  (a faulted context)
                    pass
    emit(row)
    sys.stderr.flush()
    os._exit(0)  # no teardown (a faulted CUDA context or compile workers can hang it): the row is out


def eager_check(args, model, b, dev, row, S):
    """One eager step: loss and LoRA grads, against what the compiled rows at S saved (else fxfuse, here)."""
    import torch

    row["phase"] = "eager step"
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = model(**b).loss
    loss.backward()
    lv = loss.item()
    del loss
    _sync(dev)
    row.update(first_step_s=round(time.perf_counter() - t0, 3), loss_first=lv)
    if dev == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    ref = lora_grads(model)
    model.zero_grad(set_to_none=True)
    emit(row)
    saved = {}
    for path in sorted(glob.glob(os.path.join(args.grads_dir or "/nonexistent", f"*-{S}.pt"))):
        d = torch.load(path, weights_only=False)
        saved[d["impl"]] = d
    if "fxfuse" not in saved:  # no fxfuse row at S saved its step: run it here, on these very weights
        row["phase"] = "fxfuse step (in the eager child)"
        import fxfuse

        fxfuse.clear_reports()
        backend, stats = counting_backend("fxfuse")
        fwd = torch.compile(model, backend=backend)
        loss = fwd(**b).loss
        loss.backward()
        saved["fxfuse"] = dict(impl="fxfuse", loss=loss.item(), grads=lora_grads(model),
                               weights_sq_sum=row["weights_sq_sum"], source="this process")
        del loss
        model.zero_grad(set_to_none=True)
        sub = {}
        fxfuse_summary(sub)
        row["fxfuse_fused"] = sub["fused"]
    for impl, d in saved.items():
        cmp = compare_grads(d["grads"], ref)
        row[f"vs_{impl}"] = dict(loss=d["loss"], loss_abs_diff=float(f"{abs(d['loss'] - lv):.3e}"),
                                 weights_match=d.get("weights_sq_sum") == row["weights_sq_sum"],
                                 source=d.get("source", "its ladder row (another process, same seed)"), **cmp)


# ===================================================================================================== driver
KEY = ("impl", "S", "packed")


def plot(json_path, png_path):
    """tokens/s, peak GiB and first-step seconds vs S per impl (OOM / error rows as x at the top); silently
    nothing without matplotlib."""
    plt, doc = common.pyplot_and_rows(json_path)
    if plt is None:
        return None
    rows = doc["rows"]
    groups = sorted({(r["impl"], r.get("packed", 1)) for r in rows if r.get("impl") != "eager"})
    if not groups:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    panels = (("tokens_per_s", "tokens/s after the first step (higher is better)"),
              ("peak_gib", "peak GiB allocated (lower is better)"),
              ("first_step_s", "first step s, compile included"))
    for ax, (field, label) in zip(axes, panels):
        top = max([r[field] for r in rows if isinstance(r.get(field), (int, float))] or [1])
        for impl, packed in groups:
            rs = sorted((r for r in rows if r["impl"] == impl and r.get("packed", 1) == packed), key=lambda r: r["S"])
            name = impl + (f", {packed} docs" if packed > 1 else "")
            color = {"fxfuse": "tab:red", "fxfuse-tiled": "tab:orange", "fxfuse-untiled": "tab:purple"}.get(
                impl, "tab:blue")
            ok = [(r["S"], r[field]) for r in rs if isinstance(r.get(field), (int, float)) and "error" not in r]
            line = ax.plot([p[0] for p in ok], [p[1] for p in ok], marker="o", label=name, color=color,
                           ls="-" if packed == 1 else "--")
            bad = [r for r in rs if "error" in r]
            if bad:
                ax.scatter([r["S"] for r in bad], [top * 1.08] * len(bad), marker="x", s=70,
                           color=line[0].get_color() if line else color)
                for r in bad:
                    ax.annotate(r["error"], (r["S"], top * 1.08), fontsize=7, rotation=30,
                                xytext=(3, 3), textcoords="offset points")
        if field == "peak_gib" and doc.get("gpu_mem_gib"):
            ax.axhline(doc["gpu_mem_gib"], color="gray", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        xs = sorted({r["S"] for r in rows if r.get("impl") != "eager"})
        ax.set_xticks(xs, [common.tok_label(x) for x in xs])
        ax.set_xlabel("tokens per step (batch 1)")
        ax.set_ylabel(label)
        ax.set_ylim(0, top * 1.25)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    cfg = doc.get("config", {})
    fig.suptitle(f"{cfg.get('shape', 'llama-3.1-8b')} x{cfg.get('layers')} layers, LoRA r16 all projections + "
                 f"checkpointing, bf16, AdamW; {doc.get('machine')}, torch {doc.get('torch')}, "
                 f"commit {doc.get('commit')}", fontsize=9)
    return common.save_figure(plt, fig, png_path)


def driver(args, argv):
    json_path, png_path = common.out_paths(args.out, "/tmp/longctx-lora-tiny.json" if args.tiny
                                           else "longctx-lora-h200.json")
    if args.merge:
        return common.merge_files(args.merge.split(","), json_path, png_path, plot, KEY)
    logdir = os.path.join(os.environ["OUT"], "logs") if os.environ.get("OUT") else tempfile.mkdtemp(
        prefix="longctx-lora-")
    os.makedirs(logdir, exist_ok=True)
    grads_dir = tempfile.mkdtemp(prefix="longctx-lora-grads-")
    env = dict(os.environ)
    if args.alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        env["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    doc = dict(common.versions(), commit=common.git_commit(), script="benchmarks/bench_longctx_lora.py", argv=argv,
               config=dict(shape="tiny llama (hidden 64)" if args.tiny else "llama-3.1-8b", layers=args.layers,
                           lora=dict(r=16, alpha=32, dropout=0.0, targets=LORA_TARGETS),
                           gradient_checkpointing="HF, use_reentrant=False", batch=1, dtype="bfloat16",
                           attn_implementation="sdpa", optimizer="AdamW (foreach) on the LoRA params",
                           lr=args.lr, steps=args.steps, packed=args.packed or 1, seed=args.seed,
                           eager_check=args.eager_check, timeout=args.timeout, budget=args.budget,
                           PYTORCH_CUDA_ALLOC_CONF=env.get("PYTORCH_CUDA_ALLOC_CONF"), tiny=args.tiny),
               started=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])
    try:
        doc["config"]["rope_parameters"] = getattr(config(args, max(args.lengths)), "rope_parameters", None)
    except Exception:  # noqa: BLE001
        pass
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}), flush=True)
    kept = []
    if args.append and os.path.exists(json_path):
        with open(json_path) as f:
            kept = json.load(f).get("rows", [])
        doc["appended_to_rows_of_earlier_runs"] = len(kept)

    jobs = [(S, impl) for S in sorted(args.lengths) for impl in args.impl]
    if args.eager_check:
        at = sum(1 for S, _ in jobs if S <= args.eager_check)
        jobs.insert(at, (args.eager_check, "eager"))
    deadline = time.monotonic() + args.budget if args.budget else None
    passthrough = ["--steps", str(args.steps), "--packed", str(args.packed), "--layers", str(args.layers),
                   "--lr", repr(args.lr), "--seed", str(args.seed)] + (["--tiny"] if args.tiny else [])
    for S, impl in jobs:
        base = dict(impl=impl, S=S, packed=args.packed or 1)
        timeout = args.timeout
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout < 30:
                row = dict(base, skipped=f"--budget {args.budget}s spent")
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
                continue
        extra = []
        if impl == "eager":
            extra = ["--steps", "1", "--grads-dir", grads_dir]
        elif S == args.eager_check:
            extra = ["--save-grads", os.path.join(grads_dir, f"{impl}-{S}.pt")]
        cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{impl},{S}"] + passthrough + extra
        log = os.path.join(logdir, f"lora-{impl}-{S}" + (f"-packed{args.packed}" if args.packed else "") + ".log")
        rc, row, tail, wall = common.run_child(cmd, timeout, log, env=env)
        row = common.finish_row(base, rc, row, tail, timeout)
        row["child_wall_s"] = round(wall, 1)
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
        common.save(json_path, dict(doc, rows=common.merge_rows(kept, doc["rows"], KEY)))
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    doc["rows"] = common.merge_rows(kept, doc["rows"], KEY)
    common.save(json_path, doc)
    for p in glob.glob(os.path.join(grads_dir, "*.pt")):
        os.remove(p)
    os.rmdir(grads_dir)
    png = plot(json_path, png_path)
    print(f"wrote {json_path}" + (f" and {png}" if png else " (no plot: matplotlib not importable)")
          + f"; child logs in {logdir}", flush=True)


def main():
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.replot:
        print(plot(args.replot, os.path.splitext(args.replot)[0] + ".png") or "matplotlib not importable: no plot")
    elif args.one:
        child(args)
    else:
        driver(args, argv)


if __name__ == "__main__":
    main()
