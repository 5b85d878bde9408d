"""Nothing silently wrong: stale lazy logits, user passes whatever they return, stale compiled code in Inductor's
caches, reports of graphs that share a compile id, errors a user can catch and act on, and ``verify``."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from fxfuse.errors import FxFuseError, FxFusePassError, FxFuseValidationError

from conftest import tiny_causal_lm

AOT = {"compiler": "aot_eager"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------- 1. lazy logits
@pytest.mark.slow
def test_lazy_logits_read_after_the_weights_changed_raise_and_say_how_to_get_them():
    model = tiny_causal_lm("llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cm = torch.compile(model, backend="fxfuse", options=AOT)
    ids = torch.randint(0, 128, (2, 12))
    out = cm(input_ids=ids, labels=ids, use_cache=False)
    want = model(input_ids=ids, use_cache=False).logits.detach()
    out.loss.backward()
    opt.step()
    with pytest.raises(FxFuseError, match=r"lm-head weight changed in place.*before the optimizer step.*materialize"):
        out.logits.argmax(-1)
    # read before the step: the forward's values
    out = cm(input_ids=ids, labels=ids, use_cache=False)
    want = model(input_ids=ids, use_cache=False).logits.detach()
    got = out.logits.detach().clone()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # any in-place change of the weight, not only an optimizer's
        out2 = cm(input_ids=ids, labels=ids, use_cache=False)
        model.lm_head.weight.zero_()
    with pytest.raises(FxFuseError, match="changed in place"):
        out2.logits.sum()


# -------------------------------------------------------------------------------------------- 2. user passes
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x, y):
        return F.cross_entropy(self.down(F.silu(self.up(x))), y)


def _loss_to_float64(gm):
    for n in gm.graph.nodes:
        if n.op == "output":
            (val,) = n.args[0]
            with gm.graph.inserting_before(n):
                d = gm.graph.call_method("double", (val,))
            n.args = ((d,),)
    return 0  # and claims it did nothing


def _delete_silu(gm):
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is F.silu:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    return 0


def _returns_a_string(gm):
    return "done"


@pytest.mark.parametrize("user_pass,strict_error,where", [
    (_loss_to_float64, FxFuseValidationError, "dtype changed"),
    (_returns_a_string, FxFusePassError, "returned 'done'"),
])
def test_user_pass_is_validated_whatever_it_returns(user_pass, strict_error, where):
    torch.manual_seed(0)
    net, x, y = Net(), torch.randn(5, 8), torch.randint(0, 8, (5,))
    ref = net(x, y)
    got = torch.compile(net, backend="fxfuse", options={**AOT, "extra_passes": [user_pass]})(x, y)
    torch.testing.assert_close(got, ref)
    (rec,) = fxfuse.report().rolled_back
    assert rec.pass_name == user_pass.__name__ and where in rec.reason, rec
    torch._dynamo.reset()
    with pytest.raises(strict_error, match=where):
        torch.compile(net, backend="fxfuse", options={**AOT, "extra_passes": [user_pass], "strict": True})(x, y)


def test_a_pass_that_changes_values_is_caught_by_verify_and_reported_without_it():
    torch.manual_seed(0)
    net, x, y = Net(), torch.randn(5, 8, requires_grad=True), torch.randint(0, 8, (5,))
    ref = net(x, y)
    # without verify the shapes agree: kept, but the report says the graph was changed though it returned 0
    torch.compile(net, backend="fxfuse", options={**AOT, "extra_passes": [_delete_silu]})(x, y)
    (rec,) = [r for r in fxfuse.report().records if r.pass_name == "_delete_silu"]
    assert rec.status == "fused" and "returned 0" in rec.op
    torch._dynamo.reset()
    got = torch.compile(net, backend="fxfuse", options={**AOT, "verify": True, "extra_passes": [_delete_silu]})(x, y)
    torch.testing.assert_close(got, ref)
    (rec,) = fxfuse.report().rolled_back
    assert rec.pass_name == "_delete_silu" and rec.reason.startswith("verify: ") and "differs" in rec.reason, rec
    assert "test_robustness.py" in rec.location, rec.location  # the user's line around the changed node


@pytest.mark.slow
@pytest.mark.parametrize("arch,attn,layout", [("llama", "sdpa", "padded"), ("gemma2", "eager", "padded"),
                                               ("qwen2", "sdpa", "plain")])
def test_verify_passes_every_builtin_fusion_on_tiny_models(arch, attn, layout):
    import peft

    model = tiny_causal_lm(arch, attn_implementation=attn)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=["q_proj", "k_proj", "v_proj", "up_proj"]))
    ids = torch.randint(0, 128, (2, 14))
    kw = {}
    if layout == "padded":
        kw["attention_mask"] = torch.ones(2, 14, dtype=torch.long)
        kw["attention_mask"][1, :4] = 0  # left padding: fully masked rows too
    torch.compile(model, backend="fxfuse", options={**AOT, "verify": True})(input_ids=ids, labels=ids,
                                                                               use_cache=False, **kw)
    rep = fxfuse.report()
    assert not rep.rolled_back, str(rep)
    assert rep.verified and all(v < 1.0 for v in rep.verified.values()), rep.verified
    assert {"linear_cross_entropy", "lora_linear"} <= set(rep.verified) | {r.pass_name for r in rep.fused}


# ----------------------------------------------------------------------------------------- 3. stale caches
_CACHE_SCRIPT = textwrap.dedent(r"""
    import torch, torch.nn.functional as F
    import fxfuse
    torch.manual_seed(0)
    h = torch.randn(16, 8); w = torch.randn(32, 8, requires_grad=True); y = torch.randint(0, 32, (16,))
    f = torch.compile(lambda h, w, y: F.cross_entropy(h @ w.t(), y), backend="fxfuse")
    loss = f(h, w, y)
    assert [r.pass_name for r in fxfuse.report().fused] == ["linear_cross_entropy"], fxfuse.report()
    print("LOSS", float(loss), "REF", float(F.cross_entropy(h @ w.t(), y)))
""")


@pytest.mark.slow
def test_an_edited_fxfuse_never_runs_code_cached_from_the_old_one(tmp_path):
    """Two processes share Inductor's on-disk caches; between them fxfuse's composite op is edited (its loss now
    doubled). The second process must compile and run the edited op, not the graph cached from the first."""
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "fxfuse"), src / "fxfuse", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(ROOT, "passes"), src / "passes", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(src), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
               TORCHINDUCTOR_FORCE_DISABLE_CACHES="0", TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    env.pop("TRITON_INTERPRET", None)

    def run():
        p = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], env=env, capture_output=True, text=True, cwd=str(src),
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("LOSS")][-1].split()
        return float(line[1]), float(line[3])

    loss1, ref = run()
    assert loss1 == pytest.approx(ref, rel=1e-5)
    op = src / "fxfuse" / "ops" / "linear_cross_entropy.py"
    text = op.read_text()
    needle = "gif, gh, gw, gb, int(chunk_bytes))[0]"
    assert needle in text
    op.write_text(text.replace(needle, "gif, gh, gw, gb, int(chunk_bytes))[0] * 2"))  # the "upgrade"
    loss2, ref2 = run()
    assert ref2 == ref and loss2 == pytest.approx(2 * ref, rel=1e-5), (loss2, ref)


_INSTALL_SCRIPT = textwrap.dedent(r"""
    import warnings, torch, torch.nn.functional as F
    import fxfuse
    fxfuse.install()
    torch.manual_seed(0)
    h = torch.randn(16, 8); w = torch.randn(32, 8, requires_grad=True); y = torch.randint(0, 32, (16,))
    with torch.profiler.profile() as prof:
        torch.compile(lambda h, w, y: F.cross_entropy(h @ w.t(), y))(h, w, y).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = [r.pass_name for rep in fxfuse.reports() for r in rep.fused]
    ops = sorted({e.name for e in prof.events() if e.name.startswith("fxfuse::")})
    print("RUN", fxfuse.report().summary())
    print("RESULT", fused, ops, [str(c.message)[:90] for c in caught if "AOTAutograd" in str(c.message)])
""")


@pytest.mark.slow
def test_a_graph_served_from_aotautograd_cache_under_install_says_its_report_is_missing(tmp_path):
    """Under install(), torch looks a graph up in AOTAutograd's cache before Inductor's pre-grad passes: the second
    process runs the cached fused code without running fxfuse's pass. reports() must say so, not look unfused, and
    the run report counts the graph as compiled with fxfuse's passes (from the cache)."""
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
               TORCHINDUCTOR_FORCE_DISABLE_CACHES="0", TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    env.pop("TRITON_INTERPRET", None)

    def run():
        p = subprocess.run([sys.executable, "-c", _INSTALL_SCRIPT], env=env, capture_output=True, text=True,
                           cwd=str(tmp_path), timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        lines = p.stdout.splitlines()
        return ([ln for ln in lines if ln.startswith("RESULT")][-1], [ln for ln in lines if ln.startswith("RUN")][-1])

    (first, run1), (second, run2) = run(), run()
    assert "['linear_cross_entropy']" in first and "AOTAutograd" not in first, first
    assert "1 fused" in run1 and "compile cache" not in run1, run1
    assert "fxfuse::linear_cross_entropy_fwd" in second, second  # the fused code ran from the cache
    if "[] " in second:  # no report in the second process: then it must have been said, and the run counts it
        assert "came from AOTAutograd" in second, second
        assert "1 graph from torch's compile cache: compiled with fxfuse's passes" in run2, run2
        assert "nothing compiled" not in run2, run2


# ---------------------------------------------------------------------------------------------- 4. reports
def test_reports_of_graphs_that_share_a_compile_id_are_all_kept():
    f = torch.compile(lambda x: torch.relu(x) * 2, backend="fxfuse", options=AOT)
    f(torch.randn(3))
    torch._dynamo.reset()  # compile ids start again at 0/0 for the next function
    g = torch.compile(lambda x: torch.tanh(x) + 1, backend="fxfuse", options=AOT)
    g(torch.randn(3))
    names = [r.graph_name for r in fxfuse.reports()]
    assert len(names) == 2 and len(set(names)) == 2, names


def test_report_is_the_run_every_graph_since_the_last_clear():
    """fxfuse.report() after several compiled graphs (two functions, a recompile) counts every graph's sites, by pass;
    the per-graph reports stay one call away; clear_reports() starts a new run."""
    W = torch.randn(16, 8, requires_grad=True)
    ce = torch.compile(lambda x, y: F.cross_entropy(x @ W.T, y), backend="fxfuse", options=AOT)
    relu = torch.compile(lambda x: torch.relu(x) * 2, backend="fxfuse", options=AOT)
    for n in (6, 9):  # the second length recompiles with a symbolic size: a second graph
        ce(torch.randn(n, 8), torch.randint(0, 16, (n,))).backward()
    relu(torch.randn(3))
    run = fxfuse.report()
    assert len(run.graphs) == 3 and run.graphs == fxfuse.reports(), str(run)
    assert run.by_pass() == {"linear_cross_entropy": {"fused": 2}}, str(run)
    assert [r.pass_name for r in run.fused] == ["linear_cross_entropy"] * 2
    text = str(run)
    assert text.startswith("fxfuse run: 3 graphs compiled: 2 fused") and "linear_cross_entropy: 2 fused" in text, text
    assert all(g.summary() in text for g in run.graphs), text
    fxfuse.clear_reports()
    assert not fxfuse.report().graphs and "nothing compiled" in str(fxfuse.report())


def test_backend_calls_under_one_compile_id_keep_a_report_each():
    """Dynamo's DDP graph splitting hands every bucket's submodule to the backend under the frame's compile id."""
    from torch._guards import CompileContext, CompileId, compile_context

    from fxfuse.backend import fxfuse as backend

    class Tuple(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return (self.m(x),)

    gms = [torch.fx.symbolic_trace(Tuple(m)) for m in (nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))]
    with compile_context(CompileContext(CompileId(frame_id=7, frame_compile_id=0))):
        for gm in gms:
            backend(gm, [torch.randn(3, 4)], options=AOT)
    names = [r.graph_name for r in fxfuse.reports()]
    assert names == ["graph 7/0", "graph 7/0 #2", "graph 7/0 #3"], names


# ----------------------------------------------------------------------------------------------- 5. errors
def test_a_bad_label_under_compile_names_the_users_lines_and_the_labels_entry():
    """The lm-head op sees flattened class indices inside Inductor's generated code; the error names the fused
    site's line, the caller's line and which entry of the labels the user passed it was."""
    W = torch.randn(16, 8, requires_grad=True)

    def loss_fn(h, y):
        return F.cross_entropy((h @ W.T).view(-1, 16), y.view(-1))  # the fused site

    f = torch.compile(loss_fn, backend="fxfuse", options=AOT)
    h, y = torch.randn(2, 5, 8), torch.randint(0, 16, (2, 5))
    f(h, y).backward()
    y[1, 3] = 1500
    with pytest.raises(fxfuse.FxFuseContractError) as ei:
        f(h, y)  # the caller's line
    msg = str(ei.value)
    assert "target[8] = 1500 is not a class index" in msg and "labels[1, 3] of the [2, 5] labels" in msg, msg
    here = os.path.basename(__file__)
    assert f'at the fused site: File "{__file__}"' in msg and "view(-1, 16)" in msg, msg
    assert f"called from: {__file__}" in msg and "f(h, y)  # the caller's line" in msg, msg
    assert here in msg


def test_a_bad_label_in_a_hf_model_is_told_as_the_unshifted_labels_entry():
    """HF causal LMs pad and shift the labels before flattening them: the error still names labels[row, pos] of the
    tensor the user passed, and the user's line (not transformers' or Inductor's)."""
    model = tiny_causal_lm()
    cm = torch.compile(model, backend="fxfuse")
    ids = torch.randint(0, 128, (2, 7))
    cm(input_ids=ids, labels=ids.clone()).loss.backward()
    labels = ids.clone()
    labels[1, 4] = 999
    with pytest.raises(fxfuse.FxFuseContractError) as ei:
        cm(input_ids=ids, labels=labels)  # the user's call
    msg = str(ei.value)
    assert "labels[1, 4] of the [2, 7] labels passed in = 999" in msg, msg
    assert f"called from: {__file__}" in msg and "# the user's call" in msg, msg


def test_strict_errors_reach_the_user_as_fxfuse_errors():
    def transpose_output(gm):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        (val,) = out.args[0]
        with gm.graph.inserting_before(out):
            t = gm.graph.call_method("t", (val,))
        out.args = ((t,),)
        return 1

    f = torch.compile(lambda x: x @ x.t()[:, :2], backend="fxfuse",
                      options={**AOT, "strict": True, "extra_passes": [transpose_output]})
    with pytest.raises(FxFuseValidationError, match="shape changed"):
        f(torch.randn(3, 4))


def test_a_pass_that_raises_is_reported_at_its_own_line():
    def half_done(gm):
        raise RuntimeError("half-way through")  # the line the report must name

    torch.compile(lambda x: x + 1, backend="fxfuse", options={**AOT, "extra_passes": [half_done]})(torch.randn(2))
    (rec,) = fxfuse.report().rolled_back
    assert "test_robustness.py" in rec.location and "half-way through" in rec.location, rec.location


@pytest.mark.slow
@pytest.mark.parametrize("bad", [128, -3])
def test_out_of_range_targets_name_the_op_the_value_and_the_position(bad):
    from fxfuse.errors import FxFuseContractError
    from fxfuse.ops import linear_cross_entropy, linear_log_probs

    h, w = torch.randn(6, 16), torch.randn(128, 16)
    y = torch.tensor([1, 2, -100, bad, 4, 5])
    with pytest.raises(FxFuseContractError, match=rf"linear_cross_entropy: target\[3\] = {bad} .*128-entry"):
        linear_cross_entropy(h, w, y)
    y[2] = 0
    with pytest.raises(FxFuseContractError, match=rf"linear_log_probs: index\[3\] = {bad}"):
        linear_log_probs(h, w, y)
    # through a compiled model: the same error, not an index error from deep inside
    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (2, 10))
    labels = ids.clone()
    labels[1, 4] = bad
    cm = torch.compile(model, backend="fxfuse", options=AOT)
    with pytest.raises(FxFuseContractError, match=rf"target\[\d+\] = {bad}"):
        cm(input_ids=ids, labels=labels, use_cache=False)
