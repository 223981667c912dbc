"""The batch record: what one ``cp.shard_batch`` call learned about its full batch, bound to the
tensors it returned, and the one rule by which an attention layer finds the batch it runs on.

Which batch a layer runs on (:func:`resolve`), in this order:

1. the record bound to the ``position_ids`` the layer received (exact: they are the batch's);
2. else the record its mask was built for (:func:`resolve_for_mask`, once per forward when the model
   builds its masks): the record bound to the padding ``attention_mask``, else the active context's
   only live batch, else, in a forward recomputed by checkpointing after its ``context_parallel``
   block exited, the only live multi-rank batch of the mask's shape.

A layer never looks the batch up anywhere else (not at backward time, not in "whatever context is
active"): the record carries its context, so checkpoint recomputation after the block runs on the
same group and documents. Several live batches with nothing to tell them apart raise.

Legend: ``B`` rows, ``L`` global length, ``L_local`` this rank's tokens.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from dataclasses import dataclass, field

import torch

from .agreement import meta_crc
from ..masks import SequenceMeta
from ..torch_compat import in_backward, tensor_version

__all__ = ["BatchRecord", "LiveRecords", "batch_of", "bind", "resolve", "resolve_for_mask", "AMBIGUOUS", "NO_MASK",
           "tokens_checksum", "recomputed_batch", "live_records", "LIVE_BATCHES", "LIVE_LOCK"]

AMBIGUOUS = object()
"""Returned where several live sharded batches could be meant (a forward must then name its batch
through the tensors it got from ``shard_batch``)."""
NO_MASK = object()
"""The layer got no mask of ours (e.g. a prebuilt dict of masks): :func:`resolve` falls back to the
active context's only live batch."""

_BATCH_ATTR = "_cp_attention_batch"

LIVE_BATCHES: list = []
"""``(weak references to a batch's tensors, its BatchRecord)`` of every live sharded batch: the fallback
of a forward recomputed by checkpointing after its block exited, in a model whose layers get no
position_ids. Guarded by ``LIVE_LOCK``; pruned when the batch's tensors die."""
LIVE_LOCK = threading.Lock()


@dataclass(frozen=True, eq=False)
class BatchRecord:
    """What one :meth:`~cp_attention.ContextParallel.shard_batch` call learned about its full batch:
    its length, its global documents (position restarts, ``cu_seq_lens``/``seq_idx`` boundaries and
    the padding of ``attention_mask``) and the global number of label tokens.

    A record is bound to the tensors that call returned (see :func:`batch_of`) and to its context
    ``cp``: a forward on those tensors uses this record, whichever context is active when it runs
    (or when autograd recomputes it under gradient checkpointing)."""

    cp: object  # the ContextParallel of the shard_batch call
    seq_len: int
    meta: SequenceMeta
    num_items: torch.Tensor | None
    local_position_ids: torch.Tensor = field(repr=False)
    layout: object = None  # the layout object the batch was sharded with
    padded: bool = False
    crc: int = 0  # checksum of ``meta``, compared across ranks by the batch's first attention call
    digest: bytes = b""  # 128-bit digest of ``meta``: the key of the batch's plans in its context's cache
    tokens_crc: int = -1  # checksum of the full batch's tokens (ids, labels, ...), compared across ranks; -1: none
    positions_given: bool = True
    """False when ``shard_batch`` numbered the positions itself (``arange`` of the full length): a model
    that numbers its own default positions differently (RoBERTa's ``padding_idx + 1``) refuses it."""
    doc_opens: torch.Tensor | None = field(default=None, repr=False)
    """(B, L) bool document openings, for a one-rank context's single-device layers: one tensor object
    per batch, so the plan cache digests it once per batch instead of once per layer."""
    span_next: torch.Tensor | None = field(default=None, repr=False)
    """(B, L) bool: the batch's bidirectional spans (token ``i`` and ``i + 1`` in one span), for a
    one-rank context's single-device layers, like ``doc_opens``; None without spans."""
    spans_read: bool = False
    """``shard_batch`` read the model's bidirectional spans from the batch (``model=``): a layer whose
    mask opens spans refuses a multi-rank batch without them."""
    extras: dict = field(default_factory=dict, repr=False, compare=False)
    """Values an integration keeps with the batch (transformers: the text decoder's sharded inputs that
    a multimodal front-end computed on the full batch)."""
    agreed: dict = field(default_factory=dict, repr=False, compare=False)
    """The plans the group agreed on for this batch, per call signature (every header field that
    must agree): a later call with an agreed signature exchanges nothing."""
    facts: dict = field(default_factory=dict, repr=False, compare=False)
    """Checks of tensors the batch's layers get that sync with the device (see :func:`tensor_fact`)."""
    prepared: bool = False
    """The batch's documents and layout were computed ahead by ``cp.prepare`` (its plans too, unless
    the masks or shapes prepared were not its calls')."""


def tensor_fact(record: BatchRecord, tensor: torch.Tensor, name: str, compute) -> bool:
    """``compute()``, a check of ``tensor`` that syncs with the device, memoised on ``record`` by the
    tensor's identity and in-place version: once per batch and tensor, not once per layer (the layers
    of a forward, eager or compiled, get the same ``position_ids`` and padding mask). Weak: an entry
    whose tensor died is never returned (its id may be reused) and is dropped; a tensor without a
    version counter (an inference tensor) is checked every time."""
    version, key = tensor_version(tensor), (name, id(tensor))
    hit = record.facts.get(key)
    if hit is not None and version is not None and hit[0]() is tensor and hit[1] == version:
        return hit[2]
    value = bool(compute())
    if len(record.facts) >= 32:
        for stale in [k for k, entry in record.facts.items() if entry[0]() is None]:
            del record.facts[stale]
    record.facts[key] = (weakref.ref(tensor), version, value)
    return value


def batch_of(*tensors) -> BatchRecord | None:
    """The :class:`BatchRecord` of the ``shard_batch`` call that returned any of ``tensors`` (the
    first one found), or None. Tensors derived from them (``.to()``, arithmetic) carry no record."""
    for t in tensors:
        record = getattr(t, _BATCH_ATTR, None) if isinstance(t, torch.Tensor) else None
        if record is not None:
            return record
    return None


def _alive(refs: list[weakref.ref]) -> bool:
    return any(ref() is not None for ref in refs)


class LiveRecords:
    """The records of one context's ``shard_batch`` calls, with weak references to the tensors each
    returned: a batch is alive while any of them is. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._records: list[tuple[list[weakref.ref], BatchRecord]] = []

    def add(self, refs: list[weakref.ref], record: BatchRecord) -> None:
        with self._lock:
            self._records = [(r, rec) for r, rec in self._records if _alive(r)]
            self._records.append((refs, record))

    def only(self):
        """The only live record, None when there is none, :data:`AMBIGUOUS` when several."""
        with self._lock:
            self._records = [(r, rec) for r, rec in self._records if _alive(r)]
            if not self._records:
                return None
            return self._records[0][1] if len(self._records) == 1 else AMBIGUOUS


def tokens_checksum(tensors: dict[str, torch.Tensor]) -> int:
    """A 31-bit checksum of a full batch's tensors (their names, shapes, dtypes and bytes): what the
    ranks of a group compare to make sure they were all given the same batch. -1 for none."""
    if not tensors:
        return -1
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        crc = zlib.crc32(repr((name, tuple(t.shape), str(t.dtype))).encode(), crc)
        crc = zlib.crc32(t.to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc & 0x7FFFFFFF


def bind(cp, local: dict[str, torch.Tensor], *, meta: SequenceMeta, layout, num_items: torch.Tensor | None = None,
         padded: bool = False, tokens_crc: int = -1, positions_given: bool = True,
         spans_read: bool = False, crc: int | None = None, digest: bytes | None = None) -> BatchRecord:
    """Record a sharded batch of the context ``cp``: ``local`` (this rank's tensors, ``position_ids``
    among them) and the global ``meta`` of its documents. The record is bound to every tensor of
    ``local`` (see :func:`batch_of`) and is live while any of them is. ``crc`` / ``digest``: ``meta``'s
    checksum and digest when they were computed ahead (``cp.prepare``; the record is then marked
    ``prepared``), else computed here."""
    # the record keeps its own copy of the position ids: it must not keep the returned tensors
    # alive, whose lifetime tells whether the batch is still in use
    record = BatchRecord(cp=cp, seq_len=meta.seq_len, meta=meta, num_items=num_items,
                         local_position_ids=local["position_ids"].clone(), padded=padded,
                         crc=meta_crc(meta) if crc is None else crc, digest=meta.digest() if digest is None else digest,
                         prepared=digest is not None, tokens_crc=tokens_crc, layout=layout, positions_given=positions_given,
                         doc_opens=None if cp.world_size > 1 or meta.doc_start is None
                         else meta.doc_start == torch.arange(meta.seq_len),
                         span_next=None if cp.world_size > 1 else _span_next(meta), spans_read=spans_read)
    for t in local.values():
        setattr(t, _BATCH_ATTR, record)
    refs = [weakref.ref(t) for t in local.values()]
    cp.records.add(refs, record)
    with LIVE_LOCK:
        LIVE_BATCHES[:] = [(r, rec) for r, rec in LIVE_BATCHES if _alive(r)]
        LIVE_BATCHES.append((refs, record))
    return record


def live_records(keep) -> list:
    """The records of live multi-rank batches (a tensor ``cp.shard_batch`` returned for them is alive)
    for which ``keep(record)`` holds, each once, in the order they were made."""
    with LIVE_LOCK:
        LIVE_BATCHES[:] = [(refs, rec) for refs, rec in LIVE_BATCHES if _alive(refs)]
        found = {id(rec): rec for _, rec in LIVE_BATCHES if rec.cp.world_size > 1 and keep(rec)}
    return list(found.values())


def _span_next(meta: SequenceMeta) -> torch.Tensor | None:
    """(B, L) bool: token ``i`` and ``i + 1`` in one of ``meta``'s bidirectional spans; None without."""
    if meta.spans is None:
        return None
    nxt = torch.zeros(meta.batch, meta.seq_len, dtype=torch.bool)
    for b, (starts, ends) in enumerate(meta.spans):
        for s, e in zip(starts.tolist(), ends.tolist()):
            nxt[b, s:e - 1] = True
    return nxt


def recomputed_batch(batch_size: int, local_len: int):
    """The only live multi-rank batch with this shape (a forward recomputed during backward after its
    block exited, with nothing binding it); None if there is none, :data:`AMBIGUOUS` if several."""
    found = live_records(lambda rec: rec.meta.batch == batch_size and rec.local_position_ids.shape[-1] == local_len)
    if not found:
        return None
    return found[0] if len(found) == 1 else AMBIGUOUS


def resolve_for_mask(attention_mask, active, batch_size: int, q_length: int):
    """Step 2 of the rule (module docstring): the record a forward's mask is built for, or None, or
    :data:`AMBIGUOUS`. ``active``: the active context, or None."""
    batch = batch_of(attention_mask)
    if batch is None and active is not None:
        batch = active.records.only()
    elif batch is None and in_backward():
        batch = recomputed_batch(batch_size, q_length)
    return batch


_AMBIGUOUS_MESSAGE = (
    "cp_flash: several batches returned by cp.shard_batch are alive and this forward does not say "
    "which one it runs on (this model does not hand position_ids to its attention layers); run each "
    "batch's forward before sharding the next one, or delete the other batches' tensors first")


def resolve(position_ids, active, *, mask_batch=NO_MASK) -> tuple[BatchRecord | None, Exception | None]:
    """The batch a layer call runs on (the rule of the module docstring), and an error if it cannot
    be told. ``active``: the active context or None. ``mask_batch``: what :func:`resolve_for_mask`
    gave the layer's mask (:data:`NO_MASK` without a mask of ours)."""
    batch = batch_of(position_ids)
    if batch is not None:
        return batch, None
    batch = mask_batch
    if batch is NO_MASK:
        batch = active.records.only() if active is not None else None
    if batch is AMBIGUOUS:
        return None, ValueError(_AMBIGUOUS_MESSAGE)
    mine = None if batch is None else batch.local_position_ids
    if isinstance(position_ids, torch.Tensor) and mine is not None and position_ids.shape[-1] == mine.shape[-1]:
        # other lengths (a KV cache, another batch) are refused by the length checks that follow. The
        # comparison syncs with the device: once per batch and tensor (tensor_fact), not per layer
        if not tensor_fact(batch, position_ids, "positions match",
                           lambda: (position_ids.to(mine.device) == mine).all()):
            return batch, ValueError(
                "cp_flash: the model got position_ids that cp.shard_batch did not return for this batch; pass "
                "the position_ids (and every other tensor) of one cp.shard_batch call to the model")
    return batch, None
