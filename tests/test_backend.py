"""The backend spine: by-name registration, equivalence with eager, subgraphs, dynamic shapes, options."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import fxfuse

from conftest import assert_grads_close, grads_of, tiny_causal_lm

AOT = {"compiler": "aot_eager"}


@pytest.mark.slow
def test_backend_by_name_without_import():
    code = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        x = torch.randn(3, 8)
        assert "fxfuse" not in sys.modules
        y = torch.compile(m, backend="fxfuse")(x)
        torch.testing.assert_close(y, m(x))
        assert "fxfuse" in sys.modules
        import fxfuse
        assert fxfuse.reports()[-1].graph_name.startswith("graph"), fxfuse.reports()
        assert fxfuse.report().graphs == fxfuse.reports(), fxfuse.report()
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), cwd="/")
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.slow
def test_mlp_matches_eager_through_inductor():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    ref = m(x)
    ref.sum().backward()
    gref, gx = grads_of(m), x.grad.clone()
    m.zero_grad(); x.grad = None
    y = torch.compile(m, backend="fxfuse")(x)
    y.sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x.grad, gx)
    assert_grads_close(m, gref)
    rep = fxfuse.report()
    assert rep.num_nodes > 0 and not rep.rolled_back


def _llama_step(model, ids, compiled=None):
    fn = compiled if compiled is not None else model
    out = fn(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach()


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiny_llama_loss_and_grads_match_eager(checkpointing):
    model = tiny_causal_lm("llama")  # 2 layers, eager attention
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 128, (2, 12))
    ref_loss = _llama_step(model, ids)
    ref = grads_of(model)
    model.zero_grad()

    bodies = []  # per activation-checkpoint region: the call targets of its body, after fxfuse's passes

    def checkpoint_bodies(gm):
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is torch.ops.higher_order.tag_activation_checkpoint:
                body = getattr(gm, n.args[0].target)
                bodies.append([str(m.target) for m in body.graph.nodes if m.op == "call_function"])
        return 0

    compiled = torch.compile(model, backend="fxfuse", options={**AOT, "extra_passes": [checkpoint_bodies]})
    loss = _llama_step(model, ids, compiled)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(model, ref)
    # one graph: each layer's eager attention (matmul, causal mask, softmax, matmul) fused, and the lm-head loss
    fused = [(r.pass_name, r.op.split(" ")[0]) for rep in fxfuse.reports() for r in rep.fused]
    assert sorted(fused) == [("linear_cross_entropy", "cross_entropy")] + [("softcap_attention", "attention")] * 2, \
        [str(rep) for rep in fxfuse.reports()]
    assert not [r for rep in fxfuse.reports() for r in rep.rolled_back]
    if checkpointing:
        # each layer is a checkpoint body of its own, and the attention was fused inside it: the body holds the
        # fused op and no softmax is left there
        assert len(bodies) == 2, bodies
        for targets in bodies:
            assert [t for t in targets if t.startswith("fxfuse.")] == ["fxfuse.softcap_attention.default"], targets
            assert not [t for t in targets if "softmax" in t], targets
    else:
        assert bodies == []


@pytest.mark.slow
def test_tiny_llama_through_inductor():
    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (2, 9))
    ref_loss = _llama_step(model, ids)
    ref = grads_of(model)
    model.zero_grad()
    loss = _llama_step(model, ids, torch.compile(model, backend="fxfuse"))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(model, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_dynamic_sequence_lengths_do_not_recompile():
    model = tiny_causal_lm("llama")
    calls = []

    def counting_backend(gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        from fxfuse.backend import fxfuse as be
        return be(gm, example_inputs, options=AOT)

    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend=counting_backend, dynamic=True)
    per_length = []
    for L in (7, 11, 16):
        ids = torch.randint(0, 128, (2, L))
        ref_loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss = _llama_step(model, ids, compiled)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        per_length.append(len(calls))
    # The first length compiles the one graph (no graph breaks) and the backend is called twice for it: Dynamo
    # restarts its analysis once after the first backend call (``_tensorify_python_scalars`` turns a float scalar
    # of the graph into a tensor input) and hands the re-traced graph over again. The other lengths add nothing.
    assert per_length == [2, 2, 2], (per_length, calls)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    ids = torch.randint(0, 128, (2, 23))
    _llama_step(model, ids, compiled)
    assert len(calls) == 2, f"recompiled for a new sequence length: {calls}"
    assert len({r.graph_name.split(" #")[0] for r in fxfuse.reports()}) == 1


def test_mode_and_inductor_options_forwarded(inductor_config_patches):
    seen = inductor_config_patches
    m = nn.Linear(4, 4)
    # torch.compile takes mode or options, not both
    torch.compile(m, backend="fxfuse", mode="max-autotune-no-cudagraphs")(torch.randn(2, 4))
    assert seen.get("max_autotune") is True
    torch._dynamo.reset(); seen.clear()
    torch.compile(m, backend="fxfuse", options={"epilogue_fusion": False})(torch.randn(2, 4))
    assert seen.get("epilogue_fusion") is False and "max_autotune" not in seen


def test_unknown_option_is_a_clear_error():
    m = nn.Linear(4, 4)
    with pytest.raises(Exception) as ei:
        torch.compile(m, backend="fxfuse", options={"not_an_option": 1})(torch.randn(2, 4))
    assert "not_an_option" in str(ei.value) and "extra_passes" in str(ei.value)
    with pytest.raises(Exception) as ei:
        torch.compile(m, backend="fxfuse", options={"passes": {"no_such_pass": False}})(torch.randn(2, 4))
    assert "no_such_pass" in str(ei.value)


def test_debug_dir_dumps_graphs(tmp_path):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    torch.compile(m, backend="fxfuse", options={"debug_dir": str(tmp_path), **AOT})(torch.randn(2, 4))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.endswith("0_dynamo.py") for n in names), names
    assert any(n.endswith("1_after_fxfuse.py") for n in names), names
    assert any(n.endswith("report.txt") for n in names), names
