"""The low-rank GEMM compiled for sm_90 without a GPU (Triton's ``ASTSource`` + ``GPUTarget``): what a setting costs in
shared memory and which settings are one binary, on any machine with Triton's NVIDIA backend (a CPU box included).

Writes one JSON line per compile to stdout:
  * the shipped kernel at :data:`CONFIG` (``config_for``'s choice) for ranks 16-64, both layouts: shared bytes, the
    count ``config_for`` fits (``shared_memory_bytes``), the PTX's SHA-1 (the PTX carries source line numbers, so
    digests compare settings of one tree, not trees);
  * the same with ``num_ctas=2`` (two-CTA clusters, as cuBLAS's ``nvjet ... 1x2`` kernels run): compiles or not;
  * with ``--rev REV``: that git revision's kernel compiled with ``warp_specialize`` on and off (the twenty-first
    session's flag, tree ba4b401): whether the two PTX texts are the same.

    python benchmarks/experiments/lowrank_gemm_offline_compile.py --rev ba4b401 > rows.jsonl
(not under TRITON_INTERPRET=1, which replaces Triton's language functions.)
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import triton

from fxfuse.kernels import lowrank_gemm as G


def digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def emit(**row):
    print(json.dumps(dict(row, triton=triton.__version__)), flush=True)


def shipped():
    for rank, kn in ((16, False), (16, True), (32, True), (48, True), (64, True)):
        cfg = G.config_for(2, rank, 232448)
        k = G.compiled_for(rank, kn, kn, cfg)
        emit(what="shipped", rank=rank, layout="grad x" if kn else "forward", setting=cfg, shared=k.metadata.shared,
             counted=G.shared_memory_bytes(cfg, 2, rank), ptx=digest(k.asm["ptx"]))


def two_ctas():
    real = triton.compile

    def with_clusters(src, target=None, options=None):
        return real(src, target=target, options=dict(options, num_ctas=2))
    triton.compile = with_clusters
    try:
        k = G.compiled_for(16, False, False, G.config_for(2, 16, 232448))
        emit(what="num_ctas=2", compiled=True, shared=k.metadata.shared)
    except Exception as e:  # noqa: BLE001
        # the failing MLIR pass is named on stderr (Triton 3.6: ConvertTritonToTritonGPU)
        emit(what="num_ctas=2", compiled=False, error=f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        triton.compile = real


def warp_specialised(rev: str):
    """REV's kernel (its ``warp_specialize=WS`` tile loop), compiled with WS on and off at 8 warps, rank 16."""
    src = subprocess.run(["git", "show", f"{rev}:fxfuse/kernels/lowrank_gemm.py"], capture_output=True, text=True,
                         check=True).stdout
    body = src[src.index("    @triton.jit"):src.index("def _config(")]
    lines = [ln[4:] if ln.startswith("    ") else ln for ln in body.splitlines()]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"lowrank_gemm_{rev}.py")
        with open(path, "w") as f:
            f.write("import triton\nimport triton.language as tl\n\n" + "\n".join(lines) + "\n")
        spec = importlib.util.spec_from_file_location(f"lowrank_gemm_{rev}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out = {}
        for ws in (True, False):  # that revision's shipped setting then: unflattened, whole tiles, rank 16
            cfg = dict(G.CONFIG, FLATTEN=False, SPLIT_EPI=False, num_stages=3, num_warps=8)
            k = G.compiled_for(16, False, False, cfg, kernel=mod._lowrank_gemm_kernel, WS=ws)
            out[ws] = k
            emit(what="warp_specialize", rev=rev, ws=ws, shared=k.metadata.shared, ptx=digest(k.asm["ptx"]),
                 warp_specialize_op_in_ttgir="ttg.warp_specialize" in k.asm["ttgir"])
        emit(what="warp_specialize", rev=rev, same_ptx=out[True].asm["ptx"] == out[False].asm["ptx"])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", help="a git revision whose kernel has the WS constexpr (e.g. ba4b401)")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1")
    shipped()
    two_ctas()
    if a.rev:
        warp_specialised(a.rev)
