"""Experiment (issue 34, FSDP2 LoRA): the low-rank GEMM against cuBLAS at the FSDP2 run's shapes (8B widths, 8192
tokens per GPU), and launch settings the twelfth session's sweep (16384 tokens, one H100) did not try.

Under FSDP2 (2x H200, twenty-first session call 1) fxfuse's LoRA step spent 171.5 ms a step in
``_lowrank_gemm_kernel`` plus 23.5 ms in the sibling projections' cuBLAS ``addmm_``; Inductor's cuBLAS GEMMs for the
same products took about 164 ms in all. This times each projection's GEMM alone on one GPU: cuBLAS ``mm`` (the
floor), the op's cuBLAS path (``mm(V, U.T)`` then ``addmm_``), fxfuse's kernel as shipped, and the same kernel
launched directly over settings: tile shapes, stages, warps, row-block grouping, persistent or one program per tile, Triton's
warp specialisation of the tile loop (Hopper's producer / consumer warp groups, Triton >= 3.5), and an epilogue
stored in two halves (half the output tile's registers and shared memory live at once).

Run (device machine):  PYTHONPATH=.:benchmarks python3 benchmarks/experiments/lowrank_gemm_sweep.py
(``SWEEP_SETTINGS=a,b``: only those settings; ``SWEEP_SETTINGS=``: cuBLAS and the shipped kernel only).
Writes $OUT/lowrank_gemm_sweep.jsonl (one row per shape: every setting's ms and its error against float64).
With TRITON_INTERPRET=1 on CPU it only checks two settings on tiny fp32 shapes. (The twenty-first session's call 2
ran a copy of the kernel without its bias term; the settings are now launched on fxfuse's kernel itself.)
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
INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def variant(a, b, v, u, b_kn: bool, u_kn: bool, cfg: dict):
    """fxfuse's kernel launched at one setting of its own (no bias), past ``config_for``'s choice."""
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    M, K = a.shape
    N = b.shape[1] if b_kn else b.shape[0]
    RP = dot_pad(v.shape[1])
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    desc = lambda t, blk: TensorDescriptor(t, list(t.shape), list(t.stride()), blk)  # noqa: E731
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(tiles, sm_count(a)) if cfg["persistent"] else tiles
    G._lowrank_gemm_kernel[(programs,)](
        desc(a, [BM, BK]), desc(b, [BK, BN] if b_kn else [BN, BK]), desc(v, [BM, RP]),
        desc(u, [RP, BN] if u_kn else [BN, RP]), desc(c, [BM, BN // 2] if cfg["split"] else [BM, BN]), a, M, N, K,
        BM=BM, BN=BN, BK=BK, RP=RP, B_KN=b_kn, U_KN=u_kn, HAS_BIAS=False, GROUP_M=cfg["group"],
        NUM_PROGRAMS=programs, FLATTEN=cfg["flatten"], WS=cfg["ws"], SPLIT_EPI=cfg["split"],
        num_stages=cfg["stages"], num_warps=cfg["warps"])
    return c


def cfg(BM=128, BN=256, BK=64, stages=3, warps=8, group=8, persistent=True, flatten=True, ws=False, split=False):
    return dict(BM=BM, BN=BN, BK=BK, stages=stages, warps=warps, group=group, persistent=persistent,
                flatten=flatten, ws=ws, split=split)


SETTINGS = {
    "shipped-equivalent": cfg(),
    "per-tile": cfg(persistent=False),
    "no-flatten": cfg(flatten=False),
    "group16": cfg(group=16),
    "group4": cfg(group=4),
    "split-epilogue": cfg(split=True),
    "split-epilogue-4st": cfg(split=True, stages=4),
    "256x128": cfg(BM=256, BN=128),
    "128x128-4st": cfg(BN=128, stages=4),
    "128x128-5st-w4": cfg(BN=128, stages=5, warps=4),
    "ws-w4": cfg(ws=True, flatten=False, warps=4),
    "ws-w8": cfg(ws=True, flatten=False, warps=8),
    "ws-128x128-w4": cfg(BN=128, ws=True, flatten=False, warps=4, stages=4),
    "ws-split-w8": cfg(ws=True, flatten=False, warps=8, split=True),
}


def emit(f, **row):
    print(json.dumps(row), flush=True)
    f.write(json.dumps(row) + "\n")


def shapes(M: int):
    """(name, M, N, K, b_kn, u_kn, rank): a Llama-3-8B layer's LoRA r16 GEMMs as the op launches them. Forward:
    ``x @ W.T + V @ B.T`` (W [N, K], B [N, r]); grad x: ``gy @ W + gV @ A`` (W [K, N], A [r, N]), q/k/v and
    gate/up as groups (the group's ranks side by side; the siblings' base GEMMs are cuBLAS addmm_)."""
    return [("q/o fwd", M, 4096, 4096, False, False, 16), ("k/v fwd", M, 1024, 4096, False, False, 16),
            ("gate/up fwd", M, 14336, 4096, False, False, 16), ("down fwd", M, 4096, 14336, False, False, 16),
            ("qkv gx", M, 4096, 4096, True, True, 48), ("o gx", M, 4096, 4096, True, True, 16),
            ("gate+up gx", M, 4096, 14336, True, True, 32), ("down gx", M, 14336, 4096, True, True, 16)]


# calls of each shape per layer and step (forward: q, o; k, v; gate, up; down; grad x: one each)
PER_LAYER = {"q/o fwd": 2, "k/v fwd": 2, "gate/up fwd": 2, "down fwd": 1, "qkv gx": 1, "o gx": 1, "gate+up gx": 1,
             "down gx": 1}


def main():
    from triton.testing import do_bench
    M = int(os.environ.get("SWEEP_TOKENS", "8192"))
    todo = shapes(M)
    settings = SETTINGS
    if "SWEEP_SETTINGS" in os.environ:  # a comma list of SETTINGS' names; empty: cuBLAS and the shipped kernel only
        settings = {k: SETTINGS[k] for k in os.environ["SWEEP_SETTINGS"].split(",") if k}
    if INTERP:
        todo = [("tiny", 64, 64, 96, False, False, 16), ("ragged gx", 70, 88, 104, True, True, 48)]
        settings = {"tiny": cfg(BM=32, BN=32, BK=32, stages=1, warps=4, group=2, flatten=False),
                    "tiny-split": cfg(BM=32, BN=32, BK=32, stages=1, warps=4, group=2, flatten=False, split=True)}
    f = open(os.path.join(OUT, "lowrank_gemm_sweep.jsonl"), "a")
    if DEV == "cuda":
        emit(f, section="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
             tree=os.environ.get("COMMIT", "?"), tokens=M)
    totals: dict = {}
    for name, M, N, K, b_kn, u_kn, R in todo:
        torch.manual_seed(0)
        dt = torch.float32 if INTERP else torch.bfloat16
        a = torch.randn(M, K, device=DEV, dtype=dt)
        b = torch.randn(*((K, N) if b_kn else (N, K)), device=DEV, dtype=dt) / K ** 0.5
        v = torch.randn(M, R, device=DEV, dtype=dt)
        u = torch.randn(*((R, N) if u_kn else (N, R)), device=DEV, dtype=dt) * 0.02
        ref = G.lowrank_gemm_reference(a, b, v, u, b_kn=b_kn, u_kn=u_kn)
        err = lambda out: float((out.double() - ref).norm() / ref.norm())  # noqa: E731
        bm = b if b_kn else b.t()
        um = u if u_kn else u.t()
        row = dict(section="lowrank_gemm_sweep", shape=name, M=M, N=N, K=K, rank=R, per_layer=PER_LAYER.get(name))
        if not INTERP:
            row["cublas_mm_ms"] = round(do_bench(lambda: torch.mm(a, bm)), 4)
            row["cublas_op_path_ms"] = round(do_bench(lambda: torch.mm(v, um).addmm_(a, bm)), 4)
            row["shipped_ms"] = round(do_bench(lambda: G.lowrank_gemm(a, b, v, u, b_kn=b_kn, u_kn=u_kn)), 4)
            row["shipped_err"] = err(G.lowrank_gemm(a, b, v, u, b_kn=b_kn, u_kn=u_kn))
        for label, c in settings.items():
            try:
                e = err(variant(a, b, v, u, b_kn, u_kn, c))
                res = dict(err=e)
                if not INTERP:
                    res["ms"] = round(do_bench(lambda: variant(a, b, v, u, b_kn, u_kn, c)), 4)
                if e > 1e-2:
                    res["wrong"] = True
            except Exception as ex:  # a setting that does not compile or fit shared memory
                res = dict(error=f"{type(ex).__name__}: {ex}"[:300])
            row[label] = res
        emit(f, **row)
        if not INTERP:
            n = PER_LAYER[name]
            for k in ["cublas_mm_ms", "cublas_op_path_ms", "shipped_ms"] + list(settings):
                val = row[k]
                ms = val if not isinstance(val, dict) else (None if val.get("wrong") else val.get("ms"))
                totals[k] = None if ms is None or totals.get(k, 0.0) is None else totals.get(k, 0.0) + n * ms
    if not INTERP:  # one layer's projections, forward + grad x, as a sum of the shapes' times
        emit(f, section="lowrank_gemm_sweep_layer_ms", **{k: None if v is None else round(v, 3)
                                                           for k, v in totals.items()})


if __name__ == "__main__":
    main()
