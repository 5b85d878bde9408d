"""Softcap attention on the GPU: correctness, config sweep, and the side-by-side table of DESIGN.md sec. 5.

Mirrors /work/shared/anchors/anchors_gpu.py sec_attn (cap 50, head_dim 256, 16 q / 8 kv heads, bf16,
B2 S4096 causal and B1 S8192 causal + window 4096, fwd+bwd; eager HF formula, torch.compile of it,
FlexAttention with a softcap score_mod and a block mask, SDPA without softcap) and adds fxfuse's op.
Errors are against an fp32 eager reference (fp32 upcasts of the same inputs).

Sections (argv, default all): check tune table.   Writes $OUT/attention.json; prints a table last.
Run: PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_softcap_attention.py check tune table
Env: BENCH_DEADLINE_S (default 330: later sections are skipped past it), BENCH_CONFIGS (JSON config override
for fxfuse rows: {"fwd": [BM, BN, warps, stages], "dkdv": [...], "dq": [...]}), BENCH_TUNE (JSON: candidate
lists per kernel), BENCH_CASES (comma list of case names), BENCH_CHECK_DTYPES (comma list, e.g. bfloat16).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from _common import bench, rel  # noqa: E402  (same method as the anchors)
import torch.nn.functional as F

from fxfuse.attention import block_map, launching
from fxfuse.attention.backward import attention_bwd_triton
from fxfuse.attention.forward import attention_fwd_triton
from fxfuse.attention.op import softcap_attention
from fxfuse.attention.reference import attention_reference

T0 = time.time()
OUT = os.environ.get("OUT", "/tmp")
DEADLINE = float(os.environ.get("BENCH_DEADLINE_S", "330"))
DEV = "cuda"
ROWS = []
CFG = {k: tuple(v) for k, v in json.loads(os.environ.get("BENCH_CONFIGS", "{}")).items()} or None


def emit(**row):
    row["t"] = round(time.time() - T0, 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    save()


def save():
    import triton
    meta = dict(torch=torch.__version__, triton=triton.__version__,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                argv=sys.argv[1:], configs=CFG, defaults={str(k): v for k, v in launching.DEFAULT_CONFIGS.items()})
    with open(os.path.join(OUT, "attention.json"), "w") as f:
        json.dump(dict(meta=meta, rows=ROWS), f, indent=1)


def late():
    return time.time() - T0 > DEADLINE


# ------------------------------------------------------------------------------------------------ check
def sec_check():
    """Triton kernels vs the float64 reference on small shapes, fresh random inputs every case."""
    cases = [  # B, Hq, Hkv, S, Skv, Dh, cap, causal, win, mask, dtype
        (2, 16, 8, 1000, 1000, 256, 50.0, True, 0, None, torch.bfloat16),
        (1, 16, 8, 1500, 1500, 256, 50.0, True, 300, None, torch.bfloat16),
        (2, 8, 2, 777, 777, 128, 30.0, True, 0, "additive", torch.bfloat16),
        (2, 4, 1, 513, 513, 64, 0.0, False, 0, "bool", torch.float16),
        (1, 4, 2, 300, 300, 256, 50.0, True, 64, None, torch.float32),
        (1, 4, 2, 257, 257, 96, 50.0, True, 0, "additive", torch.float32),
        (1, 4, 4, 200, 333, 128, 50.0, True, 0, None, torch.bfloat16),
        # mask tensors alone (what the graph pass hands over): block ranges from the mask
        (2, 16, 8, 1000, 1000, 256, 50.0, False, 0, "hf-causal-padded", torch.bfloat16),
        (1, 8, 4, 1500, 1500, 256, 50.0, False, 0, "hf-window-300-bool", torch.bfloat16),
        (2, 4, 2, 333, 333, 128, 30.0, False, 0, "hf-causal-padded", torch.float32),
    ]
    if os.environ.get("BENCH_CHECK_DTYPES"):  # e.g. "bfloat16,float16": skip the slow fp32 cases
        cases = [c for c in cases if str(c[-1])[6:] in os.environ["BENCH_CHECK_DTYPES"].split(",")]
    for B, Hq, Hkv, S, Skv, Dh, cap, causal, win, mk, dt in cases:
        g = torch.Generator(device=DEV).manual_seed(int(time.time() * 1e6) % 2**31)
        q = torch.randn(B, Hq, S, Dh, device=DEV, generator=g).to(dt)
        k = torch.randn(B, Hkv, Skv, Dh, device=DEV, generator=g).to(dt)
        v = torch.randn(B, Hkv, Skv, Dh, device=DEV, generator=g).to(dt)
        do = torch.randn(B, Hq, S, Dh, device=DEV, generator=g).to(dt)
        mask = None
        if mk == "additive":
            mask = torch.randn(B, 1, S, Skv, device=DEV, generator=g)
            mask[0, :, :, :50] = torch.finfo(torch.float32).min
            mask[-1, :, 7] = float("-inf")
            mask = mask.to(dt)
        elif mk == "bool":
            mask = torch.rand(B, Hq, S, Skv, device=DEV, generator=g) > 0.2
            mask[:, :, 3] = False
        elif mk and mk.startswith("hf-"):  # HF-style [B, 1, S, S]: causal (+ window), key padding
            qi, ki = torch.arange(S, device=DEV)[:, None], torch.arange(Skv, device=DEV)[None, :]
            keep = ki <= qi
            if "window" in mk:
                keep = keep & (qi - ki < int(mk.split("-")[2]))
            keep = keep[None, None].expand(B, 1, S, Skv).clone()
            keep[0, :, :, :37] = False  # left padding (its first 37 query rows are fully masked)
            keep[-1, :, :, Skv - 100:] = False  # right padding
            mask = keep if mk.endswith("bool") else torch.zeros(B, 1, S, Skv, device=DEV, dtype=dt).masked_fill(
                ~keep, torch.finfo(dt).min)
        sc = Dh ** -0.5
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        ref = attention_reference(qd, kd, vd, mask, sc, cap, causal, win)
        ref.backward(do.double())
        try:
            out, lse = attention_fwd_triton(q, k, v, mask, sc, cap, causal, win, config=CFG)
            dq, dk, dv = attention_bwd_triton(do, q, k, v, mask, out, lse, sc, cap, causal, win, config=CFG)
            torch.cuda.synchronize()
            finite = all(bool(torch.isfinite(t).all()) for t in (out, dq, dk, dv))
            emit(section="check", case=f"B{B} H{Hq}/{Hkv} S{S} Skv{Skv} D{Dh} cap{cap} causal{int(causal)} "
                                       f"win{win} mask={mk} {str(dt)[6:]}",
                 finite=finite, out_rel=rel(out, ref), dq_rel=rel(dq, qd.grad), dk_rel=rel(dk, kd.grad),
                 dv_rel=rel(dv, vd.grad))
        except Exception as e:
            emit(section="check", case=str((B, Hq, Hkv, S, Dh, mk, str(dt))), error=f"{type(e).__name__}: {e}"[:400])
            traceback.print_exc()
        del qd, kd, vd, ref
    # the public function under torch.compile(inductor, dynamic) on CUDA, two lengths
    try:
        torch._dynamo.reset()
        cf = torch.compile(lambda q, k, v: softcap_attention(q, k, v, softcap=50.0, causal=True, window=100),
                           dynamic=True)
        for S in (384, 520):
            q, k, v = (torch.randn(1, 8, S, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            o = cf(q, k, v)
            o.backward(torch.ones_like(o))
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref = attention_reference(qd, kd, vd, None, 128 ** -0.5, 50.0, True, 100)
            ref.backward(torch.ones_like(ref))
            emit(section="check", case=f"torch.compile inductor dynamic S{S}", out_rel=rel(o, ref),
                 dq_rel=rel(q.grad, qd.grad), dk_rel=rel(k.grad, kd.grad))
    except Exception as e:
        emit(section="check", case="torch.compile inductor", error=f"{type(e).__name__}: {e}"[:400])
        traceback.print_exc()


# ------------------------------------------------------------------------------------------------ cases
CASES = [("gemma2-9b causal S4k", 2, 16, 8, 4096, 256, 50.0, None),
         ("gemma2-9b causal S8k win4k", 1, 16, 8, 8192, 256, 50.0, 4096)]
if os.environ.get("BENCH_CASES"):
    CASES = [c for c in CASES if any(n in c[0] for n in os.environ["BENCH_CASES"].split(","))]


def make(B, Hq, Hkv, S, Dh, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(B, Hq, S, Dh, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, S, Dh, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, S, Dh, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, Hq, S, Dh, device=DEV, dtype=torch.bfloat16)
    return q, k, v, do


# ------------------------------------------------------------------------------------------------- tune
TUNE = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages[, split dK/dV])
    "fwd": [(128, 32, 8, 2), (64, 32, 8, 2), (128, 64, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 3)],
    "dkdv": [(32, 64, 8, 2, 1), (32, 64, 8, 2), (64, 64, 8, 2, 1), (16, 64, 8, 2), (32, 128, 8, 2, 1),
             (16, 32, 4, 2)],
    "dq": [(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 64, 8, 2), (64, 32, 4, 3)],
}
BEST = {}  # case name -> best config found by sec_tune in this process (used by sec_table)
if os.environ.get("BENCH_TUNE"):
    TUNE = {k: [tuple(c) for c in v] for k, v in json.loads(os.environ["BENCH_TUNE"]).items()}


def sec_tune():
    """Time each kernel's candidate configs on the benchmark shapes (fwd alone; bwd = pre + dkdv + dq)."""
    import triton.testing
    only = os.environ.get("BENCH_TUNE_CASES", "S4k").split(",")
    for name, B, Hq, Hkv, S, Dh, cap, win in CASES:
        if not any(o in name for o in only):
            continue
        q, k, v, do = make(B, Hq, Hkv, S, Dh)
        q, k, v = q.detach(), k.detach(), v.detach()
        sc = Dh ** -0.5
        out, lse = attention_fwd_triton(q, k, v, None, sc, cap, True, win or 0)
        best = {}
        for kind in TUNE:  # in the order given (later kernels are timed with the earlier ones' best)
            results = []
            for c in TUNE.get(kind, []):
                if late():
                    break
                cfg = dict(best)
                cfg[kind] = c
                try:
                    if kind == "fwd":
                        fn = lambda: attention_fwd_triton(q, k, v, None, sc, cap, True, win or 0, config=cfg)
                    else:
                        fn = lambda: attention_bwd_triton(do, q, k, v, None, out, lse, sc, cap, True, win or 0,
                                                          config=cfg)
                    fn()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    results.append((ms, c))
                    emit(section="tune", shape=name, kernel=kind, config=list(c), ms=round(ms, 3))
                except Exception as e:
                    emit(section="tune", shape=name, kernel=kind, config=list(c),
                         error=f"{type(e).__name__}: {str(e)[:200]}")
            if results:
                best[kind] = min(results)[1]
        BEST[name] = dict(best)
        emit(section="tune", shape=name, best={k: list(v) for k, v in best.items()})
        del q, k, v, do, out, lse
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ table
class _Fn(torch.autograd.Function):
    """The op's forward/backward launchers with an explicit config (the public op uses DEFAULT_CONFIGS)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling, softcap, causal, window, cfg):
        out, lse = attention_fwd_triton(q, k, v, mask, scaling, softcap, causal, window, config=cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.a = (mask, scaling, softcap, causal, window, cfg)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        mask, scaling, softcap, causal, window, cfg = ctx.a
        dq, dk, dv = attention_bwd_triton(do, q, k, v, mask, out, lse, scaling, softcap, causal, window,
                                          config=cfg)
        return dq, dk, dv, None, None, None, None, None, None


def K_op(q, k, v, mask, scaling, softcap, causal, window, cfg):
    if not cfg:  # the public function, exactly as users / the graph pass call it
        return softcap_attention(q, k, v, mask=mask, scaling=scaling, softcap=softcap, causal=causal,
                                 window=window)
    return _Fn.apply(q, k, v, mask, scaling, softcap, causal, window, cfg)


def sec_table():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    for name, B, Hq, Hkv, S, Dh, cap, win in CASES:
        if late():
            emit(section="attn", shape=name, skipped="deadline")
            continue
        q, k, v, do = make(B, Hq, Hkv, S, Dh)
        scale = Dh ** -0.5
        qi = torch.arange(S, device=DEV)[:, None]
        ki = torch.arange(S, device=DEV)[None, :]
        allowed = ki <= qi
        if win is not None:
            allowed = allowed & (qi - ki < win)
        fmask = torch.zeros(S, S, device=DEV, dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))
        kept = allowed.float().mean().item()
        flops = 4 * B * Hq * S * S * Dh * kept * 3.5
        del qi, ki, allowed

        def eager(q, k, v):  # the Gemma-2 eager path, as transformers writes it
            rep = Hq // Hkv
            kk = k.repeat_interleave(rep, 1)
            vv = v.repeat_interleave(rep, 1)
            s = torch.matmul(q, kk.transpose(2, 3)) * scale
            s = torch.tanh(s / cap) * cap
            s = s + fmask
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(p, vv)

        # fp32 reference (fp32 upcasts of the same bf16 inputs), out and grads
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        of = eager(qf, kf, vf)
        of.backward(do.float())
        ref = (of.detach(), qf.grad, kf.grad, vf.grad)
        del qf, kf, vf, of
        torch.cuda.empty_cache()

        def mod(score, b, h, qi_, ki_):
            return cap * torch.tanh(score / cap)

        def mask_mod(b, h, qi_, ki_):
            ok = qi_ >= ki_
            if win is not None:
                ok = ok & (qi_ - ki_ < win)
            return ok

        cfg = CFG or BEST.get(name) or next(iter(BEST.values()), None)
        impls = {
            "fxfuse softcap_attention": lambda q, k, v: K_op(q, k, v, None, scale, cap, True, win or 0, cfg),
            "fxfuse (mask tensor, no index mask)": lambda q, k, v: K_op(q, k, v, fmask, scale, cap, False, 0, cfg),
            "fxfuse (mask tensor, every block)": lambda q, k, v: K_op(q, k, v, fmask, scale, cap, False, 0, cfg),
            "fxfuse (exact tanh)": lambda q, k, v: K_op(q, k, v, None, scale, cap, True, win or 0, cfg),
            "fxfuse (head-major grid)": lambda q, k, v: K_op(q, k, v, None, scale, cap, True, win or 0, cfg),
            "eager (HF Gemma2 eager)": eager,
            "inductor(eager)": torch.compile(eager),
        }
        if win is None:
            impls["sdpa causal, NO softcap (reference)"] = lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True, scale=scale)
        bm = create_block_mask(mask_mod, None, None, S, S, device=DEV)
        cflex = torch.compile(flex_attention)
        impls["flex_attention softcap"] = lambda q, k, v: cflex(q, k, v, score_mod=mod, block_mask=bm,
                                                                 enable_gqa=True, scale=scale)
        if os.environ.get("BENCH_IMPLS"):
            impls = {k: v for k, v in impls.items() if any(w in k for w in os.environ["BENCH_IMPLS"].split(","))}
        for iname, fn in impls.items():
            if late():
                emit(section="attn", shape=name, impl=iname, skipped="deadline")
                continue

            def step():
                q.grad = k.grad = v.grad = None
                block_map.MASK_BLOCK_RANGES = "every block" not in iname  # the mask read in every block, as before
                launching.FAST_TANH = "exact tanh" not in iname  # tanh from exp2 (two MUFU ops) instead of tanh.approx
                launching.BLOCK_MAJOR_GRID = "head-major" not in iname  # grid (blocks, heads): per-head heaviest-first
                o = fn(q, k, v)
                o.backward(do)
                block_map.MASK_BLOCK_RANGES = launching.FAST_TANH = launching.BLOCK_MAJOR_GRID = True
                return o
            try:
                o = step()
                errs = dict(out_rel=rel(o, ref[0]), dq_rel=rel(q.grad, ref[1]), dk_rel=rel(k.grad, ref[2]),
                            dv_rel=rel(v.grad, ref[3]))
                del o
                ms, mem = bench(step)
                fwd_ms = None
                if iname.startswith("fxfuse softcap"):
                    with torch.no_grad():
                        import triton.testing
                        fwd_ms = round(triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100,
                                                               return_mode="median"), 3)
                emit(section="attn", shape=name, impl=iname, ms=round(ms, 3), fwd_ms=fwd_ms,
                     config={k: list(v) for k, v in cfg.items()} if (cfg and "fxfuse" in iname) else None,
                     peak_gib=round(mem, 3), tflops=round(flops / ms / 1e9, 1), **errs)
            except Exception as e:
                emit(section="attn", shape=name, impl=iname, error=f"{type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc()
            torch.cuda.empty_cache()
        del q, k, v, do, impls, ref, fmask
        torch.cuda.empty_cache()


def table():
    print("\n| shape | impl | ms | fwd ms | peak GiB | TFLOP/s | out_rel | dq_rel | dk_rel | dv_rel |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in ROWS:
        if r["section"] == "attn" and "ms" in r:
            print(f"| {r['shape']} | {r['impl']} | {r['ms']} | {r.get('fwd_ms') or ''} | {r['peak_gib']} | "
                  f"{r['tflops']} | {r['out_rel']} | {r['dq_rel']} | {r['dk_rel']} | {r['dv_rel']} |")
    for r in ROWS:
        if r["section"] == "check":
            print("check", {k: v for k, v in r.items() if k not in ("section", "t")})
        if r["section"] == "tune" and "best" in r:
            print("tune best", r["shape"], r["best"])


if __name__ == "__main__":
    secs = sys.argv[1:] or ["check", "tune", "table"]
    import triton
    print(dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name()), flush=True)
    for s in secs:
        if late():
            emit(section=s, skipped="deadline")
            continue
        try:
            {"check": sec_check, "tune": sec_tune, "table": sec_table}[s]()
        except Exception as e:
            emit(section=s, error=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
    table()
