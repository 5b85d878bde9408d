"""64-bit offsets on the GPU: the public ops at sizes where a kernel's element offsets pass 2**31, forward and
backward, checked against float64.

Cases (bf16, each in its own try block, tensors freed between cases):

* ``lora``: ``lora_linear`` with x [150000, 14336] (an 8B down_proj at 150k tokens: 2.15e9 elements of x), out
  4096, r 16, dropout 0.1 (the dropout kernels address x, grad x and the keep mask with row offsets past 2**31),
  one adapter and a run of two. y and grad x on sampled rows (rows 149797+ start past 2**31) against float64 of
  just those rows; grad A and grad B (sums over every row) against a float64 computation in row chunks.
* ``lce_mean`` / ``lce_none``: ``linear_cross_entropy`` with N 20000, V 128256, D 256 and ``chunk_bytes`` big
  enough for one logits chunk of N x V = 2.57e9 entries (rows 16744+ past 2**31): the gradient written in the
  forward (mean) and the recompute backward with per-token upstream grads (none).
* ``logp``: ``linear_log_probs`` (with entropy) at the same sizes, per-token upstream grads for both outputs.
* ``lce_scale``: the grad-scaling kernel of the lm-head ops on a tensor of 2**31 + 2**20 elements.

The lm-head references are computed in float64 chunk by chunk over all rows; their rows near the end are reported
separately. Peak memory stays under ~25 GiB, the run takes well under 2 minutes on an H200 (mostly Triton
compilation).

Run (device machine):  python benchmarks/check_int64_offsets.py
Writes $OUT/int64_offsets.jsonl (one row per case, ``ok`` true/false, ``error`` when a case raised) and prints
the rows. Without CUDA it runs a tiny smoke version through the Triton interpreter with the int64 path forced.
"""
from __future__ import annotations

import gc
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():  # smoke version: the Triton kernels through the interpreter (before triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import DEV, SMOKE, jsonl_emitter  # noqa: E402

import fxfuse  # noqa: E402,F401
from fxfuse.kernels import linear_cross_entropy as KLCE  # noqa: E402
from fxfuse.kernels import linear_log_probs as KLOGP  # noqa: E402
from fxfuse.kernels import lm_head_rows  # noqa: E402
from fxfuse.kernels import lora_linear as KLORA  # noqa: E402
from fxfuse.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from fxfuse.ops.linear_log_probs import linear_log_probs  # noqa: E402
from fxfuse.ops.lora_linear import lora_dropout_keep_mask, lora_linear  # noqa: E402

emit = jsonl_emitter("int64_offsets.jsonl")
I32 = 2**31 - 1
TOL = 1.5e-2  # bf16 (bench_lora / test_lce_op use 1e-2 / 1.5e-2 at normal sizes); a wrapped offset gives O(1)

if SMOKE:  # run the kernels (interpreter) and their int64 path at tiny sizes
    KLORA.FORCE_TRITON = KLCE.FORCE_TRITON = KLOGP.FORCE_TRITON = True
    KLORA.FORCE_INT64_IDX = True
    LORA = dict(N=300, din=96, dout=64, r=16)
    LM = dict(N=96, V=1000, D=32)
    SCALE_NUMEL = 5000
else:
    LORA = dict(N=150_000, din=14336, dout=4096, r=16)
    LM = dict(N=20_000, V=128_256, D=256)
    SCALE_NUMEL = 2**31 + 2**20


def rel(a, b):
    a, b = a.double(), b.double()
    return float(f"{((a - b).norm() / b.norm().clamp_min(1e-300)).item():.3e}")


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _rng_state():
    return torch.cuda.get_rng_state() if DEV == "cuda" else torch.random.get_rng_state()


def _set_rng_state(s):
    (torch.cuda.set_rng_state if DEV == "cuda" else torch.random.set_rng_state)(s)


def _free():
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def run_case(name, fn, **info):
    """Run one case: emit its row (errors, ok, seconds, peak GiB) or the exception it raised."""
    _free()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        row = fn()
        _sync()
        row = dict(case=name, **info, **row)
    except Exception as e:  # record and go on with the next case
        traceback.print_exc()
        row = dict(case=name, **info, ok=False, error=f"{type(e).__name__}: {e}"[:600])
    row["seconds"] = round(time.perf_counter() - t0, 2)
    if DEV == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    row["device"] = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke, interpreter)"
    emit(**row)
    _free()
    return row


# ================================================================================================ LoRA
def lora_case(n_adapters: int):
    N, din, dout, r = LORA["N"], LORA["din"], LORA["dout"], LORA["r"]
    p, scalings = 0.1, [2.0, 0.5][:n_adapters]
    dt = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(N, din, device=DEV, dtype=dt).requires_grad_()
    W = (torch.randn(dout, din, device=DEV, dtype=dt) * din ** -0.5)
    As = [(torch.randn(r, din, device=DEV, dtype=dt) * din ** -0.5).requires_grad_() for _ in range(n_adapters)]
    Bs = [(torch.randn(dout, r, device=DEV, dtype=dt) * r ** -0.5).requires_grad_() for _ in range(n_adapters)]

    flags = []  # INT64_IDX of every dropout-kernel launch
    real = KLORA._int64_idx
    KLORA._int64_idx = lambda *t: flags.append(real(*t)) or flags[-1]
    try:
        st = _rng_state()
        y = lora_linear(x, W, As, Bs, scalings, dropout_p=[p] * n_adapters)
        go = torch.randn_like(y)
        gx, *gAB = torch.autograd.grad(y, [x] + As + Bs, go)
        _sync()
        gAs, gBs = gAB[:n_adapters], gAB[n_adapters:]
        # the masks the op drew (same seeds), from the mask kernel (its int8 output passes 2**31 too)
        _set_rng_state(st)
        seeds = KLORA.draw_seeds(n_adapters, DEV)
        masks = [lora_dropout_keep_mask(seeds[i], N, din, p, DEV) for i in range(n_adapters)]
    finally:
        KLORA._int64_idx = real
    inv = 1.0 / (1.0 - p)
    x.requires_grad_(False)

    # y and grad x on sampled rows (float64 of just those rows)
    boundary = -(-(2**31) // din)  # first row whose offsets all pass 2**31
    rows = sorted({0, 1, N // 2, boundary - 1, boundary, boundary + 1, N - 33, N - 32, N - 2, N - 1}
                  | set(torch.randint(0, N, (6,), generator=torch.Generator().manual_seed(1)).tolist()))
    rows = [i for i in rows if 0 <= i < N]
    ri = torch.tensor(rows, device=DEV)
    Wd = W.double()
    xs, gos = x[ri].double(), go[ri].double()
    y_ref = xs @ Wd.t()
    gx_ref = gos @ Wd
    for A, B, s, m in zip(As, Bs, scalings, masks):
        k = m[ri].double()
        y_ref += s * ((xs * k * inv) @ A.double().t()) @ B.double().t()
        gx_ref += s * ((gos @ B.double()) @ A.double()) * k * inv
    y_s, gx_s = y[ri], gx[ri]
    tail = [j for j, i in enumerate(rows) if i * din + din - 1 > I32]
    errs = {"y_rows": rel(y_s, y_ref), "gx_rows": rel(gx_s, gx_ref),
            "y_rows_past_2_31": rel(y_s[tail], y_ref[tail]), "gx_rows_past_2_31": rel(gx_s[tail], gx_ref[tail])}
    per_row_gx = {str(i): rel(gx_s[j], gx_ref[j]) for j, i in enumerate(rows) if i >= boundary - 1}
    del y, gx, xs, gos, y_ref, gx_ref, y_s, gx_s

    # grad A, grad B: sums over every row, float64 in row chunks
    step = 8192 if not SMOKE else 64
    for a_i, (A, B, s, m, gA, gB) in enumerate(zip(As, Bs, scalings, masks, gAs, gBs)):
        gA_ref = torch.zeros(r, din, dtype=torch.float64, device=DEV)
        gB_ref = torch.zeros(dout, r, dtype=torch.float64, device=DEV)
        Ad, Bd = A.double(), B.double()
        for s0 in range(0, N, step):
            xd = x[s0:s0 + step].double() * m[s0:s0 + step] * inv
            g_c = go[s0:s0 + step].double()
            gA_ref += s * (g_c @ Bd).t() @ xd
            gB_ref += g_c.t() @ (s * (xd @ Ad.t()))
            del xd, g_c
        errs[f"gA{a_i}"] = rel(gA, gA_ref)
        errs[f"gB{a_i}"] = rel(gB, gB_ref)
    keep = [round(m.float().mean().item(), 4) for m in masks]
    max_off = KLORA.max_offset(x.shape, x.stride())
    return dict(errors=errs, gx_per_row_near_end=per_row_gx, keep_fraction=keep, rows=rows,
                x_max_offset=max_off, int64_idx_launches=flags,
                ok=all(v < TOL for v in errs.values()) and bool(flags) and all(flags) == (max_off > I32 or SMOKE))


# ================================================================================================ lm-head
def _lm_inputs(seed=0):
    N, V, D = LM["N"], LM["V"], LM["D"]
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(N, D, device=DEV, generator=g).to(torch.bfloat16).requires_grad_()
    W = (torch.randn(V, D, device=DEV, generator=g) * (2.0 / D ** 0.5)).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (N,), device=DEV, generator=g)
    return h, W, y


def _one_chunk_bytes(N, V, elem=2):
    """A ``chunk_bytes`` for which the whole [N, V] logits are one chunk (rows_per_chunk rounds to 128 rows)."""
    cb = (N + 128) * V * elem
    assert lm_head_rows.rows_per_chunk(V, elem, cb, N) == N
    return cb


def _ref_chunks(h, W, step=2048):
    """(start, end, z [rows, V] float64) over row chunks of h @ W.T."""
    Wd = W.detach().double()
    for s0 in range(0, h.shape[0], step):
        yield s0, min(s0 + step, h.shape[0]), h.detach()[s0:s0 + step].double() @ Wd.t(), Wd


def _lm_errors(pairs, N, V):
    """Norm-relative errors of the (name, got, ref) pairs, plus over the rows whose chunk offsets pass 2**31 for
    the per-row ones (first dimension N)."""
    first_past = -(-(2**31) // V)
    errs = {}
    for name, got, ref in pairs:
        errs[name] = rel(got, ref)
        if got.dim() >= 1 and got.shape[0] == N and first_past < N:
            errs[name + "_rows_past_2_31"] = rel(got[first_past:], ref[first_past:])
    return errs


def lce_case(reduction: str):
    N, V, D = LM["N"], LM["V"], LM["D"]
    h, W, y = _lm_inputs()
    y[::7] = -100
    y[-3] = -100  # an ignored row near the end
    cb = _one_chunk_bytes(N, V)
    gif = reduction == "mean"  # gradient written in the forward (mean), recompute backward (none)
    loss = linear_cross_entropy(h, W, y, reduction=reduction, grad_in_forward=gif, chunk_bytes=cb)
    go = (torch.randn(N, device=DEV, generator=torch.Generator(device=DEV).manual_seed(2))
          if reduction == "none" else torch.ones((), device=DEV))
    gh, gw = torch.autograd.grad(loss, [h, W], go)
    _sync()
    # float64, chunk by chunk over all rows
    valid = y != -100
    n_valid = valid.sum().double()
    loss_rows = torch.zeros(N, dtype=torch.float64, device=DEV)
    gh_ref = torch.zeros(N, D, dtype=torch.float64, device=DEV)
    gw_ref = torch.zeros(V, D, dtype=torch.float64, device=DEV)
    for s0, e, z, Wd in _ref_chunks(h, W):
        yc, vc = y[s0:e], valid[s0:e]
        lse = torch.logsumexp(z, dim=1)
        zy = z.gather(1, yc.clamp_min(0).unsqueeze(1)).squeeze(1)
        loss_rows[s0:e] = torch.where(vc, lse - zy, 0.0)
        gc_ = go[s0:e].double() if reduction == "none" else go.double() / n_valid
        d = torch.exp(z - lse.unsqueeze(1))
        d[torch.arange(e - s0, device=DEV), yc.clamp_min(0)] -= 1.0
        d *= torch.where(vc, gc_, 0.0).unsqueeze(1)
        gh_ref[s0:e] = d @ Wd
        gw_ref += d.t() @ h.detach()[s0:e].double()
        del z, d
    loss_ref = loss_rows if reduction == "none" else loss_rows.sum() / n_valid
    errs = _lm_errors([("loss", loss, loss_ref), ("grad_hidden", gh, gh_ref), ("grad_weight", gw, gw_ref)], N, V)
    return dict(errors=errs, chunk_rows=N, chunk_max_offset=N * V - 1,
                ok=all(v < TOL for v in errs.values()))


def logp_case():
    N, V, D = LM["N"], LM["V"], LM["D"]
    h, W, idx = _lm_inputs(seed=3)
    cb = _one_chunk_bytes(N, V)
    logp, ent = linear_log_probs(h, W, idx, return_entropy=True, chunk_bytes=cb)
    gen = torch.Generator(device=DEV).manual_seed(4)
    g_logp = torch.randn(N, device=DEV, generator=gen)
    g_ent = 0.1 * torch.randn(N, device=DEV, generator=gen)
    gh, gw = torch.autograd.grad([logp, ent], [h, W], [g_logp, g_ent])
    _sync()
    logp_ref = torch.empty(N, dtype=torch.float64, device=DEV)
    ent_ref = torch.empty(N, dtype=torch.float64, device=DEV)
    gh_ref = torch.zeros(N, D, dtype=torch.float64, device=DEV)
    gw_ref = torch.zeros(V, D, dtype=torch.float64, device=DEV)
    for s0, e, z, Wd in _ref_chunks(h, W):
        lsm = torch.log_softmax(z, dim=1)
        del z
        pr = lsm.exp()
        ar = torch.arange(e - s0, device=DEV)
        logp_ref[s0:e] = lsm[ar, idx[s0:e]]
        H = -(pr * lsm).sum(1)
        ent_ref[s0:e] = H
        # d logp / d z = onehot - p;  d H / d z = -p * (log p + H)
        d = -pr * g_logp[s0:e].double().unsqueeze(1)
        d[ar, idx[s0:e]] += g_logp[s0:e].double()
        d -= g_ent[s0:e].double().unsqueeze(1) * pr * (lsm + H.unsqueeze(1))
        gh_ref[s0:e] = d @ Wd
        gw_ref += d.t() @ h.detach()[s0:e].double()
        del lsm, pr, d
    errs = _lm_errors([("logp", logp, logp_ref), ("entropy", ent, ent_ref), ("grad_hidden", gh, gh_ref),
                       ("grad_weight", gw, gw_ref)], N, V)
    return dict(errors=errs, chunk_rows=N, chunk_max_offset=N * V - 1, ok=all(v < TOL for v in errs.values()))


def lce_scale_case():
    """The lm-head ops' in-place grad scaling (``t *= g`` read from the device) on more than 2**31 elements."""
    n = SCALE_NUMEL
    t = torch.ones(n, device=DEV, dtype=torch.bfloat16)
    t[-5:] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.bfloat16)
    g = torch.tensor(0.5, device=DEV)
    KLCE.scale_by_device_scalar_(t, g)
    _sync()
    probes = [0, 1, n // 2, 2**31 - 1 if n > 2**31 else n - 6, n - 6, n - 5, n - 4, n - 3, n - 2, n - 1]
    got = t[torch.tensor(probes, device=DEV)].float().tolist()
    want = [0.5] * 5 + [0.5, 1.0, 1.5, 2.0, 2.5]
    bad = int((t != 0.5).sum().item()) - 4  # every element but the last four is 0.5
    return dict(numel=n, probes=dict(zip(map(str, probes), got)), elements_wrong=bad,
                ok=got == want and bad == 0)


def main():
    print(f"device {DEV}{' (smoke: tiny sizes through the interpreter, int64 path forced)' if SMOKE else ''}",
          flush=True)
    rows = [
        run_case("lora", lambda: lora_case(1), **LORA, adapters=1, dropout=0.1),
        run_case("lora", lambda: lora_case(2), **LORA, adapters=2, dropout=0.1),
        run_case("lce_mean", lambda: lce_case("mean"), **LM),
        run_case("lce_none", lambda: lce_case("none"), **LM),
        run_case("logp", logp_case, **LM),
        run_case("lce_scale", lce_scale_case),
    ]
    ok = all(r.get("ok") for r in rows)
    print(f"{'ALL OK' if ok else 'FAILURES'}: {sum(bool(r.get('ok')) for r in rows)}/{len(rows)} cases ok", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
