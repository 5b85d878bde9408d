"""Variable lengths as users have them: default torch.compile (no ``dynamic=``), a new length every batch, labels a
tensor of their own; right padding with an attention mask; packed rows (position ids restarting at every document,
no attention mask); gradient checkpointing and LoRA.

fxfuse must compile no more graphs than the same compile without its passes (Dynamo's own count: a static graph,
then one with a symbolic length), keep its fusions in the symbolic-length graph, and match eager.
"""
from __future__ import annotations

import pytest
import torch

import fxfuse
import torch._dynamo.testing

from conftest import grads_of, tiny_causal_lm

# Every rewrite in these model tests is also checked numerically against the unfused graph (conftest).
pytestmark = [pytest.mark.usefixtures("verify_rewrites"), pytest.mark.slow]

AOT = {"compiler": "aot_eager"}
LENGTHS = list(range(19, 19 + 10 * 5, 5))  # 10 lengths


def _batch(layout, n, g):
    ids = torch.randint(0, 128, (2, n), generator=g)
    labels = ids.clone()  # a tensor of its own, as every collator gives
    labels[:, :3] = -100
    kw = dict(use_cache=False)
    if layout == "padded":  # right padding in batch 1, pads ignored by the loss
        am = torch.ones(2, n, dtype=torch.long)
        am[1, n - 6:] = 0
        labels[1, n - 6:] = -100
        kw["attention_mask"] = am
    elif layout == "packed":  # one row of 3 documents: position ids restart, -100 at document starts
        cuts = [0, n // 3, (2 * n) // 3, n]
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])[None]
        ids, labels = ids[:1], labels[:1].clone()
        labels[0, cuts[:-1]] = -100
        kw["position_ids"] = pos
    return ids, labels, kw


def _run(model, layout, backend, check_at=(), options=None):
    """Train steps over LENGTHS; returns (graphs compiled, {n: (loss, grads)} at ``check_at``)."""
    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    fn = model
    if backend is not None:
        if backend == "fxfuse":
            from fxfuse.backend import fxfuse as fx_backend

            cnt = torch._dynamo.testing.CompileCounterWithBackend(
                lambda gm, ex: fx_backend(gm, ex, options=dict(options or AOT)))
        fn = torch.compile(model, backend=cnt)
    g = torch.Generator().manual_seed(0)
    seen = {}
    for n in LENGTHS:
        ids, labels, kw = _batch(layout, n, g)
        model.zero_grad()
        out = fn(input_ids=ids, labels=labels, **kw)
        out.loss.backward()
        if n in check_at:
            seen[n] = (out.loss.detach(), grads_of(model))
    return (cnt.frame_count if backend is not None else 0), seen


def _fused_passes(rep):
    return sorted({r.pass_name for r in rep.fused})


CASES = [  # arch, attention, layout, passes expected in the symbolic-length graph
    ("llama", "sdpa", "labels", {"linear_cross_entropy", "sdpa_attention"}),
    ("llama", "sdpa", "padded", {"linear_cross_entropy", "sdpa_attention"}),
    ("llama", "sdpa", "packed", {"linear_cross_entropy", "sdpa_attention"}),
    ("qwen3", "sdpa", "packed", {"linear_cross_entropy", "sdpa_attention"}),
    ("mistral", "sdpa", "padded", {"linear_cross_entropy", "sdpa_attention"}),
    ("gemma2", "eager", "packed", {"linear_cross_entropy", "softcap_attention"}),
    ("gemma2", "eager", "padded", {"linear_cross_entropy", "softcap_attention"}),
    ("gemma3", "sdpa", "padded", {"linear_cross_entropy", "sdpa_attention"}),
    ("phi3", "sdpa", "labels", {"linear_cross_entropy", "sdpa_attention"}),
]


@pytest.mark.parametrize("arch,attn,layout,expected", CASES, ids=lambda c: c if isinstance(c, str) else None)
def test_new_length_every_batch_compiles_like_dynamo_and_matches_eager(arch, attn, layout, expected):
    check = (LENGTHS[0], LENGTHS[-1])
    model = tiny_causal_lm(arch, attn_implementation=attn)
    _, ref = _run(model, layout, None, check_at=check)
    torch._dynamo.reset()
    base, _ = _run(model, layout, "eager")  # Dynamo alone: no AOT trace, so no guard of AOTAutograd's either
    torch._dynamo.reset()
    fxfuse.clear_reports()
    got, seen = _run(model, layout, "fxfuse", check_at=check)
    assert got == base, f"fxfuse compiled {got} graphs where Dynamo alone compiled {base}"
    last = fxfuse.reports()[-1]
    assert "/1" in last.graph_name, last.graph_name  # the symbolic-length graph of the frame
    assert not last.rolled_back, str(last)
    assert expected <= set(_fused_passes(last)), str(last)
    for n in check:
        (l0, g0), (l1, g1) = ref[n], seen[n]
        torch.testing.assert_close(l1, l0, rtol=2e-5, atol=1e-6)
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=2e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointing"])
def test_lora_with_and_without_checkpointing(ckpt):
    import peft

    def build():
        # Under checkpointing the first layer's input requires grad (as every later layer's does), so one layer runs
        # every path, the adapters' grad x included (Dynamo's tracing of each checkpointed layer was most of the
        # test's time); without it the first layer's q/k/v need no grad x: the second layer's are the ones that do
        m = tiny_causal_lm("llama", attn_implementation="sdpa", num_hidden_layers=1 if ckpt else 2)
        m = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m.train()

    check = (LENGTHS[-1],)
    _, ref = _run(build(), "padded", None, check_at=check)
    torch._dynamo.reset()
    base, _ = _run(build(), "padded", "eager")
    torch._dynamo.reset()
    fxfuse.clear_reports()
    got, seen = _run(build(), "padded", "fxfuse", check_at=check)
    assert got == base, f"fxfuse compiled {got} graphs where Dynamo alone compiled {base}"
    reps = fxfuse.reports()
    dyn = [r for r in reps if not r.graph_name.endswith("/0")]
    fused = {r.pass_name for rep in dyn for r in rep.fused}
    assert {"lora_linear", "linear_cross_entropy", "sdpa_attention"} <= fused, [str(r) for r in dyn]
    assert not any(r.rolled_back for r in reps), [str(r) for r in reps]
    (l0, g0), (l1, g1) = ref[check[0]], seen[check[0]]
    torch.testing.assert_close(l1, l0, rtol=2e-5, atol=1e-6)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=2e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")


def test_packed_row_equals_its_documents_alone_and_new_boundaries_do_not_recompile():
    """A packed row is the documents run one by one (not only eager's packed result); a second batch of the same
    length with other document boundaries reuses the graph."""
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 30), generator=g)
    cm = torch.compile(model, backend="fxfuse", options=AOT)

    def packed(cuts):
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])[None]
        labels = ids.clone()
        labels[0, cuts[:-1]] = -100
        return cm(input_ids=ids, labels=labels, position_ids=pos, use_cache=False)

    with torch._dynamo.config.patch(error_on_recompile=False):
        out = packed([0, 11, 30])
    logits = out.logits
    for a, b in [(0, 11), (11, 30)]:
        alone = model(input_ids=ids[:, a:b], use_cache=False).logits
        torch.testing.assert_close(logits[:, a:b], alone, rtol=1e-4, atol=1e-5)
    assert "sdpa_attention" in _fused_passes(fxfuse.report())
    with torch._dynamo.config.patch(error_on_recompile=True):
        out2 = packed([0, 4, 17, 30])  # same shape, other boundaries: no new graph
    for a, b in [(0, 4), (4, 17), (17, 30)]:
        alone = model(input_ids=ids[:, a:b], use_cache=False).logits
        torch.testing.assert_close(out2.logits[:, a:b], alone, rtol=1e-4, atol=1e-5)


def test_user_pass_that_specialises_a_length_is_rolled_back_and_lengths_share_a_graph():
    def reads_a_length(gm: torch.fx.GraphModule) -> int:
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dim() == 2 and isinstance(v.shape[1], torch.SymInt):
                if int(v.shape[1]) > 0:  # a guard on the symbolic length: would recompile per length
                    return 0
        return 0

    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    got, _ = _run(model, "labels", "fxfuse", options={**AOT, "extra_passes": [reads_a_length]})
    assert got == 2
    rolled = [r for rep in fxfuse.reports() for r in rep.rolled_back if r.pass_name == "reads_a_length"]
    assert rolled and "shape guard" in rolled[0].reason and "int(v.shape[1])" in rolled[0].location + rolled[0].reason


def test_a_bound_a_pass_reads_is_kept_as_a_guard_and_the_rewrite_stays():
    """A bound on a symbolic length (here ``length < 100``; under tensor parallelism ``shard >= 1`` of a rank's
    sequence shard) does not tie the graph to one length: it is installed as a real guard, the pass is not rolled
    back, the lengths under it share a graph, and a length beyond it recompiles once (the guard is checked)."""
    from fxfuse.backend import fxfuse as fx_backend

    seen = []

    def reads_a_bound(gm: torch.fx.GraphModule) -> int:
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dim() == 2 and isinstance(v.shape[1], torch.SymInt):
                seen.append(bool(v.shape[1] < 100))  # a bound guard, true at every length of LENGTHS
                return 0
        return 0

    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    got, _ = _run(model, "labels", "fxfuse", options={**AOT, "extra_passes": [reads_a_bound]})
    assert max(LENGTHS) < 100
    assert got == 2 and seen == [True]  # the static first length, then one symbolic graph for all the others
    assert not [r for rep in fxfuse.reports() for r in rep.rolled_back], "a bound must not roll the pass back"

    def graphs_over_lengths(extra):
        torch._dynamo.reset()  # the same forward, compiled afresh with a backend that counts its graphs
        graphs = []
        fn = torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or fx_backend(
            gm, ex, options={**AOT, "extra_passes": extra}))
        for n in (13, 11, 9, 110):  # static, symbolic, shared, then past the bound
            ids = torch.randint(0, 128, (2, n))
            fn(input_ids=ids, labels=ids).loss.backward()
        return len(graphs)

    assert graphs_over_lengths([]) == 2  # without the bound, 110 shares the symbolic graph
    assert graphs_over_lengths([reads_a_bound]) == 3 and seen[-1] is False, seen  # with it, the guard fails there


def test_two_bounds_that_pin_a_length_roll_the_pass_back():
    """``length >= n`` and ``length <= n`` are bounds, but together they pin the length (a recompile per length):
    checked with each size a step either side, the pass is rolled back, with the guard in the report."""

    def pins_the_length(gm: torch.fx.GraphModule) -> int:
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dim() == 2 and isinstance(v.shape[1], torch.SymInt):
                now = v.shape[1].node.hint  # the current length, read without a guard
                bool(v.shape[1] >= now) and bool(v.shape[1] <= now)
                return 0
        return 0

    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    got, _ = _run(model, "labels", "fxfuse", options={**AOT, "extra_passes": [pins_the_length]})
    assert got == 2  # the static first length, then one symbolic graph: the pins never reached it
    rolled = [r for rep in fxfuse.reports() for r in rep.rolled_back if r.pass_name == "pins_the_length"]
    assert rolled and "shape guard" in rolled[0].reason, [r.reason for rep in fxfuse.reports() for r in rep.records]


def test_recompile_limit_warning_names_fxfuse_and_what_changed():
    def f(x):
        return (x * 2).sum()

    cf = torch.compile(f, backend="fxfuse", options=AOT, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=3, automatic_dynamic_shapes=False):
        with pytest.warns(UserWarning, match=r"fxfuse: frame .* compiled 3 times.*\[5\] -> .*\[6\]"):
            for n in (4, 5, 6):
                cf(torch.randn(n))
