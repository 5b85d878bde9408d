"""The parity runner of ``benchmarks/architectures.py``: one training step of a tiny model (:mod:`.arch_models`)
eagerly and compiled with fxfuse, what was fused / skipped / rolled back and why, and the process pool that runs
each architecture in its own process with a time limit (a crash or a hang is one row, not the end of the run).

One step: fp32, train mode with every dropout set to 0 (so eager is deterministic). The compiled model is a deep
copy of the eager one before its step, compiled with ``torch.compile(backend="fxfuse", options={"compiler":
"aot_eager"})``. Parity: the loss's relative error and, per parameter, ``max|g - g_eager| / max|g_eager|`` (see
:data:`GRAD_FLOOR`); "exact" is both <= :data:`RTOL` for every parameter.
"""
from __future__ import annotations

import collections
import copy
import json
import math
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

from .arch_models import (_fields, _first_line, aliases, build_tiny, default_build_error, make_batch,
                          module_coverage, resolve, skip_reason)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the command-line entry the pool runs each architecture through (``--worker``)
CLI = os.path.join(ROOT, "benchmarks", "architectures.py")
RTOL = 2e-5  # loss and gradient parity threshold (fp32)
ATTENTION_PASSES = ("softcap_attention", "sdpa_attention")

# --------------------------------------------------------------------------------------------- one step
_CENSUS: List[Dict[str, int]] = []


def census_pass(gm) -> int:
    """An fxfuse extra pass that changes nothing: counts what is left in each graph after the built-in passes."""
    import torch
    import torch.nn.functional as F

    from fxfuse.graph_utils import graph_modules, op_kind

    c = collections.Counter()
    sdpa = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
    for _, mod in graph_modules(gm):
        for n in mod.graph.nodes:
            if n.op == "call_function" and n.target in sdpa:
                c["sdpa_masked" if (len(n.args) > 3 and n.args[3] is not None) or
                  n.kwargs.get("attn_mask") is not None else "sdpa_unmasked"] += 1
            k = op_kind(n)
            if k in ("softmax", "cross_entropy", "nll_loss", "linear", "matmul"):
                c[k] += 1
            if n.op in ("call_function", "call_method") and getattr(n.target, "__name__", n.target) in (
                    "bmm", "baddbmm"):
                c["bmm"] += 1
            if n.op == "call_function" and "flex_attention" in str(n.target):
                c["flex_attention"] += 1
            if n.op == "call_function" and str(n.target).startswith("fxfuse."):
                c[str(n.target)] += 1
    _CENSUS.append(dict(c))
    return 0


def _loss_of(out):
    return out.loss if hasattr(out, "loss") else out[0]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b, floor: float = 0.0) -> float:
    """``max|a - b| / max(max|b|, floor)`` (NaNs must sit at the same places)."""
    import torch

    den = max(b.abs().max().item() if b.numel() else 0.0, floor)
    num = (a - b).abs().max().item() if a.numel() else 0.0
    if not math.isfinite(num) or not math.isfinite(den):
        return 0.0 if torch.equal(a.isnan(), b.isnan()) and torch.allclose(
            a.nan_to_num(), b.nan_to_num()) else math.inf
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


#: a gradient's error is relative to max(its own largest entry, GRAD_FLOOR x the model's largest gradient entry):
#: gradients that are mathematically zero (a key bias, which softmax's shift invariance cancels; a router that
#: gets no gradient) are fp32 noise in eager itself (1e-12 next to 0.3), whose relative difference means nothing
GRAD_FLOOR = 1e-3


def parity(ref_loss, ref_grads, loss, grads) -> Dict[str, Any]:
    """Loss / gradient parity of a compiled step with the eager one (see GRAD_FLOOR)."""
    top = max((g.abs().max().item() for g in ref_grads.values() if g.numel()), default=0.0)
    floor = GRAD_FLOOR * top if math.isfinite(top) else 0.0
    errs = {n: _rel(grads[n], ref_grads[n], floor) for n in ref_grads if n in grads}
    raw = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads if n in grads}
    worst = max(errs, key=errs.get) if errs else None
    out = dict(loss_eager=float(ref_loss), loss_compiled=float(loss),
               loss_rel_err=_rel(loss.detach().reshape(1).double(), ref_loss.reshape(1).double()),
               grad_max_rel_err=errs[worst] if worst else 0.0, grad_worst_param=worst,
               grad_max_rel_err_unfloored=max(raw.values(), default=0.0),
               grads_missing=sorted(set(ref_grads) ^ set(grads)), grads_compared=len(errs))
    out["exact"] = bool(out["loss_rel_err"] <= RTOL and out["grad_max_rel_err"] <= RTOL and not out["grads_missing"])
    return out



def compiled_step(model, batch, options: Optional[dict] = None):
    """One forward + backward of ``model`` compiled with fxfuse (aot_eager unless ``options`` say otherwise); returns
    (loss, grads, fusion reports, census of each graph after the passes, graph-break reasons -> count)."""
    import torch

    import fxfuse

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fxfuse.clear_reports()
    _CENSUS.clear()
    opts = {"compiler": "aot_eager", "extra_passes": [census_pass], **(options or {})}
    fn = torch.compile(model, backend="fxfuse", options=opts)
    loss = _loss_of(fn(**batch))
    loss.backward()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    return loss, _grads(model), fxfuse.reports(), list(_CENSUS), breaks


def baseline_error(model, batch) -> Optional[str]:
    """The error of one step of ``model`` (a copy) under plain ``torch.compile(backend="aot_eager")``, or None."""
    import torch

    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    try:
        _loss_of(torch.compile(m, backend="aot_eager")(**batch)).backward()
    except Exception as e:  # noqa: BLE001
        return _first_line(e)[:200]
    finally:
        torch._dynamo.reset()
    return None


def run_arch(name: str, attn_implementation: Optional[str] = None, options: Optional[dict] = None,
             coverage: bool = True) -> Dict[str, Any]:
    """Build ``name`` tiny, run one step eagerly and compiled with fxfuse, return the record."""
    import torch

    rec: Dict[str, Any] = dict(name=name, status="error")
    t0 = time.time()
    why = skip_reason(name)
    cls, cc, _ = resolve(name)
    rec.update(model_class=cls.__name__, config_class=cc.__name__)
    if why:
        rec.update(status="skipped", skip_reason=why)
        return rec
    stage = "build"
    try:
        try:
            model, notes = build_tiny(name, attn_implementation)
        except Exception as e:  # noqa: BLE001
            default_err = default_build_error(name)
            if default_err is None:
                raise
            rec.update(status="skipped", skip_reason="no model builds from its config class (neither the defaults "
                       f"nor the tiny config; real checkpoints' configs fill it in): {default_err}",
                       error=_first_line(e))
            return rec
        rec["notes"] = notes
        rec["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        rec["params"] = sum(p.numel() for p in model.parameters())
        rec["moe"] = any(f in _fields(cc) for f in ("num_experts", "num_local_experts", "n_routed_experts",
                                                    "moe_num_experts")) and \
            any(getattr(model.config, f, 0) and getattr(model.config, f, 0) > 1
                for f in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
                if isinstance(getattr(model.config, f, 0), int))
        if coverage:
            rec["lacks_modules"] = module_coverage(name, model)
        batch = make_batch(model)
        compiled_model = copy.deepcopy(model)

        stage = "eager"
        out = model(**batch)
        loss = _loss_of(out)
        if loss is None:
            raise RuntimeError("the model returned no loss for labels")
        loss.backward()
        ref_loss, ref_grads = loss.detach().clone(), _grads(model)
        rec["eager_s"] = round(time.time() - t0, 2)

        stage = "compiled"
        t1 = time.time()
        try:
            loss, got_grads, reports, census, breaks = compiled_step(compiled_model, batch, options)
        except Exception as e:  # noqa: BLE001
            # Is it fxfuse? The same model under plain torch.compile(backend="aot_eager"); if that fails too, the
            # step is run again with fxfuse in front of Inductor (its default compiler).
            base = baseline_error(model, batch)
            if base is None or (options or {}).get("compiler") == "inductor":
                raise
            rec["compiler"] = "inductor"
            rec["aot_eager_error"] = f"plain aot_eager fails too: {base}"
            compiled_model = copy.deepcopy(model)
            compiled_model.zero_grad(set_to_none=True)
            loss, got_grads, reports, census, breaks = compiled_step(compiled_model, batch,
                                                                     {**(options or {}), "compiler": "inductor"})
        rec["compiled_s"] = round(time.time() - t1, 2)

        stage = "compare"
        rec.update(parity(ref_loss, ref_grads, loss.detach(), got_grads))
        _summarise_reports(rec, reports, census)
        if not rec["exact"]:
            # Is it fxfuse? The same step with every pass off (the same compiler): if that differs from eager as
            # much, the difference is the compiler's or the model's (nondeterminism), not a rewrite's
            base_model = copy.deepcopy(model)
            base_model.zero_grad(set_to_none=True)
            b_loss, b_grads, *_ = compiled_step(base_model, batch, {**(options or {}), "passes": [],
                                                                    "compiler": rec.get("compiler") or "aot_eager"})
            b = parity(ref_loss, ref_grads, b_loss.detach(), b_grads)
            rec["passes_off_exact"] = b["exact"]
            rec["passes_off_err"] = max(b["loss_rel_err"], b["grad_max_rel_err"])
        rec["graph_breaks"] = sum(breaks.values())
        rec["graph_break_reasons"] = sorted(breaks)[:5]
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        rec["error_stage"] = stage
        rec["error"] = _first_line(e)
        rec["traceback"] = traceback.format_exc()[-3000:]
        if stage in ("compiled", "compare"):
            try:
                import fxfuse

                _summarise_reports(rec, fxfuse.reports(), list(_CENSUS))
            except Exception:  # noqa: BLE001
                pass
    finally:
        torch._dynamo.reset()
    rec["total_s"] = round(time.time() - t0, 2)
    return rec


def _summarise_reports(rec, reports, census):
    fused = collections.Counter()
    skipped = collections.Counter()
    rolled = collections.Counter()
    for rep in reports:
        for r in rep.records:
            if r.pass_name.startswith("extra_passes"):
                continue
            if r.status == "fused":
                fused[r.pass_name] += 1
            elif r.status == "skipped":
                skipped[(r.pass_name, r.op, r.reason)] += 1
            else:
                rolled[(r.pass_name, r.op, r.reason)] += 1
    cen = collections.Counter()
    for c in census:
        cen.update(c)
    rec["graphs"] = len(reports)
    rec["fused"] = dict(fused)
    rec["skipped"] = [dict(pass_name=p, op=o, reason=r, count=n) for (p, o, r), n in skipped.items()]
    rec["rolled_back"] = [dict(pass_name=p, op=o, reason=r, count=n) for (p, o, r), n in rolled.items()]
    rec["census_after_passes"] = dict(cen)
    rec["lm_head_fused"] = fused.get("linear_cross_entropy", 0) > 0
    rec["attention_fused"] = any(fused.get(p, 0) for p in ATTENTION_PASSES)
    rec["attention_sites"] = sum(fused.get(p, 0) for p in ATTENTION_PASSES)
    rec["why_not"] = why_not(rec)


def why_not(rec) -> Dict[str, str]:
    """Per missing fusion (lm-head loss, attention), the reason: a pass's skip / rollback reason, or what the census
    of the compiled graphs shows."""
    out = {}
    cen = rec.get("census_after_passes", {})

    def reasons(passes):
        rs = [r for r in rec.get("rolled_back", []) if r["pass_name"] in passes]
        rs += [r for r in rec.get("skipped", []) if r["pass_name"] in passes]
        return rs

    if not rec.get("lm_head_fused"):
        rs = reasons(("linear_cross_entropy",))
        if rs:
            r = rs[0]
            out["lm_head"] = ("rolled back: " if r in rec.get("rolled_back", []) else "") + r["reason"]
        elif not (cen.get("cross_entropy") or cen.get("nll_loss")):
            out["lm_head"] = "no cross_entropy / nll_loss in the compiled graphs"
        else:
            out["lm_head"] = "cross_entropy present but no site recorded"
    if not rec.get("attention_fused"):
        rs = reasons(ATTENTION_PASSES)
        if rs:
            r = rs[0]
            out["attention"] = ("rolled back: " if r in rec.get("rolled_back", []) else "") + \
                f"{r['pass_name']}: {r['reason']}"
        elif cen.get("sdpa_unmasked"):
            out["attention"] = "SDPA without a mask tensor (SDPA's own kernels; nothing to fuse)"
        elif cen.get("flex_attention"):
            out["attention"] = "flex_attention"
        elif cen.get("softmax") and cen.get("bmm"):
            out["attention"] = ("scores from a 3-D [batch x heads, S, D] bmm / baddbmm (the matcher wants a 4-D "
                                "q @ k^T); no site recorded")
        elif cen.get("softmax"):
            out["attention"] = "softmax not recognised as attention (no site recorded)"
        else:
            out["attention"] = "no softmax attention in the graphs (SSM / recurrent / other mixer)"
    return out


def _worker(name: str, out_path: str, attn: Optional[str]) -> None:
    import torch

    torch.set_num_threads(1)
    rec = run_arch(name, attn)
    with open(out_path, "w") as f:
        json.dump(rec, f, default=str)


def _run_one(name: str, timeout: int, attn: Optional[str], tmpdir: str) -> Dict[str, Any]:
    out_path = os.path.join(tmpdir, f"{name}.json")
    cmd = [sys.executable, CLI, "--worker", name, "--out", out_path]
    if attn:
        cmd += ["--attn", attn]
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(name=name, status="timeout", error=f"over the {timeout} s limit", total_s=round(time.time() - t0))
    if os.path.exists(out_path):
        with open(out_path) as f:
            return json.load(f)
    tail = (p.stderr or "").strip().splitlines()[-3:]
    return dict(name=name, status="error", error_stage="process", error=f"worker exited {p.returncode}: "
                + " | ".join(tail)[-400:], total_s=round(time.time() - t0))


def run_all(names: List[str], timeout: int, workers: int, attn: Optional[str]) -> List[Dict[str, Any]]:
    import tempfile

    al = aliases()
    recs: Dict[str, Dict[str, Any]] = {}
    todo = []
    for n in names:
        if n in al:
            cls, cc, _ = resolve(n)
            recs[n] = dict(name=n, status="alias", alias_of=al[n], model_class=cls.__name__, config_class=cc.__name__)
        else:
            todo.append(n)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(workers) as ex:
        futs = {n: ex.submit(_run_one, n, timeout, attn, tmp) for n in todo}
        for n in todo:
            r = futs[n].result()
            recs[n] = r
            print(f"{n:28s} {r['status']:8s} {r.get('total_s', '')!s:>7} s  fused={r.get('fused')}  "
                  f"exact={r.get('exact')}  {r.get('error') or r.get('skip_reason') or r.get('why_not') or ''}",
                  flush=True)
    return [recs[n] for n in names]
