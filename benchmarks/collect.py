"""Turn raw device rows (anchors_gpu.py / bench_e2e.py JSON lines) into benchmarks/results/<name>.json with the
machine, versions and commit, and draw the PNG plots README shows.

    python benchmarks/collect.py NAME path/to/rows.jsonl [more.jsonl ...]
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [json.loads(line) for line in f if line.strip().startswith("{")]
    return rows


def _e2e_panel(ax, e2e, title):
    """Whole-model training throughput bars (fxfuse in red), labelled with tokens/s and peak memory."""
    if not e2e:
        return
    names = [r["impl"] for r in e2e]
    ax.bar(names, [r["tokens_per_s"] / 1e3 for r in e2e],
           color=["tab:red" if "fxfuse" in n else "tab:blue" for n in names])
    for i, r in enumerate(e2e):
        ax.text(i, r["tokens_per_s"] / 1e3, f"{r['tokens_per_s'] / 1e3:.1f}k\n{r['peak_gib']:.1f} GiB",
                ha="center", va="bottom", fontsize=7)
    ax.set_title(title)
    ax.set_ylabel("k tokens/s (higher is better)")
    ax.tick_params(axis="x", rotation=25, labelsize=8)
    ax.set_ylim(0, max(r["tokens_per_s"] for r in e2e) / 1e3 * 1.25)


def plot(name, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lce = [r for r in rows if r.get("section") == "lce" and "ms" in r]
    e2e = [r for r in rows if r.get("section") == "e2e" and "tokens_per_s" in r]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, shape in zip(axes[:2], sorted({r["shape"] for r in lce})):
        rs = [r for r in lce if r["shape"] == shape]
        names = [r["impl"].replace(" (cuBLAS)", "") for r in rs]
        ms = [r["ms"] for r in rs]
        colors = ["tab:red" if "fxfuse" in n else ("tab:gray" if "floor" in n else "tab:blue") for n in names]
        ax.bar(names, ms, color=colors)
        for i, r in enumerate(rs):
            ax.text(i, r["ms"], f"{r['ms']:.1f} ms\n{r['peak_gib']:.2f} GiB", ha="center", va="bottom", fontsize=7)
        ax.set_title(f"linear+CE fwd+bwd, {shape} head, 8192 tok bf16")
        ax.set_ylabel("ms (lower is better)")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.set_ylim(0, max(ms) * 1.25)
    _e2e_panel(axes[2], e2e, f"{e2e[0]['shape']} full FT, 4x2048, AdamW bf16" if e2e else "")
    fig.tight_layout()
    out = os.path.join(RESULTS, f"{name}.png")
    fig.savefig(out, dpi=110)
    return out


def plot_lora(name, rows):
    """LoRA: per-layer fwd+bwd time (four shape x dropout groups) and whole-model LoRA training throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layer = [r for r in rows if r.get("section") == "lora" and "ms" in r and "shape" in r]
    e2e = [r for r in rows if r.get("section") == "e2e" and "tokens_per_s" in r and "lora" in r["impl"]]
    impls = ["base matmul only (floor)", "peft eager", "peft inductor", "peft fxfuse"]
    colors = ["tab:gray", "tab:blue", "tab:cyan", "tab:red"]
    groups = []
    for r in layer:
        g = (r["shape"], r["dropout"])
        if g not in groups:
            groups.append(g)
    fig, axes = plt.subplots(1, 2, figsize=(16, 4.8), gridspec_kw=dict(width_ratios=[2, 1]))
    ax = axes[0]
    w = 0.2
    for k, (impl, c) in enumerate(zip(impls, colors)):
        for i, g in enumerate(groups):
            r = next((r for r in layer if (r["shape"], r["dropout"]) == g and r["impl"] == impl), None)
            if r is None:
                continue
            floor = next(x["ms"] for x in layer if (x["shape"], x["dropout"]) == g and x["impl"] == impls[0])
            ax.bar(i + (k - 1.5) * w, r["ms"] / floor, w, color=c, label=impl if i == 0 else None)
            ax.text(i + (k - 1.5) * w, r["ms"] / floor, f"{r['ms']:.2f}\n{r['peak_gib']:.2f}G", ha="center",
                    va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{s.split(' ')[0]} {s.split(' ')[1]}\ndropout {d}" for s, d in groups], fontsize=8)
    ax.set_ylabel("time / base matmul (lower is better)")
    ax.set_ylim(0.9, 1.55)
    ax.set_title("LoRA r16 layer fwd+bwd, 16384 tokens bf16 (labels: ms, extra GiB)")
    ax.legend(fontsize=8)
    _e2e_panel(axes[1], e2e, "Llama-3.2-1B shape, LoRA r16 all proj, 4x2048")
    fig.tight_layout()
    out = os.path.join(RESULTS, f"{name}.png")
    fig.savefig(out, dpi=110)
    return out


def main():
    name, paths = sys.argv[1], sys.argv[2:]
    rows = load(paths)
    env = next((r for r in rows if r.get("section") == "env"), {})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    doc = dict(machine=env.get("gpu"), torch=env.get("torch"), triton=env.get("triton"),
               transformers=env.get("transformers"), commit=commit, rows=rows)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    if any(r.get("section") == "lora" for r in rows):
        print(plot_lora(name, rows))
    elif any(r.get("section") in ("lce", "e2e") for r in rows):
        print(plot(name, rows))
    else:
        print(os.path.join(RESULTS, f"{name}.json"), "(no plot for these sections)")


if __name__ == "__main__":
    main()
