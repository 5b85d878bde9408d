"""Which kernel runs an attention site (fxfuse.attention.dispatch): the rule, its reasons in the report, the SDPA
rewrite when it is chosen (numerics equal eager's), and the ``kernel`` overrides."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxfuse
from fxfuse.attention.dispatch import MEASURED, choose_kernel, sdpa_expressible
from fxfuse.ops import softcap_attention

from conftest import assert_grads_close, grads_of, tiny_causal_lm

CUDA = torch.device("cuda")
PLAIN = dict(softcap=0.0, causal=True, window=0, has_mask=False, has_docs=False, has_key_valid=False, sinks=False,
             head_dim_pads=(0, 0), same_length=True)


@pytest.mark.parametrize("change,reason", [
    (dict(softcap=50.0), "softcap"), (dict(window=8), "window"), (dict(has_docs=True), "documents"),
    (dict(has_key_valid=True), "key padding"), (dict(sinks=True), "sinks"), (dict(has_mask=True), "mask tensor"),
    (dict(same_length=False), "top-left"), (dict(head_dim_pads=(0, 8)), "head dims differ"),
])
def test_what_sdpa_cannot_express(change, reason):
    assert sdpa_expressible(**PLAIN) == (True, "")
    ok, why = sdpa_expressible(**{**PLAIN, **change})
    assert not ok and reason in why


def test_auto_takes_the_measured_faster_kernel_and_says_why(monkeypatch):
    from fxfuse.attention import dispatch

    bf16 = torch.bfloat16
    monkeypatch.setattr(dispatch, "_cudnn_sdpa_usable", lambda: False)  # the measured SDPA kernel is off
    assert choose_kernel("auto", CUDA, bf16, 128, True, "", capability=(9, 0)).kernel == "fxfuse"
    monkeypatch.setattr(dispatch, "_cudnn_sdpa_usable", lambda: True)
    for (cap, d), (sdpa_ms, ours_ms, where) in MEASURED.items():
        c = choose_kernel("auto", CUDA, bf16, d, True, "", capability=cap)
        assert c.kernel == ("sdpa" if sdpa_ms < ours_ms else "fxfuse"), c
        assert str(sdpa_ms) in c.reason and where in c.reason
    # no measurement on this card / head dim, fp32, a CPU tensor, or a recipe SDPA cannot run: fxfuse's kernel
    assert choose_kernel("auto", CUDA, bf16, 128, True, "", capability=(8, 0)).kernel == "fxfuse"
    assert choose_kernel("auto", CUDA, bf16, 96, True, "", capability=(9, 0)).kernel == "fxfuse"
    assert choose_kernel("auto", CUDA, torch.float32, 128, True, "", capability=(9, 0)).kernel == "fxfuse"
    assert choose_kernel("auto", torch.device("cpu"), bf16, 128, True, "").kernel == "fxfuse"
    c = choose_kernel("auto", CUDA, bf16, 128, True, "", capability=(9, 0), causal=False)  # only causal measured
    assert c.kernel == "fxfuse" and "causal" in c.reason
    c = choose_kernel("auto", CUDA, bf16, 128, False, "tanh softcap (SDPA has none)", capability=(9, 0))
    assert c.kernel == "fxfuse" and "softcap" in c.reason
    # overrides: fxfuse always; sdpa wherever SDPA can express the site (any device or dtype)
    assert choose_kernel("fxfuse", CUDA, bf16, 128, True, "", capability=(9, 0)).kernel == "fxfuse"
    assert choose_kernel("sdpa", torch.device("cpu"), torch.float32, 80, True, "").kernel == "sdpa"
    assert choose_kernel("sdpa", CUDA, bf16, 128, False, "sliding window").kernel == "fxfuse"
    with pytest.raises(ValueError):
        choose_kernel("fastest", CUDA, bf16, 128, True, "")


def _eager_llama():
    m = tiny_causal_lm("llama")
    m.config._attn_implementation = "eager"
    return m


def _batch(seq):
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, 128, (2, seq), generator=g)
    return dict(input_ids=ids, labels=ids.clone(), use_cache=False)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["sdpa", "auto"])
def test_eager_llama_attention_kernel_choice(kernel):
    """Eager attention with a causal recipe: kernel='sdpa' rewrites each site to SDPA's causal kernel on the kv heads
    (GQA), equal to eager; 'auto' on a CPU keeps fxfuse's op. Three lengths: a static graph, then one symbolic."""
    model = _eager_llama()
    opts = {"compiler": "aot_eager", "pass_options": {"softcap_attention": {"kernel": kernel}}}
    compiled = torch.compile(model, backend="fxfuse", options=opts)
    for seq in (12, 17, 23):
        batch = _batch(seq)
        ref = model(**batch)
        ref.loss.backward()
        gref = grads_of(model)
        model.zero_grad()
        out = compiled(**batch)
        out.loss.backward()
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-6)
        assert_grads_close(model, gref, rtol=1e-4, atol=1e-5)
        model.zero_grad()
    reps = fxfuse.reports()
    assert len(reps) == 2, reps  # the static first graph, then one graph for every later length
    for rep in reps:
        att = [r for r in rep.fused if r.pass_name == "softcap_attention"]
        assert len(att) == 2, str(rep)
        want = "sdpa" if kernel == "sdpa" else "fxfuse"
        assert {r.detail["kernel"] for r in att} == {want}, [r.detail for r in att]
        assert all(r.detail["kernel_reason"] for r in att)
        if kernel == "auto":
            assert all("cpu device" in r.detail["kernel_reason"] for r in att)


@pytest.mark.slow
def test_sdpa_models_plain_causal_runs_sdpa_and_fxfuse_override(monkeypatch):
    """An HF SDPA model at a symbolic length: the plain causal recipe runs SDPA's causal kernel by default;
    pass_options kernel='fxfuse' hands it to fxfuse's op instead (its implementation runs), with equal loss."""
    from fxfuse.attention import reference

    calls = []
    real = reference.attention_fwd_torch
    monkeypatch.setattr(reference, "attention_fwd_torch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    losses = {}
    for kernel in ("auto", "fxfuse"):
        torch._dynamo.reset()
        calls.clear()
        model = tiny_causal_lm("llama", attn_implementation="sdpa")
        opts = {"compiler": "aot_eager", "pass_options": {"sdpa_attention": {"kernel": kernel}}}
        compiled = torch.compile(model, backend="fxfuse", options=opts)
        compiled(**_batch(11))  # static first graph (sdpa_causal_mask's); the next length compiles a symbolic one
        calls.clear()
        losses[kernel] = compiled(**_batch(13)).loss.detach()
        rep = fxfuse.reports()[-1]
        sites = [r for r in rep.fused if r.pass_name == "sdpa_attention"]
        assert len(sites) == 2, str(rep)
        assert {r.detail["kernel"] for r in sites} == ({"sdpa"} if kernel == "auto" else {"fxfuse"}), str(rep)
        assert len(calls) == (0 if kernel == "auto" else 2), calls
    torch.testing.assert_close(losses["auto"], losses["fxfuse"], rtol=1e-4, atol=1e-6)


def test_public_function_kernel_argument():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for kernel in ("auto", "fxfuse", "sdpa"):
        torch.testing.assert_close(softcap_attention(q, k, v, causal=True, kernel=kernel), ref,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(fxfuse.FxFuseContractError, match="kernel must be one of"):
        softcap_attention(q, k, v, causal=True, kernel="cudnn")
