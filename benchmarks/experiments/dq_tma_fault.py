"""Experiment (GPU): which dQ tiles fault or hang when the dQ kernel reads K / V through tensor descriptors in every
loop (``launching.DQ_TMA=2``), each case in its own process (a fault poisons the CUDA context for the rest of its
process; a hang is cut by the timeout). What it finds decides :data:`fxfuse.attention.launching.DQ_TMA_CHECKED`.

Seen on the H200 with Triton 3.6 (attention_notes.md, thirty-seventh session): at head dim 128, plain causal,
(64, 64, 4, 2) raised "unspecified launch failure" and (64, 32, 4, 3) hung; both ran with DQ_TMA 0 / 1 and with
packed documents.

Each case: the forward at its defaults, then the backward with the dQ tiles forced onto descriptors (the tiles put
into DQ_TMA_CHECKED), against the same backward on pointer tiles (DQ_TMA=0): max |dq difference| or the failure.
Env: S (default 4096), D (128), TILES (JSON list of [BM, BN, warps, stages]), LAYOUTS (causal,docs8,win1024),
TIMEOUT_S (60).
Run: PYTHONPATH=. python3 benchmarks/experiments/dq_tma_fault.py   (rows to $OUT/dq_tma_fault.jsonl)
"""
import json
import os
import subprocess
import sys

OUT = os.environ.get("OUT", "/tmp")


def case(S, D, tile, layout):
    """One case in this process: prints a JSON row."""
    import torch
    from fxfuse.attention import launching
    from fxfuse.attention.backward import attention_bwd_triton
    from fxfuse.attention.forward import attention_fwd_triton
    from fxfuse.ops import document_ranges

    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(1, 32, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 8, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dr = document_ranges(torch.arange(S, device="cuda")[None] // (S // 8)) if layout == "docs8" else None
    window = int(layout[3:]) if layout.startswith("win") else 0
    kw = dict(doc_ranges=dr)
    out, lse = attention_fwd_triton(q, k, v, None, D ** -0.5, 0.0, True, window, **kw)
    cfg = {"dq": tuple(tile)}
    launching.DQ_TMA = 0
    ref = attention_bwd_triton(do, q, k, v, None, out, lse, D ** -0.5, 0.0, True, window, config=cfg, **kw)[0]
    launching.DQ_TMA = 2
    launching.DQ_TMA_CHECKED = {(tuple(tile), dr is not None)}
    got = attention_bwd_triton(do, q, k, v, None, out, lse, D ** -0.5, 0.0, True, window, config=cfg, **kw)[0]
    torch.cuda.synchronize()
    print(json.dumps({"max_abs_dq_diff": float((got.float() - ref.float()).abs().max())}))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        S, D, tile, layout = json.loads(sys.argv[2])
        return case(S, D, tile, layout)
    S, D = int(os.environ.get("S", 4096)), int(os.environ.get("D", 128))
    tiles = json.loads(os.environ.get("TILES", "[[64,64,4,2],[64,32,4,3],[64,64,4,3],[128,64,8,3]]"))
    layouts = os.environ.get("LAYOUTS", "causal,docs8,win1024").split(",")
    timeout = int(os.environ.get("TIMEOUT_S", 60))
    for layout in layouts:
        for tile in tiles:
            row = dict(S=S, D=D, tile=tile, layout=layout)
            try:
                p = subprocess.run([sys.executable, __file__, "--case", json.dumps([S, D, tile, layout])],
                                   capture_output=True, text=True, timeout=timeout)
                last = (p.stdout.strip().splitlines() or [""])[-1]
                row.update(json.loads(last) if p.returncode == 0 and last.startswith("{")
                           else {"failed": (p.stderr.strip().splitlines() or ["?"])[-1][:200]})
            except subprocess.TimeoutExpired:
                row["hung"] = f"past {timeout} s"
            with open(os.path.join(OUT, "dq_tma_fault.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
