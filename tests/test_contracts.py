"""The shared contract mechanism fires the same error in eager and under torch.compile."""
from __future__ import annotations

import pytest
import torch

from fxfuse.contracts import OpContract
from fxfuse.errors import FxFuseContractError


def _check(h, w):
    c = OpContract("fxfuse::test_matmul", hidden=h, weight=w)
    c.ndim("hidden", 2)
    c.same_dtype("hidden", "weight")
    c.dim_eq("hidden", -1, "weight", 1, hint="is hidden transposed?")


@torch.library.custom_op("fxfuse_test::matmul_t", mutates_args=())
def _matmul_t(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _check(h, w)
    return h @ w.t()


@_matmul_t.register_fake
def _(h, w):
    _check(h, w)
    return h.new_empty(h.shape[0], w.shape[0])


def api(h, w):
    _check(h, w)  # before the op: the same error under Dynamo as in eager
    return _matmul_t(h, w)


@pytest.mark.parametrize("how", ["eager", "compiled", "compiled_dynamic"])
def test_same_error_eager_and_compiled(how):
    h, w = torch.randn(4, 8), torch.randn(8, 6)
    fn = api
    if how != "eager":
        fn = torch.compile(api, backend="aot_eager", dynamic=how == "compiled_dynamic", fullgraph=False)
    with pytest.raises(FxFuseContractError) as ei:
        fn(h, w)
    msg = str(ei.value)
    assert "fxfuse::test_matmul" in msg and "[4, 8]" in msg and "[8, 6]" in msg and "transposed" in msg
    assert "test_contracts.py" in msg  # the user's line


def test_dtype_and_rank_checks():
    with pytest.raises(FxFuseContractError, match="dtype mismatch"):
        api(torch.randn(4, 8), torch.randn(6, 8, dtype=torch.float64))
    with pytest.raises(FxFuseContractError, match="must be 2-D"):
        api(torch.randn(2, 4, 8), torch.randn(6, 8))
    torch.testing.assert_close(api(torch.ones(2, 3), torch.ones(4, 3)), torch.full((2, 4), 3.0))
