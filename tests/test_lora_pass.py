"""The LoRA pass on PEFT models: what it fuses (every adapted projection, adapter chains, fp32 adapters on a bf16
base, inside checkpoint bodies), what it refuses (with reasons), and whole tiny Llama / Qwen2 models whose loss and
every adapter gradient match eager PEFT."""
from __future__ import annotations

import copy

import pytest
import torch

import fxfuse

from conftest import fused_sites, grads_of, skipped_sites, tiny_causal_lm

# Every rewrite in these model tests is also checked numerically against the unfused graph (conftest).
pytestmark = [pytest.mark.usefixtures("verify_rewrites"), pytest.mark.slow]

peft = pytest.importorskip("peft")

AOT = {"compiler": "aot_eager"}
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(arch="llama", dropout=0.0, dtype=torch.float32, targets=ALL_PROJ, **lora):
    model = tiny_causal_lm(arch).to(dtype)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, **lora)
    model = peft.get_peft_model(model, cfg)
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # PEFT zero-initialises B: give the adapters something to do
            torch.nn.init.normal_(p, std=0.1)
    return model


def _step(model, fn, ids):
    out = fn(input_ids=ids, labels=ids, use_cache=False)  # training callers pass it (no K/V outputs)
    out.loss.backward()
    g = grads_of(model)
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), g


def _assert_matches_eager(model, ids):
    """One step eager and one compiled with fxfuse: same loss, same gradient for every trainable parameter.
    Returns the eager gradients."""
    ref_loss, ref = _step(model, model, ids)
    loss, got = _step(model, torch.compile(model, backend="fxfuse", options=AOT), ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    return ref


def _lora_sites(rep=None):
    return fused_sites("lora_linear", rep)


def _skips(rep=None):
    return skipped_sites("lora_linear", rep)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_whole_model_matches_eager(arch):
    model = _peft_model(arch)
    ids = torch.randint(0, 128, (2, 12))
    ref = _assert_matches_eager(model, ids)
    assert len(ref) == 2 * 7 * 2  # A and B of 7 projections x 2 layers; the base stays frozen
    sites = _lora_sites()
    assert len(sites) == 14, str(fxfuse.report())
    assert all("r 4, dropout 0" in s.op for s in sites)
    assert not fxfuse.report().rolled_back


def test_dropout_in_eval_is_off_and_training_is_reproducible():
    model = _peft_model(dropout=0.3)
    ids = torch.randint(0, 128, (2, 12))
    compiled = torch.compile(model, backend="fxfuse", options=AOT)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss)
    model.train()
    torch.manual_seed(5)
    l1, g1 = _step(model, compiled, ids)
    torch.manual_seed(5)
    l2, g2 = _step(model, compiled, ids)
    torch.manual_seed(6)
    l3, _ = _step(model, compiled, ids)
    assert torch.equal(l1, l2) and all(torch.equal(g1[n], g2[n]) for n in g1)
    assert not torch.equal(l1, l3)  # a fresh draw of the dropout masks
    assert any("dropout 0.3" in s.op for s in _lora_sites(fxfuse.reports()[-1]))


def test_fp32_adapters_on_bf16_model_close_to_float64():
    """PEFT's default: fp32 adapters on a bf16 base (x cast up, result cast back). Fused, computed in bf16 with fp32
    accumulation; its error against float64 is that of eager PEFT's bf16 run."""
    model = _peft_model(dtype=torch.bfloat16)
    assert next(p for n, p in model.named_parameters() if "lora_A" in n).dtype == torch.float32
    ids = torch.randint(0, 128, (2, 16))
    _, ref = _step(model, model, ids)
    _, got = _step(model, torch.compile(model, backend="fxfuse", options=AOT), ids)
    sites = _lora_sites()
    assert len(sites) == 14 and all("float32 adapters computed in bfloat16" in s.op for s in sites)
    m64 = copy.deepcopy(model).double()
    _, exact = _step(m64, m64, ids)
    err = lambda g: max(((g[n].double() - exact[n]).norm() / exact[n].norm()).item() for n in exact)  # noqa: E731
    assert all(got[n].dtype == torch.float32 for n in got)
    assert err(got) < 2 * err(ref) + 1e-3, (err(got), err(ref))


def test_mixed_dtype_skip_option():
    model = _peft_model(dtype=torch.bfloat16, targets=["q_proj"])
    ids = torch.randint(0, 128, (2, 8))
    torch.compile(model, backend="fxfuse",
                  options={**AOT, "pass_options": {"lora_linear": {"mixed_dtype": "skip"}}})(input_ids=ids)
    assert not _lora_sites()
    assert any("mixed_dtype='skip'" in s.reason for s in _skips())


def test_bad_pass_options_are_refused_before_any_pass_runs():
    """The LoRA passes declare their options: a bad value is an options error (with a suggestion), not a
    rolled-back pass."""
    import fxfuse

    model = _peft_model(targets=["q_proj", "k_proj"])
    ids = torch.randint(0, 128, (2, 8))
    for opts, needle in (({"lora_linear": {"mixed_dtype": "skp"}}, "must be one of 'base', 'skip'.*did you mean 'skip'"),
                         ({"lora_horizontal": {"max_group": 1}}, r"'max_group'\] must be an int >= 2")):
        torch._dynamo.reset()
        with pytest.raises(fxfuse.FxFuseOptionsError, match=needle):
            torch.compile(model, backend="fxfuse", options={**AOT, "pass_options": opts})(input_ids=ids)


def test_adapter_chain_and_refusals():
    """Two active adapters on q_proj become one op; a lora_B bias (second adapter on v_proj) is refused with its
    reason, and the first adapter of that chain is still fused."""
    model = _peft_model(targets=["q_proj", "v_proj"])
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"], use_rslora=True))
    model.add_adapter("third", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"], lora_bias=True))
    model.base_model.set_adapter(["default", "second", "third"])
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 128, (2, 8))
    _assert_matches_eager(model, ids)
    ops = [s.op for s in _lora_sites()]
    assert ops.count("LoRA linear (2 adapters, r 4/2, dropout 0/0)") == 2, ops  # q_proj in both layers
    assert ops.count("LoRA linear (1 adapter, r 4, dropout 0)") == 2, ops       # v_proj: default only
    assert any("lora_bias=True" in s.reason for s in _skips())


def test_gradient_checkpointing_bodies():
    model = _peft_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 128, (2, 12))
    _assert_matches_eager(model, ids)
    # PEFT's input-requires-grad hook (enabled with checkpointing) breaks the graph: count over every graph
    n_sites = sum(len(_lora_sites(r)) for r in fxfuse.reports())
    assert n_sites == 14, [str(r) for r in fxfuse.reports()]


def test_plain_linear_sum_is_not_lora():
    """linear(x, W) + linear(linear(x, A), B) * s outside PEFT is the same math and is fused; a product with a
    tensor scale (not a number) is not LoRA-shaped in a provable way and is left alone with a reason."""
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    W, A, B = torch.randn(5, 8), torch.randn(2, 8, requires_grad=True), torch.randn(5, 2, requires_grad=True)
    s = torch.tensor(3.0)
    f_const = lambda x: torch.nn.functional.linear(x, W) + torch.nn.functional.linear(  # noqa: E731
        torch.nn.functional.linear(x, A), B) * 2.0
    f_tensor = lambda x: torch.nn.functional.linear(x, W) + torch.nn.functional.linear(  # noqa: E731
        torch.nn.functional.linear(x, A), B) * s
    torch.testing.assert_close(torch.compile(f_const, backend="fxfuse", options=AOT)(x), f_const(x))
    assert len(_lora_sites()) == 1
    fxfuse.clear_reports()
    torch.testing.assert_close(torch.compile(f_tensor, backend="fxfuse", options=AOT)(x), f_tensor(x))
    assert not _lora_sites() and any("scaling" in r.reason for r in _skips())


def test_gemma2_lora_with_attention_and_loss_fusions():
    """All three fusions in one graph: PEFT LoRA on Gemma-2 (eager softcap attention, final logit softcap): LoRA
    projections, softcap attention and the lm-head loss are fused, and loss and adapter gradients match eager."""
    model = _peft_model("gemma2")
    ids = torch.randint(0, 128, (2, 12))
    _assert_matches_eager(model, ids)
    passes = [r.pass_name for r in fxfuse.report().fused]
    assert passes.count("lora_linear") == 14 and passes.count("softcap_attention") == 2, passes
    assert passes.count("linear_cross_entropy") == 1, passes
