"""Llama-4's chunked attention at long context: fxfuse reads transformers' chunked mask as its recipe (chunk ids
as documents, nothing S x S) where Inductor runs SDPA on the materialised [B, 1, S, S] mask.

Two parts, each impl in its own subprocess (a CUDA fault, an OOM or a hang loses that impl's remaining rows only):

  check   correctness on the GPU, as users call it: a small Llama-4 text model (2 layers: one chunked with RoPE, one
          full without; hidden 512, 8 q / 2 kv heads of 64, chunk 128), bf16, two rows (row 0 left-padded by 37,
          row 1 right-padded by 50), lengths 600 then 900 (static, then the symbolic graph), compiled with
          torch.compile(model, backend="fxfuse"): loss and every parameter gradient against a float64 copy of the
          model run eagerly, beside eager bf16's own distance from it (the standard: fxfuse no further than 2x
          eager's). The report's recipes at the attention sites, and how many graphs were compiled.
  check-plain  the same model on unpadded rows (chunks tile every row: fxfuse::chunked_causal_attention), lengths
          600, 900, 100, 1024, 700 (past, inside and at a multiple of the chunk).
  opcheck fxfuse::chunked_causal_attention alone (cuDNN's path and the SDPA-per-piece path) against float64, beside
          SDPA given the chunked mask in bf16 (child_opcheck).
  layer   one attention layer at the anchors' heads, chunk 8192 (child_layer).
  steps   Llama-4 Scout's widths (hidden 5120, 40 q / 8 kv heads of 128, MLP 16384, vocab 202048, chunk 8192, qk
          norm) with --layers layers (the last one full attention without RoPE, the rest chunked), dense (no MoE),
          bf16 weights, HF gradient checkpointing, batch 1, no padding, labels = ids, forward + backward (no
          optimizer). Impl fxfuse-chunk-ids is fxfuse with the chunks' SDPA dispatch off (MEASURED_CHUNKS emptied:
          chunked layers on fxfuse's kernel over the chunk ids, as before it). One process per impl runs the lengths in --lengths in turn, a new length every batch as a
          trainer gives them (the first compiles a static graph, the second the symbolic one every later length
          reuses): per length the first step (compile included), then --reps timed steps (CUDA events), the peak
          (torch.cuda.max_memory_allocated over the timed steps, reset before them), the loss, graphs compiled so
          far. Impls: fxfuse; fxfuse-mask (fxfuse with its sdpa_attention pass off: the lm-head loss fused, SDPA
          given HF's S x S mask tensor, as before this change); inductor.

Run (device machine, repository root, one H200):
    python3 benchmarks/bench_chunked_attention.py --parts check,layer,steps --lengths 16384,32768,65536,131072
Rows go to $OUT/chunked.jsonl and, with --out, to benchmarks/results/<out>.json with a plot beside it; calls that
split the impls merge with --merge a.json,b.json --out name (no GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
OUT = os.environ.get("OUT", "/tmp")
ROWS = os.path.join(OUT, "chunked.jsonl")


def emit(**row):
    with open(ROWS, "a") as f:
        f.write(json.dumps(row) + "\n")
    print("ROW " + json.dumps(row), flush=True)


def llama4(hidden, heads, kv_heads, head_dim, mlp, vocab, layers, chunk):
    import transformers as tf

    cfg = tf.Llama4TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, intermediate_size_mlp=mlp,
                              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                              head_dim=head_dim, attention_chunk_size=chunk, interleave_moe_layer_step=1,
                              moe_layers=[], no_rope_layers=[1] * (layers - 1) + [0],
                              max_position_embeddings=max(262144, chunk))
    cfg._attn_implementation = "sdpa"
    return tf.Llama4ForCausalLM(cfg)


def recipes():
    import fxfuse

    return sorted({str(r.detail.get("recipe") or f"mask tensor: {r.detail.get('mask_tensor_kept')}")
                   for rep in fxfuse.reports() for r in rep.fused
                   if r.pass_name in ("sdpa_attention", "softcap_attention")})


def kernels():
    import fxfuse

    return sorted({f"{r.detail.get('recipe')}: {r.detail.get('kernel')}" for rep in fxfuse.reports()
                   for r in rep.fused if r.pass_name in ("sdpa_attention", "softcap_attention")})


def graphs_compiled():
    import torch

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


# --------------------------------------------------------------------------------------------------- check
def child_check(layout="padded"):
    """``layout`` "padded" (left and right padding: the chunk ids as documents, fxfuse's kernel) or "plain" (no
    attention mask: chunks tile every row, fxfuse::chunked_causal_attention), lengths crossing the chunk size."""
    import torch

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the same check
    # plain rows: heads of 128, where the chunks' SDPA dispatch was measured (MEASURED_CHUNKS)
    widths = (512, 8, 2, 64) if layout == "padded" else (1024, 8, 2, 128)
    with torch.device(dev):
        model = llama4(*widths, 1024, 1000, 2, 128).to(torch.bfloat16).train()
        ref64 = llama4(*widths, 1024, 1000, 2, 128).double().train()
    ref64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    compiled = torch.compile(model, backend="fxfuse")
    g = torch.Generator(device=dev).manual_seed(1)
    for n in ((600, 900) if layout == "padded" else (600, 900, 100, 1024, 700)):
        ids = torch.randint(0, 1000, (2, n), device=dev, generator=g)
        if layout == "padded":
            am = torch.ones(2, n, dtype=torch.long, device=dev)
            am[0, :37] = 0
            am[1, n - 50:] = 0
            labels = ids.masked_fill(am == 0, -100)
            kw = dict(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
        else:
            kw = dict(input_ids=ids, labels=ids.clone(), use_cache=False)
        res = {}
        for name, m in (("float64", ref64), ("eager_bf16", model), ("fxfuse", compiled)):
            target = ref64 if name == "float64" else model
            target.zero_grad(set_to_none=True)
            loss = m(**kw).loss
            loss.backward()
            res[name] = (loss.detach().double(), {k: p.grad.detach().double() for k, p in target.named_parameters()
                                                  if p.grad is not None})
        l64, g64 = res["float64"]

        def dist(name):
            loss, grads = res[name]
            worst = max(((grads[k] - g64[k]).norm() / g64[k].norm().clamp_min(1e-30)).item() for k in g64)
            return abs((loss - l64).item()), worst, len(grads)

        (le, ge, ne), (lf, gf, nf) = dist("eager_bf16"), dist("fxfuse")
        emit(part="check", layout=layout, kernels=kernels(), length=n, loss_float64=round(l64.item(), 6), loss_err_eager_bf16=le, loss_err_fxfuse=lf,
             grad_worst_rel_err_eager_bf16=ge, grad_worst_rel_err_fxfuse=gf, grads_compared=min(ne, nf),
             within_2x_eager=bool(lf <= 2 * le + 1e-6 and gf <= 2 * ge), recipes=recipes(),
             graphs=graphs_compiled())


# --------------------------------------------------------------------------------------------------- opcheck
def child_opcheck():
    """fxfuse::chunked_causal_attention on the GPU (cuDNN's path and the SDPA-per-piece path) against float64,
    beside SDPA given the chunked bool mask in bf16 (what eager runs): out, dq, dk, dv, relative Frobenius error;
    ragged lengths (past the chunk, one chunk or less, a multiple of it), GQA, head dims 64 and 128, two rows."""
    import torch
    import torch.nn.functional as F

    from fxfuse.attention import chunked

    C = 128
    for D, S, layout, B in [(64, S, "bhsd", 2) for S in (300, 100, 512, 129)] + \
            [(128, S, lay, B) for S in (300, 100, 129) for lay in ("bhsd", "bshd") for B in (1, 2)]:
        g = torch.Generator(device="cuda").manual_seed(S + D)
        if layout == "bshd":  # HF's layout: [B, S, H, D] projections transposed to [B, H, S, D] views
            q, k, v, do = (torch.randn(B, S, h, D, device="cuda", generator=g, dtype=torch.bfloat16)
                           .transpose(1, 2) for h in (8, 2, 2, 8))
        else:
            q, k, v, do = (torch.randn(B, h, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
                           for h in (8, 2, 2, 8))
        t = torch.arange(S, device="cuda")
        keep = (t[:, None] >= t[None, :]) & (t[:, None] // C == t[None, :] // C)

        def grads(fn, dtype):  # (the layout kept: .to() of another dtype preserves strides)
            xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
            out = fn(*xs)
            return [out.detach().double(), *(x.double() for x in torch.autograd.grad(out, xs, do.to(dtype)))]

        def masked(q_, k_, v_):
            return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=keep, enable_gqa=True)

        ref = grads(masked, torch.float64)
        row = dict(part="opcheck", D=D, S=S, chunk=C, layout=layout, B=B)
        for name, env, dtype in (("cudnn", "auto", torch.bfloat16), ("sdpa", "sdpa", torch.bfloat16),
                                 ("eager_bf16_mask", None, torch.bfloat16), ("fp32", "auto", torch.float32),
                                 ("eager_fp32_mask", None, torch.float32)):
            if env is not None:
                os.environ["FXFUSE_CHUNKED_ATTENTION_IMPL"] = env
                row[f"{name}_ran_cudnn"] = chunked.uses_cudnn(q.to(dtype), k.to(dtype), v.to(dtype))
                got = grads(lambda a, b, c: chunked.chunked_causal_attention(a, b, c, C), dtype)
            else:
                got = grads(masked, dtype)
            row[name] = {w: float((a - b).norm() / b.norm()) for w, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
        os.environ.pop("FXFUSE_CHUNKED_ATTENTION_IMPL", None)
        row["within_2x_eager"] = all(row[n][w] <= 2 * row[e][w] + 1e-6
                                     for n, e in (("cudnn", "eager_bf16_mask"), ("sdpa", "eager_bf16_mask"),
                                                  ("fp32", "eager_fp32_mask"))
                                     for w in ("out", "dq", "dk", "dv"))
        emit(**row)


# --------------------------------------------------------------------------------------------------- steps
def child_steps(impl, lengths, layers, reps):
    import torch

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = llama4(5120, 40, 8, 128, 16384, 202048, layers, 8192).to(torch.bfloat16).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if impl == "fxfuse":
        fwd = torch.compile(model, backend="fxfuse")
    elif impl == "fxfuse-chunk-ids":  # fxfuse's kernel on the chunk ids (no SDPA dispatch for chunks)
        from fxfuse.attention import dispatch

        dispatch.MEASURED_CHUNKS.clear()
        fwd = torch.compile(model, backend="fxfuse")
    elif impl == "fxfuse-mask":
        fwd = torch.compile(model, backend="fxfuse", options={"passes": {"sdpa_attention": False}})
    elif impl == "inductor":
        fwd = torch.compile(model)
    else:
        raise SystemExit(f"unknown impl {impl}")
    build_s = time.perf_counter() - t0
    g = torch.Generator(device="cuda").manual_seed(2)
    for S in lengths:
        ids = torch.randint(0, 202048, (1, S), device="cuda", generator=g)
        phase = "first step"
        try:
            def step():
                model.zero_grad(set_to_none=True)
                loss = fwd(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                return loss

            t = time.perf_counter()
            loss = step().item()
            first_s = time.perf_counter() - t
            phase = "timed steps"
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record()
            for _ in range(reps):
                step()
            e1.record()
            torch.cuda.synchronize()
            ms = e0.elapsed_time(e1) / reps
            emit(part="steps", impl=impl, layers=layers, length=S, status="ok", step_ms=round(ms, 1),
                 tokens_per_s=round(S / ms * 1e3), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                 first_step_s=round(first_s, 1), loss=round(loss, 4), graphs=graphs_compiled(),
                 build_s=round(build_s, 1), recipes=recipes() if impl.startswith("fxfuse") else None,
                 kernels=kernels() if impl.startswith("fxfuse") else None)
        except Exception as e:  # noqa: BLE001  (an OOM or a fault is a row; a CUDA fault ends the process)
            oom = isinstance(e, torch.cuda.OutOfMemoryError)
            emit(part="steps", impl=impl, layers=layers, length=S, status="oom" if oom else "error", phase=phase,
                 error=f"{type(e).__name__}: {str(e)[:400]}",
                 peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            if not oom:
                traceback.print_exc()
                return
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------- layer
def child_layer(lengths, chunk=8192):
    """One attention layer at the anchors' heads (../shared/anchors/attn_longctx.py: Hq 32, Hkv 8, D 128, bf16,
    B 1, fwd+bwd, its timing: one call, then the mean of 3 by CUDA events), chunked causal attention: fxfuse's op
    on the chunk ids the recipe builds; SDPA given the materialised chunked bool mask (Inductor's path); cuDNN's
    causal SDPA on the chunks as a batch (exact without padding: the floor). At S = 8 x chunk the anchors'
    flex_docs8 row is the same mask."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fxfuse.attention.chunked import chunked_causal_attention
    from fxfuse.attention.mask_recipe import chunk_document_ids
    from fxfuse.ops import document_ranges, softcap_attention

    Hq, Hkv, D = 32, 8, int(os.environ.get("LAYER_HEAD_DIM", "128"))  # LAYER_HEAD_DIM=64: Hq 32 of 64
    for S in lengths:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        v = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        do = torch.randn(1, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        n = max(1, S // chunk)

        def fx_op():
            ranges = document_ranges(chunk_document_ids(torch.arange(S, device="cuda"), None, 0, 1, chunk))
            return softcap_attention(q, k, v, causal=True, doc_ranges=ranges)

        def masked():
            t = torch.arange(S, device="cuda")
            keep = (t[:, None] >= t[None, :]) & (t[:, None] // chunk == t[None, :] // chunk)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[None, None], enable_gqa=True)

        def chunk_op():
            return chunked_causal_attention(q, k, v, chunk)

        def chunk_op_sdpa():
            os.environ["FXFUSE_CHUNKED_ATTENTION_IMPL"] = "sdpa"
            try:
                return chunked_causal_attention(q, k, v, chunk)
            finally:
                os.environ.pop("FXFUSE_CHUNKED_ATTENTION_IMPL")

        def per_chunk():
            def split(x):
                return x.view(x.shape[1], n, chunk, D).transpose(0, 1)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True, enable_gqa=True)
            return o.transpose(0, 1).reshape(1, Hq, S, D)

        ref = None
        impls = [("fxfuse_chunked_op", chunk_op), ("fxfuse_chunked_op_sdpa_path", chunk_op_sdpa),
                 ("fxfuse_chunk_ids", fx_op)]
        if S % chunk == 0:
            impls.insert(0, ("cudnn_per_chunk", per_chunk))
        if os.environ.get("LAYER_MASKED") == "1":
            impls.append(("sdpa_mask", masked))
        for name, fn in impls:
            try:
                def run(fn=fn):
                    q.grad = k.grad = v.grad = None
                    out = fn()
                    out.backward(do)
                    return out
                out = run().detach()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
                e0.record()
                for _ in range(3):
                    run()
                e1.record()
                torch.cuda.synchronize()
                ms = e0.elapsed_time(e1) / 3
                ref = out if ref is None else ref  # the first impl's output (cuDNN per chunk where it runs)
                emit(part="layer", impl=name, length=S, chunk=chunk, head_dim=D, ms=round(ms, 2),
                     peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                     max_abs_diff_vs_first=float((out.float() - ref.float()).abs().max()))
            except Exception as e:  # noqa: BLE001
                emit(part="layer", impl=name, length=S, chunk=chunk, error=f"{type(e).__name__}: {str(e)[:300]}")
                if not isinstance(e, torch.cuda.OutOfMemoryError):
                    traceback.print_exc()
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------- driver
def run_child(args, timeout):
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, timeout=timeout, capture_output=True,
                           text=True)
    except subprocess.TimeoutExpired as e:  # the rows it emitted stay; the row after them says where it stopped
        emit(part="timeout", args=args, after_s=timeout)
        print(((e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"))[-3000:])
        return "timeout", round(time.perf_counter() - t, 1)
    print((p.stdout + p.stderr)[-3000:], flush=True)
    return p.returncode, round(time.perf_counter() - t, 1)


def versions():
    import platform

    import torch

    v = dict(host=platform.node(), torch=torch.__version__,
             gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    for mod in ("triton", "transformers"):
        v[mod] = __import__(mod).__version__
    return v


def plot(rows, png):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for impl in sorted({r["impl"] for r in rows}):
        ok = [r for r in rows if r["impl"] == impl and r["status"] == "ok"]
        if ok:
            a.plot([r["length"] for r in ok], [r["tokens_per_s"] for r in ok], "o-", label=impl)
            b.plot([r["length"] for r in ok], [r["peak_gib"] for r in ok], "o-", label=impl)
        for r in rows:
            if r["impl"] == impl and r["status"] != "ok":
                b.annotate(f"{impl}: {r['status']}", (r["length"], r.get("peak_gib") or 0), fontsize=7)
    for ax, yl in ((a, "tokens/s"), (b, "peak GiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the row")
        ax.set_ylabel(yl)
        ax.legend(fontsize=8)
    fig.suptitle("Llama-4 Scout widths, chunked attention (chunk 8192), fwd+bwd, checkpointing, one H200", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["check", "check-plain", "opcheck", "steps", "layer"])
    ap.add_argument("--impl", default="fxfuse")
    ap.add_argument("--parts", default="check,steps")
    ap.add_argument("--impls", default="fxfuse,fxfuse-mask,inductor")
    ap.add_argument("--lengths", default="16384,32768,65536,131072")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer-lengths", default="32768,65536")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--out", default="")
    ap.add_argument("--merge", default="", help="a.json,b.json: one document and plot of their rows (no GPU)")
    a = ap.parse_args()
    if a.merge:
        docs = [json.load(open(p)) for p in a.merge.split(",")]
        doc = dict(docs[0], merged=a.merge.split(","), rows=[r for d in docs for r in d["rows"]],
                   commits=[d.get("commit") for d in docs], hosts=[d.get("host") for d in docs])
        base = os.path.join(HERE, "results", a.out)
        with open(base + ".json", "w") as f:
            json.dump(doc, f, indent=1)
        return print(plot([r for r in doc["rows"] if r.get("part") == "steps"], base + ".png"))
    lengths = [int(x) for x in a.lengths.split(",") if x]
    if a.child == "check":
        return child_check()
    if a.child == "check-plain":
        return child_check("plain")
    if a.child == "opcheck":
        return child_opcheck()
    if a.child == "steps":
        return child_steps(a.impl, lengths, a.layers, a.reps)
    if a.child == "layer":
        return child_layer(lengths)
    start = sum(1 for _ in open(ROWS)) if os.path.exists(ROWS) else 0
    runs = []
    parts = a.parts.split(",")
    for part in ("check", "check-plain", "opcheck"):
        if part in parts:
            runs.append((part, run_child(["--child", part], a.timeout)))
    if "layer" in a.parts:
        runs.append(("layer", run_child(["--child", "layer", "--lengths", a.layer_lengths], a.timeout)))
    if "steps" in a.parts:
        for impl in a.impls.split(","):
            rc = run_child(["--child", "steps", "--impl", impl, "--lengths", a.lengths, "--layers", str(a.layers),
                            "--reps", str(a.reps)], a.timeout)
            runs.append((impl, rc))
    rows = [json.loads(x) for x in open(ROWS).read().splitlines()[start:]] if os.path.exists(ROWS) else []
    doc = dict(versions(), commit=os.environ.get("COMMIT", "unknown"), script="benchmarks/bench_chunked_attention.py",
               argv=sys.argv[1:], children=[dict(what=w, returncode=rc, seconds=s) for w, (rc, s) in runs], rows=rows)
    if a.out:
        for folder in (os.path.join(HERE, "results"), OUT):
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, a.out + ".json"), "w") as f:
                json.dump(doc, f, indent=1)
            plot([r for r in rows if r.get("part") == "steps"], os.path.join(folder, a.out + ".png"))
    print(json.dumps(doc["children"]))


if __name__ == "__main__":
    main()
