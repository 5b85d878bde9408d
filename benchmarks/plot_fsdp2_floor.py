"""Draw the FSDP2 steps of one call against the issue's throughput targets, with the no-attention floor.

    python benchmarks/plot_fsdp2_floor.py benchmarks/results/h200x2-fsdp2-2026-11-27-s20.jsonl --call 1 \
        -o benchmarks/results/h200x2-fsdp2-2026-11-27-s20-floor.png

Each bar is a row's median step (ms), split by the profile's GPU kernel time per kind (``trace_summary.py``; the
kinds overlap a little across streams, so the stack is scaled to the step) and drawn beside the step the target
asks for: Inductor per layer's step / 1.15 (full fine-tune), Inductor whole model's / 1.4 (LoRA). Rows with
``FSDP_FLOOR=no-attention`` run the model with attention replaced by ``q + k + v``: no attention kernel, however
fast, takes the step below them.
"""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plot_fsdp2 import call_rows, row_label  # noqa: E402  (the same command line, rows and labels)

KINDS = [("matmul", ("matmul",)), ("attention", ("attention",)), ("optimizer + FSDP2 copy-in", ("optimizer",)),
         ("copies / casts", ("copy/cast",)), ("fused elementwise, loss, other", ("triton", "lm-head loss", "other"))]
TARGETS = {False: ("inductor-regional", 1.15), True: ("inductor", 1.4)}


def main():
    a, rows = call_rows(__doc__.split("\n")[0])
    rows = [r for r in rows if r.get("profile") and r.get("optimizer") == "AdamW foreach"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    for ax, lora in zip(axes, (False, True)):
        sel = sorted((r for r in rows if r["lora"] == lora), key=lambda r: (r.get("floor") or "", r["impl"]))
        base_impl, ratio = TARGETS[lora]
        base = next((r for r in sel if r["impl"] == base_impl and not r.get("floor")), None)
        for i, r in enumerate(sel):
            by = r["profile"]["by_kind_ms"]
            parts = [sum(by.get(k, 0.0) for k in ks) for _, ks in KINDS]
            scale = r["step_ms"] / max(sum(parts), 1e-9) if sum(parts) > r["step_ms"] else 1.0
            bottom = 0.0
            for (name, _), v in zip(KINDS, parts):
                ax.bar(i, v * scale, bottom=bottom, color=f"C{KINDS.index((name, _))}", label=name if i == 0 else None)
                bottom += v * scale
            if bottom < r["step_ms"]:  # exposed NCCL, idle
                ax.bar(i, r["step_ms"] - bottom, bottom=bottom, color="lightgrey",
                       label="NCCL exposed, idle" if i == 0 else None)
            ax.text(i, r["step_ms"] + 4, f"{r['step_ms']:.0f} ms\n{r['tokens_per_s_per_gpu'] / 1e3:.1f}k tok/s",
                    ha="center", fontsize=8)
        if base is not None:
            target = base["step_ms"] / ratio
            ax.axhline(target, color="red", ls="--", lw=1)
            ax.text(len(sel) - 0.6, target + 3, f"target: {ratio}x {base_impl} = {target:.0f} ms", color="red",
                    ha="right", fontsize=8)
        ax.set_ylim(0, 1.15 * max(r["step_ms"] for r in sel))
        ax.set_xticks(range(len(sel)), [row_label(r) for r in sel], rotation=15, ha="right", fontsize=8)
        ax.set_ylabel("ms per step (GPU kernel time by kind, scaled to the step)")
        ax.set_title(("LoRA r16" if lora else "full fine-tune") + f", call {a.call}")
        ax.legend(fontsize=7, loc="lower right")
    dev = rows[0].get("device", "?") if rows else "?"
    fig.suptitle(f"FSDP2, 8B widths x16 layers, 2x4096 tokens per GPU, 2x {dev}, tree {rows[0].get('tree', '?')}"
                 if rows else "no rows")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
