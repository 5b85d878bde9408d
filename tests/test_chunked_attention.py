"""``fxfuse::chunked_causal_attention`` (Llama-4's chunked layers run by SDPA's causal kernels on the chunks): how a
row splits into SDPA calls, the op against float64 (forward and every gradient), its contract, which recipes take
it (chunks that tile every row from its start), and a Llama-4 model compiled as users call it taking it at new
lengths with one symbolic graph. On the CPU the op runs its SDPA-per-piece path; cuDNN's path is checked on the
GPU (benchmarks/bench_chunked_attention.py, part opcheck)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxfuse
from fxfuse.attention.chunked import chunk_pieces, chunked_causal_attention
from fxfuse.errors import FxFuseContractError

from conftest import fused_sites, grads_of, tiny_causal_lm
from test_attention_recipe import _two_symbolic_dims, captured_graphs  # noqa: F401  (a fixture and its check)


@pytest.mark.parametrize("size", [1, 3, 8])
def test_pieces_cover_the_row_once_in_whole_chunks_and_a_nonempty_last(size):
    for S in range(1, 40):
        pieces = chunk_pieces(S, size)
        tokens = [t for start, n, length in pieces for t in range(start, start + n * length)]
        assert tokens == list(range(S)), (S, pieces)
        assert len(pieces) <= 2 and all(n >= 1 and 1 <= length <= size for _, n, length in pieces), (S, pieces)
        if S > size:  # whole chunks, then the last one (1..size tokens) on its own
            assert pieces[0][2] == size and pieces[-1][0] % size == 0 and pieces[-1][1] == 1, (S, pieces)


def _masked_reference(q, k, v, size):
    S = q.shape[2]
    t = torch.arange(S)
    keep = (t[:, None] >= t[None, :]) & (t[:, None] // size == t[None, :] // size)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)


@pytest.mark.parametrize("softmax", ["flat", "peaked"])
@pytest.mark.parametrize("S", [5, 8, 17, 24])
def test_forward_and_gradients_match_float64_as_close_as_eager(S, softmax):
    """The chunked mask's attention (causal inside chunks of 8), GQA 4:2, two rows; fp32 inputs against the
    float64 masked reference: no further from it than eager's SDPA given the mask tensor (2x at most). Peaked: q
    scaled up so each row's softmax is close to one-hot."""
    g = torch.Generator().manual_seed(S)
    q, do = (torch.randn(2, 4, S, 16, generator=g) for _ in range(2))
    if softmax == "peaked":
        q = q * 12.0
    k, v = (torch.randn(2, 2, S, 16, generator=g) for _ in range(2))

    def run(fn, dtype):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*xs)
        return [out.detach().double(), *(x.double() for x in torch.autograd.grad(out, xs, do.to(dtype)))]

    ref = run(lambda a, b, c: _masked_reference(a, b, c, 8), torch.float64)
    eager = run(lambda a, b, c: _masked_reference(a, b, c, 8), torch.float32)
    got = run(lambda a, b, c: chunked_causal_attention(a, b, c, 8), torch.float32)
    for name, x, e, r in zip(("out", "dq", "dk", "dv"), got, eager, ref):
        err, eager_err = (x - r).abs().max().item(), (e - r).abs().max().item()
        assert err <= 2 * eager_err + 1e-6, (name, err, eager_err)
    # a chunk's keys never reach another chunk's queries: moving keys of chunk 0 leaves later chunks' outputs
    if S > 8:
        k2 = k.clone()
        k2[:, :, :8] += 1.0
        a, b = chunked_causal_attention(q, k, v, 8), chunked_causal_attention(q, k2, v, 8)
        torch.testing.assert_close(a[:, :, 8:], b[:, :, 8:], rtol=0, atol=0)
        assert not torch.equal(a[:, :, :8], b[:, :, :8])


@pytest.mark.parametrize("refuses", ["forward", "backward"])
def test_a_piece_cudnn_refuses_at_run_time_runs_sdpa_with_the_same_values(refuses, monkeypatch):
    """Where cuDNN raises for a piece (a build with no plan for it), that piece runs the SDPA path, once warned; a
    forward that fell back saved no statistics, so its backward recomputes too, and later calls skip cuDNN for
    that piece's shape. Stood in on the CPU: cuDNN's two calls replaced by float64-exact math (the forward's
    out and log-sum-exp) or by the refusal; every value matches the SDPA path's."""
    from fxfuse.attention import chunked

    monkeypatch.setattr(chunked, "CUDNN_REFUSED", {})
    monkeypatch.setattr(chunked, "uses_cudnn", lambda q, k, v: True)
    calls = {"fwd": 0, "bwd": 0}

    def refuse(*a, **kw):
        raise RuntimeError("cuDNN Frontend error: [cudnn_frontend] Error: No valid execution plans built.")

    def cudnn_forward(qp, kp, vp, scale):  # what cuDNN computes: out and the natural-log lse [B, H, L, 1]
        calls["fwd"] += 1
        rep = qp.shape[1] // kp.shape[1]
        s = (qp @ kp.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
        L = qp.shape[2]
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        return s.softmax(-1) @ vp.repeat_interleave(rep, 1), s.logsumexp(-1)[..., None]

    def cudnn_backward(*a, **kw):
        calls["bwd"] += 1
        return refuse()

    monkeypatch.setattr(chunked, "_cudnn_attention", refuse if refuses == "forward" else cudnn_forward)
    monkeypatch.setattr(chunked, "_cudnn_attention_backward", cudnn_backward)
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 4, 20, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(2))

    def run():
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = chunked_causal_attention(*xs, 8)
        return [out.detach(), *torch.autograd.grad(out, xs, do)]

    with pytest.warns(RuntimeWarning, match="cuDNN refused a piece") as caught:
        got = run()
    assert len(chunked.CUDNN_REFUSED) == 2  # the two whole chunks as a batch, the last chunk of 4
    # a forward that fell back has no cuDNN statistics: its backward never tried cuDNN
    assert calls["bwd"] == (0 if refuses == "forward" else 2), calls
    assert len([w for w in caught if "cuDNN refused" in str(w.message)]) == 2
    monkeypatch.setattr(chunked, "uses_cudnn", lambda q, k, v: False)
    want = run()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # the next call skips cuDNN for those pieces: no second warning, no second attempt
    monkeypatch.setattr(chunked, "uses_cudnn", lambda q, k, v: True)
    before = dict(calls)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = run()
    assert calls == before
    torch.testing.assert_close(again[1], want[1], rtol=1e-5, atol=1e-6)

    # a CUDA error is a fault, not a refusal: raised
    monkeypatch.setattr(chunked, "CUDNN_REFUSED", {})
    monkeypatch.setattr(chunked, "_cudnn_attention",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("CUDA error: an illegal memory access")))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        chunked_causal_attention(q, k, v, 8)


def test_a_bad_call_names_the_op_and_the_shapes():
    q = torch.randn(1, 4, 10, 16)
    with pytest.raises(FxFuseContractError, match=r"chunked_causal_attention.*S == Skv.*\[1, 4, 10, 16\]"):
        chunked_causal_attention(q, torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16), 4)
    with pytest.raises(FxFuseContractError, match="multiple of k / v's"):
        chunked_causal_attention(q, torch.randn(1, 3, 10, 16), torch.randn(1, 3, 10, 16), 4)


@pytest.mark.parametrize("side,tiling", [
    (lambda t, C: t // C, 4),             # chunks [0, 4), [4, 8), ...: SDPA can run them as a batch
    (lambda t, C: (t + 8) // C, 4),       # shifted by whole chunks: the same cut
    (lambda t, C: (t + 1) // C, None),    # chunks [0, 3), [3, 7), ...: the chunk ids, fxfuse's kernel
])
def test_chunk_tiling_is_read_only_for_chunks_from_the_row_start(side, tiling):
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from fxfuse.attention.mask_recipe import read_mask_recipe

    def build(ids):
        q = torch.arange(ids.shape[1])[None, None, :, None]
        kv = torch.arange(ids.shape[1])[None, None, None, :]
        return (kv <= q) & (side(kv, 4) == side(q, 4))

    gm = torch.fx.symbolic_trace(build)
    FakeTensorProp(gm).propagate(torch.zeros(1, 12, dtype=torch.long))
    mask = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    recipe, why = read_mask_recipe(mask, gm, 1, 12, 12)
    assert recipe is not None and recipe.describe() == "causal + chunks of 4", why
    assert recipe.chunk_tiling == tiling


@pytest.mark.slow
@pytest.mark.parametrize("attn,pass_name", [("sdpa", "sdpa_attention"), ("eager", "softcap_attention")])
def test_llama4_chunked_layers_run_the_op_at_new_lengths_with_one_symbolic_graph(attn, pass_name, captured_graphs):
    """A tiny Llama-4 (chunks of 8), unpadded rows, compiled as users call it, kernel='sdpa' (what 'auto' picks on
    a GPU where it was measured faster): the chunked layer runs fxfuse::chunked_causal_attention, the full layer
    SDPA's causal kernel; loss and every gradient equal eager's at lengths past the chunk, inside one chunk and at
    a multiple of it, all served by the symbolic graph compiled at the second length, whose Dynamo and AOT graphs
    hold no tensor with two sequence-length dims (the chunked mask is gone)."""
    torch.manual_seed(0)
    model = tiny_causal_lm("llama4", attn_implementation=attn)
    opts = {"compiler": "aot_eager", "pass_options": {pass_name: {"kernel": "sdpa"}}}
    compiled = torch.compile(model, backend="fxfuse", options=opts)
    g = torch.Generator().manual_seed(0)
    graphs = []
    for n in (17, 22, 5, 24):
        ids = torch.randint(0, 128, (2, n), generator=g)
        labels = torch.randint(0, 128, (2, n), generator=g)
        model.zero_grad()
        ref = model(input_ids=ids, labels=labels, use_cache=False).loss
        ref.backward()
        ref_grads = grads_of(model)
        model.zero_grad()
        got = compiled(input_ids=ids, labels=labels, use_cache=False).loss
        got.backward()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        for name, gr in grads_of(model).items():
            torch.testing.assert_close(gr, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
        graphs.append(len(torch._dynamo.utils.get_compilation_metrics()))
    assert graphs[1] == graphs[2] == graphs[3], graphs  # no recompile after the symbolic graph
    symbolic = [gm for gm in captured_graphs
                if any(not isinstance(s, int) for n in gm.graph.nodes if n.op == "placeholder"
                       for s in getattr(n.meta.get("val", n.meta.get("example_value")), "shape", ()))]
    assert symbolic and _two_symbolic_dims(symbolic) == []
    sites = fused_sites(pass_name, fxfuse.reports()[-1])
    chunked = [s for s in sites if s.detail.get("recipe") == "causal + chunks of 8"]
    assert chunked and all(s.detail["kernel"] == "sdpa" for s in chunked), [s.detail for s in sites]
    assert "chunked_causal_attention" in " ".join(s.op for s in chunked), [s.op for s in chunked]


def test_auto_runs_chunks_by_sdpa_only_where_measured_faster_on_that_card(monkeypatch):
    """'auto' decides a chunked site by MEASURED_CHUNKS (the op against fxfuse's kernel on the chunk ids, side by
    side): SDPA where it was faster there, fxfuse's kernel for an unmeasured card or head dim, with the reason."""
    from fxfuse.attention import dispatch
    from fxfuse.attention.dispatch import MEASURED_CHUNKS, choose_kernel, sdpa_expressible

    monkeypatch.setattr(dispatch, "_cudnn_sdpa_usable", lambda: True)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert MEASURED_CHUNKS
    for (cap, d), (op_ms, ids_ms, where) in MEASURED_CHUNKS.items():
        c = choose_kernel("auto", cuda, bf16, d, True, "", capability=cap, chunks=8192)
        assert c.kernel == ("sdpa" if op_ms < ids_ms else "fxfuse") and where in c.reason, c
        assert "chunks of 8192" in c.reason, c
    c = choose_kernel("auto", cuda, bf16, 96, True, "", capability=(9, 0), chunks=8192)
    assert c.kernel == "fxfuse" and "no side-by-side measurement" in c.reason and "chunks" in c.reason, c
    ok, why = sdpa_expressible(softcap=0.0, causal=True, window=0, has_mask=False, has_docs=False,
                               has_key_valid=False, sinks=False, head_dim_pads=(0, 0), same_length=False, chunks=8)
    assert not ok and "S != Skv" in why


@pytest.mark.parametrize("left_padding,tiling", [("zeros", 4), ("input", None), ("zeros_then_added", None),
                                                  ("zeros_then_a_slice_filled", None)])
def test_a_left_padding_count_built_as_zeros_keeps_the_tiling(left_padding, tiling):
    """transformers' chunked mask subtracts each row's left-padding count; without an attention mask it builds that
    count as ``torch.zeros(B)``: the chunks still tile every row. A count read from the batch (left padding) shifts
    each row's chunks: the chunk ids, fxfuse's kernel."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from fxfuse.attention.mask_recipe import read_mask_recipe

    def build(ids, lp):
        if left_padding.startswith("zeros"):
            lp = torch.zeros(ids.shape[0], dtype=torch.long)
            if left_padding == "zeros_then_added":  # a count built as zeros, then written: not zeros any more
                lp.add_(3)
            elif left_padding == "zeros_then_a_slice_filled":
                lp[:1].fill_(3)
        b = torch.arange(ids.shape[0])[:, None, None, None]
        q = torch.arange(ids.shape[1])[None, None, :, None]
        kv = torch.arange(ids.shape[1])[None, None, None, :]
        return (kv <= q) & ((kv - lp[b]) // 4 == (q - lp[b]) // 4)

    gm = torch.fx.symbolic_trace(build)
    FakeTensorProp(gm).propagate(torch.zeros(2, 12, dtype=torch.long), torch.tensor([3, 0]))
    mask = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    recipe, why = read_mask_recipe(mask, gm, 2, 12, 12)
    assert recipe is not None and "chunks of 4" in recipe.describe(), why
    assert recipe.chunk_tiling == tiling
