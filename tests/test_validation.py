"""FakeTensor validation: broken rewrites are rolled back and reported; strict mode raises with the details."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse.errors import FxFusePassError, FxFuseValidationError

AOT = {"compiler": "aot_eager"}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x):
        return torch.relu(self.proj(x))  # the line a rollback must point at


def linear_to_matmul(gm: torch.fx.GraphModule) -> int:
    """A classic mistake: linear(x, w) is x @ w.T, not x @ w."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch._C._nn.linear:
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(torch.matmul, (node.args[0], node.args[1]))
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            n += 1
    return n


def transpose_output(gm: torch.fx.GraphModule) -> int:
    """Type-checks, but changes what the graph returns (shape)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    (val,) = out.args[0]
    with gm.graph.inserting_before(out):
        t = gm.graph.call_method("t", (val,))
    out.args = ((t,),)
    return 1


def raising_pass(gm: torch.fx.GraphModule) -> int:
    for node in list(gm.graph.nodes):
        if node.op == "call_function":
            gm.graph.erase_node  # touch nothing, then fail half-way
            node.target = torch.sigmoid  # a half-done rewrite
            break
    raise RuntimeError("half-way through")


def _unchanged_result(extra, **opts):
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 16, requires_grad=True)
    ref = net(x)
    got = torch.compile(net, backend="fxfuse", options={"extra_passes": [extra], **AOT, **opts})(x)
    torch.testing.assert_close(got, ref)
    got.sum().backward()  # the backward of the rolled-back graph works too
    assert x.grad is not None
    return fxfuse.report()


def test_faulty_rewrite_is_rolled_back_and_reported():
    rep = _unchanged_result(linear_to_matmul)
    (rec,) = rep.rolled_back
    assert rec.pass_name == "linear_to_matmul"
    assert "[3, 16]" in rec.reason and "[32, 16]" in rec.reason, rec.reason
    assert "test_validation.py" in rec.location and "self.proj(x)" in rec.location, rec.location
    assert "proj (Linear)" in rec.location
    text = str(rep)
    assert "rolled_back" in text and "linear_to_matmul" in text


def test_output_signature_change_is_rolled_back():
    rep = _unchanged_result(transpose_output)
    (rec,) = rep.rolled_back
    assert rec.pass_name == "transpose_output"
    assert "expected [3, 32]" in rec.reason and "got [32, 3]" in rec.reason, rec.reason


def test_raising_pass_is_rolled_back():
    rep = _unchanged_result(raising_pass)
    (rec,) = rep.rolled_back
    assert rec.pass_name == "raising_pass" and "half-way through" in rec.reason


def _inner(exc):
    while exc is not None and not isinstance(exc, fxfuse.FxFuseError):
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    return exc


def test_strict_mode_raises_with_pass_and_shapes():
    net = Net()
    with pytest.raises(Exception) as ei:
        torch.compile(net, backend="fxfuse", options={"extra_passes": [linear_to_matmul], "strict": True,
                                                      **AOT})(torch.randn(3, 16))
    err = _inner(ei.value)
    assert isinstance(err, FxFuseValidationError), ei.value
    msg = str(err)
    assert "linear_to_matmul" in msg and "[3, 16]" in msg and "[32, 16]" in msg and "self.proj(x)" in msg

    torch._dynamo.reset()
    with pytest.raises(Exception) as ei:
        torch.compile(net, backend="fxfuse", options={"extra_passes": [raising_pass], "strict": True,
                                                      **AOT})(torch.randn(3, 16))
    assert isinstance(_inner(ei.value), FxFusePassError)


def test_extra_pass_returning_none_is_reported():
    rep = _unchanged_result(lambda gm: None)
    assert rep.rolled_back and "returned None" in rep.rolled_back[0].reason


def test_good_extra_pass_is_kept_and_counted(caplog):
    def relu_to_clamp(gm):
        n = 0
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.relu:
                node.target = torch.clamp_min
                node.args = (node.args[0], 0.0)
                n += 1
        return n

    with caplog.at_level("INFO", logger="fxfuse"):
        rep = _unchanged_result(relu_to_clamp)
    assert not rep.rolled_back and "relu_to_clamp" in rep.passes_run
    assert any("fxfuse graph" in r.getMessage() for r in caplog.records)


def _autocast_nesting() -> int:
    n = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return n


def test_rollback_inside_autocast_leaves_autocast_state_alone():
    """Validation runs the graph's _enter_autocast / _exit_autocast nodes; a rewrite that fails in between must not
    leave autocast on or its nesting counter raised (a raised counter stops autocast from ever clearing its cache
    of down-cast weights, so later eager bf16 steps would reuse stale weights)."""
    net = Net()

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = net(x)
        return y.float().sum(-1)

    x = torch.randn(4, 16)
    before = (_autocast_nesting(), torch.is_autocast_enabled("cpu"))
    got = torch.compile(f, backend="fxfuse", options={"extra_passes": [linear_to_matmul], **AOT})(x)
    torch.testing.assert_close(got, f(x))
    assert fxfuse.report().rolled_back
    assert (_autocast_nesting(), torch.is_autocast_enabled("cpu")) == before
    # and eager autocast still refreshes its weight cache between steps
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = net(x)
    with torch.no_grad():
        net.proj.weight.mul_(2.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = net(x)
    assert not torch.allclose(a, b)


def test_a_rolled_back_vocab_parallel_rewrite_says_the_ranks_may_now_differ(tmp_path, monkeypatch):
    """fxfuse decides on each rank's graph alone. When the lm-head pass's vocabulary-parallel rewrite (an op that runs
    collectives inside) is rolled back, the report says that a rank that kept it runs other collectives (a hang or a
    size mismatch): what the twenty-seventh session's sequence-parallel hang looked like from one rank."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import fxfuse.pass_manager as pm

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        head = nn.Linear(16, 40, bias=False)
        parallelize_module(head, init_device_mesh("cpu", (1,)), ColwiseParallel(output_layouts=Replicate()))
        real_check = pm._check

        def refuses_the_head(gm, ctx, *args):  # validation fails for the lm-head pass only
            problem, node = real_check(gm, ctx, *args)
            return (problem or "forced by the test", node) if ctx.pass_name == "linear_cross_entropy" else (problem, node)

        monkeypatch.setattr(pm, "_check", refuses_the_head)

        def step(h, t):
            return F.cross_entropy(head(h).float(), t)

        fn = torch.compile(step, backend="fxfuse", options=AOT)
        fn(torch.randn(8, 16), torch.randint(0, 40, (8,))).backward()
        rolled = [r for rep in fxfuse.reports() for r in rep.rolled_back if r.pass_name == "linear_cross_entropy"]
        assert rolled and "forced by the test" in rolled[0].reason, [r.reason for rep in fxfuse.reports() for r in rep.records]
        assert "the ranks' collectives differ" in rolled[0].reason, rolled[0].reason
    finally:
        dist.destroy_process_group()
