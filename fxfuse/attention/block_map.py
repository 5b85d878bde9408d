"""Which tiles each attention kernel visits (the "block map"): the key ranges of a query block and the query
ranges of a key block, from the index masks and the recipe's documents, or from a mask tensor's tile classes.

Every kernel walks one row block (queries in the forward and dQ kernels, keys in the dK/dV kernel) against its
column blocks split as [lo, b) partial | [b, c) full | [c, hi) partial: nothing outside [lo, hi) is visited, and
the masks are evaluated only outside [b, c). The ranges come

* from scalars, in-kernel: the causal / sliding-window bounds and, for packed documents (``doc_ranges``: contiguous
  runs, so document starts and ends are non-decreasing), the first and last row's document start or end
  (:func:`q_block_key_ranges_of` for the forward and dQ, :func:`kv_block_query_ranges` for dK/dV);
* from a mask *tensor* alone (no index mask: what a graph pass hands over when it cannot read the mask's recipe,
  since HF builds causal / window / padding into one tensor): ``_mask_tile_classes`` reads the mask once per kernel
  tiling and classifies every (row block, column block) tile as EMPTY (every entry masked), FULL (every entry
  neutral: 0.0 additive / True bool, and inside the sequence) or PARTIAL; ``_mask_block_ranges`` turns each row of
  classes into [lo, b) partial | [b, c) full | [c, hi) partial, nothing kept outside [lo, hi). The kernels visit
  only [lo, hi) and read the mask only outside [b, c), so a causal mask tensor costs what ``causal=True`` costs.
  Any mask stays correct: a block the ranges cannot prove FULL or EMPTY is computed with the mask.
  :func:`mask_block_ranges_of` launches the two; :func:`load_ranges` reads a row block's ranges in-kernel.

Key padding (``key_valid``) narrows either to each batch row's valid-key span (first valid key, last + 1;
:func:`.launching.key_span`): padding blocks at a row's ends are never visited.
"""
from __future__ import annotations

import torch

from fxfuse.kernels.triton_support import HAVE_TRITON, tl, triton

from .scores import MASKED_BELOW_C

__all__ = ["MASK_BLOCK_RANGES", "use_mask_ranges", "mask_block_ranges_of", "load_ranges", "q_block_key_ranges_of",
           "kv_block_query_ranges", "key_block_outside_span", "key_block_needs_flags"]

# The classifier's arguments that change with the sequence length are not specialised (see launching.MASK_LENGTHS).
_LENGTHS_MASK_TILE_CLASSES = ['stride_mb', 'stride_mh', 'stride_r', 'stride_c', 'R', 'C', 'NR', 'NC']


if HAVE_TRITON:

    # ------------------------------------------------------------------------ block ranges of a mask tensor
    @triton.jit(do_not_specialize=_LENGTHS_MASK_TILE_CLASSES)
    def _mask_tile_classes(M, CLS, stride_mb, stride_mh, stride_r, stride_c, R, C, NR, NC, HM,
                           BR: tl.constexpr, BC: tl.constexpr, MASK_KIND: tl.constexpr):
        """CLS[bh, r, c] = 0 EMPTY / 1 PARTIAL / 2 FULL for the [BR, BC] mask tile (r, c) of mask (b, h).
        Rows are queries and columns keys, or the transpose (strides swapped) for the dK/dV kernel. Out-of-range
        columns count as masked and make a tile non-FULL (a FULL tile is read without bounds checks); out-of-
        range rows do not matter (the kernels never store them)."""
        pc = tl.program_id(0)
        pr = tl.program_id(1)
        bh = tl.program_id(2)
        # 64-bit addresses: a [B, 1, S, S] mask passes 2^31 elements from S = 46,341 (memory-bound kernel: free)
        rows = pr.to(tl.int64) * BR + tl.arange(0, BR)
        cols = pc.to(tl.int64) * BC + tl.arange(0, BC)
        row_in = rows[:, None] < R
        inb = row_in & (cols[None, :] < C)
        bh64 = bh.to(tl.int64)
        ptrs = M + (bh64 // HM) * stride_mb + (bh64 % HM) * stride_mh + rows[:, None] * stride_r + cols[None, :] * stride_c
        if MASK_KIND == 1:
            mv = tl.load(ptrs, mask=inb, other=float("-inf")).to(tl.float32)
            kept = mv > MASKED_BELOW_C
            neutral = mv == 0.0
        else:
            keep = tl.load(ptrs, mask=inb, other=0)
            kept = keep != 0
            neutral = kept
        any_kept = tl.max(tl.where(kept & inb, 1, 0))
        all_neutral = tl.min(tl.where(neutral | (~row_in), 1, 0))
        cls = tl.where(any_kept == 0, 0, tl.where(all_neutral == 1, 2, 1))
        tl.store(CLS + (bh * NR + pr) * NC + pc, cls.to(tl.int8))

    @triton.jit(do_not_specialize=["NC"])
    def _mask_block_ranges(CLS, RANGES, NC, BLOCK: tl.constexpr):
        """One row of tile classes -> (lo, b, c, hi) in block units: nothing kept outside [lo, hi), [b, c) all
        FULL (the first run of FULL tiles; b = c = hi when there is none). The row is read in BLOCK-wide pieces
        (a fixed BLOCK: one compiled variant for every sequence length)."""
        row = tl.program_id(0)
        lo = NC
        hi = 0
        b = NC
        for start in range(0, NC, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            valid = idx < NC
            cls = tl.load(CLS + row * NC + idx, mask=valid, other=0).to(tl.int32)
            nonempty = cls != 0
            lo = tl.minimum(lo, tl.min(tl.where(nonempty, idx, NC)))
            hi = tl.maximum(hi, tl.max(tl.where(nonempty, idx + 1, 0)))
            b = tl.minimum(b, tl.min(tl.where(cls == 2, idx, NC)))
        c = NC
        for start in range(0, NC, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            valid = idx < NC
            cls = tl.load(CLS + row * NC + idx, mask=valid, other=0).to(tl.int32)
            c = tl.minimum(c, tl.min(tl.where(valid & (cls != 2) & (idx > b), idx, NC)))
        hi = tl.maximum(hi, lo)
        none_full = b >= NC
        b = tl.where(none_full, hi, b)
        c = tl.where(none_full, hi, tl.minimum(c, hi))
        tl.store(RANGES + row * 4, lo)
        tl.store(RANGES + row * 4 + 1, b)
        tl.store(RANGES + row * 4 + 2, c)
        tl.store(RANGES + row * 4 + 3, hi)

    @triton.jit
    def load_ranges(RNG, BLOCK: tl.constexpr):
        return (tl.load(RNG) * BLOCK, tl.load(RNG + 1) * BLOCK, tl.load(RNG + 2) * BLOCK,
                tl.load(RNG + 3) * BLOCK)

    @triton.jit
    def _q_block_key_ranges(start_m, S, SKV, OFF, window, DST, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
        """Key ranges for query rows [start_m, start_m + BLOCK_M): [lo, b) and [c, hi) need index masks,
        [b, c) is fully kept for every row (multiples of BLOCK_N); keys outside [lo, hi) are skipped."""
        lo = 0
        hi = SKV
        full_lo = 0
        full_hi = (SKV // BLOCK_N) * BLOCK_N
        if IS_CAUSAL:
            hi = tl.minimum(SKV, tl.maximum(0, start_m + BLOCK_M + OFF))
            full_hi = tl.minimum(full_hi, (tl.maximum(0, start_m + OFF + 1) // BLOCK_N) * BLOCK_N)
        if HAS_WINDOW:
            lo = (tl.maximum(0, start_m + OFF - window + 1) // BLOCK_N) * BLOCK_N
            full_lo = tl.cdiv(tl.maximum(0, start_m + BLOCK_M + OFF - window), BLOCK_N) * BLOCK_N
        if HAS_DOCS:
            # document starts are non-decreasing: the block's first row has the earliest start (nothing kept
            # before it), its last row the latest (every row keeps the keys from there to the causal edge)
            first = tl.load(DST + start_m).to(tl.int32)
            last = tl.load(DST + tl.minimum(start_m + BLOCK_M, S) - 1).to(tl.int32)
            lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)
            full_lo = tl.maximum(full_lo, tl.cdiv(last, BLOCK_N) * BLOCK_N)
        hi = tl.maximum(hi, lo)
        b = tl.minimum(tl.maximum(full_lo, lo), hi)
        c = tl.minimum(tl.maximum(full_hi, b), hi)
        return lo, b, c, hi

    @triton.jit
    def q_block_key_ranges_of(RNG_row, start_m, S, SKV, OFF, window, DST, KVS, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                              MASK_RANGES: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr):
        """The forward's and dQ's key ranges (lo, b, c, hi): from the mask tensor's tile classes (MASK_RANGES,
        ``RNG_row`` = this q block's row) or from the index masks; with key padding (HAS_KVV) cut to the row's
        valid-key span ``KVS`` = (first, end)."""
        if MASK_RANGES:
            lo, b, c, hi = load_ranges(RNG_row, BLOCK_N)
        else:
            lo, b, c, hi = _q_block_key_ranges(start_m, S, SKV, OFF, window, DST, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                               HAS_WINDOW, HAS_DOCS)
        if HAS_KVV:
            # keys outside [first, end) are padding: never visited. The tiles holding first and end - 1 go to the
            # boundary loops (which read the padding flags); interior tiles lie inside the span (flags read only
            # where the span has holes)
            first = tl.load(KVS)
            end = tl.load(KVS + 1)
            lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)
            hi = tl.maximum(tl.minimum(hi, end), lo)
            b = tl.minimum(tl.maximum(b, tl.maximum(lo, tl.cdiv(first, BLOCK_N) * BLOCK_N)), hi)
            c = tl.minimum(tl.maximum(tl.minimum(c, (end // BLOCK_N) * BLOCK_N), b), hi)
        return lo, b, c, hi

    @triton.jit
    def row_skipped(KVS, SKV, ROWS: tl.constexpr):
        """Whether this launch leaves this program's batch row to the other launch of its pair (ROWS 1: the
        launch without key flags, which takes the rows whose keys are all valid, ``KVS`` = (0, SKV, no holes);
        ROWS 2: the launch with them, which takes the other rows). Key flags cost registers the kernels spill at
        head dim 64 (~20% of a layer's attention): a packed row of real tokens never reads them."""
        full = (tl.load(KVS) == 0) & (tl.load(KVS + 1) == SKV) & (tl.load(KVS + 2) == 0)
        if ROWS == 1:
            return full == 0
        else:
            return full

    @triton.jit
    def key_block_outside_span(start_n, KVS, BLOCK_N: tl.constexpr):
        """True where keys [start_n, start_n + BLOCK_N) all lie outside the row's valid-key span (pure padding):
        no query attends them, their dK / dV are 0."""
        return (start_n >= tl.load(KVS + 1)) | (start_n + BLOCK_N <= tl.load(KVS))

    @triton.jit
    def key_block_needs_flags(start_n, KVS, BLOCK_N: tl.constexpr):
        """Whether keys [start_n, start_n + BLOCK_N) may hold padding: the block reaches past the span's edges or
        the span has holes."""
        return (tl.load(KVS + 2) != 0) | (start_n < tl.load(KVS)) | (start_n + BLOCK_N > tl.load(KVS + 1))

    @triton.jit
    def kv_block_query_ranges(start_n, S, SKV, OFF, window, DEN, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
        """Query-row ranges for keys [start_n, start_n + BLOCK_N): kept iff q >= k - OFF (causal) and
        q < k - OFF + window. [lo, b) and [c, hi) need index masks; [b, c) is fully kept and inside the
        sequence (multiples of BLOCK_M, c <= S rounded down), so the kernel loads its q / dO rows without bounds
        checks: the partial last block of rows is a boundary block."""
        lo = 0
        hi = S
        full_lo = 0
        full_hi = (S // BLOCK_M) * BLOCK_M
        if IS_CAUSAL:
            lo = (tl.maximum(0, start_n - OFF) // BLOCK_M) * BLOCK_M
            full_lo = tl.cdiv(tl.maximum(0, start_n + BLOCK_N - 1 - OFF), BLOCK_M) * BLOCK_M
        if HAS_WINDOW:
            hi = tl.minimum(S, tl.maximum(0, start_n + BLOCK_N - 1 - OFF + window))
            full_hi = tl.minimum(full_hi, (tl.maximum(0, start_n - OFF + window) // BLOCK_M) * BLOCK_M)
        if HAS_DOCS:
            # document ends are non-decreasing: the block's last key reaches the furthest query, its first key
            # bounds the queries that every key of the block reaches
            first = tl.load(DEN + start_n).to(tl.int32)
            last = tl.load(DEN + tl.minimum(start_n + BLOCK_N, SKV) - 1).to(tl.int32)
            hi = tl.minimum(hi, last)
            full_hi = tl.minimum(full_hi, (first // BLOCK_M) * BLOCK_M)
        hi = tl.maximum(hi, lo)
        b = tl.minimum(tl.maximum(full_lo, lo), hi)
        c = tl.minimum(tl.maximum(full_hi, b), hi)
        return lo, b, c, hi
else:  # pragma: no cover
    load_ranges = q_block_key_ranges_of = kv_block_query_ranges = key_block_outside_span = key_block_needs_flags = \
        row_skipped = None


# Block ranges from a mask tensor (see the module docstring); False = read the mask in every block (benchmarks
# compare the two).
MASK_BLOCK_RANGES = True


def use_mask_ranges(kind, causal, window) -> bool:
    # Only for a mask tensor alone: with index masks the scalar ranges already skip blocks (the mask tensor,
    # e.g. padding, is then read in every visited block).
    return bool(MASK_BLOCK_RANGES and kind != 0 and not causal and not window)


def mask_block_ranges_of(mt, ms, kind, B, Hq, R, C, BR, BC, transpose=False, rec=None):
    """int32 [Bm * Hm * cdiv(R, BR), 4] (lo, b, c, hi) per row block, in column-block units, and its (batch,
    head) strides (0 where the mask broadcasts). ``transpose``: rows are keys, columns queries (dK/dV kernel).
    Two launches, O(mask) reads, no host sync. With ``rec`` (a :class:`fxfuse.kernels.launch_cache.Recorder`)
    they are recorded with the launcher's own, their two tensors as scratch: the launcher's replays redo them."""
    sb, sh, sm, sn = ms
    Bm, Hm = (B if sb else 1), (Hq if sh else 1)
    sr, sc = (sn, sm) if transpose else (sm, sn)
    NR, NC = triton.cdiv(R, BR), triton.cdiv(C, BC)
    if rec is None:
        cls = torch.empty(Bm * Hm * NR * NC, dtype=torch.int8, device=mt.device)
        rng = torch.empty(Bm * Hm * NR, 4, dtype=torch.int32, device=mt.device)
        _mask_tile_classes[(NC, NR, Bm * Hm)](mt, cls, sb, sh, sr, sc, R, C, NR, NC, Hm, BR=BR, BC=BC,
                                              MASK_KIND=kind, num_warps=4)
        _mask_block_ranges[(Bm * Hm * NR,)](cls, rng, NC, BLOCK=128, num_warps=4)
    else:
        cls = rec.scratch((Bm * Hm * NR * NC,), torch.int8, mt.device)
        rng = rec.scratch((Bm * Hm * NR, 4), torch.int32, mt.device)
        rec.launch(_mask_tile_classes, (NC, NR, Bm * Hm), (mt, cls, sb, sh, sr, sc, R, C, NR, NC, Hm),
                   dict(BR=BR, BC=BC, MASK_KIND=kind, num_warps=4))
        rec.launch(_mask_block_ranges, (Bm * Hm * NR,), (cls, rng, NC), dict(BLOCK=128, num_warps=4))
    return rng, (Hm * NR * 4 if Bm > 1 else 0, NR * 4 if Hm > 1 else 0)
