"""Where an attention layer's time goes, kernel by kernel, on the GPU: fxfuse's forward / delta / dK-dV / dQ
kernels beside FlexAttention's and SDPA's (cuDNN, flash), at one 8B-heads layer (32 q / 8 kv heads), bf16, B 1.

Layouts (``--layouts``): causal, docsN (N packed documents), winN (causal, window of N keys), padP (right padding:
P% of the keys valid), mixed (log-normal document lengths, median 300 tokens: :func:`mixed_doc_ids`).

Sections (``--sections``, comma list):
  breakdown  each impl once under torch.profiler: device ms per kernel name, fwd and bwd apart
  sweep      fxfuse tile configs per kernel (``--sweep-json``: {"fwd": [[BM, BN, warps, stages], ...], ...},
             or per head dim {"128": {"dkdv": [...]}, ...}),
             the other kernels at their defaults; ms of the pass that holds the kernel
``--switches '{"FAST_TANH": false}'`` sets :mod:`fxfuse.attention.launching` switches for the whole run.
  probe      which SDPA backends run the case (GQA, head dim), and what plain SDPA picks by default

Run (device): PYTHONPATH=. python3 benchmarks/profile_attention_kernels.py --S 32768 --dims 64,128
Rows go to $OUT/attn_kernels.jsonl (one JSON object a line; ``part``: fwd, bwd, fwdbwd or a kernel name).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

OUT = os.environ.get("OUT", "/tmp")
T0 = time.time()


def emit(**row):
    row["t"] = round(time.time() - T0, 1)
    with open(os.path.join(OUT, "attn_kernels.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def n_docs(layout):
    """docsN: N equal packed documents (docs8: 8)."""
    return int(layout[4:]) if layout.startswith("docs") else 1


def mixed_doc_ids(S, device="cuda"):
    """Document id of each of S tokens packed with log-normal document lengths (median 300 tokens, sigma 1,
    clipped to [16, 4096], seed 0: the packed-SFT data of bench_varlen.py), the last one cut at S."""
    g = torch.Generator().manual_seed(0)
    lens, total = [], 0
    while total < S:
        n = int(min(4096, max(16, 300 * torch.exp(torch.randn((), generator=g)).item())))
        lens.append(min(n, S - total))
        total += lens[-1]
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)


def has_docs(layout):
    """Whether a layout packs documents (its rows run the kernels' ``<kernel>_docs`` tiles)."""
    return layout.startswith("docs") or layout == "mixed"


def layout_recipe(layout, S):
    """(window, doc_ranges, key_valid) of a layout (see the module docstring); padP: one row, its last keys
    padding."""
    from fxfuse.ops import document_ranges
    window = int(layout[3:]) if layout.startswith("win") else 0
    dr = (document_ranges(torch.arange(S, device="cuda")[None] // (S // n_docs(layout)))
          if layout.startswith("docs") else None)
    if layout == "mixed":
        dr = document_ranges(mixed_doc_ids(S)[None])
    kv = (torch.arange(S, device="cuda")[None] < S * int(layout[3:]) // 100) if layout.startswith("pad") else None
    return window, dr, kv


def kept_fraction(layout, S):
    """Fraction of the causal half's scores a layout keeps (for the tflops column)."""
    if layout.startswith("win"):
        w = int(layout[3:])
        return (w * S - w * w / 2) / (S * S / 2)
    if layout.startswith("pad"):
        return (int(layout[3:]) / 100) ** 2
    if layout == "mixed":
        return float((torch.bincount(mixed_doc_ids(S, "cpu")).double() ** 2).sum() / S ** 2)
    return 1 / n_docs(layout)


def flops_fwd(S, D, Hq, layout):
    """Forward matmul flops of the kept scores (causal: half; docs: each document's causal half)."""
    full = 4 * S * S * D * Hq
    return full / 2 * kept_fraction(layout, S)


def median_ms(fn, rep_ms=200):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def inputs(S, Hq, Hkv, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(1, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)


def fxfuse_parts(S, D, layout, q, k, v, do, config=None):
    from fxfuse.attention.backward import attention_bwd_triton
    from fxfuse.attention.forward import attention_fwd_triton
    win, dr, kv = layout_recipe(layout, S)
    sc = D ** -0.5
    rec = dict(config=config, doc_ranges=dr, key_valid=kv)
    out, lse = attention_fwd_triton(q, k, v, None, sc, 0.0, True, win, **rec)
    fwd = lambda: attention_fwd_triton(q, k, v, None, sc, 0.0, True, win, **rec)
    bwd = lambda: attention_bwd_triton(do, q, k, v, None, out, lse, sc, 0.0, True, win, **rec)
    return fwd, bwd


def autograd_parts(attn, q, k, v, do):
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o = attn(qg, kg, vg)

    def fwd():
        with torch.no_grad():
            return attn(q, k, v)

    def bwd():
        torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
    return fwd, bwd


def anchor_impls(S, D, layout):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    impls = {}
    # each (head dim, layout) compiles its own block mask and kernel: start Dynamo afresh, or the eighth one passes
    # its recompile limit and FlexAttention falls back to its unfused path (it ran out of memory at Dh 64 docs8)
    torch._dynamo.reset()
    if layout == "causal":
        for name, be in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            def attn(q, k, v, be=be):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            impls[name] = attn
    doc = S // n_docs(layout)
    win = int(layout[3:]) if layout.startswith("win") else S
    valid = S * int(layout[3:]) // 100 if layout.startswith("pad") else S
    # the same keys as layout_recipe's: causal, in the query's document, within the window, not padding
    if layout == "mixed":
        ids = mixed_doc_ids(S)
        mod = lambda b, h, qi, ki: (qi >= ki) & (ids[qi] == ids[ki])
    else:
        mod = lambda b, h, qi, ki: (qi >= ki) & (qi // doc == ki // doc) & (qi - ki < win) & (ki < valid)
    bm = create_block_mask(mod, None, None, S, S, device="cuda", _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)
    impls["flex"] = lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True)
    return impls


def kernel_breakdown(fn, reps=3):
    """{kernel name: device ms per call} of fn() under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            out[ev.key[:80]] = round(t / 1e3 / reps, 3)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


def sec_breakdown(args):
    for D in args.dims:
        for layout in args.layouts:
            S, Hq, Hkv = args.S, args.hq, args.hkv
            q, k, v, do = inputs(S, Hq, Hkv, D)
            ff = flops_fwd(S, D, Hq, layout)
            impls = {"fxfuse": None}
            if args.anchors:
                impls.update(anchor_impls(S, D, layout))
            for name, attn in impls.items():
                try:
                    fwd, bwd = (fxfuse_parts(S, D, layout, q, k, v, do) if attn is None
                                else autograd_parts(attn, q, k, v, do))
                    tf, tb = median_ms(fwd), median_ms(bwd)
                    emit(impl=name, layout=layout, D=D, S=S, part="fwd", ms=round(tf, 3),
                         tflops=round(ff / tf / 1e9))
                    emit(impl=name, layout=layout, D=D, S=S, part="bwd", ms=round(tb, 3),
                         tflops=round(2.5 * ff / tb / 1e9))
                    emit(impl=name, layout=layout, D=D, S=S, part="fwdbwd", ms=round(tf + tb, 3),
                         tflops=round(3.5 * ff / (tf + tb) / 1e9))
                    emit(impl=name, layout=layout, D=D, S=S, part="kernels_fwd", kernels=kernel_breakdown(fwd))
                    emit(impl=name, layout=layout, D=D, S=S, part="kernels_bwd", kernels=kernel_breakdown(bwd))
                except Exception as e:  # one impl failing must not lose the rest of the call
                    emit(impl=name, layout=layout, D=D, S=S, error=f"{type(e).__name__}: {str(e)[:300]}")
            del q, k, v, do
            torch.cuda.empty_cache()


_SEEN = set()


def compiled_stats():
    """Registers, spills, shared memory and the wgmma count of each attention kernel compiled since the last
    call (triton keeps them in ``device_caches``)."""
    from fxfuse.attention import backward, forward
    rows = []
    for fn in (forward._attn_fwd, backward._attn_bwd_dkdv, backward._attn_bwd_dq):
        for dev_cache in fn.device_caches.values():
            for key, k in list(dev_cache[0].items()):
                if id(k) in _SEEN:
                    continue
                _SEEN.add(id(k))
                try:
                    k._init_handles()
                except Exception:
                    pass
                ptx = k.asm.get("ptx", "") if hasattr(k, "asm") else ""
                rows.append(dict(kernel=fn.__name__, regs=getattr(k, "n_regs", None),
                                 spills=getattr(k, "n_spills", None), smem=k.metadata.shared,
                                 warps=k.metadata.num_warps, stages=k.metadata.num_stages,
                                 wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"),
                                 local=ptx.count("ld.local") + ptx.count("st.local")))
    return rows


def sec_sweep(args):
    from fxfuse.attention.launching import DEFAULT_CONFIGS
    cands = json.loads(args.sweep_json) if args.sweep_json else {}
    for D, _round in [(D, r) for r in range(args.rounds) for D in args.dims]:
        defaults = DEFAULT_CONFIGS[(D, 2)]
        # {"dkdv": [...]} for every head dim, or {"128": {"dkdv": [...]}, "64": {...}} per head dim
        per_dim = cands.get(str(D), {}) if all(key.isdigit() for key in cands) else cands
        for layout in args.layouts:
            S = args.S
            q, k, v, do = inputs(S, args.hq, args.hkv, D)
            ff = flops_fwd(S, D, args.hq, layout)
            for kern, lst in per_dim.items():
                first = defaults.get(f"{kern}_docs", defaults[kern]) if has_docs(layout) else defaults[kern]
                for c in [first] + [tuple(x) for x in lst]:
                    cfg = {kind: defaults[kind] for kind in ("fwd", "dkdv", "dq")}
                    cfg[kern] = tuple(c)
                    try:
                        fwd, bwd = fxfuse_parts(S, D, layout, q, k, v, do, config=cfg)
                        fn = fwd if kern == "fwd" else bwd
                        t = median_ms(fn)
                        emit(impl="fxfuse", layout=layout, D=D, S=S, part=f"sweep_{kern}", config=list(c), round=_round,
                             ms=round(t, 3), tflops=round((1 if kern == "fwd" else 2.5) * ff / t / 1e9),
                             compiled=[r for r in compiled_stats() if r["kernel"].endswith(kern)])
                    except Exception as e:
                        emit(impl="fxfuse", layout=layout, D=D, S=S, part=f"sweep_{kern}", config=list(c),
                             error=f"{type(e).__name__}: {str(e)[:200]}")
            del q, k, v, do
            torch.cuda.empty_cache()


def sec_probe(args):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for D in (64, 128, 256):
        q, k, v, do = inputs(4096, args.hq, args.hkv, D)
        ref = None
        for name, be in (("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                def attn(q, k, v, be=be):
                    if be is None:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    with sdpa_kernel([be]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                fwd, bwd = autograd_parts(attn, q, k, v, do)
                kern = kernel_breakdown(fwd, reps=1)
                emit(part="probe", D=D, backend=name, fwd_ms=round(median_ms(fwd, 50), 3),
                     bwd_ms=round(median_ms(bwd, 50), 3), kernels=list(kern)[:3])
            except Exception as e:
                emit(part="probe", D=D, backend=name, error=f"{type(e).__name__}: {str(e)[:200]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--S", type=int, default=32768)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--dims", default="128")
    p.add_argument("--layouts", default="causal,docs8")
    p.add_argument("--sections", default="breakdown")
    p.add_argument("--anchors", type=int, default=1)
    p.add_argument("--sweep-json", default="")
    p.add_argument("--rounds", type=int, default=1, help="sweep: times through the whole sweep (compiles once)")
    p.add_argument("--switches", default="", help='launching switches to set first, e.g. {"FAST_TANH": false}')
    args = p.parse_args()
    if args.switches:
        from fxfuse.attention import launching
        for name, value in json.loads(args.switches).items():
            if not hasattr(launching, name):
                raise SystemExit(f"fxfuse.attention.launching has no switch {name!r}")
            setattr(launching, name, value)
    args.dims = [int(x) for x in args.dims.split(",")]
    args.layouts = args.layouts.split(",")
    import triton
    import fxfuse
    emit(part="env", torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(),
         fxfuse=os.path.dirname(fxfuse.__file__),
         commit=os.environ.get("COMMIT", "?"), switches=args.switches or None, sections=args.sections)
    for sec in args.sections.split(","):
        {"breakdown": sec_breakdown, "sweep": sec_sweep, "probe": sec_probe}[sec](args)


if __name__ == "__main__":
    main()
