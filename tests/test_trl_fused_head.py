"""TRL's fused lm-head (``trl.trainer.utils.add_fused_lm_head``: the backbone, then TRL's chunked
``ChunkedLogProbFunction``) under ``torch.compile(backend="fxfuse")``: fxfuse's shim makes it one graph node, no
graph break, and the node becomes ``fxfuse::linear_log_probs`` for every output set TRL's trainers ask for (GRPO's
log-probs + entropy, a reference model's log-probs, SFT's + is_top1, DPO's + mean logits + log sum p^2). Loss,
every gradient and the metrics equal eager's (fp32)."""
from __future__ import annotations

import pytest
import torch

import fxfuse
from conftest import tiny_causal_lm
from fxfuse.ops import trl_fused_head as shim

trl_utils = pytest.importorskip("trl.trainer.utils")


def _patched(arch, outputs, **kw):
    m = tiny_causal_lm(arch, **kw)
    trl_utils.add_fused_lm_head(m, outputs=outputs, **({"temperature": 0.7} if arch == "gemma2" else {}))
    return m


def _step(model, ids, labels, params=None):
    out = model(input_ids=ids, labels=labels, use_cache=False, fused_lm_head=True)
    mask = out.label_mask
    adv = torch.linspace(-1, 1, mask.numel()).view(mask.shape)  # per-token weights: a GRPO-like upstream gradient
    loss = -(out.log_probs * adv).sum() / mask.sum()
    if out.entropy is not None:
        loss = loss + 0.1 * out.entropy.sum() / mask.sum()
    # the metrics: SFT's token accuracy, DPO's mean logit and WPO weight (detached, as the trainers read them)
    metrics = {k: getattr(out, k).detach() for k in ("is_top1", "mean_logits", "log_sum_sq_probs")
               if getattr(out, k) is not None}
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in (params or model).named_parameters()}, metrics


@pytest.mark.parametrize("arch,outputs", [
    ("llama", ("log_probs", "entropy")),                   # GRPO's policy
    ("gemma2", ("log_probs",)),                            # a reference model; Gemma-2's final softcap, T = 0.7
    ("llama", ("log_probs", "entropy", "is_top1")),        # SFTTrainer's
    ("gemma2", ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")),  # DPOTrainer's (WPO on)
])
def test_trl_head_in_the_graph(arch, outputs):
    assert shim.trl_shim_installed()
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 13))
    labels = ids.clone()
    labels[0, :4] = -100
    loss_e, grads_e, metrics_e = _step(_patched(arch, outputs), ids, labels)
    torch._dynamo.utils.counters.clear()
    model = _patched(arch, outputs)
    loss_c, grads_c, metrics_c = _step(torch.compile(model, backend="fxfuse"), ids, labels, model)

    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch.allclose(loss_c, loss_e, rtol=1e-5, atol=1e-6), (loss_c, loss_e)
    for name, g in grads_e.items():
        assert torch.allclose(grads_c[name], g, rtol=1e-4, atol=1e-6), name
    assert metrics_c.keys() == metrics_e.keys() == set(outputs) & {"is_top1", "mean_logits", "log_sum_sq_probs"}
    for k, v in metrics_e.items():
        if k == "is_top1":
            assert torch.equal(metrics_c[k], v), k
        else:
            assert torch.allclose(metrics_c[k], v, rtol=1e-5, atol=1e-6), (k, metrics_c[k], v)
    rep = fxfuse.report()
    heads = [r for r in rep.fused + rep.skipped if r.pass_name == "trl_fused_head"]
    assert len(heads) == 1, str(rep)
    assert heads[0].status == "fused" and "linear_log_probs" in heads[0].op, str(rep)
    assert sorted(heads[0].detail["outputs"]) == sorted(outputs), heads[0].detail


def test_eager_calls_run_trls_function_unchanged():
    torch.manual_seed(0)
    h, w = torch.randn(9, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    t = torch.randint(0, 40, (9,))
    args = (h, w, None, t, 0.9, 32768, 20.0, 1.5, ("entropy", "is_top1"))
    via_shim = trl_utils._ChunkedLogProbFunction.apply(*args)
    direct = shim.ChunkedLogProbShim.original.apply(*args)
    for a, b in zip(via_shim, direct):
        assert (a is None and b is None) or torch.equal(a, b)


def test_op_matches_trls_function_forward_and_backward():
    """The node's own implementation (what runs where it is not rewritten) is TRL's, gradients included."""
    torch.manual_seed(1)
    h, w = torch.randn(7, 16, dtype=torch.float64), torch.randn(30, 16, dtype=torch.float64)
    t = torch.randint(0, 30, (7,))
    g_lp, g_ent = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)

    def run(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = fn(hh, ww)[:2]
        torch.autograd.backward((lp, ent), (g_lp.to(lp.dtype), g_ent.to(ent.dtype)))
        return lp, ent, hh.grad, ww.grad

    ref = run(lambda hh, ww: shim.ChunkedLogProbShim.original.apply(hh, ww, None, t, 1.3, 8, 5.0, 0.5, ("entropy",)))
    ours = run(lambda hh, ww: torch.ops.fxfuse.trl_chunked_logprob(hh, ww, None, t, 1.3, 8, 5.0, 0.5,
                                                                  [True, False, False, False], torch.float64))
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_install_is_idempotent_and_reversible():
    assert shim.install_trl_shim() == "already"
    shim.uninstall_trl_shim()
    try:
        assert trl_utils._ChunkedLogProbFunction is shim.ChunkedLogProbShim.original
        assert shim.install_trl_shim() == "installed"
    finally:
        shim.install_trl_shim()
    assert shim.trl_shim_installed()
