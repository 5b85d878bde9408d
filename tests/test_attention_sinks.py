"""Attention sinks (gpt-oss and its relatives): ``softmax(cat([scores, sinks], -1) - rowmax)[..., :-1] @ v``, a
per-head logit that joins every row's normaliser. The eager-attention pass fuses it, the sinks becoming one more
key (``append_sink_key``); forward and every gradient (the sinks' included) match the unfused graph, with GQA,
with padding masks (bool and additive), and on rows whose every real key is masked (there only the sink is left:
eager gives zeros)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxfuse

from conftest import fused_sites, skipped_sites

AOT = {"compiler": "aot_eager"}


def _eager_sink_attention(q, k, v, sinks, mask, scaling, n_rep, softcap=None):
    """HF's gpt-oss eager_attention_forward (repeat_kv, additive mask, sinks concatenated, row max shifted out)."""
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        w = w + mask
    s = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    c = torch.cat([w, s], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    p = F.softmax(c, dim=-1, dtype=c.dtype)[..., :-1]
    return torch.matmul(p, v)


def _inputs(B=2, Hq=4, Hkv=2, S=11, D=16, dead_rows=0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype, requires_grad=True)
    sinks = (torch.randn(Hq, generator=g, dtype=dtype) * 2).requires_grad_()
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    keep[1, :, :, :3] = False  # left padding in row 1: its first 3 keys masked...
    if dead_rows:
        keep[1, :, :dead_rows] = False  # ...and its first query rows see no real key at all
    additive = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    return q, k, v, sinks, additive


@pytest.mark.parametrize("dead_rows", [0, 4], ids=["padded", "fully-masked-rows"])
def test_sinks_are_fused_and_match_eager_forward_and_every_gradient(dead_rows):
    q, k, v, sinks, mask = _inputs(dead_rows=dead_rows)

    def fn(q, k, v, sinks, mask):
        return _eager_sink_attention(q, k, v, sinks, mask, q.shape[-1] ** -0.5, 2)

    args = (q, k, v, sinks, mask)
    leaves = (q, k, v, sinks)
    ref = fn(*args)
    ref_g = torch.autograd.grad(ref.square().sum(), leaves)
    fxfuse.clear_reports()
    out = torch.compile(fn, backend="fxfuse", options=AOT)(*args)
    got_g = torch.autograd.grad(out.square().sum(), leaves)
    (site,) = fused_sites("softcap_attention", fxfuse.report())
    assert site.detail["sinks"] is not None and "attention sinks" in site.op
    assert site.detail["n_rep"] == 2 and site.detail["head_dim_pads"] == [0, 1]
    for got, want in zip((out, *got_g), (ref, *ref_g)):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    if dead_rows:  # only the sink is left in those rows: the output is zero there, as eager's
        assert out[1, :, :dead_rows].abs().max() == 0


def test_sinks_against_float64_no_further_than_eager():
    q, k, v, sinks, mask = _inputs(S=40, D=24, seed=3)

    def fn(q, k, v, sinks, mask):
        return _eager_sink_attention(q, k, v, sinks, mask, 0.2, 2)

    leaves = (q, k, v, sinks)
    d = [t.detach().double().requires_grad_() for t in leaves]
    ref = fn(*d, mask.double())
    ref_g = torch.autograd.grad(ref.sum(), d)
    eager = fn(q, k, v, sinks, mask)
    eager_g = torch.autograd.grad(eager.sum(), leaves)
    out = torch.compile(fn, backend="fxfuse", options=AOT)(q, k, v, sinks, mask)
    got_g = torch.autograd.grad(out.sum(), leaves)
    assert fused_sites("softcap_attention", fxfuse.report())
    for got, e, want in zip((out, *got_g), (eager, *eager_g), (ref, *ref_g)):
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        eager_err = (e.double() - want).abs().max().item() / want.abs().max().item()
        assert err <= 2 * eager_err + 1e-7, (err, eager_err)


def test_sinks_with_a_softcap_are_left_to_inductor_with_a_reason():
    q, k, v, sinks, mask = _inputs()

    def fn(q, k, v, sinks, mask):
        return _eager_sink_attention(q, k, v, sinks, mask, 0.25, 2, softcap=30.0)

    out = torch.compile(fn, backend="fxfuse", options=AOT)(q, k, v, sinks, mask)
    torch.testing.assert_close(out, fn(q, k, v, sinks, mask))
    assert not fused_sites("softcap_attention", fxfuse.report())
    assert any("sinks together with a tanh softcap" in s.reason
               for s in skipped_sites("softcap_attention", fxfuse.report())), str(fxfuse.report())
