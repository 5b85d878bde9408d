"""The score tile every attention kernel computes, as Triton device functions shared by :mod:`.forward` and
:mod:`.backward`.

``q . k^T`` -> scaling and optional tanh softcap -> mask tensor, key padding, causal / window / document masks ->
scores in the log2 domain (softmax runs in base 2: ``exp2``, the log2(e) factor folded into the scale). The forward
and dQ loops hold queries on the tile's rows and the dK/dV loop keys, so :func:`masked_scores` takes the query and
key indices broadcast to the tile and serves all three. Index masks are applied only on BOUNDARY tiles: interior
tiles are fully kept by construction of the loop bounds (:mod:`.block_map`). An additive mask value at or below
:data:`MASKED_BELOW_C` (:data:`.conventions.MASKED_BELOW`) is -inf.

tanh comes in two forms, picked by the launchers (``SOFTCAP`` 1 / 2, :func:`.launching.softcap_mode`):
:func:`tanh_exp2` (one exp2 and one division, ``1 - 2 / (2^(2x·log2 e) + 1)``, exact limits +-1 at overflow; fp32
and the interpreter) and ``tanh.approx.f32`` (:func:`fxfuse.kernels.triton_support.tanh_approx`, bf16 / fp16 on
the GPU). Also here, used by every kernel: :func:`dot` / :func:`dot_acc` (exact fp32 products where needed; the
accumulating form hands the accumulator to the MMA) and :func:`load_tile`
(no bounds mask on interior tiles).
"""
from __future__ import annotations

from fxfuse.kernels.triton_support import HAVE_TRITON, tanh_approx, tl, triton

from .conventions import MASKED_BELOW

__all__ = ["MASKED_BELOW_C", "tanh_exp2", "dot", "dot_acc", "load_tile", "masked_scores", "row_key_bounds"]

if HAVE_TRITON:
    # MASKED_BELOW as a Triton constant: a @triton.jit function reads a module global only if it is a tl.constexpr.
    MASKED_BELOW_C = tl.constexpr(MASKED_BELOW)

    @triton.jit
    def tanh_exp2(x):
        # tanh(x) = 1 - 2 / (e^{2x} + 1): one exp2 and one division; e^{2x} -> inf gives 1, -> 0 gives -1.
        e = tl.exp2(x * 2.8853900817779268)  # 2 * log2(e)
        return 1.0 - 2.0 / (e + 1.0)

    @triton.jit
    def dot(a, b, DOT_FP32: tl.constexpr):
        # DOT_FP32: the interpreter's tl.dot on bf16 operands returns garbage (DESIGN.md sec. 4) and fp32
        # inputs want IEEE products (Triton's default for fp32 is tf32): upcast, exact fp32 product.
        if DOT_FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def dot_acc(a, b, acc, DOT_FP32: tl.constexpr):
        # acc + a @ b with the accumulator handed to the MMA (wgmma accumulates in place: no second [M, N]
        # fp32 tile live in registers for the product, which the dK/dV kernel cannot afford)
        if DOT_FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def load_tile(ptrs, msk):
        # interior blocks of a head_dim that is a power of two need no mask at all (msk is None there)
        if msk is None:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=msk, other=0.0)

    @triton.jit
    def _scores(qk, sc_mul, out_mul, SOFTCAP: tl.constexpr):
        """Raw q.k -> log2-domain score. Softcap: t = tanh(qk * scaling / cap), s2 = t * cap * log2e.
        SOFTCAP: 0 none, 1 tanh from exp2, 2 tanh.approx (see ``softcap_mode``). Returns (s2, t) (t is unused
        without softcap)."""
        if SOFTCAP == 2:
            t = tanh_approx(qk * sc_mul)
            return t * out_mul, t
        elif SOFTCAP == 1:
            t = tanh_exp2(qk * sc_mul)
            return t * out_mul, t
        else:
            return qk * out_mul, qk

    @triton.jit
    def row_key_bounds(qi, S, SKV, OFF, window, DST, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       HAS_DOCS: tl.constexpr):
        """(first, last) key each query ``qi`` may attend under the index masks (the sequence ends, causal, the
        window, its document), as tensors of qi's shape; a query past S gets first 0, last -1 (nothing). The
        boundary tiles then test two bounds per score instead of every mask (ROW_BOUNDS); the forward's loops
        compute them once per query block (the backward kernels keep the per-mask form: launching.ROW_BOUNDS)."""
        lo = tl.zeros_like(qi)
        hi = tl.where(qi < S, SKV - 1, -1)
        if IS_CAUSAL:
            hi = tl.minimum(hi, qi + OFF)
        if HAS_WINDOW:
            lo = tl.maximum(lo, qi + OFF - window + 1)
        if HAS_DOCS:
            lo = tl.maximum(lo, tl.load(DST + qi, mask=qi < S, other=0))
        return lo, hi

    @triton.jit
    def masked_scores(qk, sc_mul, out_mul, mptrs, qi, ki, S, SKV, OFF, window, DST, KVV, KV_CHECK,
                      SOFTCAP: tl.constexpr,
                      MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      BOUNDARY: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr,
                      KLO, KHI, ROW_BOUNDS: tl.constexpr):
        """(s2, t) of one score tile with every mask applied. ``qi``/``ki`` are the query/key indices broadcast
        to the tile's shape, so the forward and dQ loops (queries x keys) and the dK/dV loop (keys x queries)
        share this. Causal/window/out-of-range masking is needed only on BOUNDARY tiles; interior tiles are
        fully kept by construction of the loop bounds. Key padding (HAS_KVV) is read only where ``KV_CHECK`` says
        the tile's keys may hold some (a span edge or a hole in it; see :func:`.launching.key_span`)."""
        s2, t = _scores(qk, sc_mul, out_mul, SOFTCAP)
        if MASK_KIND != 0:
            s2 = _apply_mask_tensor(s2, mptrs, (qi < S) & (ki < SKV), MASK_KIND)
        if HAS_KVV:
            if KV_CHECK:  # key padding (a [Skv] vector of this batch row): O(BLOCK) bytes
                kv_ok = tl.load(KVV + ki, mask=ki < SKV, other=0)
                s2 = tl.where(kv_ok != 0, s2, float("-inf"))
        if BOUNDARY and ROW_BOUNDS:  # the same masks from each query's precomputed key range (row_key_bounds)
            s2 = tl.where((ki >= KLO) & (ki <= KHI), s2, float("-inf"))
        elif BOUNDARY:
            ok = (qi < S) & (ki < SKV)
            if IS_CAUSAL:
                ok = ok & (ki <= qi + OFF)
            if HAS_WINDOW:
                ok = ok & (qi + OFF - ki < window)
            if HAS_DOCS:  # contiguous documents under causal: key ki is in query qi's document iff ki >= start(qi)
                ok = ok & (ki >= tl.load(DST + qi, mask=qi < S, other=0))
            s2 = tl.where(ok, s2, float("-inf"))
        return s2, t

    @triton.jit
    def _apply_mask_tensor(s2, mptrs, mbounds, MASK_KIND: tl.constexpr):
        # MASK_KIND 1: additive float (values <= -65504 count as masked -> -inf); 2: bool/uint8, keep != 0.
        if MASK_KIND == 1:
            mv = tl.load(mptrs, mask=mbounds, other=0.0).to(tl.float32)
            mv = tl.where(mv <= MASKED_BELOW_C, float("-inf"), tl.maximum(mv, MASKED_BELOW_C) * 1.4426950408889634)
            s2 = s2 + mv
        elif MASK_KIND == 2:
            keep = tl.load(mptrs, mask=mbounds, other=1)
            s2 = tl.where(keep != 0, s2, float("-inf"))
        return s2
else:  # pragma: no cover
    MASKED_BELOW_C = MASKED_BELOW
    tanh_exp2 = dot = dot_acc = load_tile = masked_scores = row_key_bounds = None
