"""Fused linear + cross-entropy: the row kernel, its launcher, the chunk driver, a PyTorch row path and a float64
reference, side by side.

What is computed (``fxfuse::linear_cross_entropy``)::

    logits = hidden @ weight.T (+ bias)                      # [N, V], cuBLAS, in the input dtype
    z      = logits * scale                                  # fp32 from here on
    z      = softcap * tanh(z / softcap)       if softcap
    lse    = logsumexp(z, -1)
    loss_t = (1 - eps) * (lse_t - z_t[y_t]) + eps * (lse_t - mean_v z_t,v)   (0 where y_t == ignore_index)

Why it is shaped this way (design notes, sec. 6):

* The floor is the three N*D*V matmuls (6*N*D*V flops). They stay in cuBLAS; what fusion saves is the [N, V]
  fp32 logits/softmax traffic and its memory. We therefore chunk over tokens: per chunk of C tokens one bf16
  [C, V] buffer (reused across chunks) receives the logits from cuBLAS, one Triton *row kernel* turns it, in
  place, into d loss / d logits, and two more cuBLAS calls consume it (grad_hidden[chunk] = dlogits @ W,
  grad_weight += dlogits^T @ h[chunk]).
* ``grad_in_forward=True``: the row kernel writes the gradient during the forward (for upstream grad 1); the
  backward only scales the saved gradients by the upstream scalar. 3 matmuls in all.
  ``grad_in_forward=False``: the forward keeps only lse [N]; the backward recomputes the logits chunk by chunk and
  applies arbitrary per-token upstream grads (reduction="none", GRPO-style losses). 4 matmuls.
* No host syncs: the count of non-ignored rows (for "mean") stays a device scalar and reaches the kernel through a
  pointer (``g``: per-row gradient weight, stride 0 for a broadcast scalar).

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

from ._triton import HAVE_TRITON, tl, triton

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
#: Row-kernel launch settings (BLOCK_V, num_warps, FAST_TANH, LANE_ONLINE); measured choices in lce_notes.md.
ROW_CONFIG: dict = {}
#: Measured on H200 (benchmarks/lce_notes.md): per-lane online max + tanh.approx were the fastest row settings
#: (Llama-3 head 2.33 -> 2.01 ms/step, Gemma-2 head with softcap 7.07 -> 4.66 ms/step).
_ROW_DEFAULTS = dict(BLOCK_V=4096, num_warps=16, LANE_ONLINE=True, FAST_TANH=True)
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
    def _lce_rows_kernel(
        logits_ptr, stride_row,          # [C, V] chunk, overwritten with d loss / d logits when WRITE_GRAD
        target_ptr,                      # [C] int64
        g_ptr, stride_g,                 # per-row gradient weight (fp32); stride 0 = one device scalar
        loss_ptr,                        # [C] fp32 per-row loss (WRITE_LOSS)
        lse_ptr,                         # [C] fp32 lse: written (WRITE_LSE) or read (HAVE_LSE)
        V, ignore_index, scale, softcap, inv_softcap, eps,
        HAVE_LSE: tl.constexpr, WRITE_LSE: tl.constexpr, WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
        SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr, BLOCK_V: tl.constexpr, FAST_TANH: tl.constexpr,
        LANE_ONLINE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # int64: C * V exceeds 2**31 for big budgets
        base = logits_ptr + row * stride_row
        y = tl.load(target_ptr + row)
        valid = y != ignore_index
        cols0 = tl.arange(0, BLOCK_V)

        if HAVE_LSE:
            lse = tl.load(lse_ptr + row)
        else:
            # Pass 1: online logsumexp. The running max is a scalar (one tl.max per slice) so that lanes that
            # are masked in every slice (V < BLOCK_V) never produce exp(-inf - -inf) = nan.
            # LANE_ONLINE keeps a running max per lane instead (finite -1e30 start, so never inf - inf): no
            # cross-warp reduction per slice, one more exp per element.
            if LANE_ONLINE:
                m = tl.full([BLOCK_V], -1e30, dtype=tl.float32)
                s = tl.zeros([BLOCK_V], dtype=tl.float32)
            else:
                m = -float("inf")
                s = 0.0
            sz = tl.zeros([BLOCK_V], dtype=tl.float32)   # sum of z, for label smoothing
            zy = tl.zeros([BLOCK_V], dtype=tl.float32)   # z[y], picked up on the way
            for start in range(0, V, BLOCK_V):
                cols = start + cols0
                mask = cols < V
                z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * scale
                if SOFTCAP:
                    z = softcap * _tanh(z * inv_softcap, FAST_TANH)
                zm = tl.where(mask, z, -float("inf"))
                if LANE_ONLINE:
                    m_new = tl.maximum(m, zm)
                    s = s * tl.exp(m - m_new) + tl.exp(zm - m_new)
                else:
                    m_new = tl.maximum(m, tl.max(zm, axis=0))
                    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(zm - m_new), axis=0)
                m = m_new
                if SMOOTH:
                    sz += tl.where(mask, z, 0.0)
                zy += tl.where(cols == y, z, 0.0)
            if LANE_ONLINE:
                mx = tl.max(m, axis=0)
                lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
            else:
                lse = m + tl.log(s)
            if WRITE_LOSS:
                loss = lse - tl.sum(zy, axis=0)
                if SMOOTH:
                    loss = (1.0 - eps) * loss + eps * (lse - tl.sum(sz, axis=0) / V)
                tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        if WRITE_LSE:
            tl.store(lse_ptr + row, lse)

        if WRITE_GRAD:
            # Pass 2: recompute z from the (still unmodified) logits and store the gradient over them.
            # d loss/d z = softmax - (1-eps)*onehot - eps/V; times g (1/n_valid, 1 or the upstream per-token grad);
            # times dz/dlogit = scale * (1 - tanh^2) with softcap, scale without. Ignored rows get exact zeros.
            coef = tl.where(valid, tl.load(g_ptr + row * stride_g), 0.0) * scale
            for start in range(0, V, BLOCK_V):
                cols = start + cols0
                mask = cols < V
                z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * scale
                if SOFTCAP:
                    t = _tanh(z * inv_softcap, FAST_TANH)
                    z = softcap * t
                d = tl.exp(z - lse) - tl.where(cols == y, 1.0 - eps, 0.0)
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
    """Launch the row kernel on one [C, V] chunk (same contract as :func:`_rows_torch`)."""
    C, V = buf.shape
    if C == 0:
        return
    assert buf.stride(1) == 1, "logits chunk rows must be contiguous"
    cfg, BLOCK_V, num_warps, fast_tanh = row_launch_config(buf, _ROW_DEFAULTS, ROW_CONFIG)
    dummy = target  # any tensor: pointers the constexpr flags switch off are never dereferenced
    _lce_rows_kernel[(C,)](
        buf, buf.stride(0), target,
        g if g is not None else dummy, (g.stride(0) if (g is not None and g.dim() == 1) else 0),
        loss_out if loss_out is not None else dummy,
        lse_in if lse_in is not None else (lse_out if lse_out is not None else dummy),
        V, int(ignore_index), float(scale), float(softcap or 1.0), 1.0 / float(softcap or 1.0), float(eps),
        HAVE_LSE=lse_in is not None, WRITE_LSE=lse_out is not None and lse_in is None,
        WRITE_LOSS=loss_out is not None, WRITE_GRAD=bool(write_grad),
        SOFTCAP=bool(softcap), SMOOTH=eps != 0.0, BLOCK_V=BLOCK_V, FAST_TANH=fast_tanh,
        LANE_ONLINE=bool(cfg.get("LANE_ONLINE")), num_warps=num_warps,
    )


# ================================================================================================ PyTorch twin
def _rows_torch(buf, target, g, loss_out, lse_out, lse_in, ignore_index, scale, softcap, eps, write_grad):
    """The row step in PyTorch (CPU path). Same in-place contract as the kernel:

    reads the [C, V] logits in ``buf``; writes per-row loss (fp32, 0 for ignored rows) into ``loss_out`` and lse
    into ``lse_out`` (unless ``lse_in`` is given, then it is used instead of being computed); when
    ``write_grad``, overwrites ``buf`` with ``g * d loss_row / d logits`` (zeros in ignored rows).
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
    lse = torch.logsumexp(z, dim=-1) if lse_in is None else lse_in
    if loss_out is not None:
        loss = lse - z.gather(1, y).squeeze(1)
        if eps:
            loss = (1.0 - eps) * loss + eps * (lse - z.mean(dim=-1))
        loss_out.copy_(torch.where(valid, loss, 0.0))
    if lse_out is not None and lse_in is None:
        lse_out.copy_(lse)
    if write_grad:
        d = torch.exp(z - lse.unsqueeze(1))
        del z
        d.scatter_add_(1, y, torch.full_like(y, -(1.0 - eps), dtype=d.dtype))
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

    Returns (loss, lse, grad_hidden, grad_weight, grad_bias): loss fp32 ([] or [N] for "none"), lse fp32 [N];
    the grads (for upstream grad 1, in the input dtype) only when ``grad_in_forward``, else empty tensors.
    """
    N = hidden.shape[0]
    rows = _rows_triton if _use_triton(hidden) else _rows_torch
    target = target.contiguous()
    loss_rows = torch.empty(N, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
    n_valid = (target != ignore_index).sum()  # device scalar: no host sync
    if reduction == "mean":
        g = 1.0 / n_valid.to(torch.float32)   # inf when all rows are ignored; ignored rows never read it
    else:
        g = torch.ones((), dtype=torch.float32, device=hidden.device)
    write_grad = bool(grad_in_forward) and (need_gh or need_gw or (need_gb and bias is not None))

    def step(buf, s, e):
        rows(buf, target[s:e], g, loss_rows[s:e], lse[s:e], None, ignore_index, scale, softcap,
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
    """Backward by recomputation (``grad_in_forward=False``): logits chunk by chunk from the saved lse, with the
    upstream grad ``grad_loss`` ([] for mean/sum, [N] for "none"). Returns (grad_hidden, grad_weight, grad_bias)."""
    rows = _rows_triton if _use_triton(hidden) else _rows_torch
    target = target.contiguous()
    g = grad_loss.to(torch.float32)
    if reduction == "mean":
        g = g / (target != ignore_index).sum().to(torch.float32)
    per_row = g.dim() == 1

    def step(buf, s, e):
        rows(buf, target[s:e], g[s:e] if per_row else g, None, None, lse[s:e], ignore_index, scale, softcap,
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
