"""The model builder of ``benchmarks/architectures.py``: every decoder-only causal-LM architecture the installed
transformers registers, as a tiny random-init fp32 model built generically from its config class's defaults, and the
batch of the one step.

The tiny config is built generically from the config class's own defaults, scaled down through the usual
attribute spellings (:data:`SCALE`): hidden 64, 4 heads / 2 kv heads, head_dim 16, intermediate 128, vocab 256,
MoE with 4 experts of 32, top-k <= 2, sliding windows 8. Per-layer patterns (``layer_types``, hybrid block lists,
index lists of MoE / attention layers, periods and offsets) are cut to one layer of each kind, at least 2, so a
hybrid model keeps its attention, SSM, dense and MoE layers. The module classes of the tiny model are compared
with those of the full default model (built on the meta device); what the tiny one lacks is recorded.

The batch: 2 x 16, row 1 right-padded by 4 (an ``attention_mask`` where the model takes one), labels a tensor of
their own with -100 at the pads and at the first two positions of row 0.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
from typing import Any, Dict, List, Optional, Tuple

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


def _first_line(e: BaseException) -> str:
    s = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    out = f"{type(e).__name__}: {s[0][:300] if s else ''}"
    if len(s) > 1 and s[0].endswith(":"):  # "Class validation error for validator ...:\n    ValueError: ..."
        out += " " + s[1][:300]
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
