"""Draw the FSDP2 rows of one device call: tokens/s per GPU and peak memory per impl, full fine-tune and LoRA.

    python benchmarks/plot_fsdp2.py benchmarks/results/h200x2-fsdp2-2026-11-26.jsonl --call 2 \
        -o benchmarks/results/h200x2-fsdp2-2026-11-26.png

Rows come from ``bench_fsdp2.py`` (``fsdp2_runs.sh``); only rows of one call are drawn, so every bar was measured on
the same machine, and only unpadded rows of the issue's shape (rows of 4096 tokens, two per GPU).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ["eager", "inductor", "inductor-regional", "fxfuse-layer", "fxfuse-regions-nopass", "fxfuse",
         "fxfuse-regions-nolora", "fxfuse-regions"]


def call_rows(description: str):
    """The command line every FSDP2 plot takes (a rows file, ``--call``, ``-o``): (arguments, that call's rows)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("rows")
    ap.add_argument("--call", type=int, required=True)
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    return a, [r for r in map(json.loads, open(a.rows)) if r.get("call") == a.call]


def row_label(r) -> str:
    """A row's impl and the settings that set it apart from the others of its impl."""
    return (r["impl"] + (", accelerate units" if r.get("tail_unit") else "")  # FSDP_TAIL=1: embeddings; norm+head
            + (", no JIT warm-up" if r.get("triton_prewarm") is False else "")
            + (", background_compile" if r.get("background_compile") else "")
            + (" (no attention: a floor)" if r.get("floor") == "no-attention" else ""))


def main():
    a, rows = call_rows(__doc__.split("\n")[0])
    rows = [r for r in rows if "lora" in r and not r.get("padded")  # not the anchor's
            and r.get("rows", 2) == 2 and not r.get("passes_off")]
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.5))
    for ax, lora in zip(axes, (False, True)):
        sel = sorted((r for r in rows if r["lora"] == lora),
                     key=lambda r: (ORDER.index(r["impl"]), bool(r.get("tail_unit"))))
        labels = [row_label(r) for r in sel]
        names = [lab + (f", run {labels[:k + 1].count(lab)}" if labels.count(lab) > 1 else "")
                 for k, lab in enumerate(labels)]
        tps = [r["tokens_per_s_per_gpu"] / 1e3 for r in sel]
        peak = [r["peak_gib"] for r in sel]
        colors = ["tab:green" if n.startswith("fxfuse") else "tab:gray" for n in names]
        bars = ax.barh(names, tps, color=colors)
        for b, p, r in zip(bars, peak, sel):
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2,
                    f" {b.get_width():.1f}k, {p:.1f} GiB, 1st step {r['first_step_s']:.1f} s", va="center",
                    fontsize=8)
        ax.set_xlim(0, max(tps) * 2.0)
        ax.set_xlabel("tokens/s per GPU (thousands); label: peak GiB, first step (cold caches)")
        ax.set_title(("LoRA r16" if lora else "full fine-tune") + f", {sel[0]['device'] if sel else ''} x2")
    fig.suptitle("FSDP2, Llama-3-8B widths x16 layers, 2x4096 tokens per GPU (bench_fsdp2.py, one device call)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
