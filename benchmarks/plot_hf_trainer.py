"""Draw the HF Trainer recipe's rows (``examples/hf_trainer_fsdp2.py`` via ``hf_trainer_runs.sh``): step time and
peak memory per mode, one panel pair per call, for the rows of one batch setting.

    python benchmarks/plot_hf_trainer.py benchmarks/results/h200x2-hf-trainer-2026-11-27-s23.jsonl --cp 2 \
        --seq 65536 -o benchmarks/results/h200x2-hf-trainer-2026-11-27-s23-cp.png

Only rows of the same call share a panel (each call is a fresh host); bars are labelled with the mode and what set
the row apart (passes off, loss chunk, profiled), and the tree the call ran.
"""
import argparse
import json
from collections import defaultdict

from plot_fsdp2 import plt  # matplotlib with the Agg backend, as every plot script here


def label(r) -> str:
    mode = {"regions": "fxfuse regions", "inductor": "Inductor", "eager": "eager", "install": "fxfuse install"}[r["mode"]]
    extra = [f"passes off: {r['passes_off']}" if r.get("passes_off") else "",
             f"{r['lce_chunk_mib']} MiB loss chunks" if r.get("lce_chunk_mib") else "",
             "profiled" if "profile" in r else ""]
    return mode + "".join(f"\n{e}" for e in extra if e)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rows")
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    by_call = defaultdict(list)
    for r in map(json.loads, open(a.rows)):
        if r.get("cp", 1) == a.cp and r["seq"] == a.seq and not r.get("gradient_checkpointing"):
            by_call[r["call"]].append(r)
    calls = sorted(by_call)
    fig, axes = plt.subplots(2, len(calls), figsize=(3.2 * len(calls), 7), squeeze=False)
    for j, c in enumerate(calls):
        rows = by_call[c]
        names = [label(r) for r in rows]
        colors = ["tab:orange" if r["mode"] in ("regions", "install") and not r.get("passes_off") else "tab:gray"
                  for r in rows]
        for i, (key, unit) in enumerate((("step_ms", "ms a step"), ("peak_gib", "peak GiB"))):
            ax = axes[i][j]
            vals = [r[key] for r in rows]
            ax.bar(range(len(rows)), vals, color=colors)
            for x, v in enumerate(vals):
                ax.text(x, v, f"{v:,.1f}" if key == "step_ms" else f"{v:.1f}", ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(names, fontsize=6, rotation=30, ha="right")
            ax.set_ylabel(unit)
            if i == 0:
                ax.set_title(f"call {c} (tree {rows[0].get('tree', '?')})", fontsize=8)
    dev = next(iter(by_call.values()))[0].get("device", "")
    fig.suptitle(f"HF Trainer + accelerate FSDP2, {a.seq} tokens a row, context parallel {a.cp}; {dev} x2; "
                 "lower is better", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
