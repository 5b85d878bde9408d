"""``python -m fxfuse demo`` (or ``fxfuse-demo``): train a tiny random-init Llama on a toy language with fxfuse and
with default Inductor, side by side, and show that the losses match, what fxfuse rewrote and what it saved.

The toy language repeats a random prefix (``a b a b a b ...`` for period 2): the first period cannot be predicted
(its labels are ignored), everything after it can, so a 2-layer model learns it within a few AdamW steps and the
loss visibly falls from ln(vocab). Runs on a CPU-only machine in about a minute (nothing is downloaded; the model
is built from a config). The exit code says whether the two runs' losses match (0) or not (1).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
import warnings
from typing import List, Optional, Sequence

import torch


def _tiny_llama(vocab: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)


def repeat_batch(generator: torch.Generator, batch: int, seq: int, vocab: int, period: int):
    """``batch`` sequences of ``seq`` tokens, each a random ``period``-token prefix repeated; the prefix's labels
    are ignored (-100): it is random, only what follows is predictable."""
    prefix = torch.randint(0, vocab, (batch, period), generator=generator)
    ids = prefix.repeat(1, -(-seq // period))[:, :seq]
    labels = ids.clone()
    labels[:, :period] = -100
    return ids, labels


def _train(label: str, backend: str, steps: int, batch: int, seq: int, vocab: int, period: int, lr: float,
           device: str, compiler: str = "inductor"):
    model = _tiny_llama(vocab).to(device)
    model.train()
    if backend == "fxfuse":
        compiled = torch.compile(model, backend="fxfuse", options={"compiler": compiler})
    else:  # the baseline: the same lowering without fxfuse's passes
        compiled = torch.compile(model, backend=compiler)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    losses: List[float] = []
    times: List[float] = []
    for step in range(steps):
        t0 = time.perf_counter()
        ids, labels = repeat_batch(g, batch, seq, vocab, period)
        loss = compiled(input_ids=ids.to(device), labels=labels.to(device), use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        note = " (compiles forward and backward)" if step == 0 else ""
        print(f"  {label:<8} step {step + 1:>2}/{steps}  loss {losses[-1]:.4f}  {times[-1] * 1e3:7.0f} ms{note}",
              flush=True)
    return losses, times


def text_plot(curves: dict, height: int = 10, width_per_step: int = 3) -> str:
    """Loss curves as a small text chart: one column group per step, one letter per curve (its first letter,
    ``*`` where curves share a cell)."""
    names = list(curves)
    n = max(len(v) for v in curves.values())
    lo = min(min(v) for v in curves.values())
    hi = max(max(v) for v in curves.values())
    span = (hi - lo) or 1.0
    grid = [[" "] * (n * width_per_step) for _ in range(height)]
    for name in names:
        mark = name[0].upper()
        for i, y in enumerate(curves[name]):
            row = height - 1 - int(round((y - lo) / span * (height - 1)))
            col = i * width_per_step + width_per_step // 2
            grid[row][col] = mark if grid[row][col] in (" ", mark) else "*"
    lines = []
    for r, cells in enumerate(grid):
        y = hi - r * span / (height - 1)
        lines.append(f"{y:7.3f} |{''.join(cells)}")
    lines.append(" " * 8 + "+" + "-" * (n * width_per_step))
    ticks = "".join(f"{i + 1:^{width_per_step}}" if (i == 0 or (i + 1) % 5 == 0 or i == n - 1) else " " * width_per_step
                    for i in range(n))
    lines.append(" " * 9 + ticks + "  step")
    legend = ", ".join(f"{name[0].upper()} = {name}" for name in names)
    lines.append(" " * 9 + f"{legend}, * = both")
    return "\n".join(lines)


def save_png(path: str, curves: dict, title: str) -> Optional[str]:
    """The loss curves as a PNG at ``path``; None (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (name, ys), style in zip(curves.items(), ("-o", "--x")):
        ax.plot(range(1, len(ys) + 1), ys, style, label=name, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = os.path.abspath(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _is_fusion(spec) -> bool:
    """A pass is a fusion when it rewrites into one of fxfuse's ops; others (sdpa_causal_mask: a mask tensor into
    ``is_causal=True``) rewrite the graph without fusing anything, and the summary says so."""
    return "fxfuse::" in (spec.description or "")


def summarize(reports) -> List[str]:
    """One line per pass that changed something: sites, fusion or rewrite, and the memory it saved."""
    import fxfuse
    from fxfuse.report import format_bytes

    specs = {s.name: s for s in fxfuse.registered_passes()}
    by_pass = {}
    for r in reports:
        for s in r.fused:
            sites, saved = by_pass.get(s.pass_name, (0, 0))
            by_pass[s.pass_name] = (sites + 1, saved + (s.saved_bytes or 0))
    lines = []
    for name, (sites, saved) in by_pass.items():
        spec = specs.get(name)
        if spec is not None and not _is_fusion(spec):
            kind = "rewrite, not a fusion: " + spec.description.split(" -> ")[-1]
        else:
            kind = "fusion -> " + (spec.description.split(" -> ")[-1] if spec is not None else "user pass")
        lines.append(f"  {name:<22} {sites:>2} site{'s' if sites != 1 else ' '}  {kind}  (saves ~{format_bytes(saved)})")
    rolled = [s for r in reports for s in r.rolled_back]
    for s in rolled:
        lines.append(f"  {s.pass_name:<22} rolled back: {s.reason}")
    return lines or ["  nothing matched: the graphs went to Inductor unchanged"]


@contextlib.contextmanager
def _no_disk_caches():
    """Neither run may be served from Inductor's on-disk caches (a run of the demo before this one would make the
    second compile look fast, and fxfuse's passes would not run on a hit). ``force_disable_caches`` also switches
    off Dynamo's profile-guided dynamic shapes, which warns once; that warning, and only that one, is silenced:
    the demo asked for it."""
    import torch._inductor.config as ic

    prev = ic.force_disable_caches
    ic.force_disable_caches = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"dynamo_pgo force disabled")
            yield
    finally:
        ic.force_disable_caches = prev


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fxfuse demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16, help="AdamW steps per run (default 16)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--period", type=int, default=2, help="length of the repeated random prefix (default 2)")
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                    help="what lowers the graphs in both runs: 'inductor' (default) or 'aot_eager' (no Inductor: "
                         "seconds instead of a minute, for a quick look at the fusions)")
    ap.add_argument("--png", default="fxfuse_demo_loss.png",
                    help="where to save the loss curves as a PNG when matplotlib is installed "
                         "(default: ./fxfuse_demo_loss.png; '' for none)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.period < 1 or args.seq <= args.period:
        ap.error("need --steps >= 1 and 1 <= --period < --seq")

    import fxfuse

    base = args.compiler  # the baseline: the same lowering, no fxfuse passes
    print(f"fxfuse {fxfuse.__version__} demo: a tiny random-init Llama (2 layers, hidden 64) learns a toy language "
          f"that repeats a random {args.period}-token prefix (vocab {args.vocab}); {args.steps} AdamW steps of "
          f"{args.batch}x{args.seq} tokens on {args.device}, torch {torch.__version__}, once compiled with fxfuse "
          f"and once with {'Inductor' if base == 'inductor' else base} alone.")
    print(f"the loss starts near ln({args.vocab}) = {math.log(args.vocab):.2f} and falls as the model learns to "
          f"repeat.\n")
    common = (args.steps, args.batch, args.seq, args.vocab, args.period, args.lr, args.device, args.compiler)
    with _no_disk_caches():
        fxfuse.clear_reports()
        ff_losses, ff_times = _train("fxfuse", "fxfuse", *common)
        reps = fxfuse.reports()
        torch._dynamo.reset()
        ind_losses, ind_times = _train(base, base, *common)

    print("\n== what fxfuse did ==")
    for line in summarize(reps):
        print(line)
    saved = sum(r.saved_bytes for r in reps)
    print(f"estimated activation memory saved per step: {saved / 2**20:.2f} MiB (logits and their fp32 "
          f"copies/gradients never materialised)")
    print("\nthe fusion report (fxfuse.reports(); [fused] = rewritten, the summary above says which are fusions):")
    for r in reps:
        print(r)

    curves = {"fxfuse": ff_losses, base: ind_losses}
    print("\n== loss per step ==")
    print(text_plot(curves))
    print(f"\n{'step':>4} {'fxfuse':>10} {base:>10} {'diff':>9}")
    for i, (a, b) in enumerate(zip(ff_losses, ind_losses)):
        print(f"{i + 1:>4} {a:>10.5f} {b:>10.5f} {abs(a - b):>9.2e}")
    if args.png:
        where = save_png(args.png, curves, f"fxfuse demo: repeat-{args.period} language, vocab {args.vocab}")
        print(f"\nloss curves saved to {where}" if where else
              "\n(matplotlib is not installed: no PNG; `pip install matplotlib` for one)")

    later = lambda ts: sum(ts[1:]) / max(1, len(ts) - 1)  # noqa: E731
    print(f"\nfirst step (compile + run): fxfuse {ff_times[0]:.1f} s, {base} {ind_times[0]:.1f} s; later steps: "
          f"fxfuse {later(ff_times) * 1e3:.0f} ms, {base} {later(ind_times) * 1e3:.0f} ms\n"
          f"(fxfuse ran first, so its first step also pays one-time imports; CPU timings of a tiny model say "
          f"nothing about GPU speed: see README's H200 results)")
    ok = all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(ff_losses, ind_losses))
    fell = ff_losses[-1] < ff_losses[0]
    print(f"losses match: {'yes' if ok else 'NO'}; loss fell from {ff_losses[0]:.3f} to {ff_losses[-1]:.3f}"
          + ("" if fell else " (it did not fall: too few steps?)"))
    return 0 if ok else 1
