"""Long-context attention, one layer at Llama-3.1-8B heads (Hq 32, Hkv 8, head dim 128), bf16, batch 1, fwd+bwd,
at 32k..128k tokens, for two mask layouts, every (impl, layout, length) in its own subprocess (a CUDA fault or a
hang loses that row only).

Layouts
  causal  one document over the whole row
  docs8   8 equal packed documents in the row, causal within each (TFLOP/s counted on 1/8 of the causal work)

Impls (a row is skipped, with the reason, where an impl does not apply to a layout)
  sdpa_cudnn          F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) under sdpa_kernel([CUDNN])  causal
  sdpa_flash          the same under sdpa_kernel([FLASH_ATTENTION])                                               causal
  flex                FlexAttention, BlockMask from create_block_mask(mask_mod, None, None, S, S, device,
                      _compile=True) (build timed apart: block_mask_s first build, block_mask_warm_s a second one),
                      flex_attention compiled with torch.compile(dynamic=False); docs8 mask_mod:
                      (q >= k) & (doc_ids[q] == doc_ids[k])                                                both
  fxfuse              torch.ops.fxfuse.softcap_attention(q, k, v, None, scale, 0.0, True, 0, 0, doc_ranges, None),
                      doc_ranges = fxfuse.ops.document_ranges(doc_ids) for docs8 (built once,
                      timed apart: doc_ranges_ms), None for causal                                           both
  fxfuse_dispatch     the public fxfuse.ops.softcap_attention (kernel="auto"): the kernel fxfuse picks for the
                      recipe (fxfuse.attention.dispatch; the row's "kernel" says which and why)            both
  fxfuse_mask         the op given a bool [1, 1, S, S] mask tensor, causal=False (the old path)   docs8, S <= --mask-max
  sdpa_cudnn_perdoc   cuDNN SDPA is_causal on the 8 documents as a batch of 8 (views of q, k, v; the floor
                      for 8 equal documents, what a varlen kernel can at best do)                            docs8
  varlen              torch.nn.attention.varlen.varlen_attn with cu_seqlens (if this torch has it)          docs8

Per row: ms (fwd+bwd, CUDA events over --reps calls after --warmup calls), fwd_ms (forward alone, autograd on),
first_call_s (includes compiling), peak_gib (torch.cuda.max_memory_allocated over the timed calls, after a reset;
inputs, outputs and grads included) and peak_extra_gib (minus what was allocated before), tflops
(4*S*S*D*Hq/2 * 3.5, / 8 for docs8). At S <= --check-max each row also holds max |impl - ref| of out, dq, dk, dv,
ref = SDPA flash is_causal (per document for docs8; SDPA math on CPU), computed once after timing.

Run (device machine, repository root, one H200; 25 rows, ~8-11 min in all (each child pays ~10 s of start-up, a
flex child ~30-60 s of compiling): one device call per layout, ~4-6 min each, then merge:
    python3 benchmarks/bench_longctx_attention.py --layouts causal --out longctx-attention-h200-causal.json --budget 560
    python3 benchmarks/bench_longctx_attention.py --layouts docs8 --out longctx-attention-h200-docs8.json --budget 560
    python3 benchmarks/bench_longctx_attention.py --merge benchmarks/results/longctx-attention-h200-causal.json,\
benchmarks/results/longctx-attention-h200-docs8.json        (-> longctx-attention-h200.json and .png; no GPU)
Rows go to benchmarks/results/<--out> (default longctx-attention-h200.json) and $OUT/<--out>; the plot beside
them (.png, if matplotlib imports); child logs to $OUT/logs. --tiny: CPU smoke at 256 tokens (~1.5 min: CUDA-only
SDPA impls on SDPA's math backend, flex forward-only since FlexAttention has no CPU backward, varlen skipped).
--replot FILE.json redraws a plot. A child alone:
    python3 benchmarks/bench_longctx_attention.py --one fxfuse,docs8,32768
"""
import argparse
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # fxfuse from the source tree

Hq, Hkv, D = 32, 8, 128
N_DOCS = 8
LAYOUTS = ("causal", "docs8")
IMPLS = ("sdpa_cudnn", "sdpa_flash", "flex", "fxfuse", "fxfuse_dispatch", "fxfuse_mask", "sdpa_cudnn_perdoc",
         "varlen")
ROW_TAG = "@@ROW "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default=None, help="comma list (default 32768,65536,131072; --tiny 256)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 3; --tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first, >= 1 (default 2; --tiny 1)")
    p.add_argument("--check-max", type=int, default=32768, help="correctness check at S <= this (0 = never)")
    p.add_argument("--mask-max", type=int, default=32768, help="fxfuse_mask only at S <= this")
    p.add_argument("--timeout", type=float, default=300, help="seconds per child")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole driver (0 = none): children get what is left, later rows are "
                        "recorded as skipped once it is spent")
    p.add_argument("--out", default=None,
                   help="result file name in benchmarks/results (or a path with a /); "
                        "default longctx-attention-h200.json, --tiny /tmp/longctx-attention-tiny.json")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, CPU-friendly smoke run")
    p.add_argument("--one", default=None, help="child mode: impl,layout,S")
    p.add_argument("--replot", default=None, help="redraw the PNG of an existing result JSON and exit")
    p.add_argument("--append", action="store_true",
                   help="keep the rows of an existing --out file (a new row replaces one with the same impl, "
                        "layout, S): several device calls build one file")
    p.add_argument("--merge", default=None,
                   help="comma list of result JSONs to merge into --out (later files win per impl, layout, S), "
                        "then plot; runs nothing")
    a = p.parse_args(argv)
    a.lengths = [int(s) for s in (a.lengths or ("256" if a.tiny else "32768,65536,131072")).split(",") if s]
    a.layouts = [s for s in a.layouts.split(",") if s]
    a.impls = [s for s in a.impls.split(",") if s]
    a.reps = a.reps or (2 if a.tiny else 3)
    a.warmup = max(1, a.warmup or (1 if a.tiny else 2))
    for x in a.layouts:
        if x not in LAYOUTS:
            p.error(f"unknown layout {x!r}; known: {LAYOUTS}")
    for x in a.impls:
        if x not in IMPLS:
            p.error(f"unknown impl {x!r}; known: {IMPLS}")
    return a


# ================================================================================================ child: one row
class Skip(Exception):
    """This impl does not apply here (the reason goes into the row as ``skipped``)."""


def applies(impl, layout, S, args):
    """None if (impl, layout, S) is measured, else why not."""
    if impl in ("sdpa_cudnn", "sdpa_flash") and layout != "causal":
        return "is_causal SDPA expresses the causal layout only"
    if impl in ("fxfuse_mask", "sdpa_cudnn_perdoc", "varlen") and layout != "docs8":
        return "docs8 only"
    if impl == "fxfuse_mask" and S > args.mask_max:
        return f"the [S, S] mask path is measured at S <= {args.mask_max} only"
    if S % N_DOCS:
        return f"S must be a multiple of {N_DOCS}"
    return None


def _sync(dev):
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def _timed(fn, reps, dev):
    """ms per call of fn() over reps calls (CUDA events on the GPU, wall clock on CPU), and the peak allocated
    (absolute, extra over what was allocated before) during those calls in GiB (None on CPU)."""
    import torch

    _sync(dev)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return e0.elapsed_time(e1) / reps, peak / 2**30, (peak - base) / 2**30
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps, None, None


def _fx_op():
    """torch.ops.fxfuse.softcap_attention and whether it takes (doc_ranges, key_valid)."""
    import torch

    importlib.import_module("fxfuse.ops")  # registers the op

    op = torch.ops.fxfuse.softcap_attention
    names = [a.name for a in op.default._schema.arguments]
    return op, ("doc_ranges" in names and "key_valid" in names)


def build_impl(impl, layout, S, dev, q, k, v, doc_ids, row, cpu_standin):
    """fn(q, k, v) -> out [1, Hq, S, D] for this impl, plus its setup measurements put into ``row``."""
    import torch
    import torch.nn.functional as F

    scale = D ** -0.5
    if impl in ("sdpa_cudnn", "sdpa_flash", "sdpa_cudnn_perdoc"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        be = SDPBackend.FLASH_ATTENTION if impl == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        if cpu_standin:
            be = SDPBackend.MATH
            row["note"] = "CPU stand-in: SDPA math backend"
        if impl == "sdpa_cudnn_perdoc":
            n = S // N_DOCS
            row["how"] = "the 8 documents as a batch of 8 (a view of q, k, v), one is_causal call"

            def perdoc(q, k, v, contiguous):
                qb, kb, vb = (t[0].unflatten(1, (N_DOCS, n)).transpose(0, 1) for t in (q, k, v))  # [8, H, n, D]
                if contiguous:
                    qb, kb, vb = qb.contiguous(), kb.contiguous(), vb.contiguous()
                with sdpa_kernel([be]):
                    o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True, scale=scale)
                return o.transpose(0, 1).reshape(1, Hq, S, D)
            return (lambda q, k, v: perdoc(q, k, v, False)), (lambda q, k, v: perdoc(q, k, v, True))

        def fn(q, k, v):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
        return fn

    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if layout == "causal":
            def mask_mod(b, h, qi, ki):
                return qi >= ki
            row["mask_mod"] = "q >= k"
        else:
            doc = doc_ids[0]

            def mask_mod(b, h, qi, ki):
                return (qi >= ki) & (doc[qi] == doc[ki])
            row["mask_mod"] = "(q >= k) & (doc_ids[q] == doc_ids[k])"
        for key in ("block_mask_s", "block_mask_warm_s"):
            _sync(dev)
            t0 = time.perf_counter()
            bm = create_block_mask(mask_mod, None, None, S, S, device=dev, _compile=True)
            _sync(dev)
            row[key] = round(time.perf_counter() - t0, 3)
        flex = torch.compile(flex_attention, dynamic=False)
        if dev == "cpu" and q.requires_grad:
            raise AssertionError("flex on CPU must run forward-only")
        return lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True, scale=scale)

    if impl in ("fxfuse", "fxfuse_mask"):
        op, recipe_api = _fx_op()
        row["op_has_doc_ranges"] = recipe_api
        tail = (None, None) if recipe_api else ()
        if impl == "fxfuse_mask":
            i = torch.arange(S, device=dev)
            d = doc_ids[0]
            mask = ((d[:, None] == d[None, :]) & (i[None, :] <= i[:, None]))[None, None]  # bool [1, 1, S, S]
            row["mask_gib"] = round(mask.numel() / 2**30, 3)
            return lambda q, k, v: op(q, k, v, mask, scale, 0.0, False, 0, 0, *tail)[0]
        if layout == "causal":
            return lambda q, k, v: op(q, k, v, None, scale, 0.0, True, 0, 0, *tail)[0]
        # fxfuse.ops re-exports document_ranges wherever the op is defined (fxfuse.attention.op today)
        sa = importlib.import_module("fxfuse.ops")
        if not recipe_api or not hasattr(sa, "document_ranges"):
            raise Skip("this fxfuse has no recipe API yet (fxfuse.ops.document_ranges / the "
                       "op's doc_ranges argument): fxfuse docs8 rows skipped")
        _sync(dev)
        t0 = time.perf_counter()
        doc_ranges = sa.document_ranges(doc_ids)
        _sync(dev)
        row["doc_ranges_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        row["doc_ranges"] = f"{str(doc_ranges.dtype).replace('torch.', '')} {list(doc_ranges.shape)}"
        return lambda q, k, v: op(q, k, v, None, scale, 0.0, True, 0, 0, doc_ranges, None)[0]

    if impl == "fxfuse_dispatch":
        sa = importlib.import_module("fxfuse.ops")
        dispatch = importlib.import_module("fxfuse.attention.dispatch")
        dr = sa.document_ranges(doc_ids) if layout == "docs8" else None
        ok, why = dispatch.sdpa_expressible(softcap=0.0, causal=True, window=0, has_mask=False,
                                            has_docs=dr is not None, has_key_valid=False, sinks=False,
                                            head_dim_pads=(0, 0), same_length=True)
        c = dispatch.choose_kernel("auto", q.device, q.dtype, D, ok, why)
        row["kernel"], row["kernel_reason"] = c.kernel, c.reason
        return lambda q, k, v: sa.softcap_attention(q, k, v, scaling=scale, causal=True, doc_ranges=dr)

    if impl == "varlen":
        import inspect

        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as e:
            raise Skip(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn ({e})")
        params = inspect.signature(varlen_attn).parameters
        n = S // N_DOCS
        cu = torch.arange(0, S + 1, n, device=dev, dtype=torch.int32)
        kw = {"scale": scale}
        if "is_causal" in params:
            kw["is_causal"] = True
        elif "window_size" in params:
            kw["window_size"] = (-1, 0)
        else:
            raise Skip(f"varlen_attn{inspect.signature(varlen_attn)}: no causal argument")
        gqa = "enable_gqa" in params
        if gqa:
            kw["enable_gqa"] = True
        row["varlen_kwargs"] = {k_: v_ for k_, v_ in kw.items() if k_ != "scale"}

        def fn(q, k, v, contiguous=False):  # [1, H, S, D] -> [S, H, D] views
            qt, kt, vt = (t[0].transpose(0, 1) for t in (q, k, v))
            if not gqa:
                kt, vt = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (kt, vt))
            if contiguous:
                qt, kt, vt = qt.contiguous(), kt.contiguous(), vt.contiguous()
            return varlen_attn(qt, kt, vt, cu, cu, n, n, **kw).transpose(0, 1)[None]
        return fn, (lambda q, k, v: fn(q, k, v, True))
    raise ValueError(impl)


def reference(layout, S, dev, q, k, v, do):
    """(out, dq, dk, dv, name) from SDPA is_causal (per document for docs8): flash on CUDA, math on CPU."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = SDPBackend.FLASH_ATTENTION if dev == "cuda" else SDPBackend.MATH
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    n = S // N_DOCS if layout == "docs8" else S
    with sdpa_kernel([be]):
        out = torch.cat([F.scaled_dot_product_attention(qr[:, :, i:i + n], kr[:, :, i:i + n], vr[:, :, i:i + n],
                                                         is_causal=True, enable_gqa=True, scale=D ** -0.5)
                         for i in range(0, S, n)], dim=2)
    out.backward(do)
    name = f"SDPA {be.name.lower()} is_causal" + (" per document" if layout == "docs8" else "")
    return out.detach(), qr.grad, kr.grad, vr.grad, name


def check(fn, layout, S, dev, q, k, v, do, fwd_only, row):
    """max |impl - reference| of out and (fwd+bwd) dq, dk, dv, into row."""
    q.grad = k.grad = v.grad = None
    out = fn(q, k, v)
    if not fwd_only:
        out.backward(do)
    out = out.detach()
    ro, rq, rk, rv, name = reference(layout, S, dev, q, k, v, do)
    row["check_ref"] = name
    row["out_max_abs"] = float((out.float() - ro.float()).abs().max())
    if not fwd_only:
        for nm, a, b in (("dq", q.grad, rq), ("dk", k.grad, rk), ("dv", v.grad, rv)):
            row[f"{nm}_max_abs"] = float((a.float() - b.float()).abs().max())
    row["ref_out_abs_max"] = float(ro.float().abs().max())
    row["ref_dq_abs_max"] = float(rq.float().abs().max())


def child(args):
    import torch

    impl, layout, S = args.one.split(",")
    S = int(S)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    row = dict(impl=impl, layout=layout, S=S, Hq=Hq, Hkv=Hkv, D=D, dtype="bfloat16", device=dev)
    why = applies(impl, layout, S, args)
    if why:
        row["skipped"] = why
        print(ROW_TAG + json.dumps(row), flush=True)
        return
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if dev == "cpu" and impl == "varlen":
        row["skipped"] = "needs CUDA (varlen_attn runs flash attention)"
        print(ROW_TAG + json.dumps(row), flush=True)
        return
    cpu_standin = dev == "cpu" and impl in ("sdpa_cudnn", "sdpa_flash", "sdpa_cudnn_perdoc")
    fwd_only = dev == "cpu" and impl == "flex"  # FlexAttention has no CPU backward
    if fwd_only:
        row["note"] = "CPU: forward only (FlexAttention has no CPU backward); ms = forward"
    try:
        g = torch.Generator(device=dev).manual_seed(0)
        mk = lambda h: torch.randn(1, h, S, D, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v = (mk(h).requires_grad_(not fwd_only) for h in (Hq, Hkv, Hkv))
        do = mk(Hq)
        n_docs = N_DOCS if layout == "docs8" else 1
        doc_ids = (torch.arange(S, device=dev) * n_docs // S)[None]  # [1, S], non-decreasing
        row["docs"] = n_docs
        fn = build_impl(impl, layout, S, dev, q, k, v, doc_ids, row, cpu_standin)
        fn, fn_contiguous = fn if isinstance(fn, tuple) else (fn, None)
        use = {"fn": fn}

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            use["fn"](q, k, v).backward(do)

        def fwd():
            use["fn"](q, k, v)

        step = fwd if fwd_only else fwd_bwd
        _sync(dev)
        t0 = time.perf_counter()
        try:
            step()
        except RuntimeError as e:  # a kernel that refuses strided views: give it contiguous copies (timed too)
            if fn_contiguous is None or isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            use["fn"] = fn_contiguous
            try:
                step()
            except Exception:  # noqa: BLE001  (not a stride problem: report the first error)
                raise e from None
            fn = fn_contiguous
            row["note"] = (row.get("note", "") + f" strided views refused ({str(e)[:160]}): inputs made "
                           "contiguous inside every call (the copies are timed)").strip()
        _sync(dev)
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        for _ in range(args.warmup - 1):
            step()
        ms, peak, extra = _timed(step, args.reps, dev)
        fwd_ms = _timed(fwd, args.reps, dev)[0] if not fwd_only else ms
        flops = 4 * S * S * D * Hq / 2 * 3.5 / (N_DOCS if layout == "docs8" else 1)
        if fwd_only:
            flops /= 3.5
        row.update(ms=round(ms, 3), fwd_ms=round(fwd_ms, 3), reps=args.reps, warmup=args.warmup,
                   tflops=float(f"{flops / ms / 1e9:.4g}"),
                   peak_gib=None if peak is None else round(peak, 3),
                   peak_extra_gib=None if extra is None else round(extra, 3))
        print(ROW_TAG + json.dumps(row), flush=True)  # the timing survives a failing check
        if args.check_max and S <= args.check_max:
            try:
                check(fn, layout, S, dev, q, k, v, do, fwd_only, row)
            except Exception as e:  # noqa: BLE001  (the timing above stays valid)
                row.update(check_error=f"{type(e).__name__}: {str(e)[:400]}")
    except Skip as e:
        row["skipped"] = str(e)
    except torch.cuda.OutOfMemoryError as e:
        row.update(error="OOM", error_msg=str(e)[:600],
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3))
    except Exception as e:  # noqa: BLE001
        row.update(error=type(e).__name__, error_msg=str(e)[:400], traceback=traceback.format_exc()[-800:])
    print(ROW_TAG + json.dumps(row), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no teardown (a faulted CUDA context or compile workers can hang it): the row is out


# ===================================================================================================== driver
def run_child(cmd, timeout, log_path, env=None):
    """(rc or 'timeout', last row printed or None, stderr/stdout tail, wall seconds); the child runs in its own
    process group, killed as a group on timeout."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                                cwd=ROOT, env=env)
        lines = []
        try:
            out, _ = proc.communicate(timeout=timeout)
            lines = out.splitlines()
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            lines = (out or "").splitlines()
            rc = "timeout"
        try:  # what the child left running in its own group (compile workers)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    with open(log_path) as f:
        tail = f.read()[-1500:]  # the child's stderr
    with open(log_path, "a") as log:
        log.write("\n--- stdout ---\n" + "\n".join(lines) + "\n")
    rows = []
    for ln in lines:
        if ln.startswith(ROW_TAG):
            try:
                rows.append(json.loads(ln[len(ROW_TAG):]))
            except ValueError:  # a line cut by the kill
                pass
    return rc, (rows[-1] if rows else None), tail, time.perf_counter() - t0


def finish_row(base, rc, row, tail, timeout):
    """The row a child left (or a stand-in), marked with how the child ended when that was not cleanly."""
    if row is None:
        return dict(base, error="timeout" if rc == "timeout" else f"child exited rc={rc} with no row",
                    error_msg=(f"killed after {timeout:.0f}s; " if rc == "timeout" else "") + tail)
    if rc == "timeout":
        if "error" in row:
            row["error_msg"] = f"{row.get('error_msg', '')} (then killed after {timeout:.0f}s)"
        else:
            row.update(error="timeout", error_msg=f"killed after {timeout:.0f}s" +
                       (f" during {row['phase']}" if row.get("phase") else "") + "; the last row it printed kept")
    elif rc != 0 and "error" not in row:
        row.update(error=f"child rc={rc} after its row", error_msg=tail)
    return row


def versions():
    import torch

    v = dict(host=platform.node(), python=platform.python_version(), torch=torch.__version__)
    for mod in ("triton", "transformers", "peft"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            v[mod] = None
    v["gpu"] = None
    if torch.cuda.is_available():
        # from nvidia-smi: the driver then holds no CUDA context (memory) while its children measure
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
            name, mem, drv = [x.strip() for x in q.stdout.splitlines()[0].split(",")]
            v.update(gpu=name, gpu_mem_gib=round(float(mem) / 1024, 1), driver=drv)
        except Exception:  # noqa: BLE001
            v.update(gpu=torch.cuda.get_device_name(),
                     gpu_mem_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
        v["cuda"] = torch.version.cuda
        v["cudnn"] = torch.backends.cudnn.version()
        v["visible_gpus"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    v["machine"] = v["gpu"] or f"cpu ({platform.machine()})"
    return v


def git_commit():
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                           timeout=20)
        if c.returncode == 0 and c.stdout.strip():
            d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=20)
            return c.stdout.strip() + ("-dirty" if d.returncode == 0 and d.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        pass
    return os.environ.get("FXFUSE_COMMIT") or os.environ.get("COMMIT") or "unknown"


def out_paths(name, default):
    name = name or default
    path = name if os.sep in name else os.path.join(HERE, "results", name)
    return path, os.path.splitext(path)[0] + ".png"


def save(path, doc):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    if os.environ.get("OUT") and os.path.isdir(os.environ["OUT"]):
        dst = os.path.join(os.environ["OUT"], os.path.basename(path))
        if os.path.abspath(dst) != os.path.abspath(path):
            shutil.copyfile(path, dst)


COLORS = {"fxfuse": "tab:red", "fxfuse_mask": "salmon", "sdpa_cudnn": "tab:blue", "sdpa_flash": "tab:cyan",
          "flex": "tab:green", "sdpa_cudnn_perdoc": "tab:purple", "varlen": "tab:olive"}


def tok_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def pyplot_and_rows(json_path):
    """(matplotlib.pyplot with the Agg backend, the result JSON) for a plot, or (None, None) without matplotlib:
    the benchmarks' plots are optional."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return None, None
    with open(json_path) as f:
        return plt, json.load(f)


def save_figure(plt, fig, png_path):
    """Write the figure to ``png_path`` (and a copy under $OUT, which the device call brings back); its path."""
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    if os.environ.get("OUT") and os.path.isdir(os.environ["OUT"]):
        dst = os.path.join(os.environ["OUT"], os.path.basename(png_path))
        if os.path.abspath(dst) != os.path.abspath(png_path):
            shutil.copyfile(png_path, dst)
    return png_path


def plot(json_path, png_path):
    """ms and TFLOP/s vs S per impl, one column per layout; silently nothing without matplotlib."""
    plt, doc = pyplot_and_rows(json_path)
    if plt is None:
        return None
    rows = [r for r in doc["rows"] if r.get("ms") is not None]
    layouts = [x for x in LAYOUTS if any(r["layout"] == x for r in rows)]
    if not layouts:
        return None
    fig, axes = plt.subplots(2, len(layouts), figsize=(6.5 * len(layouts), 8), squeeze=False)
    for j, layout in enumerate(layouts):
        rs = [r for r in rows if r["layout"] == layout]
        for impl in [i for i in IMPLS if any(r["impl"] == i for r in rs)]:
            pts = sorted((r["S"], r["ms"], r["tflops"]) for r in rs if r["impl"] == impl)
            style = dict(marker="o", lw=2.2 if impl.startswith("fxfuse") else 1.4, color=COLORS.get(impl))
            axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], label=impl, **style)
            axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], label=impl, **style)
        axes[0][j].set_title(f"{layout}: fwd+bwd, Hq {Hq} Hkv {Hkv} D {D}, bf16, B 1")
        axes[0][j].set_ylabel("ms (lower is better)")
        axes[0][j].set_yscale("log")
        axes[1][j].set_ylabel("TFLOP/s (higher is better)")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            xs = sorted({r["S"] for r in rs})
            ax.set_xticks(xs, [tok_label(x) for x in xs])
            ax.set_xlabel("tokens S")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    fig.suptitle(f"long-context attention, {doc.get('machine')}, torch {doc.get('torch')}, "
                 f"triton {doc.get('triton')}, commit {doc.get('commit')}", fontsize=9)
    return save_figure(plt, fig, png_path)


KEY = ("impl", "layout", "S")


def merge_rows(old, new, key=KEY):
    """old rows with the new ones appended, a new row replacing an old one with the same key (except a row that
    --budget skipped: it does not displace a measurement)."""
    k_of = lambda r: tuple(r.get(k) for k in key)  # noqa: E731
    old_keys = {k_of(r) for r in old}
    new = [r for r in new if not (str(r.get("skipped", "")).startswith("--budget") and k_of(r) in old_keys)]
    keys = {k_of(r) for r in new}
    return [r for r in old if k_of(r) not in keys] + new


def merge_files(paths, json_path, png_path, plot_fn, key=KEY):
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    doc = dict(docs[0], merged_from=[dict({k: d.get(k) for k in ("machine", "torch", "triton", "commit", "started",
                                                                  "argv")}, file=p) for p, d in zip(paths, docs)])
    rows = []
    for d in docs:
        rows = merge_rows(rows, d["rows"], key)
    doc["rows"] = rows
    save(json_path, doc)
    png = plot_fn(json_path, png_path)
    print(f"wrote {json_path} ({len(rows)} rows)" + (f" and {png}" if png else ""))


def driver(args, argv):
    json_path, png_path = out_paths(args.out, "/tmp/longctx-attention-tiny.json" if args.tiny
                                    else "longctx-attention-h200.json")
    if args.merge:
        return merge_files(args.merge.split(","), json_path, png_path, plot)
    logdir = os.path.join(os.environ["OUT"], "logs") if os.environ.get("OUT") else tempfile.mkdtemp(
        prefix="longctx-attn-")
    os.makedirs(logdir, exist_ok=True)
    doc = dict(versions(), commit=git_commit(), script="benchmarks/bench_longctx_attention.py", argv=argv,
               config=dict(Hq=Hq, Hkv=Hkv, D=D, dtype="bfloat16", batch=1, docs8_documents=N_DOCS,
                           reps=args.reps, warmup=args.warmup, check_max=args.check_max, mask_max=args.mask_max,
                           timeout=args.timeout, budget=args.budget, tiny=args.tiny,
                           flops="4*S*S*D*Hq/2*3.5 (causal fwd+bwd), /8 for docs8"),
               started=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}), flush=True)
    kept = []
    if args.append and os.path.exists(json_path):
        with open(json_path) as f:
            kept = json.load(f).get("rows", [])
        doc["appended_to_rows_of_earlier_runs"] = len(kept)
    deadline = time.monotonic() + args.budget if args.budget else None
    passthrough = ["--reps", str(args.reps), "--warmup", str(args.warmup), "--check-max", str(args.check_max),
                   "--mask-max", str(args.mask_max)] + (["--tiny"] if args.tiny else [])
    for S in args.lengths:
        for layout in args.layouts:
            for impl in args.impls:
                why = applies(impl, layout, S, args)
                if why:
                    continue  # not a measurement: not a row
                base = dict(impl=impl, layout=layout, S=S)
                timeout = args.timeout
                if deadline is not None:
                    timeout = min(timeout, deadline - time.monotonic())
                    if timeout < 15:
                        row = dict(base, skipped=f"--budget {args.budget}s spent")
                        doc["rows"].append(row)
                        print(json.dumps(row), flush=True)
                        continue
                cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{impl},{layout},{S}"] + passthrough
                log = os.path.join(logdir, f"attn-{impl}-{layout}-{S}.log")
                rc, row, tail, wall = run_child(cmd, timeout, log)
                row = finish_row(base, rc, row, tail, timeout)
                row["child_wall_s"] = round(wall, 1)
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
                save(json_path, dict(doc, rows=merge_rows(kept, doc["rows"])))
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    doc["rows"] = merge_rows(kept, doc["rows"])
    save(json_path, doc)
    png = plot(json_path, png_path)
    print(f"wrote {json_path}" + (f" and {png}" if png else " (no plot: matplotlib not importable)")
          + f"; child logs in {logdir}", flush=True)


def main():
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.replot:
        png = plot(args.replot, os.path.splitext(args.replot)[0] + ".png")
        print(png or "matplotlib not importable: no plot")
    elif args.one:
        child(args)
    else:
        driver(args, argv)


if __name__ == "__main__":
    main()
