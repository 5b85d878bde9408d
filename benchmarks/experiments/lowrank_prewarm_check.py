"""The low-rank GEMM's background warm-up on one GPU: one Llama-3-8B layer's LoRA projections (q/k/v siblings, o,
gate/up siblings, down; rank 16, dropout 0, 8192 tokens, bf16), forward in order, ``--gap`` seconds of other host
work (the rest of a model's forward and its backward graph's compile), then the backward in reverse order. Prints
one JSON line: every Triton compile (kernel, thread, seconds), the backward's wall time, and a checksum of the
gradients (equal with the warm-up on and off: the same kernels run).

    rm -rf ~/.triton/cache; FXFUSE_TRITON_PREWARM=0 python benchmarks/experiments/lowrank_prewarm_check.py
    rm -rf ~/.triton/cache; FXFUSE_TRITON_PREWARM=1 python benchmarks/experiments/lowrank_prewarm_check.py
"""
import argparse
import json
import os
import threading
import time

import torch
import triton.compiler

from fxfuse.kernels import lora_linear as K

compiles = []
_compile = triton.compiler.compile


def _timed(src, *a, **k):
    t = time.perf_counter()
    try:
        return _compile(src, *a, **k)
    finally:
        compiles.append((getattr(getattr(src, "fn", None), "__name__", "?"), threading.current_thread().name,
                         round(time.perf_counter() - t, 2)))


triton.compiler.compile = _timed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--gap", type=float, default=2.0, help="seconds of host work between forward and backward")
    a = ap.parse_args()
    dev, dt, r, N = "cuda", torch.bfloat16, 16, a.tokens
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, device=dev, generator=g) * 0.02).to(dt)  # noqa: E731
    # (din, douts) per call site: q/k/v, o, gate/up, down
    sites = [(4096, (4096, 1024, 1024)), (4096, (4096,)), (4096, (14336, 14336)), (14336, (4096,))]
    saved = []
    t0 = time.perf_counter()
    for din, douts in sites:
        n = len(douts)
        x, Ws = rnd(N, din), [rnd(d, din) for d in douts]
        A, Bs = rnd(n * r, din), [rnd(d, r) for d in douts]
        seeds = K.draw_seeds(n, dev)
        adapters = ([r] * n, [1] * n, [2.0] * n, [0.0] * n)
        ys, V = K.lora_forward(x, Ws, [None] * n, A, Bs, seeds, *adapters)
        saved.append((x, Ws, A, Bs, V, seeds, adapters, [rnd(*y.shape) for y in ys]))
    torch.cuda.synchronize()
    t_fwd = time.perf_counter() - t0
    time.sleep(a.gap)
    t1 = time.perf_counter()
    check = 0.0
    for x, Ws, A, Bs, V, seeds, adapters, gys in reversed(saved):
        gx, _, _, ga, gbs = K.lora_backward(gys, x, Ws, A, Bs, V, seeds, *adapters, True, False, False, True, True)
        check += float(gx.float().abs().sum() + ga.float().abs().sum() + sum(b.float().abs().sum() for b in gbs))
    torch.cuda.synchronize()
    t_bwd = time.perf_counter() - t1
    print(json.dumps(dict(prewarm=os.environ.get("FXFUSE_TRITON_PREWARM", "1") != "0", forward_s=round(t_fwd, 2),
                          backward_s=round(t_bwd, 2), compiles=compiles, checksum=check,
                          device=torch.cuda.get_device_name(), torch=torch.__version__,
                          triton=triton.__version__)))


if __name__ == "__main__":
    main()
