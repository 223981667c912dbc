"""Tiny configs and models of image-text-to-text families, for the vision-language sweep (:mod:`.vlm`).

A family's tiny config is its defaults shrunk by the rules of :mod:`.configs` and by the vision rules
here (:func:`shrink_vision`: SIDE x SIDE images, widths at the text width, tiny VQ tokenizers, token ids
renumbered into the vocabulary), the rope and window sized, then the overrides of :mod:`.configs` and
:data:`OVERRIDES` where the rules cannot know a constraint.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from types import MappingProxyType

import torch

from . import configs

__all__ = ["SEED", "KINDS", "WORLDS", "SLOTS", "SIDE", "HIDDEN", "ID_KEY_RE", "IMAGE_KEYS", "CODES", "CODE_BASE",
           "OVERRIDES", "families", "model_class_name", "shrink_vision", "config_ids", "tiny_config", "build_model"]

SEED = 0
KINDS, WORLDS = ("text", "image"), ("1", "2")
SLOTS = tuple(f"{kind}/{ws}" for kind in KINDS for ws in WORLDS)  # the four outcomes of a family
SIDE = 8  # an image is SIDE x SIDE patches
HIDDEN = configs.HIDDEN


def families() -> list[str]:
    """Every key of transformers' MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES (the installed version)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def model_class_name(family: str) -> str:
    """The class MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES names for ``family``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[family]


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None


# ---- the tiny config: the rules of configs, the vision rules, overrides ----

WIDE_HIDDEN_RE = re.compile(r"(projector|projection|proj|alignment|adapter|merger|mlp)_(hidden|intermediate)_size$")
ADAPTER_IN_RE = re.compile(r"((adapter|projector|merger)_(in_dim|out_dim|input_size)|projection_dim|token_embed_dim|"
                           r"mm_embed_dim|output_proj_dims)$")  # widths that must equal a tower's (or the text's)
ID_KEY_RE = re.compile(r"(_id|_index|_ids)$")
IMAGE_KEYS = ("image_token_id", "image_token_index")
CODES, CODE_BASE = 16, configs.ID_RANGE[1]  # a tiny VQ image tokenizer's codebook; its codes are the ids from CODE_BASE
VQ_TOKENIZER = MappingProxyType(dict(base_channels=32, channel_multiplier=[1, 1, 1], num_res_blocks=1, resolution=16))


def shrink_vision(d: dict, vocab: int, taken: set[int]) -> dict:
    """The rules :mod:`.configs` lacks, on a shrunk config dict and its sub-configs: SIDE x SIDE images, widths at
    the text width, VQ tokenizers tiny, ids beyond the vocabulary (or None) renumbered (``taken``: in use)."""
    def ints(v) -> bool:
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)

    def free_id() -> int:
        i = max(set(range(vocab)) - taken)
        taken.add(i)
        return i

    out, patch = dict(d), d.get("patch_size")
    patch = patch if (ints(patch) and len(patch) == 2) or (isinstance(patch, int) and patch > 0) else None
    for key, value in d.items():
        if isinstance(value, dict) and (str(key).endswith("_config") or key in ("sam", "encoder", "decoder")):
            out[key] = shrink_vision(value, vocab, taken)
        elif isinstance(value, bool):
            continue
        elif key == "mm_tokens_per_image" and isinstance(value, int):
            out[key] = (SIDE // 2) ** 2  # pooled 2 x 2
        elif key == "image_size" and patch is not None and isinstance(value, (int, list, tuple)):
            out[key] = patch * SIDE if isinstance(patch, int) and isinstance(value, int) else \
                [x * SIDE for x in (patch if isinstance(patch, list) else (patch, patch))]
        elif isinstance(value, int) and WIDE_HIDDEN_RE.search(key) and value > 2 * HIDDEN:
            out[key] = 2 * HIDDEN
        elif isinstance(value, int) and (key.endswith("hidden_size") or ADAPTER_IN_RE.search(key)) and value > HIDDEN:
            out[key] = HIDDEN
        elif key in ("hidden_sizes", "depths") and ints(value):
            out[key] = [32 if key == "hidden_sizes" else 1] * len(value)  # a staged (conv) tower
        elif key == "downsample_channels" and isinstance(value, list):  # SAM's neck, into the next tower
            out[key] = [HIDDEN] * len(value)
        elif (key in IMAGE_KEYS and value is None) or (isinstance(value, int) and ID_KEY_RE.search(key)
                                                       and value >= vocab):
            out[key] = free_id()  # None: left for the checkpoint's tokenizer to fill
        elif ints(value) and ID_KEY_RE.search(str(key)) and value and max(value) >= vocab:
            out[key] = [free_id() for _ in value]
    if isinstance(d.get("base_channels"), int) and isinstance(d.get("channel_multiplier"), list):  # a VQ tokenizer
        tiny = dict(num_embeddings=CODES, codebook_size=CODES, hidden_size=32 * VQ_TOKENIZER["channel_multiplier"][-1],
                    spatial_scale_factor=2 ** (len(VQ_TOKENIZER["channel_multiplier"]) - 1))  # widths that match
        out.update(VQ_TOKENIZER, **{k: v for k, v in tiny.items() if isinstance(d.get(k), int)})
        out.update({k: 32 for k in ("embed_dim", "latent_channels") if isinstance(d.get(k), int) and d[k] > 32})
    return out


def config_ids(d: dict) -> set[int]:
    """Every token id a config dict (and its sub-configs) names."""
    ids: set[int] = set()
    for key, value in d.items():
        if isinstance(value, dict):
            ids |= config_ids(value)
        elif ID_KEY_RE.search(str(key)):
            ids |= {x for x in (value if isinstance(value, (list, tuple)) else [value])
                    if isinstance(x, int) and not isinstance(x, bool)}
    return ids


def _text(kwargs: dict) -> dict:
    return kwargs["text_config"] if isinstance(kwargs.get("text_config"), dict) else kwargs


def _sub(name: str, **values):
    """An override setting ``values`` in the sub-config ``name`` ("" for the top level)."""
    return lambda kwargs: (kwargs[name] if name else kwargs).update(values)


def _default_vision(family: str):
    """An override giving ``family`` the shrunk defaults of its optional vision config, pooling 2 x 2."""
    def apply(kwargs):
        spec = _config_class(family).sub_configs_defaults["vision_config"]
        d = shrink_vision(configs.shrink(_config_class(spec.model_type)().to_dict(), text=False), configs.VOCAB,
                          set())
        kwargs["vision_config"] = dict(d, pooling_kernel_size=2)
    return apply


def _vq_vocabulary(kwargs, name, **extra):
    """The vocabulary map a VQ family's checkpoint brings: ``<image>``, CODES codes ``name(i)`` from CODE_BASE."""
    kwargs["image_token_id"] = configs.VOCAB - 1
    kwargs["vocabulary_map"] = {"<image>": configs.VOCAB - 1, **extra, **{name(i): CODE_BASE + i for i in range(CODES)}}


_PINPOINTS = ("any-resolution grids for the real image size: one grid of the tiny image size",
              lambda kw: kw.update(image_grid_pinpoints=[[kw["vision_config"]["image_size"]] * 2]))
_MUSE = ("its adapter takes the merged vision width (vision hidden x merge^2)",
         _sub("", out_hidden_size=4 * HIDDEN, projector_hidden_size=HIDDEN))
_VQ, _NO_VISION = ("its image codes are text ids named by a vocabulary map the checkpoint brings",
                   "its defaults have no vision config; the tiny one pools 2 x 2")
OVERRIDES: Mapping[str, tuple[str, object]] = MappingProxyType({  # {family: (reason, function(kwargs) editing them)}, after the rules
    "apertus1p5": ("its image codes are the text ids from image_token_offset; its audio tokenizer has "
                   "codebook_dim = hidden_size", lambda kw: (
                       kw["audio_config"].update(codebook_size=8, codebook_dim=HIDDEN, num_filters=8),
                       kw.update(image_token_offset=CODE_BASE, audio_token_offset=CODE_BASE + CODES))),
    "aria": ("its projector maps patch counts of the real image sizes to query counts",
             _sub("", projector_patch_to_query_dict={SIDE * SIDE: 16})),
    "chameleon": (_VQ, lambda kw: _vq_vocabulary(
        kw, lambda i: "IMGIMG" + "".join(chr(ord("A") + int(c)) for c in str(i)) + "Z")),
    "glm5_next": ("its indexer keeps index_topk // index_kpool pools of keys: index_topk (8 here) must be a multiple "
                  "of index_kpool (default 16)", lambda kw: _text(kw).update(index_kpool=4)),
    "deepseek_ocr2": ("mlp_layer_types defaults to None, which the text model indexes", lambda kw: _text(kw).update(
        mlp_layer_types=["dense"] + ["sparse"] * (_text(kw)["num_hidden_layers"] - 1))),
    "diffusion_gemma": ("its MoE fields default to None; a canvas of the real length", lambda kw: (
        _text(kw).update(num_experts=4, top_k_experts=2, moe_intermediate_size=32), kw.update(canvas_length=8))),
    "emu3": (_VQ, lambda kw: _vq_vocabulary(kw, lambda i: f"<|visual token {i:06d}|>", **{"<|extra_200|>": 126})),
    "ernie4_5_vl_moe": ("its rotary pre-rotation pairs the height and width sections: they must be equal",
                        lambda kw: _text(kw)["rope_parameters"].update(mrope_section=[3, 3, 2])),
    "gemma4": (_NO_VISION, _default_vision("gemma4")),
    "gemma4_unified": (_NO_VISION, _default_vision("gemma4_unified")),
    "granite4_vision": ("its projector and deepstack layer maps are left to the checkpoint; one any-resolution grid",
                        lambda kw: (_PINPOINTS[1](kw), kw.update(
                            downsample_rate="2/4", deepstack_layer_map=[[-1, 0]], spatial_target_layers=[0, 1, 0, 1]))),
    "kimi_k25": ("its projector normalizes merged patches at the vision width",
                 _sub("", projection_hidden_size=HIDDEN)),
    "kosmos-2": ("an image takes latent_query_num (64) positions", _sub("", latent_query_num=16)),
    "kosmos-2.5": ("an image takes latent_query_num (2048) positions", _sub("", latent_query_num=16)),
    "llava_next": _PINPOINTS, "llava_next_video": _PINPOINTS, "llava_onevision": _PINPOINTS,
    "mistral4": ("its rope covers half of head_dim: head_dim = 2 x qk_rope_head_dim",
                 _sub("", head_dim=2 * configs.FIXED["qk_rope_head_dim"])),
    "mllama": ("its vision output concatenates the last and the intermediate layers' states", lambda kw: kw[
        "vision_config"].update(num_global_layers=1, vision_output_dim=HIDDEN * (
            1 + len(kw["vision_config"]["intermediate_layers_indices"])))),
    "molmo2": ("its adapter reads vision layers 24 and 18", _sub("adapter_config", vision_feature_layer=[-1, -2])),
    "muse_glimmer": _MUSE, "muse_spark": _MUSE,
    "paddleocr_vl": ("mrope_section is left to the modeling code's default (sized for the real head dim)",
                     lambda kw: _text(kw)["rope_parameters"].update(mrope_section=[2, 3, 3])),
    "pix2struct": ("its attention width is heads x d_kv, not the hidden size", lambda kw: (
        kw["vision_config"].update(d_kv=configs.HEAD_DIM), kw["text_config"].update(d_kv=configs.HEAD_DIM))),
    "step3p7": ("it builds a sliding-window mask without sliding layers: sliding_window must be set",
                _sub("text_config", sliding_window=configs.WINDOW)),
    "vipllava": ("it reads five vision layers by index", _sub("", vision_feature_layers=[-1, -2, -3, -1, -2])),
    "vision-encoder-decoder": ("its text decoder cross-attends to the image (family_sweep's rules turn that off)",
                               _sub("decoder", add_cross_attention=True, is_decoder=True)),
})


def _mrope(text: dict) -> None:
    """An M-RoPE (or MLA) text config gets an ``mrope_section`` summing to the tiny rotary dim / 2."""
    rope, mla = text.get("rope_parameters"), isinstance(text.get("qk_rope_head_dim"), int)
    cls = _config_class(text.get("model_type"))
    if cls is None or "mrope_section" not in getattr(cls, "ignore_keys_at_rope_validation", ()) or \
            not isinstance(rope, dict) or ("mrope_section" in rope and not mla):
        return
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rotary = text["qk_rope_head_dim"] if mla else \
        int(head_dim * (text.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0))
    text["rope_parameters"] = dict(rope, mrope_section=configs.scale_section(rope.get("mrope_section", [2, 3, 3]),
                                                                             rotary // 2))


def tiny_config(family: str):
    """The tiny config of ``family``: its defaults shrunk by ``configs.shrink`` and :func:`shrink_vision`, the
    rope and window sized, the overrides of :mod:`.configs` and then :data:`OVERRIDES`. Raises whatever the
    config class raises."""
    cls = _config_class(family)
    kwargs = configs.drop_derived(cls, configs.shrink(cls().to_dict()))
    kwargs.update({k: configs.shrink(v) for k, v in kwargs.items()
                   if k in ("encoder", "decoder") and isinstance(v, dict)})
    top = {k: v for k, v in kwargs.items() if ID_KEY_RE.search(str(k)) and isinstance(v, int)}

    def align(d: dict) -> None:  # a sub-config's token id named like a top-level one is that token
        for value in (v for v in d.values() if isinstance(v, dict)):
            value.update({k: top[k] for k, v in value.items() if k in top and isinstance(v, int)})
            align(value)

    align(kwargs)
    kwargs = shrink_vision(kwargs, configs.VOCAB, config_ids(kwargs))
    text = _text(kwargs)
    _mrope(text)
    if "sliding_attention" in (text.get("layer_types") or ()) and text.get("sliding_window") is None:
        text["sliding_window"] = configs.WINDOW  # left unset in the defaults, read by the sliding layers
    for fix in [configs.OVERRIDES.get(n) for n in {family, text.get("model_type")}] + [OVERRIDES.get(family)]:
        if fix is not None:
            fix[1](kwargs)
    return cls(**kwargs)


# ---- models and batches ----

def build_model(family: str, config, attn_implementation: str, state_dict: dict | None = None):
    """The family's model of ``config``, float32, training mode, dropouts at 0: weights from SEED or ``state_dict``."""
    torch.manual_seed(SEED)
    import transformers

    model = getattr(transformers, model_class_name(family))._from_config(
        copy.deepcopy(config), dtype=torch.float32, attn_implementation=attn_implementation)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    for module in (m for m in model.modules() if isinstance(m, torch.nn.Dropout)):
        module.p = 0.0
    return model.train()
