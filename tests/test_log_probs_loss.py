"""The log_probs_loss pass and fxfuse::linear_log_probs_loss: a per-token loss over fused log-probs, compiled in the
same graph, has its lm-head gradient formed in the forward (the logits projected once).

Checked against float64 (no further from it than eager fp32 / bf16 is, 2x at most), at a new length every call
without ``dynamic=``; the projections counted by the profiler; what is refused, with its reason, still exact."""
from __future__ import annotations

import json
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import fxfuse
from fxfuse.fx_program import ProgramError, dump_graph, load_program

from conftest import fused_sites, skipped_sites

pytestmark = pytest.mark.usefixtures("verify_rewrites")

AOT = {"compiler": "aot_eager"}
T, EPS = 0.7, 0.2


def dapo(h, W, y, mask, adv):
    """TRL's GRPO token loss, "dapo" form, on-policy: clipped ratio times the advantage over the completion mask,
    divided by the token count (computed after the per-token terms: the pass moves it before the op)."""
    logp = torch.log_softmax(F.linear(h, W).float() / T, dim=-1).gather(-1, y[..., None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    a = adv[:, None]
    per_tok = -torch.min(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)
    return (per_tok * mask).sum() / mask.sum().clamp(min=1.0)


def pg_entropy(h, W, y, mask, adv):
    """Policy gradient minus an entropy bonus, a Gemma-2-style softcap before the temperature: two means."""
    z = torch.tanh(F.linear(h, W) / 30.0) * 30.0 / T
    lp = F.log_softmax(z.float(), dim=-1)
    logp = lp.gather(-1, y[..., None]).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)
    return -(logp * adv[:, None] * mask).mean() - 0.01 * ent.mean()


def _data(B, L, D=16, V=53, dtype=torch.float32, seed=0, peaked=False):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, D, generator=g) / D ** 0.5
    y = torch.randint(0, V, (B, L), generator=g)
    h = torch.randn(B, L, D, generator=g)
    if peaked:  # the chosen token far above the rest: log-probs near 0, gradients ~1e-6
        h = h + 6.0 * W[y]
    mask = (torch.arange(L)[None] < torch.randint(1, L + 1, (B, 1), generator=g)).float()
    adv = torch.randn(B, generator=g)
    return h.to(dtype), W.to(dtype), y, mask, adv


def _grads(fn, h, W, y, mask, adv, scale=1.0, dtype=None, frozen=False):
    hh = h.detach().to(dtype or h.dtype).requires_grad_()
    ww = W.detach().to(dtype or W.dtype).requires_grad_(not frozen)
    m, a = (mask.to(dtype), adv.to(dtype)) if dtype is not None else (mask, adv)
    loss = fn(hh, ww, y, m, a)
    (loss * scale).backward()
    return loss.detach(), hh.grad, ww.grad


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _projections(fn, *args):
    """How many logits projections (an mm / addmm reading the head as a [D, V] matrix) a forward + backward
    runs."""
    V, D = args[1].shape
    with torch.profiler.profile(record_shapes=True) as prof:
        fn(*args).backward()
    return sum(1 for e in prof.events()
               if e.name in ("aten::mm", "aten::addmm") and [D, V] in [list(s) for s in e.input_shapes])


def _policy(loss_fn):
    """A tiny policy: embedding -> lm-head, the completion's next-token log-probs (hidden states and labels share
    the sequence's length, as in a model), then ``loss_fn``'s loss."""
    def step(E, W, ids, mask, adv):
        return loss_fn(F.embedding(ids, E)[:, :-1], W, ids[:, 1:], mask, adv)
    return step


@pytest.mark.parametrize("loss_fn", [dapo, pg_entropy], ids=["dapo", "pg_entropy"])
def test_new_length_every_call_matches_float64(loss_fn):
    """As users call it (default backend options, no dynamic=): three lengths, one recompile at most, the site
    fused each time, loss and both gradients as close to float64 as eager fp32 is."""
    step = _policy(loss_fn)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, backend="fxfuse")
    for L in (7, 10, 13):
        _, W, _, mask, adv = _data(2, L, seed=L)
        g = torch.Generator().manual_seed(L)
        E = torch.randn(W.shape, generator=g)
        ids = torch.randint(0, W.shape[0], (2, L + 1), generator=g)
        ref = _grads(step, E, W, ids, mask, adv, dtype=torch.float64)
        eager = _grads(step, E, W, ids, mask, adv)
        got = _grads(compiled, E, W, ids, mask, adv)
        for g, e, r in zip(got, eager, ref):
            assert _rel(g, r) <= 2 * _rel(e, r) + 1e-6, (L, _rel(g, r), _rel(e, r))
    reports = fxfuse.reports()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= len(reports) <= 2 and graphs <= 2
    for rep in reports:  # the static first compile and the symbolic-length one both rewrote the site
        assert fused_sites("log_probs_loss", rep), str(rep)
    # as many graphs as plain Inductor compiles for the same lengths
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plain = torch.compile(step)
    for L in (7, 10, 13):
        _, W, _, mask, adv = _data(2, L, seed=L)
        E = torch.randn(W.shape)
        plain(E, W, torch.randint(0, W.shape[0], (2, L + 1)), mask, adv)
    assert graphs == torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_head", "frozen_head"])
@pytest.mark.parametrize("peaked", [False, True], ids=["flat", "peaked"])
def test_gradients_against_float64(dtype, frozen, peaked):
    """Trainable and frozen heads, fp32 and bf16, flat and peaked rows, entropy in the loss, an upstream gradient
    of 3 (a scaled loss): within 2x of eager's distance from float64."""
    h, W, y, mask, adv = _data(3, 11, dtype=dtype, peaked=peaked)
    compiled = torch.compile(pg_entropy, backend="fxfuse", options=AOT)
    ref = _grads(pg_entropy, h, W, y, mask, adv, scale=3.0, dtype=torch.float64, frozen=frozen)
    eager = _grads(pg_entropy, h, W, y, mask, adv, scale=3.0, frozen=frozen)
    got = _grads(compiled, h, W, y, mask, adv, scale=3.0, frozen=frozen)
    assert fused_sites("log_probs_loss"), str(fxfuse.report())
    assert (got[2] is None) == frozen
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    for g, e, r in zip(got, eager, ref):
        if r is not None:
            assert _rel(g, r) <= 2 * _rel(e, r) + tol, (_rel(g, r), _rel(e, r))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machines run the Triton row kernels in the interpreter")
def test_triton_row_kernels_in_the_interpreter(monkeypatch):
    """The op's GPU path (the Triton forward and gradient row kernels, per-token gradients from the loss between
    them) under TRITON_INTERPRET: bf16 loss and gradients within 2x of eager bf16's distance from float64."""
    from fxfuse.kernels import linear_log_probs as K

    monkeypatch.setattr(K, "FORCE_TRITON", True)
    monkeypatch.setattr(K, "ROW_CONFIG", {"BLOCK_V": 16})  # rows over several slices
    calls = []
    real_bwd = K._rows_triton_bwd
    monkeypatch.setattr(K, "_rows_triton_bwd", lambda *a: calls.append(1) or real_bwd(*a))
    h, W, y, mask, adv = _data(2, 6, V=37, dtype=torch.bfloat16)
    ref = _grads(pg_entropy, h, W, y, mask, adv, dtype=torch.float64)
    eager = _grads(pg_entropy, h, W, y, mask, adv)
    got = _grads(torch.compile(pg_entropy, backend="fxfuse", options=AOT), h, W, y, mask, adv)
    assert fused_sites("log_probs_loss"), str(fxfuse.report())
    assert calls, "the Triton gradient row kernel did not run"
    for g, e, r in zip(got, eager, ref):
        assert _rel(g, r) <= 2 * _rel(e, r) + 1e-3, (_rel(g, r), _rel(e, r))


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_head", "frozen_head"])
def test_logits_projected_once(frozen):
    """The profiler's count of logits projections: one with the loss in the graph, two when the pass is off (the
    backward projects again)."""
    h, W, y, mask, adv = _data(2, 9)
    W.requires_grad_(not frozen)
    h.requires_grad_()
    # with the entropy in the loss: a frozen head with log-probs alone projects once either way (the op's
    # unit-gradient path)
    on = torch.compile(pg_entropy, backend="fxfuse", options=AOT)
    off = torch.compile(pg_entropy, backend="fxfuse", options={**AOT, "passes": {"log_probs_loss": False}})
    on(h, W, y, mask, adv)  # compile outside the profiled call
    off(h, W, y, mask, adv)
    assert _projections(on, h, W, y, mask, adv) == 1
    assert _projections(off, h, W, y, mask, adv) == 2


def test_frozen_head_log_probs_alone_keep_the_unit_gradient_path():
    """A frozen head with log-probs alone: the op's forward already forms the hidden states' gradient (one
    projection), so the site is left as it is, with that reason, and still projects once."""
    h, W, y, mask, adv = _data(2, 9)
    h.requires_grad_()
    compiled = torch.compile(dapo, backend="fxfuse", options=AOT)
    compiled(h, W, y, mask, adv)
    assert not fused_sites("log_probs_loss")
    assert any("not needed" in r.reason for r in skipped_sites("log_probs_loss")), str(fxfuse.report())
    assert _projections(compiled, h, W, y, mask, adv) == 1


def test_metrics_and_inputs_with_gradients():
    """Detached metrics beside the loss (clip fraction, the largest log-prob) do not stop the rewrite; an
    advantage that takes a gradient gets it through the graph's own ops, as in eager."""
    def fn(h, W, y, mask, adv):
        logp = torch.log_softmax(F.linear(h, W) / T, dim=-1).gather(-1, y[..., None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        per_tok = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 1 - EPS, 1 + EPS) * adv[:, None])
        loss = (per_tok * mask).sum() / mask.sum()
        clipped = (((ratio - 1).abs() > EPS).float() * mask).sum() / mask.sum()
        return loss, clipped, logp.detach().max()

    h, W, y, mask, adv = _data(2, 8)
    leaves = [lambda: h.clone().requires_grad_(), lambda: W.clone().requires_grad_(), lambda: y,
              lambda: mask, lambda: adv.clone().requires_grad_()]
    a, b = [f() for f in leaves], [f() for f in leaves]
    ref = fn(*a)
    got = torch.compile(fn, backend="fxfuse", options=AOT)(*b)
    assert fused_sites("log_probs_loss"), str(fxfuse.report())
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)
    ref[0].backward()
    got[0].backward()
    for x, z in ((a[0], b[0]), (a[1], b[1]), (a[4], b[4])):
        torch.testing.assert_close(z.grad, x.grad, rtol=1e-4, atol=1e-6)


def trl_grpo_kl(h, W, y, mask, adv, ref_logp):
    """TRL's "grpo" loss type with its KL term (beta 0.04): per-sequence means, then the batch mean."""
    logp = torch.log_softmax(F.linear(h, W) / T, dim=-1).gather(-1, y[..., None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    a = adv[:, None]
    per_tok = -torch.min(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    per_tok = per_tok + 0.04 * kl
    return ((per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def test_trl_grpo_loss_with_kl():
    """Per-sequence normalisation (a partial sum divided by each row's token count) and a KL term against a
    reference model's log-probs: linear after token-wise, so fused; gradients as eager's."""
    h, W, y, mask, adv = _data(3, 9)
    ref_logp = -torch.rand(3, 9) * 5
    a = [h.clone().requires_grad_(), W.clone().requires_grad_()]
    b = [h.clone().requires_grad_(), W.clone().requires_grad_()]
    ref = trl_grpo_kl(*a, y, mask, adv, ref_logp)
    got = torch.compile(trl_grpo_kl, backend="fxfuse", options=AOT)(*b, y, mask, adv, ref_logp)
    assert fused_sites("log_probs_loss"), str(fxfuse.report())
    torch.testing.assert_close(got, ref)
    ref.backward()
    got.backward()
    for x, z in zip(a, b):
        torch.testing.assert_close(z.grad, x.grad, rtol=1e-4, atol=1e-6)


def masked_token_ce(h, W, y, mask, adv):
    """A custom loop's token loss: per-token cross-entropy (reduction "none", ignore_index rows), a Gemma-2-style
    softcap after a logit scale, weighted by a mask and the advantages, averaged over the mask."""
    z = torch.tanh(F.linear(h, W).float() / T / 30.0) * 30.0
    ce = F.cross_entropy(z.view(-1, z.shape[-1]), y.reshape(-1), reduction="none", ignore_index=-100)
    w = (mask * adv[:, None].abs()).reshape(-1)
    return (ce * w).sum() / mask.sum()


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_head", "frozen_head"])
def test_cross_entropy_per_token_loss(frozen):
    """Cross-entropy with reduction "none" and a loss over it in the graph: the same rewrite (the per-token loss is
    -logp, 0 on ignored rows), the logits projected once where the op's backward projected them again; loss and
    gradients within 2x of eager's distance from float64."""
    h, W, y, mask, adv = _data(3, 10)
    y[0, 3] = y[2, 7] = -100  # ignored rows
    ref = _grads(masked_token_ce, h, W, y, mask, adv, dtype=torch.float64, frozen=frozen)
    eager = _grads(masked_token_ce, h, W, y, mask, adv, frozen=frozen)
    compiled = torch.compile(masked_token_ce, backend="fxfuse", options=AOT)
    got = _grads(compiled, h, W, y, mask, adv, frozen=frozen)
    assert fused_sites("linear_cross_entropy") and fused_sites("log_probs_loss"), str(fxfuse.report())
    for g, e, r in zip(got, eager, ref):
        if r is not None:
            assert _rel(g, r) <= 2 * _rel(e, r) + 1e-6, (_rel(g, r), _rel(e, r))
    hh, ww = h.clone().requires_grad_(), W.clone().requires_grad_(not frozen)
    off = torch.compile(masked_token_ce, backend="fxfuse", options={**AOT, "passes": {"log_probs_loss": False}})
    off(hh, ww, y, mask, adv)
    assert _projections(compiled, hh, ww, y, mask, adv) == 1
    assert _projections(off, hh, ww, y, mask, adv) == 2


def _logp(h, W, y):
    return torch.log_softmax(F.linear(h, W) / T, dim=-1).gather(-1, y[..., None]).squeeze(-1)


REFUSED = {
    # a sequence-level loss: logsigmoid of summed log-ratios (DPO), nonlinear after the sum
    "sequence_level": (lambda h, W, y, mask, adv: -F.logsigmoid(0.1 * (_logp(h, W, y) * mask).sum(-1)).mean(),
                       "neither token-wise"),
    # the loss per token: its upstream gradient is the caller's
    "per_token_output": (lambda h, W, y, mask, adv: -_logp(h, W, y) * adv[:, None], "not one loss value"),
    # a mask from a quantile over all tokens' log-probs: every token's gradient reads the others
    "quantile_mask": (lambda h, W, y, mask, adv: (lambda lp: -(lp * (lp.detach() >= torch.quantile(
        lp.detach(), 0.5)).float()).mean())(_logp(h, W, y)), "neither token-wise"),
    # the log-probs returned with their gradient beside the loss
    "logp_returned": (lambda h, W, y, mask, adv: (lambda lp: (-(lp * adv[:, None]).mean(), lp))(_logp(h, W, y)),
                      "more than one graph output"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_with_reason_and_still_exact(case):
    fn, why = REFUSED[case]
    h, W, y, mask, adv = _data(2, 8)
    a = [h.clone().requires_grad_(), W.clone().requires_grad_(), y, mask, adv]
    b = [h.clone().requires_grad_(), W.clone().requires_grad_(), y, mask, adv]
    ref, got = fn(*a), torch.compile(fn, backend="fxfuse", options=AOT)(*b)
    assert not fused_sites("log_probs_loss")
    assert fused_sites("linear_log_probs"), str(fxfuse.report())
    reasons = [r.reason for r in skipped_sites("log_probs_loss")]
    assert any(why in r for r in reasons), reasons
    ref, got = (ref if isinstance(ref, tuple) else (ref,)), (got if isinstance(got, tuple) else (got,))
    sum(r.sum() for r in ref).backward()
    sum(g.sum() for g in got).backward()
    torch.testing.assert_close(b[0].grad, a[0].grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(b[1].grad, a[1].grad, rtol=1e-4, atol=1e-6)


def test_program_text_round_trip_and_refusals():
    g = fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("n")
    y = g.call_function(torch.clamp, (g.call_method("detach", (x,)), 0.5, float("inf")))
    g.output(g.call_function(operator.truediv, (g.call_method("sum", (g.call_function(torch.mul, (x, y)),)), s)))
    text = dump_graph(g)
    assert json.loads(text)["modules"] == {"torch": "torch"}
    t = torch.tensor([0.25, 2.0])
    torch.testing.assert_close(load_program(text)(t, 2), (t * t.clamp(0.5)).sum() / 2)
    bad = fx.Graph()
    a = bad.placeholder("a")
    bad.output(bad.call_function(torch.min, (a, torch.mul)))  # a function object as an argument: no round trip
    with pytest.raises(ProgramError, match="does not load back"):
        dump_graph(bad)
    attr = fx.Graph()
    attr.output(attr.get_attr("weight"))
    with pytest.raises(ProgramError, match="get_attr"):
        dump_graph(attr)
