"""Another library's fused lm-head / loss in the graph: said in the report, never silence (no rewrite).

Liger-Kernel, Cut Cross-Entropy and Unsloth replace a model's lm-head + cross-entropy with their own fused kernels
(an autograd.Function over Triton kernels, patched into the model's forward). Dynamo cannot trace those Functions
(Triton launches, ``.item()``, storage pointers): it breaks the graph at them, so the lm-head never reaches
fxfuse's lm-head passes as a projection + loss, and without this pass a report would say nothing about the loss.
What does reach fxfuse are the graphs Dynamo resumes inside the library's frames (seen with Liger-Kernel 0.8.5 on a
tiny Llama: its ``LigerFusedLinearCrossEntropyFunction`` breaks the graph, and the following graphs' nodes carry
stack traces in ``liger_kernel/``). This pass finds such nodes by the files in their stack traces and records one
skipped site per library and graph: which library's fused head runs there (its line in the site's ``frame``
detail), and that fxfuse leaves it to the library (undo the library's loss patch to get fxfuse's
``linear_cross_entropy`` instead).

TRL's fused head is not here: fxfuse's shim makes it one graph node, which ``trl_fused_head`` rewrites.
"""
from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import torch.fx as fx

from fxfuse.registry import register_pass

NAME = "foreign_fused_heads"

#: package folder -> the library's name, for the libraries known to patch a fused lm-head / loss into models
LIBRARIES: Dict[str, str] = {
    "liger_kernel": "Liger-Kernel",
    "cut_cross_entropy": "Cut Cross-Entropy",
    "unsloth": "Unsloth",
    "unsloth_zoo": "Unsloth",
}

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def library_frame(stack_trace: Optional[str]) -> Optional[Tuple[str, str]]:
    """(library name, "file:line in function") of the innermost frame of ``stack_trace`` that lies in one of
    :data:`LIBRARIES`' packages, or None."""
    if not stack_trace:
        return None
    for path, line, func in reversed(_FRAME.findall(stack_trace)):
        parts = re.split(r"[\\/]", path)
        for folder, lib in LIBRARIES.items():
            if folder in parts[:-1]:
                rel = "/".join(parts[parts.index(folder):])
                return lib, f"{rel}:{line} in {func}"
    return None


@register_pass(name=NAME,
               description="reports another library's fused lm-head / loss (Liger-Kernel, Cut Cross-Entropy, "
                           "Unsloth) found in the graph by its frames; rewrites nothing")
def foreign_fused_heads_pass(gm: fx.GraphModule, ctx) -> int:
    seen = set()
    for mod in ctx.graph_modules(gm):
        for node in mod.graph.nodes:
            found = library_frame(node.meta.get("stack_trace"))
            if found is None or found[0] in seen:
                continue
            lib, where = found
            seen.add(lib)
            ctx.skipped(node, f"{lib}'s fused lm-head / loss",
                        f"the model's loss is {lib}'s own fused kernel: Dynamo breaks the graph at its "
                        "autograd.Function, so fxfuse sees only pieces of it (left to the library, except what "
                        f"the lm-head passes recognise); without {lib}'s loss patch fxfuse fuses the lm-head loss "
                        "itself (linear_cross_entropy)", library=lib, frame=where)
    return 0
