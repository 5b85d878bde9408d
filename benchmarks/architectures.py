"""Every decoder-only causal-LM architecture the installed transformers registers, tiny and random-init, trained for
one step eagerly and compiled with fxfuse: what is fused, what is not and why, and whether loss and gradients
match eager.

    python benchmarks/architectures.py                  # all of them (CPU, 2 workers, ~1 h on 2 cores)
    python benchmarks/architectures.py llama mixtral    # a few
    python benchmarks/architectures.py --markdown       # only re-render docs/architectures.md from the JSON

Writes ``benchmarks/results/architectures.json`` and ``docs/architectures.md``. Each architecture runs in its own
process with a time limit (``--timeout``, default 300 s), so a crash or a hang is one row, not the end of the run.

The tiny config is built generically from the config class's own defaults, scaled down through the usual
attribute spellings (:data:`SCALE`): hidden 64, 4 heads / 2 kv heads, head_dim 16, intermediate 128, vocab 256,
MoE with 4 experts of 32, top-k <= 2, sliding windows 8. Per-layer patterns (``layer_types``, hybrid block lists,
index lists of MoE / attention layers, periods and offsets) are cut to one layer of each kind, at least 2, so a
hybrid model keeps its attention, SSM, dense and MoE layers. The module classes of the tiny model are compared
with those of the full default model (built on the meta device); what the tiny one lacks is recorded.

One step: batch 2 x 16, row 1 right-padded by 4 (an ``attention_mask`` where the model takes one), labels a
tensor of their own with -100 at the pads and at the first two positions of row 0; fp32, train mode with every
dropout set to 0 (so eager is deterministic). The compiled model is a deep copy of the eager one before its step,
compiled with ``torch.compile(backend="fxfuse", options={"compiler": "aot_eager"})``. Parity: the loss's relative
error and, per parameter, ``max|g - g_eager| / max|g_eager|``; "exact" is both <= 2e-5 for every parameter.
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import inspect
import json
import math
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # fxfuse from the source tree

JSON_PATH = os.path.join(ROOT, "benchmarks", "results", "architectures.json")
MD_PATH = os.path.join(ROOT, "docs", "architectures.md")
RTOL = 2e-5  # loss and gradient parity threshold (fp32)
ATTENTION_PASSES = ("softcap_attention", "sdpa_attention")
BATCH, SEQ, PAD = 2, 16, 4

# ------------------------------------------------------------------------------------------- tiny configs
HIDDEN = 64
_MISSING = object()
#: attribute spelling -> value for the tiny config. A callable gets the default value and returns the new one
#: (or the default to keep it). Only attributes the config class declares are touched.
SCALE: Dict[str, Any] = {}


def _set(names, value):
    for n in names.split():
        SCALE[n] = value


def _cap(v):
    return lambda d: min(d, v) if isinstance(d, int) and not isinstance(d, bool) and d > 0 else d


def _if_int(v):
    return lambda d: v if isinstance(d, int) and not isinstance(d, bool) and d > 0 else d


_set("hidden_size n_embd d_model embed_dim emb_dim model_dim d_embed hidden_dim word_embed_proj_dim embedding_size "
     "input_embedding_size output_embedding_size embedding_dim", _if_int(HIDDEN))
_set("num_attention_heads n_head num_heads n_heads decoder_attention_heads attention_heads swa_num_attention_heads",
     _if_int(4))
_set("num_key_value_heads n_kv_heads num_kv_heads multi_query_group_num swa_num_key_value_heads kv_heads",
     lambda d: 2 if d is None or (isinstance(d, int) and not isinstance(d, bool) and d > 1) else d)
_set("intermediate_size ffn_dim n_inner ffn_hidden_size d_ff decoder_ffn_dim intermediate_size_mlp "
     "feed_forward_size dff dim_ff ffn_size d_inner dense_intermediate_size prefix_dense_intermediate_size",
     _if_int(2 * HIDDEN))
_set("moe_intermediate_size expert_intermediate_size shared_expert_intermediate_size shared_intermediate_size "
     "moe_shared_expert_intermediate_size shared_experts_intermediate_size expert_ffn_hidden_size",
     _if_int(HIDDEN // 2))
_set("num_experts num_local_experts n_routed_experts moe_num_experts", lambda d: 4 if isinstance(d, int) and d > 4
     else d)
_set("num_experts_per_tok num_experts_per_token top_k moe_top_k moe_topk moe_k top_k_experts", _cap(2))
_set("n_shared_experts num_shared_experts moe_num_shared_experts", _cap(1))
_set("n_group topk_group n_groups mamba_n_groups mamba_ngroups", _cap(1))
_set("head_dim attention_head_dim swa_head_dim d_head dim_head attention_head_size kv_channels",
     lambda d: 16 if d is None or (isinstance(d, int) and not isinstance(d, bool) and d > 0) else d)
_set("qk_nope_head_dim v_head_dim index_head_dim indexer_head_dim linear_key_head_dim linear_value_head_dim "
     "mamba_d_head mamba_head_dim linear_head_dim", _if_int(16))
_set("qk_rope_head_dim rotary_dim", _cap(8))
_set("kv_lora_rank q_lora_rank o_lora_rank", _if_int(32))
_set("index_n_heads indexer_n_heads linear_num_key_heads indexer_kv_heads", _if_int(2))
_set("linear_num_value_heads linear_num_heads", _if_int(4))
_set("mamba_n_heads mamba_num_heads n_mamba_heads", _if_int(4))  # x head 16 = 1 (mamba_expand) x hidden
_set("expand mamba_expand", _if_int(1))
_set("mamba_d_ssm", _if_int(HIDDEN))
_set("num_kv_shared_layers", lambda d: 0 if isinstance(d, int) and not isinstance(d, bool) else d)
_set("mamba_d_state ssm_state_size state_size", _if_int(16))
_set("vocab_size vocab_size_per_layer_input", _if_int(256))
_set("max_position_embeddings n_positions n_ctx max_seq_len max_target_positions", _cap(128))
_set("sliding_window sliding_window_size attention_window_size window_size local_attention_window_len "
     "attention_chunk_size", _cap(8))
# layer-pattern scalars: keep one layer of each kind within a few layers
_set("first_k_dense_replace num_dense_layers moe_layer_start_index", _cap(1))
_set("attn_layer_period expert_layer_period global_attn_every_n_layers no_rope_layer_interval sliding_window_pattern "
     "interleave_moe_layer_step moe_layer_interval decoder_sparse_step", _cap(2))
_set("attn_layer_offset expert_layer_offset", _cap(1))
_set("max_window_layers", _cap(1))

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers")
MAX_LAYERS = 4
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
              "decoder_start_token_id", "forced_eos_token_id", "eod_token_id", "image_token_id",
              "boi_token_id", "eoi_token_id", "unk_index", "mask_index")
MULTIMODAL_HINTS = ("vision", "audio", "image", "video", "codebook", "speech", "mel")


def _fields(cc) -> Dict[str, Any]:
    try:
        return {f.name: f for f in dataclasses.fields(cc)}
    except TypeError:
        return {}


def _get(cfg, name: str, default=None):
    """``cfg.name``; heterogeneous (per-layer) configs answer with their global value instead of refusing."""
    try:
        g = getattr(cfg, "_getattr_without_heterogeneous_validation", None)
        return g(name, default) if g is not None else getattr(cfg, name, default)
    except Exception:  # noqa: BLE001
        return default


def _scaled(name: str, d: Any) -> Any:
    rule = SCALE.get(name)
    if rule is None:
        return d
    return rule(d) if callable(rule) else rule


def _is_dropout(name: str) -> bool:
    n = name.lower()
    return ("dropout" in n or "pdrop" in n or n.endswith("_drop") or "layerdrop" in n or "jitter" in n
            or n in ("dropout_p", "attn_pdrop"))


def _n_layers(cfg) -> Tuple[Optional[str], Optional[int]]:
    for k in LAYER_KEYS:
        v = _get(cfg, k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return k, v
    return None, None


def _per_layer_fields(cfg0, fields, L0) -> Tuple[Dict[str, Any], Dict[str, List[int]]]:
    """Per-layer patterns of the default config: lists (or strings) with one entry per layer, and lists of layer
    indices (MoE layers, attention layers, ...)."""
    per_layer, index_lists = {}, {}
    for name in fields:
        v = _get(cfg0, name)
        if (isinstance(v, (list, tuple)) or (isinstance(v, str) and "pattern" in name)) and L0 and len(v) == L0 \
                and L0 > 1:
            if all(isinstance(x, (str, int, bool, float)) or x is None for x in v):
                per_layer[name] = v
                continue
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v) and "type" in name:
            per_layer[name] = v  # a pattern of block kinds not (yet) expanded to the layer count
            continue
        if (isinstance(v, (list, tuple)) and v and L0 and all(isinstance(x, int) and not isinstance(x, bool)
                                                              and 0 <= x < L0 for x in v)
                and len(set(v)) == len(v) and len(v) < L0
                and any(s in name for s in ("layer", "idx", "indices", "ids"))):
            index_lists[name] = list(v)
    return per_layer, index_lists


def _select_layers(per_layer, index_lists, L0, per_kind: int = 1) -> List[int]:
    """``per_kind`` layers of each kind (first occurrences), at least 2 and at most MAX_LAYERS (or 2 per kind), in
    order."""
    n = max([len(v) for v in per_layer.values()] + ([L0] if not per_layer or index_lists else []) + [1])
    seen, sel = collections.Counter(), []
    for i in range(n):
        key = tuple(v[i % len(v)] for v in per_layer.values()) + tuple(i in v for v in index_lists.values())
        if seen[key] < per_kind:
            seen[key] += 1
            sel.append(i)
    sel = sel[:max(MAX_LAYERS, 2 * per_kind)] if per_kind == 1 else sel[:2 * MAX_LAYERS]
    for i in range(n):
        if len(sel) >= 2:
            break
        if i not in sel:
            sel.append(i)
    return sorted(sel)


def _rle_pattern(v: Any, L0: int) -> bool:
    """``[[[kinds...], repeats], ...]`` expanding to one kind per layer (GPT-Neo's attention_types)."""
    try:
        return bool(v) and all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], (list, tuple))
                               and isinstance(p[1], int) for p in v) and sum(len(p[0]) * p[1] for p in v) == L0
    except Exception:  # noqa: BLE001
        return False


def _expand_rle(v) -> List[Any]:
    return [k for kinds, r in v for _ in range(r) for k in kinds]


def _scale_rope(rp: Any, head_dim: Optional[int]) -> Any:
    """rope_parameters: a multimodal section split rescaled to the new rotary half-dim."""
    if isinstance(rp, dict):
        out = {k: _scale_rope(v, head_dim) for k, v in rp.items()}
        sec = out.get("mrope_section")
        if isinstance(sec, (list, tuple)) and sec and head_dim:
            half = int(head_dim * float(out.get("partial_rotary_factor", 1.0))) // 2
            tot = sum(sec)
            new = [max(1, s * half // tot) for s in sec]
            new[0] += half - sum(new)
            out["mrope_section"] = new
        return out
    return rp


def resolve(name: str):
    """(model class, config class, canonical config class of the mapping) for a mapping name."""
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as M

    cls = getattr(tf, M[name])
    cc = getattr(cls, "config_class", None) or CONFIG_MAPPING[name]
    return cls, cc, CONFIG_MAPPING[name]


def skip_reason(name: str) -> Optional[str]:
    """Why ``name`` is not a decoder-only text LM that can be built here from its config class, or None."""
    cls, cc, mapped = resolve(name)
    try:
        cfg0 = cc()
    except Exception as e:  # noqa: BLE001
        return f"its config class's defaults do not validate: {_first_line(e)[:200]}"
    if getattr(cfg0, "is_encoder_decoder", False):
        return "encoder-decoder"
    subs = list((getattr(cfg0, "sub_configs", None) or {}).keys())
    mm = [s for s in subs if any(h in s for h in MULTIMODAL_HINTS)]
    mm += [f for f in _fields(cc) if any(f.startswith(h) for h in ("vision", "audio", "num_codebooks"))]
    if mm or "ConditionalGeneration" in cls.__name__:
        return f"multimodal / audio ({', '.join(sorted(set(mm))) or cls.__name__})"
    if "text_config" in subs:
        return "multimodal (a composite config around a text_config)"
    return None


def default_build_error(name: str) -> Optional[str]:
    """Why the full model of the config class's defaults does not build (on the meta device), or None."""
    import torch

    cls, cc, _ = resolve(name)
    try:
        with torch.device("meta"):
            cls(cc())
    except Exception as e:  # noqa: BLE001
        return _first_line(e)[:200]
    return None


def _widths(cfg) -> set:
    """The hidden sizes of a config and of its sub-configs."""
    out = set()
    for k in ("hidden_size", "n_embd", "d_model"):
        v = _get(cfg, k)
        if isinstance(v, int):
            out.add(v)
    for f in _fields(type(cfg)):
        d = _get(cfg, f)
        if dataclasses.is_dataclass(d) and hasattr(d, "to_dict"):
            out |= _widths(d)
    return out


def _tiny_kwargs(cc, cfg0, notes: List[str], prefix: str = "", per_kind: int = 1,
                 widths: Optional[set] = None) -> Dict[str, Any]:
    """Constructor arguments that scale ``cfg0`` (an instance of ``cc`` with its defaults) down; text sub-configs
    (BLT's patcher / encoder / global / decoder, DBRX's attention / FFN) are scaled the same way."""
    fields = _fields(cc)
    widths = _widths(cfg0) if widths is None else widths
    kw: Dict[str, Any] = {}
    for fname in fields:
        if fname.startswith("_") or fname in ("rope_parameters",):
            continue
        d = _get(cfg0, fname, _MISSING)
        if d is _MISSING:
            continue
        if dataclasses.is_dataclass(d) and hasattr(d, "to_dict"):
            sub_kw = _tiny_kwargs(type(d), d, notes, prefix + fname + ".", per_kind, widths)
            if sub_kw:
                try:  # rebuilt, so that what its __post_init__ derives (head_dim, ...) follows
                    kw[fname] = type(d)(**{**{k: _get(d, k) for k in _fields(type(d)) if not k.startswith("_")
                                              and k != "transformers_version" and _get(d, k, _MISSING) is not _MISSING},
                                           **sub_kw})
                except Exception:  # noqa: BLE001
                    sub = copy.deepcopy(d)
                    for k, v in sub_kw.items():
                        setattr(sub, k, v)
                    kw[fname] = sub
            continue
        if fname in SCALE:
            rule = SCALE[fname]
            v = rule(d) if callable(rule) else rule
            if v != d:
                kw[fname] = v
        elif "hidden_size" in fname and isinstance(d, int) and not isinstance(d, bool) and d > HIDDEN:
            # hidden_size_global, attention_hidden_size, ...: other names of a width; a multiple of the config's
            # own hidden size (Zamba's 2 x hidden attention input) stays that multiple, unless it is the width of
            # another config of the model (BLT's global hidden size)
            own = _get(cfg0, "hidden_size")
            if isinstance(own, int) and own > 0 and d % own == 0 and d != own and d not in widths:
                kw[fname] = HIDDEN * (d // own)
            else:
                kw[fname] = HIDDEN
        elif _is_dropout(fname) and isinstance(d, float) and not isinstance(d, bool) and d != 0.0:
            kw[fname] = 0.0
    # multi-head-latent attention: head_dim / qk_head_dim keep their relation to the nope / rope / v parts
    parts = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if all(p in fields for p in parts[:2]):
        old = {p: _get(cfg0, p) for p in parts}
        new = {p: kw.get(p, old[p]) for p in parts}
        for f in ("head_dim", "qk_head_dim"):
            v0 = _get(cfg0, f) if f in fields else None
            if not isinstance(v0, int) or not all(isinstance(old[p], int) for p in parts[:2]):
                continue
            # per-layer overrides of the nope part count too (Dots-3's sliding layers)
            spec_o = getattr(getattr(cfg0, "_heterogeneity_spec", None), "per_layer_overrides", None) or {}
            nopes = [old["qk_nope_head_dim"]] + [o["qk_nope_head_dim"] for o in spec_o.values()
                                                 if isinstance(o.get("qk_nope_head_dim"), int)]
            if v0 == old["qk_rope_head_dim"]:
                kw[f] = new["qk_rope_head_dim"]
            elif any(v0 == nope + old["qk_rope_head_dim"] for nope in nopes if isinstance(nope, int)):
                kw[f] = _scaled("qk_nope_head_dim", next(nope for nope in nopes if isinstance(nope, int) and v0
                                                         == nope + old["qk_rope_head_dim"])) + new["qk_rope_head_dim"]
            elif v0 == old["v_head_dim"]:
                kw[f] = new["v_head_dim"]
    lkey, L0 = _n_layers(cfg0)
    if lkey is not None:
        per_layer, index_lists = _per_layer_fields(cfg0, fields, L0)
        rle = {f: _get(cfg0, f) for f in fields if not f.startswith("_") and f not in per_layer
               and _rle_pattern(_get(cfg0, f), L0)}
        keyed = {**per_layer, **{f: _expand_rle(v) for f, v in rle.items()}}
        # heterogeneous configs: per-layer overrides of global attributes (Gemma-4's global head_dim, ...)
        spec = getattr(cfg0, "_heterogeneity_spec", None)
        overrides = dict(getattr(spec, "per_layer_overrides", None) or {})
        if overrides:
            keyed["per_layer_config"] = [tuple(sorted(overrides.get(i, {}).items())) for i in range(L0)]
        sel = _select_layers(keyed, index_lists, L0, per_kind)
        for f, v in per_layer.items():
            cut = [v[i % len(v)] for i in sel]
            if all(isinstance(x, int) and not isinstance(x, bool) for x in cut):  # per-layer sizes
                base = next((k for k in sorted(SCALE, key=len, reverse=True) if f.startswith(k)), None)
                cut = [_scaled(base, x) for x in cut] if base else cut
            kw[f] = "".join(cut) if isinstance(v, str) else type(v)(cut)
        if overrides:
            kw["per_layer_config"] = {j: {a: _scaled(a, x) for a, x in overrides[i].items()}
                                      for j, i in enumerate(sel) if i in overrides}
        for f, v in rle.items():
            kw[f] = [[[keyed[f][i] for i in sel], 1]]
        for f, v in index_lists.items():
            kw[f] = [j for j, i in enumerate(sel) if i in v]
        kw[lkey] = len(sel)
        if keyed or index_lists:
            notes.append(f"{prefix}layers {sel} of the default pattern "
                         f"({', '.join(list(keyed) + list(index_lists))})")
    vocab = kw.get("vocab_size", _get(cfg0, "vocab_size", 256))
    if isinstance(vocab, int):
        for i, t in enumerate(TOKEN_KEYS):
            d = _get(cfg0, t) if t in fields else None
            if isinstance(d, int) and not isinstance(d, bool) and d >= vocab:
                kw[t] = min(i, vocab - 1)
            elif isinstance(d, (list, tuple)) and any(isinstance(x, int) and x >= vocab for x in d):
                kw[t] = [x for x in d if x < vocab] or [min(i, vocab - 1)]
    if "rope_parameters" in fields:
        rp = _get(cfg0, "rope_parameters")
        new = _scale_rope(rp, kw.get("head_dim", _get(cfg0, "head_dim")))
        if new != rp:
            kw["rope_parameters"] = new
    if "is_decoder" in fields and not prefix:
        kw["is_decoder"] = True  # an encoder-style stack used as a causal LM needs it; decoders ignore it
    return kw


KV_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "swa_num_key_value_heads",
           "kv_heads")
#: what to try when the first tiny config does not build or run: attention with as many kv heads as heads (MLA and
#: other attentions that use num_key_value_heads differently)
FALLBACKS = [("", {}), ("kv heads = heads", {"__kv_equal_heads__": True}),
             ("two layers of each kind", {"__per_kind__": 2}),
             ("two layers of each kind, kv heads = heads", {"__per_kind__": 2, "__kv_equal_heads__": True})]


def tiny_config(name: str, overrides: Optional[dict] = None):
    """A tiny config of ``name``'s config class (the defaults scaled down, see SCALE); returns (config, notes)."""
    cls, cc, _ = resolve(name)
    notes: List[str] = []
    overrides = dict(overrides or {})
    kw = _tiny_kwargs(cc, cc(), notes, per_kind=overrides.pop("__per_kind__", 1))
    if overrides.pop("__kv_equal_heads__", False):
        for layer in (kw.get("per_layer_config") or {}).values():
            for k in KV_KEYS:
                if k in layer and "num_attention_heads" in layer:
                    layer[k] = layer["num_attention_heads"]
        for k in KV_KEYS:
            if k in kw:
                kw.pop(k)
                heads = [kw[h] for h in ("num_attention_heads", "n_head", "num_heads", "n_heads") if h in kw]
                if heads:
                    kw[k] = heads[0]
    kw.update(overrides)
    return cc(**kw), notes


def build_tiny(name: str, attn_implementation: Optional[str] = None, overrides: Optional[dict] = None, seed=0,
               check: bool = True):
    """The tiny random-init fp32 model of mapping name ``name`` in train mode; returns (model, notes).

    With ``check``, a config that does not build, or whose model does not run an eager forward on
    :func:`make_batch`, is retried with the next of :data:`FALLBACKS` (the note says which was used)."""
    import torch

    cls, cc, _ = resolve(name)
    first_err = None
    for label, extra in (FALLBACKS if check else FALLBACKS[:1]):
        try:
            cfg, notes = tiny_config(name, {**extra, **(overrides or {})})
            if attn_implementation is not None:
                cfg._attn_implementation = attn_implementation
            torch.manual_seed(seed)
            model = cls(cfg).float()
            model.train()
            if check:
                with torch.no_grad():
                    model(**make_batch(model))
            if label:
                notes.append(f"{label} (the first config failed: {_first_line(first_err)[:120]})")
            return model, notes
        except Exception as e:  # noqa: BLE001
            first_err = first_err or e
    raise first_err


def module_coverage(name: str, model) -> List[str]:
    """Module classes of the full default model (meta device) that the tiny model does not have."""
    import torch

    cls, cc, _ = resolve(name)
    try:
        with torch.device("meta"):
            full = cls(cc())
    except Exception:  # noqa: BLE001
        return []
    have = {type(m).__name__ for m in model.modules()}
    return sorted({type(m).__name__ for m in full.modules()} - have)


def make_batch(model, seed=0):
    """input_ids [2, 16] (ids >= 8: no special tokens), attention_mask (row 1 right-padded by 4) and labels."""
    import torch

    g = torch.Generator().manual_seed(seed)
    V = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else \
        model.config.vocab_size
    ids = torch.randint(8, min(V, model.config.vocab_size), (BATCH, SEQ), generator=g)
    am = torch.ones(BATCH, SEQ, dtype=torch.long)
    am[1, SEQ - PAD:] = 0
    labels = torch.randint(8, min(V, model.config.vocab_size), (BATCH, SEQ), generator=g)
    labels[am == 0] = -100
    labels[0, :2] = -100
    kw = dict(input_ids=ids, labels=labels)
    params = inspect.signature(model.forward).parameters
    if "attention_mask" in params:
        kw["attention_mask"] = am
    if "use_cache" in params:
        kw["use_cache"] = False
    return kw


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


def _first_line(e: BaseException) -> str:
    s = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    out = f"{type(e).__name__}: {s[0][:300] if s else ''}"
    if len(s) > 1 and s[0].endswith(":"):  # "Class validation error for validator ...:\n    ValueError: ..."
        out += " " + s[1][:300]
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


# ----------------------------------------------------------------------------------------- the whole walk
def all_names() -> List[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as M

    return list(M)


def aliases() -> Dict[str, str]:
    """Mapping names whose model class another name already covers -> that name (the one whose own config class
    the model class uses, else the first)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as M

    by_cls: Dict[str, List[str]] = collections.defaultdict(list)
    for n, c in M.items():
        by_cls[c].append(n)
    out = {}
    for c, names in by_cls.items():
        if len(names) < 2:
            continue
        try:
            canon = [n for n in names if resolve(n)[1] is resolve(n)[2] and resolve(n)[1].model_type == n]
            canon = canon or [n for n in names if resolve(n)[1] is resolve(n)[2]]
        except Exception:  # noqa: BLE001
            canon = []
        keep = canon[0] if canon else names[0]
        for n in names:
            if n != keep:
                out[n] = keep
    return out


def _worker(name: str, out_path: str, attn: Optional[str]) -> None:
    import torch

    torch.set_num_threads(1)
    rec = run_arch(name, attn)
    with open(out_path, "w") as f:
        json.dump(rec, f, default=str)


def _run_one(name: str, timeout: int, attn: Optional[str], tmpdir: str) -> Dict[str, Any]:
    out_path = os.path.join(tmpdir, f"{name}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--out", out_path]
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="mapping names (default: all)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per architecture")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--attn", default=None, help="force an attention implementation (default: the model's)")
    ap.add_argument("--markdown", action="store_true", help="only re-render docs/architectures.md from the JSON")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return _worker(a.worker, a.out, a.attn)
    if a.markdown:
        with open(JSON_PATH) as f:
            data = json.load(f)
        data["summary"] = summary(data["records"])
        with open(MD_PATH, "w") as f:
            f.write(render_markdown(data))
        return
    names = a.names or all_names()
    recs = run_all(names, a.timeout, a.workers, a.attn)
    if not a.no_write:
        data = write(recs, merge=bool(a.names))
        print(json.dumps({k: v for k, v in data["summary"].items() if k != "top_reasons"}))


if __name__ == "__main__":
    main()
