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
except its max; ``stats_update`` / ``stats_finish`` of :mod:`~fxfuse.kernels.lm_head_rows`, which holds what this
op shares with the log-probs op). Every ``z - lse`` is formed as ``(z - mx) - ls``: z - mx is exact for the max
element (0) and for z near it, and ls keeps its relative precision however small it is. One fp32 lse = mx + log S
cannot do that: it rounds to ~|lse| * 6e-8 absolute, and on a peaked row (the target far above the rest, loss
~1e-6 and below) that error swamps the target's true z_y - lse, so the loss and the target's gradient entry lost
all their precision. Measured (CPU, fp32, N=256, D=64, V=4000, h = randn + 10 w[y] with
|w_v|^2 ~ 4: target logit ~40, mean loss 1.5e-5): relative error of the loss 3.6e-3 with one lse, 1.4e-6 now,
eager fp32 1.1e-3 (its log S rounds 1 + tiny); grad_hidden 2.4e-3 -> 1.5e-6 (eager 4.1e-4).
tests/test_lm_head_accuracy.py keeps fxfuse within eager's error.
Consequently:

    loss_row  = (mx - z_y) + ls
    p_v       = exp((z_v - mx) - ls)
    p_y - 1   = expm1((z_y - mx) - ls)        (the target entry of the gradient: an accurate expm1, ``expm1``)

The target entry is computed once per row (a scalar) and selected into the slice, so the expm1 costs nothing
per element; the backward re-reads the target's logit once per row (``pick``) through the same z transform as
the row loop, so z_y - mx is still exactly 0 when the target is the max. On CUDA the final multiply of that
transform is an explicitly rounded ``mul.rn.f32`` (``mul_rn``): contracted into an FMA with the ``- mx`` that
follows, z - mx at the max element would be the product's rounding error instead of 0 (measured on an H100: the
entropy gradient of the log-probs op 5e-4 off at softcap 30, T 0.7). The online pass takes ONE exp per element
(e^-|z - m| is either the rescale of the old sums or the new term), where the single-lse version took two; the
lanes combine with one max-with-index and one sum. H100 row-kernel timings against the single-lse kernel (bf16
chunks, 1024 x 128256 / 512 x 256000 with softcap): forward + gradient 0.298 -> 0.317 ms and 0.328 -> 0.334 ms,
recompute backward unchanged (0.194 / 0.198 ms); the log-probs forward 0.209 -> 0.174 ms.

The row kernel makes two passes over each row of the chunk: an online max/sum-exp pass (plus the label-smoothing
sum and z[y]), then a pass that recomputes z and stores the gradient over the logits it read. The buffer is
read twice and written once; rows are long (V ~ 1e5..2.6e5) so one program handles one row in BLOCK_V slices.

The same chunk loop (``lm_head_rows.chunk_loop``) runs with a PyTorch implementation of the row step
(``_rows_torch``), used on CPU and as the CI-testable twin of the kernel; the Triton kernel runs on CUDA, or on CPU
under ``TRITON_INTERPRET=1`` when ``FORCE_TRITON`` (env ``FXFUSE_LCE_FORCE_TRITON=1``) is set.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from . import background_compile
from .lm_head_rows import chunk_loop, rounded_z, row_launch_config, row_stats_torch
from .triton_support import HAVE_TRITON, tl, triton, use_triton

if HAVE_TRITON:
    from .lm_head_rows import expm1, mul_rn, pick, softcap_tanh, stats_finish, stats_init, stats_update

__all__ = [
    "MIN_MEMORY_CHUNK_BYTES",
    "FORCE_TRITON",
    "lce_forward",
    "lce_backward",
    "lce_reference",
    "lce_prewarm",
    "scale_by_device_scalar_",
]

#: The min-memory setting of the [C, V] logits chunk budget (the default, ``lm_head_rows.DEFAULT_CHUNK_BYTES``,
#: is ~256 MiB). The fp32 grad_weight accumulation threshold is ``lm_head_rows.FP32_ACCUM_MAX_BYTES``.
MIN_MEMORY_CHUNK_BYTES = 16 << 20
#: Row-kernel launch settings (BLOCK_V, num_warps, FAST_TANH); measured choices in lce_notes.md.
ROW_CONFIG: dict = {}
#: Measured on H200 (benchmarks/lce_notes.md): per-lane online max + tanh.approx were the fastest row settings
#: (Llama-3 head 2.33 -> 2.01 ms/step, Gemma-2 head with softcap 7.07 -> 4.66 ms/step). The per-lane max is the
#: only variant now (the scalar running-max one was removed with the two-number row normaliser).
_ROW_DEFAULTS = dict(BLOCK_V=4096, num_warps=16, FAST_TANH=True)
#: Run the Triton row kernel on CPU tensors too (needs TRITON_INTERPRET=1); for tests.
FORCE_TRITON = os.environ.get("FXFUSE_LCE_FORCE_TRITON", "0") == "1"


# ================================================================================================ Triton kernel
if HAVE_TRITON:

    @triton.jit
    def _ce_z(x, scale, softcap, inv_softcap, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, RN: tl.constexpr):
        """(z, t) from the fp32 logits x: z = x * scale, then softcap * tanh(z / softcap) (t = the tanh); the
        final product rounded (``mul_rn``)."""
        if SOFTCAP:
            t = softcap_tanh(x * scale * inv_softcap, FAST_TANH)
            z = mul_rn(t, softcap, RN)
        else:
            z = mul_rn(x, scale, RN)
            t = z
        return z, t

    # The per-row pointers are slices of per-chunk buffers ([2, C] statistics, C targets): their 16-byte alignment
    # changes with the chunk's row count, and a new alignment is a new specialisation (a JIT compile of ~0.4 s in
    # the middle of training, measured on the H200 with a new token count every step). Scalar loads gain nothing
    # from it.
    @triton.jit(do_not_specialize_on_alignment=["target_ptr", "g_ptr", "loss_ptr", "mx_ptr", "ls_ptr"])
    def _lce_rows_kernel(
        logits_ptr, stride_row,          # [C, V] chunk, overwritten with d loss / d logits when WRITE_GRAD
        target_ptr,                      # [C] int64
        g_ptr, stride_g,                 # per-row gradient weight (fp32); stride 0 = one device scalar
        loss_ptr,                        # [C] fp32 per-row loss (WRITE_LOSS), or z[y] (LOSS_IS_ZY)
        mx_ptr, ls_ptr,                  # [C] fp32 row max and log S: written (WRITE_LSE) or read (HAVE_LSE)
        V, ignore_index, scale, softcap, inv_softcap, eps,
        HAVE_LSE: tl.constexpr, WRITE_LSE: tl.constexpr, WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
        SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, BLOCK_V: tl.constexpr, FAST_TANH: tl.constexpr,
        RN: tl.constexpr, LOSS_IS_ZY: tl.constexpr = False,
    ):
        # A target outside [0, V) that is not ignore_index is *absent* from this slice of the vocabulary (the
        # vocabulary-parallel op's rows whose class another rank holds): its row counts, z[y] is 0 and the gradient
        # has no one-hot term.
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
                xk, k = pick(base, y, valid & (y >= 0) & (y < V))
                zk, _t = _ce_z(xk, scale, softcap, inv_softcap, SOFTCAP, FAST_TANH, RN)
                zy = tl.sum(tl.where(k == 0, zk, 0.0), axis=0)
        else:
            # Pass 1: per-lane online max and sum of e^(z - max) without the max (no cross-warp reduction per
            # slice), plus the label-smoothing sum and z[y], picked up on the way.
            m, r = stats_init(BLOCK_V)
            sz = tl.zeros([BLOCK_V], dtype=tl.float32)   # sum of z, for label smoothing
            zyv = tl.zeros([BLOCK_V], dtype=tl.float32)  # z[y]
            for start in range(0, V, BLOCK_V):
                cols = start + cols0
                mask = cols < V
                z, _t = _ce_z(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32), scale, softcap,
                              inv_softcap, SOFTCAP, FAST_TANH, RN)
                m, r, _q, _d, _up = stats_update(m, r, tl.where(mask, z, -float("inf")))
                if SMOOTH:
                    sz += tl.where(mask, z, 0.0)
                zyv += tl.where(cols == y, z, 0.0)
            mx, ls, _w, _s = stats_finish(m, r, BLOCK_V)
            zy = tl.sum(zyv, axis=0)
            if LOSS_IS_ZY:  # the target logit itself (0 where absent or ignored), for a cross-rank combine
                tl.store(loss_ptr + row, tl.where(valid, zy, 0.0))
            elif WRITE_LOSS:
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
            dy = expm1((zy - mx) - ls)
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


    @triton.jit(do_not_specialize=["n"])
    def _scale_by_device_scalar_kernel(x_ptr, n, g_ptr, BLOCK: tl.constexpr):
        # x *= g in place, g read from device memory. With g == 1 (loss.backward() straight on the loss) the
        # programs return without touching x: the common case costs one launch, not a read and write of x.
        g = tl.load(g_ptr)
        if g != 1.0:  # NaN != 1 too: a NaN factor (consumed gradients) still poisons x
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            x = tl.load(x_ptr + offs, mask=m)
            tl.store(x_ptr + offs, (x.to(tl.float32) * g).to(x_ptr.dtype.element_ty), mask=m)


_SCALE_CONSTS = dict(BLOCK=4096, num_warps=8)


def _scale_key(t: torch.Tensor, g: torch.Tensor) -> tuple:
    """The specialisation of :func:`scale_by_device_scalar_`'s kernel for ``t`` (``n`` is not specialised on: only
    the dtypes and t's alignment make a new kernel)."""
    return (t.device.index, t.dtype, t.data_ptr() % 16 == 0, g.dtype)


def scale_by_device_scalar_(t: torch.Tensor, g: torch.Tensor) -> None:
    """``t *= g`` in place for a contiguous ``t`` and a 0-dim fp32 ``g`` on the same device, without a host sync.

    On CUDA this is one vectorised Triton pass, skipped on the device when g == 1. ``t.mul_(g)`` with a bf16
    ``t`` and an fp32 0-dim CUDA ``g`` takes ATen's non-vectorised dynamic-cast path: 2.6 ms for a Gemma-2
    grad_weight on the H200, where one read and write of it takes ~0.6 ms."""
    if t.numel() == 0:
        return
    if use_triton(t, FORCE_TRITON) and t.is_contiguous():
        if background_compile.in_flight():  # its warm-up (lce_prewarm) still compiling: wait for it
            background_compile.wait_for(_scale_by_device_scalar_kernel, _scale_key(t, g))
        _scale_by_device_scalar_kernel[(triton.cdiv(t.numel(), _SCALE_CONSTS["BLOCK"]),)](t, t.numel(), g,
                                                                                         **_SCALE_CONSTS)
    else:
        t.mul_(g)


def _rows_launch(buf, target, g, loss_out, lse_out, lse_in, ignore_index, scale, softcap, eps, write_grad,
                 zy_out=False):
    """(args, constexprs) of one row-kernel launch over the [C, V] chunk ``buf`` (the grid is (C,))."""
    C, V = buf.shape
    # fp32 logits keep the exact tanh (tanh.approx's ~2^-11 relative error is far above fp32's: 1e-4 on the loss at
    # softcap 30); bf16 / fp16 logits are rounded coarser than that already.
    _, BLOCK_V, num_warps, fast_tanh = row_launch_config(buf, _ROW_DEFAULTS, ROW_CONFIG,
                                                         (torch.bfloat16, torch.float16))
    dummy = target  # any tensor: pointers the constexpr flags switch off are never dereferenced
    st = lse_in if lse_in is not None else lse_out
    args = (buf, buf.stride(0), target,
            g if g is not None else dummy, (g.stride(0) if (g is not None and g.dim() == 1) else 0),
            loss_out if loss_out is not None else dummy,
            st[0] if st is not None else dummy, st[1] if st is not None else dummy,
            V, int(ignore_index), float(scale), float(softcap or 1.0), 1.0 / float(softcap or 1.0), float(eps))
    consts = dict(HAVE_LSE=lse_in is not None, WRITE_LSE=lse_out is not None and lse_in is None,
                  WRITE_LOSS=loss_out is not None, WRITE_GRAD=bool(write_grad),
                  SOFTCAP=bool(softcap), SMOOTH=eps != 0.0, BLOCK_V=BLOCK_V, FAST_TANH=fast_tanh, RN=rounded_z(buf),
                  LOSS_IS_ZY=bool(zy_out), num_warps=num_warps)
    return args, consts


def _rows_key(args, consts) -> tuple:
    """What Triton compiles a new row kernel for: the pointers' dtypes, the integer arguments (by value: V and
    ignore_index are the model's, the strides V and 0 or 1), the constexprs, the logits' alignment."""
    buf = args[0]
    return (buf.device.index, buf.data_ptr() % 16 == 0,
            tuple(a.dtype if isinstance(a, torch.Tensor) else (a if isinstance(a, int) else float) for a in args),
            tuple(sorted(consts.items())))


def _rows_triton(buf, target, g, loss_out, lse_out, lse_in, ignore_index, scale, softcap, eps, write_grad,
                 zy_out=False):
    """Launch the row kernel on one [C, V] chunk (same contract as :func:`_rows_torch`; ``lse_out`` / ``lse_in``
    are [2, C] fp32 row statistics: row 0 the max, row 1 log S)."""
    C, V = buf.shape
    if C == 0:
        return
    assert buf.stride(1) == 1, "logits chunk rows must be contiguous"
    args, consts = _rows_launch(buf, target, g, loss_out, lse_out, lse_in, ignore_index, scale, softcap, eps,
                                write_grad, zy_out)
    if background_compile.in_flight():  # its warm-up (lce_prewarm) still compiling: wait, do not compile it twice
        background_compile.wait_for(_lce_rows_kernel, _rows_key(args, consts))
    _lce_rows_kernel[(C,)](*args, **consts)


_prewarmed: set = set()


def lce_prewarm(hidden, weight, target, bias, ignore_index: int, reduction: str, softcap: float, scale: float,
                label_smoothing: float, grad_in_forward: bool, need_gh: bool, need_gw: bool, need_gb: bool,
                device: Optional[torch.device] = None) -> None:
    """From the forward op's fake impl (fxfuse's validation and AOTAutograd trace the loss graph before its first
    real call): start compiling, on the warm-up threads (``background_compile.py``), the row kernel's launches of
    the coming forward and backward and the backward's gradient scaling, so that the first step does not stop for
    their JIT (0.3 s alone on the H200, 0.7-1.5 s in the first step of an 8B-wide model under FSDP2). Reads
    only shapes, dtypes and the device (meta tensors welcome, with ``device`` where the launches will run); the
    stand-ins are small real tensors of the launches' dtypes (each allocation 16-byte aligned, as the chunk buffer
    and the fresh gradients are)."""
    V = weight.shape[0]
    device = hidden.device if device is None else device
    if not (HAVE_TRITON and (background_compile.can_start(device) or (background_compile.ENABLED and FORCE_TRITON))) \
            or not isinstance(V, int):
        return  # (FORCE_TRITON: the CPU tests' keys; background_compile.start itself starts nothing but on CUDA)
    gb = need_gb and bias is not None
    write_grad = bool(grad_in_forward) and (need_gh or need_gw or gb)
    key = (device, hidden.dtype, weight.dtype, None if bias is None else bias.dtype, V, int(ignore_index),
           reduction, bool(softcap), float(label_smoothing) != 0.0, write_grad, need_gh, need_gw, gb)
    if key in _prewarmed:
        return
    _prewarmed.add(key)
    with torch.utils._python_dispatch._disable_current_modes():  # plain tensors: nothing traced, nothing faked
        f32 = dict(dtype=torch.float32, device=device)
        buf = torch.empty((1, V), dtype=hidden.dtype, device=device)
        tgt = torch.empty(1, dtype=torch.long, device=device)
        g = torch.empty((), **f32)
        launches = [(buf, tgt, g, torch.empty(1, **f32), torch.empty((2, 1), **f32), None, write_grad)]
        if not grad_in_forward and (need_gh or need_gw or gb):  # lce_backward's recompute launch
            # per-token upstream grads: a contiguous tensor (an expanded one, loss.sum()'s, is another kernel)
            g_bwd = torch.empty(1, **f32) if reduction == "none" else g
            launches.append((buf, tgt, g_bwd, None, None, torch.empty((2, 1), **f32), True))
        for b, t, gg, loss_out, lse_out, lse_in, wg in launches:
            args, consts = _rows_launch(b, t, gg, loss_out, lse_out, lse_in, ignore_index, scale, softcap,
                                        label_smoothing, wg)
            background_compile.start(_lce_rows_kernel, _rows_key(args, consts), device, (1,), args, consts)
        if write_grad:  # the backward scales the saved gradients by the upstream grad (linear_cross_entropy.py)
            for dt in {dt for dt, need in ((hidden.dtype, need_gh), (weight.dtype, need_gw),
                                           (None if bias is None else bias.dtype, gb)) if need}:
                t16 = torch.empty(16, dtype=dt, device=device)
                background_compile.start(_scale_by_device_scalar_kernel, _scale_key(t16, g), device, (1,),
                                         (t16, t16.numel(), g), dict(_SCALE_CONSTS))


# ================================================================================================ PyTorch twin
def _rows_torch(buf, target, g, loss_out, lse_out, lse_in, ignore_index, scale, softcap, eps, write_grad,
                zy_out=False):
    """The row step in PyTorch (CPU path). Same in-place contract as the kernel:

    reads the [C, V] logits in ``buf``; writes per-row loss (fp32, 0 for ignored rows; with ``zy_out`` the target
    logit z[y] instead, 0 where absent or ignored) into ``loss_out`` and the
    row statistics into ``lse_out`` ([2, C] fp32: the max, log S; unless ``lse_in`` is given, then it is used
    instead of being computed); when ``write_grad``, overwrites ``buf`` with ``g * d loss_row / d logits`` (zeros
    in ignored rows). A target outside [0, V) that is not ``ignore_index`` is absent from this vocabulary slice: the
    row counts, with no one-hot term.
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
    present = valid & (target >= 0) & (target < V)
    y = torch.where(present, target, 0).unsqueeze(1)
    if zy_out:
        loss_out.copy_(torch.where(present, z.gather(1, y).squeeze(1), 0.0))
        loss_out = None
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
        # the one-hot term where the target is in this slice; an absent target's column keeps its p
        d.scatter_(1, y, torch.where(present, dy, torch.where(valid, d.gather(1, y).squeeze(1), 0.0)).unsqueeze(1))
        if eps:
            d -= eps / V
        coef = torch.where(valid, g.float().expand(C), 0.0) * scale
        d *= coef.unsqueeze(1)
        if t is not None:
            d *= 1.0 - t * t
        buf.copy_(d)


# ================================================================================================ chunk driver
def lce_forward(hidden, weight, target, bias, ignore_index: int, reduction: str, softcap: float, scale: float,
                label_smoothing: float, grad_in_forward: bool, need_gh: bool, need_gw: bool, need_gb: bool,
                chunk_bytes: int, target_logit: bool = False):
    """Forward of the fused op. hidden [N, D], weight [V, D], target [N], bias [V] or None.

    Returns (loss, lse, grad_hidden, grad_weight, grad_bias): loss fp32 ([] or [N] for "none"), lse the row
    statistics, fp32 [2, N] (row 0 the row max mx, row 1 ls = log sum exp(z - mx); logsumexp = mx + ls); the grads
    (for upstream grad 1, in the input dtype) only when ``grad_in_forward``, else empty tensors.
    ``target_logit`` (reduction "none", no gradients): ``loss`` holds each row's target logit z[y] instead (0 where
    the target is ignored or outside [0, V)), for the vocabulary-parallel op's combine across ranks.
    """
    N = hidden.shape[0]
    rows = _rows_triton if use_triton(hidden, FORCE_TRITON) else _rows_torch
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
             label_smoothing, write_grad, target_logit)

    gh, gw, gb = chunk_loop(hidden, weight, bias, step, need_gh, need_gw, need_gb and bias is not None,
                             chunk_bytes, write_grad)
    if reduction == "none":
        loss = loss_rows
    elif reduction == "sum":
        loss = loss_rows.sum()
    else:
        loss = loss_rows.sum() / n_valid  # 0/0 = nan when every row is ignored, like torch
    return loss, lse, gh, gw, gb


def lce_forward_split_vocab(hidden, weight, local_target, ignore_index: int, reduction: str, softcap: float,
                            scale: float, need_gh: bool, need_gw: bool, chunk_bytes: int, combine, chunk_vocab: int):
    """Forward of the vocabulary-parallel op with its gradients (for upstream grad 1), over this rank's slice
    ``weight`` [V_local, D] of the vocabulary; ``local_target`` [N] as :func:`_rows_torch` reads it (a class of
    another rank's slice is outside [0, V_local): absent).

    Chunk by chunk: the logits (one matmul), this rank's row statistics and target logits, then
    ``combine(mx, ls) -> (M, log_S)`` (the caller's collectives: the whole vocabulary's max and log S of the
    chunk's rows; every rank cuts the same chunks, counted for ``chunk_vocab`` vocabulary rows), then the gradient
    over the chunk from those (the one-hot term only where the target is this rank's) and the grad_hidden /
    grad_weight matmuls: three matmuls, as the one-rank op, where recomputing the logits in the backward would take
    four. Returns (stats [2, N] fp32: M, log S; zy [N] fp32; grad_hidden [N, D]
    fp32, this rank's part of the sum over the vocabulary; grad_weight [V_local, D])."""
    N = hidden.shape[0]
    rows = _rows_triton if use_triton(hidden, FORCE_TRITON) else _rows_torch
    local_target = local_target.contiguous()
    zy = torch.empty(N, dtype=torch.float32, device=hidden.device)
    lse_local = torch.empty((2, N), dtype=torch.float32, device=hidden.device)
    stats = torch.empty((2, N), dtype=torch.float32, device=hidden.device)
    n_valid = (local_target != ignore_index).sum()
    g = 1.0 / n_valid.to(torch.float32) if reduction == "mean" else \
        torch.ones((), dtype=torch.float32, device=hidden.device)

    def step(buf, s, e):
        t = local_target[s:e]
        rows(buf, t, g, zy[s:e], lse_local[:, s:e], None, ignore_index, scale, softcap, 0.0, False, True)
        m, log_s = combine(lse_local[0, s:e], lse_local[1, s:e])
        stats[0, s:e].copy_(m)
        stats[1, s:e].copy_(log_s)
        rows(buf, t, g, None, None, stats[:, s:e], ignore_index, scale, softcap, 0.0, True)

    gh, gw, _gb = chunk_loop(hidden, weight, None, step, need_gh, need_gw, False, chunk_bytes, True,
                             grad_hidden_fp32=True, chunk_vocab=chunk_vocab)
    return stats, zy, gh, gw


def lce_backward(grad_loss, hidden, weight, target, bias, lse, ignore_index: int, reduction: str, softcap: float,
                 scale: float, label_smoothing: float, need_gh: bool, need_gw: bool, need_gb: bool,
                 chunk_bytes: int, grad_hidden_fp32: bool = False):
    """Backward by recomputation (``grad_in_forward=False``): logits chunk by chunk from the saved row statistics
    ``lse`` ([2, N]: max, log S), with the upstream grad ``grad_loss`` ([] for mean/sum, [N] for "none").
    Returns (grad_hidden, grad_weight, grad_bias); grad_hidden in fp32 with ``grad_hidden_fp32``."""
    rows = _rows_triton if use_triton(hidden, FORCE_TRITON) else _rows_torch
    target = target.contiguous()
    g = grad_loss.to(torch.float32)
    if reduction == "mean":
        g = g / (target != ignore_index).sum().to(torch.float32)
    per_row = g.dim() == 1

    def step(buf, s, e):
        rows(buf, target[s:e], g[s:e] if per_row else g, None, None, lse[:, s:e], ignore_index, scale, softcap,
             label_smoothing, True)

    return chunk_loop(hidden, weight, bias, step, need_gh, need_gw, need_gb and bias is not None, chunk_bytes,
                       True, grad_hidden_fp32)


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
