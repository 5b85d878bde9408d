"""LoRA linear: ``y = x @ W.T + bias + sum_i s_i * dropout_i(x) @ A_i.T @ B_i.T``, forward and backward, with the
dropout masks regenerated from a seed instead of stored. Kernels, launchers, the PyTorch (CPU) path and a float64
reference side by side.

Notation: x [N, din], W [dout, din] (usually frozen), A = cat_i A_i [R, din], B = cat_i B_i [dout, R] (the
adapters' ranks concatenated), ``Bs = B * s`` (each adapter's scaling folded into its columns of B: a [dout, R]
multiply instead of an [N, dout] one), ``V = [drop_1(x) @ A_1.T, ...]`` [N, R] (the only activation saved
besides x: N x r per adapter).

Where the time goes (design notes sec. 6): the base GEMM is compute-bound; the low-rank terms are bandwidth-bound
passes over [N, din] / [N, dout] tensors. PEFT runs each as its own kernel and stores ``dropout(x)`` (and the
mask) for every adapted projection. Here:

* forward:  ``V = drop(x) @ A.T`` (one read of x; dropout applied in registers by ``_lora_down_kernel``),
  ``y = addmm(V @ Bs.T (+ bias), x, W.T)``: the low-rank product is the addmm's C operand, which cuBLAS reads in
  its epilogue, so there is no separate ``y + delta`` pass.
* backward: ``gV = gy @ Bs`` and ``gBs = gy.T @ V`` (cuBLAS), ``gx = addmm(keep * (gV @ A) / (1 - p), gy, W)``
  (again the low-rank term is the C operand), ``gA = gV.T @ drop(x)``; with dropout the last two are one kernel
  (``_lora_up_dropout_bwd_kernel``) that regenerates the mask once per tile.

Dropout masks: Triton's Philox (``tl.rand``) keyed by a per-call, per-adapter seed (a device tensor drawn from
torch's generator, so ``torch.manual_seed`` reproduces it and there is no host sync) and the element offset
``row * din + col`` (32-bit, so the pattern repeats after 2**32 elements of x in one call). The CPU path uses
torch's CPU generator per 256-row block, keyed by the same seed; the two paths draw different (equally
distributed) masks. :func:`dropout_keep_mask` returns the mask a path uses, for references in tests.
"""
from __future__ import annotations

import functools
import os
from typing import List, Optional, Sequence, Tuple

import torch

from ._triton import HAVE_TRITON, tl, triton

__all__ = ["lora_forward", "lora_backward", "lora_reference", "dropout_keep_mask", "FORCE_TRITON", "draw_seeds"]

#: Run the Triton kernels on CPU tensors too (needs TRITON_INTERPRET=1); for tests.
FORCE_TRITON = os.environ.get("FXFUSE_LORA_FORCE_TRITON", "0") == "1"
#: Launch settings of the dropout kernels (tile rows BM, tile columns BK (a multiple of 8), warps, stages);
#: measured choices in benchmarks/lora_notes.md.
DOWN_CONFIG = dict(BM=32, BK=128, num_warps=4, num_stages=4)
UP_BWD_CONFIG = dict(BM=32, BK=128, num_warps=4, num_stages=3)
#: Dropout mask generation: Philox rounds (10 = cuRAND's and Triton's default) and the word -> tile expansion.
MASK_CONFIG = dict(ROUNDS=10, EXPAND=0)
#: CPU path: rows per dropout-mask block (each block has its own generator state, so any block regenerates alone).
CPU_MASK_ROWS = 256


def _use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and (t.device.type == "cuda" or FORCE_TRITON)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def draw_seeds(n: int, device) -> torch.Tensor:
    """One int64 seed per adapter, drawn on ``device`` from torch's generator (no host sync on CUDA)."""
    return torch.randint(0, 2**31 - 1, (n,), device=device, dtype=torch.int64)


def _dropout_threshold(p: float) -> Tuple[int, float]:
    """(16-bit threshold, 1 / keep probability) of the Triton mask: keep = bits >= round(p * 65536), so the
    kept fraction is exactly 1 - thresh / 65536 and the rescale uses that (unbiased; |p_eff - p| < 2**-17)."""
    t = int(round(float(p) * 65536))
    return t, 65536.0 / (65536 - t)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _rank_pad(r: int) -> int:
    return max(16, triton.next_power_of_2(r))  # tl.dot needs every dimension >= 16


# ================================================================================================ Triton kernels
if HAVE_TRITON:

    @triton.jit
    def _keep_mask(seed, row0, col0, din, thresh, BM: tl.constexpr, BK: tl.constexpr, ROUNDS: tl.constexpr,
                   EXPAND: tl.constexpr):
        """Dropout keep mask of the [BM, BK] tile of x at (row0, col0) (col0 a multiple of 8).

        One Philox call (``randint4x``: 4 x 32 random bits) covers 8 consecutive elements of a row, 16 bits each,
        so the RNG costs ~1/8 of one ``tl.rand`` per element (which made the mask the bottleneck). The mask is a
        function of (row, col) alone, whatever the tile shape: Philox counter = row * ceil(din / 8) + col // 8
        (32-bit), element j = col % 8 takes half j % 2 of word 2 * ((j // 2) % 2) + j // 4.
        keep = bits >= thresh with thresh = round(p * 65536). EXPAND picks how the [BM, BK / 8] words become the
        [BM, BK] tile (0: tl.join, 1: broadcast + select); both give the same mask.
        """
        G: tl.constexpr = BK // 8
        rows = row0 + tl.arange(0, BM)
        groups = col0 // 8 + tl.arange(0, G)
        offs = rows.to(tl.int32)[:, None] * ((din + 7) // 8) + groups.to(tl.int32)[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, offs, ROUNDS)
        if EXPAND == 0:
            lo = 0xFFFF
            q0 = tl.join(tl.join(r0 & lo, r1 & lo), tl.join(r2 & lo, r3 & lo))     # [BM, G, 2, 2]
            q1 = tl.join(tl.join(r0 >> 16, r1 >> 16), tl.join(r2 >> 16, r3 >> 16))
            bits = tl.reshape(tl.join(q0, q1), (BM, BK))
        else:
            j = tl.arange(0, 8)[None, None, :]
            w = ((j // 2) % 2) * 2 + j // 4
            word = tl.where(w == 0, r0[:, :, None], tl.where(w == 1, r1[:, :, None],
                                                             tl.where(w == 2, r2[:, :, None], r3[:, :, None])))
            bits = tl.reshape((word >> ((j % 2) * 16)) & 0xFFFF, (BM, BK))
        return bits >= thresh

    @triton.jit
    def _keep_mask_kernel(out_ptr, seed_ptr, N, DIN, thresh, BM: tl.constexpr, BK: tl.constexpr,
                          ROUNDS: tl.constexpr, EXPAND: tl.constexpr):
        row0 = tl.program_id(0) * BM
        col0 = tl.program_id(1) * BK
        rows = row0 + tl.arange(0, BM)
        cols = col0 + tl.arange(0, BK)
        keep = _keep_mask(tl.load(seed_ptr), row0, col0, DIN, thresh, BM, BK, ROUNDS, EXPAND)
        inb = (rows < N)[:, None] & (cols < DIN)[None, :]
        tl.store(out_ptr + rows[:, None] * DIN + cols[None, :], keep.to(tl.int8), mask=inb)

    @triton.jit
    def _lora_down_kernel(
        x_ptr, stride_x,          # [N, DIN]
        a_ptr, stride_a,          # [r, DIN] (this adapter's rows of A)
        v_ptr, stride_v,          # [N, r] (this adapter's columns of V)
        seed_ptr, N, DIN, R, thresh, inv_keep,
        BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, DOT_F32: tl.constexpr, ROUNDS: tl.constexpr,
        EXPAND: tl.constexpr,
    ):
        """V[rows] = (keep * x[rows]) @ A.T / (1 - p): one read of x, the mask never leaves registers."""
        row0 = tl.program_id(0) * BM
        rows = row0 + tl.arange(0, BM)
        rr = tl.arange(0, RP)
        seed = tl.load(seed_ptr)
        acc = tl.zeros((BM, RP), dtype=tl.float32)
        for k0 in range(0, DIN, BK):
            cols = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                        mask=(rows < N)[:, None] & (cols < DIN)[None, :], other=0.0)
            x = tl.where(_keep_mask(seed, row0, k0, DIN, thresh, BM, BK, ROUNDS, EXPAND), x, 0.0)
            at = tl.load(a_ptr + rr[None, :] * stride_a + cols[:, None],
                         mask=(rr < R)[None, :] & (cols < DIN)[:, None], other=0.0)   # [BK, RP] = A.T tile
            if DOT_F32:  # the interpreter's bf16 tl.dot is wrong (DESIGN.md sec. 4)
                acc += tl.dot(x.to(tl.float32), at.to(tl.float32), input_precision="ieee")
            else:  # A may be wider than x (PEFT's fp32 adapters): rounded to x's dtype here, not by a cast kernel
                acc += tl.dot(x, at.to(x_ptr.dtype.element_ty))
        acc = acc * inv_keep
        tl.store(v_ptr + rows[:, None] * stride_v + rr[None, :], acc.to(v_ptr.dtype.element_ty),
                 mask=(rows < N)[:, None] & (rr < R)[None, :])

    @triton.jit
    def _lora_up_dropout_bwd_kernel(
        gv_ptr, stride_gv,        # [N, r] grad of this adapter's V (scaling already folded in)
        a_ptr, stride_a,          # [r, DIN]
        x_ptr, stride_x,          # [N, DIN]
        c_ptr, stride_c,          # [N, DIN] out: keep * (gV @ A) / (1 - p)   (+= when ACCUMULATE)
        ga_ptr,                   # [r, DIN] fp32, zeroed: += gV.T @ (keep * x) / (1 - p)
        seed_ptr, N, DIN, R, thresh, inv_keep,
        BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr,
        WRITE_C: tl.constexpr, ACCUMULATE: tl.constexpr, WRITE_GA: tl.constexpr, DOT_F32: tl.constexpr,
        ROUNDS: tl.constexpr, EXPAND: tl.constexpr,
    ):
        """Both dropout-side gradients of one adapter from one mask regeneration per [BM, BK] tile of x.

        Grid (column blocks, row splits): a program owns BK columns and strides over row blocks, so its slice of
        gA accumulates in registers and reaches memory with one atomic add per element per program.
        """
        col0 = tl.program_id(0) * BK
        cols = col0 + tl.arange(0, BK)
        split = tl.program_id(1)
        nsplit = tl.num_programs(1)
        rr = tl.arange(0, RP)
        seed = tl.load(seed_ptr)
        a = tl.load(a_ptr + rr[:, None] * stride_a + cols[None, :],
                    mask=(rr < R)[:, None] & (cols < DIN)[None, :], other=0.0)       # [RP, BK]
        acc_at = tl.zeros((BK, RP), dtype=tl.float32)  # gA.T slice: x.T @ gV keeps the MMA's M dimension large
        for mb in range(split, tl.cdiv(N, BM), nsplit):
            rows = mb * BM + tl.arange(0, BM)
            inb = (rows < N)[:, None] & (cols < DIN)[None, :]
            gv = tl.load(gv_ptr + rows[:, None] * stride_gv + rr[None, :],
                         mask=(rows < N)[:, None] & (rr < R)[None, :], other=0.0)    # [BM, RP]
            keep = _keep_mask(seed, mb * BM, col0, DIN, thresh, BM, BK, ROUNDS, EXPAND)
            if WRITE_C:
                if DOT_F32:
                    t = tl.dot(gv.to(tl.float32), a.to(tl.float32), input_precision="ieee")
                else:
                    t = tl.dot(gv, a.to(gv_ptr.dtype.element_ty))  # A may be fp32: rounded here
                t = tl.where(keep, t * inv_keep, 0.0)
                c_ptrs = c_ptr + rows[:, None] * stride_c + cols[None, :]
                if ACCUMULATE:
                    t += tl.load(c_ptrs, mask=inb, other=0.0).to(tl.float32)
                tl.store(c_ptrs, t.to(c_ptr.dtype.element_ty), mask=inb)
            if WRITE_GA:
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=inb, other=0.0)
                x = tl.where(keep, x, 0.0)
                if DOT_F32:
                    acc_at += tl.dot(tl.trans(x.to(tl.float32)), gv.to(tl.float32), input_precision="ieee")
                else:
                    acc_at += tl.dot(tl.trans(x), gv)
        if WRITE_GA:
            tl.atomic_add(ga_ptr + rr[None, :] * DIN + cols[:, None], acc_at * inv_keep,
                          mask=(rr < R)[None, :] & (cols < DIN)[:, None])


# ================================================================================================ dropout masks
def _cpu_block_generator(seed: int, block: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((int(seed) * 1_000_003 + block * 0x9E3779B1) % (2**63 - 1))
    return g


def _cpu_keep(seed: int, start: int, end: int, din: int, p: float) -> torch.Tensor:
    """Keep mask of rows [start, end) of x on the CPU path (start on a CPU_MASK_ROWS boundary)."""
    parts = []
    for b0 in range(start, end, CPU_MASK_ROWS):
        n = min(CPU_MASK_ROWS, end - b0)
        u = torch.rand((n, din), generator=_cpu_block_generator(seed, b0 // CPU_MASK_ROWS))
        parts.append(u >= p)
    return torch.cat(parts) if parts else torch.empty((0, din), dtype=torch.bool)


def dropout_keep_mask(seed: torch.Tensor, N: int, din: int, p: float, device) -> torch.Tensor:
    """The bool [N, din] keep mask the op uses for one adapter with this seed on this device's path."""
    dev = torch.device(device)
    probe = torch.empty(0, device=dev)
    if _use_triton(probe):
        out = torch.empty((N, din), dtype=torch.int8, device=dev)
        seed_d = seed.reshape(1).to(dev)
        if N and din:
            _keep_mask_kernel[(triton.cdiv(N, 32), triton.cdiv(din, 32))](
                out, seed_d, N, din, _dropout_threshold(p)[0], BM=32, BK=32, **MASK_CONFIG)
        return out.bool()
    return _cpu_keep(int(seed), 0, N, din, p).to(dev)


# ================================================================================================ layout helpers
def _offsets(ranks: Sequence[int]) -> List[int]:
    offs, o = [], 0
    for r in ranks:
        offs.append(o)
        o += r
    return offs


def _scaled_b(B: torch.Tensor, ranks, scalings, dtype: torch.dtype) -> torch.Tensor:
    """``Bs = B * s`` per adapter column block, written in the compute dtype (one kernel per adapter, also when the
    adapters are fp32 on a bf16 base). Python-float multiplies only: building an [R] scaling tensor on the device
    from a Python list is a pageable host-to-device copy, i.e. a stream sync per call."""
    out = torch.empty(B.shape, dtype=dtype, device=B.device)
    for o, r, s in zip(_offsets(ranks), ranks, scalings):
        torch.mul(B[:, o:o + r], float(s), out=out[:, o:o + r])
    return out


def _compute_dtype(A: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return A if A.dtype == dtype else A.to(dtype)


def _dropout_kernel_a(A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A as the dropout paths take it: the Triton kernels read wider adapters (PEFT's fp32 A on a bf16 base) as
    they are and round them in registers, which saves a cast kernel per call; the PyTorch path needs x's dtype."""
    return A if _use_triton(x) else _compute_dtype(A, x.dtype)


# ================================================================================================ forward
def _down_dropout(x, A_i, V_i, seed_i, p):
    N, din = x.shape
    r = A_i.shape[0]
    if _use_triton(x):
        if N == 0:
            return
        cfg = DOWN_CONFIG
        _lora_down_kernel[(triton.cdiv(N, cfg["BM"]),)](
            x, x.stride(0), A_i, A_i.stride(0), V_i, V_i.stride(0), seed_i, N, din, r, *_dropout_threshold(p),
            RP=_rank_pad(r), DOT_F32=_interpreted() or x.dtype == torch.float32, **MASK_CONFIG, **cfg)
        return
    seed = int(seed_i)
    for s in range(0, N, CPU_MASK_ROWS * 8):
        e = min(N, s + CPU_MASK_ROWS * 8)
        keep = _cpu_keep(seed, s, e, din, p)
        xd = x[s:e] * keep.to(x.dtype)
        V_i[s:e] = (xd @ A_i.t()) * (1.0 / (1.0 - p))


def lora_forward(x, weight, bias, A, B, ranks, scalings, dropout_p, seeds):
    """x [N, din] -> (y [N, dout], V [N, R]). ``seeds`` [n_adapters] int64 (ignored where p == 0). A / B may be
    wider than x (fp32 adapters on a bf16 base): the matmuls run in x's dtype with fp32 accumulation."""
    N = x.shape[0]
    R = A.shape[0]
    if all(p == 0 for p in dropout_p):
        V = torch.mm(x, _compute_dtype(A, x.dtype).t())
    else:
        V = x.new_empty((N, R))
        Ak = _dropout_kernel_a(A, x)
        for i, (o, r, p) in enumerate(zip(_offsets(ranks), ranks, dropout_p)):
            if p == 0:
                V[:, o:o + r] = x @ _compute_dtype(Ak[o:o + r], x.dtype).t()
            else:
                _down_dropout(x, Ak[o:o + r], V[:, o:o + r], seeds[i:i + 1], p)
    Bs = _scaled_b(B, ranks, scalings, x.dtype)
    # The low-rank product is the C operand of the base GEMM: cuBLAS adds it in its epilogue.
    C = torch.addmm(bias, V, Bs.t()) if bias is not None else torch.mm(V, Bs.t())
    # In place: out-of-place addmm first copies C into a fresh output (a 64 us DtoD copy at 16384 x 4096).
    return C.addmm_(x, weight.t()), V


# ================================================================================================ backward
def _up_dropout_bwd(gV_i, A_i, x, C, ga32_i, seed_i, p, write_c, accumulate):
    """One dropout adapter's backward: C (+)= keep * (gV_i @ A_i) / (1 - p) when ``write_c``, and
    ga32_i += gV_i.T @ (keep * x) / (1 - p) (fp32, zeroed by the caller) when ``ga32_i`` is given."""
    N, din = x.shape
    r = A_i.shape[0]
    write_ga = ga32_i is not None
    if _use_triton(x):
        if N == 0:
            return
        thresh, inv = _dropout_threshold(p)
        cfg = UP_BWD_CONFIG
        BM, BK = cfg["BM"], cfg["BK"]
        ncol = triton.cdiv(din, BK)
        sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device()) \
            if x.is_cuda else 4
        nsplit = max(1, min(triton.cdiv(N, BM), (2 * sms) // ncol))
        _lora_up_dropout_bwd_kernel[(ncol, nsplit)](
            gV_i, gV_i.stride(0), A_i, A_i.stride(0), x, x.stride(0),
            C if write_c else x, C.stride(0) if write_c else 0, ga32_i if write_ga else x, seed_i, N, din, r,
            thresh, inv, RP=_rank_pad(r), WRITE_C=write_c, ACCUMULATE=accumulate, WRITE_GA=write_ga,
            DOT_F32=_interpreted() or x.dtype == torch.float32, **MASK_CONFIG, **cfg)
        return
    seed, inv = int(seed_i), 1.0 / (1.0 - p)
    step = CPU_MASK_ROWS * 8
    for s in range(0, N, step):
        e = min(N, s + step)
        keep = _cpu_keep(seed, s, e, din, p).to(x.dtype)
        if write_c:
            t = (gV_i[s:e] @ A_i) * keep * inv
            if accumulate:
                C[s:e] += t
            else:
                C[s:e] = t
        if write_ga:
            ga32_i += (gV_i[s:e].t() @ (x[s:e] * keep)).float() * inv


def lora_backward(gy, x, weight, A, B, V, seeds, ranks, scalings, dropout_p,
                  need_gx: bool, need_gw: bool, need_gbias: bool, need_ga: bool, need_gb: bool):
    """Returns (gx [N, din], gW [dout, din], gbias [dout], gA [R, din], gB [dout, R]); [0] for those not asked.
    gA / gB come back in A / B's dtype (fp32 adapters: accumulated in fp32 and returned without a bf16 round)."""
    N, din = x.shape
    empty = lambda: x.new_empty(0)  # noqa: E731  (distinct tensors: custom_op outputs must not alias)
    Bs = _scaled_b(B, ranks, scalings, x.dtype)
    offs = _offsets(ranks)
    gx = gw = gbias = ga = gb = None
    need_gv = need_gx or need_ga
    gV = None
    # Both products that read gy stay in cuBLAS: a Triton kernel computing them from one read of gy (atomics
    # for gB) measured no faster on H200 (0.089-0.137 ms vs 2 x 0.045 ms at 16384 x 4096; lora_notes.md).
    if need_gv:
        gV = gy @ Bs
    if need_gb:
        g16 = gy.t() @ V
        gb = torch.empty(B.shape, dtype=B.dtype, device=B.device)
        for o, r, s in zip(offs, ranks, scalings):
            torch.mul(g16[:, o:o + r], float(s), out=gb[:, o:o + r])
    C2 = None
    if need_gv:
        if all(p == 0 for p in dropout_p):
            Ac = _compute_dtype(A, x.dtype)
            if need_gx:
                C2 = gV @ Ac
            if need_ga:
                ga = _compute_dtype(gV.t() @ x, A.dtype)
        else:
            C2 = x.new_empty((N, din)) if need_gx else None
            ga32 = torch.zeros((A.shape[0], din), dtype=torch.float32, device=x.device) if need_ga else None
            first = True
            Ak = _dropout_kernel_a(A, x)
            for i, (o, r, p) in enumerate(zip(offs, ranks, dropout_p)):
                gV_i = gV[:, o:o + r]
                if p == 0:
                    A_i = _compute_dtype(Ak[o:o + r], x.dtype)
                    if need_gx:
                        if first:
                            torch.mm(gV_i, A_i, out=C2)
                        else:
                            C2.addmm_(gV_i, A_i)
                    if need_ga:
                        ga32[o:o + r] = gV_i.t() @ x
                else:
                    _up_dropout_bwd(gV_i, Ak[o:o + r], x, C2, ga32[o:o + r] if need_ga else None, seeds[i:i + 1],
                                    p, need_gx, need_gx and not first)
                first = False
            if need_ga:
                ga = _compute_dtype(ga32, A.dtype)
    if need_gx:
        gx = C2.addmm_(gy, weight)  # the low-rank gradient is the C operand of the base GEMM (in place: no copy)
    if need_gw:
        gw = gy.t() @ x
    if need_gbias:
        gbias = gy.sum(0)
    return tuple(t if t is not None else empty() for t in (gx, gw, gbias, ga, gb))


# ================================================================================================ reference
def lora_reference(x, weight, bias, As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], scalings,
                   keep_masks: Optional[Sequence[Optional[torch.Tensor]]] = None, dropout_p=None):
    """PEFT's formula in float64 (or the inputs' dtype, for an eager baseline): base + sum_i s_i * B_i(A_i(drop_i(x)))
    with the given keep masks (``None`` = no dropout for that adapter)."""
    y = torch.nn.functional.linear(x, weight, bias)
    for i, (A_i, B_i, s) in enumerate(zip(As, Bs, scalings)):
        xd = x
        if keep_masks is not None and keep_masks[i] is not None:
            xd = x * keep_masks[i].to(x.dtype) / (1.0 - dropout_p[i])
        y = y + (xd @ A_i.t() @ B_i.t()) * s
    return y
