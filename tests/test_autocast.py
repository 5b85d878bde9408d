"""Autocast (AMP) rules of fxfuse's ops: under ``torch.autocast`` each op computes in the autocast dtype, as the
linears / matmuls it replaces do in eager (``fxfuse/autocast.py``). Each check: fp32 leaves under autocast give
exactly what the op gives on operands cast by hand, and the gradients reach the fp32 leaves in fp32."""
from __future__ import annotations

import pytest
import torch

import fxfuse  # noqa: F401  (registers the ops)


def _leaves(*shapes, scale=1.0):
    return [(torch.randn(*s) * scale).requires_grad_() for s in shapes]


def _check(call, leaves, dtype, n_out=1):
    """call(*tensors) under autocast with fp32 leaves == call(*leaves cast to dtype) without autocast."""
    with torch.autocast("cpu", dtype=dtype):
        got = call(*leaves)
    ref = call(*[t.detach().to(dtype) for t in leaves])
    got, ref = (got, ref) if isinstance(got, (tuple, list)) else ((got,), (ref,))
    for g, r in zip(got[:n_out], ref[:n_out]):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    sum(g.float().sum() for g in got[:n_out]).backward()
    for t in leaves:
        assert t.grad is not None and t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_cross_entropy_autocast(dtype):
    torch.manual_seed(0)
    h, W = _leaves((2, 9, 16), (37, 16), scale=0.5)
    y = torch.randint(0, 37, (2, 9))
    y[0, :3] = -100
    _check(lambda h, W: torch.ops.fxfuse.linear_cross_entropy(h, W, y, None, -100, "mean", 30.0, 1.0, 0.0, True, 0),
           [h, W], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_log_probs_autocast(dtype):
    torch.manual_seed(1)
    h, W, b = _leaves((2, 7, 16), (41, 16), (41,), scale=0.5)
    y = torch.randint(0, 41, (2, 7))
    _check(lambda h, W, b: torch.ops.fxfuse.linear_log_probs(h, W, y, b, 0.7, 0.0, True, 0), [h, W, b], dtype,
           n_out=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_linear_autocast(dtype):
    torch.manual_seed(2)
    x, W, A, B = _leaves((2, 5, 16), (24, 16), (4, 16), (24, 4), scale=0.5)
    _check(lambda x, W, A, B: torch.ops.fxfuse.lora_linear(x, W, None, [A], [B], [2.0], [0.0]), [x, W, A, B], dtype)


def test_autocast_off_changes_nothing():
    torch.manual_seed(3)
    h, W = _leaves((3, 16), (11, 16))
    y = torch.randint(0, 11, (3,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        out = torch.ops.fxfuse.linear_cross_entropy(h, W, y, None, -100, "sum", 0.0, 1.0, 0.0, True, 0)
    ref = torch.nn.functional.cross_entropy(h @ W.t(), y, reduction="sum")
    torch.testing.assert_close(out, ref)
