"""FSDP2 training step, whole-model vs regional compilation, fxfuse beside Inductor (the shape and method of the
anchor probe ``fsdp2_probe.py``: Llama-3.2-1B shape full fine-tune, fp32 master weights with bf16 params / fp32
reduce, ``fully_shard`` per layer and root, 2x2048 tokens per GPU, AdamW). ``FSDP_TAIL=1`` adds accelerate's units:
the embeddings, and [final norm, lm-head] kept gathered after the forward (the lm-head then carries FSDP2's hooks).

Impl (argv[1]):
  inductor           torch.compile(model)                                   whole model, Inductor
  inductor-regional  torch.compile(layer.forward) per decoder layer          regional, Inductor (torchtitan style)
  fxfuse             torch.compile(model, backend="fxfuse")                 whole model
  fxfuse-regions     fxfuse.compile_regions(model)                          blocks + lm-head loss; base model, hooks eager
  fxfuse-regions-nopass  compile_regions with every fxfuse pass off       the structure alone (Inductor kernels)
  fxfuse-regions-nolora  compile_regions with the LoRA passes off
  fxfuse-layer       torch.compile(layer.forward, backend="fxfuse") per layer   inductor-regional's structure
  eager

Run on one GPU (the issue's measurement) or several, from the repository root:
  for i in inductor inductor-regional fxfuse fxfuse-regions; do
      PYTHONPATH=. torchrun --nproc_per_node 1 benchmarks/bench_fsdp2.py $i; done
Rank 0 appends a row (tokens/s per GPU, peak, first-step time, losses, graphs, fused sites) to $OUT/fsdp2.jsonl.
``setup_s`` is the process's time before the first step (imports, model build, sharding, the compile call),
``start_to_first_step_s`` the two together.

Environment (the issue-20 shapes): ``FSDP_SHAPE=8b`` (Llama-3-8B widths: hidden 4096, 14336, 32 / 8 heads, untied
128256 vocab; default ``1b``), ``FSDP_LAYERS`` (default 16), ``FSDP_SEQ`` (tokens per row, 2 rows per GPU; default
2048), ``FSDP_LORA=1`` (PEFT LoRA r16 on all seven projections, base weights frozen), ``FSDP_STEPS`` (timed steps,
default 8), ``FSDP_ROWS`` (rows per GPU, default 2), ``FSDP_PAD=1`` (rows after the first right-padded from 3/4 of their
length: HF's mask tensor), ``FSDP_PASSES_OFF`` (comma-separated fxfuse passes turned off for ``fxfuse-regions``),
``FSDP_COMPILER`` (fxfuse's ``compiler`` option for ``fxfuse-regions``: ``inductor`` lowers the loss graph with Inductor
too), ``FSDP_SP=1`` (with ``FSDP_TP``: sequence parallelism too, torchtitan's plan: norms on each rank's part of the
sequence, all-gathers / reduce-scatters around attention and MLP; ``FSDP_ASYNC_TP=1`` adds Inductor's micro-pipelined
TP, CUDA only), ``FSDP_TP_BLOCKS`` (with ``FSDP_TP``: fxfuse's ``tp_all_reduce_blocks`` option for ``fxfuse-regions``,
default 1: 1 merges the all-reduces of summed input gradients, N >= 2 also splits all-reduced matmuls into N blocks,
0 leaves them), ``FSDP_COMM_OVERLAP`` (``0``: fxfuse's ``comm_overlap`` option off; ``1`` on ``inductor-regional``:
Inductor alone with the same compute / collective reordering; see ``fxfuse.comm_overlap``),
``FSDP_BACKGROUND=1`` (``fxfuse-regions`` with ``background_compile=True``: the row adds the steps until every
graph ran Inductor's version, ``early_steps_ms`` and ``to_compiled_s``, and each background compile: the child's and the
switch's seconds, the cache hits at the switch; ``FSDP_BACKGROUND_EARLY=1`` starts the compile process at the
script's start with ``fxfuse.start_background_compile_process()``), ``FSDP_CPROFILE=1`` (rank 0's first step under
cProfile, its top functions in ``$OUT/cprofile-IMPL.txt``: the first step's time is then inflated, compare it between
impls only), ``FSDP_SAMPLE=1`` (each rank's first step sampled every 5 ms by ``benchmarks/stack_sampler.py``: the row's
``first_step_sampled`` gives rank 0's seconds by frame, ``$OUT/sampled-IMPL*-rankR.json`` each rank's and
``$OUT/stacks-IMPL*-rankR.txt`` the collapsed stacks; the step is hardly slowed; ``FSDP_TAG`` is added to their names
and to the row). Every row has ``first_step_cpu_s`` (rank 0's main-thread and process CPU seconds in the first step, and
how busy the host was) and ``loss_step11`` (the loss of the 11th step, which background rows reach among their early
steps; ``loss_last`` is the last step's). Impl ``fxfuse-nolce`` is ``fxfuse`` with the lm-head pass off (the anchor
probe's third row).
Every first step starts with the ranks together (a barrier on the store; see ``_start_together``).
"""
import json
import os
import sys
import time

_T_SCRIPT = time.perf_counter()  # before torch's import: start_to_first_step_s counts the whole process

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Compile-time phases of the first step worth a line each (torch._dynamo.utils.compile_times, seconds summed over
# every graph of the process): tracing, fxfuse's and Inductor's passes, lowering, Triton codegen, waits.
_PHASES = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler",
           "create_aot_dispatcher_function", "compile_fx.<locals>.fw_compiler_base", "compile_fx_inner",
           "GraphLowering.codegen", "PyCodeCache.load_by_key_path", "async_compile.wait", "compile_file",
           "_recursive_joint_graph_passes", "build_guards",
           # the backward graphs compile at the first backward (AOTAutograd's lazy backward)
           "backward._backward_impl", "compile_fx.<locals>.bw_compiler")


class _TritonJitTimer:
    """Seconds this process spends in Triton's compiler (fxfuse's kernels at each new specialisation, and Inductor's
    if it compiles in-process; its worker pool's time shows as ``async_compile.wait``), by kernel name."""

    def __init__(self):
        self.by_kernel = {}

    def install(self):
        import triton.compiler

        compile_fn = triton.compiler.compile  # JITFunction reads it from triton.compiler at its first launch

        def timed(src, *a, **k):
            t = time.perf_counter()
            try:
                return compile_fn(src, *a, **k)
            finally:
                name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
                n, sec = self.by_kernel.get(name, (0, 0.0))
                self.by_kernel[name] = (n + 1, sec + time.perf_counter() - t)

        triton.compiler.compile = timed

    def summary(self):
        top = sorted(self.by_kernel.items(), key=lambda kv: -kv[1][1])
        return dict(triton_jit_s=round(sum(s for _, s in self.by_kernel.values()), 2),
                    triton_jit_kernels={k: [n, round(s, 2)] for k, (n, s) in top[:12]})


class _BackendSplit:
    """Where a compile backend's seconds go: fxfuse's pass manager (passes, fake propagation, validation, report),
    Inductor's ``compile_fx`` (outermost calls: AOTAutograd, lowering, codegen; the forward graph's, the backward's
    compile later at the first backward) and fxfuse's AOTAutograd-only lowering, summed over the process's graphs."""

    def __init__(self):
        self.s = {}

    def _wrap(self, owner, name, key):
        fn = getattr(owner, name)
        depth = [0]

        def timed(*a, **k):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    self.s[key] = self.s.get(key, 0.0) + time.perf_counter() - t

        setattr(owner, name, timed)

    def install(self):
        import torch._inductor.compile_fx as cf

        import fxfuse.backend
        import fxfuse.pass_manager

        self._wrap(cf, "compile_fx", "compile_fx_s")
        self._wrap(fxfuse.pass_manager.PassManager, "run", "fxfuse_pass_manager_s")
        self._wrap(fxfuse.backend, "_aot_eager", "fxfuse_aot_eager_s")

    def summary(self):
        return {k: round(v, 2) for k, v in self.s.items()}



def _attention_costs_nothing() -> None:
    """``FSDP_FLOOR=no-attention``: a bound, not a model. HF's "sdpa" attention becomes ``q + k + v`` (k and v
    repeated over their query heads), so every projection still gets its gradient and its GEMMs, and the step
    measures what the rest costs: the time no attention kernel, however fast, can take below. The losses of such a
    run mean nothing."""
    from transformers.integrations.sdpa_attention import repeat_kv
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def no_attention(module, query, key, value, attention_mask, **kwargs):
        groups = query.shape[1] // key.shape[1]
        return (query + repeat_kv(key, groups) + repeat_kv(value, groups)).transpose(1, 2).contiguous(), None

    ALL_ATTENTION_FUNCTIONS["sdpa"] = no_attention

def _start_together():
    """Every rank leaves here at about the same moment: a barrier on the process group's store (it starts no NCCL
    communicator; the first step's first all-gather still does, in every impl). The ranks' setups end seconds apart
    (1.2-1.4 s measured on two H200s), and without it the first rank's first step counted its wait for the last
    one's setup at its first collective (rows before the nineteenth session)."""
    store = dist.distributed_c10d._get_default_store()
    if store.add("bench_fsdp2/start", 1) == dist.get_world_size():
        store.set("bench_fsdp2/start/all", "1")
    store.wait(["bench_fsdp2/start/all"])


def _host_cpu_ticks():
    """(busy, total) clock ticks of the whole host from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return sum(v) - idle, sum(v)


def _cpu_clocks(before=None):
    """CPU seconds of this thread and process, and the host's busy share, since ``before`` (or now, to start):
    a main thread whose CPU seconds fall short of the wall time waited (a GPU sync, a lock, a child's pipe); a busy
    host says the rank shared its cores (the compile process, Inductor's workers, the other rank)."""
    now = dict(t=time.perf_counter(), thread=time.thread_time(), process=time.process_time(), host=_host_cpu_ticks())
    if before is None:
        return now
    out = dict(wall=round(now["t"] - before["t"], 2), main_thread=round(now["thread"] - before["thread"], 2),
               process=round(now["process"] - before["process"], 2))
    if now["host"] and before["host"]:
        busy, total = (a - b for a, b in zip(now["host"], before["host"]))
        out.update(host_busy=round(busy / max(total, 1), 3), host_cores=os.cpu_count())
    return out


def first_step_breakdown(timer, split=None):
    h, v = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    phases = {k: round(float(x), 2) for k, x in zip(h, v) if k in _PHASES}
    out = dict(compile_phases_s=phases, **(timer.summary() if timer else {}))
    if split is not None:
        out["backend_split_s"] = split.summary()
    try:  # each frame Dynamo compiled: which graph the seconds went to (the layer, the loss, the root's pieces)
        from torch._dynamo.utils import get_compilation_metrics

        out["frames"] = [dict(frame=f"{m.co_name}:{m.co_firstlineno}",
                              frame_s=round(m.entire_frame_compile_time_s or 0, 2),
                              backend_s=round(m.backend_compile_time_s or 0, 2), ops=m.graph_op_count)
                         for m in get_compilation_metrics() if m.co_name]
    except Exception:  # noqa: BLE001
        pass
    try:
        import fxfuse

        out["fxfuse_passes_s"] = round(sum(r.total_pass_ms for r in fxfuse.reports()) / 1e3, 2)
    except Exception:  # noqa: BLE001  (a row without it is still a row)
        pass
    return out


def main(impl):
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    if os.environ.get("FSDP_DUMP_AFTER"):  # every thread's stack to stderr after this many seconds (a hang)
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["FSDP_DUMP_AFTER"]), repeat=True)
    dev = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, LlamaConfig

    import fxfuse
    from fxfuse.comm_overlap import overlap_config_patches
    from fxfuse.options import FxFuseOptions

    early = os.environ.get("FSDP_BACKGROUND_EARLY") == "1" and os.environ.get("FSDP_BACKGROUND") == "1"
    if early:  # the compile process started before the model is built, not at compile_regions()
        fxfuse.start_background_compile_process()
    timer = None
    if dev.type == "cuda":
        timer = _TritonJitTimer()
        try:
            timer.install()
        except Exception as e:  # noqa: BLE001  (another Triton: the row says why the count is missing)
            print(f"no Triton JIT timing: {type(e).__name__}: {e}", flush=True)
            timer = None
    split = _BackendSplit()
    try:
        split.install()
    except Exception as e:  # noqa: BLE001
        print(f"no backend split: {type(e).__name__}: {e}", flush=True)
        split = None
    small = dev.type == "cpu"
    shape = os.environ.get("FSDP_SHAPE", "1b")
    n_layers = int(os.environ.get("FSDP_LAYERS", 16))
    lora = os.environ.get("FSDP_LORA", "0") == "1"
    if small:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512)
    elif shape == "8b":
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=n_layers, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                          tie_word_embeddings=False, rope_theta=500000.0)
    else:
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=n_layers, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                          tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(dev):  # built on the GPU: a CPU init of billions of fp32 parameters takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    floor = os.environ.get("FSDP_FLOOR", "")
    if floor == "no-attention":
        _attention_costs_nothing()
    elif floor:
        raise SystemExit(f"FSDP_FLOOR={floor!r}: only 'no-attention'")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    layers = next(m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList))
    # FSDP_TP=N: 2-D parallelism, FSDP2 over world / N data ranks x tensor parallelism over N (torchtitan's Llama
    # plan on each layer: q/k/v and gate/up column-split, o and down row-split; the lm-head split over the
    # vocabulary, its logits gathered as HF's plan does); each data rank its own rows, its TP ranks the same
    tp = int(os.environ.get("FSDP_TP", 1))
    sp = tp > 1 and os.environ.get("FSDP_SP") == "1"  # sequence parallelism on top (below)
    async_tp = sp and os.environ.get("FSDP_ASYNC_TP") == "1"
    dp_mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)

        mesh2 = init_device_mesh(dev.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh2["dp"]
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # FSDP_SP=1: sequence parallelism too (torchtitan's plan): the residual stream between layers split over
        # the sequence on the tensor dim, the norms run on each rank's part, each layer's attention and MLP input
        # all-gathered and their outputs reduce-scattered (instead of all-reduced); the embeddings' output
        # reduce-scattered, the lm-head's input all-gathered. HF's Llama builds positions from its input's (local)
        # length, so the step passes them (every row the whole sequence); its causal mask is None either way.
        out_sp = dict(output_layouts=Shard(1)) if sp else {}
        for layer in layers:
            plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(**out_sp),
                    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                    "mlp.down_proj": RowwiseParallel(**out_sp)}
            if sp:
                plan.update({
                    "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                    "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
            parallelize_module(layer, mesh2["tp"], plan)
        head_in = dict(input_layouts=Shard(1)) if sp else {}  # SP: the head all-gathers its input
        head_plan = {"lm_head": ColwiseParallel(output_layouts=Replicate(), **head_in)}
        if sp:
            head_plan.update({"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                              "model.norm": SequenceParallel()})
        parallelize_module(base, mesh2["tp"], head_plan)
        if async_tp:  # Inductor's micro-pipelined TP (torchtitan's async TP):
            # each all-gather + matmul and matmul + reduce-scatter of the compiled graphs becomes a fused, chunked
            # op over symmetric memory; fxfuse's graphs go through the same Inductor post-grad passes
            from torch._inductor import config as inductor_config
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            inductor_config._micro_pipeline_tp = True
            enable_symm_mem_for_group(mesh2["tp"].get_group().group_name)
    comm_overlap_env = os.environ.get("FSDP_COMM_OVERLAP", "")  # "", "0" or "1"
    if impl in ("inductor-regional", "fxfuse-layer"):  # per layer before sharding: hooks outside the region
        backend = "fxfuse" if impl == "fxfuse-layer" else "inductor"
        # FSDP_COMM_OVERLAP=1 on Inductor alone: the same scheduler settings fxfuse's comm_overlap asks for
        ind_opts = overlap_config_patches({}) if impl == "inductor-regional" and comm_overlap_env == "1" else None
        for layer in layers:
            layer.forward = torch.compile(layer.forward, backend=backend, options=ind_opts)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if not small else None
    kw = dict(mp_policy=mp) if mp else {}
    if dp_mesh is not None:
        kw["mesh"] = dp_mesh
    for layer in layers:
        fully_shard(layer, **kw)
    tail = os.environ.get("FSDP_TAIL") == "1"
    if tail:  # accelerate's units: the embeddings, and [final norm, lm-head] kept gathered after the forward
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        fully_shard(base.get_input_embeddings(), **kw)
        fully_shard([base.model.norm, base.get_output_embeddings()], reshard_after_forward=False, **kw)
    fully_shard(model, **kw)
    fwd = model
    background = os.environ.get("FSDP_BACKGROUND") == "1" and impl == "fxfuse-regions"
    if impl == "inductor":
        fwd = torch.compile(model)
    elif impl == "fxfuse":
        fwd = torch.compile(model, backend="fxfuse")
    elif impl == "fxfuse-nolce":
        fwd = torch.compile(model, backend="fxfuse", options={"passes": {"linear_cross_entropy": False}})
    elif impl == "fxfuse-regions":
        off = [p for p in os.environ.get("FSDP_PASSES_OFF", "").split(",") if p]  # e.g. linear_cross_entropy
        kw = dict(passes={p: False for p in off}) if off else {}
        if os.environ.get("FSDP_COMPILER"):  # fxfuse's compiler option: auto (default), inductor, aot_eager
            kw["compiler"] = os.environ["FSDP_COMPILER"]
        if background:  # AOTAutograd alone until a compile process has filled Inductor's caches
            kw["background_compile"] = True
        if os.environ.get("FSDP_TP_BLOCKS"):  # FSDP_TP > 1: tensor parallelism's all-reduces merged / in blocks
            kw["tp_all_reduce_blocks"] = int(os.environ["FSDP_TP_BLOCKS"])
        if comm_overlap_env:  # fxfuse's comm_overlap (default on): Inductor's compute / collective reordering
            kw["comm_overlap"] = comm_overlap_env == "1"
        fwd = fxfuse.compile_regions(model, **kw)
    elif impl == "fxfuse-regions-nopass":
        fwd = fxfuse.compile_regions(model, passes=[])
    elif impl == "fxfuse-regions-nolora":
        fwd = fxfuse.compile_regions(model, passes={"lora_linear": False, "lora_horizontal": False})
    # foreach (the default here, every row so far) or fused (torchtitan's default): the same for every impl of a table
    opt_impl = os.environ.get("FSDP_OPT", "foreach")
    if opt_impl not in ("foreach", "fused"):
        raise SystemExit(f"FSDP_OPT={opt_impl!r}: foreach or fused")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, **{opt_impl: True})
    B, S = (2, 64) if small else (int(os.environ.get("FSDP_ROWS", 2)), int(os.environ.get("FSDP_SEQ", 2048)))
    g = torch.Generator(device=dev).manual_seed(100 + (dp_mesh.get_local_rank() if dp_mesh is not None else rank))
    ids = torch.randint(0, cfg.vocab_size, (B, S), device=dev, generator=g)
    mask, labels = None, ids
    if os.environ.get("FSDP_PAD") == "1":  # every row after the first right-padded from 3/4 of its length
        mask = torch.ones(B, S, dtype=torch.long, device=dev)
        mask[1:, 3 * S // 4:] = 0
        labels = ids.masked_fill(mask == 0, -100)

    steps_run, loss11 = [0], [None]

    positions = {}
    if sp:  # sequence parallel: positions of the whole rows
        if mask is not None:
            raise SystemExit("FSDP_SP=1 takes unpadded rows (no FSDP_PAD)")
        positions["position_ids"] = torch.arange(S, device=dev).unsqueeze(0)

    def step():
        out = fwd(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **positions)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps_run[0] += 1
        if steps_run[0] == 11:  # every row's loss after the same number of steps (background rows run more)
            loss11[0] = round(out.loss.item(), 4)
        return out.loss

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    _start_together()
    t0 = time.perf_counter()
    setup = t0 - _T_SCRIPT  # imports, process group, model build, sharding, the compile call
    prof = None
    if os.environ.get("FSDP_CPROFILE") == "1" and rank == 0:  # the first step's host time by function
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    sampler = None
    if os.environ.get("FSDP_SAMPLE") == "1":  # the first step's main-thread wall time by frame, every rank
        from benchmarks.stack_sampler import StackSampler

        sampler = StackSampler(interval=float(os.environ.get("FSDP_SAMPLE_INTERVAL", 0.005))).start()
    cpu0 = _cpu_clocks()
    l0 = step().item()
    first = time.perf_counter() - t0
    cpu_first = _cpu_clocks(cpu0)
    if sampler is not None:
        sampler.stop()
        tag = (f"{impl}{'-lora' if lora else ''}{'-bg' if background else ''}{os.environ.get('FSDP_TAG', '')}"
               f"-rank{rank}")
        sampler.write_collapsed(os.path.join(os.environ.get("OUT", "/tmp"), f"stacks-{tag}.txt"))
        with open(os.path.join(os.environ.get("OUT", "/tmp"), f"sampled-{tag}.json"), "w") as f:
            json.dump(dict(first_step_s=first, cpu=cpu_first, **sampler.summary(top=60)), f)
    if background and rank == 0:
        print(f"first step {first:.1f} s", file=sys.stderr)
    if prof is not None:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("cumulative").print_stats(120)
        st.sort_stats("tottime").print_stats(50)
        name = f"cprofile-{impl}{'-lora' if lora else ''}.txt"
        with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
            f.write(buf.getvalue())
    breakdown = first_step_breakdown(timer, split)
    early_ms, to_compiled, switch_step = [], None, {}
    if background:  # steps until every graph ran Inductor's version in a step (each step synced by its loss)
        while len(early_ms) < int(os.environ.get("FSDP_BACKGROUND_MAX_STEPS", 80)):
            before = {j.name: j.compiled_calls for j in fxfuse.background_compiles()}
            t1 = time.perf_counter()
            step().item()
            early_ms.append(round((time.perf_counter() - t1) * 1e3, 1))
            if rank == 0:
                print(f"early step {len(early_ms)}: {early_ms[-1]} ms, jobs "
                      f"{[(j.state, j.eager_calls) for j in fxfuse.background_compiles()]}", file=sys.stderr)
            for i, j in enumerate(fxfuse.background_compiles()):  # the early step (1-based) of each switch here
                if j.state == "switched" and i not in switch_step:
                    switch_step[i] = len(early_ms)
            done = all(j.state == "switched" and j.compiled_calls > before.get(j.name, 0)
                       for j in fxfuse.background_compiles())
            # Every rank must run as many steps (FSDP's collectives pair up): the ranks agree on when to switch but
            # may still switch a step apart, so stop where all of them ran compiled
            flag = torch.tensor([1.0 if done else 0.0], device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if flag.item() == 1.0:
                to_compiled = time.perf_counter() - t0  # the end of the first step every graph ran compiled
                break
        switch_steps_by_rank = [None] * dist.get_world_size()  # whether the ranks switched each graph together
        mine = [switch_step.get(i) for i in range(len(fxfuse.background_compiles()))]
        dist.all_gather_object(switch_steps_by_rank, mine)
    for _ in range(2):
        step()
    sync()
    peak_early = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    n = int(os.environ.get("FSDP_STEPS", 8)) if not small else 2
    times, host = [], []
    for _ in range(n):  # one sync a step (the step ends in the optimizer anyway): the median drops an outlier
        t0 = time.perf_counter()
        loss = step()
        host.append(time.perf_counter() - t0)  # the host's issue time: near the step's, the GPU waited on the host
        sync()
        times.append(time.perf_counter() - t0)
    loss = loss.item()
    dt = sorted(times)[len(times) // 2]
    row = dict(impl=impl, passes_off=os.environ.get("FSDP_PASSES_OFF", ""),
               compiler=os.environ.get("FSDP_COMPILER", "auto") if impl == "fxfuse-regions" else None,
               triton_prewarm=os.environ.get("FXFUSE_TRITON_PREWARM", "1") != "0",
               gpus=dist.get_world_size(),
               device=torch.cuda.get_device_name() if dev.type == "cuda" else
               "cpu", torch=torch.__version__, tokens_per_s_per_gpu=round(B * S / tp / dt), step_ms=round(dt * 1e3, 1),
               tensor_parallel=tp, sequence_parallel=sp, async_tp=async_tp,
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None,
               step_ms_all=[round(t * 1e3, 1) for t in times], step_host_ms_all=[round(t * 1e3, 1) for t in host], first_step_s=round(first, 1),
               setup_s=round(setup, 1), start_to_first_step_s=round(setup + first, 1),
               caches="kept" if os.environ.get("KEEP_CACHES") == "1" else "cleared",
               commit=os.environ.get("COMMIT", "?"), loss0=round(l0, 4), loss_last=round(loss, 4),
               shape="tiny" if small else shape, layers=cfg.num_hidden_layers, tokens_per_gpu=B * S, lora=lora,
               rows=B, padded=mask is not None, tail_unit=tail, first_step=breakdown,
               peak_first_steps_gib=round(peak_early, 2) if peak_early is not None else None,
               first_step_cpu_s=cpu_first, loss_step11=loss11[0], first_step_starts="together (store barrier)",
               tag=os.environ.get("FSDP_TAG", ""), floor=floor or None,
               tp_all_reduce_blocks=int(os.environ.get("FSDP_TP_BLOCKS", FxFuseOptions.parse({}).tp_all_reduce_blocks))
               if impl == "fxfuse-regions" else None,
               # Inductor's compute / collective reordering: fxfuse's comm_overlap (default on), or asked for
               # Inductor alone with FSDP_COMM_OVERLAP=1
               comm_overlap=(comm_overlap_env != "0") if impl.startswith("fxfuse") else comm_overlap_env == "1",
               # fxfuse's post-grad rewrites counted in this process (comm_overlap: all-reduces merged / split)
               fxfuse_counters=dict(torch._dynamo.utils.counters["fxfuse"]),
               optimizer=f"AdamW {opt_impl}",
               # NCCL's and fxfuse's environment knobs this run had (NCCL_MAX_CTAS, FXFUSE_LOWRANK_GEMM_PERSISTENT...),
               # so a tagged row says what it changed
               env={k: v for k, v in sorted(os.environ.items())
                    if (k.startswith("NCCL_") or k.startswith("FXFUSE_")) and k not in ("NCCL_NVLS_ENABLE",)})
    if sampler is not None:
        row["first_step_sampled"] = sampler.summary()
    if background:  # the steps between the first and the first all-compiled one, and each graph's compile
        row.update(background_compile=True, background_process_started="script start" if early else "compile call",
                   early_steps_ms=early_ms,
                   to_compiled_s=round(to_compiled, 1) if to_compiled is not None else None,
                   background_jobs=[dict(name=j.name, state=j.state, send_s=round(j.send_seconds, 2),
                                         child_s=round(j.child_seconds, 2), queued_s=round(j.queued_seconds, 2),
                                         child_startup_s=j.child_startup,
                                         switch_s=round(j.switch_seconds, 2), cache=j.cache_hits,
                                         eager_calls=j.eager_calls, error=j.error[:300], note=j.note)
                                    for j in fxfuse.background_compiles()],
                   switch_steps_by_rank=switch_steps_by_rank)
    if os.environ.get("FSDP_PROFILE") and dev.type == "cuda":  # top GPU kernels of 2 steps, to compare impls
        from torch.profiler import ProfilerActivity, profile

        # record_shapes: trace_summary's beside_nccl compares launches of one kernel at the same shapes
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(2):
                step()
            sync()
        if rank == 0:
            import gzip
            import tempfile

            from benchmarks.trace_summary import summarize

            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                prof.export_chrome_trace(tmp.name)
                with open(tmp.name) as f:
                    trace = json.load(f)
            row["profile"] = summarize(trace, steps=2)
            if os.environ.get("FSDP_PROFILE") == "trace":
                with gzip.open(os.path.join(os.environ.get("OUT", "/tmp"), f"trace-{impl}.json.gz"), "wt") as f:
                    json.dump(trace, f)
    if impl.startswith("fxfuse"):
        fused = {}
        for r in fxfuse.reports():
            for rec in r.fused:
                fused[rec.pass_name] = fused.get(rec.pass_name, 0) + 1
        row.update(fused=fused, graphs=len(fxfuse.reports()), lowering=[r.lowering[:300] for r in fxfuse.reports()],
                   rolled_back=[f"{r.graph_name}: {x.pass_name}: {x.reason[:100]}" for r in fxfuse.reports()
                                for x in r.rolled_back])
    if rank == 0:
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "fsdp2.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fxfuse-regions")
