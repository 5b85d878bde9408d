"""Accuracy of the fused lm-head ops on peaked rows, in fp32, against a float64 reference and eager fp32.

A peaked row (the target logit far above the rest, loss ~1e-6 and below) is where one fp32 lse fails: every
``z - lse`` carries ~|lse| * 6e-8 absolute error, more than the target's whole ``z_y - lse``. The ops keep the
row normaliser as two numbers (the row max and log1p(S - 1)); this file checks that fxfuse is never clearly worse
than plain PyTorch fp32 on the same inputs, for the loss / log-probs / entropy and every gradient:

    rel_err(fxfuse) <= 2 * rel_err(eager fp32) + 2 * floor + 1e-7

with rel_err = ||x - ref64|| / ||ref64|| and ``floor`` the error that rounding the logits z to fp32 alone causes
(the float64 computation run on eager's fp32 z). Both implementations inherit that error, and eager's own rounding
can cancel part of it by chance (seen with softcap 30, where |z| ~ 30 rounds to ~1e-6): without the floor term
the inequality would compare noise. It is 4e-8 .. 6e-6 here (|z| up to ~100) and fxfuse sits at it, orders of
magnitude below the errors of one fp32 lse at margins 10 and 20 (1e-3 .. 1; eager fp32 itself: up to 4e-3).

Inputs: ``h = randn + m * w[y]`` with rows of w of squared norm ~4, so the target logit leads by roughly 4m
(margins m = 0, 5, 10, 20: uniform-ish, moderately peaked, very peaked, loss ~1e-9 per row). Both row paths
(PyTorch twin; Triton kernel under TRITON_INTERPRET=1 with BLOCK_V=64, several slices per row), tiny shapes, one
logits chunk (chunked logits round differently from eager's one matmul; chunking is covered by test_lce_op.py /
test_log_probs_op.py).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fxfuse
from fxfuse.kernels import linear_cross_entropy as KC
from fxfuse.kernels import linear_log_probs as KL
from fxfuse.kernels import lm_head_rows
from fxfuse.ops.linear_cross_entropy import linear_cross_entropy
from fxfuse.ops.linear_log_probs import linear_log_probs

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MARGINS = [0, 5, 10, 20]
N, H, V = 30, 32, 200
IGNORE = -100


def rel(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    n = ref.norm()
    return ((a - ref).norm() / n).item() if n > 0 else (a - ref).norm().item()


def peaked(m, seed=0, n=N, h_dim=H, v=V):
    """(h, w, y): fp32, ``h = randn + m * w[y]``, |w_v|^2 ~ 4 (target logit ~4m above an O(1) + O(m) spread)."""
    g = torch.Generator().manual_seed(seed + 1000 * m)
    w = torch.randn(v, h_dim, generator=g) * (2.0 / h_dim**0.5)
    y = torch.randint(0, v, (n,), generator=g)
    h = torch.randn(n, h_dim, generator=g) + m * w[y]
    return h, w, y


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch):
    """Which row implementation runs: the PyTorch twin or the Triton kernel (interpreter on CPU, several slices
    per row)."""
    if request.param == "triton":
        if not KC.HAVE_TRITON:
            pytest.skip("triton not installed")
        if not INTERPRET:  # these tests use CPU tensors
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set by conftest.py before import)")
        for K in (KC, KL):
            monkeypatch.setattr(K, "FORCE_TRITON", True)
            monkeypatch.setattr(K, "ROW_CONFIG", {"BLOCK_V": 64})
    else:
        for K in (KC, KL):
            monkeypatch.setattr(K, "FORCE_TRITON", False)
    return request.param


def run(fn, tensors, grad_of):
    """fn(*leaf copies) -> (outputs..., loss); returns (outputs, grads of the leaves listed in grad_of)."""
    leaves = [t.detach().clone().requires_grad_(i in grad_of) for i, t in enumerate(tensors)]
    *outs, loss = fn(*leaves)
    loss.backward()
    return [o.detach() for o in outs], [leaves[i].grad for i in grad_of]


def floor_err(fl_rows, ref_rows, ref):
    """The floor of one output: the float64 computation on eager's fp32 logits against the reference. For a
    scalar (a reduced loss) from its per-row terms, summed in absolute value: the scalar's own difference can be
    near 0 by cancellation, while an implementation whose logits round differently (the Triton path's tanh) gets
    the same per-row errors with other signs."""
    if ref.dim() == 0:
        return ((fl_rows.double() - ref_rows.double()).abs().sum() / ref.double().abs()).item()
    return rel(fl_rows, ref_rows)


def assert_bound(names, fx, eager, floor, ref):
    """fxfuse's error <= 2 * eager's + 2 * floor + 1e-7 for each output (``floor``: relative errors)."""
    errs = {}
    for name, a, e, ff, r in zip(names, fx, eager, floor, ref):
        ef, ee = rel(a, r), rel(e, r)
        errs[name] = (ef, ee, ff)
        assert ef <= 2 * ee + 2 * ff + 1e-7, (name, f"fxfuse {ef:.2e} vs eager fp32 {ee:.2e} (floor {ff:.2e})", errs)
    return errs


def compare(f_fx, f_eager, tensors, grad_of, names):
    """Run the fused and the eager function in fp32, the eager one in float64 (the reference) and once more in
    float64 with eager's fp32 logits substituted (the floor); assert the bound on every output and gradient.
    ``f_eager(*tensors, zhook=..., rows=...)`` passes its logits z (after softcap / temperature) through
    ``zhook``; ``rows=True`` returns a reduced loss as its per-row terms (their sum), for the floor."""
    zs = []
    o_ea, g_ea = run(lambda *a: f_eager(*a, zhook=lambda z: zs.append(z.detach()) or z), tensors, grad_of)
    t64 = [t.double() if t.is_floating_point() else t for t in tensors]
    o_64, g_64 = run(f_eager, t64, grad_of)
    o_64r, _ = run(lambda *a: f_eager(*a, rows=True), t64, grad_of)
    z32 = iter(zs)
    o_fl, g_fl = run(lambda *a: f_eager(*a, zhook=lambda z: z + (next(z32).double() - z).detach(), rows=True),
                     t64, grad_of)
    floors = [floor_err(f, r64r, r64) for f, r64r, r64 in zip(o_fl + g_fl, o_64r + g_64, o_64 + g_64)]
    o_fx, g_fx = run(f_fx, tensors, grad_of)
    return assert_bound(names, o_fx + g_fx, o_ea + g_ea, floors, o_64 + g_64)


# ------------------------------------------------------------------------------------------------ row statistics
def _stat_rows(V=45):
    """[C, V] fp32 logits for the lane bookkeeping: ties for the max in one lane (cols 3, 19 with BLOCK_V=16) and
    across lanes, a constant row (ls = log V), one-hot rows (S - 1 ~ 1e-12), the max in the last, ragged slice,
    a row of large |z| (one fp32 lse would round to ~1e-6 there)."""
    g = torch.Generator().manual_seed(14)
    z = torch.randn(8, V, generator=g)
    z[0, [3, 19, 7]] = 5.0
    z[1] = 0.25
    z[2] = -40.0
    z[2, 11] = -10.0
    z[3, 44] = 9.0
    z[4] = torch.randn(V, generator=g) * 0.01 + 100.0
    z[5, 30] = 35.0
    z[6, [0, 16, 32]] = 3.0
    z[6, 40] = 3.0
    return z


@pytest.mark.parametrize("op", ["ce", "logp"])
def test_row_statistics(op, path):
    """mx and ls = log sum exp(z - mx) against float64, per row (relative 1e-6; mx exact), and with them the
    per-row loss / log-prob and the entropy."""
    if path == "triton":
        for K in (KC, KL):
            K.ROW_CONFIG["BLOCK_V"] = 16  # 3 slices per row, the last ragged
    z = _stat_rows()
    C, V = z.shape
    y = torch.tensor([3, 0, 11, 44, 7, 30, 16, 2])
    # float64 references in the same two-number form (log(1 + 5e-14) in float64 keeps only ~3 digits)
    z64 = z.double()
    mx64, ls64, zs64, e64 = lm_head_rows.row_stats_torch(z64)
    zy64 = zs64.gather(1, y[:, None]).squeeze(1)
    st = torch.empty(2, C)
    if op == "ce":
        loss = torch.empty(C)
        (KC._rows_triton if path == "triton" else KC._rows_torch)(
            z.clone(), y, None, loss, st, None, IGNORE, 1.0, 0.0, 0.0, False)
        outs = [(loss, ls64 - zy64)]
    else:
        logp, ent, ez = torch.empty(C), torch.empty(C), torch.empty(C)
        (KL._rows_triton_fwd if path == "triton" else KL._rows_torch_fwd)(z.clone(), y, logp, ent, st, ez, 1.0, 0.0)
        outs = [(logp, zy64 - ls64), (ent, ls64 - (e64 * zs64).sum(-1) / (1.0 + e64.sum(-1)))]
    assert torch.equal(st[0].double(), mx64)
    assert torch.all((st[1].double() - ls64).abs() <= 1e-6 * ls64.abs() + 1e-30), (st[1].double() - ls64) / ls64
    for got, want in outs:
        assert torch.all((got.double() - want).abs() <= 1e-6 * want.abs() + 1e-6 * 2**-24), (got.double() - want)


# ------------------------------------------------------------------------------------------------ cross-entropy
def _rows(z, y, reduction, label_smoothing=0.0):
    """The per-row terms of a reduced cross-entropy (their sum is the loss)."""
    r = F.cross_entropy(z, y, ignore_index=IGNORE, reduction="none", label_smoothing=label_smoothing)
    return r / (y != IGNORE).sum() if reduction == "mean" else r


def _ce_pair(reduction, softcap=None, label_smoothing=0.0, grad_in_forward=None, upstream=None):
    """(fused, eager) loss functions of (h, w, y) returning (loss, scalar to backprop)."""
    def post(loss):
        return loss.sum() if upstream is None else (loss * upstream.to(loss.dtype)).sum()

    def fx(h, w, y):
        loss = linear_cross_entropy(h, w, y, ignore_index=IGNORE, reduction=reduction, softcap=softcap,
                                    label_smoothing=label_smoothing, grad_in_forward=grad_in_forward,
                                    )
        return loss, post(loss)

    def eager(h, w, y, zhook=None, rows=False):
        z = h @ w.T
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        if zhook is not None:
            z = zhook(z)
        loss = F.cross_entropy(z, y, ignore_index=IGNORE, reduction=reduction, label_smoothing=label_smoothing)
        return (_rows(z, y, reduction, label_smoothing) if rows else loss), post(loss)

    return fx, eager


@pytest.mark.slow
@pytest.mark.parametrize("margin", MARGINS)
@pytest.mark.parametrize("mode", ["mean", "sum", "none", "mean-recompute"])
def test_ce_peaked(margin, mode, path):
    """Loss, grad_hidden, grad_weight; every 5th row ignored. "none" takes per-token upstream grads and, like
    "mean-recompute", the recompute backward (statistics saved by the forward, read by the backward kernel)."""
    h, w, y = peaked(margin)
    y[::5] = IGNORE
    reduction = mode.split("-")[0]
    upstream = torch.rand(N, generator=torch.Generator().manual_seed(3)) + 0.5 if reduction == "none" else None
    fx, eager = _ce_pair(reduction, grad_in_forward=False if mode == "mean-recompute" else None, upstream=upstream)
    compare(fx, eager, [h, w, y], (0, 1), ("loss", "grad_hidden", "grad_weight"))


@pytest.mark.slow
@pytest.mark.parametrize("margin", MARGINS)
def test_ce_peaked_softcap(margin, path):
    """Softcap 30 (Gemma-2): z in (-30, 30), so |z| and the old lse error are large for every row."""
    h, w, y = peaked(margin, seed=1)
    y[::7] = IGNORE
    fx, eager = _ce_pair("mean", softcap=30.0)
    compare(fx, eager, [h, w, y], (0, 1), ("loss", "grad_hidden", "grad_weight"))


@pytest.mark.slow
@pytest.mark.parametrize("margin", [5, 20])
@pytest.mark.parametrize("recompute", [False, True])
def test_ce_peaked_label_smoothing(margin, recompute, path):
    h, w, y = peaked(margin, seed=2)
    y[::4] = IGNORE
    fx, eager = _ce_pair("sum", label_smoothing=0.1, grad_in_forward=not recompute)
    compare(fx, eager, [h, w, y], (0, 1), ("loss", "grad_hidden", "grad_weight"))


@pytest.mark.slow
@pytest.mark.parametrize("margin", [0, 10, 20])
def test_ce_peaked_tied_weights(margin, path):
    """One weight as input embedding and lm head: its gradient sums the head's and the lookup's."""
    _, w, y = peaked(margin, seed=4)
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(N, H, generator=g)
    y[::6] = IGNORE
    ids = y.clamp_min(0)

    def model(ce):
        def f(w, noise, y, **kw):
            h = noise + margin * F.embedding(ids, w)  # the embedding of the target token: peaked rows
            return ce(h, w, y, **kw)
        return f

    def fx(h, w, y):
        loss = linear_cross_entropy(h, w, y, ignore_index=IGNORE)
        return loss, loss

    _, eager = _ce_pair("mean")
    compare(model(fx), model(eager), [w, noise, y], (0, 1), ("loss", "grad_weight", "grad_noise"))


# ------------------------------------------------------------------------------------------------ log-probs
def _logp_pair(reduction, temperature=1.0, softcap=None, mask=None, g_logp=None, g_ent=None):
    """(fused, eager) functions of (h, w, y) returning (logp, entropy, loss) with loss = reduce(g_logp * mask *
    logp) + reduce(g_ent * mask * entropy)."""
    red = (lambda t: t.sum()) if reduction == "sum" else (lambda t: t.mean())

    def loss_of(logp, ent):
        dt = logp.dtype
        return red(g_logp.to(dt) * mask.to(dt) * logp) + red(g_ent.to(dt) * mask.to(dt) * ent)

    def fx(h, w, y):
        logp, ent = linear_log_probs(h, w, y, temperature=temperature, softcap=softcap, return_entropy=True,
                                     )
        return logp, ent, loss_of(logp, ent)

    def eager(h, w, y, zhook=None, rows=False):
        z = h @ w.T
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        if zhook is not None:
            z = zhook(z)
        lsm = torch.log_softmax(z, dim=-1)
        logp = lsm.gather(1, y[:, None]).squeeze(1)
        ent = -(lsm.exp() * lsm).sum(-1)
        return logp, ent, loss_of(logp, ent)

    return fx, eager


def _upstream(seed=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, generator=g), 0.1 * torch.randn(N, generator=g),
            (torch.rand(N, generator=g) > 0.2).float())


@pytest.mark.slow
@pytest.mark.parametrize("margin", MARGINS)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_log_probs_peaked(margin, reduction, path):
    """logp, entropy, grad_hidden, grad_weight under GRPO-like upstream grads (advantages, a token mask)."""
    h, w, y = peaked(margin, seed=7)
    gl, ge, mask = _upstream()
    fx, eager = _logp_pair(reduction, mask=mask, g_logp=gl, g_ent=ge)
    compare(fx, eager, [h, w, y], (0, 1), ("logp", "entropy", "grad_hidden", "grad_weight"))


@pytest.mark.slow
@pytest.mark.parametrize("margin", MARGINS)
def test_log_probs_peaked_softcap_temperature(margin, path):
    h, w, y = peaked(margin, seed=8)
    gl, ge, mask = _upstream(9)
    fx, eager = _logp_pair("sum", temperature=0.7, softcap=30.0, mask=mask, g_logp=gl, g_ent=ge)
    compare(fx, eager, [h, w, y], (0, 1), ("logp", "entropy", "grad_hidden", "grad_weight"))


@pytest.mark.parametrize("margin", [0, 10, 20])
def test_log_probs_peaked_tied_weights(margin, path):
    _, w, y = peaked(margin, seed=10)
    noise = torch.randn(N, H, generator=torch.Generator().manual_seed(11))
    gl, ge, mask = _upstream(12)

    def model(fn):
        def f(w, noise, y, **kw):
            return fn(noise + margin * F.embedding(y, w), w, y, **kw)
        return f

    fx, eager = _logp_pair("sum", mask=mask, g_logp=gl, g_ent=ge)
    compare(model(fx), model(eager), [w, noise, y], (0, 1), ("logp", "entropy", "grad_weight", "grad_noise"))


# ------------------------------------------------------------------------------------------------ torch.compile
class _Head(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.lm_head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(w)

    def forward(self, hidden, labels, zhook=None, rows=False):
        z = self.lm_head(hidden)
        if zhook is not None:
            z = zhook(z)
        return _rows(z, labels, "mean") if rows else F.cross_entropy(z, labels, ignore_index=IGNORE)


@pytest.mark.slow
def test_compiled_module_peaked(path):
    """hidden -> linear head -> cross_entropy through torch.compile(backend="fxfuse") at margin 10: the site is
    fused and the loss and gradients meet the same bound."""
    h, w, y = peaked(10, seed=13)
    y[::5] = IGNORE

    def run_model(model, hidden, **kw):
        hidden = hidden.detach().clone().requires_grad_()
        loss = model(hidden, y, **kw)
        loss.sum().backward()
        return [loss.detach(), hidden.grad, next(model.parameters()).grad]

    got = run_model(torch.compile(_Head(w), backend="fxfuse", options={"compiler": "aot_eager"}), h)
    fused = [r for r in fxfuse.report().fused if r.pass_name == "linear_cross_entropy"]
    assert len(fused) == 1, str(fxfuse.report())
    zs = []
    eager = run_model(_Head(w), h, zhook=lambda z: zs.append(z.detach()) or z)
    ref = run_model(_Head(w).double(), h.double())
    ref_rows = run_model(_Head(w).double(), h.double(), rows=True)
    floor = run_model(_Head(w).double(), h.double(), zhook=lambda z: z + (zs[0].double() - z).detach(), rows=True)
    floors = [floor_err(f, r, r0) for f, r, r0 in zip(floor, ref_rows, ref)]
    assert_bound(("loss", "grad_hidden", "grad_weight"), got, eager, floors, ref)
