"""The lm-head loss under tensor parallelism, on one host's GPUs (torchrun, one rank per GPU, NCCL).

The Llama-3-8B head (vocabulary 128,256, hidden 4,096, bf16) split over the vocabulary with ``ColwiseParallel``,
every rank holding the same tokens' hidden states, forward + backward of the mean cross-entropy:

* ``gathered``: the logits all-gathered (``output_layouts=Replicate()``, HF's ``colwise_rep``), then a plain
  cross-entropy: every rank holds the whole [tokens x vocab] logits;
* ``loss_parallel``: the logits stay sharded into ``loss_parallel()``'s cross-entropy (torchtitan's recipe);

each eager, compiled by Inductor and compiled by fxfuse (which runs ``fxfuse::vocab_parallel_cross_entropy`` for
both). ``--loss logp`` times RL's objective instead, the sampled tokens' log-probs at a temperature weighted by
advantages (``--loss logp_entropy``: minus 0.01 x the mean entropy, an entropy bonus), through the gathered head
(fxfuse: ``fxfuse::vocab_parallel_log_probs``). Per row: median ms of 10 timed steps after 3 warm-up steps (CUDA events, the ranks in lockstep), the peak
memory above the weights and inputs (rank 0), and, at the smallest token count, the loss and gradients against a
float64 reference. Rows to $OUT/tp_head.jsonl (each with machine, versions, commit), plot $OUT/tp_head.png
(``--plot ROWS.jsonl [PNG]`` redraws one from saved rows).

    torchrun --nproc_per_node 2 benchmarks/bench_tp_head.py [--tokens 4096,16384] [--impls ...]

Without a GPU it runs on the CPU over gloo (a smoke run: give it ``--vocab 1000 --hidden 64 --tokens 64``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OUT = os.environ.get("OUT", "/tmp")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
V, D = 128256, 4096  # --vocab, --hidden
LOSS = "ce"  # --loss
IMPLS = [f"{c}-{layout}" for layout in ("gathered", "loss_parallel") for c in ("eager", "inductor", "fxfuse")]


def _versions():
    import transformers
    import triton

    # FXFUSE_TREE: the tree's commit where the copy's git metadata is not the working tree's (the device machines)
    commit = os.environ.get("FXFUSE_TREE") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    return dict(machine=torch.cuda.get_device_name() if CUDA else "cpu", gpus=dist.get_world_size(), torch=torch.__version__,
                triton=triton.__version__, transformers=transformers.__version__, commit=commit)


def _head(mesh, layout, seed=0):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(D, V, bias=False, device=DEV, dtype=torch.bfloat16))
    with torch.no_grad():
        m[0].weight.normal_(0, D ** -0.5)
    style = ColwiseParallel(output_layouts=Replicate()) if layout == "gathered" else \
        ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(m, mesh, {"0": style})
    return m


def _rl_objective(z, y, loss):
    """-(advantage-weighted log-probs of the sampled tokens y at temperature 0.7), with ``logp_entropy`` minus 0.01 x
    the mean entropy; ``z`` the logits."""
    lp = torch.log_softmax(z / 0.7, -1)
    logp = lp.gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    out = -(logp * torch.linspace(-1.0, 1.0, logp.numel(), device=logp.device, dtype=logp.dtype)).mean()
    if loss == "logp_entropy":
        out = out - 0.01 * (-(lp.exp() * lp).sum(-1)).mean()
    return out


def _step_fn(m, impl, loss="ce"):
    compiler, layout = impl.split("-", 1)

    def step(h, y):
        logits = m(h)
        if loss.startswith("logp"):  # RL: the sampled tokens' log-probs at a temperature, advantage-weighted
            return _rl_objective(logits.float(), y, loss)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    if compiler == "inductor":
        step = torch.compile(step)
    elif compiler == "fxfuse":
        step = torch.compile(step, backend="fxfuse")
    ctx = contextlib.nullcontext
    if layout == "loss_parallel":
        from torch.distributed.tensor.parallel import loss_parallel as ctx
    return step, ctx


def _run(m, step, ctx, h, y):
    with ctx():
        loss = step(h, y)
        loss.backward()
    return loss


def _time(m, step, ctx, h, y, warmup=3, reps=10):
    for _ in range(warmup):
        _run(m, step, ctx, h, y)
        m.zero_grad(set_to_none=True)
        h.grad = None
    dist.barrier()
    ts = []
    for _ in range(reps):
        if CUDA:
            torch.cuda.synchronize()
        t = time.perf_counter()
        _run(m, step, ctx, h, y)
        if CUDA:
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
        m.zero_grad(set_to_none=True)
        h.grad = None
    if not CUDA:
        return sorted(ts)[len(ts) // 2], float("nan"), ts
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _run(m, step, ctx, h, y)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    m.zero_grad(set_to_none=True)
    h.grad = None
    return sorted(ts)[len(ts) // 2], peak, ts


def _reference(m, h, y):
    """float64 loss, grad hidden and this rank's grad-weight slice, the logits chunk by chunk (rank-local)."""
    from torch.distributed.tensor import DTensor

    w = m[0].weight.full_tensor() if isinstance(m[0].weight, DTensor) else m[0].weight
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    if LOSS.startswith("logp"):
        loss = _rl_objective(hd @ wd.T, y, LOSS)
    else:
        loss = F.cross_entropy((hd @ wd.T), y.reshape(-1))
    loss.backward()
    return loss.detach(), hd.grad, wd.grad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--loss", default="ce", choices=("ce", "logp", "logp_entropy"),
                    help="ce: mean cross-entropy; logp: RL log-probs of the sampled tokens (gathered impls only); "
                         "logp_entropy: the same with an entropy bonus")
    ap.add_argument("--vocab", type=int, default=V)
    ap.add_argument("--hidden", type=int, default=D)
    a = ap.parse_args()
    globals().update(V=a.vocab, D=a.hidden, LOSS=a.loss)
    dist.init_process_group("nccl" if CUDA else "gloo")
    rank = dist.get_rank()
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import fxfuse

    mesh = init_device_mesh(DEV, (dist.get_world_size(),))
    info = _versions()
    rows = []
    tokens = [int(t) for t in a.tokens.split(",")]
    for n in tokens:
        g = torch.Generator(device=DEV).manual_seed(1)
        h = torch.randn(n, D, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
        y = torch.randint(0, V, (n,), device=DEV, generator=g)
        y[::7] = -100
        ref = None
        for impl in a.impls.split(","):
            m = _head(mesh, impl.split("-", 1)[1])
            step, ctx = _step_fn(m, impl, a.loss)
            row = dict(bench="tp_head", objective=a.loss, impl=impl, tokens=n, vocab=V, hidden=D, dtype="bf16", **info)
            try:
                ms, peak, ts = _time(m, step, ctx, h, y)
                row.update(ms=round(ms, 3), peak_gib=round(peak, 3), ms_all=[round(t, 3) for t in ts])
                if n == tokens[0]:  # accuracy against float64 at the smallest size
                    if ref is None:
                        ref = _reference(m, h, y)
                    loss = _run(m, step, ctx, h, y).detach()
                    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                    gw = m[0].weight.grad
                    gw = gw.to_local() if isinstance(gw, DTensor) else gw
                    from fxfuse.ops.vocab_parallel_cross_entropy import vocab_slice

                    s0, ln = vocab_slice(V, rank, dist.get_world_size())

                    def err(x, r):
                        return float(f"{(x.double() - r).abs().max().item():.3e}")

                    row.update(loss=float(loss), loss_err=err(loss, ref[0]), grad_hidden_err=err(h.grad, ref[1]),
                               grad_weight_err=err(gw, ref[2][s0:s0 + ln]))
                    m.zero_grad(set_to_none=True)
                    h.grad = None
                if impl.startswith("fxfuse"):
                    recs = [f"{r.pass_name}: {r.status} {r.reason[:100]}" for rep in fxfuse.reports()
                            for r in rep.records]
                    row["fused"] = [next((x for x in reversed(recs) if x.startswith(p)), f"{p}: no site")
                                    for p in (("linear_log_probs", "log_probs_loss") if a.loss.startswith("logp")
                                              else ("linear_cross_entropy",))]
            except Exception as e:  # noqa: BLE001  (a row that fails is reported, the others still run)
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if rank == 0:
                rows.append(row)
                with open(os.path.join(OUT, "tp_head.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps({k: v for k, v in row.items() if k != "ms_all"}), flush=True)
            del m, step
            torch._dynamo.reset()
            if CUDA:
                torch.cuda.empty_cache()
    if rank == 0:
        _plot(rows)
    dist.barrier()
    dist.destroy_process_group()


def _plot(rows):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in rows if "ms" in r]
    tokens = sorted({r["tokens"] for r in ok})
    impls = [i for i in IMPLS if any(r["impl"] == i for r in ok)]  # the impls this run measured
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ms", "fwd+bwd ms"), (axes[1], "peak_gib", "peak GiB above inputs (rank 0)")):
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            vals = [next((r[key] for r in ok if r["impl"] == impl and r["tokens"] == t), 0) for t in tokens]
            ax.bar([j + i * width for j in range(len(tokens))], vals, width, label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tokens))], [f"{t} tokens" for t in tokens])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    r0 = ok[0] if ok else {}
    what = {"logp": "RL log-probs", "logp_entropy": "RL log-probs + entropy"}.get(r0.get("objective"),
                                                                              "lm-head loss")
    fig.suptitle(f"Llama-3-8B {what}, vocabulary split over {r0.get('gpus')} x {r0.get('machine')} "
                 f"(torch {r0.get('torch')}, {r0.get('commit')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "tp_head.png"), dpi=110)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"]:
        rows = [json.loads(line) for line in open(sys.argv[2])]
        call = max(r.get("call", 0) for r in rows)
        OUT = os.path.dirname(sys.argv[3]) if len(sys.argv) > 3 else OUT
        _plot([r for r in rows if r.get("call", 0) == call])
        if len(sys.argv) > 3:
            os.replace(os.path.join(OUT, "tp_head.png"), sys.argv[3])
    else:
        main()
