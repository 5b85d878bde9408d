"""Plot of the padded-vs-packed training rows of issue 31 (bench_varlen.py e2e, H200): real tokens/s and peak memory
per layout and implementation, from a results JSONL (default benchmarks/results/h200-unpad-s7.jsonl, the rows of its
e2e rows picked by PLOT_ROWS, default calls 6 and 7 (steps 4-15) and call 2's Inductor row (steps 2-11)).

Run: python benchmarks/plot_unpad.py [rows.jsonl] [out.png]
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "h200-unpad-s7.jsonl")
    dst = sys.argv[2] if len(sys.argv) > 2 else os.path.join(HERE, "results", "h200-unpad-s7.png")
    # which rows: device call -> impls (* = all); default the two final calls and call 2's Inductor row
    pick = dict(x.split(":") for x in os.environ.get("PLOT_ROWS", "6:*,7:*,2:inductor").split(","))
    rows = {}
    for line in open(src):
        r = json.loads(line)
        want = pick.get(str(r.get("device_call")))
        if r.get("section") == "e2e" and r.get("real_tokens_per_s") and want in ("*", r["impl"]):
            rows[(r["layout"], r["impl"], r["device_call"])] = r
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(rows, key=lambda k: -rows[k]["real_tokens_per_s"])
    labels = [f"{layout}\n{impl}\n(call {c})" for layout, impl, c in keys]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    a.bar(labels, [rows[k]["real_tokens_per_s"] / 1e3 for k in keys], color="tab:blue")
    a.set_ylabel("real (non-pad) tokens/s, thousands")
    b.bar(labels, [rows[k]["peak_gib"] for k in keys], color="tab:orange")
    b.set_ylabel("peak GiB")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7)
    r0 = rows[keys[0]]
    fig.suptitle(f"Llama-3.2-1B widths, {r0['layers']} layers, full fine-tune, 8 log-normal documents a step (H200)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(dst)


if __name__ == "__main__":
    main()
