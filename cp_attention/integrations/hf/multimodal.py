"""Vision-language models under context parallelism: shard after the model's own multimodal front-end.

A vision-language model turns its images (``pixel_values``, ``image_grid_thw``, ...) into features
with a vision tower, merges them into the text embeddings at the image tokens, and may compute more
inputs for its text decoder from the whole batch: Qwen-VL's 3-D M-RoPE ``position_ids`` (rows of
temporal, height and width positions), Qwen3-VL's deepstack features added at the image tokens of
early layers (``visual_pos_masks``, ``deepstack_visual_embeds``), Gemma 4's per-layer inputs. None of
that can be computed from one shard: an image's tokens may sit on several ranks, positions count
over the whole sequence.

``cp.shard_batch(**processor_output, model=model)`` therefore runs the model's *own* forward on the
full batch, on every rank alike and outside the context (the vision tower attends on one device over
its own tokens), up to the call of its text decoder (``model.get_decoder()``), where a pre-hook takes
the decoder's keyword arguments and stops the forward (:func:`decoder_inputs`). They are sharded along
the sequence (:func:`shard_decoder_inputs`): ``(B, L, ...)`` tensors along dim 1, ``(k, B, L)``
position rows along dim 2, per-image-token rows (deepstack) by the image tokens each rank holds. The
model then runs on ``inputs_embeds`` (no ``pixel_values``), and a pre-hook on its decoder
(:func:`install_injection`) hands the decoder exactly the sharded arguments the full batch gave it:
the decoder computes on each rank what it computes on one device. Gradients flow back through the
sharded embeddings into the vision tower, which every rank ran on the whole batch: each rank's
vision-tower gradient is its tokens' share, so their mean over the group (DDP, FSDP2) is the
single-device gradient, as for every other parameter.

Legend: ``B`` rows, ``L`` global tokens, ``N`` image tokens of the batch, ``D`` hidden size.
"""

from __future__ import annotations

import inspect
import re

import torch

from ...engine.batch import batch_of
from ...engine.context import outside_context
from ...refusals import refuse
from ..patches import record
from ...torch_compat import WeakIdKeyDictionary

__all__ = ["refuse_media", "media_inputs", "outer_inputs", "decoder_inputs", "shard_decoder_inputs", "install_injection", "NOT_INJECTED"]

NOT_INJECTED = frozenset({"attention_mask", "cache", "past_key_values", "use_cache", "return_dict",
                          "output_attentions", "output_hidden_states", "cache_position", "labels"})
"""Decoder arguments the local forward builds itself (masks from the shard's own tensors, through
cp_flash's mask function) or that are not along the sequence."""

_INJECTED = WeakIdKeyDictionary()  # text decoder -> True: its injection hook is registered (weak: dies with it)


class _Captured(Exception):
    """Raised by the capture hook to stop the full-batch forward at the text decoder."""


def _accepted(model) -> set[str] | None:
    """The names ``model.forward`` takes as named parameters (not what a ``**kwargs`` would swallow)."""
    params = inspect.signature(model.forward).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names


MEDIA_NAME = re.compile(r"^(pixel_|image_|video_|audio_|input_features)|_grid_thw$|_sizes$")
"""Names of multimodal inputs, taken as media whatever their shape (a (num_images, patches, dim)
``pixel_values`` may happen to have the batch's (B, L) leading dims)."""


def refuse_media(model, kwargs: dict | None) -> None:
    """Images (video, audio) handed to a cp_flash model's forward in a multi-rank block: they belong in
    ``cp.shard_batch(..., model=model)``, whose front-end runs on the full batch."""
    named = sorted(k for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor) and MEDIA_NAME.search(k))
    if named:
        raise refuse("media_handed_to_the_model", named=", ".join(named), model=type(model).__name__)


def media_inputs(model, inputs: dict, B: int, L: int) -> dict:
    """The entries of a batch that are not along its sequence and that ``model.forward`` takes by
    name: the images and their metadata (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ...)."""
    accepted = _accepted(model)
    media = {}
    for name, value in inputs.items():
        along = isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (B, L) \
            and not MEDIA_NAME.search(name)
        rows = name == "position_ids" and isinstance(value, torch.Tensor) and value.shape[-1] == L
        if not along and not rows and name in accepted:
            media[name] = value
    return media


def outer_inputs(model, captured: dict) -> list[str]:
    """The decoder arguments the model's own forward also takes by name (besides ``position_ids``,
    which stays the batch's 2-D positions there): ``inputs_embeds``, and e.g. Gemma 4's
    ``per_layer_inputs``, which the model would otherwise recompute from the shard."""
    accepted = _accepted(model)
    return [name for name, value in captured.items() if name in accepted and isinstance(value, torch.Tensor)
            and name not in NOT_INJECTED and name != "position_ids"]


def decoder_inputs(model, full_inputs: dict) -> dict:
    """Run ``model``'s forward on the full batch (outside any context, every rank alike) up to its
    text decoder and return the keyword arguments the decoder got. Raises ValueError when the
    forward never reaches the decoder (``model.get_decoder()``)."""
    decoder = model.get_decoder()
    captured: dict = {}

    def hook(module, args, kwargs):
        if args:
            raise refuse("decoder_positional_arguments", model=type(model).__name__)
        captured.update(kwargs)
        raise _Captured

    handle = decoder.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with outside_context():
            model(**full_inputs, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not captured:
        raise refuse("decoder_not_called", model=type(model).__name__, decoder=type(decoder).__name__)
    return captured


def shard_decoder_inputs(captured: dict, shard, B: int, L: int) -> dict:
    """This rank's shard of the decoder's arguments (``shard(x, dim)``: the batch's layout): (B, L, ...)
    tensors along dim 1 (``(1, L)`` position rows too), (k, B, L, ...) position rows along dim 2, and
    lists of per-image-token rows (N, ...) ordered like the True entries of a (B, L) bool argument
    (Qwen3-VL's ``deepstack_visual_embeds`` by ``visual_pos_masks``): the rows of this rank's image
    tokens, in its token order. ``None`` and arguments in :data:`NOT_INJECTED` are left out; any other
    tensor raises NotImplementedError naming it (it would be dropped)."""
    local: dict = {}
    token_masks = {name: v for name, v in captured.items() if isinstance(v, torch.Tensor) and v.dtype == torch.bool
                   and tuple(v.shape) == (B, L)}
    for name, value in captured.items():
        if name in NOT_INJECTED or value is None or isinstance(value, (bool, int, float, str)):
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == L and value.shape[0] in (1, B):
            local[name] = shard(value, 1)
        elif isinstance(value, torch.Tensor) and value.dim() >= 3 and value.shape[2] == L and value.shape[1] in (1, B):
            local[name] = shard(value, 2)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            mask = next((m for m in token_masks.values() if all(v.shape[0] == int(m.sum()) for v in value)), None)
            if mask is None:
                raise refuse("decoder_list_not_along_sequence", name=name, shape=tuple(value[0].shape))
            order = torch.full((B, L), -1, dtype=torch.long, device=mask.device)
            order[mask] = torch.arange(int(mask.sum()), device=mask.device)  # row-major, as masked_scatter reads
            rows = shard(order, 1)
            rows = rows[rows >= 0]
            local[name] = type(value)(v[rows.to(v.device)] for v in value)
        elif isinstance(value, torch.Tensor):
            raise refuse("decoder_tensor_not_along_sequence", name=name, shape=tuple(value.shape), length=L)
    return local


def install_injection(decoder) -> None:
    """A pre-hook on the text decoder (once per module): in a forward on tensors of a batch whose
    record holds decoder inputs (:func:`shard_decoder_inputs`), the decoder gets them in place of
    what the model computed from the shard."""
    if _INJECTED.get(decoder, False):
        return

    def inject(module, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        record = batch_of(*args, *(v for v in kwargs.values() if isinstance(v, torch.Tensor)))
        extras = None if record is None else record.extras.get("decoder_inputs")
        if not extras:
            return None
        return args, {**kwargs, **extras}

    decoder.register_forward_pre_hook(inject, with_kwargs=True)
    record("decoder_injection", f"{type(decoder).__module__}.{type(decoder).__qualname__} (an instance): a forward "
           "pre-hook", inject, admitted="multimodal's refusals", instance=True)
    _INJECTED[decoder] = True
