"""``kernels/lowrank_gemm.py`` compiled for the GPU (sm_90+), every tile schedule, against float64: the CPU suite
runs the kernel through the Triton interpreter in fp32 only; this file checks the bf16 binaries themselves, with
shapes of many tiles per program (the persistent and the counter-claimed schedules hand each program several),
ragged edges, the dynamic schedule's per-stream counters and its stand-in during CUDA-graph capture. Skipped
without such a GPU."""
from __future__ import annotations

import pytest
import torch

from fxfuse.kernels import lowrank_gemm as G
from fxfuse.kernels.triton_support import HAVE_TRITON, interpreting

pytestmark = pytest.mark.skipif(
    not (HAVE_TRITON and not interpreting() and torch.cuda.is_available()
         and torch.cuda.get_device_capability()[0] >= 9),
    reason="compiles the kernel for a CUDA GPU of sm_90 or newer")


def _operands(M, N, K_, R, b_kn, u_kn, bias, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)  # noqa: E731
    return (r(M, K_), r(K_, N) if b_kn else r(N, K_), r(M, R), r(R, N) if u_kn else r(N, R),
            r(N) if bias else None)


def _eager(a, b, v, u, bias, b_kn, u_kn):
    """What the graph ran before the fusion: two 16-bit GEMMs and their sum, each rounded to 16 bits."""
    out = a @ (b if b_kn else b.t()) + v @ (u if u_kn else u.t())
    return out + bias if bias is not None else out


def _error(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.fixture
def schedule(request, monkeypatch):
    monkeypatch.setattr(G, "SCHEDULE", request.param)
    monkeypatch.setattr(G, "_COUNTERS", {})
    return request.param


@pytest.mark.parametrize("schedule", G.SCHEDULES, indirect=True)
@pytest.mark.parametrize("b_kn,u_kn", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("M,N,K_,R,bias", [(8200, 4096, 4096, 16, False),  # ~1,000 tiles: several per SM
                                             (1000, 776, 520, 8, True),     # ragged in M, N and K
                                             (33, 64, 40, 8, False)])        # one tile, rank below the dot
def test_bf16_binaries_match_float64(schedule, M, N, K_, R, bias, b_kn, u_kn):
    # ranks are multiples of 8: 16-byte rows, which the copy engine needs (smaller ones are declined)
    first, second = (_operands(M, N, K_, R, b_kn, u_kn, bias, seed=s) for s in (0, 1))
    assert G.lowrank_gemm_supported(*first, b_kn, u_kn)
    out = G.lowrank_gemm(*first, b_kn=b_kn, u_kn=u_kn)
    again = G.lowrank_gemm(*second, b_kn=b_kn, u_kn=u_kn)  # the same layout: a replay with other operands
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    for got, ops in ((out, first), (again, second)):
        ref = G.lowrank_gemm_reference(*ops, b_kn=b_kn, u_kn=u_kn)
        # one rounding of an fp32 accumulator: no further from float64 than eager's two roundings and a 16-bit sum
        assert _error(got, ref) <= 1.05 * _error(_eager(*ops, b_kn, u_kn), ref)
    if schedule == "dynamic":
        torch.cuda.synchronize()
        [counters] = G._COUNTERS.values()
        assert counters.tolist() == [0, 0]  # the last program out reset them for the next launch


@pytest.mark.parametrize("schedule", ["dynamic"], indirect=True)
def test_dynamic_schedule_keeps_one_counter_pair_per_stream(schedule):
    """Launches on two streams at once each claim tiles from their own stream's counters; every tile is computed
    once on both (a shared pair would leave one launch's tiles unwritten)."""
    side = torch.cuda.Stream()
    ops = [_operands(4100, 2048, 1024, 16, False, False, False, seed=s) for s in (0, 1)]
    torch.cuda.synchronize()
    outs = [None, None]
    for _ in range(3):
        outs[0] = G.lowrank_gemm(*ops[0])
        with torch.cuda.stream(side):
            outs[1] = G.lowrank_gemm(*ops[1])
    torch.cuda.synchronize()
    assert len(G._COUNTERS) == 2 and all(c.tolist() == [0, 0] for c in G._COUNTERS.values())
    for out, op in zip(outs, ops):
        ref = G.lowrank_gemm_reference(*op)
        assert _error(out, ref) <= 1.05 * _error(_eager(*op, False, False), ref)


@pytest.mark.parametrize("schedule", ["dynamic"], indirect=True)
def test_capture_on_a_stream_without_counters_runs_the_static_schedule(schedule):
    """A CUDA graph captured where the stream has no counters yet launches the static schedule (counters made
    during capture would live in the graph's memory pool); the replayed graph computes the product."""
    a, b, v, u, _ = _operands(2048, 1024, 512, 8, False, False, False)
    G.SCHEDULE = "static"  # compile (and record) the static launch outside the capture; the fixture restores it
    G.lowrank_gemm(a, b, v, u)
    G.SCHEDULE = "dynamic"
    torch.cuda.synchronize()
    G._COUNTERS.clear()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = G.lowrank_gemm(a, b, v, u)
    assert G._COUNTERS == {}
    a.copy_(_operands(2048, 1024, 512, 8, False, False, False, seed=3)[0])
    graph.replay()
    torch.cuda.synchronize()
    ref = G.lowrank_gemm_reference(a, b, v, u)
    assert _error(out, ref) <= 1.05 * _error(_eager(a, b, v, u, None, False, False), ref)
