"""Fused linear + per-token log-probabilities (and entropy): the row kernel, its launcher, a PyTorch row path,
the chunk drivers and a float64 reference, side by side.

What is computed (``fxfuse::linear_log_probs``), for every token row t (no ignore_index: every row is real)::

    logits = hidden @ weight.T (+ bias)                      # [N, V], cuBLAS, in the input dtype
    z      = logits                                          # fp32 from here on
    z      = softcap * tanh(z / softcap)       if softcap    # FIRST the softcap (Gemma-2: inside the model)
    z      = z / temperature                                 # THEN the temperature (TRL: in the trainer)
    mx_t   = max_v z_t,v,   ls_t = log sum_v exp(z_t,v - mx_t)   # the row normaliser, two fp32 numbers (below)
    logp_t = (z_t[index_t] - mx_t) - ls_t                    # = log_softmax(z_t)[index_t]
    H_t    = ls_t - sum_v p_t,v * (z_t,v - mx_t)             # entropy, p = softmax(z)

and, when asked, three per-token statistics without a gradient (what TRL's trainers log or weight by: SFT's token
accuracy, DPO / KTO's mean logit, DPO's WPO weighting)::

    top1_t = index_t is the FIRST argmax of z_t             # (z_y >= mx) & (z_y > max_{v < y} z_v): argmax's tie rule
    mean_t = sum_v z_t,v / V
    lsq_t  = log sum_v p_t,v^2 = log sum_v exp(2 (z_t,v - mx_t)) - 2 ls_t

The order softcap -> temperature is TRL's (GRPO/DPO trainers divide the model's logits, which Gemma-2 has already
softcapped, by the temperature): ``z = softcap(logits) / temperature``.

Gradients (backward by recomputation; the forward saves the row statistics [2, N] = (mx, ls) and, with entropy,
E_p[z] - mx [N], all fp32), for arbitrary per-token upstream grads g_logp [N] and g_ent [N] (advantages, masks,
importance ratios)::

    d logp_t / d z_t = onehot(index_t) - p_t,     p_t,v = exp((z_t,v - mx_t) - ls_t)
                       (at index_t: 1 - p = -expm1((z_t[index_t] - mx_t) - ls_t), one scalar per row)
    d H_t    / d z_t = -p_t * ((z_t - mx_t) - (E_p[z_t] - mx_t))
    d z / d logits   = (1 - tanh^2(logits / softcap)) / temperature      (1 / temperature without softcap)

Memory: like the LCE op (:mod:`fxfuse.kernels.linear_cross_entropy`; both run the chunk loop of
:mod:`fxfuse.kernels.lm_head_rows`), one [C, V] logits buffer of ``chunk_bytes`` (default 256 MiB) is reused across
token chunks; the row kernel reads it (forward: the row statistics, the picked logit, the entropy) or overwrites it
in place with d loss / d logits (backward), and cuBLAS does the three matmuls (logits chunk, grad_hidden[chunk] =
dlogits @ W, grad_weight += dlogits^T @ h).

Precision: the row normaliser is two fp32 numbers, not one lse (:mod:`~fxfuse.kernels.lm_head_rows` and the LCE
kernel module explain why; the former holds the shared helpers ``stats_*``, ``expm1``, ``pick``, ``mul_rn``):
``mx`` the row max (one of the z values, so z - mx is exact at the max) and ``ls = log1p(S - 1)``, S = sum
e^(z-mx), S - 1 summed without the max element's 1 (per lane online: max m, r = sum e^(z-m) without the lane's
max, t = sum e^(z-m) (z-m)). One fp32 lse rounds to ~|lse| * 6e-8 absolute, which swamps log-probs near 0
(peaked rows: logp ~ -1e-6) and their gradient 1 - p_y; ``(z - mx) - ls`` keeps them at their relative precision.
The entropy ``H = log1p(S - 1) - T / S`` with T = sum e^(z-mx) (z-mx) has two terms >= 0 (no cancellation between
lse and E_p[z], which loses ~|z| * 1e-7 absolute in fp32), and its gradient uses z - E_p[z] = (z - mx) - T/S (E_p[z]
is saved relative to mx).

The PyTorch row step (``_rows_torch_*``) runs on CPU and is the CI twin of the kernel; the Triton kernel runs on
CUDA, or on CPU under ``TRITON_INTERPRET=1`` when ``FORCE_TRITON`` (env ``FXFUSE_LOGP_FORCE_TRITON=1``) is set.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from .lm_head_rows import chunk_loop, rounded_z, row_launch_config, row_stats_torch
from .triton_support import HAVE_TRITON, tl, triton, use_triton

if HAVE_TRITON:
    from .lm_head_rows import expm1, log1p, mul_rn, pick, softcap_tanh, stats_finish, stats_init, stats_update

__all__ = [
    "FORCE_TRITON",
    "logp_forward",
    "logp_forward_with_grads",
    "logp_backward",
    "logp_forward_split_vocab",
    "logp_reference",
    "logp_stats_reference",
]

#: Run the Triton row kernel on CPU tensors too (needs TRITON_INTERPRET=1); for tests.
FORCE_TRITON = os.environ.get("FXFUSE_LOGP_FORCE_TRITON", "0") == "1"
#: Row-kernel launch settings (BLOCK_V, num_warps, FAST_TANH); overrides of _ROW_DEFAULTS.
ROW_CONFIG: dict = {}
#: Same starting point as the LCE row kernel (benchmarks/lce_notes.md). FAST_TANH (tanh.approx.f32, ~2^-11
#: relative) is used only for bf16/fp16 logits, where it is below the logits' own rounding; fp32 inputs get the
#: exact tanh (RL importance ratios exp(logp - old_logp) are sensitive to a 30 * 2^-11 error in z).
_ROW_DEFAULTS = dict(BLOCK_V=4096, num_warps=16, FAST_TANH=True)


# ================================================================================================ Triton kernel
if HAVE_TRITON:

    @triton.jit
    def _logp_z(x, inv_temp, softcap, inv_softcap, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr,
                RN: tl.constexpr):
        """(z, th) from the fp32 logits x: first the softcap (th = the tanh), then / temperature; the final product
        rounded (``mul_rn``: z - mx exactly 0 at the max on CUDA too)."""
        th = x
        if SOFTCAP:
            th = softcap_tanh(x * inv_softcap, FAST_TANH)
            x = softcap * th
        return mul_rn(x, inv_temp, RN), th

    # per-row pointers: no alignment specialisation (see linear_cross_entropy._lce_rows_kernel)
    @triton.jit(do_not_specialize_on_alignment=["index_ptr", "logp_ptr", "ent_ptr", "mx_ptr", "ls_ptr", "ez_ptr",
                                                "glogp_ptr", "gent_ptr", "top1_ptr", "mean_ptr", "lsq_ptr"])
    def _logp_rows_kernel(
        logits_ptr, stride_row,          # [C, V] chunk; overwritten with d loss / d logits when BACKWARD
        index_ptr,                       # [C] int64
        logp_ptr, ent_ptr,               # [C] fp32 outputs (forward)
        mx_ptr, ls_ptr, ez_ptr,          # [C] fp32: written (forward) or read (backward): row max, log S and
                                         #   E_p[z] - mx
        glogp_ptr, stride_gl,            # [C] upstream grad of logp (backward, HAS_GLOGP)
        gent_ptr, stride_ge,             # [C] upstream grad of the entropy (backward, HAS_GENT)
        top1_ptr, mean_ptr, lsq_ptr,     # [C] forward statistics without a gradient: uint8 / fp32 / fp32
        V, inv_temp, softcap, inv_softcap,
        BACKWARD: tl.constexpr, ENTROPY: tl.constexpr, HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr,
        SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, FAST_TANH: tl.constexpr, RN: tl.constexpr,
        TOP1: tl.constexpr, MEAN: tl.constexpr, LSQ: tl.constexpr, LOGP_IS_ZY: tl.constexpr = False,
    ):
        row = tl.program_id(0).to(tl.int64)  # int64: C * V exceeds 2**31 for big budgets
        base = logits_ptr + row * stride_row
        # An index outside [0, V) is *absent* from this slice of the vocabulary (the vocabulary-parallel op: another
        # rank holds it): no column matches it, so it picks no logit (z_y = 0) and gets no one-hot term.
        y = tl.load(index_ptr + row)
        cols0 = tl.arange(0, BLOCK_V)

        if not BACKWARD:
            # One pass, per-lane online softmax statistics (shared with the LCE kernel: m, r = sum e^(z-m) without
            # the lane's max) and, with ENTROPY, t = sum e^(z-m) (z-m).
            m, r = stats_init(BLOCK_V)
            t = tl.zeros([BLOCK_V], dtype=tl.float32)
            zy = tl.zeros([BLOCK_V], dtype=tl.float32)
            # the statistics without a gradient, per lane like (m, r): the max of z before the index column; the
            # sum of z; sum e^(2 (z - m)) without the lane's max (-1 = not hit yet, as r)
            zb = tl.full([BLOCK_V], -float("inf"), dtype=tl.float32)
            zsum = tl.zeros([BLOCK_V], dtype=tl.float32)
            q2 = tl.full([BLOCK_V], -1.0, dtype=tl.float32)
            for start in range(0, V, BLOCK_V):
                cols = start + cols0
                mask = cols < V
                z, _th = _logp_z(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32), inv_temp, softcap,
                                 inv_softcap, SOFTCAP, FAST_TANH, RN)
                m_new, r_new, q, dz, up = stats_update(m, r, tl.where(mask, z, -float("inf")))
                if ENTROPY:
                    # new max (dz = z - m > 0): t rescales by q = e^-dz and shifts by -dz per element (r + 1 = the
                    # lane's full sum, 0 for a lane not hit yet); else the element adds q * dz = e^(z-m) (z-m)
                    dz = tl.where(mask, dz, 0.0)  # masked lanes: -inf (q = 0, up false): no nan from 0 * inf
                    t = tl.where(up, q * (t - dz * (r + 1.0)), t + q * dz)
                if LSQ:  # e^(2 (z - m)) = q^2 for a new element, the rescale of the old sum for a new max
                    q2 = tl.where(up, (q2 + 1.0) * q * q, q2 + q * q)
                if MEAN:
                    zsum += tl.where(mask, z, 0.0)
                if TOP1:  # columns before the index (all < V)
                    zb = tl.maximum(zb, tl.where(cols < y, z, -float("inf")))
                m = m_new
                r = r_new
                zy += tl.where(cols == y, z, 0.0)
            mx, ls, w, Sm1 = stats_finish(m, r, BLOCK_V)
            zyr = tl.sum(zy, axis=0)
            tl.store(mx_ptr + row, mx)
            tl.store(ls_ptr + row, ls)
            if LOGP_IS_ZY:  # the picked logit itself (0 where absent), for a cross-rank combine
                tl.store(logp_ptr + row, zyr)
            else:
                tl.store(logp_ptr + row, (zyr - mx) - ls)
            if TOP1:  # argmax's rule: the first maximum wins a tie
                tl.store(top1_ptr + row, ((zyr >= mx) & (zyr > tl.max(zb, axis=0))).to(tl.uint8))
            if MEAN:
                tl.store(mean_ptr + row, tl.sum(zsum, axis=0) / V)
            if LSQ:
                # sum e^(2 (z - mx)) - 1 combined over the lanes as stats_finish combines S - 1 (the lane holding
                # the row max gives its sum without the max's 1), then log1p: exact for nearly one-hot rows
                _mx, imx = tl.max(m, axis=0, return_indices=True)
                Q2m1 = tl.sum(tl.where(tl.arange(0, BLOCK_V) == imx, q2, w * w * (q2 + 1.0)), axis=0)
                tl.store(lsq_ptr + row, log1p(Q2m1) - 2.0 * ls)
            if ENTROPY:
                # H = log S - T/S with S = 1 + Sm1, T = sum e^(z-mx) (z-mx) <= 0: both terms >= 0 (no lse - E_p[z]
                # cancellation) and log S = log1p(Sm1) keeps nearly one-hot rows exact.
                T = tl.sum(w * (t + (m - mx) * (r + 1.0)), axis=0)  # lanes never hit: w = 0, r + 1 = 0
                ezr = T / (1.0 + Sm1)
                tl.store(ent_ptr + row, ls - ezr)
                tl.store(ez_ptr + row, ezr)
        else:
            # d loss / d z = g_logp * (onehot - p) - g_ent * p * ((z - mx) - (E_p[z] - mx)); times dz/dlogit.
            # The index entry g_logp * (1 - p_y) = -g_logp * expm1((z_y - mx) - ls) is one scalar per row.
            mx = tl.load(mx_ptr + row)
            ls = tl.load(ls_ptr + row)
            gl = 0.0
            ge = 0.0
            ezr = 0.0
            dy = 0.0
            if HAS_GLOGP:
                gl = tl.load(glogp_ptr + row * stride_gl).to(tl.float32)
                xk, k = pick(base, y, (y >= 0) & (y < V))
                zk, _thk = _logp_z(xk, inv_temp, softcap, inv_softcap, SOFTCAP, FAST_TANH, RN)
                dy = -gl * expm1((tl.sum(tl.where(k == 0, zk, 0.0), axis=0) - mx) - ls)
            if HAS_GENT:
                ge = tl.load(gent_ptr + row * stride_ge).to(tl.float32)
                ezr = tl.load(ez_ptr + row)
            for start in range(0, V, BLOCK_V):
                cols = start + cols0
                mask = cols < V
                z, th = _logp_z(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32), inv_temp, softcap,
                                inv_softcap, SOFTCAP, FAST_TANH, RN)
                zr = z - mx
                p = tl.exp(zr - ls)
                d = tl.zeros([BLOCK_V], dtype=tl.float32)
                if HAS_GLOGP:
                    d = tl.where(cols == y, dy, -gl * p)
                if HAS_GENT:
                    d = d - ge * p * (zr - ezr)
                d = d * inv_temp
                if SOFTCAP:
                    d = d * (1.0 - th * th)
                tl.store(base + cols, d.to(logits_ptr.dtype.element_ty), mask=mask)


def _launch(buf, index, logp, ent, lse, ez, g_logp, g_ent, temperature, softcap, backward, top1=None, mean=None,
            lsq=None, zy_out=False):
    C, V = buf.shape
    if C == 0:
        return
    assert buf.stride(1) == 1, "logits chunk rows must be contiguous"
    # fp32 logits keep the exact tanh: at softcap 30 the approximation's ~2^-11 error is too large for
    # importance ratios.
    _, BLOCK_V, num_warps, fast_tanh = row_launch_config(buf, _ROW_DEFAULTS, ROW_CONFIG,
                                                         (torch.bfloat16, torch.float16))
    dummy = lse  # any fp32 tensor: pointers the constexpr flags switch off are never dereferenced
    _logp_rows_kernel[(C,)](
        buf, buf.stride(0), index,
        logp if logp is not None else dummy, ent if ent is not None else dummy,
        lse[0], lse[1], ez if ez is not None else dummy,
        g_logp if g_logp is not None else dummy, g_logp.stride(0) if g_logp is not None else 0,
        g_ent if g_ent is not None else dummy, g_ent.stride(0) if g_ent is not None else 0,
        top1 if top1 is not None else dummy, mean if mean is not None else dummy, lsq if lsq is not None else dummy,
        V, 1.0 / float(temperature), float(softcap or 1.0), 1.0 / float(softcap or 1.0),
        BACKWARD=bool(backward), ENTROPY=ent is not None, HAS_GLOGP=g_logp is not None,
        HAS_GENT=g_ent is not None, SOFTCAP=bool(softcap), BLOCK_V=BLOCK_V, FAST_TANH=fast_tanh,
        RN=rounded_z(buf), TOP1=top1 is not None, MEAN=mean is not None, LSQ=lsq is not None,
        LOGP_IS_ZY=bool(zy_out), num_warps=num_warps,
    )


def _rows_triton_fwd(buf, index, logp, ent, lse, ez, temperature, softcap, top1=None, mean=None, lsq=None,
                     zy_out=False):
    """Forward row step on one [C, V] chunk (same contract as :func:`_rows_torch_fwd`)."""
    _launch(buf, index, logp, ent, lse, ez, None, None, temperature, softcap, False, top1, mean, lsq, zy_out)


def _rows_triton_bwd(buf, index, lse, ez, g_logp, g_ent, temperature, softcap):
    """Backward row step on one [C, V] chunk (same contract as :func:`_rows_torch_bwd`)."""
    _launch(buf, index, None, None, lse, ez, g_logp, g_ent, temperature, softcap, True)


# ================================================================================================ PyTorch twin
def _z(buf, temperature, softcap):
    z = buf.float()
    th = None
    if softcap:
        th = torch.tanh(z / softcap)
        z = th * softcap
    if temperature != 1.0:
        z = z / temperature
    return z, th


def _rows_torch_fwd(buf, index, logp, ent, lse, ez, temperature, softcap, top1=None, mean=None, lsq=None,
                    zy_out=False):
    """Reads the [C, V] logits in ``buf``; writes logp [C] (with ``zy_out`` the picked logit z[index] instead), the
    row statistics ``lse`` ([2, C]: the row max, log S) and, when ``ent`` is given, the entropy and E_p[z] - mx into
    ``ent`` / ``ez`` ([C]); all fp32. ``top1`` (uint8), ``mean``, ``lsq`` ([C] each, or None): whether the index is
    z's first argmax, the mean of z, log sum p^2. An index outside [0, V) is absent from this vocabulary slice:
    it picks 0 (log-prob ``-mx - ls``)."""
    C, V = buf.shape
    if C == 0:
        return
    z, _ = _z(buf, temperature, softcap)
    present = (index >= 0) & (index < V)
    y = torch.where(present, index, 0).unsqueeze(1)
    if zy_out:
        logp.copy_(torch.where(present, z.gather(1, y).squeeze(1), 0.0))
    if top1 is not None:
        top1.copy_(z.argmax(-1) == index)  # argmax returns the first maximum, the kernel's tie rule
    if mean is not None:
        mean.copy_(z.sum(-1) / z.shape[1])
    mx, ls, zs, e = row_stats_torch(z)  # as in the kernel: log S = log1p(S - 1), S - 1 without the max's 1
    del z
    if lsq is not None:  # sum e^(2 (z - mx)) = 1 + sum of e^2 without the max's 1
        lsq.copy_(torch.log1p((e * e).sum(-1)) - 2.0 * ls)
    lse[0].copy_(mx)
    lse[1].copy_(ls)
    if not zy_out:
        logp.copy_(torch.where(present, zs.gather(1, y).squeeze(1), -mx) - ls)
    if ent is not None:
        # H = log1p(S - 1) - T/S around the row max: exact for nearly one-hot rows too (e is 0 at the max,
        # where zs = 0 contributes nothing to T anyway)
        S = 1.0 + e.sum(-1)
        ezr = (e * zs).sum(-1) / S
        ent.copy_(ls - ezr)
        ez.copy_(ezr)


def _rows_torch_bwd(buf, index, lse, ez, g_logp, g_ent, temperature, softcap):
    """Overwrites ``buf`` (the [C, V] logits) with d(sum g_logp*logp + g_ent*H)/d logits, from the saved row
    statistics ``lse`` ([2, C]) and ``ez`` (E_p[z] - mx, [C])."""
    C, V = buf.shape
    if C == 0:
        return
    z, th = _z(buf, temperature, softcap)
    zs = z - lse[0].unsqueeze(1)  # z - mx
    del z
    p = torch.exp(zs - lse[1].unsqueeze(1))
    if g_logp is not None:
        gl = g_logp.float()
        d = p * -gl.unsqueeze(1)
        present = (index >= 0) & (index < V)
        idx = torch.where(present, index, 0).unsqueeze(1)
        # the index entry g (1 - p_y) = -g expm1((z_y - mx) - ls): accurate for peaked rows; an absent index's
        # column (another rank holds it) keeps its -g p
        dy = -gl * torch.expm1(zs.gather(1, idx).squeeze(1) - lse[1])
        d.scatter_(1, idx, torch.where(present, dy, d.gather(1, idx).squeeze(1)).unsqueeze(1))
    else:
        d = torch.zeros_like(p)
    if g_ent is not None:
        d -= g_ent.float().unsqueeze(1) * p * (zs - ez.unsqueeze(1))
    del p, zs
    if temperature != 1.0:
        d /= temperature
    if th is not None:
        d *= 1.0 - th * th
    buf.copy_(d)


# ================================================================================================ chunk drivers
def logp_forward(hidden, weight, index, bias, temperature: float, softcap: float, entropy: bool,
                 chunk_bytes: int, top1: bool = False, mean_logits: bool = False, log_sum_sq_probs: bool = False,
                 unit_grad: bool = False, target_logit: bool = False):
    """hidden [N, D], weight [V, D], index [N] int64, bias [V] or None.

    Returns (logp [N], entropy [N] or [0], lse [2, N], ez [N] or [0], top1 [N] bool or [0], mean_logits [N] or
    [0], log_sum_sq_probs [N] or [0], unit [N, D] or [0]), fp32 but top1 and unit; ``lse`` = the row statistics
    (row 0 the max mx, row 1 ls = log sum exp(z - mx)), ``ez`` = E_p[z] - mx (saved for the entropy gradient); the
    statistics as asked.

    ``unit_grad`` (a frozen lm-head, log-probs only): also ``unit`` = d logp_t / d hidden_t for an upstream
    gradient of 1, in hidden's dtype. The gradient is linear in the per-token upstream gradient g, so the backward
    is ``g[:, None] * unit``: the chunk that was just projected is turned into d logp / d logits in place and
    multiplied by W (two matmuls in all, where recomputing in the backward takes three).

    ``target_logit`` (no gradients formed): ``logp`` holds each row's picked logit z[index] instead, 0 where the
    index is outside [0, V) (absent from this vocabulary slice): what the vocabulary-parallel op combines."""
    ones = torch.ones(hidden.shape[0] if unit_grad else 0, dtype=torch.float32, device=hidden.device)
    out = logp_forward_with_grads(hidden, weight, index, bias, temperature, softcap, entropy, chunk_bytes,
                                  (lambda s, e, logp, ent: (ones[s:e], None)) if unit_grad else None,
                                  unit_grad, False, False, top1, mean_logits, log_sum_sq_probs,
                                  target_logit=target_logit)
    return out[:7] + (out[7],)


def _row_paths(hidden):
    """(forward, backward) row implementations for ``hidden``'s device: the Triton kernels or their PyTorch twin."""
    if use_triton(hidden, FORCE_TRITON):
        return _rows_triton_fwd, _rows_triton_bwd
    return _rows_torch_fwd, _rows_torch_bwd


def _chunk_into_grads(bwd, buf, index, stats, ez, grads, entropy: bool, temperature: float, softcap: float):
    """Turn a projected chunk into d loss / d logits in place (the backward row step), for the chunk's per-token
    upstream gradients ``grads = (g_logp, g_ent)`` (either None: no term; both None: zeros) and its row statistics
    ``stats`` [2, C] and ``ez`` [C] (E_p[z] - max, read only with an entropy gradient)."""
    g_logp, g_ent = grads
    if g_ent is not None and not entropy:
        raise ValueError("an entropy gradient without the entropy")
    if g_logp is None and g_ent is None:
        g_logp = torch.zeros(buf.shape[0], dtype=torch.float32, device=buf.device)
    bwd(buf, index, stats, ez if g_ent is not None else None, g_logp, g_ent, temperature, softcap)


def logp_forward_with_grads(hidden, weight, index, bias, temperature: float, softcap: float, entropy: bool,
                            chunk_bytes: int, chunk_grads, need_gh: bool, need_gw: bool, need_gb: bool,
                            top1: bool = False, mean_logits: bool = False, log_sum_sq_probs: bool = False,
                            target_logit: bool = False):
    """The forward chunk loop, optionally forming gradients as it goes.

    ``chunk_grads(start, end, logp, ent) -> (g_logp, g_ent)``, called once per token chunk right after the chunk's
    row statistics are written (``logp`` / ``ent``: the [N] outputs, filled up to ``end``), gives the chunk's
    per-token upstream gradients ([end - start] fp32, either None); the chunk is then turned into d / d logits in
    place and multiplied out (grad_hidden rows, grad_weight / grad_bias accumulated): the backward's matmuls in the
    forward, no recomputation of the logits. Returns the :func:`logp_forward` outputs but ``unit``, then
    (grad_hidden, grad_weight, grad_bias) (empty [0] tensors for those not asked for)."""
    N = hidden.shape[0]
    dev = hidden.device
    fwd, bwd = _row_paths(hidden)
    index = index.contiguous()
    # zeros, not empty: the chunk_grads callback may read the rows past ``end`` (they must hold finite values)
    logp = torch.zeros(N, dtype=torch.float32, device=dev)
    lse = torch.empty((2, N), dtype=torch.float32, device=dev)
    ent = torch.zeros(N if entropy else 0, dtype=torch.float32, device=dev)
    ez = torch.empty(N if entropy else 0, dtype=torch.float32, device=dev)
    top = torch.empty(N if top1 else 0, dtype=torch.uint8, device=dev)
    mean = torch.empty(N if mean_logits else 0, dtype=torch.float32, device=dev)
    lsq = torch.empty(N if log_sum_sq_probs else 0, dtype=torch.float32, device=dev)

    def step(buf, s, e):
        fwd(buf, index[s:e], logp[s:e], ent[s:e] if entropy else None, lse[:, s:e], ez[s:e] if entropy else None,
            temperature, softcap, top[s:e] if top1 else None, mean[s:e] if mean_logits else None,
            lsq[s:e] if log_sum_sq_probs else None, target_logit)
        if chunk_grads is not None:  # the same chunk, now with its row statistics: d / d logits, in place
            _chunk_into_grads(bwd, buf, index[s:e], lse[:, s:e], ez[s:e] if entropy else None,
                              chunk_grads(s, e, logp, ent), entropy, temperature, softcap)

    need_gb = need_gb and bias is not None
    grads = chunk_loop(hidden, weight, bias, step, need_gh, need_gw, need_gb, chunk_bytes, chunk_grads is not None)
    return (logp, ent, lse, ez, top.view(torch.bool), mean, lsq) + tuple(grads)


def logp_forward_split_vocab(hidden, weight, local_index, temperature: float, softcap: float, entropy: bool,
                             chunk_bytes: int, combine, chunk_vocab: int, chunk_grads, need_gh: bool, need_gw: bool):
    """The forward of the vocabulary-parallel log-probs over this rank's slice ``weight`` [V_local, D], forming the
    gradients as it goes (the loss is known: ``chunk_grads`` as in :func:`logp_forward_with_grads`).

    Chunk by chunk: the logits (one matmul); this rank's row statistics, its slice's entropy statistics and the
    picked logits (``local_index`` outside [0, V_local): absent, picks 0); then ``combine(s, e, zy, lse, ez) ->
    (logp, entropy or None, stats [2, C], ez or None)``, the caller's collectives giving the whole vocabulary's values
    for the chunk's rows (every rank cuts the same chunks, counted for ``chunk_vocab`` vocabulary rows); then the
    chunk's upstream gradients from ``chunk_grads`` on the whole-vocabulary log-probs so far, and the gradient over
    this rank's slice with the combined statistics (the one-hot term only where the index is this rank's) times
    the hidden states and weight: three matmuls, where recomputing in the backward would take four.

    Returns (logp [N], entropy [N] or [0], grad_hidden [N, D] fp32: this rank's part of the sum over the
    vocabulary, grad_weight [V_local, D]), empty [0] tensors for gradients not asked for."""
    N = hidden.shape[0]
    dev = hidden.device
    fwd, bwd = _row_paths(hidden)
    local_index = local_index.contiguous()
    f32 = dict(dtype=torch.float32, device=dev)
    zy = torch.empty(N, **f32)
    lse_local = torch.empty((2, N), **f32)
    ent_local = torch.empty(N if entropy else 0, **f32)
    ez_local = torch.empty(N if entropy else 0, **f32)
    # zeros, not empty: chunk_grads reads the rows past the chunk (they must hold finite values)
    logp = torch.zeros(N, **f32)
    ent = torch.zeros(N if entropy else 0, **f32)

    def step(buf, s, e):
        idx = local_index[s:e]
        fwd(buf, idx, zy[s:e], ent_local[s:e] if entropy else None, lse_local[:, s:e],
            ez_local[s:e] if entropy else None, temperature, softcap, zy_out=True)
        lp, en, stats, ez = combine(s, e, zy[s:e], lse_local[:, s:e], ez_local[s:e] if entropy else None)
        logp[s:e].copy_(lp)
        if entropy:
            ent[s:e].copy_(en)
        _chunk_into_grads(bwd, buf, idx, stats, ez, chunk_grads(s, e, logp, ent), entropy, temperature, softcap)

    gh, gw, _gb = chunk_loop(hidden, weight, None, step, need_gh, need_gw, False, chunk_bytes, True,
                             grad_hidden_fp32=True, chunk_vocab=chunk_vocab)
    return logp, ent, gh, gw


def logp_backward(g_logp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor], hidden, weight, index, bias,
                  lse, ez, temperature: float, softcap: float, need_gh: bool, need_gw: bool, need_gb: bool,
                  chunk_bytes: int, grad_hidden_fp32: bool = False):
    """Backward by recomputation, for per-token upstream grads ``g_logp`` / ``g_ent`` ([N] each, either None).

    Returns (grad_hidden [N, D], grad_weight [V, D], grad_bias [V]) in the input dtypes (grad_hidden in fp32 with
    ``grad_hidden_fp32``: a partial sum to be added to other ranks' before it is rounded); empty [0] tensors for
    those not asked for."""
    need_gb = need_gb and bias is not None
    if g_logp is None and g_ent is None:  # nothing flows back: exact zeros, no matmuls
        N, D = hidden.shape
        z = lambda t, shape: t.new_zeros(shape)  # noqa: E731
        return (hidden.new_zeros((N, D), dtype=torch.float32 if grad_hidden_fp32 else hidden.dtype) if need_gh
                else hidden.new_empty(0),
                z(weight, tuple(weight.shape)) if need_gw else hidden.new_empty(0),
                z(bias, tuple(bias.shape)) if need_gb else hidden.new_empty(0))
    bwd = _row_paths(hidden)[1]
    index = index.contiguous()
    if g_logp is not None and g_logp.dtype != torch.float32:
        g_logp = g_logp.float()
    if g_ent is not None and g_ent.dtype != torch.float32:
        g_ent = g_ent.float()

    def step(buf, s, e):
        bwd(buf, index[s:e], lse[:, s:e], ez[s:e] if g_ent is not None else None,
            g_logp[s:e] if g_logp is not None else None, g_ent[s:e] if g_ent is not None else None,
            temperature, softcap)

    return chunk_loop(hidden, weight, bias, step, need_gh, need_gw, need_gb, chunk_bytes, True,
                      grad_hidden_fp32=grad_hidden_fp32)


# ================================================================================================ reference
def logp_reference(hidden, weight, index, bias=None, temperature=1.0, softcap=None, g_logp=None, g_ent=None,
                   dtype=torch.float64):
    """float64 reference through plain PyTorch (log_softmax / gather / entropy) and autograd.

    Returns (logp, entropy, grad_hidden, grad_weight, grad_bias) with ``loss = sum(g_logp * logp) +
    sum(g_ent * entropy)`` (grads None when both upstream grads are None, grad_bias None without bias)."""
    D = hidden.shape[-1]
    h = hidden.detach().reshape(-1, D).to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    b = bias.detach().to(dtype).requires_grad_() if bias is not None else None
    z = F.linear(h, w, b)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    lsm = torch.log_softmax(z, dim=-1)
    logp = lsm.gather(1, index.reshape(-1, 1).long()).squeeze(1)
    ent = -(lsm.exp() * lsm).sum(-1)
    gh = gw = gb = None
    if g_logp is not None or g_ent is not None:
        loss = logp.new_zeros(())
        if g_logp is not None:
            loss = loss + (g_logp.reshape(-1).to(dtype) * logp).sum()
        if g_ent is not None:
            loss = loss + (g_ent.reshape(-1).to(dtype) * ent).sum()
        grads = torch.autograd.grad(loss, [h, w] + ([b] if b is not None else []))
        gh, gw = grads[0].reshape(hidden.shape), grads[1]
        gb = grads[2] if b is not None else None
    return logp.detach().reshape(index.shape), ent.detach().reshape(index.shape), gh, gw, gb


def logp_stats_reference(hidden, weight, index, bias=None, temperature=1.0, softcap=None, dtype=torch.float64):
    """float64 reference of the statistics without a gradient: (top1 bool, mean of z, log sum p^2), each [N]."""
    D = hidden.shape[-1]
    z = F.linear(hidden.detach().reshape(-1, D).to(dtype), weight.detach().to(dtype),
                 bias.detach().to(dtype) if bias is not None else None)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    top1 = z.argmax(-1) == index.reshape(-1)  # the first maximum
    lsm = torch.log_softmax(z, dim=-1)
    return top1, z.mean(-1), torch.logsumexp(2.0 * lsm, dim=-1)
