"""A sweep over every causal-LM family of the installed transformers under attn_implementation="cp_flash".

For each entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny config built generically from the
family's config class (:func:`tiny_config`: the defaults, shrunk by rules over attribute names, with a
small override table), the same weights under ``"eager"`` and ``"cp_flash"``, and one packed row of
documents (:data:`DOCS`, ``position_ids`` restarting per document). The ground truth is eager with each
document run alone (logits, and parameter gradients of ``sum(logits * R)`` for a fixed random ``R``),
as in ``hf_cases``; tolerances are hf_cases'.

Outcomes per family and world size (:func:`run_family`):

* ``exact``: logits max abs error <= TOL, gradients within ``hf_cases.grad_tol``;
* ``refused``: a NotImplementedError (its message recorded);
* ``wrong``: ran, numbers off (max errors recorded);
* ``crash``: any other exception (type and first line);
* ``unbuildable``: the tiny config, the eager model or its docs-alone forward failed.

World size 1 runs through ``context_parallel()`` + ``cp.shard_batch`` in the family's process; world
size 2 on two gloo ranks (``run_ranks``). Two more world-size-1 comparisons separate the library from
the family: ``ws1_plain`` (cp_flash without a context, model(ids, position_ids=pos)) against the ground
truth, ``ws1_vs_packed_eager`` (the same call) against the family's own eager on the same packed row,
and ``eager_isolates`` (the family's packed eager against the ground truth: False means its own eager
lets documents see each other).

CLI: ``python tests/family_sweep.py --families a,b --world 1,2 --json out.json [--md out.md]``; each
family runs in its own subprocess with a timeout, at most ``--jobs`` (<= 2) at a time.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import hf_cases  # noqa: E402  (tests/ on sys.path)

__all__ = ["DOCS", "families", "tiny_config", "build_model", "run_family", "classify", "main"]

DOCS = (13, 22, 9)  # one packed row, L = 44 (zigzag at world size 2: 4 slices of 11)
SEED = 0
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
VOCAB, MAX_POS, WINDOW, CHUNK = 128, 512, 8, 8
MAX_LAYERS = 6  # the family's distinct kinds of layers, at most this many (2 when it has one kind)
ID_RANGE = (3, 96)  # input ids; special (image, audio, ...) token ids live above, 127 downwards
FAMILY_TIMEOUT = 120.0
OUTCOMES = ("exact", "refused", "wrong", "crash", "unbuildable", "timeout")


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
FIXED = {  # name -> value, applied when the default is an int (MLA, SSM, linear attention, indexers, ...)
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
}
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
NONE_FILL = {"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS, "num_experts_per_tok": 2,
             "n_routed_experts": 4, "n_shared_experts": 1}  # None in the defaults, required by the model code
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
               "cls_token_id": 1, "sep_token_id": 2, "mask_token_id": 3, "unk_token_id": 0,
               "forced_eos_token_id": 2, "forced_bos_token_id": 1, "eod_token_id": 2}
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


_QSA = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4)
OVERRIDES: dict[str, tuple[str, object]] = {
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
}
# After the model is built: {model_type: (reason, function(model))}
POST_BUILD: dict[str, tuple[str, object]] = {
    "xmod": ("the model refuses to run before a default language adapter is chosen",
             lambda m: m.set_default_language(next(iter(m.config.languages)))),
}

FLOAT64: dict[str, str] = {  # family -> why its comparison runs in float64 (every other family: float32)
    "gemma3n_text": "its activation-sparsity gate (a 95% Gaussian top-k, then ReLU) is discontinuous: the "
                    "rounding-level float32 difference between any two attention orders flips gate elements "
                    "and moves gradients by ~1e-3 relative (with the gate off, cp_flash is within 1e-5 in float32)",
}


def model_dtype(family: str) -> torch.dtype:
    """The dtype a family's models run in for the sweep (:data:`FLOAT64`)."""
    return torch.float64 if family in FLOAT64 else torch.float32


def _layer_count(d: dict) -> tuple[str | None, int | None]:
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


def _scale_section(section: list[int], total: int) -> list[int]:
    """An mrope section scaled to sum to ``total`` (each part >= 1)."""
    s = sum(section)
    out = [max(1, round(x * total / s)) for x in section]
    out[-1] += total - sum(out)
    return out


def shrink(d: dict, *, text: bool = True) -> dict:
    """The shrunk kwargs of one config dict (recursing into sub-config dicts)."""
    out = dict(d)
    n_key, n0 = _layer_count(d)
    has_per_layer = False
    if n0:
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
            out[key] = dict(value, mrope_section=_scale_section(value["mrope_section"], HEAD_DIM // 2))
        if value is None and key in NONE_FILL:  # a default left for the checkpoint to fill
            out[key] = NONE_FILL[key]
            continue
        if not isinstance(value, int):
            continue
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


def _drop_derived(cls, kwargs: dict) -> dict:
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
    kwargs = _drop_derived(cls, shrink(d))
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
# Models, inputs, runs
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


def forward_kwargs(model) -> dict:
    """Which of position_ids / use_cache the model's forward names."""
    params = inspect.signature(model.forward).parameters
    return dict(position_ids="position_ids" in params, use_cache="use_cache" in params)


def make_inputs(docs=DOCS) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (1, L), position_ids (1, L) restarting at 0 per document)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(*ID_RANGE, (1, sum(docs)), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    return ids, pos


def _call(model, fkw: dict, ids, pos):
    kwargs = {}
    if fkw["use_cache"]:
        kwargs["use_cache"] = False
    if fkw["position_ids"] and pos is not None:
        kwargs["position_ids"] = pos
    out = model(input_ids=ids, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits


def _R(shape, seed: int = 4321) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ground_truth(model, fkw: dict, ids, pos, docs=DOCS) -> dict:
    """Each document run alone under eager: logits (1, L, V), flat gradients of sum(logits * R), R."""
    model.zero_grad(set_to_none=True)
    pieces, start, R = [], 0, None
    for n in docs:
        sl = slice(start, start + n)
        logits = _call(model, fkw, ids[:, sl], torch.arange(n).unsqueeze(0))
        if R is None:
            R = _R((1, sum(docs), logits.shape[-1]))
        (logits * R[:, sl]).sum().backward()
        pieces.append(logits.detach())
        start += n
    return dict(logits=torch.cat(pieces, dim=1), grads=hf_cases.flat_grads(model), R=R)


def run_packed(model, fkw: dict, ids, pos, R) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed row in one call, no context: (logits, flat gradients)."""
    model.zero_grad(set_to_none=True)
    logits = _call(model, fkw, ids, pos)
    (logits * R).sum().backward()
    return logits.detach(), hf_cases.flat_grads(model)


def run_context(model, fkw: dict, ids, pos, R) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed row through context_parallel() + cp.shard_batch on the current group (world size 1
    without torch.distributed): gathered logits and this rank's gradients."""
    import cp_attention

    model.zero_grad(set_to_none=True)
    with cp_attention.context_parallel() as cp:
        batch = cp.shard_batch(input_ids=ids, position_ids=pos)
        kwargs = {}
        if fkw["use_cache"]:
            kwargs["use_cache"] = False
        if not fkw["position_ids"]:
            batch.pop("position_ids", None)
        out = model(**batch, **kwargs)
        logits = out.logits if hasattr(out, "logits") else out[0]
        (logits * cp.shard(R, dim=1)).sum().backward()
        logits = cp.gather(logits.detach(), dim=1)
    return logits, hf_cases.flat_grads(model)


def diffs(logits, grads, ref_logits, ref_grads, spans=None) -> dict:
    """Max abs errors, the gradient scale and (with spans) the worst parameter."""
    if logits.shape != ref_logits.shape or grads.shape != ref_grads.shape:
        return dict(finite=False, logit_err=float("inf"), grad_err=float("inf"), grad_scale=0.0,
                    note=f"shapes {tuple(logits.shape)} vs {tuple(ref_logits.shape)}")
    gdiff = (grads - ref_grads).abs()
    res = dict(finite=bool(torch.isfinite(logits).all() and torch.isfinite(grads).all()),
               logit_err=float((logits - ref_logits).abs().max()), grad_err=float(gdiff.max()),
               grad_scale=float(ref_grads.abs().max()))
    res["grad_rel"] = res["grad_err"] / res["grad_scale"] if res["grad_scale"] > 0 else res["grad_err"]
    if spans:
        worst = max(spans, key=lambda s: float(gdiff[s[1]:s[2]].max()) if s[2] > s[1] else -1.0)
        res["worst_param"] = worst[0]
    return res


def within(d: dict) -> bool:
    return (d["finite"] and d["logit_err"] <= hf_cases.TOL
            and d["grad_err"] <= hf_cases.grad_tol(d["grad_scale"]))


def _error(exc: BaseException) -> dict:
    msg = str(exc).strip().splitlines()
    # the model check's findings, one "  - <what> in <modules>: <why>" line each
    reasons = [m.group(1) for m in (re.match(r"\s*- (.+?) in \S", line) for line in msg[1:]) if m]
    return dict(error_type=type(exc).__name__, message=msg[0][:300] if msg else "", reasons=reasons)


def classify(result: dict | None = None, exc: BaseException | None = None) -> dict:
    """One outcome record from a diffs() dict or an exception."""
    if exc is not None:
        outcome = "refused" if isinstance(exc, NotImplementedError) else "crash"
        return dict(outcome=outcome, **_error(exc))
    return dict(outcome="exact" if within(result) else "wrong", **result)


def _compare_or_error(fn, ref_logits, ref_grads, spans) -> dict:
    try:
        logits, grads = fn()
    except Exception as exc:  # noqa: BLE001 - the outcome
        return classify(exc=exc)
    return classify(diffs(logits, grads, ref_logits, ref_grads, spans))


def _rank_worker(rank: int, world_size: int, family: str, state_dict: dict, ids, pos, R):
    """A CP rank: the cp_flash model with the eager weights, the packed row through context_parallel
    + shard_batch; returns (outcome of an exception or None, logits, summed gradients) on rank 0."""
    import torch.distributed as dist

    import cp_attention  # noqa: F401 - registers cp_flash

    torch.set_num_threads(1)
    try:
        model = build_model(tiny_config(family), "cp_flash", state_dict)
        logits, grads = run_context(model, forward_kwargs(model), ids, pos, R)
        dist.all_reduce(grads)
    except Exception as exc:  # noqa: BLE001 - reported per rank
        return dict(refused=isinstance(exc, NotImplementedError), **_error(exc))
    if rank:
        return dict(ok=True)
    # bytes, not tensors: a tensor put on the queue lives in shared memory the exiting rank may unlink
    buf = io.BytesIO()
    torch.save(dict(logits=logits, grads=grads), buf)
    return dict(payload=buf.getvalue())


def _pick_rank_error(per_rank: list[dict]) -> dict | None:
    errors = [r for r in per_rank if "error_type" in r]
    if not errors:
        return None
    primary = [r for r in errors if r["error_type"] != "RankFailedError"] or errors
    e = primary[0]
    outcome = "refused" if e["refused"] else "crash"
    return dict(outcome=outcome, error_type=e["error_type"], message=e["message"], reasons=e.get("reasons", []))


def run_family(family: str, world_sizes=(1, 2), *, rank_timeout: float = 90.0) -> dict:
    """The sweep of one family in this process (world size 2 spawns two gloo ranks). Returns
    {family, outcomes: {"1": ..., "2": ...}, ws1_plain, ws1_vs_packed_eager, eager_isolates, info, seconds}."""
    import cp_attention  # noqa: F401 - registers cp_flash
    from cp_attention.tools.launch import run_ranks

    torch.set_num_threads(1)
    t0 = time.monotonic()
    res: dict = dict(family=family, outcomes={}, info={})

    def unbuildable(stage: str, exc: BaseException) -> dict:
        rec = dict(outcome="unbuildable", stage=stage, **_error(exc))
        res["outcomes"] = {str(ws): rec for ws in world_sizes}
        res["seconds"] = round(time.monotonic() - t0, 1)
        return res

    try:
        config = tiny_config(family)
    except Exception as exc:  # noqa: BLE001
        return unbuildable("config", exc)
    try:
        eager = build_model(config, "eager")
        fkw = forward_kwargs(eager)
        ids, pos = make_inputs()
        ref = ground_truth(eager, fkw, ids, pos)
    except Exception as exc:  # noqa: BLE001
        return unbuildable("eager docs-alone", exc)
    state_dict = {k: v.detach().clone() for k, v in eager.state_dict().items()}
    spans = hf_cases.param_spans(eager)
    res["info"] = dict(model_class=type(eager).__name__, accepts_position_ids=fkw["position_ids"],
                       params=sum(p.numel() for p in eager.parameters()),
                       layers=_layer_count(_text(config).to_dict())[1],
                       layer_kinds=_layer_kinds(_text(config)))
    R = ref["R"]
    try:
        packed_logits, packed_grads = run_packed(eager, fkw, ids, pos, R)
        iso = diffs(packed_logits, packed_grads, ref["logits"], ref["grads"], spans)
        res["eager_isolates"] = dict(isolates=within(iso), **iso)
    except Exception as exc:  # noqa: BLE001
        packed_logits = None
        res["eager_isolates"] = dict(isolates=None, **_error(exc))
    try:
        cp_model = build_model(config, "cp_flash", state_dict)
    except Exception as exc:  # noqa: BLE001
        rec = classify(exc=exc)
        rec["stage"] = "cp_flash model build"
        res["outcomes"] = {str(ws): rec for ws in world_sizes}
        res["seconds"] = round(time.monotonic() - t0, 1)
        return res
    if 1 in world_sizes:
        res["outcomes"]["1"] = _compare_or_error(lambda: run_context(cp_model, fkw, ids, pos, R),
                                                 ref["logits"], ref["grads"], spans)
        res["ws1_plain"] = _compare_or_error(lambda: run_packed(cp_model, fkw, ids, pos, R),
                                             ref["logits"], ref["grads"], spans)
        if packed_logits is not None:
            res["ws1_vs_packed_eager"] = _compare_or_error(lambda: run_packed(cp_model, fkw, ids, pos, R),
                                                           packed_logits, packed_grads, spans)
    for ws in world_sizes:
        if ws == 1:
            continue
        try:
            per_rank = run_ranks(ws, _rank_worker, family, state_dict, ids, pos, R, timeout=rank_timeout)
        except Exception as exc:  # noqa: BLE001 - a rank died or hung
            text = str(exc)
            rec = dict(outcome="timeout" if "did not finish" in text else "crash", error_type=type(exc).__name__,
                       message=text.strip().splitlines()[0][:300])
        else:
            rec = _pick_rank_error(per_rank)
            if rec is None:
                got = torch.load(io.BytesIO(per_rank[0]["payload"]))
                rec = classify(diffs(got["logits"], got["grads"], ref["logits"], ref["grads"], spans))
        res["outcomes"][str(ws)] = rec
    res["seconds"] = round(time.monotonic() - t0, 1)
    return res


def _text(config):
    return getattr(config, "text_config", None) or config


def _layer_kinds(config) -> dict:
    d = config.to_dict()
    _, n = _layer_count(d)
    kinds = {}
    for key, value in d.items():
        if n and (_is_per_layer(value, n) or _is_pattern_string(key, value, n)):
            kinds[key] = [str(v) for v in value]
    return kinds


# --------------------------------------------------------------------------------------------------
# CLI: one subprocess per family
# --------------------------------------------------------------------------------------------------

def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items() if k != "exc"}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return "nan"
    if isinstance(obj, float) and obj in (float("inf"), float("-inf")):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _run_one_subprocess(family: str, world: str, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile(prefix=f"sweep_{family}_", suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", family, "--world", world, "--json", path]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the family's process group: itself and its ranks
        proc.communicate()
        rec = dict(outcome="timeout", message=f"no result within {timeout:.0f}s")
        return dict(family=family, outcomes={w: rec for w in world.split(",")}, seconds=round(timeout, 1))
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        tail = out.decode(errors="replace").strip().splitlines()[-3:]
        rec = dict(outcome="crash", error_type=f"process exit {proc.returncode}", message=" | ".join(tail)[:300])
        return dict(family=family, outcomes={w: rec for w in world.split(",")},
                    seconds=round(time.monotonic() - t0, 1))
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def _reason(rec: dict) -> str:
    if rec.get("outcome") in ("exact", "wrong"):
        s = f"logit {rec['logit_err']:.1e}, grad {rec['grad_err']:.1e} (rel {rec.get('grad_rel', 0):.1e})"
        if rec.get("outcome") == "wrong" and rec.get("worst_param"):
            s += f" worst {rec['worst_param']}"
        if not rec.get("finite", True):
            s += " NON-FINITE"
        return s
    return f"{rec.get('error_type', '')}: {rec.get('message', '')}".strip(": ")


def summary_markdown(results: list[dict]) -> str:
    counts: dict = {}
    for r in results:
        for ws, rec in r["outcomes"].items():
            counts.setdefault(ws, {}).setdefault(rec["outcome"], 0)
            counts[ws][rec["outcome"]] += 1
    lines = ["# cp_flash family sweep", "", f"docs {list(DOCS)} in one row; tolerances of hf_cases "
             f"(logits {hf_cases.TOL:g}, gradients max({hf_cases.TOL:g}, {hf_cases.GRAD_REL_TOL:g} x max|grad|))", ""]
    for ws in sorted(counts):
        lines.append(f"- world size {ws}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts[ws].items())))
    lines += ["", "| family | ws1 | ws2 | ws1 plain (no context) | eager isolates docs | cp_flash vs packed eager "
              "| reason / diffs |", "|---|---|---|---|---|---|---|"]
    for r in results:
        o = r["outcomes"]
        ws1, ws2 = o.get("1", {}), o.get("2", {})
        plain = r.get("ws1_plain", {}).get("outcome", "")
        iso = r.get("eager_isolates", {}).get("isolates", "")
        vs = r.get("ws1_vs_packed_eager", {}).get("outcome", "")
        reasons = []
        for tag, rec in (("ws1", ws1), ("ws2", ws2)):
            if rec and rec.get("outcome") != "exact":
                reasons.append(f"{tag}: {_reason(rec)}")
        if not reasons and ws1:
            reasons.append(_reason(ws1))
        text = "; ".join(reasons).replace("|", "/")
        lines.append(f"| {r['family']} | {ws1.get('outcome', '')} | {ws2.get('outcome', '')} | {plain} | {iso} | {vs} "
                     f"| {text} |")
    return "\n".join(lines) + "\n"


def ws1_as_eager(record: dict) -> bool:
    """The family's own eager lets packed documents see each other, and cp_flash at world size 1
    (no context) equals that eager exactly."""
    return (record.get("eager_isolates") or {}).get("isolates") is False and \
        (record.get("ws1_vs_packed_eager") or {}).get("outcome") == "exact"


def readme_table(results: list[dict]) -> str:
    """The README's support table: one row per family, its outcome at world size 1 and CP = 2 and
    why it is refused (the model check's findings, else the error's first line)."""
    counts: dict = {}
    rows = ["| family | world size 1 | CP = 2 | why (refusals) |", "|---|---|---|---|"]
    for r in results:
        cells, whys = [], []
        for ws in ("1", "2"):
            rec = r["outcomes"].get(ws, {})
            label = rec.get("outcome", "")
            if label == "wrong" and ws == "1" and ws1_as_eager(r):
                label = "as eager"
            counts.setdefault(ws, {}).setdefault(label, 0)
            counts[ws][label] += 1
            cells.append(label)
            if label not in ("exact", "as eager"):  # the model check's findings first, else the message
                whys.append((not rec.get("reasons"), "; ".join(rec.get("reasons") or [])
                             or str(rec.get("message") or "")[:100]))
        why = min(whys)[1] if whys else ""
        rows.append(f"| {r['family']} | {cells[0]} | {cells[1]} | {why.replace('|', '/')} |")
    summary = [f"- {'world size 1' if ws == '1' else 'CP = 2'}: " + ", ".join(
        f"{n} {label}" for label, n in sorted(counts[ws].items(), key=lambda kv: -kv[1])) for ws in sorted(counts)]
    return "\n".join(summary) + "\n\n" + "\n".join(rows) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="", help="comma-separated (default: all of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)")
    p.add_argument("--world", default="1,2", help="world sizes, comma-separated (1 and/or 2)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--md", default="", help="write the summary table here")
    p.add_argument("--readme", default="", help="write the README's support table here")
    p.add_argument("--jobs", type=int, default=2, help="families at a time (at most 2)")
    p.add_argument("--timeout", type=float, default=FAMILY_TIMEOUT, help="seconds per family")
    p.add_argument("--resume", action="store_true",
                   help="keep the families already in --json (but those that timed out), run the rest")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one family in this process
    args = p.parse_args(argv)
    world = tuple(int(w) for w in args.world.split(","))
    if args.one:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        try:
            res = run_family(args.one, world)
        except Exception as exc:  # noqa: BLE001 - recorded, never lost
            rec = dict(outcome="crash", **_error(exc), traceback=traceback.format_exc()[-2000:])
            res = dict(family=args.one, outcomes={str(w): rec for w in world})
        with open(args.json, "w") as f:
            json.dump(_jsonable(res), f, indent=1)
        return 0
    names = [f for f in args.families.split(",") if f] or families()
    jobs = max(1, min(2, args.jobs))
    results: dict = {}
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            results = {r["family"]: r for r in json.load(f)["results"] if r["family"] in names
                       and all(rec["outcome"] != "timeout" for rec in r["outcomes"].values())}
    todo = [n for n in names if n not in results]
    write_lock = threading.Lock()  # the two workers' threads write the same files
    t0 = time.monotonic()

    def one(name):
        r = _run_one_subprocess(name, ",".join(map(str, world)), args.timeout)
        results[name] = r
        outs = " ".join(f"ws{k}={v['outcome']}" for k, v in r["outcomes"].items())
        print(f"[{len(results)}/{len(names)} {time.monotonic() - t0:.0f}s] {name}: {outs} ({r.get('seconds', '?')}s)",
              flush=True)
        if args.json:  # written as it goes: a partial sweep is still a result
            with write_lock:
                _write(args, [results[n] for n in names if n in results])

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, todo))
    _write(args, [results[n] for n in names])
    return 0


def _write(args, ordered: list[dict]) -> None:
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(docs=list(DOCS), results=ordered), f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    if args.md:
        with open(args.md, "w") as f:
            f.write(summary_markdown(ordered))
    if args.readme:
        with open(args.readme, "w") as f:
            f.write(readme_table(ordered))


if __name__ == "__main__":
    sys.exit(main())
