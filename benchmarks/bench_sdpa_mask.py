"""SDPA with HF's materialised causal mask vs ``is_causal=True`` (what the ``sdpa_causal_mask`` pass turns the
first into), at Llama-3.2-1B's attention shape (4 x 2048, 32 q / 8 kv heads, head dim 64, bf16), fwd+bwd and fwd,
same ``bench`` as the anchors. Also fxfuse's own Triton attention kernel (no softcap) for scale.

Run (device machine): PYTHONPATH=. python3 benchmarks/bench_sdpa_mask.py    Writes $OUT/sdpa_mask.jsonl.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench, jsonl_emitter, rel  # noqa: E402

from fxfuse.attention.op import softcap_attention  # noqa: E402

emit = jsonl_emitter("sdpa_mask.jsonl")


def main():
    B, H, Hkv, S, D = 4, 32, 8, 2048, 64
    torch.manual_seed(0)
    mk = lambda h: torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(H), mk(Hkv), mk(Hkv)
    go = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(S, S, dtype=torch.bool, device="cuda").tril()[None, None].expand(B, 1, S, S)
    variants = {
        "sdpa, [B,1,S,S] bool causal mask (HF under compile)":
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "sdpa, is_causal=True (after the pass)":
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "fxfuse Triton attention kernel, causal": lambda: softcap_attention(q, k, v, causal=True),
    }
    ref = variants["sdpa, is_causal=True (after the pass)"]().detach()
    emit(section="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, shape=[B, H, Hkv, S, D])
    for name, fn in variants.items():
        err = rel(fn().detach(), ref)

        def step(fn=fn):
            q.grad = k.grad = v.grad = None
            fn().backward(go)
        ms, _ = bench(step)
        with torch.no_grad():
            ms_f, _ = bench(fn)
        emit(section="sdpa_mask", impl=name, fwd_bwd_ms=round(ms, 3), fwd_ms=round(ms_f, 3), rel_err=round(err, 5))


if __name__ == "__main__":
    main()
