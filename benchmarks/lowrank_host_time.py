"""Host (CPU) microseconds per launch of the low-rank GEMM (``fxfuse/kernels/lowrank_gemm.py``) and of the LoRA
forward around it, at the 8B layer widths with a handful of tokens (so the GPU's work is far below the host's).

Why: under FSDP2 (8B widths x16 layers, LoRA r16, two H200s) the GPU sat idle ~35 ms a step inside
``fxfuse::lora_linear_fwd`` with the low-rank GEMM on and ~4 ms with it off (``fsdp2_notes.md``, twentieth
session): the forward is host-bound there. This says which part of a launch the host time is in: the launcher's
Python, Triton's JIT dispatch, or the descriptors. Writes ``$OUT/lowrank_host_time.jsonl`` and a cProfile of the
slowest case.

Run (device):  PYTHONPATH=.:benchmarks python3 benchmarks/lowrank_host_time.py
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats

import torch

from _common import DEV, host_us, jsonl_emitter

import fxfuse  # noqa: F401  (registers the ops)
from fxfuse.kernels import lora_linear as K
from fxfuse.kernels import lowrank_gemm as G

emit = jsonl_emitter("lowrank_host_time.jsonl")


def main():
    if DEV != "cuda" or not G.lowrank_gemm_supported(*(torch.empty(16, 16, dtype=torch.bfloat16, device=DEV),) * 4):
        print("the low-rank GEMM needs CUDA sm_90+: nothing to time here")
        return
    N, d, dkv, r = int(os.environ.get("ROWS", 64)), 4096, 1024, 16
    dt = torch.bfloat16
    x = torch.randn(N, d, device=DEV, dtype=dt)
    Ws = [torch.randn(o, d, device=DEV, dtype=dt) for o in (d, dkv, dkv)]  # q, k, v: one group
    A = torch.randn(3 * r, d, device=DEV, dtype=dt)
    Bs = [torch.randn(o, r, device=DEV, dtype=dt) for o in (d, dkv, dkv)]
    seeds = K.draw_seeds(3, x.device)
    V = torch.mm(x, A.t())
    args = G._launch_args(x, Ws[0], V[:, :r], Bs[0], torch.empty(N, d, device=DEV, dtype=dt), None, False, False,
                          x.device)
    grid, largs, consts = args

    def group_fwd():
        return K.lora_forward(x, Ws, [None] * 3, A, Bs, seeds, [r] * 3, [1] * 3, [2.0] * 3, [0.0] * 3)

    def group_op():
        return torch.ops.fxfuse.lora_linear_fwd(x, Ws, [], [-1] * 3, A, Bs, seeds, [r] * 3, [1] * 3, [2.0] * 3,
                                                [0.0] * 3)

    cases = {
        "lowrank_gemm (q projection)": lambda: G.lowrank_gemm(x, Ws[0], V[:, :r], Bs[0]),
        "_launch_args alone": lambda: G._launch_args(x, Ws[0], V[:, :r], Bs[0], x.new_empty(N, d), None, False,
                                                     False, x.device),
        "Triton launch alone (kernel[grid](...))": lambda: G._lowrank_gemm_kernel[grid](*largs, **consts),
        "lowrank_gemm_supported": lambda: G.lowrank_gemm_supported(x, Ws[0], V[:, :r], Bs[0], None),
        "K.lora_forward, q/k/v group": group_fwd,
        "op lora_linear_fwd, q/k/v group": group_op,
        "torch.mm + addmm_ (cuBLAS path, q projection)": lambda: torch.mm(V[:, :r], Bs[0].t()).addmm_(x, Ws[0].t()),
    }
    for name, fn in cases.items():
        host, wall = host_us(fn)
        emit(section="lowrank_host", case=name, host_us_per_call=host, wall_us_per_call=wall, N=N, lowrank=True)
        print(f"{name:50s} host {host:8.1f} us  wall {wall:8.1f} us", flush=True)
    G.ENABLED = False
    host, wall = host_us(group_fwd)
    emit(section="lowrank_host", case="K.lora_forward, q/k/v group, low-rank GEMM off", host_us_per_call=host,
         wall_us_per_call=wall, N=N, lowrank=False)
    print(f"{'K.lora_forward, q/k/v group, GEMM off':50s} host {host:8.1f} us  wall {wall:8.1f} us", flush=True)
    G.ENABLED = True
    # replays launch with the new call's operands: fresh ones of the same layout against float64
    assert G._PLANS.replays, "no replay was recorded"
    for seed in range(3):
        torch.manual_seed(seed)
        a, b, vv, u = (torch.randn_like(t) for t in (x, Ws[1], V[:, :r], Bs[1]))
        bias = torch.randn(Ws[1].shape[0], device=DEV, dtype=dt)
        for _ in range(2):  # the first of a layout records, the second replays
            out = G.lowrank_gemm(a, b, vv, u, bias)
        ref = G.lowrank_gemm_reference(a, b, vv, u, bias)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        emit(section="lowrank_replay_check", seed=seed, rel_err=err)
        print(f"replayed launch vs float64: rel err {err:.2e}", flush=True)
        assert err < 1e-2, err
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        G.lowrank_gemm(x, Ws[0], V[:, :r], Bs[0])
    prof.disable()
    if DEV == "cuda":
        torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(35)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "lowrank_host_cprofile.txt"), "w") as f:
        f.write(s.getvalue())
    print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
