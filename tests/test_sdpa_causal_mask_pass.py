"""The sdpa_causal_mask pass: HF's in-graph causal mask becomes ``is_causal=True`` only when it provably is the
causal mask (evaluated from an input-free producer subgraph); padding masks, sliding windows shorter than the
sequence and symbolic lengths are left alone with a reason; loss and gradients match eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxfuse
from fxfuse.attention.conventions import MASKED_BELOW

from conftest import fused_sites, grads_of, skipped_sites, tiny_causal_lm

AOT = {"compiler": "aot_eager"}


def _sdpa_model(arch="llama", **kw):
    m = tiny_causal_lm(arch, **kw)
    m.config._attn_implementation = "sdpa"
    return m


def _reasons(rep=None):
    return [s.reason for s in skipped_sites("sdpa_causal_mask", rep)]


@pytest.mark.slow
def test_causal_mask_becomes_is_causal_and_matches_eager(tmp_path):
    m = _sdpa_model()
    ids = torch.randint(0, 128, (2, 16))
    ref = m(input_ids=ids, labels=ids, use_cache=False)
    ref.loss.backward()
    g_ref = grads_of(m)
    m.zero_grad(set_to_none=True)
    opts = dict(AOT, debug_dir=str(tmp_path))
    out = torch.compile(m, backend="fxfuse", options=opts)(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert len(fused_sites("sdpa_causal_mask")) == 2 and not _reasons()  # one per layer
    torch.testing.assert_close(out.loss, ref.loss)
    for n, g in grads_of(m).items():
        torch.testing.assert_close(g, g_ref[n], rtol=1e-5, atol=1e-6, msg=lambda s: f"{n}: {s}")
    # the rewritten graph runs SDPA causal with no mask tensor, and the mask's construction is gone
    after = next(p for p in tmp_path.iterdir() if p.name.endswith("1_after_fxfuse.py")).read_text()
    before = next(p for p in tmp_path.iterdir() if p.name.endswith("0_dynamo.py")).read_text()
    assert "is_causal = False" in before or "is_causal=False" in before.replace(" ", "")
    assert after.replace(" ", "").count("is_causal=True") == 2 and "cumsum" in before and "cumsum" not in after


@pytest.mark.slow
def test_padding_mask_is_left_alone():
    m = _sdpa_model()
    ids = torch.randint(0, 128, (2, 16))
    am = torch.ones(2, 16, dtype=torch.long)
    am[1, :5] = 0  # left padding
    ref = m(input_ids=ids, attention_mask=am, labels=ids, use_cache=False).loss
    out = torch.compile(m, backend="fxfuse", options=AOT)(input_ids=ids, attention_mask=am, labels=ids,
                                                           use_cache=False).loss
    torch.testing.assert_close(out, ref)
    assert not fused_sites("sdpa_causal_mask")
    assert any("graph input" in r for r in _reasons())


@pytest.mark.slow
def test_sliding_window_shorter_than_sequence_is_not_causal():
    m = _sdpa_model("mistral", sliding_window=8)
    ids = torch.randint(0, 128, (1, 16))
    ref = m(input_ids=ids, labels=ids, use_cache=False).loss
    out = torch.compile(m, backend="fxfuse", options=AOT)(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(out, ref)
    assert not fused_sites("sdpa_causal_mask")
    assert any("not the plain causal mask" in r for r in _reasons()), _reasons()


@pytest.mark.slow
def test_symbolic_sequence_length_is_left_alone():
    m = _sdpa_model()
    c = torch.compile(m, backend="fxfuse", options=AOT, dynamic=True)
    for s in (12, 17):
        ids = torch.randint(0, 128, (1, s))
        torch.testing.assert_close(c(input_ids=ids, labels=ids, use_cache=False).loss,
                                   m(input_ids=ids, labels=ids, use_cache=False).loss)
    assert not fused_sites("sdpa_causal_mask")
    assert any("symbolic" in r or "graph input" in r for r in _reasons()), _reasons()


@pytest.mark.parametrize("fill, causal", [(torch.finfo(torch.float16).min, True), (float("-inf"), True),
                                          (-1e4, False)], ids=["fp16-min", "-inf", "soft"])
def test_additive_mask_is_causal_only_with_a_hard_fill(fill, causal):
    """An additive mask is the causal mask when its masked entries are -inf or at most the attention family's
    masked-value threshold (MASKED_BELOW = -65504 = finfo(fp16).min: HF's finfo.min fill in every dtype); a softer
    fill is a bias, and stays."""
    assert torch.finfo(torch.float16).min == MASKED_BELOW

    def attn(q, k, v):
        i = torch.arange(q.shape[-2])
        mask = torch.zeros(q.shape[-2], q.shape[-2]).masked_fill(i[None, :] > i[:, None], fill)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    out = torch.compile(attn, backend="fxfuse", options=AOT)(q, k, v)
    torch.testing.assert_close(out, attn(q, k, v))
    if causal:
        assert len(fused_sites("sdpa_causal_mask")) == 1 and not _reasons(), _reasons()
    else:
        assert not fused_sites("sdpa_causal_mask")
        assert any("hard mask (-inf or <= -65504)" in r for r in _reasons()), _reasons()


def test_bad_option_is_refused_before_any_pass_runs():
    """max_mask_elements is declared by the pass: a bad value is an options error at the first call."""
    m = _sdpa_model()
    ids = torch.randint(0, 128, (1, 8))
    opts = dict(AOT, pass_options={"sdpa_causal_mask": {"max_mask_elements": "big"}})
    with pytest.raises(fxfuse.FxFuseOptionsError, match=r"\['max_mask_elements'\] must be an int >= 1"):
        torch.compile(m, backend="fxfuse", options=opts)(input_ids=ids, labels=ids, use_cache=False)
