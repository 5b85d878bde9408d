"""TRL's fused lm-head as one graph node: ``fxfuse::trl_chunked_logprob``, and the shim that puts it there.

TRL (>= 1.16) trainers patch the model's forward (``trl.trainer.utils.add_fused_lm_head``): the backbone, then
``ChunkedLogProbFunction.apply(hidden [N, D], weight [V, D], bias, targets [N], temperature, chunk_size, softcap,
logit_scale, outputs)``, an autograd.Function over TRL's chunked Triton kernels that returns per-token log-probs
and, as asked, entropy, ``log sum p^2``, the mean logit and whether the target is the argmax. Dynamo cannot trace
that Function (an ``out=`` matmul into a non-contiguous tile, then its backward), so it breaks the graph there and
the lm-head runs eagerly between two graphs, where no pass sees it (benchmarks/trl_fused_head_notes.md).

:func:`install_trl_shim` replaces the module global through which TRL calls it
(``trl.trainer.utils._ChunkedLogProbFunction``) with a shim: eager calls go to TRL's Function unchanged; a call
that Dynamo traces becomes one ``fxfuse::trl_chunked_logprob`` node whose implementation *is* TRL's forward and
backward (the same kernels, numbers and autocast dtype, captured at trace time: inside a compiled graph the op no
longer sees the caller's autocast). Left in the graph it runs TRL's kernel with no graph break; the pass
``trl_fused_head`` rewrites it to ``fxfuse::linear_log_probs`` where only the log-probs and entropy are read, and
reports the site either way.

The node::

    torch.ops.fxfuse.trl_chunked_logprob(hidden, weight, bias, targets, temperature, chunk_size, softcap,
                                         logit_scale, outputs: bool[4], compute_dtype)
      -> (log_probs [N], entropy [N]|[0], log_sum_sq_probs [N]|[0], mean_logits [N]|[0], is_top1 [N]|[0], log_z [N])

``outputs`` = which of TRL's optional outputs (entropy, log_sum_sq_probs, mean_logits, is_top1) were asked for;
an output not asked for is an empty tensor (the shim gives TRL's caller None). ``log_z`` is for the backward.
"""
from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace
from typing import List, Optional

import torch
from torch import Tensor

from ..errors import FxFuseError

__all__ = ["install_trl_shim", "install_trl_shim_on_import", "uninstall_trl_shim", "trl_shim_installed", "OPTIONAL_OUTPUTS", "OP_NAME"]

OP_NAME = "fxfuse::trl_chunked_logprob"
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # TRL 1.16's, in its order
# TRL's forward signature the shim is written against: another one is left alone (its Function keeps running
# eagerly between graphs, as without fxfuse).
_TRL_FORWARD_PARAMS = ("ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                       "final_logit_softcapping", "logit_scale", "outputs")


def _trl_function():
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    return ChunkedLogProbFunction


class _Ctx(SimpleNamespace):
    """What TRL's forward / backward use of an autograd ctx, outside autograd."""

    def set_materialize_grads(self, value):
        pass

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass


def _kernel_args(temperature, softcap, logit_scale):
    # what TRL 1.16's forward stores in ctx.kernel_args (checked against it in every forward)
    return {"logit_scale": logit_scale, "softcap": softcap or 1.0, "inv_t": 1 / temperature,
            "HAS_SOFTCAP": softcap is not None}


def _autocast(device: torch.device, dtype: torch.dtype, like: Tensor):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != like.dtype)


def _none_if_empty(x: Tensor, flag: bool) -> Optional[Tensor]:
    return x if flag else None


_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define("trl_chunked_logprob(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, float temperature, "
            "int chunk_size, float? softcap, float logit_scale, bool[] outputs, ScalarType compute_dtype) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_lib.define("trl_chunked_logprob_backward(Tensor? grad_log_probs, Tensor? grad_entropy, Tensor hidden, "
            "Tensor weight, Tensor? bias, Tensor targets, Tensor log_z, Tensor entropy, float temperature, "
            "int chunk_size, float? softcap, float logit_scale, ScalarType compute_dtype, bool[] needs_grad) "
            "-> (Tensor, Tensor, Tensor)")


def _forward_impl(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs,
                  compute_dtype):
    names = tuple(n for n, f in zip(OPTIONAL_OUTPUTS, outputs) if f)
    ctx = _Ctx()
    with _autocast(hidden.device, compute_dtype, hidden), torch.no_grad():
        res = _trl_function().forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, softcap,
                                      logit_scale, names)
    if getattr(ctx, "kernel_args", None) != _kernel_args(temperature, softcap, logit_scale) \
            or getattr(ctx, "compute_dtype", None) != compute_dtype:
        raise FxFuseError(f"{OP_NAME}: this TRL version's ChunkedLogProbFunction keeps other state for its backward "
                          "than fxfuse's shim rebuilds; run without fxfuse.ops.trl_fused_head.install_trl_shim()")
    def given(x, dtype=torch.float32):  # an absent output: its own empty tensor (outputs must not alias)
        return hidden.new_empty(0, dtype=dtype) if x is None else x
    logp, ent, lssp, mean, top1 = res
    log_z = ctx.saved_tensors[4]
    return (logp, given(ent), given(lssp), given(mean), given(top1, torch.bool), log_z)


def _backward_impl(grad_logp, grad_ent, hidden, weight, bias, targets, log_z, entropy, temperature, chunk_size,
                   softcap, logit_scale, compute_dtype, needs_grad):
    ctx = _Ctx(saved_tensors=(hidden, weight, bias, targets, log_z, entropy), compute_dtype=compute_dtype,
               chunk_size=chunk_size, kernel_args=_kernel_args(temperature, softcap, logit_scale),
               needs_input_grad=tuple(needs_grad) + (False,) * 6)
    with torch.no_grad():
        gh, gw, gb = _trl_function().backward(ctx, grad_logp, grad_ent)[:3]
    return tuple(hidden.new_empty(0) if g is None else g for g in (gh, gw, gb))


_lib.impl("trl_chunked_logprob", _forward_impl, "CompositeExplicitAutograd")
_lib.impl("trl_chunked_logprob_backward", _backward_impl, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME, lib=_lib)
def _(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs, compute_dtype):
    n = hidden.shape[0]

    def f32(flag):
        return hidden.new_empty(n if flag else 0, dtype=torch.float32)
    return (f32(True), f32(outputs[0]), f32(outputs[1]), f32(outputs[2]),
            hidden.new_empty(n if outputs[3] else 0, dtype=torch.bool), f32(True))


@torch.library.register_fake("fxfuse::trl_chunked_logprob_backward", lib=_lib)
def _(grad_logp, grad_ent, hidden, weight, bias, targets, log_z, entropy, temperature, chunk_size, softcap,
      logit_scale, compute_dtype, needs_grad):
    return (hidden.new_empty(hidden.shape if needs_grad[0] else (0,)),
            weight.new_empty(weight.shape if needs_grad[1] else (0,)),
            hidden.new_empty(bias.shape if (bias is not None and needs_grad[2]) else (0,)))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs, compute_dtype = inputs
    logp, ent, lssp, mean, top1, log_z = output
    ctx.save_for_backward(hidden, weight, bias, targets, log_z, ent if outputs[0] else log_z)
    ctx.args = (temperature, chunk_size, softcap, logit_scale, compute_dtype)
    ctx.mark_non_differentiable(lssp, mean, top1, log_z)
    ctx.set_materialize_grads(False)


def _backward(ctx, g_logp, g_ent, *_):
    hidden, weight, bias, targets, log_z, ent = ctx.saved_tensors
    needs = [bool(x) for x in ctx.needs_input_grad[:3]]
    needs[2] = needs[2] and bias is not None
    gh, gw, gb = torch.ops.fxfuse.trl_chunked_logprob_backward(g_logp, g_ent, hidden, weight, bias, targets, log_z,
                                                               ent, *ctx.args, needs)
    return (gh if needs[0] else None, gw if needs[1] else None, gb if needs[2] else None) + (None,) * 7


torch.library.register_autograd(OP_NAME, _backward, setup_context=_setup_context, lib=_lib)


# ================================================================================================ the shim
class ChunkedLogProbShim:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction`` (only its ``apply`` is used there)."""

    original = None  # TRL's ChunkedLogProbFunction

    @classmethod
    def apply(cls, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=OPTIONAL_OUTPUTS):
        if not torch.compiler.is_compiling():
            return cls.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                      final_logit_softcapping, logit_scale, outputs)
        dev = hidden.device.type
        # TRL's forward reads its compute dtype from autocast; inside a compiled graph the op's implementation
        # no longer sees the caller's autocast, so it is read here, at trace time, and passed on.
        cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
        flags = [name in outputs for name in OPTIONAL_OUTPUTS]
        softcap = None if final_logit_softcapping is None else float(final_logit_softcapping)
        logp, ent, lssp, mean, top1, _ = torch.ops.fxfuse.trl_chunked_logprob(
            hidden, weight, bias, targets, float(temperature), int(chunk_size), softcap, float(logit_scale), flags,
            cdt)
        return logp, _none_if_empty(ent, flags[0]), _none_if_empty(lssp, flags[1]), \
            _none_if_empty(mean, flags[2]), _none_if_empty(top1, flags[3])


def _trl_utils():
    return sys.modules.get("trl.trainer.utils")


def trl_shim_installed() -> bool:
    utils = _trl_utils()
    return utils is not None and getattr(utils, "_ChunkedLogProbFunction", None) is ChunkedLogProbShim


def install_trl_shim() -> str:
    """Put the shim in TRL's place if TRL's trainer utilities are imported and of the version it is written for.
    Returns what happened: "installed", "already", "no trl" (not imported: nothing to do yet) or the reason it
    was not installed. Called when fxfuse is imported, installed, and at every compile (cheap)."""
    utils = _trl_utils()
    if utils is None:
        return "no trl"
    current = getattr(utils, "_ChunkedLogProbFunction", None)
    if current is ChunkedLogProbShim:
        return "already"
    if current is None:
        return "trl.trainer.utils has no _ChunkedLogProbFunction (another TRL version)"
    try:
        params = tuple(inspect.signature(current.forward).parameters)
    except (TypeError, ValueError):
        params = ()
    if params != _TRL_FORWARD_PARAMS:
        return f"TRL's ChunkedLogProbFunction.forward{params} is not the signature the shim is written for"
    ChunkedLogProbShim.original = current
    utils._ChunkedLogProbFunction = ChunkedLogProbShim
    return "installed"


class _AfterTrlUtilsImport:
    """A ``sys.meta_path`` finder that installs the shim right after ``trl.trainer.utils`` is imported (fxfuse
    imported first, TRL's trainers later: the usual order in a training script). It finds nothing itself: it
    asks the other finders for the module's spec and wraps its loader."""

    TARGET = "trl.trainer.utils"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.TARGET:
            return None
        import importlib.machinery

        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                loader = spec.loader
                exec_module = loader.exec_module

                def exec_then_install(module, _exec=exec_module):
                    _exec(module)
                    install_trl_shim()
                loader.exec_module = exec_then_install
                return spec
        return None


def install_trl_shim_on_import() -> None:
    """Install the shim now if TRL's trainer utilities are imported, else as soon as they are."""
    if install_trl_shim() == "no trl" and not any(isinstance(f, _AfterTrlUtilsImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTrlUtilsImport())


def uninstall_trl_shim() -> None:
    utils = _trl_utils()
    if utils is not None and utils._ChunkedLogProbFunction is ChunkedLogProbShim:
        utils._ChunkedLogProbFunction = ChunkedLogProbShim.original


def outputs_names(flags: List[bool]) -> List[str]:
    return [n for n, f in zip(OPTIONAL_OUTPUTS, flags) if f]
