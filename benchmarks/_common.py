"""Measurement helpers shared by the GPU benchmark scripts: the same method as ../shared/anchors/anchors_gpu.py,
so fxfuse rows compare with the anchor rows."""
import json
import os
import sys
import time

import torch

# the repository root, so the scripts import fxfuse from the source tree without an install
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMOKE = DEV == "cpu"  # no GPU: the scripts run a tiny smoke version


def bench(fn, warmup=3, reps=10):
    """Median ms of ``fn()`` (triton's do_bench, CUDA events) and peak extra memory (GiB) of one call."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        import triton.testing

        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return ms, (torch.cuda.max_memory_allocated() - base) / 2**30
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return ts[len(ts) // 2], float("nan")


def host_us(fn, n=300, warmup=20):
    """Host microseconds per call of ``fn`` issued back to back, and wall microseconds per call once the GPU has
    caught up (with GPU work per call far below the host's cost, the first is the launch overhead)."""
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    sync()
    wall = (time.perf_counter() - t) / n * 1e6
    return round(host, 1), round(wall, 1)


def rel(a, b):
    """Norm-relative error of ``a`` against ``b`` (in fp32), rounded for JSON."""
    a, b = a.float(), b.float()
    return float(f"{((a - b).norm() / b.norm().clamp_min(1e-30)).item():.2e}")


def jsonl_emitter(filename):
    """``emit(**row)``: print a result row and append it to $OUT/<filename> (the device returns $OUT)."""

    def emit(**row):
        with open(os.path.join(OUT, filename), "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    return emit
