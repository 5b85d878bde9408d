"""The forward kernel ``_attn_fwd`` and its launcher :func:`attention_fwd_triton` (FA2 structure).

One program per (q block, b, q head), GQA by reading the q head's kv head (``h // G``: repeat_kv is never
materialised); online softmax over the key blocks of the q block's range (:mod:`.block_map`) in three loops,
[masked | unmasked | masked]: the index masks (causal, window, sequence end, documents) are evaluated only on the
boundary blocks, blocks that they remove entirely are never visited, and a mask tensor's FULL blocks are not read.

Memory: the forward saves ``lse`` [B, Hq, S] fp32 (natural log; +inf marks a fully masked row so that the
backward's exp(s - lse) is exactly 0 there); nothing of size S x Skv is ever stored. Fully masked rows get what
``masked_rows`` says (:mod:`.reference`) in the epilogue.
"""
from __future__ import annotations

import torch

from fxfuse.kernels.launch_cache import PlanCache, Recorder, rebase_descriptor
from fxfuse.kernels.triton_support import HAVE_TRITON, interpreting, tl, triton

from . import launching
from .block_map import mask_block_ranges_of, q_block_key_ranges_of, row_skipped, use_mask_ranges
from .conventions import MASKED_ROWS_UNIFORM, MASKED_ROWS_ZERO
from .launching import (MASK_LENGTHS, config_for, grid, grid_ids, launch_with_fallbacks, mask_args, needs_int64,
                        plan_key, recipe_args, recipe_tensors, row_launches, score_scalars, softcap_mode)
from .reference import expand_mask, value_mean
from .scores import dot, dot_acc, load_tile, masked_scores, row_key_bounds

__all__ = ["attention_fwd_triton"]

# The lengths and the mask / recipe strides are not specialised (see launching.MASK_LENGTHS).
_LENGTHS_ATTN_FWD = MASK_LENGTHS + ['S', 'SKV', 'OFF']


if HAVE_TRITON:

    @triton.jit
    def _fwd_inner(acc, l_i, m_i, q, K_blk, V_blk, K_DESC, V_DESC, b, hk, M_blk, offs_m, offs_n0, offs_d, lo,
                   hi, stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV, kv_holes,
                   BLOCK_N: tl.constexpr, D_MASK: tl.constexpr, SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BOUNDARY: tl.constexpr,
                   DOT_FP32: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr, ROW_BOUNDS: tl.constexpr,
                   USE_DESC: tl.constexpr, BLOCK_D: tl.constexpr):
        # interior tiles lie inside the row's valid-key span: key padding is read there only if it has holes
        kv_check = 1 if BOUNDARY else kv_holes
        if BOUNDARY and ROW_BOUNDS:  # each query's key range, once for all its key blocks
            klo, khi = row_key_bounds(offs_m[:, None], S, SKV, OFF, window, DST, IS_CAUSAL, HAS_WINDOW, HAS_DOCS)
        else:
            klo, khi = 0, 0
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            if USE_DESC:
                # the copy engine: keys past SKV and head-dim padding read as 0 (no bounds mask); coordinates are
                # 32-bit (each < 2^31 even where the INT64 variant runs; the engine addresses the rest)
                k = K_DESC.load([tl.cast(b, tl.int32), tl.cast(hk, tl.int32), tl.cast(start_n, tl.int32),
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
            qk = dot(q, tl.trans(k), DOT_FP32)
            s2, t = masked_scores(qk, sc_mul, out_mul, M_blk + offs_n[None, :] * stride_mn, offs_m[:, None],
                                  offs_n[None, :], S, SKV, OFF, window, DST, KVV, kv_check, SOFTCAP, MASK_KIND,
                                  IS_CAUSAL, HAS_WINDOW, BOUNDARY, HAS_DOCS, HAS_KVV, klo, khi, ROW_BOUNDS)
            m_new = tl.maximum(m_i, tl.max(s2, 1))
            if BOUNDARY or MASK_KIND != 0 or HAS_KVV:
                # a row with nothing kept so far has m = -inf: subtract 0 instead (exp2(-inf - 0) = 0, no NaN)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:  # an interior tile keeps every score: m_new is finite
                m_use = m_new
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s2 - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if USE_DESC:
                v = V_DESC.load([tl.cast(b, tl.int32), tl.cast(hk, tl.int32), tl.cast(start_n, tl.int32),
                                 0]).reshape(BLOCK_N, BLOCK_D)
            else:
                v = load_tile(V_blk + offs_n[:, None] * stride_vn, kv_mask)
            acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], DOT_FP32)  # eager: p.to(q.dtype) @ v
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit(do_not_specialize=_LENGTHS_ATTN_FWD)
    def _attn_fwd(Q, K, V, M, RNG, DOCS, KVVEC, KVSPAN, O, LSE, VMEAN, K_DESC, V_DESC,
                  stride_qb, stride_qh, stride_qm, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  stride_mb, stride_mh, stride_mm, stride_mn, stride_rb, stride_rh,
                  stride_docb, stride_doce, stride_kvvb, stride_spanb,
                  stride_ob, stride_oh, stride_om, stride_od,
                  H, G, S, SKV, OFF, window, sc_mul, out_mul,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, MASK_RANGES: tl.constexpr,
                  BLOCK_MAJOR: tl.constexpr, MASKED_ROWS: tl.constexpr, HAS_DOCS: tl.constexpr,
                  HAS_KVV: tl.constexpr, INT64: tl.constexpr, ROWS: tl.constexpr, ROW_BOUNDS: tl.constexpr,
                  USE_DESC: tl.constexpr):
        # USE_DESC: K / V tiles by tensor descriptor in the boundary loops (1) or in every loop (2); 0 pointer tiles
        pid_m, bh = grid_ids(BLOCK_MAJOR, True)
        b = bh // H
        if ROWS != 0:  # one of a pair of launches: rows whose keys are all valid / the others (block_map)
            if row_skipped(KVSPAN + b * stride_spanb, SKV, ROWS):
                return
        h = bh % H
        hk = h // G  # GQA: this q head's kv head
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        if INT64:  # some tensor's offsets pass 2^31 (a long mask, a long HF-strided q): 64-bit address math
            b, h, hk, bh = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64), bh.to(tl.int64)
            offs_m, offs_n0 = offs_m.to(tl.int64), offs_n0.to(tl.int64)
        DST = DOCS + b * stride_docb  # this row's document starts (HAS_DOCS)
        KVV = KVVEC + b * stride_kvvb  # this row's key-valid flags (HAS_KVV)
        offs_d = tl.arange(0, BLOCK_D)
        D_MASK: tl.constexpr = HEAD_DIM if BLOCK_D != HEAD_DIM else 0

        q_mask = offs_m[:, None] < S
        if D_MASK:
            q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=q_mask, other=0.0)
        K_blk = K + b * stride_kb + hk * stride_kh + offs_d[None, :] * stride_kd
        V_blk = V + b * stride_vb + hk * stride_vh + offs_d[None, :] * stride_vd
        M_blk = M + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mm

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # MASK_RANGES: the FULL middle [b_, c_) of the mask tensor's ranges needs no mask reads
        MID_MASK: tl.constexpr = 0 if MASK_RANGES else MASK_KIND
        KVS = KVSPAN + b * stride_spanb  # this row's valid-key span (first, end, holes) (HAS_KVV)
        kv_holes = tl.load(KVS + 2) if HAS_KVV else 0
        lo, b_, c_, hi = q_block_key_ranges_of(RNG + b * stride_rb + h * stride_rh + pid_m * 4, start_m, S, SKV,
                                               OFF, window, DST, KVS, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW,
                                               MASK_RANGES, HAS_DOCS, HAS_KVV)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_blk, V_blk, K_DESC, V_DESC, b, hk, M_blk, offs_m,
                                   offs_n0, offs_d, lo, b_, stride_kn, stride_vn, stride_mn, S, SKV,
                                   OFF, window, sc_mul, out_mul, DST, KVV, kv_holes, BLOCK_N, D_MASK,
                                   SOFTCAP, MASK_KIND, IS_CAUSAL, HAS_WINDOW, True, DOT_FP32, HAS_DOCS,
                                   HAS_KVV, ROW_BOUNDS, USE_DESC >= 1, BLOCK_D)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_blk, V_blk, K_DESC, V_DESC, b, hk, M_blk, offs_m,
                                   offs_n0, offs_d, b_, c_, stride_kn, stride_vn, stride_mn, S, SKV,
                                   OFF, window, sc_mul, out_mul, DST, KVV, kv_holes, BLOCK_N, D_MASK,
                                   SOFTCAP, MID_MASK, IS_CAUSAL, HAS_WINDOW, False, DOT_FP32, HAS_DOCS,
                                   HAS_KVV, ROW_BOUNDS, USE_DESC == 2, BLOCK_D)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_blk, V_blk, K_DESC, V_DESC, b, hk, M_blk, offs_m,
                                   offs_n0, offs_d, c_, hi, stride_kn, stride_vn, stride_mn, S, SKV,
                                   OFF, window, sc_mul, out_mul, DST, KVV, kv_holes, BLOCK_N, D_MASK,
                                   SOFTCAP, MASK_KIND, IS_CAUSAL, HAS_WINDOW, True, DOT_FP32, HAS_DOCS,
                                   HAS_KVV, ROW_BOUNDS, USE_DESC >= 1, BLOCK_D)
        dead = l_i == 0.0  # every key masked: lse = +inf (the backward's p = exp(s - inf) = 0 there)
        acc = acc / tl.where(dead, 1.0, l_i)[:, None]
        if MASKED_ROWS == 1:  # eager with a finite fill: uniform over all keys, mean_j v_j (VMEAN [B*Hq, Dh])
            vm = tl.load(VMEAN + bh * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
            acc = tl.where(dead[:, None], vm[None, :], acc)
        elif MASKED_ROWS == 2:  # eager with a -inf fill: softmax of an all -inf row is NaN
            acc = tl.where(dead[:, None], float("nan"), acc)
        lse = tl.where(dead, float("inf"), (m_i + tl.log2(tl.where(dead, 1.0, l_i))) * 0.6931471805599453)
        tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                 acc.to(O.dtype.element_ty), mask=q_mask)
        tl.store(LSE + bh * S + offs_m, lse, mask=offs_m < S)


# Replays of the launch by call signature (fxfuse.kernels.launch_cache): a call whose shapes, strides, dtypes and
# scalars were seen before skips this module's Python and Triton's binding and launches the recorded binary. The
# K / V tile descriptors are rebuilt over each call's own k and v from templates (None where pointer tiles ran).
_PLANS = PlanCache()
_DESCRIPTORS = {}


def attention_fwd_triton(q, k, v, mask, scaling, softcap, causal, window, config=None,
                         masked_rows=MASKED_ROWS_ZERO, doc_ranges=None, key_valid=None):
    """Launch ``_attn_fwd``. Returns (out contiguous [B, Hq, S, Dh], lse [B, Hq, S] fp32)."""
    B, Hq, S, Dh = q.shape
    key = plan_key("fwd", q, k, v, mask, config, scaling, softcap, causal, window, masked_rows, doc_ranges,
                   key_valid)
    out = torch.empty(B, Hq, S, Dh, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    docs, kvv, span = recipe_tensors(doc_ranges, key_valid, lse)
    Hkv, Skv = k.shape[1], k.shape[2]
    mt, ms, kind = mask_args(mask, B, Hq, S, Skv, q)
    mask_role = (mt,) if mask is not None else ()
    templates = _DESCRIPTORS.get(key)
    if templates is not None:
        descs = tuple(None if t is None else rebase_descriptor(t, x) for t, x in zip(templates, (k, v)))
        roles = (q, k, v, docs, kvv, span, out, lse, *descs, *mask_role)
        replay = _PLANS.lookup(key, roles)
        if replay is not None and replay(roles, q.device.index):
            return out, lse

    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    sc_mul, out_mul = score_scalars(scaling, softcap)

    ranges = use_mask_ranges(kind, causal, window)
    vmean = value_mean(v, Hq // Hkv).contiguous() if masked_rows == MASKED_ROWS_UNIFORM else lse
    _, sdb, sde, _, skb, _, ssb, has_docs, has_kvv = recipe_args(doc_ranges, key_valid, lse, (docs, kvv, span))
    cfg = config_for("fwd", BLOCK_D, q.dtype, config, docs=has_docs)
    int64 = needs_int64(q, k, v, out, expand_mask(mask, B, Hq, S, Skv))
    rec = Recorder()

    descs = [None, None]
    smode = softcap_mode(softcap, q.dtype)

    def launch(c):
        BM, BN, nw, ns = c[:4]
        # K / V tiles through the copy engine where it can address them (launching.FWD_TMA)
        variant = (BLOCK_D, q.dtype, kind, bool(causal), bool(window), ranges, has_docs, has_kvv, smode,
                   int(masked_rows), int64, tuple(c))
        launching.launch_kv_tiles("forward", variant, launching.FWD_TMA, BLOCK_D, BN, k, v,
                                  lambda mode, kd, vd: launch_tiles(c, mode, kd, vd), f"head dim {Dh}, tile {tuple(c)}")

    def launch_tiles(c, tma, kd, vd):
        BM, BN, nw, ns = c[:4]
        descs[:] = [kd, vd] if tma else [None, None]
        with rec.attempt():
            rng, rs = mask_block_ranges_of(mt, ms, kind, B, Hq, S, Skv, BM, BN, rec=rec) if ranges else (lse, (0, 0))
            for rows, flags in row_launches(has_kvv):
                rec.launch(_attn_fwd, grid(triton.cdiv(S, BM), B * Hq), (
                    q, k, v, mt, rng, docs, kvv, span, out, lse, vmean, descs[0], descs[1], *q.stride(), *k.stride(),
                    *v.stride(), *ms, *rs, sdb, sde, skb, ssb, *out.stride(),
                    Hq, Hq // Hkv, S, Skv, Skv - S, int(window or 0), sc_mul, out_mul), dict(
                    HEAD_DIM=Dh, BLOCK_D=BLOCK_D, BLOCK_M=BM, BLOCK_N=BN, SOFTCAP=smode, MASK_KIND=kind,
                    IS_CAUSAL=bool(causal), HAS_WINDOW=bool(window),
                    DOT_FP32=interpreting() or q.dtype == torch.float32, MASK_RANGES=ranges,
                    BLOCK_MAJOR=launching.BLOCK_MAJOR_GRID, MASKED_ROWS=int(masked_rows), HAS_DOCS=has_docs,
                    HAS_KVV=flags, INT64=int64, ROWS=rows, ROW_BOUNDS=launching.ROW_BOUNDS, USE_DESC=tma,
                    num_warps=nw, num_stages=ns))

    launch_with_fallbacks("fwd", _attn_fwd, None, cfg, (BLOCK_D, q.dtype, kind, bool(window), ranges, has_docs,
                                                         has_kvv), launch)
    if key is not None:
        if len(_DESCRIPTORS) >= _PLANS.max_entries:
            _DESCRIPTORS.clear()
        _DESCRIPTORS[key] = tuple(None if d is None else rebase_descriptor(d, None) for d in descs)
        _PLANS.store(key, (q, k, v, docs, kvv, span, out, lse, *descs, *mask_role), rec)
    return out, lse
