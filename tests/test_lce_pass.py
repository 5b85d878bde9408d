"""The linear + cross-entropy pass: what it matches, what it refuses (with reasons), and whole HF models."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxfuse
from fxfuse.errors import FxFuseError
from fxfuse.lazy import LazyLogits

from conftest import assert_grads_close, grads_of, tiny_causal_lm

# Every rewrite in these model tests is also checked numerically against the unfused graph (conftest).
pytestmark = pytest.mark.usefixtures("verify_rewrites")

AOT = {"compiler": "aot_eager"}


def _run(fn, *tensors, options=None, dynamic=False):
    """Eager vs fxfuse on fresh leaf copies: returns (ref_out, out, ref_grads, grads)."""
    def leaves():
        return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]

    a = leaves()
    ref = fn(*a)
    ref.float().sum().backward()
    b = leaves()
    out = torch.compile(fn, backend="fxfuse", options={**AOT, **(options or {})}, dynamic=dynamic)(*b)
    out.float().sum().backward()
    return ref, out, [t.grad for t in a if t.is_floating_point()], [t.grad for t in b if t.is_floating_point()]


def _inputs(N=13, D=16, V=37, dtype=torch.float32, ignore_every=4):
    torch.manual_seed(N * 7 + V)
    h = torch.randn(N, D, dtype=dtype)
    W = torch.randn(V, D, dtype=dtype) / D ** 0.5
    y = torch.randint(0, V, (N,))
    y[::ignore_every] = -100
    return h, W, y


class _LCEView:
    """The report restricted to this pass (whole models also get other fusions, e.g. attention)."""

    def __init__(self, rep):
        self.rep = rep
        self.fused = [r for r in rep.fused if r.pass_name == "linear_cross_entropy"]


def _assert_fused(n=1):
    rep = fxfuse.reports()[-1]  # the graph compiled last (fxfuse.report() adds up the whole run)
    view = _LCEView(rep)
    assert len(view.fused) == n, str(rep)
    assert not rep.rolled_back, str(rep)
    return view


FORMS = {
    "linear_mean": lambda h, W, y: F.cross_entropy(F.linear(h, W), y),
    "matmul_t_float": lambda h, W, y: F.cross_entropy((h @ W.t()).float(), y, ignore_index=-100),
    "matmul_T_sum": lambda h, W, y: F.cross_entropy(torch.matmul(h, W.T), y, reduction="sum"),
    "softcap": lambda h, W, y: F.cross_entropy(torch.tanh(F.linear(h, W) / 30.0) * 30.0, y),
    "scale_div": lambda h, W, y: F.cross_entropy(F.linear(h, W).float() / 4.0, y, reduction="sum"),
    "scale_mul_softcap": lambda h, W, y: F.cross_entropy(5.0 * torch.tanh(0.5 * F.linear(h, W) / 5.0), y),
    "label_smoothing": lambda h, W, y: F.cross_entropy(F.linear(h, W), y, label_smoothing=0.1),
    "none": lambda h, W, y: F.cross_entropy(F.linear(h, W), y, reduction="none") * torch.arange(
        y.numel(), dtype=h.dtype),
    "nll_log_softmax": lambda h, W, y: F.nll_loss(F.log_softmax(F.linear(h, W).float(), dim=-1), y),
    "num_items_in_batch": lambda h, W, y: F.cross_entropy(F.linear(h, W), y, reduction="sum") / 7,
    "ignore_index_0": lambda h, W, y: F.cross_entropy(F.linear(h, W), y.clamp_min(0), ignore_index=0),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_forms_fuse_and_match_eager(form):
    h, W, y = _inputs()
    ref, out, gref, g = _run(FORMS[form], h, W, y)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, gref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    rec = _assert_fused().fused[0]
    assert rec.detail["grad_in_forward"] == (form != "none")
    if "softcap" in form:
        assert rec.detail["softcap"] == pytest.approx(30.0 if form == "softcap" else 5.0)


def test_weight_as_d_by_v_and_bias():
    h, W, y = _inputs()
    b = torch.randn(W.shape[0])
    ref, out, gref, g = _run(lambda h, Wt, y: F.cross_entropy(h @ Wt, y), h, W.t().contiguous(), y)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, c in zip(g, gref):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
    _assert_fused()
    torch._dynamo.reset()
    ref, out, gref, g = _run(lambda h, W, b, y: F.cross_entropy(F.linear(h, W, b), y), h, W, b, y)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, c in zip(g, gref):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
    _assert_fused()


def test_label_shift_slice_is_moved_onto_hidden():
    def shifted(h, W, y):  # the pre-5.x HF shift: logits[..., :-1, :] against labels[..., 1:]
        logits = F.linear(h, W).float()
        return F.cross_entropy(logits[..., :-1, :].contiguous().view(-1, W.shape[0]),
                               y[..., 1:].contiguous().view(-1))

    torch.manual_seed(0)
    h, W = torch.randn(2, 9, 16), torch.randn(29, 16)
    y = torch.randint(0, 29, (2, 9))
    ref, out, gref, g = _run(shifted, h, W, y)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, gref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    _assert_fused()


def test_bf16_logits_without_upcast_keep_loss_dtype():
    h, W, y = _inputs(dtype=torch.bfloat16)
    ref, out, gref, g = _run(lambda h, W, y: F.cross_entropy(F.linear(h, W), y), h, W, y)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(g, gref):
        assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2
    _assert_fused()


@pytest.mark.parametrize("case,reason", [
    ("class_weights", "class weights"),
    ("no_projection", "no lm-head projection"),
    ("probability_targets", "probability targets"),
    ("nonconstant_scale", "not a compile-time constant"),
    ("logits_input", "the logits are an input of this graph"),  # the lm-head in another graph (FSDP2 tail unit)
])
def test_refused_sites_are_reported_with_reason(case, reason):
    h, W, y = _inputs()
    fns = {
        "class_weights": lambda h, W, y: F.cross_entropy(F.linear(h, W), y, weight=torch.ones(W.shape[0])),
        "no_projection": lambda h, W, y: F.cross_entropy(h @ W.t() + 0.0 * h.sum(), y),
        "probability_targets": lambda h, W, y: F.cross_entropy(F.linear(h, W),
                                                              F.one_hot(y.clamp_min(0), W.shape[0]).float()),
        "nonconstant_scale": lambda h, W, y: F.cross_entropy(F.linear(h, W) * h.mean(), y),
        "logits_input": lambda h, W, y: F.cross_entropy(h, y.remainder(h.shape[1])),  # h as the logits
    }
    ref, out, _, _ = _run(fns[case], h, W, y)
    torch.testing.assert_close(out, ref)
    rep = fxfuse.report()
    assert not rep.fused, str(rep)
    assert any(reason in r.reason for r in rep.skipped), str(rep)


def test_pass_can_be_disabled():
    h, W, y = _inputs()
    _run(FORMS["linear_mean"], h, W, y, options={"passes": {"linear_cross_entropy": False}})
    assert not fxfuse.report().fused and not fxfuse.report().skipped


def test_dynamic_token_count_no_recompile():
    calls = []

    def counting(gm, ex):
        calls.append(1)
        from fxfuse.backend import fxfuse as be
        return be(gm, ex, options=AOT)

    fn = torch.compile(FORMS["softcap"], backend=counting, dynamic=True)
    for N in (5, 11, 29):
        h, W, y = _inputs(N=N)
        h.requires_grad_()
        out = fn(h, W, y)
        torch.testing.assert_close(out, FORMS["softcap"](h, W, y), rtol=1e-5, atol=1e-5)
        out.backward()
    assert len(calls) == 1 and fxfuse.report().fused


# ------------------------------------------------------------------------------------------- whole HF models
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gemma2"])
def test_hf_models_loss_grads_and_lazy_logits(arch):
    model = tiny_causal_lm(arch)
    model.train()
    ids = torch.randint(0, 128, (2, 12))
    labels = ids.clone()
    labels[1, :4] = -100  # padding
    ref = model(input_ids=ids, labels=labels, use_cache=False)
    ref.loss.backward()
    gref = grads_of(model)
    model.zero_grad()
    out = torch.compile(model, backend="fxfuse", options=AOT)(input_ids=ids, labels=labels, use_cache=False)
    rep = _assert_fused()
    assert rep.fused[0].detail["lazy_logits_outputs"], str(rep)
    assert isinstance(out.logits, LazyLogits) and not out.logits.materialized
    assert out.logits.shape == ref.logits.shape and out.logits.dtype == ref.logits.dtype
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(model, gref)
    assert not out.logits.materialized  # backward did not need them
    torch.testing.assert_close(out.logits.detach(), ref.logits.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_reading_lazy_logits_backpropagates_into_the_graph():
    model = tiny_causal_lm("gemma2")
    ids = torch.randint(0, 128, (2, 10))

    def step(m):
        o = m(input_ids=ids, labels=ids, use_cache=False)
        aux = o.logits.float().logsumexp(-1).pow(2).mean()  # a z-loss on the logits
        (o.loss + 1e-2 * aux).backward()
        return o.loss.detach(), aux.detach()

    ref = step(model)
    gref = grads_of(model)
    model.zero_grad()
    got = step(torch.compile(model, backend="fxfuse", options=AOT))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert_grads_close(model, gref)


@pytest.mark.slow
def test_a_backward_hook_on_lazy_logits_computes_nothing_until_they_are_read():
    """FSDP2's root registers a pre-backward hook on every output that requires grad (``t.register_hook``): on
    lazy logits that computed the [tokens, vocab] logits every step (an eager lm-head matmul, 12 ms at the 8B head
    on the H200). The hook now waits for the logits: not computed by registering, never called when only the loss
    is backpropagated, called with the logits' gradient once they are read and backpropagated; removable."""
    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (2, 10))
    fn = torch.compile(model, backend="fxfuse", options=AOT)
    seen = []

    out = fn(input_ids=ids, labels=ids)
    handle = out.logits.register_hook(lambda g: seen.append(g.shape))
    assert isinstance(out.logits, LazyLogits) and not out.logits.materialized
    out.loss.backward()
    assert not out.logits.materialized and seen == []
    handle.remove()

    model.zero_grad()
    out = fn(input_ids=ids, labels=ids)
    out.logits.register_hook(lambda g: seen.append(tuple(g.shape)))
    removed = out.logits.register_hook(lambda g: seen.append("removed hook ran"))
    removed.remove()
    (out.loss + out.logits.float().logsumexp(-1).mean()).backward()
    assert seen == [(2, 10, model.config.vocab_size)]


@pytest.mark.slow
def test_a_clone_of_lazy_logits_stays_lazy_like_ddps_output_sink_makes_it():
    """DDP with ``find_unused_parameters=True`` (HF Trainer's default) passes every output through an autograd
    function that clones it: that computed the [tokens, vocab] logits every step. A clone of lazy logits is lazy
    logits of the same forward: nothing computed until read; read, the values and the gradient through them are
    eager's; read after an optimizer step, it raises like the original."""
    import fxfuse.lazy as lazy

    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (2, 10))

    class Sink(torch.autograd.Function):  # what torch.nn.parallel.distributed._DDPSink does with the outputs
        @staticmethod
        def forward(ctx, *xs):
            return tuple(x.clone() for x in xs)

        @staticmethod
        def backward(ctx, *gs):
            return gs

    def step(m, read):
        o = m(input_ids=ids, labels=ids, use_cache=False)
        loss, logits = Sink.apply(o.loss, o.logits)
        total = loss + (1e-2 * logits.float().logsumexp(-1).pow(2).mean() if read else 0)
        total.backward()
        return o, logits, total.detach()

    fn = torch.compile(model, backend="fxfuse", options=AOT)
    step(fn, read=False)  # compiles (the tests' verify_rewrites runs the graphs once)
    model.zero_grad()
    before = sum(lazy.materialized_at.values())
    out, cloned, _ = step(fn, read=False)
    assert isinstance(cloned, LazyLogits) and not cloned.materialized and not out.logits.materialized
    assert cloned.shape == out.logits.shape and cloned.dtype == out.logits.dtype
    assert sum(lazy.materialized_at.values()) == before  # nothing computed anywhere
    model.zero_grad()

    ref = step(model, read=True)[2]
    gref = grads_of(model)
    model.zero_grad()
    got = step(fn, read=True)[2]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert_grads_close(model, gref)
    assert any("test_lce_pass.py" in site for site in lazy.materialized_at)  # the read is where it was computed

    # the logits changed in place after the copies were made: the copies keep the values of a real clone / cast
    ref_logits = model(input_ids=ids, use_cache=False).logits.detach()
    out = fn(input_ids=ids, labels=ids, use_cache=False)
    clone, wide = out.logits.clone(), out.logits.to(torch.float64)
    with torch.no_grad():
        out.logits.add_(1.0)
    torch.testing.assert_close(clone.detach(), ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wide.detach(), ref_logits.double(), rtol=1e-5, atol=1e-5)
    model.zero_grad()

    out, cloned, _ = step(fn, read=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # an optimizer step
    with pytest.raises(FxFuseError, match="changed in place"):
        cloned.argmax(-1)


@pytest.mark.slow
def test_a_cast_of_lazy_logits_stays_lazy_like_fsdp2s_output_dtype_makes_it():
    """FSDP2 casts the root's outputs to its policy's ``output_dtype`` (accelerate sets it): ``.to(dtype)`` of lazy
    logits computed them every step. A floating cast (same device; also ``.float()`` and friends, which accelerate's
    ``convert_outputs_to_fp32`` calls) is now lazy logits in that dtype, read as ``.to(dtype)`` of the real logits,
    through them; a cast to their own dtype is themselves; an integer cast still reads them."""
    import fxfuse.lazy as lazy

    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (2, 10))
    fn = torch.compile(model, backend="fxfuse", options=AOT)
    fn(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # compiles
    model.zero_grad()
    ref = model(input_ids=ids, labels=ids, use_cache=False)

    before = sum(lazy.materialized_at.values())
    out = fn(input_ids=ids, labels=ids, use_cache=False)
    wide = out.logits.to(torch.float64)
    assert out.logits.to(out.logits.dtype) is out.logits
    also = out.logits.to("cpu", dtype=torch.float64, non_blocking=True)
    copied = out.logits.to(out.logits.dtype, copy=True)
    assert out.logits.float() is out.logits  # already float32 here
    for t, dtype in ((wide, torch.float64), (also, torch.float64), (copied, out.logits.dtype),
                     (out.logits.bfloat16(), torch.bfloat16), (wide.float(), torch.float32)):
        assert isinstance(t, LazyLogits) and not t.materialized and t.dtype == dtype and t.shape == ref.logits.shape
    assert sum(lazy.materialized_at.values()) == before
    (out.loss + 1e-2 * wide.logsumexp(-1).pow(2).mean()).backward()  # read: computed, and backpropagated
    got = grads_of(model)
    model.zero_grad()
    (ref.loss + 1e-2 * ref.logits.to(torch.float64).logsumexp(-1).pow(2).mean()).backward()
    assert_grads_close(model, got)  # the model holds eager's gradients now
    torch.testing.assert_close(wide.detach(), ref.logits.detach().to(torch.float64), rtol=1e-5, atol=1e-5)
    assert sum(lazy.materialized_at.values()) == before + 1  # one projection, for the read cast
    assert out.logits.materialized  # read through its source: gradients and the source's hooks go through it
    seen = []  # FSDP2's root hooks the outputs first, then casts them: the hook must see the gradient of a read cast
    out = fn(input_ids=ids, labels=ids, use_cache=False)
    out.logits.register_hook(lambda g: seen.append(tuple(g.shape)))
    (out.loss + out.logits.to(torch.float64).logsumexp(-1).mean()).backward()
    assert seen == [tuple(ref.logits.shape)]

    out = fn(input_ids=ids, labels=ids, use_cache=False)
    as_int = out.logits.to(torch.int64)  # not a floating cast: the logits themselves are read
    assert not isinstance(as_int, LazyLogits) and as_int.dtype == torch.int64 and out.logits.materialized


@pytest.mark.slow
def test_accelerates_fp32_output_conversion_keeps_lazy_logits_lazy():
    """accelerate wraps a mixed-precision model's forward in ``convert_outputs_to_fp32``: ``.float()`` on every bf16
    output. Under bf16 autocast the lazy logits are bf16, and that call must not compute them."""
    from accelerate.utils import convert_to_fp32

    import fxfuse.lazy as lazy

    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (2, 10))
    fn = torch.compile(model, backend="fxfuse", options=AOT)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fn(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # compiles
        model.zero_grad()
        before = sum(lazy.materialized_at.values())
        out = fn(input_ids=ids, labels=ids, use_cache=False)
    assert isinstance(out.logits, LazyLogits) and out.logits.dtype == torch.bfloat16
    conv = convert_to_fp32(out)
    assert isinstance(conv.logits, LazyLogits) and conv.logits.dtype == torch.float32 and not conv.logits.materialized
    conv.loss.backward()
    assert sum(lazy.materialized_at.values()) == before and not out.logits.materialized
    torch.testing.assert_close(conv.logits.detach(), out.logits.detach().float())  # read: bf16 values, widened


def test_lazy_logits_whose_weight_was_freed_raise_instead_of_reading_freed_memory():
    """FSDP2 frees a unit's gathered weight (its storage resized to 0) when it reshards: logits read later cannot be
    computed, and say so rather than reading freed memory. Before that they compute as usual."""
    from fxfuse.errors import FxFuseError

    h, w = torch.randn(3, 8), torch.randn(16, 8)
    lazy = LazyLogits(h, w, None, [], False, torch.float32)
    torch.testing.assert_close(LazyLogits(h, w, None, [], False, torch.float32).materialize(), h @ w.T)
    w.untyped_storage().resize_(0)
    with pytest.raises(FxFuseError, match="lm-head weight was freed"):
        lazy.materialize()


@pytest.mark.slow
def test_materialize_option_returns_real_logits():
    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (2, 10))
    out = torch.compile(model, backend="fxfuse", options={
        **AOT, "pass_options": {"linear_cross_entropy": {"logits": "materialize"}}})(input_ids=ids, labels=ids)
    assert type(out.logits) is torch.Tensor
    rep = _assert_fused()
    assert rep.fused[0].detail["logits_still_materialised_for"]


def test_second_backward_through_grad_in_forward_is_loud_not_wrong():
    h, W, y = _inputs()
    h.requires_grad_()
    loss = torch.compile(FORMS["linear_mean"], backend="fxfuse", options=AOT)(h, W, y)
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    assert torch.isfinite(first).all()
    h.grad = None
    loss.backward()  # a second backward through gradients computed in the forward
    # Either functionalization kept the saved gradients intact (same, correct result) or the device-side
    # consumed-flag poisoned them (NaN): never a silently different value.
    assert torch.allclose(h.grad, first) or torch.isnan(h.grad).all()


def test_chunk_bytes_option_reaches_the_op(monkeypatch):
    """``pass_options={"linear_cross_entropy": {"chunk_bytes": n}}`` sets the fused op's logits-chunk budget."""
    from fxfuse.kernels import linear_cross_entropy as K

    seen = []
    real = K.lce_forward
    monkeypatch.setattr(K, "lce_forward", lambda *a: seen.append(a[-1]) or real(*a))
    h, W, y = _inputs()
    budget = W.shape[0] * 4 * 3  # three fp32 rows per chunk: 13 tokens -> 5 chunks, the last one ragged
    ref, out, gref, g = _run(FORMS["linear_mean"], h, W, y,
                             options={"pass_options": {"linear_cross_entropy": {"chunk_bytes": budget}}})
    _assert_fused()
    assert seen and set(seen) == {budget}  # (verify=True runs the op once more at compile time)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, gref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bad_chunk_bytes_option_is_an_error_before_any_pass_runs():
    """A bad value is refused when the options are parsed (the pass declares chunk_bytes), not rolled back."""
    h, W, y = _inputs()
    fn = torch.compile(FORMS["linear_mean"], backend="fxfuse",
                       options={**AOT, "pass_options": {"linear_cross_entropy": {"chunk_bytes": "big"}}})
    with pytest.raises(fxfuse.FxFuseOptionsError, match=r"\['chunk_bytes'\] must be an int >= 0"):
        fn(h, W, y)
