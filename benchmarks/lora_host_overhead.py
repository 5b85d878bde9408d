"""Host (CPU) time per call of the LoRA op and of its pieces, on the GPU machine.

The whole-model LoRA profile showed the GPU idle between the op's small kernels (the host launching them is
slower than the GPU running them at k/v-projection sizes). This measures where the host time goes: calls are
issued back to back with tiny token counts (GPU work per call far below the host cost), timed with
perf_counter and one synchronize at the end. Writes $OUT/lora_host_overhead.jsonl.

Run (device):  PYTHONPATH=. python3 benchmarks/lora_host_overhead.py   (on CPU: a smoke run of the same calls)
"""
from __future__ import annotations


import torch

from _common import DEV, host_us, jsonl_emitter

import fxfuse  # noqa: F401  (registers the ops)
from fxfuse.kernels import lora_linear as K

emit = jsonl_emitter("lora_host_overhead.jsonl")


def main():
    N, din, dout, r, p = 128, 2048, 2048, 16, 0.05
    dt = torch.bfloat16
    x = torch.randn(N, din, device=DEV, dtype=dt)
    W = torch.randn(dout, din, device=DEV, dtype=dt)
    A = torch.randn(r, din, device=DEV)        # PEFT's fp32 adapters on a bf16 model
    B = torch.randn(dout, r, device=DEV)
    seeds = K.draw_seeds(1, x.device)
    (y,), V = torch.ops.fxfuse.lora_linear_fwd(x, [W], [], [-1], A, [B], seeds, [r], [1], [2.0], [p])
    gy = torch.randn_like(y)
    Ab = A.to(dt)
    Vb = torch.empty(N, r, device=DEV, dtype=dt)
    cases = {
        "op fwd (torch.ops.fxfuse.lora_linear_fwd)":
            lambda: torch.ops.fxfuse.lora_linear_fwd(x, [W], [], [-1], A, [B], seeds, [r], [1], [2.0], [p]),
        "op bwd (torch.ops.fxfuse.lora_linear_bwd)":
            lambda: torch.ops.fxfuse.lora_linear_bwd([gy], x, [W], A, [B], V, seeds, [r], [1], [2.0], [p],
                                                     True, False, False, True, True),
        "K.lora_forward (no dispatcher)": lambda: K.lora_forward(x, [W], [None], A, [B], seeds, [r], [1], [2.0], [p]),
        "K.lora_backward (no dispatcher)": lambda: K.lora_backward([gy], x, [W], A, [B], V, seeds, [r], [1], [2.0],
                                                                   [p], True, False, False, True, True),
        "Triton down kernel launch": lambda: K._down_dropout(x, Ab, Vb, seeds, 1, r, 2.0, p),
        "A.to(bf16)": lambda: A.to(dt),
        "torch.mm": lambda: torch.mm(x, W.t()),
        "x.new_empty": lambda: x.new_empty((N, r)),
        "draw_seeds": lambda: K.draw_seeds(1, x.device),
    }
    for name, fn in cases.items():
        host, wall = host_us(fn)
        emit(section="lora_host", case=name, host_us_per_call=host, wall_us_per_call=wall, N=N)


if __name__ == "__main__":
    main()
