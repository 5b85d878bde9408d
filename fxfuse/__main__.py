"""Command line: ``python -m fxfuse <command>`` (``--help`` lists them); ``fxfuse-demo`` runs the demo directly.

Subcommands are plain functions ``fn(argv) -> exit code`` in :data:`COMMANDS`, each with a one-line description
for ``--help``; an unknown one prints a short usage and exits 2 (argparse's convention for usage errors).
"""
from __future__ import annotations

import contextlib

import glob
import json
import os
import platform
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .report import FusionReport, RunReport


def _demo(argv: Sequence[str]) -> int:
    from .demo import main

    return main(list(argv))


def _report(argv: Sequence[str]) -> int:
    """Print the fusion reports saved in a debug directory (``*.report.txt``, written by ``fxfuse.debug(dir)`` or
    ``options["debug_dir"]``): the run's summary by pass first (what ``fxfuse.report()`` prints), then each graph's
    report, oldest first."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fxfuse report", description=_report.__doc__)
    ap.add_argument("debug_dir", help="the directory given to fxfuse.debug() or options['debug_dir']")
    args = ap.parse_args(list(argv))
    if not os.path.isdir(args.debug_dir):
        print(f"fxfuse report: {args.debug_dir} is not a directory", file=sys.stderr)
        return 1
    files = sorted(glob.glob(os.path.join(args.debug_dir, "**", "*.report.txt"), recursive=True),
                   key=lambda f: (os.path.getmtime(f), f))
    if not files:
        print(f"fxfuse report: no *.report.txt in {args.debug_dir} (compile with fxfuse inside "
              f"`with fxfuse.debug({args.debug_dir!r}):` or with options={{'debug_dir': {args.debug_dir!r}}})",
              file=sys.stderr)
        return 1
    graphs = []
    for f in files:
        try:
            with open(f[:-len(".txt")] + ".json") as fh:
                graphs.append(FusionReport.from_dict(json.load(fh)))
        except (OSError, ValueError, KeyError, TypeError):  # a report written before the JSON twin existed
            pass
    if graphs:
        print(RunReport.of(graphs))
        print()
    for i, f in enumerate(files):
        if i:
            print()
        print(f"# {os.path.relpath(f, args.debug_dir)}")
        with open(f) as fh:
            print(fh.read().rstrip("\n"))
    return 0


def _version(module: str) -> str:
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "installed (no version)"))
    except Exception as e:  # ImportError or a broken install: say which
        return "not installed" if isinstance(e, ImportError) else f"broken ({type(e).__name__}: {e})"


def _triton_status() -> str:
    import torch

    from .kernels.triton_support import HAVE_TRITON

    if not HAVE_TRITON:
        return "no: triton is not installed (every fused op uses its PyTorch path)"
    if torch.cuda.is_available():
        return "yes, on the GPU (CUDA driver found)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "yes, through the interpreter (TRITON_INTERPRET=1: for tests, slow)"
    return ("no GPU: fused ops use their PyTorch CPU paths (TRITON_INTERPRET=1 before importing triton runs the "
            "kernels through the interpreter, for tests)")


def _smoke_inputs(name: str, device: str):
    """A tiny call of each public fused op (forward + backward) to show it runs on ``device``."""
    import torch

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device).requires_grad_()

    if name == "linear_cross_entropy":
        return (rnd(6, 8), rnd(16, 8), torch.randint(0, 16, (6,), generator=g).to(device)), {}
    if name == "linear_log_probs":
        return (rnd(6, 8), rnd(16, 8), torch.randint(0, 16, (6,), generator=g).to(device)), {}
    if name in _COLLECTIVE_OPS:  # one rank holding the whole vocabulary (see _sample_context)
        return (rnd(6, 8), rnd(16, 8), torch.randint(0, 16, (6,), generator=g).to(device)), {"vocab_size": 16}
    if name == "lora_linear":
        return (rnd(6, 8), rnd(12, 8), rnd(2, 8), rnd(12, 2), 0.5), {}
    if name == "softcap_attention":
        return (rnd(1, 2, 4, 8), rnd(1, 2, 4, 8), rnd(1, 2, 4, 8)), {"causal": True}
    return None


#: the public ops that run collectives (tensor parallelism): their sample calls need a process group
_COLLECTIVE_OPS = ("vocab_parallel_cross_entropy", "vocab_parallel_log_probs")


@contextlib.contextmanager
def _sample_context(name: str):
    """Where the sample call of op ``name`` runs: for an op that runs collectives, in the program's default process
    group if it has one, else in a one-rank gloo group of this process, destroyed afterwards."""
    import torch.distributed as dist

    if name not in _COLLECTIVE_OPS or not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _launched_kernels(module, JITFunction) -> List[str]:
    """The ``@triton.jit`` functions of ``module`` that are launched as kernels (``name[grid](...)`` in its
    source), not the device helpers they call."""
    import inspect
    import re

    try:
        src = inspect.getsource(module)
    except (OSError, TypeError):
        src = ""
    return [k for k, v in vars(module).items() if isinstance(v, JITFunction) and re.search(rf"\b{k}\[", src)]


def _op_rows() -> List[Tuple[str, str, str]]:
    """(op, GPU kernel, CPU path) for every public op in fxfuse.ops: the Triton kernels in the kernel module the
    op's module uses, and whether a tiny forward + backward runs on the CPU here."""
    import importlib
    import types

    import torch

    from . import ops

    try:
        from triton.runtime.jit import JITFunction
    except Exception:
        JITFunction = None
    else:
        try:  # under TRITON_INTERPRET=1, @triton.jit makes InterpretedFunction objects instead
            from triton.runtime.interpreter import InterpretedFunction

            JITFunction = (JITFunction, InterpretedFunction)
        except Exception:
            pass
    rows = []
    for name in ops.__all__:
        fn = getattr(ops, name)
        mod = importlib.import_module(fn.__module__)
        kernels = [v for v in vars(mod).values() if isinstance(v, types.ModuleType)
                   and v.__name__.startswith((f"{__package__}.kernels.", f"{__package__}.attention."))]
        if JITFunction is None:
            gpu = "Triton kernels: unknown (triton not installed)"
        else:
            jit = sorted({k for km in kernels for k in _launched_kernels(km, JITFunction)})
            gpu = f"Triton: {len(jit)} kernel{'s' if len(jit) != 1 else ''}" if jit else "no Triton kernel"
        call = _smoke_inputs(name, "cpu")
        if call is None:
            cpu = "not checked (no sample call)"
        else:
            try:
                with _sample_context(name):
                    out = fn(*call[0], **call[1])
                    out = out[0] if isinstance(out, tuple) else out
                    out.float().sum().backward()
                cpu = "yes (PyTorch path: forward + backward ran)"
            except Exception as e:
                cpu = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]
        if torch.cuda.is_available() and call is not None:
            try:
                gcall = _smoke_inputs(name, "cuda")
                with _sample_context(name):
                    out = fn(*gcall[0], **gcall[1])
                    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
                    torch.cuda.synchronize()
                gpu += ", ran here"
            except Exception as e:
                gpu += f", FAILED here: {type(e).__name__}"
        rows.append((f"fxfuse.ops.{name}", gpu, cpu))
    return rows


def _doctor(argv: Sequence[str]) -> int:
    """Versions, GPU, whether Triton can run kernels here, and each fused op's GPU kernel and CPU path."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fxfuse doctor", description=_doctor.__doc__)
    ap.parse_args(list(argv))
    import torch

    import fxfuse

    print("== versions ==")
    print(f"  {'python':<13} {platform.python_version()} ({sys.executable})")
    for mod in ("torch", "triton", "transformers", "peft", "trl"):
        print(f"  {mod:<13} {_version(mod)}")
    print(f"  {'fxfuse':<13} {fxfuse.__version__} ({os.path.dirname(os.path.abspath(fxfuse.__file__))})")
    print("== device ==")
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"  GPU           {', '.join(gpus)} (CUDA {torch.version.cuda})")
    else:
        print("  GPU           no GPU")
    print(f"  Triton runs   {_triton_status()}")
    print("== fused ops ==")
    rows = _op_rows()
    w = max(len(r[0]) for r in rows)
    for op, gpu, cpu in rows:
        print(f"  {op:<{w}}  GPU: {gpu}; CPU: {cpu}")
    print("== passes ==")
    for s in fxfuse.registered_passes():
        opts = ", ".join(f"{k}={v.show_default()}" for k, v in s.options.items())
        off = "" if s.enabled_by_default else "  [off by default: options={'passes': {'%s': True}}]" % s.name
        print(f"  {s.name:<22} {s.description}" + (f"  [options: {opts}]" if opts else "") + off)
    return 0 if all(not r[2].startswith("FAILED") and "FAILED" not in r[1] for r in rows) else 1


#: subcommand -> (one-line description, function(argv) -> exit code)
COMMANDS: Dict[str, Tuple[str, Callable[[Sequence[str]], int]]] = {
    "demo": ("train a tiny model with fxfuse and with Inductor; show the loss curves, the fusions and the "
             "memory saved (about a minute on a CPU)", _demo),
    "report": ("print the fusion reports saved in a debug directory: python -m fxfuse report <debug_dir>", _report),
    "doctor": ("versions, GPU, whether Triton can run kernels here, and each fused op's GPU kernel and CPU path",
               _doctor),
}


def _usage() -> str:
    return "usage: python -m fxfuse {" + ",".join(COMMANDS) + "} [args...]   (python -m fxfuse --help)"


def _help() -> str:
    lines = [_usage(), "", "fxfuse: a torch.compile backend that fuses LLM training graphs.", "", "commands:"]
    lines += [f"  {name:<8} {desc}" for name, (desc, _) in COMMANDS.items()]
    lines += ["", "python -m fxfuse <command> --help shows a command's own options."]
    return "\n".join(lines)


def _main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None and os.path.basename(sys.argv[0]) == "fxfuse-demo":
        return demo_main()  # a console script installed when pyproject pointed fxfuse-demo here
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help", "help"):
        print(_help())
        return 0
    if not args or args[0] not in COMMANDS:
        if args:
            print(f"python -m fxfuse: unknown command {args[0]!r}", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    return COMMANDS[args[0]][1](args[1:])


def demo_main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``fxfuse-demo`` console script: the demo, with no subcommand to type."""
    return _demo(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(_main())
