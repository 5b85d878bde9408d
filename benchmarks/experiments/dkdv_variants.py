"""Experiment (GPU): variants of the dK/dV kernel's structure at one 8B-heads layer, causal, bf16, against the
production kernel's output and time. Not a library kernel: what it measures decides what goes into
fxfuse/attention/backward.py.

Variants (constexprs of ``_dkdv_exp``):
  DESC  q / dO (and k / v) through TMA tensor descriptors instead of pointer tiles
  FLAT  the G query heads' fully kept blocks walked as one loop of G * n steps (one software pipeline per
        program instead of one per head)
  LONGEST_FIRST  program 0 takes key block 0 (the most query blocks under causal) instead of the last one
Env: S (tokens), VARIANTS ("desc,flat,longest" triples separated by ';', default all desc x flat, shortest first),
CONFIGS_128 / CONFIGS_64 (JSON lists of [BM, BN, warps, stages]).
Run: PYTHONPATH=. python3 benchmarks/experiments/dkdv_variants.py   (rows to $OUT/dkdv_variants.jsonl)
"""
import json
import os
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _load_rows(desc, ptr, b, h, m0, offs_m, offs_d, stride_m, DESC: tl.constexpr, BM: tl.constexpr,
               D: tl.constexpr):
    if DESC:
        return desc.load([b, h, m0, 0]).reshape(BM, D)
    else:
        return tl.load(ptr + (m0 + offs_m)[:, None] * stride_m + offs_d[None, :])


@triton.jit
def _step(dk, dv, k, v, q, do, lse2, Di, offs_n, offs_m, out_mul, MASK: tl.constexpr):
    qkT = tl.dot(k, tl.trans(q))
    s2 = qkT * out_mul
    if MASK:
        s2 = tl.where(offs_n[:, None] <= offs_m[None, :], s2, float("-inf"))
    pT = tl.exp2(s2 - lse2[None, :])
    dv = tl.dot(pT.to(do.dtype), do, dv)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - Di[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _head_block(dk, dv, k, v, Q, DO, LSE, DELTA, dq_desc, ddo_desc, h, m0, S, offs_m0, offs_n, offs_d,
                stride_qh, stride_qm, stride_doh, stride_dom, out_mul, MASK: tl.constexpr, DESC: tl.constexpr,
                BM: tl.constexpr, D: tl.constexpr):
    # one query block of q head h against this program's key block
    offs_m = m0 + offs_m0
    q = _load_rows(dq_desc, Q + h * stride_qh, 0, h, m0, offs_m0, offs_d, stride_qm, DESC, BM, D)
    do = _load_rows(ddo_desc, DO + h * stride_doh, 0, h, m0, offs_m0, offs_d, stride_dom, DESC, BM, D)
    lse2 = tl.load(LSE + h * S + offs_m) * 1.4426950408889634
    Di = tl.load(DELTA + h * S + offs_m)
    return _step(dk, dv, k, v, q, do, lse2, Di, offs_n, offs_m, out_mul, MASK)


@triton.jit(do_not_specialize=['S'])
def _dkdv_exp(Q, K, V, DO, LSE, DELTA, DK, DV, dq_desc, dk_desc, dv_desc, ddo_desc,
              stride_qh, stride_qm, stride_kh, stride_kn, stride_doh, stride_dom,
              H, HKV, G, S, out_mul, scaling,
              D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DESC: tl.constexpr, FLAT: tl.constexpr,
              LONGEST_FIRST: tl.constexpr):
    if LONGEST_FIRST:  # causal: key block 0 meets every query block
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.num_programs(1) - 1 - tl.program_id(1)
    hk = tl.program_id(0)
    start_n = pid_n * BN
    offs_n = start_n + tl.arange(0, BN)
    offs_m0 = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    if DESC:
        k = dk_desc.load([0, hk, start_n, 0]).reshape(BN, D)
        v = dv_desc.load([0, hk, start_n, 0]).reshape(BN, D)
    else:
        k = tl.load(K + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :])
        v = tl.load(V + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :])
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    lo = (start_n // BM) * BM
    full_lo = tl.cdiv(start_n + BN - 1, BM) * BM
    n_full = (S - full_lo) // BM  # S a multiple of BM here
    for g in range(G):  # the diagonal (masked) blocks of each head
        h = hk * G + g
        for m0 in range(lo, full_lo, BM):
            dk, dv = _head_block(dk, dv, k, v, Q, DO, LSE, DELTA, dq_desc, ddo_desc, h, m0, S, offs_m0, offs_n,
                                 offs_d, stride_qh, stride_qm, stride_doh, stride_dom, out_mul, True, DESC, BM, D)
    if FLAT:
        for it in range(G * n_full):
            g = it // n_full
            h = hk * G + g
            m0 = full_lo + (it - g * n_full) * BM
            dk, dv = _head_block(dk, dv, k, v, Q, DO, LSE, DELTA, dq_desc, ddo_desc, h, m0, S, offs_m0, offs_n,
                                 offs_d, stride_qh, stride_qm, stride_doh, stride_dom, out_mul, False, DESC, BM, D)
    else:
        for g in range(G):
            h = hk * G + g
            for m0 in range(full_lo, S, BM):
                dk, dv = _head_block(dk, dv, k, v, Q, DO, LSE, DELTA, dq_desc, ddo_desc, h, m0, S, offs_m0, offs_n,
                                     offs_d, stride_qh, stride_qm, stride_doh, stride_dom, out_mul, False, DESC, BM,
                                     D)
    tl.store(DK + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], (dk * scaling).to(DK.dtype.element_ty))
    tl.store(DV + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], dv.to(DV.dtype.element_ty))


def run_variant(q, k, v, do, lse, delta, BM, BN, warps, stages, desc, flat, longest=False):
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    mk = lambda t, bm: TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, bm, D])
    kern = _dkdv_exp[(Hkv, S // BN)](
        q, k, v, do, lse, delta, dk, dv, mk(q, BM), mk(k, BN), mk(v, BN), mk(do, BM),
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), do.stride(1), do.stride(2),
        Hq, Hkv, Hq // Hkv, S, D ** -0.5 * 1.4426950408889634, D ** -0.5,
        D=D, BM=BM, BN=BN, DESC=desc, FLAT=flat, LONGEST_FIRST=longest, num_warps=warps, num_stages=stages)
    return dk, dv, kern


def main():
    from fxfuse.attention.backward import attention_bwd_triton
    from fxfuse.attention.forward import attention_fwd_triton
    import triton.testing
    S, Hq, Hkv = int(os.environ.get("S", 32768)), 32, 8
    for D in (128, 64):
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda h: torch.randn(1, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v, do = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
        out, lse = attention_fwd_triton(q, k, v, None, D ** -0.5, 0.0, True, 0)
        delta = (out.float() * do.float()).sum(-1)
        ref = attention_bwd_triton(do, q, k, v, None, out, lse, D ** -0.5, 0.0, True, 0)
        cfgs = [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]
        if D == 64:
            cfgs = [(32, 128, 4, 2), (64, 128, 8, 2), (64, 128, 4, 3), (32, 128, 4, 4), (64, 64, 4, 3)]
        cfgs = [tuple(c) for c in json.loads(os.environ.get(f"CONFIGS_{D}", "null") or "null")] or cfgs
        variants = [(d, f, False) for d in (False, True) for f in (False, True)]
        if os.environ.get("VARIANTS"):
            variants = [tuple(bool(int(x)) for x in t.split(",")) for t in os.environ["VARIANTS"].split(";")]
        for cfg in cfgs:
            for desc, flat, longest in variants:
                row = dict(D=D, S=S, config=cfg, desc=desc, flat=flat, longest_first=longest)
                try:
                    dk, dv, kern = run_variant(q, k, v, do, lse, delta, *cfg, desc, flat, longest)
                    row["err_dk"] = float((dk.float() - ref[1].float()).abs().max())
                    row["err_dv"] = float((dv.float() - ref[2].float()).abs().max())
                    ms = triton.testing.do_bench(lambda: run_variant(q, k, v, do, lse, delta, *cfg, desc, flat, longest),
                                                 warmup=10, rep=150, return_mode="median")
                    row.update(ms=round(ms, 3), tflops=round(2 * 4 * S * S * D * Hq / 2 / ms / 1e9),
                               regs=kern.n_regs, spills=kern.n_spills, smem=kern.metadata.shared)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(json.dumps(row), flush=True)
                with open(os.path.join(OUT, "dkdv_variants.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
        del q, k, v, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
