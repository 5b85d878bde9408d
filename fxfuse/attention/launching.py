"""What the forward and backward launchers share: tile configs and the launch-with-fallback helper, the
switches that pick a kernel variant, and the arguments every attention kernel takes the same way.

* Configs: (BLOCK_M, BLOCK_N, num_warps, num_stages[, split]) per kernel ("fwd", "dkdv", "dq"), keyed by padded
  head_dim and element size (:data:`DEFAULT_CONFIGS`), the fallbacks tried in order when one does not fit
  (:data:`FALLBACK_CONFIGS`, :func:`launch_with_fallbacks`), tiny tiles under the interpreter
  (:data:`INTERPRET_CONFIG`); :func:`config_for` picks one.
* Switches, module attributes read at every launch (benchmarks and tests set them here): ``FAST_TANH``
  (tanh.approx for bf16 / fp16), ``BLOCK_MAJOR_GRID`` (grid order), ``FORCE_INT64`` (64-bit addresses at any size).
  The mask tensor's block ranges have theirs in :mod:`.block_map` (``MASK_BLOCK_RANGES``).
* Arguments: a mask tensor's strides and kind (:func:`mask_args`), the recipe vectors (:func:`recipe_args`),
  whether addresses need 64 bits (:func:`needs_int64`), the softcap variant and scalars (:func:`softcap_mode`,
  :func:`score_scalars`), the grid and a program's ids in it (:func:`grid`, ``grid_ids``), and the arguments
  Triton must not specialise on (:data:`MASK_LENGTHS`).
"""
from __future__ import annotations

import os
import warnings

import torch

from fxfuse.kernels.triton_support import COMPILER_ERRORS, HAVE_TRITON, interpreting, tile_descriptor, tl, triton

from . import block_map
from .conventions import LOG2E, MASKED_ROWS_UNIFORM
from .reference import expand_mask

__all__ = ["DEFAULT_CONFIGS", "FALLBACK_CONFIGS", "INTERPRET_CONFIG", "launch_with_fallbacks", "config_for",
           "MASK_LENGTHS", "mask_args", "recipe_args", "recipe_tensors", "plan_key", "key_span", "FORCE_INT64", "needs_int64", "FAST_TANH", "ROW_BOUNDS", "FWD_TMA",
           "DQ_TMA", "DQ_TMA_CHECKED", "dq_tma_mode", "TMA_MAX_HEAD_DIM", "POINTER_TILES", "descriptor_tiles",
           "launch_tiles_or_pointers", "launch_kv_tiles",
           "softcap_mode", "BLOCK_MAJOR_GRID", "grid", "grid_ids", "score_scalars", "ROW_PAIRS", "row_launches"]

# Configs: (BLOCK_M, BLOCK_N, num_warps, num_stages[, split]) per kernel, keyed by padded head_dim and element
# size. Dh 256 bf16 (H200 sweeps in benchmarks/attention_notes.md): fwd (128, 64, 8 warps) keeps Q [128, 256]
# in smem and streams K, V [64, 256]; the dK/dV kernel spills registers when it holds K, V and both fp32
# [BLOCK_N, 256] accumulators, so it runs as two launches (split=1: dK, then dV), 2.5x faster than one;
# configs that need more than Hopper's 227 KB smem (e.g. dq (128, 32, 8, 3) plus a mask tile) fall back.
DEFAULT_CONFIGS = {
    # (BLOCK_D, elem_size): {kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages)}; M = query rows, N = key rows
    (256, 2): {"fwd": (128, 64, 8, 2), "dkdv": (32, 128, 8, 2, 1), "dq": (128, 32, 8, 3)},
    # Dh 128 bf16: backward tiles from an H200 sweep at 32k tokens, 8 packed documents, 32 q / 8 kv heads
    # (results/h200-attn-bwd-sweep.jsonl): dq (128, 32, 8, 2) -> (128, 64, 8, 3) 11.74 -> 9.86 ms,
    # dkdv (32, 128, 8, 2) -> (64, 128, 8, 2) 11.74 -> 11.27 ms (each axis swept with the other at its old value).
    # fwd (128, 64, 8, 3) -> (128, 128, 8, 3): 18.9 -> 17.8 ms causal, 2.65 -> 2.63 docs8 (32k, H200,
    # results/h200-attn-kernels-2026-11-25.jsonl). Dh 64: dkdv (32, 128, 4, 2) -> (32, 128, 4, 3) 37.3 -> 36.4 ms
    # causal backward, dq (128, 32, 4, 2) -> (128, 64, 4, 3) 36.6 -> 33.5 ms (same file).
    # dkdv on 64 x 64 tiles, 4 warps (H200, 32k, whole backward, two rounds each,
    # results/h200-attn-dkdv-tiles-2026-11-29-s37.jsonl): at Dh 128 (64, 128, 8, 2) -> (64, 64, 4, 2) is faster on
    # every layout: causal 57.7 -> 53.4 ms, 8 documents 8.01 -> 7.45, 128 / 512 documents 1.74 -> 1.37 / 1.57 -> 1.20,
    # window 4096 14.2 -> 13.2, 75% right padding 55.2 -> 52.2. At Dh 64 it is 7% slower causal (30.5 -> 32.6), so
    # only packed documents ("dkdv_docs") take it there: 128 / 512 documents 1.005 -> 0.854 / 0.90 -> 0.718, 8
    # documents 4.36 -> 4.50.
    # Packed documents ("<kind>_docs"): short documents leave each program one or two key blocks, so 64-row tiles
    # win (same card, results/h200-attn-docs-tiles-2026-11-29-s37.jsonl; 128 / 512 / 8 documents of 32k, ms):
    # Dh 128 fwd (128, 128, 8, 3) -> (64, 64, 4, 3) 0.593 / 0.556 / 2.59 -> 0.443 / 0.350 / 2.60-2.75, dq
    # (128, 64, 8, 3) -> (64, 64, 4, 2) backward 1.37 / 1.20 / 7.35 -> 1.21 / 0.955 / 7.53-7.63; Dh 64 fwd
    # (128, 64, 4, 3) -> (64, 64, 4, 3) 0.282 / 0.262 / 1.43-1.50 -> 0.251 / 0.199 / 1.49-1.55, dq (128, 64, 4, 3)
    # -> (64, 64, 4, 3) 1.006 / 0.900 / 4.35-4.42 -> 0.912 / 0.774 / 4.34-4.49. Long documents lose 0-6%.
    (128, 2): {"fwd": (128, 128, 8, 3), "fwd_docs": (64, 64, 4, 3), "dkdv": (64, 64, 4, 2),
               "dq": (128, 64, 8, 3), "dq_docs": (64, 64, 4, 2)},
    (64, 2): {"fwd": (128, 64, 4, 3), "fwd_docs": (64, 64, 4, 3), "dkdv": (32, 128, 4, 3), "dkdv_docs": (64, 64, 4, 2),
              "dq": (128, 64, 4, 3), "dq_docs": (64, 64, 4, 3)},
    (256, 4): {"fwd": (64, 32, 8, 1), "dkdv": (32, 32, 8, 1), "dq": (32, 32, 8, 1)},
    (128, 4): {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 1), "dq": (64, 32, 4, 1)},
    (64, 4): {"fwd": (64, 64, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)},
}
# Tried in order when a config does not fit (a mask tensor adds a tile of shared memory per block: the
# Dh-256 dq config (128, 32, 8, 3) needs 240 KB with a mask, over Hopper's 227 KB; with a causal mask tensor at
# B2 S4096 on the H200 its backward takes 3.62 ms with dq (128, 32, 8, 2), 3.65 with (128, 64, 8, 1), 3.88 with
# (64, 32, 4, 3), against 3.27 ms with causal=True and no mask).
FALLBACK_CONFIGS = {"fwd": [(128, 64, 8, 3), (64, 64, 4, 2), (32, 32, 4, 1)], "dkdv": [(32, 64, 8, 2, 1), (16, 32, 4, 1, 1)],
                    "dq": [(128, 32, 8, 2), (64, 32, 4, 3), (32, 32, 4, 1)]}
_WORKING = {}  # (kind, block_d, dtype, mask kind, requested config) -> config that launched


def launch_with_fallbacks(kind, kernel, grid_of, cfg, key, launch):
    """launch(cfg) with cfg, else with the fallbacks, remembering what worked for this key."""
    from triton.runtime.errors import OutOfResources

    k = (kind, key, tuple(cfg))
    tries = [_WORKING[k]] if k in _WORKING else [tuple(cfg)] + FALLBACK_CONFIGS[kind]
    for i, c in enumerate(tries):
        try:
            launch(c)
            _WORKING[k] = c
            return
        except OutOfResources:
            if i == len(tries) - 1:
                raise


# Tiny blocks for the interpreter (numpy): cheap and exercises the multi-block / boundary logic.
INTERPRET_CONFIG = {"fwd": (16, 16, 4, 1), "dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)}


def config_for(kind: str, block_d: int, dtype, override=None, docs: bool = False):
    """The tiles ``kind``'s kernel launches with: ``override[kind]`` if given, else the default for the head dim and
    element size; ``docs`` (packed documents in the recipe) picks a ``<kind>_docs`` entry where one exists (short
    documents leave each program one or two key blocks, where smaller tiles win)."""
    if override and kind in override:
        return override[kind]
    es = 4 if dtype == torch.float32 else 2
    configs = INTERPRET_CONFIG if interpreting() else DEFAULT_CONFIGS[(max(64, block_d), es)]
    return configs.get(f"{kind}_docs", configs[kind]) if docs else configs[kind]


# Arguments whose divisibility changes with the sequence length (the lengths; the mask's strides, which contain one)
# are not specialised by Triton: with specialisation (on == 1 and on divisibility by 16) a variable-length workload
# JIT-compiles new variants of each kernel in the middle of training. They only bound loops and address the mask.
# q / k / v / output strides stay specialised: with a head_dim that is a multiple of 16 their divisibility does not
# depend on the length, and it is what proves the tile loads aligned.
MASK_LENGTHS = ['stride_mb', 'stride_mh', 'stride_mm', 'stride_rb', 'stride_rh', 'stride_docb', 'stride_doce',
                'stride_kvvb', 'stride_spanb']


def mask_args(mask, B, Hq, S, Skv, like):
    """(tensor to pass, 4 strides, MASK_KIND). Broadcast dims get stride 0; bool is read as uint8."""
    if mask is None:
        return like, (0, 0, 0, 0), 0
    m = expand_mask(mask, B, Hq, S, Skv)
    st = list(m.stride())
    if m.shape[1] != Hq:  # head-broadcast mask: stride 0 over q heads
        st[1] = 0
    for i, n in enumerate(m.shape):
        if n == 1:
            st[i] = 0
    if m.dtype == torch.bool:
        return m.view(torch.uint8), tuple(st), 2
    return m, tuple(st), 1


def recipe_tensors(doc_ranges, key_valid, like):
    """The recipe vectors as the kernels read them: (docs int32 [2, B|1, S], key-valid flags uint8 [B|1, Skv],
    kv_span int32 [B|1, 4]); ``like`` stands in for an absent one (a dummy pointer)."""
    docs = like if doc_ranges is None else doc_ranges.to(torch.int32).contiguous()
    if key_valid is None:
        return docs, like, like
    valid = key_valid.to(torch.bool).contiguous()
    return docs, valid.view(torch.uint8), key_span(valid)


def recipe_args(doc_ranges, key_valid, like, tensors=None):
    """The recipe vectors as kernel arguments: (docs, stride_docb, stride_doce, kvv, stride_kvvb, kv_span,
    stride_spanb, HAS_DOCS, HAS_KVV). ``doc_ranges`` int [2, B|1, S] (start, end of each token's document),
    ``key_valid`` bool [B|1, Skv]; a batch of 1 broadcasts (stride 0). O(B x S) each; absent ones are replaced by
    a dummy pointer. ``kv_span`` int32 [B|1, 4] (:func:`key_span`): each row's first valid key, last valid key + 1
    and whether padding lies between them, so that the kernels skip the key blocks padding fills (right / left
    padding: a padded row of length L costs about L^2 / 2 of causal work, not S^2 / 2) and read the padding flags
    only where a tile can hold some; computed on the device, no host sync. ``tensors``: what
    :func:`recipe_tensors` already gave for these arguments."""
    docs, kvv, span = tensors if tensors is not None else recipe_tensors(doc_ranges, key_valid, like)
    sdb = sde = skb = ssb = 0
    if doc_ranges is not None:
        sdb = docs.stride(1) if docs.shape[1] > 1 else 0
        sde = docs.stride(0)
    if key_valid is not None:
        skb = kvv.stride(0) if kvv.shape[0] > 1 else 0
        ssb = 4 if kvv.shape[0] > 1 else 0
    return docs, sdb, sde, kvv, skb, span, ssb, doc_ranges is not None, key_valid is not None


def plan_key(kind, q, k, v, mask, config, scaling, softcap, causal, window, masked_rows, doc_ranges, key_valid,
             *extra):
    """What decides every argument of a launcher's Triton launches except the role tensors themselves (see
    fxfuse.kernels.launch_cache): shapes, strides, dtypes, device, scalars, which recipe vectors are given and
    their layouts, the mask tensor's (its block ranges are recorded as launches over scratch tensors, redone by
    each replay) and this module's switches. None (no replay) for an explicit config or masked_rows="uniform" (its
    value mean is computed per call)."""
    if config is not None or masked_rows == MASKED_ROWS_UNIFORM:
        return None
    dr = None if doc_ranges is None else (doc_ranges.shape, doc_ranges.stride())
    kv = None if key_valid is None else (key_valid.shape, key_valid.stride())
    m = None if mask is None else (mask.shape, mask.stride(), mask.dtype)
    return (kind, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, scaling, softcap, causal, window, masked_rows, dr, kv, m, BLOCK_MAJOR_GRID, FAST_TANH,
            ROW_BOUNDS, FWD_TMA, DQ_TMA, FORCE_INT64, ROW_PAIRS, block_map.MASK_BLOCK_RANGES, extra)


# Key flags, a pair of launches: the kernels' flag-reading variant (HAS_KVV) holds more registers, and at head dim
# 64 it spills (dQ 472 bytes, the forward 28; ptxas for sm_90a, benchmarks/unpad_notes.md): ~20% of a layer's
# attention on the H200 even where every flag is True. So each kernel runs twice, as (ROWS, HAS_KVV): once
# without flags over the rows whose keys are all valid (the span says (0, Skv, no holes)), once with them over
# the others; a program of the other launch's row returns at once (a few microseconds for an empty launch). The
# choice is made on the device, per row: no host sync. ROW_PAIRS = False launches the flag variant alone.
ROW_PAIRS = True


def row_launches(has_kvv):
    """(ROWS, HAS_KVV) of each launch of a kernel: see ROW_PAIRS."""
    if not has_kvv:
        return ((0, False),)
    return ((1, False), (2, True)) if ROW_PAIRS else ((0, True),)


_SPAN_CACHE = {}  # "last": (the key_valid tensor, its storage address, layout, version, its span)


def key_span(valid):
    """int32 [B, 4] per row of a bool [B, Skv]: (first True, last True + 1, 1 if a False lies between them, 0);
    (Skv, 0, 0, 0) for a row of False. The kernels skip the key blocks outside [first, end) and read the flags
    only in the tiles at its edges, or everywhere in a row with holes.

    Every layer's forward and backward of a step get the same key flags (the recipe builds them once per step), so
    the last span is kept while they are unmodified: a dozen small kernels and ~0.5 ms of host time once per step
    instead of once per call. Inductor's generated code hands each call a fresh alias of one buffer
    (``reinterpret_tensor``: no ``_base``, a version counter of its own), so the flags are recognised by their
    storage's address and their layout; the cache holds the last tensor, so that storage cannot be freed and its
    address given to other flags while cached. An in-place change through the cached tensor or a view of it (the
    version counter) recomputes; a write through an unrelated alias is not seen (Inductor never writes into a
    buffer while a later op still reads it)."""
    ptr = valid.untyped_storage().data_ptr()
    layout = (valid.shape, valid.stride(), valid.storage_offset(), valid.dtype, valid.device)
    last = _SPAN_CACHE.get("last")
    if last is not None:
        held, held_ptr, held_layout, held_version, span = last
        if held_ptr == ptr and held_layout == layout and held._version == held_version:
            return span
    span = _key_span(valid)
    _SPAN_CACHE["last"] = (valid, ptr, layout, valid._version, span)
    return span


def _key_span(valid):
    Skv = valid.shape[-1]
    idx = torch.arange(Skv, device=valid.device, dtype=torch.int32)
    first = torch.where(valid, idx, Skv).amin(-1)
    end = torch.where(valid, idx + 1, 0).amax(-1)
    holes = (end - first).clamp_min(0) != valid.sum(-1, dtype=torch.int32)
    return torch.stack([first, end, holes.to(torch.int32), torch.zeros_like(first)], -1).to(torch.int32).contiguous()


# Tests set this to run the 64-bit address path at small sizes.
FORCE_INT64 = False


def needs_int64(*tensors) -> bool:
    """Does any tensor's farthest element sit at an offset past 2^31 - 1 (int32 address math would wrap)? Then
    the kernels compute addresses in 64 bits (a constexpr variant); below that the int32 fast path."""
    if FORCE_INT64:
        return True
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            if sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) >= 2**31 - 1:
                return True
    return False


# tanh.approx.f32 for bf16 / fp16 inputs on the GPU (one MUFU op per score instead of two; the softcap kernels
# are MUFU-heavy: tanh and exp2 per score, in the forward and in each backward recompute). fp32 keeps the exact
# formula (its 1e-4 tolerance is below tanh.approx's error); the interpreter cannot run inline PTX.
FAST_TANH = True

# The forward's boundary tiles mask from each query's key range, computed once per query block
# (scores.row_key_bounds: two compares a score, the document starts read once) instead of every index mask per
# tile. H200, 32k tokens (benchmarks/attention_notes.md, thirty-fifth session): forward 2.5-7% faster on packed
# documents of 64-256 tokens, level elsewhere. The backward kernels keep the per-mask form: the same change there
# made Dh 64 with 8 documents 21% slower. FXFUSE_ATTENTION_ROW_BOUNDS=0 at import turns it off.
ROW_BOUNDS = os.environ.get("FXFUSE_ATTENTION_ROW_BOUNDS", "1") != "0"

# The forward loads its K / V tiles through the copy engine (TMA tensor descriptors over k and v) where it can
# address them (fxfuse.kernels.triton_support.tile_addressable; else pointer tiles): rows past the key end and
# head-dim padding read as 0, so no tile load takes a bounds mask. 0: never; 1: in the boundary loops (the
# default); 2: in every loop. H200, 32k tokens, 8B heads, two rounds (benchmarks/attention_notes.md, thirty-sixth
# session): 1 is level with 0 on causal and 8 documents and 2.5-3.5% faster on documents of 64-256 tokens; 2 is
# faster still on Dh-128 documents (2-6%) but 2-4% slower on Dh-128 causal and Dh-64 documents of 256 tokens.
# FXFUSE_ATTENTION_FWD_TMA (0 / 1 / 2) at import sets it.
FWD_TMA = int(os.environ.get("FXFUSE_ATTENTION_FWD_TMA", "1"))
# The same choice for the dQ kernel's K / V tiles (its loops mirror the forward's); 2 by default. H200, same
# shapes, whole backward, two rounds (attention_notes.md, thirty-sixth session): 2 is 1.8-6.9% faster at Dh 64,
# 0.3-1.5% at Dh 128, and 1.6% slower on Dh-128 documents of 64 tokens; 1 was 14% slower at Dh 64 with 8 documents.
DQ_TMA = int(os.environ.get("FXFUSE_ATTENTION_DQ_TMA", "2"))
# The dQ tiles whose descriptor variant has run right on the H200 (Triton 3.6), as (BLOCK_M, BLOCK_N, warps, stages)
# and whether the row has packed documents; any other config (a fallback, a benchmark's override) reads pointer tiles.
# Triton 3.6 built faulting or hanging dQ kernels from some other tiles' every-loop descriptor variant, on plain
# causal rows: (64, 64, 4, 2) raised "unspecified launch failure" at 4k and 32k tokens (fine with DQ_TMA 0 or 1, and
# with documents); (64, 32, 4, 3) ran past its process's 90 s limit, twice (attention_notes.md, thirty-seventh
# session). Each entry here went through check_attention_recipe.py on the H200 and the timing calls.
DQ_TMA_CHECKED = {((128, 64, 8, 3), False), ((128, 64, 8, 3), True), ((64, 64, 4, 2), True),  # Dh 128 (docs)
                  ((128, 64, 4, 3), False), ((128, 64, 4, 3), True), ((64, 64, 4, 3), True)}  # Dh 64 (docs)


def dq_tma_mode(config, docs: bool) -> int:
    """DQ_TMA for the dQ tiles ``config`` (with or without packed documents) where :data:`DQ_TMA_CHECKED` lists
    them, else 0 (pointer tiles)."""
    return DQ_TMA if (tuple(config[:4]), bool(docs)) in DQ_TMA_CHECKED else 0


# Head dims the descriptor tiles are used at: at Dh 256 (16k tokens, 16 / 8 heads) they were no faster on
# documents, and ptxas (Triton 3.6) crashed compiling the causal forward. A variant the compiler fails on falls back
# to pointer tiles anyway (launch_tiles_or_pointers).
TMA_MAX_HEAD_DIM = 128
# (kernel, variant) pairs whose descriptor tiles the compiler failed on: pointer tiles from then on.
POINTER_TILES = set()


def descriptor_tiles(kernel, variant, mode, block_d, tensors, block_shape):
    """(mode, descriptors) for a launch of ``kernel``'s ``variant`` (its constexprs): the TMA descriptors that load
    ``block_shape`` tiles of ``tensors`` and ``mode`` (FWD_TMA / DQ_TMA: 1 boundary loops, 2 every loop), or
    (0, Nones) where the mode is off, the head dim is past TMA_MAX_HEAD_DIM, the variant failed to compile with
    descriptors before, or the copy engine cannot address one of the tensors (tile_addressable)."""
    none = [None] * len(tensors)
    if not mode or block_d > TMA_MAX_HEAD_DIM or (kernel, variant) in POINTER_TILES:
        return 0, none
    descs = [tile_descriptor(t, block_shape) for t in tensors]
    return (mode, descs) if all(d is not None for d in descs) else (0, none)


def launch_kv_tiles(kernel, variant, mode, block_d, block_n, k, v, launch_tiles, what):
    """Launch a kernel that reads K / V tiles: ``launch_tiles(mode, k_desc, v_desc)`` with the descriptors of
    :func:`descriptor_tiles` (mode 0 and Nones: pointer tiles)."""
    mode, descs = descriptor_tiles(kernel, variant, mode, block_d, (k, v), [1, 1, block_n, block_d])
    launch_tiles_or_pointers(kernel, variant, mode, descs, lambda m, ds: launch_tiles(m, *ds), what)


def launch_tiles_or_pointers(kernel, variant, mode, descs, launch_tiles, what):
    """``launch_tiles(mode, descs)``; where Triton's compiler fails on the descriptor variant (ptxas crashed on a
    Dh-256 causal forward in Triton 3.6), warn once, remember the variant and launch it with pointer tiles, whose
    values are the same. A failure of the pointer variant itself is raised."""
    try:
        launch_tiles(mode, descs)
    except COMPILER_ERRORS as e:
        if not mode:
            raise
        POINTER_TILES.add((kernel, variant))
        warnings.warn(f"fxfuse attention {kernel}: Triton could not compile the tensor-descriptor tiles for {what} "
                      f"({type(e).__name__}: {str(e).strip()[:200]}); this variant loads pointer tiles from now on",
                      RuntimeWarning, stacklevel=3)
        launch_tiles(0, [None] * len(descs))


def softcap_mode(softcap, dtype) -> int:
    if not softcap:
        return 0
    return 2 if (FAST_TANH and dtype in (torch.bfloat16, torch.float16) and not interpreting()) else 1


# Grid order (see ``grid_ids``): True = (batch*heads, blocks), longest-first dispatch across all heads.
BLOCK_MAJOR_GRID = True


def grid(n_blocks, n_bh):
    return (n_bh, n_blocks) if BLOCK_MAJOR_GRID else (n_blocks, n_bh)


def score_scalars(scaling, softcap):
    if softcap:
        return scaling / softcap, softcap * LOG2E
    return 1.0, scaling * LOG2E



if HAVE_TRITON:

    @triton.jit
    def grid_ids(BLOCK_MAJOR: tl.constexpr, REVERSE: tl.constexpr):
        """(block index, batch*head index) of this program. Under a causal mask the work per block grows with
        the query block (fwd, dQ: REVERSE, heaviest = last) or shrinks with the key block (dK/dV). Programs are
        dispatched in linear-id order, so BLOCK_MAJOR (grid = (batch*heads, blocks)) makes the block index the
        slow axis: every head's heaviest blocks go first and the light ones fill the tail (longest-first; the
        H200 measured shortest-first 18% slower in the dK/dV kernel, 43.4 vs 36.7 ms at 32k causal)."""
        if BLOCK_MAJOR:
            blk = tl.program_id(1)
            nblk = tl.num_programs(1)
            bh = tl.program_id(0)
        else:
            blk = tl.program_id(0)
            nblk = tl.num_programs(0)
            bh = tl.program_id(1)
        if REVERSE:
            blk = nblk - 1 - blk
        return blk, bh
else:  # pragma: no cover
    grid_ids = None
