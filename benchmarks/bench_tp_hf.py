"""A transformers model under its own tensor-parallel plan (``from_pretrained(tp_plan="auto")``: attention and MLP
split by heads / columns, the lm-head split over the vocabulary and its logits gathered), one rank per GPU
(torchrun, NCCL): forward + backward of the model's own loss (``labels=``), eager, Inductor and fxfuse, each on a
fresh load of the same random-init checkpoint.

* ``--shape tiny``: a 2-layer Llama; the losses and the lm-head / embedding gradients of Inductor and fxfuse
  against eager's (a correctness check on the GPU's transformers and torch).
* ``--shape 1b``: Llama-3.2-1B widths (vocabulary 128,256, untied head), ``--tokens`` per step: median ms of the
  timed steps (after warm-up, the ranks in lockstep) and the peak memory of one step above the model (rank 0).

Rows to $OUT/tp_hf.jsonl (machine, versions, commit: FXFUSE_TREE where the copy's git metadata is stale).

    torchrun --nproc_per_node 2 benchmarks/bench_tp_hf.py --shape 1b --tokens 8192
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OUT = os.environ.get("OUT", "/tmp")
CUDA = torch.cuda.is_available()


def _config(shape):
    from transformers import LlamaConfig

    if shape == "1b":
        return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                           tie_word_embeddings=False)
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)  # transformers 5.17: V % tp == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=("tiny", "1b"))
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step (rows of 2048; tiny: rows of 16)")
    ap.add_argument("--impls", default="eager,inductor,fxfuse")
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    import transformers
    import triton

    dist.init_process_group("nccl" if CUDA else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    from torch.distributed.tensor import DTensor

    import fxfuse

    path = [None]
    if rank == 0:
        path[0] = tempfile.mkdtemp(prefix="fxfuse-tp-hf-")
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(_config(a.shape)).save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    seq = 16 if a.shape == "tiny" else 2048
    g = torch.Generator().manual_seed(1)
    cfg = _config(a.shape)
    ids = torch.randint(0, cfg.vocab_size, (max(1, a.tokens // seq), seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 8] = -100
    dev = "cuda" if CUDA else "cpu"
    ids, labels = ids.to(dev), labels.to(dev)
    commit = os.environ.get("FXFUSE_TREE") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    info = dict(bench="tp_hf", shape=a.shape, tokens=ids.numel(), gpus=world, commit=commit,
                machine=torch.cuda.get_device_name() if CUDA else "cpu", torch=torch.__version__,
                triton=triton.__version__, transformers=transformers.__version__)
    eager = None

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    for impl in a.impls.split(","):
        m = transformers.AutoModelForCausalLM.from_pretrained(
            path[0], tp_plan="auto", dtype=torch.bfloat16 if a.shape == "1b" else torch.float32,
            attn_implementation="sdpa")
        m.config.use_cache = False
        row = dict(impl=impl, **info, head_split=isinstance(m.lm_head.weight, DTensor)
                   and m.lm_head.weight.to_local().shape[0] < m.lm_head.weight.shape[0])
        fn = m if impl == "eager" else torch.compile(m) if impl == "inductor" else torch.compile(m, backend="fxfuse")

        def step():
            out = fn(input_ids=ids, labels=labels)
            row["logits_type"] = type(out.logits).__name__  # fxfuse's lazy logits, or a real tensor
            loss = out.loss
            loss.backward()
            return loss

        try:
            ts = []
            for i in range(a.steps + 3):
                m.zero_grad(set_to_none=True)
                if CUDA:
                    torch.cuda.synchronize()
                dist.barrier()
                t = time.perf_counter()
                loss = step()
                if CUDA:
                    torch.cuda.synchronize()
                ts.append((time.perf_counter() - t) * 1e3)
            row.update(ms=round(sorted(ts[3:])[len(ts[3:]) // 2], 2), first_step_s=round(ts[0] / 1e3, 2),
                       loss=float(full(loss.detach())))
            if CUDA:
                m.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                row["peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
            m.zero_grad(set_to_none=True)
            loss = step()  # one more step for the gradients compared with eager's
            params = dict(m.named_parameters())
            grads = {k: full(params[k].grad).float() for k in ("lm_head.weight", "model.embed_tokens.weight")}
            if impl == "eager":
                eager = (row["loss"], grads)
            elif eager is not None:
                row["loss_vs_eager"] = abs(row["loss"] - eager[0])
                row["grad_vs_eager"] = {k: float((grads[k] - eager[1][k]).abs().max()) for k in grads}
            if impl == "fxfuse":
                row["lce_sites"] = [f"{r.status}: {r.op[:200]} {r.reason[:90]}" for rep in fxfuse.reports()
                                    for r in rep.records if r.pass_name == "linear_cross_entropy"]
        except Exception as e:  # noqa: BLE001  (reported; the other impls still run)
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        if rank == 0:
            with open(os.path.join(OUT, "tp_hf.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
        m = fn = None  # released before the next load
        torch._dynamo.reset()
        if CUDA:
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
