"""LoRA linear: ``y = x @ W.T + bias + sum_i s_i * dropout_i(x) @ A_i.T @ B_i.T``, forward and backward, with the
dropout masks regenerated from a seed instead of stored. Kernels, launchers, the PyTorch (CPU) path and a float64
reference side by side.

Notation: x [N, din]; one or several projections j read x (one for a plain LoRA layer; q/k/v or gate/up after
horizontal fusion), each with its weight W_j [dout_j, din] (usually frozen) and its adapters i; A = cat_i A_i
[R, din] over all adapters of all projections, B_j = cat of projection j's B_i [dout_j, R_j];
``V = [s_i * drop_i(x) @ A_i.T]`` [N, R], each adapter's scaling s_i folded in (the only activation saved besides
x: N x r per adapter; grad B_j = gy_j.T @ V_j needs no rescale).

Where the time goes (benchmarks/lora_notes.md): the base GEMMs are compute-bound; the low-rank terms are
bandwidth-bound passes over [N, din] / [N, dout] tensors. PEFT runs each as its own kernel and stores
``dropout(x)`` (and the mask) for every adapted projection. Here:

* forward:  ``V = s * drop(x) @ A.T`` (one read of x for all adapters of all projections that share a dropout
  setting: ``_lora_down_kernel``, dropout applied in registers), ``y_j = addmm(V_j @ B_j.T (+ bias), x, W_j.T)``:
  the low-rank product is the addmm's C operand, which cuBLAS reads in its epilogue (no ``y + delta`` pass); on
  Hopper one more K step of the base GEMM instead (last point below).
* backward: ``gV_j = gy_j @ B_j`` and ``gB_j = gy_j.T @ V_j`` (cuBLAS); the low-rank part of grad x,
  ``s * sum_i keep_i * (gV_i @ A_i) / (1 - p)``, and ``gA_i = s * gV_i.T @ (keep_i * x) / (1 - p)`` come from one
  kernel (``_lora_up_dropout_bwd_kernel``: one read of x, one write of the [N, din] term, each mask regenerated
  once per tile); then every projection's base GEMM adds ``gy_j @ W_j`` into that buffer in place, so sibling
  projections' grad x are summed without a separate pass.
* On Hopper (TMA), ``V_j @ B_j.T`` and, without dropout, ``gV @ A`` are instead one more K step of the base GEMM
  (``kernels/lowrank_gemm.py``): the low-rank product never goes through memory as an [N, d] C operand.

Dropout masks: Triton's Philox (``tl.rand``) keyed by a per-call, per-adapter seed (a device tensor drawn from
torch's generator, so ``torch.manual_seed`` reproduces it and there is no host sync) and the counter
``row * ceil(din / 8) + col // 8`` (one per 8 elements; 32-bit on purpose, whatever the index width below, so the
pattern repeats after 2**35 elements of x in one call). The CPU path uses
torch's CPU generator per 256-row block, keyed by the same seed; the two paths draw different (equally
distributed) masks. :func:`dropout_keep_mask` returns the mask a path uses, for references in tests.

64-bit offsets: the kernels address x, V / gV, grad x's low-rank term and the mask as ``rows * stride + cols``,
which wraps in int32 once a tensor has more than 2**31 elements (an 8B down_proj, in_features 14336, at ~150k
tokens in one call). As Inductor does, the launchers keep int32 index math while every offset the kernel can form
into those tensors fits in int32 and otherwise set the constexpr ``INT64_IDX`` (:func:`needs_int64_idx`), under
which the row indices are int64 before they meet a stride. The flag flips only past 2**31 elements: normal sizes
compile and run the same kernels as before. A and grad A ([R, din], R = the adapters' ranks) stay int32 (checked).
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch

from . import background_compile
from .lowrank_gemm import lowrank_gemm, lowrank_gemm_prewarm, lowrank_gemm_supported
from .triton_support import HAVE_TRITON, dot_pad, interpreting, sm_count, tl, triton, use_triton

__all__ = ["lora_forward", "lora_backward", "lora_reference", "dropout_keep_mask", "prewarm", "FORCE_TRITON",
           "draw_seeds", "max_offset", "needs_int64_idx"]

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
#: Run the kernels' 64-bit index path (``INT64_IDX``) at any size; for tests (it must compute what int32 does).
FORCE_INT64_IDX = False
INT32_MAX = 2**31 - 1


def draw_seeds(n: int, device) -> torch.Tensor:
    """One int64 seed per adapter, drawn on ``device`` from torch's generator (no host sync on CUDA)."""
    return torch.randint(0, 2**31 - 1, (n,), device=device, dtype=torch.int64)


def _dropout_threshold(p: float) -> Tuple[int, float]:
    """(16-bit threshold, 1 / keep probability) of the Triton mask: keep = bits >= round(p * 65536), so the
    kept fraction is exactly 1 - thresh / 65536 and the rescale uses that (unbiased; |p_eff - p| < 2**-17)."""
    t = int(round(float(p) * 65536))
    return t, 65536.0 / (65536 - t)




# ================================================================================================ 64-bit offsets
def max_offset(shape: Sequence[int], strides: Sequence[int]) -> int:
    """The largest element offset ``sum_d (size_d - 1) * stride_d`` into a tensor of this layout (0 if empty)."""
    off = 0
    for n, st in zip(shape, strides):
        if n == 0:
            return 0
        off += (n - 1) * st
    return off


def needs_int64_idx(*layouts) -> bool:
    """Whether a kernel addressing these tensors must form its element offsets in 64 bits: some offset it can reach
    (``max_offset``) passes 2**31 - 1. Each layout is a tensor or a (shape, strides) pair of ints."""
    for t in layouts:
        shape, strides = (t.shape, t.stride()) if isinstance(t, torch.Tensor) else t
        if max_offset(shape, strides) > INT32_MAX:
            return True
    return False


def _int64_idx(*tensors: torch.Tensor) -> bool:
    """The launchers' ``INT64_IDX``: :func:`needs_int64_idx` of the [N, .] tensors the kernel addresses."""
    return FORCE_INT64_IDX or needs_int64_idx(*tensors)


def _check_int32_adapters(*tensors: torch.Tensor) -> None:
    """A / grad A ([R, din]) are addressed with int32 offsets in every variant of the kernels."""
    for t in tensors:
        if max_offset(t.shape, t.stride()) > INT32_MAX:
            raise ValueError(f"lora_linear: the adapters' A {tuple(t.shape)} has more than 2**31 elements")


# ================================================================================================ Triton kernels
if HAVE_TRITON:

    @triton.jit
    def _tile_rows(row0, BM: tl.constexpr, INT64_IDX: tl.constexpr):
        """Row indices row0 + [0, BM) of a tile, int64 under INT64_IDX: ``rows * stride`` then cannot wrap."""
        rows = row0 + tl.arange(0, BM)
        if INT64_IDX:
            rows = rows.to(tl.int64)
        return rows

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

    # N (tokens) changes every step with variable lengths: no specialisation on its divisibility (a JIT compile
    # per new residue class mid-training); the kernels mask by N anyway
    @triton.jit(do_not_specialize=["N"])
    def _keep_mask_kernel(out_ptr, seed_ptr, N, DIN, thresh, BM: tl.constexpr, BK: tl.constexpr,
                          ROUNDS: tl.constexpr, EXPAND: tl.constexpr, INT64_IDX: tl.constexpr):
        row0 = tl.program_id(0) * BM
        col0 = tl.program_id(1) * BK
        rows = _tile_rows(row0, BM, INT64_IDX)
        cols = col0 + tl.arange(0, BK)
        keep = _keep_mask(tl.load(seed_ptr), row0, col0, DIN, thresh, BM, BK, ROUNDS, EXPAND)
        inb = (rows < N)[:, None] & (cols < DIN)[None, :]
        tl.store(out_ptr + rows[:, None] * DIN + cols[None, :], keep.to(tl.int8), mask=inb)

    # The dropout kernels take a *run* of NA <= 4 adapters that share rank r, dropout p and scaling s and sit side
    # by side in A (rows k*r), V / gV (columns k*r), the seeds (k) and grad A (rows k*r): PEFT's q/k/v or gate/up
    # adapters of one layer after horizontal fusion, or several active adapters on one layer. Each tile of x is
    # read once for the whole run and masked NA times (each adapter keeps its own mask, so the result is the same
    # as NA separate calls). Triton has no lists of loop-carried tensors: the per-adapter accumulators are spelled
    # out (acc0..acc3) and the unused ones are compiled away (NA is a constexpr; runs are cut at MAX_RUN).

    @triton.jit
    def _masked_x_at(x, a_ptr, stride_a, rr, cols, R, DIN, seed, row0, col0, thresh, acc,
                     BM: tl.constexpr, BK: tl.constexpr, ROUNDS: tl.constexpr, EXPAND: tl.constexpr,
                     DOT_F32: tl.constexpr):
        """acc += (keep * x) @ A_k.T over one [BM, BK] tile of x (A_k's [BK, RP] slice loaded here)."""
        xm = tl.where(_keep_mask(seed, row0, col0, DIN, thresh, BM, BK, ROUNDS, EXPAND), x, 0.0)
        at = tl.load(a_ptr + rr[None, :] * stride_a + cols[:, None],
                     mask=(rr < R)[None, :] & (cols < DIN)[:, None], other=0.0)       # [BK, RP] = A_k.T tile
        if DOT_F32:  # the interpreter's bf16 tl.dot is wrong (DESIGN.md sec. 4)
            acc += tl.dot(xm.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:  # A may be wider than x (PEFT's fp32 adapters): rounded to x's dtype here, not by a cast kernel
            acc += tl.dot(xm, at.to(x.dtype))
        return acc

    @triton.jit
    def _store_v(v_ptr, stride_v, rows, rr, N, R, acc):
        tl.store(v_ptr + rows[:, None] * stride_v + rr[None, :], acc.to(v_ptr.dtype.element_ty),
                 mask=(rows < N)[:, None] & (rr < R)[None, :])

    @triton.jit(do_not_specialize=["N"])
    def _lora_down_kernel(
        x_ptr, stride_x,          # [N, DIN]
        a_ptr, stride_a,          # [NA * r, DIN]: the run's rows of A
        v_ptr, stride_v,          # [N, NA * r]: the run's columns of V
        seed_ptr, N, DIN, R, thresh, scale,
        BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, NA: tl.constexpr, DOT_F32: tl.constexpr,
        ROUNDS: tl.constexpr, EXPAND: tl.constexpr, INT64_IDX: tl.constexpr,
    ):
        """V_k[rows] = s * (keep_k * x[rows]) @ A_k.T / (1 - p) for the run's NA adapters: one read of x, the masks
        never leave registers, the scaling s rides along (V is saved scaled: grad B = gy.T @ V needs no rescale)."""
        row0 = tl.program_id(0) * BM
        rows = _tile_rows(row0, BM, INT64_IDX)
        rr = tl.arange(0, RP)
        s0 = tl.load(seed_ptr)
        s1 = s0
        s2 = s0
        s3 = s0
        if NA > 1:
            s1 = tl.load(seed_ptr + 1)
        if NA > 2:
            s2 = tl.load(seed_ptr + 2)
        if NA > 3:
            s3 = tl.load(seed_ptr + 3)
        acc0 = tl.zeros((BM, RP), dtype=tl.float32)
        acc1 = tl.zeros((BM, RP), dtype=tl.float32)
        acc2 = tl.zeros((BM, RP), dtype=tl.float32)
        acc3 = tl.zeros((BM, RP), dtype=tl.float32)
        for k0 in range(0, DIN, BK):
            cols = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                        mask=(rows < N)[:, None] & (cols < DIN)[None, :], other=0.0)
            acc0 = _masked_x_at(x, a_ptr, stride_a, rr, cols, R, DIN, s0, row0, k0, thresh, acc0,
                                BM, BK, ROUNDS, EXPAND, DOT_F32)
            if NA > 1:
                acc1 = _masked_x_at(x, a_ptr + R * stride_a, stride_a, rr, cols, R, DIN, s1, row0, k0, thresh,
                                    acc1, BM, BK, ROUNDS, EXPAND, DOT_F32)
            if NA > 2:
                acc2 = _masked_x_at(x, a_ptr + 2 * R * stride_a, stride_a, rr, cols, R, DIN, s2, row0, k0, thresh,
                                    acc2, BM, BK, ROUNDS, EXPAND, DOT_F32)
            if NA > 3:
                acc3 = _masked_x_at(x, a_ptr + 3 * R * stride_a, stride_a, rr, cols, R, DIN, s3, row0, k0, thresh,
                                    acc3, BM, BK, ROUNDS, EXPAND, DOT_F32)
        _store_v(v_ptr, stride_v, rows, rr, N, R, acc0 * scale)
        if NA > 1:
            _store_v(v_ptr + R, stride_v, rows, rr, N, R, acc1 * scale)
        if NA > 2:
            _store_v(v_ptr + 2 * R, stride_v, rows, rr, N, R, acc2 * scale)
        if NA > 3:
            _store_v(v_ptr + 3 * R, stride_v, rows, rr, N, R, acc3 * scale)

    @triton.jit
    def _load_a(a_ptr, stride_a, rr, cols, R, DIN):
        return tl.load(a_ptr + rr[:, None] * stride_a + cols[None, :],
                       mask=(rr < R)[:, None] & (cols < DIN)[None, :], other=0.0)        # [RP, BK]

    @triton.jit
    def _adapter_bwd_tile(gv_ptr, stride_gv, a, x, seed, rows, rr, row0, col0, N, DIN, R, thresh, t, acc_at,
                          BM: tl.constexpr, BK: tl.constexpr, WRITE_C: tl.constexpr, WRITE_GA: tl.constexpr,
                          DOT_F32: tl.constexpr, ROUNDS: tl.constexpr, EXPAND: tl.constexpr):
        """One adapter on one [BM, BK] tile: t += keep * (gV_k @ A_k), acc_at += (keep * x).T @ gV_k."""
        gv = tl.load(gv_ptr + rows[:, None] * stride_gv + rr[None, :],
                     mask=(rows < N)[:, None] & (rr < R)[None, :], other=0.0)            # [BM, RP]
        keep = _keep_mask(seed, row0, col0, DIN, thresh, BM, BK, ROUNDS, EXPAND)
        if WRITE_C:
            if DOT_F32:
                d = tl.dot(gv.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                d = tl.dot(gv, a.to(gv.dtype))  # A may be fp32: rounded here
            t += tl.where(keep, d, 0.0)
        if WRITE_GA:
            xm = tl.where(keep, x, 0.0)
            if DOT_F32:
                acc_at += tl.dot(tl.trans(xm.to(tl.float32)), gv.to(tl.float32), input_precision="ieee")
            else:  # x.T @ gV keeps the MMA's M dimension large
                acc_at += tl.dot(tl.trans(xm), gv)
        return t, acc_at

    @triton.jit
    def _atomic_add_ga(ga_ptr, stride_ga, rr, cols, R, DIN, acc_at):
        tl.atomic_add(ga_ptr + rr[None, :] * stride_ga + cols[:, None], acc_at,
                      mask=(rr < R)[None, :] & (cols < DIN)[:, None])

    @triton.jit(do_not_specialize=["N"])
    def _lora_up_dropout_bwd_kernel(
        gv_ptr, stride_gv,        # [N, NA * r] grad of the run's (scaled) V
        a_ptr, stride_a,          # [NA * r, DIN]
        x_ptr, stride_x,          # [N, DIN]
        c_ptr, stride_c,          # [N, DIN] out: s * sum_k keep_k * (gV_k @ A_k) / (1 - p)   (+= when ACCUMULATE)
        ga_ptr, stride_ga,        # [NA * r, DIN] fp32, zeroed: += s * gV_k.T @ (keep_k * x) / (1 - p)
        seed_ptr, N, DIN, R, thresh, scale,
        BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, NA: tl.constexpr,
        WRITE_C: tl.constexpr, ACCUMULATE: tl.constexpr, WRITE_GA: tl.constexpr, DOT_F32: tl.constexpr,
        ROUNDS: tl.constexpr, EXPAND: tl.constexpr, INT64_IDX: tl.constexpr,
    ):
        """Both dropout-side gradients of a run of adapters from one read of each [BM, BK] tile of x (and one
        write of grad x's low-rank term for the whole run), each adapter's mask regenerated once per tile.

        Grid (column blocks, row splits): a program owns BK columns and strides over row blocks, so its slices of
        grad A accumulate in registers and reach memory with one atomic add per element per program.
        """
        col0 = tl.program_id(0) * BK
        cols = col0 + tl.arange(0, BK)
        split = tl.program_id(1)
        nsplit = tl.num_programs(1)
        rr = tl.arange(0, RP)
        s0 = tl.load(seed_ptr)
        s1 = s0
        s2 = s0
        s3 = s0
        a0 = _load_a(a_ptr, stride_a, rr, cols, R, DIN)
        a1 = a0
        a2 = a0
        a3 = a0
        if NA > 1:
            s1 = tl.load(seed_ptr + 1)
            a1 = _load_a(a_ptr + R * stride_a, stride_a, rr, cols, R, DIN)
        if NA > 2:
            s2 = tl.load(seed_ptr + 2)
            a2 = _load_a(a_ptr + 2 * R * stride_a, stride_a, rr, cols, R, DIN)
        if NA > 3:
            s3 = tl.load(seed_ptr + 3)
            a3 = _load_a(a_ptr + 3 * R * stride_a, stride_a, rr, cols, R, DIN)
        acc0 = tl.zeros((BK, RP), dtype=tl.float32)  # grad A_k.T slices
        acc1 = tl.zeros((BK, RP), dtype=tl.float32)
        acc2 = tl.zeros((BK, RP), dtype=tl.float32)
        acc3 = tl.zeros((BK, RP), dtype=tl.float32)
        for mb in range(split, tl.cdiv(N, BM), nsplit):
            row0 = mb * BM
            rows = _tile_rows(row0, BM, INT64_IDX)
            inb = (rows < N)[:, None] & (cols < DIN)[None, :]
            if WRITE_GA:
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=inb, other=0.0)
            else:
                x = tl.zeros((BM, BK), dtype=x_ptr.dtype.element_ty)
            t = tl.zeros((BM, BK), dtype=tl.float32)
            t, acc0 = _adapter_bwd_tile(gv_ptr, stride_gv, a0, x, s0, rows, rr, row0, col0, N, DIN, R, thresh,
                                        t, acc0, BM, BK, WRITE_C, WRITE_GA, DOT_F32, ROUNDS, EXPAND)
            if NA > 1:
                t, acc1 = _adapter_bwd_tile(gv_ptr + R, stride_gv, a1, x, s1, rows, rr, row0, col0, N, DIN, R,
                                            thresh, t, acc1, BM, BK, WRITE_C, WRITE_GA, DOT_F32, ROUNDS, EXPAND)
            if NA > 2:
                t, acc2 = _adapter_bwd_tile(gv_ptr + 2 * R, stride_gv, a2, x, s2, rows, rr, row0, col0, N, DIN, R,
                                            thresh, t, acc2, BM, BK, WRITE_C, WRITE_GA, DOT_F32, ROUNDS, EXPAND)
            if NA > 3:
                t, acc3 = _adapter_bwd_tile(gv_ptr + 3 * R, stride_gv, a3, x, s3, rows, rr, row0, col0, N, DIN, R,
                                            thresh, t, acc3, BM, BK, WRITE_C, WRITE_GA, DOT_F32, ROUNDS, EXPAND)
            if WRITE_C:
                t = t * scale
                c_ptrs = c_ptr + rows[:, None] * stride_c + cols[None, :]
                if ACCUMULATE:
                    t += tl.load(c_ptrs, mask=inb, other=0.0).to(tl.float32)
                tl.store(c_ptrs, t.to(c_ptr.dtype.element_ty), mask=inb)
        if WRITE_GA:
            _atomic_add_ga(ga_ptr, stride_ga, rr, cols, R, DIN, acc0 * scale)
            if NA > 1:
                _atomic_add_ga(ga_ptr + R * stride_ga, stride_ga, rr, cols, R, DIN, acc1 * scale)
            if NA > 2:
                _atomic_add_ga(ga_ptr + 2 * R * stride_ga, stride_ga, rr, cols, R, DIN, acc2 * scale)
            if NA > 3:
                _atomic_add_ga(ga_ptr + 3 * R * stride_ga, stride_ga, rr, cols, R, DIN, acc3 * scale)


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
    if use_triton(probe, FORCE_TRITON):
        out = torch.empty((N, din), dtype=torch.int8, device=dev)
        seed_d = seed.reshape(1).to(dev)
        if N and din:
            _keep_mask_kernel[(triton.cdiv(N, 32), triton.cdiv(din, 32))](
                out, seed_d, N, din, _dropout_threshold(p)[0], BM=32, BK=32, **MASK_CONFIG,
                INT64_IDX=_int64_idx(out))
        return out.bool()
    return _cpu_keep(int(seed), 0, N, din, p).to(dev)


# ================================================================================================ layout helpers
def _offsets(sizes: Sequence[int]) -> List[int]:
    offs, o = [], 0
    for r in sizes:
        offs.append(o)
        o += r
    return offs


def _compute_dtype(A: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return A if A.dtype == dtype else A.to(dtype)


def _dropout_kernel_a(A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A as the dropout paths take it: the Triton kernels read wider adapters (PEFT's fp32 A on a bf16 base) as
    they are and round them in registers, which saves a cast kernel per call; the PyTorch path needs x's dtype."""
    return A if use_triton(x, FORCE_TRITON) else _compute_dtype(A, x.dtype)


MAX_RUN = 4  # adapters per dropout-kernel launch (the kernels spell out four accumulators)


def _runs(ranks: Sequence[int], scalings: Sequence[float], dropout_p: Sequence[float]):
    """Adapters with dropout, in runs for the dropout kernels: (first adapter, count <= MAX_RUN, r, s, p) over
    consecutive adapters that share rank, scaling and dropout p (one LoraConfig: all of them)."""
    out = []
    for i, (r, s, p) in enumerate(zip(ranks, scalings, dropout_p)):
        if p == 0:
            continue
        last = out[-1] if out else None
        if last and last[0] + last[1] == i and last[1] < MAX_RUN and last[2:] == (r, s, p):
            out[-1] = (last[0], last[1] + 1, r, s, p)
        else:
            out.append((i, 1, r, s, p))
    return out


def _projection_slices(counts: Sequence[int], ranks: Sequence[int]) -> List[slice]:
    """Columns of V / rows of A that belong to each projection (its adapters are consecutive)."""
    r_proj = [sum(ranks[a:a + c]) for a, c in zip(_offsets(counts), counts)]
    return [slice(o, o + r) for o, r in zip(_offsets(r_proj), r_proj)]


# ================================================================================================ forward
def _down_dropout(x, A_run, V_run, seeds_run, na, r, s, p):
    """V_run (the run's [N, na * r] columns of V) = s * drop_k(x) @ A_k.T for the run's adapters."""
    N, din = x.shape
    thresh, inv = _dropout_threshold(p)
    if use_triton(x, FORCE_TRITON):
        if N == 0:
            return
        cfg = DOWN_CONFIG
        _check_int32_adapters(A_run)
        _lora_down_kernel[(triton.cdiv(N, cfg["BM"]),)](
            x, x.stride(0), A_run, A_run.stride(0), V_run, V_run.stride(0), seeds_run, N, din, r, thresh, s * inv,
            RP=dot_pad(r), NA=na, DOT_F32=interpreting() or x.dtype == torch.float32, **MASK_CONFIG, **cfg,
            INT64_IDX=_int64_idx(x, V_run))
        return
    inv = 1.0 / (1.0 - p)
    for k in range(na):
        seed, A_k = int(seeds_run[k]), A_run[k * r:(k + 1) * r]
        for s0 in range(0, N, CPU_MASK_ROWS * 8):
            e = min(N, s0 + CPU_MASK_ROWS * 8)
            xd = x[s0:e] * _cpu_keep(seed, s0, e, din, p).to(x.dtype)
            V_run[s0:e, k * r:(k + 1) * r] = (xd @ A_k.t()) * (s * inv)


_grad_x_prewarmed: set = set()


def _meta_like(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A meta tensor with ``t``'s sizes and strides (``dtype``: another dtype): what a warm-up reads of an operand."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype if dtype is None else dtype, device="meta")


def _prewarm_grad_x(x, W0, A, device: Optional[torch.device] = None):
    """Start compiling the low-rank GEMM specialisation this call's backward will launch for grad x
    (``lora_backward``: ``gy_0 @ W_0 + gV @ A`` with gy_0 [N, dout_0] and gV [N, R] fresh and contiguous), so its
    Triton JIT overlaps the rest of the forward instead of stalling the first backward (``background_compile.py``). Once
    per layout: the set check is all a later call pays. ``device``: where operands given as meta tensors live."""
    device = x.device if device is None else device
    N = x.shape[0]
    key = (device, x.dtype, N % 16 == 0, tuple(W0.shape), W0.stride(), W0.dtype, A.shape[0], A.dtype)
    if key in _grad_x_prewarmed:
        return
    _grad_x_prewarmed.add(key)
    meta = lambda *shape: torch.empty(shape, dtype=x.dtype, device="meta")  # noqa: E731
    Ac = A if A.dtype == x.dtype else meta(*A.shape)  # the backward's _compute_dtype(A, x.dtype)
    lowrank_gemm_prewarm(meta(N, W0.shape[0]), W0, meta(N, A.shape[0]), Ac, b_kn=True, u_kn=True, device=device)


_forward_prewarmed: set = set()


def prewarm(x, weights, biases, A, Bs, ranks, counts, dropout_p) -> None:
    """From the forward op's fake impl, which runs while fxfuse's passes check the rewritten graph and again while
    AOTAutograd traces it, seconds before the first real call: start compiling the low-rank GEMM specialisations
    :func:`lora_forward` will launch (one per projection layout) and its backward's grad x on the warm-up threads,
    so the first forward finds them compiled or in flight instead of compiling each at its launch. Reads only
    shapes, strides, dtypes and the device (fake tensors welcome); nothing where the sizes are symbolic, off
    Triton, or with dropout (the dropout path launches other kernels; :func:`lowrank_gemm_prewarm` starts nothing
    but on CUDA)."""
    if not (background_compile.ENABLED and use_triton(x, FORCE_TRITON)) or any(p != 0 for p in dropout_p):
        return
    tensors = [x, A, *weights, *Bs, *(b for b in biases if b is not None)]
    if any(not isinstance(d, int) for t in tensors for d in (*t.shape, *t.stride())):
        return  # symbolic: the launch's divisibility by 16 is not known yet
    device, N = x.device, x.shape[0]
    key = (device, x.dtype, N % 16 == 0, tuple((tuple(w.shape), w.stride(), w.dtype) for w in weights),
           tuple(b is not None for b in biases), A.shape[0], A.dtype, tuple(B.dtype for B in Bs), tuple(ranks),
           tuple(counts))
    if key in _forward_prewarmed:
        return
    _forward_prewarmed.add(key)
    # Outside the tracing modes (fake, functional, proxy): the stand-ins are plain meta tensors, nothing is recorded
    with torch.utils._python_dispatch._disable_current_modes():
        xm = _meta_like(x)
        V = torch.empty((N, A.shape[0]), dtype=x.dtype, device="meta")  # as lora_forward makes it (torch.mm's)
        for W, b, B, cols in zip(weights, biases, Bs, _projection_slices(counts, ranks)):
            lowrank_gemm_prewarm(xm, _meta_like(W), V[:, cols], _meta_like(B, x.dtype),
                                 None if b is None else _meta_like(b), device=device)
        _prewarm_grad_x(xm, _meta_like(weights[0]), _meta_like(A), device=device)


def lora_forward(x, weights, biases, A, Bs, seeds, ranks, counts, scalings, dropout_p):
    """x [N, din] -> ([y_j [N, dout_j] per projection], V [N, R]).

    ``weights`` / ``biases`` (None allowed): one per projection that reads x (one for a plain LoRA layer, q/k/v
    after horizontal fusion); ``counts[j]`` adapters belong to projection j, consecutive in ``A`` = cat_i A_i
    [R, din], ``ranks``, ``scalings``, ``dropout_p`` and ``seeds`` [n_adapters] int64 (read where p > 0);
    ``Bs[j]`` = cat of projection j's B_i [dout_j, R_j]. V [N, R] = [s_i * drop_i(x) @ A_i.T], saved for the
    backward. A / B may be wider than x (fp32 adapters on a bf16 base): the matmuls run in x's dtype with fp32
    accumulation."""
    N = x.shape[0]
    R = A.shape[0]
    if all(p == 0 for p in dropout_p):
        V = torch.mm(x, _compute_dtype(A, x.dtype).t())
        for o, r, s in zip(_offsets(ranks), ranks, scalings):
            if s != 1.0:
                V[:, o:o + r].mul_(s)
    else:
        V = x.new_empty((N, R))
        Ak = _dropout_kernel_a(A, x)
        offs = _offsets(ranks)
        for o, r, s, p in zip(offs, ranks, scalings, dropout_p):
            if p == 0:
                torch.mm(x, _compute_dtype(Ak[o:o + r], x.dtype).t(), out=V[:, o:o + r])
                if s != 1.0:
                    V[:, o:o + r].mul_(s)
        for i, na, r, s, p in _runs(ranks, scalings, dropout_p):
            o = offs[i]
            _down_dropout(x, Ak[o:o + na * r], V[:, o:o + na * r], seeds[i:i + na], na, r, s, p)
    if background_compile.ENABLED and use_triton(x, FORCE_TRITON) and all(p == 0 for p in dropout_p):
        _prewarm_grad_x(x, weights[0], A)
    ys = []
    for W, b, B, cols in zip(weights, biases, Bs, _projection_slices(counts, ranks)):
        Bc = _compute_dtype(B, x.dtype)
        if use_triton(x, FORCE_TRITON) and lowrank_gemm_supported(x, W, V[:, cols], Bc, b):
            # V_j @ B_j.T as one more K step of the base GEMM's accumulator (kernels/lowrank_gemm.py)
            ys.append(lowrank_gemm(x, W, V[:, cols], Bc, b))
            continue
        # Otherwise the low-rank product is the C operand of the base GEMM: cuBLAS adds it in its epilogue.
        C = torch.addmm(b, V[:, cols], Bc.t()) if b is not None else torch.mm(V[:, cols], Bc.t())
        # In place: out-of-place addmm first copies C into a fresh output (a 64 us DtoD copy at 16384 x 4096).
        ys.append(C.addmm_(x, W.t()))
    return ys, V


# ================================================================================================ backward
def _up_dropout_bwd(gV_run, A_run, x, C, ga32_run, seeds_run, na, r, s, p, write_c, accumulate):
    """One run's backward: C (+)= s * sum_k keep_k * (gV_k @ A_k) / (1 - p) when ``write_c``, and
    ga32_run[k] += s * gV_k.T @ (keep_k * x) / (1 - p) (fp32, zeroed by the caller) when ``ga32_run`` is given."""
    N, din = x.shape
    write_ga = ga32_run is not None
    thresh, inv = _dropout_threshold(p)
    if use_triton(x, FORCE_TRITON):
        if N == 0:
            return
        cfg = UP_BWD_CONFIG
        BM, BK = cfg["BM"], cfg["BK"]
        ncol = triton.cdiv(din, BK)
        sms = sm_count(x)
        nsplit = max(1, min(triton.cdiv(N, BM), (2 * sms) // ncol))
        _check_int32_adapters(A_run, *((ga32_run,) if write_ga else ()))
        int64_idx = _int64_idx(gV_run, x, *((C,) if write_c else ()))
        _lora_up_dropout_bwd_kernel[(ncol, nsplit)](
            gV_run, gV_run.stride(0), A_run, A_run.stride(0), x, x.stride(0),
            C if write_c else x, C.stride(0) if write_c else 0, ga32_run if write_ga else x,
            ga32_run.stride(0) if write_ga else 0, seeds_run, N, din, r, thresh, s * inv, RP=dot_pad(r), NA=na,
            WRITE_C=write_c, ACCUMULATE=accumulate, WRITE_GA=write_ga,
            DOT_F32=interpreting() or x.dtype == torch.float32, **MASK_CONFIG, **cfg, INT64_IDX=int64_idx)
        return
    inv = 1.0 / (1.0 - p)
    step = CPU_MASK_ROWS * 8
    for k in range(na):
        seed, A_k, gV_k = int(seeds_run[k]), A_run[k * r:(k + 1) * r], gV_run[:, k * r:(k + 1) * r]
        for s0 in range(0, N, step):
            e = min(N, s0 + step)
            keep = _cpu_keep(seed, s0, e, din, p).to(x.dtype)
            if write_c:
                t = (gV_k[s0:e] @ A_k) * keep * (s * inv)
                if accumulate or k > 0:
                    C[s0:e] += t
                else:
                    C[s0:e] = t
            if write_ga:
                ga32_run[k * r:(k + 1) * r] += (gV_k[s0:e].t() @ (x[s0:e] * keep)).float() * (s * inv)


def lora_backward(gys, x, weights, A, Bs, V, seeds, ranks, counts, scalings, dropout_p,
                  need_gx: bool, need_gw: bool, need_gbias: bool, need_ga: bool, need_gb: bool):
    """Gradients of :func:`lora_forward`: (gx [N, din], [gW_j], [gbias_j], gA [R, din], [gB_j]); gx and gA are
    empty and the lists are [] where not asked. gA / gB come back in A / B's dtype (fp32 adapters: accumulated in
    fp32 and returned without a bf16 round). grad x sums every projection's base and low-rank terms in one buffer:
    the low-rank terms of all adapters are one kernel's output and each base GEMM adds into it in place."""
    N, din = x.shape
    empty = lambda: x.new_empty(0)  # noqa: E731  (distinct tensors: op outputs must not alias)
    projs = _projection_slices(counts, ranks)
    offs = _offsets(ranks)
    gx = ga = None
    gws, gbiases, gbs = [], [], []
    need_gv = need_gx or need_ga

    # grad of the scaled V: gV_j = gy_j @ B_j (written straight into its columns of one [N, R] buffer). Both
    # products that read gy stay in cuBLAS: a Triton kernel computing them from one read of gy (atomics for gB)
    # measured no faster on H200 (lora_notes.md).
    if need_gv:
        gV = x.new_empty((N, A.shape[0]))
        for gy, B, cols in zip(gys, Bs, projs):
            torch.mm(gy, _compute_dtype(B, x.dtype), out=gV[:, cols])
        # Adapters without dropout take cuBLAS below; their scaling goes into gV (a tiny [N, r] multiply). The
        # dropout kernels fold it into their epilogue.
        for o, r, s, p in zip(offs, ranks, scalings, dropout_p):
            if p == 0 and s != 1.0:
                gV[:, o:o + r].mul_(s)
    if need_gb:  # V is saved scaled, so grad B_j = gy_j.T @ V_j exactly
        for gy, B, cols in zip(gys, Bs, projs):
            gbs.append(_compute_dtype(gy.t() @ V[:, cols], B.dtype))
    C2 = None
    gx_done = 0  # projections whose base term gy_j @ W_j is already in C2
    if need_gv and all(p == 0 for p in dropout_p):  # no dropout: all adapters in one product each
        Ac = _compute_dtype(A, x.dtype)
        if need_gx:
            gy0, W0 = gys[0], weights[0]
            if use_triton(x, FORCE_TRITON) and lowrank_gemm_supported(gy0, W0, gV, Ac, b_kn=True, u_kn=True):
                # gy_0 @ W_0 + gV @ A in one accumulator (kernels/lowrank_gemm.py); the siblings add in below
                C2, gx_done = lowrank_gemm(gy0, W0, gV, Ac, b_kn=True, u_kn=True), 1
            else:
                C2 = gV @ Ac
        if need_ga:
            ga = _compute_dtype(gV.t() @ x, A.dtype)
    elif need_gv:
        C2 = x.new_empty((N, din)) if need_gx else None
        ga32 = torch.zeros((A.shape[0], din), dtype=torch.float32, device=x.device) if need_ga else None
        first = True
        Ak = _dropout_kernel_a(A, x)
        for o, r, p in zip(offs, ranks, dropout_p):  # adapters without dropout beside some with: cuBLAS
            if p != 0:
                continue
            A_i = _compute_dtype(Ak[o:o + r], x.dtype)
            if need_gx:
                if first:
                    torch.mm(gV[:, o:o + r], A_i, out=C2)
                else:
                    C2.addmm_(gV[:, o:o + r], A_i)
                first = False
            if need_ga:
                ga32[o:o + r] = gV[:, o:o + r].t() @ x
        for i, na, r, s, p in _runs(ranks, scalings, dropout_p):
            o = offs[i]
            _up_dropout_bwd(gV[:, o:o + na * r], Ak[o:o + na * r], x, C2,
                            ga32[o:o + na * r] if need_ga else None, seeds[i:i + na], na, r, s, p,
                            need_gx, need_gx and not first)
            first = False
        if need_ga:
            ga = _compute_dtype(ga32, A.dtype)
    if need_gx:
        gx = C2
        for gy, W in zip(gys[gx_done:], weights[gx_done:]):  # the base GEMMs add in place (no copy, no sum)
            gx = gx.addmm_(gy, W)
    if need_gw:
        gws = [gy.t() @ x for gy in gys]
    if need_gbias:
        gbiases = [gy.sum(0) for gy in gys]
    return (gx if gx is not None else empty(), gws, gbiases, ga if ga is not None else empty(), gbs)


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
