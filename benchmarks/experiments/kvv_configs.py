"""Which kernel configs the key-padding (HAS_KVV) variants of the attention kernels want on the H200 (issue 31): ptxas
for sm_90a shows the dQ kernel at head dim 64 spilling 472 bytes with key flags against 60 without (the forward 28
against 0) at the default (128, 64, 4 warps, 3 stages); 8 warps or smaller tiles spill nothing. Times the forward and
the backward of one layer (Llama-3.2-1B / Llama-3-8B heads, bf16) over one packed row of 8 documents with and without
an all-true key_valid, per candidate config.

Run (device): PYTHONPATH=. python3 benchmarks/experiments/kvv_configs.py   -> $OUT/kvv-configs.jsonl
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import DEV, SMOKE, bench, jsonl_emitter  # noqa: E402
from bench_varlen import doc_lengths  # noqa: E402
from fxfuse.attention.backward import attention_bwd_triton  # noqa: E402
from fxfuse.attention.forward import attention_fwd_triton  # noqa: E402
from fxfuse.attention.op import document_ranges  # noqa: E402

emit = jsonl_emitter("kvv-configs.jsonl")
CANDIDATES = {"fwd": [None, (128, 64, 8, 3), (128, 64, 4, 2), (64, 64, 4, 3)],
              "dq": [None, (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3)]}


def main():
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    lens = doc_lengths(8, 11) if not SMOKE else [20, 30]
    N = sum(lens)
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None].to(DEV)
    docs = document_ranges(doc)
    for H, Hkv, D in ((32, 8, 64), (32, 8, 128)) if not SMOKE else ((4, 2, 16),):
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, h, N, D, generator=g).to(DEV, dt) for h in (H, Hkv, Hkv, H))
        for kv in (None, torch.ones(1, N, dtype=torch.bool, device=DEV)):
            for kind in ("fwd", "dq"):
                for cfg in CANDIDATES[kind]:
                    over = {kind: cfg} if cfg else None
                    out, lse = attention_fwd_triton(q, k, v, None, D ** -0.5, 0.0, True, 0, config=over,
                                                    doc_ranges=docs, key_valid=kv)
                    if kind == "fwd":
                        fn = lambda: attention_fwd_triton(q, k, v, None, D ** -0.5, 0.0, True, 0,  # noqa: E731
                                                          config=over, doc_ranges=docs, key_valid=kv)
                    else:
                        fn = lambda: attention_bwd_triton(do, q, k, v, None, out, lse, D ** -0.5, 0.0,  # noqa: E731
                                                          True, 0, config=over, doc_ranges=docs, key_valid=kv)
                    try:
                        ms, _ = bench(fn)
                        emit(D=D, tokens=N, key_valid=kv is not None, kernel=kind if kind == "fwd" else "bwd (dq varied)",
                             config=list(cfg) if cfg else "default", ms=round(ms, 4))
                    except Exception as e:
                        emit(D=D, key_valid=kv is not None, kernel=kind, config=list(cfg) if cfg else "default",
                             error=f"{type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
