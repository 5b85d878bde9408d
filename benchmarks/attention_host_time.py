"""Host time of one attention layer's forward and forward + backward: what the CPU spends per call, beside the
GPU's time, for fxfuse's op (Triton launches through the JIT or through the stored binary,
``FXFUSE_TRITON_FAST_LAUNCH``), FlexAttention (compiled, BlockMask built once) and SDPA cuDNN.

Per (impl, layout, S): ``host_us`` = wall time of N calls queued back to back divided by N, measured up to the
last launch (no sync inside; at 128 tokens the GPU work is a few microseconds per kernel, so the queue never
fills and this is the CPU's time per call); ``wall_us`` = the same loop with a sync at the end (what a step
pays: the larger of host and GPU time); ``gpu_us`` = CUDA-event time of the loop (the GPU's view: it equals
wall_us when the GPU is the bottleneck, host_us when the launches are). One layer at Llama-3-8B heads (32 q / 8 kv,
head dim 128), bf16, batch 1; docs8 = 8 equal packed documents; causal = fxfuse's own kernel (kernel='fxfuse');
mask = a [1, 1, S, S] causal bool mask tensor (fxfuse on its tile classes, cuDNN given attn_mask; --head-dim 64
for Llama-3.2-1B's heads).
Then a cProfile of fxfuse's forward + backward at 128 tokens (top functions by own time).

    python benchmarks/attention_host_time.py [--lengths 128,4096] [--out attention-host-time-h200.json]
Rows: benchmarks/results/<--out> and $OUT/<--out>; the profile to $OUT/host_profile.txt.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxfuse.ops  # noqa: E402,F401
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_longctx_attention import git_commit, versions  # noqa: E402


def make_inputs(S, D=128, Hq=32, Hkv=8, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, Hq, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, Hkv, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, Hkv, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(1, Hq, S, D, device=dev, dtype=torch.bfloat16, generator=g)
    return q, k, v, do


def doc_ids(S, dev, n=8):
    return (torch.arange(S, device=dev) * n // S).view(1, S)


def build(impl, layout, S, q):
    dev = q.device
    D = q.shape[-1]
    # "mask": HF's [1, 1, S, S] causal bool mask as a tensor (what a layer graph gets from the graph that built it)
    mask = torch.ones(S, S, dtype=torch.bool, device=dev).tril()[None, None] if layout == "mask" else None
    if impl == "fxfuse":
        dr = fxfuse.ops.document_ranges(doc_ids(S, dev)) if layout == "docs8" else None
        op = torch.ops.fxfuse.softcap_attention
        return lambda q, k, v: op(q, k, v, mask, D ** -0.5, 0.0, mask is None, 0, 0, dr, None)[0]
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        ids = doc_ids(S, dev)[0]

        def mask_mod(b, h, qi, ki):
            m = qi >= ki
            if layout == "docs8":
                m = m & (ids[qi] == ids[ki])
            return m
        bm = create_block_mask(mask_mod, None, None, S, S, device=dev, _compile=True)
        flex = torch.compile(flex_attention, dynamic=False)
        return lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True)
    if impl == "sdpa_cudnn":
        if layout not in ("causal", "mask"):
            return None
        from torch.nn.attention import SDPBackend, sdpa_kernel
        F = torch.nn.functional

        def f(q, k, v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                      enable_gqa=True)
        return f
    raise ValueError(impl)


def time_loop(step, n, dev):
    for _ in range(5):
        step()
    torch.cuda.synchronize(dev)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    e1.record()
    torch.cuda.synchronize(dev)
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6, e0.elapsed_time(e1) / n * 1e3


def kernel_us(step, n=20):
    """GPU kernel time per call of ``step`` (the sum of its kernels' durations, torch.profiler): what the call
    costs the GPU, whatever the host does."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / n


def host_us(step, n=200, loops=5):
    """Min over ``loops`` of the CPU time per call of ``step`` queued back to back (no sync inside a loop)."""
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


def breakdown():
    """Host time of each piece of fxfuse's forward + backward at 128 tokens (8 documents, head dim 128)."""
    from fxfuse.attention import backward as bw, forward as fw
    from fxfuse.attention.launching import needs_int64, recipe_args
    from fxfuse.kernels.triton_support import tile_descriptor
    dev = torch.device("cuda")
    S, D = 128, 128
    q, k, v, do = make_inputs(S, dev=dev)
    dr = fxfuse.ops.document_ranges(doc_ids(S, dev))
    op, bop = torch.ops.fxfuse.softcap_attention, torch.ops.fxfuse.softcap_attention_backward
    sc = D ** -0.5
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = op(qd, kd, vd, None, sc, 0.0, True, 0, 0, dr, None)
    rows = {}

    def fwd_bwd():
        o = op(q, k, v, None, sc, 0.0, True, 0, 0, dr, None)[0]
        torch.autograd.grad(o, (q, k, v), do)

    def trivial_grad():
        torch.autograd.grad(q * 2.0, (q,), do)
    pieces = dict(
        fwd_bwd=fwd_bwd,
        op_fwd_requires_grad=lambda: op(q, k, v, None, sc, 0.0, True, 0, 0, dr, None),
        op_fwd_no_grad=lambda: op(qd, kd, vd, None, sc, 0.0, True, 0, 0, dr, None),
        fwd_launcher=lambda: fw.attention_fwd_triton(qd, kd, vd, None, sc, 0.0, True, 0, doc_ranges=dr),
        op_bwd=lambda: bop(do, qd, kd, vd, None, out, lse, sc, 0.0, True, 0, 0, dr, None),
        bwd_launchers=lambda: bw.attention_bwd_triton(do, qd, kd, vd, None, out, lse, sc, 0.0, True, 0,
                                                      doc_ranges=dr),
        trivial_autograd_grad=trivial_grad,
        empty_x3=lambda: (torch.empty(1, 32, S, D, device=dev, dtype=torch.bfloat16),) * 3,
        tile_descriptor_x2=lambda: (tile_descriptor(qd, [1, 1, 64, 128]), tile_descriptor(do, [1, 1, 64, 128])),
        needs_int64_x7=lambda: needs_int64(qd, kd, vd, do, qd, kd, vd, None),
        recipe_args=lambda: recipe_args(dr, None, lse),
    )
    for fast in ("1", "0"):
        os.environ["FXFUSE_TRITON_FAST_LAUNCH"] = fast
        for name, fn in pieces.items():
            rows[f"{name}{'' if fast == '1' else '_jit'}"] = round(host_us(fn), 1)
    print("@@BREAKDOWN", json.dumps(rows), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--breakdown", action="store_true", help="host time of each piece at 128 tokens, then exit")
    ap.add_argument("--lengths", default="128,4096")
    ap.add_argument("--layouts", default="docs8,causal")
    ap.add_argument("--impls", default="fxfuse,fxfuse_jit,flex,sdpa_cudnn")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kernel-time", action="store_true", help="also each row's GPU kernel time (torch.profiler)")
    ap.add_argument("--profile-layout", default="docs8", help="the layout of the closing cProfile")
    ap.add_argument("--profile-length", type=int, default=128)
    ap.add_argument("--out", default="attention-host-time-h200.json")
    args = ap.parse_args()
    if args.breakdown:
        rows = breakdown()
        out_dir = os.environ.get("OUT")
        if out_dir:
            with open(os.path.join(out_dir, "host_breakdown.json"), "w") as fh:
                json.dump(dict(versions(), commit=git_commit(), rows=rows), fh, indent=1)
        return
    dev = torch.device("cuda")
    rows = []
    for layout in args.layouts.split(","):
        for S in map(int, args.lengths.split(",")):
            q, k, v, do = make_inputs(S, D=args.head_dim, dev=dev)
            for impl in args.impls.split(","):
                base = "fxfuse" if impl.startswith("fxfuse") else impl
                os.environ["FXFUSE_TRITON_FAST_LAUNCH"] = "0" if impl == "fxfuse_jit" else "1"
                f = build(base, layout, S, q)
                if f is None:
                    continue
                with torch.no_grad():
                    fwd = time_loop(lambda: f(q, k, v), args.n, dev)

                def fwd_bwd():
                    out = f(q, k, v)
                    torch.autograd.grad(out, (q, k, v), do)
                both = time_loop(fwd_bwd, args.n, dev)
                row = dict(impl=impl, layout=layout, S=S, D=args.head_dim, fwd_host_us=fwd[0], fwd_wall_us=fwd[1],
                           fwd_gpu_us=fwd[2], host_us=both[0], wall_us=both[1], gpu_us=both[2],
                           kernel_us=kernel_us(fwd_bwd) if args.kernel_time else None)
                rows.append(row)
                print("@@ROW", json.dumps(row), flush=True)
    os.environ["FXFUSE_TRITON_FAST_LAUNCH"] = "1"
    q, k, v, do = make_inputs(args.profile_length, D=args.head_dim, dev=dev)
    f = build("fxfuse", args.profile_layout, args.profile_length, q)

    def fwd_bwd():
        out = f(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)
    for _ in range(10):
        fwd_bwd()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        fwd_bwd()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
    out_dir = os.environ.get("OUT")
    payload = dict(versions(), commit=git_commit(), script="benchmarks/attention_host_time.py", rows=rows)
    for d in [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")] + ([out_dir] if out_dir else []):
        with open(os.path.join(d, args.out), "w") as fh:
            json.dump(payload, fh, indent=1)
        if d == out_dir:
            with open(os.path.join(d, "host_profile.txt"), "w") as fh:
                fh.write(s.getvalue())
    print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
