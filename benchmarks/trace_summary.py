"""Where a training step's GPU time goes, from a torch.profiler Chrome trace (``prof.export_chrome_trace``).

    python benchmarks/trace_summary.py trace.json[.gz] [--steps N]

Prints (and returns, as a dict) per step: the wall time the trace's kernels span, the time some compute kernel
runs (the union of the non-NCCL kernels' intervals, any stream), the GPU idle time (neither compute nor NCCL),
NCCL kernel time and the part of it no compute kernel overlaps (communication that the step waits for, if the
compute stream waits on it), and the kernel time by kind: matmuls, attention, Triton (Inductor's and fxfuse's
fused kernels), the optimizer's foreach kernels, copies / casts, NCCL and the rest, with the top kernels by time,
the longest stretches without a compute kernel (where, how long, what NCCL ran there, between which kernels),
what the host was doing while the GPU ran nothing (the CPU ops overlapping those gaps, inclusive), and how much
the compute kernels that ran beside NCCL were slowed (``beside_nccl``: one kernel at one grid, with and without).
Kernel names decide the kind (cuBLAS / CUTLASS / nvjet are matmuls, flash / fmha / cudnn / fxfuse's attention
kernels are attention, ``triton_`` are Inductor's fused kernels, ``ncclDevKernel`` / ``ncclKernel`` NCCL).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

KINDS = (  # (kind, substrings of a kernel's name, lower case), first match wins; Inductor's generated kernels
    # (named triton_<kind>_fused_<ops>) are "triton" whatever ops their names list
    ("nccl", ("nccl",)),
    ("triton", ("triton_poi_", "triton_red_", "triton_per_", "triton_tem_")),
    ("attention", ("flash", "fmha", "cudnn", "attn", "attention")),
    ("lm-head loss", ("_lce_", "_ce_", "_logp", "cross_entropy", "log_softmax", "nll_loss")),
    ("lora", ("_lora_", "_adapter")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "wgmma", "_mm_", "matmul")),
    ("optimizer", ("multi_tensor", "foreach", "adam")),
    ("copy/cast", ("copy", "cast", "memcpy", "memset", "fill", "chunk_cat", "split_with_sizes")),
    ("triton", ("triton",)),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: List[Tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _uncovered(xs: List[Tuple[float, float]], cover: List[Tuple[float, float]]) -> float:
    """Length of the union ``xs`` outside the union ``cover`` (both sorted, disjoint)."""
    total, j = 0.0, 0
    for a, b in xs:
        cur = a
        while j < len(cover) and cover[j][1] <= cur:
            j += 1
        k = j
        while cur < b:
            if k >= len(cover) or cover[k][0] >= b:
                total += b - cur
                break
            if cover[k][0] > cur:
                total += cover[k][0] - cur
            cur = max(cur, cover[k][1])
            k += 1
    return total


def compute_gaps(kernels: List[Dict], iv: List[Tuple[float, float]], compute: List[Tuple[float, float]],
                 top: int = 8) -> List[Dict]:
    """The longest stretches of the trace with no compute kernel running (the step waits there: for NCCL, for the
    host, or for nothing), longest first: where it starts (ms from the trace's first kernel), how long it is, how
    much of it NCCL kernels cover and which (their names, shortened), and the compute kernels just before and after
    it, which place it in the step (the first all-gather before the first layer's GEMMs, the last reduce-scatter
    before the optimizer's kernels)."""
    t0 = min(a for a, _ in iv)
    holes = [(b0, a1) for (_, b0), (a1, _) in zip(compute, compute[1:]) if a1 > b0]
    out = []
    for a, b in sorted(holes, key=lambda h: h[0] - h[1])[:top]:
        nccl = [(max(x, a), min(y, b), e["name"]) for (x, y), e in zip(iv, kernels)
                if kind_of(e["name"]) == "nccl" and x < b and y > a]
        before = max(((y, e["name"]) for (x, y), e in zip(iv, kernels) if kind_of(e["name"]) != "nccl" and y <= a),
                     default=(0.0, ""))[1]
        after = min(((x, e["name"]) for (x, y), e in zip(iv, kernels) if kind_of(e["name"]) != "nccl" and x >= b),
                    default=(0.0, ""))[1]
        out.append({"at_ms": round((a - t0) / 1e3, 2), "ms": round((b - a) / 1e3, 2),
                    "nccl_ms": round(_length(_union([(x, y) for x, y, _ in nccl])) / 1e3, 2),
                    "nccl": sorted({_short(n) for _, _, n in nccl}), "before": _short(before), "after": _short(after)})
    return out


def host_during_idle(trace: Dict, kernels: List[Dict], iv: List[Tuple[float, float]], steps: int = 1,
                     min_gap_us: float = 5.0, top: int = 20) -> Dict:
    """What the host was doing while the GPU ran nothing at all (no kernel, NCCL's included): the GPU waits for
    the host there. Each CPU op (``cpu_op`` / ``user_annotation`` events of every thread: the main one and the
    autograd engine's) is credited with its overlap with those gaps (gaps shorter than ``min_gap_us`` are left
    out: a launch's own latency), so nested ops each get their inclusive share; the longest first, per step."""
    busy = _union(iv)
    gaps = [(b0, a1) for (_, b0), (a1, _) in zip(busy, busy[1:]) if a1 - b0 >= min_gap_us]
    starts = [a for a, _ in gaps]
    per: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in ("cpu_op", "user_annotation") or "dur" not in e:
            continue
        s0 = float(e["ts"])
        s1 = s0 + float(e["dur"])
        i = max(0, bisect.bisect_right(starts, s0) - 1)
        got = 0.0
        while i < len(gaps) and gaps[i][0] < s1:
            got += max(0.0, min(s1, gaps[i][1]) - max(s0, gaps[i][0]))
            i += 1
        if got > 0:
            rec = per[e.get("name", "?")[:100]]
            rec[0] += got
            rec[1] += 1
    ms = lambda us: round(us / 1e3 / steps, 2)  # noqa: E731
    return {"gaps": int(len(gaps) / steps), "gap_ms": ms(_length(gaps)),
            "ops": [{"name": n, "ms": ms(v[0]), "events": int(v[1] / steps)}
                    for n, v in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]]}


def _overlap(a: float, b: float, cover: List[Tuple[float, float]], starts: List[float]) -> float:
    """Length of [a, b) inside the union ``cover`` (sorted, disjoint; ``starts`` its interval starts)."""
    i, got = max(0, bisect.bisect_right(starts, a) - 1), 0.0
    while i < len(cover) and cover[i][0] < b:
        got += max(0.0, min(b, cover[i][1]) - max(a, cover[i][0]))
        i += 1
    return got


def beside_nccl(kernels: List[Dict], iv: List[Tuple[float, float]], nccl: List[Tuple[float, float]],
                ops: Optional[Dict] = None, top: int = 8) -> Dict:
    """How much NCCL kernels running beside them slow the compute kernels (NCCL takes SMs and memory bandwidth).
    Per kind, the kernel time that overlapped NCCL; then, for the launches of one kernel doing the same work, the
    mean duration of the launches that ran beside NCCL for more than half their time against those that ran with
    none: ``ratio`` > 1 is the slowdown. The same work: the same kernel at the same grid, launched by the same CPU op
    with the same input shapes as its same-numbered launch (``ops`` maps a kernel's ``External id`` to that op and
    its shapes: :func:`launching_ops`, which needs ``record_shapes=True``), since a persistent kernel's grid is the
    SM count at any shape. The ``top`` such groups by total time, and the matmuls' sum: ``matmul_alone_ms`` is what
    the compared matmul launches would have taken at their no-NCCL speed."""
    starts = [a for a, _ in nccl]
    ops = ops or {}
    by_kind: Dict[str, float] = defaultdict(float)
    groups: Dict[Tuple, List[List[float]]] = defaultdict(lambda: [[], []])
    nth: Dict[object, int] = defaultdict(int)
    for (a, b), e in sorted(zip(iv, kernels), key=lambda p: p[0]):
        kind = kind_of(e["name"])
        if kind == "nccl" or b <= a:
            continue
        o = _overlap(a, b, nccl, starts)
        by_kind[kind] += o
        # The same work: a persistent kernel's grid is the SM count whatever its shapes, so the key also has the
        # CPU op that launched it with that op's input shapes (record_shapes) and which of its launches this is
        args = e.get("args", {})
        ext = args.get("External id")
        key = (e["name"], str(args.get("grid")), ops.get(ext), nth[ext] if ext is not None else 0)
        if ext is not None:
            nth[ext] += 1
        if o > 0.5 * (b - a):
            groups[key][0].append(b - a)
        elif o == 0:
            groups[key][1].append(b - a)
    rows, mm_actual, mm_alone = [], 0.0, 0.0
    for (name, grid, op, _), (w, wo) in groups.items():
        if not w or not wo:
            continue
        mean_w, mean_wo = sum(w) / len(w), sum(wo) / len(wo)
        rows.append({"name": _short(name), "grid": grid, "op": op[0] if op else None, "kind": kind_of(name),
                     "beside": len(w), "alone": len(wo),
                     "mean_beside_us": round(mean_w, 1), "mean_alone_us": round(mean_wo, 1),
                     "ratio": round(mean_w / mean_wo, 3), "total_ms": (sum(w) + sum(wo)) / 1e3})
        if kind_of(name) == "matmul":
            mm_actual += sum(w) + sum(wo)
            mm_alone += mean_wo * (len(w) + len(wo))
    rows.sort(key=lambda r: -r["total_ms"])
    for r in rows:
        r["total_ms"] = round(r["total_ms"], 2)
    return {"overlapped_ms_by_kind": {k: round(v / 1e3, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "matmul_compared_ms": round(mm_actual / 1e3, 2), "matmul_alone_ms": round(mm_alone / 1e3, 2),
            "groups": rows[:top]}


def launching_ops(trace: Dict) -> Dict:
    """``External id`` -> (CPU op name, its input shapes) for every CPU op of the trace that has one."""
    out = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            ext = e.get("args", {}).get("External id")
            if ext is not None:
                out[ext] = (e.get("name"), str(e.get("args", {}).get("Input Dims")))
    return out


def _short(name: str) -> str:
    """A kernel's name without its template arguments and argument list, at most 60 characters."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    return name.split("<")[0].split("(")[0][:60]


def summarize(trace: Dict, steps: int = 1, top: int = 15, gaps: int = 8) -> Dict:
    kernels = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in ("kernel",
                                                                                                   "gpu_memcpy",
                                                                                                   "gpu_memset")]
    if not kernels:
        return {"error": "no kernel events in the trace"}
    rank0 = min(e.get("pid") for e in kernels if isinstance(e.get("pid"), int)) if any(
        isinstance(e.get("pid"), int) for e in kernels) else None
    kernels = [e for e in kernels if rank0 is None or e.get("pid") == rank0]  # one device
    iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]
    span = max(b for _, b in iv) - min(a for a, _ in iv)
    nccl = _union([x for x, e in zip(iv, kernels) if kind_of(e["name"]) == "nccl"])
    compute = _union([x for x, e in zip(iv, kernels) if kind_of(e["name"]) != "nccl"])
    busy = _union(nccl + compute)
    by_kind: Dict[str, float] = defaultdict(float)
    by_name: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for (a, b), e in zip(iv, kernels):
        by_kind[kind_of(e["name"])] += b - a
        rec = by_name[e["name"][:110]]
        rec[0] += b - a
        rec[1] += 1
    ms = lambda us: round(us / 1e3 / steps, 2)  # noqa: E731  (per step, ms)
    return {
        "compute_gaps": compute_gaps(kernels, iv, compute, top=gaps),
        "host_during_idle": host_during_idle(trace, kernels, iv, steps),
        "steps": steps,
        "span_ms": ms(span),
        "compute_busy_ms": ms(_length(compute)),
        "idle_ms": ms(span - _length(busy)),
        "nccl_ms": ms(_length(nccl)),
        "nccl_exposed_ms": ms(_uncovered(nccl, compute)),
        # the CTAs (= SMs) NCCL's kernels hold while they run (NCCL_MAX_CTAS caps them)
        "nccl_grids": sorted({str(e.get("args", {}).get("grid")) for e in kernels if kind_of(e["name"]) == "nccl"}),
        "by_kind_ms": {k: ms(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "ms": ms(v[0]), "calls": int(v[1] / steps), "kind": kind_of(n)}
                        for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
        # (whole trace, not per step: a ratio of means)
        "beside_nccl": beside_nccl(kernels, iv, nccl, launching_ops(trace)),
    }


def load(path: str) -> Dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=1)
    a = ap.parse_args()
    print(json.dumps(summarize(load(a.trace), a.steps), indent=1))


if __name__ == "__main__":
    main()
