"""A convergence suite in the style of Liger-Kernel's mini-model tests, run against eager: tiny random models
(hidden 64) of 8 architectures, 20 AdamW steps in fp32 on batches alternately left- and right-padded whose pad
tokens are kept as labels (so fully masked query rows and peaked losses both reach the loss). The compiled model's loss must equal
eager's at every step (rtol 1e-5), with every fusion that applies in place."""
from __future__ import annotations

import pytest
import torch

import fxfuse

from conftest import tiny_causal_lm

# Every rewrite in these model tests is also checked numerically against the unfused graph (conftest).
pytestmark = [pytest.mark.usefixtures("verify_rewrites"), pytest.mark.slow]

ARCHS = [("llama", "sdpa"), ("mistral", "sdpa"), ("qwen2", "sdpa"), ("qwen3", "sdpa"), ("gemma", "sdpa"),
         ("gemma2", "eager"), ("gemma3", "eager"), ("phi3", "sdpa")]
STEPS = 20


def _data(steps=STEPS, B=4, S=20, seed=0):
    """Batches alternately left- and right-padded (row 0 unpadded), pad tokens kept as labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        ids = torch.randint(3, 128, (B, S), generator=g)
        am = torch.ones(B, S, dtype=torch.long)
        for b in range(1, B):
            n = int(torch.randint(2, S // 2, (1,), generator=g))
            if step % 2 == 0:  # left padding: the pad query rows see no key at all
                ids[b, :n], am[b, :n] = 0, 0
            else:
                ids[b, S - n:], am[b, S - n:] = 0, 0
        out.append((ids, am, ids.clone()))  # pads kept as labels, as the peer suite does
    return out


def _train(model, fn, data):
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids, am, labels in data:
        out = fn(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses


@pytest.mark.parametrize("arch,attn", ARCHS, ids=[a for a, _ in ARCHS])
def test_losses_match_eager_at_every_step(arch, attn):
    data = _data()
    m_ref = tiny_causal_lm(arch, attn_implementation=attn, hidden_size=64, intermediate_size=128)
    ref = _train(m_ref, m_ref, data)
    m = tiny_causal_lm(arch, attn_implementation=attn, hidden_size=64, intermediate_size=128)
    got = _train(m, torch.compile(m, backend="fxfuse", options={"compiler": "aot_eager"}), data)
    assert got == pytest.approx(ref, rel=1e-5), [(a, b, abs(a - b) / abs(b)) for a, b in zip(got, ref)]
    rep = fxfuse.report()
    assert not rep.rolled_back, str(rep)
    fused = {r.pass_name for r in rep.fused}
    assert "linear_cross_entropy" in fused, str(rep)
    assert fused & {"softcap_attention", "sdpa_attention"}, str(rep)
