"""Attention from its mask's recipe: causal / window / packed documents / key padding as scalars and O(S) vectors.

* The op's recipe path against float64 (forward and every gradient), on the PyTorch path and under the Triton
  interpreter, beside eager's own float64 distance; a hypothesis property test over random document boundaries,
  left / right / mixed padding, windows, GQA ratios and softcap against the same mask given as a tensor.
* Tiny HF models compiled as users compile them (a new length every batch), packed and padded: each attention
  site reads its recipe, the loss and gradients equal eager's, and no graph fxfuse hands on (the rewritten Dynamo
  graph with its checkpoint bodies, AOTAutograd's forward and backward) holds a tensor with two sequence-length
  dims: nothing of size S x S is computed, saved for the backward or passed to an op.
"""
from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings, strategies as st

import fxfuse
from fxfuse.attention import launching
from fxfuse.attention.reference import attention_reference
from fxfuse.kernels.triton_support import HAVE_TRITON, interpreting
from fxfuse.ops import document_ranges, softcap_attention

from conftest import fused_sites, grads_of, tiny_causal_lm


def _ids(B, S, bounds):
    ids = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        for x in bounds[b]:
            ids[b, x:] += 1
    return ids


def _case(B, Hq, Hkv, S, D, bounds, valid=None, softcap=0.0, window=0, masked_rows="zero", dtype=torch.float32,
          seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype).requires_grad_()
    do = torch.randn(B, Hq, S, D, generator=g).to(dtype)
    ids = _ids(B, S, bounds)
    keep = ids[:, :, None] == ids[:, None, :]  # the documents as a mask tensor, from the ids (not the ranges)
    if valid is not None:
        keep = keep & valid[:, None, :]
    return q, k, v, do, ids, keep[:, None]


def _grads(out, q, k, v, do):
    return [out, *torch.autograd.grad(out, (q, k, v), do)]


def test_document_ranges_are_each_tokens_document_run():
    ids = torch.tensor([[0, 0, 1, 1, 1, 4], [2, 3, 3, 3, 3, 3]])
    r = document_ranges(ids)
    assert r.dtype == torch.int32 and r.shape == (2, 2, 6)
    assert r[0].tolist() == [[0, 0, 2, 2, 2, 5], [0, 1, 1, 1, 1, 1]]
    assert r[1].tolist() == [[2, 2, 5, 5, 5, 6], [1, 6, 6, 6, 6, 6]]


@pytest.mark.parametrize("with_docs", [False, True])
def test_chunk_ids_keep_exactly_the_pairs_of_transformers_chunked_mask(with_docs):
    """The ids built for chunked attention put two tokens in one run iff transformers' chunked mask function
    (``(kv - lp[b]) // C == (q - lp[b]) // C``, on position ids when packed) and, when packed, its documents keep
    the pair; every run is contiguous (what document_ranges needs)."""
    from fxfuse.attention.mask_recipe import chunk_and_document_ids, chunk_document_ids

    S, C = 29, 4
    lp = torch.tensor([0, 3, 9])  # HF's left-padding counts: chunks start at each row's first real token
    if with_docs:  # packed rows: positions restart at each document (lengths 6, 13, 10), chunks within each
        pos = torch.cat([torch.arange(n) for n in (6, 13, 10)])[None].expand(3, S)
        docs = (torch.diff(pos, dim=-1, prepend=pos[:, :1]) != 1).cumsum(-1)
        ids = chunk_and_document_ids(chunk_document_ids(pos, lp, 0, -1, C), docs)
        keep = ((pos[:, :, None] - lp[:, None, None]) // C == (pos[:, None, :] - lp[:, None, None]) // C) & \
            (docs[:, :, None] == docs[:, None, :])
    else:
        t = torch.arange(S)
        ids = chunk_document_ids(t, lp, 0, -1, C)
        keep = (t[None, :, None] - lp[:, None, None]) // C == (t[None, None, :] - lp[:, None, None]) // C
    assert ids.shape == (3, S) and ids.dtype == torch.int64
    assert torch.equal(ids[:, :, None] == ids[:, None, :], keep)
    assert bool((torch.diff(ids, dim=-1) >= 0).all())
    if not with_docs:  # row 1's chunks start at its first real token, 3
        assert (ids[1, :3] != ids[1, 3]).all() and ids[1, 3] == ids[1, 6] != ids[1, 7]


CASES = [  # B, Hq, Hkv, S, D, document starts per row, padding, softcap, window, masked_rows
    (2, 4, 2, 37, 16, [[5, 17, 30], [1, 36]], None, 0.0, 0, "zero"),
    (1, 4, 1, 64, 32, [[3, 40]], None, 20.0, 0, "zero"),
    (2, 2, 1, 70, 16, [[10, 33], [2]], None, 0.0, 9, "zero"),
    (2, 2, 2, 50, 16, [[20], []], "left+right", 0.0, 0, "zero"),
    (2, 2, 2, 50, 16, [[20], []], "left+right", 30.0, 7, "uniform"),
]


def _padding(kind, B, S):
    if kind is None:
        return None
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[0, :7] = False  # left padding: the first query rows see no key at all
    valid[1, S - 6:] = False  # right padding
    return valid


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_recipe_op_matches_float64_within_eager(case, impl, monkeypatch):
    if impl == "triton" and (not HAVE_TRITON or not interpreting()):
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    if impl == "triton" and case not in (0, 4):
        pytest.skip("two cases under the interpreter are enough (slow)")
    monkeypatch.setenv("FXFUSE_ATTENTION_IMPL", impl)
    B, Hq, Hkv, S, D, bounds, pad, softcap, window, mr = CASES[case]
    valid = _padding(pad, B, S)
    q, k, v, do, ids, keep = _case(B, Hq, Hkv, S, D, bounds, valid, dtype=torch.bfloat16)
    got = _grads(softcap_attention(q, k, v, scaling=0.3, softcap=softcap, causal=True, window=window,
                                   doc_ranges=document_ranges(ids), key_valid=valid, masked_rows=mr), q, k, v, do)
    mr_i = {"zero": 0, "uniform": 1}[mr]
    ref = _grads(attention_reference(q, k, v, keep, 0.3, softcap, True, window, masked_rows=mr_i), q, k, v,
                 do.double())
    eager = _grads(attention_reference(q, k, v, keep, 0.3, softcap, True, window, dtype=torch.bfloat16,
                                       masked_rows=mr_i), q, k, v, do)
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), got, ref, eager):
        err, eager_err = (a.double() - b).abs().max().item(), (e.double() - b).abs().max().item()
        assert err <= 2 * eager_err + 1e-6, f"{name}: fxfuse {err:.3g} vs eager bf16 {eager_err:.3g} from float64"


@pytest.mark.parametrize("int64", [False, True])
def test_triton_recipe_path_with_64_bit_addresses(int64, monkeypatch):
    if not HAVE_TRITON or not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    monkeypatch.setenv("FXFUSE_ATTENTION_IMPL", "triton")
    monkeypatch.setattr(launching, "FORCE_INT64", int64)
    assert launching.needs_int64() is int64  # the switch the launchers' 64-bit rule reads
    q, k, v, do, ids, keep = _case(1, 2, 1, 40, 16, [[9, 25]], seed=3)
    got = _grads(softcap_attention(q, k, v, causal=True, window=13, doc_ranges=document_ranges(ids)), q, k, v, do)
    ref = _grads(attention_reference(q, k, v, keep, None, 0.0, True, 13), q, k, v, do.double())
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4)


def test_key_span_is_each_rows_first_and_last_valid_key_and_holes():
    valid = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert launching.key_span(valid).tolist() == [[1, 5, 1, 0], [6, 0, 0, 0], [0, 6, 0, 0]]
    assert launching.key_span(valid) is launching.key_span(valid)  # one computation per step's key_valid
    valid[1, 2] = True  # modified in place: computed again
    assert launching.key_span(valid).tolist()[1] == [2, 3, 0, 0]
    # a fresh view of the same buffer (what Inductor's code passes each call): the cached span
    view = valid.as_strided(valid.shape, valid.stride())
    assert launching.key_span(view) is launching.key_span(valid)
    view[0, 0] = True  # written through the view: the shared version counter misses
    assert launching.key_span(valid).tolist()[0] == [0, 5, 1, 0]
    assert launching.key_span(valid[1:]).tolist() == [[2, 3, 0, 0], [0, 6, 0, 0]]  # another layout: its own span
    same_values = valid.clone()  # another buffer: computed for itself
    assert launching.key_span(same_values) is not launching.key_span(valid)
    # Inductor's aliases (reinterpret_tensor: no _base, their own version counter): the cached span
    from torch._C._dynamo.guards import _reinterpret_tensor
    alias = _reinterpret_tensor(valid, tuple(valid.shape), tuple(valid.stride()), 0)
    assert alias._base is None and launching.key_span(alias) is launching.key_span(valid)
    valid[2, 0] = False  # written through the cached tensor: its version counter
    assert launching.key_span(_reinterpret_tensor(valid, tuple(valid.shape), tuple(valid.stride()), 0)
                              ).tolist()[2] == [1, 6, 0, 0]


def test_forward_key_ranges_per_query_mask_like_each_mask_in_turn(monkeypatch):
    """The forward's boundary tiles masked from each query's precomputed key range (``launching.ROW_BOUNDS``, the
    default) give the same output and lse as the per-mask form, with documents, a window, a query range longer
    than the keys' and left / right key padding together (interpreter tiles of 16: many boundary tiles)."""
    if not HAVE_TRITON or not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    from fxfuse.attention.forward import attention_fwd_triton

    valid = _padding("left+right", 2, 53)
    q, k, v, do, ids, keep = _case(2, 4, 2, 53, 16, [[9, 20, 31], [4]], valid, seed=11)
    got = {}
    for on in (False, True):
        monkeypatch.setattr(launching, "ROW_BOUNDS", on)
        got[on] = attention_fwd_triton(q.detach(), k.detach(), v.detach(), None, 0.3, 0.0, True, 13,
                                       doc_ranges=document_ranges(ids), key_valid=valid)
    torch.testing.assert_close(got[True][0], got[False][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[True][1], got[False][1], rtol=0, atol=1e-6)
    ref = attention_reference(q, k, v, keep, 0.3, 0.0, True, 13)
    torch.testing.assert_close(got[True][0].double(), ref, rtol=1e-4, atol=1e-4)


def test_tma_tiles_read_like_pointer_tiles(monkeypatch):
    """K / V tiles through tensor descriptors (``launching.FWD_TMA`` in the forward, ``DQ_TMA`` in the dQ kernel:
    in the boundary loops, or in every loop) give the pointer tiles' output, lse and dQ: keys past the end and
    head-dim padding read as 0 without a bounds mask. Head dim 24 (tiles of 32), k / v in HF's [B, S, H, D] layout
    (strided heads), a ragged length, documents, a window and key padding; then a mask tensor over more keys than
    queries. The descriptors must really be taken (a spy on the launchers' descriptor builder)."""
    if not HAVE_TRITON or not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    from fxfuse.attention import backward, forward

    made = []

    def spy(t, block_shape):
        d = tile_descriptor(t, block_shape)
        made.append(d is not None)
        return d

    tile_descriptor = launching.tile_descriptor
    monkeypatch.setattr(launching, "tile_descriptor", spy)
    valid = _padding("left+right", 2, 53)
    q, k, v, do, ids, keep = _case(2, 4, 2, 53, 24, [[9, 20, 31], [4]], valid, seed=12)
    k_hf, v_hf = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    assert k_hf.stride(1) == 24 and k_hf.stride(2) == 48  # heads inside a token: HF's layout after .transpose
    g = torch.Generator().manual_seed(3)
    mq = torch.randn(2, 4, 29, 24, generator=g).requires_grad_()
    mk, mv = torch.randn(2, 2, 61, 24, generator=g), torch.randn(2, 2, 61, 24, generator=g)
    mdo = torch.randn(2, 4, 29, 24, generator=g)
    keep_m = torch.rand(2, 1, 29, 61, generator=g) > 0.3
    cases = {"recipe": ((q.detach(), k_hf, v_hf, None, 0.3, 0.0, True, 13),
                        dict(doc_ranges=document_ranges(ids), key_valid=valid), keep, (q, k, v, do)),
             "mask": ((mq.detach(), mk, mv, keep_m, 0.25, 0.0, False, 0), {}, keep_m, (mq, mk, mv, mdo))}
    monkeypatch.setattr(launching, "DQ_TMA", 0)
    tiny = tuple(launching.INTERPRET_CONFIG["dq"])  # the interpreter's dQ tiles, as if checked on the GPU
    monkeypatch.setattr(launching, "DQ_TMA_CHECKED", {(tiny, True), (tiny, False)})
    grads_by_case = {}
    for name, (args, kw, keep_ref, (rq, rk, rv, rdo)) in cases.items():
        ref = attention_reference(rq, rk, rv, keep_ref, args[4], 0.0, args[6], args[7])
        ref_dq, = torch.autograd.grad(ref, rq, rdo.double())
        got, grads = {}, {}
        for mode in (0, 1, 2):
            made.clear()
            monkeypatch.setattr(launching, "FWD_TMA", mode)
            got[mode] = forward.attention_fwd_triton(*args, **kw)
            assert made == ([True, True] if mode else []), (name, "forward", mode, made)
        out, lse = got[0]
        for mode in (0, 2):  # dQ: off and its default (mode 1, boundary loops alone, is checked on the forward)
            made.clear()
            monkeypatch.setattr(launching, "DQ_TMA", mode)
            grads[mode] = backward.attention_bwd_triton(rdo, *args[:4], out, lse, *args[4:], **kw)
            assert made == ([True, True] if mode else []), (name, "dq", mode, made)
        for mode in (1, 2):
            torch.testing.assert_close(got[mode][0], got[0][0], rtol=0, atol=1e-6)
            torch.testing.assert_close(got[mode][1], got[0][1], rtol=0, atol=1e-6)
            torch.testing.assert_close(got[mode][0].double(), ref, rtol=1e-4, atol=1e-4)
        for a, b in zip(grads[2], grads[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(grads[2][0].double(), ref_dq.double(), rtol=1e-4, atol=1e-4)
        grads_by_case[name] = grads[0]
    # dQ tiles not listed as checked (a fallback, an override) read pointer tiles whatever DQ_TMA says
    monkeypatch.setattr(launching, "DQ_TMA_CHECKED", {(tiny, False)})
    made.clear()
    args, kw = cases["recipe"][0], cases["recipe"][1]  # with documents: (tiny, True) is no longer listed
    out, lse = forward.attention_fwd_triton(*args, **kw)
    made.clear()
    unchecked = backward.attention_bwd_triton(do, *args[:4], out, lse, *args[4:], **kw)
    assert made == [], made
    torch.testing.assert_close(unchecked[0], grads_by_case["recipe"][0], rtol=0, atol=1e-6)


def test_a_descriptor_variant_the_compiler_fails_on_runs_pointer_tiles(monkeypatch):
    """Where Triton's compiler fails on the forward's tensor-descriptor variant (ptxas crashed on one at Dh 256 in
    Triton 3.6), the forward warns once and runs pointer tiles, with the same values, for that variant from then
    on; a failure of the pointer variant itself is raised."""
    if not HAVE_TRITON or not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    from triton.runtime.errors import PTXASError

    from fxfuse.attention import forward
    from fxfuse.kernels.launch_cache import Recorder

    tried = []

    class FailingDescriptors(Recorder):
        def launch(self, fn, grid, args, kwargs):
            tried.append(kwargs["USE_DESC"])
            if kwargs["USE_DESC"] or fail_all:
                raise PTXASError("ptxas stand-in: Segmentation fault")
            return super().launch(fn, grid, args, kwargs)

    monkeypatch.setattr(launching, "POINTER_TILES", set())
    monkeypatch.setattr(launching, "FWD_TMA", 1)
    q, k, v, do, ids, keep = _case(1, 2, 1, 37, 16, [[20]], seed=4)
    args = (q.detach(), k.detach(), v.detach(), None, 0.25, 0.0, True, 0)
    kw = dict(doc_ranges=document_ranges(ids), config={"fwd": (16, 16, 4, 1)})  # no replays (explicit config)
    expected = forward.attention_fwd_triton(*args, **kw)
    monkeypatch.setattr(forward, "Recorder", FailingDescriptors)
    fail_all = False
    with pytest.warns(RuntimeWarning, match="could not compile the tensor-descriptor tiles"):
        got = forward.attention_fwd_triton(*args, **kw)
    assert tried == [1, 0]
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    tried.clear()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the variant is remembered
        forward.attention_fwd_triton(*args, **kw)
    assert tried == [0]
    fail_all = True
    with pytest.raises(PTXASError):
        forward.attention_fwd_triton(*args, **kw)


@pytest.mark.parametrize("row_pairs", [True, False])
def test_triton_padding_blocks_are_skipped_with_the_same_result(monkeypatch, row_pairs):
    """Rows padded by more than a tile at either end (interpreter tiles are 16): the kernels skip those key blocks
    (the valid-key span) and still give the PyTorch path's values, forward and every gradient, with a hole of
    padding inside the span masked tile by tile, a row with no valid key at all and a row with no padding (run by
    the launch without key flags where the kernels launch in row pairs, ``launching.ROW_PAIRS``)."""
    if not HAVE_TRITON or not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    from fxfuse.attention import launching

    monkeypatch.setattr(launching, "ROW_PAIRS", row_pairs)
    B, S = 5, 70
    valid = torch.ones(B, S, dtype=torch.bool)  # row 4: no padding
    valid[0, :37] = False  # left padding: key blocks [0, 32) skipped, rows before 37 see nothing
    valid[1, 21:] = False  # right padding: key blocks from 32 on skipped
    valid[1, 5:9] = False  # a hole inside the span: the flags are read in every tile of this row
    valid[2] = False  # nothing valid
    valid[3, 50:] = False  # right padding, no hole: interior tiles [0, 48) read no flags
    q, k, v, do, ids, keep = _case(B, 4, 2, S, 16, [[], [], [], [], []], valid, seed=5)
    for mr in ("zero", "uniform"):
        kw = dict(scaling=0.4, causal=True, key_valid=valid, masked_rows=mr)
        monkeypatch.setenv("FXFUSE_ATTENTION_IMPL", "triton")
        got = _grads(softcap_attention(q, k, v, **kw), q, k, v, do)
        monkeypatch.setenv("FXFUSE_ATTENTION_IMPL", "torch")
        want = _grads(softcap_attention(q, k, v, **kw), q, k, v, do)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{mr} {name}")


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_recipe_equals_the_same_mask_as_a_tensor(data):
    """Random documents, padding, windows, GQA, softcap and flat to peaked rows: the recipe path gives what the mask-tensor path gives
    for the mask those recipes describe (PyTorch path, fp32)."""
    B = data.draw(st.integers(1, 2))
    S = data.draw(st.integers(2, 40))
    Hkv = data.draw(st.sampled_from([1, 2]))
    Hq = Hkv * data.draw(st.sampled_from([1, 2, 3]))
    bounds = [sorted(set(data.draw(st.lists(st.integers(1, S - 1), max_size=4)))) for _ in range(B)]
    window = data.draw(st.sampled_from([0, 1, 3, 8]))
    softcap = data.draw(st.sampled_from([0.0, 5.0]))
    pad = data.draw(st.sampled_from(["none", "left", "right", "mixed"]))
    valid = None
    if pad != "none":
        valid = torch.ones(B, S, dtype=torch.bool)
        n = data.draw(st.integers(0, S))
        if pad in ("left", "mixed"):
            valid[0, :n] = False
        if pad in ("right", "mixed"):
            valid[-1, S - n:] = False
    mr = data.draw(st.sampled_from(["zero", "uniform"]))
    q, k, v, do, ids, keep = _case(B, Hq, Hkv, S, 8, bounds, valid, seed=data.draw(st.integers(0, 99)))
    scaling = data.draw(st.sampled_from([0.05, 0.5, 8.0]))  # flat, moderate and peaked softmax rows
    kw = dict(scaling=scaling, softcap=softcap, causal=True, window=window, masked_rows=mr)
    got = _grads(softcap_attention(q, k, v, doc_ranges=document_ranges(ids), key_valid=valid, **kw), q, k, v, do)
    want = _grads(softcap_attention(q, k, v, mask=keep, **kw), q, k, v, do)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_recipe_contract_errors_name_the_problem():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(fxfuse.FxFuseContractError, match="needs causal=True"):
        softcap_attention(q, q, q, doc_ranges=document_ranges(torch.zeros(1, 8, dtype=torch.long)))
    with pytest.raises(fxfuse.FxFuseContractError, match="key_valid"):
        softcap_attention(q, q, q, causal=True, key_valid=torch.ones(1, 7, dtype=torch.bool))


# ----------------------------------------------------------------------------------- models, as users compile
def _two_symbolic_dims(graphs):
    """Nodes whose tensor has two or more symbolic (sequence-length) dims, in any of ``graphs``."""
    hits = []
    for gm in graphs:
        for m in gm.modules():
            if not isinstance(m, torch.fx.GraphModule):
                continue
            for n in m.graph.nodes:
                v = n.meta.get("val", n.meta.get("example_value"))
                if isinstance(v, torch.Tensor) and sum(not isinstance(s, int) for s in v.shape) >= 2:
                    hits.append(f"{n.format_node()} {tuple(v.shape)}")
    return hits


@pytest.fixture
def captured_graphs(monkeypatch):
    """fxfuse with compiler="aot_eager", recording the rewritten Dynamo graph and AOTAutograd's forward and
    backward graphs of every compile."""
    import torch._dynamo.backends.debugging as dbg
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def keeping(compiler):
        def keep(gm, example_inputs):
            out = compiler(gm, example_inputs) if compiler is not None else make_boxed_func(gm.forward)
            seen.append(gm)
            return out
        return keep

    def recording_aot_eager(gm, example_inputs, fw_compiler=None, bw_compiler=None, **kwargs):
        seen.append(gm)
        return aot_autograd(fw_compiler=keeping(fw_compiler), bw_compiler=keeping(bw_compiler))(gm, example_inputs)

    monkeypatch.setattr(dbg, "aot_eager", recording_aot_eager)
    return seen


MODELS = [  # arch, attention implementation, layout, recipe names expected at the attention sites
    ("llama", "sdpa", "packed", {"causal + documents"}, {}),
    ("llama", "sdpa", "padded", {"causal + key padding"}, {}),
    ("mistral", "sdpa", "packed", {"causal + window 6 + documents"}, {"sliding_window": 6}),
    ("qwen3", "sdpa", "padded", {"causal + key padding", "causal + window 6 + key padding"},
     {"sliding_window": 6, "use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]}),
    ("gemma2", "eager", "padded", {"causal + window 6 + key padding", "causal + key padding"}, {"sliding_window": 6}),
    ("gemma3", "eager", "packed", {"causal + window 6 + documents", "causal + documents"}, {"sliding_window": 6}),
    # Llama-4's chunked attention (chunks of 8): from the row's first real token (left padding), within each
    # packed document, and with neither (the mask HF builds once a row passes one chunk)
    ("llama4", "sdpa", "padded", {"causal + chunks of 8 + key padding", "causal + key padding"}, {}),
    ("llama4", "eager", "packed", {"causal + documents + chunks of 8", "causal + documents"}, {}),
    ("llama4", "sdpa", "plain", {"causal + chunks of 8", "causal"}, {}),
]


def _batch(layout, n, g):
    ids = torch.randint(0, 128, (2, n), generator=g)
    kw = dict(use_cache=False, labels=ids.clone())
    if layout == "padded":  # left padding in row 0 (its first queries see no key), right padding in row 1
        am = torch.ones(2, n, dtype=torch.long)
        am[0, :4] = 0
        am[1, n - 5:] = 0
        kw["labels"][am == 0] = -100
        kw["attention_mask"] = am
    elif layout == "packed":  # three documents per row, position ids restart
        cuts = [0, n // 3, n - 4, n]
        kw["position_ids"] = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])[None].expand(2, n)
    return ids, kw


@pytest.mark.slow
@pytest.mark.parametrize("arch,attn,layout,recipes,cfg", MODELS, ids=[f"{m[0]}-{m[2]}" for m in MODELS])
def test_models_attend_from_the_recipe_with_no_s_by_s_tensor(arch, attn, layout, recipes, cfg, captured_graphs):
    torch.manual_seed(0)
    model = tiny_causal_lm(arch, attn_implementation=attn, **cfg)
    compiled = torch.compile(model, backend="fxfuse", options={"compiler": "aot_eager"})
    g = torch.Generator().manual_seed(0)
    for n in (17, 22):  # static, then symbolic (the graph that serves every later length)
        ids, kw = _batch(layout, n, g)
        model.zero_grad()
        ref = model(input_ids=ids, **kw).loss
        ref.backward()
        ref_grads = grads_of(model)
        model.zero_grad()
        got = compiled(input_ids=ids, **kw).loss
        got.backward()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        for name, gr in grads_of(model).items():
            torch.testing.assert_close(gr, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    rep = fxfuse.reports()[-1]  # the symbolic-length graph's report
    sites = fused_sites("sdpa_attention", rep) + fused_sites("softcap_attention", rep)
    assert {s.detail.get("recipe") for s in sites} == recipes
    symbolic = [gm for gm in captured_graphs
                if any(not isinstance(s, int) for n in gm.graph.nodes if n.op == "placeholder"
                       for s in getattr(n.meta.get("val", n.meta.get("example_value")), "shape", ()))]
    assert symbolic, "no symbolic-length graph was compiled"
    assert _two_symbolic_dims(symbolic) == []


@pytest.mark.slow
def test_checkpointed_layers_get_the_recipe_vectors_not_the_mask(captured_graphs):
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    compiled = torch.compile(model, backend="fxfuse", options={"compiler": "aot_eager"})
    g = torch.Generator().manual_seed(1)
    for n in (17, 23):
        ids, kw = _batch("packed", n, g)
        ref = model(input_ids=ids, **kw).loss
        got = compiled(input_ids=ids, **kw).loss
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    rep = fxfuse.report()
    assert {s.detail.get("recipe") for s in fused_sites("sdpa_attention", rep)} == {"causal + documents"}, str(rep)
    dynamo_graph = captured_graphs[-3]  # the rewritten Dynamo graph of the symbolic compile (then AOT fw, bw)
    assert _two_symbolic_dims([dynamo_graph]) == []
    bodies = [m for name, m in dynamo_graph.named_modules() if name.startswith("wrap_body")]
    assert bodies and all(any(n.name.startswith("fxfuse_") for n in b.graph.nodes if n.op == "placeholder")
                          for b in bodies)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_document_starting_past_its_token_is_a_dead_query(monkeypatch, impl):
    """unpad_tokens' encoding of kept padding that sees no key: each such token its own document whose start lies
    past its index. It attends to nothing (zeros, as SDPA's fully masked row) and no query attends to it: the
    values and every gradient equal those of the same row with those tokens masked as keys (key_valid), or flagged
    valid."""
    if impl == "triton" and (not HAVE_TRITON or not interpreting()):
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    S, pads = 40, [0, 13, 14, 31]  # a dead token first, two in a row, one late
    seg = torch.zeros(S, dtype=torch.long)
    for p in pads:  # each pad its own segment, the tokens after it a new one
        seg[p] += 1
        if p + 1 < S:
            seg[p + 1] += 1
    seg = seg.cumsum(0)[None]
    valid = torch.ones(1, S, dtype=torch.bool)
    valid[0, pads] = False
    dead = document_ranges(seg)
    dead[0, 0, pads] = torch.tensor(pads, dtype=torch.int32) + 1
    q, k, v, do, *_ = _case(1, 4, 2, S, 16, [[]], seed=3)
    monkeypatch.setenv("FXFUSE_ATTENTION_IMPL", impl)
    got = _grads(softcap_attention(q, k, v, causal=True, doc_ranges=dead), q, k, v, do)
    want = _grads(softcap_attention(q, k, v, causal=True, doc_ranges=document_ranges(seg), key_valid=valid),
                  q, k, v, do)
    # unpad_tokens flags the dead tokens' keys valid (no query reaches them): all flags True, the same values
    flagged = _grads(softcap_attention(q, k, v, causal=True, doc_ranges=dead, key_valid=torch.ones_like(valid)),
                     q, k, v, do)
    assert (got[0][0, :, pads] == 0).all()
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, want, flagged):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("masked_rows", [0, 1])  # zeros (SDPA), uniform (eager's finfo.min)
def test_row_pairs_with_more_keys_than_queries(monkeypatch, masked_rows):
    """The kernels' launch pairs (rows whose keys are all valid run the variant without key flags, the others the
    flag variant) with Skv != S (causal, bottom-right aligned): full, left-padded, holed and empty rows, dK and dV
    in one launch and split in two, equal to float64 as the flag variant alone is."""
    if not HAVE_TRITON or not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    from fxfuse.attention.backward import attention_bwd_triton
    from fxfuse.attention.forward import attention_fwd_triton

    g = torch.Generator().manual_seed(9)
    B, S, Skv = 5, 30, 50
    q = torch.randn(B, 4, S, 16, generator=g)
    k, v = (torch.randn(B, 2, Skv, 16, generator=g) for _ in range(2))
    do = torch.randn(B, 4, S, 16, generator=g)
    valid = torch.ones(B, Skv, dtype=torch.bool)  # rows 0 and 4: no padding
    valid[1, :23] = False
    valid[2, 40:] = False
    valid[2, 5:9] = False
    valid[3] = False
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, scaling=0.3, causal=True, masked_rows=masked_rows, key_valid=valid)
    want = [ref, *torch.autograd.grad(ref, (q64, k64, v64), do.double())]
    for pairs in (True, False):
        monkeypatch.setattr(launching, "ROW_PAIRS", pairs)
        for split in (0, 1):
            cfg = {"fwd": (16, 16, 4, 1), "dkdv": (16, 16, 4, 1, split), "dq": (16, 16, 4, 1)}
            out, lse = attention_fwd_triton(q, k, v, None, 0.3, 0.0, True, 0, config=cfg, masked_rows=masked_rows,
                                            key_valid=valid)
            grads = attention_bwd_triton(do, q, k, v, None, out, lse, 0.3, 0.0, True, 0, config=cfg,
                                         masked_rows=masked_rows, key_valid=valid)
            for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
                torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=f"{pairs} {split} {name}")


@pytest.mark.parametrize("kv_side,read", [
    (lambda kv, C: kv // C, "causal + chunks of 4"),
    (lambda kv, C: (kv + 1) // C, "chunk ids of the queries and keys computed differently"),  # shifted on one side
    (lambda kv, C: kv // (C + 1), "chunk ids of the queries and keys computed differently"),  # another chunk size
    (lambda kv, C: kv // C.sum(), "by something other than a positive constant"),  # a tensor divisor
])
def test_chunk_condition_is_read_only_when_both_sides_chunk_alike(kv_side, read):
    """A chunk condition becomes the recipe only when queries and keys are cut into the same chunks; anything else
    is refused with the reason (the attention passes then keep the mask tensor and report why)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from fxfuse.attention.mask_recipe import read_mask_recipe

    def build(ids, C):  # as transformers' sdpa_mask builds it, the length read from the tokens
        q = torch.arange(ids.shape[1])[None, None, :, None]
        kv = torch.arange(ids.shape[1])[None, None, None, :]
        return (kv <= q) & (kv_side(kv, C) == q // C)

    ids = torch.zeros(1, 12, dtype=torch.long)
    if "positive" in read:
        gm = torch.fx.symbolic_trace(build)
        FakeTensorProp(gm).propagate(ids, torch.tensor(4))
    else:
        gm = torch.fx.symbolic_trace(lambda ids: build(ids, 4))
        FakeTensorProp(gm).propagate(ids)
    mask = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    recipe, why = read_mask_recipe(mask, gm, 1, 12, 12)
    got = recipe.describe() if recipe is not None else why
    assert read in got, got


def test_packed_documents_launch_each_kernel_on_their_own_tiles(monkeypatch):
    """With document ranges the forward, dK/dV and dQ kernels launch on the head dim's ``<kernel>_docs`` tiles
    (short documents leave a program one or two key blocks; smaller tiles win there), without them on the plain
    ones; both equal to float64."""
    if not HAVE_TRITON or not interpreting():
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    from fxfuse.attention import backward, forward

    docs_tiles = {"fwd": (32, 16, 4, 1), "dkdv": (32, 16, 4, 1), "dq": (16, 32, 4, 1)}
    monkeypatch.setattr(launching, "INTERPRET_CONFIG",
                        dict(launching.INTERPRET_CONFIG, **{f"{k}_docs": v for k, v in docs_tiles.items()}))
    launched = []
    for module in (forward, backward):
        real = module.launch_with_fallbacks
        monkeypatch.setattr(module, "launch_with_fallbacks",
                            lambda kind, kernel, grid_of, cfg, *a, real=real: (launched.append((kind, cfg)),
                                                                                 real(kind, kernel, grid_of, cfg, *a)))
    attention_fwd_triton = forward.attention_fwd_triton
    g = torch.Generator().manual_seed(4)
    S = 70
    q, do = (torch.randn(1, 4, S, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, S, 16, generator=g) for _ in range(2))
    ids = (torch.arange(S) >= 9).long() + (torch.arange(S) >= 50).long()  # documents of 9, 41 and 20 tokens
    plain = {k: launching.INTERPRET_CONFIG[k] for k in docs_tiles}
    for docs, want_tiles in ((document_ranges(ids[None]), docs_tiles), (None, plain)):
        launched.clear()
        kw = dict(doc_ranges=docs)
        out, lse = attention_fwd_triton(q, k, v, None, 0.25, 0.0, True, 0, **kw)
        grads = backward.attention_bwd_triton(do, q, k, v, None, out, lse, 0.25, 0.0, True, 0, **kw)
        assert dict(launched) == want_tiles
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref = attention_reference(q64, k64, v64, scaling=0.25, causal=True, doc_ranges=docs)
        want = torch.autograd.grad(ref, (q64, k64, v64), do.double())
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *want)):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=f"docs={docs is not None} {name}")
