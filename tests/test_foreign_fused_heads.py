"""Another library's fused lm-head loss (Liger-Kernel, Cut Cross-Entropy, Unsloth patch one into the model) is
named in the report, never silence: the ``foreign_fused_heads`` pass finds its frames in the graphs Dynamo hands
fxfuse. The libraries themselves need a GPU, so a stand-in package written here plays one: an autograd.Function
with a host sync in its forward (Dynamo breaks the graph there, as at the real libraries' Functions)."""
from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import fxfuse
from fxfuse.passes import foreign_fused_heads as ffh

_LIBRARY = textwrap.dedent('''
    import torch
    import torch.nn.functional as F


    class FusedLinearCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w, y):
            n = max(int((y != -100).sum().item()), 1)  # a host sync, as the libraries' Functions have
            ctx.save_for_backward(h, w, y)
            ctx.n = n
            return F.cross_entropy((h @ w.t()).float(), y, reduction="sum") / n

        @staticmethod
        def backward(ctx, g):
            h, w, y = ctx.saved_tensors
            with torch.enable_grad():
                hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
                loss = F.cross_entropy((hh @ ww.t()).float(), y, reduction="sum") / ctx.n
                return (*torch.autograd.grad(loss, (hh, ww), g), None)


    def fused_loss(h, w, y):
        return FusedLinearCE.apply(h, w, y)
''')


@pytest.fixture
def stand_in_library(tmp_path, monkeypatch):
    pkg = tmp_path / "fxfuse_stand_in_fused_loss"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(_LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ffh.LIBRARIES, "fxfuse_stand_in_fused_loss", "StandInLib")
    import fxfuse_stand_in_fused_loss
    yield fxfuse_stand_in_fused_loss
    sys.modules.pop("fxfuse_stand_in_fused_loss", None)


class _Model(torch.nn.Module):
    def __init__(self, loss_fn):
        super().__init__()
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 40, bias=False)
        self.loss_fn = loss_fn

    def forward(self, x, y):
        return self.loss_fn(torch.relu(self.body(x)), self.head.weight, y)


def test_a_library_fused_loss_is_named_in_the_report(stand_in_library):
    torch.manual_seed(0)
    m = _Model(stand_in_library.fused_loss)
    x, y = torch.randn(6, 16), torch.randint(0, 40, (6,))
    y[1] = -100
    ref = m(x, y)
    ref.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    fxfuse.clear_reports()
    out = torch.compile(m, backend="fxfuse")(x, y)
    out.backward()
    assert torch.allclose(out, ref, rtol=1e-6)
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, grads[n], rtol=1e-5, atol=1e-7), n
    rep = fxfuse.report()
    sites = [s for s in rep.skipped if s.pass_name == "foreign_fused_heads"]
    assert sites and all(s.detail["library"] == "StandInLib" for s in sites), str(rep)
    assert any(s.detail["frame"].startswith("fxfuse_stand_in_fused_loss/__init__.py:") for s in sites), \
        [s.detail for s in sites]
    assert "StandInLib's own fused kernel" in str(rep)


def test_no_library_no_record():
    m = _Model(lambda h, w, y: torch.nn.functional.cross_entropy(h @ w.t(), y))
    fxfuse.clear_reports()
    torch.compile(m, backend="fxfuse")(torch.randn(6, 16), torch.randint(0, 40, (6,))).backward()
    rep = fxfuse.report()
    assert not [s for s in rep.skipped if s.pass_name == "foreign_fused_heads"], str(rep)
    assert [s for s in rep.fused if s.pass_name == "linear_cross_entropy"], str(rep)


@pytest.mark.parametrize("trace,found", [
    ('  File "/x/site-packages/liger_kernel/ops/fused_linear_cross_entropy.py", line 12, in forward\n    z = 1',
     ("Liger-Kernel", "liger_kernel/ops/fused_linear_cross_entropy.py:12 in forward")),
    ('  File "/m/model.py", line 3, in forward\n    x\n  File "C:\\env\\cut_cross_entropy\\linear.py", line 7, in '
     'linear_cross_entropy\n    y', ("Cut Cross-Entropy", "cut_cross_entropy/linear.py:7 in linear_cross_entropy")),
    ('  File "/m/liger_kernel_notes.py", line 3, in f\n    x', None),  # a file named like the package: not it
    (None, None),
])
def test_library_frame(trace, found):
    assert ffh.library_frame(trace) == found
