"""``fxfuse.comm_overlap``: tensor parallelism's all-reduces (RowwiseParallel outputs, ColwiseParallel input
gradients) merged where they are only summed, and all-reduced matmuls split into blocks of rows, each all-reduced
while the next block's matmul runs.

In-process on a one-rank gloo group (the graph rewrites themselves: which sites they take, the same values), and on
two gloo ranks end to end: a tensor-parallel MLP (gate / up ColwiseParallel, down RowwiseParallel) compiled with
``backend="fxfuse"`` and ``tp_all_reduce_blocks``, its loss and every gradient against eager DTensor, and the number
of all-reduces that ran."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from fxfuse.comm_overlap import merge_summed_all_reduces, split_all_reduced_matmuls

HERE = os.path.dirname(os.path.abspath(__file__))


def _ops(gm, name):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _traced(group, rows, *, mm_read_twice=False, tracing_mode="fake"):
    from torch.fx.experimental.proxy_tensor import make_fx

    c10d = torch.ops._c10d_functional

    def f(x, w):
        y = torch.mm(x, w)
        h = c10d.wait_tensor(c10d.all_reduce(y.reshape(2, -1, w.shape[1]), "sum", group))
        return (h, y * 2) if mm_read_twice else (h.sin(),)

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, 24, generator=g), torch.randn(24, 8, generator=g)
    return make_fx(f, tracing_mode=tracing_mode)(x, w), (x, w), f


def test_splits_an_all_reduced_matmul_into_blocks_with_the_same_values(one_rank):
    gm, args, f = _traced(one_rank, 1000)
    ref = f(*args)
    assert split_all_reduced_matmuls(gm.graph, 4, min_rows=16) == 1
    gm.recompile()
    assert _ops(gm, "all_reduce") == 4 and _ops(gm, "wait_tensor") == 4 and _ops(gm, "aten.mm") == 4
    out = gm(*args)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-6)
    # the blocks are issued in order, each all-reduce right after its matmul; the waits come after the last one
    order = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"
             and any(k in str(n.target) for k in ("aten.mm", "all_reduce", "wait_tensor"))]
    assert order == ["aten.mm.default", "_c10d_functional.all_reduce.default"] * 4 + \
        ["_c10d_functional.wait_tensor.default"] * 4


def test_a_site_whose_values_cannot_be_computed_is_left_as_traced(one_rank, monkeypatch, caplog):
    """Rollback: the new nodes go before anything is rewired to them; the graph runs as traced."""
    gm, args, f = _traced(one_rank, 1000)
    ref = f(*args)
    before = [str(n.target) for n in gm.graph.nodes]

    def broken_cat(*a, **k):
        raise RuntimeError("no cat today")

    monkeypatch.setattr(torch, "cat", broken_cat)
    assert split_all_reduced_matmuls(gm.graph, 4, min_rows=16) == 0
    monkeypatch.undo()
    assert [str(n.target) for n in gm.graph.nodes] == before
    assert "left as traced" in caplog.text and "no cat today" in caplog.text
    gm.graph.lint()
    gm.recompile()
    torch.testing.assert_close(gm(*args)[0], ref[0])


def test_leaves_what_it_cannot_split(one_rank):
    gm, _args, _f = _traced(one_rank, 1000, mm_read_twice=True)  # the matmul's rows are read unreduced too
    assert split_all_reduced_matmuls(gm.graph, 4, min_rows=16) == 0
    gm, _args, _f = _traced(one_rank, 40)  # fewer rows than blocks x min_rows
    assert split_all_reduced_matmuls(gm.graph, 4, min_rows=16) == 0
    gm, _args, _f = _traced(one_rank, 1000, tracing_mode="symbolic")  # a symbolic row count
    assert split_all_reduced_matmuls(gm.graph, 4, min_rows=16) == 0
    assert _ops(gm, "all_reduce") == 1
    gm, _args, _f = _traced(one_rank, 1000)
    assert split_all_reduced_matmuls(gm.graph, 0) == 0  # off


def test_merges_all_reduces_that_are_only_summed(one_rank):
    """q / k / v's input gradients: t + all_reduce(a) + all_reduce(b) + all_reduce(c) -> t + all_reduce(a + b + c);
    an all-reduce read elsewhere too, or of another reduction, stays."""
    from torch.fx.experimental.proxy_tensor import make_fx

    c10d = torch.ops._c10d_functional

    def ar(t, op="sum"):
        return c10d.wait_tensor(c10d.all_reduce(t, op, one_rank))

    def f(t, a, b, c, d):
        s = t + ar(a) + ar(b) + ar(c)
        kept = ar(d)  # read twice
        return s, kept * 2 + s, ar(a * 3, "max") + ar(b * 3, "max")

    args = [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    ref = f(*args)
    for mode in ("fake", "symbolic"):  # symbolic: a new length every batch merges too
        gm = make_fx(f, tracing_mode=mode)(*args)
        assert _ops(gm, "all_reduce") == 6
        assert merge_summed_all_reduces(gm.graph) == 2
        gm.graph.lint()
        gm.recompile()
        assert _ops(gm, "all_reduce") == 4  # a + b + c as one; d and the two "max" ones as they were
        for got, want in zip(gm(*args), ref):
            torch.testing.assert_close(got, want)


def test_the_post_grad_pass_and_the_compile_processs_rebuild_do_the_same(one_rank):
    """The backend's post-grad pass runs the rewrite the option asks for, its cache key (``uuid()``) differs with
    the option, and ``background_compile``'s compile process rebuilds the same pass from what it is sent."""
    from fxfuse import background_inductor
    from fxfuse.options import FxFuseOptions
    from fxfuse.pass_manager import PassManager

    def post_grad(blocks):
        return PassManager(FxFuseOptions.parse({"tp_all_reduce_blocks": blocks})).post_grad_pass(None)

    from torch._dynamo.utils import counters

    assert post_grad(1).uuid() != post_grad(0).uuid() != post_grad(2).uuid()
    for blocks, all_reduces in ((0, 1), (4, 4)):
        for make in (lambda b: post_grad(b), lambda b: background_inductor._post_grad_pass("key", b)):
            gm, _args, _f = _traced(one_rank, 4096)
            split_before = counters["fxfuse"]["tp_all_reduces_split"]
            make(blocks)(gm.graph)
            assert _ops(gm, "all_reduce") == all_reduces
            # what was done is counted where Inductor counts its rewrites (benchmarks put it in their rows)
            assert counters["fxfuse"]["tp_all_reduces_split"] - split_before == (blocks >= 2)
    assert post_grad(3).tp_all_reduce_blocks == 3  # what background_inductor sends its compile process


def test_install_runs_the_rewrite_in_its_post_grad_pass_and_a_second_run_changes_nothing(one_rank):
    """``fxfuse.install()`` (HF Trainer's ``torch_compile``) gets the same rewrite in its post-grad pass, with its
    option; the rewrite is idempotent, so the backend's own post-grad pass after install()'s adds nothing."""
    import torch._inductor.config as ic

    import fxfuse
    from fxfuse.comm_overlap import rewrite_tp_all_reduces

    for blocks, all_reduces in ((None, 1), (0, 1), (4, 4)):
        with fxfuse.install(**({} if blocks is None else {"tp_all_reduce_blocks": blocks})):
            post = ic.post_grad_custom_post_pass
            post = post[-1] if isinstance(post, (list, tuple)) else post
            assert post.tp_all_reduce_blocks == (1 if blocks is None else blocks)
            gm, _args, _f = _traced(one_rank, 4096)
            post(gm.graph)
            assert _ops(gm, "all_reduce") == all_reduces
            # the backend's pass after it, with the same option: nothing merged or split again
            rewrite_tp_all_reduces(gm.graph, post.tp_all_reduce_blocks)
            assert _ops(gm, "all_reduce") == all_reduces
            gm.graph.lint()


def test_option_is_checked():
    from fxfuse.errors import FxFuseOptionsError
    from fxfuse.options import FxFuseOptions

    assert FxFuseOptions.parse({"tp_all_reduce_blocks": 4}).tp_all_reduce_blocks == 4
    assert FxFuseOptions.parse({}).tp_all_reduce_blocks == 1  # merged by default (twenty-seventh session's rows)
    assert FxFuseOptions.parse({"tp_all_reduce_blocks": 0}).tp_all_reduce_blocks == 0
    for bad in (-2, True, 2.0):
        with pytest.raises(FxFuseOptionsError, match="tp_all_reduce_blocks"):
            FxFuseOptions.parse({"tp_all_reduce_blocks": bad})


def test_comm_overlap_option_and_install_scope_inductors_reordering():
    """``comm_overlap`` (default on) asks Inductor for its compute / collective reordering; install() sets it for
    its lifetime and puts back what was there; a user's own setting of it is left alone."""
    import torch._inductor.config as ic

    import fxfuse
    from fxfuse.comm_overlap import overlap_config_patches, reorder_compute_for_overlap_safely
    from fxfuse.errors import FxFuseOptionsError
    from fxfuse.options import FxFuseOptions

    assert FxFuseOptions.parse({}).comm_overlap is True
    assert FxFuseOptions.parse({"comm_overlap": False}).comm_overlap is False
    with pytest.raises(FxFuseOptionsError, match="comm_overlap"):
        FxFuseOptions.parse({"comm_overlap": "no"})
    assert overlap_config_patches({}) == {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": [reorder_compute_for_overlap_safely]}
    assert overlap_config_patches({"reorder_for_compute_comm_overlap_passes": ["sink_waits"]}) == {}
    before = (ic.reorder_for_compute_comm_overlap, list(ic.reorder_for_compute_comm_overlap_passes))
    with fxfuse.install():
        assert ic.reorder_for_compute_comm_overlap is True
        assert list(ic.reorder_for_compute_comm_overlap_passes) == [reorder_compute_for_overlap_safely]
        fxfuse.install(comm_overlap=False)  # re-installed without it: what was there comes back
        assert (ic.reorder_for_compute_comm_overlap, list(ic.reorder_for_compute_comm_overlap_passes)) == before
    assert (ic.reorder_for_compute_comm_overlap, list(ic.reorder_for_compute_comm_overlap_passes)) == before
    with ic.patch(reorder_for_compute_comm_overlap=True, reorder_for_compute_comm_overlap_passes=["sink_waits"]):
        with fxfuse.install():
            assert list(ic.reorder_for_compute_comm_overlap_passes) == ["sink_waits"]  # the user's, kept
        assert list(ic.reorder_for_compute_comm_overlap_passes) == ["sink_waits"]


def test_only_graphs_that_can_hold_collectives_ask_for_the_reordering(one_rank):
    """A graph on plain tensors compiles with Inductor's settings untouched (its cache key and code as before);
    one computing on DTensors or calling functional collectives asks for the reordering."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fxfuse.comm_overlap import may_hold_collectives

    def plain(x):
        return torch.relu(x @ x.T)

    x = torch.randn(8, 8)
    gm = torch.fx.symbolic_trace(plain)
    assert not may_hold_collectives(gm, [x])
    mesh = init_device_mesh("cpu", (1,))
    assert may_hold_collectives(gm, [distribute_tensor(x, mesh, [Replicate()])])
    c10d = torch.ops._c10d_functional

    def reduced(x):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", one_rank))

    from torch.fx.experimental.proxy_tensor import make_fx

    assert may_hold_collectives(make_fx(reduced)(x), [x])


def test_a_graph_with_a_vocab_parallel_op_keeps_inductors_order(monkeypatch):
    """The vocabulary-parallel ops run collectives the scheduler cannot see: a graph holding one is left in its
    order (two ranks with different shard sizes could otherwise reorder it differently and hang); any other graph
    goes through Inductor's pass."""
    from types import SimpleNamespace

    import torch._inductor.comms as comms

    import fxfuse.ops  # noqa: F401  (registers fxfuse's ops)
    from fxfuse.comm_overlap import reorder_compute_for_overlap_safely

    calls = []
    monkeypatch.setattr(comms, "reorder_compute_for_overlap", lambda snodes: calls.append(snodes) or snodes[::-1])
    vocab_op = SimpleNamespace(node=SimpleNamespace(op_overload=torch.ops.fxfuse.vocab_parallel_cross_entropy.default))
    mm = SimpleNamespace(node=SimpleNamespace(op_overload=torch.ops.aten.mm.default))
    add = SimpleNamespace(node=SimpleNamespace(op_overload=torch.ops.aten.add.Tensor))
    assert reorder_compute_for_overlap_safely([mm, vocab_op]) == [mm, vocab_op] and not calls
    assert reorder_compute_for_overlap_safely([mm, add]) == [add, mm] and len(calls) == 1  # Inductor's pass ran


class GatedMLP(torch.nn.Module):
    def __init__(self, d=32, f=64):
        super().__init__()
        self.gate = torch.nn.Linear(d, f, bias=False)
        self.up = torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _matmuls_in_flight(codes) -> int:
    """The most matmuls Inductor's code runs between issuing an all-reduce and waiting for it."""
    import re

    most = 0
    for code in codes:
        calls = re.findall(r"extern_kernels\.mm\(|all_reduce_\.default\(|wait_tensor\.default\(", code)
        open_mms = None
        for c in calls:
            if c.startswith("all_reduce"):
                open_mms = 0
            elif c.startswith("wait"):
                most, open_mms = max(most, open_mms or 0), None
            elif open_mms is not None:
                open_mms += 1
    return most


def _worker(rank, world, port, result_path):
    sys.path.insert(0, HERE)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from torch._inductor.utils import run_and_get_code

    import fxfuse  # noqa: F401  (registers the backend)

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 300, 32, generator=g)  # 1,200 token rows: 4 blocks of 300
        for mode in ("eager", "merged", "blocks", "in_order"):
            torch.manual_seed(0)
            mlp = GatedMLP()
            parallelize_module(mlp, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                           "down": RowwiseParallel()})
            xi = x.clone().requires_grad_()

            def step(t):
                return mlp(t).pow(2).mean()

            fn = step if mode == "eager" else torch.compile(step, backend="fxfuse", options={
                "tp_all_reduce_blocks": 4 if mode == "blocks" else 1, "comm_overlap": mode != "in_order",
                "compiler": "inductor"})
            # the compile (Dynamo and Inductor trace the collectives on fake tensors), with Inductor's code
            _, code = run_and_get_code(lambda: fn(xi).backward())
            for p in mlp.parameters():
                p.grad = None
            xi.grad = None
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loss = fn(xi)
                loss.backward()
            full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
            out[mode] = {"loss": float(full(loss)), "grad_x": xi.grad.tolist(),
                         "grads": [full(p.grad).tolist() for p in mlp.parameters()],
                         "all_reduces": sum(1 for e in prof.events() if e.name.startswith("gloo:all_reduce")),
                         "matmuls_in_flight": _matmuls_in_flight(code)}
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(out, f)


@pytest.mark.slow
def test_two_ranks_tensor_parallel_mlp_overlapped_matches_eager(tmp_path):
    from test_distributed import RANK_TIMEOUT_S, _free_port, _spawn

    result = tmp_path / "result.json"
    _spawn(_worker, (2, _free_port(), str(result)), nprocs=2, timeout=RANK_TIMEOUT_S)
    r = json.loads(result.read_text())
    e = r["eager"]
    # eager: the RowwiseParallel output's all-reduce (forward), one per ColwiseParallel input gradient (backward)
    assert e["all_reduces"] == 3, e["all_reduces"]
    assert r["merged"]["all_reduces"] == 2, r["merged"]["all_reduces"]  # gate's and up's gradients: one
    assert r["blocks"]["all_reduces"] == 8, r["blocks"]["all_reduces"]  # and both sites in 4 blocks
    assert r["in_order"]["all_reduces"] == 2
    # comm_overlap (default): the weight-gradient matmuls run between the input gradient's all-reduce and its
    # wait; as traced (and with comm_overlap=False) the wait follows the all-reduce at once
    assert r["merged"]["matmuls_in_flight"] >= 2, r["merged"]["matmuls_in_flight"]
    assert r["in_order"]["matmuls_in_flight"] == 0, r["in_order"]["matmuls_in_flight"]
    for f in (r["merged"], r["blocks"], r["in_order"]):
        assert f["loss"] == pytest.approx(e["loss"], rel=1e-5)
        torch.testing.assert_close(torch.tensor(f["grad_x"]), torch.tensor(e["grad_x"]), rtol=1e-4, atol=1e-6)
        for a, b in zip(f["grads"], e["grads"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-6)
