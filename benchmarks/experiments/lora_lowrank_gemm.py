"""Experiment (issue 33, LoRA): the adapter's up-projection as one more K step of the base GEMM.

fxfuse's LoRA op forms ``y = x @ W.T + V @ (s B).T`` as cuBLAS ``C.addmm_(x, W.T)`` with ``C = V @ (s B).T`` (and the
backward's ``gx = gy @ W + gV @ A`` the same way): the low-rank product is written to memory once and read back as
the addmm's C operand. This script times a persistent TMA Triton GEMM that adds ``V @ U.T`` (K = r) to its fp32
accumulator after the main K loop, so nothing [N, d_out] is written twice, against cuBLAS ``mm`` (the floor),
``addmm_`` on a precomputed C (what the op does) and the two-call sum. Shapes: q_proj / up_proj at 16384 tokens
(fwd and gx), Llama-3.2-1B's at 8192 tokens.

Run (device machine):  PYTHONPATH=.:benchmarks python3 benchmarks/experiments/lora_lowrank_gemm.py
Writes $OUT/lora_lowrank_gemm.jsonl. With TRITON_INTERPRET=1 on CPU it only checks tiny shapes.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _mm_lowrank_kernel(a_desc, b_desc, v_desc, u_desc, c_desc, M, N, K,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       B_KN: tl.constexpr, HAS_LR: tl.constexpr, GROUP_M: tl.constexpr,
                       NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr):
    """C[M, N] = A[M, K] @ op(B) + V[M, R] @ U[N, R].T; op(B) = B[K, N] if B_KN else B[N, K].T."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    in_group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=FLATTEN):
        group = tile // in_group
        first_m = group * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        om = (first_m + tile % size_m) * BM
        on = ((tile % in_group) // size_m) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BK])
            if B_KN:
                acc = tl.dot(a, b_desc.load([ki * BK, on]), acc)
            else:
                acc = tl.dot(a, b_desc.load([on, ki * BK]).T, acc)
        if HAS_LR:
            acc = tl.dot(v_desc.load([om, 0]), u_desc.load([on, 0]).T, acc)
        c_desc.store([om, on], acc.to(c_desc.dtype))


def mm_lowrank(a, b, v, u, b_kn: bool, cfg):
    BM, BN, BK, stages, warps, flatten = cfg
    M, K = a.shape
    N = b.shape[1] if b_kn else b.shape[0]
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    R = v.shape[1] if v is not None else 16
    nsm = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    desc = lambda t, blk: TensorDescriptor(t, list(t.shape), list(t.stride()), blk)
    a_d = desc(a, [BM, BK])
    b_d = desc(b, [BK, BN] if b_kn else [BN, BK])
    v_d = desc(v, [BM, R]) if v is not None else a_d
    u_d = desc(u, [BN, R]) if u is not None else a_d
    c_d = desc(c, [BM, BN])
    grid = (min(nsm, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    _mm_lowrank_kernel[grid](a_d, b_d, v_d, u_d, c_d, M, N, K, BM=BM, BN=BN, BK=BK, B_KN=b_kn,
                             HAS_LR=v is not None, GROUP_M=8, NUM_SMS=nsm, FLATTEN=flatten,
                             num_stages=stages, num_warps=warps)
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
