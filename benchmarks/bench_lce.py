"""Fused linear + cross-entropy on the GPU: correctness vs an fp32 reference, then fwd+bwd time and extra peak
memory, side by side with the cuBLAS 3-matmul floor, eager, inductor, Liger and CCE.

The setup and the measurement mirror /work/shared/anchors/anchors_gpu.py ``sec_lce`` exactly (same seed, inputs,
``y[::7] = -100``, same ``bench``: do_bench median after warm-up, peak = max_allocated - allocated before one
call, with the previous call's grads still held), so the numbers compare with DESIGN.md sec. 5.

Run (device machine):  PYTHONPATH=. python3 benchmarks/bench_lce.py [llama3-8b gemma2-2b] [--quick]
Writes $OUT/bench_lce.json (machine, versions, rows) and prints a table.
On CPU it runs a tiny smoke version (no timings that mean anything).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import torch

from _common import bench, rel  # noqa: E402  (same method as the anchors)
import torch.nn.functional as F

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
try:  # the package's __init__ pulls in the backend and passes; this benchmark needs only the op
    import fxfuse  # noqa: F401
except Exception as _e:  # work in progress elsewhere must not stop the kernel benchmark
    import types
    print(f"note: 'import fxfuse' failed ({_e!r}); loading fxfuse.ops/kernels without the package __init__")
    _pkg = types.ModuleType("fxfuse")
    _pkg.__path__ = [os.path.join(_ROOT, "fxfuse")]
    sys.modules["fxfuse"] = _pkg
from fxfuse.kernels import linear_cross_entropy as K  # noqa: E402
from fxfuse.kernels import lm_head_rows  # noqa: E402
from fxfuse.kernels.triton_support import use_triton  # noqa: E402
from fxfuse.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMOKE = DEV == "cpu"
ROWS = []


def emit(**row):
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def env_row():
    import triton
    info = dict(section="env", torch=torch.__version__, triton=triton.__version__, dev=DEV)
    if DEV == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        n = 8192
        a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16); b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
        ms, _ = bench(lambda: a @ b)
        info["bf16_mm_tflops"] = round(2 * n**3 / ms / 1e9, 1)
    emit(**info)


def sec_lce(names, quick=False):
    shapes = [("llama3-8b", 8192, 4096, 128256, None), ("gemma2-2b", 8192, 2304, 256000, 30.0)]
    shapes = [s for s in shapes if s[0] in names]
    if SMOKE:
        shapes = [("tiny", 256, 64, 1000, None), ("tiny-softcap", 256, 64, 1000, 30.0)]
    for name, N, D, V, cap in shapes:
        torch.manual_seed(0)
        h = (torch.randn(N, D, device=DEV, dtype=torch.bfloat16) * 0.5).requires_grad_()
        W = (torch.randn(V, D, device=DEV, dtype=torch.bfloat16) / math.sqrt(D)).requires_grad_()
        y = torch.randint(0, V, (N,), device=DEV)
        y[::7] = -100
        flops = 6 * N * D * V

        def eager_loss(h, W, y):
            logits = (h @ W.t()).float()
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
            return F.cross_entropy(logits, y, ignore_index=-100)

        # fp32 reference on the GPU (true fp32 matmuls: TF32 is off for matmul by default)
        hr = h.detach().float().requires_grad_(); Wr = W.detach().float().requires_grad_()
        lr = eager_loss(hr, Wr, y); lr.backward()
        ref32 = (lr.item(), hr.grad, Wr.grad)
        del lr, hr, Wr
        torch.cuda.empty_cache() if DEV == "cuda" else None

        def fx(**kw):
            return lambda h, W, y: linear_cross_entropy(h, W, y, softcap=cap, **kw)

        impls = {"eager": eager_loss}
        if not quick:
            impls["inductor"] = torch.compile(eager_loss)
        impls["fxfuse (256 MiB chunks)"] = fx()
        impls["fxfuse (512 MiB chunks)"] = fx(chunk_bytes=512 << 20)
        impls["fxfuse (1 GiB chunks)"] = fx(chunk_bytes=1 << 30)
        impls["fxfuse (16 MiB, min-memory)"] = fx(chunk_bytes=K.MIN_MEMORY_CHUNK_BYTES)
        impls["fxfuse recompute (grad_in_forward=False)"] = fx(grad_in_forward=False)
        impls["fxfuse fp32 gW accum (256 MiB chunks)"] = "fp32acc"
        if cap:
            impls["fxfuse fast tanh (256 MiB chunks)"] = "fasttanh"
        if not quick:
            impls["fxfuse under torch.compile"] = torch.compile(fx())
        if not SMOKE and not quick:
            try:
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
                lig = LigerFusedLinearCrossEntropyLoss(softcap=cap)
                impls["liger"] = lambda h, W, y: lig(W, h, y)
            except Exception as e:
                emit(section="lce", shape=name, impl="liger", error=repr(e)[:300])
            try:
                from cut_cross_entropy import linear_cross_entropy as cce_lce
                impls["cce"] = lambda h, W, y: cce_lce(h, W, y, softcap=cap)
            except Exception as e:
                emit(section="lce", shape=name, impl="cce", error=repr(e)[:300])

        def matmul_floor():
            logits = h @ W.t()
            logits.backward(torch.ones_like(logits))

        ms, mem = bench(lambda: (h.grad, W.grad, matmul_floor(), setattr(h, "grad", None), setattr(W, "grad", None)))
        floor_ms = ms
        emit(section="lce", shape=name, impl="3-matmul floor (cuBLAS)", ms=round(ms, 3), peak_gib=round(mem, 3),
             tflops=round(flops / ms / 1e9, 1))

        # The same floor with a random upstream grad: the anchor's floor backpropagates ones, and cuBLAS runs
        # faster on constant data (METHOD.md); a real dlogits is not constant.
        gr = (torch.randn(N, V, device=DEV) * 1e-4).to(torch.bfloat16) if not SMOKE else torch.randn(N, V, dtype=torch.bfloat16)

        def matmul_floor_rand():
            logits = h @ W.t()
            logits.backward(gr)
        ms, mem = bench(lambda: (matmul_floor_rand(), setattr(h, "grad", None), setattr(W, "grad", None)))
        emit(section="lce", shape=name, impl="3-matmul floor, random upstream grad", ms=round(ms, 3),
             peak_gib=round(mem, 3), tflops=round(flops / ms / 1e9, 1), x_floor=round(ms / floor_ms, 3))
        del gr

        # the chunked cuBLAS work alone (row kernel replaced by nothing): what chunking costs the matmuls
        for cb in (256 << 20, K.MIN_MEMORY_CHUNK_BYTES):
            def chunk_mm_only(cb=cb):
                with torch.no_grad():
                    return lm_head_rows.chunk_loop(h.detach(), W.detach(), None, lambda b, s, e: None, True, True,
                                                   False, cb, True)
            ms, mem = bench(chunk_mm_only)
            emit(section="lce", shape=name, impl=f"chunked cuBLAS only ({cb >> 20} MiB)", ms=round(ms, 3),
                 peak_gib=round(mem, 3), x_floor=round(ms / floor_ms, 3))

        # the row kernel alone on one default chunk
        C = lm_head_rows.rows_per_chunk(V, 2, lm_head_rows.DEFAULT_CHUNK_BYTES, N)
        buf = (torch.randn(C, V, device=DEV) * 2).to(torch.bfloat16)
        lrow = torch.empty(C, device=DEV); lse = torch.empty(2, C, device=DEV)  # row max, log S
        g1 = torch.ones((), device=DEV)
        rows = K._rows_triton if use_triton(buf, K.FORCE_TRITON) else K._rows_torch
        ms, _ = bench(lambda: rows(buf, y[:C], g1, lrow, lse, None, -100, 1.0, cap or 0.0, 0.0, True))
        gbs = 3 * C * V * 2 / ms / 1e6
        emit(section="lce", shape=name, impl=f"row kernel alone (C={C})", ms=round(ms, 4), gb_s=round(gbs, 1),
             per_step_ms=round(ms * N / C, 3))
        del buf

        ref = None
        for iname, fn in impls.items():
            prev_acc, prev_cfg = lm_head_rows.FP32_ACCUM_MAX_BYTES, dict(K.ROW_CONFIG)
            if fn == "fp32acc":
                lm_head_rows.FP32_ACCUM_MAX_BYTES = 1 << 40
                fn = fx()
            elif fn == "fasttanh":
                K.ROW_CONFIG["FAST_TANH"] = True
                fn = fx()

            def step():
                h.grad = None; W.grad = None
                loss = fn(h, W, y)
                loss.backward()
                return loss

            def run():
                loss = step()
                return (loss.detach().float().item(), h.grad.float(), W.grad.float())

            try:
                loss, gh, gW = run()
                if ref is None:
                    ref = (loss, gh, gW)
                err = dict(loss_rel=abs(loss - ref[0]) / abs(ref[0]), gh_rel=rel(gh, ref[1]), gW_rel=rel(gW, ref[2]),
                           loss_rel32=abs(loss - ref32[0]) / abs(ref32[0]), gh_rel32=rel(gh, ref32[1]),
                           gW_rel32=rel(gW, ref32[2]))
                del gh, gW
                ms, mem = bench(step)
                emit(section="lce", shape=name, impl=iname, ms=round(ms, 3), peak_gib=round(mem, 4),
                     tflops=round(flops / ms / 1e9, 1), x_floor=round(ms / floor_ms, 3),
                     **{k: float(f"{v:.2e}") for k, v in err.items()})
            except Exception as e:
                emit(section="lce", shape=name, impl=iname, error=f"{type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc()
            finally:
                lm_head_rows.FP32_ACCUM_MAX_BYTES = prev_acc
                K.ROW_CONFIG.clear(); K.ROW_CONFIG.update(prev_cfg)
        del h, W, y, impls, ref32
        if DEV == "cuda":
            torch.cuda.empty_cache()


def sec_tune(names):
    """Where the time goes: the chunked matmuls one by one per chunk size, and row-kernel launch settings."""
    import triton.testing
    shapes = [("llama3-8b", 8192, 4096, 128256, None), ("gemma2-2b", 8192, 2304, 256000, 30.0)]
    for name, N, D, V, cap in [s for s in shapes if s[0] in names]:
        torch.manual_seed(0)
        W = torch.randn(V, D, device=DEV, dtype=torch.bfloat16) / math.sqrt(D)
        h = torch.randn(N, D, device=DEV, dtype=torch.bfloat16) * 0.5
        y = torch.randint(0, V, (N,), device=DEV)
        gW = torch.empty_like(W)
        t = lambda f: triton.testing.do_bench(f, warmup=20, rep=150, return_mode="median")  # noqa: E731
        # the per-chunk matmul sweep (results in lce_notes.md) only when asked: LCE_TUNE_MATMULS=1
        for C in ((512, 1024, 2048, 4096, 8192) if os.environ.get("LCE_TUNE_MATMULS") == "1" else ()):
            buf = (torch.randn(C, V, device=DEV) * 0.01).to(torch.bfloat16)
            hc = h[:C]
            ghc = torch.empty(C, D, device=DEV, dtype=torch.bfloat16)
            r = dict(section="tune", shape=name, C=C)
            r["logits_ms"] = t(lambda: torch.mm(hc, W.t(), out=buf)) * N / C
            r["gh_ms"] = t(lambda: torch.mm(buf, W, out=ghc)) * N / C
            r["gw_mm_ms"] = t(lambda: torch.mm(buf.t(), hc, out=gW)) * N / C
            r["gw_addmm_ms"] = t(lambda: gW.addmm_(buf.t(), hc)) * N / C
            r["sum_ms"] = r["logits_ms"] + r["gh_ms"] + r["gw_addmm_ms"]
            emit(**{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
            del buf
        C = lm_head_rows.rows_per_chunk(V, 2, lm_head_rows.DEFAULT_CHUNK_BYTES, N)
        buf0 = (torch.randn(C, V, device=DEV) * 2).to(torch.bfloat16)
        buf = buf0.clone()
        lrow = torch.empty(C, device=DEV); lse = torch.empty(2, C, device=DEV); g1 = torch.ones((), device=DEV)
        # Launch settings around the defaults (BLOCK_V 4096, 16 warps, per-lane max, fast tanh). (A grid of fewer
        # programs than rows, rows strided over them so that pass 2 might hit L2, measured no faster: run 4.)
        configs = [dict(), dict(num_warps=8), dict(BLOCK_V=2048, num_warps=8), dict(BLOCK_V=8192)]
        for extra in configs:
            cfg = {**K._ROW_DEFAULTS, **extra}
            K.ROW_CONFIG.clear(); K.ROW_CONFIG.update(cfg)
            try:
                ms = t(lambda: K._rows_triton(buf, y[:C], g1, lrow, lse, None, -100, 1.0, cap or 0.0, 0.0, True))
                emit(section="tune_rows", shape=name, C=C, BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"],
                     fast_tanh=cfg["FAST_TANH"],
                     ms=round(ms, 4), per_step_ms=round(ms * N / C, 3), gb_s=round(3 * C * V * 2 / ms / 1e6, 1))
            except Exception as e:
                emit(section="tune_rows", shape=name, config=str(cfg), error=repr(e)[:200])
        K.ROW_CONFIG.clear()
        del W, h, gW, buf, buf0
        torch.cuda.empty_cache()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    quick = "--quick" in sys.argv
    env_row()
    if "--tune" in sys.argv:
        sec_tune(args or ["llama3-8b", "gemma2-2b"])
    sec_lce(args or ["llama3-8b", "gemma2-2b"], quick=quick)
    with open(os.path.join(OUT, "bench_lce.json"), "w") as f:
        json.dump({"rows": ROWS}, f, indent=1)
    print("\n==== summary")
    for shp in ("llama3-8b", "gemma2-2b"):
        tr = sorted((r for r in ROWS if r.get("section") == "tune_rows" and r.get("shape") == shp and "ms" in r),
                    key=lambda r: r["ms"])
        for r in tr[:4]:
            print("best rows", shp, {k: r[k] for k in ("BLOCK_V", "num_warps", "fast_tanh", "ms", "per_step_ms", "gb_s")})
    keys = ["C", "logits_ms", "gh_ms", "gw_mm_ms", "gw_addmm_ms", "sum_ms", "BLOCK_V", "num_warps", "fast_tanh",
            "ms", "x_floor", "peak_gib", "tflops", "gh_rel32", "gW_rel32", "loss_rel32", "gh_rel", "gW_rel", "gb_s",
            "per_step_ms", "error"]
    for r in ROWS:
        if r.get("section") == "env":
            print(" | ".join(f"{k}={v}" for k, v in r.items() if k != "section"))
            continue
        if r.get("section") == "tune_rows" and "error" not in r:
            continue  # many rows: see the JSON; the best is printed below
        print(f"{r.get('shape', ''):10s} {r.get('impl', ''):44s} " +
              " ".join(f"{k}={r[k]}" for k in keys if k in r))
