"""Whether Inductor's FX graph cache works for graphs compiled under ``fxfuse.install()`` on this torch.

    TORCHINDUCTOR_CACHE_DIR=/tmp/ic python benchmarks/check_install_cache.py   # twice, the same cache folder

Compiles a tiny random Llama's training step (forward + backward, loss fused) with ``backend="inductor"`` and
fxfuse's passes installed, then prints one JSON line: Inductor's FX-graph-cache counters (a graph whose key cannot
be computed, e.g. a pass that does not pickle, counts as a bypass), the log lines that mention pickling, and what
fxfuse fused. A first run in an empty folder should miss and store (no bypass); a second run should hit, and then
fuses nothing new (a cache hit skips the pre-grad passes: the cached code already has the fusions).
"""
import io
import json
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fxfuse


def main():
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    handler.setLevel(logging.DEBUG)
    for name in ("torch._inductor", "torch._functorch", "torch._dynamo"):
        logging.getLogger(name).addHandler(handler)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, use_cache=False)
    model = LlamaForCausalLM(cfg).to(dev)
    fxfuse.install()
    step = torch.compile(model)
    ids = torch.randint(0, 256, (2, 32), device=dev)
    loss = step(input_ids=ids, labels=ids.clone()).loss
    loss.backward()
    from torch._dynamo.utils import counters

    print("RESULT", json.dumps({
        "torch": torch.__version__, "device": dev,
        "fxgraph_cache": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
        "aot_autograd_cache": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
        "pickle_log_lines": [ln[:200] for ln in log.getvalue().splitlines() if "pickle" in ln.lower()][:5],
        "fused": sorted({r.pass_name for rep in fxfuse.reports() for r in rep.fused}),
        "loss": round(loss.item(), 5)}), flush=True)


if __name__ == "__main__":
    main()
