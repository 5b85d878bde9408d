"""The log-probs pass: log_softmax(lm-head logits) -> gather (+ entropy) forms, refusals with reasons, and a
GRPO-style loss over a whole tiny model (values and every gradient equal to eager)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxfuse

from conftest import fused_sites, skipped_sites, tiny_causal_lm

# Every rewrite in these model tests is also checked numerically against the unfused graph (conftest).
pytestmark = pytest.mark.usefixtures("verify_rewrites")

AOT = {"compiler": "aot_eager"}


def _sites(rep=None):
    return fused_sites("linear_log_probs", rep)


def _skips(rep=None):
    return skipped_sites("linear_log_probs", rep)


def _compare(fn, *tensors, n_sites=1):
    """Eager vs fxfuse on fresh leaf copies of the float tensors: every output and every gradient."""
    def leaves():
        return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]

    a, b = leaves(), leaves()
    ref = fn(*a)
    got = torch.compile(fn, backend="fxfuse", options=AOT)(*b)
    ref, got = (ref if isinstance(ref, tuple) else (ref,)), (got if isinstance(got, tuple) else (got,))
    torch.manual_seed(0)
    ws = [torch.randn(r.shape) for r in ref]
    sum((r.float() * w).sum() for r, w in zip(ref, ws)).backward()
    sum((g.float() * w).sum() for g, w in zip(got, ws)).backward()
    for r, g in zip(ref, got):
        assert g.shape == r.shape and g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    for x, y in zip(a, b):
        if x.grad is not None:
            torch.testing.assert_close(y.grad, x.grad, rtol=1e-4, atol=1e-5)
    assert len(_sites()) == n_sites, str(fxfuse.report())


def _inputs(B=2, S=9, D=16, V=37):
    torch.manual_seed(B * S + V)
    return torch.randn(B, S, D), torch.randn(V, D) / D ** 0.5, torch.randint(0, V, (B, S))


FORMS = {
    "gather_squeeze_T": lambda h, W, y: F.log_softmax(F.linear(h, W) / 0.7, dim=-1).gather(
        -1, y.unsqueeze(-1)).squeeze(-1),
    "method_no_squeeze": lambda h, W, y: (h @ W.t()).float().log_softmax(-1).gather(2, y[..., None]),
    "label_shift": lambda h, W, y: torch.log_softmax(F.linear(h, W)[:, :-1, :], -1).gather(
        -1, y[:, 1:].unsqueeze(-1)).squeeze(-1),
    "softcap_T": lambda h, W, y: F.log_softmax(torch.tanh(F.linear(h, W) / 30.0) * 30.0 / 1.3, -1).gather(
        -1, y.unsqueeze(-1)).squeeze(-1),
    "selected_minus_lse": lambda h, W, y: (lambda z: z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(
        z, dim=-1))(F.linear(h, W).float() / 0.7),
    "selected_minus_lse_keepdim": lambda h, W, y: (lambda z: z.gather(-1, y[:, 1:, None]) - z.logsumexp(
        -1, keepdim=True))(F.linear(h, W)[:, :-1]),
    "entropy_exp": lambda h, W, y: (lambda lp: (lp.gather(-1, y.unsqueeze(-1)).squeeze(-1),
                                                -(lp.exp() * lp).sum(-1)))(F.log_softmax(F.linear(h, W), -1)),
    "entropy_softmax": lambda h, W, y: (lambda z: (lambda lp: (lp.gather(-1, y.unsqueeze(-1)).squeeze(-1),
                                                               -(F.softmax(z, -1) * lp).sum(-1)))(
        F.log_softmax(z, -1)))(F.linear(h, W) / 2.0),
    # the entropy from the logits, sharing the log-probs' logsumexp: lse - (softmax(z) * z).sum(-1)
    "entropy_lse": lambda h, W, y: (lambda z: (lambda lse: (z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse,
                                                            lse - (torch.softmax(z, -1) * z).sum(-1)))(
        torch.logsumexp(z, -1)))(F.linear(h, W).float() / 0.7),
    "entropy_lse_unsqueeze": lambda h, W, y: (lambda z: (lambda lse: (z.gather(-1, y[:, 1:, None]) - lse.unsqueeze(
        -1), lse - (z * z.softmax(-1)).sum(-1)))(z.logsumexp(-1)))(F.linear(h, W)[:, :-1]),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_forms_match_eager(form):
    h, W, y = _inputs()
    _compare(FORMS[form], h, W, y)
    if "entropy" in form:
        assert "entropy" in _sites()[0].op


def test_report_names_temperature_and_softcap():
    h, W, y = _inputs()
    _compare(FORMS["softcap_T"], h, W, y)
    d = _sites()[0].detail
    assert d["softcap"] == pytest.approx(30.0) and d["temperature"] == pytest.approx(1.3)


REFUSALS = {
    "full_distribution_used": (lambda h, W, y: (lambda lp: (lp.gather(-1, y.unsqueeze(-1)), lp.max(-1).values))(
        F.log_softmax(F.linear(h, W), -1)), "other users"),
    "topk_gather": (lambda h, W, y: F.log_softmax(F.linear(h, W), -1).gather(-1, torch.stack([y, y], -1)),
                    "more than one index"),
    "tensor_temperature": (lambda h, W, y: F.log_softmax(F.linear(h, W) / h.new_tensor(0.5), -1).gather(
        -1, y.unsqueeze(-1)), "no lm-head projection"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_have_reasons_and_stay_correct(case):
    fn, reason = REFUSALS[case]
    h, W, y = _inputs()
    ref = fn(h, W, y)
    got = torch.compile(fn, backend="fxfuse", options=AOT)(h, W, y)
    for r, g in zip(ref if isinstance(ref, tuple) else (ref,), got if isinstance(got, tuple) else (got,)):
        torch.testing.assert_close(g, r)
    assert not _sites()
    assert any(reason in s.reason for s in _skips()), str(fxfuse.report())


@pytest.mark.slow
def test_grpo_style_loss_on_a_whole_model():
    """A user's GRPO-style step compiled as one region: model logits -> shift -> / T -> log-probs and entropy ->
    advantage-weighted loss. Fused; loss, log-probs, entropy and every parameter gradient equal eager."""
    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (2, 12))
    adv = torch.tensor([0.5, -1.0])

    def grpo(ids):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1, :] / 0.7
        lp = F.log_softmax(logits.float(), dim=-1)
        logp = lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        ent = -(lp.exp() * lp).sum(-1)
        ratio = torch.exp(logp - logp.detach())
        return -(ratio * adv[:, None]).mean() - 0.01 * ent.mean(), logp, ent

    def run(fn):
        model.zero_grad(set_to_none=True)
        loss, logp, ent = fn(ids)
        loss.backward()
        return [loss, logp, ent], {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, gref = run(grpo)
    got, ggot = run(torch.compile(grpo, backend="fxfuse", options=AOT))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    for n in gref:
        torch.testing.assert_close(ggot[n], gref[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    assert len(_sites()) == 1 and "entropy" in _sites()[0].op


# ------------------------------------------------------------------------------- per-row loops (TRL's helper)
def _compile_keep_graph(fn):
    graphs = []

    def keep(gm, ex):
        from fxfuse.backend import fxfuse as be
        graphs.append(gm)  # the backend rewrites gm in place: after the call it is the lowered graph
        return be(gm, ex, options=AOT)

    return torch.compile(fn, backend=keep), graphs


def _count(graphs, kind):
    from fxfuse.graph_utils import op_kind
    return sum(op_kind(n) == kind for gm in graphs for n in gm.graph.nodes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_trl_selective_log_softmax_row_loop_is_folded_and_fused(dtype):
    """TRL's selective_log_softmax loops over the batch (Dynamo unrolls it): bf16 logits -> per-row
    log_softmax + gather; fp32 -> gather minus a stack of per-row logsumexps. One fused op replaces the loop;
    log-probs and gradients match a float64 reference as closely as eager does."""
    utils = pytest.importorskip("trl.trainer.utils")
    torch.manual_seed(3)
    B, S, D, V = 3, 7, 16, 41
    h = torch.randn(B, S, D)
    W = torch.randn(V, D) / D ** 0.5
    y = torch.randint(0, V, (B, S - 1))
    g = torch.randn(B, S - 1)

    def policy_logps(h, W):  # GRPO-style: shift, cast, temperature, TRL's helper
        logits = F.linear(h, W)[:, :-1].to(dtype)
        return utils.selective_log_softmax(logits, y, temperature=0.7)

    def run(fn, dt):
        hh, WW = (t.detach().clone().to(dt).requires_grad_() for t in (h, W))
        out = fn(hh, WW)
        (out.double() * g.double()).sum().backward()
        return out.double(), hh.grad.double(), WW.grad.double()

    ref = run(lambda a, b: torch.log_softmax(F.linear(a, b)[:, :-1] / 0.7, -1).gather(
        -1, y.unsqueeze(-1)).squeeze(-1), torch.float64)
    eager = run(policy_logps, dtype)
    cf, graphs = _compile_keep_graph(policy_logps)
    got = run(cf, dtype)
    sites = _sites()
    assert len(sites) == 1, str(fxfuse.report())
    assert _count(graphs, "log_softmax") == 0 and _count(graphs, "logsumexp") == 0 and _count(graphs, "stack") == 0
    for r, e, o in zip(ref, eager, got):
        err_eager = ((e - r).norm() / r.norm()).item()
        err_fused = ((o - r).norm() / r.norm()).item()
        assert err_fused <= max(2 * err_eager, 1e-6), (err_fused, err_eager)


def test_row_loop_that_is_not_fused_is_left_as_a_loop():
    """Logits that are a graph input (no lm-head projection): the batched form is tried, refused with a
    reason, and the loop is restored, so no [B, S, V] log-softmax appears where the loop had [S, V] ones."""
    utils = pytest.importorskip("trl.trainer.utils")
    torch.manual_seed(4)
    logits = torch.randn(3, 5, 11, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 11, (3, 5))
    cf, graphs = _compile_keep_graph(lambda z: utils.selective_log_softmax(z, y))
    out = cf(logits)
    assert not _sites()
    assert any("no lm-head projection" in s.reason for s in _skips()), str(fxfuse.report())
    assert _count(graphs, "log_softmax") == 3 and _count(graphs, "stack") == 1
    torch.testing.assert_close(out, utils.selective_log_softmax(logits, y))
