"""Attention whose value head_dim differs from the query/key one (multi-head latent attention: DeepSeek-V2/V3,
MiniCPM3, Kimi, ...) and multi-query attention written as a broadcast of one k / v head (Falcon): both attention
passes fuse them (zero columns appended to the narrower head dims, the output sliced back; one kv head as GQA),
and forward and every gradient match the unfused graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxfuse

from conftest import fused_sites, skipped_sites

AOT = {"compiler": "aot_eager"}


def _qkv(B=2, H=4, Hkv=4, S=12, D=24, Dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, S, Dv, generator=g, requires_grad=True)
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    keep[1, :, :, S - 3:] = False  # padding keys of row 1
    return q, k, v, keep


def _check(fn, *args):
    ref = fn(*args)
    ref_grads = torch.autograd.grad(ref.square().sum(), [a for a in args if a.requires_grad])
    torch._dynamo.reset()
    fxfuse.clear_reports()
    out = torch.compile(fn, backend="fxfuse", options=AOT)(*args)
    grads = torch.autograd.grad(out.square().sum(), [a for a in args if a.requires_grad])
    assert out.shape == ref.shape
    for got, want in zip((out, *grads), (ref, *ref_grads)):  # fp32: within 2e-5 of each tensor's scale
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    return fxfuse.report()


@pytest.mark.parametrize("D,Dv", [(24, 16), (16, 24)], ids=["v-narrower", "v-wider"])
def test_sdpa_with_a_value_head_dim_of_its_own_is_fused_and_exact(D, Dv):
    def fn(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    rep = _check(fn, *_qkv(D=D, Dv=Dv))
    (site,) = fused_sites("sdpa_attention", rep)
    assert site.detail["head_dim_pads"] == [max(D, Dv) - D, max(D, Dv) - Dv], str(rep)
    assert "zero columns" in site.op


def test_eager_attention_with_a_narrower_value_head_dim_is_fused_and_exact():
    def fn(q, k, v, keep):  # HF's eager_attention_forward with an additive mask
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        s = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
        return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)

    rep = _check(fn, *_qkv(D=24, Dv=16))
    (site,) = fused_sites("softcap_attention", rep)
    assert site.detail["head_dim_pads"] == [0, 8], str(rep)


def test_head_dims_wider_than_the_kernel_are_still_refused():
    def fn(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    rep = _check(fn, *_qkv(D=16, Dv=264))
    assert not fused_sites("sdpa_attention", rep)
    assert any("head_dim 264 > 256" in s.reason for s in skipped_sites("sdpa_attention", rep)), str(rep)


def test_one_kv_head_broadcast_over_the_query_heads_is_fused_as_gqa():
    def fn(q, k, v, keep):  # Falcon's multi-query SDPA call: k / v [B, 1, S, D], no enable_gqa
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    rep = _check(fn, *_qkv(Hkv=1, D=16, Dv=16))
    (site,) = fused_sites("sdpa_attention", rep)
    assert site.detail["n_rep"] == 4, str(rep)
