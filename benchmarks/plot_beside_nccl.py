"""Draw how much the compute kernels that ran beside NCCL were slowed, per profiled FSDP2 row of one device call
(``trace_summary.beside_nccl``: one kernel's launches at the same shapes, the mean of those beside NCCL for more than
half their time over the mean of those with none), with each row's step time in its title.

    python benchmarks/plot_beside_nccl.py benchmarks/results/h200x2-fsdp2-2026-11-28-s31.jsonl --call 2 \
        -o benchmarks/results/h200x2-fsdp2-2026-11-28-s31-beside-nccl.png
"""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from plot_fsdp2 import call_rows  # noqa: E402

COLOURS = {"fxfuse's low-rank GEMM": "tab:red", "cuBLAS": "tab:blue", "attention": "tab:green", "other": "tab:gray"}


def family(group) -> str:
    if group["name"].startswith("_lowrank_gemm"):
        return "fxfuse's low-rank GEMM"
    if group["kind"] == "matmul":
        return "cuBLAS"
    return "attention" if group["kind"] == "attention" else "other"


def main() -> None:
    a, rows = call_rows(__doc__.split("\n")[0])
    rows = [r for r in rows if r.get("profile", {}).get("beside_nccl")]
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 4.2), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], rows):
        groups = r["profile"]["beside_nccl"]["groups"]
        for i, g in enumerate(groups):
            ax.bar(i, g["ratio"], color=COLOURS[family(g)])
            ax.text(i, g["ratio"] + 0.02, f"{g['beside']}/{g['alone']}", ha="center", fontsize=7)
        ax.axhline(1.0, color="black", lw=0.8)
        name = r["impl"] + (" LoRA" if r.get("lora") else " full") + (r.get("tag") or "")
        ax.set_title(f"{name}\nstep {r['step_ms']} ms", fontsize=9)
        ax.set_xticks(range(len(groups)), [g["op"].split("::")[-1][:18] if g["op"] else "?" for g in groups],
                      rotation=60, ha="right", fontsize=7)
        present = sorted({family(g) for g in groups}, key=list(COLOURS).index)
        ax.legend([Patch(color=COLOURS[f]) for f in present], present, fontsize=7, loc="lower right")
        ax.set_ylim(0, 2.1)
    axes[0][0].set_ylabel("beside NCCL / alone (same kernel, shapes)")
    fig.suptitle(f"{rows[0]['device']} x{rows[0]['gpus']}, call {a.call}: the 8 kernel groups with most time "
                 "(labels: launches beside / alone)", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
