"""Plot of profile_attention_kernels.py's breakdown rows: fwd + bwd ms of one attention layer per head dim and layout,
fxfuse's kernel beside FlexAttention and SDPA cuDNN (where it runs the layout), each bar labelled with its ms and
the speed-up of fxfuse's kernel over FlexAttention above each group. fxfuse's rows from several rounds: the median.

Run: python benchmarks/plot_attention_kernels.py [rows.jsonl] [out.png]
(default benchmarks/results/h200-attn-anchors-2026-11-29-s37.{jsonl,png})
"""
import json
import os
import statistics
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
IMPLS = (("fxfuse", "fxfuse's kernel"), ("flex", "FlexAttention"), ("sdpa_cudnn", "SDPA cuDNN"))


def layer_ms(rows):
    """{(D, layout): {impl: median fwd+bwd ms}} from the rows with part fwdbwd."""
    got = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("part") == "fwdbwd" and "ms" in r:
            got[(r["D"], r["layout"])][r["impl"]].append(r["ms"])
    return {k: {impl: statistics.median(v) for impl, v in d.items()} for k, d in got.items()}


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "h200-attn-anchors-2026-11-29-s37.jsonl")
    dst = sys.argv[2] if len(sys.argv) > 2 else os.path.splitext(src)[0] + ".png"
    rows = [json.loads(line) for line in open(src)]
    env = next((r for r in rows if r.get("part") == "env"), {})
    ms = layer_ms(rows)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({d for d, _ in ms}, reverse=True)
    fig, axes = plt.subplots(1, len(dims), figsize=(7 * len(dims), 4.5), squeeze=False)
    for ax, D in zip(axes[0], dims):
        layouts = [lay for d, lay in ms if d == D]
        width = 0.8 / len(IMPLS)
        for i, (impl, label) in enumerate(IMPLS):
            # each group relative to FlexAttention (layouts differ by 100x in ms); the bar's label is its ms
            xs = [j for j, lay in enumerate(layouts) if impl in ms[(D, lay)]]
            vals = [ms[(D, layouts[j])][impl] / ms[(D, layouts[j])]["flex"] for j in xs]
            bars = ax.bar([x + (i - 1) * width for x in xs], vals, width, label=label)
            for b, j in zip(bars, xs):
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{ms[(D, layouts[j])][impl]:.3g}",
                        ha="center", va="bottom", fontsize=7)
        for j, lay in enumerate(layouts):
            ax.text(j, 1.32, f"{ms[(D, lay)]['flex'] / ms[(D, lay)]['fxfuse']:.2f}x", ha="center", fontsize=9)
        ax.set_xticks(range(len(layouts)), layouts)
        ax.set_ylim(0, 1.45)
        ax.set_ylabel("fwd + bwd time / FlexAttention's (bar label: ms)")
        ax.set_title(f"head dim {D}: fxfuse's speed-up over FlexAttention above each group")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=len(IMPLS), fontsize=8)
    fig.suptitle(f"one attention layer, 32 q / 8 kv heads, bf16, 32k tokens; {env.get('gpu', '?')}, torch "
                 f"{env.get('torch', '?')}, triton {env.get('triton', '?')}, tree {env.get('commit', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(dst)


if __name__ == "__main__":
    main()
