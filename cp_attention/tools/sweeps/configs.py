"""Tiny configs of any transformers family, built generically from its config class.

:func:`tiny_config` takes the config class's defaults and shrinks them by rules over attribute names
(:func:`shrink`: widths, heads, layers of each distinct kind, experts, vocabularies, windows, token
ids), then applies a small table of per-family :data:`OVERRIDES` where the rules cannot know a
constraint; :func:`build_model` builds the family's causal LM of such a config. The family sweep
(:mod:`.family`), the head sweep (:mod:`.heads`), the vision-language sweep (:mod:`.vlm_configs`) and
the tests build their tiny models with these rules.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from types import MappingProxyType

import torch

__all__ = ["SEED", "HIDDEN", "HEADS", "KV_HEADS", "HEAD_DIM", "VOCAB", "MAX_POS", "WINDOW", "CHUNK", "ID_RANGE",
           "FIXED", "OVERRIDES", "POST_BUILD", "FLOAT64", "families", "model_dtype", "layer_count", "choose_layers",
           "scale_section", "shrink", "drop_derived", "tiny_config", "model_class", "config_class", "build_model",
           "text_config", "layer_kinds"]

SEED = 0  # the weights of every model built here
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
VOCAB, MAX_POS, WINDOW, CHUNK = 128, 512, 8, 8
MAX_LAYERS = 6  # the family's distinct kinds of layers, at most this many (2 when it has one kind)
ID_RANGE = (3, 96)  # input ids; special (image, audio, ...) token ids live above, 127 downwards


def families() -> list[str]:
    """Every key of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (the installed version)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# --------------------------------------------------------------------------------------------------
# The tiny config: rules over attribute names
# --------------------------------------------------------------------------------------------------

LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers")
OTHER_LAYER_COUNT_KEYS = ("encoder_layers", "num_encoder_layers")  # an encoder a causal LM does not run
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "embedding_size", "word_embed_proj_dim", "embed_dim",
               "attention_hidden_size", "input_embedding_size", "output_embedding_size", "model_dim",
               "hidden_size_global", "dim_model", "emb_dim", "embedding_dim")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "encoder_attention_heads",
             "decoder_attention_heads", "num_encoder_attention_heads", "num_decoder_attention_heads",
             "swa_num_attention_heads", "linear_num_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "multi_query_group_num",
                "num_query_groups", "swa_num_key_value_heads")
HEAD_DIM_KEYS = ("head_dim", "attention_head_dim", "d_head", "dim_head", "kv_channels", "attention_head_size",
                 "swa_head_dim", "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "mamba_d_head", "mamba_head_dim", "mamba_headdim", "index_head_dim", "indexer_head_dim",
                 "global_head_dim")
FIXED = MappingProxyType({  # name -> value, applied when the default is an int (MLA, SSM, linear attention, indexers, ...)
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "qk_head_dim": 24, "kv_lora_rank": 16,
    "q_lora_rank": 32, "o_lora_rank": 16, "rotary_dim": 8, "rotary_emb_base": None,
    "state_size": 8, "d_state": 8, "ssm_state_size": 8, "mamba_d_state": 8,
    "mamba_n_heads": 8, "mamba_num_heads": 8, "n_mamba_heads": 8, "mamba_nheads": 8, "mamba_n_groups": 1,
    "n_groups": 1, "mamba_ngroups": 1, "mamba_chunk_size": 16, "chunk_size": 16, "time_step_rank": 8,
    "mamba_dt_rank": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "index_n_heads": 2,
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "n_group": 1, "num_expert_group": 1, "topk_group": 1,
    "hidden_size_per_layer_input": 16, "laurel_rank": 8, "first_k_dense_replace": 1, "num_dense_layers": 1,
    "moe_layer_start_index": 1, "attention_chunk_size": CHUNK, "num_nextn_predict_layers": 0,
    "num_kv_shared_layers": 0, "kv_n_heads": 2, "router_hidden_size": 32, "backbone_hidden_size": 64,
    "num_memory_blocks": 1, "num_mem_blocks": 1, "adapter_rank": 8, "gated_norm_rank": 8, "hc_lowrank": 8,
    "moe_latent_size": 32, "ple_embed_dim": 16, "loop_gate_rank": 8,
    "index_topk": 8,  # an indexer keeps 8 keys per query: fewer than a 44-token document's, so the selection binds
})
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_layer")
TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k_experts", "num_selected_experts",
             "moe_k", "top_k")
SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
WINDOW_KEYS = ("sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len",
               "local_attention", "window_size", "attention_window")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                 "max_target_positions", "context_length", "max_source_positions", "model_max_length")
DROPOUT_RE = re.compile(r"(dropout|pdrop|drop_rate|layerdrop|dropout_p|_drop$|^drop_)")
INTERMEDIATE_RE = re.compile(r"(intermediate|ffn|feed_forward|dim_ff|^n_inner$|mlp_dim|ff_dim|mlp_hidden)")
INTERVAL_RE = re.compile(r"(interval|period|every_n|_step$|_pattern$|layer_group_size|per_attn_res_block)")
OFFSET_RE = re.compile(r"offset$")
TOKEN_ID_RE = re.compile(r"(_token_id|_token_index|_token_ids)$")
INDEX_LIST_RE = re.compile(r"(layer|idx|indices|ids)")
NONE_FILL = MappingProxyType({"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS, "num_experts_per_tok": 2,
             "n_routed_experts": 4, "n_shared_experts": 1})  # None in the defaults, required by the model code
SPECIAL_IDS = MappingProxyType({"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
               "cls_token_id": 1, "sep_token_id": 2, "mask_token_id": 3, "unk_token_id": 0,
               "forced_eos_token_id": 2, "forced_bos_token_id": 1, "eod_token_id": 2})
TEXT_SUBCONFIGS = ("text_config", "decoder_config", "global_config", "encoder_config", "patcher_config",
                   "attn_config", "ffn_config", "depth_decoder_config")

# Per-family overrides, applied to the kwargs after the rules where the rules cannot know a constraint:
# {family: (reason, function(kwargs) -> None, editing kwargs in place)}.


def _text_kwargs(kwargs: dict) -> dict:
    return kwargs["text_config"] if isinstance(kwargs.get("text_config"), dict) else kwargs


def _set(**values):
    """Set ``values`` (in text_config where there is one); a new layer list also sets the layer count."""
    def apply(kwargs):
        target = _text_kwargs(kwargs)
        target.update(values)
        for key in ("layer_types", "layers_block_type"):
            if key in values and "num_hidden_layers" not in values:
                target["num_hidden_layers"] = len(values[key])
    return apply


def _dory(kwargs):
    n = kwargs["num_hidden_layers"]
    kwargs.update(n_input_layers=1, n_recurrent_layers=n - 2, n_output_layers=1)


_QSA = MappingProxyType(dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4))
OVERRIDES: Mapping[str, tuple[str, object]] = MappingProxyType({
    "mamba2": ("its SSM heads are the generic `num_heads`/`head_dim` names: hidden * expand = num_heads * head_dim",
               _set(num_heads=8)),
    "granitemoehybrid": ("the defaults have only Mamba layers; the family's mix is Mamba + attention",
                         _set(layer_types=["linear_attention", "attention"])),
    "zamba": ("the shared transformer's tied weights need two hybrid layers", _set(
        num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"])),
    "zamba2": ("the shared transformer's tied weights need two hybrid layers", _set(
        num_hidden_layers=4, hybrid_layer_ids=[1, 3],
        layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"])),
    "dory": ("n_input_layers + n_recurrent_layers + n_output_layers must equal num_hidden_layers",
             _dory),
    "reformer": ("axial position embedding dims must sum to hidden_size, their shape multiply to the max length",
                 _set(axial_pos_embds_dim=[16, 48], axial_pos_shape=[16, 32])),
    "minimax_m3_vl_text": ("the default layer_types have no sparse layer (a checkpoint's sparse_attention_freq "
                           "sets them): the family's mix has them, with blocks that select within 44 tokens",
                           _set(num_hidden_layers=3, layer_types=["full_attention", "minimax_m3_sparse",
                                                                  "minimax_m3_sparse"],
                                index_block_size=4, index_topk_blocks=2, index_local_blocks=1, index_n_heads=2)),
    "deepseek_v4": ("one layer of each kind, with compression rates, a window and a rotary share that bind within "
                    "44 tokens (the defaults compress 128 tokens and attend to a 128-token window)",
                    lambda kw: (kw.pop("qk_rope_head_dim", None), kw.update(
                        index_topk=2, head_dim=16, partial_rotary_factor=0.5, sliding_window=8, num_hidden_layers=3,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention"],
                        mlp_layer_types=["hash_moe", "moe", "moe"]))),
    "qwen4_exp": ("the sparse-attention indexer fields default to None but the model needs them", _set(**_QSA)),
    "qwen4_exp_text": ("the sparse-attention indexer fields default to None but the model needs them", _set(**_QSA)),
    "lfm2_moe": ("layer_types defaults to None, which the model indexes", _set(layer_types=["conv", "full_attention"])),
    "cohere_compass_text": ("rope_parameters defaults to {} but the model reads it per layer type",
                            _set(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "dbrx": ("the attention reads attn_config.rope_theta, which the default attn_config lacks",
             lambda kw: kw["attn_config"].update(rope_theta=10000.0, clip_qkv=8.0)),  # None clip crashes eager
    "dots3_note": ("its SWA layers' head_dim must equal qk_nope_head_dim + qk_rope_head_dim (the MLA rule sets the "
                   "rope dim)", _set(head_dim=24)),
    "dots3_note_text": ("its SWA layers' head_dim must equal qk_nope_head_dim + qk_rope_head_dim (the MLA rule sets "
                        "the rope dim)", _set(head_dim=24)),
    "musicgen": ("input_ids are (batch x num_codebooks, L): one codebook keeps them (1, L)", _set(num_codebooks=1)),
    "musicgen_melody": ("input_ids are (batch x num_codebooks, L): one codebook keeps them (1, L)",
                        _set(num_codebooks=1)),
})
# After the model is built: {model_type: (reason, function(model))}
POST_BUILD: Mapping[str, tuple[str, object]] = MappingProxyType({
    "xmod": ("the model refuses to run before a default language adapter is chosen",
             lambda m: m.set_default_language(next(iter(m.config.languages)))),
})

FLOAT64: Mapping[str, str] = MappingProxyType({  # family -> why its comparison runs in float64 (every other family: float32)
    "gemma3n_text": "its activation-sparsity gate (a 95% Gaussian top-k, then ReLU) is discontinuous: the "
                    "rounding-level float32 difference between any two attention orders flips gate elements "
                    "and moves gradients by ~1e-3 relative (with the gate off, cp_flash is within 1e-5 in float32)",
})


def model_dtype(family: str) -> torch.dtype:
    """The dtype a family's models run in for the sweep (:data:`FLOAT64`)."""
    return torch.float64 if family in FLOAT64 else torch.float32


def layer_count(d: dict) -> tuple[str | None, int | None]:
    for key in LAYER_COUNT_KEYS:
        if isinstance(d.get(key), int) and d[key] > 0:
            return key, d[key]
    for key, value in d.items():  # no count, only a per-layer list (Nemotron-H's layers_block_type)
        if key.endswith(("layer_types", "block_type", "block_types")) and isinstance(value, (list, tuple)) and value:
            return None, len(value)
    return None, None


def _is_per_layer(value, n0: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == n0 and n0 > 1


def _is_pattern_string(key: str, value, n0: int) -> bool:
    return isinstance(value, str) and len(value) == n0 and n0 > 1 and "pattern" in key


def _is_index_list(key: str, value, n0: int) -> bool:
    return (isinstance(value, (list, tuple)) and INDEX_LIST_RE.search(key) is not None and len(value) < n0
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n0 for x in value))


def _layer_keyed(value, n0: int) -> dict[int, object] | None:
    """A dict keyed by layer index (``per_layer_config``: {"05": {...}}) as {int: value}, else None."""
    if not isinstance(value, dict) or not value:
        return None
    try:
        out = {int(k): v for k, v in value.items()}
    except (TypeError, ValueError):
        return None
    return out if all(0 <= k < n0 for k in out) else None


def choose_layers(d: dict, n0: int) -> list[int]:
    """Indices of the layers kept: the first layer of each distinct kind, where a layer's kind is its
    entry in every per-layer list (``layer_types``, ``mlp_layer_types``, ``layers_block_type``, ...),
    its character of a pattern string (``hybrid_override_pattern``) and its membership of every list
    of layer indices (``attn_layer_indices``, ``mlp_only_layers``, ...); at least 2 layers."""
    sig = [[] for _ in range(n0)]
    for key, value in sorted(d.items()):
        if _is_per_layer(value, n0) or _is_pattern_string(key, value, n0):
            for i in range(n0):
                sig[i].append(str(value[i]))
        elif _is_index_list(key, value, n0) and value:
            members = set(value)
            for i in range(n0):
                sig[i].append(str(i in members))
        elif _layer_keyed(value, n0) is not None:
            keyed = _layer_keyed(value, n0)
            for i in range(n0):
                sig[i].append(json.dumps(keyed.get(i), sort_keys=True, default=str))
    seen, chosen = set(), []
    for i in range(n0):
        s = tuple(sig[i])
        if s not in seen:
            seen.add(s)
            chosen.append(i)
    chosen = chosen[:MAX_LAYERS]
    if len(chosen) < 2:
        chosen = sorted(set(chosen) | set(range(min(2, n0))))
    return chosen


def scale_section(section: list[int], total: int) -> list[int]:
    """An mrope section scaled to sum to ``total`` (each part >= 1)."""
    s = sum(section)
    out = [max(1, round(x * total / s)) for x in section]
    out[-1] += total - sum(out)
    return out


def _shrink_layers(d: dict, out: dict, n0: int, text: bool) -> None:
    """Into ``out``: the chosen layers of every per-layer value of ``d`` (``n0`` layers), and the layer counts."""
    has_per_layer = False
    chosen = choose_layers(d, n0)
    for key, value in d.items():
        if _is_per_layer(value, n0):
            out[key] = type(value)(value[i] for i in chosen)
            has_per_layer = True
        elif _is_pattern_string(key, value, n0):
            out[key] = "".join(value[i] for i in chosen)
            has_per_layer = True
        elif _is_index_list(key, value, n0):
            members = set(value)
            out[key] = [j for j, i in enumerate(chosen) if i in members]
        elif _layer_keyed(value, n0) is not None:
            keyed = _layer_keyed(value, n0)
            out[key] = {j: shrink(keyed[i], text=text) if isinstance(keyed[i], dict) else keyed[i]
                        for j, i in enumerate(chosen) if i in keyed}
    n = len(chosen)
    intervals = [k for k, v in d.items() if INTERVAL_RE.search(k) and isinstance(v, int)
                 and not isinstance(v, bool) and v > 1]
    if intervals and not has_per_layer:  # layer kinds computed from periods: period 2 on 4 layers
        n = 4
    for k in intervals:
        out[k] = 2
    for k, v in d.items():
        if OFFSET_RE.search(k) and "layer" in k and isinstance(v, int) and v > 1:
            out[k] = 1
    for key in LAYER_COUNT_KEYS:
        if isinstance(d.get(key), int) and d[key] > 0:
            out[key] = n


def _shrink_int(key: str, value: int, out: dict, heads0: int | None, text: bool) -> None:
    """Into ``out``: the shrunk value of the int ``key`` (``heads0``: the config's attention heads)."""
    if key in FIXED and FIXED[key] is not None:
        if value > 0:
            out[key] = FIXED[key]
    elif key in HIDDEN_KEYS:
        out[key] = HIDDEN
    elif key in HEAD_KEYS:
        out[key] = HEADS
    elif key in KV_HEAD_KEYS:
        out[key] = 1 if value == 1 else (HEADS if heads0 is not None and value == heads0 else KV_HEADS)
    elif key in HEAD_DIM_KEYS:
        out[key] = HEAD_DIM
    elif key in EXPERT_KEYS:
        out[key] = min(value, 4)
    elif key in TOPK_KEYS:
        out[key] = min(value, 2)
    elif key in SHARED_EXPERT_KEYS:
        out[key] = min(value, 1)
    elif key in POSITION_KEYS:
        out[key] = MAX_POS
    elif text and key in WINDOW_KEYS and value > WINDOW:
        out[key] = WINDOW
    elif key.endswith("vocab_size") or key in ("n_vocab", "vocab_size_per_layer_input", "output_vocab_size"):
        if value > VOCAB:
            out[key] = VOCAB
    elif INTERMEDIATE_RE.search(key) and value > 32:
        out[key] = 32 if re.search(r"moe|expert|shared", key) else 2 * HIDDEN


def _shrink_coupled(d: dict, out: dict) -> None:
    """Into ``out``: the sizes that follow others (Zamba's attention width, Falcon-H1's SSM width, MLA's head dim)."""
    hidden0 = next((d[k] for k in HIDDEN_KEYS if isinstance(d.get(k), int) and not isinstance(d[k], bool)), None)
    if hidden0 and isinstance(d.get("attention_hidden_size"), int):  # Zamba: attention over [h, embeddings]
        out["attention_hidden_size"] = HIDDEN * max(1, round(d["attention_hidden_size"] / hidden0))
        if isinstance(d.get("attention_head_dim"), int):
            out["attention_head_dim"] = out["attention_hidden_size"] // HEADS
    expand = d.get("mamba_expand", d.get("expand"))
    if isinstance(expand, int) and isinstance(d.get("mamba_d_ssm"), int):  # Falcon-H1: heads x head dim
        out["mamba_d_ssm"] = expand * HIDDEN
    if isinstance(d.get("qk_rope_head_dim"), int) and isinstance(d.get("head_dim"), int):  # MLA: rope dim
        out["head_dim"] = out["qk_rope_head_dim"]


def shrink(d: dict, *, text: bool = True) -> dict:
    """The shrunk kwargs of one config dict (recursing into sub-config dicts)."""
    out = dict(d)
    n_key, n0 = layer_count(d)
    if n0:
        _shrink_layers(d, out, n0, text)
    for key in OTHER_LAYER_COUNT_KEYS:
        if isinstance(d.get(key), int) and d[key] > 1:
            out[key] = 1
    heads0 = next((d[k] for k in HEAD_KEYS if isinstance(d.get(k), int)), None)
    for key, value in d.items():
        if isinstance(value, bool):
            continue
        if n0 and _layer_keyed(value, n0) is not None:
            continue
        if isinstance(value, dict) and (key.endswith("_config") or key in TEXT_SUBCONFIGS):
            out[key] = shrink(value, text=key in TEXT_SUBCONFIGS)
            continue
        if isinstance(value, float) and DROPOUT_RE.search(key):
            out[key] = 0.0
        if key == "rope_parameters" and isinstance(value, dict) and isinstance(value.get("mrope_section"), list):
            out[key] = dict(value, mrope_section=scale_section(value["mrope_section"], HEAD_DIM // 2))
        if value is None and key in NONE_FILL:  # a default left for the checkpoint to fill
            out[key] = NONE_FILL[key]
            continue
        if isinstance(value, int):
            _shrink_int(key, value, out, heads0, text)
    _shrink_coupled(d, out)
    # per-layer lists of sizes (heads per layer, ...) follow the scalar rules
    if n0:
        for key in ("num_attention_heads_per_layer",):
            if isinstance(out.get(key), (list, tuple)):
                out[key] = [HEADS] * len(out[key])
    _token_ids(d, out)
    if "is_decoder" in d:
        out["is_decoder"] = True
    if "add_cross_attention" in d:
        out["add_cross_attention"] = False
    return out


def _token_ids(d: dict, out: dict) -> None:
    special = VOCAB - 1
    for key in sorted(d):
        if not TOKEN_ID_RE.search(key) or isinstance(d[key], bool):
            continue
        value = d[key]
        if key in SPECIAL_IDS:
            target = SPECIAL_IDS[key]
            if isinstance(value, int):
                out[key] = target
            elif isinstance(value, (list, tuple)) and value:
                out[key] = [target]
        elif isinstance(value, int):
            out[key] = special
            special -= 1


def drop_derived(cls, kwargs: dict) -> dict:
    """Keep what the config class takes (a dataclass field or an __init__ parameter), plus anything
    when it takes **kwargs; ``transformers_version`` and ``architectures`` never."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("transformers_version", "architectures", "_name_or_path",
                                                           "model_type", "dtype", "torch_dtype")}
    return kwargs


def tiny_config(family: str):
    """The tiny config of ``family``: the config class's defaults shrunk by :func:`shrink` (rules over
    attribute names), then :data:`OVERRIDES`. Raises whatever the config class raises."""
    cls = config_class(family)
    d = cls().to_dict()
    kwargs = drop_derived(cls, shrink(d))
    if family in OVERRIDES:
        OVERRIDES[family][1](kwargs)
    return cls(**kwargs)


def model_class(family: str):
    """The class MODEL_FOR_CAUSAL_LM_MAPPING_NAMES names for ``family``."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])


def config_class(family: str):
    """The family's config class (CONFIG_MAPPING), or the model class's own where the family's config
    describes no language model (neither vocab_size nor text_config: Musicgen's composite, whose causal LM
    takes the decoder config)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    d = cls().to_dict()
    own = getattr(model_class(family), "config_class", None)
    if "vocab_size" not in d and "text_config" not in d and own is not None and own is not cls:
        return own
    return cls


# --------------------------------------------------------------------------------------------------
# The model of a tiny config
# --------------------------------------------------------------------------------------------------

def build_model(config, attn_implementation: str, state_dict: dict | None = None):
    """An eval-mode model of ``config`` from AutoModelForCausalLM in :func:`model_dtype` (weights
    from SEED, or ``state_dict`` when given: the cp_flash model then holds the eager model's exact
    weights)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import transformers as tf

    torch.manual_seed(SEED)
    family = getattr(config, "model_type", "")
    dtype = model_dtype(family)
    config = copy.deepcopy(config)
    try:
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                    dtype=dtype)
    except ValueError as exc:  # a config class AutoModelForCausalLM does not map (Musicgen's decoder)
        if "Unrecognized configuration class" not in str(exc):
            raise
        cls = next(getattr(tf, name) for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                   if getattr(getattr(tf, name, None), "config_class", None) is type(config))
        model = cls._from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    if family in POST_BUILD:
        POST_BUILD[family][1](model)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def text_config(config):
    """The language model's config of ``config`` (its ``text_config``, else itself)."""
    return getattr(config, "text_config", None) or config


def layer_kinds(config) -> dict:
    """The per-layer lists (and pattern strings) of ``config`` that say each layer's kind, as strings."""
    d = config.to_dict()
    _, n = layer_count(d)
    kinds = {}
    for key, value in d.items():
        if n and (_is_per_layer(value, n) or _is_pattern_string(key, value, n)):
            kinds[key] = [str(v) for v in value]
    return kinds


