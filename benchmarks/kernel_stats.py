"""Compile fxfuse's attention kernels for sm_90 on a machine without a GPU and report what ptxas says about each
(registers, spill bytes, shared memory, wgmma count): register pressure is what decides the dK/dV kernel's speed on
the H200 (spills cost it ~20%), and this loop needs no device time.

Every launch in the launchers is intercepted (``JITFunction.run``): the kernel is specialised exactly as Triton's
JIT would for those arguments, compiled for the target, and not run. Use the Triton version of the GPU machine for
numbers that carry over (``pip install --target /tmp/triton36 --no-deps triton==3.6.0``, then
``PYTHONPATH=/tmp/triton36``).

Run: PYTHONPATH=/tmp/triton36 python benchmarks/kernel_stats.py [--dims 128,64] [--layouts causal,docs8,docs8+kv]
     [--configs '{"dkdv": [[64,128,8,3]]}']
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
STATS = []


def ptxas_stats(ptx: str, name: str) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill_st = re.search(r"(\d+) bytes spill stores", out)
    spill_ld = re.search(r"(\d+) bytes spill loads", out)
    return dict(regs=int(regs.group(1)) if regs else None, spill_store=int(spill_st.group(1)) if spill_st else None,
                spill_load=int(spill_ld.group(1)) if spill_ld else None)


def offline_run(self, *args, grid, warmup, **kwargs):
    """JITFunction.run's specialisation and compile, for TARGET, without a device; records the stats."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(self.signature, self.params, backend)
    kwargs.setdefault("debug", False)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
    kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    ptx = kernel.asm["ptx"]
    row = dict(kernel=self.__name__, warps=options.num_warps, stages=options.num_stages, smem=kernel.metadata.shared,
               wgmma=ptx.count("wgmma.mma_async"),
               blocks={k: v for k, v in kwargs.items() if k.startswith("BLOCK_")})
    row.update(ptxas_stats(ptx, self.__name__))
    STATS.append(row)
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", default="128,64")
    p.add_argument("--layouts", default="causal,docs8")
    p.add_argument("--configs", default="")
    p.add_argument("--S", type=int, default=4096)
    args = p.parse_args()
    JITFunction.run = offline_run
    from fxfuse.attention.backward import attention_bwd_triton
    from fxfuse.attention.forward import attention_fwd_triton
    from fxfuse.attention.launching import DEFAULT_CONFIGS
    from fxfuse.ops import document_ranges
    extra = {k: [tuple(c) for c in v] for k, v in json.loads(args.configs).items()} if args.configs else {}
    S = args.S
    for D in [int(x) for x in args.dims.split(",")]:
        q = torch.empty(1, 32, S, D, dtype=torch.bfloat16)
        k = torch.empty(1, 8, S, D, dtype=torch.bfloat16)
        lse = torch.empty(1, 32, S)
        for layout in args.layouts.split(","):
            dr = document_ranges(torch.arange(S)[None] // (S // 8)) if layout.startswith("docs8") else None
            kv = torch.ones(1, S, dtype=torch.bool) if layout.endswith("+kv") else None  # key padding flags
            base = DEFAULT_CONFIGS[(max(64, triton.next_power_of_2(D)), 2)]
            for kern in ("fwd", "dkdv", "dq"):
                for c in [base[kern]] + extra.get(kern, []):
                    cfg = dict(base, **{kern: c})
                    STATS.clear()
                    if kern == "fwd":
                        attention_fwd_triton(q, k, k, None, D ** -0.5, 0.0, True, 0, config=cfg, doc_ranges=dr,
                                             key_valid=kv)
                    else:
                        attention_bwd_triton(q, q, k, k, None, q, lse, D ** -0.5, 0.0, True, 0, config=cfg,
                                             doc_ranges=dr, key_valid=kv)
                    for r in STATS:
                        if r["kernel"].endswith(kern):
                            print(json.dumps(dict(D=D, layout=layout, config=list(c), **r)), flush=True)


if __name__ == "__main__":
    main()
