"""Tensor-parallel MLP layers (Llama-3-8B widths: 4096 -> 14336 -> 4096, gate / up ColwiseParallel, down
RowwiseParallel, residual), forward + backward, over the GPUs of one host (torchrun, NCCL): Inductor alone, and
fxfuse with ``tp_all_reduce_blocks`` = 0 / 1 / 2 / 4 (``fxfuse.comm_overlap``: 1 merges the gate / up input
gradients' all-reduces into one, N >= 2 also splits each all-reduced matmul into N blocks of rows). Configs
``inductor+reorder`` (Inductor with the scheduler settings of fxfuse's ``comm_overlap``) and ``fxfuse1-inorder``
(``comm_overlap=False``). Median ms of the timed steps (the ranks in lockstep, synchronised), the loss (the same
within bf16 noise in every config) and the number of NCCL all-reduces a step.

    torchrun --nproc_per_node 2 benchmarks/bench_tp_overlap.py --tokens 8192 --layers 4

Rows to $OUT/tp_overlap.jsonl (machine, versions, commit: FXFUSE_TREE where the copy's git metadata is stale).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

OUT = os.environ.get("OUT", "/tmp")


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class MLP(torch.nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate = torch.nn.Linear(d, f, bias=False)
        self.up = torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--configs", default="inductor,inductor+reorder,fxfuse1-inorder,fxfuse1,fxfuse0,fxfuse2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    a = ap.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fxfuse  # noqa: F401  (registers the backend)
    from fxfuse.comm_overlap import overlap_config_patches

    cuda = torch.cuda.is_available()  # CPU (gloo): a smoke run of the script, no timings worth reading
    dev = "cuda" if cuda else "cpu"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    mesh = init_device_mesh(dev, (world,))
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(max(1, a.tokens // 2048), min(a.tokens, 2048), a.dim, device=dev, dtype=torch.bfloat16,
                    generator=g)
    rows = []
    for cfg in a.configs.split(","):
        torch._dynamo.reset()
        torch.manual_seed(0)
        layers = torch.nn.Sequential(*[MLP(a.dim, a.ffn) for _ in range(a.layers)]).to(dev, torch.bfloat16)
        for blk in layers:
            parallelize_module(blk, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                           "down": RowwiseParallel()})
        # "+reorder" on Inductor: the scheduler settings fxfuse's comm_overlap asks for; "-inorder" on fxfuse:
        # comm_overlap off (the twenty-seventh session's fxfuse)
        name, _, flag = cfg.partition("+") if "+" in cfg else cfg.partition("-")
        if name == "inductor":
            fwd = torch.compile(layers, options=overlap_config_patches({}) if flag == "reorder" else None)
        else:
            fwd = torch.compile(layers, backend="fxfuse",
                                options={"tp_all_reduce_blocks": int(name[len("fxfuse"):]), "compiler": "inductor",
                                         "comm_overlap": flag != "inorder"})
        xi = x.clone().requires_grad_()

        def step():
            loss = fwd(xi).float().pow(2).mean()
            loss.backward()
            return loss

        for _ in range(3):
            loss = step()
        times = []
        for _ in range(a.steps):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            loss = step()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        with torch.profiler.profile() as prof:
            step()
            sync()
        nccl = [e for e in prof.events() if ("AllReduce" in e.name and e.device_type == torch.autograd.DeviceType.CUDA)
                or e.name.startswith("gloo:all_reduce")]
        rows.append(dict(bench="tp_overlap", config=cfg, tokens=a.tokens, layers=a.layers, gpus=world,
                         step_ms=round(statistics.median(times), 3), min_ms=round(min(times), 3),
                         loss=float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss),
                         all_reduces=len(nccl),
                         all_reduce_ms=round(sum(getattr(e, "device_time", 0) for e in nccl if e.device_type ==
                                                 torch.autograd.DeviceType.CUDA) / 1e3, 3),
                         device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                         commit=os.environ.get("FXFUSE_TREE")))
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        with open(os.path.join(OUT, "tp_overlap.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
