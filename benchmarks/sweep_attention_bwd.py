"""Sweep the attention backward's tile configs (dK/dV and dQ kernels) at head dim 128, bf16, one 8B-heads layer
(32 q / 8 kv heads), causal and 8 packed documents at 32k tokens: which config the defaults should be.
Run: python benchmarks/sweep_attention_bwd.py  (rows to $OUT/attn_bwd_sweep.jsonl)"""
import json, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fxfuse.attention.backward import attention_bwd_triton  # noqa: E402
from fxfuse.attention.forward import attention_fwd_triton  # noqa: E402
from fxfuse.attention.launching import DEFAULT_CONFIGS  # noqa: E402
from fxfuse.ops import document_ranges  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
S, Hq, Hkv, D = 32768, 32, 8, 128


def emit(**row):
    with open(os.path.join(OUT, "attn_bwd_sweep.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def time_ms(fn, reps=5):
    fn(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps


g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
k = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
v = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
do = torch.randn(1, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
for layout in ("docs8",):
    dr = document_ranges(torch.arange(S, device="cuda")[None] // (S // 8)) if layout == "docs8" else None
    out, lse = attention_fwd_triton(q, k, v, None, D ** -0.5, 0.0, True, 0, doc_ranges=dr)
    ref = None
    d_dkdv, d_dq = DEFAULT_CONFIGS[(128, 2)]["dkdv"], DEFAULT_CONFIGS[(128, 2)]["dq"]
    grid = [(c, d_dq) for c in [(32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2),
                                (32, 128, 4, 2)]]
    grid += [(d_dkdv, c) for c in [(128, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 2)]]
    for dkdv, dq in grid:
        if True:
            cfg = {"dkdv": dkdv, "dq": dq}
            try:
                fn = lambda: attention_bwd_triton(do, q, k, v, None, out, lse, D ** -0.5, 0.0, True, 0, config=cfg,
                                                  doc_ranges=dr)
                grads = fn()
                if ref is None:
                    ref = grads
                err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, ref))
                emit(layout=layout, S=S, dkdv=dkdv, dq=dq, bwd_ms=round(time_ms(fn), 3), diff_vs_first=err)
            except Exception as e:
                emit(layout=layout, S=S, dkdv=dkdv, dq=dq, error=f"{type(e).__name__}: {str(e)[:160]}")
