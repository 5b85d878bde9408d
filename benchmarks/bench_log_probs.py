"""Fused lm-head log-probs + entropy on the GPU (issue 6): correctness of ``fxfuse::linear_log_probs`` against a
float64 reference, then GRPO-style fwd+bwd time and extra peak memory next to eager and Inductor.

GRPO-style: ``z = (h @ W.T) / T``; per-token ``logp = log_softmax(z)[y]`` and ``entropy``; backward with
per-token upstream gradients (advantages for logp, a coefficient for the entropy). Llama-3-8B head (D 4096,
V 128256), 8 x 2048 completion tokens, bf16, T = 0.7.

Section ``frozen``: the same head frozen (LoRA RL: only the hidden states train), log-probs alone with per-token
advantages: fxfuse's op forms the hidden gradient per unit upstream gradient in the forward (2 matmuls), next to
eager, Inductor and the 2-matmul floor.

The "fxfuse (pass)" rows compile the loss with the head, so the ``log_probs_loss`` pass forms the lm-head gradient in
the forward (3 matmuls with a trainable head, 2 frozen); "log_probs_loss off" is the same compile without it.

Section ``grpo``: the whole GRPO token loss (clipped ratio x advantage, completion mask) compiled by Inductor and
by fxfuse next to Liger's fused GRPO loss.

Section ``ce_none``: a custom loop's loss, ``F.cross_entropy(logits, y, reduction="none")`` weighted per token and
averaged over the weights (ignored rows, a per-token weight), Llama-3-8B head, 8192 tokens: the ``log_probs_loss``
pass takes the per-token cross-entropy with the loss over it and forms the gradients in the forward; beside it the
same compile with the pass off, the plain ``reduction="mean"`` loss through fxfuse, eager, Inductor and the floor.

Run (device machine):  PYTHONPATH=. python3 benchmarks/bench_log_probs.py [check] [time] [frozen] [grpo] [ce_none]
[profile]
Writes $OUT/bench_log_probs.jsonl. On CPU it runs a tiny smoke version.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import DEV, SMOKE, bench, jsonl_emitter, rel  # noqa: E402

import fxfuse  # noqa: E402,F401
from fxfuse.kernels import linear_log_probs as K  # noqa: E402
from fxfuse.ops import linear_log_probs  # noqa: E402

emit = jsonl_emitter("bench_log_probs.jsonl")
# Each section compiles the same loss function with several backends / option sets: one frame, many compiles.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
# The loss in the same graph lets the log_probs_loss pass form the lm-head gradient in the forward; with it off the
# op's backward projects the logits again (the row beside it shows what the pass saves).
LOSS_PASS_OFF = {"passes": {"log_probs_loss": False}}
CHUNK_1G = {"pass_options": {"linear_log_probs": {"chunk_bytes": 1 << 30}}}
PROFILE = "profile" in sys.argv[1:]  # also profile the "fxfuse (pass)" rows: where the GPU time goes


def profile_step(section, name, step, steps=3):
    """GPU time of ``steps`` calls by kernel kind and the top kernels (trace_summary), as one row."""
    if DEV != "cuda":
        return
    import tempfile

    from trace_summary import summarize

    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    before = torch.cuda.memory_stats()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    # host-side: CUDA runtime calls that can stall the pipeline (allocations, synchronisations), per step
    runtime = {}
    for e in trace.get("traceEvents", []):
        n = e.get("name", "")
        if e.get("cat") == "cuda_runtime" and any(k in n for k in ("Malloc", "Free", "Synchronize", "MemcpyAsync")):
            c, d = runtime.get(n, (0, 0.0))
            runtime[n] = (c + 1, d + float(e.get("dur", 0)))
    emit(section=section + "_profile", impl=name, **summarize(trace, steps=steps, top=12),
         allocator={k: after.get(k, 0) - before.get(k, 0) for k in keys},
         runtime_calls={n: [c, round(d / 1e3, 2)] for n, (c, d) in runtime.items()})


def check():
    cases = [(37, 64, 1000, torch.float32, 1.0, None, False), (300, 128, 5003, torch.float32, 0.7, 30.0, True),
             (300, 128, 5003, torch.bfloat16, 0.7, None, True), (1000, 256, 32003, torch.bfloat16, 1.3, 50.0, True)]
    if SMOKE:
        cases = cases[:1]
    for N, D, V, dt, T, cap, bias in cases:
        try:
            torch.manual_seed(0)
            h = torch.randn(N, D, device=DEV, dtype=dt, requires_grad=True)
            W = (torch.randn(V, D, device=DEV) / D ** 0.5).to(dt).requires_grad_()
            b = torch.randn(V, device=DEV, dtype=dt, requires_grad=True) if bias else None
            y = torch.randint(0, V, (N,), device=DEV)
            logp, ent = linear_log_probs(h, W, y, temperature=T, softcap=cap, bias=b, return_entropy=True)
            g1, g2 = torch.randn(N, device=DEV), torch.randn(N, device=DEV)
            ((logp * g1).sum() + (ent * g2).sum()).backward()
            rl, re, rh, rw, rb = K.logp_reference(h, W, y, b, T, cap, g1, g2)
            errs = dict(logp=rel(logp, rl), entropy=rel(ent, re), gh=rel(h.grad, rh), gW=rel(W.grad, rw))
            if bias:
                errs["gb"] = rel(b.grad, rb)
            tol = 1e-4 if dt == torch.float32 else 2e-2
            emit(section="logp_check", N=N, D=D, V=V, dtype=str(dt), T=T, softcap=cap, bias=bias, errors=errs,
                 ok=all(v < tol for v in errs.values()))
        except Exception as e:
            emit(section="logp_check", N=N, V=V, error=f"{type(e).__name__}: {e}"[:300], ok=False)
            traceback.print_exc()


def time_head(frozen: bool = False):
    """GRPO-style log-probs fwd+bwd next to eager, Inductor and the cuBLAS floor. Trainable head (section
    ``logp``): log-probs and entropy, both with gradients, 3 matmuls at the floor. Frozen head (``logp_frozen``):
    log-probs alone, only the hidden states take a gradient, 2 matmuls at the floor."""
    N, D, V = (8 * 2048, 4096, 128256) if not SMOKE else (64, 32, 500)
    T = 0.7
    section, shape = ("logp_frozen", "llama3-8b head 8x2048, frozen") if frozen else ("logp", "llama3-8b head 8x2048")
    torch.manual_seed(0)
    h = torch.randn(N, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(V, D, device=DEV) / D ** 0.5).to(torch.bfloat16).requires_grad_(not frozen)
    y = torch.randint(0, V, (N,), device=DEV)
    adv = torch.randn(N, device=DEV)
    grads = [h] if frozen else [h, W]

    def eager(h, W):
        lp = F.log_softmax(F.linear(h, W).float() / T, dim=-1)
        logp = lp.gather(-1, y[:, None]).squeeze(-1)
        if frozen:
            return -(logp * adv).mean()
        ent = -(lp.exp() * lp).sum(-1)
        return -(logp * adv).mean() - 0.01 * ent.mean()

    def fused(h, W):
        if frozen:
            return -(linear_log_probs(h, W, y, temperature=T) * adv).mean()
        logp, ent = linear_log_probs(h, W, y, temperature=T, return_entropy=True)
        return -(logp * adv).mean() - 0.01 * ent.mean()

    impls = {"eager": eager, "inductor": torch.compile(eager), "fxfuse (pass)": torch.compile(eager, backend="fxfuse"),
             "fxfuse (pass, log_probs_loss off)": torch.compile(eager, backend="fxfuse", options=LOSS_PASS_OFF),
             "fxfuse (pass, 1 GiB chunks)": torch.compile(eager, backend="fxfuse", options=CHUNK_1G),
             "fxfuse op": fused}
    ref = None
    for name, fn in impls.items():
        def step(fn=fn):
            for t in grads:
                t.grad = None
            fn(h, W).backward()
        try:
            ms, mem = bench(step)
            step()
            if ref is None:
                ref = [t.grad.clone() for t in grads]
            errs = {f"{k}_rel": rel(t.grad, r) for k, t, r in zip(("gh", "gW"), grads, ref)}
            emit(section=section, shape=shape, impl=name, ms=round(ms, 3), peak_gib=round(mem, 3), **errs)
            if PROFILE and name == "fxfuse (pass)":
                profile_step(section, name, step)
        except Exception as e:
            emit(section=section, impl=name, error=f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc()
        torch.cuda.empty_cache() if DEV == "cuda" else None

    def floor():  # the logits matmul and the gradient matmuls, nothing else
        for t in grads:
            t.grad = None
        z = F.linear(h, W)
        z.backward(z)
    ms, mem = bench(floor)
    emit(section=section, shape=shape, impl=f"{len(grads) + 1}-matmul floor (cuBLAS)", ms=round(ms, 3),
         peak_gib=round(mem, 3))


def time_losses(section, shape, impls, h, W, profiled=(), compare_to_first=lambda name: True):
    """fwd+bwd of each ``impls[name](h, W) -> loss``: time and peak (``bench``), the loss and both gradients
    against the first impl's (eager) where ``compare_to_first(name)``, a profile row for the names in
    ``profiled`` (with ``profile`` on the command line). Errors become rows."""
    ref = None
    for name, fn in impls.items():
        def step(fn=fn):
            h.grad = None
            W.grad = None
            loss = fn(h, W)
            loss.backward()
            return loss
        try:
            loss = step()
            if ref is None:
                ref = (loss.detach().clone(), h.grad.clone(), W.grad.clone())
            errs = {}
            if compare_to_first(name):
                errs = dict(loss_rel=rel(loss, ref[0]), gh_rel=rel(h.grad, ref[1]), gW_rel=rel(W.grad, ref[2]))
            ms, mem = bench(step)
            emit(section=section, shape=shape, impl=name, ms=round(ms, 3), peak_gib=round(mem, 3), **errs)
            if PROFILE and name in profiled:
                profile_step(section, name, step)
        except Exception as e:
            emit(section=section, impl=name, error=f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc()
        torch.cuda.empty_cache() if DEV == "cuda" else None


def time_grpo_loss():
    """The whole GRPO token loss (TRL's "dapo" form, beta 0, on-policy: ratio = exp(logp - logp.detach())),
    B 8 x 2048 completion tokens with a completion mask, Llama-3-8B head, T 0.7: eager / Inductor / fxfuse
    compile the same PyTorch function; Liger's LigerFusedLinearGRPOLoss (its own chunked kernel) side by side.
    Gradients compared with eager's."""
    B, L, D, V = (8, 2048, 4096, 128256) if not SMOKE else (2, 32, 32, 500)
    T, eps = 0.7, 0.2
    torch.manual_seed(0)
    h = torch.randn(B, L, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(V, D, device=DEV) / D ** 0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (B, L), device=DEV)
    mask = (torch.arange(L, device=DEV)[None, :] < torch.randint(L // 2, L + 1, (B, 1), device=DEV)).float()
    adv = torch.randn(B, device=DEV)

    def grpo(h, W):
        logits = F.linear(h, W).float() / T
        logp = torch.log_softmax(logits, dim=-1).gather(-1, y[..., None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        a = adv[:, None]
        per_tok = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps) * a)
        return (per_tok * mask).sum() / mask.sum().clamp(min=1.0)

    impls = {"eager": grpo, "inductor": torch.compile(grpo), "fxfuse (pass)": torch.compile(grpo, backend="fxfuse"),
             "fxfuse (pass, log_probs_loss off)": torch.compile(grpo, backend="fxfuse", options=LOSS_PASS_OFF),
             "fxfuse (pass, 1 GiB chunks)": torch.compile(grpo, backend="fxfuse", options=CHUNK_1G)}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        lig = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo", temperature=T,
                                       epsilon_low=eps, epsilon_high=eps)
        impls["liger GRPO loss 0.8.5"] = lambda h, W: lig(h, W, y, mask, adv)[0]
    except Exception as e:  # not installed
        emit(section="grpo", impl="liger GRPO loss", error=f"{type(e).__name__}: {e}"[:200])
    time_losses("grpo", f"llama3-8b head {B}x{L} dapo loss", impls, h, W, profiled=("fxfuse (pass)", "inductor"))


def time_ce_none():
    """Per-token cross-entropy (reduction="none") with a weighted token mean over it, as custom training loops write
    it: ignored rows (-100, every 7th as in the LCE anchor), a per-token weight; fwd+bwd of h and W."""
    N, D, V = (8192, 4096, 128256) if not SMOKE else (64, 32, 500)
    torch.manual_seed(0)
    h = torch.randn(N, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(V, D, device=DEV) / D ** 0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (N,), device=DEV)
    y[::7] = -100
    w = torch.rand(N, device=DEV)

    def weighted(h, W):
        tok = F.cross_entropy(F.linear(h, W).float(), y, reduction="none")
        return (tok * w).sum() / (w * (y != -100)).sum()

    def mean(h, W):
        return F.cross_entropy(F.linear(h, W).float(), y)

    impls = {"eager": weighted, "inductor": torch.compile(weighted),
             "fxfuse (pass)": torch.compile(weighted, backend="fxfuse"),
             "fxfuse (pass, log_probs_loss off)": torch.compile(weighted, backend="fxfuse", options=LOSS_PASS_OFF),
             "fxfuse, reduction mean (other loss)": torch.compile(mean, backend="fxfuse")}
    time_losses("ce_none", f"llama3-8b head {N} tokens, weighted token mean", impls, h, W,
                profiled=("fxfuse (pass)",), compare_to_first=lambda name: "other loss" not in name)

    def floor():
        h.grad = None
        W.grad = None
        z = F.linear(h, W)
        z.backward(torch.randn_like(z) if SMOKE else z)
    ms, mem = bench(floor)
    emit(section="ce_none", shape=f"llama3-8b head {N} tokens", impl="3-matmul floor (cuBLAS)", ms=round(ms, 3),
         peak_gib=round(mem, 3))


if __name__ == "__main__":
    secs = [a for a in sys.argv[1:] if a != "profile"] or ["check", "time"]
    if DEV == "cuda":
        import triton

        emit(section="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    if "check" in secs:
        check()
    if "time" in secs:
        time_head()
    if "frozen" in secs:
        time_head(frozen=True)
    if "grpo" in secs:
        time_grpo_loss()
    if "ce_none" in secs:
        time_ce_none()
