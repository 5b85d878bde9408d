"""``kernels/lowrank_gemm.py`` (a GEMM with LoRA's rank-r product as one more K step of its accumulator) against
float64, through the Triton interpreter on CPU: every operand layout, ragged sizes, ranks below the 16-wide dot,
bias; the LoRA op's forward and its dropout-free grad x taking it; the cases it must decline."""
from __future__ import annotations

import os
from concurrent.futures import Future

import pytest
import torch

from fxfuse.kernels import background_compile as BC
from fxfuse.kernels import lora_linear as K
from fxfuse.kernels import lowrank_gemm as G
from fxfuse.kernels.triton_support import HAVE_TRITON, interpreting

pytestmark = pytest.mark.skipif(not (HAVE_TRITON and interpreting()),
                                reason="runs the kernel on CPU tensors through TRITON_INTERPRET=1")


def _operands(M, N, K_, R, b_kn, u_kn, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(M, K_), r(K_, N) if b_kn else r(N, K_), r(M, R), r(R, N) if u_kn else r(N, R),
            r(N) if bias else None)


@pytest.mark.parametrize("b_kn,u_kn", [(False, False), (True, True), (False, True), (True, False)])
@pytest.mark.parametrize("M,N,K_,R,bias", [(70, 36, 104, 4, True), (33, 64, 40, 12, False), (96, 40, 64, 16, True)])
def test_matches_float64(M, N, K_, R, bias, b_kn, u_kn):
    a, b, v, u, bb = _operands(M, N, K_, R, b_kn, u_kn, bias)
    assert G.lowrank_gemm_supported(a, b, v, u, bb, b_kn=b_kn, u_kn=u_kn)
    out = G.lowrank_gemm(a, b, v, u, bb, b_kn=b_kn, u_kn=u_kn)
    ref = G.lowrank_gemm_reference(a, b, v, u, bb, b_kn=b_kn, u_kn=u_kn)
    assert out.shape == ref.shape and out.dtype == a.dtype
    # fp32 operands: as close as torch's own fp32 matmul is
    eager = (a.double() @ (b if b_kn else b.t()).double()).float() + (v @ (u if u_kn else u.t())) + \
        (bb if bias else 0)
    rel = lambda t: ((t.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    err, eager_err = rel(out), rel(eager)
    assert err < max(2 * eager_err, 1e-6), (err, eager_err)


def test_declines_what_the_copy_engine_cannot_address():
    a, b, v, u, _ = _operands(16, 24, 32, 4, False, False, False)
    assert not G.lowrank_gemm_supported(a, b[:, :30].contiguous()[:, 1:], v, u)  # K strides not 16-byte aligned
    assert not G.lowrank_gemm_supported(a, b[:21], v, u[:21])  # 21 output columns: rows of 84 bytes
    assert not G.lowrank_gemm_supported(a, b, v.double(), u)  # mixed dtypes
    assert not G.lowrank_gemm_supported(a, b, torch.randn(16, 80), torch.randn(24, 80))  # rank above 64
    assert not G.lowrank_gemm_supported(a[:0], b, v[:0], u)  # no rows


def test_lora_op_forward_and_grad_x_take_it(monkeypatch):
    """The LoRA op (Triton path forced, as on a GPU) calls the kernel for y and, without dropout, for grad x, and
    matches float64 in y and every gradient; with dropout the grad x keeps the dropout kernel's term."""
    from tests.test_lora_op import _check, _inputs

    monkeypatch.setattr(K, "FORCE_TRITON", True)
    calls = []
    real = K.lowrank_gemm

    def counted(*args, **kw):
        calls.append(kw.get("b_kn", False))
        return real(*args, **kw)

    monkeypatch.setattr(K, "lowrank_gemm", counted)
    x, W, b, As, Bs = _inputs(37, 48, 40, (4,), torch.float32, bias=True)
    _check(x, W, b, As, Bs, [2.0], (0.0,), tol=2e-5)
    assert calls == [False, True]  # forward, then grad x
    calls.clear()
    x, W, b, As, Bs = _inputs(37, 48, 40, (4, 8), torch.float32)
    _check(x, W, b, As, Bs, [2.0, 0.5], (0.0, 0.25), tol=2e-5)
    assert calls == [False]  # forward only: dropout's grad x term comes from its own kernel


def test_grouped_projections_sum_grad_x(monkeypatch):
    """q/k/v after horizontal fusion: the first projection's base GEMM and the low-rank term in one kernel, the
    siblings' base GEMMs added in place: grad x against float64."""
    monkeypatch.setattr(K, "FORCE_TRITON", True)
    calls = []
    real = K.lowrank_gemm
    monkeypatch.setattr(K, "lowrank_gemm", lambda *a, **kw: calls.append(kw.get("b_kn", False)) or real(*a, **kw))
    g = torch.Generator().manual_seed(1)
    N, din, douts, r = 29, 32, (24, 8, 8), 4
    x = torch.randn(N, din, generator=g)
    Ws = [torch.randn(d, din, generator=g) / din ** 0.5 for d in douts]
    A = torch.randn(3 * r, din, generator=g) / din ** 0.5
    Bs = [torch.randn(d, r, generator=g) / r ** 0.5 for d in douts]
    seeds = K.draw_seeds(3, "cpu")
    adapters = ([r] * 3, [1] * 3, [2.0] * 3, [0.0] * 3)  # ranks, adapters per projection, scalings, dropout
    ys, V = K.lora_forward(x, Ws, [None] * 3, A, Bs, seeds, *adapters)
    gys = [torch.randn_like(y) for y in ys]
    gx = K.lora_backward(gys, x, Ws, A, Bs, V, seeds, *adapters, True, False, False, False, False)[0]
    xd, A64 = x.double(), A.double()
    ref = sum(gy.double() @ W.double() + 2.0 * (gy.double() @ B.double()) @ A64[i * r:(i + 1) * r]
              for i, (gy, W, B) in enumerate(zip(gys, Ws, Bs)))
    assert calls == [False, False, False, True]  # three forward projections, one grad x
    assert ((gx.double() - ref).norm() / ref.norm()).item() < 1e-5
    yref = [xd @ W.double().t() + 2.0 * (xd @ A64[i * r:(i + 1) * r].t()) @ B.double().t()
            for i, (W, B) in enumerate(zip(Ws, Bs))]
    for y, yr in zip(ys, yref):
        assert ((y.double() - yr).norm() / yr.norm()).item() < 1e-5


def test_pipeline_stages_fit_shared_memory(monkeypatch):
    """An H100 / H200 block gets 232448 bytes of shared memory. Shipped (flattened loop, output in halves) every rank
    up to 64 keeps 3 stages. Asked for whole tiles, the flattened loop keeps them at rank 16 but must halve them at
    rank sums 32 and 64 (whole, rank 32 asked 237608 bytes: the launch failed on the GPU); unflattened, the low-rank
    tiles go in the stages' buffers and whole tiles fit at every rank; a fourth stage fits unflattened with halves
    only; too little memory declines."""
    h100 = 232448
    stages_split = lambda rank, limit=h100: (G.config_for(2, rank, limit)["num_stages"],  # noqa: E731
                                             G.config_for(2, rank, limit)["SPLIT_EPI"])
    for rank in (16, 32, 48, 64):
        assert G.config_for(2, rank, h100) == dict(G.CONFIG, num_stages=3, SPLIT_EPI=True)
    assert G.config_for(2, 16, 100 * 1024) is None
    assert stages_split(16, 170 * 1024) == (2, True)
    monkeypatch.setitem(G.CONFIG, "SPLIT_EPI", False)
    assert stages_split(16) == (3, False)
    for rank in (32, 64):
        assert stages_split(rank) == (3, True)
    monkeypatch.setitem(G.CONFIG, "FLATTEN", False)
    for rank in (16, 32, 48, 64):
        assert stages_split(rank) == (3, False)
    monkeypatch.setitem(G.CONFIG, "num_stages", 4)
    assert stages_split(64) == (4, True)
    monkeypatch.setitem(G.CONFIG, "FLATTEN", True)
    assert stages_split(64) == (3, True)


_COMPILE_SETTINGS = """
import json, sys
from fxfuse.kernels import lowrank_gemm as G
rows = []
for rank, kn in ((16, False), (64, True)):
    for flatten in (False, True):
        for stages, split in ((3, False), (3, True), (4, True)):
            cfg = dict(G.CONFIG, FLATTEN=flatten, num_stages=stages, SPLIT_EPI=split)
            k = G.compiled_for(rank, kn, kn, cfg)
            rows.append(dict(rank=rank, flatten=flatten, stages=stages, split=split, shared=k.metadata.shared,
                             counted=G.shared_memory_bytes(cfg, 2, rank)))
print(json.dumps(rows))
"""


def test_shared_memory_count_matches_compiled_kernels():
    """``shared_memory_bytes`` (what ``config_for`` fits) against Triton's own allocation: the kernel compiled for
    sm_90 without a GPU, at rank 16 (forward layout) and 64 (grad-x layout), flattened or not, 3 or 4 stages, whole
    or halved output. Triton adds only its barriers (under the 1 KiB config_for keeps). A child process: the
    interpreter this suite runs under replaces Triton's language functions, and the compiler needs them."""
    import importlib.util
    import json
    import subprocess
    import sys
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this Triton has no NVIDIA backend to compile for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SETTINGS], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 12
    for row in rows:
        assert 0 <= row["shared"] - row["counted"] < 1024, row


@pytest.mark.parametrize("b_kn,u_kn", [(False, False), (True, True)])
def test_output_stored_in_halves_matches_float64(monkeypatch, b_kn, u_kn):
    """The two-half epilogue (the shipped GPU setting at every rank) writes every column once, ragged last tiles
    included."""
    monkeypatch.setattr(G, "INTERPRETER_CONFIG", dict(G.INTERPRETER_CONFIG, SPLIT_EPI=True))
    a, b, v, u, bb = _operands(70, 88, 104, 48, b_kn, u_kn, True)
    assert G.lowrank_gemm_supported(a, b, v, u, bb, b_kn=b_kn, u_kn=u_kn)
    out = G.lowrank_gemm(a, b, v, u, bb, b_kn=b_kn, u_kn=u_kn)
    ref = G.lowrank_gemm_reference(a, b, v, u, bb, b_kn=b_kn, u_kn=u_kn)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def _replaying_stand_in(monkeypatch):
    """Replays on, on CPU: a stand-in for the kernel records each JIT launch ``(args, kwargs)`` and returns a fake
    binary whose replays it records too (replays are for compiled kernels)."""
    import inspect
    from types import SimpleNamespace

    from fxfuse.kernels import launch_cache
    from tests.test_launch_cache import _Binary

    monkeypatch.setattr(launch_cache, "fast_launch_enabled", lambda: True)
    monkeypatch.setattr(launch_cache, "_hooks_idle", lambda: True)
    monkeypatch.setattr(launch_cache, "_raw_stream", lambda device: 7)
    monkeypatch.setattr(G, "_DESCRIPTORS", {})
    monkeypatch.setattr(G, "_PLANS", launch_cache.PlanCache())
    real = G._lowrank_gemm_kernel
    names = list(inspect.signature(getattr(real, "fn", real)).parameters)  # the real kernel's, constexprs included

    class StandIn:
        params = [SimpleNamespace(name=n) for n in names]

        def __init__(self):
            self.binary, self.jit_calls = _Binary(), []

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.jit_calls.append((args, kwargs)) or self.binary

    kern = StandIn()
    monkeypatch.setattr(G, "_lowrank_gemm_kernel", kern)
    return kern, len(names)


@pytest.mark.parametrize("schedule", ["dynamic", "per_tile"])
def test_other_schedules_match_float64(monkeypatch, schedule):
    """Programs claiming their tiles from a counter ("dynamic": under the interpreter, which runs programs one
    after another, the first claims them all) or one program per tile: every tile written once, ragged ones
    included; the dynamic schedule's counters are zero again after each launch (its last program resets them), so
    the next launch, at another shape, starts from tile 0."""
    monkeypatch.setattr(G, "SCHEDULE", schedule)
    monkeypatch.setattr(G, "_COUNTERS", {})
    for M, N, K_, R, b_kn in [(70, 88, 104, 16, False), (33, 40, 64, 4, True), (70, 88, 104, 16, False)]:
        a, b, v, u, bb = _operands(M, N, K_, R, b_kn, b_kn, True)
        out = G.lowrank_gemm(a, b, v, u, bb, b_kn=b_kn, u_kn=b_kn)
        ref = G.lowrank_gemm_reference(a, b, v, u, bb, b_kn=b_kn, u_kn=b_kn)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6
        if schedule == "dynamic":
            [counters] = G._COUNTERS.values()
            assert counters.tolist() == [0, 0]
        else:
            assert G._COUNTERS == {}


def test_dynamic_schedule_hands_each_launch_its_streams_counters(monkeypatch):
    """A replayed launch of the dynamic schedule reads the counters of the stream it runs on (a role, like the
    operands): two streams never share one pair."""
    monkeypatch.setattr(G, "SCHEDULE", "dynamic")
    monkeypatch.setattr(G, "_COUNTERS", {})
    kern, _ = _replaying_stand_in(monkeypatch)
    a, b, v, u, _ = _operands(70, 36, 104, 4, False, False, False)
    G.lowrank_gemm(a, b, v, u)
    (args, kwargs), = kern.jit_calls
    [first] = G._COUNTERS.values()
    assert kwargs["DYNAMIC"] is True and args[6] is first and first.dtype == torch.int32
    G._COUNTERS.clear()  # as if this launch ran on another stream: it has its own pair
    G.lowrank_gemm(a, b, v, u)
    (_, _, replayed), = kern.binary.launches
    [second] = G._COUNTERS.values()
    assert replayed[6] is second and second is not first


def test_interpreter_declines_16_bit_operands():
    """The interpreter computes in numpy, which has no bf16: 16-bit CPU operands take the cuBLAS-style path."""
    a, b, v, u, _ = _operands(16, 24, 32, 4, False, False, False)
    assert G.lowrank_gemm_supported(a, b, v, u)
    assert not G.lowrank_gemm_supported(*(t.bfloat16() for t in (a, b, v, u)))


def test_peft_model_compiled_new_length_every_batch(monkeypatch):
    """As users call it: a tiny PEFT Llama (LoRA on all seven projections, dropout 0) under
    ``torch.compile(model, backend="fxfuse")`` without ``dynamic=``, labels a tensor of their own, a new length every
    batch, with the Triton path forced (as on a Hopper GPU) so the low-rank GEMM computes every projection's output
    and grad x: loss and every adapter gradient within 2x of eager fp32's distance from float64, and as many graphs
    as the model compiled without fxfuse."""
    import copy

    peft = pytest.importorskip("peft")
    from conftest import grads_of, tiny_causal_lm

    monkeypatch.setattr(K, "FORCE_TRITON", True)
    calls = []
    real = K.lowrank_gemm
    monkeypatch.setattr(K, "lowrank_gemm", lambda *a, **kw: calls.append(kw.get("b_kn", False)) or real(*a, **kw))
    model = peft.get_peft_model(tiny_causal_lm("llama"), peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # PEFT zero-initialises B: give the adapters something to do
            torch.nn.init.normal_(p, std=0.1)
    model64 = copy.deepcopy(model).double()

    def step(m, fn, ids):
        out = fn(input_ids=ids, labels=ids.clone(), use_cache=False)
        out.loss.backward()
        g = grads_of(m)
        m.zero_grad(set_to_none=True)
        return out.loss.detach().double(), g

    lengths = (12, 17, 9)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="fxfuse")
    for L in lengths:
        ids = torch.randint(0, 128, (2, L), generator=torch.Generator().manual_seed(L))
        ref_loss, ref = step(model64, model64, ids)
        eager_loss, eager = step(model, model, ids)
        calls.clear()
        loss, got = step(model, compiled, ids)
        # every projection's output (7 x 2 layers); grad x once per op (q/k/v and gate/up grouped: 4 a layer), less
        # the first layer's q/k/v, whose input (the frozen embedding) needs none
        assert (calls.count(False), calls.count(True)) == (14, 7), calls
        rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()  # noqa: E731
        assert rel(loss, ref_loss) <= 2 * rel(eager_loss, ref_loss) + 1e-6
        assert set(got) == set(ref) and len(ref) == 2 * 7 * 2
        for n in ref:
            assert rel(got[n], ref[n]) <= 2 * rel(eager[n], ref[n]) + 1e-6, (L, n, rel(got[n], ref[n]))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plain = torch.compile(model, backend="eager")  # graphs are Dynamo's: the backend behind it does not count
    for L in lengths:
        step(model, plain, torch.randint(0, 128, (2, L)))
    assert graphs == torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _record_specialisations(monkeypatch, grad_x_only: bool):
    """Patch the LoRA kernels' warm-up and launch of the low-rank GEMM to record the specialisation key of each
    (the interpreter compiles nothing). A warm-up's operands must be meta stand-ins (W may be the real weight when
    the forward asks for its backward's launch) that the kernel accepts; ``grad_x_only``: record only the launches
    with ``b_kn`` (the backward's grad x), else every launch, and every warm-up operand must be a stand-in. Returns
    the (asked, launched) lists."""
    monkeypatch.setattr(K, "FORCE_TRITON", True)
    monkeypatch.setattr(K, "_grad_x_prewarmed", set())
    monkeypatch.setattr(K, "_forward_prewarmed", set())
    asked, launched = [], []
    real = K.lowrank_gemm

    def prewarm(a, b, v, u, bias=None, b_kn=False, u_kn=False, device=None):
        assert a.is_meta and v.is_meta and device == torch.device("cpu")
        assert grad_x_only or (b.is_meta and u.is_meta)  # from a trace: every operand a stand-in
        assert G.lowrank_gemm_supported(a, b, v, u, bias, b_kn, u_kn, device)
        c = torch.empty((a.shape[0], b.shape[1] if b_kn else b.shape[0]), device="meta")
        _, args, consts = G._launch_args(a, b, v, u, c, bias, b_kn, u_kn, device, torch.empty(64))
        asked.append(G._specialisation(device, a.dtype, args, consts))

    def launch(a, b, v, u, bias=None, b_kn=False, u_kn=False):
        if b_kn or not grad_x_only:
            c = torch.empty((a.shape[0], b.shape[1] if b_kn else b.shape[0]))
            _, args, consts = G._launch_args(a, b, v, u, c, bias, b_kn, u_kn, a.device)
            launched.append(G._specialisation(a.device, a.dtype, args, consts))
        return real(a, b, v, u, bias, b_kn=b_kn, u_kn=u_kn)

    monkeypatch.setattr(K, "lowrank_gemm_prewarm", prewarm)
    monkeypatch.setattr(K, "lowrank_gemm", launch)
    return asked, launched


def test_forward_prewarms_the_backward_grad_x_launch(monkeypatch):
    """The first forward of a layout asks for the specialisation its backward's grad x will launch (compiled on a
    background thread on a GPU; the interpreter compiles nothing): the launch built from the forward's meta
    stand-ins has the same specialisation key as the backward's real launch, for a single adapter and for q/k/v
    siblings (rank sum 24: a wider low-rank tile, another kernel); a second forward of the layout asks for
    nothing."""
    asked, launched = _record_specialisations(monkeypatch, grad_x_only=True)
    g = torch.Generator().manual_seed(3)
    N, din, r = 40, 32, 8
    seeds = K.draw_seeds(3, "cpu")
    for douts in ((24,), (24, 8, 8)):
        n = len(douts)
        x = torch.randn(N, din, generator=g)
        Ws = [torch.randn(d, din, generator=g) for d in douts]
        A = torch.randn(n * r, din, generator=g)
        Bs = [torch.randn(d, r, generator=g) for d in douts]
        adapters = ([r] * n, [1] * n, [2.0] * n, [0.0] * n)
        for _ in range(2):  # the second forward of the layout asks for nothing
            ys, V = K.lora_forward(x, Ws, [None] * n, A, Bs, seeds[:n], *adapters)
            K.lora_backward([torch.randn_like(y) for y in ys], x, Ws, A, Bs, V, seeds[:n], *adapters,
                            True, False, False, False, False)
    assert len(asked) == 2 and len(launched) == 4
    assert asked == launched[::2]
    assert [dict(k[2])["RP"] for k in asked] == [16, 32]


def test_tracing_the_forward_op_prewarms_its_launches(monkeypatch):
    """The forward op's fake impl (fxfuse's passes and AOTAutograd trace it seconds before the first real call) asks
    for every low-rank GEMM specialisation the real forward and its backward's grad x will launch, from fake
    tensors: a q/k/v sibling group whose projections' widths make two forward kernels, and grad x's. The keys are
    the real launches'; a second trace of the layout asks for nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    asked, launched = _record_specialisations(monkeypatch, grad_x_only=False)
    g = torch.Generator().manual_seed(4)
    N, din, r, douts = 40, 32, 8, (32, 8, 8)  # 32 and 8 columns: divisible by 16 or not, two forward kernels
    x = torch.randn(N, din, generator=g)
    Ws = [torch.randn(d, din, generator=g) for d in douts]
    A = torch.randn(3 * r, din, generator=g)
    Bs = [torch.randn(d, r, generator=g) for d in douts]
    seeds = K.draw_seeds(3, "cpu")
    adapters = ([r] * 3, [1] * 3, [2.0] * 3, [0.0] * 3)
    with FakeTensorMode() as mode:
        fake = lambda t: mode.from_tensor(t)  # noqa: E731
        for _ in range(2):
            torch.ops.fxfuse.lora_linear_fwd(fake(x), [fake(w) for w in Ws], [], [-1] * 3, fake(A),
                                             [fake(b) for b in Bs], fake(seeds), *adapters)
    assert len(asked) == 4 and not launched  # three projections and grad x, asked once
    ys, V = K.lora_forward(x, Ws, [None] * 3, A, Bs, seeds, *adapters)
    K.lora_backward([torch.randn_like(y) for y in ys], x, Ws, A, Bs, V, seeds, *adapters,
                    True, False, False, False, False)
    assert len(asked) == 4  # the real forward found its layout asked for already
    assert set(asked) == set(launched) and len(set(launched)) == 3, (asked, launched)


def test_launch_waits_for_a_warm_up_of_its_specialisation():
    """A launch whose specialisation a background warm-up is still compiling waits for that compile (instead of
    compiling the kernel a second time beside it) and then runs."""
    import threading

    a, b, v, u, _ = _operands(40, 24, 32, 4, False, False, False)
    c = torch.empty(40, 24)
    _, args, consts = G._launch_args(a, b, v, u, c, None, False, False, a.device)
    key = (G._lowrank_gemm_kernel, G._specialisation(a.device, a.dtype, args, consts))
    fut = Future()
    BC._pending[key] = fut
    try:
        threading.Timer(0.3, fut.set_result, (None,)).start()
        out = G.lowrank_gemm(a, b, v, u)
        assert fut.done()
    finally:
        BC._pending.pop(key, None)
    ref = G.lowrank_gemm_reference(a, b, v, u)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_forked_child_forgets_the_parents_warm_ups(monkeypatch):
    """A forked child (a DataLoader worker) has none of the parent's warm-up threads: its bookkeeping starts empty,
    so a launch there never waits on a compile that no thread will finish; the parent keeps its own."""
    monkeypatch.setitem(BC._pending, ("k",), Future())
    BC._started.add(("k",))
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not BC._pending and not BC._started and BC._pool is None else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert ("k",) in BC._pending and ("k",) in BC._started
    finally:
        BC._started.discard(("k",))


def test_second_launch_of_a_layout_replays_with_its_own_operands(monkeypatch):
    """A launch's Python (configs, five tile descriptors, Triton's argument binding) is paid once per layout: a
    later call with the same sizes, strides, dtypes and alignment launches the recorded binary with its own
    operands in every slot (the descriptors rebuilt over them), and any other layout or a bias of another alignment
    takes Triton's path again. On CPU a stand-in kernel records the launches (replays are for compiled kernels)."""
    kern, n_params = _replaying_stand_in(monkeypatch)
    a, b, v, u, bias = _operands(70, 36, 104, 4, False, False, True)
    G.lowrank_gemm(a, b, v, u, bias)
    assert len(kern.jit_calls) == 1 and kern.binary.launches == []
    a2, b2, v2, u2, bias2 = _operands(70, 36, 104, 4, False, False, True, seed=1)
    built = []
    real_args = G._launch_args
    monkeypatch.setattr(G, "_launch_args", lambda *x, **kw: built.append(1) or real_args(*x, **kw))
    c2 = G.lowrank_gemm(a2, b2, v2, u2, bias2)
    assert len(kern.jit_calls) == 1 and built == []  # neither Triton's dispatch nor the launch arguments again
    (grid, stream, args), = kern.binary.launches
    recorded = kern.jit_calls[0][0]
    assert stream == 7 and grid[1:] == (1, 1)  # the recorded 1-D grid
    descs = args[:5]
    assert [d.base for d in descs] == [a2, b2, v2, u2, c2]
    assert [(d.shape, d.strides, d.block_shape) for d in descs] == \
        [(d.shape, d.strides, d.block_shape) for d in recorded[:5]]
    # the bias, the schedule's counters (the static schedule reads none: the bias stands in), M, N, K as recorded
    assert args[5] is bias2 and args[6] is bias2 and args[7:10] == recorded[7:10]
    assert len(args) == n_params  # every parameter, the constexprs too
    # another layout (rows), no bias, or a bias of another alignment: Triton's path
    G.lowrank_gemm(*_operands(72, 36, 104, 4, False, False, True)[:4], bias2)
    G.lowrank_gemm(a2, b2, v2, u2)
    shifted = torch.randn(37)[1:]
    G.lowrank_gemm(a2, b2, v2, u2, shifted)
    assert len(kern.jit_calls) == 4 and len(kern.binary.launches) == 1
    G.forget_launches()  # e.g. after CONFIG changed: the recorded layout goes through Triton again
    G.lowrank_gemm(a2, b2, v2, u2, bias2)
    assert len(kern.jit_calls) == 5 and len(kern.binary.launches) == 1


def test_supported_is_remembered_by_layout_and_alignment():
    """The answer is kept per layout, but a misaligned operand of a remembered layout is still declined."""
    a, b, v, u, _ = _operands(16, 24, 32, 4, False, False, False)
    assert G.lowrank_gemm_supported(a, b, v, u)
    misaligned = torch.randn(16 * 32 + 1)[1:].view(16, 32)  # a's sizes and strides, 4 bytes off
    assert not G.lowrank_gemm_supported(misaligned, b, v, u)
    assert G.lowrank_gemm_supported(a.clone(), b, v, u)


def test_no_replay_where_fast_launch_is_off(monkeypatch):
    """Under the interpreter or ``FXFUSE_TRITON_FAST_LAUNCH=0`` every launch goes through Triton, and nothing is
    recorded for a replay."""
    monkeypatch.setattr(G, "_DESCRIPTORS", {})
    a, b, v, u, bias = _operands(33, 64, 40, 12, False, False, True)
    for _ in range(2):
        out = G.lowrank_gemm(a, b, v, u, bias)
    assert G._DESCRIPTORS == {}
    ref = G.lowrank_gemm_reference(a, b, v, u, bias)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
