"""fxfuse::linear_cross_entropy against a float64 reference: loss and gradients, both gradient strategies, both
paths (chunked PyTorch; Triton row kernel under TRITON_INTERPRET=1 on CPU, natively on CUDA), the contract
errors, and torch.compile (aot_eager / inductor, dynamic N without recompiles).

Tiny ragged shapes (N, V multiples of nothing) so the whole file runs in well under two minutes on a CPU.
"""
from __future__ import annotations

import os

import pytest
import torch

from fxfuse.errors import FxFuseContractError, FxFuseError
from fxfuse.kernels import linear_cross_entropy as K
from fxfuse.kernels import lm_head_rows
from fxfuse.ops.linear_cross_entropy import linear_cross_entropy

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def rel(a, ref):
    a, ref = a.double(), ref.double()
    n = ref.norm()
    return ((a - ref).norm() / n).item() if n > 0 else (a - ref).norm().item()


def make(N, D, V, dtype=torch.float32, device="cpu", bias=False, ignore_every=5, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else N * 131 + V)
    h = torch.randn(N, D, generator=g).to(dtype).to(device).requires_grad_()
    W = (torch.randn(V, D, generator=g) / D**0.5).to(dtype).to(device).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.5).to(dtype).to(device).requires_grad_() if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        y[::ignore_every] = -100
    return h, W, b, y.to(device)


def check(h, W, b, y, tol, grad_out_fn=None, **kw):
    """Run the op, backprop an upstream grad, compare loss and every grad with the float64 reference."""
    for t in (h, W, b):
        if t is not None:
            t.grad = None
    loss = linear_cross_entropy(h, W, y, bias=b, **kw)
    assert loss.dtype == torch.float32
    go = grad_out_fn(loss) if grad_out_fn else torch.ones_like(loss)
    loss.backward(go)
    ref_kw = {k: v for k, v in kw.items() if k not in ("grad_in_forward", "chunk_bytes")}
    rl, rh, rw, rb = K.lce_reference(h, W, y, b, grad_out=go, **ref_kw)
    assert loss.shape == rl.shape
    if torch.isnan(rl).any():
        assert torch.isnan(loss).all()
    else:
        assert rel(loss, rl) < tol, ("loss", rel(loss, rl))
    assert h.grad.dtype == h.dtype and W.grad.dtype == W.dtype
    assert rel(h.grad, rh) < tol, ("grad_hidden", rel(h.grad, rh))
    assert rel(W.grad, rw) < tol, ("grad_weight", rel(W.grad, rw))
    if b is not None:
        assert b.grad.dtype == b.dtype
        assert rel(b.grad, rb) < tol, ("grad_bias", rel(b.grad, rb))
    return loss


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch):
    """Which row implementation runs: the PyTorch twin, or the Triton kernel (interpreter on CPU)."""
    if request.param == "triton":
        if not K.HAVE_TRITON:
            pytest.skip("triton not installed")
        device = getattr(getattr(request.node, "callspec", None), "params", {}).get("device", "cpu")
        if device == "cpu" and not INTERPRET:
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (see test_triton_interpreter_subprocess)")
        monkeypatch.setattr(K, "FORCE_TRITON", True)
    else:
        monkeypatch.setattr(K, "FORCE_TRITON", False)
    return request.param


# ------------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("grad_in_forward", [True, False])
@pytest.mark.parametrize("variant", ["plain", "bias+softcap", "scale+smoothing", "all"])
def test_matches_reference_fp32(device, reduction, grad_in_forward, variant, path):
    if path == "torch" and device == "cuda":
        pytest.skip("the torch row path is the CPU path")
    bias = variant in ("bias+softcap", "all")
    kw = dict(reduction=reduction, grad_in_forward=grad_in_forward,
              softcap=5.0 if variant in ("bias+softcap", "all") else None,
              scale=0.7 if variant in ("scale+smoothing", "all") else None,
              label_smoothing=0.1 if variant in ("scale+smoothing", "all") else 0.0)
    h, W, b, y = make(29, 24, 61, device=device, bias=bias)
    # upstream grad != 1: x3 for scalars, random per-token weights for "none"
    gfn = (lambda l: torch.full_like(l, 3.0)) if reduction != "none" else (lambda l: torch.rand_like(l) * 2)
    check(h, W, b, y, 1e-4 if not (device == "cuda") else 2e-4, gfn, chunk_bytes=61 * 4 * 8, **kw)  # 4 chunks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_bf16(device, grad_in_forward, path):
    if path == "torch" and device == "cuda":
        pytest.skip("the torch row path is the CPU path")
    h, W, b, y = make(40, 32, 97, dtype=torch.bfloat16, device=device, bias=True)
    check(h, W, b, y, TOL[torch.bfloat16], softcap=30.0, grad_in_forward=grad_in_forward, chunk_bytes=97 * 2 * 16)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction, path):
    h, W, b, y = make(9, 8, 13, bias=True, ignore_every=0)
    y[:] = -100
    loss = linear_cross_entropy(h, W, y, bias=b, reduction=reduction)
    ref = torch.nn.functional.cross_entropy(h.detach() @ W.detach().T + b.detach(), y, reduction=reduction)
    torch.testing.assert_close(loss, ref, equal_nan=True)  # mean: nan, like torch
    loss.sum().backward()
    for t in (h, W, b):
        assert torch.all(t.grad == 0)


def test_custom_ignore_index_and_empty():
    h, W, b, y = make(17, 8, 19, ignore_every=0)
    y[::3] = 7  # ignore class 7 itself
    check(h, W, b, y, 1e-5, ignore_index=7)
    h0 = torch.randn(0, 8, requires_grad=True)
    W.grad = None
    loss = linear_cross_entropy(h0, W, torch.zeros(0, dtype=torch.long), reduction="sum")
    loss.backward()
    assert loss.item() == 0 and h0.grad.shape == (0, 8) and torch.all(W.grad == 0)


def test_leading_dims_and_none_shape():
    h, W, b, y = make(24, 16, 37)
    h3, y3 = h.detach().view(4, 6, 16).requires_grad_(), y.view(4, 6)
    loss = linear_cross_entropy(h3, W, y3, reduction="none")
    assert loss.shape == (4, 6)
    ref = K.lce_reference(h, W, y, reduction="none")[0]
    assert rel(loss.reshape(-1), ref) < 1e-5


@pytest.mark.parametrize("chunk_bytes", [1, 37 * 4 * 3, 1 << 30])
def test_chunk_sizes(chunk_bytes, path):
    """1 byte -> one token per chunk; 3 tokens per chunk (ragged last chunk); everything in one chunk."""
    h, W, b, y = make(23, 16, 37, bias=True)
    check(h, W, b, y, 1e-4, chunk_bytes=chunk_bytes, label_smoothing=0.2)


def test_fp32_grad_weight_accumulation(monkeypatch):
    h, W, b, y = make(31, 16, 37, dtype=torch.bfloat16)
    monkeypatch.setattr(lm_head_rows, "FP32_ACCUM_MAX_BYTES", 1 << 30)
    check(h, W, b, y, TOL[torch.bfloat16], chunk_bytes=37 * 2 * 4)


def test_only_some_inputs_require_grad():
    h, W, b, y = make(11, 8, 13, bias=True)
    W.requires_grad_(False)
    b.requires_grad_(False)
    loss = linear_cross_entropy(h, W, y, bias=b)
    loss.backward()
    assert W.grad is None and b.grad is None
    assert rel(h.grad, K.lce_reference(h, W, y, b)[1]) < 1e-5
    with torch.no_grad():  # no grads asked for: forward only
        assert linear_cross_entropy(h, W, y, bias=b).isfinite()


@pytest.mark.parametrize("g", [1.0, 2.5, -0.25, float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_by_device_scalar(g, dtype, path):
    """The in-place scaling of the saved gradients by the upstream scalar: g == 1 is skipped on the device (no
    host check), every other factor (NaN: consumed gradients) multiplies, odd sizes included."""
    t = torch.randn(3, 1000 + 37).to(dtype)
    expect = (t.float() * g).to(dtype)
    K.scale_by_device_scalar_(t, torch.tensor(g))
    # bf16: one rounding step apart at most (the interpreter rounds fp32 -> bf16 by truncation, CUDA to nearest)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    torch.testing.assert_close(t, expect, equal_nan=True, **tol)


def test_eager_backward_allocates_no_zero_grads_for_aux_outputs():
    """The forward op's auxiliary outputs (lse, the saved gradients) are non-differentiable: eager autograd must
    not materialise zeros of their shapes for the backward (a [V, D] zeros buffer: +1.1 GiB at Gemma-2 size)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(o, torch.Tensor):
                    made.append((str(func), tuple(o.shape)))
            return out

    h, W, b, y = make(12, 8, 50)
    loss = linear_cross_entropy(h, W, y)
    with Record():
        loss.backward()
    allocs = [(f, s) for f, s in made if s in (tuple(W.shape), tuple(h.shape))
              and any(k in f for k in ("zeros", "empty", "fill", "full"))]
    assert not allocs, allocs
    assert rel(W.grad, K.lce_reference(h, W, y)[2]) < 1e-5


def test_backward_twice_with_grad_in_forward_raises():
    h, W, b, y = make(7, 8, 11)
    loss = linear_cross_entropy(h, W, y)
    loss.backward(retain_graph=True)
    with pytest.raises(FxFuseError, match="backward ran twice"):
        loss.backward()
    h.grad = W.grad = None
    loss = linear_cross_entropy(h, W, y, grad_in_forward=False)  # the recompute strategy allows it
    loss.backward(retain_graph=True)
    loss.backward()


def test_property_random_configs():
    hyp = pytest.importorskip("hypothesis")
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=15, deadline=None, derandomize=True)
    @given(N=st.integers(1, 20), D=st.integers(1, 12), V=st.integers(2, 40), red=st.sampled_from(["mean", "sum", "none"]),
           cap=st.sampled_from([None, 3.0]), eps=st.sampled_from([0.0, 0.3]), gif=st.booleans(),
           chunk=st.integers(1, 2000), seed=st.integers(0, 1000))
    def prop(N, D, V, red, cap, eps, gif, chunk, seed):
        h, W, b, y = make(N, D, V, bias=True, ignore_every=3, seed=seed)
        check(h, W, b, y, 1e-4, reduction=red, softcap=cap, label_smoothing=eps, grad_in_forward=gif,
              chunk_bytes=chunk)

    prop()


# ------------------------------------------------------------------------------------------------ Triton on CPU
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU-only hosts' check of the "
                    "kernels; on the GPU host (torch 2.11, triton 3.6) the interpreter raises numpy's 'only "
                    "0-dimensional arrays can be converted to Python scalars'")
def test_triton_interpreter_subprocess():
    """The Triton row kernel itself, through the op, under TRITON_INTERPRET=1 (set before triton is imported,
    hence a subprocess). bf16 buffers included; the kernel uses no tl.dot (the interpreter's bf16 dot is wrong)."""
    if not K.HAVE_TRITON:
        pytest.skip("triton not installed")
    if INTERPRET:
        pytest.skip("already running under the interpreter: the path fixture covers it")
    import subprocess
    import sys
    code = r"""
import torch
from fxfuse.kernels import linear_cross_entropy as K
from fxfuse.ops.linear_cross_entropy import linear_cross_entropy
assert K.FORCE_TRITON
torch.manual_seed(0)
worst = 0.0
for dt, red, gif, cap, eps, sc in [(torch.float32, "mean", True, None, 0.0, None), (torch.float32, "none", False, 4.0, 0.1, 0.5),
                                   (torch.float32, "sum", True, 4.0, 0.1, None), (torch.bfloat16, "mean", False, 30.0, 0.0, None)]:
    h = torch.randn(21, 16).to(dt).requires_grad_(); W = (torch.randn(45, 16) / 4).to(dt).requires_grad_()
    b = torch.randn(45).to(dt).requires_grad_(); y = torch.randint(0, 45, (21,)); y[::4] = -100
    loss = linear_cross_entropy(h, W, y, bias=b, reduction=red, softcap=cap, scale=sc, label_smoothing=eps,
                                grad_in_forward=gif, chunk_bytes=45 * 4 * 5)
    go = torch.rand_like(loss) + 0.5; loss.backward(go)
    r = K.lce_reference(h, W, y, b, reduction=red, softcap=cap, scale=sc, label_smoothing=eps, grad_out=go)
    tol = 1e-4 if dt == torch.float32 else 2e-2
    for a, ref in zip((loss, h.grad, W.grad, b.grad), r):
        e = ((a.double() - ref).norm() / ref.norm()).item(); worst = max(worst, e / tol)
        assert e < tol, (dt, red, gif, cap, e)
print("OK", worst)
"""
    env = dict(os.environ, TRITON_INTERPRET="1", FXFUSE_LCE_FORCE_TRITON="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------ contract
def test_logits_as_hidden_error_eager():
    W = torch.randn(320, 64)
    logits = torch.randn(8, 320)
    y = torch.randint(0, 320, (8,))
    with pytest.raises(FxFuseContractError) as ei:
        linear_cross_entropy(logits, W, y)
    msg = str(ei.value)
    assert "[8, 320]" in msg and "[320, 64]" in msg and "logits, not hidden states" in msg


def test_logits_as_hidden_error_compiled():
    W = torch.randn(320, 64)
    logits = torch.randn(8, 320)
    y = torch.randint(0, 320, (8,))
    torch._dynamo.reset()
    f = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t), backend="aot_eager")
    with pytest.raises(FxFuseContractError) as ei:
        f(logits, W, y)
    assert "logits, not hidden states" in str(ei.value) and "[8, 320]" in str(ei.value)


@pytest.mark.parametrize("case", ["target_numel", "target_dtype", "mixed_dtype", "bad_D", "reduction", "bias_shape"])
def test_contract_errors(case):
    h, W, y = torch.randn(6, 8), torch.randn(10, 8), torch.randint(0, 10, (6,))
    kw = {}
    if case == "target_numel":
        y = y[:5]
    elif case == "target_dtype":
        y = y.float()
    elif case == "mixed_dtype":
        W = W.to(torch.bfloat16)
    elif case == "bad_D":
        h = torch.randn(6, 7)
    elif case == "reduction":
        kw["reduction"] = "avg"
    elif case == "bias_shape":
        kw["bias"] = torch.randn(9)
    with pytest.raises(FxFuseContractError):
        linear_cross_entropy(h, W, y, **kw)


def test_fake_impl_checks_contract():
    """The op node a graph pass inserts is checked too (its fake impl runs the same contract)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        W = torch.randn(320, 64)
        logits = torch.randn(8, 320)
        y = torch.randint(0, 320, (8,))
        with pytest.raises(FxFuseContractError, match="logits, not hidden states"):
            torch.ops.fxfuse.linear_cross_entropy.default(logits, W, y, None, -100, "mean", 0.0, 1.0, 0.0, True)


# ------------------------------------------------------------------------------------------------ torch.compile
def _counting(backend):
    from torch._dynamo.testing import CompileCounterWithBackend
    return CompileCounterWithBackend(backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("reduction,gif", [("mean", True), ("none", False), ("sum", False)])
def test_compile_dynamic_no_recompile(backend, reduction, gif):
    if backend == "inductor" and reduction != "mean":
        pytest.skip("inductor: one strategy is enough for CI time")
    torch._dynamo.reset()
    D, V = 16, 53
    W = (torch.randn(V, D) / 4).requires_grad_()
    b = torch.randn(V).requires_grad_()
    cnt = _counting(backend)

    def f(h, W, y, b, w):
        loss = linear_cross_entropy(h, W, y, bias=b, reduction=reduction, softcap=5.0, grad_in_forward=gif,
                                    chunk_bytes=V * 4 * 8)
        if reduction == "none":
            return (loss * w).sum()  # per-token upstream grads
        return loss * 3

    cf = torch.compile(f, backend=cnt, dynamic=True)
    frames = None
    for N in (37, 50, 64):
        h = torch.randn(N, D, requires_grad=True)
        y = torch.randint(0, V, (N,))
        y[::5] = -100
        W.grad = b.grad = None
        w = torch.rand(N) + 0.5
        cf(h, W, y, b, w).backward()
        go = w.double() if reduction == "none" else torch.tensor(3.0, dtype=torch.float64)
        _, rh, rw, rb = K.lce_reference(h, W, y, b, reduction=reduction, softcap=5.0, grad_out=go)
        assert rel(h.grad, rh) < 1e-4 and rel(W.grad, rw) < 1e-4 and rel(b.grad, rb) < 1e-4
        if frames is None:
            frames = cnt.frame_count
        assert cnt.frame_count == frames, f"recompiled at N={N}"


def test_op_call_signature_for_graph_passes():
    """The exact call a graph pass inserts, with positional args, and the fwd op's fake strides."""
    h, W, b, y = make(12, 8, 21, bias=True)
    loss = torch.ops.fxfuse.linear_cross_entropy.default(h, W, y, b, -100, "mean", 0.0, 1.0, 0.0, True)
    assert rel(loss, K.lce_reference(h, W, y, b)[0]) < 1e-5
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    hd, Wd = h.detach(), W.detach()
    m = FakeTensorMode(shape_env=ShapeEnv())
    fh, fW, fy = m.from_tensor(hd), m.from_tensor(Wd), m.from_tensor(y)
    with m:
        outs = torch.ops.fxfuse.linear_cross_entropy_fwd(fh, fW, fy, None, -100, "none", 0.0, 1.0, 0.0, True,
                                                         True, True, False, 0)
        assert [tuple(o.shape) for o in outs] == [(12,), (2, 12), (12, 8), (21, 8), (0,), ()]  # lse: max, log S
        assert outs[2].stride() == (8, 1) and outs[0].dtype == torch.float32


def test_default_chunk_budget_holds_at_least_1024_tokens():
    """The default logits-chunk budget: 256 MiB, raised to 1024 rows of the vocabulary where that is more (Gemma-2's
    256k: 512 MiB); an explicit budget is kept as given."""
    from fxfuse.kernels import lm_head_rows
    from fxfuse.ops._lm_head import chunk_budget

    gemma = torch.empty(256000, 2304, dtype=torch.bfloat16, device="meta")
    llama = torch.empty(128256, 4096, dtype=torch.bfloat16, device="meta")
    assert lm_head_rows.MIN_DEFAULT_CHUNK_ROWS == 1024
    assert chunk_budget(0, gemma) == 1024 * 256000 * 2
    assert lm_head_rows.rows_per_chunk(256000, 2, chunk_budget(0, gemma), 8192) == 1024
    assert chunk_budget(0, llama) == lm_head_rows.DEFAULT_CHUNK_BYTES == 256 << 20
    assert lm_head_rows.rows_per_chunk(128256, 2, chunk_budget(0, llama), 8192) == 1024
    assert chunk_budget(16 << 20, gemma) == 16 << 20


@pytest.mark.skipif(not INTERPRET, reason="the row kernel's CPU launches need TRITON_INTERPRET=1")
@pytest.mark.parametrize("reduction,grad_in_forward,bias", [("mean", True, False), ("none", False, True)])
def test_tracing_the_forward_op_prewarms_its_launches(monkeypatch, reduction, grad_in_forward, bias):
    """The forward op's fake impl (fxfuse's validation and AOTAutograd trace it before the first real call) asks,
    from fake tensors, for every Triton specialisation the real forward and backward then launch: the row kernel's
    forward (with the gradient written in it, or the statistics only) and its recompute in the backward, or the
    backward's scaling of the saved gradients. The keys are the real launches'; a second trace asks for nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxfuse.kernels import background_compile as BC

    monkeypatch.setattr(K, "FORCE_TRITON", True)
    monkeypatch.setattr(K, "_prewarmed", set())
    asked, launched = [], []
    monkeypatch.setattr(BC, "start", lambda kernel, key, *a: asked.append((kernel, key)))
    monkeypatch.setattr(BC, "in_flight", lambda: True)  # every launch then names its key to wait_for
    monkeypatch.setattr(BC, "wait_for", lambda kernel, key: launched.append((kernel, key)))
    h, W, b, y = make(37, 16, 53, bias=bias)
    args = (-100, reduction, 0.0, 1.0, 0.0, grad_in_forward, True, True, bias, 0)
    mode = FakeTensorMode()
    h0, W0, y0, b0 = (None if t is None else mode.from_tensor(t.detach()) for t in (h, W, y, b))
    with mode:
        for _ in range(2):
            torch.ops.fxfuse.linear_cross_entropy_fwd(h0, W0, y0, b0, *args)
    expected = 2  # rows forward + the gradients' scaling (grad in forward), rows forward + recompute (otherwise)
    assert len(asked) == expected and not launched, asked
    loss = linear_cross_entropy(h, W, y, bias=b, reduction=reduction, grad_in_forward=grad_in_forward)
    # per-token weights (a contiguous upstream grad, as a GRPO-style loss gives; loss.sum()'s is an expand)
    loss.backward(torch.ones_like(loss) if loss.dim() == 0 else torch.rand_like(loss))
    assert len(asked) == expected  # the real call found its launches asked for already
    assert set(asked) == set(launched), (asked, launched)
    kernels = {k for k, _ in asked}
    assert (K._scale_by_device_scalar_kernel in kernels) == grad_in_forward


@pytest.mark.skipif(not INTERPRET, reason="the row kernel's CPU launches need TRITON_INTERPRET=1")
def test_compile_regions_asks_for_the_loss_kernels_at_the_first_block(monkeypatch):
    """compile_regions asks for the fused loss's Triton launches when the first block is called in training, before
    any graph of the step is traced (the loss graph comes after the last block): for a Hugging Face causal LM the
    guess names exactly the launches the first step then makes. An evaluation call first asks for nothing."""
    import fxfuse
    from conftest import tiny_causal_lm
    from fxfuse.kernels import background_compile as BC

    monkeypatch.setattr(K, "FORCE_TRITON", True)
    monkeypatch.setattr(K, "_prewarmed", set())
    asked, launched, graphs_then = [], [], []

    def start(kernel, key, *a):
        asked.append((kernel, key))
        graphs_then.append(len(fxfuse.reports()))

    monkeypatch.setattr(BC, "start", start)
    monkeypatch.setattr(BC, "in_flight", lambda: True)
    monkeypatch.setattr(BC, "wait_for", lambda kernel, key: launched.append((kernel, key)))
    m = tiny_causal_lm("llama", attn_implementation="sdpa")
    fxfuse.clear_reports()
    fxfuse.compile_regions(m)
    ids = torch.randint(0, 128, (2, 19))
    with torch.no_grad():
        m.eval()
        m(input_ids=ids, use_cache=False)
    assert not asked
    m.train()
    fxfuse.clear_reports()
    m(input_ids=ids, labels=ids.clone(), use_cache=False).loss.backward()
    assert asked and graphs_then[0] == 0, graphs_then  # asked before the step's first graph
    assert set(asked) == set(launched), (asked, launched)
    fxfuse.undo_compile_regions(m)


def test_a_failing_early_warm_up_never_breaks_the_forward(monkeypatch):
    """Whatever goes wrong in compile_regions' early warm-up of the loss kernels is logged, never raised: the
    training call runs and gives the eager model's loss."""
    import fxfuse
    from conftest import tiny_causal_lm

    def broken(*a, **k):
        raise RuntimeError("no warm-up today")

    monkeypatch.setattr(K, "lce_prewarm", broken)
    ref = tiny_causal_lm("llama", attn_implementation="sdpa")
    m = tiny_causal_lm("llama", attn_implementation="sdpa").train()
    fxfuse.compile_regions(m)
    ids = torch.randint(0, 128, (2, 11))
    out = m(input_ids=ids, labels=ids.clone(), use_cache=False)
    want = ref(input_ids=ids, labels=ids.clone(), use_cache=False)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    fxfuse.undo_compile_regions(m)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of fake CUDA tensors on a machine without CUDA")
def test_tracing_fake_cuda_tensors_without_cuda_starts_no_warm_up():
    """The fused ops' fake impls ask for Triton warm-ups; fake CUDA tensors traced where this process has no CUDA
    (export or cross-compilation on a CPU machine) must trace as before, with nothing started (it raised 'Torch not
    compiled with CUDA enabled' from the warm-up's stand-in tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxfuse.kernels import background_compile as BC

    with FakeTensorMode():
        h, w = torch.empty(8, 4, device="cuda"), torch.empty(16, 4, device="cuda")
        y = torch.zeros(8, dtype=torch.long, device="cuda")
        loss, lse, gh, gw, gb, _ = torch.ops.fxfuse.linear_cross_entropy_fwd(h, w, y, None, -100, "mean", 0.0, 1.0,
                                                                             0.0, True, True, True, False, 0)
        assert loss.device.type == "cuda" and gh.shape == (8, 4) and gw.shape == (16, 4)
        A, B = torch.empty(4, 4, device="cuda"), torch.empty(16, 4, device="cuda")
        seeds = torch.zeros(1, dtype=torch.long, device="cuda")
        (y0,), V = torch.ops.fxfuse.lora_linear_fwd(h, [w], [], [-1], A, [B], seeds, [4], [1], [2.0], [0.0])
        assert y0.shape == (8, 16) and V.shape == (8, 4)
    assert not BC.in_flight()
