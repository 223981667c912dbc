"""What a model's head does with the sequence after its layers, checked before a multi-rank forward.

A head that reads positions or reduces over tokens by itself sees only this rank's shard:

* sequence classification (reward models) pools one token of each row (its last non-padding
  token, or the first: [CLS]), which one rank holds: every other rank would pool one of its own;
* question answering takes ``start_positions``/``end_positions`` of the sequence as indices into the
  shard;
* token classification and masked-LM heads that take the mean of their cross entropy over their own
  tokens (not through ``self.loss_function(..., **kwargs)``, which divides a sum by the batch's
  ``num_items_in_batch``) would average per rank;
* ``logits_to_keep=k`` keeps each rank's last ``k`` local tokens;
* a ``num_items_in_batch`` handed to the model that is not the one ``cp.shard_batch`` bound to the
  batch (label tokens / P) scales the loss wrongly.

:func:`check_call` raises before the forward runs (NotImplementedError for what cannot be made exact,
ValueError for a wrong argument), alike on every rank. The keyword arguments of the call are read from
the frame of ``nn.Module._call_impl`` that runs the global forward pre-hook (torch's global pre-hooks
take no keyword arguments); where that frame is not found nothing is checked (a test pins it).
"""

from __future__ import annotations

import functools
import re
import sys

import torch

from ..batch import batch_of
from .losses import LOSS_SCALE

__all__ = ["call_kwargs", "check_call"]

_NUM_ITEMS_LOSS = re.compile(r"self\.loss_function\((?:[^()]|\([^()]*\))*\*\*kwargs", re.S)


def call_kwargs() -> dict | None:
    """The keyword arguments of the module call whose global forward pre-hook is running: read from
    the frame that called the hook (``nn.Module._call_impl``, or the ``inner`` function it runs the
    hooks in), two frames up from here; None when that frame is neither."""
    frame = sys._getframe(2)
    name = frame.f_code.co_name
    if not (name == "_call_impl" or (name == "inner" and frame.f_back is not None
                                     and frame.f_back.f_code.co_name == "_call_impl")):
        return None
    kwargs = frame.f_locals.get("kwargs")
    return kwargs if isinstance(kwargs, dict) else None


@functools.lru_cache(maxsize=1)
def _heads() -> dict[str, frozenset]:
    from transformers.models.auto import modeling_auto as auto

    def names(mapping) -> frozenset:
        out = set()
        for value in mapping.values():
            out.update(value if isinstance(value, (tuple, list)) else (value,))
        return frozenset(out)

    return dict(sequence=names(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
                qa=names(auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES),
                token=names(auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES),
                masked=names(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
                causal=names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def _loss_takes_num_items(cls: type) -> bool:
    """Whether ``cls.forward`` computes its loss through ``self.loss_function(..., **kwargs)`` (the
    batch's ``num_items_in_batch`` reaches the loss)."""
    from .model_check import class_source

    return bool(_NUM_ITEMS_LOSS.search(class_source(cls)))


def _given(kwargs: dict, name: str) -> bool:
    return kwargs.get(name) is not None


def check_call(model, kwargs: dict | None) -> None:
    """Raise before a multi-rank forward of ``model`` (a transformers model with a head) called with
    ``kwargs`` what its head would compute from this rank's shard alone (module docstring)."""
    if not kwargs:
        return
    name, heads = type(model).__name__, _heads()
    keep = kwargs.get("logits_to_keep")
    if keep is not None and not (isinstance(keep, int) and keep == 0):
        raise NotImplementedError(
            f"cp_flash: {name} was called with logits_to_keep={keep!r} under context parallelism: each rank would keep "
            "the last tokens of its own shard. Pass logits_to_keep=0 and take the positions you need from the "
            "ranks that hold them")
    if name in heads["sequence"]:
        raise NotImplementedError(
            f"cp_flash: {name} pools one token of each row (its last non-padding token, or its first: [CLS]), which "
            "only one rank holds; under context parallelism every other rank would pool a token of its own shard. "
            "Run sequence classification (reward models) without context_parallel")
    if name in heads["qa"] and (_given(kwargs, "start_positions") or _given(kwargs, "end_positions")):
        raise NotImplementedError(
            f"cp_flash: {name} reads start_positions/end_positions as indices into the sequence, but each rank holds "
            "a shard of it. Compute the span loss from the gathered logits, or run without context_parallel")
    if _given(kwargs, "labels") and name not in heads["causal"] and \
            (name in heads["token"] or name in heads["masked"]) and not _loss_takes_num_items(type(model)):
        raise NotImplementedError(
            f"cp_flash: {name} takes the mean of its loss over the tokens it is given, which under context "
            "parallelism are this rank's: the ranks' means are not the batch's. Call it without labels and compute "
            "the loss from the logits (sum over the shard / the batch's label count), or run without "
            "context_parallel")
    given = kwargs.get("num_items_in_batch")
    if given is None:
        return
    record = batch_of(*(v for v in kwargs.values() if isinstance(v, torch.Tensor)))
    if record is None or record.num_items is None or LOSS_SCALE in record.extras:
        return  # not a shard_batch batch with labels, or a trainer's own count (CPTrainerMixin)
    want = float(record.num_items) / record.cp.world_size
    value = float(torch.as_tensor(given).detach().sum())
    if abs(value - want) > 1e-6 * max(1.0, abs(want)):
        raise ValueError(
            f"cp_flash: num_items_in_batch={value:g} was handed to the model, but the batch cp.shard_batch returned "
            f"binds {want:g} (its {float(record.num_items):g} label tokens / {record.cp.world_size} ranks: each "
            "rank's loss is P times its share). To count over accumulated micro-batches, pass num_items_in_batch "
            "to cp.shard_batch, and hand the model the value it returns")
