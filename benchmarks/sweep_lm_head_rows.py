"""Launch settings of the lm-head row kernels on one logits chunk (the kernels alone, no matmuls): BLOCK_V x
num_warps for the log-probs op's forward (statistics + log-probs + entropy) and gradient kernels, and the LCE row
kernel (forward + gradient), at the chunk the default 256 MiB budget gives at the Llama-3-8B head (1046 x 128256,
bf16). Effective bandwidth counts one read per pass and one write for the gradient kernels.

Run (device machine):  PYTHONPATH=. python3 benchmarks/sweep_lm_head_rows.py
Writes $OUT/sweep_lm_head_rows.jsonl.
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import DEV, SMOKE, jsonl_emitter  # noqa: E402

from fxfuse.kernels import linear_cross_entropy as LCE  # noqa: E402
from fxfuse.kernels import linear_log_probs as LP  # noqa: E402

emit = jsonl_emitter("sweep_lm_head_rows.jsonl")


def timed(fn):
    if DEV != "cuda":
        fn()
        return float("nan")
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def main():
    C, V = (1046, 128256) if not SMOKE else (8, 300)
    torch.manual_seed(0)
    logits = (torch.randn(C, V, device=DEV) * 2.0).to(torch.bfloat16)
    buf = logits.clone()
    index = torch.randint(0, V, (C,), device=DEV)
    f32 = dict(dtype=torch.float32, device=DEV)
    logp, ent, lse, ez = torch.empty(C, **f32), torch.empty(C, **f32), torch.empty(2, C, **f32), torch.empty(C, **f32)
    g1, g2 = torch.randn(C, **f32), torch.randn(C, **f32)
    g_mean = torch.full((), 1.0 / C, **f32)  # the LCE kernel's 0-dim "mean" weight
    loss = torch.empty(C, **f32)
    bytes_chunk = C * V * 2
    blocks = (2048, 4096, 8192) if not SMOKE else (128,)
    warps = (4, 8, 16, 32) if not SMOKE else (4,)
    LP._rows_triton_fwd(buf, index, logp, ent, lse, ez, 0.7, 0.0)  # statistics for the gradient kernel
    for BLOCK_V, num_warps in itertools.product(blocks, warps):
        cfg = dict(BLOCK_V=BLOCK_V, num_warps=num_warps)
        LP.ROW_CONFIG.clear()
        LP.ROW_CONFIG.update(cfg)
        LCE.ROW_CONFIG.clear()
        LCE.ROW_CONFIG.update(cfg)
        rows = {}
        try:
            rows["logp_fwd_entropy"] = (timed(lambda: LP._rows_triton_fwd(buf, index, logp, ent, lse, ez, 0.7, 0.0)), 1)

            def logp_bwd():
                buf.copy_(logits)  # the gradient kernel overwrites the chunk (the copy is timed apart below)
                LP._rows_triton_bwd(buf, index, lse, ez, g1, g2, 0.7, 0.0)
            rows["logp_grad_both"] = (timed(logp_bwd), 2)

            def lce():
                buf.copy_(logits)
                LCE._rows_triton(buf, index, g_mean, loss, lse, None, -100, 1.0, 0.0, 0.0, True)
            rows["lce_fwd_grad"] = (timed(lce), 3)
        except Exception as e:  # noqa: BLE001  (a setting that does not compile is a row with its error)
            emit(BLOCK_V=BLOCK_V, num_warps=num_warps, error=f"{type(e).__name__}: {e}"[:200])
            continue
        copy_ms = timed(lambda: buf.copy_(logits))
        for name, (ms, passes) in rows.items():
            net = ms - copy_ms if name != "logp_fwd_entropy" else ms
            emit(kernel=name, BLOCK_V=BLOCK_V, num_warps=num_warps, ms=round(net, 4), chunk=[C, V],
                 tb_s=round(passes * bytes_chunk / (net * 1e-3) / 1e12, 2) if net == net and net > 0 else None)
    LP.ROW_CONFIG.clear()
    LCE.ROW_CONFIG.clear()


if __name__ == "__main__":
    main()
