"""``fxfuse::lora_linear``: forward and every gradient against a float64 reference (same dropout masks), on the
chunked PyTorch path and on the Triton kernels (interpreter on CPU); dropout statistics, determinism, contract
errors, compile with dynamic shapes, activation checkpointing."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fxfuse
from fxfuse.kernels import lora_linear as K
from fxfuse.kernels.triton_support import interpreting
from fxfuse.ops.lora_linear import lora_dropout_keep_mask, lora_linear


def _inputs(N, din, dout, ranks, dtype, adapter_dtype=None, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    adt = adapter_dtype or dtype
    x = torch.randn(N, din, generator=g).to(dtype).requires_grad_()
    W = (torch.randn(dout, din, generator=g) / din ** 0.5).to(dtype)
    b = torch.randn(dout, generator=g).to(dtype) if bias else None
    As = [(torch.randn(r, din, generator=g) / din ** 0.5).to(adt).requires_grad_() for r in ranks]
    Bs = [(torch.randn(dout, r, generator=g) / r ** 0.5).to(adt).requires_grad_() for r in ranks]
    return x, W, b, As, Bs


def _check(x, W, b, As, Bs, scalings, ps, tol, fn=lora_linear):
    """Run the op, rebuild its masks from the seeds it drew, compare y and every gradient with float64."""
    state = torch.random.get_rng_state()
    y = fn(x, W, As, Bs, scalings, bias=b, dropout_p=list(ps))
    go = torch.randn_like(y)
    got = torch.autograd.grad(y, [x] + As + Bs, go)
    torch.random.set_rng_state(state)
    seeds = K.draw_seeds(len(ps), "cpu")
    N, din = x.shape
    masks = [lora_dropout_keep_mask(seeds[i], N, din, p, "cpu") if p > 0 else None for i, p in enumerate(ps)]
    d = lambda t: t.detach().double().requires_grad_()  # noqa: E731
    xr, Ar, Br = d(x), [d(a) for a in As], [d(q) for q in Bs]
    yr = K.lora_reference(xr, W.double(), None if b is None else b.double(), Ar, Br, scalings, masks, ps)
    ref = torch.autograd.grad(yr, [xr] + Ar + Br, go.double())
    assert y.dtype == x.dtype and y.shape == (N, W.shape[0])
    for name, a, r in [("y", y, yr)] + list(zip(["x"] + [f"A{i}" for i in range(len(As))] +
                                              [f"B{i}" for i in range(len(Bs))], got, ref)):
        err = ((a.double() - r).norm() / r.norm()).item()
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"
    for a, g in zip(As + Bs, got[1:]):
        assert g.dtype == a.dtype  # fp32 adapters get fp32 gradients
    return masks


CASES = [  # N, din, dout, ranks, dropout ps, bias
    (37, 48, 40, (4,), (0.0,), False),
    (37, 48, 40, (4,), (0.25,), True),
    (70, 72, 33, (4, 8), (0.0, 0.3), False),
    (5, 16, 24, (2, 3), (0.5, 0.1), True),
]



def _force_triton_on_cpu(monkeypatch):
    """Run the Triton kernels on the CPU tensors of these tests: only through the interpreter (conftest sets
    TRITON_INTERPRET=1 on CPU-only machines); on a GPU host the compiled kernels cannot read CPU memory."""
    if not K.HAVE_TRITON:
        pytest.skip("triton not installed")
    if not interpreting():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (CPU-only hosts)")
    monkeypatch.setattr(K, "FORCE_TRITON", True)

@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-r{'+'.join(map(str, c[3]))}-p{'+'.join(map(str, c[4]))}")
def test_matches_float64_reference_torch_path(case):
    N, din, dout, ranks, ps, bias = case
    x, W, b, As, Bs = _inputs(N, din, dout, ranks, torch.float32, bias=bias)
    _check(x, W, b, As, Bs, [2.0, 0.5][:len(ranks)], ps, tol=1e-5)


@pytest.mark.parametrize("case", CASES[1:3], ids=["one-adapter-dropout", "two-adapters"])
def test_matches_float64_reference_triton_kernels(case, monkeypatch):
    """The Triton kernels themselves (interpreter on CPU): ragged sizes, masked rank padding, atomics."""
    _force_triton_on_cpu(monkeypatch)
    N, din, dout, ranks, ps, bias = case
    x, W, b, As, Bs = _inputs(N, din, dout, ranks, torch.float32, bias=bias)
    _check(x, W, b, As, Bs, [2.0, 0.5][:len(ranks)], ps, tol=2e-5)  # 16-bit dropout threshold: p within 2**-17


def test_bf16_and_fp32_adapters_on_bf16_base():
    x, W, b, As, Bs = _inputs(64, 48, 40, (8,), torch.bfloat16, bias=True)
    _check(x, W, b, As, Bs, [2.0], (0.1,), tol=1e-2)
    x, W, b, As, Bs = _inputs(64, 48, 40, (8,), torch.bfloat16, adapter_dtype=torch.float32)
    _check(x, W, b, As, Bs, [2.0], (0.1,), tol=1e-2)


def test_dropout_mask_statistics_and_determinism():
    N, din, p = 512, 256, 0.2
    m1 = lora_dropout_keep_mask(torch.tensor(1), N, din, p, "cpu")
    m2 = lora_dropout_keep_mask(torch.tensor(2), N, din, p, "cpu")
    assert m1.dtype == torch.bool and m1.shape == (N, din)
    assert abs(m1.float().mean().item() - (1 - p)) < 0.01
    assert (m1 != m2).float().mean().item() > 0.2  # independent masks per seed
    assert torch.equal(m1, lora_dropout_keep_mask(torch.tensor(1), N, din, p, "cpu"))
    # the op: same torch seed -> same output; a new draw -> a different mask
    x, W, b, As, Bs = _inputs(N, din, 16, (4,), torch.float32)
    torch.manual_seed(3)
    y1 = lora_linear(x, W, As[0], Bs[0], 1.0, dropout_p=p)
    y2 = lora_linear(x, W, As[0], Bs[0], 1.0, dropout_p=p)
    torch.manual_seed(3)
    y3 = lora_linear(x, W, As[0], Bs[0], 1.0, dropout_p=p)
    assert torch.equal(y1, y3) and not torch.equal(y1, y2)


def test_triton_mask_statistics(monkeypatch):
    _force_triton_on_cpu(monkeypatch)
    m = lora_dropout_keep_mask(torch.tensor(7), 96, 200, 0.3, "cpu")
    assert abs(m.float().mean().item() - 0.7) < 0.02
    # per column residue mod 8 (the 8 elements one Philox call covers) the keep rate is the same
    for j in range(8):
        assert abs(m[:, j::8].float().mean().item() - 0.7) < 0.06


@pytest.mark.parametrize("bad", ["a_in", "b_out", "rank", "p", "dtype"])
def test_contract_errors_name_op_and_shapes(bad):
    x, W, b, As, Bs = _inputs(8, 16, 12, (4,), torch.float32)
    A, B, p = As[0], Bs[0], 0.0
    if bad == "a_in":
        A = torch.randn(4, 15)
    elif bad == "b_out":
        B = torch.randn(11, 4)
    elif bad == "rank":
        B = torch.randn(12, 5)
    elif bad == "p":
        p = 1.0
    elif bad == "dtype":
        W = W.double()
    with pytest.raises(fxfuse.FxFuseContractError, match="fxfuse::lora_linear") as e:
        lora_linear(x, W, A, B, 1.0, dropout_p=p)
    assert "x: [8, 16]" in str(e.value)


def test_compiled_dynamic_shapes_no_recompile():
    from torch._dynamo.testing import CompileCounter

    x, W, b, As, Bs = _inputs(40, 24, 20, (4,), torch.float32)
    cnt = CompileCounter()
    f = torch.compile(lambda x: lora_linear(x, W, As[0], Bs[0], 2.0, dropout_p=0.1), backend=cnt, dynamic=True,
                      fullgraph=True)
    for n in (40, 57, 13):
        xi = torch.randn(n, 24, requires_grad=True)
        f(xi).sum().backward()
        assert xi.grad.shape == (n, 24)
    assert cnt.frame_count == 1


@pytest.mark.slow
def test_checkpointed_recompute_uses_the_forward_mask():
    """Activation checkpointing recomputes the op in the backward: the seed is a saved graph value (drawn by
    torch.randint in the op's decomposition), so the recomputed mask is the forward's."""
    import torch._inductor.config as ic

    x, W, b, As, Bs = _inputs(32, 24, 20, (4,), torch.float32)
    layer = lambda x: torch.tanh(lora_linear(x, W, As[0], Bs[0], 2.0, dropout_p=0.5))  # noqa: E731

    def run(fn):
        torch.manual_seed(11)
        y = fn(x)
        return [y] + list(torch.autograd.grad(y.sum(), [x, As[0], Bs[0]]))

    ref = run(layer)
    for fn in (lambda x: checkpoint(layer, x, use_reentrant=False),
               torch.compile(lambda x: checkpoint(layer, x, use_reentrant=False), backend="aot_eager")):
        for a, r in zip(run(fn), ref):
            torch.testing.assert_close(a, r)
    with ic.patch(fallback_random=True):  # Inductor draws the seed with aten's generator: same seed as eager
        got = run(torch.compile(lambda x: checkpoint(layer, x, use_reentrant=False)))
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ sibling groups
def _group_inputs(N, din, douts, ranks, dtype, adapter_dtype=None, biases=(), trainable_w=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    adt = adapter_dtype or dtype
    x = torch.randn(N, din, generator=g).to(dtype).requires_grad_()
    Ws = [(torch.randn(d, din, generator=g) / din ** 0.5).to(dtype).requires_grad_(trainable_w) for d in douts]
    bs = [torch.randn(d, generator=g).to(dtype).requires_grad_(trainable_w) if j in biases else None
          for j, d in enumerate(douts)]
    As = [[(torch.randn(r, din, generator=g) / din ** 0.5).to(adt).requires_grad_() for r in rs] for rs in ranks]
    Bs = [[(torch.randn(d, r, generator=g) / r ** 0.5).to(adt).requires_grad_() for r in rs]
          for d, rs in zip(douts, ranks)]
    return x, Ws, bs, As, Bs


def _check_group(x, Ws, bs, As, Bs, scalings, ps, tol, unused=()):
    """lora_linear_group against float64 references of each projection (with the masks it drew) and every
    gradient; projections in ``unused`` do not reach the loss."""
    from fxfuse.ops.lora_linear import lora_linear_group

    state = torch.random.get_rng_state()
    ys = lora_linear_group(x, Ws, As, Bs, scalings, biases=bs, dropout_p=ps)
    gos = [torch.randn_like(y) for y in ys]
    leaves = [x] + [a for aa in As for a in aa] + [b for bb in Bs for b in bb]
    leaves += [t for t in list(Ws) + list(bs) if t is not None and t.requires_grad]
    loss = sum((y * go).sum() for j, (y, go) in enumerate(zip(ys, gos)) if j not in unused)
    got = torch.autograd.grad(loss, leaves, allow_unused=True)
    torch.random.set_rng_state(state)
    flat_p = [p for pp in ps for p in pp]
    seeds = K.draw_seeds(len(flat_p), "cpu")
    N, din = x.shape
    masks = [lora_dropout_keep_mask(seeds[i], N, din, p, "cpu") if p > 0 else None for i, p in enumerate(flat_p)]
    d = lambda t: None if t is None else t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
    xr = d(x)
    Ar, Br = [[d(a) for a in aa] for aa in As], [[d(b) for b in bb] for bb in Bs]
    Wr, br = [d(w) for w in Ws], [d(b) for b in bs]
    yrs, i = [], 0
    for j in range(len(Ws)):
        n = len(As[j])
        yrs.append(K.lora_reference(xr, Wr[j], br[j], Ar[j], Br[j], scalings[j], masks[i:i + n], flat_p[i:i + n]))
        i += n
    rleaves = [xr] + [a for aa in Ar for a in aa] + [b for bb in Br for b in bb]
    rleaves += [t for t in Wr + br if t is not None and t.requires_grad]
    rloss = sum((y * go.double()).sum() for j, (y, go) in enumerate(zip(yrs, gos)) if j not in unused)
    ref = torch.autograd.grad(rloss, rleaves, allow_unused=True)
    for j, (y, yr) in enumerate(zip(ys, yrs)):
        err = ((y.double() - yr).norm() / yr.norm()).item()
        assert y.dtype == x.dtype and err < tol, f"y{j}: relative error {err:.2e}"
    for k, (a, r) in enumerate(zip(got, ref)):
        if r is None:
            assert a is None or a.abs().max() == 0, f"grad {k} should be zero"
            continue
        err = ((a.double() - r).norm() / r.norm()).item()
        assert err < tol, f"grad {k} of {len(ref)}: relative error {err:.2e} >= {tol}"
        assert a.dtype == leaves[k].dtype


GROUP_CASES = {  # din, douts, ranks per projection, ps per projection, biases on
    "qkv-one-run": (40, (24, 8, 8), ((4,), (4,), (4,)), ((0.1,), (0.1,), (0.1,)), ()),
    "gate-up-bias": (36, (20, 20), ((3,), (3,)), ((0.2,), (0.2,)), (0,)),
    "mixed-ranks-and-p": (40, (16, 12, 8), ((4, 2), (4,), (6,)), ((0.1, 0.1), (0.0,), (0.3,)), (1, 2)),
    "five-adapters-one-setting": (24, (8, 8, 8), ((2, 2), (2, 2), (2,)), ((0.2,) * 2, (0.2,) * 2, (0.2,)), ()),
    "no-dropout": (40, (24, 8), ((4,), (4,)), ((0.0,), (0.0,)), (0, 1)),
}


@pytest.mark.parametrize("triton", [False, True], ids=["torch-path", "triton-kernels"])
@pytest.mark.parametrize("case", list(GROUP_CASES), ids=list(GROUP_CASES))
def test_group_matches_per_projection_float64_reference(case, triton, monkeypatch):
    if triton:
        _force_triton_on_cpu(monkeypatch)
    din, douts, ranks, ps, biases = GROUP_CASES[case]
    x, Ws, bs, As, Bs = _group_inputs(37, din, douts, ranks, torch.float32, biases=biases)
    scalings = [[2.0] * len(r) for r in ranks]
    if case == "mixed-ranks-and-p":
        scalings[0] = [2.0, 0.5]
    _check_group(x, Ws, bs, As, Bs, scalings, ps, tol=2e-5)


def test_group_trainable_base_unused_output_and_fp32_adapters():
    x, Ws, bs, As, Bs = _group_inputs(33, 24, (16, 8, 8), ((4,), (4,), (4,)), torch.float32, biases=(0, 2),
                                      trainable_w=True)
    _check_group(x, Ws, bs, As, Bs, [[2.0]] * 3, [[0.1]] * 3, tol=1e-5, unused=(1,))
    x, Ws, bs, As, Bs = _group_inputs(64, 48, (40, 24), ((8,), (8,)), torch.bfloat16, adapter_dtype=torch.float32)
    _check_group(x, Ws, bs, As, Bs, [[2.0]] * 2, [[0.1]] * 2, tol=1e-2)


def test_group_equals_separate_calls_bitwise_masks():
    """Grouping changes no mask: with the same seeds, the group's outputs equal one lora_linear per projection."""
    from fxfuse.ops.lora_linear import lora_linear_group

    x, Ws, bs, As, Bs = _group_inputs(50, 32, (16, 8), ((4,), (4,)), torch.float32)
    torch.manual_seed(5)
    ys = lora_linear_group(x, Ws, As, Bs, [[2.0], [2.0]], dropout_p=[[0.3], [0.3]])
    torch.manual_seed(5)
    seeds = K.draw_seeds(2, "cpu")
    for j in range(2):
        torch.manual_seed(0)
        # one call per projection with the group's seed for that adapter: patch the draw
        orig = K.draw_seeds
        K.draw_seeds = lambda n, dev, _s=seeds[j:j + 1]: _s.clone()
        try:
            y = lora_linear(x, Ws[j], As[j], Bs[j], 2.0, dropout_p=0.3)
        finally:
            K.draw_seeds = orig
        torch.testing.assert_close(ys[j], y, rtol=1e-6, atol=1e-6)
