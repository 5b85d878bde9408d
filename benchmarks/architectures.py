"""Every decoder-only causal-LM architecture the installed transformers registers, tiny and random-init, trained for
one step eagerly and compiled with fxfuse: what is fused, what is not and why, and whether loss and gradients
match eager.

    python benchmarks/architectures.py                  # all of them (CPU, 2 workers, ~1 h on 2 cores)
    python benchmarks/architectures.py llama mixtral    # a few
    python benchmarks/architectures.py --markdown       # only re-render docs/architectures.md from the JSON
    python -m benchmarks.architectures ...              # the same, from the repository root

Writes ``benchmarks/results/architectures.json`` and ``docs/architectures.md``. Each architecture runs in its own
process with a time limit (``--timeout``, default 300 s), so a crash or a hang is one row, not the end of the run.

The tiny configs (hidden 64, 4 heads / 2 kv heads, per-layer patterns cut to one layer of each kind) and the
batch are built in ``benchmarks/arch_models.py``; ``arch_runner.py`` runs them, ``arch_render.py`` writes the table.

One step: batch 2 x 16, row 1 right-padded by 4 (an ``attention_mask`` where the model takes one), labels a
tensor of their own with -100 at the pads and at the first two positions of row 0; fp32, train mode with every
dropout set to 0 (so eager is deterministic). The compiled model is a deep copy of the eager one before its step,
compiled with ``torch.compile(backend="fxfuse", options={"compiler": "aot_eager"})``. Parity: the loss's relative
error and, per parameter, ``max|g - g_eager| / max|g_eager|``; "exact" is both <= 2e-5 for every parameter.

This file is the command line only; the code is in three modules of the ``benchmarks`` package:
``arch_models`` (the tiny configs, models and batch), ``arch_runner`` (the step, parity, fusion summary and the
process pool) and ``arch_render`` (the summary, the markdown table, the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a script: sys.path[0] is benchmarks/, the package lives in the repository root
    sys.path.insert(0, ROOT)  # (and fxfuse from the source tree)

from benchmarks.arch_models import all_names  # noqa: E402
from benchmarks.arch_render import JSON_PATH, MD_PATH, render_markdown, summary, write  # noqa: E402
from benchmarks.arch_runner import _worker, run_all  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="mapping names (default: all)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per architecture")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--attn", default=None, help="force an attention implementation (default: the model's)")
    ap.add_argument("--markdown", action="store_true", help="only re-render docs/architectures.md from the JSON")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return _worker(a.worker, a.out, a.attn)
    if a.markdown:
        with open(JSON_PATH) as f:
            data = json.load(f)
        data["summary"] = summary(data["records"])
        with open(MD_PATH, "w") as f:
            f.write(render_markdown(data))
        return
    names = a.names or all_names()
    recs = run_all(names, a.timeout, a.workers, a.attn)
    if not a.no_write:
        data = write(recs, merge=bool(a.names))
        print(json.dumps({k: v for k, v in data["summary"].items() if k != "top_reasons"}))


if __name__ == "__main__":
    main()
