"""The token-dimension analysis under unpadding (``passes/_token_dims.py``): on the graphs fxfuse's passes leave for
tiny Llama, Qwen3 and Gemma-2 models called with a padded batch, every node from the embedding to the lm-head loss
is placed in the token region with the right token dimensions, the tensors that enter it (RoPE's cos / sin, the
shifted labels) are found with theirs, and every size argument Dynamo baked into the graph has exactly its token
dimensions marked, also where a size's value equals a head count or a head dimension. Token-mixing ops refuse."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_causal_lm
from fxfuse.options import FxFuseOptions
from fxfuse.pass_manager import PassManager
from fxfuse.passes._token_dims import B, S, T, token_region


def _graph_after_fxfuse(model, *args, **kwargs):
    """The graph Inductor would get: Dynamo's graph after fxfuse's passes (meta['val'] filled)."""
    from torch._guards import detect_fake_mode

    graphs = []

    def backend(gm, example_inputs):
        PassManager(FxFuseOptions.parse({"passes": {"unpad_tokens": False}}), entry_point="backend",
                    can_substitute_outputs=True).run(gm, example_inputs, detect_fake_mode(example_inputs))
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*args, **kwargs)
    assert len(graphs) == 1
    return graphs[0]


def _padded_batch(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 128, (rows, cols), generator=g)
    am = torch.ones(rows, cols, dtype=torch.long)
    am[0, cols - 3:] = 0     # right padding
    am[1, :2] = 0            # left padding
    return ids, am, ids.masked_fill(am == 0, -100)


def _embedding(gm):
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.embedding)


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


@pytest.mark.parametrize("arch,rows,cols", [
    ("llama", 3, 13),    # no size equals another
    ("llama", 2, 8),     # B = number of kv heads, S = head dim: values say nothing
    ("qwen3", 3, 13),
    ("gemma2", 2, 8),    # softcap, sliding window, eager attention
])
def test_region_of_a_padded_batch(arch, rows, cols):
    ids, am, labels = _padded_batch(rows, cols)
    gm = _graph_after_fxfuse(tiny_causal_lm(arch), input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
    r = token_region(gm, _embedding(gm))
    assert r.ok, r.refused

    # every projection, attention site and the loss are in the region
    linears = _calls(gm, torch._C._nn.linear)
    assert linears and all(n in r.tags for n in linears)
    assert r.attention == _calls(gm, torch.ops.fxfuse.softcap_attention.default) and len(r.attention) == 2
    assert r.losses == _calls(gm, torch.ops.fxfuse.linear_cross_entropy.default)
    for n in linears:
        assert r.tags[n][:2] == (B, S), (n, r.tags[n])

    # what enters the region: RoPE's cos / sin along S (broadcast over rows and heads; HF unsqueezes them in every
    # layer), the shifted labels as T
    kinds = sorted(map(str, r.inputs.values()))
    assert kinds == sorted(map(str, [(None, None, S, None)] * 2 * len(r.attention) + [(T,)])), r.inputs
    # what leaves it: the loss (no token dimension left) and the hidden states fxfuse returns for the lazy logits
    assert sorted(map(str, (r.tags[o] for o in r.outputs))) == sorted(map(str, [(), (B, S, None)])), \
        {o: r.tags[o] for o in r.outputs}

    # the sizes Dynamo baked in: markers exactly where the token dimensions are (the oracle reads values, which
    # the analysis must not: in the (2, 8) case a row count equals the kv heads and S the head dimension)
    assert r.sizes
    for n, marked in r.sizes.items():
        shape = tuple(n.meta["val"].shape)
        sizes = n.args[1:] if not isinstance(n.args[1], (tuple, list)) else tuple(n.args[1])
        back = tuple({B: rows, S: cols, T: rows * cols}.get(m, m) if isinstance(m, str) else m for m in marked)
        assert back == tuple(sizes), (n, marked, sizes)
        tags = r.tags[n]
        for m, s, t, size in zip(marked, sizes, tags, shape):
            if t in (B, S, T):
                assert m == t or s == -1, (n, marked, tags)
            else:
                assert m == s, (n, marked, tags)
    assert any(m == B for marked in r.sizes.values() for m in marked)


class _Mixer(torch.nn.Module):
    """An embedding, a token-mixing op, a projection and a loss."""

    def __init__(self, mix):
        super().__init__()
        self.emb, self.head, self.mix = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False), mix

    def forward(self, ids, labels):
        h = self.mix(torch.relu(self.emb(ids)))
        return F.cross_entropy(self.head(h).view(-1, 50), labels.view(-1))


@pytest.mark.parametrize("mix,why", [
    (lambda h: h.cumsum(1), "not known to act on each token alone"),
    (lambda h: h[:, 1:], "slices the token dimension"),
    (lambda h: h - h.mean(1, keepdim=True), "reduces over a token dimension"),
    (lambda h: h.roll(1, dims=1), "not known to act on each token alone"),
])
def test_token_mixing_ops_refuse(mix, why):
    ids = torch.randint(0, 50, (3, 7))
    labels = torch.randint(0, 50, (3, 7 if "slice" not in why else 6))
    gm = _graph_after_fxfuse(_Mixer(mix), ids, labels)
    r = token_region(gm, _embedding(gm))
    assert not r.ok and why in r.refused[1], r.refused


def test_token_wise_model_is_one_region():
    ids, labels = torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 7))
    gm = _graph_after_fxfuse(_Mixer(lambda h: h * torch.sigmoid(h)), ids, labels)
    r = token_region(gm, _embedding(gm))
    assert r.ok, r.refused
    assert r.losses and r.inputs and all(t == (T,) for t in r.inputs.values())
