"""64-bit offsets in the Triton kernels once a tensor passes 2**31 elements (an 8B down_proj, in_features 14336, at
~150k tokens; lm-head logits chunks of more than 2**31 entries).

* LoRA: the launchers' rule (``needs_int64_idx``: int64 exactly when an offset the kernel can form passes
  2**31 - 1) on plain integers and on meta tensors (no memory), and that each launcher hands the kernel the flag
  of the tensors it addresses; the kernels with ``INT64_IDX`` forced on at tiny shapes (interpreter on CPU)
  against the float64 reference and bit for bit against the int32 path; the row helper itself at offsets past
  2**31 (where int32 wraps), without a large allocation.
* lm-head (cross-entropy, log-probs): their row kernels form one int64 row offset per program (free), so they have
  no flag: a guard that it stays so.

The large-size runs on a GPU are benchmarks/check_int64_offsets.py.
"""
from __future__ import annotations

import inspect
import os

import pytest
import torch

from fxfuse.kernels import linear_cross_entropy as LCE
from fxfuse.kernels import linear_log_probs as LOGP
from fxfuse.kernels import lora_linear as K
from fxfuse.ops.lora_linear import lora_dropout_keep_mask, lora_linear

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KDEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not K.HAVE_TRITON or (KDEV == "cpu" and not INTERPRET),
                                   reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set by conftest on CPU)")
I32 = 2**31 - 1


def contiguous(*shape):
    strides, s = [], 1
    for n in reversed(shape):
        strides.append(s)
        s *= n
    return tuple(shape), tuple(reversed(strides))


# ================================================================================================ the rule
@pytest.mark.parametrize("layout, want", [
    (contiguous(150_000, 14336), True),        # the known case: 2.15e9 elements of x
    (contiguous(149_796, 14336), False),       # max offset 2147475455
    (contiguous(149_797, 14336), True),        # its last row starts past 2**31
    (contiguous(2, 2**30), False),             # max offset exactly 2**31 - 1
    (contiguous(2, 2**30 + 1), True),          # max offset 2**31 + 1 (numel 2**31 + 2)
    (contiguous(1, 2**31), False),             # one row: offsets 0 .. 2**31 - 1
    (((2, 2**30 + 1), (2**30, 1)), True),      # overlapping rows: max offset 2**31
    (((110_000, 14336), (20_000, 1)), True),   # strided rows: numel 1.6e9 but offsets reach 2.2e9
    (((110_000, 16), (20_000, 1)), True),      # a narrow column slice of a wide buffer (V_run of V)
    (((150_000, 16), (48, 1)), False),         # V [N, 48], one adapter's columns
    (contiguous(0, 14336), False),             # empty
    (contiguous(16384, 4096), False),          # normal training sizes
    (contiguous(131072, 14336), False),        # 128k tokens: 1.88e9
])
def test_rule_on_integers(layout, want):
    shape, strides = layout
    assert K.needs_int64_idx(layout) is want
    assert (K.max_offset(shape, strides) > I32) is want


def test_rule_takes_any_of_several_layouts_and_tensors():
    small, big = contiguous(16, 16), contiguous(150_000, 14336)
    assert not K.needs_int64_idx(small, small)
    assert K.needs_int64_idx(small, big)
    assert K.needs_int64_idx(torch.empty(150_000, 14336, device="meta", dtype=torch.bfloat16))
    assert not K.needs_int64_idx(torch.empty(150_000, 4096, device="meta"))
    # a transposed view reaches the same offsets as its base
    assert K.needs_int64_idx(torch.empty(14336, 150_000, device="meta").t())


class _Spy:
    """Stands in for a kernel: records the launch's constexprs instead of running."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(kw)
        return launch


@pytest.mark.skipif(not K.HAVE_TRITON, reason="launchers need triton")
@pytest.mark.parametrize("N, din, want", [(150_000, 14336, True), (16384, 14336, False), (300, 64, False)])
def test_launchers_pass_the_flag_of_their_tensors(N, din, want, monkeypatch):
    """Each launcher, on meta tensors (no memory), hands its kernel INT64_IDX = the rule of the [N, .] tensors."""
    monkeypatch.setattr(K, "FORCE_TRITON", True)
    down, up, mask = _Spy(), _Spy(), _Spy()
    monkeypatch.setattr(K, "_lora_down_kernel", down)
    monkeypatch.setattr(K, "_lora_up_dropout_bwd_kernel", up)
    monkeypatch.setattr(K, "_keep_mask_kernel", mask)
    meta = dict(device="meta", dtype=torch.bfloat16)
    r, na = 16, 2
    x = torch.empty(N, din, **meta)
    A = torch.empty(na * r, din, **meta)
    V = torch.empty(N, 3 * r, **meta)
    seeds = torch.empty(na, device="meta", dtype=torch.int64)
    K._down_dropout(x, A, V[:, r:], seeds, na, r, 2.0, 0.1)
    C = torch.empty(N, din, **meta)
    ga = torch.empty(na * r, din, device="meta", dtype=torch.float32)
    K._up_dropout_bwd(V[:, r:], A, x, C, ga, seeds, na, r, 2.0, 0.1, True, False)
    K._up_dropout_bwd(V[:, r:], A, x, C, None, seeds, na, r, 2.0, 0.1, True, True)
    K.dropout_keep_mask(torch.zeros((), dtype=torch.int64), N, din, 0.1, "meta")
    flags = [c["INT64_IDX"] for s in (down, up, mask) for c in s.calls]
    assert flags == [want] * 4


@pytest.mark.skipif(not K.HAVE_TRITON, reason="launchers need triton")
def test_launcher_flag_from_a_wide_strided_V(monkeypatch):
    """x small enough for int32, but V's run is a column slice of a V so wide that its row offsets pass 2**31."""
    monkeypatch.setattr(K, "FORCE_TRITON", True)
    down = _Spy()
    monkeypatch.setattr(K, "_lora_down_kernel", down)
    meta = dict(device="meta", dtype=torch.bfloat16)
    N, din, r = 3_000_000, 512, 16
    x = torch.empty(N, din, **meta)                   # 1.5e9: int32 is enough
    V = torch.empty(N, 1024, **meta)                  # 3.1e9 offsets
    K._down_dropout(x, torch.empty(r, din, **meta), V[:, :r], torch.empty(1, device="meta", dtype=torch.int64),
                    1, r, 1.0, 0.1)
    K._down_dropout(x, torch.empty(r, din, **meta), V[:N // 4, :r], torch.empty(1, device="meta", dtype=torch.int64),
                    1, r, 1.0, 0.1)
    assert [c["INT64_IDX"] for c in down.calls] == [True, False]


def test_oversized_adapter_is_refused_not_wrapped(monkeypatch):
    """A ([R, din]) keeps int32 offsets in every kernel variant: a (never seen) A past 2**31 elements raises."""
    monkeypatch.setattr(K, "FORCE_TRITON", True)
    monkeypatch.setattr(K, "_lora_down_kernel", _Spy())
    meta = dict(device="meta", dtype=torch.bfloat16)
    din, r = 32768, 65537  # 2**31 + 32768 elements
    with pytest.raises(ValueError, match="2\\*\\*31"):
        K._down_dropout(torch.empty(8, din, **meta), torch.empty(r, din, **meta), torch.empty(8, r, **meta),
                        torch.empty(1, device="meta", dtype=torch.int64), 1, r, 1.0, 0.1)


# ================================================================================================ the kernels
if K.HAVE_TRITON:
    from fxfuse.kernels.triton_support import tl, triton

    @triton.jit
    def _row_offsets_probe(out_ptr, row0, stride, BM: tl.constexpr, INT64_IDX: tl.constexpr):
        rows = K._tile_rows(row0, BM, INT64_IDX)
        tl.store(out_ptr + tl.arange(0, BM), (rows * stride).to(tl.int64))


@needs_kernels
def test_tile_rows_offsets_past_2_31():
    """The kernels' row helper at the end of x [150000, 14336]: int64 gives the exact offsets, int32 wraps (which
    is what the flag is for, and shows this probe can see it)."""
    BM, stride = 32, 14336
    row0 = 150_000 - BM
    exact = torch.arange(row0, row0 + BM, dtype=torch.int64) * stride
    assert exact.max() > I32
    got = {}
    for flag in (True, False):
        out = torch.zeros(BM, dtype=torch.int64, device=KDEV)
        _row_offsets_probe[(1,)](out, row0, stride, BM=BM, INT64_IDX=flag)
        got[flag] = out.cpu()
    assert torch.equal(got[True], exact)
    assert not torch.equal(got[False], exact)
    assert torch.equal(got[False], (exact + 2**31) % 2**32 - 2**31)  # int32 wrap-around


def _inputs(N, din, dout, ranks, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, din, generator=g).to(dtype).to(KDEV).requires_grad_()
    W = (torch.randn(dout, din, generator=g) / din ** 0.5).to(dtype).to(KDEV)
    b = torch.randn(dout, generator=g).to(dtype).to(KDEV)
    As = [(torch.randn(r, din, generator=g) / din ** 0.5).to(dtype).to(KDEV).requires_grad_() for r in ranks]
    Bs = [(torch.randn(dout, r, generator=g) / r ** 0.5).to(dtype).to(KDEV).requires_grad_() for r in ranks]
    return x, W, b, As, Bs


def _rng_state():
    return torch.cuda.get_rng_state() if KDEV == "cuda" else torch.random.get_rng_state()


def _set_rng_state(s):
    (torch.cuda.set_rng_state if KDEV == "cuda" else torch.random.set_rng_state)(s)


def _run(x, W, b, As, Bs, scalings, ps, go, state):
    _set_rng_state(state)
    y = lora_linear(x, W, As, Bs, scalings, bias=b, dropout_p=list(ps))
    return [y.detach()] + list(torch.autograd.grad(y, [x] + As + Bs, go))


# Ragged N, din and rank; the second case is a run of two adapters (NA=2: A / V / seed offsets per adapter) beside
# one without dropout.
CASES = [(37, 48, 40, (4,), (0.25,)), (45, 40, 24, (4, 4, 8), (0.3, 0.3, 0.0))]


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=["one-adapter", "run-of-two"])
def test_int64_path_matches_float64_and_int32_path(case, monkeypatch):
    """Every LoRA kernel (dropout down, dropout backward, keep mask) with INT64_IDX forced on at tiny shapes: the
    same outputs and gradients as the int32 path, bit for bit, and the float64 reference's."""
    monkeypatch.setattr(K, "FORCE_TRITON", True)
    N, din, dout, ranks, ps = case
    scalings = [2.0, 0.5, 1.0][:len(ranks)]
    x, W, b, As, Bs = _inputs(N, din, dout, ranks)
    go = torch.randn(N, dout, generator=torch.Generator().manual_seed(1)).to(KDEV)
    state = _rng_state()
    launches = []
    real = K._int64_idx
    monkeypatch.setattr(K, "_int64_idx", lambda *t: launches.append(real(*t)) or launches[-1])
    got32 = _run(x, W, b, As, Bs, scalings, ps, go, state)
    monkeypatch.setattr(K, "FORCE_INT64_IDX", True)
    got64 = _run(x, W, b, As, Bs, scalings, ps, go, state)
    n = len(launches) // 2
    assert n >= 2 and launches == [False] * n + [True] * n  # both kernels ran, under each flag
    names = ["y", "x"] + [f"A{i}" for i in range(len(As))] + [f"B{i}" for i in range(len(Bs))]
    for name, a, c in zip(names, got32, got64):
        if KDEV == "cuda" and name.startswith("A"):  # grad A: fp32 atomics, in any order on a GPU
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(a, c), f"{name}: the int64 path differs from the int32 path"

    # float64 reference with the masks the op drew (the mask kernel itself under the forced flag)
    _set_rng_state(state)
    seeds = K.draw_seeds(len(ps), KDEV)
    masks = [lora_dropout_keep_mask(seeds[i], N, din, p, KDEV) if p > 0 else None for i, p in enumerate(ps)]
    monkeypatch.setattr(K, "FORCE_INT64_IDX", False)
    masks32 = [lora_dropout_keep_mask(seeds[i], N, din, p, KDEV) if p > 0 else None for i, p in enumerate(ps)]
    assert all(m is None or torch.equal(m, m32) for m, m32 in zip(masks, masks32))
    d = lambda t: t.detach().double().requires_grad_()  # noqa: E731
    xr, Ar, Br = d(x), [d(a) for a in As], [d(q) for q in Bs]
    yr = K.lora_reference(xr, W.double(), b.double(), Ar, Br, scalings, masks, ps)
    ref = [yr.detach()] + list(torch.autograd.grad(yr, [xr] + Ar + Br, go.double()))
    for name, a, r in zip(names, got64, ref):
        err = ((a.double() - r).norm() / r.norm()).item()
        assert err < 2e-5, f"{name}: relative error {err:.2e} (int64 path)"


# ================================================================================================ lm-head
@pytest.mark.skipif(not LCE.HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("kernel", ["lce_rows", "logp_rows", "scale"])
def test_lm_head_kernels_form_int64_row_offsets(kernel):
    """The lm-head row kernels address a [C, V] logits chunk (C * V passes 2**31 with a large ``chunk_bytes``) from
    one int64 row offset per program (a scalar: free), and the gradient-scaling kernel its blocks from an int64
    program offset: no flag needed, and none may lose that cast."""
    fn = {"lce_rows": LCE._lce_rows_kernel, "logp_rows": LOGP._logp_rows_kernel,
          "scale": LCE._scale_by_device_scalar_kernel}[kernel]
    src = inspect.getsource(getattr(fn, "fn", fn))
    assert "tl.program_id(0).to(tl.int64)" in src
