"""Online row statistics of a logits chunk, and the token-chunk loop around them: what the two lm-head ops
(:mod:`~fxfuse.kernels.linear_cross_entropy`, :mod:`~fxfuse.kernels.linear_log_probs`) compute alike.

Both ops reduce each row z of a [C, V] logits chunk (V ~ 1e5..2.6e5) to its softmax normaliser, and both keep it as
two fp32 numbers, not one lse:

    mx = max_v z_v           (one of the z values, so z - mx is exact at the max element and near it)
    ls = log S = log1p(S - 1),   S = sum_v exp(z_v - mx) >= 1,   S - 1 summed WITHOUT the max element's 1

and form every ``z - lse`` as ``(z - mx) - ls``. One fp32 lse = mx + log S rounds to ~|lse| * 6e-8 absolute, which
swamps what a peaked row has left (a loss or a log-prob of -1e-6, the target's gradient entry p_y - 1); the
two-number form keeps them at their relative precision (the LCE module's docstring has the measurements;
tests/test_lm_head_accuracy.py keeps both ops within eager's error).

The row kernels compute (mx, ls) in one online pass over BLOCK_V-wide slices of a row, per lane (no cross-warp
reduction per slice): :func:`stats_init` starts every lane at (m = -1e30, r = -1), :func:`stats_update` folds a
slice in with ONE exp per element (e^-|z - m| is either the rescale of the lane's old sums, when z is a new lane
max, or the new term), keeping m = the lane's running max and r = sum of e^(z - m) over the lane's elements except
its max; :func:`stats_finish` combines the lanes with one max-with-index and one sum (the lane that holds the row
max contributes its r, every other lane its full sum). Around them:

* :func:`mul_rn` rounds the last product of the z transform explicitly on CUDA, so that no FMA contraction with
  the following ``- mx`` turns z - mx at the max element into a rounding error instead of 0;
* :func:`pick` reads one row's target logit as a scalar (pushed through the same transform by the caller), and
  :func:`expm1` turns (z_y - mx) - ls into the target's gradient entry p_y - 1 without cancellation;
* :func:`softcap_tanh` is the softcap's tanh, the hardware approximation or the exp form
  (:mod:`~fxfuse.kernels.triton_support`), chosen by a constexpr;
* :func:`row_stats_torch` is the same normaliser in PyTorch, for the ops' CPU paths and as the tests' reference
  form; :func:`rounded_z` and :func:`row_launch_config` are the launchers' shared settings.

Shared, too, is the chunk loop (:func:`chunk_loop`): per chunk of C tokens cuBLAS writes the logits into one
reused [C, V] buffer (``DEFAULT_CHUNK_BYTES``, :func:`rows_per_chunk`), the op's row step reads it (and may
overwrite it with d loss / d logits), and two more cuBLAS calls consume the gradient. Its settings
(``DEFAULT_CHUNK_BYTES``, ``FP32_ACCUM_MAX_BYTES``) are read here, at call time, for both ops.

Defined once here because the two ops must agree: the same statistics give the log-probs op's log-prob and the
cross-entropy op's loss of the same row the same value, and a numerical fix to one (the two-number normaliser, the
rounded product) is a fix to both.
"""
from __future__ import annotations

import os

import torch

from .triton_support import HAVE_TRITON, interpreting, tanh_approx, tanh_exp, tl, triton

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MIN_DEFAULT_CHUNK_ROWS",
    "FP32_ACCUM_MAX_BYTES",
    "rows_per_chunk",
    "chunk_loop",
    "row_stats_torch",
    "rounded_z",
    "row_launch_config",
    # Triton jit helpers (None without Triton)
    "softcap_tanh",
    "mul_rn",
    "stats_init",
    "stats_update",
    "stats_finish",
    "expm1",
    "log1p",
    "pick",
]

#: Budget for the [C, V] logits chunk buffer of both lm-head ops (design: ~256 MiB); the op argument
#: ``chunk_bytes=0`` means this.
DEFAULT_CHUNK_BYTES = int(os.environ.get("FXFUSE_LCE_CHUNK_BYTES", 256 << 20))
#: The default budget (not one a caller or FXFUSE_LCE_CHUNK_BYTES gives) holds at least this many token rows: at
#: Gemma-2's 256k vocabulary 256 MiB is 512 rows, and the grad_weight GEMMs that accumulate chunk by chunk cost
#: more than the memory saves (H200, 8192 tokens: 55.5 ms at 512 rows, 51.6 at 1024 (512 MiB), Inductor 50.9;
#: benchmarks/lce_notes.md). The Llama-3 head (128k) gets 1024 rows from 256 MiB already.
MIN_DEFAULT_CHUNK_ROWS = 0 if "FXFUSE_LCE_CHUNK_BYTES" in os.environ else 1024
#: Accumulate grad_weight in fp32 (then cast once) when the fp32 accumulator fits in this many bytes. Each
#: chunk's addmm otherwise rounds the running bf16 sum once more (see benchmarks/lce_notes.md for the error).
#: Read by :func:`chunk_loop`, i.e. for both lm-head ops.
FP32_ACCUM_MAX_BYTES = int(os.environ.get("FXFUSE_LCE_FP32_ACCUM_BYTES", 0))


def rows_per_chunk(V: int, elem_bytes: int, chunk_bytes: int, N: int) -> int:
    """Tokens per chunk so that the [C, V] logits buffer fits ``chunk_bytes`` (at least 1, at most N)."""
    c = max(1, int(chunk_bytes) // max(1, V * elem_bytes))
    if c >= 256:
        c -= c % 128  # whole 128-row tiles for cuBLAS
    return max(1, min(c, N))


# ================================================================================================ Triton helpers
if HAVE_TRITON:

    @triton.jit
    def softcap_tanh(x, FAST: tl.constexpr):
        """tanh of the softcap: with FAST one MUFU instruction (``tanh_approx``, sm_75+; max relative error
        ~2^-11, under the bf16 rounding of the logits), else tanh from one exp (``tanh_exp``: runs in the
        interpreter, ~3e-8 absolute in fp32)."""
        if FAST:
            return tanh_approx(x)
        else:
            return tanh_exp(x)

    @triton.jit
    def mul_rn(a, b, RN: tl.constexpr):
        """a * b rounded to fp32 before anything else uses it. On CUDA (RN) an explicitly rounded mul.rn.f32,
        which neither LLVM nor ptxas contracts into an FMA with a following add: z = x * c feeds both the row max
        (rounded) and z - mx; contracted, z - mx at the max element is the product's rounding error (~|z| * 6e-8)
        instead of 0, which is the whole of z_y - E_p[z] on a peaked row (the entropy gradient there)."""
        if RN:
            return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return a * b

    # ---- the two-number row normaliser, shared by the lm-head row kernels
    @triton.jit
    def stats_init(BLOCK_V: tl.constexpr):
        """Per-lane online statistics: running max m (finite -1e30 start: never inf - inf) and r = sum of
        e^(z - m) over the lane's elements EXCEPT its max (-1 = lane not hit yet, so that r + 1 = the full sum)."""
        return tl.full([BLOCK_V], -1e30, dtype=tl.float32), tl.full([BLOCK_V], -1.0, dtype=tl.float32)

    @triton.jit
    def stats_update(m, r, zm):
        """One slice ``zm`` (z, -inf on masked lanes) into (m, r), with ONE exp per element: for d = zm - m either
        the element is a new max (d > 0: the old sums rescale by e^-d and the old max's 1 joins r) or it joins r
        as e^d; q = e^-|d| is both. Returns (m_new, r_new, q, d, up = d > 0). Masked lanes: d = -inf, q = 0, no
        change. Ties count in r: only one max is left out."""
        d = zm - m
        q = tl.exp(-tl.abs(d))
        up = d > 0
        return tl.maximum(m, zm), tl.where(up, (r + 1.0) * q, r + q), q, d, up

    @triton.jit
    def log1p(x):
        """log(1 + x) for x >= 0 with relative precision also for tiny x, without relying on tl.log near 1
        (approximate on GPUs): 2 atanh(s), s = x / (2 + x) <= 1/3, as a series for x < 1; tl.log(1 + x) above,
        where log(1 + x) >= log 2 keeps an absolute error of the log small relative to the result."""
        s = x / (2.0 + x)
        s2 = s * s
        p = 1.0 + s2 * (1.0 / 3.0 + s2 * (1.0 / 5.0 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0 + s2 * (
            1.0 / 11.0 + s2 * (1.0 / 13.0 + s2 * (1.0 / 15.0 + s2 * (1.0 / 17.0))))))))
        return tl.where(x < 1.0, 2.0 * s * p, tl.log(1.0 + x))

    @triton.jit
    def expm1(x):
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
    def stats_finish(m, r, BLOCK_V: tl.constexpr):
        """Combine the lanes: (mx, ls, w, Sm1) with mx the row max, Sm1 = S - 1 (S = sum e^(z - mx)) summed without
        the max's 1, ls = log1p(Sm1), w = e^(m - mx) per lane (0 for lanes never hit, where r + 1 = 0 too). One lane
        holding the row max contributes its r (its max's 1 left out), every other lane its full w (r + 1), lanes
        that tie for the max included: two reductions, as for a plain logsumexp."""
        mx, imx = tl.max(m, axis=0, return_indices=True)
        w = tl.exp(m - mx)
        Sm1 = tl.sum(tl.where(tl.arange(0, BLOCK_V) == imx, r, w * (r + 1.0)), axis=0)
        return mx, log1p(Sm1), w, Sm1

    @triton.jit
    def pick(base, idx, ok):
        """The element ``base[idx]`` (0.0 where not ``ok``) as a [2] fp32 vector (lane 0), for the scalar target
        logit: callers push it through the same z transform as their row loop and take lane 0."""
        k = tl.arange(0, 2)
        # (mask built by one vector compare: the interpreter rejects a scalar-and-vector bool mask)
        return tl.load(base + tl.where(ok, idx, 0) + k, mask=tl.where(ok, k, 1) == 0, other=0.0).to(tl.float32), k
else:  # pragma: no cover
    softcap_tanh = mul_rn = stats_init = stats_update = stats_finish = expm1 = log1p = pick = None


# ================================================================================================ launch settings
def rounded_z(buf) -> bool:
    """Whether the row kernels round z with an explicit mul.rn.f32 (:func:`mul_rn`): NVIDIA GPUs, not the
    interpreter (numpy never contracts a multiply and an add)."""
    return buf.is_cuda and torch.version.hip is None and not interpreting()


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
    fast_tanh = (bool(cfg.get("FAST_TANH")) and buf.is_cuda and not interpreting()
                 and (fast_tanh_dtypes is None or buf.dtype in fast_tanh_dtypes))
    return cfg, BLOCK_V, num_warps, fast_tanh


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


# ================================================================================================ chunk loop
def _matmul_fp32_(out, a, b, accumulate: bool):
    """``out (+)= a @ b`` into an fp32 ``out`` with low-precision operands: cuBLAS reads / writes ``out`` in fp32 (one
    rounding, at the end, by the caller). ``accumulate``: add to ``out`` (the grad_weight accumulator) instead of
    overwriting it (a partial grad_hidden that other ranks' are added to)."""
    if out.is_cuda and a.dtype != torch.float32:
        try:
            if accumulate:
                torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            else:
                torch.mm(a, b, out_dtype=torch.float32, out=out)
            return
        except (RuntimeError, TypeError):  # torch without (add)mm(out_dtype=): upcast (slower, same numbers)
            pass
    if accumulate:
        out.addmm_(a.float(), b.float())
    else:
        torch.mm(a.float(), b.float(), out=out)


def chunk_loop(hidden, weight, bias, rows_step, need_gh, need_gw, need_gb, chunk_bytes, write_grad,
               grad_hidden_fp32=False, chunk_vocab=None):
    """Shared token-chunk loop: logits chunk (cuBLAS) -> ``rows_step(buf, start, end)`` -> gradient matmuls.

    Returns (grad_hidden, grad_weight, grad_bias), empty tensors for those not asked for (or when no gradient is
    written in this pass). ``grad_hidden_fp32``: grad_hidden in fp32, unrounded (a partial sum that the caller adds
    to other ranks' before rounding it once: the vocabulary-parallel op). ``chunk_vocab``: the vocabulary size the
    chunk rows are counted for, instead of ``weight``'s (ranks with slices of different sizes must cut the same
    chunks when ``rows_step`` runs collectives).
    """
    N, D = hidden.shape
    V = weight.shape[0]
    dt = hidden.dtype
    empty = lambda: hidden.new_empty(0)  # noqa: E731  (distinct tensors: custom_op outputs must not alias)
    gh = hidden.new_empty((N, D), dtype=torch.float32 if grad_hidden_fp32 else dt) if (write_grad and need_gh) \
        else empty()
    gw, gw32 = empty(), None
    if write_grad and need_gw:
        gw = weight.new_empty((V, D))
        if dt != torch.float32 and V * D * 4 <= FP32_ACCUM_MAX_BYTES:
            gw32 = torch.zeros((V, D), dtype=torch.float32, device=weight.device)
        elif N == 0:
            gw.zero_()
    gb32 = torch.zeros(V, dtype=torch.float32, device=hidden.device) if (write_grad and need_gb) else None
    if N > 0:
        C = rows_per_chunk(chunk_vocab or V, hidden.element_size(), chunk_bytes, N)
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
                if gh.dtype != buf.dtype:
                    _matmul_fp32_(gh[start:end], buf, weight, accumulate=False)
                else:
                    torch.mm(buf, weight, out=gh[start:end])
            if need_gw:
                if gw32 is not None:
                    _matmul_fp32_(gw32, buf.t(), h_c, accumulate=True)
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
