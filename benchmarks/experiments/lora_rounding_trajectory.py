"""Why the LoRA loss moves faster with the low-rank GEMM than in eager PEFT (CPU, float64 simulation; runs in seconds).

A LoRA layer's output early in training is ``y = base + delta`` with ``delta = s * x A^T B^T`` tiny (B starts at zero
and moves by ~lr per step). Stored in bf16, eager PEFT rounds twice: ``round(round(base) + round(delta))``, so any
``|delta|`` under half a bf16 ulp of ``base`` is lost outright; cuBLAS ``addmm_`` with a bf16 C operand measured the
same (its output is 2.85e-3 from the one-rounding result at the 1B shapes, twice bf16's one rounding). The low-rank
GEMM adds ``delta`` to the fp32 accumulator and rounds once: ``round(base + delta)``. Here one LoRA layer fits a random
target with Adam (lr 1e-5) from the same start; the rounding is applied straight-through so the gradients are the
same float64 gradients and only the forward's rounding differs. Observed: float64 2.749e-4 of loss decrease over 12
steps, one rounding 2.677e-4, two roundings 3.28e-5 (eight times less): one rounding follows float64.

Run: python3 benchmarks/experiments/lora_rounding_trajectory.py
"""
import torch
torch.manual_seed(0)
N, d, r, lr = 4096, 512, 16, 1e-5
x = torch.randn(N, d).bfloat16(); W = (torch.randn(d, d) / d**0.5).bfloat16()
t = torch.randn(N, d)  # target
A0 = torch.randn(r, d) / d**0.5
def run(mode):
    A = A0.clone().double().requires_grad_(); B = torch.zeros(d, r, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([A, B], lr=lr)
    out = []
    for _ in range(12):
        base = x.double() @ W.double().t()
        delta = (x.double() @ A.t()) @ B.t() * 2.0
        if mode == "x64":
            y = base + delta
        else:
            # bf16 storage of y: the rounding applied as a straight-through function so gradients are the same
            if mode == "double":   # eager / cuBLAS addmm_: base rounded, then base + delta rounded
                yv = (base.bfloat16().double() + delta.bfloat16().double()).bfloat16().double()
            else:                  # one accumulator: base + delta rounded once
                yv = (base + delta).bfloat16().double()
            y = base + delta + (yv - (base + delta)).detach()
        loss = ((y - t.double()) ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        out.append(round(loss.item(), 7))
    return out
for m in ("x64", "double", "single"):
    L = run(m); print(m, L[0], L[-1], round(L[0]-L[-1], 7))
