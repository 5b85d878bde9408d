"""Context parallelism (torch's ring attention) with fxfuse: does the backend keep CP's results?

torch's ``context_parallel(mesh, buffers=...)`` shards each sequence over the ranks and replaces
``F.scaled_dot_product_attention`` by a wrapper that makes q, k, v sequence-sharded DTensors, whose attention
runs as ring attention across the ranks (flash / efficient / cuDNN SDPA only: no CPU path). A backend that rewrote
that SDPA into a one-rank kernel over the local chunk would attend within each rank's chunk only: silently wrong.
This compares, under CP on every rank, eager against ``torch.compile(backend="fxfuse")`` (and Inductor):

* ``sdpa``: causal SDPA of sequence-sharded q, k, v (fp32 and bf16), the output and q/k/v gradients, and the
  local output against one rank's full-sequence attention sliced to this rank's positions (CP itself correct);
* ``llama``: a small random Llama (HF, sdpa attention, bf16) with ``input_ids``, ``labels`` and ``position_ids`` as
  CP buffers, loss and gradients (embeddings, the first q_proj, the lm-head), a new length every batch.

Rows to $OUT/context_parallel.jsonl (machine, versions, commit); what fxfuse fused or left is in each row.

    torchrun --nproc_per_node 2 benchmarks/check_context_parallel.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OUT = os.environ.get("OUT", "/tmp")


def _versions():
    import transformers
    import triton

    commit = os.environ.get("FXFUSE_TREE") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    return dict(machine=torch.cuda.get_device_name(), gpus=dist.get_world_size(), torch=torch.__version__,
                triton=triton.__version__, transformers=transformers.__version__, commit=commit)


def _fused(fxfuse):
    return sorted({f"{r.pass_name}: {r.status}" + (f" ({r.reason[:80]})" if r.reason else "")
                   for rep in fxfuse.reports() for r in rep.records})


def _compiled(fn, backend):
    return fn if backend == "eager" else torch.compile(fn, backend=backend)


def check_sdpa(mesh, backend, dtype):
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    _cp_options.enable_load_balance = False  # each rank a contiguous chunk: the slice check below reads it so
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, S, Dh = 2, 4, 1024, 64
    q, k, v = (torch.randn(B, H, S, Dh, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    go = torch.randn(B, H, S, Dh, device="cuda", dtype=dtype, generator=g)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # one rank, the whole sequence

    def attn(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    fn = _compiled(attn, backend)
    ql, kl, vl, gl = (t.clone() for t in (q, k, v, go))
    with context_parallel(mesh, buffers=[ql, kl, vl, gl], buffer_seq_dims=[2, 2, 2, 2]):
        qs, ks, vs = (t.detach().requires_grad_() for t in (ql, kl, vl))
        out = fn(qs, ks, vs)
        out.backward(gl)
    n = S // world
    ref = full[:, :, rank * n:(rank + 1) * n]
    return {"out_vs_full_attention": (out.float() - ref.float()).abs().max().item(),
            "out": out.detach(), "grads": [t.grad.detach() for t in (qs, ks, vs)]}


def check_llama(mesh, backend):
    import transformers as tf
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    _cp_options.enable_load_balance = False
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"  # HF's SDPA path: torch's CP replaces the function it calls
    m = tf.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    fn = _compiled(lambda ids, pos, lab: m(input_ids=ids, position_ids=pos, labels=lab, use_cache=False).loss,
                   backend)
    losses = []
    for S in (2048, 1536, 1024):
        g = torch.Generator(device="cuda").manual_seed(S)
        ids = torch.randint(0, 1024, (2, S), device="cuda", generator=g)
        lab = ids.clone()
        pos = torch.arange(S, device="cuda").expand(2, S).contiguous()
        with context_parallel(mesh, buffers=[ids, lab, pos], buffer_seq_dims=[1, 1, 1],
                              no_restore_buffers={ids, lab, pos}):
            loss = fn(ids, pos, lab)
            loss.backward()
        losses.append(loss.item())
    grads = [p.grad.detach().float().clone() for p in (m.model.embed_tokens.weight,
                                                       m.model.layers[0].self_attn.q_proj.weight, m.lm_head.weight)]
    return {"losses": losses, "grads": grads}


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    from torch.distributed.device_mesh import init_device_mesh

    import fxfuse

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    info = _versions()
    rows = []

    def emit(row):
        if rank == 0:
            rows.append(row)
            with open(os.path.join(OUT, "context_parallel.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)

    for dtype in (torch.float32, torch.bfloat16):
        res = {}
        for backend in ("eager", "inductor", "fxfuse"):
            fxfuse.clear_reports()
            torch._dynamo.reset()
            try:
                res[backend] = check_sdpa(mesh, backend, dtype)
                row = dict(check="sdpa", dtype=str(dtype), backend=backend,
                           out_vs_full_attention=res[backend]["out_vs_full_attention"], **info)
                if backend != "eager":
                    e = res["eager"]
                    row["out_vs_eager_cp"] = (res[backend]["out"].float() - e["out"].float()).abs().max().item()
                    row["grads_vs_eager_cp"] = [(a.float() - b.float()).abs().max().item()
                                                for a, b in zip(res[backend]["grads"], e["grads"])]
                if backend == "fxfuse":
                    row["fxfuse"] = _fused(fxfuse)
            except Exception as ex:  # noqa: BLE001  (a failed case is a row, the rest still run)
                row = dict(check="sdpa", dtype=str(dtype), backend=backend, error=f"{type(ex).__name__}: "
                           f"{str(ex)[:400]}", **info)
            emit(row)
    res = {}
    for backend in ("eager", "inductor", "fxfuse"):
        fxfuse.clear_reports()
        torch._dynamo.reset()
        try:
            res[backend] = check_llama(mesh, backend)
            row = dict(check="llama", backend=backend, losses=res[backend]["losses"], **info)
            if backend != "eager" and "eager" in res:
                row["grads_rel_vs_eager_cp"] = [((a - b).norm() / b.norm()).item()
                                                for a, b in zip(res[backend]["grads"], res["eager"]["grads"])]
            if backend == "fxfuse":
                row["fxfuse"] = _fused(fxfuse)
        except Exception as ex:  # noqa: BLE001
            row = dict(check="llama", backend=backend, error=f"{type(ex).__name__}: {str(ex)[:400]}", **info)
        emit(row)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
