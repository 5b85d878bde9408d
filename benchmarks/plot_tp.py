"""Draw tensor-parallel rows: step time and peak memory per impl, one panel per device call (every bar of a panel
measured on the same host), for ``bench_fsdp2.py`` rows (``FSDP_TP``) and ``examples/hf_trainer_fsdp2.py --tp`` rows.

    python benchmarks/plot_tp.py -o benchmarks/results/h200-tp-2026-11-27-s28.png \
        benchmarks/results/h200x2-tp-2026-11-27-s28.jsonl:1 \
        benchmarks/results/h200x2-hf-trainer-tp-2026-11-27-s28.jsonl:2 \
        benchmarks/results/h200x4-fsdp2-tp-2026-11-27-s28.jsonl:3 benchmarks/results/h200x2-tp-2026-11-27-s28.jsonl:4
    python benchmarks/plot_tp.py -o benchmarks/results/h200-tp-2026-11-27-s27.png \
        benchmarks/results/h200x2-tp-2026-11-27-s27.jsonl:1 \
        benchmarks/results/h200x4-fsdp2-tp-2026-11-27-s27.jsonl:2 \
        benchmarks/results/h200x4-hf-trainer-fsdp2-tp-2026-11-27-s27.jsonl:3

Each argument is ``ROWS_FILE:CALL``; anchor rows and rows without a step time are left out.
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(r) -> str:
    """What sets a row apart: the impl (bench) or mode (Trainer), the parallelism and fxfuse's all-reduce option."""
    if "mode" in r:  # examples/hf_trainer_fsdp2.py
        name = {"regions": "fxfuse compile_regions", "install": "fxfuse install() + torch_compile",
                "inductor": "Inductor (torch_compile)", "eager": "eager"}[r["mode"]]
        return f"{name}, Trainer, TP {r['tp']}"
    name = r["impl"]
    tp = r.get("tensor_parallel", 1)
    name += f", FSDP2 over {r['gpus'] // tp} x TP {tp}" if tp > 1 else f", FSDP2 over {r['gpus']}"
    if r.get("sequence_parallel"):
        name += " + SP" + (" + async TP" if r.get("async_tp") else "")
    if r.get("tp_all_reduce_blocks") is not None and tp > 1:
        name += f", tp_all_reduce_blocks={r['tp_all_reduce_blocks']}"
    if "comm_overlap" in r and tp > 1:  # fxfuse's comm_overlap, or Inductor alone asked for the same reordering
        if r["impl"].startswith("fxfuse") and not r["comm_overlap"]:
            name += ", comm_overlap=False"
        elif not r["impl"].startswith("fxfuse") and r["comm_overlap"]:
            name += " + reorder_compute_for_overlap"
    if r.get("tag"):
        name += f" ({r['tag']})"
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("calls", nargs="+", help="ROWS_FILE:CALL")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    panels = []
    for spec in a.calls:
        path, call = spec.rsplit(":", 1)
        rows = [r for r in map(json.loads, open(path)) if r.get("call") == int(call) and r.get("step_ms")
                and not r.get("anchor") and ("impl" in r or "mode" in r)]
        panels.append((path.rsplit("/", 1)[-1], int(call), rows))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.2 + 0.45 * sum(len(p[2]) for p in panels)))
    for ax, (name, call, rows) in zip(axes if len(panels) > 1 else [axes], panels):
        names = [label(r) for r in rows]
        ms = [r["step_ms"] for r in rows]
        colors = ["tab:green" if n.startswith("fxfuse") else "tab:gray" for n in names]
        bars = ax.barh(names, ms, color=colors)
        for b, r in zip(bars, rows):
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2,
                    f" {r['step_ms']:.1f} ms, {r['peak_gib']:.1f} GiB", va="center", fontsize=8)
        ax.set_xlim(0, max(ms) * 1.35)
        ax.invert_yaxis()
        ax.set_title(f"{name}, call {call}", fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
    axes_list = axes if len(panels) > 1 else [axes]
    axes_list[-1].set_xlabel("step ms (median of the timed steps; label: step, peak GiB); cold caches")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
