"""The attention benchmark matrix of issue 29 ("Attention at Hopper speed"): one attention layer, bf16, forward and
backward apart and together, in TFLOP/s, for head dims 64 / 128 / 256 at 4k..128k tokens and five mask layouts,
fxfuse beside SDPA cuDNN, SDPA flash and FlexAttention, every impl in the same call.

Cases (head-dim family x layout)
  D 64, D 128   Llama-3 heads: 32 q / 8 kv, scale D**-0.5, no softcap; layouts causal, window, docs8, padded4
  D 256         Gemma-2-9B heads: 16 q / 8 kv, scale 256**-0.5, tanh softcap 50; layouts causal, window
Layouts
  causal   batch 1, one causal row of S tokens
  window   causal + sliding window --window (4096): key k kept for query q iff 0 <= q - k < window
  docs8    batch 1, 8 equal packed documents, causal within each
  padded4  batch 4 right-padded rows of S tokens, real lengths S, 3S/4, S/2, S/4: causal + padding keys dropped
           (query rows past a length still attend the real keys: what fxfuse's key_valid and Flex's mask both give)

Impls (a row says "skipped" and why where an impl cannot express a case)
  fxfuse             torch.ops.fxfuse.softcap_attention(q, k, v, None, scale, softcap, True, window, 0, doc_ranges,
                     key_valid)[0]: fxfuse's own kernel. doc_ranges = fxfuse.ops.document_ranges(doc_ids) (docs8),
                     key_valid bool [4, S] (padded4), both built once outside the timing (once per step in training)
  fxfuse_dispatch    the public fxfuse.ops.softcap_attention(..., kernel="auto"): the kernel fxfuse picks
                     (fxfuse.attention.dispatch); the row's kernel / kernel_reason say which and why
  flex               FlexAttention: BlockMask from create_block_mask(mask_mod, B|None, None, S, S, device,
                     _compile=True) (build timed apart: block_mask_s first, block_mask_warm_s a second build),
                     flex_attention compiled with torch.compile(dynamic=False), enable_gqa=True; D 256 adds the
                     score_mod 50 * tanh(score / 50)
  sdpa_cudnn         F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) under sdpa_kernel([CUDNN]):
                     causal, D 64 / 128 only (no window, documents or padding without an [S, S] mask; no softcap)
  sdpa_flash         the same under sdpa_kernel([FLASH_ATTENTION])
  sdpa_cudnn_perdoc  docs8 only: cuDNN is_causal on the 8 documents as a batch of 8 (views of q, k, v): the floor
                     for 8 equal documents, what a varlen kernel can at best do

Per row (impl, D, layout, S): fwd_ms (forward alone, autograd on), bwd_ms (torch.autograd.grad on the output of an
untimed forward), ms (fwd+bwd together), each the median of --reps calls timed one by one with CUDA events (queued
back to back, one sync at the end); fwd_tflops / bwd_tflops / tflops on the case's work: forward 4*D*Hq*P with
P = S*S/2 (causal), the window band counted exactly, S*S/16 (docs8), sum of L*L/2 over the real lengths (padded4),
backward 2.5x that; peak_gib / peak_extra_gib (max allocated during the fwd+bwd calls, and minus what was allocated
before them: inputs excluded); first_call_s (compiling included); wall_s (the row's time in the child). At S <=
--check-max every row also holds max |impl - ref| of out, dq, dk, dv, ref = the formula in fp32 on the same bf16
inputs with the layout's mask made explicit (the very mask_mod Flex gets), a chunk of query rows at a time.

One child process per (impl, case) walks the lengths in ascending order, one row each: it pays torch's start-up
(~10 s) once and Flex's compiles per shape, and a crash, a CUDA fault or its timeout loses only its remaining rows
(recorded as errors or skipped, with the reason). Children run in the order of --dims, --layouts, --impls (every
impl of a case before the next case; --order impl: every case of an impl first); once --budget is spent no new child
starts and its rows are skipped with "--budget ...", which never displaces a measured row on --append / --merge.

Run (device machine, repository root, one H200, torch 2.11 / triton 3.6). Estimates from bench_longctx_attention's
H200 rows (one child per row there): a fxfuse / fxfuse_dispatch child ~25-50 s (the 128k row dominates: ~12 s at
D 128 causal, ~22 s padded4; Triton compiles its kernels on a fresh machine: ~10 s), an SDPA child ~25 s, a Flex
child ~2.5-3 min (a block mask and a flex_attention compile per length, ~15-30 s each). One case with every impl
~3.5-4.5 min, the whole matrix (10 cases) ~40 min. Split it by cases, every impl of a case in the same call (the
comparison is then made on one machine state), two cases per device call of <= 9 min, all into one file:
    B="python3 benchmarks/bench_attention.py --resume --budget 520"     (--budget counts the driver's ~10 s start)
    call 1  $B --dims 128 --layouts causal,docs8        ~8 min
    call 2  $B --dims 128 --layouts padded4,window      ~8 min
    call 3  $B --dims 64 --layouts causal,docs8         ~8 min
    call 4  $B --dims 64 --layouts padded4,window       ~8 min
    call 5  $B --dims 256                               ~8 min   (causal, window with softcap 50)
--resume (implies --append) runs only what the file lacks or what a --budget cut skipped, a child only from its
first missing length: a call that ran out of budget is repeated as it is. Copy each call's $OUT/<--out> back to
benchmarks/results/ before the next call (the device machine works on a copy of the working tree; the file is not
git-ignored, so it travels). A cheaper first pass: --lengths
8192,32768,131072 (Flex's compiles are per length). Rows go to benchmarks/results/<--out> (default
attention-matrix-h200.json) and $OUT/<--out>, saved after every child; the plot beside them (.png: one panel per head
dim x layout, fwd+bwd TFLOP/s vs tokens, one line per impl; if matplotlib imports); child logs to $OUT/logs. Files
made apart are joined with --merge a.json,b.json (later files win; no GPU).
    --markdown FILE.json   the README table: fwd+bwd ms per impl, fxfuse's speed-up over Flex and over the best
                           SDPA row (cudnn / flash / cudnn_perdoc)
    --replot FILE.json     redraw the PNG
    --tiny                 CPU smoke run (~3 min on 2 cores with warm compile caches, ~5 cold): 256 and 512 tokens,
                           D 64 and 256, 4 q / 2 kv heads, window 64; SDPA impls on SDPA's math backend, flex
                           forward-only (no CPU backward) with its block mask built eagerly (compiling it costs
                           ~15 s a shape on CPU); --lengths 256 halves it
    --one fxfuse,128,docs8 --lengths 32768     a child alone (prints its @@ROW lines)
"""
import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

# (importing it also puts the repository root on sys.path: fxfuse comes from the source tree)
from bench_longctx_attention import COLORS as LONGCTX_COLORS
from bench_longctx_attention import (ROW_TAG, Skip, git_commit, merge_files, merge_rows, out_paths, pyplot_and_rows,
                                     run_child, save, save_figure, tok_label, versions)

FAMILIES = {  # head dim -> heads, softcap and the layouts measured
    64: dict(Hq=32, Hkv=8, softcap=0.0, layouts=("causal", "window", "docs8", "padded4"), heads="Llama-3"),
    128: dict(Hq=32, Hkv=8, softcap=0.0, layouts=("causal", "window", "docs8", "padded4"), heads="Llama-3.1-8B"),
    256: dict(Hq=16, Hkv=8, softcap=50.0, layouts=("causal", "window"), heads="Gemma-2-9B"),
}
TINY_HEADS = (4, 2)  # --tiny: q / kv heads of every family
LAYOUTS = ("causal", "window", "docs8", "padded4")
IMPLS = ("fxfuse", "fxfuse_dispatch", "flex", "sdpa_cudnn", "sdpa_flash", "sdpa_cudnn_perdoc")
SDPA_IMPLS = ("sdpa_cudnn", "sdpa_flash", "sdpa_cudnn_perdoc")
N_DOCS = 8
PADDED_QUARTERS = (4, 3, 2, 1)  # padded4's real lengths, in quarters of S
KEY = ("impl", "D", "layout", "S")
MIN_CHILD_S = 30  # budget left below which no child starts (its start-up alone takes ~10 s)
COLORS = dict(LONGCTX_COLORS, fxfuse_dispatch="tab:orange")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default=None, help="comma list of head dims, 64,128,256 (default all; --tiny 64,256)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--lengths", default=None,
                   help="comma list of tokens per row (default 4096..131072 by powers of 2; --tiny 256,512)")
    p.add_argument("--order", choices=("case", "impl"), default="case",
                   help="children: every impl of a case before the next case (case), or every case of an impl")
    p.add_argument("--window", type=int, default=None, help="the window layout's window (default 4096; --tiny 64)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 3; --tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed fwd+bwd calls first, >= 1 (default 2; --tiny 1)")
    p.add_argument("--check-max", type=int, default=16384, help="correctness check at S <= this (0 = never)")
    p.add_argument("--timeout", type=float, default=480, help="seconds per child (one impl, one case, all lengths)")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole driver (0 = none): no child starts once less than "
                        f"{MIN_CHILD_S}s are left, a running one is killed when it is spent")
    p.add_argument("--out", default=None,
                   help="result file name in benchmarks/results (or a path with a /); default "
                        "attention-matrix-h200.json, --tiny /tmp/attention-matrix-tiny.json")
    p.add_argument("--append", action="store_true",
                   help="keep the rows of an existing --out file (a new row replaces one with the same impl, D, "
                        "layout, S): several device calls build one file")
    p.add_argument("--resume", action="store_true",
                   help="--append, and run only the rows the file lacks or that a --budget cut skipped (a child "
                        "gets only those lengths): repeat a call that ran out of budget")
    p.add_argument("--merge", default=None, help="comma list of result JSONs joined into --out (later files win), "
                                                 "then plotted; runs nothing")
    p.add_argument("--markdown", default=None, help="print the README table of a result JSON and exit")
    p.add_argument("--replot", default=None, help="redraw the PNG of a result JSON and exit")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny heads, 256 / 512 tokens")
    p.add_argument("--one", default=None, help="child mode: impl,D,layout (walks --lengths)")
    a = p.parse_args(argv)
    a.append = a.append or a.resume
    a.dims = [int(s) for s in (a.dims or ("64,256" if a.tiny else "64,128,256")).split(",") if s]
    a.layouts = [s for s in a.layouts.split(",") if s]
    a.impls = [s for s in a.impls.split(",") if s]
    default_lengths = "256,512" if a.tiny else ",".join(str(2**i) for i in range(12, 18))
    a.lengths = sorted(int(s) for s in (a.lengths or default_lengths).split(",") if s)
    a.window = a.window or (64 if a.tiny else 4096)
    a.reps = a.reps or (2 if a.tiny else 3)
    a.warmup = max(1, a.warmup or (1 if a.tiny else 2))
    for xs, known, what in ((a.dims, FAMILIES, "head dim"), (a.layouts, LAYOUTS, "layout"), (a.impls, IMPLS, "impl")):
        for x in xs:
            if x not in known:
                p.error(f"unknown {what} {x!r}; known: {tuple(known)}")
    return a


def family(D, tiny):
    """(Hq, Hkv, softcap) of head dim D's family."""
    f = FAMILIES[D]
    return (*(TINY_HEADS if tiny else (f["Hq"], f["Hkv"])), f["softcap"])


def in_matrix(impl, D, layout):
    """Whether (impl, D, layout) has rows at all: a case of D's family, and sdpa_cudnn_perdoc only on docs8."""
    return layout in FAMILIES[D]["layouts"] and (impl != "sdpa_cudnn_perdoc" or layout == "docs8")


def skip_reason(impl, D, layout):
    """Why an impl cannot measure this case (its rows say so), or None."""
    if impl not in ("sdpa_cudnn", "sdpa_flash"):
        return None
    if FAMILIES[D]["softcap"]:
        return "SDPA has no tanh softcap"
    return {"window": "SDPA has no sliding window without an [S, S] mask tensor",
            "docs8": "is_causal SDPA cannot keep packed documents apart without an [S, S] mask tensor "
                     "(sdpa_cudnn_perdoc is the per-document floor)",
            "padded4": "is_causal SDPA cannot drop padding keys without an [B, 1, S, S] mask tensor"}.get(layout)


def padded_lengths(S):
    return [S * n // 4 for n in PADDED_QUARTERS]


def fwd_flops(D, Hq, layout, S, window):
    """The forward's matmul flops (4 * D * Hq per kept (query, key) pair) of the useful work of this case."""
    if layout == "causal":
        pairs = S * S / 2
    elif layout == "window":  # sum over queries of min(q + 1, window)
        w = min(window, S)
        pairs = w * (w + 1) / 2 + (S - w) * w
    elif layout == "docs8":
        pairs = N_DOCS * (S / N_DOCS) ** 2 / 2
    else:  # padded4: the real tokens' causal work
        pairs = sum(n * n / 2 for n in padded_lengths(S))
    return 4 * D * Hq * pairs


# ============================================================================================ child: one case
def _sync(dev):
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def _median_ms(call, reps, dev, prepare=None):
    """(median ms of call(prepare()) over reps calls each timed alone, peak allocated GiB during them, peak minus
    what was allocated before, GiB). On the GPU every call sits between its own CUDA events and all are queued
    back to back with one sync at the end (no launch gaps, as in training); prepare (the forward a backward needs)
    runs outside the events. CPU: the wall clock per call, no memory figures."""
    import torch

    _sync(dev)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        spans = []
        for _ in range(reps):
            arg = prepare() if prepare else None
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            call(arg)
            e1.record()
            spans.append((e0, e1))
            del arg
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return statistics.median(a.elapsed_time(b) for a, b in spans), peak / 2**30, (peak - base) / 2**30
    times = []
    for _ in range(reps):
        arg = prepare() if prepare else None
        t0 = time.perf_counter()
        call(arg)
        times.append((time.perf_counter() - t0) * 1e3)
        del arg
    return statistics.median(times), None, None


class Case:
    """One (head dim, layout, S) on a device: its sizes and the layout's inputs (doc_ids for docs8; lens and
    key_valid for padded4) and keep(b, q, k), the layout's mask as index arithmetic: Flex's mask_mod and the
    reference's explicit mask are both this function."""

    def __init__(self, D, layout, S, args, dev):
        import torch

        self.D, self.layout, self.S, self.dev = D, layout, S, dev
        self.Hq, self.Hkv, self.softcap = family(D, args.tiny)
        self.scale = D ** -0.5
        self.window = args.window if layout == "window" else 0
        self.B = len(PADDED_QUARTERS) if layout == "padded4" else 1
        self.doc_ids = self.lens = self.key_valid = None
        if layout == "causal":
            self.keep = lambda b, q, k: q >= k
        elif layout == "window":
            w = self.window
            self.keep = lambda b, q, k: (q >= k) & (q - k < w)
        elif layout == "docs8":
            doc = torch.arange(S, device=dev) * N_DOCS // S  # non-decreasing: 8 contiguous documents
            self.doc_ids = doc[None]
            self.keep = lambda b, q, k: (q >= k) & (doc[q] == doc[k])
        else:
            lens = torch.tensor(padded_lengths(S), device=dev)
            self.lens = lens
            self.key_valid = torch.arange(S, device=dev)[None] < lens[:, None]  # bool [4, S]
            self.keep = lambda b, q, k: (q >= k) & (k < lens[b])

    def describe(self):
        mask = {"causal": "q >= k", "window": f"(q >= k) & (q - k < {self.window})",
                "docs8": "(q >= k) & (doc_ids[q] == doc_ids[k])", "padded4": "(q >= k) & (k < lens[b])"}
        d = dict(B=self.B, Hq=self.Hq, Hkv=self.Hkv, softcap=self.softcap, window=self.window,
                 mask=mask[self.layout])
        if self.lens is not None:
            d["lens"] = self.lens.tolist()
        if self.doc_ids is not None:
            d["docs"] = N_DOCS
        return d


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """flex_attention compiled once per child; it recompiles per length (dynamic=False, and every length brings a
    new mask_mod closure), so dynamo's recompile limit (8 by default) must not cap a long --lengths list."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    setattr(cfg, "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit", 64)
    return torch.compile(flex_attention, dynamic=False)


def build_impl(impl, c, q, row, cpu_standin):
    """(fn(q, k, v) -> out [B, Hq, S, D], fallback fn or None) for impl on case c; setup measurements and the
    impl's choices go into row."""
    import torch
    import torch.nn.functional as F

    if impl in SDPA_IMPLS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        be = SDPBackend.FLASH_ATTENTION if impl == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        if cpu_standin:
            be = SDPBackend.MATH
            row["note"] = "CPU stand-in: SDPA math backend"

        def sdpa(q, k, v):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=c.scale)
        if impl != "sdpa_cudnn_perdoc":
            return sdpa, None
        n = c.S // N_DOCS
        row["how"] = "the 8 documents as a batch of 8 (a view of q, k, v), one is_causal call"

        def perdoc(q, k, v, contiguous=False):
            qb, kb, vb = (t[0].unflatten(1, (N_DOCS, n)).transpose(0, 1) for t in (q, k, v))  # [8, H, n, D]
            if contiguous:
                qb, kb, vb = qb.contiguous(), kb.contiguous(), vb.contiguous()
            return sdpa(qb, kb, vb).transpose(0, 1).reshape(1, c.Hq, c.S, c.D)
        # a backend that refuses the strided views gets contiguous copies (timed with it, and noted)
        return perdoc, functools.partial(perdoc, contiguous=True)

    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        flex = _compiled_flex()
        keep = c.keep
        # on CPU (--tiny) the block mask is built eagerly: compiling it costs ~15 s per shape there, instantly
        # built at these sizes, and no CPU row is a measurement
        compile_mask = c.dev != "cpu"
        if not compile_mask:
            row["block_mask"] = "built eagerly (_compile=False) on CPU"
        for key in ("block_mask_s", "block_mask_warm_s"):
            _sync(c.dev)
            t0 = time.perf_counter()
            bm = create_block_mask(lambda b, h, qi, ki: keep(b, qi, ki), c.B if c.lens is not None else None, None,
                                   c.S, c.S, device=c.dev, _compile=compile_mask)
            _sync(c.dev)
            row[key] = round(time.perf_counter() - t0, 3)
        kw = dict(block_mask=bm, enable_gqa=True, scale=c.scale)
        if c.softcap:
            cap = c.softcap
            kw["score_mod"] = lambda score, b, h, qi, ki: cap * torch.tanh(score / cap)
            row["score_mod"] = f"{cap:g} * tanh(score / {cap:g})"
        return (lambda q, k, v: flex(q, k, v, **kw)), None

    import fxfuse.ops as fx  # registers torch.ops.fxfuse.softcap_attention

    doc_ranges = None if c.doc_ids is None else fx.document_ranges(c.doc_ids)
    if impl == "fxfuse":
        op = torch.ops.fxfuse.softcap_attention
        return (lambda q, k, v: op(q, k, v, None, c.scale, c.softcap, True, c.window, 0, doc_ranges,
                                   c.key_valid)[0]), None
    from fxfuse.attention import dispatch

    # the same question the public function asks, so that the row says which kernel ran and why
    ok, why = dispatch.sdpa_expressible(softcap=c.softcap, causal=True, window=c.window, has_mask=False,
                                        has_docs=doc_ranges is not None, has_key_valid=c.key_valid is not None,
                                        sinks=False, head_dim_pads=(0, 0), same_length=True)
    choice = dispatch.choose_kernel("auto", q.device, q.dtype, c.D, ok, why, causal=True)
    row["kernel"], row["kernel_reason"] = choice.kernel, choice.reason
    return (lambda q, k, v: fx.softcap_attention(q, k, v, scaling=c.scale, softcap=c.softcap, causal=True,
                                                 window=c.window, doc_ranges=doc_ranges, key_valid=c.key_valid,
                                                 kernel="auto")), None


def reference(c, q, k, v, do):
    """(out, dq, dk, dv) of the formula in fp32 (upcasts of the bf16 inputs), c.keep as an explicit mask. Query rows
    go a chunk at a time under checkpoint, so one chunk's [B, Hq, C, S] scores (<= 2^28 elements) exist at once:
    16k tokens fit beside the impl's tensors."""
    import torch
    from torch.utils.checkpoint import checkpoint

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    G = c.Hq // c.Hkv
    kt, vg = kf.transpose(-1, -2)[:, :, None], vf[:, :, None]  # [B, Hkv, 1, D, S], [B, Hkv, 1, S, D]
    bi = torch.arange(c.B, device=c.dev)[:, None, None]
    ki = torch.arange(c.S, device=c.dev)[None, None, :]

    def rows(qc, i0):  # query head h reads kv head h // G, as GQA does
        s = (qc.unflatten(1, (c.Hkv, G)) @ kt) * c.scale  # [B, Hkv, G, C, S]
        if c.softcap:
            s = c.softcap * torch.tanh(s / c.softcap)
        qi = torch.arange(i0, i0 + qc.shape[2], device=c.dev)[None, :, None]
        s = s.masked_fill(~c.keep(bi, qi, ki)[:, None, None], float("-inf"))  # no row is fully masked here
        return (s.softmax(-1) @ vg).flatten(1, 2)

    C = max(16, min(c.S, 2**28 // (c.B * c.Hq * c.S)))
    out = torch.cat([checkpoint(rows, qf[:, :, i:i + C], i, use_reentrant=False) for i in range(0, c.S, C)], dim=2)
    out.backward(do.float())
    return out.detach(), qf.grad, kf.grad, vf.grad


def measure(impl, D, layout, S, args, dev, fwd_only, row):
    """Time impl on (D, layout, S) into row: first call, then fwd, bwd, fwd+bwd; the row is printed once timed
    (the timing survives a failing check), then checked at S <= --check-max."""
    import torch

    parts = {"docs8": N_DOCS, "padded4": len(PADDED_QUARTERS)}.get(layout, 1)
    if S % parts:
        raise Skip(f"{layout} needs S to be a multiple of {parts}")
    c = Case(D, layout, S, args, dev)
    row.update(c.describe())
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda h: torch.randn(c.B, h, S, D, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = (mk(h).requires_grad_(not fwd_only) for h in (c.Hq, c.Hkv, c.Hkv))
    do = mk(c.Hq)
    fn, fallback = build_impl(impl, c, q, row, cpu_standin=dev == "cpu" and impl in SDPA_IMPLS)
    fwd = lambda: fn(q, k, v)  # noqa: E731  (fn is looked up at call time: the fallback may replace it)
    fwd_bwd = lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)  # noqa: E731
    first = fwd if fwd_only else fwd_bwd
    _sync(dev)
    t0 = time.perf_counter()
    try:
        first()
    except RuntimeError as e:
        if fallback is None or isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        fn = fallback
        first()
        row["note"] = f"strided views refused ({str(e)[:160]}): contiguous copies inside every call (timed)"
    _sync(dev)
    row["first_call_s"] = round(time.perf_counter() - t0, 3)
    for _ in range(args.warmup - 1):
        first()
    flops = fwd_flops(D, c.Hq, layout, S, c.window)
    row["fwd_flops"] = flops
    fwd_ms, peak, extra = _median_ms(lambda _: fwd(), args.reps, dev)
    row.update(fwd_ms=round(fwd_ms, 3), fwd_tflops=float(f"{flops / fwd_ms / 1e9:.4g}"), reps=args.reps,
               warmup=args.warmup)
    if not fwd_only:
        bwd_ms = _median_ms(lambda out: torch.autograd.grad(out, (q, k, v), do), args.reps, dev, prepare=fwd)[0]
        ms, peak, extra = _median_ms(lambda _: fwd_bwd(), args.reps, dev)
        row.update(bwd_ms=round(bwd_ms, 3), bwd_tflops=float(f"{2.5 * flops / bwd_ms / 1e9:.4g}"),
                   ms=round(ms, 3), tflops=float(f"{3.5 * flops / ms / 1e9:.4g}"))
    row.update(peak_gib=None if peak is None else round(peak, 3),
               peak_extra_gib=None if extra is None else round(extra, 3))
    print(ROW_TAG + json.dumps(row), flush=True)
    if args.check_max and S <= args.check_max:
        try:
            out = fn(q, k, v)
            grads = () if fwd_only else torch.autograd.grad(out, (q, k, v), do)
            ref = reference(c, q, k, v, do)
            row["check_ref"] = "fp32 formula, explicit mask" + (", CPU" if dev == "cpu" else "")
            for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
                row[f"{name}_max_abs"] = float((a.float() - b).abs().max())
            row.update(ref_out_abs_max=float(ref[0].abs().max()), ref_dq_abs_max=float(ref[1].abs().max()))
        except Exception as e:  # noqa: BLE001  (the timing above stays valid)
            row["check_error"] = f"{type(e).__name__}: {str(e)[:400]}"


def child(args):
    """One impl on one case, every --lengths in order, one @@ROW each; exits without teardown."""
    import torch

    impl, D, layout = args.one.split(",")
    D = int(D)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    fwd_only = dev == "cpu" and impl == "flex"  # FlexAttention has no CPU backward
    stop = skip_reason(impl, D, layout)  # why the lengths from here on are not run
    for S in args.lengths:
        row = dict(impl=impl, D=D, layout=layout, S=S, dtype="bfloat16", device=dev)
        t0 = time.perf_counter()
        if stop:
            row["skipped"] = stop
        else:
            if fwd_only:
                row["note"] = "CPU: forward only (FlexAttention has no CPU backward)"
            try:
                measure(impl, D, layout, S, args, dev, fwd_only, row)
            except Skip as e:
                row["skipped"] = str(e)
            except torch.cuda.OutOfMemoryError as e:
                row.update(error="OOM", error_msg=str(e)[:600])
                stop = f"not run: OOM at S={S} (lengths ascend)"
            except Exception as e:  # noqa: BLE001
                row.update(error=type(e).__name__, error_msg=str(e)[:400], traceback=traceback.format_exc()[-800:])
                if "CUDA error" in str(e) or type(e).__name__ == "AcceleratorError":  # the context is unusable
                    stop = f"not reached: CUDA fault at S={S}"
            row["wall_s"] = round(time.perf_counter() - t0, 1)
        print(ROW_TAG + json.dumps(row), flush=True)
        gc.collect()
        if dev == "cuda" and stop is None:
            torch.cuda.empty_cache()
    sys.stderr.flush()
    os._exit(0)  # no teardown (a faulted CUDA context or compile workers can hang it): the rows are out


# ===================================================================================================== driver
def child_rows(log_path):
    """Every @@ROW a child printed, from its log: run_child returns only the last row, but appends the child's
    whole stdout to the log after a '--- stdout ---' line."""
    with open(log_path) as f:
        stdout = f.read().rpartition("\n--- stdout ---\n")[2]
    rows = []
    for ln in stdout.splitlines():
        if ln.startswith(ROW_TAG):
            try:
                rows.append(json.loads(ln[len(ROW_TAG):]))
            except ValueError:  # a line cut by the kill
                pass
    return rows


def fill_missing(base, lengths, rows, rc, tail, timeout, budget_cut, budget):
    """One row per length: the child's last row for it, else why there is none (the length in progress when the
    child died gets the error, the later ones 'not reached'; all 'skipped: --budget' when the budget killed it).
    A row printed only once timed (its final print sets wall_s) lost its check to the child's end."""
    got = {r["S"]: r for r in rows}
    how = f"was killed after {timeout:.0f}s" if rc == "timeout" else f"exited rc={rc}"
    out, lost_at = [], None
    for S in lengths:
        if S in got:
            r = got[S]
            if "wall_s" not in r and "skipped" not in r:
                r["check_error"] = f"the child {how} during the check (the timing is kept)"
            out.append(r)
            continue
        row = dict(base, S=S)
        if budget_cut:
            row["skipped"] = f"--budget {budget:g}s spent: the child {how} before this length"
        elif lost_at is None:
            lost_at = S
            row.update(error="timeout" if rc == "timeout" else "child died", error_msg=f"the child {how}; {tail}")
        else:
            row["skipped"] = f"not reached: the child {how} at S={lost_at}"
        out.append(row)
    return out


def summary(r):
    head = f"{r['impl']:<17} D{r['D']:<3} {r['layout']:<7} S {r['S']:>6}: "
    if r.get("skipped"):
        return head + "skipped: " + r["skipped"][:100]
    if r.get("error"):
        return head + f"ERROR {r['error']}: {str(r.get('error_msg', ''))[:100]}"
    fb = f", fwd+bwd {r['ms']} ms {r['tflops']} TFLOP/s" if r.get("ms") is not None else ""
    chk = f", out err {r['out_max_abs']:.3g}" if "out_max_abs" in r else (" CHECK " + r["check_error"][:80]
                                                                       if "check_error" in r else "")
    kern = f", kernel {r['kernel']}" if "kernel" in r else ""
    wall = f" ({r['wall_s']} s)" if "wall_s" in r else ""
    return head + f"fwd {r['fwd_ms']} ms {r['fwd_tflops']} TFLOP/s{fb}{kern}{chk}{wall}"


def driver(args, argv):
    t_start = time.monotonic()
    json_path, png_path = out_paths(args.out, "/tmp/attention-matrix-tiny.json" if args.tiny
                                    else "attention-matrix-h200.json")
    if args.merge:
        return merge_files(args.merge.split(","), json_path, png_path, plot, KEY)
    logdir = os.path.join(os.environ["OUT"], "logs") if os.environ.get("OUT") else tempfile.mkdtemp(
        prefix="attention-matrix-")
    os.makedirs(logdir, exist_ok=True)
    doc = dict(versions(), commit=git_commit(), script="benchmarks/bench_attention.py", argv=argv,
               config=dict(families={D: dict(zip(("Hq", "Hkv", "softcap"), family(D, args.tiny)),
                                             layouts=FAMILIES[D]["layouts"], heads=FAMILIES[D]["heads"])
                                     for D in FAMILIES},
                           dtype="bfloat16", window=args.window, docs8_documents=N_DOCS,
                           padded4_lengths="S, 3S/4, S/2, S/4", reps=args.reps, warmup=args.warmup,
                           check_max=args.check_max, timeout=args.timeout, budget=args.budget, tiny=args.tiny,
                           flops="forward 4*D*Hq*kept pairs (causal S*S/2, window exact, docs8 S*S/16, padded4 "
                                 "sum L*L/2), backward 2.5x"),
               started=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])
    print(json.dumps({k: v for k, v in doc.items() if k not in ("rows", "config")}), flush=True)
    kept = []
    if args.append and os.path.exists(json_path):
        with open(json_path) as f:
            kept = json.load(f).get("rows", [])
        doc["appended_to_rows_of_earlier_runs"] = len(kept)
    done = {tuple(r.get(k) for k in KEY) for r in kept if not str(r.get("skipped", "")).startswith("--budget")}
    cases = [(D, layout) for D in args.dims for layout in args.layouts if layout in FAMILIES[D]["layouts"]]
    if args.order == "case":
        children = [(impl, D, layout) for D, layout in cases for impl in args.impls]
    else:
        children = [(impl, D, layout) for impl in args.impls for D, layout in cases]
    passthrough = ["--window", str(args.window), "--reps", str(args.reps), "--warmup", str(args.warmup),
                   "--check-max", str(args.check_max)] + (["--tiny"] if args.tiny else [])
    for impl, D, layout in children:
        if not in_matrix(impl, D, layout):
            continue
        lengths = [S for S in args.lengths if not (args.resume and (impl, D, layout, S) in done)]
        if not lengths:
            continue
        base = dict(impl=impl, D=D, layout=layout)
        why = skip_reason(impl, D, layout)
        left = args.budget - (time.monotonic() - t_start) if args.budget else None
        if why or (left is not None and left < MIN_CHILD_S):  # no child: one line says why
            why = why or f"--budget {args.budget:g}s spent"
            rows = [dict(base, S=S, skipped=why) for S in lengths]
            print(f"  {impl:<17} D{D:<3} {layout:<7} {len(lengths)} lengths: skipped: {why}", flush=True)
        else:
            timeout = args.timeout if left is None else min(args.timeout, left)
            print(f"[{time.monotonic() - t_start:6.0f}s] child {impl} D{D} {layout} (timeout {timeout:.0f}s)",
                  flush=True)
            cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{impl},{D},{layout}", "--lengths",
                   ",".join(map(str, lengths))] + passthrough
            log = os.path.join(logdir, f"attn-{impl}-d{D}-{layout}.log")
            rc, _, tail, wall = run_child(cmd, timeout, log)
            rows = fill_missing(base, lengths, child_rows(log), rc, tail, timeout,
                                budget_cut=rc == "timeout" and timeout < args.timeout, budget=args.budget)
            for r in rows:
                r["child_wall_s"] = round(wall, 1)
                print("  " + summary(r), flush=True)
        doc["rows"] += rows
        save(json_path, dict(doc, rows=merge_rows(kept, doc["rows"], KEY)))
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    doc["rows"] = merge_rows(kept, doc["rows"], KEY)
    save(json_path, doc)
    png = plot(json_path, png_path)
    print(f"wrote {json_path}" + (f" and {png}" if png else " (no plot: matplotlib not importable)")
          + f"; child logs in {logdir}; {time.monotonic() - t_start:.0f}s", flush=True)


# ============================================================================================ plot, markdown
def _case_key(D, layout, S=0):
    return list(FAMILIES).index(D), LAYOUTS.index(layout), S


def plot(json_path, png_path):
    """fwd+bwd TFLOP/s vs tokens, one panel per (head dim, layout), one line per impl; None without matplotlib."""
    plt, doc = pyplot_and_rows(json_path)
    if plt is None:
        return None
    rows = [r for r in doc["rows"] if r.get("tflops") is not None]
    panels = sorted({(r["D"], r["layout"]) for r in rows}, key=lambda p: _case_key(*p))
    if not panels:
        return None
    ncol = min(4, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.8 * nrow), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (D, layout) in zip(axes.flat, panels):
        rs = [r for r in rows if r["D"] == D and r["layout"] == layout]
        for impl in [i for i in IMPLS if any(r["impl"] == i for r in rs)]:
            pts = sorted((r["S"], r["tflops"]) for r in rs if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl, color=COLORS.get(impl),
                    lw=2.2 if impl.startswith("fxfuse") else 1.4)
        r0 = rs[0]
        ax.set_title(f"D {D} {layout}: Hq {r0.get('Hq')} Hkv {r0.get('Hkv')}"
                     + (f", softcap {r0['softcap']:g}" if r0.get("softcap") else "")
                     + (f", window {r0['window']}" if r0.get("window") else "") + f", B {r0.get('B')}", fontsize=9)
        xs = sorted({r["S"] for r in rs})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [tok_label(x) for x in xs])
        ax.set_xlabel("tokens S")
        ax.set_ylabel("fwd+bwd TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"attention, bf16, fwd+bwd: {doc.get('machine')}, torch {doc.get('torch')}, triton "
                 f"{doc.get('triton')}, commit {doc.get('commit')}", fontsize=9)
    return save_figure(plt, fig, png_path)


def markdown(json_path):
    """The README table: per (D, layout, S) every impl's fwd+bwd ms, fxfuse's speed-up over Flex and over the
    fastest SDPA row (ms of the other / fxfuse's ms: > 1 means fxfuse is faster)."""
    with open(json_path) as f:
        doc = json.load(f)
    by = {}
    for r in doc["rows"]:
        by.setdefault((r["D"], r["layout"], r["S"]), {})[r["impl"]] = r
    impls = [i for i in IMPLS if any(i in c for c in by.values())]

    def cell(r):  # blank: no row; —: skipped (the impl cannot express the case, or was not run: the row says why)
        if r is None:
            return ""
        if r.get("skipped"):
            return "—"
        if r.get("error"):
            return "OOM" if r["error"] == "OOM" else "error"
        return f"{r['ms']:.4g}" if r.get("ms") is not None else f"{r['fwd_ms']:.4g} (fwd)"

    def ms(r):
        return None if r is None else r.get("ms")

    lines = [f"fwd+bwd ms, bf16 ({doc.get('machine')}, torch {doc.get('torch')}, triton {doc.get('triton')}, "
             f"commit {doc.get('commit')}); speed-up = other ms / fxfuse ms",
             "", "| D | layout | S | " + " | ".join(impls) + " | fxfuse vs flex | fxfuse vs best SDPA |",
             "|---|---|---|" + "---|" * (len(impls) + 2)]
    for (D, layout, S), c in sorted(by.items(), key=lambda kv: _case_key(*kv[0])):
        fx = ms(c.get("fxfuse"))
        flex = ms(c.get("flex"))
        sdpa = [(ms(c.get(i)), i) for i in SDPA_IMPLS if ms(c.get(i)) is not None]
        vs_flex = f"{flex / fx:.2f}x" if fx and flex else ""
        vs_sdpa = ""
        if fx and sdpa:
            best, name = min(sdpa)
            vs_sdpa = f"{best / fx:.2f}x ({name.replace('sdpa_', '')})"
        lines.append(f"| {D} | {layout} | {tok_label(S)} | " + " | ".join(cell(c.get(i)) for i in impls)
                     + f" | {vs_flex} | {vs_sdpa} |")
    print("\n".join(lines))


def main():
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.markdown:
        markdown(args.markdown)
    elif args.replot:
        png = plot(args.replot, os.path.splitext(args.replot)[0] + ".png")
        print(png or "matplotlib not importable: no plot")
    elif args.one:
        child(args)
    else:
        driver(args, argv)


if __name__ == "__main__":
    main()
