"""What ``fxfuse::softcap_attention`` computes: the float64 reference, and the blockwise PyTorch path that runs
it wherever the Triton kernels do not (CPU, or ``FXFUSE_ATTENTION_IMPL=torch``), with the kernels' semantics.

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
additive mask value is <= -65504 (:data:`.conventions.MASKED_BELOW` = finfo(fp16).min; HF's eager masks use
finfo(dtype).min, so its padding entries count as masked in every dtype). Partially masked rows are unaffected by
the threshold: exp(-65504) is 0 in fp32 either way. A row whose every key is masked (left padding: a pad query
sees only pad keys) gets what the attention it replaces gives, chosen by ``masked_rows``:

* ``MASKED_ROWS_ZERO`` (0): zeros and zero gradients: ``scaled_dot_product_attention`` with a bool mask (its
  math path's safe softmax since torch 2.5).
* ``MASKED_ROWS_UNIFORM`` (1): eager softmax attention whose masked scores are a finite fill (HF's additive
  ``finfo(dtype).min`` masks, ``masked_fill(~keep, finfo.min)``): every score of the row is absorbed into the
  same fill value, so eager's softmax is uniform over all Skv keys: out = mean_j v_j, and its backward still
  flows through the (absorbed) raw scores: dS_ij = (1/Skv) (dO_i . v_j - dO_i . out_i) * dsoftcap(s_ij), a dense
  term over every key that the block-skipping kernels never visit. Two extra kernels add it (``_attn_bwd_dead_*``
  in :mod:`.backward`); they skip every query block without such a row, so they cost next to nothing when there
  is none.
* ``MASKED_ROWS_NAN`` (2): eager attention masked with -inf (``masked_fill(~keep, -inf)``): NaN rows, and
  NaN gradients for dq there and for all of dk / dv of that (batch, kv head), as eager's softmax backward gives.

:func:`attention_reference` is the formula itself (differentiable: autograd through it gives the reference
gradients). :func:`attention_fwd_torch` / :func:`attention_bwd_torch` are the op's PyTorch path, chunked over query
rows so that no [S, Skv] score matrix exists at once. The launchers of the Triton kernels (:mod:`.forward`,
:mod:`.backward`) share three helpers from here: :func:`expand_mask` (a mask's broadcast to [B, Hq|1, S, Skv]),
:func:`value_mean` (a uniform row's output) and :func:`nan_grads_of_dead_rows` (``MASKED_ROWS_NAN``'s gradients).
"""
from __future__ import annotations

from typing import Optional

import torch

from .conventions import MASKED_BELOW, MASKED_ROWS_NAN, MASKED_ROWS_UNIFORM, MASKED_ROWS_ZERO

__all__ = ["attention_reference", "attention_fwd_torch", "attention_bwd_torch", "expand_mask", "value_mean",
           "nan_grads_of_dead_rows", "CPU_SCORE_BUDGET"]


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
CPU_SCORE_BUDGET = 32 * 2**20  # bytes of fp32 scores per chunk


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
    return max(16, min(S, CPU_SCORE_BUDGET // max(1, 4 * B * Hq * Skv)))


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


def expand_mask(mask, B, Hq, S, Skv):
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.expand(B, mask.shape[1] if mask.shape[1] == Hq else 1, S, Skv)


def value_mean(v, G):
    """mean_j v_j per (batch, kv head) in fp32, repeated to the q heads: [B, Hkv * G, Dh] (uniform rows)."""
    return v.float().mean(dim=2).repeat_interleave(G, dim=1)


def _dead_rows_fixup_torch(out, lse, v, G, masked_rows):
    """Give fully masked rows (lse = +inf) what ``masked_rows`` says (zeros are already there)."""
    if masked_rows == MASKED_ROWS_ZERO:
        return out
    dead = torch.isinf(lse).unsqueeze(-1)
    fill = value_mean(v, G).unsqueeze(2) if masked_rows == MASKED_ROWS_UNIFORM else float("nan")
    return torch.where(dead, torch.as_tensor(fill, dtype=torch.float32, device=out.device), out.float()).to(out.dtype)


def nan_grads_of_dead_rows(dq, dk, dv, lse, G, masked_rows):
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
    mask = expand_mask(mask, B, Hq, S, Skv)
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
    mask = expand_mask(mask, B, Hq, S, Skv)
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
    return nan_grads_of_dead_rows(dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), lse, G, masked_rows)
