"""Experiment (issue 33, LoRA): the adapter's up-projection as one more K step of the base GEMM.

fxfuse's LoRA op forms ``y = x @ W.T + V @ (s B).T`` as cuBLAS ``C.addmm_(x, W.T)`` with ``C = V @ (s B).T`` (and the
backward's ``gx = gy @ W + gV @ A`` the same way): the low-rank product is written to memory once and read back as
the addmm's C operand. This script times the persistent TMA Triton GEMM (now ``fxfuse/kernels/lowrank_gemm.py``) that adds ``V @ U.T`` (K = r) to its fp32
accumulator after the main K loop, so nothing [N, d_out] is written twice, against cuBLAS ``mm`` (the floor),
``addmm_`` on a precomputed C (what the op does) and the two-call sum. Shapes: q_proj / up_proj at 16384 tokens
(fwd and gx), Llama-3.2-1B's at 8192 tokens.

Run (device machine):  PYTHONPATH=.:benchmarks python3 benchmarks/experiments/lora_lowrank_gemm.py
Writes $OUT/lora_lowrank_gemm.jsonl. With TRITON_INTERPRET=1 on CPU it only checks tiny shapes.
"""
from __future__ import annotations

import json
import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from fxfuse.kernels import lowrank_gemm as G
from fxfuse.kernels.triton_support import dot_pad, sm_count

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def mm_lowrank(a, b, v, u, b_kn: bool, cfg):
    """fxfuse's kernel (fxfuse/kernels/lowrank_gemm.py; the sweep's first version of it lived here) at one launch
    setting; v None: the plain GEMM (a zero rank-16 term)."""
    BM, BN, BK, stages, warps, flatten = cfg
    M, K = a.shape
    N = b.shape[1] if b_kn else b.shape[0]
    if v is None:
        v, u = a.new_zeros(M, 16), a.new_zeros(N, 16)
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    R = v.shape[1]
    desc = lambda t, blk: TensorDescriptor(t, list(t.shape), list(t.stride()), blk)  # noqa: E731
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(tiles, sm_count(a))
    G._lowrank_gemm_kernel[(programs,)](
        desc(a, [BM, BK]), desc(b, [BK, BN] if b_kn else [BN, BK]), desc(v, [BM, dot_pad(R)]),
        desc(u, [BN, dot_pad(R)]), desc(c, [BM, BN]), a, a, M, N, K, BM=BM, BN=BN, BK=BK, RP=dot_pad(R), B_KN=b_kn,
        U_KN=False, HAS_BIAS=False, GROUP_M=8, NUM_PROGRAMS=programs, FLATTEN=flatten, SPLIT_EPI=False,
        DYNAMIC=False, num_stages=stages,
        num_warps=warps)
    return c


CONFIGS = [(128, 256, 64, 3, 8, True), (128, 256, 64, 3, 8, False), (128, 128, 64, 4, 8, True),
           (128, 128, 64, 4, 4, True), (256, 128, 64, 3, 8, True), (128, 128, 128, 3, 8, True),
           (128, 256, 128, 2, 8, True)]


def emit(f, **row):
    print(json.dumps(row), flush=True)
    f.write(json.dumps(row) + "\n")


def main():
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    # (name, M tokens, N out, K in, B layout [K, N]?): fwd y = x @ W.T (W [N, K]); gx = gy @ W (W [K, N])
    shapes = [("q_proj fwd", 16384, 4096, 4096, False), ("q_proj gx", 16384, 4096, 4096, True),
              ("up_proj fwd", 16384, 14336, 4096, False), ("up_proj gx", 16384, 4096, 14336, True),
              ("1b q fwd", 8192, 2048, 2048, False), ("1b up fwd", 8192, 8192, 2048, False),
              ("1b down fwd", 8192, 2048, 8192, False), ("1b up gx", 8192, 2048, 8192, True)]
    configs = CONFIGS
    if interp:
        shapes, configs = [("tiny", 64, 64, 96, False), ("ragged", 70, 88, 104, False), ("ragged gx", 70, 88, 104, True)], [(32, 32, 32, 2, 4, False)]
    R = 16
    f = open(os.path.join(OUT, "lora_lowrank_gemm.jsonl"), "a")
    if DEV == "cuda":
        emit(f, section="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
             tree=os.environ.get("TREE", "?"))
    for name, M, N, K, b_kn in shapes:
        torch.manual_seed(0)
        dt = torch.float32 if interp else torch.bfloat16  # the interpreter (numpy) has no bf16
        x = torch.randn(M, K, device=DEV, dtype=dt)
        W = torch.randn(N, K, device=DEV, dtype=dt) / K ** 0.5
        Wkn = W.t().contiguous() if b_kn else None  # gx's B operand is W [d_out, d_in] = [K, N] here
        V = torch.randn(M, R, device=DEV, dtype=dt)
        U = torch.randn(N, R, device=DEV, dtype=dt) * 0.02
        Bop = Wkn if b_kn else W
        mmB = Bop if b_kn else W.t()
        ref = (x.double() @ mmB.double() + V.double() @ U.double().t())
        row = dict(section="lowrank_gemm", shape=name, M=M, N=N, K=K, r=R)
        if not interp:
            from triton.testing import do_bench
            row["mm_ms"] = round(do_bench(lambda: torch.mm(x, mmB)), 4)
            C = torch.mm(V, U.t())
            row["addmm_on_C_ms"] = round(do_bench(lambda: C.clone().addmm_(x, mmB)) - do_bench(lambda: C.clone()), 4)
            row["op_path_ms"] = round(do_bench(lambda: torch.mm(V, U.t()).addmm_(x, mmB)), 4)
            row["op_path_err"] = float(((torch.mm(V, U.t()).addmm_(x, mmB).double() - ref).norm() / ref.norm()))
        best = None
        for cfg in configs:
            try:
                out = mm_lowrank(x, Bop, V, U, b_kn, cfg)
                err = float((out.double() - ref).norm() / ref.norm())
                res = dict(cfg=list(cfg), err=err)
                if not interp:
                    res["lr_ms"] = round(do_bench(lambda: mm_lowrank(x, Bop, V, U, b_kn, cfg)), 4)
                    res["plain_ms"] = round(do_bench(lambda: mm_lowrank(x, Bop, None, None, b_kn, cfg)), 4)
                    if best is None or res["lr_ms"] < best["lr_ms"]:
                        best = res
                row.setdefault("configs", []).append(res)
                assert err < 1e-2, (name, cfg, err)
            except Exception as e:  # a config that does not fit shared memory / registers
                row.setdefault("configs", []).append(dict(cfg=list(cfg), error=f"{type(e).__name__}: {e}"[:200]))
        row["best"] = best
        emit(f, **row)


if __name__ == "__main__":
    main()
