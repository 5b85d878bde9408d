"""The instruction mix of fxfuse's attention kernels as the GPU runs them: each kernel's SASS (from Triton's own
``cuobjdump``), its opcode counts by class, and the same for the innermost loop of the kernel (the longest basic
block that branches back to an earlier address: in these kernels the interior tiles' pipelined loop).

Why: the thirty-fifth session's experiments (benchmarks/attention_notes.md) moved work off the MUFU unit and took
instructions out of the forward's softmax, and neither paid; what bounds the loops has to be read from what they
execute, not guessed. Registers, spills and shared memory come with each kernel.

Run (device): PYTHONPATH=. python3 benchmarks/attention_sass_mix.py   (rows to $OUT/attention_sass_mix.jsonl, each
kernel's SASS in $OUT/attention_sass.tar.gz as sass/<kernel>-<variant>.sass). ``parse`` / ``loops`` / ``mix`` also
read a saved listing offline.
"""
from __future__ import annotations

import collections
import json
import os
import re

import torch

OUT = os.environ.get("OUT", "/tmp")

# opcode -> class (the first dotted part of the opcode decides)
CLASSES = {
    "HGMMA": "mma", "HMMA": "mma", "WARPGROUP": "mma",
    "MUFU": "mufu",
    "FFMA": "fp32", "FMUL": "fp32", "FADD": "fp32", "FMNMX": "fp32", "FSEL": "fp32", "FSETP": "fp32",
    "FCHK": "fp32", "FSET": "fp32",
    "F2F": "convert", "F2FP": "convert", "I2F": "convert", "F2I": "convert",
    "LDS": "shared", "STS": "shared", "LDSM": "shared", "STSM": "shared",
    "LDG": "global", "STG": "global", "LDGSTS": "global", "UBLKCP": "tma", "UTMALDG": "tma", "UTMASTG": "tma",
    "LDGDEPBAR": "global", "RED": "global", "ATOM": "global",
    "SHFL": "shuffle",
    "BAR": "sync", "SYNCS": "sync", "DEPBAR": "sync", "WARPSYNC": "sync",
    "IMAD": "int", "IADD3": "int", "LOP3": "int", "SHF": "int", "LEA": "int", "ISETP": "int", "IMNMX": "int",
    "SEL": "int", "MOV": "move", "UMOV": "uniform", "ULDC": "uniform", "UIADD3": "uniform", "USHF": "uniform",
    "ULEA": "uniform", "UISETP": "uniform", "ULOP3": "uniform", "USEL": "uniform", "UIMAD": "uniform",
    "BRA": "branch", "EXIT": "branch", "BSSY": "branch", "BSYNC": "branch", "CALL": "branch", "RET": "branch",
    "NOP": "nop", "PRMT": "int", "P2R": "int", "R2P": "int", "CS2R": "move", "S2R": "move", "S2UR": "uniform",
    "PLOP3": "int", "VOTE": "int", "FRND": "fp32", "POPC": "int", "VIADD": "int", "SGXT": "int", "LDC": "uniform",
    "STL": "local", "LDL": "local", "HFMA2": "fp16x2", "HADD2": "fp16x2", "HMUL2": "fp16x2",
    "FMUL2": "fp32", "VIMNMX": "int", "IABS": "int",
}
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Za-z0-9_.]*)?\s*([^;]*);")
# Triton's own SASS listing: "<control codes>\t[@P0 ]OPCODE[.mods] operands;" lines and "LBBn:" labels
_CTRL = re.compile(r"^[-0-9a-fA-FY:]+\t(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Za-z0-9_.]*)?\s*([^;]*);")
_LABEL = re.compile(r"^(\.?L\w+):")


def parse(sass: str):
    """[(position, opcode, operands)] of the kernel's instructions, and {label: position}. Positions are
    cuobjdump's addresses, or the instruction's index in Triton's own listing."""
    out, labels = [], {}
    if _LINE.search(sass):
        for m in _LINE.finditer(sass):
            out.append((int(m.group(1), 16), m.group(3), m.group(5)))
        return out, labels
    for line in sass.splitlines():
        line = line.strip()
        lab = _LABEL.match(line)
        if lab:
            labels[lab.group(1)] = len(out)
            continue
        m = _CTRL.match(line)
        if m:
            out.append((len(out), m.group(2), m.group(4)))
    return out, labels


def mix(instrs):
    c = collections.Counter(CLASSES.get(op, "other") for _, op, _ in instrs)
    return dict(sorted(c.items(), key=lambda kv: -kv[1]))


def loops(instrs, labels):
    """The innermost loops' bodies (a backward branch's [target, branch] range holding no other backward branch),
    longest first: a kernel's tile loops."""
    spans = []
    for pos, op, args in instrs:
        if op != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)", args)
        tgt = int(m.group(1), 16) if m else labels.get(args.strip().strip("`()"))
        if tgt is not None and tgt < pos:
            spans.append((tgt, pos))
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    found = [[x for x in instrs if a <= x[0] <= b] for a, b in inner]
    return sorted(found, key=len, reverse=True)


def run_kernels():
    from fxfuse.attention.backward import attention_bwd_triton
    from fxfuse.attention.forward import attention_fwd_triton
    from fxfuse.ops import document_ranges
    S, Hq, Hkv = 4096, 8, 2
    for D in (128, 64):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, do = (torch.randn(1, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        for docs in (None, document_ranges(torch.arange(S, device="cuda")[None] // (S // 8))):
            out, lse = attention_fwd_triton(q, k, v, None, D ** -0.5, 0.0, True, 0, doc_ranges=docs)
            attention_bwd_triton(do, q, k, v, None, out, lse, D ** -0.5, 0.0, True, 0, doc_ranges=docs)
    torch.cuda.synchronize()


def main():
    run_kernels()
    from fxfuse.attention import backward, forward
    os.makedirs(os.path.join(OUT, "sass"), exist_ok=True)
    for fn in (forward._attn_fwd, backward._attn_bwd_dkdv, backward._attn_bwd_dq):
        for dev_cache in fn.device_caches.values():
            for i, (cache_key, k) in enumerate(dev_cache[0].items()):
                try:
                    sass = k.asm["sass"]
                except Exception as e:  # no cuobjdump: say so
                    print(json.dumps({"kernel": fn.__name__, "error": f"{type(e).__name__}: {e}"[:300]}))
                    continue
                c = k.metadata.constants if hasattr(k.metadata, "constants") else {}
                tag = f"{fn.__name__}-{i}"
                with open(os.path.join(OUT, "sass", tag + ".sass"), "w") as f:
                    f.write(sass)
                instrs, labels = parse(sass)
                found = loops(instrs, labels)
                loop = found[0] if found else []
                row = dict(kernel=fn.__name__, variant=i, regs=getattr(k, "n_regs", None),
                           spills=getattr(k, "n_spills", None), smem=k.metadata.shared,
                           warps=k.metadata.num_warps, stages=k.metadata.num_stages,
                           constants={str(a): v for a, v in (c.items() if isinstance(c, dict) else [])
                                      if str(a).isupper() or "BLOCK" in str(a)},
                           cache_key=str(cache_key)[-600:],  # the specialisation: which constexprs
                           instructions=len(instrs), mix=mix(instrs), loop_len=len(loop), loop_mix=mix(loop),
                           loops=[(len(x), mix(x)) for x in found[:4]],
                           loop_mufu_per_mma=round(sum(1 for _, o, _ in loop if o == "MUFU")
                                                   / max(1, sum(1 for _, o, _ in loop if o == "HGMMA")), 2))
                with open(os.path.join(OUT, "attention_sass_mix.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps({k_: row[k_] for k_ in ("kernel", "variant", "regs", "spills", "loop_len",
                                                          "loop_mix")}), flush=True)


if __name__ == "__main__":
    main()
    import shutil  # one archive: the device returns a limited number of files
    shutil.make_archive(os.path.join(OUT, "attention_sass"), "gztar", OUT, "sass")
    shutil.rmtree(os.path.join(OUT, "sass"))
