"""Several processes (gloo, 2 ranks on the CPU): DDP (also around ``compile_regions`` with HF Trainer's
``find_unused_parameters=True``), FSDP2 with the whole model compiled, FSDP2 with
``compile_regions``, FSDP2 over a PEFT LoRA model. In each, fxfuse's fused ops run (seen by the profiler) and the
loss averaged over the ranks equals single-process eager on the same global batch, before and after an optimizer
step (so the gradients agree too). ``compile_regions`` is also checked in one process. The cases with several ranks
run in batches, one spawn each (:data:`BATCHES`); every rank of a batch must finish, its teardown included, within a
time limit and exit 0: a hang fails the test."""
from __future__ import annotations

import functools
import inspect
import json
import os
import socket
import sys
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from conftest import grads_of, tiny_causal_lm

pytestmark = pytest.mark.slow  # compiles whole models several times, trains, or starts processes

HERE = os.path.dirname(os.path.abspath(__file__))
AOT = {"compiler": "aot_eager"}
STEPS = 2
#: seconds for all ranks of a run to finish, teardown included (about a minute each on 2 CPU cores); past it the
#: ranks are killed and the test fails: a hang is a bug, never a pass
RANK_TIMEOUT_S = 300
#: the same for one torchrun of examples/hf_trainer_fsdp2.py (2 to 3 minutes on 2 loaded CPU cores)
HF_TIMEOUT_S = 480


def _global_batch():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (4, 16), generator=g) for _ in range(STEPS)]  # 2 rows per rank


def _model(lora):
    m = tiny_causal_lm("llama", attn_implementation="sdpa")
    if lora:
        import peft

        m = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return m


def _eager_losses(lora):
    m = _model(lora)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    out = []
    for ids in _global_batch():
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _worker(rank, world, port, cases, result_dir):
    """One rank of a batch: ``cases`` in turn in one process group (see :data:`BATCHES`). Rank 0 writes each
    case's result to ``result_dir/<case>.json`` as it finishes; a rank whose case raises writes the traceback to
    ``<case>.rank<r>.error`` and exits 1 at once (the other ranks' next collective then fails, or they are killed
    at the deadline): the cases after it do not run."""
    sys.path.insert(0, HERE)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun sets them
    import torch  # (a local name here: the imports of torch's submodules below bind it)
    import torch.distributed as dist
    # One intra-op thread a rank, as conftest gives each xdist worker its share of the cores: a spawned rank would
    # take a thread per core, and two ranks of a lock-stepped gloo group beside the other worker oversubscribe CI's
    # two cores (a rank waiting in a collective for one descheduled behind the other's threads).
    torch.set_num_threads(1)
    # What the ranks use is imported before the group exists: torch.distributed.nn.functional (which FSDP2 imports)
    # binds the default group of the moment of its import as default arguments; imported after init_process_group
    # it would keep the group (and its gloo threads) alive past destroy_process_group, to the interpreter's exit.
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import fxfuse.regions  # noqa: F401

    if "fsdp2_lora" in cases:
        import peft  # noqa: F401

    tp = cases[0].startswith("tp_")
    assert all(c.startswith("tp_") == tp for c in cases), cases  # a batch is all tensor-parallel or none
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for case in cases:
        started = time.perf_counter()
        try:
            result = (_train_tp if tp else _train)(rank, world, case)
        except BaseException:
            traceback.print_exc()  # shown by pytest even if this rank's exit then hangs and is killed
            with open(os.path.join(result_dir, f"{case}.rank{rank}.error"), "w") as f:
                f.write(traceback.format_exc())
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # no teardown: the other ranks may be inside a collective this rank will never join
        if rank == 0:
            tmp = os.path.join(result_dir, f"{case}.json.tmp")
            with open(tmp, "w") as f:  # (with its seconds: where a batch's CI time goes)
                json.dump({**result, "case_seconds": round(time.perf_counter() - started, 1)}, f)
            os.replace(tmp, os.path.join(result_dir, f"{case}.json"))
        _between_cases()
    if tp:
        # DTensor's compiled graphs keep the device mesh, and with it the gloo group, alive from where the collector
        # does not see (bound methods of the mesh, held from C++): the group cannot be torn down in order. After a
        # barrier (every collective done) the rank leaves without the interpreter's finalization, where a live gloo
        # group's destructor can hang (see _teardown).
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _teardown()
    # every gloo group is destroyed, its worker threads joined: nothing is left for the interpreter's finalization
    assert _gloo_worker_threads() == 0, (_gloo_worker_threads(), _mesh_holders())


def _between_cases():
    """What one case leaves that the next must not see: Dynamo's compiled code and code state (as in a fresh
    process: the same step function compiles afresh, static then symbolic), fxfuse's reports, the lazy-logits
    counter. After a barrier, so no rank resets while another still runs the case's collectives."""
    import gc

    import torch.distributed as dist

    import fxfuse
    from fxfuse.lazy import materialized_at

    dist.barrier()
    torch._dynamo.reset()
    fxfuse.clear_reports()
    materialized_at.clear()
    gc.collect()


def _train(rank, world, case):
    """The ranks' work. Every module, compiled function and tensor of it is local here, so it is all released
    when this returns (before :func:`_teardown`)."""
    import torch.distributed as dist

    import fxfuse
    from fxfuse.regions import compile_regions

    torch.manual_seed(0)
    m = _model(lora=case == "fsdp2_lora")
    if case == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        fwd = torch.compile(DDP(m), backend="fxfuse", options=AOT)
    elif case == "ddp_regions_unused":  # HF Trainer's DDP: find_unused_parameters=True around compiled blocks
        from torch.nn.parallel import DistributedDataParallel as DDP

        fwd = DDP(compile_regions(m, compiler="aot_eager"), find_unused_parameters=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in m.get_decoder().layers if hasattr(m, "get_decoder") else m.model.layers:
            fully_shard(layer, mesh=mesh)
        if case == "fsdp2_regions_tail":  # accelerate's units: the embeddings, then [final norm, lm-head] unsharded
            fully_shard(m.model.embed_tokens, mesh=mesh)  # after forward (its pre-hook gathers both at the norm)
            fully_shard([m.model.norm, m.lm_head], mesh=mesh, reshard_after_forward=False)
        elif case == "fsdp2_regions_head":  # the lm-head a unit of its own, resharded after its forward
            fully_shard(m.lm_head, mesh=mesh)
        if case == "fsdp2_regions_output_dtype":  # accelerate's policy casts the root's outputs (to bf16 there; to
            from torch.distributed.fsdp import MixedPrecisionPolicy  # float64 here, which keeps eager's losses)

            fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(output_dtype=torch.float64))
        else:
            fully_shard(m, mesh=mesh)
        if case.startswith("fsdp2_regions"):
            fwd = compile_regions(m, compiler="aot_eager")
        else:
            fwd = torch.compile(m, backend="fxfuse", options=AOT)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    losses, ops, logits_computed = [], set(), []
    for ids in _global_batch():
        shard = ids[rank * 2:(rank + 1) * 2]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fwd(input_ids=shard, labels=shard, use_cache=False)
            loss = out.loss
            loss.backward()
        # lazy logits nobody read stay uncomputed (FSDP2's root hooks every output that requires grad)
        logits_computed.append(getattr(out.logits, "materialized", True))
        ops |= {e.name for e in prof.events() if e.name.startswith("fxfuse::")}
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
    fused = sorted({r.pass_name for rep in fxfuse.reports() for r in rep.fused})
    from fxfuse.lazy import materialized_at

    return {"losses": losses, "ops": sorted(ops), "fused": fused, "logits_computed": logits_computed,
            "lazy_logits_computed_at": dict(materialized_at)}


def _train_tp(rank, world, case):
    """A vocabulary-sharded lm-head (tensor parallelism: ColwiseParallel) and its cross-entropy, eager and compiled
    with fxfuse, on the same weights and tokens (a 127-entry vocabulary: shards of 64 and 63 rows; ignored label
    rows). Cases: ``tp_loss_parallel`` the module's logits stay sharded into a ``loss_parallel()`` cross-entropy
    (its output ``redistribute`` is a no-op); ``tp_linear_softcap`` ``F.linear`` on a replicated hidden DTensor and
    the sharded weight, a tanh softcap, ``loss_parallel()``; ``tp_gathered`` the logits gathered
    (``output_layouts=Replicate()``, local output: HF's ``colwise_rep``) into a plain cross-entropy;
    ``tp_local_slice`` each rank's local slice of the logits into a plain cross-entropy (a per-rank loss over part
    of the vocabulary: eager's semantics, which a vocabulary-parallel loss would change); ``tp_hf_plan`` the whole
    model under transformers' own tensor-parallel plan (``from_pretrained(tp_plan="auto")``: its lm-head gathers
    the logits) and its loss (``labels=``), compiled whole (its returned logits lazy; ``tp_hf_plan_few_tokens``
    with fewer tokens than the hidden width: kept real); ``tp_fsdp2_regions`` four ranks, a 2 x 2 (data, tensor)
    mesh: the lm-head split over the vocabulary on the tensor dim, FSDP2 over the data dim (each data rank its own
    rows), ``compile_regions`` and the model's loss; ``tp_fsdp2_hf_config`` the same mesh as transformers (>= 5.24)
    builds it at load time (``DistributedConfig(tp_size=2, fsdp_size=2)``: its plan and FSDP2 units), then
    ``compile_regions``; ``tp_log_probs`` a gathered head's per-token log-probs
    (``log_softmax(...).gather``) in a GRPO-like weighted sum, ``tp_sequence_parallel`` each rank's part of the
    sequence into a head that all-gathers it (``input_layouts=Shard(1)``: sequence parallelism) and
    ``loss_parallel()``, ``tp_log_probs_entropy`` the same plus an entropy
    bonus. Returns the losses, the lm-head's and the embeddings'
    gradients of both, the loss pass's sites and the fxfuse ops that ran."""
    import contextlib

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    import fxfuse

    ids = _global_batch()[0] % 127
    # one decoder layer (a second one repeats the same code; traced in both modes of every case, it was a large
    # part of the case's time); two under FSDP2 x TP, where the second layer's FSDP2 unit reuses the compiled block
    layers = 2 if case in ("tp_fsdp2_regions", "tp_fsdp2_hf_config") else 1
    if case == "tp_fsdp2_regions":
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        mesh = mesh2["tp"]
        dp = mesh2["dp"].get_local_rank()
        ids = ids[dp * 2:(dp + 1) * 2]
    else:
        mesh = init_device_mesh("cpu", (world,))
    if case == "tp_hf_plan_few_tokens":
        ids = ids[:, :4]  # 16 tokens, fewer than the hidden width (32)
    # FSDP2 x TP as transformers (>= 5.24) loads it: DistributedConfig(tp_size=2, fsdp_size=2), a (fsdp, tp) mesh
    # whose rank is fsdp * 2 + tp; compile_regions after the load, as examples/hf_trainer_fsdp2.py --tp 2 does
    hf_config = case == "tp_fsdp2_hf_config"
    if hf_config:
        dp = rank // 2
        ids = ids[dp * 2:(dp + 1) * 2]
    hf = case.startswith("tp_hf_plan") or hf_config
    labels = torch.roll(ids, -1, 1)
    labels[:, :3] = -100
    if case == "tp_local_slice":
        labels = labels.where(labels < 0, labels % 60)  # classes every rank's slice holds
    style = {"tp_gathered": ColwiseParallel(output_layouts=Replicate()),
             "tp_log_probs": ColwiseParallel(output_layouts=Replicate()),
             "tp_log_probs_entropy": ColwiseParallel(output_layouts=Replicate()),
             "tp_fsdp2_regions": ColwiseParallel(output_layouts=Replicate()),
             "tp_local_slice": ColwiseParallel(output_layouts=Shard(-1)),
             # sequence parallelism (torchtitan's plan): the head's input sharded over the sequence, all-gathered
             "tp_sequence_parallel": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                     use_local_output=False)}.get(
        case, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    parallel_loss = loss_parallel if case in ("tp_loss_parallel", "tp_linear_softcap", "tp_sequence_parallel") \
        else contextlib.nullcontext
    saved = [None]
    if hf:  # a checkpoint for from_pretrained, written by rank 0
        import tempfile

        import torch.distributed as dist

        if rank == 0:
            saved[0] = tempfile.mkdtemp(prefix="fxfuse-tp-")
            tiny_causal_lm("llama", attn_implementation="sdpa", vocab_size=127,
                           num_hidden_layers=layers).save_pretrained(saved[0])
        dist.broadcast_object_list(saved, src=0)
    out = {}
    for mode in ("eager", "fxfuse"):
        torch.manual_seed(0)
        if hf_config:
            import transformers as tf
            from transformers.distributed import DistributedConfig

            from fxfuse.regions import compile_regions

            m = tf.AutoModelForCausalLM.from_pretrained(
                saved[0], distributed_config=DistributedConfig(tp_size=2, fsdp_size=world // 2), dtype=torch.float32,
                attn_implementation="sdpa")
            if mode == "fxfuse":
                compile_regions(m, compiler="aot_eager")
        elif hf:
            import transformers as tf

            m = tf.AutoModelForCausalLM.from_pretrained(saved[0], tp_plan="auto", dtype=torch.float32,
                                                        attn_implementation="sdpa")
        else:
            m = tiny_causal_lm("llama", attn_implementation="sdpa", vocab_size=127, num_hidden_layers=layers)
            parallelize_module(m, mesh, {"lm_head": style})
        if case == "tp_fsdp2_regions":
            from torch.distributed.fsdp import fully_shard

            from fxfuse.regions import compile_regions

            if mode == "fxfuse":
                compile_regions(m, compiler="aot_eager")
            for layer in m.model.layers:
                fully_shard(layer, mesh=mesh2["dp"])
            fully_shard(m, mesh=mesh2["dp"])

        # transformers' plan: the model compiled whole, as the Trainer does, returning its (gathered) logits too
        model = torch.compile(m, backend="fxfuse", options=AOT) if hf and not hf_config and mode == "fxfuse" else m
        returned = []

        def step(ids, labels):
            if hf:
                o = model(input_ids=ids, labels=labels, use_cache=False)
                returned.append(o.logits)
                return o.loss
            if case == "tp_fsdp2_regions":
                return m(input_ids=ids, labels=labels, use_cache=False).loss
            h = m.model(input_ids=ids, use_cache=False).last_hidden_state
            if case == "tp_sequence_parallel":  # this rank's part of the sequence (lengths divisible by the ranks)
                h = h.chunk(world, dim=1)[rank]
            if case.startswith("tp_log_probs"):  # RL: per-token log-probs of the sampled tokens, weighted
                lp = torch.log_softmax(m.lm_head(h).float() / 0.7, -1)
                logp = lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
                adv = ids.float() / 63.0 - 1.0  # per-token weights (not torch.linspace(..., numel), which
                # specialises the length: a recompile per length in every backend)
                loss = -(logp * adv).mean()
                if case == "tp_log_probs_entropy":
                    loss = loss - 0.01 * (-(lp.exp() * lp).sum(-1)).mean()
                return loss
            if case == "tp_linear_softcap":
                h = DTensor.from_local(h, mesh, [Replicate()], run_check=False, shape=h.shape, stride=h.stride())
                logits = torch.tanh(F.linear(h, m.lm_head.weight) / 3.0) * 3.0
            else:
                logits = m.lm_head(h)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

        fn = step if mode == "eager" or case == "tp_fsdp2_regions" or hf else \
            torch.compile(step, backend="fxfuse", options=AOT)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with parallel_loss():
                loss = fn(ids, labels)
                loss.backward()
        loss = loss.detach()
        lengths = []  # then a new length every batch (gradients accumulate alike in both modes)
        frames = len(torch._dynamo.utils.get_compilation_metrics())
        # (three layouts: the sharded loss, the sequence-sharded input, the gathered head's log-probs + entropy; the
        # gathered loss and the plain log-probs share their recompile with those, and CI's time)
        if case in ("tp_loss_parallel", "tp_log_probs_entropy", "tp_sequence_parallel"):
            for n in ((14, 12, 10) if case == "tp_sequence_parallel" else (13, 11, 9)):
                with parallel_loss():
                    more = fn(ids[:, :n], labels[:, :n])
                    more.backward()
                lengths.append(float(more.full_tensor() if isinstance(more, DTensor) else more))

        def full(t):
            return t.full_tensor() if isinstance(t, DTensor) else t

        grads = {"grad": full(m.lm_head.weight.grad).tolist(), "embed_grad": full(m.model.embed_tokens.weight.grad).tolist()}
        logits = {"type": type(returned[0]).__name__} if hf else {}
        if case == "tp_hf_plan":  # the returned logits: lazy, not computed unless read, then read by rank 0 alone
            import torch.distributed as dist

            from fxfuse.lazy import materialized_at

            before = sum(materialized_at.values())
            if rank == 0:
                logits["rows"] = returned[0][:, :3].float().tolist()
            logits["materialised_unread"] = before
            dist.barrier()  # rank 1 never read them: a collective inside the read would hang here
            # a loss on the logits themselves, every rank: its gradient goes through the read into the rank's slice
            m.zero_grad(set_to_none=True)
            o = model(input_ids=ids, labels=labels, use_cache=False)
            (o.logits.float().pow(2).mean() * 10).backward()
            logits["read_grads"] = [full(m.lm_head.weight.grad).tolist(), full(m.model.embed_tokens.weight.grad).tolist()]

        out[mode] = {"loss": float(full(loss)), "loss_is_dtensor": isinstance(loss, DTensor), "lengths": lengths,
                     "frames_after_lengths": len(torch._dynamo.utils.get_compilation_metrics()) - frames,
                     "logits": logits,
                     "head_split": isinstance(m.lm_head.weight, DTensor)
                     and m.lm_head.weight.to_local().shape[0] < m.lm_head.weight.shape[0],
                     **grads,
                     "ops": sorted({e.name for e in prof.events() if e.name.startswith("fxfuse::")}),
                     # all-gathers that ran (gloo's own events: Dynamo's and AOT's tracing in the first call also
                     # dispatches the functional collectives, on fake tensors)
                     "gathers": sorted({e.name for e in prof.events() if e.name.startswith("gloo:all_gather")})}
        if case == "tp_gathered" and mode == "fxfuse":  # under AMP (the HF Trainer's bf16) the op computes in bf16
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as ap:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    fn(ids, labels).backward()
            # the weight's dtype (the profiler records no dtype for the flattened hidden states)
            out[mode]["autocast_dtypes"] = [e.input_dtypes[1] for e in ap.events()
                                            if e.name == "fxfuse::vocab_parallel_cross_entropy_fwd"]
    if hf:  # both modes have loaded the checkpoint: rank 0 removes it (the ranks leave by os._exit, no finalizers)
        import shutil

        import torch.distributed as dist

        dist.barrier()
        if rank == 0:
            shutil.rmtree(saved[0], ignore_errors=True)
    sites = [(r.status, r.reason) for rep in fxfuse.reports() for r in rep.records
             if r.pass_name == ("linear_log_probs" if case.startswith("tp_log_probs") else "linear_cross_entropy")]
    loss_sites = [(r.status, r.reason) for rep in fxfuse.reports() for r in rep.records
                  if r.pass_name == "log_probs_loss"]
    kept_real = [x for rep in fxfuse.reports() for r in rep.records if r.pass_name == "linear_cross_entropy"
                 for x in r.detail.get("logits_kept_real_because", [])]
    return {**out, "lce_sites": sites, "loss_sites": loss_sites, "logits_kept_real_because": kept_real}


def _gloo_worker_threads():
    """How many of this process's threads are a gloo process group's workers (they live as long as the group)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


def _mesh_holders(depth=12, limit=8):
    """What keeps a DeviceMesh (and so its process group) alive, for the teardown check's message: from each live
    mesh up through containers (tuples, lists, dicts, DTensor's specs) to the first object that is none of those
    (a cache, a module, a function, a class instance), or to a container nothing visible holds (held from C++)."""
    import gc
    import types

    from torch.distributed.device_mesh import DeviceMesh

    def name(o):
        if isinstance(o, (types.FunctionType, types.MethodType, functools._lru_cache_wrapper)):
            return f"{type(o).__name__} {getattr(o, '__module__', '?')}.{getattr(o, '__qualname__', '?')}"
        if isinstance(o, types.ModuleType):
            return f"module {o.__name__}"
        if isinstance(o, dict):
            return f"dict of {o['__name__']}" if "__name__" in o else f"dict({', '.join(map(str, list(o)[:4]))})"
        return f"{type(o).__module__}.{type(o).__qualname__}"

    def container(o):
        return isinstance(o, (tuple, list, dict, set, frozenset)) or type(o).__module__.startswith(
            ("torch.distributed.tensor", "torch.distributed.device_mesh"))

    gc.collect()
    meshes = [o for o in gc.get_objects() if isinstance(o, DeviceMesh)]
    found, seen = [], {id(meshes)}
    frontier = [(m, [name(m)]) for m in meshes]
    for _ in range(depth):
        nxt = []
        for obj, chain in frontier:
            refs = [r for r in gc.get_referrers(obj) if id(r) not in seen and not isinstance(r, types.FrameType)
                    and r is not frontier and r is not nxt and r is not found]
            seen.update(id(r) for r in refs)
            if not refs:
                found.append(chain + ["(held from outside the collector's view)"])
            for r in refs:
                (nxt if container(r) else found).append((r, chain + [name(r)]) if container(r) else chain + [name(r)])
        frontier = nxt[:200]
        if not frontier:
            break
    uniq = list(dict.fromkeys(" <- ".join(c[:1] + c[-3:]) for c in found))
    return {"meshes": len(meshes), "holders": uniq[:limit]}


def _teardown():
    """Leave the process group in order, while the interpreter is fully alive.

    Left to the interpreter's finalization, the last reference to the gloo group was the Reducer of the DDP module,
    and ``~ProcessGroupGloo`` joined the group's worker threads while the finalizing thread held the GIL: once in
    CI both ranks hung there (``~ProcessGroupGloo -> std::thread::join``, a gloo thread waiting for the GIL). Here
    a barrier first (every collective of both ranks has completed: the worker threads are idle), then what still
    holds the group is released (compiled code holding the modules; DTensor's caches holding FSDP2's mesh) and
    collected, and ``destroy_process_group`` drops the last reference: the destructor joins idle threads now, and
    the rank checks that no gloo thread is left."""
    import gc

    import torch.distributed as dist

    dist.barrier()
    torch._dynamo.reset()  # compiled code holds the modules
    try:  # DTensor's sharding-propagation caches hold FSDP2's device mesh, which holds the group
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        pass
    else:
        _clear_sharding_prop_cache()
    # and, on torch 2.11, caches that this does not clear (the GPU machine's gloo run kept the mesh through
    # OpSpec / OpStrategy tuples): every functools cache of torch, found by the collector
    for f in gc.get_objects():
        try:
            if isinstance(f, functools._lru_cache_wrapper) and str(getattr(f, "__module__", "")).startswith("torch."):
                f.cache_clear()
        except ReferenceError:  # a weakref proxy whose object is gone (DTensor's tensor-parallel run leaves some)
            pass
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _spawn(fn, args, nprocs, timeout):
    """``fn(rank, *args)`` in ``nprocs`` spawned processes. Fails the test if a rank raises or exits non-zero
    (``ProcessContext.join`` raises, with the rank's traceback) or if the ranks are not all gone within ``timeout``
    seconds (a hang, during the work or in teardown: the ranks still alive are killed and the test fails)."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=10):
        if time.monotonic() >= deadline:
            alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
            pytest.fail(f"ranks {alive} still running after {timeout} s (exit codes: "
                        f"{[p.exitcode for p in ctx.processes]}): a hang")


def _kill_tree(pid):
    """SIGKILL ``pid`` and every process below it. (torchrun starts each rank in a session of its own: killing
    torchrun's process group would leave the ranks running, holding the output pipes open.)"""
    import signal

    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(d))
    tree, todo = [], [pid]
    while todo:
        q = todo.pop()
        tree.append(q)
        todo += children.get(q, [])
    for q in tree:
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass


#: The two-rank cases run in batches, one spawn per batch: each rank starts, imports torch, transformers and fxfuse
#: and compiles its first graph once for the batch (a spawn per case cost ~10 s of that on CI's 2 cores, 19 times).
#: The cases of a batch run in turn in one process group, Dynamo and fxfuse's reports reset between them
#: (:func:`_between_cases`); each case is still its own test, reading its own result. name -> (world, cases).
BATCHES = {
    "data_parallel": (2, ("ddp", "ddp_regions_unused", "fsdp2", "fsdp2_regions", "fsdp2_regions_tail",
                          "fsdp2_regions_head", "fsdp2_regions_output_dtype", "fsdp2_lora")),
    "tensor_parallel": (2, ("tp_linear_softcap", "tp_gathered", "tp_local_slice", "tp_hf_plan",
                            "tp_hf_plan_few_tokens", "tp_loss_parallel", "tp_sequence_parallel", "tp_log_probs",
                            "tp_log_probs_entropy")),
    "fsdp2_x_tp": (4, ("tp_fsdp2_regions", "tp_fsdp2_hf_config")),
}
#: seconds a case may add to a batch's deadline (each takes 10-40 s on 2 loaded CPU cores)
CASE_TIMEOUT_S = 120
_batch_runs = {}  # name -> (result folder, why the batch's ranks did not all exit 0 in time, or None)


def _hf_distributed_config_missing():
    try:
        import transformers.distributed  # noqa: F401
    except ImportError:
        return True
    return False


def _batch_cases(name):
    world, cases = BATCHES[name]
    if _hf_distributed_config_missing():
        cases = tuple(c for c in cases if c != "tp_fsdp2_hf_config")
    return world, cases


def _run_batch(name, tmp_path_factory):
    """Runs batch ``name`` once per pytest process (xdist sends each batch's tests to one worker: ``xdist_group``)
    and returns its result folder and, if its ranks did not all exit 0 within the deadline, why."""
    if name not in _batch_runs:
        world, cases = _batch_cases(name)
        folder = tmp_path_factory.mktemp(f"ranks-{name}")
        why = None
        try:
            _spawn(_worker, (world, _free_port(), cases, str(folder)), nprocs=world,
                   timeout=RANK_TIMEOUT_S + CASE_TIMEOUT_S * len(cases))
        except BaseException as e:  # pytest.fail (a hang) included: each case's test reports what it concerns
            why = f"{type(e).__name__}: {e}"
        _batch_runs[name] = (folder, why)
    return _batch_runs[name]


def _batch_of(case):
    return next(n for n, (_, cases) in BATCHES.items() if case in cases)


def _in_batch(case, *values):
    """A parametrization of ``case`` that xdist sends to the worker that runs (or will run) the case's batch."""
    return pytest.param(case, *values, marks=pytest.mark.xdist_group(_batch_of(case)))


def _case_result(case, tmp_path_factory):
    """Case ``case``'s result from its batch; the test fails with the rank's traceback if the case raised, or with
    the batch's failure if the batch stopped before the case."""
    name = _batch_of(case)
    folder, why = _run_batch(name, tmp_path_factory)
    path = folder / f"{case}.json"
    if not path.exists():
        errors = "\n".join(p.read_text() for p in sorted(folder.glob(f"{case}.rank*.error")))
        raised = sorted({p.name.split(".rank")[0] for p in folder.glob("*.error")})
        pytest.fail(f"case {case} of batch {name} gave no result: "
                    + (errors or f"the batch stopped before it ({why}; cases that raised: {raised or 'none'})"),
                    pytrace=False)
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(n)) for n in BATCHES])
def test_each_batch_of_ranks_runs_every_case_and_exits_cleanly(name, tmp_path_factory):
    """Every rank of the batch finished, its teardown included, within the deadline and exited 0 (a hang fails the
    test, never a pass); every case gave its result."""
    folder, why = _run_batch(name, tmp_path_factory)
    assert why is None, why
    _, cases = _batch_cases(name)
    assert sorted(p.name for p in folder.glob("*.json")) == sorted(f"{c}.json" for c in cases)


@pytest.mark.parametrize("case,ops", [
    _in_batch("ddp", {"fxfuse::linear_cross_entropy_fwd"}),
    # DDP's output sink (find_unused_parameters=True) clones the lazy logits: still never computed
    _in_batch("ddp_regions_unused", {"fxfuse::linear_cross_entropy_fwd"}),
    _in_batch("fsdp2", {"fxfuse::linear_cross_entropy_fwd"}),
    # regions: the base model runs eagerly and builds no mask for these unpadded rows, so the blocks run SDPA's
    # own causal kernels (no fxfuse attention op); the head's loss is fused
    _in_batch("fsdp2_regions", {"fxfuse::linear_cross_entropy_fwd"}),
    # the lm-head in an FSDP2 unit of its own (accelerate's [norm, lm_head]; a lone lm-head): its hooks run eagerly
    # around the compiled loss, which stays fused
    _in_batch("fsdp2_regions_tail", {"fxfuse::linear_cross_entropy_fwd"}),
    _in_batch("fsdp2_regions_head", {"fxfuse::linear_cross_entropy_fwd"}),
    # the root's outputs cast to the policy's output_dtype: the lazy logits too, still never computed
    _in_batch("fsdp2_regions_output_dtype", {"fxfuse::linear_cross_entropy_fwd"}),
    _in_batch("fsdp2_lora", {"fxfuse::linear_cross_entropy_fwd", "fxfuse::lora_linear"}),
])
def test_two_ranks_match_single_process_eager(case, ops, tmp_path_factory):
    got = _case_result(case, tmp_path_factory)
    ref = _eager_losses(lora=case == "fsdp2_lora")
    assert got["losses"] == pytest.approx(ref, rel=2e-5), (got, ref)
    missing = {o for o in ops if not any(name.startswith(o) for name in got["ops"])}
    assert not missing, (missing, got)
    assert not any(got["logits_computed"]) and not got["lazy_logits_computed_at"], got


@pytest.mark.parametrize("case,status,why", [
    _in_batch("tp_fsdp2_regions", "fused", ""),  # FSDP2 x TP on four ranks, compile_regions  # fxfuse::vocab_parallel_cross_entropy, the loss a DTensor again
    _in_batch("tp_linear_softcap", "fused", ""),
    _in_batch("tp_gathered", "fused", ""),       # the logits' all-gather gone
    _in_batch("tp_local_slice", "skipped", "this rank's slice"),  # a per-rank loss: eager's semantics kept
    _in_batch("tp_hf_plan", "fused", ""),        # transformers' tp_plan="auto" and its own loss, the model compiled whole
    _in_batch("tp_hf_plan_few_tokens", "fused", ""),  # the same with fewer tokens than the hidden width: logits kept real
    _in_batch("tp_fsdp2_hf_config", "fused", ""),  # FSDP2 x TP loaded by transformers' DistributedConfig, compile_regions
    _in_batch("tp_loss_parallel", "fused", ""),
    _in_batch("tp_sequence_parallel", "fused", ""),  # the head's input sequence-sharded (SequenceParallel), loss_parallel()
    _in_batch("tp_log_probs", "fused", ""),      # fxfuse::vocab_parallel_log_probs
    _in_batch("tp_log_probs_entropy", "fused", ""),  # the same with the entropy
])
def test_tensor_parallel_lm_head_loss_is_vocab_parallel_and_equals_eager(case, status, why, tmp_path_factory):
    """Under tensor parallelism the lm-head loss runs as the vocabulary-parallel op on each rank's weight shard and
    gives eager DTensor's loss, lm-head gradient and hidden-state gradient (through the embeddings); a loss that
    reads only a rank's slice of the vocabulary is left alone, with the reason in the report."""
    if case == "tp_fsdp2_hf_config" and _hf_distributed_config_missing():
        pytest.skip("transformers < 5.24 has no DistributedConfig")
    got = _case_result(case, tmp_path_factory)
    fx, ea = got["fxfuse"], got["eager"]
    assert fx["loss"] == pytest.approx(ea["loss"], rel=1e-5)
    assert fx["lengths"] == pytest.approx(ea["lengths"], rel=1e-5)
    # three new lengths: one symbolic-length recompile, as plain torch.compile without tensor parallelism (Inductor
    # and aot_eager themselves stop at the second length here on torch 2.13: a RecursionError in make_fx)
    if fx["lengths"]:
        assert fx["frames_after_lengths"] == 1, fx["frames_after_lengths"]
    assert fx["loss_is_dtensor"] == ea["loss_is_dtensor"]
    assert fx["head_split"] and ea["head_split"]  # the lm-head really is split over the vocabulary
    for g in ("grad", "embed_grad"):
        torch.testing.assert_close(torch.tensor(fx[g]), torch.tensor(ea[g]), rtol=1e-4, atol=1e-6)
    assert got["lce_sites"] and all(st == status and why in reason for st, reason in got["lce_sites"]), got["lce_sites"]
    op = "fxfuse::vocab_parallel_log_probs" if case.startswith("tp_log_probs") else \
        "fxfuse::vocab_parallel_cross_entropy"
    ran = any(o.startswith(op) for o in fx["ops"])
    assert ran == (status == "fused"), (fx["ops"], got["lce_sites"])
    if case == "tp_hf_plan_few_tokens":  # gathering the weight would move more than the logits: they stay real
        assert fx["logits"]["type"] == "Tensor" and "fewer than the hidden width" in \
            " ".join(got["logits_kept_real_because"]), (fx["logits"], got["logits_kept_real_because"])
    if case == "tp_hf_plan":  # the model's returned logits: lazy, never computed unread, rank 0's read equals eager's
        assert fx["logits"]["type"] == "LazyLogits" and fx["logits"]["materialised_unread"] == 0, fx["logits"]
        torch.testing.assert_close(torch.tensor(fx["logits"]["rows"]), torch.tensor(ea["logits"]["rows"]),
                                   rtol=1e-5, atol=1e-6)
        for f, e in zip(fx["logits"]["read_grads"], ea["logits"]["read_grads"]):  # lm-head, embeddings
            torch.testing.assert_close(torch.tensor(f), torch.tensor(e), rtol=1e-4, atol=1e-6)
    if case.startswith("tp_log_probs"):  # the loss in the same graph: the gradients formed in the forward
        assert got["loss_sites"] and all(st == "fused" for st, _ in got["loss_sites"]), got["loss_sites"]
        assert any(o.startswith("fxfuse::vocab_parallel_log_probs_loss") for o in fx["ops"]), fx["ops"]
    if case in ("tp_gathered", "tp_log_probs", "tp_log_probs_entropy"):  # the step returns no logits: their all-gather is gone
        assert ea["gathers"] and not fx["gathers"], (ea["gathers"], fx["gathers"])
    if case == "tp_gathered":  # one more step under bf16 autocast: the op's operands arrive in bf16 (the fp32 weight cast)
        assert fx["autocast_dtypes"] and set(fx["autocast_dtypes"]) == {"c10::BFloat16"}, fx["autocast_dtypes"]


def test_compile_regions_one_process_compiles_each_block_once_and_fuses_the_head():
    """Blocks compiled once for all layers (a static then a symbolic-length graph), the base model eager (no mask
    for an unpadded causal batch: SDPA's causal kernels in the blocks), the lm-head loss fused; a padded batch
    brings HF's mask tensor, which the blocks' sdpa_attention fuses. Losses and gradients match the eager model."""
    import fxfuse
    from fxfuse.regions import compile_regions, undo_compile_regions

    ref = tiny_causal_lm("llama", attn_implementation="sdpa", num_hidden_layers=3)
    m = tiny_causal_lm("llama", attn_implementation="sdpa", num_hidden_layers=3)
    compile_regions(m, compiler="aot_eager")
    # the root's forward keeps its signature: HF's Trainer drops the dataset columns it does not name
    assert inspect.signature(m.forward) == inspect.signature(ref.forward)
    padded = torch.ones(2, 23, dtype=torch.long)
    padded[1, 17:] = 0
    for n, mask in ((14, None), (19, None), (23, None), (23, padded)):
        ids = torch.randint(0, 128, (2, n))
        labels = ids.masked_fill(mask == 0, -100) if mask is not None else ids
        m.zero_grad()
        ref.zero_grad()
        out = m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        want = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        want.loss.backward()
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
        g0, g1 = grads_of(ref), grads_of(m)
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=2e-4, atol=2e-6)
        if n == 23 and mask is None:
            reps = fxfuse.reports()
            heads = [r for r in reps if any(s.pass_name == "linear_cross_entropy" for s in r.fused)]
            # one static + one symbolic-length graph of the block, shared by the 3 layers; the same for the head
            assert len(reps) == 4 and len(heads) == 2, [(r.graph_name, [s.pass_name for s in r.fused]) for r in reps]
            assert not any(s.pass_name == "sdpa_attention" for r in reps for s in r.fused)  # no mask was built
    masked = [r for r in fxfuse.reports()[4:] if any(s.pass_name == "sdpa_attention" for s in r.fused)]
    assert len(masked) == 1, [(r.graph_name, [s.pass_name for s in r.fused]) for r in fxfuse.reports()]
    undo_compile_regions(m)
    assert "forward" not in m.model.layers[0].__dict__ and "_call_impl" not in m.model.__dict__
    assert not m.model._forward_hooks  # the hook that gathers an FSDP2 lm-head after the blocks
    assert not hasattr(m, "_fxfuse_regions") and "forward" not in m.__dict__


def _fsdp2_like(fn):
    """``fn`` as FSDP2's hooks present themselves (their ``__module__``): compile_regions holds such hooks aside."""
    fn.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"
    return fn


def test_compile_regions_runs_an_fsdp2_lm_heads_hooks_eagerly_around_the_fused_loss():
    """An lm-head with FSDP2's forward hooks (stand-ins here, with FSDP2's ``__module__``; the two-rank cases above
    run the real ones): the loss graph still fuses the head, the hooks do not run inside the compiled code, the head
    is gathered (``unshard``) after the blocks and before the loss, then its pre- and post-hook run once each, after
    the compiled code, with the loss as the head's output. With any other hook on the head nothing is held: the hook
    sees the real logits (the head's loss is not fused) and the result equals eager with the same hook."""
    import fxfuse
    from fxfuse.regions import compile_regions

    ref = tiny_causal_lm("llama", attn_implementation="sdpa")
    m = tiny_causal_lm("llama", attn_implementation="sdpa")
    events = []
    m.lm_head.unshard = lambda: events.append("unshard")
    m.model.norm.register_forward_hook(lambda mod, a, out: events.append("blocks done"))
    m.lm_head.register_forward_pre_hook(_fsdp2_like(lambda mod, a, k: events.append(("pre", a, k))),
                                        with_kwargs=True)
    m.lm_head.register_forward_hook(_fsdp2_like(lambda mod, a, out: events.append(("post", out))))
    compile_regions(m, compiler="aot_eager")
    for n in (9, 12):
        ids = torch.randint(0, 128, (2, n))
        events.clear()
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        want = ref(input_ids=ids, labels=ids, use_cache=False)
        want.loss.backward()
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.lm_head.weight.grad, ref.lm_head.weight.grad, rtol=2e-4, atol=2e-6)
        assert events[:3] == ["blocks done", "unshard", ("pre", (), {})], events
        assert len(events) == 4 and events[3][0] == "post" and events[3][1] is out.loss, events
        assert not out.logits.materialized  # lazy: the head's loss was fused
    assert sum(s.pass_name == "linear_cross_entropy" for r in fxfuse.reports() for s in r.fused) >= 1

    # another hook on the head as well: nothing is held, the hook changes the logits the loss sees, as in eager.
    # (Registered before compiling, in a fresh Dynamo: by default Dynamo does not guard on modules' hooks,
    # skip_nnmodule_hook_guards, so code compiled for the first model would serve this one.)
    torch._dynamo.reset()
    ref = tiny_causal_lm("llama", attn_implementation="sdpa")
    m = tiny_causal_lm("llama", attn_implementation="sdpa")
    m.lm_head.unshard = lambda: events.append("unshard")
    m.lm_head.register_forward_hook(_fsdp2_like(lambda mod, a, out: events.append(("post", out))))
    for model in (m, ref):
        model.lm_head.register_forward_hook(lambda mod, a, out: out * 0.5)
    compile_regions(m, compiler="aot_eager")
    ids = torch.randint(0, 128, (2, 10))
    events.clear()
    got = m(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(got.loss, ref(input_ids=ids, labels=ids, use_cache=False).loss, rtol=1e-5, atol=1e-6)
    assert "unshard" not in events and [e[0] for e in events] == ["post"], events
    assert events[0][1] is not got.loss  # the hook saw the head's own output


def test_hf_trainer_recipe_two_ranks_runs_fxfuse_and_matches_the_uncompiled_run(tmp_path):
    """``examples/hf_trainer_fsdp2.py`` as written, under torchrun with 2 ranks: HF Trainer with
    ``torch_compile=True`` (accelerate's Inductor backend) after ``fxfuse.install()``, and with ``--regions``
    (``fxfuse.compile_regions``, under gradient checkpointing), fuse the lm-head loss and log the losses of the same
    script with ``--no-compile``, on right-padded rows (HF's mask tensor reaches the attention). On the CPU accelerate applies no FSDP (it shards only
    on accelerators) and the ranks run data-parallel; the FSDP2 half of the recipe runs only on GPUs."""
    import subprocess

    root = os.path.dirname(HERE)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}  # conftest's cache settings inherited

    def run(*flags):
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(_free_port()), os.path.join(root, "examples", "hf_trainer_fsdp2.py"),
                              "--out", str(tmp_path / "out"), *flags],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                             start_new_session=True)
        try:
            out, err = p.communicate(timeout=HF_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # a hang is a bug, wherever it is (the training or the ranks' teardown): kill the ranks and fail
            _kill_tree(p.pid)
            out, err = p.communicate()
            pytest.fail(f"hf_trainer_fsdp2.py {' '.join(flags) or '(compiled)'} still running after {HF_TIMEOUT_S} s, "
                        f"{'after' if 'RESULT ' in out else 'before'} rank 0 printed its result: a hang\n"
                        + out[-2000:] + err[-4000:])
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        # torchrun exits non-zero when any rank does
        assert p.returncode == 0 and lines, (p.returncode, out[-2000:] + err[-4000:])
        return json.loads(lines[-1][len("RESULT "):])

    # padded rows (HF's attention-mask path); --regions also under the Trainer's gradient checkpointing (64k rows)
    got, ref = run("--pad"), run("--no-compile", "--pad")
    regions = run("--regions", "--pad", "--gradient-checkpointing")
    assert ref["padded"] and ref["real_tokens_per_row"] < ref["seq"], ref
    assert "linear_cross_entropy" in got["fused"], got
    assert len(got["losses"]) == 2 and got["losses"] == pytest.approx(ref["losses"], rel=1e-5), (got, ref)
    # --regions: fxfuse.compile_regions before the Trainer, torch_compile off (the faster mode on GPUs)
    assert regions["mode"] == "regions" and regions["gradient_checkpointing"], regions
    assert {"linear_cross_entropy", "sdpa_attention"} <= set(regions["fused"]), regions
    assert regions["losses"] == pytest.approx(ref["losses"], rel=1e-5), (regions, ref)
