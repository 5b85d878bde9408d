"""``python -m fxfuse demo``: compile a tiny random-init HF causal LM with fxfuse and with default Inductor,
train a few steps with each, and show what fxfuse fused and what it saved.

Runs on a CPU-only machine in about a minute (nothing is downloaded; the model is built from a config).
"""
from __future__ import annotations

import argparse
import time

import torch


def _tiny_llama(vocab: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)


def _train(backend: str, steps: int, batch: int, seq: int, vocab: int, device: str):
    model = _tiny_llama(vocab).to(device)
    model.train()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    losses, t_first = [], None
    t0 = time.perf_counter()
    for step in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        labels = ids.clone()
        labels[0, -4:] = -100  # some ignored positions, as padding gives
        loss = compiled(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 0:
            t_first = time.perf_counter() - t0
    rest = time.perf_counter() - t0 - t_first
    return losses, t_first, rest / max(1, steps - 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fxfuse demo", description=__doc__)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    import fxfuse

    # Compare compile times fairly: no run may hit the other's on-disk cache (and passes must run).
    torch._inductor.config.force_disable_caches = True
    print(f"fxfuse {fxfuse.__version__} demo: tiny random-init Llama (vocab {args.vocab}), "
          f"{args.steps} AdamW steps of {args.batch}x{args.seq} tokens on {args.device}, torch {torch.__version__}")
    print("built-in passes:", ", ".join(s.name for s in fxfuse.registered_passes()) or "<none>")

    fxfuse.clear_reports()
    ff_losses, ff_first, ff_step = _train("fxfuse", args.steps, args.batch, args.seq, args.vocab, args.device)
    reps = fxfuse.reports()
    torch._dynamo.reset()
    ind_losses, ind_first, ind_step = _train("inductor", args.steps, args.batch, args.seq, args.vocab, args.device)

    print("\n== what fxfuse did ==")
    for r in reps:
        print(r)
    saved = sum(r.saved_bytes for r in reps)
    print(f"\nestimated activation memory saved per step: {saved / 2**20:.2f} MiB "
          f"(logits and their fp32 copies/gradients never materialised)")
    print("\n== loss per step ==")
    print(f"{'step':>4} {'fxfuse':>10} {'inductor':>10} {'diff':>9}")
    for i, (a, b) in enumerate(zip(ff_losses, ind_losses)):
        print(f"{i:>4} {a:>10.5f} {b:>10.5f} {abs(a - b):>9.2e}")
    print(f"\nfirst step (compile + run): fxfuse {ff_first:.1f} s, inductor {ind_first:.1f} s; "
          f"later steps: fxfuse {ff_step * 1e3:.0f} ms, inductor {ind_step * 1e3:.0f} ms\n"
          f"(fxfuse ran first, so its first step also pays one-time imports; CPU timings of a tiny model say "
          f"nothing about GPU speed: see README's H200 results)")
    ok = all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(ff_losses, ind_losses))
    print("losses match:", "yes" if ok else "NO")
    return 0 if ok else 1
