"""Inductor in a background process: a graph runs AOTAutograd-only until a compile of it is in Inductor's caches.

``options={"background_compile": True}`` (off by default). Without it, the first call of a graph waits for Inductor:
tracing the joint graph, lowering, code generation, Triton's compiles (and the backward's at the first backward),
5-9 s for one Llama-8B layer graph under FSDP2 on the H200 hosts, while the GPUs idle. With it, the backend lowers
the rewritten graph with AOTAutograd alone (``compiler="aot_eager"``'s lowering, the min-cut partition Inductor
uses: fxfuse's fused ops run their kernels, the rest ATen's eager ones) and hands the same graph to a compile
process, which compiles it with Inductor (forward and backward) into Inductor's on-disk caches. The calls run the
AOTAutograd version meanwhile; at the first safe call after the process is done, the graph is compiled here with
``compile_fx`` as without the option, AOTAutograd's entry and its FX graphs now cache hits (what remains is
loading them), and the calls switch to it. Inductor's cache keys read more than its config, so the child also
takes this process's thread count, deterministic-algorithms mode, float32 matmul settings and cache directory. A
child that failed only means that compile is cold.

Why a process and not a thread: FX's tracer (which AOTAutograd and Inductor's pattern matcher run) patches
``torch.nn.Module.__call__`` and ``__getattr__`` process-wide while it traces, and a Dynamo-compiled function refuses
to run meanwhile ("Detected that you are using FX to symbolically trace a dynamo-optimized function"): a compile on a
thread breaks the training loop's module calls beside it. Inductor's own async compile mode is out of process too.

The switch happens only where it is safe: never inside a backward, and never while a call that ran the AOTAutograd
version under non-reentrant activation checkpointing still waits for its recompute (the recompute must run the same
graph as its forward, or the saved tensors would not line up). Otherwise the two versions are interchangeable: each
call is its own autograd node.

Where it is not used (the reason is in the fusion report's ``lowering``): the graph has symbolic sizes (Inductor may
add shape guards while it compiles, and a frame's guards are fixed when Dynamo finishes it; Dynamo's second, dynamic
compile when lengths vary compiles at once, as without the option); the graph cannot be sent to another process (an
op of a library other than torch and fxfuse, which the compile process does not import; a user's post-grad pass; an
input view off 16-byte alignment); Inductor's FX graph cache off; nothing for Inductor (``compiler="auto"``'s rule) or
``compiler="aot_eager"``. Costs: the first steps run unfused elementwise kernels (slower; larger transient buffers),
and the compile process holds a CUDA context on its GPU (not measured) until its queue is empty. Its Inductor
worker pool takes its share of the host's cores (the cores over torchrun's ranks on the host, less one for the
rank's own process), not Inductor's default of up to 32 per process. The process and its workers run at a lower
scheduling priority (``nice`` :data:`CHILD_NICENESS`, env ``FXFUSE_BACKGROUND_NICE``; 0 keeps the caller's): their
compile is background work, and on a loaded host the training ranks' first steps (Python-bound: tracing, FSDP's
hooks, fxfuse's own Triton JIT) must not wait for cores behind it.

Several ranks (a default process group of more than one): a rank's switch takes seconds, during which the other
ranks wait at their next collective. Were each rank to switch when its own child is done, every rank's switch would
stall the others in turn. So a graph is ready to switch only once every rank's child is done with it: each rank
counts itself in on the group's store (the key: the graph's name and how many graphs of that name came before; a
thread waits there, never the training loop), and the ranks, in step with each other, then switch at about the
same call. A rank that does not come within :data:`RANKS_AGREE_TIMEOUT_S` (it compiled that graph at once, or
crashed) only means the others switch on their own: this decides when, never what, runs.
:func:`wait_for_background_compiles` waits for every child compile; :func:`background_compiles` lists them.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

__all__ = ["BackgroundJob", "CannotCompileInBackground", "reason_not_to_compile_in_background", "compile_in_background",
           "start_background_compile_process",
           "background_compiles", "wait_for_background_compiles"]

_SYMBOLIC = "symbolic sizes (Inductor's shape guards must be in place when Dynamo finishes the frame)"


@dataclass
class BackgroundJob:
    """One graph's background compile, as :func:`background_compiles` lists it."""

    name: str
    #: compiling (in the child) -> cached (the child is done) / failed (the child's error) -> switched (compiled
    #: here, the calls run Inductor's version)
    state: str = "compiling"
    send_seconds: float = 0.0  # here, in the first call: the graph and its inputs prepared and pickled
    child_seconds: float = 0.0  # the child's compile (its wall time)
    switch_seconds: float = 0.0  # the compile here at the switch (loading the cache entries)
    queued_seconds: float = 0.0  # from sending it to the child's start on it (its imports, earlier jobs)
    #: the child's start-up, seconds from its launch: "fxfuse" (imported: torch, Triton, fxfuse's ops and passes),
    #: "inductor" (Inductor's compiler imported, ready for jobs)
    child_startup: Dict[str, float] = field(default_factory=dict)
    error: str = ""
    eager_calls: int = 0  # calls that ran the AOTAutograd version
    compiled_calls: int = 0
    cache_hits: Dict[str, int] = field(default_factory=dict)  # the compile here: Inductor's counters
    note: str = ""  # e.g. why the ranks did not switch together
    _future: Optional[Future] = field(default=None, repr=False)


_jobs: List[BackgroundJob] = []
_lock = threading.Lock()
#: AOTAutograd cache hits of the switches here: graphs fxfuse's passes ran on (and reported) in this process, which
#: the count of graphs served from the cache without a report (fxfuse.api, under install()) leaves out
aot_cache_hits_of_switches = 0
RANKS_AGREE_TIMEOUT_S = 120.0  # how long a rank whose child is done waits for the other ranks' (module docstring)


# -- the ranks' agreement ------------------------------------------------------------------------------------
def _ranks_to_agree() -> Optional[Tuple[Any, int]]:
    """(the default process group's store, its world size) where it has more than one rank, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store(), dist.get_world_size()


def _agree(key: str, store: Any, world_size: int, job: BackgroundJob, ready: Future) -> None:
    """On its own thread: count this rank in under ``key``; the last rank to come says so under ``key/all``, which
    every rank waits for. Then the graph may switch here."""
    try:
        if store.add(key, 1) >= world_size:
            store.set(key + "/all", "1")
        store.wait([key + "/all"], timedelta(seconds=RANKS_AGREE_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001  (timed out, or the store is gone: switch on this rank's own)
        job.note = f"switched without the other ranks: {type(e).__name__}: {e}"[:300]
    ready.set_result(None)


# -- the compile child ---------------------------------------------------------------------------------------
def _message(obj: Any) -> bytes:
    data = pickle.dumps(obj)
    return struct.pack("<Q", len(data)) + data


def _write_message(f, obj: Any) -> None:
    f.write(_message(obj))
    f.flush()


def _read_message(f) -> Any:
    head = f.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(f.read(n))


class _Child:
    """One compile process (``python -m fxfuse.background_inductor``): jobs in order over its stdin, results over
    its stdout. Two threads here move bytes only (the pickles are made on the caller's thread): a writer, since a
    payload larger than the pipe's buffer blocks until the child reads it (it may still be importing torch, or
    compiling the previous job), and a reader that resolves the futures. It exits when its stdin closes: when no
    job of it is pending (:func:`_submit` starts another)."""

    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        log = os.environ.get("FXFUSE_BACKGROUND_LOG")  # the child's stderr (Inductor's logs, with TORCH_LOGS)
        env["FXFUSE_BACKGROUND_RANKS_HERE"] = os.environ.get("LOCAL_WORLD_SIZE", "1")  # torchrun's: cores to share
        env["FXFUSE_BACKGROUND_LAUNCHED_AT"] = repr(time.time())  # the child times its start-up from here
        self.proc = subprocess.Popen([sys.executable, "-m", "fxfuse.background_inductor"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env,
                                     stderr=open(log, "ab") if log else subprocess.DEVNULL)
        self.pending: Dict[int, Future] = {}
        self.closed = False
        self.outbox: "queue.Queue[Optional[bytes]]" = queue.Queue()
        threading.Thread(target=self._write, name="fxfuse-compile-child-in", daemon=True).start()
        threading.Thread(target=self._read, name="fxfuse-compile-child-out", daemon=True).start()

    def _write(self) -> None:
        while True:
            data = self.outbox.get()
            try:
                if data is None:
                    self.proc.stdin.close()
                    return
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except Exception:  # the child is gone: the reader fails what is pending
                return

    def _read(self) -> None:
        try:
            while True:
                msg = _read_message(self.proc.stdout)
                with _lock:
                    fut = self.pending.pop(msg["id"], None)
                    if not self.pending and not self.closed:
                        self.closed = True
                        self.outbox.put(None)
                if fut is not None:
                    fut.set_result(msg)
        except Exception:
            pass
        with _lock:
            self.closed = True
            pending, self.pending = dict(self.pending), {}
        for fut in pending.values():
            fut.set_result({"ok": False, "seconds": 0.0, "error": "the compile process exited"})

    def submit(self, job_id: int, data: bytes) -> Optional[Future]:
        fut: Future = Future()
        fut.submitted_at = time.time()  # the child's answer says when it started on it
        with _lock:
            if self.closed or self.proc.poll() is not None:
                return None
            self.pending[job_id] = fut
            self.outbox.put(data)
        return fut


_child: Optional[_Child] = None


def _forget_after_fork() -> None:  # a forked child (a DataLoader worker) has none of the parent's pipes or threads
    global _child, _lock
    _child, _lock = None, threading.Lock()
    _jobs.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_after_fork)


def _stop_child() -> None:
    """Let the compile process finish what it has and exit (tests: each starts with none)."""
    global _child
    with _lock:
        child, _child = _child, None
        if child is not None and not child.closed:
            child.closed = True
            child.outbox.put(None)


def start_background_compile_process() -> None:
    """Start the compile process that ``background_compile=True`` hands its graphs to, now, if none is running.

    ``fxfuse.compile()`` / ``compile_regions()`` with the option call it too, but it takes seconds to import
    torch, fxfuse and Inductor's compiler (10.7 s to be ready on a 2x H200 host beside two ranks' first step), and
    the first graph waits for it. Called at the top of a training script, the process gets the model's build and
    sharding to make itself ready in: on 2x H200 at 8B widths Inductor's version then ran 7.2 s (full fine-tune)
    and 4.4 s (LoRA) sooner; the first step itself did not shorten (one run each). Each graph brings Inductor's config
    and cache directory with it; environment variables set after this call do not reach the process."""
    global _child
    with _lock:
        if _child is None or _child.closed:
            _child = _Child()


def _submit(job_id: int, payload: Dict[str, Any]) -> Future:
    global _child
    data = _message(dict(payload, id=job_id))
    for _ in range(2):  # the current child, or a new one where it has closed
        if _child is None:
            _child = _Child()
        fut = _child.submit(job_id, data)
        if fut is not None:
            return fut
        _child = None
    fut = Future()
    fut.set_result({"ok": False, "seconds": 0.0, "error": "could not start the compile process"})
    return fut


#: How much lower the compile process's scheduling priority is than the training process's (``os.nice``; inherited
#: by Inductor's worker processes). ``FXFUSE_BACKGROUND_NICE=0`` keeps it equal.
CHILD_NICENESS = int(os.environ.get("FXFUSE_BACKGROUND_NICE", "10"))


def _child_main() -> None:
    """The compile process: for each job, rebuild the graph and compile it (forward and backward) with Inductor,
    which leaves the FX graphs in its on-disk caches; answer with the time or the error."""
    if CHILD_NICENESS > 0 and hasattr(os, "nice"):
        try:
            os.nice(CHILD_NICENESS)  # before anything starts: the imports and every worker process inherit it
        except OSError:
            pass
    proto = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints from torch or Inductor must not reach the protocol
    launched = float(os.environ.get("FXFUSE_BACKGROUND_LAUNCHED_AT", time.time()))
    importlib.import_module("fxfuse")  # registers torch.ops.fxfuse.*, which the graphs call
    startup = {"fxfuse": time.time() - launched}
    # Tracing a fused op starts compiling its Triton kernels ahead (kernels/background_compile.py): the training
    # process does that, here it would only take cores from Inductor
    importlib.import_module("fxfuse.kernels.background_compile").ENABLED = False
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    startup["inductor"] = time.time() - launched
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:  # Inductor's pool: this process's share of the cores
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // max(1, int(os.environ.get("FXFUSE_BACKGROUND_RANKS_HERE", "1"))) - 1)
    else:
        threads = None
    stdin = sys.stdin.buffer
    while True:
        try:
            job = _read_message(stdin)
        except EOFError:
            return
        t0, started_at = time.perf_counter(), time.time()
        try:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = job["cache_dir"]  # the parent's now (it may have moved)
            if job.get("inductor_config") is not None:
                torch._inductor.config.load_config(job["inductor_config"])
            if threads is not None:  # not part of any cache key
                torch._inductor.config.compile_threads = min(threads, torch._inductor.config.compile_threads or threads)
            _apply_process_settings(job["settings"])
            fake_mode = FakeTensorMode(shape_env=ShapeEnv())
            gm, example_inputs = GraphPickler.loads(job["graph"], fake_mode)
            for node, source in zip(gm.graph.find_nodes(op="placeholder"), job["sources"]):
                node._dynamo_source = source
            gm.meta.update(job["meta"])
            if job["param_sources"] is not None:
                gm._param_name_to_source = job["param_sources"]
            patches = dict(job["patches"])
            patches["post_grad_custom_post_pass"] = _post_grad_pass(job["post_grad_uuid"], job["tp_all_reduce_blocks"])
            if job["device"] is not None:
                torch.cuda.set_device(job["device"])
            with tracing(TracingContext(fake_mode)), \
                    torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                _restore_example_values(gm, example_inputs, fake_mode)
                compile_fx(gm, example_inputs, config_patches=patches)
            _write_message(proto, {"id": job["id"], "ok": True, "seconds": time.perf_counter() - t0, "error": "",
                                   "started_at": started_at, "startup": startup})
        except BaseException as e:  # noqa: BLE001  (any failure is the answer, not the child's end)
            _write_message(proto, {"id": job["id"], "ok": False, "seconds": time.perf_counter() - t0,
                                   "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}",
                                   "started_at": started_at, "startup": startup})


def _process_settings() -> Dict[str, Any]:
    """The process-wide settings besides Inductor's config that Inductor's cache keys read (and the compile honours):
    the child takes the parent's, or every lookup here would miss."""
    cuda_matmul = torch.backends.cuda.matmul
    settings = dict(
        num_threads=torch.get_num_threads(),  # a CPU graph's C++ code is generated for it
        deterministic=(torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled()),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        allow_tf32=cuda_matmul.allow_tf32,
        allow_fp16_reduced=cuda_matmul.allow_fp16_reduced_precision_reduction,
        allow_bf16_reduced=cuda_matmul.allow_bf16_reduced_precision_reduction,
    )
    if hasattr(cuda_matmul, "fp32_precision"):  # torch >= 2.9's spelling, its own value in the key
        settings["fp32_precision"] = cuda_matmul.fp32_precision
    return settings


def _apply_process_settings(settings: Dict[str, Any]) -> None:
    """Each setting the child does not already have, through its setter (a setter may move related values: only a
    difference is applied, and fp32_precision, which the others move, last)."""
    cuda_matmul = torch.backends.cuda.matmul
    setters = dict(
        num_threads=torch.set_num_threads,
        deterministic=lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        float32_matmul_precision=torch.set_float32_matmul_precision,
        allow_tf32=lambda v: setattr(cuda_matmul, "allow_tf32", v),
        allow_fp16_reduced=lambda v: setattr(cuda_matmul, "allow_fp16_reduced_precision_reduction", v),
        allow_bf16_reduced=lambda v: setattr(cuda_matmul, "allow_bf16_reduced_precision_reduction", v),
        fp32_precision=lambda v: setattr(cuda_matmul, "fp32_precision", v),
    )
    for key, setter in setters.items():
        now = _process_settings()
        if key in settings and key in now and now[key] != settings[key]:
            setter(settings[key])


def _post_grad_pass(uuid: Any, tp_all_reduce_blocks: int):
    """fxfuse's post-grad pass as :meth:`PassManager.post_grad_pass` builds it (no user pass before it), with the
    parent's ``uuid()``: Inductor's cache keys must be the parent's, and so must what the pass does."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from .comm_overlap import rewrite_tp_all_reduces
    from .ops.host_offload import fold_round_trips

    class FxFusePostGrad(CustomGraphPass):
        def __call__(self, graph):
            fold_round_trips(graph)
            rewrite_tp_all_reduces(graph, tp_all_reduce_blocks)

        def uuid(self):
            return uuid

    return FxFusePostGrad()


# -- the backend's side ----------------------------------------------------------------------------------------
def reason_not_to_compile_in_background(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Optional[str]:
    """Why ``gm`` must compile at once (see the module docstring), or None."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    for x in example_inputs:
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) or (
                isinstance(x, torch.Tensor) and free_symbols(x)):
            return _SYMBOLIC
    for node in gm.graph.nodes:
        if free_symbols(node.meta.get("val")) or free_symbols(node.meta.get("example_value")):
            return _SYMBOLIC
    return None


# Op namespaces a fresh ``import torch, fxfuse`` (the compile process) registers; an op of any other library would
# not unpickle there
_KNOWN_OP_NAMESPACES = {"aten", "prims", "fxfuse", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional",
                        "rngprims"}


def _foreign_op(gm: fx.GraphModule) -> Optional[str]:
    """The first op in ``gm`` of a library the compile process would not have imported, as ``ns::name``, or None."""
    for node in gm.graph.nodes:
        t = node.target
        if node.op != "call_function" or not isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            continue
        name = t.name() if isinstance(t, torch._ops.OpOverload) else t._qualified_op_name  # "ns::op[.overload]"
        if name.split("::")[0] not in _KNOWN_OP_NAMESPACES:
            return name
    return None


def _graph_to_send(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its own graph and without its nodes' example values and Dynamo's records of its inputs (which
    hold the real tensors; node meta dicts are copies). AOTAutograd
    traces the graph again from its inputs, so neither side needs them, and GraphPickler cannot take a view's fake
    tensor. Both the child and this process compile this one: the same graph, the same cache keys."""
    sent = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    sent.meta = dict(getattr(gm, "meta", {}))
    if hasattr(gm, "_param_name_to_source"):
        sent._param_name_to_source = gm._param_name_to_source
    for src, dst in zip(gm.graph.find_nodes(op="placeholder"), sent.graph.find_nodes(op="placeholder")):
        if hasattr(src, "_dynamo_source"):
            dst._dynamo_source = src._dynamo_source
    for node in sent.graph.nodes:
        for key in ("val", "example_value", "grapharg"):  # grapharg: Dynamo's record of the input, the real tensor
            node.meta.pop(key, None)
    return sent


def _restore_example_values(gm: fx.GraphModule, inputs: Sequence[Any], fake_mode) -> None:
    """Give the sent graph's nodes example values again, the same way in both processes (fake propagation from
    the sent inputs). AOTAutograd's cache takes a graph only where each method call's receiver has one (its
    ``check_cacheable``): without them every switch traced and partitioned the graph again (its cache bypassed,
    only Inductor's FX graph cache hit). Node meta is not part of either cache key; the graph's code is."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta.pop("val")


def _inputs_to_send(fake_mode, example_inputs: Sequence[Any]) -> List[Any]:
    """Fake copies of the example inputs that GraphPickler can take: a view (FSDP2's unsharded parameters are views
    of the all-gather buffer) becomes a tensor of its own with the same sizes, strides, dtype, device and
    requires_grad, and Parameters stay Parameters. Inductor reads one more thing from an input, whether its data
    is 16-byte aligned (it assumes so for those that were, and copies a misaligned one at run time): a view off
    that alignment cannot be stood in for (raises)."""
    out = []
    for t in example_inputs:
        if not isinstance(t, torch.Tensor):
            out.append(t)
            continue
        if t._is_view() or t.storage_offset():
            if (t.storage_offset() * t.element_size()) % 16:
                raise CannotCompileInBackground("an input is a view whose data is not 16-byte aligned")
            with fake_mode:
                fresh = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
            fresh = (torch.nn.Parameter(fresh, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter)
                     else fresh.requires_grad_(t.requires_grad))
            out.append(fresh)
        else:
            out.append(fake_mode.from_tensor(t))
    return out


def _payload(sent: fx.GraphModule, inputs: Sequence[Any], patches: Dict[str, Any]) -> Dict[str, Any]:
    """What the child needs to compile ``sent`` as this process will (raises where something cannot be sent)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch.fx._graph_pickler import GraphPickler, Options

    patches = dict(patches)
    post_grad = patches.pop("post_grad_custom_post_pass", None)
    if getattr(post_grad, "user_passes", None) != [] or getattr(post_grad, "fxfuse_key", None) is None:
        raise ValueError("a user's post-grad pass runs before fxfuse's (the child cannot rebuild it)")
    uuid = post_grad.uuid()
    try:
        inductor_config = torch._inductor.config.save_config_portable()
    except Exception:  # a config the child cannot take: its own defaults (a cache miss at worst)
        inductor_config = None
    device = next((t.device.index for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"), None)
    return dict(
        graph=GraphPickler.dumps((sent, list(inputs)), Options(ops_filter=None)),
        sources=[getattr(n, "_dynamo_source", None) for n in sent.graph.find_nodes(op="placeholder")],
        meta=dict(sent.meta), param_sources=getattr(sent, "_param_name_to_source", None),
        patches=patches, post_grad_uuid=uuid, tp_all_reduce_blocks=getattr(post_grad, "tp_all_reduce_blocks", 0),
        inductor_config=inductor_config, settings=_process_settings(),
        cache_dir=cache_dir(), device=device)


def _checkpoint_phase() -> Optional[str]:
    """"forward" inside a non-reentrant activation checkpoint's forward, "recompute" inside its recompute."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    name = getattr(hooks[0], "__qualname__", "")
    if name.startswith("_checkpoint_hook"):
        return "forward"
    if name.startswith("_recomputation_hook"):
        return "recompute"
    return None


@contextlib.contextmanager
def _saved_tensors_hooks_suspended():
    """No saved-tensor hooks while the switch compiles: a switch may come inside an activation checkpoint's forward,
    and whatever the compile runs (loading AOTAutograd's cache entry) must not be packed into that checkpoint's
    saved tensors, or its recompute would not line up with them."""
    stack = []
    while torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        stack.append(torch._C._autograd._top_saved_tensors_default_hooks(True))
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


class _SwitchWhenCached:
    """The callable handed back to Dynamo: the AOTAutograd version until the child is done and the switch is safe
    (module docstring), then ``compile_now()``'s (Inductor's, from its caches)."""

    def __init__(self, eager_fn: Callable, compile_now: Callable[[], Callable], job: BackgroundJob):
        self._eager_fn = eager_fn
        self._compile_now = compile_now
        self._compiled: Optional[Callable] = None
        self._job = job
        self._awaiting_recompute = 0  # eager calls under a non-reentrant checkpoint whose recompute has not run

    def _try_switch(self) -> None:
        fut = self._job._future
        if fut is None or not fut.done() or self._awaiting_recompute or torch._C._current_graph_task_id() != -1:
            return
        self._job._future = None
        t0 = time.perf_counter()
        counters = torch._dynamo.utils.counters
        keys = [("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss")]
        before = {k: counters[a][k] for a, k in keys}
        with _saved_tensors_hooks_suspended():
            self._compiled = self._compile_now()  # as without the option: an error here is the compile's own
        self._job.cache_hits = {k: counters[a][k] - before[k] for a, k in keys}
        global aot_cache_hits_of_switches
        aot_cache_hits_of_switches += self._job.cache_hits["autograd_cache_hit"]
        self._job.switch_seconds = time.perf_counter() - t0
        self._job.state = "switched"
        self._eager_fn = self._compile_now = None  # nor the graph and its inputs kept for the compile

    def __call__(self, *args: Any) -> Any:
        if self._compiled is None:
            self._try_switch()
        if self._compiled is not None:
            self._job.compiled_calls += 1
            return self._compiled(*args)
        self._job.eager_calls += 1
        if torch.is_grad_enabled():
            phase = _checkpoint_phase()
            if phase == "forward":
                self._awaiting_recompute += 1
            elif phase == "recompute" and self._awaiting_recompute:
                self._awaiting_recompute -= 1
        return self._eager_fn(*args)


def compile_in_background(gm: fx.GraphModule, example_inputs: Sequence[Any], patches: Dict[str, Any],
                          lower_eagerly: Callable[[fx.GraphModule, Sequence[Any]], Callable],
                          name: str) -> Optional[Callable]:
    """Lower ``gm`` with ``lower_eagerly`` now, send it to the compile child, and return the callable that switches
    to ``compile_fx(gm, ...)`` once the child has filled the caches (module docstring). Raises
    :class:`CannotCompileInBackground` (nothing started) where the graph cannot be sent: the caller compiles at
    once."""
    from torch._guards import CompileContext, TracingContext, compile_context, detect_fake_mode, tracing
    from torch._inductor.compile_fx import compile_fx

    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise CannotCompileInBackground("no fake mode (not called by Dynamo)")
    if torch._inductor.config.force_disable_caches or not torch._inductor.config.fx_graph_cache:
        raise CannotCompileInBackground("Inductor's FX graph cache is off (the child hands its work over through it)")
    foreign = _foreign_op(gm)
    if foreign is not None:
        raise CannotCompileInBackground(f"the op {foreign} is another library's: the compile process would not have it")
    t0 = time.perf_counter()
    try:
        sent = _graph_to_send(gm)
        inputs = _inputs_to_send(fake_mode, example_inputs)
        payload = _payload(sent, inputs, patches)
    except CannotCompileInBackground:
        raise
    except Exception as e:  # noqa: BLE001
        raise CannotCompileInBackground(f"cannot send it to the compile process: {type(e).__name__}: {e}"[:300]
                                        ) from None
    compile_id = CompileContext.current_compile_id()

    def compile_now() -> Callable:
        with compile_context(CompileContext(compile_id)), tracing(TracingContext(fake_mode)), \
                torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            _restore_example_values(sent, inputs, fake_mode)
            return compile_fx(sent, inputs, config_patches=patches)

    job = BackgroundJob(name=name, send_seconds=time.perf_counter() - t0)
    eager_fn = lower_eagerly(gm, example_inputs)
    with _lock:
        job_id = len(_jobs)
        same_name = sum(j.name == name for j in _jobs)
        _jobs.append(job)
    ranks = _ranks_to_agree()
    ready: Future = Future()  # the child is done, and so are the other ranks' (module docstring)

    def done(f: Future, job=job) -> None:
        msg = f.result()
        job.child_seconds = msg["seconds"]
        if "started_at" in msg and hasattr(f, "submitted_at"):
            job.queued_seconds = max(0.0, msg["started_at"] - f.submitted_at)
        job.child_startup = {k: round(v, 2) for k, v in msg.get("startup", {}).items()}
        if job.state == "compiling":
            job.state, job.error = ("cached", "") if msg["ok"] else ("failed", msg["error"])
        if ranks is None:
            ready.set_result(None)
        else:
            threading.Thread(target=_agree, args=(f"fxfuse/background_compile/{name}/{same_name}", *ranks, job,
                                                  ready), name="fxfuse-background-ranks", daemon=True).start()
    job._future = ready
    _submit(job_id, payload).add_done_callback(done)
    return _SwitchWhenCached(eager_fn, compile_now, job)


class CannotCompileInBackground(Exception):
    """The graph cannot be compiled in the child (the message says why)."""


def background_compiles() -> List[BackgroundJob]:
    """Every background compile of this process, oldest first (name, state, the child's and the switch's seconds,
    error, and how many calls ran each version)."""
    with _lock:
        return list(_jobs)


def wait_for_background_compiles(timeout: Optional[float] = None) -> bool:
    """Wait for every compile child job (and, with several ranks, for the other ranks' children: module
    docstring); True if none is left running (``timeout`` seconds at most, None: no limit). The graphs switch to
    Inductor's version at their next safe call; a failed child compile counts as finished (that switch then
    compiles cold)."""
    import concurrent.futures as cf

    futures = [j._future for j in background_compiles() if j._future is not None]
    _, not_done = cf.wait(futures, timeout=timeout)
    return not not_done


if __name__ == "__main__":
    _child_main()
