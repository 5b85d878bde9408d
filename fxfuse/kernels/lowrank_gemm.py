"""A GEMM with a low-rank term in the same accumulator: ``C = A @ op(B) + V @ op(U) (+ bias)``.

LoRA's ``y = x @ W.T + (s * drop(x) @ A.T) @ B.T`` and, without dropout, its ``grad x = gy @ W + gV @ A`` are a
base GEMM plus a rank-r product. cuBLAS can only take the rank-r product as ``addmm``'s C operand: it is written to
memory ([N, d_out], as large as the output) and read back in the GEMM's epilogue, and the C-operand kernels cuBLAS
picks run slower than its plain ones (``benchmarks/lora_notes.md``: on an H100 at 16384 x 4096 x 4096, ``mm`` 0.69
ms, the product + ``addmm_`` 0.79 ms). Here the rank-r product is one more K step of a persistent TMA GEMM: after
the main K loop each output tile's fp32 accumulator takes ``V[rows, :r] @ U[:r, cols]`` (one [BM, r] and one
[r, BN] tile, a single ``tl.dot``), so nothing [N, d_out] is written twice (0.75 ms at that shape).

Layouts (all row-major): A [M, K]; B [N, K] (``b_kn=False``: ``x @ W.T``) or [K, N] (``b_kn=True``: ``gy @ W``);
V [M, R]; U [N, R] (``u_kn=False``: B_lora [d_out, r]) or [R, N] (``u_kn=True``: A_lora [r, d_in]). Operands are
read through TMA descriptors (tiles past a dim's end read as zero: ragged sizes and ranks below 16 need no masks),
so every operand's rows must be 16-byte aligned; :func:`lowrank_gemm_supported` says whether a call qualifies and
callers fall back to cuBLAS otherwise. Coordinates are int32 per dimension (the copy engine's), addresses 64-bit:
no offset wraps at 2**31 elements.

Where: CUDA with the copy engine (sm_90+), 16-bit operands; the Triton interpreter (CPU tests, fp32). Launch
setting: 128 x 256 tiles, K step 64, 3 stages, 8 warps, a persistent loop over the tiles in groups of 8 row blocks
(L2 reuse of B) (an H100 sweep, ``benchmarks/experiments/lora_lowrank_gemm.py``), flattened with the K loop into one
pipeline, the output tile stored in two halves (:data:`CONFIG`). How programs get their tiles (persistent with fixed
shares, claimed from a counter, or one program per tile) is :data:`SCHEDULE`: FSDP2's NCCL kernels beside it are why
that matters. :func:`compiled_for` builds the kernel for an sm_90
card without one (shared memory, the PTX): ``config_for``'s count is checked against it on CPU.

The twenty-first session shipped ``tl.range(..., warp_specialize=True)`` on the tile loop, from a sweep where it
measured 8.82 against 9.07 ms a layer. Compiled offline (Triton 3.6 and 3.9, sm_90) that setting yields the same
PTX as the loop without it: Triton's Hopper warp specialisation does not take this 8-warp loop (at 4 warps its pass
fails). The difference was the sweep's run-to-run spread, which the sweep now measures (twenty-second session,
``benchmarks/lora_notes.md``); the flag is gone.
"""
from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Optional, Tuple

import torch

from . import background_compile
from . import launch_cache
from .launch_cache import PlanCache, Recorder, rebase_descriptor
from .triton_support import (HAVE_TRITON, TensorDescriptor, dot_pad, interpreting, sm_count, smem_limit,
                             tile_addressable, tl, triton)

__all__ = ["lowrank_gemm", "lowrank_gemm_prewarm", "lowrank_gemm_reference", "lowrank_gemm_supported", "CONFIG"]

# FLATTEN: Triton flattens the tile and K loops into one software pipeline, so the next tile's loads start during
# this tile's epilogue. Its stage buffers then stay live and the low-rank tiles come on top of them (unflattened,
# they go in the stage buffers once the K loop is done: config_for counts both). SPLIT_EPI: the output tile stored in
# two halves (half the staging; config_for also falls back to it wherever a whole tile would cost a stage). Paired
# against the unflattened loop with whole tiles on two H200s (twenty-second session, benchmarks/lora_notes.md), this
# setting was faster at each of a Llama-3-8B layer's LoRA GEMMs (median ratios 0.969-0.992): 8.94 against 9.14 ms
# and 8.91 against 9.12 ms a layer. cuBLAS's mm without the low-rank term still takes 4% less (two-CTA clusters,
# which Triton 3.6 does not compile here).
CONFIG = dict(BM=128, BN=256, BK=64, GROUP_M=8, FLATTEN=True, SPLIT_EPI=True, num_stages=3, num_warps=8)
# The interpreter runs one program at a time over numpy blocks: small tiles keep CPU tests quick.
INTERPRETER_CONFIG = dict(BM=32, BN=32, BK=32, GROUP_M=2, FLATTEN=False, SPLIT_EPI=False, num_stages=1,
                          num_warps=4)
# FXFUSE_LORA_LOWRANK_GEMM=0 (or ENABLED = False at run time) keeps cuBLAS's ``addmm_`` path: benchmarks time both.
ENABLED = os.environ.get("FXFUSE_LORA_LOWRANK_GEMM", "1") != "0"
# How programs get their tiles (FXFUSE_LOWRANK_GEMM_SCHEDULE):
# * "static" (default): one program per SM, each walking a fixed share of the tiles (persistent). Fastest alone, but
#   beside an NCCL kernel (FSDP2's all-gathers hold 23-24 SMs) the programs that find no free SM start only when it
#   ends and still do their whole share: under FSDP2 (8B LoRA, 2x H200) such launches took 1.75-1.86x their time
#   alone, cuBLAS's 1.08-1.42x.
# * "dynamic": one program per SM, each claiming its next tile from a counter in device memory: a late program takes
#   what is left. Beside NCCL 1.12-1.24x, but alone ~8% slower than "static" (no pipeline across tiles).
# * "per_tile": one program per tile (the hardware schedules them); FXFUSE_LOWRANK_GEMM_PERSISTENT=0 also asks it.
# The three steps under FSDP2 came out within the runs' spread (static 305.5-308.4 ms, dynamic 309.8-311.8, per tile
# 299.7-305.7; benchmarks/fsdp2_notes.md, thirty-first session): the NCCL kernels the static schedule waits for are
# not waited for elsewhere, so static stays the default.
SCHEDULES = ("static", "dynamic", "per_tile")
SCHEDULE = os.environ.get("FXFUSE_LOWRANK_GEMM_SCHEDULE") or (
    "per_tile" if os.environ.get("FXFUSE_LOWRANK_GEMM_PERSISTENT", "1") == "0" else "static")
if SCHEDULE not in SCHEDULES:
    raise ValueError(f"FXFUSE_LOWRANK_GEMM_SCHEDULE={SCHEDULE!r}: expected one of {SCHEDULES}")


if HAVE_TRITON:

    @triton.jit
    def _lowrank_tile(a_desc, b_desc, v_desc, u_desc, c_desc, bias_ptr, N, k_tiles, om, on,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, B_KN: tl.constexpr, U_KN: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SPLIT_EPI: tl.constexpr):
        """One [BM, BN] output tile at (om, on): the K loop, the low-rank K step, the bias, the store."""
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BK])
            if B_KN:
                acc = tl.dot(a, b_desc.load([ki * BK, on]), acc)
            else:
                acc = tl.dot(a, b_desc.load([on, ki * BK]).T, acc)
        # The low-rank term: one more K step of width RP (rank columns past R read as zero).
        v = v_desc.load([om, 0])
        if U_KN:
            acc = tl.dot(v, u_desc.load([0, on]), acc)
        else:
            acc = tl.dot(v, u_desc.load([on, 0]).T, acc)
        if HAS_BIAS:
            cols = on + tl.arange(0, BN)
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if SPLIT_EPI:  # two [BM, BN / 2] stores (c's descriptor block is half the tile): half the staging
            halves = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            c_desc.store([om, on], halves[0].to(c_desc.dtype))
            c_desc.store([om, on + BN // 2], halves[1].to(c_desc.dtype))
        else:
            c_desc.store([om, on], acc.to(c_desc.dtype))

    @triton.jit
    def _tile_origin(tile, num_pid_m, num_pid_n, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """Tile ``tile``'s (row, column) origin: consecutive tiles share a group of GROUP_M row blocks, so the B
        tiles they read stay in L2."""
        in_group = GROUP_M * num_pid_n
        first_m = (tile // in_group) * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        return (first_m + tile % size_m) * BM, ((tile % in_group) // size_m) * BN

    @triton.jit
    def _lowrank_gemm_kernel(a_desc, b_desc, v_desc, u_desc, c_desc, bias_ptr, sched_ptr, M, N, K,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr,
                             B_KN: tl.constexpr, U_KN: tl.constexpr, HAS_BIAS: tl.constexpr,
                             GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
                             SPLIT_EPI: tl.constexpr, DYNAMIC: tl.constexpr):
        num_pid_m = tl.cdiv(M, BM)
        num_pid_n = tl.cdiv(N, BN)
        k_tiles = tl.cdiv(K, BK)
        num_tiles = num_pid_m * num_pid_n
        if DYNAMIC:
            # Each program claims its next tile from a counter (sched_ptr[0]) as it finishes one, so programs that
            # start late, after an NCCL kernel beside this one frees its SMs, take what is left instead of a fixed
            # share (benchmarks/fsdp2_notes.md, thirty-first session). No flattened pipeline across tiles here.
            tile = tl.atomic_add(sched_ptr, 1)
            while tile < num_tiles:
                om, on = _tile_origin(tile, num_pid_m, num_pid_n, BM, BN, GROUP_M)
                _lowrank_tile(a_desc, b_desc, v_desc, u_desc, c_desc, bias_ptr, N, k_tiles, om, on,
                              BM, BN, BK, B_KN, U_KN, HAS_BIAS, SPLIT_EPI)
                tile = tl.atomic_add(sched_ptr, 1)
            # The last program out (every claim made) zeroes both counters for the next launch on this stream.
            if tl.atomic_add(sched_ptr + 1, 1) == NUM_PROGRAMS - 1:
                tl.atomic_xchg(sched_ptr, 0)
                tl.atomic_xchg(sched_ptr + 1, 0)
        else:
            # Persistent (one program per SM walking tiles NUM_PROGRAMS apart) or, with NUM_PROGRAMS = the tile
            # count, one program per tile.
            for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
                om, on = _tile_origin(tile, num_pid_m, num_pid_n, BM, BN, GROUP_M)
                _lowrank_tile(a_desc, b_desc, v_desc, u_desc, c_desc, bias_ptr, N, k_tiles, om, on,
                              BM, BN, BK, B_KN, U_KN, HAS_BIAS, SPLIT_EPI)


def _config(device: torch.device, element_size: int, rank: int) -> Optional[dict]:
    """The launch setting for ``device`` and this rank, or None if its tiles do not fit shared memory. The
    software pipeline keeps ``num_stages`` A and B tiles; the low-rank tiles and the output tile come on top (at
    rank 32 three stages need 232 KiB, past an H100's 227 KiB), so wider ranks take fewer stages."""
    if interpreting() or device.type != "cuda":
        return INTERPRETER_CONFIG
    return config_for(element_size, rank, smem_limit(device))


def shared_memory_bytes(cfg: dict, element_size: int, rank: int) -> int:
    """Shared memory a launch at setting ``cfg`` takes, counted the way Triton allocates it (the CPU tests check
    the count against kernels compiled for sm_90): the pipeline's stages, the low-rank tiles placed in the stages'
    buffers once the K loop is done (on top of them in a flattened loop, where those buffers stay live), and the
    output tile's staging (half of it when stored in halves). Barriers (a few dozen bytes) not counted."""
    BM, BN, BK, RP = cfg["BM"], cfg["BN"], cfg["BK"], dot_pad(rank)
    stages = cfg["num_stages"] * (BM * BK + BK * BN) * element_size
    low_rank = (BM * RP + RP * BN) * element_size
    pipeline = stages + low_rank if cfg["FLATTEN"] else max(stages, low_rank)
    return pipeline + BM * BN // (2 if cfg["SPLIT_EPI"] else 1) * element_size


def config_for(element_size: int, rank: int, smem_limit: int) -> Optional[dict]:
    """:data:`CONFIG` fitted to ``smem_limit`` bytes of shared memory (:func:`shared_memory_bytes`, 1 KiB kept for
    the pipeline's barriers): the output tile stored in two halves if CONFIG says so or when whole it would not fit
    (the stages are worth more: at rank sums 48 and 32 two stages ran 27-34% slower than three with halves), then
    stages dropped; None below two."""
    cfg = dict(CONFIG)

    def fits(**change) -> bool:
        return shared_memory_bytes(dict(cfg, **change), element_size, rank) <= smem_limit - 1024

    cfg["SPLIT_EPI"] = cfg["SPLIT_EPI"] or not fits(SPLIT_EPI=False)
    while cfg["num_stages"] > 1 and not fits():
        cfg["num_stages"] -= 1
    return cfg if cfg["num_stages"] > 1 else None


def compiled_for(rank: int, b_kn: bool, u_kn: bool, cfg: dict, arch: int = 90, dtype: str = "bf16", kernel=None,
                 **constexprs):
    """The kernel as Triton builds it for an ``sm_<arch>`` card at setting ``cfg`` (a :data:`CONFIG`-like dict),
    without one: its ``metadata.shared`` (bytes of shared memory) and ``asm`` (TTGIR, PTX) say what a launch would
    need and run. For tests and sweeps: two settings with the same PTX are one binary. ``kernel`` (with its extra
    ``constexprs``): another version of the kernel, e.g. an earlier revision's (experiments). Not under
    ``TRITON_INTERPRET=1``, which replaces Triton's language functions in the process (the tests compile in a child
    process)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    BM, BN, BK, RP = cfg["BM"], cfg["BN"], cfg["BK"], dot_pad(rank)
    blocks = dict(a_desc=[BM, BK], b_desc=[BK, BN] if b_kn else [BN, BK], v_desc=[BM, RP],
                  u_desc=[RP, BN] if u_kn else [BN, RP], c_desc=[BM, BN // 2] if cfg["SPLIT_EPI"] else [BM, BN])
    signature = {name: f"tensordesc<{dtype}[{blk[0]}, {blk[1]}]>" for name, blk in blocks.items()}
    kernel = kernel or _lowrank_gemm_kernel
    scheduled = "sched_ptr" in kernel.arg_names  # revisions before the tile schedules had neither argument
    signature.update(bias_ptr=f"*{dtype}", **({"sched_ptr": "*i32"} if scheduled else {}), M="i32", N="i32", K="i32")
    consts = dict(BM=BM, BN=BN, BK=BK, RP=RP, B_KN=b_kn, U_KN=u_kn, HAS_BIAS=False, GROUP_M=cfg["GROUP_M"],
                  NUM_PROGRAMS=132, FLATTEN=cfg["FLATTEN"], SPLIT_EPI=cfg["SPLIT_EPI"],
                  **({"DYNAMIC": cfg.get("DYNAMIC", False)} if scheduled else {}), **constexprs)
    signature.update({k: "constexpr" for k in consts})
    # the pointer and the sizes divisible by 16, as at the FSDP2 shapes; 132 programs, an H100 / H200's SMs
    attrs = {(i,): [["tt.divisibility", 16]] for i in ((5, 6, 7, 8, 9) if scheduled else (5, 6, 7, 8))}
    return triton.compile(ASTSource(kernel, signature, consts, attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def _tiles(a, b, v, u, c, b_kn: bool, u_kn: bool, cfg: dict):
    """(operand, tile shape) for each descriptor the kernel reads or writes (c: None while only checking)."""
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    RP = dot_pad(v.shape[1])
    c_block = [BM, BN // 2] if cfg["SPLIT_EPI"] else [BM, BN]
    return [(a, [BM, BK]), (b, [BK, BN] if b_kn else [BN, BK]), (v, [BM, RP]),
            (u, [RP, BN] if u_kn else [BN, RP])] + ([(c, c_block)] if c is not None else [])


def _layout_key(a, b, v, u, bias, b_kn: bool, u_kn: bool, schedule: str = SCHEDULE) -> tuple:
    """Everything a launch depends on but the operands' data: their device, dtypes, sizes and strides, the bias's
    presence and dtype, the layouts. Sizes go in whole, not by divisibility: a replayed launch passes the recorded
    M, N, K and grid, and its descriptors keep the recorded shapes and strides."""
    return (a.device, a.dtype, b.dtype, v.dtype, u.dtype, None if bias is None else bias.dtype,
            tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), tuple(v.shape), v.stride(), tuple(u.shape),
            u.stride(), b_kn, u_kn, schedule)


# lowrank_gemm_supported's answers for real (not meta) operands by layout and alignment: LoRA asks for every
# projection of every call, and the full check (19 us on the H200 machine's host) is most of a replayed launch.
_SUPPORTED: dict = {}


def lowrank_gemm_supported(a, b, v, u, bias=None, b_kn: bool = False, u_kn: bool = False,
                           device: Optional[torch.device] = None) -> bool:
    """Whether :func:`lowrank_gemm` can run these operands: Triton on CUDA sm_90+ with 16-bit operands of one
    dtype (or the interpreter, fp32 only), rank <= 64, every operand addressable by the copy engine (16-byte aligned
    rows and base), the output's row too. ``device``: where operands given as meta tensors will live."""
    if not (HAVE_TRITON and ENABLED) or v.shape[1] > 64 or v.shape[1] == 0 or a.shape[0] == 0:
        return False
    if device is not None or a.device.type == "meta":
        return _supported(a, b, v, u, bias, b_kn, u_kn, device)
    # what the answer reads of the data: the operands' base alignment (the output is fresh, always aligned)
    key = (_layout_key(a, b, v, u, bias, b_kn, u_kn),
           (a.data_ptr() | b.data_ptr() | v.data_ptr() | u.data_ptr()) % 16 == 0, interpreting())
    ok = _SUPPORTED.get(key)
    if ok is None:
        if len(_SUPPORTED) >= 1024:  # many distinct shapes: start over rather than grow
            _SUPPORTED.clear()
        ok = _SUPPORTED[key] = _supported(a, b, v, u, bias, b_kn, u_kn, None)
    return ok


def _supported(a, b, v, u, bias, b_kn: bool, u_kn: bool, device: Optional[torch.device]) -> bool:
    device = a.device if device is None else device
    dt = a.dtype
    if any(t.dtype != dt for t in (b, v, u)) or (bias is not None and bias.dtype != dt):
        return False
    if device.type == "cuda":
        if interpreting() or dt not in (torch.bfloat16, torch.float16):
            return False
        if torch.cuda.get_device_capability(device)[0] < 9:
            return False
    elif not interpreting() or dt != torch.float32:  # the interpreter (numpy) has no bf16
        return False
    n = b.shape[1] if b_kn else b.shape[0]
    if (n * a.element_size()) % 16:  # the output's rows
        return False
    cfg = _config(device, a.element_size(), v.shape[1])
    # checked without building the descriptors: this runs for every projection of every call
    return cfg is not None and all(tile_addressable(t, blk) for t, blk in _tiles(a, b, v, u, None, b_kn, u_kn, cfg))


# The "dynamic" schedule's two int32 counters (next tile, programs done) per (device, stream): zero between
# launches (the last program of each launch resets them), and one pair per stream so that launches on two streams
# at once never share one.
_COUNTERS: dict = {}


def _schedule_for(device: torch.device) -> Tuple[str, Optional[torch.Tensor]]:
    """The schedule a launch on ``device``'s current stream uses and, for "dynamic", that stream's counters (one
    stream lookup a launch). "static" stands in for "dynamic" while a CUDA graph is being captured on a stream that
    has no counters yet: made then, they would live in the graph's pool."""
    if SCHEDULE != "dynamic":
        return SCHEDULE, None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buf = _COUNTERS.get((device, stream))
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "static", None
        buf = _COUNTERS[(device, stream)] = torch.zeros(2, dtype=torch.int32, device=device)
    return "dynamic", buf


def _launch_args(a, b, v, u, c, bias, b_kn: bool, u_kn: bool, device: torch.device, base=None,
                 schedule: Optional[Tuple[str, Optional[torch.Tensor]]] = None):
    """(grid, positional args, constexprs) of one launch. ``base``: a tensor the descriptors and the bias pointer
    stand on instead of the operands, which are then only read for their shapes and strides (a warm-up compile
    from meta tensors); a launch's Triton specialisation depends on dtypes, tile shapes, constexprs, the sizes'
    divisibility by 16 and pointer alignment, none of which the stand-in changes. ``schedule``:
    :func:`_schedule_for`'s answer, if the caller has it."""
    M, K = a.shape
    N = c.shape[1]
    rank = v.shape[1]
    cfg = dict(_config(device, a.element_size(), rank))
    descs = [TensorDescriptor(t if base is None else base, list(t.shape), list(t.stride()), list(blk))
             for t, blk in _tiles(a, b, v, u, c, b_kn, u_kn, cfg)]
    tiles = triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"])
    if schedule is None:  # a warm-up (base) compiles SCHEDULE's kernel and needs no counters
        schedule = _schedule_for(device) if base is None else (SCHEDULE, None)
    schedule, counters = schedule
    programs = tiles if schedule == "per_tile" else min(tiles, sm_count(device))
    bias_arg = bias if bias is not None else (a if base is None else base)
    # the counters: only the dynamic schedule reads them (any int32-aligned pointer will do for the others)
    sched = (counters if base is None else base.view(torch.int32)) if schedule == "dynamic" else bias_arg
    args = (*descs, bias_arg, sched, M, N, K)
    consts = dict(RP=dot_pad(rank), B_KN=b_kn, U_KN=u_kn, HAS_BIAS=bias is not None, NUM_PROGRAMS=programs,
                  DYNAMIC=schedule == "dynamic", **cfg)
    return (programs,), args, consts


def _specialisation(device: torch.device, dtype, args, consts) -> tuple:
    """What Triton compiles a new kernel for, as far as this launcher varies it: the constexprs, the dtype and the
    divisibility of M, N, K by 16. A warm-up started for one launch is waited on by every launch of the same key."""
    M, N, K = args[-3:]
    return (device.index, dtype, tuple(sorted(consts.items())), M % 16 == 0, N % 16 == 0, K % 16 == 0)


def lowrank_gemm_prewarm(a, b, v, u, bias=None, b_kn: bool = False, u_kn: bool = False,
                         device: Optional[torch.device] = None) -> Optional[Future]:
    """Start compiling, on a background thread, the kernel :func:`lowrank_gemm` will launch for operands laid out
    like these on ``device`` (meta tensors welcome: only shapes, strides and dtypes are read). Returns the compile's
    future, or None where there is nothing to start: prewarming off, not a CUDA launch, operands the kernel
    declines, or this specialisation already started in this process."""
    device = a.device if device is None else device
    if not background_compile.can_start(device) or not lowrank_gemm_supported(a, b, v, u, bias, b_kn, u_kn, device):
        return None
    M = a.shape[0]
    N = b.shape[1] if b_kn else b.shape[0]
    base = torch.empty(64, dtype=a.dtype, device=device)  # 128 bytes to stand on, aligned like any allocation
    c = torch.empty((M, N), dtype=a.dtype, device="meta")
    grid, args, consts = _launch_args(a, b, v, u, c, bias if bias is None else base, b_kn, u_kn, device, base)
    return background_compile.start(_lowrank_gemm_kernel, _specialisation(device, a.dtype, args, consts), device,
                                    grid, args, consts)


# Replays of a launch by layout (launch_cache.py), and the five tile descriptors' templates each replay rebuilds
# over its own operands. The launcher's Python (configs, five descriptors, Triton's binding of 20 arguments) took 84
# us of host time per launch on the H200 machine against 29 us for cuBLAS's mm + addmm_; under FSDP2 (8B widths,
# LoRA r16, 2 x 4096 tokens per GPU) the LoRA forward was host-bound there: the GPU idled ~35 ms a step
# (benchmarks/fsdp2_notes.md, twentieth session).
_PLANS = PlanCache()
_DESCRIPTORS: dict = {}


def forget_launches() -> None:
    """Drop the recorded launches and the remembered support answers: after
    :data:`CONFIG` changes (experiments), a replay would otherwise relaunch the binary of the setting it was recorded
    under."""
    _PLANS.replays.clear()
    _DESCRIPTORS.clear()
    _SUPPORTED.clear()


def lowrank_gemm(a, b, v, u, bias: Optional[torch.Tensor] = None, b_kn: bool = False,
                 u_kn: bool = False) -> torch.Tensor:
    """``a @ op(b) + v @ op(u) (+ bias)`` in a's dtype with fp32 accumulation (see the module docstring for the
    layouts). Call only where :func:`lowrank_gemm_supported` says so."""
    M, K = a.shape
    N = b.shape[1] if b_kn else b.shape[0]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    schedule = _schedule_for(a.device)
    key = _layout_key(a, b, v, u, bias, b_kn, u_kn, schedule[0])
    templates = _DESCRIPTORS.get(key)
    if templates is not None:
        bias_arg = a if bias is None else bias
        roles = (a, b, v, u, c, bias_arg, bias_arg if schedule[1] is None else schedule[1],
                 *(rebase_descriptor(t, x) for t, x in zip(templates, (a, b, v, u, c))))
        replay = _PLANS.lookup(key, roles)
        if replay is not None and replay(roles, a.device.index):
            return c
    grid, args, consts = _launch_args(a, b, v, u, c, bias, b_kn, u_kn, a.device, schedule=schedule)
    if background_compile.in_flight():  # a warm-up of this specialisation in flight: wait, do not compile it twice
        background_compile.wait_for(_lowrank_gemm_kernel, _specialisation(a.device, a.dtype, args, consts))
    if not launch_cache.fast_launch_enabled():  # the interpreter, or FXFUSE_TRITON_FAST_LAUNCH=0: no replays
        _lowrank_gemm_kernel[grid](*args, **consts)
        return c
    rec = Recorder()
    rec.launch(_lowrank_gemm_kernel, grid, args, consts)
    descs, bias_arg, sched = args[:5], args[5], args[6]
    if len(_DESCRIPTORS) >= _PLANS.max_entries:
        _DESCRIPTORS.clear()
    _DESCRIPTORS[key] = tuple(rebase_descriptor(d, None) for d in descs)
    _PLANS.store(key, (a, b, v, u, c, bias_arg, sched, *descs), rec)
    return c


def lowrank_gemm_reference(a, b, v, u, bias=None, b_kn: bool = False, u_kn: bool = False) -> torch.Tensor:
    """Float64 reference of :func:`lowrank_gemm`."""
    a, b, v, u = (t.double() for t in (a, b, v, u))
    out = a @ (b if b_kn else b.t()) + v @ (u if u_kn else u.t())
    return out + bias.double() if bias is not None else out
