"""``fxfuse::vocab_parallel_cross_entropy`` and ``fxfuse::vocab_parallel_log_probs`` on two gloo ranks (CPU): each
rank holds its torch.chunk slice of a 127-entry vocabulary (64 and 63 rows) and the same hidden states and targets.
The loss (log-probs, entropy) and every gradient (hidden, the rank's weight slice) are compared with a float64
reference over the whole vocabulary, next to eager's distance from it (the same formula in the input dtype) and the
one-rank fused op's: ragged rows, ignored rows, a peaked and a flat row, softcap and scale (temperature), several
logits chunks, gradients formed in the forward ("mean") and recomputed in the backward ("sum", "none", log-probs),
per-token upstream gradients of the log-probs, of the entropy and of both, both row implementations (the PyTorch twin
and the Triton kernel in the interpreter). The passes that insert the ops are tested in ``test_distributed.py``
(tensor-parallel cases).

Triton's interpreter rounds fp32 -> bf16 by truncation (1 + 2^-8 + 2^-10 becomes 1.0; the GPU's cvt.rn rounds to
nearest), a biased error that sums up over a gradient's rows: the kernel path runs in fp32 here (its logic does not
depend on the dtype), bf16 on the PyTorch path; bf16 on the kernel is checked on the GPU
(``benchmarks/bench_tp_head.py``)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from test_distributed import RANK_TIMEOUT_S, _free_port, _spawn

pytestmark = pytest.mark.slow  # starts processes

HERE = os.path.dirname(os.path.abspath(__file__))
V, N, D = 127, 37, 24
#: several logits chunks, of different row counts for the two slices if counted by each slice's own size (10 rows
#: of 63 fp32 logits, 9 of 64): the op must cut the same chunks on both ranks (it combines each chunk's statistics)
CHUNK_BYTES = 63 * 4 * 10


def _finish(rank, result_path, rows, contract):
    """A worker's end, every rank: leave the group together; rank 0 writes what the test reads (nothing if the
    worker raised before its last check: ``contract`` still None, the error then fails the test)."""
    import torch.distributed as dist

    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0 and contract is not None:
        with open(result_path, "w") as f:
            json.dump({"rows": rows, "contract": contract}, f)


def _two_ranks(worker, path, tmp_path):
    """``worker`` on two gloo ranks (the Triton path needs triton); what rank 0 wrote."""
    if path == "triton":
        pytest.importorskip("triton")
    result = tmp_path / "result.json"
    _spawn(worker, (2, _free_port(), path, str(result)), nprocs=2, timeout=RANK_TIMEOUT_S)
    return json.loads(result.read_text())


def _cases(path):
    for dt in (torch.float32,) + ((torch.bfloat16,) if path == "torch" else ()):
        for softcap, scale in ((0.0, 1.0), (5.0, 0.5)):
            for reduction in ("mean", "sum", "none"):
                yield dt, softcap, scale, reduction


def _worker(rank, world, port, path, result_path):
    sys.path.insert(0, HERE)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if path == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch.distributed as dist

    from fxfuse.errors import FxFuseContractError
    from fxfuse.kernels import linear_cross_entropy as K
    from fxfuse.ops.linear_cross_entropy import linear_cross_entropy
    from fxfuse.ops.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy, vocab_slice

    K.FORCE_TRITON = path == "triton"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows, contract = [], None
    try:
        start, length = vocab_slice(V, rank, world)
        for dt, softcap, scale, reduction in _cases(path):
            g = torch.Generator().manual_seed(1)
            h = (torch.randn(N, D, generator=g) * 2).to(dt)
            w = torch.randn(V, D, generator=g).to(dt)
            h[0] = 0  # a flat row: uniform softmax
            w[7] *= 8  # a peaked class (row 5's target)
            t = torch.randint(0, V, (N,), generator=g)
            t[3] = t[11] = -100
            t[5], t[6], t[8], t[9] = 7, V - 1, 64, 63  # the peaked class, the last class, either side of the split
            go = torch.rand(N, generator=g) + 0.5 if reduction == "none" else None
            ref = K.lce_reference(h, w, t, reduction=reduction, softcap=softcap or None, scale=scale, grad_out=go)
            # eager in the input dtype, whole vocabulary, on one rank
            he, we = h.clone().requires_grad_(), w.clone().requires_grad_()
            z = (he @ we.T).float() * scale
            if softcap:
                z = torch.tanh(z / softcap) * softcap
            le = torch.nn.functional.cross_entropy(z, t, reduction=reduction)
            le.backward(go) if go is not None else le.backward()
            hf, wf = h.clone().requires_grad_(), w[start:start + length].clone().requires_grad_()
            lf = vocab_parallel_cross_entropy(hf, wf, t, vocab_size=V, reduction=reduction, softcap=softcap or None,
                                              scale=scale, chunk_bytes=CHUNK_BYTES,
                                              grad_in_forward=reduction != "sum")  # "sum": the recompute path
            lf.backward(go) if go is not None else lf.backward()
            h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()  # the one-rank op, same row path
            l1 = linear_cross_entropy(h1, w1, t, reduction=reduction, softcap=softcap or None, scale=scale,
                                      grad_in_forward=False, chunk_bytes=CHUNK_BYTES)
            l1.backward(go) if go is not None else l1.backward()

            def err(a, b):
                return (a.detach().double() - b.double()).abs().max().item()

            sl = slice(start, start + length)
            rows.append({"case": f"{dt} softcap={softcap} scale={scale} {reduction}",
                         "fxfuse": [err(lf, ref[0]), err(hf.grad, ref[1]), err(wf.grad, ref[2][sl])],
                         "eager": [err(le, ref[0]), err(he.grad, ref[1]), err(we.grad[sl], ref[2][sl])],
                         "one_rank": [err(l1, ref[0]), err(h1.grad, ref[1]), err(w1.grad[sl], ref[2][sl])],
                         "same_on_ranks": None})
            both = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(both, lf.detach().double().sum().reshape(1))
            rows[-1]["same_on_ranks"] = both[0].item() == both[1].item()
        try:  # a weight slice that is not this rank's torch.chunk part
            vocab_parallel_cross_entropy(h, w[:10], t, vocab_size=V)
            contract = ""
        except FxFuseContractError as e:
            contract = str(e)
    finally:
        _finish(rank, result_path, rows, contract)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_two_ranks_match_the_float64_whole_vocabulary_loss(path, tmp_path):
    got = _two_ranks(_worker, path, tmp_path)
    assert len(got["rows"]) == len(list(_cases(path)))
    for r in got["rows"]:
        assert r["same_on_ranks"], r
        for what, f, e, one in zip(("loss", "grad hidden", "grad weight"), r["fxfuse"], r["eager"], r["one_rank"]):
            # no further from float64 than eager (2x at most), nor than the one-rank fused op, with a floor at fp32
            # rounding of O(1) values
            assert f <= 2 * min(e, one) + 2e-6, (r["case"], what, f, e, one)
    assert "fxfuse::vocab_parallel_cross_entropy" in got["contract"] and "64" in got["contract"], got["contract"]


def _logp_cases(path):
    for dt in (torch.float32,) + ((torch.bfloat16,) if path == "torch" else ()):
        for softcap, temperature in ((0.0, 1.0), (5.0, 0.7)):
            for grads in ("logp", "entropy", "both"):
                yield dt, softcap, temperature, grads


def _tail(logp, ent, g_logp, g_ent):
    """The loss the op runs per chunk: sum(g_logp * logp) + sum(g_ent * entropy), the reference's weighting."""
    return (g_logp * logp).sum() + (g_ent * ent).sum()


def _tail_text():
    import torch.fx as fx

    from fxfuse.fx_program import dump_graph

    return dump_graph(fx.symbolic_trace(_tail).graph)


def _logp_worker(rank, world, port, path, result_path):
    sys.path.insert(0, HERE)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if path == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch.distributed as dist

    from fxfuse.errors import FxFuseContractError
    from fxfuse.kernels import linear_log_probs as K
    from fxfuse.ops.linear_log_probs import linear_log_probs
    from fxfuse.ops.vocab_parallel_log_probs import vocab_parallel_log_probs
    from fxfuse.ops.vocab_parallel_cross_entropy import vocab_slice

    K.FORCE_TRITON = path == "triton"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows, contract = [], None
    global TAIL
    TAIL = _tail_text()
    try:
        start, length = vocab_slice(V, rank, world)
        sl = slice(start, start + length)
        for dt, softcap, temperature, grads in _logp_cases(path):
            g = torch.Generator().manual_seed(2)
            h = (torch.randn(N, D, generator=g) * 2).to(dt)
            w = torch.randn(V, D, generator=g).to(dt)
            h[0] = 0  # a flat row: uniform softmax, the largest entropy
            w[7] *= 8
            h[5] = w[7] / 100  # a peaked row (its index: class 7): log-prob -1.3e-6, entropy 2.5e-5 without softcap
            t = torch.randint(0, V, (N,), generator=g)
            t[5], t[6], t[8], t[9] = 7, V - 1, 64, 63  # the peaked class, the last class, either side of the split
            gl = torch.randn(N, generator=g) if grads in ("logp", "both") else None
            ge = torch.randn(N, generator=g) if grads in ("entropy", "both") else None
            ref = K.logp_reference(h, w, t, None, temperature, softcap or None, gl, ge)

            def backward(logp, ent):
                loss = 0.0
                if gl is not None:
                    loss = loss + (gl * logp.float()).sum()
                if ge is not None:
                    loss = loss + (ge * ent.float()).sum()
                loss.backward()

            he, we = h.clone().requires_grad_(), w.clone().requires_grad_()  # eager, input dtype, whole vocabulary
            z = (he @ we.T).float()
            if softcap:
                z = torch.tanh(z / softcap) * softcap
            lsm = torch.log_softmax(z / temperature, -1)
            le, ee = lsm.gather(-1, t[:, None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)
            backward(le, ee)
            hf, wf = h.clone().requires_grad_(), w[sl].clone().requires_grad_()
            lf, ef = vocab_parallel_log_probs(hf, wf, t, vocab_size=V, temperature=temperature,
                                              softcap=softcap or None, return_entropy=True, chunk_bytes=CHUNK_BYTES)
            backward(lf, ef)
            h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()  # the one-rank op, same row path
            l1, e1 = linear_log_probs(h1, w1, t, temperature=temperature, softcap=softcap or None,
                                      return_entropy=True, chunk_bytes=CHUNK_BYTES)
            backward(l1, e1)
            # with its loss (what the log_probs_loss pass inserts): the gradients formed in the forward, each chunk's
            # statistics combined across the ranks first (chunks of 10 rows for both slices)
            hl, wl = h.clone().requires_grad_(), w[sl].clone().requires_grad_()
            tail_args = [gl if gl is not None else torch.zeros(N), ge if ge is not None else torch.zeros(N)]
            ll, el, carrier = torch.ops.fxfuse.vocab_parallel_log_probs_loss(
                hl, wl, t, V, dist.group.WORLD.group_name, temperature, softcap, True, CHUNK_BYTES, TAIL, tail_args,
                [])
            (_tail(ll, el, *tail_args) + carrier).backward()

            def err(a, b):
                return (a.detach().double() - b.double()).abs().max().item()

            rows.append({"case": f"{dt} softcap={softcap} temperature={temperature} grads of {grads}",
                         "fxfuse": [err(lf, ref[0]), err(ef, ref[1]), err(hf.grad, ref[2]), err(wf.grad, ref[3][sl])],
                         "with_loss": [err(ll, ref[0]), err(el, ref[1]), err(hl.grad, ref[2]),
                                       err(wl.grad, ref[3][sl])],
                         "eager": [err(le, ref[0]), err(ee, ref[1]), err(he.grad, ref[2]), err(we.grad[sl], ref[3][sl])],
                         "one_rank": [err(l1, ref[0]), err(e1, ref[1]), err(h1.grad, ref[2]),
                                      err(w1.grad[sl], ref[3][sl])]})
            both = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(both, torch.stack([lf.detach().double().sum(), ef.detach().double().sum()]))
            rows[-1]["same_on_ranks"] = bool(torch.equal(both[0], both[1]))
            # the peaked row: its log-prob and entropy keep their relative precision (~1e-5 and below, not ~1e-7
            # absolute lost to an lse)
            rows[-1]["peaked"] = [lf[5].item(), ref[0][5].item(), ef[5].item(), ref[1][5].item()]
        try:  # an index outside the vocabulary
            vocab_parallel_log_probs(h, w[sl], torch.full((N,), V), vocab_size=V)
            contract = ""
        except FxFuseContractError as e:
            contract = str(e)
    finally:
        _finish(rank, result_path, rows, contract)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_two_ranks_log_probs_and_entropy_match_the_float64_whole_vocabulary(path, tmp_path):
    got = _two_ranks(_logp_worker, path, tmp_path)
    assert len(got["rows"]) == len(list(_logp_cases(path)))
    for r in got["rows"]:
        assert r["same_on_ranks"], r
        for what, f, fl, e, one in zip(("log-probs", "entropy", "grad hidden", "grad weight"), r["fxfuse"],
                                       r["with_loss"], r["eager"], r["one_rank"]):
            assert f <= 2 * min(e, one) + 2e-6, (r["case"], what, f, e, one)
            assert fl <= 2 * min(e, one) + 2e-6, (r["case"], "with its loss", what, fl, e, one)
        lf, lref, ef, eref = r["peaked"]
        if "float32" in r["case"] and "softcap=0.0" in r["case"]:
            assert lref < 0 and abs(lf - lref) <= 1e-3 * abs(lref) and abs(ef - eref) <= 1e-3 * abs(eref), r
    assert "fxfuse::vocab_parallel_log_probs" in got["contract"] and str(V) in got["contract"], got["contract"]


def test_logit_chain_reads_the_dtensor_calls_dynamo_captures_as_functions(tmp_path):
    """Through torch 2.11 Dynamo records a DTensor's ``redistribute`` / ``to_local`` as functions made on the fly,
    named ``prim_redistribute`` / ``prim_to_local`` (the placements bound inside; torch 2.13 records methods). The
    lm-head matcher reads both: here a hand-built graph of a gathered-output lm-head (one gloo rank, in-process)."""
    import torch.distributed as dist
    import torch.fx as fx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from fxfuse.passes._logit_chain import match_logit_chain

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        mesh = init_device_mesh("cpu", (1,))
        h = DTensor.from_local(torch.randn(2, 3, 8), mesh, [Replicate()])
        w = DTensor.from_local(torch.randn(10, 8), mesh, [Shard(0)])
        logits = torch.nn.functional.linear(h, w)
        gathered = logits.redistribute(mesh, [Replicate()])
        local = gathered.to_local()

        def prim_redistribute(x):
            return x.redistribute(mesh, [Replicate()])

        def prim_to_local(x):
            return x.to_local()

        g = fx.Graph()
        nh, nw = g.placeholder("h"), g.placeholder("w")
        lin = g.call_function(torch.nn.functional.linear, (nh, nw))
        red = g.call_function(prim_redistribute, (lin,))
        loc = g.call_function(prim_to_local, (red,))
        flat = g.call_method("reshape", (loc, -1, 10))
        for node, val in ((nh, h), (nw, w), (lin, logits), (red, gathered), (loc, local),
                          (flat, local.reshape(-1, 10))):
            node.meta["example_value"] = val
        chain, why = match_logit_chain(flat)
        assert chain is not None, why
        assert chain.vocab_split is not None and chain.vocab_split.vocab_size == 10
        assert chain.hidden is nh and chain.weight is nw and [n.name for n in chain.nodes][1:3] == [red.name, loc.name]
        # the local slice of sharded logits (no gather) is this rank's vocabulary only: not matched
        g2 = fx.Graph()
        nh2, nw2 = g2.placeholder("h"), g2.placeholder("w")
        lin2 = g2.call_function(torch.nn.functional.linear, (nh2, nw2))
        loc2 = g2.call_function(prim_to_local, (lin2,))
        for node, val in ((nh2, h), (nw2, w), (lin2, logits), (loc2, logits.to_local())):
            node.meta["example_value"] = val
        chain, why = match_logit_chain(loc2)
        assert chain is None and "this rank's slice" in why, why
    finally:
        dist.destroy_process_group()
