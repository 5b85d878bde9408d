"""The softcap_attention pass: what it matches (standalone eager attention, whole Gemma-2 / Gemma-3 models, inside
activation-checkpoint bodies), what it refuses (with reasons), and that results and gradients equal eager."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import fxfuse

from conftest import assert_grads_close, grads_of, tiny_causal_lm

# Every rewrite in these model tests is also checked numerically against the unfused graph (conftest).
pytestmark = pytest.mark.usefixtures("verify_rewrites")

AOT = {"compiler": "aot_eager"}
B, HQ, HKV, S, D = 2, 4, 2, 10, 16


def repeat_kv(x, n_rep):  # transformers' repeat_kv
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def eager_attention(q, k, v, mask, *, softcap=50.0, mask_form="add", p=0.0, training=True, return_probs=False,
                    interleave=False):
    n_rep = q.shape[1] // k.shape[1]
    if interleave:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    else:
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    s = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
    if softcap:
        s = s / softcap
        s = torch.tanh(s)
        s = s * softcap
    if mask is not None:
        if mask_form == "add":
            s = s + mask
        elif mask_form == "masked_fill":
            s = s.masked_fill(~mask, float("-inf"))
        elif mask_form == "where":
            s = torch.where(mask, s, float("-inf"))
        elif mask_form == "slice":  # HF's causal_mask[:, :, :, : key_states.shape[-2]]
            s = s + mask[:, :, :, : k.shape[-2]]
        elif mask_form == "bad_slice":
            s = s + mask[:, :, :, 1: k.shape[-2] + 1]
    probs = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=p, training=training)
    out = torch.matmul(probs, v)
    return (out, probs) if return_probs else out


def _qkv(dtype, hkv=HKV):
    torch.manual_seed(0)
    return (torch.randn(B, HQ, S, D, dtype=dtype), torch.randn(B, hkv, S, D, dtype=dtype),
            torch.randn(B, hkv, S, D, dtype=dtype))


def _keep(extra_keys=0):
    """Bool [B, 1, S, S + extra] keep-mask: causal + right padding of batch row 1 (no fully masked row)."""
    i = torch.arange(S)[:, None]
    j = torch.arange(S + extra_keys)[None, :]
    keep = (j <= i)[None, None].expand(B, 1, S, S + extra_keys).clone()
    keep[1, :, :, S - 3:] = False  # the last 3 keys of row 1 are padding
    return keep


def _additive(keep, dtype):
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def _close(a, b, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    else:
        err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
        assert err < 1e-2, f"relative error {err:.3g}"


def _compare(fn, q, k, v, mask, dtype):
    def leaves():
        return [t.detach().clone().requires_grad_() for t in (q, k, v)]

    a = leaves()
    ref = fn(*a, mask)
    ref.float().square().sum().backward()
    b = leaves()
    out = torch.compile(fn, backend="fxfuse", options=AOT)(*b, mask)
    rep = fxfuse.report()
    out.float().square().sum().backward()
    _close(out, ref, dtype)
    for x, y in zip(b, a):
        _close(x.grad, y.grad, dtype)
    return rep


def _attn_fused(rep):
    return [r for r in rep.fused if r.pass_name == "softcap_attention"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["softcap_additive", "no_softcap", "no_mask", "bool_masked_fill", "bool_where",
                                  "prefix_slice", "repeat_interleave", "no_gqa"])
def test_standalone_attention_fuses_and_matches_eager(case, dtype):
    hkv = HQ if case == "no_gqa" else HKV
    q, k, v = _qkv(dtype, hkv)
    keep = _keep(extra_keys=4 if case == "prefix_slice" else 0)
    kw, mask = {}, _additive(keep, dtype)
    if case == "no_softcap":
        kw["softcap"] = None
    elif case == "no_mask":
        mask = None
    elif case in ("bool_masked_fill", "bool_where"):
        kw["mask_form"], mask = case[5:], keep
    elif case == "prefix_slice":
        kw["mask_form"] = "slice"
    elif case == "repeat_interleave":
        kw["interleave"] = True
    rep = _compare(functools.partial(eager_attention, **kw), q, k, v, mask, dtype)
    fused = _attn_fused(rep)
    assert len(fused) == 1 and not rep.rolled_back and not rep.skipped, str(rep)
    d = fused[0].detail
    assert d["softcap"] == (0.0 if case == "no_softcap" else 50.0)
    assert d["scaling"] == pytest.approx(D ** -0.5)
    assert d["n_rep"] == HQ // hkv  # k / v went in before the repeat
    assert d["mask"] == {"no_mask": "none", "bool_masked_fill": "bool", "bool_where": "bool"}.get(case, "additive")
    assert fused[0].saved_bytes and fused[0].saved_bytes >= B * HQ * S * S * 4
    assert "eager_attention" in fused[0].location  # the user's source line


def test_two_call_sites_two_fusions():
    q, k, v = _qkv(torch.float32)
    mask = _additive(_keep(), torch.float32)

    def two(q, k, v, mask):
        return eager_attention(q, k, v, mask) + eager_attention(q * 2, k, v, mask, softcap=None)

    rep = _compare(two, q, k, v, mask, torch.float32)
    assert len(_attn_fused(rep)) == 2, str(rep)


@pytest.mark.parametrize("p,training", [(0.0, True), (0.3, False)])
def test_dropout_that_is_identity_is_fused(p, training):
    q, k, v = _qkv(torch.float32)
    rep = _compare(functools.partial(eager_attention, p=p, training=training), q, k, v,
                   _additive(_keep(), torch.float32), torch.float32)
    assert len(_attn_fused(rep)) == 1, str(rep)


@pytest.mark.parametrize("case,reason", [
    ("dropout", "attention dropout p>0 in training"),
    ("probs_returned", "other users"),
    ("bad_slice", "not a prefix slice"),
])
def test_refused_with_reason(case, reason):
    q, k, v = _qkv(torch.float32)
    mask = _additive(_keep(extra_keys=4 if case == "bad_slice" else 0), torch.float32)
    kw = {"dropout": dict(p=0.1, training=True), "probs_returned": dict(return_probs=True),
          "bad_slice": dict(mask_form="bad_slice")}[case]
    fn = functools.partial(eager_attention, **kw)
    out = torch.compile(fn, backend="fxfuse", options=AOT)(q, k, v, mask)
    rep = fxfuse.report()
    assert not _attn_fused(rep), str(rep)
    assert any(r.pass_name == "softcap_attention" and reason in r.reason for r in rep.skipped), str(rep)
    if case != "dropout":
        torch.testing.assert_close(out, fn(q, k, v, mask))


def test_dynamic_sequence_length_prefix_slice_no_recompile():
    calls = []

    def counting(gm, ex):
        calls.append(1)
        from fxfuse.backend import fxfuse as be
        return be(gm, ex, options=AOT)

    fn = torch.compile(functools.partial(eager_attention, mask_form="slice"), backend=counting)
    for s in (7, 11, 13):
        torch.manual_seed(s)
        q, k, v = torch.randn(B, HQ, s, D), torch.randn(B, HKV, s, D), torch.randn(B, HKV, s, D)
        mask = torch.randn(B, 1, s, s + 5)
        for t, dims in ((q, (2,)), (k, (2,)), (v, (2,)), (mask, (2, 3))):
            for d in dims:
                torch._dynamo.mark_dynamic(t, d)
        torch.testing.assert_close(fn(q, k, v, mask), eager_attention(q, k, v, mask, mask_form="slice"),
                                   rtol=1e-4, atol=1e-5)
    assert len(calls) == 1
    assert len(_attn_fused(fxfuse.report())) == 1, str(fxfuse.report())


def test_unspecialised_scaling_is_refused():
    q, k, v = _qkv(torch.float32)

    def fn(q, k, v, scale):
        s = torch.matmul(q, k.transpose(2, 3)) * scale.item()
        return torch.matmul(F.softmax(s, dim=-1), v)

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        out = torch.compile(fn, backend="fxfuse", options=AOT)(q, q, q, torch.tensor(0.25))
    torch.testing.assert_close(out, fn(q, q, q, torch.tensor(0.25)))
    rep = fxfuse.report()
    assert not _attn_fused(rep)
    assert any("not known at compile time" in r.reason for r in rep.skipped), str(rep)


def test_non_attention_softmax_is_not_reported():
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    torch.compile(lambda x, w: F.softmax(F.linear(x, w), dim=-1) @ w, backend="fxfuse", options=AOT)(x, w)
    rep = fxfuse.report()
    assert not [r for r in rep.records if r.pass_name == "softcap_attention"], str(rep)


def test_pass_can_be_disabled():
    q, k, v = _qkv(torch.float32)
    torch.compile(eager_attention, backend="fxfuse",
                  options={**AOT, "passes": {"softcap_attention": False}})(q, k, v, None)
    assert not _attn_fused(fxfuse.report())


# ------------------------------------------------------------------------------------------- whole HF models
def _tiny_gemma3():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                              max_position_embeddings=128, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention"],
                              final_logit_softcapping=30.0)  # Gemma-3 attention has no logit softcap
    cfg._attn_implementation = "eager"
    return tf.Gemma3ForCausalLM(cfg)


def _model(arch):
    if arch == "gemma2":
        m = tiny_causal_lm("gemma2", sliding_window=6)  # attn softcap 50, final softcap 30
    else:
        m = _tiny_gemma3()
    return m


ARCHS = ["gemma2"]
try:  # pragma: no cover - depends on the transformers version
    import transformers as _tf

    if hasattr(_tf, "Gemma3ForCausalLM") and hasattr(_tf, "Gemma3TextConfig"):
        ARCHS.append("gemma3")
except Exception:  # pragma: no cover
    pass


def _batch(seq=14):
    """A right-padded batch longer than the sliding window (6); labels -100 on padding. Right padding keeps every
    query row with at least one visible key (see the pass docstring on fully masked rows)."""
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, seq))
    am = torch.ones(2, seq, dtype=torch.long)
    am[1, seq - 4:] = 0
    labels = ids.masked_fill(am == 0, -100)
    return dict(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)


def _assert_model_report(model, rep):
    n_layers = model.config.num_hidden_layers
    att = _attn_fused(rep)
    assert len(att) == n_layers, str(rep)
    expect = model.config.attn_logit_softcapping if model.config.model_type == "gemma2" else None
    assert all(r.detail["softcap"] == (expect or 0.0) for r in att), str(rep)
    assert [r for r in rep.fused if r.pass_name == "linear_cross_entropy"], str(rep)
    assert not rep.rolled_back and not [r for r in rep.skipped if r.pass_name == "softcap_attention"], str(rep)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_model_train_loss_and_grads(arch):
    model = _model(arch)
    model.train()
    batch = _batch()
    ref = model(**batch)
    ref.loss.backward()
    gref = grads_of(model)
    model.zero_grad()
    out = torch.compile(model, backend="fxfuse", options=AOT)(**batch)
    _assert_model_report(model, fxfuse.report())
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-6)
    assert_grads_close(model, gref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_model_eval_loss_and_logits(arch):
    model = _model(arch)
    model.eval()
    batch = _batch()
    with torch.no_grad():
        ref = model(**batch)
        out = torch.compile(model, backend="fxfuse", options=AOT)(**batch)
        _assert_model_report(model, fxfuse.report())
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(torch.as_tensor(out.logits.detach()), ref.logits, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_gradient_checkpointing_bodies_are_fused():
    model = _model("gemma2")
    model.train()
    batch = _batch()
    ref = model(**batch)
    ref.loss.backward()
    gref = grads_of(model)
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated alias of activation_checkpointing_enable
        model.gradient_checkpointing_enable()
    graphs = []

    def keep(gm, ex):
        graphs.append(gm)
        from fxfuse.backend import fxfuse as be
        return be(gm, ex, options=AOT)

    out = torch.compile(model, backend=keep)(**batch)
    rep = fxfuse.report()
    att = _attn_fused(rep)
    assert len(att) == model.config.num_hidden_layers, str(rep)
    op = torch.ops.fxfuse.softcap_attention.default
    bodies = [m for gm in graphs for name, m in gm.named_modules() if name.startswith("wrap_body")]
    assert len(bodies) == model.config.num_hidden_layers
    assert all(any(n.target is op for n in body.graph.nodes) for body in bodies)  # fused inside each body
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-6)
    assert_grads_close(model, gref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "llama"])
def test_autocast_bf16_attention_is_fused_and_as_accurate_as_eager(arch):
    """AMP: an fp32 model under bf16 autocast. q / k / v are fp32 and both attention matmuls return bf16 (autocast
    casts their operands); the pass casts q / k / v the same way and fuses. Loss and every gradient are at least
    as close to the fp32 run as eager autocast is."""
    torch.manual_seed(0)
    model = tiny_causal_lm(arch)
    model.train()
    ids = torch.randint(0, 128, (2, 12))

    def run(fn, amp):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach().double(), grads_of(model)

    ref = run(model, False)                      # fp32
    eager = run(model, True)                     # eager autocast
    got = run(torch.compile(model, backend="fxfuse", options=AOT), True)
    rep = fxfuse.report()
    att = _attn_fused(rep)
    assert len(att) == model.config.num_hidden_layers and not rep.rolled_back, str(rep)
    assert all(r.detail["autocast_dtype"] == "torch.bfloat16" for r in att), str(rep)

    def err(run_):
        loss_err = abs((run_[0] - ref[0]).item()) / abs(ref[0].item())
        g_err = max(((run_[1][n].double() - g.double()).norm() / g.double().norm().clamp_min(1e-30)).item()
                    for n, g in ref[1].items())
        return loss_err, g_err

    (le, ge), (lf, gf) = err(eager), err(got)
    assert lf <= 2 * le + 1e-4 and gf <= 1.5 * ge + 1e-3, ((lf, gf), (le, ge))
