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
    with open(os.path.join(OUT, f"profile_{impl}.json"), "w") as f:
        json.dump(dict(impl=impl, gpu_ms_per_step=round(total, 1), rows=rows), f, indent=1)
    print(f"{impl}: {total:.1f} ms of kernels per step")
    for r in rows[:40]:
        print(f"{r['ms']:8.3f} ms {r['calls']:5d}x  {r['kernel']}")


if __name__ == "__main__":
    main()
