"""transformers' batch conventions under context parallelism: what ``cp.shard_batch`` does.

A data collator's whole batch (padding collators, or transformers' ``DataCollatorWithFlattening``
with its document keys) becomes this rank's shard plus a :class:`~cp_attention.engine.batch.BatchRecord`
of the batch's documents; transformers' loss conventions are applied here: labels shifted
globally into ``shift_labels`` (-100 where nothing is predicted), ``num_items_in_batch`` such that
the mean of the ranks' losses is the single-device loss.

Legend: ``B`` rows, ``L`` global length.
"""

from __future__ import annotations

import torch

from ...engine.batch import batch_of
from ...refusals import refuse
from .heads import HAS_PADDING
from .models import unwrap_adapters
from .positions import default_position_start
from .models import attention_shapes, model_masks
from .multimodal import MEDIA_NAME, decoder_inputs, install_injection, media_inputs, outer_inputs, shard_decoder_inputs
from .overlays import batch_span_next

__all__ = ["DOCUMENT_KEYS", "shard_batch"]

# Keys a packing collator (transformers' DataCollatorWithFlattening) adds next to (B, L) tensors:
# they describe the documents of the one packed row, are translated into the batch's documents and
# are not passed on (the model's layers get the documents from the record instead).
DOCUMENT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _document_opens(documents: dict, seq_len: int) -> torch.Tensor | None:
    """(1, L) bool document openings of one packed row from a packing collator's keys
    (``cu_seq_lens_q``/``_k`` boundaries, ``seq_idx`` changes), after checking them; None if none."""
    if not documents:
        return None
    opens = torch.zeros(1, seq_len, dtype=torch.bool)
    opens[0, 0] = True
    bounds = {}
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if documents.get(name) is None:
            continue
        cu = torch.as_tensor(documents[name]).detach().to("cpu", torch.int64)
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) \
                or int(cu[-1]) != seq_len:
            raise ValueError(f"shard_batch: {name} must hold the (N+1,) document boundaries 0 = c_0 <= ... <= "
                             f"c_N = L of the packed row, with L = {seq_len}; got {cu.tolist()[:16]}")
        opens[0, cu[:-1].clamp(max=seq_len - 1)] = True
        bounds[name] = cu
    if len(bounds) == 2 and not torch.equal(*bounds.values()):
        raise ValueError("shard_batch: cu_seq_lens_q and cu_seq_lens_k differ; a packed row for training has "
                         "the same documents for queries and keys")
    for name in ("max_length_q", "max_length_k"):
        value = documents.get(name)
        if value is None:
            continue
        longest = max(int(d) for d in torch.diff(next(iter(bounds.values())))) if bounds else 1
        if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)) or int(value) < longest:
            raise ValueError(f"shard_batch: {name} must be an int no smaller than the longest document "
                             f"({longest} tokens), got {value!r}")
    seq_idx = documents.get("seq_idx")
    if seq_idx is not None:
        seq_idx = torch.as_tensor(seq_idx).detach().to("cpu", torch.int64)
        if tuple(seq_idx.shape) != (1, seq_len):
            raise ValueError(f"shard_batch: seq_idx must have shape (1, L) = (1, {seq_len}), got "
                             f"{tuple(seq_idx.shape)}")
        opens[0, 1:] |= seq_idx[0, 1:] != seq_idx[0, :-1]
    return opens


def shard_batch(cp, *, shift_labels: bool = True, document_starts: torch.Tensor | None = None, model=None,
                prepare: dict | None = None, **inputs):
    """:meth:`ContextParallel.shard_batch <cp_attention.ContextParallel.shard_batch>` (see there) for the
    context ``cp``: transformers' conventions, then the engine's :meth:`~cp_attention.ContextParallel.shard_documents`.

    Multimodal batches (a processor's output: ``pixel_values`` and the like, which are not along the
    sequence) need ``model``: its own front-end runs on the full batch and the text decoder's inputs
    are sharded (:mod:`.multimodal`); the returned batch then holds ``inputs_embeds`` instead of
    ``input_ids``.

    ``prepare`` (``{"masks": ..., "shapes": {...}, "executor": ...}``, from :meth:`ContextParallel.prepare
    <cp_attention.ContextParallel.prepare>`): read the batch the same way, then, instead of sharding
    it, the engine's :meth:`~cp_attention.ContextParallel.prepare_documents` on the same tensors, with the
    masks and shapes of ``model``'s attention layers where the request names none (no front-end runs);
    returns its :class:`~cp_attention.engine.prepare.PreparedBatch`."""
    model = None if model is None else unwrap_adapters(model)  # a PEFT wrapper: its transformers model
    inputs, media = _split_media(model, inputs)
    tensors, opens, num_items_given = _translate_inputs(inputs)
    B, L, device, opens = _check_rows(cp, tensors, opens, document_starts)
    position_ids = tensors.pop("position_ids", None)
    given_positions = position_ids  # the front-end of a multimodal model numbers its own when none is given
    positions_given = position_ids is not None or model is not None
    if position_ids is None:
        position_ids = _default_positions(model, opens, B, L, device)
    valid = tensors.get("attention_mask")
    if valid is not None and valid.dim() != 2:
        raise ValueError("shard_batch: attention_mask must be a 2D (B, L) padding mask")
    to_shard, num_items = _labels(tensors, shift_labels, num_items_given)
    to_shard.update(tensors)
    # each rank's loss is P x its share, so the MEAN over ranks is the single-device loss
    scaled = {} if num_items is None else {"num_items_in_batch": num_items.to(device, torch.float32) / cp.world_size}
    span_next, spans_read = batch_span_next(model, tensors)  # image blocks, as the model's mask opens them
    if prepare is not None:  # the documents exactly as below, planned instead of sharded
        masks, shapes = prepare["masks"], dict(prepare["shapes"])
        if model is not None:
            masks = masks if masks is not None else model_masks(model)[0]
            shapes = {**attention_shapes(model), **shapes}
        return cp.prepare_documents(B, L, position_ids=position_ids, opens=opens,
                                    valid=None if valid is None else valid.bool(),
                                    model_masks=None if model is None else (lambda: model_masks(model)),
                                    span_next=span_next, masks=masks, shapes=shapes, documents_path=model is None,
                                    executor=prepare.get("executor"))
    derived, largest = None, position_ids
    if media:
        derived, decoder_positions = _front_end(model, tensors, media, given_positions, B, L)
        largest = position_ids if decoder_positions is None else decoder_positions
    out = cp.shard_documents(to_shard, position_ids=position_ids, opens=opens,
                             valid=None if valid is None else valid.bool(),
                             model_masks=None if model is None else (lambda: model_masks(model)),
                             num_items=num_items, bind_also=scaled, positions_given=positions_given,
                             span_next=span_next, spans_read=spans_read, derived=derived)
    # the largest position the text decoder gets, for a rope that depends on it (.rope)
    record = batch_of(*out.values())
    record.extras["position_max"] = int(largest.max())
    record.extras[HAS_PADDING] = valid is not None and not bool(valid.bool().all())
    if media:
        out.pop("input_ids", None)  # the model gets inputs_embeds (ids and embeddings are exclusive)
    return out


def _split_media(model, inputs: dict) -> tuple[dict, dict]:
    """``inputs`` without the media a multimodal ``model``'s front-end reads (``pixel_values``, M-RoPE rows
    (k, B, L), ...), and those media; media without a model are refused."""
    if model is None:
        named = sorted(name for name in inputs if MEDIA_NAME.search(name))
        if named:
            raise refuse("media_without_model", named=", ".join(named))
        return inputs, {}
    B0, L0 = _batch_shape(inputs)
    media = media_inputs(model, inputs, B0, L0)
    if isinstance(inputs.get("position_ids"), torch.Tensor) and inputs["position_ids"].dim() == 3:
        media["position_ids"] = inputs["position_ids"]  # M-RoPE rows (k, B, L): the model's own
    return {name: value for name, value in inputs.items() if name not in media}, media


def _check_rows(cp, tensors: dict, opens, document_starts):
    """``(B, L, device, opens)`` of the batch's (B, L, ...) tensors, checked against each other and the group,
    with ``document_starts`` (B, L) bool added to the documents' starts ``opens``."""
    ref_name = "input_ids" if "input_ids" in tensors else next(iter(tensors))
    B, L = tensors[ref_name].shape[:2]
    device = tensors[ref_name].device
    for name, t in tensors.items():
        if name == "position_ids" and t.shape[0] == 1 and t.shape[1] == L:
            continue
        if tuple(t.shape[:2]) != (B, L):
            raise ValueError(f"shard_batch: {name} has shape {tuple(t.shape)}, expected (B, L, ...) = "
                             f"({B}, {L}, ...) like {ref_name}")
    if L < cp.world_size:
        raise ValueError(f"shard_batch: sequence length {L} is shorter than the world size {cp.world_size}")
    if opens is not None and B != 1:
        raise ValueError(f"shard_batch: cu_seq_lens_*/seq_idx describe one packed row, but the batch has {B} "
                         f"rows; describe the documents of several rows with position_ids")
    if document_starts is not None:
        if tuple(document_starts.shape) != (B, L) or document_starts.dtype != torch.bool:
            raise ValueError(f"shard_batch: document_starts must be a (B, L) = ({B}, {L}) bool tensor, got "
                             f"{document_starts.dtype} {tuple(document_starts.shape)}")
        opens = document_starts.cpu() if opens is None else (opens | document_starts.cpu())
    return B, L, device, opens


def _default_positions(model, opens, B: int, L: int, device) -> torch.Tensor:
    """(B, L) positions for a batch given none: numbered as ``model`` numbers its default positions (RoBERTa-style
    models from ``padding_idx + 1``) when it is given, else from 0 (a model that counts otherwise refuses);
    each packed document of ``opens`` from that start, as when alone."""
    start = default_position_start(model) if model is not None else 0
    position_ids = (torch.arange(L, device=device) + start).expand(B, L)
    if start and opens is not None:
        idx = torch.arange(L).expand(opens.shape[0], L)
        position_ids = (idx - torch.where(opens, idx, 0).cummax(dim=1).values + start).to(device).expand(B, L)
    return position_ids


def _labels(tensors: dict, shift_labels: bool, num_items_given) -> tuple[dict, torch.Tensor | None]:
    """The (B, L) label tensors to shard (``labels``, and ``shift_labels``: the next token's label, -100 at a
    row's end, unless given) popped from ``tensors``, and the number of labelled tokens (the given count, else
    the targets not -100)."""
    to_shard: dict[str, torch.Tensor] = {}
    labels = tensors.pop("labels", None)
    if labels is None:
        return to_shard, None
    target = tensors.get("shift_labels", labels)
    if shift_labels and "shift_labels" not in tensors:
        target = torch.full_like(labels, -100)
        target[:, :-1] = labels[:, 1:]
        to_shard["shift_labels"] = target
    to_shard["labels"] = labels
    return to_shard, (num_items_given if num_items_given is not None else (target != -100).sum())


def _batch_shape(inputs: dict) -> tuple[int, int]:
    """(B, L) of a batch: its ``input_ids`` (else ``inputs_embeds``, else ``labels``)."""
    for name in ("input_ids", "inputs_embeds", "labels"):
        value = inputs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0], value.shape[1]
    if any(name.startswith("decoder_") for name in inputs):
        raise refuse("encoder_decoder_batch")
    raise ValueError("shard_batch with model= needs input_ids (or inputs_embeds) of shape (B, L)")


def _front_end(model, tensors: dict, media: dict, position_ids, B: int, L: int):
    """Run ``model``'s multimodal front-end on the full batch (:func:`.multimodal.decoder_inputs`) and
    return the ``derived`` function of :meth:`~cp_attention.ContextParallel.shard_documents` that
    shards the decoder's inputs (the model's ``inputs_embeds`` among them) with the batch's layout,
    and the full position ids the decoder gets (M-RoPE rows for Qwen-VL; None: none captured)."""
    full = {name: t for name, t in tensors.items() if name not in ("labels", "shift_labels")}
    full.update(media)
    if position_ids is not None:
        full["position_ids"] = position_ids
    captured = decoder_inputs(model, full)
    if not isinstance(captured.get("inputs_embeds"), torch.Tensor):
        raise refuse("decoder_without_inputs_embeds", model=type(model).__name__)
    install_injection(model.get_decoder())

    passed = outer_inputs(model, captured)

    def derived(shard):
        local = shard_decoder_inputs(captured, shard, B, L)
        # what the model's forward takes by name goes in the batch too (Gemma 4's per-layer inputs, which it
        # would otherwise recompute from the shard by reversing the embedding)
        return {**{name: local[name] for name in passed if name in local}, "decoder_inputs": local}

    positions = captured.get("position_ids")
    return derived, positions if isinstance(positions, torch.Tensor) else None


def _translate_inputs(inputs: dict):
    """Split a collator's batch into (B, L, ...) tensors to shard, document openings (1, L) bool
    from ``cu_seq_lens_*``/``seq_idx`` (or None) and a given ``num_items_in_batch`` (or None)."""
    if not inputs:
        raise ValueError("shard_batch needs at least one (B, L, ...) tensor, e.g. input_ids=...")
    tensors: dict[str, torch.Tensor] = {}
    documents: dict = {}
    num_items = None
    for name, value in inputs.items():
        if name in DOCUMENT_KEYS:
            documents[name] = value
        elif name == "num_items_in_batch":
            if value is not None:
                num_items = torch.as_tensor(value).detach().sum()
        elif isinstance(value, torch.Tensor) and value.dim() >= 2:
            tensors[name] = value
        else:
            what = f"a {value.dim()}-D tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"shard_batch: {name} is {what}; it takes (B, L, ...) tensors to shard, "
                             f"num_items_in_batch and the document keys of a packing collator "
                             f"({', '.join(DOCUMENT_KEYS)}); drop {name} or pass it to the model yourself")
    if not tensors:
        raise ValueError("shard_batch needs at least one (B, L, ...) tensor, e.g. input_ids=...")
    L = next(iter(tensors.values())).shape[1]
    return tensors, _document_opens(documents, L), num_items
