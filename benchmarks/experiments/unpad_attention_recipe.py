"""What the unpadded row's attention recipe costs (issue 31): one attention layer fwd+bwd over one packed row of 8
log-normal documents (Llama-3.2-1B heads, bf16), documents only, documents + an all-true ``key_valid`` (what
unpad_tokens passes; with the kernels' row pairs, ``launching.ROW_PAIRS``, and with the flag variant alone), and documents whose kept padding is encoded in ``doc_ranges`` alone (a kept pad is its
own empty document: start = its index + 1, so no query sees it and it sees nothing), checked against the key_valid
form with those pads marked invalid.

Run (device): PYTHONPATH=. python3 benchmarks/experiments/unpad_attention_recipe.py   -> $OUT/unpad-attn.jsonl
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import DEV, SMOKE, bench, jsonl_emitter, rel  # noqa: E402
from bench_varlen import doc_lengths  # noqa: E402
from fxfuse.attention import launching  # noqa: E402
from fxfuse.attention.op import document_ranges, softcap_attention  # noqa: E402

emit = jsonl_emitter("unpad-attn.jsonl")


def main():
    H, Hkv, D = (32, 8, 64) if not SMOKE else (4, 2, 16)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    for seed in (5, 11):
        lens = doc_lengths(8, seed) if not SMOKE else [5, 9, 3]
        N = sum(lens)
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None].to(DEV)
        docs = document_ranges(doc)
        # the first token of documents 1.. is a kept pad (left padding's label-used pad)
        starts = torch.cumsum(torch.tensor([0] + lens[:-1]), 0).to(DEV)
        pads = starts[1:]
        kv = torch.ones(1, N, dtype=torch.bool, device=DEV)
        kv[0, pads] = False
        g = torch.Generator(device="cpu").manual_seed(seed)
        q = torch.randn(1, H, N, D, generator=g).to(DEV, dt).requires_grad_()
        k = torch.randn(1, Hkv, N, D, generator=g).to(DEV, dt).requires_grad_()
        v = torch.randn(1, Hkv, N, D, generator=g).to(DEV, dt).requires_grad_()
        do = torch.randn(1, H, N, D, generator=g).to(DEV, dt)
        # the dead-pad ranges: document ids where each pad is its own document, then the pad's start moved past it
        seg = torch.zeros(N, dtype=torch.long, device=DEV)
        seg[starts[1:]] += 1
        seg[starts[1:] + 1] += 1
        seg = seg.cumsum(0)[None]
        dead = document_ranges(seg)
        dead[0, 0, pads] = pads.to(torch.int32) + 1
        variants = {"docs": dict(doc_ranges=docs),
                    "docs + key_valid all true": dict(doc_ranges=docs, key_valid=torch.ones_like(kv)),
                    "docs + key_valid all true, flag variant only": dict(doc_ranges=docs, key_valid=torch.ones_like(kv),
                                                                        row_pairs=False),
                    "segments + key_valid pads": dict(doc_ranges=document_ranges(seg), key_valid=kv),
                    "segments, dead pads in ranges": dict(doc_ranges=dead)}
        outs = {}
        for name, kw in variants.items():
            kw = dict(kw)
            launching.ROW_PAIRS = kw.pop("row_pairs", True)  # see fxfuse.attention.launching

            def step(kw=kw):
                o = softcap_attention(q, k, v, causal=True, kernel="fxfuse", **kw)
                o.backward(do)
                return o
            o = step()
            outs[name] = (o.detach().float(), q.grad.float(), k.grad.float(), v.grad.float())
            q.grad = k.grad = v.grad = None
            ms, peak = bench(step)
            q.grad = k.grad = v.grad = None
            emit(tokens=N, docs=len(lens), variant=name, fwd_bwd_ms=round(ms, 3), peak_gib=round(peak, 3))
        launching.ROW_PAIRS = True
        a, b = outs["segments + key_valid pads"], outs["segments, dead pads in ranges"]
        emit(tokens=N, check="dead-pad ranges vs key_valid", out_rel=rel(b[0], a[0]), dq_rel=rel(b[1], a[1]),
             dk_rel=rel(b[2], a[2]), dv_rel=rel(b[3], a[3]), pad_rows_zero=bool((b[0][0, :, pads] == 0).all()))


if __name__ == "__main__":
    main()
