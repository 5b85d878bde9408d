"""Where the fused linear + cross-entropy op's time goes on the GPU (companion to bench_lce.py).

For each lm-head shape and variant it prints and writes (``$OUT/profile_lce.jsonl``):
  * the do_bench median of one forward + backward (same inputs and method as bench_lce.py),
  * the CUDA kernel time per step by kernel, from torch.profiler (3 steps), and the sum,
  * the peak extra memory of the forward and of the backward separately (eager), which shows whether the
    autograd engine copies the gradients computed in the forward (AccumulateGrad clones a gradient it cannot
    steal).

Variants: chunk budget (``chunk_bytes``), eager vs torch.compile.
Run (device):  PYTHONPATH=. python3 benchmarks/profile_lce.py [gemma2-2b llama3-8b]
"""
from __future__ import annotations

import math
import sys
from collections import defaultdict

import torch

from _common import DEV, SMOKE, bench, jsonl_emitter

from fxfuse.kernels import linear_cross_entropy as K
from fxfuse.ops.linear_cross_entropy import linear_cross_entropy

emit = jsonl_emitter("profile_lce.jsonl")
SHAPES = {"llama3-8b": (8192, 4096, 128256, None), "gemma2-2b": (8192, 2304, 256000, 30.0)}


def kernel_table(step, n=3):
    """CUDA kernel time per step by kernel name (ms), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    step(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:90]] += getattr(e, "device_time_total", 0.0) / 1e3 / n
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def phase_peaks(fn, h, W, y):
    """Peak extra GiB of the forward and of the backward, measured separately (grads set to None first)."""
    h.grad = None; W.grad = None
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    loss = fn(h, W, y)
    torch.cuda.synchronize()
    fwd = (torch.cuda.max_memory_allocated() - base) / 2**30
    mid = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    bwd = (torch.cuda.max_memory_allocated() - mid) / 2**30
    after = (torch.cuda.memory_allocated() - base) / 2**30
    return round(fwd, 3), round(bwd, 3), round(after, 3)


def main(names):
    for name in names:
        N, D, V, cap = SHAPES[name]
        if SMOKE:
            N, D, V = 256, 64, 1000
        torch.manual_seed(0)
        h = (torch.randn(N, D, device=DEV, dtype=torch.bfloat16) * 0.5).requires_grad_()
        W = (torch.randn(V, D, device=DEV, dtype=torch.bfloat16) / math.sqrt(D)).requires_grad_()
        y = torch.randint(0, V, (N,), device=DEV)
        y[::7] = -100
        ref = None
        # (The two-stream variant -- row kernel of one half-chunk beside the other half's matmul -- measured
        #  slower: the row kernel ran at half speed beside cuBLAS; see lce_notes.md. Removed.)
        variants = [("default 256 MiB", {}, False), ("512 MiB", dict(chunk_bytes=512 << 20), False),
                    ("1 GiB", dict(chunk_bytes=1 << 30), False), ("default 256 MiB, compiled", {}, True)]
        for vname, kw, compiled in variants:
            fn = lambda h, W, y, kw=kw: linear_cross_entropy(h, W, y, softcap=cap, **kw)  # noqa: E731
            if compiled:
                torch._dynamo.reset()
                fn = torch.compile(fn)

            def step():
                h.grad = None; W.grad = None
                fn(h, W, y).backward()

            try:
                step()
                if ref is None:
                    ref = (h.grad.float().clone(), W.grad.float().clone())
                gh_rel = float(((h.grad.float() - ref[0]).norm() / ref[0].norm()).item())
                gw_rel = float(((W.grad.float() - ref[1]).norm() / ref[1].norm()).item())
                ms, peak = bench(step)
                row = dict(section="profile_lce", shape=name, variant=vname, ms=round(ms, 3), peak_gib=round(peak, 3),
                           gh_vs_default=float(f"{gh_rel:.2e}"), gw_vs_default=float(f"{gw_rel:.2e}"))
                if DEV == "cuda":
                    row["fwd_bwd_after_gib"] = phase_peaks(fn, h, W, y)
                    kt = kernel_table(step)
                    row["gpu_ms"] = round(sum(kt.values()), 3)
                    row["kernels"] = {k: round(v, 3) for k, v in list(kt.items())[:10]}
                emit(**row)
            except Exception as e:  # noqa: BLE001
                emit(section="profile_lce", shape=name, variant=vname, error=f"{type(e).__name__}: {str(e)[:300]}")
        del h, W, y
        if DEV == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("-")] or ["gemma2-2b", "llama3-8b"])
