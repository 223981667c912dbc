"""What a transformers model's configuration says about its attention layers: the one reading of a
config into per-layer masks (used by the ``cp_flash`` adapter, the balanced layout of
``cp.shard_batch(model=...)`` and the probe), the model's token weight, and a checksum of the
configuration that the ranks agree on.
"""

from __future__ import annotations

import json
import zlib

from . import state
from ...refusals import refuse
from ...masks import MaskSpec

__all__ = ["text_config", "layer_mask", "layer_masks", "model_masks", "attention_shapes", "config_crc", "is_model",
           "is_model_class", "text_configs", "text_modules", "family_of", "inner_model", "cp_flash_model",
           "unwrap_adapters"]

_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version")


def text_config(model_or_config):
    """The configuration of a model's text decoder (``text_config`` of a multimodal config)."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "text_config", None) or config


def layer_mask(config, layer_idx: int | None) -> MaskSpec:
    """The mask of layer ``layer_idx`` as the configuration declares it: ``layer_types``
    (``"sliding_attention"`` with ``sliding_window``, ``"chunked_attention"`` with
    ``attention_chunk_size``, anything else full) and ``is_causal`` (ModernBERT is bidirectional).
    A config without ``layer_types`` but with a ``sliding_window`` (Mistral, Phi-3) slides on every
    layer; without either, or for ``layer_idx`` None, a layer is full. A heterogeneous config
    (transformers' ``per_layer_config``: NeoMME) is read at the layer. ModernBERT's ``sliding_window``
    is a half-window (``local_attention / 2``: a key at that distance is seen), so its layers' window
    is one more, as they pass it."""
    modernbert = getattr(config, "model_type", "") == "modernbert"
    causal = bool(getattr(config, "is_causal", True)) and not modernbert
    types = getattr(config, "layer_types", None)
    if getattr(config, "is_heterogeneous", False):  # per-layer values (transformers' heterogeneous configs)
        config = config.per_layer_config[layer_idx] if layer_idx is not None else None
    window = getattr(config, "sliding_window", None)
    if types is None:
        kind = "sliding_attention" if layer_idx is not None else None
    else:
        kind = types[layer_idx] if layer_idx is not None and layer_idx < len(types) else None
    if kind == "sliding_attention" and window:
        return MaskSpec(causal=causal, window=int(window) + int(modernbert))
    if kind == "chunked_attention":
        return MaskSpec(causal=causal, chunk_size=int(config.attention_chunk_size))
    return MaskSpec(causal=causal)


def layer_masks(config) -> list[MaskSpec]:
    """:func:`layer_mask` of every decoder layer (``num_hidden_layers`` of them)."""
    config = text_config(config)
    return [layer_mask(config, i) for i in range(int(config.num_hidden_layers))]


_MIXER_LAYER_WORDS = ("linear", "conv", "mamba", "mlp", "moe", "recurrent", "ssm")


def _attention_layer(kind) -> bool:
    """Whether a ``layer_types`` / ``layers_block_type`` entry names a layer with attention (a hybrid's
    convolution, Mamba or linear-attention layers cost per token, like its MLPs)."""
    return not (isinstance(kind, str) and any(word in kind for word in _MIXER_LAYER_WORDS))


def model_masks(model) -> tuple[list[dict], float]:
    """A transformers model's attention layers as ``balanced_layout`` masks (one dict per layer:
    sliding windows, Llama 4 chunks, bidirectional layers; a hybrid's convolution, Mamba and
    linear-attention layers are not attention) and its token weight: the dense compute per token
    (2 x the parameters outside the embeddings, which include those mixers' projections) in units of
    one visible pair of one layer (4 x heads x head_dim flops: the scores and the weighted values). A model
    without attention (no ``num_attention_heads``) has no masks and a token weight of 1."""
    config = text_config(model)
    if getattr(config, "num_attention_heads", None) is None:  # sequence mixers alone (Mamba, RWKV, xLSTM)
        return [], 1.0  # every layer costs per token: the balanced layout spreads the tokens evenly
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    masks = [{name: value for name, value in (("causal", m.causal), ("window", m.window),
                                               ("chunk_size", m.chunk_size)) if value is not None}
             for i, m in enumerate(layer_masks(config))
             if kinds is None or i >= len(kinds) or _attention_layer(kinds[i])]
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    token_weight = 0.0
    if hasattr(model, "named_parameters"):
        dense = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name)
        token_weight = 2.0 * dense / (4.0 * heads * head_dim)
    return masks, token_weight


def attention_shapes(model) -> dict:
    """The shapes of a transformers model's attention calls as ``cp_flash`` receives them, from its
    configuration: ``heads`` (``num_attention_heads``), ``kv_heads`` (``num_key_value_heads``, else the
    heads), ``head_dim`` of q and k (``head_dim``, else ``hidden_size / heads``; multi-head latent
    attention: ``qk_nope_head_dim + qk_rope_head_dim``), ``head_dim_v`` (``v_head_dim``, else
    ``head_dim``) and ``dtype``, its first floating parameter's (the config's ``dtype`` without any).
    What :meth:`ContextParallel.prepare <cp_attention.ContextParallel.prepare>` plans for."""
    config = text_config(model)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if nope and rope:  # multi-head latent attention (DeepSeek-V2/V3, ...)
        head_dim = int(nope) + int(rope)
    head_dim_v = int(getattr(config, "v_head_dim", None) or head_dim)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None) \
        if hasattr(model, "parameters") else None
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype)


def config_crc(module) -> int:
    """A 31-bit checksum of the configuration of ``module``'s model (every field but its path and
    transformers version), agreed by the ranks on a batch's first call: two ranks whose models
    differ (a window, the layer types) then raise together instead of one of them waiting for an
    agreement the others skip. -1 when the module has no config. Computed once per config object
    (:data:`cp_attention.integrations.hf.state.CONFIG_CHECKSUMS`)."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return -1
    with state.CONFIG_LOCK:
        crc = state.CONFIG_CHECKSUMS.get(config)
    if crc is not None:
        return crc
    fields = {key: value for key, value in config.to_dict().items() if key not in _VOLATILE_CONFIG_KEYS}
    crc = zlib.crc32(json.dumps(fields, sort_keys=True, default=str).encode()) & 0x7FFFFFFF
    with state.CONFIG_LOCK:
        state.CONFIG_CHECKSUMS[config] = crc
    return crc


def is_model_class(cls: type) -> bool:
    return getattr(cls, "base_model_prefix", None) is not None


def is_model(module) -> bool:
    """A transformers PreTrainedModel (its class says so: wrappers such as torch.compile's forward
    attribute lookups to the model they wrap, and are not one)."""
    return is_model_class(type(module))


def text_configs(model) -> tuple:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) if config is not None else None
    return tuple(c for c in (config, text) if c is not None)


def text_modules(model):
    """``model``'s modules over the text sequence: sub-models with a configuration of their own
    (vision or audio towers) are skipped."""
    own = {id(c) for c in text_configs(model)}

    def walk(module, prefix):
        yield prefix, module
        for name, child in module.named_children():
            config = getattr(child, "config", None)
            if config is not None and hasattr(config, "to_dict") and id(config) not in own \
                    and is_model(child) and id(getattr(config, "text_config", None)) not in own:
                continue
            yield from walk(child, f"{prefix}.{name}" if prefix else name)

    yield from walk(model, "")


def family_of(model) -> str:
    configs = text_configs(model)
    return next((getattr(c, "model_type", "") for c in configs if getattr(c, "model_type", "")), type(model).__name__)


def inner_model(module):
    """The transformers model a call of ``module`` runs: itself, or the one inside a PEFT wrapper
    (whose forward calls the model's ``forward`` directly, past its hooks)."""
    if not is_model(module) and callable(getattr(module, "get_base_model", None)) and \
            getattr(module, "active_peft_config", None) is not None:
        return module.get_base_model()
    return module


def cp_flash_model(module) -> bool:
    """Whether ``module`` is a transformers model whose text configuration selects "cp_flash"."""
    if not is_model(module):
        return False
    return any(getattr(c, "_attn_implementation", None) == "cp_flash" for c in text_configs(module))


def unwrap_adapters(model):
    """The transformers model inside a PEFT wrapper (``PeftModel``: its forward hands the batch to the
    base model unchanged for the weight adapters, LoRA, DoRA, IA3, ...), or ``model`` itself. Prompt
    learning (prompt, prefix and p-tuning) raises NotImplementedError naming the PEFT type: its virtual
    tokens would be prepended to each rank's shard instead of to the sequence."""
    config = getattr(model, "active_peft_config", None)
    get_base = getattr(model, "get_base_model", None)
    if config is None or not callable(get_base):
        return model
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(getattr(config, "peft_type", None), "value", None) or type(config).__name__
        raise refuse("peft_prompt_learning", kind=kind, tokens=getattr(config, "num_virtual_tokens", "its"))
    return get_base()
