"""Fused linear + cross-entropy: the row kernel, its launcher, the chunk driver, a PyTorch row path and a float64
reference, side by side.

What is computed (``fxfuse::linear_cross_entropy``)::

    logits = hidden @ weight.T (+ bias)                      # [N, V], cuBLAS, in the input dtype
    z      = logits * scale                                  # fp32 from here on
    z      = softcap * tanh(z / softcap)       if softcap
    mx     = max_v z_v,   ls = log sum_v exp(z_v - mx)       # the row normaliser, two fp32 numbers (below)
    loss_t = (1 - eps) * ((mx - z[y]) + ls) + eps * ((mx - mean_v z_v) + ls)   (0 where y_t == ignore_index)

Why it is shaped this way (design notes, sec. 6):

* The floor is the three N*D*V matmuls (6*N*D*V flops). They stay in cuBLAS; what fusion saves is the [N, V]
  fp32 logits/softmax traffic and its memory. We therefore chunk over tokens: per chunk of C tokens one bf16
  [C, V] buffer (reused across chunks) receives the logits from cuBLAS, one Triton *row kernel* turns it, in
  place, into d loss / d logits, and two more cuBLAS calls consume it (grad_hidden[chunk] = dlogits @ W,
  grad_weight += dlogits^T @ h[chunk]).
* ``grad_in_forward=True``: the row kernel writes the gradient during the forward (for upstream grad 1); the
  backward only scales the saved gradients by the upstream scalar. 3 matmuls in all.
  ``grad_in_forward=False``: the forward keeps only the row statistics [2, N] (mx, ls); the backward recomputes
  the logits chunk by chunk and applies arbitrary per-token upstream grads (reduction="none", GRPO-style
  losses). 4 matmuls.
* No host syncs: the count of non-ignored rows (for "mean") stays a device scalar and reaches the kernel through a
  pointer (``g``: per-row gradient weight, stride 0 for a broadcast scalar).

Row normaliser: two fp32 numbers, not one lse. ``mx`` is the row max (one of the z values, exactly) and
``ls = log S`` with S = sum_v exp(z_v - mx) >= 1, computed as ``log1p(S - 1)`` where S - 1 is summed WITHOUT the
max element's 1 (per-lane online statistics: running max m and r = sum of e^(z - m) over the lane's elements
except its max; ``_stats_update`` / ``_stats_finish``). Every ``z - lse`` is formed as ``(z - mx) - ls``: z - mx is
exact for the max element (0) and for z near it, and ls keeps its relative precision however small it is. One
fp32 lse = mx + log S cannot do that: it rounds to ~|lse| * 6e-8 absolute, and on a peaked row (the target far
above the rest, loss ~1e-6 and below) that error swamps the target's true z_y - lse, so the loss and the target's
gradient entry lost all their precision. Measured (CPU, fp32, N=256, D=64, V=4000, h = randn + 10 w[y] with
|w_v|^2 ~ 4: target logit ~40, mean loss 1.5e-5): relative error of the loss 3.6e-3 with one lse, 1.4e-6 now,
eager fp32 1.1e-3 (its log S rounds 1 + tiny); grad_hidden 2.4e-3 -> 1.5e-6 (eager 4.1e-4).
tests/test_lm_head_accuracy.py keeps fxfuse within eager's error.
Consequently:

    loss_row  = (mx - z_y) + ls
    p_v       = exp((z_v - mx) - ls)
    p_y - 1   = expm1((z_y - mx) - ls)        (the target entry of the gradient: an accurate expm1, ``_expm1``)

The target entry is computed once per row (a scalar) and selected into the slice, so the expm1 costs nothing
per element; the backward re-reads the target's logit once per row (``_pick``) through the same z transform as
the row loop, so z_y - mx is still exactly 0 when the target is the max. On CUDA the final multiply of that
transform is an explicitly rounded ``mul.rn.f32`` (``_mul_rn``): contracted into an FMA with the ``- mx`` that
follows, z - mx at the max element would be the product's rounding error instead of 0 (measured on an H100: the
entropy gradient of the log-probs op 5e-4 off at softcap 30, T 0.7). The online pass takes ONE exp per element
(e^-|z - m| is either the rescale of the old sums or the new term), where the single-lse version took two; the
lanes combine with one max-with-index and one sum. H100 row-kernel timings against the single-lse kernel (bf16
chunks, 1024 x 128256 / 512 x 256000 with softcap): forward + gradient 0.298 -> 0.317 ms and 0.328 -> 0.334 ms,
recompute backward unchanged (0.194 / 0.198 ms); the log-probs forward 0.209 -> 0.174 ms.

The row kernel makes two passes over each row of the chunk: an online max/sum-exp pass (plus the label-smoothing
sum and z[y]), then a pass that recomputes z and stores the gradient over the logits it read. The buffer is
read twice and written once; rows are long (V ~ 1e5..2.6e5) so one program handles one row in BLOCK_V slices.

The same chunk driver runs with a PyTorch implementation of the row step (``_rows_torch``), used on CPU and as
the CI-testable twin of the kernel; the Triton kernel runs on CUDA, or on CPU under ``TRITON_INTERPRET=1`` when
``FORCE_TRITON`` (env ``FXFUSE_LCE_FORCE_TRITON=1``) is set.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MIN_MEMORY_CHUNK_BYTES",
    "FORCE_TRITON",
    "lce_forward",
    "lce_backward",
    "lce_reference",
    "rows_per_chunk",
    "scale_by_device_scalar_",
]

#: Budget for the [C, V] logits chunk buffer (design: ~256 MiB); the min-memory setting is 16 MiB.
DEFAULT_CHUNK_BYTES = int(os.environ.get("FXFUSE_LCE_CHUNK_BYTES", 256 << 20))
MIN_MEMORY_CHUNK_BYTES = 16 << 20
#: Accumulate grad_weight in fp32 (then cast once) when the fp32 accumulator fits in this many bytes. Each
#: chunk's addmm otherwise rounds the running bf16 sum once more (see benchmarks/lce_notes.md for the error).
FP32_ACCUM_MAX_BYTES = int(os.environ.get("FXFUSE_LCE_FP32_ACCUM_BYTES", 0))
#: Row-kernel launch settings (BLOCK_V, num_warps, FAST_TANH); measured choices in lce_notes.md.
ROW_CONFIG: dict = {}
#: Measured on H200 (benchmarks/lce_notes.md): per-lane online max + tanh.approx were the fastest row settings
#: (Llama-3 head 2.33 -> 2.01 ms/step, Gemma-2 head with softcap 7.07 -> 4.66 ms/step). The per-lane max is the
#: only variant now (the scalar running-max one was removed with the two-number row normaliser).
_ROW_DEFAULTS = dict(BLOCK_V=4096, num_warps=16, FAST_TANH=True)
#: Run the Triton row kernel on CPU tensors too (needs TRITON_INTERPRET=1); for tests.
FORCE_TRITON = os.environ.get("FXFUSE_LCE_FORCE_TRITON", "0") == "1"


def rows_per_chunk(V: int, elem_bytes: int, chunk_bytes: int, N: int) -> int:
    """Tokens per chunk so that the [C, V] logits buffer fits ``chunk_bytes`` (at least 1, at most N)."""
    c = max(1, int(chunk_bytes) // max(1, V * elem_bytes))
    if c >= 256:
        c -= c % 128  # whole 128-row tiles for cuBLAS
    return max(1, min(c, N))


def _use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and (t.device.type == "cuda" or FORCE_TRITON)


# ================================================================================================ Triton kernel
if HAVE_TRITON:

    @triton.jit
    def _tanh(x, FAST: tl.constexpr):
        if FAST:
            # one MUFU instruction (sm_75+); max relative error ~2^-11, under the bf16 rounding of the logits
            return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            # tanh from one exp: runs in the interpreter (libdevice does not), ~3e-8 absolute in fp32.
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            return tl.where(x >= 0, t, -t)

    @triton.jit
    def _mul_rn(a, b, RN: tl.constexpr):
        """a * b rounded to fp32 before anything else uses it. On CUDA (RN) an explicitly rounded mul.rn.f32,
        which neither LLVM nor ptxas contracts into an FMA with a following add: z = x * c feeds both the row max
        (rounded) and z - mx; contracted, z - mx at the max element is the product's rounding error (~|z| * 6e-8)
        instead of 0, which is the whole of z_y - E_p[z] on a peaked row (the entropy gradient there)."""
        if RN:
            return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return a * b

    # ---- shared by the lm-head row kernels (this one and linear_log_probs'): the two-number row normaliser
    @triton.jit
    def _stats_init(BLOCK_V: tl.constexpr):
        """Per-lane online statistics: running max m (finite -1e30 start: never inf - inf) and r = sum of
        e^(z - m) over the lane's elements EXCEPT its max (-1 = lane not hit yet, so that r + 1 = the full sum)."""
        return tl.full([BLOCK_V], -1e30, dtype=tl.float32), tl.full([BLOCK_V], -1.0, dtype=tl.float32)

    @triton.jit
    def _stats_update(m, r, zm):
        """One slice ``zm`` (z, -inf on masked lanes) into (m, r), with ONE exp per element: for d = zm - m either
        the element is a new max (d > 0: the old sums rescale by e^-d and the old max's 1 joins r) or it joins r
        as e^d; q = e^-|d| is both. Returns (m_new, r_new, q, d, up = d > 0). Masked lanes: d = -inf, q = 0, no
        change. Ties count in r: only one max is left out."""
        d = zm - m
        q = tl.exp(-tl.abs(d))
        up = d > 0
        return tl.maximum(m, zm), tl.where(up, (r + 1.0) * q, r + q), q, d, up

    @triton.jit
    def _log1p(x):
        """log(1 + x) for x >= 0 with relative precision also for tiny x, without relying on tl.log near 1
        (approximate on GPUs): 2 atanh(s), s = x / (2 + x) <= 1/3, as a series for x < 1; tl.log(1 + x) above,
        where log(1 + x) >= log 2 keeps an absolute error of the log small relative to the result."""
        s = x / (2.0 + x)
        s2 = s * s
        p = 1.0 + s2 * (1.0 / 3.0 + s2 * (1.0 / 5.0 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0 + s2 * (
            1.0 / 11.0 + s2 * (1.0 / 13.0 + s2 * (1.0 / 15.0 + s2 * (1.0 / 17.0))))))))
        return tl.where(x < 1.0, 2.0 * s * p, tl.log(1.0 + x))

    @triton.jit
    def _expm1(x):
        """exp(x) - 1 with relative precision for small |x| (Triton has no expm1 the interpreter runs): Taylor to
        degree 12 in Horner form for |x| < 1 (truncation < 2e-9 relative), exp(x) - 1 beyond (|result| > 0.63
        there, so exp's own rounding stays relative). Scalar per row in the callers: its cost does not matter."""
        q = 1.0 + x * (1.0 / 12.0)
        q = 1.0 + x * (1.0 / 11.0) * q
        q = 1.0 + x * (1.0 / 10.0) * q
        q = 1.0 + x * (1.0 / 9.0) * q
        q = 1.0 + x * (1.0 / 8.0) * q
        q = 1.0 + x * (1.0 / 7.0) * q
        q = 1.0 + x * (1.0 / 6.0) * q
        q = 1.0 + x * (1.0 / 5.0) * q
        q = 1.0 + x * (1.0 / 4.0) * q
        q = 1.0 + x * (1.0 / 3.0) * q
        q = 1.0 + x * 0.5 * q
        return tl.where(tl.abs(x) < 1.0, x * q, tl.exp(x) - 1.0)

    @triton.jit
    def _stats_finish(m, r, BLOCK_V: tl.constexpr):
        """Combine the lanes: (mx, ls, w, Sm1) with mx the row max, Sm1 = S - 1 (S = sum e^(z - mx)) summed without
        the max's 1, ls = log1p(Sm1), w = e^(m - mx) per lane (0 for lanes never hit, where r + 1 = 0 too). One lane
        holding the row max contributes its r (its max's 1 left out), every other lane its full w (r + 1), lanes
        that tie for the max included: two reductions, as for a plain logsumexp."""
        mx, imx = tl.max(m, axis=0, return_indices=True)
        w = tl.exp(m - mx)
        Sm1 = tl.sum(tl.where(tl.arange(0, BLOCK_V) == imx, r, w * (r + 1.0)), axis=0)
        return mx, _log1p(Sm1), w, Sm1

    @triton.jit
    def _pick(base, idx, ok):
        """The element ``base[idx]`` (0.0 where not ``ok``) as a [2] fp32 vector (lane 0), for the scalar target
        logit: callers push it through the same z transform as their row loop and take lane 0."""
        k = tl.arange(0, 2)
        # (mask built by one vector compare: the interpreter rejects a scalar-and-vector bool mask)
        return tl.load(base + tl.where(ok, idx, 0) + k, mask=tl.where(ok, k, 1) == 0, other=0.0).to(tl.float32), k

    @triton.jit
    def _ce_z(x, scale, softcap, inv_softcap, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, RN: tl.constexpr):
        """(z, t) from the fp32 logits x: z = x * scale, then softcap * tanh(z / softcap) (t = the tanh); the
        final product rounded (``_mul_rn``)."""
        if SOFTCAP:
            t = _tanh(x * scale * inv_softcap, FAST_TANH)
            z = _mul_rn(t, softcap, RN)
        else:
            z = _mul_rn(x, scale, RN)
            t = z
        return z, t

    @triton.jit
    def _lce_rows_kernel(
        logits_ptr, stride_row,          # [C, V] chunk, overwritten with d loss / d logits when WRITE_GRAD
        target_ptr,                      # [C] int64
        g_ptr, stride_g,                 # per-row gradient weight (fp32); stride 0 = one device scalar
        loss_ptr,                        # [C] fp32 per-row loss (WRITE_LOSS)
        mx_ptr, ls_ptr,                  # [C] fp32 row max and log S: written (WRITE_LSE) or read (HAVE_LSE)
        V, ignore_index, scale, softcap, inv_softcap, eps,
        HAVE_LSE: tl.constexpr, WRITE_LSE: tl.constexpr, WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
        SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, BLOCK_V: tl.constexpr, FAST_TANH: tl.constexpr,
        RN: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # int64: C * V exceeds 2**31 for big budgets
        base = logits_ptr + row * stride_row
        y = tl.load(target_ptr + row)
        valid = y != ignore_index
        cols0 = tl.arange(0, BLOCK_V)

        if HAVE_LSE:
            mx = tl.load(mx_ptr + row)
            ls = tl.load(ls_ptr + row)
            zy = 0.0
            if WRITE_GRAD:
                # the target logit, once per row, through the same transform as the loop (z_y - mx stays exact)
                xk, k = _pick(base, y, valid & (y >= 0) & (y < V))
                zk, _t = _ce_z(xk, scale, softcap, inv_softcap, SOFTCAP, FAST_TANH, RN)
                zy = tl.sum(tl.where(k == 0, zk, 0.0), axis=0)
        else:
            # Pass 1: per-lane online max and sum of e^(z - max) without the max (no cross-warp reduction per
            # slice), plus the label-smoothing sum and z[y], picked up on the way.
            m, r = _stats_init(BLOCK_V)
            sz = tl.zeros([BLOCK_V], dtype=tl.float32)   # sum of z, for label smoothing
            zyv = tl.zeros([BLOCK_V], dtype=tl.float32)  # z[y]
            for start in range(0, V, BLOCK_V):
                cols = start + cols0
                mask = cols < V
                z, _t = _ce_z(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32), scale, softcap,
                              inv_softcap, SOFTCAP, FAST_TANH, RN)
                m, r, _q, _d, _up = _stats_update(m, r, tl.where(mask, z, -float("inf")))
                if SMOOTH:
                    sz += tl.where(mask, z, 0.0)
                zyv += tl.where(cols == y, z, 0.0)
            mx, ls, _w, _s = _stats_finish(m, r, BLOCK_V)
            zy = tl.sum(zyv, axis=0)
            if WRITE_LOSS:
                loss = (mx - zy) + ls
                if SMOOTH:
                    loss = (1.0 - eps) * loss + eps * ((mx - tl.sum(sz, axis=0) / V) + ls)
                tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        if WRITE_LSE:
            tl.store(mx_ptr + row, mx)
            tl.store(ls_ptr + row, ls)

        if WRITE_GRAD:
            # Pass 2: recompute z from the (still unmodified) logits and store the gradient over them.
            # d loss/d z = softmax - (1-eps)*onehot - eps/V; times g (1/n_valid, 1 or the upstream per-token grad);
            # times dz/dlogit = scale * (1 - tanh^2) with softcap, scale without. Ignored rows get exact zeros.
            # The target entry p_y - 1 + eps = expm1((z_y - mx) - ls) + eps is one scalar per row.
            dy = _expm1((zy - mx) - ls)
            if SMOOTH:
                dy = dy + eps
            dy = tl.where(valid, dy, 0.0)  # ignored rows: finite (times coef 0) even where ignore_index is a column
            coef = tl.where(valid, tl.load(g_ptr + row * stride_g), 0.0) * scale
            for start in range(0, V, BLOCK_V):
                cols = start + cols0
                mask = cols < V
                z, t = _ce_z(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32), scale, softcap,
                             inv_softcap, SOFTCAP, FAST_TANH, RN)
                d = tl.where(cols == y, dy, tl.exp((z - mx) - ls))
                if SMOOTH:
                    d = d - eps / V
                d = d * coef
                if SOFTCAP:
                    d = d * (1.0 - t * t)
                tl.store(base + cols, d.to(logits_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _scale_by_device_scalar_kernel(x_ptr, n, g_ptr, BLOCK: tl.constexpr):
        # x *= g in place, g read from device memory. With g == 1 (loss.backward() straight on the loss) the
        # programs return without touching x: the common case costs one launch, not a read and write of x.
        g = tl.load(g_ptr)
        if g != 1.0:  # NaN != 1 too: a NaN factor (consumed gradients) still poisons x
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            x = tl.load(x_ptr + offs, mask=m)
            tl.store(x_ptr + offs, (x.to(tl.float32) * g).to(x_ptr.dtype.element_ty), mask=m)


def scale_by_device_scalar_(t: torch.Tensor, g: torch.Tensor) -> None:
    """``t *= g`` in place for a contiguous ``t`` and a 0-dim fp32 ``g`` on the same device, without a host sync.

    On CUDA this is one vectorised Triton pass, skipped on the device when g == 1. ``t.mul_(g)`` with a bf16
    ``t`` and an fp32 0-dim CUDA ``g`` takes ATen's non-vectorised dynamic-cast path: 2.6 ms for a Gemma-2
    grad_weight on the H200, where one read and write of it takes ~0.6 ms."""
    if t.numel() == 0:
        return
    if _use_triton(t) and t.is_contiguous():
        BLOCK = 4096
        _scale_by_device_scalar_kernel[(triton.cdiv(t.numel(), BLOCK),)](t, t.numel(), g, BLOCK=BLOCK, num_warps=8)
    else:
        t.mul_(g)


def rounded_z(buf) -> bool:
    """Whether the row kernels round z with an explicit mul.rn.f32 (``_mul_rn``): NVIDIA GPUs, not the
    interpreter (numpy never contracts a multiply and an add)."""
    return buf.is_cuda and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


def row_launch_config(buf, defaults: dict, overrides: dict, fast_tanh_dtypes=None):
    """Launch settings of a one-program-per-row kernel over a [C, V] logits chunk (shared by the lm-head ops):
    (cfg, BLOCK_V, num_warps, fast_tanh). ``overrides`` (a module's ROW_CONFIG) win over ``defaults``. The
    approximate hardware tanh is used only on CUDA, never under the interpreter, and only for
    ``fast_tanh_dtypes`` when given."""
    V = buf.shape[1]
    cfg = {**defaults, **overrides}
    BLOCK_V = min(cfg.get("BLOCK_V") or 4096, triton.next_power_of_2(V))
    num_warps = cfg.get("num_warps") or (16 if BLOCK_V >= 4096 else (8 if BLOCK_V >= 1024 else 4))
    num_warps = min(num_warps, max(1, BLOCK_V // 32))  # no more warps than a block has 32-wide slices
    fast_tanh = (bool(cfg.get("FAST_TANH")) and buf.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
                 and (fast_tanh_dtypes is None or buf.dtype in fast_tanh_dtypes))
    return cfg, BLOCK_V, num_warps, fast_tanh


def _rows_triton(buf, target, g, loss_out, lse_out, lse_in, ignore_index, scale, softcap, eps, write_grad):
    """Launch the row kernel on one [C, V] chunk (same contract as :func:`_rows_torch`; ``lse_out`` / ``lse_in``
    are [2, C] fp32 row statistics: row 0 the max, row 1 log S)."""
    C, V = buf.shape
    if C == 0:
        return
    assert buf.stride(1) == 1, "logits chunk rows must be contiguous"
    # fp32 logits keep the exact tanh (tanh.approx's ~2^-11 relative error is far above fp32's: 1e-4 on the loss at
    # softcap 30); bf16 / fp16 logits are rounded coarser than that already.
    _, BLOCK_V, num_warps, fast_tanh = row_launch_config(buf, _ROW_DEFAULTS, ROW_CONFIG,
                                                         (torch.bfloat16, torch.float16))
    dummy = target  # any tensor: pointers the constexpr flags switch off are never dereferenced
    st = lse_in if lse_in is not None else lse_out
    _lce_rows_kernel[(C,)](
        buf, buf.stride(0), target,
        g if g is not None else dummy, (g.stride(0) if (g is not None and g.dim() == 1) else 0),
        loss_out if loss_out is not None else dummy,
        st[0] if st is not None else dummy, st[1] if st is not None else dummy,
        V, int(ignore_index), float(scale), float(softcap or 1.0), 1.0 / float(softcap or 1.0), float(eps),
        HAVE_LSE=lse_in is not None, WRITE_LSE=lse_out is not None and lse_in is None,
        WRITE_LOSS=loss_out is not None, WRITE_GRAD=bool(write_grad),
        SOFTCAP=bool(softcap), SMOOTH=eps != 0.0, BLOCK_V=BLOCK_V, FAST_TANH=fast_tanh, RN=rounded_z(buf),
        num_warps=num_warps,
    )


# ================================================================================================ PyTorch twin
def row_stats_torch(z):
    """The two-number row normaliser in PyTorch (shared by the lm-head ops' CPU paths): returns (mx [C], ls [C],
    zs [C, V], e [C, V]) with mx the row max, zs = z - mx (exactly 0 at the max), e = exp(zs) with the (first)
    max's 1 zeroed, and ls = log1p(e.sum(-1)) = log sum exp(zs): S - 1 summed without the max's 1."""
    mx, am = z.max(dim=-1, keepdim=True)
    zs = z - mx
    e = zs.exp()
    e.scatter_(1, am, 0.0)
    return mx.squeeze(1), torch.log1p(e.sum(-1)), zs, e


def _rows_torch(buf, target, g, loss_out, lse_out, lse_in, ignore_index, scale, softcap, eps, write_grad):
    """The row step in PyTorch (CPU path). Same in-place contract as the kernel:

    reads the [C, V] logits in ``buf``; writes per-row loss (fp32, 0 for ignored rows) into ``loss_out`` and the
    row statistics into ``lse_out`` ([2, C] fp32: the max, log S; unless ``lse_in`` is given, then it is used
    instead of being computed); when ``write_grad``, overwrites ``buf`` with ``g * d loss_row / d logits`` (zeros
    in ignored rows).
    """
    C, V = buf.shape
    if C == 0:
        return
    z = buf.float()
    if scale != 1.0:
        z = z * scale
    t = None
    if softcap:
        t = torch.tanh(z / softcap)
        z = t * softcap
    valid = target != ignore_index
    y = torch.where(valid, target, 0).unsqueeze(1)
    if lse_in is None:
        mx, ls, zs, e = row_stats_torch(z)
        del e
    else:
        mx, ls = lse_in[0], lse_in[1]
        zs = z - mx.unsqueeze(1)
    del z
    zs_y = zs.gather(1, y).squeeze(1)  # z_y - mx
    if loss_out is not None:
        loss = ls - zs_y
        if eps:
            loss = (1.0 - eps) * loss + eps * (ls - zs.mean(dim=-1))
        loss_out.copy_(torch.where(valid, loss, 0.0))
    if lse_out is not None and lse_in is None:
        lse_out[0].copy_(mx)
        lse_out[1].copy_(ls)
    if write_grad:
        d = zs.sub_(ls.unsqueeze(1)).exp_()  # p = exp((z - mx) - ls), in place of zs
        dy = torch.expm1(zs_y - ls)          # p_y - 1, accurate for peaked rows
        if eps:
            dy = dy + eps
        d.scatter_(1, y, torch.where(valid, dy, 0.0).unsqueeze(1))
        if eps:
            d -= eps / V
        coef = torch.where(valid, g.float().expand(C), 0.0) * scale
        d *= coef.unsqueeze(1)
        if t is not None:
            d *= 1.0 - t * t
        buf.copy_(d)


# ================================================================================================ chunk driver
def _addmm_fp32_(acc, a, b):
    """acc += a @ b with an fp32 accumulator and low-precision operands (cuBLAS reads/writes acc in fp32)."""
    if acc.is_cuda and a.dtype != torch.float32:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):  # torch without addmm(out_dtype=): upcast (slower, same numbers)
            pass
    acc.addmm_(a.float(), b.float())


def _chunk_loop(hidden, weight, bias, rows_step, need_gh, need_gw, need_gb, chunk_bytes, write_grad):
    """Shared token-chunk loop: logits chunk (cuBLAS) -> ``rows_step(buf, start, end)`` -> gradient matmuls.

    Returns (grad_hidden, grad_weight, grad_bias), empty tensors for those not asked for (or when no gradient is
    written in this pass).
    """
    N, D = hidden.shape
    V = weight.shape[0]
    dt = hidden.dtype
    empty = lambda: hidden.new_empty(0)  # noqa: E731  (distinct tensors: custom_op outputs must not alias)
    gh = hidden.new_empty((N, D)) if (write_grad and need_gh) else empty()
    gw, gw32 = empty(), None
    if write_grad and need_gw:
        gw = weight.new_empty((V, D))
        if dt != torch.float32 and V * D * 4 <= FP32_ACCUM_MAX_BYTES:
            gw32 = torch.zeros((V, D), dtype=torch.float32, device=weight.device)
        elif N == 0:
            gw.zero_()
    gb32 = torch.zeros(V, dtype=torch.float32, device=hidden.device) if (write_grad and need_gb) else None
    if N > 0:
        C = rows_per_chunk(V, hidden.element_size(), chunk_bytes, N)
        buf_all = hidden.new_empty((C, V))
        wt = weight.t()
        for start in range(0, N, C):
            end = min(start + C, N)
            h_c = hidden[start:end]
            buf = buf_all[: end - start]
            if bias is not None:
                torch.addmm(bias, h_c, wt, out=buf)
            else:
                torch.mm(h_c, wt, out=buf)
            rows_step(buf, start, end)
            if not write_grad:
                continue
            if need_gh:
                torch.mm(buf, weight, out=gh[start:end])
            if need_gw:
                if gw32 is not None:
                    _addmm_fp32_(gw32, buf.t(), h_c)
                elif start == 0:
                    torch.mm(buf.t(), h_c, out=gw)
                else:
                    gw.addmm_(buf.t(), h_c)
            if need_gb:
                gb32 += buf.sum(dim=0, dtype=torch.float32)
        del buf_all
    if gw32 is not None:
        gw.copy_(gw32)
    gb = gb32.to(bias.dtype) if gb32 is not None else empty()
    return gh, gw, gb


def lce_forward(hidden, weight, target, bias, ignore_index: int, reduction: str, softcap: float, scale: float,
                label_smoothing: float, grad_in_forward: bool, need_gh: bool, need_gw: bool, need_gb: bool,
                chunk_bytes: int):
    """Forward of the fused op. hidden [N, D], weight [V, D], target [N], bias [V] or None.

    Returns (loss, lse, grad_hidden, grad_weight, grad_bias): loss fp32 ([] or [N] for "none"), lse the row
    statistics, fp32 [2, N] (row 0 the row max mx, row 1 ls = log sum exp(z - mx); logsumexp = mx + ls); the grads
    (for upstream grad 1, in the input dtype) only when ``grad_in_forward``, else empty tensors.
    """
    N = hidden.shape[0]
    rows = _rows_triton if _use_triton(hidden) else _rows_torch
    target = target.contiguous()
    loss_rows = torch.empty(N, dtype=torch.float32, device=hidden.device)
    lse = torch.empty((2, N), dtype=torch.float32, device=hidden.device)
    n_valid = (target != ignore_index).sum()  # device scalar: no host sync
    if reduction == "mean":
        g = 1.0 / n_valid.to(torch.float32)   # inf when all rows are ignored; ignored rows never read it
    else:
        g = torch.ones((), dtype=torch.float32, device=hidden.device)
    write_grad = bool(grad_in_forward) and (need_gh or need_gw or (need_gb and bias is not None))

    def step(buf, s, e):
        rows(buf, target[s:e], g, loss_rows[s:e], lse[:, s:e], None, ignore_index, scale, softcap,
             label_smoothing, write_grad)

    gh, gw, gb = _chunk_loop(hidden, weight, bias, step, need_gh, need_gw, need_gb and bias is not None,
                             chunk_bytes, write_grad)
    if reduction == "none":
        loss = loss_rows
    elif reduction == "sum":
        loss = loss_rows.sum()
    else:
        loss = loss_rows.sum() / n_valid  # 0/0 = nan when every row is ignored, like torch
    return loss, lse, gh, gw, gb


def lce_backward(grad_loss, hidden, weight, target, bias, lse, ignore_index: int, reduction: str, softcap: float,
                 scale: float, label_smoothing: float, need_gh: bool, need_gw: bool, need_gb: bool,
                 chunk_bytes: int):
    """Backward by recomputation (``grad_in_forward=False``): logits chunk by chunk from the saved row statistics
    ``lse`` ([2, N]: max, log S), with the upstream grad ``grad_loss`` ([] for mean/sum, [N] for "none").
    Returns (grad_hidden, grad_weight, grad_bias)."""
    rows = _rows_triton if _use_triton(hidden) else _rows_torch
    target = target.contiguous()
    g = grad_loss.to(torch.float32)
    if reduction == "mean":
        g = g / (target != ignore_index).sum().to(torch.float32)
    per_row = g.dim() == 1

    def step(buf, s, e):
        rows(buf, target[s:e], g[s:e] if per_row else g, None, None, lse[:, s:e], ignore_index, scale, softcap,
             label_smoothing, True)

    return _chunk_loop(hidden, weight, bias, step, need_gh, need_gw, need_gb and bias is not None, chunk_bytes,
                       True)


# ================================================================================================ reference
def lce_reference(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", softcap=None,
                  scale=None, label_smoothing=0.0, grad_out=None, dtype=torch.float64):
    """float64 reference through plain PyTorch autograd: returns (loss, grad_hidden, grad_weight, grad_bias)
    (grads None where an input is None). ``grad_out`` is the upstream grad (default ones)."""
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    b = bias.detach().to(dtype).requires_grad_() if bias is not None else None
    z = F.linear(h, w, b)
    if scale is not None and scale != 1.0:
        z = z * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    go = torch.ones_like(loss) if grad_out is None else grad_out.to(dtype)
    grads = torch.autograd.grad(loss, [h, w] + ([b] if b is not None else []), go, allow_unused=True)
    gh, gw = grads[0], grads[1]
    gb = grads[2] if b is not None else None
    return loss.detach(), gh, gw, gb
