"""The renderer of ``benchmarks/architectures.py``: the summary of the records, ``docs/architectures.md`` (the
markdown table) and ``benchmarks/results/architectures.json``."""
from __future__ import annotations

import collections
import json
import os
import time
from typing import Any, Dict, List

from .arch_models import BATCH, PAD, SEQ, all_names
from .arch_runner import RTOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JSON_PATH = os.path.join(ROOT, "benchmarks", "results", "architectures.json")
MD_PATH = os.path.join(ROOT, "docs", "architectures.md")

# ---------------------------------------------------------------------------------------------- reporting
def summary(recs: List[Dict[str, Any]]) -> Dict[str, Any]:
    ran = [r for r in recs if r["status"] in ("ok", "error", "timeout")]
    ok = [r for r in ran if r["status"] == "ok"]
    with_attn = [r for r in ok if not r.get("why_not", {}).get("attention", "").startswith("no softmax attention")]
    moe = [r for r in ran if r.get("moe")]
    rc = collections.Counter()
    for r in ok:
        for k, v in r.get("why_not", {}).items():
            rc[f"{k}: {_short_reason(v)}"] += 1
    return dict(
        registered=len(recs), aliases=sum(r["status"] == "alias" for r in recs),
        skipped=sum(r["status"] == "skipped" for r in recs), ran=len(ran), ok=len(ok),
        errors=sum(r["status"] == "error" for r in ran), timeouts=sum(r["status"] == "timeout" for r in ran),
        lm_head_fused=sum(bool(r.get("lm_head_fused")) for r in ok),
        attention_fused=sum(bool(r.get("attention_fused")) for r in ok),
        with_softmax_attention=len(with_attn),
        attention_fused_of_those=sum(bool(r.get("attention_fused")) for r in with_attn),
        exact=sum(bool(r.get("exact")) for r in ok),
        rolled_back=sum(bool(r.get("rolled_back")) for r in ok),
        moe_ran=len(moe), moe_lm_head_fused=sum(bool(r.get("lm_head_fused")) for r in moe),
        moe_exact=sum(bool(r.get("exact")) for r in moe),
        top_reasons=rc.most_common(15),
    )


def _short_reason(s: str, n: int = 150) -> str:
    s = " ".join(str(s).split()).replace("|", "/")
    return s if len(s) <= n else s[: n - 3] + "..."


def _pct(a, b):
    return f"{a}/{b} ({100.0 * a / b:.0f}%)" if b else f"{a}/{b}"


def render_markdown(data: Dict[str, Any]) -> str:
    recs, s, meta = data["records"], data["summary"], data["meta"]
    L = []
    L.append("# Architectures\n")
    L.append(
        f"Every causal-LM architecture transformers {meta['transformers']} registers "
        f"(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {s['registered']} names), built tiny from its config class's defaults "
        f"and trained for one step (forward + backward with labels) eagerly and with "
        f"`torch.compile(backend=\"fxfuse\", options={{\"compiler\": \"aot_eager\"}})` on the CPU (torch "
        f"{meta['torch']}). Made by `python benchmarks/architectures.py` (raw rows: "
        f"`benchmarks/results/architectures.json`); the method is in the script's docstring: hidden 64, 4 heads / "
        f"2 kv heads, head_dim 16, 4 experts of 32 with top-k <= 2, one layer of each kind in hybrid models, "
        f"batch 2 x 16 with one row right-padded (attention mask) and labels with some -100, fp32, dropout 0. "
        f"`tests/test_architectures.py` asserts a subset of them.\n")
    L.append("## Summary\n")
    L.append(
        f"Of {s['ran']} decoder-only text architectures run ({s['skipped']} skipped: encoder-decoder, multimodal or "
        f"not buildable; {s['aliases']} names share a model class with another name), {s['ok']} ran in both modes "
        f"({s['errors']} failed, {s['timeouts']} timed out). Of the {s['ran']}:\n")
    L.append(f"* **lm-head loss fused**: {_pct(s['lm_head_fused'], s['ran'])}")
    L.append(f"* **attention fused**: {_pct(s['attention_fused'], s['ran'])} "
             f"({_pct(s['attention_fused_of_those'], s['with_softmax_attention'])} of those whose graphs have "
             f"softmax attention)")
    L.append(f"* **loss and every gradient equal to eager** (relative error <= {RTOL:g}): {_pct(s['exact'], s['ran'])}")
    L.append(f"* rolled-back rewrites: in {s['rolled_back']} architectures")
    L.append(f"* MoE: {s['moe_ran']} run, lm-head loss fused in {s['moe_lm_head_fused']}, exact in {s['moe_exact']}\n")
    if s["top_reasons"]:
        L.append("Most common reasons something is not fused (architectures):\n")
        for r, n in s["top_reasons"]:
            L.append(f"* {n}: {r}")
        L.append("")
    L.append("## Table\n")
    L.append("`attn`: the attention implementation transformers picked for the model (its default). `fused`: sites "
             "per pass over all graphs of the compile (`lce` = linear_cross_entropy, `sdpa` = sdpa_attention, "
             "`eager-attn` = softcap_attention). `exact`: loss and every gradient within "
             f"{RTOL:g} of eager (worst relative error in brackets).\n")
    L.append("| architecture | attn | fused | exact | not fused / rolled back / error |")
    L.append("|---|---|---|---|---|")
    short = {"linear_cross_entropy": "lce", "sdpa_attention": "sdpa", "softcap_attention": "eager-attn",
             "sdpa_causal_mask": "causal-mask", "linear_log_probs": "log-probs"}
    for r in recs:
        name = f"`{r['name']}`" + (" (MoE)" if r.get("moe") else "")
        if r["status"] == "alias":
            L.append(f"| {name} | | | | same model class as `{r['alias_of']}` ({r.get('model_class', '')}) |")
            continue
        if r["status"] == "skipped":
            L.append(f"| {name} | | | | skipped: {_short_reason(r['skip_reason'])} |")
            continue
        if r["status"] in ("error", "timeout"):
            L.append(f"| {name} | {r.get('attn_implementation') or ''} | | | **{r['status']}** "
                     f"({r.get('error_stage', '')}): {_short_reason(r.get('error', ''))} |")
            continue
        fused = ", ".join(f"{short.get(k, k)} {v}" for k, v in sorted(r.get("fused", {}).items())) or "-"
        err = max(r.get("loss_rel_err", 0.0), r.get("grad_max_rel_err", 0.0))
        exact = ("yes" if r.get("exact") else "**no**") + f" ({err:.1e})"
        if not r.get("exact") and "passes_off_err" in r:
            exact += f"; passes off: {'yes' if r['passes_off_exact'] else 'no'} ({r['passes_off_err']:.1e})"
        why = []
        for k, v in r.get("why_not", {}).items():
            why.append(f"{'lm-head' if k == 'lm_head' else k}: {_short_reason(v)}")
        for rb in r.get("rolled_back", []):
            why.append(f"**rolled back** {rb['pass_name']}: {_short_reason(rb['reason'])}")
        if r.get("grads_missing"):
            why.append(f"gradients missing/extra: {', '.join(r['grads_missing'][:3])}")
        if r.get("compiler") == "inductor":
            why.append(f"compiled with Inductor ({_short_reason(r.get('aot_eager_error', ''), 110)})")
        if r.get("lacks_modules"):
            why.append(f"(tiny model lacks {', '.join(r['lacks_modules'][:3])})")
        L.append(f"| {name} | {r.get('attn_implementation') or ''} | {fused} | {exact} | {'; '.join(why)} |")
    L.append("")
    return "\n".join(L)


def write(recs: List[Dict[str, Any]], merge: bool) -> Dict[str, Any]:
    import torch
    import transformers

    if merge and os.path.exists(JSON_PATH):
        with open(JSON_PATH) as f:
            old = {r["name"]: r for r in json.load(f)["records"]}
        new = {r["name"]: r for r in recs}
        names = all_names()
        recs = [new.get(n) or old.get(n) for n in names if (new.get(n) or old.get(n))]
    for r in recs:
        r.pop("traceback", None) if r.get("status") == "ok" else None
    data = dict(meta=dict(transformers=transformers.__version__, torch=torch.__version__, rtol=RTOL,
                          batch=[BATCH, SEQ], pad=PAD, date=time.strftime("%Y-%m-%d")),
                summary=summary(recs), records=recs)
    os.makedirs(os.path.dirname(JSON_PATH), exist_ok=True)
    with open(JSON_PATH, "w") as f:
        json.dump(data, f, indent=1, default=str)
    with open(MD_PATH, "w") as f:
        f.write(render_markdown(data))
    return data
