"""LoRA linear on the GPU: correctness of ``fxfuse::lora_linear`` against a float64 reference (same dropout masks),
then fwd+bwd time and extra peak memory side by side with the base matmul alone, PEFT eager, PEFT + Inductor and
PEFT + fxfuse.

The timing setup mirrors /work/shared/anchors/anchors_gpu.py ``sec_lora`` exactly (PEFT ``inject_adapter_in_model``
on a bias-free bf16 Linear, r16, alpha 32, lora weights ~N(0, 0.02), x [16384, 4096] requiring grad, same ``bench``),
so the rows compare with DESIGN.md sec. 5. Extra rows: the op called directly; per-kernel profile; launch-setting
sweeps of the two dropout kernels (section ``tune``).

Run (device machine):  PYTHONPATH=. python3 benchmarks/bench_lora.py [check] [check-groups] [time] [time-groups] [tune] [rng]
Writes $OUT/bench_lora.jsonl and prints rows. On CPU it runs a tiny smoke version.
"""
from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.nn as nn
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import DEV, SMOKE, bench, jsonl_emitter, rel  # noqa: E402

import fxfuse  # noqa: E402,F401
from fxfuse.kernels import lora_linear as K  # noqa: E402
from fxfuse.kernels import lowrank_gemm as G  # noqa: E402
from fxfuse.ops.lora_linear import lora_dropout_keep_mask, lora_linear  # noqa: E402

emit = jsonl_emitter("bench_lora.jsonl")


def _rng_state():
    return torch.cuda.get_rng_state() if DEV == "cuda" else torch.random.get_rng_state()


def _set_rng_state(s):
    (torch.cuda.set_rng_state if DEV == "cuda" else torch.random.set_rng_state)(s)


# ------------------------------------------------------------------------------------------------ correctness
def check():
    cases = [  # N, din, dout, ranks, dropout ps, bias, dtype
        (1000, 320, 200, (16,), (0.0,), False, torch.bfloat16),
        (1000, 320, 200, (16,), (0.1,), True, torch.bfloat16),
        (777, 4096, 1030, (24,), (0.05,), False, torch.bfloat16),
        (513, 200, 300, (8, 16), (0.0, 0.3), True, torch.bfloat16),
        (1000, 320, 200, (16,), (0.1,), True, torch.float32),
        (333, 96, 80, (4, 8), (0.2, 0.0), False, torch.float32),
        (256, 128, 64, (16,), (0.1,), False, torch.float16),
        # PEFT's fp32 adapters on a bf16 model (get_peft_model's default): A is rounded inside the kernels
        (777, 4096, 1030, (16,), (0.05,), False, torch.bfloat16, torch.float32),
        (1000, 320, 200, (16,), (0.1,), True, torch.bfloat16, torch.float32),
        (513, 200, 300, (8, 16), (0.0, 0.3), True, torch.bfloat16, torch.float32),
    ]
    if SMOKE:
        cases = cases[:2]
    for case in cases:
        try:
            _check_case(*case)
        except Exception as e:
            emit(section="lora_check", case=str(case), error=f"{type(e).__name__}: {e}"[:400], ok=False)
            traceback.print_exc()


def _check_case(N, din, dout, ranks, ps, has_bias, dt, adt=None):
    adt = adt or dt
    torch.manual_seed(0)
    x = torch.randn(N, din, device=DEV, dtype=dt, requires_grad=True)
    W = (torch.randn(dout, din, device=DEV) / din ** 0.5).to(dt)
    b = torch.randn(dout, device=DEV, dtype=dt) if has_bias else None
    As = [(torch.randn(r, din, device=DEV) / din ** 0.5).to(adt).requires_grad_() for r in ranks]
    Bs = [(torch.randn(dout, r, device=DEV) / r ** 0.5).to(adt).requires_grad_() for r in ranks]
    ss = [2.0 / (i + 1) for i in range(len(ranks))]
    st = _rng_state()
    if DEV == "cuda":  # the op must not synchronise with the host (forward and backward)
        torch.cuda.set_sync_debug_mode("error")
    try:
        y = lora_linear(x, W, As, Bs, ss, bias=b, dropout_p=list(ps))
        go = torch.randn_like(y)
        gs = torch.autograd.grad(y, [x] + As + Bs, go)
    finally:
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    _set_rng_state(st)
    seeds = K.draw_seeds(len(ps), DEV)
    masks = [lora_dropout_keep_mask(seeds[i], N, din, p, DEV) if p > 0 else None for i, p in enumerate(ps)]
    d = lambda t: t.detach().double().requires_grad_()  # noqa: E731
    xr, Ar, Br = d(x), [d(a) for a in As], [d(q) for q in Bs]
    yr = K.lora_reference(xr, W.double(), b.double() if b is not None else None, Ar, Br, ss, masks, ps)
    gr = torch.autograd.grad(yr, [xr] + Ar + Br, go.double())
    names = ["x"] + [f"A{i}" for i in range(len(As))] + [f"B{i}" for i in range(len(Bs))]
    errs = {"y": rel(y, yr), **{f"g{n}": rel(a, r) for n, a, r in zip(names, gs, gr)}}
    keep = [round(m.float().mean().item(), 4) for m in masks if m is not None]
    tol = 1e-2 if dt != torch.float32 else 1e-4
    emit(section="lora_check", N=N, din=din, dout=dout, ranks=list(ranks), dropout=list(ps), bias=has_bias,
         dtype=str(dt), adapter_dtype=str(adt), errors=errs, keep_fraction=keep, ok=all(v < tol for v in errs.values()))


# ------------------------------------------------------------------------------------------------ timing
def _lora_model(din, dout, r, dropout):
    import peft

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(din, dout, bias=False)).to(DEV, torch.bfloat16)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout,
                                                         target_modules=["0"]), model)
    lw = [p for n, p in model.named_parameters() if "lora" in n]
    for n, p in model.named_parameters():
        p.requires_grad_("lora" in n)
    with torch.no_grad():
        for p in lw:
            p.normal_(0, 0.02)
    return model, lw


def time_layers():
    cases = [("q_proj 4096->4096 r16", 16384, 4096, 4096, 16), ("up_proj 4096->14336 r16", 16384, 4096, 14336, 16)]
    if SMOKE:
        cases = [("tiny", 256, 64, 96, 8)]
    for name, N, din, dout, r in cases:
        for dropout in (0.0, 0.05):
            model, lw = _lora_model(din, dout, r, dropout)
            x = torch.randn(N, din, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            go = torch.randn(N, dout, device=DEV, dtype=torch.bfloat16)
            flops = 2 * 2 * N * din * dout
            lin = model[0]
            A, B = lin.lora_A["default"].weight, lin.lora_B["default"].weight
            s = lin.scaling["default"]
            W = lin.base_layer.weight

            def op_call():
                return lora_linear(x, W, A, B, s, dropout_p=dropout)

            variants = {"peft eager": model, "peft inductor": torch.compile(model),
                        "peft fxfuse": torch.compile(model, backend="fxfuse"),
                        "fxfuse op": "op", "fxfuse op (low-rank GEMM off: cuBLAS addmm_)": "op-addmm"}
            for iname, m in variants.items():
                def step(m=m):
                    x.grad = None
                    for p in lw:
                        p.grad = None
                    G.ENABLED = m != "op-addmm"  # for the whole step: the backward's grad x takes it too
                    try:
                        y = op_call() if m in ("op", "op-addmm") else m(x)
                        y.backward(go)
                    finally:
                        G.ENABLED = True
                try:
                    ms, mem = bench(step)
                    emit(section="lora", shape=name, dropout=dropout, impl=iname, ms=round(ms, 3),
                         peak_gib=round(mem, 3), tflops_base=round(flops / ms / 1e9, 1))
                except Exception as e:
                    emit(section="lora", shape=name, dropout=dropout, impl=iname, error=f"{type(e).__name__}: {e}"[:300])
                    traceback.print_exc()
            Wb = torch.randn(dout, din, device=DEV, dtype=torch.bfloat16)

            def base_only():
                x.grad = None
                y = torch.nn.functional.linear(x, Wb)
                y.backward(go)
            ms, mem = bench(base_only)
            emit(section="lora", shape=name, dropout=dropout, impl="base matmul only (floor)", ms=round(ms, 3),
                 peak_gib=round(mem, 3), tflops_base=round(flops / ms / 1e9, 1))
            # where the fused op's time goes: forward alone, and the base GEMM + addmm epilogue alone
            with torch.no_grad():
                ms_f, _ = bench(op_call)
                C = torch.randn(N, dout, device=DEV, dtype=torch.bfloat16)
                ms_mm, _ = bench(lambda: torch.mm(x, Wb.t()))
                ms_addmm, _ = bench(lambda: torch.addmm(C, x, Wb.t()))
            emit(section="lora_parts", shape=name, dropout=dropout, fwd_op_ms=round(ms_f, 3), mm_ms=round(ms_mm, 3),
                 addmm_ms=round(ms_addmm, 3))
            del model, variants
            torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------ profile
def profile():
    """Per-kernel CUDA time of the op's fwd+bwd (q_proj shape), and alternatives for the two gy products."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    N, din, dout, r = (16384, 4096, 4096, 16) if not SMOKE else (256, 64, 96, 8)
    x = torch.randn(N, din, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(dout, din, device=DEV, dtype=torch.bfloat16) / din ** 0.5
    A = (torch.randn(r, din, device=DEV, dtype=torch.bfloat16) * 0.02).requires_grad_()
    B = (torch.randn(dout, r, device=DEV, dtype=torch.bfloat16) * 0.02).requires_grad_()
    go = torch.randn(N, dout, device=DEV, dtype=torch.bfloat16)
    for p in (0.0, 0.05):
        def step():
            y = lora_linear(x, W, A, B, 2.0, dropout_p=p)
            y.backward(go)
        for _ in range(3):
            step()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
        with tprofile(activities=acts) as prof:
            for _ in range(5):
                step()
            if DEV == "cuda":
                torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", 0) if DEV == "cuda" else e.cpu_time_total
            if t and (DEV != "cuda" or e.device_type.name == "CUDA"):
                rows.append((e.key[:90], round(t / 5 / 1e3, 4), e.count // 5))
        rows.sort(key=lambda t: -t[1])
        emit(section="lora_profile", dropout=p, kernels_ms_per_step=rows[:14])
    Bs = B.detach() * 2.0
    V = torch.randn(N, r, device=DEV, dtype=torch.bfloat16)
    alts = {"cuBLAS gy@Bs": lambda: go @ Bs, "cuBLAS gy.T@V": lambda: go.t() @ V,
            "cuBLAS V.T@gy": lambda: V.t() @ go, "cuBLAS x@A.T": lambda: x.detach() @ A.detach().t(),
            "cuBLAS V@Bs.T": lambda: V @ Bs.t()}
    with torch.no_grad():
        for name, fn in alts.items():
            try:
                ms, _ = bench(fn)
                emit(section="lora_alt", what=name, ms=round(ms, 4))
            except Exception as e:
                emit(section="lora_alt", what=name, error=f"{type(e).__name__}: {e}"[:300])


def _dropout_kernel_inputs(N, din, r, na=1):
    """x, A, V, gV, C, gA (fp32, as the backward accumulates it), seeds for timing the two dropout kernels alone
    on a run of ``na`` adapters (q/k/v after horizontal fusion: 3)."""
    bf = dict(device=DEV, dtype=torch.bfloat16)
    return (torch.randn(N, din, **bf), torch.randn(na * r, din, **bf) * 0.02, torch.empty(N, na * r, **bf),
            torch.randn(N, na * r, **bf), torch.empty(N, din, **bf),
            torch.zeros(na * r, din, device=DEV, dtype=torch.float32), K.draw_seeds(na, DEV))


def _down(x, A, V, seeds, na, r):
    return lambda: K._down_dropout(x, A, V, seeds, na, r, 2.0, 0.05)


def _up_bwd(gV, A, x, C, gA, seeds, na, r):
    return lambda: K._up_dropout_bwd(gV, A, x, C, gA, seeds, na, r, 2.0, 0.05, True, False)


def tune(sweep_launch=False):
    """The two dropout kernels alone, on runs of 1 / 2 / 3 adapters: time against cuBLAS ``x @ A.T`` at the q_proj
    and the e2e (Llama-3.2-1B, 4x2048) shapes, and optionally a launch-setting sweep."""
    r = 16
    shapes = [(16384, 4096), (8192, 2048), (8192, 8192)] if not SMOKE else [(256, 64)]
    for N, din in shapes:
        for na in (1, 2, 3):
            x, A, V, gV, C, gA, seeds = _dropout_kernel_inputs(N, din, r, na)
            with torch.no_grad():
                ms_mm, _ = bench(lambda: x @ A.t())
            emit(section="lora_tune", shape=[N, din], adapters=na, kernel="cuBLAS x @ A.T (no dropout)",
                 ms=round(ms_mm, 4))
            for what, fn in (("down", _down(x, A, V, seeds, na, r)), ("up_bwd both", _up_bwd(gV, A, x, C, gA, seeds, na, r))):
                try:
                    ms, _ = bench(fn)
                    emit(section="lora_tune", shape=[N, din], adapters=na, kernel=what, cfg=K.DOWN_CONFIG
                         if what == "down" else K.UP_BWD_CONFIG, ms=round(ms, 4))
                except Exception as e:
                    emit(section="lora_tune", shape=[N, din], adapters=na, kernel=what,
                         error=f"{type(e).__name__}: {e}"[:200])
                    traceback.print_exc()
    if not sweep_launch:
        return
    default_down, default_up = dict(K.DOWN_CONFIG), dict(K.UP_BWD_CONFIG)
    for N, din in shapes[1:] if not SMOKE else shapes:
        for na in (1, 3):
            x, A, V, gV, C, gA, seeds = _dropout_kernel_inputs(N, din, r, na)
            for BM, BK, nw, ns in ((32, 128, 4, 4), (64, 64, 4, 3), (32, 64, 4, 3), (16, 128, 4, 4),
                                   (64, 128, 4, 3), (32, 128, 8, 4), (64, 64, 8, 3)):
                K.DOWN_CONFIG = dict(BM=BM, BK=BK, num_warps=nw, num_stages=ns)
                ms, _ = bench(_down(x, A, V, seeds, na, r))
                emit(section="lora_tune", shape=[N, din], adapters=na, kernel="down", cfg=K.DOWN_CONFIG,
                     ms=round(ms, 4))
            for BM, BK, nw, ns in ((32, 128, 4, 3), (64, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (16, 128, 4, 3),
                                   (32, 128, 8, 3), (64, 128, 8, 3), (32, 256, 8, 3)):
                K.UP_BWD_CONFIG = dict(BM=BM, BK=BK, num_warps=nw, num_stages=ns)
                ms, _ = bench(_up_bwd(gV, A, x, C, gA, seeds, na, r))
                emit(section="lora_tune", shape=[N, din], adapters=na, kernel="up_bwd both", cfg=K.UP_BWD_CONFIG,
                     ms=round(ms, 4))
            K.DOWN_CONFIG, K.UP_BWD_CONFIG = dict(default_down), dict(default_up)


def rng_ablation():
    """How much of each dropout kernel is mask generation: Philox rounds 10 (default) / 7 / 3 / 0 (no mixing at
    all: the cost of everything but the RNG) for runs of 1 and 3 adapters, both kernels, e2e shapes."""
    r = 16
    shapes = [(8192, 2048), (8192, 8192)] if not SMOKE else [(256, 64)]
    default_mask = dict(K.MASK_CONFIG)
    for N, din in shapes:
        for na in (1, 3):
            x, A, V, gV, C, gA, seeds = _dropout_kernel_inputs(N, din, r, na)
            for rounds in (10, 7, 3, 0):
                K.MASK_CONFIG = dict(default_mask, ROUNDS=rounds)
                ms_d, _ = bench(_down(x, A, V, seeds, na, r))
                ms_u, _ = bench(_up_bwd(gV, A, x, C, gA, seeds, na, r))
                emit(section="lora_rng", shape=[N, din], adapters=na, rounds=rounds, down_ms=round(ms_d, 4),
                     up_bwd_ms=round(ms_u, 4))
            K.MASK_CONFIG = dict(default_mask)


# ------------------------------------------------------------------------------------------------ sibling groups
def check_groups():
    """lora_linear_group on the GPU against float64 per-projection references (same masks), no host sync."""
    from fxfuse.ops.lora_linear import lora_linear_group

    cases = [  # N, din, douts, r, p, bias on, dtype, adapter dtype
        (1000, 320, (200, 64, 64), 16, 0.1, (), torch.bfloat16, torch.bfloat16),
        (777, 2048, (2048, 512, 512), 16, 0.05, (0, 1, 2), torch.bfloat16, torch.float32),
        (513, 2048, (1030, 1030), 16, 0.05, (), torch.bfloat16, torch.float32),
        (333, 96, (80, 40, 40), 8, 0.2, (1,), torch.float32, torch.float32),
        (600, 256, (256, 128), 16, 0.0, (), torch.bfloat16, torch.float32),
    ]
    if SMOKE:
        cases = cases[:1]
    for N, din, douts, r, p, biases, dt, adt in cases:
        try:
            torch.manual_seed(0)
            x = torch.randn(N, din, device=DEV, dtype=dt, requires_grad=True)
            Ws = [(torch.randn(d, din, device=DEV) / din ** 0.5).to(dt) for d in douts]
            bs = [torch.randn(d, device=DEV, dtype=dt) if j in biases else None for j, d in enumerate(douts)]
            As = [[(torch.randn(r, din, device=DEV) / din ** 0.5).to(adt).requires_grad_()] for _ in douts]
            Bs = [[(torch.randn(d, r, device=DEV) / r ** 0.5).to(adt).requires_grad_()] for d in douts]
            st = _rng_state()
            if DEV == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            try:
                ys = lora_linear_group(x, Ws, As, Bs, [[2.0]] * len(douts), biases=bs, dropout_p=[[p]] * len(douts))
                gos = [torch.randn_like(y) for y in ys]
                leaves = [x] + [a[0] for a in As] + [b[0] for b in Bs]
                gs = torch.autograd.grad(ys, leaves, gos)
            finally:
                if DEV == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            _set_rng_state(st)
            seeds = K.draw_seeds(len(douts), DEV) if p > 0 else None
            masks = [lora_dropout_keep_mask(seeds[j], N, din, p, DEV) if p > 0 else None for j in range(len(douts))]
            d = lambda t: t.detach().double().requires_grad_()  # noqa: E731
            xr, Ar, Br = d(x), [d(a[0]) for a in As], [d(b[0]) for b in Bs]
            yrs = [K.lora_reference(xr, Ws[j].double(), bs[j].double() if bs[j] is not None else None, [Ar[j]],
                                    [Br[j]], [2.0], [masks[j]], [p]) for j in range(len(douts))]
            gr = torch.autograd.grad(yrs, [xr] + Ar + Br, [g.double() for g in gos])
            errs = {f"y{j}": rel(y, yr) for j, (y, yr) in enumerate(zip(ys, yrs))}
            names = ["x"] + [f"A{j}" for j in range(len(douts))] + [f"B{j}" for j in range(len(douts))]
            errs.update({f"g{n}": rel(a, r_) for n, a, r_ in zip(names, gs, gr)})
            tol = 1e-2 if dt != torch.float32 else 1e-4
            emit(section="lora_group_check", N=N, din=din, douts=list(douts), r=r, dropout=p, biases=list(biases),
                 dtype=str(dt), adapter_dtype=str(adt), errors=errs, ok=all(v < tol for v in errs.values()))
        except Exception as e:
            emit(section="lora_group_check", case=str((N, din, douts)), error=f"{type(e).__name__}: {e}"[:400],
                 ok=False)
            traceback.print_exc()


def time_groups():
    """Llama-3.2-1B's q/k/v (2048 -> 2048 / 512 / 512) and gate/up (2048 -> 8192 x 2) at the e2e token count (4 x
    2048), r16, fwd+bwd: the base GEMMs alone (floor), one lora_linear per projection, one lora_linear_group."""
    from fxfuse.ops.lora_linear import lora_linear_group

    cases = [("q/k/v 2048->2048/512/512 r16", 8192, 2048, (2048, 512, 512)),
             ("gate/up 2048->8192x2 r16", 8192, 2048, (8192, 8192))]
    if SMOKE:
        cases = [("tiny", 256, 64, (96, 32))]
    r = 16
    for name, N, din, douts in cases:
        for p in (0.0, 0.05):
            torch.manual_seed(0)
            x = torch.randn(N, din, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            Ws = [torch.randn(d, din, device=DEV, dtype=torch.bfloat16) / din ** 0.5 for d in douts]
            As = [(torch.randn(r, din, device=DEV) * 0.02).requires_grad_() for _ in douts]  # PEFT's fp32 adapters
            Bs = [(torch.randn(d, r, device=DEV) * 0.02).requires_grad_() for d in douts]
            gos = [torch.randn(N, d, device=DEV, dtype=torch.bfloat16) for d in douts]
            params = [x] + As + Bs

            def clear():
                for t in params:
                    t.grad = None

            def base():
                x.grad = None
                ys = [torch.nn.functional.linear(x, W) for W in Ws]
                torch.autograd.backward(ys, gos)

            def separate():
                clear()
                ys = [lora_linear(x, W, A, B, 2.0, dropout_p=p) for W, A, B in zip(Ws, As, Bs)]
                torch.autograd.backward(ys, gos)

            def group():
                clear()
                ys = lora_linear_group(x, Ws, [[A] for A in As], [[B] for B in Bs], [[2.0]] * len(douts),
                                       dropout_p=[[p]] * len(douts))
                torch.autograd.backward(ys, gos)

            for iname, fn in (("base GEMMs only (floor)", base), ("lora_linear per projection", separate),
                              ("lora_linear_group", group)):
                try:
                    ms, mem = bench(fn)
                    emit(section="lora_group", shape=name, dropout=p, impl=iname, ms=round(ms, 3),
                         peak_gib=round(mem, 3))
                except Exception as e:
                    emit(section="lora_group", shape=name, dropout=p, impl=iname, error=f"{type(e).__name__}: {e}"[:300])
                    traceback.print_exc()


if __name__ == "__main__":
    secs = sys.argv[1:] or ["check", "time"]
    if DEV == "cuda":
        emit(section="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    if "check" in secs:
        check()
    if "profile" in secs:
        profile()
    if "tune" in secs or "tune-launch" in secs:
        tune(sweep_launch="tune-launch" in secs)
    if "rng" in secs:
        rng_ablation()
    if "check-groups" in secs:
        check_groups()
    if "time-groups" in secs:
        time_groups()
    if "time" in secs:
        time_layers()
