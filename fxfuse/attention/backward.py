"""Softcap flash attention (Gemma-2 family): Triton kernels, their launchers, a float64 reference and a
blockwise PyTorch path for CPU, side by side (Triton-tutorial style).

What is computed (Gemma-2's eager attention, with ``repeat_kv`` never materialised)::

    q [B, Hq, S, Dh], k/v [B, Hkv, Skv, Dh], Hq % Hkv == 0; query head h reads kv head h // (Hq // Hkv)
    s = (q @ k^T) * scaling
    s = softcap * tanh(s / softcap)              if softcap > 0
    s = s + mask                                  additive float mask, or where(mask, s, -inf) for a bool mask
    s = where(allowed(qi, ki), s, -inf)           causal / sliding window, computed from indices
    p = softmax(s, dim=-1) in fp32;  out = p.to(q.dtype) @ v

Index masks are bottom-right aligned (as HF / flash-attn do when Skv != S), with ``off = Skv - S``:
causal keeps ``ki <= qi + off``; a sliding ``window`` W (only together with causal) also requires
``qi + off - ki < W``. HF training has S == Skv (off = 0).

Fully masked rows: a key is *masked* when its index mask says so, when a bool mask is False, or when an
additive mask value is <= -65504 (= finfo(fp16).min; HF's eager masks use finfo(dtype).min, so its padding
entries count as masked in every dtype). Partially masked rows are unaffected by the threshold: exp(-65504) is 0
in fp32 either way. A row whose every key is masked (left padding: a pad query sees only pad keys) gets what the
attention it replaces gives, chosen by ``masked_rows``:

* ``MASKED_ROWS_ZERO`` (0): zeros and zero gradients: ``scaled_dot_product_attention`` with a bool mask (its
  math path's safe softmax since torch 2.5).
* ``MASKED_ROWS_UNIFORM`` (1): eager softmax attention whose masked scores are a finite fill (HF's additive
  ``finfo(dtype).min`` masks, ``masked_fill(~keep, finfo.min)``): every score of the row is absorbed into the
  same fill value, so eager's softmax is uniform over all Skv keys: out = mean_j v_j, and its backward still
  flows through the (absorbed) raw scores: dS_ij = (1/Skv) (dO_i . v_j - dO_i . out_i) * dsoftcap(s_ij), a dense
  term over every key that the block-skipping kernels never visit. Two extra kernels add it (``_attn_bwd_dead_*``);
  they skip every query block without such a row, so they cost next to nothing when there is none.
* ``MASKED_ROWS_NAN`` (2): eager attention masked with -inf (``masked_fill(~keep, -inf)``): NaN rows, and
  NaN gradients for dq there and for all of dk / dv of that (batch, kv head), as eager's softmax backward gives.

Memory: the forward saves ``lse`` [B, Hq, S] fp32 (natural log; +inf marks a fully masked row so that the
backward's exp(s - lse) is exactly 0 there); nothing of size S x Skv is ever stored.

Kernels (FA2 structure):
  * ``_attn_fwd``       one program per (q block, b, q head); online softmax over KV blocks.
  * ``_attn_bwd_pre``   delta = rowsum(dO * O) in fp32.
  * ``_attn_bwd_dkdv``  one program per (kv block, b, kv head); loops over the G query heads of its group and
                        over q blocks, so GQA gradients are summed in registers (no repeat_kv, no atomics).
  * ``_attn_bwd_dq``    one program per (q block, b, q head); loops over KV blocks.
Every kernel splits its KV (or Q) range into [masked | unmasked | masked] loops: index masks (causal, window,
sequence end) are only evaluated on the boundary blocks, and blocks that the causal / window masks remove
entirely are never visited.

A mask *tensor* alone (no index mask: what a graph pass hands over, since HF builds causal / window / padding
into one tensor) gets the same treatment from the data: ``_mask_tile_classes`` reads the mask once per kernel
tiling and classifies every (row block, column block) tile as EMPTY (every entry masked), FULL (every entry
neutral: 0.0 additive / True bool, and inside the sequence) or PARTIAL; ``_mask_block_ranges`` turns each row
of classes into [lo, b) partial | [b, c) full | [c, hi) partial, nothing kept outside [lo, hi). The kernels
visit only [lo, hi) and read the mask only outside [b, c), so a causal mask tensor costs what ``causal=True``
costs. Any mask stays correct: a block the ranges cannot prove FULL or EMPTY is computed with the mask.

Softmax runs in base 2 (``exp2``; the log2(e) factor is folded into the scale), and tanh is written with one
exp2 (``1 - 2 / (2^(2x·log2 e) + 1)``, exact limits +-1 at overflow), which the interpreter also runs.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .triton_support import HAVE_TRITON, tl, triton

__all__ = [
    "MASKED_BELOW",
    "attention_reference",
    "attention_fwd_torch",
    "attention_bwd_torch",
    "attention_fwd_triton",
    "attention_bwd_triton",
    "interpreting",
    "DEFAULT_CONFIGS",
    "MASKED_ROWS_ZERO",
    "MASKED_ROWS_UNIFORM",
    "MASKED_ROWS_NAN",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Additive mask values at or below this count as "masked" (see module docstring).
MASKED_BELOW = -65504.0
# What a fully masked query row gives (see module docstring).
MASKED_ROWS_ZERO, MASKED_ROWS_UNIFORM, MASKED_ROWS_NAN = 0, 1, 2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ================================================================================================ reference
def _allowed(S: int, Skv: int, causal: bool, window: int, device) -> Optional[torch.Tensor]:
    """[S, Skv] bool of what the index masks keep (None when nothing is index-masked)."""
    if not causal and not window:
        return None
    off = Skv - S
    qi = torch.arange(S, device=device)[:, None] + off
    ki = torch.arange(Skv, device=device)[None, :]
    ok = torch.ones(S, Skv, dtype=torch.bool, device=device)
    if causal:
        ok = ok & (ki <= qi)
    if window:
        ok = ok & (qi - ki < window)
    return ok


def _additive(mask: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    """The mask as an additive tensor in ``dtype`` with the masked convention applied (-inf where masked)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    m = mask.to(dtype)
    return m.masked_fill(m <= MASKED_BELOW, float("-inf"))


def attention_reference(q, k, v, mask=None, scaling=None, softcap=0.0, causal=False, window=0,
                        dtype=torch.float64, masked_rows=MASKED_ROWS_ZERO, doc_ranges=None, key_valid=None):
    """The eager formula in ``dtype`` (float64 by default), with repeat_interleave for GQA.

    Differentiable (autograd through it gives the reference gradients). Fully masked rows give zeros
    (``MASKED_ROWS_ZERO``), what eager gives with a finfo(dtype).min fill (``MASKED_ROWS_UNIFORM``: the masked
    entries are that fill here too, so autograd reproduces eager's gradients) or NaN (``MASKED_ROWS_NAN``).
    """
    B, Hq, S, Dh = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    scaling = Dh ** -0.5 if scaling is None else scaling
    qq, kk, vv = q.to(dtype), k.to(dtype), v.to(dtype)
    rep = Hq // Hkv
    kk = kk.repeat_interleave(rep, 1)
    vv = vv.repeat_interleave(rep, 1)
    s = torch.matmul(qq, kk.transpose(-1, -2)) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    raw = s
    am = _additive(mask, dtype)
    if am is not None:
        s = s + am
    ok = _allowed(S, Skv, causal, window, q.device)
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    if doc_ranges is not None:  # [2, B|1, S]: key j is in query i's document iff start_i <= j < end_i
        kj = torch.arange(Skv, device=q.device)
        same = (kj[None, None, :] >= doc_ranges[0][:, :, None]) & (kj[None, None, :] < doc_ranges[1][:, :, None])
        s = s.masked_fill(~same[:, None], float("-inf"))
    if key_valid is not None:  # [B|1, Skv]
        s = s.masked_fill(~key_valid.to(torch.bool)[:, None, None, :], float("-inf"))
    if masked_rows == MASKED_ROWS_UNIFORM:  # eager's finite fill: raw + fill == fill for every masked entry
        keep = ~torch.isneginf(s.detach())
        s = torch.where(keep, s, raw + torch.finfo(dtype).min)
        return torch.matmul(torch.softmax(s, dim=-1), vv)
    if masked_rows == MASKED_ROWS_NAN:
        return torch.matmul(torch.softmax(s, dim=-1), vv)
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)  # fully masked rows
    s = s.masked_fill(dead, 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(dead, 0.0)
    return torch.matmul(p, vv)


# ================================================================================ blockwise PyTorch (CPU) path
# Same semantics as the kernels, chunked over query rows: a chunk of C rows materialises [B, Hq, C, L] fp32
# scores (L = the keys its causal / window range can reach), never [S, Skv]. GQA: q is viewed as
# [B, Hkv, G*C, Dh] so that one batched matmul against k [B, Hkv, Dh, L] serves the whole group.
_CPU_SCORE_BUDGET = 32 * 2**20  # bytes of fp32 scores per chunk


def _key_range(q0: int, q1: int, S: int, Skv: int, causal: bool, window: int):
    off = Skv - S
    lo, hi = 0, Skv
    if causal:
        hi = max(0, min(Skv, q1 - 1 + off + 1))
    if window:
        lo = max(0, q0 + off - window + 1)
    return lo, max(lo, hi)


def _chunk_rows(B, Hq, S, Skv, chunk):
    if chunk:
        return max(1, int(chunk))
    return max(16, min(S, _CPU_SCORE_BUDGET // max(1, 4 * B * Hq * Skv)))


def _chunk_scores(q, k, mask, q0, q1, lo, hi, scaling, softcap, causal, window, S, Skv, doc_ranges=None,
                  key_valid=None):
    """fp32 scores (after softcap, mask, index mask) of rows [q0, q1) against keys [lo, hi), grouped as
    [B, Hkv, G, C, L]; also tanh(.) (for the backward) when softcap."""
    B, Hq, _, Dh = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    C, L = q1 - q0, hi - lo
    qc = q[:, :, q0:q1].float().reshape(B, Hkv, G * C, Dh)
    kc = k[:, :, lo:hi].float()
    s = torch.matmul(qc, kc.transpose(-1, -2)).view(B, Hkv, G, C, L)
    t = None
    if softcap:
        t = torch.tanh(s * (scaling / softcap))
        s = t * softcap
    else:
        s = s * scaling
    if mask is not None:
        mc = mask[:, :, q0:q1, lo:hi]  # mask is already expanded to [B, Hq, S, Skv] (a view)
        mc = mc.reshape(B, Hkv, G, C, L) if mc.shape[1] == Hq else mc.unsqueeze(2)
        if mc.dtype == torch.bool:
            s = s.masked_fill(~mc, float("-inf"))
        else:
            mf = mc.float()
            s = s + mf.masked_fill(mf <= MASKED_BELOW, float("-inf"))
    if causal or window:
        off = Skv - S
        qi = torch.arange(q0, q1)[:, None] + off
        ki = torch.arange(lo, hi)[None, :]
        ok = torch.ones(C, L, dtype=torch.bool)
        if causal:
            ok &= ki <= qi
        if window:
            ok &= qi - ki < window
        s = s.masked_fill(~ok.to(s.device), float("-inf"))
    if doc_ranges is not None:  # contiguous documents: key ki is in query qi's document iff start <= ki < end
        ki = torch.arange(lo, hi, device=s.device)[None, None, :]
        st, en = doc_ranges[0, :, q0:q1, None], doc_ranges[1, :, q0:q1, None]  # [B|1, C, 1]
        ok = (ki >= st) & (ki < en)
        s = s.masked_fill(~ok[:, None, None], float("-inf"))
    if key_valid is not None:
        s = s.masked_fill(~key_valid[:, None, None, None, lo:hi].to(torch.bool), float("-inf"))
    return s, t


def _expand_mask(mask, B, Hq, S, Skv):
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.expand(B, mask.shape[1] if mask.shape[1] == Hq else 1, S, Skv)


def _value_mean(v, G):
    """mean_j v_j per (batch, kv head) in fp32, repeated to the q heads: [B, Hkv * G, Dh] (uniform rows)."""
    return v.float().mean(dim=2).repeat_interleave(G, dim=1)


def _dead_rows_fixup_torch(out, lse, v, G, masked_rows):
    """Give fully masked rows (lse = +inf) what ``masked_rows`` says (zeros are already there)."""
    if masked_rows == MASKED_ROWS_ZERO:
        return out
    dead = torch.isinf(lse).unsqueeze(-1)
    fill = _value_mean(v, G).unsqueeze(2) if masked_rows == MASKED_ROWS_UNIFORM else float("nan")
    return torch.where(dead, torch.as_tensor(fill, dtype=torch.float32, device=out.device), out.float()).to(out.dtype)


def _nan_grads_of_dead_rows(dq, dk, dv, lse, G, masked_rows):
    """MASKED_ROWS_NAN: eager's softmax over an all -inf row is NaN, and its backward spreads NaN to dq of that
    row and to every dk / dv entry of the (batch, kv head) it reads."""
    if masked_rows != MASKED_ROWS_NAN:
        return dq, dk, dv
    dead = torch.isinf(lse)  # [B, Hq, S]
    B, Hq, S = dead.shape
    any_dead = dead.view(B, Hq // G, G * S).any(-1)[:, :, None, None]  # [B, Hkv, 1, 1]
    nan = torch.tensor(float("nan"), device=dq.device)
    return (torch.where(dead.unsqueeze(-1), nan.to(dq.dtype), dq), torch.where(any_dead, nan.to(dk.dtype), dk),
            torch.where(any_dead, nan.to(dv.dtype), dv))


def attention_fwd_torch(q, k, v, mask, scaling, softcap, causal, window, chunk=None,
                        masked_rows=MASKED_ROWS_ZERO, doc_ranges=None, key_valid=None):
    """Blockwise forward on any device. Returns (out [B, Hq, S, Dh] in q.dtype, lse [B, Hq, S] fp32)."""
    B, Hq, S, Dh = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    mask = _expand_mask(mask, B, Hq, S, Skv)
    out = torch.empty(B, Hq, S, Dh, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    C = _chunk_rows(B, Hq, S, Skv, chunk)
    for q0 in range(0, S, C):
        q1 = min(S, q0 + C)
        lo, hi = _key_range(q0, q1, S, Skv, causal, window)
        if hi <= lo:
            out[:, :, q0:q1] = 0
            lse[:, :, q0:q1] = float("inf")
            continue
        s, _ = _chunk_scores(q, k, mask, q0, q1, lo, hi, scaling, softcap, causal, window, S, Skv, doc_ranges,
                             key_valid)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        dead = l == 0
        p = p / torch.where(dead, torch.ones_like(l), l)
        o = torch.matmul(p.view(B, Hkv, G * (q1 - q0), hi - lo), v[:, :, lo:hi].float())
        out[:, :, q0:q1] = o.view(B, Hq, q1 - q0, Dh).to(q.dtype)
        ls = torch.where(dead, torch.full_like(l, float("inf")), m + torch.log(l))
        lse[:, :, q0:q1] = ls.view(B, Hq, q1 - q0)
    return _dead_rows_fixup_torch(out, lse, v, G, masked_rows), lse


def _uniform_dead_rows_bwd_torch(do, q, k, v, lse, delta, scaling, softcap, dq, dk, dv, C):
    """MASKED_ROWS_UNIFORM backward of the fully masked rows: p = 1/Skv over every key, the gradient through
    the raw (absorbed) scores. Chunks without such a row are skipped (on CUDA they are computed: no host sync)."""
    B, Hq, S, Dh = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    dead_all = torch.isinf(lse)
    for q0 in range(0, S, C):
        q1 = min(S, q0 + C)
        dead = dead_all[:, :, q0:q1]
        if not q.is_cuda and not bool(dead.any()):
            continue
        C_ = q1 - q0
        s, t = _chunk_scores(q, k, None, q0, q1, 0, Skv, scaling, softcap, False, 0, S, Skv)
        p = dead.reshape(B, Hkv, G, C_, 1).to(torch.float32) / Skv
        doc = do[:, :, q0:q1].float().reshape(B, Hkv, G * C_, Dh)
        dp = torch.matmul(doc, v.float().transpose(-1, -2)).view(B, Hkv, G, C_, Skv)
        ds = p * (dp - delta[:, :, q0:q1].reshape(B, Hkv, G, C_, 1))
        if softcap:
            ds = ds * (1.0 - t * t)
        ds = (ds * scaling).view(B, Hkv, G * C_, Skv)
        pe = p.expand(B, Hkv, G, C_, Skv).reshape(B, Hkv, G * C_, Skv)
        dv += torch.matmul(pe.transpose(-1, -2), doc)
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, q0:q1].float().reshape(B, Hkv, G * C_, Dh))
        dq[:, :, q0:q1] += torch.matmul(ds, k.float()).view(B, Hq, C_, Dh)


def attention_bwd_torch(do, q, k, v, mask, out, lse, scaling, softcap, causal, window, chunk=None,
                        masked_rows=MASKED_ROWS_ZERO, doc_ranges=None, key_valid=None):
    """Blockwise backward on any device. Returns (dq, dk, dv) in the inputs' dtype."""
    B, Hq, S, Dh = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    mask = _expand_mask(mask, B, Hq, S, Skv)
    dq = torch.zeros(B, Hq, S, Dh, dtype=torch.float32, device=q.device)
    dk = torch.zeros(B, Hkv, Skv, Dh, dtype=torch.float32, device=q.device)
    dv = torch.zeros(B, Hkv, Skv, Dh, dtype=torch.float32, device=q.device)
    delta = (do.float() * out.float()).sum(-1)  # [B, Hq, S]
    C = _chunk_rows(B, Hq, S, Skv, chunk)
    for q0 in range(0, S, C):
        q1 = min(S, q0 + C)
        lo, hi = _key_range(q0, q1, S, Skv, causal, window)
        if hi <= lo:
            continue
        C_, L = q1 - q0, hi - lo
        s, t = _chunk_scores(q, k, mask, q0, q1, lo, hi, scaling, softcap, causal, window, S, Skv, doc_ranges,
                             key_valid)
        ls = lse[:, :, q0:q1].reshape(B, Hkv, G, C_, 1)
        p = torch.exp(s - ls)  # lse = +inf on dead rows -> exactly 0
        doc = do[:, :, q0:q1].float().reshape(B, Hkv, G * C_, Dh)
        vc = v[:, :, lo:hi].float()
        dp = torch.matmul(doc, vc.transpose(-1, -2)).view(B, Hkv, G, C_, L)
        ds = p * (dp - delta[:, :, q0:q1].reshape(B, Hkv, G, C_, 1))
        if softcap:
            ds = ds * (1.0 - t * t)
        ds = (ds * scaling).view(B, Hkv, G * C_, L)
        p = p.view(B, Hkv, G * C_, L)
        dv[:, :, lo:hi] += torch.matmul(p.transpose(-1, -2), doc)
        dk[:, :, lo:hi] += torch.matmul(ds.transpose(-1, -2), q[:, :, q0:q1].float().reshape(B, Hkv, G * C_, Dh))
        dq[:, :, q0:q1] = torch.matmul(ds, k[:, :, lo:hi].float()).view(B, Hq, C_, Dh)
    if masked_rows == MASKED_ROWS_UNIFORM:
        _uniform_dead_rows_bwd_torch(do, q, k, v, lse, delta, scaling, softcap, dq, dk, dv, C)
    return _nan_grads_of_dead_rows(dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), lse, G, masked_rows)


# ============================================================================================ Triton kernels
# Configs: (BLOCK_M, BLOCK_N, num_warps, num_stages[, split]) per kernel, keyed by padded head_dim and element
# size. Dh 256 bf16 (H200 sweeps in benchmarks/attention_notes.md): fwd (128, 64, 8 warps) keeps Q [128, 256]
# in smem and streams K, V [64, 256]; the dK/dV kernel spills registers when it holds K, V and both fp32
# [BLOCK_N, 256] accumulators, so it runs as two launches (split=1: dK, then dV), 2.5x faster than one;
# configs that need more than Hopper's 227 KB smem (e.g. dq (128, 32, 8, 3) plus a mask tile) fall back.
DEFAULT_CONFIGS = {
    # (BLOCK_D, elem_size): {kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages)}; M = query rows, N = key rows
    (256, 2): {"fwd": (128, 64, 8, 2), "dkdv": (32, 128, 8, 2, 1), "dq": (128, 32, 8, 3)},
    # Dh 128 bf16: backward tiles from an H200 sweep at 32k tokens, 8 packed documents, 32 q / 8 kv heads
    # (results/h200-attn-bwd-sweep.jsonl): dq (128, 32, 8, 2) -> (128, 64, 8, 3) 11.74 -> 9.86 ms,
    # dkdv (32, 128, 8, 2) -> (64, 128, 8, 2) 11.74 -> 11.27 ms (each axis swept with the other at its old value)
    (128, 2): {"fwd": (128, 64, 8, 3), "dkdv": (64, 128, 8, 2), "dq": (128, 64, 8, 3)},
    (64, 2): {"fwd": (128, 64, 4, 3), "dkdv": (32, 128, 4, 2), "dq": (128, 32, 4, 2)},
    (256, 4): {"fwd": (64, 32, 8, 1), "dkdv": (32, 32, 8, 1), "dq": (32, 32, 8, 1)},
    (128, 4): {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 1), "dq": (64, 32, 4, 1)},
    (64, 4): {"fwd": (64, 64, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)},
}
# Tried in order when a config does not fit (a mask tensor adds a tile of shared memory per block: the
# Dh-256 dq config (128, 32, 8, 3) needs 240 KB with a mask, over Hopper's 227 KB; with a causal mask tensor at
# B2 S4096 on the H200 its backward takes 3.62 ms with dq (128, 32, 8, 2), 3.65 with (128, 64, 8, 1), 3.88 with
# (64, 32, 4, 3), against 3.27 ms with causal=True and no mask).
FALLBACK_CONFIGS = {"fwd": [(64, 64, 4, 2), (32, 32, 4, 1)], "dkdv": [(32, 64, 8, 2, 1), (16, 32, 4, 1, 1)],
                    "dq": [(128, 32, 8, 2), (64, 32, 4, 3), (32, 32, 4, 1)]}
_WORKING = {}  # (kind, block_d, dtype, mask kind, requested config) -> config that launched


def _launch(kind, kernel, grid_of, cfg, key, launch):
    """launch(cfg) with cfg, else with the fallbacks, remembering what worked for this key."""
    from triton.runtime.errors import OutOfResources

    k = (kind, key, tuple(cfg))
    tries = [_WORKING[k]] if k in _WORKING else [tuple(cfg)] + FALLBACK_CONFIGS[kind]
    for i, c in enumerate(tries):
        try:
            launch(c)
            _WORKING[k] = c
            return
        except OutOfResources:
            if i == len(tries) - 1:
                raise


# Tiny blocks for the interpreter (numpy): cheap and exercises the multi-block / boundary logic.
INTERPRET_CONFIG = {"fwd": (16, 16, 4, 1), "dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)}


def _config(kind: str, block_d: int, dtype, override=None):
    if override and kind in override:
        return override[kind]
    if interpreting():
        return INTERPRET_CONFIG[kind]
    es = 4 if dtype == torch.float32 else 2
    key = (max(64, block_d), es)
    return DEFAULT_CONFIGS[key][kind]


# Arguments whose divisibility changes with the sequence length (the lengths; the mask's strides, which contain one)
# are not specialised by Triton: with specialisation (on == 1 and on divisibility by 16) a variable-length workload
# JIT-compiles new variants of each kernel in the middle of training. They only bound loops and address the mask.
# q / k / v / output strides stay specialised: with a head_dim that is a multiple of 16 their divisibility does not
# depend on the length, and it is what proves the tile loads aligned.
_LENGTHS_MASK_TILE_CLASSES = ['stride_mb', 'stride_mh', 'stride_r', 'stride_c', 'R', 'C', 'NR', 'NC']
_MASK_LENGTHS = ['stride_mb', 'stride_mh', 'stride_mm', 'stride_rb', 'stride_rh', 'stride_docb', 'stride_doce',
                 'stride_kvvb']
_LENGTHS_ATTN_FWD = _MASK_LENGTHS + ['S', 'SKV', 'OFF']
_LENGTHS_ATTN_BWD_PRE = ['S']
_LENGTHS_ATTN_BWD_DKDV = _MASK_LENGTHS + ['S', 'SKV', 'OFF']
_LENGTHS_ATTN_BWD_DQ = _MASK_LENGTHS + ['S', 'SKV', 'OFF']
_LENGTHS_ATTN_BWD_DEAD_DQ = ['S', 'SKV', 'NQB']
_LENGTHS_ATTN_BWD_DEAD_DKDV = ['S', 'SKV', 'NQB']


if HAVE_TRITON:

    @triton.jit
    def _tanh(x):
        # tanh(x) = 1 - 2 / (e^{2x} + 1): one exp2 and one division; e^{2x} -> inf gives 1, -> 0 gives -1.
        e = tl.exp2(x * 2.8853900817779268)  # 2 * log2(e)
        return 1.0 - 2.0 / (e + 1.0)

    @triton.jit
    def _dot(a, b, DOT_FP32: tl.constexpr):
        # DOT_FP32: the interpreter's tl.dot on bf16 operands returns garbage (DESIGN.md sec. 4) and fp32
        # inputs want IEEE products (Triton's default for fp32 is tf32): upcast, exact fp32 product.
        if DOT_FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _load_tile(ptrs, msk):
        # interior blocks of a head_dim that is a power of two need no mask at all (msk is None there)
        if msk is None:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=msk, other=0.0)

    @triton.jit
    def _tanh_approx(x):
        # one MUFU instruction instead of _tanh's exp2 + reciprocal; max relative error ~2^-11, i.e. <= 0.025 on
        # a score capped at 50, below the bf16 rounding of eager's scores (~0.1 there). bf16 / fp16 only.
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _scores(qk, sc_mul, out_mul, SOFTCAP: tl.constexpr):
        """Raw q.k -> log2-domain score. Softcap: t = tanh(qk * scaling / cap), s2 = t * cap * log2e.
        SOFTCAP: 0 none, 1 tanh from exp2, 2 tanh.approx (see ``_softcap_mode``). Returns (s2, t) (t is unused
        without softcap)."""
        if SOFTCAP == 2:
            t = _tanh_approx(qk * sc_mul)
            return t * out_mul, t
        elif SOFTCAP == 1:
            t = _tanh(qk * sc_mul)
            return t * out_mul, t
        else:
            return qk * out_mul, qk

    @triton.jit
    def _masked_scores(qk, sc_mul, out_mul, mptrs, qi, ki, S, SKV, OFF, window, DST, KVV, SOFTCAP: tl.constexpr,
                       MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       BOUNDARY: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr):
        """(s2, t) of one score tile with every mask applied. ``qi``/``ki`` are the query/key indices broadcast
        to the tile's shape, so the forward and dQ loops (queries x keys) and the dK/dV loop (keys x queries)
        share this. Causal/window/out-of-range masking is needed only on BOUNDARY tiles; interior tiles are
        fully kept by construction of the loop bounds."""
        s2, t = _scores(qk, sc_mul, out_mul, SOFTCAP)
        if MASK_KIND != 0:
            s2 = _apply_mask_tensor(s2, mptrs, (qi < S) & (ki < SKV), MASK_KIND)
        if HAS_KVV:  # key padding (a [Skv] vector of this batch row): read in every tile, O(BLOCK) bytes
            kv_ok = tl.load(KVV + ki, mask=ki < SKV, other=0)
            s2 = tl.where(kv_ok != 0, s2, float("-inf"))
        if BOUNDARY:
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
            mv = tl.where(mv <= -65504.0, float("-inf"), tl.maximum(mv, -65504.0) * 1.4426950408889634)
            s2 = s2 + mv
        elif MASK_KIND == 2:
            keep = tl.load(mptrs, mask=mbounds, other=1)
            s2 = tl.where(keep != 0, s2, float("-inf"))
        return s2

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
            kept = mv > -65504.0
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
    def _grid_ids(BLOCK_MAJOR: tl.constexpr, REVERSE: tl.constexpr):
        """(block index, batch*head index) of this program. Under a causal mask the work per block grows with
        the query block (fwd, dQ: REVERSE, heaviest = last) or shrinks with the key block (dK/dV). Programs are
        dispatched in linear-id order, so BLOCK_MAJOR (grid = (batch*heads, blocks)) makes the block index the
        slow axis: every head's heaviest blocks go first and the light ones fill the tail (longest-first)."""
        if BLOCK_MAJOR:
            blk = tl.program_id(1)
            nblk = tl.num_programs(1)
            bh = tl.program_id(0)
        else:
            blk = tl.program_id(0)
            nblk = tl.num_programs(0)
            bh = tl.program_id(1)
        if REVERSE:
            blk = nblk - 1 - blk
        return blk, bh

    @triton.jit
    def _load_ranges(RNG, BLOCK: tl.constexpr):
        return (tl.load(RNG) * BLOCK, tl.load(RNG + 1) * BLOCK, tl.load(RNG + 2) * BLOCK,
                tl.load(RNG + 3) * BLOCK)

    # ------------------------------------------------------------------------------------------- forward
    @triton.jit
    def _fwd_inner(acc, l_i, m_i, q, K_blk, V_blk, M_blk, offs_m, offs_n0, offs_d, lo, hi,
                   stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV,
                   BLOCK_N: tl.constexpr, D_MASK: tl.constexpr, SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BOUNDARY: tl.constexpr,
                   DOT_FP32: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            if BOUNDARY:
                kv_mask = offs_n[:, None] < SKV
                if D_MASK:
                    kv_mask = kv_mask & (offs_d[None, :] < D_MASK)
            else:
                if D_MASK:
                    kv_mask = offs_d[None, :] < D_MASK
                else:
                    kv_mask = None
            k = _load_tile(K_blk + offs_n[:, None] * stride_kn, kv_mask)
            qk = _dot(q, tl.trans(k), DOT_FP32)
            s2, t = _masked_scores(qk, sc_mul, out_mul, M_blk + offs_n[None, :] * stride_mn, offs_m[:, None],
                                   offs_n[None, :], S, SKV, OFF, window, DST, KVV, SOFTCAP, MASK_KIND, IS_CAUSAL,
                                   HAS_WINDOW, BOUNDARY, HAS_DOCS, HAS_KVV)
            m_new = tl.maximum(m_i, tl.max(s2, 1))
            # a row with nothing kept so far has m = -inf: subtract 0 instead (exp2(-inf - 0) = 0, no NaN)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s2 - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_tile(V_blk + offs_n[:, None] * stride_vn, kv_mask)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)  # eager: p.to(q.dtype) @ v
            m_i = m_new
        return acc, l_i, m_i

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
    def _q_block_key_ranges_of(RNG_row, start_m, S, SKV, OFF, window, DST, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                               MASK_RANGES: tl.constexpr, HAS_DOCS: tl.constexpr):
        """The forward's and dQ's key ranges (lo, b, c, hi): from the mask tensor's tile classes (MASK_RANGES,
        ``RNG_row`` = this q block's row) or from the index masks."""
        if MASK_RANGES:
            return _load_ranges(RNG_row, BLOCK_N)
        else:
            return _q_block_key_ranges(start_m, S, SKV, OFF, window, DST, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW,
                                       HAS_DOCS)

    @triton.jit(do_not_specialize=_LENGTHS_ATTN_FWD)
    def _attn_fwd(Q, K, V, M, RNG, DOCS, KVVEC, O, LSE, VMEAN,
                  stride_qb, stride_qh, stride_qm, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  stride_mb, stride_mh, stride_mm, stride_mn, stride_rb, stride_rh,
                  stride_docb, stride_doce, stride_kvvb,
                  stride_ob, stride_oh, stride_om, stride_od,
                  H, G, S, SKV, OFF, window, sc_mul, out_mul,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, MASK_RANGES: tl.constexpr,
                  BLOCK_MAJOR: tl.constexpr, MASKED_ROWS: tl.constexpr, HAS_DOCS: tl.constexpr,
                  HAS_KVV: tl.constexpr, INT64: tl.constexpr):
        pid_m, bh = _grid_ids(BLOCK_MAJOR, True)
        b = bh // H
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
        lo, b_, c_, hi = _q_block_key_ranges_of(RNG + b * stride_rb + h * stride_rh + pid_m * 4, start_m, S, SKV,
                                                OFF, window, DST, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW, MASK_RANGES,
                                                HAS_DOCS)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_blk, V_blk, M_blk, offs_m, offs_n0, offs_d, lo, b_,
                                   stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV,
                                   BLOCK_N, D_MASK, SOFTCAP, MASK_KIND, IS_CAUSAL, HAS_WINDOW, True, DOT_FP32, HAS_DOCS,
                                   HAS_KVV)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_blk, V_blk, M_blk, offs_m, offs_n0, offs_d, b_, c_,
                                   stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV,
                                   BLOCK_N, D_MASK, SOFTCAP, MID_MASK, IS_CAUSAL, HAS_WINDOW, False, DOT_FP32, HAS_DOCS,
                                   HAS_KVV)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_blk, V_blk, M_blk, offs_m, offs_n0, offs_d, c_, hi,
                                   stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV,
                                   BLOCK_N, D_MASK, SOFTCAP, MASK_KIND, IS_CAUSAL, HAS_WINDOW, True, DOT_FP32, HAS_DOCS,
                                   HAS_KVV)
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

    # ------------------------------------------------------------------------------------------ backward
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
    def _kv_block_query_ranges(start_n, S, SKV, OFF, window, DEN, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
        """Query-row ranges for keys [start_n, start_n + BLOCK_N): kept iff q >= k - OFF (causal) and
        q < k - OFF + window. [lo, b) and [c, hi) need index masks; [b, c) is fully kept (multiples of
        BLOCK_M; rows >= S there are harmless: their lse is +inf, so p = 0)."""
        lo = 0
        hi = S
        full_lo = 0
        full_hi = tl.cdiv(S, BLOCK_M) * BLOCK_M
        if IS_CAUSAL:
            lo = (tl.maximum(0, start_n - OFF) // BLOCK_M) * BLOCK_M
            full_lo = tl.cdiv(tl.maximum(0, start_n + BLOCK_N - 1 - OFF), BLOCK_M) * BLOCK_M
        if HAS_WINDOW:
            hi = tl.minimum(S, tl.maximum(0, start_n + BLOCK_N - 1 - OFF + window))
            full_hi = (tl.maximum(0, start_n - OFF + window) // BLOCK_M) * BLOCK_M
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

    @triton.jit
    def _bwd_dkdv_inner(dk, dv, k, v, Q_blk, DO_blk, M_blk, LSE_h, DELTA_h, offs_n, offs_m0, offs_d, lo, hi,
                        stride_qm, stride_dom, stride_mm, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV,
                        BLOCK_M: tl.constexpr, D_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
                        MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        BOUNDARY: tl.constexpr, DOT_FP32: tl.constexpr, DO_DK: tl.constexpr,
                        DO_DV: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr):
        # transposed formulation (keys on rows): sT = k q^T [BLOCK_N, BLOCK_M]
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            q_mask = offs_m[:, None] < S
            if D_MASK:
                q_mask = q_mask & (offs_d[None, :] < D_MASK)
            q = tl.load(Q_blk + offs_m[:, None] * stride_qm, mask=q_mask, other=0.0)
            lse2 = tl.load(LSE_h + offs_m, mask=offs_m < S, other=float("inf")) * 1.4426950408889634
            qkT = _dot(k, tl.trans(q), DOT_FP32)
            s2, t = _masked_scores(qkT, sc_mul, out_mul, M_blk + offs_m[None, :] * stride_mm, offs_m[None, :],
                                   offs_n[:, None], S, SKV, OFF, window, DST, KVV, SOFTCAP, MASK_KIND, IS_CAUSAL,
                                   HAS_WINDOW, BOUNDARY, HAS_DOCS, HAS_KVV)
            pT = tl.exp2(s2 - lse2[None, :])
            do = tl.load(DO_blk + offs_m[:, None] * stride_dom, mask=q_mask, other=0.0)
            if DO_DV:
                dv += _dot(pT.to(do.dtype), do, DOT_FP32)
            if DO_DK:
                dpT = _dot(v, tl.trans(do), DOT_FP32)
                Di = tl.load(DELTA_h + offs_m, mask=offs_m < S, other=0.0)
                dsT = pT * (dpT - Di[None, :])
                if SOFTCAP:
                    dsT = dsT * (1.0 - t * t)  # d(cap * tanh(x / cap)) = 1 - tanh^2
                dk += _dot(dsT.to(q.dtype), q, DOT_FP32)
        return dk, dv

    @triton.jit(do_not_specialize=_LENGTHS_ATTN_BWD_DKDV)
    def _attn_bwd_dkdv(Q, K, V, M, RNG, DOCS, KVVEC, DO, LSE, DELTA, DK, DV,
                       stride_qb, stride_qh, stride_qm, stride_qd,
                       stride_kb, stride_kh, stride_kn, stride_kd,
                       stride_vb, stride_vh, stride_vn, stride_vd,
                       stride_mb, stride_mh, stride_mm, stride_mn, stride_rb, stride_rh,
                  stride_docb, stride_doce, stride_kvvb,
                       stride_dob, stride_doh, stride_dom, stride_dod,
                       stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                       stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                       H, HKV, G, S, SKV, OFF, window, sc_mul, out_mul, scaling,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
                       IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
                       DO_DK: tl.constexpr, DO_DV: tl.constexpr, MASK_RANGES: tl.constexpr,
                       BLOCK_MAJOR: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr,
                       INT64: tl.constexpr):
        # DO_DK / DO_DV: at head_dim 256 holding K, V and both fp32 accumulators [BLOCK_N, 256] spills
        # registers; the launcher can split dK and dV into two launches (one extra q.k^T recompute).
        pid_n, bhk = _grid_ids(BLOCK_MAJOR, False)
        b = bhk // HKV
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
        for g in range(G):  # the query heads sharing this kv head: GQA gradients summed in registers
            h = hk * G + g
            if MASK_RANGES:  # query ranges of this key block from the (transposed) mask's tile classes
                lo, b_, c_, hi = _load_ranges(RNG + b * stride_rb + h * stride_rh + pid_n * 4, BLOCK_M)
            else:
                lo, b_, c_, hi = _kv_block_query_ranges(start_n, S, SKV, OFF, window, DEN, BLOCK_M, BLOCK_N,
                                                        IS_CAUSAL, HAS_WINDOW, HAS_DOCS)
            Q_blk = Q + b * stride_qb + h * stride_qh + offs_d[None, :] * stride_qd
            DO_blk = DO + b * stride_dob + h * stride_doh + offs_d[None, :] * stride_dod
            M_blk = M + b * stride_mb + h * stride_mh + offs_n[:, None] * stride_mn
            LSE_h = LSE + (b * H + h) * S
            DELTA_h = DELTA + (b * H + h) * S
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_blk, DO_blk, M_blk, LSE_h, DELTA_h, offs_n, offs_m0, offs_d,
                                     lo, b_, stride_qm, stride_dom, stride_mm, S, SKV, OFF, window, sc_mul,
                                     out_mul, DST, KVV, BLOCK_M, D_MASK, SOFTCAP, MASK_KIND, IS_CAUSAL, HAS_WINDOW, True,
                                     DOT_FP32, DO_DK, DO_DV, HAS_DOCS, HAS_KVV)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_blk, DO_blk, M_blk, LSE_h, DELTA_h, offs_n, offs_m0, offs_d,
                                     b_, c_, stride_qm, stride_dom, stride_mm, S, SKV, OFF, window, sc_mul,
                                     out_mul, DST, KVV, BLOCK_M, D_MASK, SOFTCAP, MID_MASK, IS_CAUSAL, HAS_WINDOW, False,
                                     DOT_FP32, DO_DK, DO_DV, HAS_DOCS, HAS_KVV)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_blk, DO_blk, M_blk, LSE_h, DELTA_h, offs_n, offs_m0, offs_d,
                                     c_, hi, stride_qm, stride_dom, stride_mm, S, SKV, OFF, window, sc_mul,
                                     out_mul, DST, KVV, BLOCK_M, D_MASK, SOFTCAP, MASK_KIND, IS_CAUSAL, HAS_WINDOW, True,
                                     DOT_FP32, DO_DK, DO_DV, HAS_DOCS, HAS_KVV)
        if DO_DK:
            dk = dk * scaling
            tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn
                     + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=kv_mask)
        if DO_DV:
            tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvn
                     + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _bwd_dq_inner(dq, q, do, lse2, Di, K_blk, V_blk, M_blk, offs_m, offs_n0, offs_d, lo, hi,
                      stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV,
                      BLOCK_N: tl.constexpr, D_MASK: tl.constexpr, SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
                      IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BOUNDARY: tl.constexpr,
                      DOT_FP32: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            if BOUNDARY:
                kv_mask = offs_n[:, None] < SKV
                if D_MASK:
                    kv_mask = kv_mask & (offs_d[None, :] < D_MASK)
            else:
                if D_MASK:
                    kv_mask = offs_d[None, :] < D_MASK
                else:
                    kv_mask = None
            k = _load_tile(K_blk + offs_n[:, None] * stride_kn, kv_mask)
            v = _load_tile(V_blk + offs_n[:, None] * stride_vn, kv_mask)
            qk = _dot(q, tl.trans(k), DOT_FP32)
            s2, t = _masked_scores(qk, sc_mul, out_mul, M_blk + offs_n[None, :] * stride_mn, offs_m[:, None],
                                   offs_n[None, :], S, SKV, OFF, window, DST, KVV, SOFTCAP, MASK_KIND, IS_CAUSAL,
                                   HAS_WINDOW, BOUNDARY, HAS_DOCS, HAS_KVV)
            p = tl.exp2(s2 - lse2[:, None])
            dp = _dot(do, tl.trans(v), DOT_FP32)
            ds = p * (dp - Di[:, None])
            if SOFTCAP:
                ds = ds * (1.0 - t * t)
            dq += _dot(ds.to(k.dtype), k, DOT_FP32)
        return dq

    @triton.jit(do_not_specialize=_LENGTHS_ATTN_BWD_DQ)
    def _attn_bwd_dq(Q, K, V, M, RNG, DOCS, KVVEC, DO, LSE, DELTA, DQ,
                     stride_qb, stride_qh, stride_qm, stride_qd,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd,
                     stride_mb, stride_mh, stride_mm, stride_mn, stride_rb, stride_rh,
                  stride_docb, stride_doce, stride_kvvb,
                     stride_dob, stride_doh, stride_dom, stride_dod,
                     stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                     H, G, S, SKV, OFF, window, sc_mul, out_mul, scaling,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, MASK_RANGES: tl.constexpr,
                     BLOCK_MAJOR: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KVV: tl.constexpr,
                     INT64: tl.constexpr):
        pid_m, bh = _grid_ids(BLOCK_MAJOR, True)
        b = bh // H
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
        lo, b_, c_, hi = _q_block_key_ranges_of(RNG + b * stride_rb + h * stride_rh + pid_m * 4, start_m, S, SKV,
                                                OFF, window, DST, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW, MASK_RANGES,
                                                HAS_DOCS)
        dq = _bwd_dq_inner(dq, q, do, lse2, Di, K_blk, V_blk, M_blk, offs_m, offs_n0, offs_d, lo, b_,
                           stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV,
                           BLOCK_N, D_MASK, SOFTCAP, MASK_KIND, IS_CAUSAL, HAS_WINDOW, True, DOT_FP32, HAS_DOCS,
                           HAS_KVV)
        dq = _bwd_dq_inner(dq, q, do, lse2, Di, K_blk, V_blk, M_blk, offs_m, offs_n0, offs_d, b_, c_,
                           stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV,
                           BLOCK_N, D_MASK, SOFTCAP, MID_MASK, IS_CAUSAL, HAS_WINDOW, False, DOT_FP32, HAS_DOCS,
                           HAS_KVV)
        dq = _bwd_dq_inner(dq, q, do, lse2, Di, K_blk, V_blk, M_blk, offs_m, offs_n0, offs_d, c_, hi,
                           stride_kn, stride_vn, stride_mn, S, SKV, OFF, window, sc_mul, out_mul, DST, KVV,
                           BLOCK_N, D_MASK, SOFTCAP, MASK_KIND, IS_CAUSAL, HAS_WINDOW, True, DOT_FP32, HAS_DOCS,
                           HAS_KVV)
        dq = dq * scaling
        tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
                 dq.to(DQ.dtype.element_ty), mask=q_mask)


if HAVE_TRITON:

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
                dp = _dot(do, tl.trans(v), DOT_FP32)
                ds = pd[:, None] * (dp - Di[:, None])
                if SOFTCAP:
                    t = _tanh(_dot(q, tl.trans(k), DOT_FP32) * sc_mul)
                    ds = ds * (1.0 - t * t)
                ds = tl.where(offs_n[None, :] < SKV, ds, 0.0)
                dq += _dot(ds.to(k.dtype), k, DOT_FP32)
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
                    dv += _dot(pT.to(do.dtype), do, DOT_FP32)
                    dpT = _dot(v, tl.trans(do), DOT_FP32)
                    dsT = pT * (dpT - Di[None, :])
                    if SOFTCAP:
                        t = _tanh(_dot(k, tl.trans(q), DOT_FP32) * sc_mul)
                        dsT = dsT * (1.0 - t * t)
                    dk += _dot(dsT.to(q.dtype), q, DOT_FP32)
        if any_ != 0:
            kp = DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
            vp = DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
            old_k = tl.load(kp, mask=kv_mask, other=0.0).to(tl.float32)
            tl.store(kp, (old_k + dk * scaling).to(DK.dtype.element_ty), mask=kv_mask)
            old_v = tl.load(vp, mask=kv_mask, other=0.0).to(tl.float32)
            tl.store(vp, (old_v + dv).to(DV.dtype.element_ty), mask=kv_mask)


# ================================================================================================ launchers
def _mask_args(mask, B, Hq, S, Skv, like):
    """(tensor to pass, 4 strides, MASK_KIND). Broadcast dims get stride 0; bool is read as uint8."""
    if mask is None:
        return like, (0, 0, 0, 0), 0
    m = _expand_mask(mask, B, Hq, S, Skv)
    st = list(m.stride())
    if m.shape[1] != Hq:  # head-broadcast mask: stride 0 over q heads
        st[1] = 0
    for i, n in enumerate(m.shape):
        if n == 1:
            st[i] = 0
    if m.dtype == torch.bool:
        return m.view(torch.uint8), tuple(st), 2
    return m, tuple(st), 1


def _recipe_args(doc_ranges, key_valid, like):
    """The recipe vectors as kernel arguments: (docs, stride_docb, stride_doce, kvv, stride_kvvb, HAS_DOCS,
    HAS_KVV). ``doc_ranges`` int [2, B|1, S] (start, end of each token's document), ``key_valid`` bool [B|1, Skv];
    a batch of 1 broadcasts (stride 0). O(B x S) each; absent ones are replaced by a dummy pointer."""
    docs, sdb, sde, has_docs = like, 0, 0, False
    if doc_ranges is not None:
        docs = doc_ranges.to(torch.int32).contiguous()
        sdb = docs.stride(1) if docs.shape[1] > 1 else 0
        sde, has_docs = docs.stride(0), True
    kvv, skb, has_kvv = like, 0, False
    if key_valid is not None:
        kvv = key_valid.to(torch.bool).contiguous().view(torch.uint8)
        skb, has_kvv = (kvv.stride(0) if kvv.shape[0] > 1 else 0), True
    return docs, sdb, sde, kvv, skb, has_docs, has_kvv


# Tests set this to run the 64-bit address path at small sizes.
FORCE_INT64 = False


def _needs_int64(*tensors) -> bool:
    """Does any tensor's farthest element sit at an offset past 2^31 - 1 (int32 address math would wrap)? Then
    the kernels compute addresses in 64 bits (a constexpr variant); below that the int32 fast path."""
    if FORCE_INT64:
        return True
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            if sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) >= 2**31 - 1:
                return True
    return False


# Block ranges from a mask tensor (see the module docstring); False = read the mask in every block (benchmarks
# compare the two).
MASK_BLOCK_RANGES = True


def _use_mask_ranges(kind, causal, window) -> bool:
    # Only for a mask tensor alone: with index masks the scalar ranges already skip blocks (the mask tensor,
    # e.g. padding, is then read in every visited block).
    return bool(MASK_BLOCK_RANGES and kind != 0 and not causal and not window)


def _mask_block_ranges_of(mt, ms, kind, B, Hq, R, C, BR, BC, transpose=False):
    """int32 [Bm * Hm * cdiv(R, BR), 4] (lo, b, c, hi) per row block, in column-block units, and its (batch,
    head) strides (0 where the mask broadcasts). ``transpose``: rows are keys, columns queries (dK/dV kernel).
    Two launches, O(mask) reads, no host sync."""
    sb, sh, sm, sn = ms
    Bm, Hm = (B if sb else 1), (Hq if sh else 1)
    sr, sc = (sn, sm) if transpose else (sm, sn)
    NR, NC = triton.cdiv(R, BR), triton.cdiv(C, BC)
    cls = torch.empty(Bm * Hm * NR * NC, dtype=torch.int8, device=mt.device)
    _mask_tile_classes[(NC, NR, Bm * Hm)](mt, cls, sb, sh, sr, sc, R, C, NR, NC, Hm, BR=BR, BC=BC,
                                          MASK_KIND=kind, num_warps=4)
    rng = torch.empty(Bm * Hm * NR, 4, dtype=torch.int32, device=mt.device)
    _mask_block_ranges[(Bm * Hm * NR,)](cls, rng, NC, BLOCK=128, num_warps=4)
    return rng, (Hm * NR * 4 if Bm > 1 else 0, NR * 4 if Hm > 1 else 0)


# tanh.approx.f32 for bf16 / fp16 inputs on the GPU (one MUFU op per score instead of two; the softcap kernels
# are MUFU-heavy: tanh and exp2 per score, in the forward and in each backward recompute). fp32 keeps the exact
# formula (its 1e-4 tolerance is below tanh.approx's error); the interpreter cannot run inline PTX.
FAST_TANH = True


def _softcap_mode(softcap, dtype) -> int:
    if not softcap:
        return 0
    return 2 if (FAST_TANH and dtype in (torch.bfloat16, torch.float16) and not interpreting()) else 1


# Grid order (see ``_grid_ids``): True = (batch*heads, blocks), longest-first dispatch across all heads.
BLOCK_MAJOR_GRID = True


def _grid(n_blocks, n_bh):
    return (n_bh, n_blocks) if BLOCK_MAJOR_GRID else (n_blocks, n_bh)


def _scalars(scaling, softcap):
    if softcap:
        return scaling / softcap, softcap * LOG2E
    return 1.0, scaling * LOG2E


def attention_fwd_triton(q, k, v, mask, scaling, softcap, causal, window, config=None,
                         masked_rows=MASKED_ROWS_ZERO, doc_ranges=None, key_valid=None):
    """Launch ``_attn_fwd``. Returns (out contiguous [B, Hq, S, Dh], lse [B, Hq, S] fp32)."""
    B, Hq, S, Dh = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    cfg = _config("fwd", BLOCK_D, q.dtype, config)
    out = torch.empty(B, Hq, S, Dh, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    mt, ms, kind = _mask_args(mask, B, Hq, S, Skv, q)
    sc_mul, out_mul = _scalars(scaling, softcap)

    ranges = _use_mask_ranges(kind, causal, window)
    vmean = _value_mean(v, Hq // Hkv).contiguous() if masked_rows == MASKED_ROWS_UNIFORM else lse
    docs, sdb, sde, kvv, skb, has_docs, has_kvv = _recipe_args(doc_ranges, key_valid, lse)
    int64 = _needs_int64(q, k, v, out, _expand_mask(mask, B, Hq, S, Skv))

    def launch(c):
        BM, BN, nw, ns = c[:4]
        rng, rs = _mask_block_ranges_of(mt, ms, kind, B, Hq, S, Skv, BM, BN) if ranges else (lse, (0, 0))
        _attn_fwd[_grid(triton.cdiv(S, BM), B * Hq)](
            q, k, v, mt, rng, docs, kvv, out, lse, vmean, *q.stride(), *k.stride(), *v.stride(), *ms, *rs, sdb, sde,
            skb, *out.stride(),
            Hq, Hq // Hkv, S, Skv, Skv - S, int(window or 0), sc_mul, out_mul,
            HEAD_DIM=Dh, BLOCK_D=BLOCK_D, BLOCK_M=BM, BLOCK_N=BN, SOFTCAP=_softcap_mode(softcap, q.dtype),
            MASK_KIND=kind,
            IS_CAUSAL=bool(causal), HAS_WINDOW=bool(window),
            DOT_FP32=interpreting() or q.dtype == torch.float32, MASK_RANGES=ranges, BLOCK_MAJOR=BLOCK_MAJOR_GRID,
            MASKED_ROWS=int(masked_rows), HAS_DOCS=has_docs, HAS_KVV=has_kvv, INT64=int64, num_warps=nw,
            num_stages=ns)

    _launch("fwd", _attn_fwd, None, cfg, (BLOCK_D, q.dtype, kind, bool(window), ranges, has_docs, has_kvv), launch)
    return out, lse


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


def attention_bwd_triton(do, q, k, v, mask, out, lse, scaling, softcap, causal, window, config=None,
                         masked_rows=MASKED_ROWS_ZERO, doc_ranges=None, key_valid=None):
    """Launch the three backward kernels. Returns contiguous (dq, dk, dv) in the inputs' dtypes."""
    B, Hq, S, Dh = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    dot32 = interpreting() or q.dtype == torch.float32
    delta = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    PRE_M = 16 if interpreting() else 64
    _attn_bwd_pre[(triton.cdiv(S, PRE_M), B * Hq)](out, do, delta, *out.stride(), *do.stride(), Hq, S,
                                                   HEAD_DIM=Dh, BLOCK_D=BLOCK_D, BLOCK_M=PRE_M)
    mt, ms, kind = _mask_args(mask, B, Hq, S, Skv, q)
    sc_mul, out_mul = _scalars(scaling, softcap)
    dq = torch.empty(B, Hq, S, Dh, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, Skv, Dh, dtype=k.dtype, device=q.device)
    dv = torch.empty(B, Hkv, Skv, Dh, dtype=v.dtype, device=q.device)
    common = dict(HEAD_DIM=Dh, BLOCK_D=BLOCK_D, SOFTCAP=_softcap_mode(softcap, q.dtype), MASK_KIND=kind,
                  IS_CAUSAL=bool(causal),
                  HAS_WINDOW=bool(window), DOT_FP32=dot32)
    ranges = _use_mask_ranges(kind, causal, window)
    docs, sdb, sde, kvv, skb, has_docs, has_kvv = _recipe_args(doc_ranges, key_valid, lse)
    key = (BLOCK_D, q.dtype, kind, bool(window), ranges, has_docs, has_kvv)
    common["MASK_RANGES"] = ranges
    common["BLOCK_MAJOR"] = BLOCK_MAJOR_GRID
    common.update(HAS_DOCS=has_docs, HAS_KVV=has_kvv,
                  INT64=_needs_int64(q, k, v, do, dq, dk, dv, _expand_mask(mask, B, Hq, S, Skv)))

    def launch_dkdv(c):
        BM, BN, nw, ns, *split = c
        # split (5th config field): dK and dV in two launches, each holding one fp32 accumulator
        passes = [(True, False), (False, True)] if split and split[0] else [(True, True)]
        # rows = key blocks, columns = query blocks: the transposed mask's ranges
        rng, rs = (_mask_block_ranges_of(mt, ms, kind, B, Hq, Skv, S, BN, BM, transpose=True) if ranges
                   else (lse, (0, 0)))
        for do_dk, do_dv in passes:
            _attn_bwd_dkdv[_grid(triton.cdiv(Skv, BN), B * Hkv)](
                q, k, v, mt, rng, docs, kvv, do, lse, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *ms,
                *rs, sdb, sde, skb, *do.stride(), *dk.stride(), *dv.stride(), Hq, Hkv, G, S, Skv, Skv - S, int(window or 0), sc_mul,
                out_mul, float(scaling), BLOCK_M=BM, BLOCK_N=BN, num_warps=nw, num_stages=ns, DO_DK=do_dk,
                DO_DV=do_dv, **common)

    def launch_dq(c):
        BM, BN, nw, ns = c[:4]
        rng, rs = _mask_block_ranges_of(mt, ms, kind, B, Hq, S, Skv, BM, BN) if ranges else (lse, (0, 0))
        _attn_bwd_dq[_grid(triton.cdiv(S, BM), B * Hq)](
            q, k, v, mt, rng, docs, kvv, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *ms, *rs, sdb,
            sde, skb, *do.stride(),
            *dq.stride(), Hq, G, S, Skv, Skv - S, int(window or 0), sc_mul, out_mul, float(scaling),
            BLOCK_M=BM, BLOCK_N=BN, num_warps=nw, num_stages=ns, **common)

    _launch("dkdv", _attn_bwd_dkdv, None, _config("dkdv", BLOCK_D, q.dtype, config), key, launch_dkdv)
    _launch("dq", _attn_bwd_dq, None, _config("dq", BLOCK_D, q.dtype, config), key, launch_dq)
    if masked_rows == MASKED_ROWS_UNIFORM:
        _dead_rows_bwd_triton(do, q, k, v, lse, delta, dq, dk, dv, scaling, softcap, BLOCK_D, dot32)
    return _nan_grads_of_dead_rows(dq, dk, dv, lse, G, masked_rows)
