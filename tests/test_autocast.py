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


def _tail(logp, ent, g_logp, g_ent):
    return (g_logp * logp).sum() + (g_ent * ent).sum()


def test_vocabulary_parallel_ops_autocast(tmp_path):
    """The tensor-parallel lm-head ops (cross-entropy, log-probs, log-probs + loss) on a one-rank gloo group: under
    autocast their matmuls run on autocast-dtype operands, as the unfused head's. Without the rule an fp32 model
    under bf16 autocast ran them in fp32 (the HF Trainer with accelerate's tensor parallelism: fp32 GEMMs over the
    vocabulary slice, 0.77x Inductor's step on two H200s)."""
    import torch.distributed as dist
    import torch.fx as fx

    from fxfuse.fx_program import dump_graph
    from fxfuse.ops import vocab_parallel_cross_entropy, vocab_parallel_log_probs

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        group = dist.group.WORLD.group_name
        torch.manual_seed(4)
        h, W = _leaves((2, 9, 16), (37, 16), scale=0.5)
        y = torch.randint(0, 37, (2, 9))
        y[0, :3] = -100
        _check(lambda h, W: vocab_parallel_cross_entropy(h, W, y, vocab_size=37, softcap=30.0), [h, W],
               torch.bfloat16)
        h.grad = W.grad = None
        t = y.clamp(min=0)
        _check(lambda h, W: vocab_parallel_log_probs(h, W, t, vocab_size=37, temperature=0.7, return_entropy=True),
               [h, W], torch.bfloat16, n_out=2)
        h.grad = W.grad = None
        tail = dump_graph(fx.symbolic_trace(_tail).graph)
        weights = [torch.randn(18), torch.randn(18)]

        def loss_op(h, W):  # its gradients come through the carrier (formed in the forward, per chunk)
            return torch.ops.fxfuse.vocab_parallel_log_probs_loss(
                h.reshape(18, 16), W, t.reshape(18), 37, group, 1.0, 0.0, True, 0, tail, weights, [])

        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, ent, carrier = loss_op(h, W)
        ref = loss_op(h.detach().bfloat16(), W.detach().bfloat16())
        torch.testing.assert_close((logp, ent), ref[:2], rtol=0, atol=0)
        (_tail(logp, ent, *weights) + carrier).backward()
        assert h.grad.dtype == W.grad.dtype == torch.float32 and torch.isfinite(h.grad).all() and W.grad.abs().sum() > 0
    finally:
        dist.destroy_process_group()
