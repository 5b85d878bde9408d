"""The backward kernels and their launcher :func:`attention_bwd_triton` (FA2 structure), the fully masked rows'
kernels included.

Kernels:
  * ``_attn_bwd_pre``   delta = rowsum(dO * O) in fp32.
  * ``_attn_bwd_dkdv``  one program per (kv block, b, kv head); loops over the G query heads of its group and
                        over q blocks, so GQA gradients are summed in registers (no repeat_kv, no atomics).
  * ``_attn_bwd_dq``    one program per (q block, b, q head); loops over KV blocks.
  * ``_attn_bwd_dead_dq`` / ``_attn_bwd_dead_dkdv``  ``MASKED_ROWS_UNIFORM`` only: the fully masked rows' dense
                        gradient term over every key (:mod:`.reference`); they skip every query block without
                        such a row, so they cost next to nothing when there is none.
dK/dV and dQ recompute p = exp2(s - lse) from the forward's lse and split their range into [masked | unmasked |
masked] loops like the forward (:mod:`.block_map`). At head_dim 256 dK and dV run as two launches (the config's
``split``: one fp32 accumulator each). ``MASKED_ROWS_NAN`` gets eager's NaN gradients afterwards
(:func:`.reference.nan_grads_of_dead_rows`).
"""
from __future__ import annotations

import itertools

import torch

from fxfuse.kernels.launch_cache import PlanCache, Recorder, rebase_descriptor
from fxfuse.kernels.triton_support import HAVE_TRITON, interpreting, tile_descriptor, tl, triton

from . import launching
from .block_map import (key_block_needs_flags, key_block_outside_span, kv_block_query_ranges, load_ranges,
                        mask_block_ranges_of, q_block_key_ranges_of, row_skipped, use_mask_ranges)
from .conventions import MASKED_ROWS_UNIFORM, MASKED_ROWS_ZERO
from .launching import (MASK_LENGTHS, config_for, grid, grid_ids, launch_with_fallbacks, mask_args, needs_int64,
                        plan_key, recipe_args, recipe_tensors, row_launches, score_scalars, softcap_mode)
from .reference import expand_mask, nan_grads_of_dead_rows
from .scores import dot, dot_acc, load_tile, masked_scores, tanh_exp2

__all__ = ["attention_bwd_triton"]

# The lengths and the mask / recipe strides are not specialised (see launching.MASK_LENGTHS).
_LENGTHS_ATTN_BWD_PRE = ['S']
_LENGTHS_ATTN_BWD_DKDV = MASK_LENGTHS + ['S', 'SKV', 'OFF']
_LENGTHS_ATTN_BWD_DQ = MASK_LENGTHS + ['S', 'SKV', 'OFF']
_LENGTHS_ATTN_BWD_DEAD_DQ = ['S', 'SKV', 'NQB']
_LENGTHS_ATTN_BWD_DEAD_DKDV = ['S', 'SKV', 'NQB']


if HAVE_TRITON:

    @triton.jit(do_not_specialize=_LENGTHS_ATTN_BWD_PRE)
    def _attn_bwd_pre(O, DO, DELTA,
                      stride_ob, stride_oh, stride_om, stride_od,
                      stride_dob, stride_doh, stride_dom, stride_dod,
                      H, S, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)  # memory-bound: 64-bit addresses cost nothing here
        b = bh // H
        h = bh % H
        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        msk = (offs_m[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
        o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                    mask=msk, other=0.0).to(tl.float32)
        do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                     + offs_d[None, :] * stride_dod, mask=msk, other=0.0).to(tl.float32)
        tl.store(DELTA + bh * S + offs_m, tl.sum(o * do, 1), mask=offs_m < S)

    @triton.jit
    def _bwd_dkdv_inner(dk, dv, k, v, Q_blk, DO_blk, Q_DESC, DO_DESC, b, h, M_blk, LSE_h, DELTA_h, offs_n,
                        offs_m0, offs_d, lo, hi, stride_qm, stride_dom, stride_mm, S, SKV, OFF, window, sc_mul,
                        out_mul, DST, KVV, kv_check,
                        BLOCK_M: tl.constexpr, D_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
                        MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        BOUNDARY: tl.constexpr, DOT_FP32: tl.constexpr, DO_DK: tl.constexpr,
                        DO_DV: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr,
                        USE_DESC: tl.constexpr, BLOCK_D: tl.constexpr):
        # transposed formulation (keys on rows): sT = k q^T [BLOCK_N, BLOCK_M]. This kernel holds two fp32
        # [BLOCK_N, Dh] accumulators: every register counts (spills cost it ~20% on the H200), so no q / dO load
        # here takes a bounds mask: interior blocks lie inside the sequence (block_map), boundary blocks go
        # through the copy engine (or clamp their row index).
        # Boundary blocks are few (the diagonal, a document's edge, the ragged end): their loops run unpipelined,
        # so that their buffers do not add to the interior loop's register pressure (sm_90, 3 stages: 424 -> 72
        # bytes of spills in the Dh-128 kernel).
        for start_m in tl.range(lo, hi, BLOCK_M, num_stages=1 if BOUNDARY else None):
            offs_m = start_m + offs_m0
            # Rows past the sequence end (the last, partial block): the copy engine reads them as 0 (USE_DESC), or
            # they are read at the clamped index S - 1 (pointer tiles). Bounds-masked pointer loads would cost
            # registers this kernel does not have. Those rows' scores are masked (BOUNDARY: qi < S): p = 0.
            rows = tl.minimum(offs_m, S - 1) if BOUNDARY else offs_m
            # every load first (q, dO, lse, delta), then the math: the order of the minimal experiment kernel
            # (benchmarks/experiments/dkdv_variants.py), which the H200 ran faster
            if USE_DESC:
                # coordinates are 32-bit (each < 2^31 even where the INT64 variant runs; the engine does the rest)
                q = Q_DESC.load([tl.cast(b, tl.int32), tl.cast(h, tl.int32), tl.cast(start_m, tl.int32),
                                 0]).reshape(BLOCK_M, BLOCK_D)
                do = DO_DESC.load([tl.cast(b, tl.int32), tl.cast(h, tl.int32), tl.cast(start_m, tl.int32),
                                   0]).reshape(BLOCK_M, BLOCK_D)
            else:
                d_mask = (offs_d[None, :] < D_MASK) if D_MASK else None
                q = load_tile(Q_blk + rows[:, None] * stride_qm, d_mask)
                do = load_tile(DO_blk + rows[:, None] * stride_dom, d_mask)
            lse2 = tl.load(LSE_h + rows) * 1.4426950408889634
            if DO_DK:
                Di = tl.load(DELTA_h + rows)
            qkT = dot(k, tl.trans(q), DOT_FP32)
            s2, t = masked_scores(qkT, sc_mul, out_mul, M_blk + offs_m[None, :] * stride_mm, offs_m[None, :],
                                  offs_n[:, None], S, SKV, OFF, window, DST, KVV, kv_check, SOFTCAP, MASK_KIND,
                                  IS_CAUSAL, HAS_WINDOW, BOUNDARY, HAS_DOCS, HAS_KVV, 0, 0, False)
            pT = tl.exp2(s2 - lse2[None, :])
            if DO_DV:
                dv = dot_acc(pT.to(do.dtype), do, dv, DOT_FP32)
            if DO_DK:
                dpT = dot(v, tl.trans(do), DOT_FP32)
                dsT = pT * (dpT - Di[None, :])
                if SOFTCAP:
                    dsT = dsT * (1.0 - t * t)  # d(cap * tanh(x / cap)) = 1 - tanh^2
                dk = dot_acc(dsT.to(q.dtype), q, dk, DOT_FP32)
        return dk, dv

    @triton.jit
    def _dkdv_query_ranges(RNG, b, h, pid_n, stride_rb, stride_rh, start_n, S, SKV, OFF, window, DEN, KVS,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                           HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, MASK_RANGES: tl.constexpr,
                           HAS_KVV: tl.constexpr):
        """(lo, b, c, hi) query ranges of this key block for q head h: from the (transposed) mask tensor's tile
        classes (MASK_RANGES) or from the index masks; empty for a block of padding keys (HAS_KVV)."""
        if MASK_RANGES:
            lo, b_, c_, hi = load_ranges(RNG + b * stride_rb + h * stride_rh + pid_n * 4, BLOCK_M)
        else:
            lo, b_, c_, hi = kv_block_query_ranges(start_n, S, SKV, OFF, window, DEN, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                                   HAS_WINDOW, HAS_DOCS)
        if HAS_KVV:  # a block of padding keys: nothing to visit (dK = dV = 0)
            pad = key_block_outside_span(start_n, KVS, BLOCK_N)
            b_, c_, hi = tl.where(pad, lo, b_), tl.where(pad, lo, c_), tl.where(pad, lo, hi)
        return lo, b_, c_, hi

    @triton.jit(do_not_specialize=_LENGTHS_ATTN_BWD_DKDV)
    def _attn_bwd_dkdv(Q, K, V, M, RNG, DOCS, KVVEC, KVSPAN, DO, LSE, DELTA, DK, DV, Q_DESC, DO_DESC,
                       stride_qb, stride_qh, stride_qm, stride_qd,
                       stride_kb, stride_kh, stride_kn, stride_kd,
                       stride_vb, stride_vh, stride_vn, stride_vd,
                       stride_mb, stride_mh, stride_mm, stride_mn, stride_rb, stride_rh,
                       stride_docb, stride_doce, stride_kvvb, stride_spanb,
                       stride_dob, stride_doh, stride_dom, stride_dod,
                       stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                       stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                       H, HKV, G, S, SKV, OFF, window, sc_mul, out_mul, scaling,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
                       IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
                       DO_DK: tl.constexpr, DO_DV: tl.constexpr, MASK_RANGES: tl.constexpr,
                       BLOCK_MAJOR: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr,
                       INT64: tl.constexpr, USE_DESC: tl.constexpr, ROWS: tl.constexpr):
        # DO_DK / DO_DV: at head_dim 256 holding K, V and both fp32 accumulators [BLOCK_N, 256] spills
        # registers; the launcher can split dK and dV into two launches (one extra q.k^T recompute).
        pid_n, bhk = grid_ids(BLOCK_MAJOR, False)
        b = bhk // HKV
        if ROWS != 0:  # one of a pair of launches (launching.ROW_PAIRS)
            if row_skipped(KVSPAN + b * stride_spanb, SKV, ROWS):
                return
        hk = bhk % HKV
        start_n = pid_n * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        if INT64:
            b, hk = b.to(tl.int64), hk.to(tl.int64)
            offs_n, offs_m0 = offs_n.to(tl.int64), offs_m0.to(tl.int64)
        DST = DOCS + b * stride_docb  # document starts (element masks: key in the query's document)
        DEN = DST + stride_doce  # document ends (the query range of a key block)
        KVV = KVVEC + b * stride_kvvb
        offs_d = tl.arange(0, BLOCK_D)
        D_MASK: tl.constexpr = HEAD_DIM if BLOCK_D != HEAD_DIM else 0
        kv_mask = offs_n[:, None] < SKV
        if D_MASK:
            kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        if DO_DK:
            v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn
                        + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        else:
            v = k  # unused
        if DO_DK:
            dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        else:
            dk = tl.zeros([1, 1], tl.float32)
        if DO_DV:
            dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        else:
            dv = tl.zeros([1, 1], tl.float32)
        MID_MASK: tl.constexpr = 0 if MASK_RANGES else MASK_KIND
        # key padding flags are read only where this key block may hold padding (a span edge or a hole)
        kv_check = key_block_needs_flags(start_n, KVSPAN + b * stride_spanb, BLOCK_N) if HAS_KVV else 0
        for g in range(G):  # the query heads sharing this kv head: GQA gradients summed in registers
            h = hk * G + g
            lo, b_, c_, hi = _dkdv_query_ranges(RNG, b, h, pid_n, stride_rb, stride_rh, start_n, S, SKV, OFF,
                                                window, DEN, KVSPAN + b * stride_spanb, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                                HAS_WINDOW, HAS_DOCS, MASK_RANGES, HAS_KVV)
            Q_blk = Q + b * stride_qb + h * stride_qh + offs_d[None, :] * stride_qd
            DO_blk = DO + b * stride_dob + h * stride_doh + offs_d[None, :] * stride_dod
            M_blk = M + b * stride_mb + h * stride_mh + offs_n[:, None] * stride_mn
            LSE_h = LSE + (b * H + h) * S
            DELTA_h = DELTA + (b * H + h) * S
            # [lo, b) boundary | [b, c) interior | [c, hi) boundary
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_blk, DO_blk, Q_DESC, DO_DESC, b, h, M_blk, LSE_h, DELTA_h,
                                     offs_n, offs_m0, offs_d, lo, b_, stride_qm, stride_dom, stride_mm, S, SKV, OFF,
                                     window, sc_mul, out_mul, DST, KVV, kv_check, BLOCK_M, D_MASK, SOFTCAP, MASK_KIND,
                                     IS_CAUSAL, HAS_WINDOW, True, DOT_FP32, DO_DK, DO_DV, HAS_DOCS, HAS_KVV,
                                     USE_DESC, BLOCK_D)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_blk, DO_blk, Q_DESC, DO_DESC, b, h, M_blk, LSE_h, DELTA_h,
                                     offs_n, offs_m0, offs_d, b_, c_, stride_qm, stride_dom, stride_mm, S, SKV, OFF,
                                     window, sc_mul, out_mul, DST, KVV, kv_check, BLOCK_M, D_MASK, SOFTCAP, MID_MASK,
                                     IS_CAUSAL, HAS_WINDOW, False, DOT_FP32, DO_DK, DO_DV, HAS_DOCS, HAS_KVV,
                                     USE_DESC, BLOCK_D)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_blk, DO_blk, Q_DESC, DO_DESC, b, h, M_blk, LSE_h, DELTA_h,
                                     offs_n, offs_m0, offs_d, c_, hi, stride_qm, stride_dom, stride_mm, S, SKV, OFF,
                                     window, sc_mul, out_mul, DST, KVV, kv_check, BLOCK_M, D_MASK, SOFTCAP, MASK_KIND,
                                     IS_CAUSAL, HAS_WINDOW, True, DOT_FP32, DO_DK, DO_DV, HAS_DOCS, HAS_KVV,
                                     USE_DESC, BLOCK_D)
        if DO_DK:
            dk = dk * scaling
            tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn
                     + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=kv_mask)
        if DO_DV:
            tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvn
                     + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _bwd_dq_inner(dq, q, do, lse2, Di, K_blk, V_blk, K_DESC, V_DESC, b, hk, M_blk, offs_m, offs_n0, offs_d, lo,
                      hi, stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV, kv_holes,
                      BLOCK_N: tl.constexpr, D_MASK: tl.constexpr, SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
                      IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BOUNDARY: tl.constexpr,
                      DOT_FP32: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr,
                      USE_DESC: tl.constexpr, BLOCK_D: tl.constexpr):
        kv_check = 1 if BOUNDARY else kv_holes  # as in the forward's loops
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            if USE_DESC:  # the copy engine, as in the forward (launching.DQ_TMA): keys past SKV read as 0
                k = K_DESC.load([tl.cast(b, tl.int32), tl.cast(hk, tl.int32), tl.cast(start_n, tl.int32),
                                 0]).reshape(BLOCK_N, BLOCK_D)
                v = V_DESC.load([tl.cast(b, tl.int32), tl.cast(hk, tl.int32), tl.cast(start_n, tl.int32),
                                 0]).reshape(BLOCK_N, BLOCK_D)
            else:
                if BOUNDARY:
                    kv_mask = offs_n[:, None] < SKV
                    if D_MASK:
                        kv_mask = kv_mask & (offs_d[None, :] < D_MASK)
                else:
                    if D_MASK:
                        kv_mask = offs_d[None, :] < D_MASK
                    else:
                        kv_mask = None
                k = load_tile(K_blk + offs_n[:, None] * stride_kn, kv_mask)
                v = load_tile(V_blk + offs_n[:, None] * stride_vn, kv_mask)
            qk = dot(q, tl.trans(k), DOT_FP32)
            s2, t = masked_scores(qk, sc_mul, out_mul, M_blk + offs_n[None, :] * stride_mn, offs_m[:, None],
                                  offs_n[None, :], S, SKV, OFF, window, DST, KVV, kv_check, SOFTCAP, MASK_KIND,
                                  IS_CAUSAL, HAS_WINDOW, BOUNDARY, HAS_DOCS, HAS_KVV, 0, 0, False)
            p = tl.exp2(s2 - lse2[:, None])
            dp = dot(do, tl.trans(v), DOT_FP32)
            ds = p * (dp - Di[:, None])
            if SOFTCAP:
                ds = ds * (1.0 - t * t)
            dq = dot_acc(ds.to(k.dtype), k, dq, DOT_FP32)
        return dq

    @triton.jit(do_not_specialize=_LENGTHS_ATTN_BWD_DQ)
    def _attn_bwd_dq(Q, K, V, M, RNG, DOCS, KVVEC, KVSPAN, DO, LSE, DELTA, DQ, K_DESC, V_DESC,
                     stride_qb, stride_qh, stride_qm, stride_qd,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd,
                     stride_mb, stride_mh, stride_mm, stride_mn, stride_rb, stride_rh,
                     stride_docb, stride_doce, stride_kvvb, stride_spanb,
                     stride_dob, stride_doh, stride_dom, stride_dod,
                     stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                     H, G, S, SKV, OFF, window, sc_mul, out_mul, scaling,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, MASK_RANGES: tl.constexpr,
                     BLOCK_MAJOR: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr,
                     INT64: tl.constexpr, ROWS: tl.constexpr, USE_DESC: tl.constexpr):
        # USE_DESC: K / V tiles by tensor descriptor in the boundary loops (1) or in every loop (2); 0 pointer tiles
        pid_m, bh = grid_ids(BLOCK_MAJOR, True)
        b = bh // H
        if ROWS != 0:  # one of a pair of launches (launching.ROW_PAIRS)
            if row_skipped(KVSPAN + b * stride_spanb, SKV, ROWS):
                return
        h = bh % H
        hk = h // G
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        if INT64:
            b, h, hk, bh = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64), bh.to(tl.int64)
            offs_m, offs_n0 = offs_m.to(tl.int64), offs_n0.to(tl.int64)
        DST = DOCS + b * stride_docb
        KVV = KVVEC + b * stride_kvvb
        offs_d = tl.arange(0, BLOCK_D)
        D_MASK: tl.constexpr = HEAD_DIM if BLOCK_D != HEAD_DIM else 0
        q_mask = offs_m[:, None] < S
        if D_MASK:
            q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=q_mask, other=0.0)
        do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                     + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
        lse2 = tl.load(LSE + bh * S + offs_m, mask=offs_m < S, other=float("inf")) * 1.4426950408889634
        Di = tl.load(DELTA + bh * S + offs_m, mask=offs_m < S, other=0.0)
        K_blk = K + b * stride_kb + hk * stride_kh + offs_d[None, :] * stride_kd
        V_blk = V + b * stride_vb + hk * stride_vh + offs_d[None, :] * stride_vd
        M_blk = M + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mm
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        MID_MASK: tl.constexpr = 0 if MASK_RANGES else MASK_KIND
        KVS = KVSPAN + b * stride_spanb
        kv_holes = tl.load(KVS + 2) if HAS_KVV else 0
        lo, b_, c_, hi = q_block_key_ranges_of(RNG + b * stride_rb + h * stride_rh + pid_m * 4, start_m, S, SKV,
                                               OFF, window, DST, KVS, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW,
                                               MASK_RANGES, HAS_DOCS, HAS_KVV)
        dq = _bwd_dq_inner(dq, q, do, lse2, Di, K_blk, V_blk, K_DESC, V_DESC, b, hk, M_blk, offs_m, offs_n0,
                           offs_d, lo, b_, stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul,
                           out_mul, DST, KVV, kv_holes, BLOCK_N, D_MASK, SOFTCAP, MASK_KIND, IS_CAUSAL,
                           HAS_WINDOW, True, DOT_FP32, HAS_DOCS, HAS_KVV, USE_DESC >= 1, BLOCK_D)
        dq = _bwd_dq_inner(dq, q, do, lse2, Di, K_blk, V_blk, K_DESC, V_DESC, b, hk, M_blk, offs_m, offs_n0,
                           offs_d, b_, c_, stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul,
                           out_mul, DST, KVV, kv_holes, BLOCK_N, D_MASK, SOFTCAP, MID_MASK, IS_CAUSAL,
                           HAS_WINDOW, False, DOT_FP32, HAS_DOCS, HAS_KVV, USE_DESC == 2, BLOCK_D)
        dq = _bwd_dq_inner(dq, q, do, lse2, Di, K_blk, V_blk, K_DESC, V_DESC, b, hk, M_blk, offs_m, offs_n0,
                           offs_d, c_, hi, stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul,
                           out_mul, DST, KVV, kv_holes, BLOCK_N, D_MASK, SOFTCAP, MASK_KIND, IS_CAUSAL,
                           HAS_WINDOW, True, DOT_FP32, HAS_DOCS, HAS_KVV, USE_DESC >= 1, BLOCK_D)
        dq = dq * scaling
        tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
                 dq.to(DQ.dtype.element_ty), mask=q_mask)

    # -------------------------------------------------- fully masked rows, MASKED_ROWS_UNIFORM (see docstring)
    @triton.jit(do_not_specialize=_LENGTHS_ATTN_BWD_DEAD_DQ)
    def _attn_bwd_dead_dq(Q, K, V, DO, LSE, DELTA, DQ, FLAGS,
                          stride_qb, stride_qh, stride_qm, stride_qd,
                          stride_kb, stride_kh, stride_kn, stride_kd,
                          stride_vb, stride_vh, stride_vn, stride_vd,
                          stride_dob, stride_doh, stride_dom, stride_dod,
                          stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                          H, G, S, SKV, NQB, sc_mul, scaling, inv_skv,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr):
        """dq += the fully masked rows' share: p = 1/Skv on every key, ds = p (dO.v - D) dsoftcap. Also writes
        FLAGS[bh, q block] = 1 where the block has such a row (the dK/dV kernel visits only those). A block
        without one returns after reading its lse."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        hk = h // G
        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        lse = tl.load(LSE + bh * S + offs_m, mask=offs_m < S, other=0.0)
        dead = (lse == float("inf")) & (offs_m < S)
        n_dead = tl.sum(dead.to(tl.int32), 0)
        tl.store(FLAGS + bh * NQB + pid_m, (n_dead > 0).to(tl.int8))
        if n_dead > 0:
            q_mask = (offs_m[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
            q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                        + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
            do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                         + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
            Di = tl.load(DELTA + bh * S + offs_m, mask=offs_m < S, other=0.0)
            pd = tl.where(dead, inv_skv, 0.0)
            dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for start_n in range(0, SKV, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N).to(tl.int64)
                kv_mask = (offs_n[:, None] < SKV) & (offs_d[None, :] < HEAD_DIM)
                k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn
                            + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
                v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn
                            + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
                dp = dot(do, tl.trans(v), DOT_FP32)
                ds = pd[:, None] * (dp - Di[:, None])
                if SOFTCAP:
                    t = tanh_exp2(dot(q, tl.trans(k), DOT_FP32) * sc_mul)
                    ds = ds * (1.0 - t * t)
                ds = tl.where(offs_n[None, :] < SKV, ds, 0.0)
                dq = dot_acc(ds.to(k.dtype), k, dq, DOT_FP32)
            ptrs = DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
            st = dead[:, None] & q_mask
            old = tl.load(ptrs, mask=st, other=0.0).to(tl.float32)
            tl.store(ptrs, (old + dq * scaling).to(DQ.dtype.element_ty), mask=st)

    @triton.jit(do_not_specialize=_LENGTHS_ATTN_BWD_DEAD_DKDV)
    def _attn_bwd_dead_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, FLAGS,
                            stride_qb, stride_qh, stride_qm, stride_qd,
                            stride_kb, stride_kh, stride_kn, stride_kd,
                            stride_vb, stride_vh, stride_vn, stride_vd,
                            stride_dob, stride_doh, stride_dom, stride_dod,
                            stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                            stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                            H, HKV, G, S, SKV, NQB, sc_mul, scaling, inv_skv,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr):
        """dk, dv += the fully masked rows' share for keys [start_n, start_n + BLOCK_N), over the q blocks
        FLAGS marks (all query heads of this kv head)."""
        pid_n = tl.program_id(0)
        bhk = tl.program_id(1).to(tl.int64)
        b = bhk // HKV
        hk = bhk % HKV
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        kv_mask = (offs_n[:, None] < SKV) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        any_ = 0
        for g in range(G):
            h = hk * G + g
            bh = b * H + h
            for qb in range(NQB):
                fl = tl.load(FLAGS + bh * NQB + qb).to(tl.int32)
                any_ = tl.maximum(any_, fl)
                if fl != 0:
                    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
                    q_mask = (offs_m[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
                    lse = tl.load(LSE + bh * S + offs_m, mask=offs_m < S, other=0.0)
                    dead = (lse == float("inf")) & (offs_m < S)
                    pd = tl.where(dead, inv_skv, 0.0)
                    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                                + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
                    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                                 + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
                    Di = tl.load(DELTA + bh * S + offs_m, mask=offs_m < S, other=0.0)
                    pT = tl.where(offs_n[:, None] < SKV, pd[None, :], 0.0)  # [BLOCK_N, BLOCK_M]
                    dv += dot(pT.to(do.dtype), do, DOT_FP32)
                    dpT = dot(v, tl.trans(do), DOT_FP32)
                    dsT = pT * (dpT - Di[None, :])
                    if SOFTCAP:
                        t = tanh_exp2(dot(k, tl.trans(q), DOT_FP32) * sc_mul)
                        dsT = dsT * (1.0 - t * t)
                    dk += dot(dsT.to(q.dtype), q, DOT_FP32)
        if any_ != 0:
            kp = DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
            vp = DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
            old_k = tl.load(kp, mask=kv_mask, other=0.0).to(tl.float32)
            tl.store(kp, (old_k + dk * scaling).to(DK.dtype.element_ty), mask=kv_mask)
            old_v = tl.load(vp, mask=kv_mask, other=0.0).to(tl.float32)
            tl.store(vp, (old_v + dv).to(DV.dtype.element_ty), mask=kv_mask)


def _dead_rows_bwd_triton(do, q, k, v, lse, delta, dq, dk, dv, scaling, softcap, BLOCK_D, dot32):
    """MASKED_ROWS_UNIFORM: add the fully masked rows' gradients (two launches; near-free without such rows)."""
    B, Hq, S, Dh = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if interpreting():
        BM = BN = 16
    else:
        BM = BN = 32 if BLOCK_D > 128 else 64
    NQB = triton.cdiv(S, BM)
    flags = torch.empty(B * Hq * NQB, dtype=torch.int8, device=q.device)
    sc_mul = (scaling / softcap) if softcap else 1.0
    common = dict(HEAD_DIM=Dh, BLOCK_D=BLOCK_D, BLOCK_M=BM, BLOCK_N=BN, SOFTCAP=bool(softcap), DOT_FP32=dot32,
                  num_warps=4, num_stages=1)
    _attn_bwd_dead_dq[(NQB, B * Hq)](q, k, v, do, lse, delta, dq, flags, *q.stride(), *k.stride(), *v.stride(),
                                     *do.stride(), *dq.stride(), Hq, G, S, Skv, NQB, sc_mul, float(scaling),
                                     1.0 / Skv, **common)
    _attn_bwd_dead_dkdv[(triton.cdiv(Skv, BN), B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, flags, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(),
        *dv.stride(), Hq, Hkv, G, S, Skv, NQB, sc_mul, float(scaling), 1.0 / Skv, **common)


# Replays of the three launches by call signature (fxfuse.kernels.launch_cache), and the q / dO (dK/dV kernel) and
# K / V (dQ kernel) tile descriptors each replay rebuilds over its own tensors (templates without a tensor; None
# where the pointer path ran).
_PLANS = PlanCache()
_DESCRIPTORS = {}


def _descriptor_template(d):
    return None if d is None else rebase_descriptor(d, None)


def attention_bwd_triton(do, q, k, v, mask, out, lse, scaling, softcap, causal, window, config=None,
                         masked_rows=MASKED_ROWS_ZERO, doc_ranges=None, key_valid=None):
    """Launch the three backward kernels. Returns contiguous (dq, dk, dv) in the inputs' dtypes."""
    B, Hq, S, Dh = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    plan = plan_key("bwd", q, k, v, mask, config, scaling, softcap, causal, window, masked_rows, doc_ranges,
                    key_valid, do.shape, do.stride(), out.shape, out.stride(), lse.shape, lse.stride())
    delta = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    dq = torch.empty(B, Hq, S, Dh, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, Skv, Dh, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, Hkv, Skv, Dh, dtype=v.dtype, device=q.device)
    docs, kvv, span = recipe_tensors(doc_ranges, key_valid, lse)
    mt, ms, kind = mask_args(mask, B, Hq, S, Skv, q)
    mask_role = (mt,) if mask is not None else ()
    templates = _DESCRIPTORS.get(plan)
    if templates is not None:
        rebased = [None if t is None else rebase_descriptor(t, x) for t, x in zip(templates, (q, do, k, v))]
        roles = (q, k, v, do, out, lse, delta, dq, dk, dv, docs, kvv, span, *rebased, *mask_role)
        replay = _PLANS.lookup(plan, roles)
        if replay is not None and replay(roles, q.device.index):
            return nan_grads_of_dead_rows(dq, dk, dv, lse, G, masked_rows)

    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    dot32 = interpreting() or q.dtype == torch.float32
    rec = Recorder()
    PRE_M = 16 if interpreting() else 64
    rec.launch(_attn_bwd_pre, (triton.cdiv(S, PRE_M), B * Hq), (out, do, delta, *out.stride(), *do.stride(), Hq, S),
               dict(HEAD_DIM=Dh, BLOCK_D=BLOCK_D, BLOCK_M=PRE_M))
    sc_mul, out_mul = score_scalars(scaling, softcap)
    common = dict(HEAD_DIM=Dh, BLOCK_D=BLOCK_D, SOFTCAP=softcap_mode(softcap, q.dtype), MASK_KIND=kind,
                  IS_CAUSAL=bool(causal),
                  HAS_WINDOW=bool(window), DOT_FP32=dot32)
    ranges = use_mask_ranges(kind, causal, window)
    _, sdb, sde, _, skb, _, ssb, has_docs, has_kvv = recipe_args(doc_ranges, key_valid, lse, (docs, kvv, span))
    key = (BLOCK_D, q.dtype, kind, bool(window), ranges, has_docs, has_kvv)
    common["MASK_RANGES"] = ranges
    common["BLOCK_MAJOR"] = launching.BLOCK_MAJOR_GRID
    common.update(HAS_DOCS=has_docs,
                  INT64=needs_int64(q, k, v, do, dq, dk, dv, expand_mask(mask, B, Hq, S, Skv)))
    descs = [None, None, None, None]  # the dK/dV kernel's q / dO tiles, the dQ kernel's K / V tiles

    def launch_dkdv(c):
        BM, BN, nw, ns, *split = c
        # split (5th config field): dK and dV in two launches, each holding one fp32 accumulator
        passes = [(True, False), (False, True)] if split and split[0] else [(True, True)]
        # rows = key blocks, columns = query blocks: the transposed mask's ranges
        # q / dO tiles through the copy engine where it can address them (no bounds masks, no pointer tiles)
        q_desc, do_desc = tile_descriptor(q, [1, 1, BM, BLOCK_D]), tile_descriptor(do, [1, 1, BM, BLOCK_D])
        use_desc = q_desc is not None and do_desc is not None
        descs[:2] = [q_desc, do_desc] if use_desc else [None, None]
        with rec.attempt():
            rng, rs = (mask_block_ranges_of(mt, ms, kind, B, Hq, Skv, S, BN, BM, transpose=True, rec=rec)
                       if ranges else (lse, (0, 0)))
            for (do_dk, do_dv), (rows, flags) in itertools.product(passes, row_launches(has_kvv)):
                rec.launch(_attn_bwd_dkdv, grid(triton.cdiv(Skv, BN), B * Hkv), (
                    q, k, v, mt, rng, docs, kvv, span, do, lse, delta, dk, dv, descs[0], descs[1],
                    *q.stride(), *k.stride(), *v.stride(), *ms,
                    *rs, sdb, sde, skb, ssb, *do.stride(), *dk.stride(), *dv.stride(), Hq, Hkv, G, S, Skv, Skv - S,
                    int(window or 0), sc_mul, out_mul, float(scaling)), dict(
                    BLOCK_M=BM, BLOCK_N=BN, num_warps=nw, num_stages=ns, DO_DK=do_dk,
                    DO_DV=do_dv, USE_DESC=use_desc, HAS_KVV=flags, ROWS=rows, **common))

    def launch_dq(c):
        BM, BN, nw, ns = c[:4]
        # K / V tiles through the copy engine where it can address them (launching.DQ_TMA), for the tiles whose
        # descriptor variant has been checked on the GPU (launching.DQ_TMA_CHECKED)
        variant = (key, common["SOFTCAP"], bool(causal), common["INT64"], tuple(c))
        launching.launch_kv_tiles("dq", variant, launching.dq_tma_mode(c, has_docs), BLOCK_D, BN, k, v,
                                  lambda mode, kd, vd: launch_dq_tiles(c, mode, kd, vd),
                                  f"head dim {Dh}, tile {tuple(c)}")

    def launch_dq_tiles(c, tma, kd, vd):
        BM, BN, nw, ns = c[:4]
        descs[2:] = [kd, vd] if tma else [None, None]
        with rec.attempt():
            rng, rs = (mask_block_ranges_of(mt, ms, kind, B, Hq, S, Skv, BM, BN, rec=rec) if ranges
                       else (lse, (0, 0)))
            for rows, flags in row_launches(has_kvv):
                rec.launch(_attn_bwd_dq, grid(triton.cdiv(S, BM), B * Hq), (
                    q, k, v, mt, rng, docs, kvv, span, do, lse, delta, dq, descs[2], descs[3], *q.stride(),
                    *k.stride(), *v.stride(),
                    *ms, *rs, sdb, sde, skb, ssb, *do.stride(),
                    *dq.stride(), Hq, G, S, Skv, Skv - S, int(window or 0), sc_mul, out_mul, float(scaling)), dict(
                    BLOCK_M=BM, BLOCK_N=BN, num_warps=nw, num_stages=ns, HAS_KVV=flags, ROWS=rows,
                    USE_DESC=tma, **common))

    launch_with_fallbacks("dkdv", _attn_bwd_dkdv, None, config_for("dkdv", BLOCK_D, q.dtype, config, docs=has_docs),
                          key, launch_dkdv)
    launch_with_fallbacks("dq", _attn_bwd_dq, None, config_for("dq", BLOCK_D, q.dtype, config, docs=has_docs), key,
                          launch_dq)
    if masked_rows == MASKED_ROWS_UNIFORM:
        _dead_rows_bwd_triton(do, q, k, v, lse, delta, dq, dk, dv, scaling, softcap, BLOCK_D, dot32)
    elif plan is not None:
        if len(_DESCRIPTORS) >= _PLANS.max_entries:
            _DESCRIPTORS.clear()
        _DESCRIPTORS[plan] = tuple(_descriptor_template(d) for d in descs)
        _PLANS.store(plan, (q, k, v, do, out, lse, delta, dq, dk, dv, docs, kvv, span, *descs, *mask_role), rec)
    return nan_grads_of_dead_rows(dq, dk, dv, lse, G, masked_rows)
