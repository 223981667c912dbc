"""cp_flash's attention function: one transformers attention call -> one :class:`~cp_attention.masks.MaskSpec`
and the engine's layer entry (:func:`cp_attention.engine.attend_layer`).

It translates only: the call's keyword arguments into a MaskSpec (causal, window, chunks, softcap, scale,
sinks), the tensor transposes, the documents of the mask or the call, a family's query adjustment (Llama 4's
temperature), what the adapters recorded for the call (:meth:`.adapters.base.Adapter.layer_call`), and the
refusals of what it cannot apply (a dense mask, a score bias, a selection it did not make). Under the guard's
trace it refuses the same and otherwise answers per token; in a decode step of generate it attends over the
sharded cache.

Legend: ``B`` batch, ``L``/``Lq`` query tokens, ``Lk`` key tokens, ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from .adapters import ADAPTERS
from .adapters.base import LayerCall
from .forward import guard_position_start, guard_sub_model, note_cp_flash_call
from .generation import decode_attention, running_decode
from .masks import CPMask
from .models import config_crc, layer_mask, text_config
from .positions import layer_position_ids
from .selection import global_selection
from .token_trace import stand_in_attention, tracing
from ...engine.layer import LayerDocs, attend_layer
from ...masks import MaskSpec
from ...refusals import refuse

__all__ = ["cp_flash_attention", "layer_mask_spec"]


def layer_mask_spec(module, *, sliding_window=None, softcap=None, scaling=None, is_causal=None,
                    mask_window: int | None = None, mask_causal=None, mask_spans=None) -> MaskSpec:
    """The MaskSpec of one transformers attention layer: causal from the call or ``module.is_causal``
    (a layer declared bidirectional is causal when its mask is: ``mask_causal``, a callable,
    :meth:`CPMask.sees_no_later_key`), chunks from the configuration (:func:`~.models.layer_mask`),
    the window the layer passes, else the one its causal mask applies (``mask_window``:
    :attr:`CPMask.local_size`; not on chunked layers, whose builder reports the chunk there), and
    whether a causal layer's mask opens bidirectional spans (``mask_spans(window)``, a callable:
    :meth:`CPMask.opens_spans`)."""
    config = getattr(module, "config", None)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal and mask_causal is not None and mask_causal():
        causal = True  # eager follows the mask, not the flag
    chunk = None if config is None else layer_mask(text_config(config), getattr(module, "layer_idx", None)).chunk_size
    window = int(sliding_window) if sliding_window is not None else None
    if window is None and mask_window is not None and chunk is None and causal:
        # transformers' causal sliding mask keeps 0 <= q - k < local_size: the MaskSpec window's meaning
        # (its bidirectional builder counts local_size differently; those layers pass their window)
        window = int(mask_window)
    spans = bool(causal) and chunk is None and mask_spans is not None and mask_spans(window)
    return MaskSpec(causal=bool(causal), window=window, chunk_size=chunk,
                    softcap=float(softcap) if softcap is not None else None,
                    scale=float(scaling) if scaling is not None else None, spans=spans)


def _llama4_temperature(positions: torch.Tensor, module) -> torch.Tensor:
    """Llama 4's NoPE attention temperature for absolute positions (its own formula)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def _llama4_adjust(module):
    """Llama 4 scales NoPE-layer queries by a temperature of ``arange(local length)``; on a shard the
    true positions are global: the engine calls the returned function with them, which rescales by
    temperature(global) / temperature(local) (1 wherever the temperature does not change, i.e. below
    ``floor_scale``). None for every other layer."""
    if not (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)):
        return None

    def adjust(q_BLHD: torch.Tensor, positions_L: torch.Tensor) -> torch.Tensor:
        L = q_BLHD.shape[1]
        ratio = _llama4_temperature(positions_L, module) / _llama4_temperature(torch.arange(L), module)
        if bool((ratio == 1).all()):
            return q_BLHD
        return (q_BLHD * ratio.to(q_BLHD.device, torch.float32).view(1, L, 1, 1)).to(q_BLHD.dtype)

    return adjust


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, q, k and v in the autocast dtype (as sdpa computes them): a float32 model under
    bf16 autocast hands over float32 queries and keys (RoPE upcasts) but bfloat16 values."""
    dtypes = {t.dtype for t in tensors}
    device = tensors[0].device.type
    if len(dtypes) == 1 or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


SELECTION_ARGUMENT = re.compile(r"(^|_)indices$")
"""Keyword names of a selection of keys per query (DSA's ``indices``, MiniMax-M3's ``block_indices``)."""


SCORE_ARGUMENTS = frozenset({"sinks", "position_bias", "alibi", "attention_bias", "attn_bias", "score_bias"})
"""Keyword names of a tensor added to the scores whatever its shape (Inkling2's per-query ``sinks`` (B, H, Lq, 1);
cp_flash's own sinks are the ``s_aux`` parameter)."""


def _refuse_score_tensors(kwargs: dict, q_length: int, kv_length: int, info) -> None:
    """A keyword tensor over (query, key) pairs, ``(..., Lq, Lk)`` with at least 3 dims, is a score
    bias or a dense mask (Inkling's relative-position ``position_bias``), and one named ``indices``
    or ``*_indices`` is a sparse-attention indexer's selection of keys: cp_flash cannot apply either,
    so the layer raises instead of dropping it."""
    for name, value in kwargs.items():
        if not isinstance(value, torch.Tensor):
            continue
        family = (info.family if info is not None else "") or "this model"
        if name == "indices" and global_selection(value):  # an adapted DSA indexer's choice: read as key_select
            continue
        if SELECTION_ARGUMENT.search(name):  # DSA's indices=, MiniMax-M3's block_indices=: keys chosen per query
            raise refuse("selected_keys_argument", family=family, name=name, shape=tuple(value.shape))
        if name in SCORE_ARGUMENTS or (value.dim() >= 3 and tuple(value.shape[-2:]) == (q_length, kv_length)):
            raise refuse("score_tensor_argument", family=family, name=name, shape=tuple(value.shape))


def cp_flash_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                       dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                       softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """The attention function registered for "cp_flash".

    query (B, H, Lq, D), key/value (B, H_kv, Lk, D) (GQA not repeated) -> ((B, Lq, H, D), None).
    """
    if tracing():  # the model check's trace: what cp_flash refuses in the call, else it answers per token
        if isinstance(attention_mask, torch.Tensor):
            raise refuse("dense_mask", shape=tuple(attention_mask.shape),
                         family=str(getattr(getattr(module, "config", None), "model_type", "") or "this model"))
        _refuse_score_tensors(kwargs, query.shape[2], key.shape[2],
                              attention_mask if isinstance(attention_mask, CPMask) else None)
        return stand_in_attention(query, key, value), None
    if dropout and getattr(module, "training", False):
        raise refuse("attention_dropout", dropout=dropout)
    decoding = running_decode()
    if decoding is not None:  # a decode step over the KV cache sharded by .generation
        spec = layer_mask_spec(module, sliding_window=sliding_window, softcap=softcap, scaling=scaling)
        return decode_attention(decoding, spec, *_autocast(query, key, value), s_aux, cached=key), None
    if isinstance(attention_mask, torch.Tensor):
        family = str(getattr(getattr(module, "config", None), "model_type", "") or "this model")
        raise refuse("dense_mask", shape=tuple(attention_mask.shape), family=family)
    info = attention_mask if isinstance(attention_mask, CPMask) else None
    tower = guard_sub_model(module)
    if tower is not None:
        raise refuse("sub_model_attention", tower=tower)
    note_cp_flash_call(module)
    if info is not None and not getattr(info.batch, "positions_given", True) and guard_position_start():
        raise refuse("position_start", family=info.family or "this model", start=guard_position_start())
    query, key, value = _autocast(query, key, value)
    _refuse_score_tensors(kwargs, query.shape[2], key.shape[2], info)
    spec = layer_mask_spec(module, sliding_window=sliding_window, softcap=softcap, scaling=scaling,
                           is_causal=kwargs.get("is_causal"), mask_window=info.local_size if info is not None else None,
                           mask_causal=info.sees_no_later_key if info is not None else None,
                           mask_spans=info.opens_spans if info is not None else None)
    if info is not None and spec.window is not None and spec.chunk_size is None:
        info.check_window(spec.window)
    collator = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
    position_ids = layer_position_ids(module, kwargs.get("position_ids"), collator)
    if info is None:
        docs = LayerDocs(cu_seqlens=kwargs.get("cu_seq_lens_q"), collator_documents=collator)
    else:
        docs = LayerDocs(mask=True, batch=info.batch, q_offset=info.q_offset,
                         kv_offset=info.kv_offset, kv_length=info.kv_length, valid=info.valid, opens=info.opens,
                         cu_seqlens=kwargs.get("cu_seq_lens_q"), collator_documents=collator,
                         span_next=info.span_next if spec.spans else None)
    call = LayerCall(module, key, value, kwargs)
    for adapter in ADAPTERS:  # what the layer's adapted parts recorded for this call (DeepSeek-V4's entries)
        adapter.layer_call(call)
    key, value, extra_kv, latent = call.key, call.value, call.extra_kv, call.latent
    key_select = kwargs.get("indices")  # DeepSeek Sparse Attention: the keys each query selected (.indexers)
    if info is not None and info.key_select is not None:  # Qwen4's block indexer: carried by the mask
        key_select = info.key_select
    if key_select is not None:
        if spec.spans and info is not None and info.span_next is not None and bool(info.span_next.any()):
            raise refuse("selection_with_spans", family=info.family or "this model")
        # spans=True without any span: a compiled one-device mask that may open some (the probe is a tensor)
        spec = dataclasses.replace(spec, selection=True, spans=False)
    out = attend_layer(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), spec,
                       position_ids=position_ids, docs=docs, sinks=s_aux,
                       layer=getattr(module, "layer_idx", None), model_crc=lambda: config_crc(module),
                       adjust_q=_llama4_adjust(module), key_select=key_select, extra_kv=extra_kv,
                       latent=latent)
    return out, None
