"""TRL's fused lm-head (its ChunkedLogProbFunction, as TRL trainers call it) beside what fxfuse makes of it under
torch.compile, on the GPU, fwd+bwd, for the output sets TRL's trainers ask for (--outputs):
  grpo  log-probs + entropy, both with gradients (GRPO's policy with an entropy term)
  sft   log-probs (the loss), entropy and is_top1 detached (SFTTrainer's metrics)
  dpo   log-probs (the loss), entropy, mean logits, is_top1, log sum p^2 detached (DPOTrainer with WPO weighting)

Rows (one process, same inputs; Llama-3-8B head 4096 x 128256 and Gemma-2-2B head 2304 x 256000 with its final
softcap 30, N tokens, bf16):
  trl_eager        trl.trainer.utils._ChunkedLogProbFunction.apply(...) run eagerly (what runs without fxfuse,
                   or between graphs when Dynamo breaks at it)
  trl_in_graph     the same call compiled with backend="fxfuse" and the pass trl_fused_head disabled: TRL's kernel
                   as one graph node (fxfuse's shim)
  fxfuse           compiled with backend="fxfuse": the node rewritten to fxfuse::linear_log_probs
Per row: ms (median of --reps), peak extra GiB over the inputs, max |diff| of log-probs / entropy / grads vs
trl_eager, the metrics' agreement with trl_eager (share of equal is_top1, max |diff| of the others), and the
fusion report's line for the site.

    python benchmarks/bench_trl_head.py [--tokens 8192] [--reps 10] [--outputs grpo,sft,dpo]
                                                                          (rows to $OUT/trl_head.jsonl)
"""
import argparse
import itertools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxfuse  # noqa: E402

try:
    import trl.trainer.utils as trl_utils  # noqa: E402
    TRL_UTILS = "trl.trainer.utils"
except ImportError:  # a machine without TRL's trainer dependencies (datasets, accelerate, pandas): its kernel only
    import contextlib
    import types

    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    trl_utils = types.ModuleType("trl.trainer.utils")
    trl_utils._ChunkedLogProbFunction = ChunkedLogProbFunction
    trl_utils.maybe_gather_lm_head_ctx = lambda weight, bias: contextlib.nullcontext()  # what TRL's backward imports
    sys.modules["trl.trainer.utils"] = trl_utils
    fxfuse.ops.trl_fused_head.install_trl_shim()
    TRL_UTILS = "stub module holding TRL's ChunkedLogProbFunction (trainer dependencies missing)"

HEADS = {"llama3-8b": (4096, 128256, None), "gemma2-2b": (2304, 256000, 30.0)}
# output set -> (TRL's optional outputs, whether the entropy carries a gradient)
OUTPUT_SETS = {"grpo": (("entropy",), True), "sft": (("entropy", "is_top1"), False),
               "dpo": (("entropy", "mean_logits", "is_top1", "log_sum_sq_probs"), False)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--outputs", default="grpo", help="comma-separated: " + ", ".join(OUTPUT_SETS))
    args = ap.parse_args()
    dev = torch.device("cuda")
    out_path = os.path.join(os.environ.get("OUT", "/tmp"), "trl_head.jsonl")
    for (head, (D, V, softcap)), oset in itertools.product(HEADS.items(), args.outputs.split(",")):
        outputs, ent_grad = OUTPUT_SETS[oset]
        torch.manual_seed(0)
        N = args.tokens
        h0 = (torch.randn(N, D, device=dev) * 0.5).to(torch.bfloat16)
        w0 = (torch.randn(V, D, device=dev) * D ** -0.5).to(torch.bfloat16)
        t = torch.randint(0, V, (N,), device=dev)
        adv = torch.randn(N, device=dev)

        def step(h, w):
            lp, ent, lssp, mean, top1 = trl_utils._ChunkedLogProbFunction.apply(h, w, None, t, 0.9, 32768, softcap,
                                                                                1.0, outputs)
            if ent_grad:
                loss = -(lp * adv).sum() + 0.01 * ent.sum()
            else:
                loss = -lp.sum() / N
                ent = ent.detach()
            metrics = [x.detach() for x in (top1, mean, lssp) if x is not None]
            return loss, lp, ent, metrics

        results = {}
        for impl in ("trl_eager", "trl_in_graph", "fxfuse"):
            torch._dynamo.reset()
            fxfuse.clear_reports()
            if impl == "trl_eager":
                fn = step
            else:
                opts = {"passes": {"trl_fused_head": False}} if impl == "trl_in_graph" else None
                fn = torch.compile(step, backend="fxfuse", options=opts)
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()

            def run():
                h.grad = w.grad = None
                loss, lp, ent, metrics = fn(h, w)
                loss.backward()
                return lp, ent, metrics
            lp, ent, metrics = run()  # compiles
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                lp, ent, metrics = run()
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1))
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            vals = [lp.detach().float(), ent.detach().float(), h.grad.float(), w.grad.float()]
            results[impl] = (vals, metrics)
            diff = metric_agreement = None
            if impl != "trl_eager":
                ref_vals, ref_metrics = results["trl_eager"]
                diff = [float((a - b).abs().max()) for a, b in zip(vals, ref_vals)]
                metric_agreement = [float((a == b).float().mean()) if a.dtype == torch.bool
                                    else float((a - b).abs().max()) for a, b in zip(metrics, ref_metrics)]
            rep = fxfuse.report() if impl != "trl_eager" else None
            site = [f"{r.status}: {r.op} {r.reason}" for r in (rep.fused + rep.skipped if rep else [])
                    if r.pass_name == "trl_fused_head"]
            row = dict(head=head, outputs=oset, trl_outputs=list(outputs), entropy_grad=ent_grad, impl=impl,
                       tokens=N, D=D, V=V, softcap=softcap, ms=statistics.median(times),
                       peak_extra_gib=round(peak, 3), max_diff_logp_ent_dh_dw_vs_trl=diff,
                       metrics_vs_trl_top1_share_equal_then_max_diff=metric_agreement, site=site,
                       gpu=torch.cuda.get_device_name(), torch=torch.__version__, trl_utils=TRL_UTILS,
                       graph_breaks=dict(torch._dynamo.utils.counters["graph_break"]))
            print("@@ROW", json.dumps(row), flush=True)
            with open(out_path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            del h, w, lp, ent, metrics, fn
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
