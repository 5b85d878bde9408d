"""fxfuse::linear_log_probs against a float64 reference (plain log_softmax / gather / entropy on upcast inputs):
log-probs and entropy values, gradients under random per-token upstream grads (logp alone, entropy alone, both),
temperature and softcap (TRL order: softcap, then / temperature), both row paths (chunked PyTorch; the Triton row
kernel under TRITON_INTERPRET=1 on CPU, natively on CUDA), contract errors, torch.compile with dynamic N.

Tiny ragged shapes (N, V multiples of nothing), several chunks per call.
"""
from __future__ import annotations

import os

import pytest
import torch

from fxfuse.errors import FxFuseContractError
from fxfuse.kernels import linear_log_probs as K
from fxfuse.ops.linear_log_probs import linear_log_probs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
#: values (logp, entropy) / gradients. bf16: the logits chunk and d loss/d logits are bf16 (as in eager);
#: eager bf16 (F.linear in bf16, then fp32 log_softmax) is at ~2e-2 on the gradients for the same inputs.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1.5e-2)}


def rel(a, ref):
    a, ref = a.double(), ref.double()
    n = ref.norm()
    return ((a - ref).norm() / n).item() if n > 0 else (a - ref).norm().item()


def make(N, D, V, dtype=torch.float32, device="cpu", bias=True, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else N * 131 + V)
    h = torch.randn(N, D, generator=g).to(dtype).to(device).requires_grad_()
    W = (torch.randn(V, D, generator=g) * (2.0 / D**0.5)).to(dtype).to(device).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.5).to(dtype).to(device).requires_grad_() if bias else None
    y = torch.randint(0, V, (N,), generator=g).to(device)
    return h, W, b, y


def upstream(N, mode, device="cpu", seed=0):
    """Per-token upstream grads: advantages for logp, beta * mask for the entropy (GRPO-like)."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(N, generator=g).to(device)
    mask = (torch.rand(N, generator=g) > 0.3).float().to(device)
    g_logp = adv if mode in ("logp", "both") else None
    g_ent = 0.05 * mask if mode in ("ent", "both") else None
    if mode == "ent":
        g_ent = g_ent * 20  # entropy alone: an O(1) signal
    return g_logp, g_ent


def check(h, W, b, y, mode, dtype=torch.float32, tol=None, **kw):
    """Run the op (with entropy), backprop sum(g_logp*logp) + sum(g_ent*H), compare with the float64 reference."""
    tv, tg = tol or TOL[dtype]
    for t in (h, W, b):
        if t is not None:
            t.grad = None
    logp, ent = linear_log_probs(h, W, y, bias=b, return_entropy=True, **kw)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == y.shape
    g_logp, g_ent = upstream(y.numel(), mode, device=h.device)
    loss = 0.0
    if g_logp is not None:
        loss = loss + (g_logp * logp).sum()
    if g_ent is not None:
        loss = loss + (g_ent * ent).sum()
    loss.backward()
    ref_kw = {k: v for k, v in kw.items() if k != "chunk_bytes"}
    rl, re_, rh, rw, rb = K.logp_reference(h, W, y, b, g_logp=g_logp, g_ent=g_ent, **ref_kw)
    assert rel(logp, rl) < tv, ("logp", rel(logp, rl))
    assert rel(ent, re_) < tv, ("entropy", rel(ent, re_))
    assert h.grad.dtype == h.dtype and W.grad.dtype == W.dtype
    assert rel(h.grad, rh) < tg, ("grad_hidden", rel(h.grad, rh))
    assert rel(W.grad, rw) < tg, ("grad_weight", rel(W.grad, rw))
    if b is not None:
        assert b.grad.dtype == b.dtype
        assert rel(b.grad, rb) < tg, ("grad_bias", rel(b.grad, rb))


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch):
    """Which row implementation runs: the PyTorch twin, or the Triton kernel (interpreter on CPU). The Triton
    path uses BLOCK_V=16 so that rows span several slices (the online max/sum/entropy combine is exercised)."""
    if request.param == "triton":
        if not K.HAVE_TRITON:
            pytest.skip("triton not installed")
        device = getattr(getattr(request.node, "callspec", None), "params", {}).get("device", "cpu")
        if device == "cpu" and not INTERPRET:
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set by conftest.py before import)")
        monkeypatch.setattr(K, "FORCE_TRITON", True)
        monkeypatch.setattr(K, "ROW_CONFIG", {"BLOCK_V": 16})
    else:
        monkeypatch.setattr(K, "FORCE_TRITON", False)
    return request.param


# ------------------------------------------------------------------------------------------------ numerics
@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.0, 30.0), (0.7, 30.0)])
@pytest.mark.parametrize("mode", ["logp", "ent", "both"])
def test_matches_reference(device, dtype, temperature, softcap, mode, path):
    if path == "torch" and device == "cuda":
        pytest.skip("the torch row path is the CPU path")
    if path == "triton" and device == "cpu" and mode != "both" and (temperature, softcap) != (0.7, 30.0):
        pytest.skip("interpreter time: single-grad modes run with temperature and softcap both on")
    N, D, V = 29, 24, 61
    h, W, b, y = make(N, D, V, dtype=dtype, device=device)
    # 4 tokens per chunk -> 8 chunks, the last one ragged
    check(h, W, b, y, mode, dtype, temperature=temperature, softcap=softcap, chunk_bytes=V * h.element_size() * 4)


def test_softcap_then_temperature_order():
    """z = softcap(logits) / temperature (TRL: the model softcaps, the trainer divides), not softcap(logits / T)."""
    h, W, b, y = make(13, 8, 21, bias=False)
    with torch.no_grad():
        W.mul_(8.0)  # logits of tens: the two orders differ clearly with cap 5
    logp = linear_log_probs(h, W, y, temperature=0.5, softcap=5.0)
    logits = (h @ W.T).double()
    trl = torch.log_softmax((5.0 * torch.tanh(logits / 5.0)) / 0.5, -1).gather(1, y[:, None])[:, 0]
    other = torch.log_softmax(5.0 * torch.tanh((logits / 0.5) / 5.0), -1).gather(1, y[:, None])[:, 0]
    assert rel(logp, trl) < 1e-5 and rel(logp, other) > 1e-2


def test_no_bias_logp_only_and_leading_dims(path):
    """return_entropy=False returns one tensor with index's shape; [B, T] inputs; strided upstream grads."""
    h, W, _, y = make(24, 16, 37, bias=False)
    h3, y3 = h.detach().view(4, 6, 16).requires_grad_(), y.view(4, 6)
    logp = linear_log_probs(h3, W, y3, temperature=0.9, chunk_bytes=37 * 4 * 5)
    assert isinstance(logp, torch.Tensor) and logp.shape == (4, 6) and logp.dtype == torch.float32
    adv = torch.randn(4, 7)[:, :6]  # non-contiguous
    (adv * logp).sum().backward()
    rl, _, rh, rw, _ = K.logp_reference(h3, W, y3, None, temperature=0.9, g_logp=adv)
    assert rel(logp, rl) < 1e-5 and rel(h3.grad, rh) < 1e-5 and rel(W.grad, rw) < 1e-5


@pytest.mark.slow
def test_one_output_unused(path):
    """Entropy returned but only logp used (and vice versa): the unused output's grad is None, not zeros."""
    for use in ("logp", "ent"):
        h, W, b, y = make(17, 8, 23, seed=3)
        logp, ent = linear_log_probs(h, W, y, bias=b, softcap=30.0, return_entropy=True, chunk_bytes=23 * 4 * 6)
        g = torch.randn(17)
        ((g * logp) if use == "logp" else (g * ent)).sum().backward()
        kw = {"g_logp": g} if use == "logp" else {"g_ent": g}
        _, _, rh, rw, rb = K.logp_reference(h, W, y, b, softcap=30.0, **kw)
        assert rel(h.grad, rh) < 1e-5 and rel(W.grad, rw) < 1e-5 and rel(b.grad, rb) < 1e-5


def test_only_some_inputs_require_grad_and_no_grad():
    h, W, b, y = make(11, 8, 13)
    W.requires_grad_(False)
    b.requires_grad_(False)
    logp, ent = linear_log_probs(h, W, y, bias=b, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert W.grad is None and b.grad is None
    ones = torch.ones(11)
    assert rel(h.grad, K.logp_reference(h, W, y, b, g_logp=ones, g_ent=ones)[2]) < 1e-5
    with torch.no_grad():
        lp = linear_log_probs(h, W, y, bias=b)
        assert not lp.requires_grad and torch.all(lp <= 0)
    # backward twice (retain_graph): the recompute strategy keeps nothing that the first backward consumes
    h.grad = None
    lp = linear_log_probs(h, W, y)
    lp.sum().backward(retain_graph=True)
    g1 = h.grad.clone()
    lp.sum().backward()
    torch.testing.assert_close(h.grad, 2 * g1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, 30.0)])
def test_frozen_head_forms_the_gradient_in_the_forward(dtype, temperature, softcap, path):
    """A frozen lm-head and log-probs alone: the forward forms d logp / d hidden per unit upstream gradient and
    the backward only scales it (no backward op, no recompute). Against float64 under random per-token upstream
    gradients, ragged chunks, peaked rows (logits of tens) and flat ones: no further from it than the recompute
    path is (2x at most), and exact zeros for a zero upstream gradient; a second backward works."""
    N, D, V = 29, 24, 61
    h, W, b, y = make(N, D, V, dtype=dtype, seed=11)
    W.requires_grad_(False)
    b.requires_grad_(False)
    with torch.no_grad():
        W[:, :4].mul_(6.0)  # some rows peaked
        h[::3].mul_(0.01)  # some nearly flat
    g = torch.randn(N)
    g[5] = 0.0
    chunk = V * h.element_size() * 4
    errs = {}
    for name in ("unit", "recompute"):
        hh = h.detach().clone().requires_grad_()
        if name == "recompute":  # the same call with the weight trainable takes the recompute path
            Wt = W.detach().clone().requires_grad_()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            logp = linear_log_probs(hh, W if name == "unit" else Wt, y, bias=b, temperature=temperature,
                                    softcap=softcap, chunk_bytes=chunk)
            (g * logp).sum().backward(retain_graph=True)
        bwd_ops = [e.name for e in prof.events() if e.name == "fxfuse::linear_log_probs_bwd"]
        assert bool(bwd_ops) == (name == "recompute"), (name, bwd_ops)
        rl, _, rh, _, _ = K.logp_reference(hh, W, y, b, temperature=temperature, softcap=softcap, g_logp=g)
        errs[name] = (rel(logp, rl), rel(hh.grad, rh))
        if name == "unit":
            assert torch.all(hh.grad[5] == 0)
            first = hh.grad.clone()
            (g * logp).sum().backward()  # saved unit gradient is not consumed
            torch.testing.assert_close(hh.grad, 2 * first)
    tol = TOL[dtype]
    assert errs["unit"][0] <= tol[0] and errs["unit"][1] <= tol[1], errs
    assert errs["unit"][1] <= 2 * errs["recompute"][1] + 1e-7, errs


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30])
def test_chunk_extremes_and_empty(chunk_bytes, path):
    """1 byte -> one token per chunk; everything in one chunk; N = 0."""
    h, W, b, y = make(9, 8, 19)
    check(h, W, b, y, "both", chunk_bytes=chunk_bytes, temperature=0.7, softcap=30.0)
    h0 = torch.randn(0, 8, requires_grad=True)
    W.grad = b.grad = None
    lp, ent = linear_log_probs(h0, W, torch.zeros(0, dtype=torch.long), bias=b, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == ent.shape == (0,) and h0.grad.shape == (0, 8)
    assert torch.all(W.grad == 0) and torch.all(b.grad == 0)


def test_peaked_entropy_precision(path):
    """Nearly one-hot rows (entropy down to ~1e-5): every row's entropy keeps its relative precision in fp32 (no
    lse - E[z] cancellation, log1p(S - 1)); eager fp32 (log_softmax, -(p * logp).sum()) is ~1e-2 off there.
    The entropy gradient -p (z - E[z]) of such rows carries ~ulp(|z|) absolute error (z - E[z] is formed in fp32):
    3e-5 relative over the whole gradient."""
    h, W, b, y = make(12, 8, 45, bias=False, seed=7)
    with torch.no_grad():
        W.mul_(6.0)
    logp, ent = linear_log_probs(h, W, y, temperature=0.7, return_entropy=True, chunk_bytes=45 * 4 * 5)
    _, re_, _, _, _ = K.logp_reference(h, W, y, None, temperature=0.7)
    assert re_.min() < 1e-3, "inputs are not peaked enough for this test"
    assert torch.all(((ent.double() - re_).abs() / re_) < 1e-3), ((ent.double() - re_).abs() / re_).max()
    check(h, W, None, y, "ent", temperature=0.7, chunk_bytes=45 * 4 * 5, tol=(1e-5, 3e-5))


def test_property_random_configs():
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(N=st.integers(1, 20), D=st.integers(1, 12), V=st.integers(2, 40), bias=st.booleans(),
           cap=st.sampled_from([None, 3.0, 30.0]), temp=st.sampled_from([0.5, 1.0, 1.3]),
           mode=st.sampled_from(["logp", "ent", "both"]), chunk=st.integers(1, 2000), seed=st.integers(0, 1000))
    def prop(N, D, V, bias, cap, temp, mode, chunk, seed):
        h, W, b, y = make(N, D, V, bias=bias, seed=seed)
        check(h, W, b, y, mode, temperature=temp, softcap=cap, chunk_bytes=chunk)

    prop()


# ------------------------------------------------------------------------------------------------ statistics
def _stats_case(dtype):
    """Rows with ties at the maximum (integer logits: index on the first max, on a later max, off the max),
    a peaked row and a flat one; ragged V so the last slice is partial."""
    N, D, V = 9, 4, 37
    g = torch.Generator().manual_seed(3)
    W = torch.randint(-2, 3, (V, D), generator=g).float()
    h = torch.randint(-2, 3, (N, D), generator=g).float()
    h[7] = torch.tensor([40.0, 0, 0, 0])   # peaked: one logit far above the rest
    h[8] = 0.0                             # flat: every logit 0, the first column is the argmax
    logits = h @ W.T
    y = torch.randint(0, V, (N,), generator=g)
    for row, k in ((0, 0), (1, 1), (2, -1)):  # first max, second max, last max (ties where there are any)
        maxes = (logits[row] == logits[row].max()).nonzero().flatten()
        y[row] = maxes[k]
    y[7] = logits[7].argmax()
    y[8] = 3
    return h.to(dtype), W.to(dtype), y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature,softcap", [(1.0, 0.0), (0.7, 30.0)])
def test_statistics_match_reference(device, dtype, temperature, softcap, path):
    """is_top1 (argmax's first-maximum rule, ties included), the mean logit and log sum p^2 against float64,
    on both row paths; asking for them leaves log-probs and entropy as they were."""
    if path == "torch" and device == "cuda":
        pytest.skip("the torch row path is the CPU path")
    h, W, y = (t.to(device) for t in _stats_case(dtype))
    kw = dict(temperature=temperature, softcap=softcap, return_entropy=True, chunk_bytes=W.shape[0] * 4 * 4)
    lp, ent, top1, mean, lsq = torch.ops.fxfuse.linear_log_probs(h, W, y, None, kw["temperature"], kw["softcap"],
                                                                 True, kw["chunk_bytes"], True, True, True)
    lp0, ent0, *rest = torch.ops.fxfuse.linear_log_probs(h, W, y, None, kw["temperature"], kw["softcap"], True,
                                                         kw["chunk_bytes"])
    assert all(t.numel() == 0 for t in rest)
    assert torch.equal(lp, lp0) and torch.equal(ent, ent0)
    rt, rm, rl = K.logp_stats_reference(h, W, y, None, temperature, softcap or None)
    assert top1.dtype == torch.bool and torch.equal(top1, rt), (top1, rt)
    n_max = [int((W.double() @ h[r].double()).eq((W.double() @ h[r].double()).max()).sum()) for r in range(3)]
    assert max(n_max) > 1, n_max  # the case holds a tie at the maximum
    assert rt[0] and rt[1] == (n_max[1] == 1) and rt[2] == (n_max[2] == 1)
    # bf16 logits with a softcap on CUDA take the hardware tanh (2^-11 relative, below bf16's own rounding)
    tol = 2e-3 if (device == "cuda" and dtype == torch.bfloat16 and softcap) else 1e-5
    assert rel(mean, rm) < tol and rel(lsq, rl) < tol, (rel(mean, rm), rel(lsq, rl))
    # the peaked row: log sum p^2 ~ -2 (1 - p_max), kept at its relative precision
    assert abs(lsq[7].double() / rl[7] - 1) < max(tol, 1e-4), (lsq[7], rl[7])


# ------------------------------------------------------------------------------------------------ row kernel
@pytest.mark.slow
@pytest.mark.skipif(not (K.HAVE_TRITON and (INTERPRET or torch.cuda.is_available())),
                    reason="needs triton + TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_v", [8, 64])
def test_row_kernel_matches_torch_twin(dtype, block_v, monkeypatch):
    """The Triton row step on one chunk against the PyTorch row step, forward and backward, several slices per
    row (BLOCK_V=8, V=45) and one (BLOCK_V=64)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # exact tanh: the twin comparison checks the kernel's logic; the hardware tanh it takes for bf16 logits on CUDA
    # (2^-11 relative) is held to the float64 reference by test_matches_reference
    monkeypatch.setattr(K, "ROW_CONFIG", {"BLOCK_V": block_v, "FAST_TANH": False})
    C, V = 7, 45
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(C, V, generator=g) * 4).to(dtype).to(device)
    idx = torch.randint(0, V, (C,), generator=g).to(device)
    gl = torch.randn(C, generator=g).to(device)
    ge = torch.randn(14, generator=g).to(device)[::2]  # strided upstream grad
    for T, cap in [(1.0, 0.0), (0.7, 5.0)]:
        outs = {}
        for name, fwd, bwd in [("torch", K._rows_torch_fwd, K._rows_torch_bwd),
                               ("triton", K._rows_triton_fwd, K._rows_triton_bwd)]:
            lp, ent, ez = (torch.empty(C, device=device) for _ in range(3))
            lse = torch.empty(2, C, device=device)  # row statistics: max, log S
            fwd(logits, idx, lp, ent, lse, ez, T, cap)
            buf = logits.clone()
            bwd(buf, idx, lse, ez, gl, ge, T, cap)
            outs[name] = (lp, ent, lse, ez, buf)
        for a, r, what in zip(outs["triton"], outs["torch"], ("logp", "ent", "lse", "ez", "dlogits")):
            tol = 1e-5 if (dtype == torch.float32 or what != "dlogits") else 1e-2
            assert rel(a, r) < tol, (what, T, cap, rel(a, r))


# ------------------------------------------------------------------------------------------------ contract
def _logits_case():
    W = torch.randn(320, 64)
    logits = torch.randn(8, 320)
    y = torch.randint(0, 320, (8,))
    return logits, W, y


def test_logits_as_hidden_error_eager():
    logits, W, y = _logits_case()
    with pytest.raises(FxFuseContractError) as ei:
        linear_log_probs(logits, W, y)
    msg = str(ei.value)
    assert "fxfuse::linear_log_probs" in msg and "logits, not hidden states" in msg
    assert "[8, 320]" in msg and "[320, 64]" in msg


def test_logits_as_hidden_error_compiled():
    logits, W, y = _logits_case()
    f = torch.compile(lambda h, w, t: linear_log_probs(h, w, t, return_entropy=True), backend="aot_eager")
    with pytest.raises(FxFuseContractError) as ei:
        f(logits, W, y)
    assert "logits, not hidden states" in str(ei.value) and "[8, 320]" in str(ei.value)


def test_fake_impl_checks_contract():
    """The op node a graph pass inserts is checked too (its fake impl runs the same contract)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits, W, y = _logits_case()
        with pytest.raises(FxFuseContractError, match="logits, not hidden states"):
            torch.ops.fxfuse.linear_log_probs.default(logits, W, y, None, 1.0, 0.0, True)


@pytest.mark.parametrize("case", ["index_numel", "index_dtype", "mixed_dtype", "bad_D", "temperature", "bias"])
def test_contract_errors(case):
    h, W, y = torch.randn(6, 8), torch.randn(10, 8), torch.randint(0, 10, (6,))
    kw = {}
    if case == "index_numel":
        y = y[:5]
    elif case == "index_dtype":
        y = y.float()
    elif case == "mixed_dtype":
        W = W.to(torch.bfloat16)
    elif case == "bad_D":
        h = torch.randn(6, 7)
    elif case == "temperature":
        kw["temperature"] = 0.0
    elif case == "bias":
        kw["bias"] = torch.randn(9)
    with pytest.raises(FxFuseContractError, match="fxfuse::linear_log_probs"):
        linear_log_probs(h, W, y, **kw)


def test_fake_shapes_and_strides():
    """The fwd/bwd fake impls: dtypes, shapes and strides (Inductor asserts them for custom-op outputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    h, W, b, y = make(12, 8, 21)
    m = FakeTensorMode(shape_env=ShapeEnv())
    fh, fW, fb, fy = (m.from_tensor(t.detach()) for t in (h, W, b, y))
    with m:
        for ent in (True, False):
            stats = [ent, not ent, ent]  # is_top1, mean_logits, log_sum_sq_probs
            outs = torch.ops.fxfuse.linear_log_probs_fwd(fh, fW, fy, fb, 0.7, 30.0, ent, True, True, True, 0, stats)
            n, m = (12, 0) if ent else (0, 12)
            # logp, entropy, lse (max, log S), ez, then the statistics, then the unit gradient (not here: W trains)
            assert [tuple(o.shape) for o in outs] == [(12,), (n,), (2, 12), (n,), (n,), (m,), (n,), (0,)]
            assert [o.dtype for o in outs] == [torch.float32] * 4 + [torch.bool] + [torch.float32] * 3
        # a frozen head, log-probs alone: the forward forms d logp / d hidden per unit upstream gradient
        unit = torch.ops.fxfuse.linear_log_probs_fwd(fh, fW, fy, fb, 0.7, 30.0, False, True, False, False, 0,
                                                     [False] * 3)[-1]
        assert unit.shape == (12, 8) and unit.stride() == (8, 1) and unit.dtype == fh.dtype
        gl = torch.empty(12)
        gh, gw, gb = torch.ops.fxfuse.linear_log_probs_bwd(gl, None, fh, fW, fy, fb, outs[2], outs[3], 0.7, 30.0,
                                                           True, True, True, 0)
        assert gh.shape == (12, 8) and gh.stride() == (8, 1) and gw.shape == (21, 8) and gb.shape == (21,)


# ------------------------------------------------------------------------------------------------ torch.compile
def test_compile_dynamic_no_recompile():
    """aot_eager, dynamic=True, N in {37, 50, 64}: one frame, GRPO-like loss, grads against the reference."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    D, V = 16, 53
    W = (torch.randn(V, D) / 2).requires_grad_()
    b = torch.randn(V).requires_grad_()
    cnt = CompileCounterWithBackend("aot_eager")

    def f(h, W, y, b, adv, mask):
        logp, ent = linear_log_probs(h, W, y, bias=b, temperature=0.7, softcap=30.0, return_entropy=True,
                                     chunk_bytes=V * 4 * 8)
        return (adv * logp).sum() + 0.1 * (mask * ent).sum()

    cf = torch.compile(f, backend=cnt, dynamic=True)
    frames = None
    for N in (37, 50, 64):
        h = torch.randn(N, D, requires_grad=True)
        y = torch.randint(0, V, (N,))
        adv, mask = torch.randn(N), (torch.rand(N) > 0.3).float()
        W.grad = b.grad = None
        out = cf(h, W, y, b, adv, mask)
        out.backward()
        rl, re_, rh, rw, rb = K.logp_reference(h, W, y, b, temperature=0.7, softcap=30.0, g_logp=adv,
                                               g_ent=0.1 * mask)
        ref_out = (adv.double() * rl).sum() + (0.1 * mask.double() * re_).sum()
        assert abs(out.item() - ref_out.item()) < 1e-4 * max(1.0, abs(ref_out.item()))
        assert rel(h.grad, rh) < 1e-5 and rel(W.grad, rw) < 1e-5 and rel(b.grad, rb) < 1e-5
        if frames is None:
            frames = cnt.frame_count
        assert cnt.frame_count == frames, f"recompiled at N={N}"
    assert frames == 1
