"""Experiment: the LoRA op's fwd+bwd (q_proj / up_proj, 16384 tokens, r16) with the low-rank GEMM persistent, with
one program per tile, and off (cuBLAS addmm_), beside the base matmul. Prints JSON rows."""
import json

import torch
from triton.testing import do_bench

from fxfuse.kernels import lowrank_gemm as G
from fxfuse.ops.lora_linear import lora_linear

dev = "cuda"
for name, N, din, dout in (("q_proj", 16384, 4096, 4096), ("up_proj", 16384, 4096, 14336)):
    x = torch.randn(N, din, device=dev, dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(dout, din, device=dev, dtype=torch.bfloat16) / din ** 0.5
    A = (torch.randn(16, din, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    B = (torch.randn(dout, 16, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    go = torch.randn(N, dout, device=dev, dtype=torch.bfloat16)
    for p in (0.0, 0.05):
        row = dict(shape=name, p=p, gpu=torch.cuda.get_device_name())
        for label, enabled, schedule in (("persistent", True, "static"), ("per_tile", True, "per_tile"),
                                         ("off", False, "static")):
            G.ENABLED, G.SCHEDULE = enabled, schedule
            row[label] = round(do_bench(lambda: lora_linear(x, W, A, B, 2.0, dropout_p=p).backward(go)), 4)
        xb = x.detach().requires_grad_()
        row["base"] = round(do_bench(lambda: torch.nn.functional.linear(xb, W).backward(go)), 4)
        print(json.dumps(row), flush=True)
G.ENABLED, G.SCHEDULE = True, "static"
