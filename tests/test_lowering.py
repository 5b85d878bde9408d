"""fxfuse.lowering: a graph left with nothing for Inductor to generate after fxfuse's passes (fxfuse ops, views,
O(tokens) label bookkeeping) is lowered without Inductor under compiler="auto"; any floating-point work, a mask being
built, a graph without fxfuse ops, or Inductor settings the user gave keep Inductor. The values are the same."""
import pytest
import torch
import torch.nn.functional as F

import fxfuse
import fxfuse.ops  # noqa: F401  (registers torch.ops.fxfuse.*)
from fxfuse.lowering import reason_to_skip_inductor

LCE = torch.ops.fxfuse.linear_cross_entropy.default


def _dynamo_graph(fn, *args):
    """The graph Dynamo hands a backend for ``fn(*args)`` (with its example values), as fxfuse's backend sees it."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def _inputs(S=24, V=64, H=16):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, S, H, generator=g)
    w = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (2, S), generator=g)
    return h, w, labels


def _loss_graph(h, w, labels):  # compile_regions' loss graph after the lm-head pass (HF's ForCausalLMLoss shifts)
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous().view(-1)
    return LCE(h[:, 0:, :], w, shift, None, -100, "mean", 0.0, 1.0, 0.0, True, 0)


def test_label_bookkeeping_around_a_fused_op_needs_no_inductor():
    why = reason_to_skip_inductor(_dynamo_graph(_loss_graph, *_inputs()))
    assert why is not None and "1 fxfuse op" in why


def test_floating_point_work_keeps_inductor():
    def scaled(h, w, labels):
        return _loss_graph(h * 2.0, w, labels)  # an elementwise op Inductor would generate code for
    assert reason_to_skip_inductor(_dynamo_graph(scaled, *_inputs())) is None


def test_a_mask_being_built_keeps_inductor():
    def with_mask(h, w, labels):
        S = labels.shape[1] * 4
        pos = torch.arange(S)
        mask = pos[:, None] >= pos[None, :]  # S x S bool: Inductor builds it in one kernel, eager in several
        return _loss_graph(h, w, labels), mask
    assert reason_to_skip_inductor(_dynamo_graph(with_mask, *_inputs())) is None


def test_a_graph_without_fxfuse_ops_keeps_inductor():
    def views_only(h, w, labels):
        return h[:, 1:], labels.view(-1)
    assert reason_to_skip_inductor(_dynamo_graph(views_only, *_inputs())) is None


def _lm_head_loss(h, w, labels):
    """What the lm-head pass fuses: linear -> cross-entropy on shifted labels (HF's ForCausalLMLoss)."""
    logits = F.linear(h, w)
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), shift.view(-1), ignore_index=-100)


@pytest.mark.parametrize("options,lowered_by", [({}, "aot_eager: "), ({"compiler": "inductor"}, "inductor"),
                                                ({"max_autotune": False}, "inductor")])
def test_backend_lowering_and_values(options, lowered_by):
    """Through the backend, as users call it: the fused loss graph skips Inductor by default (said in the report),
    and not where Inductor is asked for; values and gradients equal the eager graph's either way."""
    h, w, labels = _inputs()
    h64, w64 = (t.double().requires_grad_() for t in (h, w))
    ref = _lm_head_loss(h64, w64, labels)
    ref.backward()
    h, w = h.requires_grad_(), w.requires_grad_()
    fxfuse.clear_reports()
    torch._dynamo.reset()
    loss = torch.compile(_lm_head_loss, backend="fxfuse", options=options)(h, w, labels)
    loss.backward()
    (rep,) = fxfuse.reports()
    assert [r.pass_name for r in rep.fused] == ["linear_cross_entropy"]
    assert rep.lowering.startswith(lowered_by), rep.lowering
    assert ("lowered without Inductor" in str(rep)) == lowered_by.startswith("aot_eager")
    assert fxfuse.FusionReport.from_dict(rep.to_dict()).lowering == rep.lowering
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_lowered_without_inductor_the_loss_backward_scales_its_gradients_in_place(monkeypatch):
    """The lm-head loss's backward scales the gradients its forward computed with an in-place op, which AOTAutograd
    wraps in auto_functionalized_v2 (a clone of every buffer it writes: a second lm-head weight gradient). Lowered
    without Inductor, the backward writes the donated buffers in place (nothing cloned); gradients stay those of
    the eager graph over repeated steps, and a first backward with retain_graph=True (no donated buffers) still
    gives the right sums."""
    import fxfuse.backend as backend

    clone_sets = []
    real = backend._mutate_in_place

    def spy(graph, is_backward):
        real(graph, is_backward)
        af2 = torch.ops.higher_order.auto_functionalized_v2
        clone_sets.extend((is_backward, n.kwargs.get("_only_clone_these_bases", "all"))
                          for n in graph.nodes if n.target is af2)

    monkeypatch.setattr(backend, "_mutate_in_place", spy)
    h, w, labels = _inputs()
    h64, w64 = (t.double().requires_grad_() for t in (h, w))
    _lm_head_loss(h64, w64, labels).backward()
    h, w = h.requires_grad_(), w.requires_grad_()
    torch._dynamo.reset()
    step = torch.compile(_lm_head_loss, backend="fxfuse")
    for _ in range(2):
        h.grad = w.grad = None
        step(h, w, labels).backward()
        torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)
    assert clone_sets == [(True, ())], clone_sets  # the backward's scale op clones none of its buffers

    torch._dynamo.reset()
    h.grad = w.grad = None
    loss = torch.compile(_lm_head_loss, backend="fxfuse")(h, w, labels)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(w.grad.double(), 2 * w64.grad, rtol=1e-4, atol=1e-5)


def test_compile_regions_loss_graph_skips_inductor_and_its_blocks_do_not():
    """As users call it (no dynamic=, a new length every batch, labels a tensor of their own): compile_regions with
    default options lowers the fused loss graph without Inductor, static and symbolic-length alike, and the blocks
    (floating-point work) with it; the graphs are the same two per region as with Inductor everywhere (a static one,
    then one symbolic in the length); loss and gradients those of the eager model at every length."""
    from conftest import grads_of, tiny_causal_lm

    ref = tiny_causal_lm("llama", attn_implementation="sdpa")
    m = tiny_causal_lm("llama", attn_implementation="sdpa")
    fxfuse.clear_reports()
    fxfuse.compile_regions(m)
    for n in (19, 23, 27):
        m.zero_grad()
        ref.zero_grad()
        ids = torch.randint(0, 128, (2, n))
        out = m(input_ids=ids, labels=ids.clone(), use_cache=False)
        out.loss.backward()
        want = ref(input_ids=ids, labels=ids.clone(), use_cache=False)
        want.loss.backward()
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
        g0, g1 = grads_of(ref), grads_of(m)
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=2e-4, atol=2e-6)
    reps = fxfuse.reports()
    heads = [r.lowering for r in reps if "linear_cross_entropy" in [s.pass_name for s in r.fused]]
    blocks = [r.lowering for r in reps if "linear_cross_entropy" not in [s.pass_name for s in r.fused]]
    assert len(heads) == 2 and all(x.startswith("aot_eager: ") for x in heads), heads  # the loss graphs
    assert blocks == ["inductor", "inductor"], blocks                                 # the blocks


def test_a_lowering_check_that_fails_leaves_the_graph_to_inductor(monkeypatch):
    """Should the rule ever fail to read a graph, the graph goes to Inductor, with the reason in the report, and
    computes the same values: never a crash."""
    import fxfuse.backend as backend

    def unreadable(gm):
        raise RuntimeError("no example value")

    monkeypatch.setattr(backend, "reason_to_skip_inductor", unreadable)
    h, w, labels = _inputs()
    ref = _lm_head_loss(h.double(), w.double(), labels)
    fxfuse.clear_reports()
    torch._dynamo.reset()
    loss = torch.compile(_lm_head_loss, backend="fxfuse")(h, w, labels)
    (rep,) = fxfuse.reports()
    assert rep.lowering.startswith("inductor (the lowering check could not read this graph: RuntimeError"), \
        rep.lowering
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


def test_compile_prefetches_tritons_cache_key(monkeypatch):
    """fxfuse.compile() (and so compile_regions) starts hashing Triton's per-process cache key on a thread, before
    any graph is traced: the first compile then finds it cached."""
    pytest.importorskip("triton")
    from triton.runtime.cache import triton_key

    import fxfuse.lowering as lowering

    monkeypatch.setattr(lowering, "_prefetch_asked", False)
    monkeypatch.setattr(lowering, "_prefetch_thread", None)
    triton_key.cache_clear()
    fxfuse.compile(torch.nn.Linear(2, 2))  # compiles nothing yet
    thread = lowering._prefetch_thread
    thread.join(timeout=120)
    assert triton_key.cache_info().currsize == 1
    fxfuse.compile(torch.nn.Linear(2, 2))
    assert lowering._prefetch_thread is thread  # once per process
