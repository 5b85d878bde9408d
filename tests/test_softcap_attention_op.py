"""fxfuse::softcap_attention: CPU path, Triton kernels under the interpreter, torch.compile, contracts.

Every check draws fresh random inputs and compares output and dq/dk/dv with the float64 eager formula
(``attention_reference``: repeat_interleave for GQA, fully masked rows -> zeros) by relative norm error.
Run: cd /work/main && PYTHONPATH=. python -m pytest tests/test_softcap_attention_op.py -q
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fxfuse.attention import reference
from fxfuse.attention.conventions import MASKED_ROWS
from fxfuse.attention.op import softcap_attention
from fxfuse.errors import FxFuseContractError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_case(B, Hq, Hkv, S, Dh, dtype, mask_kind=None, Skv=None, dead_rows=(), seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    Skv = S if Skv is None else Skv
    q = (torch.randn(B, Hq, S, Dh, generator=g) * 2).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, Skv, Dh, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, Skv, Dh, generator=g).to(dtype).requires_grad_()
    do = torch.randn(B, Hq, S, Dh, generator=g).to(dtype)
    mask = None
    if mask_kind == "additive":  # padding-style: random biases, some -inf keys, fully dead rows
        mask = torch.randn(B, 1, S, Skv, generator=g)
        mask[0, :, :, : Skv // 5] = float("-inf")  # left padding of batch 0's keys
        for r in dead_rows:
            mask[-1, :, r] = torch.finfo(torch.float32).min if r % 2 else float("-inf")
        mask = mask.to(dtype)
    elif mask_kind == "bool":
        mask = torch.rand(B, Hq, S, Skv, generator=g) > 0.3
        for r in dead_rows:
            mask[:, :, r] = False
    return q, k, v, do, mask


def structured_mask(B, S, kind, *, window=0, pad_left=0, pad_right=0, dtype=torch.float32):
    """HF-style [B, 1, S, S] mask: causal (+ sliding window), key padding on the left of batch 0 and on the
    right of batch B-1; bool (True = keep) or additive (0 / finfo.min)."""
    qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
    keep = ki <= qi
    if window:
        keep &= qi - ki < window
    keep = keep[None, None].expand(B, 1, S, S).clone()
    if pad_left:
        keep[0, :, :, :pad_left] = False
    if pad_right:
        keep[-1, :, :, S - pad_right:] = False
    if kind == "bool":
        return keep
    return torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


MODES = MASKED_ROWS  # "zero" / "uniform" / "nan" -> the op's masked_rows codes


def check(q, k, v, do, mask, *, softcap, causal, window, scaling=None, fn=None, tol=None, masked_rows="zero"):
    fn = fn or softcap_attention
    kw = {} if masked_rows == "zero" else {"masked_rows": masked_rows}
    out = fn(q, k, v, mask=mask, scaling=scaling, softcap=softcap, causal=causal, window=window, **kw)
    out.backward(do)
    grads = [t.grad for t in (q, k, v)]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.attention_reference(qd, kd, vd, mask, scaling, softcap or 0.0, causal, window or 0,
                                masked_rows=MODES[masked_rows])
    ref.backward(do.double())
    tol = tol or TOL[q.dtype]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    errs = {"out": rel(out, ref), "dq": rel(grads[0], qd.grad), "dk": rel(grads[1], kd.grad),
            "dv": rel(grads[2], vd.grad)}
    assert all(e < tol for e in errs.values()), errs
    return out, grads


@pytest.fixture(autouse=True)
def small_cpu_chunks(monkeypatch):
    # force several query chunks in the blockwise CPU path even at tiny S
    monkeypatch.setattr(reference, "CPU_SCORE_BUDGET", 1)
    monkeypatch.setenv("FXFUSE_ATTENTION_IMPL", "auto")


CASES = [  # B, Hq, Hkv, S, Dh, softcap, causal, window, mask_kind
    (2, 4, 2, 37, 64, 50.0, True, 0, None),       # GQA 2:1, S not a multiple of 16
    (1, 4, 1, 50, 64, 0.0, True, 0, None),        # GQA 4:1 (MQA-like), no softcap
    (1, 4, 2, 70, 64, 50.0, True, 9, None),       # sliding window much shorter than the sequence
    (2, 2, 2, 33, 128, 30.0, False, 0, "additive"),
    (2, 4, 2, 24, 128, 50.0, True, 0, "bool"),
    (1, 2, 1, 20, 256, 50.0, True, 0, None),      # Gemma-2 head_dim, tiny S
    (1, 2, 2, 19, 80, 20.0, True, 5, "additive"),  # head_dim not a power of two
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}/{}S{}D{}cap{}c{}w{}{}".format(*c))
def test_cpu_path_matches_reference(case, dtype):
    B, Hq, Hkv, S, Dh, cap, causal, win, mk = case
    q, k, v, do, mask = make_case(B, Hq, Hkv, S, Dh, dtype, mk, dead_rows=(3,))
    check(q, k, v, do, mask, softcap=cap, causal=causal, window=win)


def test_fully_masked_rows_zero_output_and_grads():
    for mk in ("additive", "bool"):
        q, k, v, do, mask = make_case(2, 4, 2, 29, 64, torch.float32, mk, dead_rows=(0, 5, 6))
        out, (dq, dk, dv) = check(q, k, v, do, mask, softcap=50.0, causal=True, window=0)
        b = slice(None) if mk == "bool" else -1
        assert (out[b][..., [0, 5, 6], :] == 0).all()
        assert (dq[b][..., [0, 5, 6], :] == 0).all()


def left_padded_case(dtype, mask_kind, *, B=2, Hq=4, Hkv=2, S=37, Dh=32, pad=9, seed=0):
    """HF's left padding: batch 1's first ``pad`` tokens are padding, so its first ``pad`` query rows see no key
    at all (causal + key padding); finfo.min additive or bool (True = keep) masks."""
    q, k, v, do, _ = make_case(B, Hq, Hkv, S, Dh, dtype, seed=seed)
    keep = torch.ones(S, S).tril().bool()[None].repeat(B, 1, 1)
    keep[1, :, :pad] = False
    if mask_kind == "bool":
        return q, k, v, do, keep[:, None]
    return q, k, v, do, torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~keep[:, None], torch.finfo(dtype).min)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_follow_eager(dtype, softcap):
    """masked_rows="uniform": eager's finfo.min masks give a fully masked row the mean of v over every key, and
    gradients through the raw scores (dq of those rows, dk / dv of every key); the fused op matches float64
    eager there, forward and backward. "nan": eager's -inf fill gives NaN rows and NaN dk / dv."""
    q, k, v, do, mask = left_padded_case(dtype, "additive")
    out, (dq, dk, dv) = check(q, k, v, do, mask, softcap=softcap, causal=False, window=0, masked_rows="uniform")
    torch.testing.assert_close(out[1, :, :9].float(), v[1].float().mean(1, keepdim=True).repeat_interleave(2, 0)
                               .expand(4, 9, 32), rtol=0, atol=TOL[dtype] * 4)
    assert dq[1, :, :9].abs().amax() > 0  # the rows' gradient is not dropped
    q, k, v, do, mask = left_padded_case(dtype, "bool")
    out = softcap_attention(q, k, v, mask=mask, softcap=softcap, masked_rows="nan")
    out.backward(do)
    assert torch.isnan(out[1, :, :9]).all() and not torch.isnan(out[1, :, 9:]).any() and not torch.isnan(out[0]).any()
    assert torch.isnan(q.grad[1, :, :9]).all() and not torch.isnan(q.grad[1, :, 9:]).any()
    assert torch.isnan(k.grad[1]).all() and not torch.isnan(k.grad[0]).any() and torch.isnan(v.grad[1]).all()


def test_causal_rows_before_first_key_and_s_ne_skv():
    # bottom-right aligned causal with Skv < S: the first S - Skv query rows see no key -> zeros
    q, k, v, do, _ = make_case(1, 2, 1, 30, 64, torch.float32, Skv=21)
    out, _ = check(q, k, v, do, None, softcap=50.0, causal=True, window=4)
    assert (out[:, :, :9] == 0).all()
    q, k, v, do, _ = make_case(1, 2, 1, 17, 64, torch.float32, Skv=40)  # prefix keys (Skv > S)
    check(q, k, v, do, None, softcap=0.0, causal=True, window=0)


def test_scaling_and_mask_broadcast_forms():
    q, k, v, do, _ = make_case(2, 4, 2, 26, 64, torch.float32)
    pad = torch.ones(2, 26, dtype=torch.bool)
    pad[1, :7] = False
    check(q, k, v, do, pad[:, None, None, :], softcap=50.0, causal=True, window=0, scaling=0.0625)
    q, k, v, do, _ = make_case(1, 2, 2, 26, 64, torch.float32)
    m2 = torch.randn(26, 26)  # 2-D [S, Skv]
    check(q, k, v, do, m2, softcap=10.0, causal=False, window=0)


# ------------------------------------------------------------------------------------- Triton interpreter
_INTERP_SCRIPT = textwrap.dedent(r"""
    import json, torch
    import tests.test_softcap_attention_op as T
    from fxfuse.attention import block_map, launching
    from fxfuse.kernels.triton_support import interpreting
    assert interpreting()
    res = []
    cases = [  # B, Hq, Hkv, S, Skv, Dh, cap, causal, win, mask, dtype
        (2, 4, 2, 37, 37, 64, 50.0, True, 0, None, torch.float32),
        (1, 4, 1, 45, 45, 64, 0.0, True, 7, None, torch.float32),
        (2, 2, 2, 27, 27, 32, 30.0, False, 0, "additive", torch.float32),
        (1, 4, 2, 24, 24, 64, 50.0, True, 0, "bool", torch.float32),
        (1, 2, 1, 18, 18, 256, 50.0, True, 0, None, torch.float32),
        (1, 2, 2, 19, 19, 80, 20.0, True, 5, "additive", torch.float32),
        (1, 2, 1, 30, 21, 64, 50.0, True, 4, None, torch.float32),
        (2, 4, 2, 33, 33, 64, 50.0, True, 0, "additive", torch.bfloat16),
        (1, 4, 2, 48, 48, 32, 0.0, True, 0, None, torch.float32),  # S a multiple of the tiles: no tail loop
    ]

    def run(tag, some):
        for B, Hq, Hkv, S, Skv, Dh, cap, causal, win, mk, dt in some:
            q, k, v, do, mask = T.make_case(B, Hq, Hkv, S, Dh, dt, mk, Skv=Skv, dead_rows=(2,))
            try:
                T.check(q, k, v, do, mask, softcap=cap, causal=causal, window=win)
                res.append([tag, str(dt), S, Dh, "ok"])
            except AssertionError as e:
                res.append([tag, str(dt), S, Dh, "FAIL " + str(e)[:300]])

    run("kernels", cases)
    # dK and dV in two launches (the head_dim-256 GPU config) instead of one
    launching.INTERPRET_CONFIG["dkdv"] = (16, 16, 4, 1, 1)
    run("split", cases[1:3])
    # the dK/dV kernel reads q / dO tiles through TMA descriptors where the copy engine can address them
    # (these cases) and through clamped pointer tiles otherwise (a head dim whose rows are not 16-byte aligned):
    # run the pointer path on the ragged / windowed / padded-head-dim cases too
    from fxfuse.attention import backward as BW
    from fxfuse.kernels.triton_support import tile_descriptor
    q0 = T.make_case(1, 2, 1, 19, 64, torch.float32, None)[0]
    res.append(["descriptor-used", "ok" if tile_descriptor(q0, [1, 1, 16, 64]) is not None else "FAIL"])
    res.append(["descriptor-refused", "ok" if tile_descriptor(q0[..., 1:], [1, 1, 16, 64]) is None else "FAIL"])
    BW.tile_descriptor = lambda t, block_shape: None
    run("pointer-tiles", cases[:2] + cases[5:7])
    BW.tile_descriptor = tile_descriptor
    # mask tensors alone (what the pass hands over): block ranges from the mask's tile classes
    for B, Hq, Hkv, S, Dh, kind, win, pl, pr, dt in [
        (1, 2, 1, 70, 64, "additive", 0, 0, 0, torch.float32),   # causal as a tensor
        (2, 4, 2, 53, 64, "bool", 20, 0, 0, torch.float32),      # sliding window shorter than S
        (2, 2, 1, 61, 32, "additive", 0, 9, 17, torch.float32),  # left padding in batch 0, right in batch 1
        (2, 2, 2, 40, 64, "additive", 0, 0, 0, torch.bfloat16),
    ]:
        q, k, v, do, _ = T.make_case(B, Hq, Hkv, S, Dh, dt)
        m = T.structured_mask(B, S, kind, window=win, pad_left=pl, pad_right=pr, dtype=dt)
        try:
            T.check(q, k, v, do, m, softcap=50.0, causal=False, window=0)
            res.append(["ranges", kind, S, win, pl, pr, "ok"])
        except AssertionError as e:
            res.append(["ranges", kind, S, win, pl, pr, "FAIL " + str(e)[:300]])
    # fully masked rows (left padding) in the uniform mode: forward epilogue + the two dead-row kernels
    for dt, cap, mk, Dh in [(torch.float32, 30.0, "additive", 32), (torch.float32, 0.0, "bool", 64),
                            (torch.bfloat16, 30.0, "additive", 32)]:
        q, k, v, do, m = T.left_padded_case(dt, mk, Dh=Dh, S=41, pad=19)
        try:
            T.check(q, k, v, do, m, softcap=cap, causal=False, window=0, masked_rows="uniform")
            res.append(["uniform", str(dt), cap, mk, "ok"])
        except AssertionError as e:
            res.append(["uniform", str(dt), cap, mk, "FAIL " + str(e)[:300]])
    # the ranges themselves: a causal mask tensor [S, S] at 16x16 tiles keeps key blocks [0, r] for query
    # block r, [0, r) FULL (but never a tile past the last key); key padding on the right empties tiles
    S = 70
    m = T.structured_mask(2, S, "additive", pad_right=40)
    mt, ms, kind = launching.mask_args(m, 2, 2, S, S, m)
    rng, rs = block_map.mask_block_ranges_of(mt, ms, kind, 2, 2, S, S, 16, 16)
    got = rng.view(2, -1, 4).tolist()
    # (no FULL tile: b = c = hi, so the whole [lo, hi) is read with the mask)
    want0 = [[0, 1, 1, 1]] + [[0, 0, min(r, S // 16), r + 1] for r in range(1, 5)]
    # batch 1: keys >= 30 masked -> key blocks >= 2 empty, block 1 (keys 16..31) partial for every row block
    want1 = [[0, 1, 1, 1]] + [[0, 0, 1, 2] for r in range(1, 5)]
    res.append(["ranges-values", "ok" if (got[0] == want0 and got[1] == want1 and rs == (5 * 4, 0))
                else "FAIL " + json.dumps([got, rs])])
    print("RESULT " + json.dumps(res))
""")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU-only hosts' check of the "
                    "kernels; on the GPU host (torch 2.11, triton 3.6) the interpreter raises numpy's 'only "
                    "0-dimensional arrays can be converted to Python scalars'")
def test_triton_kernels_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", FXFUSE_ATTENTION_IMPL="triton",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    bad = [r for r in res if r[-1] != "ok"]
    assert not bad, bad


# ------------------------------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_dynamic_no_recompile(backend, monkeypatch):
    monkeypatch.setattr(reference, "CPU_SCORE_BUDGET", 32 * 2**20)
    torch._dynamo.reset()

    def f(q, k, v, mask):
        return softcap_attention(q, k, v, mask=mask, softcap=50.0, causal=True, scaling=0.1)

    cf = torch.compile(f, backend=backend, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for S in (24, 41, 66):
            q, k, v, do, mask = make_case(2, 4, 2, S, 64, torch.float32, "additive")
            check(q, k, v, do, mask, softcap=50.0, causal=True, window=0, scaling=0.1,
                  fn=lambda q, k, v, **kw: cf(q, k, v, kw["mask"]))


def test_compile_contract_error():
    torch._dynamo.reset()
    cf = torch.compile(lambda q, k, v, m: softcap_attention(q, k, v, mask=m, causal=True), backend="aot_eager")
    q, k, v, _, _ = make_case(1, 2, 1, 16, 64, torch.float32)
    with pytest.raises(FxFuseContractError, match="key length"):
        cf(q, k, v, torch.zeros(16, 24))


# ------------------------------------------------------------------------------------------------ contract
def test_contract_errors():
    q, k, v, _, _ = make_case(1, 4, 2, 16, 64, torch.float32)
    with pytest.raises(FxFuseContractError, match="key length"):  # a mask longer than the keys
        softcap_attention(q, k, v, mask=torch.zeros(1, 1, 16, 32))
    with pytest.raises(FxFuseContractError, match="query length"):  # a mask for another sequence
        softcap_attention(q, k, v, mask=torch.zeros(1, 1, 12, 16, dtype=torch.bool))
    with pytest.raises(FxFuseContractError, match="q heads"):  # a per-kv-head mask
        softcap_attention(q, k, v, mask=torch.zeros(1, 2, 16, 16))
    with pytest.raises(FxFuseContractError, match="bool"):
        softcap_attention(q, k, v, mask=torch.zeros(1, 1, 16, 16, dtype=torch.int64))
    with pytest.raises(FxFuseContractError, match="multiple of kv heads"):
        softcap_attention(q, k[:, :1].expand(1, 3, 16, 64), v[:, :1].expand(1, 3, 16, 64))
    with pytest.raises(FxFuseContractError, match="causal"):
        softcap_attention(q, k, v, window=4)
    with pytest.raises(FxFuseContractError, match="dtype mismatch"):
        softcap_attention(q, k.double().float().half(), v)


def test_fake_impl_shapes_strides_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn(2, 24, 4, 64).transpose(1, 2)  # HF layout: a [B, S, H, D] buffer viewed as [B, H, S, D]
    k = torch.randn(2, 2, 24, 64)
    v = torch.randn(2, 2, 24, 64)
    mask = torch.zeros(2, 1, 24, 24)
    out, lse = torch.ops.fxfuse.softcap_attention(q, k, v, mask, 0.125, 50.0, True, 0)
    with FakeTensorMode() as mode:
        fq, fk, fv, fm = (mode.from_tensor(t) for t in (q, k, v, mask))
        fo, fl = torch.ops.fxfuse.softcap_attention(fq, fk, fv, fm, 0.125, 50.0, True, 0)
    assert (fo.shape, fo.stride(), fo.dtype) == (out.shape, out.stride(), out.dtype)
    assert (fl.shape, fl.stride(), fl.dtype) == (lse.shape, lse.stride(), lse.dtype)
    for args in [(q, k, v, mask, 0.125, 50.0, True, 0), (q, k, v, None, 0.125, 0.0, True, 5)]:
        torch.library.opcheck(torch.ops.fxfuse.softcap_attention.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_autocast_casts_q_k_v_like_the_matmuls_it_replaces():
    """Under autocast the op casts fp32 q / k / v to the autocast dtype (as autocast does for the two matmuls) and
    leaves the additive mask alone; the result equals calling it on the cast operands."""
    q, k, v, do, mask = make_case(1, 4, 2, 21, 64, torch.float32, "additive")
    for dt in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dt):
            out, lse = torch.ops.fxfuse.softcap_attention(q, k, v.to(dt), mask, 0.125, 50.0, True, 0)
        ref, ref_lse = torch.ops.fxfuse.softcap_attention(q.to(dt), k.to(dt), v.to(dt), mask, 0.125, 50.0, True, 0)
        assert out.dtype == dt
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
        out.float().backward(do)  # gradients flow back to the fp32 leaves through the casts
        assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()
        q.grad = k.grad = v.grad = None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays launch compiled binaries: CUDA only (the "
                    "record / replay logic itself: test_launch_cache.py)")
@pytest.mark.parametrize("layout", ["docs", "padded", "window_softcap", "mask_tensor"])
def test_replayed_launches_equal_the_jit_path(layout, monkeypatch):
    """From the second call with a signature on, the launchers replay their recorded launches with the new
    tensors: values and gradients must be those of the ordinary JIT path, bit for bit, on fresh data."""
    import fxfuse.ops
    from fxfuse.attention import backward as bw, forward as fw

    dev, B, Hq, Hkv, S, D = "cuda", 2, 4, 2, 300, 64
    doc_ranges = key_valid = mask = None
    softcap, window, causal = 0.0, 0, True
    if layout == "mask_tensor":  # HF's [B, 1, S, S] bool mask from another graph: block ranges from its tiles
        pos = torch.arange(S, device=dev)
        mask = ((pos[:, None] >= pos[None, :]) & (pos[None, :] >= torch.tensor([0, 40], device=dev)[:, None, None]))
        mask, causal = mask[:, None], False
    elif layout == "docs":
        doc_ranges = fxfuse.ops.document_ranges((torch.arange(S, device=dev) * 3 // S).expand(B, S))
    elif layout == "padded":
        key_valid = torch.arange(S, device=dev)[None, :] < torch.tensor([[S], [S // 3]], device=dev)
    else:
        softcap, window = 30.0, 77

    def run(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        q, k, v = (torch.randn(B, h, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
                   for h in (Hq, Hkv, Hkv))
        do = torch.randn(B, Hq, S, D, device=dev, dtype=torch.bfloat16, generator=g)
        out = torch.ops.fxfuse.softcap_attention(q, k, v, mask, D ** -0.5, softcap, causal, window, 0, doc_ranges,
                                                 key_valid)[0]
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    run(0)  # records
    f0, b0 = sum(r.launches for r in fw._PLANS.replays.values()), sum(r.launches for r in bw._PLANS.replays.values())
    replayed = run(1)
    assert sum(r.launches for r in fw._PLANS.replays.values()) == f0 + 1
    assert sum(r.launches for r in bw._PLANS.replays.values()) == b0 + 1
    monkeypatch.setenv("FXFUSE_TRITON_FAST_LAUNCH", "0")
    for a, b in zip(replayed, run(1)):
        assert torch.equal(a, b)
