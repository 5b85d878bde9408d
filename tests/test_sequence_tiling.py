"""sequence_tiling / ``fxfuse::token_tiled`` (issue 32): a decoder's MLP run over chunks of tokens, saving only its
input; the backward recomputes it chunk by chunk.

The op against a float64 reference (forward, the input's and every trainable weight's gradient; ragged token
counts, a sequence shorter than a chunk, frozen weights); whole models as users compile them (Llama, Gemma-2's
GELU MLP, PEFT LoRA, HF gradient checkpointing): loss and every gradient as eager, what the forward saves for the
backward smaller by the MLP's intermediates, no recompile as the length changes, and LoRA dropout left untiled with
the reason."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import fxfuse
from fxfuse.ops.token_tiled import token_tiled

from conftest import saved_activation_bytes, tiny_causal_lm

TILE = {"pass_options": {"sequence_tiling": {"chunk_tokens": 7, "mode": "always"}}}


def _mlp(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


@pytest.mark.parametrize("shape,chunk", [((3, 37, 16), 10), ((5, 16), 64), ((1, 64, 16), 16)])
def test_op_matches_float64_forward_and_gradients(shape, chunk):
    """Ragged (37 tokens in chunks of 10), shorter than one chunk, exact multiples: float64 values and gradients
    as the untiled subgraph's; a frozen weight gets none."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    wg = torch.randn(48, 16, generator=g, dtype=torch.float64, requires_grad=True)
    wu = torch.randn(48, 16, generator=g, dtype=torch.float64)  # frozen
    wd = torch.randn(16, 48, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(*shape, generator=g, dtype=torch.float64)
    want = _mlp(x, wg, wu, wd)
    gw = torch.autograd.grad(want, (x, wg, wd), dy)
    got = token_tiled(x, [wg, wu, wd], fx.symbolic_trace(_mlp), chunk)
    gg = torch.autograd.grad(got, (x, wg, wd), dy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert wu.grad is None


def test_op_in_bf16_is_as_close_to_float64_as_the_untiled_subgraph():
    """bf16 weights: the tiled gradients (fp32 accumulation across chunks) no further from float64 than the untiled
    bf16 subgraph's, within 2x."""
    g = torch.Generator().manual_seed(1)
    ref = [torch.randn(*s, generator=g, dtype=torch.float64) * 0.2 for s in ((2, 300, 64), (128, 64), (128, 64),
                                                                           (64, 128))]
    dy = torch.randn(2, 300, 64, generator=g, dtype=torch.float64)
    x64, *w64 = [t.clone().requires_grad_() for t in ref]
    exact = torch.autograd.grad(_mlp(x64, *w64), [x64] + w64, dy)

    def err(tiled):
        xb, *wb = [t.to(torch.bfloat16).requires_grad_() for t in ref]
        y = token_tiled(xb, wb, fx.symbolic_trace(_mlp), 32) if tiled else _mlp(xb, *wb)
        got = torch.autograd.grad(y, [xb] + wb, dy.to(torch.bfloat16))
        return [((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, exact)]

    for tiled_err, eager_err in zip(err(True), err(False)):
        assert tiled_err <= 2 * eager_err + 1e-6, (tiled_err, eager_err)


def _loss_and_grads(model, batch, options=None):
    fn = torch.compile(model, backend="fxfuse", options={"compiler": "aot_eager", **(options or {})}) \
        if options is not None else model
    out = fn(**batch, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.loss.detach(), grads


def _tiled_records(kind="fused"):
    return [r for r in getattr(fxfuse.report(), kind) if r.pass_name == "sequence_tiling"]


@pytest.mark.parametrize("arch,checkpointing", [("llama", False), ("llama", True), ("gemma2", False)])
def test_models_train_as_eager_with_their_mlps_tiled(arch, checkpointing):
    """Each layer's MLP becomes one tiled op (in the checkpoint bodies under HF gradient checkpointing): the loss
    and every gradient equal eager's."""
    model = tiny_causal_lm(arch, attn_implementation="eager" if arch == "gemma2" else "sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(4, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    batch = dict(input_ids=ids, labels=ids.clone())
    ref, ref_grads = _loss_and_grads(model, batch)
    fxfuse.clear_reports()
    torch._dynamo.reset()
    loss, grads = _loss_and_grads(model, batch, TILE)
    assert torch.allclose(loss, ref, rtol=1e-6), (loss, ref)
    for name, g in ref_grads.items():
        assert (grads[name] - g).norm() <= 1e-5 * g.norm() + 1e-7, name
    rec = _tiled_records()
    assert len(rec) == model.config.num_hidden_layers, str(fxfuse.report())
    assert rec[0].detail["chunk_tokens"] == 7 and rec[0].detail["widest"] == model.config.intermediate_size


def test_peft_lora_mlp_is_tiled_and_lora_dropout_is_left_with_the_reason():
    """PEFT LoRA on the MLP: fxfuse's LoRA ops go inside the tiled body, adapter gradients as eager; with LoRA
    dropout the body would draw other masks in the backward's recompute: left untiled, with the reason."""
    import peft

    ids = torch.randint(4, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    batch = dict(input_ids=ids, labels=ids.clone())
    for dropout in (0.0, 0.1):
        model = peft.get_peft_model(tiny_causal_lm("llama", attn_implementation="sdpa"), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
            target_modules=["gate_proj", "up_proj", "down_proj"]))
        model.train()
        fxfuse.clear_reports()
        torch._dynamo.reset()
        if dropout:
            _loss_and_grads(model, batch, TILE)
            assert not _tiled_records() and "random" in _tiled_records("skipped")[0].reason, str(fxfuse.report())
            continue
        ref, ref_grads = _loss_and_grads(model, batch)
        loss, grads = _loss_and_grads(model, batch, TILE)
        assert torch.allclose(loss, ref, rtol=1e-6)
        for name, g in ref_grads.items():
            assert (grads[name] - g).norm() <= 1e-5 * g.norm() + 1e-7, name
        assert len(_tiled_records()) == 2, str(fxfuse.report())


def test_saved_activations_lose_the_mlp_intermediates_and_lengths_do_not_recompile():
    """What the compiled forward saves (autograd's saved-tensor hooks, parameters not counted) shrinks by at least
    the MLP's three [tokens, intermediate] tensors per layer; a new length every batch compiles 2 graphs, as
    without the pass."""
    from torch._dynamo.utils import counters

    model = tiny_causal_lm("llama", attn_implementation="sdpa", intermediate_size=256)
    cfg = model.config

    def run(options, lengths):
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(model, backend="fxfuse", options={"compiler": "aot_eager", **options})
        total = 0
        for n in lengths:
            ids = torch.randint(4, 128, (1, n), generator=torch.Generator().manual_seed(n))
            with saved_activation_bytes() as sizes:
                out = fn(input_ids=ids, labels=ids.clone(), use_cache=False)
            out.loss.backward()
            model.zero_grad()
            total = sizes[0]
        return total, counters["stats"]["unique_graphs"]

    lengths = [40, 48, 56, 64]
    plain, graphs_plain = run({}, lengths)
    tiled, graphs_tiled = run(TILE, lengths)
    mlp = 3 * lengths[-1] * cfg.intermediate_size * 4 * cfg.num_hidden_layers  # gate, up, act(gate) * up: fp32
    assert plain - tiled >= mlp, (plain, tiled, mlp)
    assert graphs_tiled == graphs_plain == 2, (graphs_tiled, graphs_plain)


def test_auto_mode_tiles_only_what_would_take_a_large_share_of_the_budget():
    """Auto mode (the default): with a memory budget the MLPs' intermediates would take more than 25% of, every
    MLP is tiled (the report holds the prediction); with a budget they fit in, none, and the report says why; on
    a CPU without a budget, nothing and nothing said."""
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    ids = torch.randint(4, 128, (2, 20), generator=torch.Generator().manual_seed(4))
    batch = dict(input_ids=ids, labels=ids.clone())
    need = 6 * 40 * model.config.intermediate_size * 4  # 40 tokens, fp32
    for budget, tiled in ((need * 2, True), (need * 100, False), (0, False)):
        fxfuse.clear_reports()
        torch._dynamo.reset()
        opts = {"pass_options": {"sequence_tiling": {"memory_budget": budget}}} if budget else {}
        _loss_and_grads(model, batch, opts)
        rec, skipped = _tiled_records(), _tiled_records("skipped")
        assert bool(rec) == tiled, str(fxfuse.report())
        if tiled:
            assert rec[0].detail["predicted_bytes"] == need and rec[0].detail["mode"] == "auto"
        elif budget:
            assert "not needed" in skipped[0].reason and "within 25%" in skipped[0].reason, skipped[0].reason
        else:
            assert not skipped, str(fxfuse.report())


def test_under_autocast_the_tiled_mlp_runs_in_the_autocast_dtype():
    """An fp32 model under bf16 autocast: the tiled op gets its inputs cast as autocast casts a projection's, so its
    loss sits with eager autocast's, not with fp32's (the op runs with autocast off: without the casts its MLP
    computed in fp32, and the loss moved 2.6e-5 from eager autocast's, further than fp32's own 1.3e-5), and the MLP
    weights' gradients are nearer eager autocast's than fp32's are."""
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    ids = torch.randint(4, 128, (2, 20), generator=torch.Generator().manual_seed(5))
    batch = dict(input_ids=ids, labels=ids.clone())

    def run(options, autocast=True):
        torch._dynamo.reset()
        fxfuse.clear_reports()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return _loss_and_grads(model, batch, options)

    fp32_loss, fp32_grads = run(None, autocast=False)
    amp_loss, amp_grads = run(None)
    tiled_loss, tiled_grads = run(TILE)
    assert _tiled_records(), str(fxfuse.report())
    assert abs(tiled_loss - amp_loss) <= 0.25 * abs(fp32_loss - amp_loss), (tiled_loss, amp_loss, fp32_loss)
    for name, g in amp_grads.items():
        if ".mlp." in name:
            assert (tiled_grads[name] - g).norm() <= 0.75 * (fp32_grads[name] - g).norm(), name


def test_padded_batch_unpadded_then_tiled():
    """unpad_tokens runs the projections of its packed row as 2-D matmuls (squeeze / unsqueeze around each): the
    MLPs are still matched and tiled, and the loss and every gradient equal eager's on the padded batch."""
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    ids = torch.randint(4, 128, (3, 16), generator=torch.Generator().manual_seed(6))
    am = torch.ones_like(ids)
    am[0, 11:] = 0
    am[1, :5] = 0
    batch = dict(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    ref, ref_grads = _loss_and_grads(model, batch)
    fxfuse.clear_reports()
    torch._dynamo.reset()
    loss, grads = _loss_and_grads(model, batch, TILE)
    assert torch.allclose(loss, ref, rtol=1e-6)
    for name, g in ref_grads.items():
        assert (grads[name] - g).norm() <= 1e-5 * g.norm() + 1e-7, name
    rep = fxfuse.report()
    assert any(r.pass_name == "unpad_tokens" for r in rep.fused), str(rep)
    assert len(_tiled_records()) == model.config.num_hidden_layers, str(rep)


def test_an_input_with_a_token_dimension_is_not_taken_for_a_weight():
    """A region that also reads a per-token graph input (a [tokens, 1] scale, not a weight): chunks of x would not
    match it, so it is left as it was, with the reason naming it; values as eager at a length of several chunks."""
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = torch.nn.Linear(8, 24, bias=False), torch.nn.Linear(8, 24, bias=False)
            self.down = torch.nn.Linear(24, 8, bias=False)

        def forward(self, x, m):
            return self.down(F.silu(self.gate(x)) * self.up(x) * m).sum()

    mlp = MLP()
    x, m = torch.randn(30, 8), torch.rand(30, 1)
    fxfuse.clear_reports()
    torch._dynamo.reset()
    fn = torch.compile(mlp, backend="fxfuse", options={"compiler": "aot_eager", **TILE})
    assert torch.allclose(fn(x, m), mlp(x, m), rtol=1e-5)
    assert not _tiled_records()
    assert "l_m_" in _tiled_records("skipped")[0].reason, str(fxfuse.report())  # names the per-token input


def test_a_permuted_input_gets_contiguous_gradients_under_inductor():
    """The backward's fake impl gives the real impl's (contiguous) strides, so Inductor's stride checks hold for a
    token input that is a permuted view."""
    body = fx.symbolic_trace(_mlp)
    g = torch.Generator().manual_seed(7)
    ws = [torch.randn(24, 8, generator=g, requires_grad=True), torch.randn(24, 8, generator=g),
          torch.randn(8, 24, generator=g, requires_grad=True)]
    xt = torch.randn(8, 2, 11, generator=g, requires_grad=True)

    def f(xt, a, b, c):
        return token_tiled(xt.permute(1, 2, 0), [a, b, c], body, 4).square().sum()

    torch._dynamo.reset()
    got = torch.compile(f, backend="inductor")(xt, *ws)
    gg = torch.autograd.grad(got, [xt, ws[0], ws[2]])
    want = f(xt, *ws)
    gw = torch.autograd.grad(want, [xt, ws[0], ws[2]])
    assert torch.allclose(got, want, rtol=1e-4)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_back_to_back_regions_tile_the_first_and_say_why_not_the_second():
    """Two MLPs in a row, the second reading the first's output directly: the first is tiled, the second is left
    as it was (its input is a region's output), with the reason; values and gradients as eager."""
    def block():
        return torch.nn.ModuleList([torch.nn.Linear(8, 24, bias=False), torch.nn.Linear(8, 24, bias=False),
                                    torch.nn.Linear(24, 8, bias=False)])

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = block(), block()

        def forward(self, x):
            for g, u, d in (self.a, self.b):
                x = d(F.silu(g(x)) * u(x))
            return x.square().sum()

    torch.manual_seed(0)
    model, x = Two(), torch.randn(30, 8)
    want = model(x)
    gw = torch.autograd.grad(want, list(model.parameters()))
    fxfuse.clear_reports()
    torch._dynamo.reset()
    got = torch.compile(model, backend="fxfuse", options={"compiler": "aot_eager", **TILE})(x)
    gg = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(_tiled_records()) == 1, str(fxfuse.report())
    assert "output of a region tiled already" in _tiled_records("skipped")[0].reason, str(fxfuse.report())
