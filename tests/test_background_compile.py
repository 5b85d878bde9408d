"""options={"background_compile": True} (fxfuse.background_inductor): a graph runs through AOTAutograd alone while a
compile process fills Inductor's caches with it; at the first safe call after, it is compiled here from those caches
and the calls switch, never inside a backward or between an activation checkpoint's forward and its recompute.
Values and gradients match the module run eagerly on both sides of the switch. Inductor's caches are on here (a
temporary directory), unlike the rest of the suite: they are how the child hands its work over."""
import os
import time

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fxfuse
from fxfuse import background_inductor
from fxfuse.errors import FxFuseOptionsError


class _Mlp(nn.Module):
    """Elementwise work around two matmuls: Inductor has kernels to generate (compiler="auto" keeps it)."""

    def __init__(self, d=16):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.up(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        return x + self.down(torch.nn.functional.silu(h) * 0.5)


@pytest.fixture(autouse=True)
def _caches_on_and_no_jobs_left(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # the FX graph and AOTAutograd caches on: in the child (it reads the environment at import) and here, where
    # conftest's TORCHINDUCTOR_*_CACHE=0 were read at import and outrank a setting
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    monkeypatch.setattr(torch._inductor.config._config["fx_graph_cache"], "env_value_force", True)
    monkeypatch.setattr(torch._functorch.config._config["enable_autograd_cache"], "env_value_force", True)
    # the compile process at the tests' own priority: at nice 10 it got a small share of CI's 2 cores beside the other
    # xdist worker, and the tests waited for it (one took 134 s, 24 s at nice 0; its priority is tested below)
    monkeypatch.setenv("FXFUSE_BACKGROUND_NICE", "0")
    background_inductor._stop_child()  # a process another test started has that test's environment
    background_inductor._jobs.clear()
    yield
    assert fxfuse.wait_for_background_compiles(timeout=600)  # nothing left compiling into the next test
    background_inductor._stop_child()
    background_inductor._jobs.clear()


def _pair(seed=0):
    torch.manual_seed(seed)
    ref = _Mlp()
    mod = _Mlp()
    mod.load_state_dict(ref.state_dict())
    return ref, mod


def _step(fn, module, x):
    """One forward + backward; the output and the parameters' gradients (cleared after)."""
    out = fn(x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return out.detach(), grads


def _assert_close(a, b):
    out_a, grads_a = a
    out_b, grads_b = b
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-6)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)


def test_runs_eagerly_until_cached_then_switches_with_the_same_values(tmp_path, monkeypatch):
    ref, mod = _pair()
    fxfuse.start_background_compile_process()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "moved"))  # after the process started: it follows
    compiled = fxfuse.compile(mod, background_compile=True)
    x = torch.randn(3, 8, 16)

    _assert_close(_step(compiled, mod, x), _step(ref, ref, x))  # AOTAutograd's version, the child compiling
    (job,) = fxfuse.background_compiles()
    assert (job.eager_calls, job.compiled_calls) == (1, 0)
    assert fxfuse.wait_for_background_compiles(timeout=600)
    assert job.state == "cached", job.error
    assert job.child_seconds > 0

    _assert_close(_step(compiled, mod, x), _step(ref, ref, x))  # compiled here from the child's cache entries
    assert job.state == "switched" and (job.eager_calls, job.compiled_calls) == (1, 1)
    assert job.cache_hits["fxgraph_cache_hit"] == 2 and job.cache_hits["fxgraph_cache_miss"] == 0, job.cache_hits
    # AOTAutograd's own entry too: the switch neither traces nor partitions the graph again
    assert job.cache_hits["autograd_cache_hit"] == 1, job.cache_hits
    assert (tmp_path / "moved" / "fxgraph").is_dir()
    (rep,) = fxfuse.reports()
    assert rep.lowering.startswith("inductor from a background compile")
    assert "lowered by inductor from a background compile" in str(rep)


def test_several_ranks_switch_once_every_ranks_child_is_done(monkeypatch):
    # Two ranks stood in by a store: this rank's child is done, the other rank's is not, so no switch yet; once the
    # other rank counts itself in, the graph switches at the next call. A rank that never comes delays, never blocks.
    store = torch.distributed.HashStore()
    monkeypatch.setattr(background_inductor, "_ranks_to_agree", lambda: (store, 2))
    ref, mod = _pair()
    compiled = fxfuse.compile(mod, background_compile=True)
    x = torch.randn(3, 16)
    _step(compiled, mod, x)
    (job,) = fxfuse.background_compiles()
    key = f"fxfuse/background_compile/{job.name}/0"
    deadline = time.monotonic() + 600
    while job.state == "compiling" and time.monotonic() < deadline:  # this rank's child finishes...
        time.sleep(0.05)
    assert not fxfuse.wait_for_background_compiles(timeout=0.5)  # ...the other rank's has not come
    assert job.state == "cached" and store.add(key, 0) == 1
    _assert_close(_step(compiled, mod, x), _step(ref, ref, x))
    assert (job.eager_calls, job.compiled_calls) == (2, 0)
    store.add(key, 1)  # the other rank's child is done: the last to come says so
    store.set(key + "/all", "1")
    assert fxfuse.wait_for_background_compiles(timeout=60)
    _assert_close(_step(compiled, mod, x), _step(ref, ref, x))
    assert job.state == "switched" and (job.eager_calls, job.compiled_calls) == (2, 1) and job.note == ""

    monkeypatch.setattr(background_inductor, "RANKS_AGREE_TIMEOUT_S", 0.5)
    torch._dynamo.reset()  # a second graph of the same code
    compiled = fxfuse.compile(_Mlp(), background_compile=True)
    _step(compiled, compiled, x)
    assert fxfuse.wait_for_background_compiles(timeout=60)  # the other rank never comes: switched all the same
    _step(compiled, compiled, x)
    late = fxfuse.background_compiles()[1]
    assert late.state == "switched" and "without the other ranks" in late.note, late.note


def test_the_process_started_early_serves_the_first_graph():
    # Started at the top of a script (before the model exists): that process, and no second one, takes the graph
    fxfuse.start_background_compile_process()
    fxfuse.start_background_compile_process()
    pid = background_inductor._child.proc.pid
    ref, mod = _pair()
    compiled = fxfuse.compile(mod, background_compile=True)
    x = torch.randn(3, 16)
    _step(compiled, mod, x)
    assert fxfuse.wait_for_background_compiles(timeout=600)
    (job,) = fxfuse.background_compiles()
    assert background_inductor._child.proc.pid == pid and job.state == "cached", job.error
    assert 0 < job.child_startup["fxfuse"] <= job.child_startup["inductor"]
    _assert_close(_step(compiled, mod, x), _step(ref, ref, x))
    assert job.state == "switched"


def test_the_compile_process_runs_below_the_callers_priority(monkeypatch):
    """Background work: by default the process lowers its own scheduling priority first thing (its Inductor
    workers inherit it). Checked apart from any compile: at nice 10 on CI's two loaded cores a compile took minutes."""
    monkeypatch.delenv("FXFUSE_BACKGROUND_NICE")  # the default, read by the process at its start
    fxfuse.start_background_compile_process()
    pid = background_inductor._child.proc.pid
    want = min(19, os.getpriority(os.PRIO_PROCESS, 0) + background_inductor.CHILD_NICENESS)
    assert want > os.getpriority(os.PRIO_PROCESS, 0)
    deadline = time.monotonic() + 120  # it lowers it once its interpreter has imported the module
    while os.getpriority(os.PRIO_PROCESS, pid) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.getpriority(os.PRIO_PROCESS, pid) == want


def _two_ranks_worker(rank, world, port, result_path):
    """One of two gloo ranks compiling the same module with the option; rank 1 stands for a rank whose compile
    process is slower: its child's answer arrives 3 s late. Each rank records the step at which its child was done
    and the step at which it switched."""
    import json
    import threading
    from concurrent.futures import Future

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 1:
        submit = background_inductor._submit

        def slow_submit(job_id, payload):
            late = Future()
            submit(job_id, payload).add_done_callback(
                lambda f: threading.Timer(3.0, late.set_result, (f.result(),)).start())
            return late
        background_inductor._submit = slow_submit
    try:
        torch.manual_seed(0)
        mod = _Mlp()
        compiled = fxfuse.compile(mod, background_compile=True)
        x = torch.randn(3, 16)
        seen = dict(cached=None, switched=None)
        for step in range(3000):  # each step ends in a barrier: the ranks stay in step, as collectives keep them
            compiled(x).square().mean().backward()
            dist.barrier()
            (job,) = fxfuse.background_compiles()
            for key, now in (("cached", job.state != "compiling"), ("switched", job.state == "switched")):
                if seen[key] is None and now:
                    seen[key] = step
            both = torch.tensor([seen["switched"] is not None], dtype=torch.int32)
            dist.all_reduce(both, op=dist.ReduceOp.MIN)
            if both.item():
                break
            time.sleep(0.01)
        everyone = [None] * world
        dist.all_gather_object(everyone, seen)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(everyone, f)
        dist.barrier()
    finally:
        background_inductor._stop_child()
        dist.destroy_process_group()


def test_two_ranks_switch_at_the_same_step_once_both_children_are_done(tmp_path):
    # Real ranks and store (gloo, two processes). Without the agreement rank 0 would switch as soon as its own
    # child is done, ~3 s of steps before the slow rank's.
    import json

    from test_distributed import RANK_TIMEOUT_S, _free_port, _spawn

    result = tmp_path / "ranks.json"
    _spawn(_two_ranks_worker, (2, _free_port(), str(result)), nprocs=2, timeout=RANK_TIMEOUT_S)
    fast, slow = json.loads(result.read_text())
    assert fast["cached"] < slow["cached"], (fast, slow)  # rank 0's child was done before rank 1's
    assert fast["switched"] >= slow["cached"], (fast, slow)  # and rank 0 waited for it
    assert abs(fast["switched"] - slow["switched"]) <= 1, (fast, slow)


def test_switches_are_not_counted_as_graphs_served_from_the_cache_without_a_report():
    # A switch hits AOTAutograd's cache by design, for a graph whose passes ran (and reported) here; under install()
    # fxfuse counts the process's other cache hits as graphs with no report, and warns about them: not these.
    import warnings

    ref, mod = _pair()
    compiled = fxfuse.compile(mod, background_compile=True)
    x = torch.randn(3, 16)
    _step(compiled, mod, x)
    assert fxfuse.wait_for_background_compiles(timeout=600)
    _step(compiled, mod, x)
    (job,) = fxfuse.background_compiles()
    assert job.cache_hits["autograd_cache_hit"] == 1
    try:
        fxfuse.install()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the "came from AOTAutograd's on-disk cache" warning would raise
            assert fxfuse.report().cached_graphs == 0
    finally:
        fxfuse.uninstall()


def test_a_dead_child_means_a_cold_compile_at_the_switch():
    ref, mod = _pair()
    compiled = fxfuse.compile(mod, background_compile=True)
    x = torch.randn(3, 16)
    _step(compiled, mod, x)
    background_inductor._child.proc.kill()
    assert fxfuse.wait_for_background_compiles(timeout=60)
    (job,) = fxfuse.background_compiles()
    assert job.state == "failed" and "exited" in job.error
    _assert_close(_step(compiled, mod, x), _step(ref, ref, x))
    assert job.state == "switched" and job.cache_hits["fxgraph_cache_miss"] == 2


def test_as_users_call_it_a_new_length_every_batch():
    # torch.compile with the option and no dynamic=: the first length's graph goes to the compile process; Dynamo's
    # second, dynamic graph compiles at once (its shape guards must exist before the frame's are fixed), and serves
    # every later length: two graphs, as under Inductor.
    ref, mod = _pair()
    compiled = torch.compile(mod, backend="fxfuse", options={"background_compile": True})
    for n in (5, 7, 9, 11):
        x = torch.randn(n, 16)
        _assert_close(_step(compiled, mod, x), _step(ref, ref, x))
    lowerings = [r.lowering for r in fxfuse.reports()]
    assert len(lowerings) == 2, lowerings
    assert lowerings[0].startswith("inductor from a background compile")
    assert lowerings[1].startswith("inductor, at once: symbolic sizes")
    (job,) = fxfuse.background_compiles()
    assert job.eager_calls == 1  # the static graph served the first length only


def test_symbolic_sizes_compile_at_once():
    ref, mod = _pair()
    compiled = fxfuse.compile(mod, dynamic=True, background_compile=True)
    x = torch.randn(5, 16)
    _assert_close(_step(compiled, mod, x), _step(ref, ref, x))
    assert fxfuse.background_compiles() == []
    (rep,) = fxfuse.reports()
    assert rep.lowering.startswith("inductor, at once: symbolic sizes")


def test_a_users_post_grad_pass_compiles_at_once():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Nothing(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "nothing"

    ref, mod = _pair()
    compiled = fxfuse.compile(mod, background_compile=True, options={"post_grad_custom_post_pass": Nothing()})
    x = torch.randn(3, 16)
    _assert_close(_step(compiled, mod, x), _step(ref, ref, x))
    assert fxfuse.background_compiles() == []
    (rep,) = fxfuse.reports()
    assert "inductor, at once: cannot send it to the compile process" in rep.lowering
    assert "user's post-grad pass" in rep.lowering


def test_an_op_of_another_library_compiles_at_once():
    # The compile process imports torch and fxfuse only: a graph calling another library's op stays here.
    @torch.library.custom_op("fxfuse_bg_test::halve", mutates_args=())
    def halve(x: torch.Tensor) -> torch.Tensor:
        return x * 0.5

    @halve.register_fake
    def _(x):
        return torch.empty_like(x)

    x = torch.randn(3, 16)
    compiled = fxfuse.compile(lambda t: torch.ops.fxfuse_bg_test.halve(t).sin() + 1, background_compile=True)
    torch.testing.assert_close(compiled(x), (x * 0.5).sin() + 1)
    assert fxfuse.background_compiles() == []
    (rep,) = fxfuse.reports()
    assert "inductor, at once: the op fxfuse_bg_test::halve" in rep.lowering


def test_no_switch_between_a_checkpointed_forward_and_its_recompute():
    # The child is done between two checkpointed calls of one step (two layers sharing the graph): the second call
    # must not switch while the first waits for its recompute, and no recompute (inside the backward) may run
    # another version than its forward did, or the saved tensors would not line up.
    ref, mod = _pair()
    compiled = fxfuse.compile(mod, background_compile=True)
    _step(compiled, mod, torch.randn(4, 16, requires_grad=True))
    assert fxfuse.wait_for_background_compiles(timeout=600)
    (job,) = fxfuse.background_compiles()
    x = torch.randn(4, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)

    job.eager_calls = 0
    fut, job._future = job._future, None  # hold the switch back for the first checkpointed call...
    h = checkpoint(compiled, x, use_reentrant=False)
    job._future = fut  # ...then the compile is "ready" for the second one
    out = checkpoint(compiled, h, use_reentrant=False)
    out.square().mean().backward()
    assert (job.eager_calls, job.compiled_calls) == (4, 0)  # two forwards, two recomputes: AOTAutograd's
    out_ref = checkpoint(ref, checkpoint(ref, x_ref, use_reentrant=False), use_reentrant=False)
    out_ref.square().mean().backward()
    torch.testing.assert_close(out.detach(), out_ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    mod.zero_grad(set_to_none=True)

    _step(lambda t: checkpoint(compiled, t, use_reentrant=False), mod, torch.randn(4, 16, requires_grad=True))
    assert job.compiled_calls == 2 and len(fxfuse.background_compiles()) == 1  # the next step: Inductor's


def test_compile_regions_sends_fused_layers_and_keeps_the_loss():
    # A tiny Llama by regions: the layer graph (fxfuse's ops in it reach the child, which imports fxfuse) goes to
    # the child; the loss graph has nothing for Inductor and runs through AOTAutograd as always.
    from conftest import tiny_causal_lm

    torch.manual_seed(0)
    ref = tiny_causal_lm("llama")
    model = tiny_causal_lm("llama")
    model.load_state_dict(ref.state_dict())
    fxfuse.compile_regions(model, background_compile=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    labels = ids.clone()

    def step(m):
        loss = m(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return loss.detach(), grads

    def close(a, b):
        torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-5)
        for ga, gb in zip(a[1], b[1]):
            torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-5)

    close(step(model), step(ref))
    assert fxfuse.wait_for_background_compiles(timeout=600)
    jobs = fxfuse.background_compiles()
    assert jobs and all(j.state == "cached" for j in jobs), [j.error for j in jobs]
    close(step(model), step(ref))
    assert all(j.state == "switched" and j.cache_hits["fxgraph_cache_hit"] == 2 for j in jobs)
    assert all(j.cache_hits["autograd_cache_hit"] == 1 for j in jobs), [j.cache_hits for j in jobs]
    lowerings = sorted(r.lowering.split(" (")[0].split(":")[0] for r in fxfuse.reports())
    assert "aot_eager" in lowerings and "inductor from a background compile" in lowerings


def test_caches_off_compile_at_once(monkeypatch):
    monkeypatch.setattr(torch._inductor.config._config["fx_graph_cache"], "env_value_force", False)
    ref, mod = _pair()
    compiled = fxfuse.compile(mod, background_compile=True)
    x = torch.randn(3, 16)
    _assert_close(_step(compiled, mod, x), _step(ref, ref, x))
    assert fxfuse.background_compiles() == []
    (rep,) = fxfuse.reports()
    assert "inductor, at once: Inductor's FX graph cache is off" in rep.lowering


def test_the_option_is_a_bool_and_not_installs():
    with pytest.raises(FxFuseOptionsError, match="background_compile"):
        fxfuse.compile(_Mlp(), background_compile="yes")
    with pytest.raises(FxFuseOptionsError, match="background_compile.*does not apply"):
        fxfuse.install(background_compile=True)  # Inductor compiles there: nothing to run in its place
    assert not fxfuse.inductor_hook.installed()
