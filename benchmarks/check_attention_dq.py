"""GPU check of the backward's two dQ modes (``fxfuse.attention.launching.DQ_IN_DKDV``): dQ from its own kernel
(deterministic) and dQ added atomically by the dK/dV kernel, against float64, beside eager bf16's own distance
from float64 (relative norms; each gradient within 2x of eager's), through the public op, twice per mode (the second call replays
the recorded launches: fxfuse.kernels.launch_cache).

Cases: causal, packed documents, a window, right / left padding (key_valid, fully masked rows), softcap at head
dim 256 (dK and dV in two launches: dQ rides in the dK pass), a mask tensor, head dims 64 / 80 / 128.

Run (device): PYTHONPATH=. python3 benchmarks/check_attention_dq.py; rows to $OUT/attention_dq_check.jsonl.
"""
from __future__ import annotations

import json
import os

import torch

from fxfuse.attention import launching
from fxfuse.attention.reference import attention_reference
from fxfuse.ops import document_ranges, softcap_attention

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
S_ = 1024 if DEV == "cuda" else 40


def emit(**row):
    with open(os.path.join(OUT, "attention_dq_check.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def case(name, B, Hq, Hkv, S, D, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    mk = lambda h: torch.randn(B, h, S, D, device=DEV, generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v, do = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
    kw, ref_kw = dict(causal=True), dict(causal=True)
    if name == "docs":
        ids = (torch.arange(S, device=DEV)[None].expand(B, S) * 7 // S).contiguous()  # 7 ragged-ish documents
        ids = ids + (torch.arange(S, device=DEV)[None] > S // 3).long()
        kw["doc_ranges"] = ref_kw["doc_ranges"] = document_ranges(ids)
    if name == "window":
        kw["window"] = ref_kw["window"] = S // 5
    if name == "padded":
        valid = torch.ones(B, S, dtype=torch.bool, device=DEV)
        valid[0, S - S // 3:] = False
        if B > 1:
            valid[1, :S // 4] = False  # left padding: rows that see no key
        kw["key_valid"] = ref_kw["key_valid"] = valid
    if name == "softcap":
        kw["softcap"] = ref_kw["softcap"] = 50.0
    if name == "mask":
        t = torch.arange(S, device=DEV)
        keep = (t[:, None] >= t[None, :]) & ((t[:, None] - t[None, :]) < S // 2)
        m = torch.zeros(S, S, device=DEV).masked_fill(~keep, float("-inf")).to(torch.bfloat16)[None, None]
        kw, ref_kw = dict(mask=m), dict(mask=m)
    return (q, k, v, do), kw, ref_kw


def rel(x, ref):
    """||x - ref|| / ||ref|| (METHOD.md's measure: max-abs errors of a few bf16 elements are too noisy to rank)."""
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def grads(fn, q, k, v, do, dtype=None):
    qq, kk, vv = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v))
    out = fn(qq, kk, vv)
    return [out.detach(), *torch.autograd.grad(out, (qq, kk, vv), do.to(out.dtype))]


def main():
    rows_bad = 0
    for name, B, Hq, Hkv, D in [("causal", 1, 8, 2, 128), ("docs", 2, 8, 2, 128), ("docs", 1, 8, 8, 64),
                                ("window", 1, 8, 2, 128), ("padded", 2, 8, 2, 128), ("padded", 2, 4, 1, 80),
                                ("softcap", 1, 4, 2, 256), ("mask", 1, 8, 2, 64)]:
        (q, k, v, do), kw, ref_kw = case(name, B, Hq, Hkv, S_, D)
        ref = grads(lambda a, b, c: attention_reference(a, b, c, **ref_kw), q, k, v, do, torch.float64)
        eager = grads(lambda a, b, c: attention_reference(a, b, c, dtype=torch.bfloat16, **ref_kw), q, k, v, do)
        eager_err = [rel(e, r) for e, r in zip(eager, ref)]
        got = {}
        for mode in (False, True):
            launching.DQ_IN_DKDV = mode
            for call in (1, 2):  # the second call replays the first's launches
                got[(mode, call)] = g = grads(lambda a, b, c: softcap_attention(a, b, c, **kw), q, k, v, do)
                err = [rel(x, r) for x, r in zip(g, ref)]
                ok = all(e <= 2 * ee + 1e-6 for e, ee in zip(err, eager_err)) and all(
                    bool(torch.isfinite(x).all()) for x in g)
                rows_bad += not ok
                emit(case=name, B=B, Hq=Hq, Hkv=Hkv, S=S_, D=D, dq_in_dkdv=mode, call=call,
                     err=dict(zip(("out", "dq", "dk", "dv"), err)),
                     eager_err=dict(zip(("out", "dq", "dk", "dv"), eager_err)), ok=ok)
        # the two modes' dq, and the atomic mode's two calls (fp32 sums in another order: bf16 rounding apart)
        dq_sep, dq_a1, dq_a2 = got[(False, 1)][1], got[(True, 1)][1], got[(True, 2)][1]
        emit(case=name, D=D, dq_modes_max_diff=(dq_sep.float() - dq_a1.float()).abs().max().item(),
             dq_atomic_calls_max_diff=(dq_a1.float() - dq_a2.float()).abs().max().item(),
             dk_modes_equal=bool(torch.equal(got[(False, 1)][2], got[(True, 1)][2])))
    launching.DQ_IN_DKDV = None
    emit(summary=True, failed=rows_bad)


if __name__ == "__main__":
    main()
