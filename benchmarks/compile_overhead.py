"""Compile-time cost of fxfuse's passes on a tiny random-init Llama (CPU is fine: passes run on the host).

Reports the time the passes took (fake propagation, each pass with its validation) from the fusion report, and
the wall time of the first training step (compile + run) with backend="fxfuse" and "inductor", caches off.
Writes benchmarks/results/compile_overhead_<device>.json.
"""
import json
import os
import platform
import subprocess
import sys
import time

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
import torch  # noqa: E402


def first_step(backend, dynamic):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 4096, (2, 64))
    t0 = time.perf_counter()
    torch.compile(model, backend=backend, dynamic=dynamic)(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - t0


def main():
    import fxfuse

    rows = []
    for dynamic in (False, True):
        for backend in ("inductor", "fxfuse", "inductor", "fxfuse"):  # twice each: the first run warms imports
            torch._dynamo.reset()
            fxfuse.clear_reports()
            wall = first_step(backend, dynamic)
            reps = fxfuse.reports()
            rows.append(dict(backend=backend, dynamic=dynamic, first_step_s=round(wall, 2),
                             pass_ms=round(sum(r.total_pass_ms for r in reps), 1) if backend == "fxfuse" else None,
                             pass_ms_by_pass={k: round(v, 1) for r in reps for k, v in r.pass_ms.items()}
                             if backend == "fxfuse" else None,
                             nodes=sum(r.num_nodes for r in reps) if backend == "fxfuse" else None))
            print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = dict(machine=platform.node(), cpu_count=os.cpu_count(), torch=torch.__version__, commit=commit,
               device=dev, rows=rows[2:4] + rows[6:8])
    path = os.path.join(os.path.dirname(__file__), "results", f"compile_overhead_{dev}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
