"""Experiment (issue 34, FSDP2 LoRA): the low-rank GEMM against cuBLAS at the FSDP2 run's shapes (8B widths, 8192
tokens per GPU), over launch settings, with the run-to-run spread measured.

Each projection's GEMM is timed alone on one GPU: cuBLAS ``mm`` (the floor), the op's cuBLAS path (``mm(V, U.T)``
then ``addmm_``), fxfuse's kernel as the op launches it (``config_for``'s setting, replayed launches), and the same
kernel launched directly at other settings (stages, output stored in halves, flattened loop, row-block grouping,
tile shape). Descriptors are built once per setting, so host time stays out of the short launches.

The twenty-first session timed each setting once, one after another, and shipped a 3% difference between two
settings that compile to the same PTX (``compiled_for``). So: ``SWEEP_ROUNDS`` rounds (default 5), each timing every
entry once (``do_bench``'s median), the entries' order rotated each round; a row gives each entry's median over the
rounds and its spread (max - min over the rounds, as a fraction of the median), and each setting's PTX digest, so
two settings that are one binary show as such. ``shipped-direct`` is the shipped setting launched like the others:
against ``shipped`` it shows the launcher's cost and one more same-binary spread.

The rounds' spread on one H200 (twenty-second session) was 2-22% for one entry, cuBLAS's included: larger than the
settings' differences. ``SWEEP_PAIR=name`` instead compares one setting (or ``cublas_mm``, ``cublas_op_path``) with
the shipped one, paired: the two timed
alternately ``SWEEP_PAIRS`` times (default 30; ``do_bench`` median of 20 ms each), and the median and quartiles of
the per-pair ratios (setting / shipped) reported, so a clock that drifts over seconds moves both sides of a pair.

Run (device machine):  PYTHONPATH=.:benchmarks python3 benchmarks/experiments/lowrank_gemm_sweep.py
(``SWEEP_SETTINGS=a,b``: only those settings; ``SWEEP_SETTINGS=``: cuBLAS and the shipped kernel only).
Writes $OUT/lowrank_gemm_sweep.jsonl (one row per shape, then the layer's sums). With TRITON_INTERPRET=1 on CPU it
only checks two settings on tiny fp32 shapes against float64.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from fxfuse.kernels import lowrank_gemm as G
from fxfuse.kernels.triton_support import dot_pad, sm_count, smem_limit

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
ROUNDS = int(os.environ.get("SWEEP_ROUNDS", "5"))


def setting(**over) -> dict:
    """A launch setting: :data:`G.CONFIG` with ``over`` (and ``persistent``)."""
    return {**G.CONFIG, "persistent": True, **over}


SETTINGS = {  # names as of tree 3212f69's successor; at 3212f69 the shipped setting was "unflattened-whole"
    "shipped-direct": setting(),
    "unflattened-whole": setting(FLATTEN=False, SPLIT_EPI=False),  # shipped from the twenty-first session to 3212f69
    "unflattened-halves-4st": setting(FLATTEN=False, num_stages=4),
    "flattened-whole": setting(SPLIT_EPI=False),  # fits 3 stages at rank 16 only
    "group16": setting(GROUP_M=16),
    "per-tile": setting(persistent=False),
    "256x128": setting(BM=256, BN=128),
}


def launcher(a, b, v, u, b_kn: bool, u_kn: bool, cfg: dict):
    """fxfuse's kernel at setting ``cfg`` (no bias) over these operands, descriptors built once: returns (launch,
    output)."""
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    M, K = a.shape
    N = b.shape[1] if b_kn else b.shape[0]
    RP = dot_pad(v.shape[1])
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), blk)
             for t, blk in G._tiles(a, b, v, u, c, b_kn, u_kn, cfg)]
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(tiles, sm_count(a)) if cfg["persistent"] else tiles
    kernel = G._lowrank_gemm_kernel[(programs,)]

    def launch():
        kernel(*descs, a, a, M, N, K, BM=BM, BN=BN, BK=BK, RP=RP, B_KN=b_kn, U_KN=u_kn, HAS_BIAS=False,
               GROUP_M=cfg["GROUP_M"], NUM_PROGRAMS=programs, FLATTEN=cfg["FLATTEN"], SPLIT_EPI=cfg["SPLIT_EPI"],
               DYNAMIC=False, num_stages=cfg["num_stages"], num_warps=cfg["num_warps"])
        return c
    return launch, c


def ptx_digest(rank: int, b_kn: bool, u_kn: bool, cfg: dict) -> str:
    """The first 12 hex digits of the PTX's SHA-1 for this setting, compiled for sm_90 (the program count is a
    constexpr: a per-tile grid's differs, so those are not compared)."""
    try:
        return hashlib.sha1(G.compiled_for(rank, b_kn, u_kn, cfg).asm["ptx"].encode()).hexdigest()[:12]
    except Exception as ex:  # noqa: BLE001
        return f"{type(ex).__name__}"


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


def timed_rounds(entries: dict) -> dict:
    """{name: (median ms, spread)} over ROUNDS rounds of timing every entry once, the order rotated each round."""
    from triton.testing import do_bench
    names = list(entries)
    times = {k: [] for k in names}
    for r in range(ROUNDS):
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(do_bench(entries[k], warmup=10, rep=60, return_mode="median"))
    out = {}
    for k, ts in times.items():
        med = statistics.median(ts)
        out[k] = (round(med, 4), round((max(ts) - min(ts)) / med, 4))
    return out


def paired(a_fn, b_fn, pairs: int) -> dict:
    """b against a, timed alternately ``pairs`` times: the ratios' median and quartiles, and each side's median."""
    from triton.testing import do_bench
    ta, tb = [], []
    for _ in range(pairs):
        ta.append(do_bench(a_fn, warmup=5, rep=20, return_mode="median"))
        tb.append(do_bench(b_fn, warmup=5, rep=20, return_mode="median"))
    ratios = sorted(y / x for x, y in zip(ta, tb))
    q = statistics.quantiles(ratios, n=4)
    return dict(ratio_median=round(statistics.median(ratios), 4), ratio_q1=round(q[0], 4), ratio_q3=round(q[2], 4),
                shipped_ms=round(statistics.median(ta), 4), setting_ms=round(statistics.median(tb), 4), pairs=pairs)


def main_paired(name: str):
    """SWEEP_PAIR: setting ``name`` against the shipped setting, both launched directly, shape by shape."""
    pairs = int(os.environ.get("SWEEP_PAIRS", "30"))
    f = open(os.path.join(OUT, "lowrank_gemm_sweep.jsonl"), "a")
    emit(f, section="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
         tree=os.environ.get("COMMIT", "?"), tokens=int(os.environ.get("SWEEP_TOKENS", "8192")), pair=name)
    sums = {"shipped_ms": 0.0, "setting_ms": 0.0}
    for shape, M, N, K, b_kn, u_kn, R in shapes(int(os.environ.get("SWEEP_TOKENS", "8192"))):
        torch.manual_seed(0)
        a = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(*((K, N) if b_kn else (N, K)), device=DEV, dtype=torch.bfloat16) / K ** 0.5
        v = torch.randn(M, R, device=DEV, dtype=torch.bfloat16)
        u = torch.randn(*((R, N) if u_kn else (N, R)), device=DEV, dtype=torch.bfloat16) * 0.02
        ref = G.lowrank_gemm_reference(a, b, v, u, b_kn=b_kn, u_kn=u_kn)
        shipped = dict(G.config_for(a.element_size(), R, smem_limit(a)), persistent=True)
        fa, _ = launcher(a, b, v, u, b_kn, u_kn, shipped)
        bm, um = (b if b_kn else b.t()), (u if u_kn else u.t())
        if name == "cublas_mm":  # the floor: the base GEMM alone, no low-rank term (its error is the term's size)
            fb = lambda: torch.mm(a, bm)  # noqa: E731
        elif name == "cublas_op_path":  # the op's path without the kernel: mm(V, U) then addmm_
            fb = lambda: torch.mm(v, um).addmm_(a, bm)  # noqa: E731
        else:
            fb, _ = launcher(a, b, v, u, b_kn, u_kn, SETTINGS[name])
        errs = [float((fn().double() - ref).norm() / ref.norm()) for fn in (fa, fb)]
        row = dict(section="lowrank_gemm_pair", shape=shape, setting=name, per_layer=PER_LAYER[shape],
                   shipped_err=errs[0], setting_err=errs[1], **paired(fa, fb, pairs))
        for k in sums:
            sums[k] += PER_LAYER[shape] * row[k]
        emit(f, **row)
    emit(f, section="lowrank_gemm_pair_layer_ms", setting=name, **{k: round(v, 3) for k, v in sums.items()})


def main():
    if os.environ.get("SWEEP_PAIR"):
        return main_paired(os.environ["SWEEP_PAIR"])
    M = int(os.environ.get("SWEEP_TOKENS", "8192"))
    todo = shapes(M)
    settings = SETTINGS
    if "SWEEP_SETTINGS" in os.environ:  # a comma list of SETTINGS' names; empty: cuBLAS and the shipped kernel only
        settings = {k: SETTINGS[k] for k in os.environ["SWEEP_SETTINGS"].split(",") if k}
    if INTERP:
        todo = [("tiny", 64, 64, 96, False, False, 16), ("ragged gx", 70, 88, 104, True, True, 48)]
        tiny = dict(BM=32, BN=32, BK=32, num_stages=1, num_warps=4, GROUP_M=2)
        settings = {"tiny": setting(**tiny), "tiny-halves": setting(**tiny, SPLIT_EPI=True)}
    f = open(os.path.join(OUT, "lowrank_gemm_sweep.jsonl"), "a")
    if DEV == "cuda":
        emit(f, section="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
             tree=os.environ.get("COMMIT", "?"), tokens=M, rounds=ROUNDS)
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
        entries = {}
        if not INTERP:
            shipped_cfg = G.config_for(a.element_size(), R, smem_limit(a))
            row["shipped_setting"] = {k: shipped_cfg[k] for k in ("num_stages", "SPLIT_EPI", "FLATTEN")}
            row["shipped_err"] = err(G.lowrank_gemm(a, b, v, u, b_kn=b_kn, u_kn=u_kn))
            entries["cublas_mm"] = lambda: torch.mm(a, bm)
            entries["cublas_op_path"] = lambda: torch.mm(v, um).addmm_(a, bm)
            entries["shipped"] = lambda: G.lowrank_gemm(a, b, v, u, b_kn=b_kn, u_kn=u_kn)
            row["shipped_ptx"] = ptx_digest(R, b_kn, u_kn, shipped_cfg)
        for label, c in settings.items():
            try:
                launch, _ = launcher(a, b, v, u, b_kn, u_kn, c)
                e = err(launch())
                row[label] = dict(err=e)
                if e > 1e-2:
                    row[label]["wrong"] = True
                elif not INTERP:
                    entries[label] = launch
                    row[label]["ptx"] = ptx_digest(R, b_kn, u_kn, c)
            except Exception as ex:  # a setting that does not compile or fit shared memory
                row[label] = dict(error=f"{type(ex).__name__}: {ex}"[:300])
        if not INTERP:
            for k, (ms, spread) in timed_rounds(entries).items():
                if k in settings:
                    row[k].update(ms=ms, spread=spread)
                else:
                    row[f"{k}_ms"], row[f"{k}_spread"] = ms, spread
        emit(f, **row)
        if not INTERP:
            n = PER_LAYER[name]
            for k in ["cublas_mm", "cublas_op_path", "shipped"] + list(settings):
                val = row.get(k, row.get(f"{k}_ms"))
                ms = val if not isinstance(val, dict) else val.get("ms")
                totals[k] = None if ms is None or totals.get(k, 0.0) is None else totals.get(k, 0.0) + n * ms
    if not INTERP:  # one layer's projections, forward + grad x, as a sum of the shapes' medians
        emit(f, section="lowrank_gemm_sweep_layer_ms", **{k: None if v is None else round(v, 3)
                                                           for k, v in totals.items()})


if __name__ == "__main__":
    main()
