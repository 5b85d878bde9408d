"""Diagnostic: LoRA forward / grad x with the low-rank GEMM on against off (cuBLAS addmm_) at the Llama-3.2-1B
shapes the e2e step uses (single projections and q/k/v, gate/up groups), with a LoRA term as large as the base
term, repeated to catch a nondeterministic tile; as shipped (the flattened loop, output in halves) and with the setting
shipped before (unflattened, whole output tiles)."""
import json

import torch

from fxfuse.kernels import lora_linear as K
from fxfuse.kernels import lowrank_gemm as G

torch.manual_seed(0)
dev = "cuda"
N = 8192
cases = [("q single", 2048, (2048,)), ("k single", 2048, (512,)), ("qkv group", 2048, (2048, 512, 512)),
         ("gate/up group", 2048, (8192, 8192)), ("down single", 8192, (2048,))]
shipped = dict(G.CONFIG)
for setting, cfg in (("shipped", shipped), ("unflattened, whole tiles", dict(shipped, FLATTEN=False, SPLIT_EPI=False))):
    G.CONFIG.update(cfg)
    G.forget_launches()
    for name, din, douts in cases:
        for p in (0.0, 0.05):
            r = 16
            n = len(douts)
            x = torch.randn(N, din, device=dev, dtype=torch.bfloat16)
            Ws = [torch.randn(d, din, device=dev, dtype=torch.bfloat16) / din ** 0.5 for d in douts]
            A = torch.randn(n * r, din, device=dev, dtype=torch.bfloat16) / din ** 0.5
            Bs = [torch.randn(d, r, device=dev, dtype=torch.bfloat16) / r ** 0.5 for d in douts]
            seeds = K.draw_seeds(n, dev)
            args = ([r] * n, [1] * n, [2.0] * n, [p] * n)
            gys = [torch.randn(N, d, device=dev, dtype=torch.bfloat16) for d in douts]
            res = {}
            for on in (False, True):
                G.ENABLED = on
                outs = []
                for rep in range(3):
                    ys, V = K.lora_forward(x, Ws, [None] * n, A, Bs, seeds, *args)
                    gx = K.lora_backward(gys, x, Ws, A, Bs, V, seeds, *args, True, False, False, False, False)[0]
                    outs.append((ys, V, gx))
                res[on] = outs
            off = res[False][0]
            row = dict(case=name, p=p, setting=setting)
            for j in range(n):
                ref = off[0][j].double()
                lr = (off[1][:, j * r:(j + 1) * r].double() @ Bs[j].double().t())
                row[f"y{j}_on_vs_off"] = max(((o[0][j].double() - ref).norm() / ref.norm()).item() for o in res[True])
                row[f"y{j}_lr_share"] = (lr.norm() / ref.norm()).item()
                row[f"y{j}_on_vs_x64"] = ((res[True][0][0][j].double() - (x.double() @ Ws[j].double().t() + lr)).norm()
                                          / ref.norm()).item()
            gref = off[2].double()
            row["gx_on_vs_off"] = max(((o[2].double() - gref).norm() / gref.norm()).item() for o in res[True])
            print(json.dumps(row), flush=True)
G.ENABLED = True
G.CONFIG.update(shipped)
