"""Does Triton's warp specialisation on Hopper overlap attention's softmax with its products? A probe.

The thirty-fifth session's SASS reading (attention_notes.md) put the forward's interior iteration at about the
products' time plus the exponentials', as if the two did not overlap within a warpgroup; a source-level lookahead
did not get the overlap in Triton 3.6. FlashAttention-3 gets it below the language: a producer warp loading K/V by
TMA and consumer warpgroups whose wgmma runs beside the other's softmax. Triton has a form of that in
``tl.range(..., warp_specialize=True)`` over tensor-descriptor loads. Before any of it goes into fxfuse's kernel
(masks, documents, GQA, softcap), this probe measures whether it pays on the installed Triton, on the plainest
kernel: the interior loop alone (no masks), one forward, against the same kernel without it, fxfuse's shipped
forward and cuDNN's SDPA, side by side in one process.

Variants (``--variants``):
  ptr          pointer loads, plain ``range`` (what fxfuse's interior loop is)
  desc         on-device tensor descriptors (``tl.make_tensor_descriptor``), plain ``range``
  desc_ws      the same, ``tl.range(..., warp_specialize=True)``
Each over a small config sweep; a config Triton cannot compile is recorded with its error and skipped.

Run (device): PYTHONPATH=. python3 benchmarks/attention_ws_probe.py --S 16384 --dims 128,64
Rows: $OUT/attn_ws_probe.jsonl (one JSON object a line).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import jsonl_emitter  # noqa: E402

emit = jsonl_emitter("attn_ws_probe.jsonl")


@triton.jit
def _online_softmax_step(s, v, acc, l_i, m_i):
    # one key tile of the online softmax (scores s in the log2 domain)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _probe_fwd(Q, K, V, O, S, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, USE_DESC: tl.constexpr, WS: tl.constexpr, H: tl.constexpr, G: tl.constexpr):
    # q, o: [B*H*S, D] rows; k, v: [B*Hkv*S, D] rows (contiguous); one program per (q block, b*h)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    hk = (bh // H) * (H // G) + (bh % H) // G
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = bh.to(tl.int64) * S + start_m
    kv_row0 = hk.to(tl.int64) * S
    if USE_DESC:
        dq = tl.make_tensor_descriptor(Q + q_row * HEAD_DIM, shape=[S - start_m, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
        dk = tl.make_tensor_descriptor(K + kv_row0 * HEAD_DIM, shape=[S, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
        dv = tl.make_tensor_descriptor(V + kv_row0 * HEAD_DIM, shape=[S, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
        q = dq.load([0, 0])
    else:
        q = tl.load(Q + (q_row + tl.arange(0, BLOCK_M))[:, None] * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = start_m if CAUSAL else S  # causal: the interior blocks; the diagonal block follows, masked
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WS):
        if USE_DESC:
            k = dk.load([start_n, 0])
            v = dv.load([start_n, 0])
        else:
            rows = kv_row0 + start_n + offs_n0
            k = tl.load(K + rows[:, None] * HEAD_DIM + offs_d[None, :])
            v = tl.load(V + rows[:, None] * HEAD_DIM + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        acc, l_i, m_i = _online_softmax_step(s, v, acc, l_i, m_i)
    if CAUSAL:
        for start_n in range(start_m, start_m + BLOCK_M, BLOCK_N):
            rows = kv_row0 + start_n + offs_n0
            k = tl.load(K + rows[:, None] * HEAD_DIM + offs_d[None, :])
            v = tl.load(V + rows[:, None] * HEAD_DIM + offs_d[None, :])
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(offs_m[:, None] >= (start_n + offs_n0)[None, :], s, float("-inf"))
            acc, l_i, m_i = _online_softmax_step(s, v, acc, l_i, m_i)
    acc = acc / l_i[:, None]
    tl.store(O + (q_row + tl.arange(0, BLOCK_M))[:, None] * HEAD_DIM + offs_d[None, :], acc.to(O.dtype.element_ty))


def _alloc(size, alignment, stream):  # scratch for on-device tensor descriptors
    return torch.empty(size, device="cuda", dtype=torch.int8)


def probe_fwd(q, k, v, causal, cfg, variant):
    B, H, S, D = q.shape
    Hkv = k.shape[1]
    BM, BN, nw, ns = cfg
    assert S % BM == 0 and BM % BN == 0
    o = torch.empty_like(q)
    use_desc = variant in ("desc", "desc_ws")
    ws = variant == "desc_ws"
    _probe_fwd[(S // BM, B * H)](q, k, v, o, S, D ** -0.5 * 1.4426950408889634, HEAD_DIM=D, BLOCK_M=BM,
                                 BLOCK_N=BN, CAUSAL=causal, USE_DESC=use_desc, WS=ws, H=H, G=H // Hkv,
                                 num_warps=nw, num_stages=ns)
    return o


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=16384)
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--variants", default="ptr,desc,desc_ws")
    ap.add_argument("--configs", default="128,128,8,3;128,64,4,3;128,128,4,2;128,64,8,3;256,128,8,2;128,128,8,2")
    ap.add_argument("--causal", default="0,1")
    a = ap.parse_args()
    triton.set_allocator(_alloc)
    emit(part="env", torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(),
         commit=os.environ.get("COMMIT", ""))
    cfgs = [tuple(int(x) for x in c.split(",")) for c in a.configs.split(";")]
    from fxfuse.attention.forward import attention_fwd_triton
    for D in [int(d) for d in a.dims.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, a.hq, a.S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, a.hkv, a.S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, a.hkv, a.S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        for causal in [bool(int(c)) for c in a.causal.split(",")]:
            flops = 4 * a.S * a.S * D * a.hq / (2 if causal else 1)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            base = dict(D=D, S=a.S, causal=causal)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
            emit(**base, impl="cudnn", ms=ms, tflops=flops / ms / 1e9)
            fx = lambda: attention_fwd_triton(q, k, v, None, D ** -0.5, 0.0, causal, 0)
            err = (fx()[0].float() - ref.float()).abs().max().item()
            ms = median_ms(fx)
            emit(**base, impl="fxfuse", ms=ms, tflops=flops / ms / 1e9, max_err=err)
            for variant in a.variants.split(","):
                for cfg in cfgs:
                    try:
                        o = probe_fwd(q, k, v, causal, cfg, variant)
                        torch.cuda.synchronize()
                        err = (o.float() - ref.float()).abs().max().item()
                        ms = median_ms(lambda: probe_fwd(q, k, v, causal, cfg, variant))
                        emit(**base, impl=variant, cfg=cfg, ms=ms, tflops=flops / ms / 1e9, max_err=err)
                    except Exception as e:  # a config this Triton cannot compile: recorded, skipped
                        emit(**base, impl=variant, cfg=cfg, error=f"{type(e).__name__}: {str(e)[:300]}")
                        traceback.print_exc(limit=2)


if __name__ == "__main__":
    main()
