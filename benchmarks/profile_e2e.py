"""Where a whole-model training step spends its GPU time: the bench_e2e.py setup (same model, shapes, optimizer)
under torch.profiler, top kernels by total CUDA time per step.

Run (device machine):  PYTHONPATH=. python3 benchmarks/profile_e2e.py lora-fxfuse [llama|gemma2] [B]
Writes $OUT/profile_<impl>.json (rows: kernel, ms per step, calls per step).
"""
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")


def main():
    impl = sys.argv[1] if len(sys.argv) > 1 else "lora-fxfuse"
    fwd, model, opt, ids, cfg = bench_e2e.build(impl, *(sys.argv[2:] or []))

    def step():
        out = fwd(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    n = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    rows = []
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0)
        if t and e.device_type.name == "CUDA":
            rows.append(dict(kernel=e.key[:120], ms=round(t / n / 1e3, 3), calls=e.count // n))
            total += t / n / 1e3
    rows.sort(key=lambda r: -r["ms"])
    # GPU idle time: gaps between consecutive kernels on the timeline (the GPU waiting for the CPU to launch)
    kern = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start), key=lambda t: t[0])
    gaps, busy_end, prev = [], None, None
    for st, en, name in kern:
        if busy_end is not None and st > busy_end:
            gaps.append((st - busy_end, prev, name))
        if busy_end is None or en > busy_end:
            busy_end, prev = en, name
    span = (kern[-1][1] - kern[0][0]) / 1e3 / n if kern else 0.0
    idle = sum(g for g, _, _ in gaps) / 1e3 / n
    gaps.sort(key=lambda t: -t[0])
    by_pair = {}
    for g, a, b in gaps:
        k = f"{a[:50]} -> {b[:50]}"
        by_pair[k] = by_pair.get(k, 0.0) + g / 1e3 / n
    top_pairs = sorted(by_pair.items(), key=lambda kv: -kv[1])[:15]
    with open(os.path.join(OUT, f"profile_{impl}.json"), "w") as f:
        json.dump(dict(impl=impl, gpu_ms_per_step=round(total, 1), span_ms_per_step=round(span, 1),
                       idle_ms_per_step=round(idle, 2), idle_by_kernel_pair=[(k, round(v, 3)) for k, v in top_pairs],
                       rows=rows), f, indent=1)
    print(f"{impl}: {total:.1f} ms of kernels per step; timeline {span:.1f} ms/step, GPU idle {idle:.2f} ms/step")
    for k, v in top_pairs:
        print(f"  idle {v:7.3f} ms/step  {k}")
    for r in rows[:40]:
        print(f"{r['ms']:8.3f} ms {r['calls']:5d}x  {r['kernel']}")


if __name__ == "__main__":
    main()
