"""The public entry points: :func:`attention` and :func:`context_parallel`.

Legend: ``B`` batch, ``L`` local (this rank's) length, ``H`` query heads, ``K`` K/V heads,
``D`` head dim, ``N`` documents.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import struct
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from . import layout as layout_mod
from .backends import BACKENDS, select_backend
from .comm import Comm
from .masks import (MaskSpec, SequenceMeta, doc_starts_from_cu_seqlens,
                    doc_starts_from_position_ids, segment_runs)
from .plan import PlanStats, RankPlan, build_plan
from .ring import ring_attention

__all__ = ["attention", "context_parallel", "ContextParallel", "last_plan_stats", "forward_plan_stats", "BatchRecord",
           "batch_of"]

log = logging.getLogger(__name__)

_ACTIVE: contextvars.ContextVar[ContextParallel | None] = contextvars.ContextVar("cp_attention_ctx", default=None)
_LAST_STATS: list[PlanStats | None] = [None]
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PLAN_CACHE_SIZE = 16


def active_context() -> ContextParallel | None:
    """The innermost active :func:`context_parallel` context of this thread, or None."""
    return _ACTIVE.get()


def last_plan_stats() -> PlanStats | None:
    """Statistics of the plan used by the most recent attention call in this process (the bare
    :func:`attention` or a ``cp_flash`` layer, at any world size)."""
    return _LAST_STATS[0]


# Per thread: the (layer index, PlanStats) of every cp_flash layer call of the current forward.
_FORWARD = threading.local()


def forward_plan_stats() -> list[tuple[int | None, PlanStats]]:
    """``(layer index, PlanStats)`` of every attention layer call of the most recent ``cp_flash``
    model forward in this thread, in call order, at any world size (recomputations by gradient
    checkpointing during backward are not counted again)."""
    return list(getattr(_FORWARD, "calls", []))


def begin_forward() -> None:
    """Mark the start of a model forward for :func:`forward_plan_stats` (the integration calls it
    when the model builds its masks); a no-op until a layer of the previous forward has run."""
    if getattr(_FORWARD, "layer_ran", True):
        _FORWARD.calls, _FORWARD.layer_ran = [], False


def note_layer_stats(stats: PlanStats, layer: int | None) -> None:
    """Report a model layer's plan to :func:`last_plan_stats` and :func:`forward_plan_stats` (for
    engine entries outside this module, e.g. the compiled single-device op)."""
    _note_stats(stats, layer, in_model=True)


def _note_stats(stats: PlanStats, layer: int | None = None, in_model: bool = False) -> None:
    _LAST_STATS[0] = stats
    if in_model and torch._C._current_graph_task_id() == -1:  # not a recomputation in backward
        if not hasattr(_FORWARD, "calls"):
            _FORWARD.calls = []
        _FORWARD.calls.append((layer, stats))
        _FORWARD.layer_ran = True
    if log.isEnabledFor(logging.DEBUG):
        log.debug("attention call%s: %d kernel calls, K/V sent %d B / received %d B in %d rounds, dK/dV %d B",
                  "" if layer is None else f" (layer {layer})", stats.kernel_calls, stats.kv_bytes_sent,
                  stats.kv_bytes_recv, stats.rounds, stats.grad_bytes_sent)


@dataclass(frozen=True, eq=False)
class BatchRecord:
    """What one :meth:`ContextParallel.shard_batch` call learned about its full batch: its length, its
    global documents (position restarts, ``cu_seq_lens``/``seq_idx`` boundaries and the padding of
    ``attention_mask``) and the global number of label tokens.

    A record is bound to the tensors that call returned (see :func:`batch_of`) and to its context
    ``cp``: a forward on those tensors uses this record, whichever context is active when it runs
    (or when autograd recomputes it under gradient checkpointing)."""

    cp: "ContextParallel"
    seq_len: int
    meta: SequenceMeta
    num_items: torch.Tensor | None
    local_position_ids: torch.Tensor = field(repr=False)
    layout: object = "zigzag"  # the layout the batch was sharded with (a name or a layout.Layout)
    padded: bool = False
    crc: int = 0  # checksum of ``meta``, compared across ranks by the batch's first attention call
    agreed: dict = field(default_factory=dict, repr=False, compare=False)
    """The plans the group agreed on for this batch, per call signature (every header field that
    must agree): a later call with an agreed signature exchanges nothing."""


_BATCH_ATTR = "_cp_attention_batch"


def batch_of(*tensors) -> BatchRecord | None:
    """The :class:`BatchRecord` of the ``shard_batch`` call that returned any of ``tensors`` (the
    first one found), or None. Tensors derived from them (``.to()``, arithmetic) carry no record."""
    for t in tensors:
        record = getattr(t, _BATCH_ATTR, None) if isinstance(t, torch.Tensor) else None
        if record is not None:
            return record
    return None


# Every live sharded batch of this process, for one case only: a forward recomputed by gradient
# checkpointing of a whole model call, after its context has exited, in a model whose attention
# layers get no position_ids (see recomputed_batch). Guarded by the lock; entries die with the
# tensors shard_batch returned.
_LIVE: list[tuple[list[weakref.ref], "BatchRecord"]] = []
_LIVE_LOCK = threading.Lock()


def recomputed_batch(batch_size: int, local_len: int):
    """The sharded batch an attention layer recomputed during backward (activation checkpointing)
    most likely ran on when nothing binds it: the only live multi-rank batch with this shape; None
    if there is none, :data:`AMBIGUOUS` if several."""
    with _LIVE_LOCK:
        _LIVE[:] = [(refs, rec) for refs, rec in _LIVE if _alive(refs)]
        found = [rec for _, rec in _LIVE if rec.cp.world_size > 1 and rec.meta.batch == batch_size
                 and rec.local_position_ids.shape[-1] == local_len]
    if not found:
        return None
    return found[0] if len(found) == 1 else AMBIGUOUS


AMBIGUOUS = object()

_INFO_SEEN: set = set()  # (world size, layout, backend) already announced at INFO, once per process
_INFO_LOCK = threading.Lock()
"""Returned by :meth:`ContextParallel.current_batch` when several sharded batches are alive."""

def _alive(refs: list[weakref.ref]) -> bool:
    return any(ref() is not None for ref in refs)


def _as_group(group, mesh_dim: str | None = None):
    """A process group from a ProcessGroup, None (the WORLD group) or a DeviceMesh (1-D, or with the
    name of its context-parallel dimension in ``mesh_dim``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if mesh_dim is not None:
            if mesh_dim not in (group.mesh_dim_names or ()):
                raise ValueError(f"mesh_dim={mesh_dim!r} is not a dimension of the DeviceMesh "
                                 f"(its dimensions: {group.mesh_dim_names})")
            return group.get_group(mesh_dim)
        if group.ndim != 1:
            raise ValueError(f"context_parallel got a {group.ndim}-D DeviceMesh with dimensions "
                             f"{group.mesh_dim_names}; pass its context-parallel dimension: group=mesh['cp'] "
                             f"or context_parallel(mesh, mesh_dim='cp')")
        return group.get_group()
    if mesh_dim is not None:
        raise ValueError("mesh_dim names a dimension of a DeviceMesh; group is not a DeviceMesh")
    return group


class ContextParallel:
    """A context-parallel group: how sequences are sharded over its ranks, plus a plan cache.

    Plans depend on the batch's sequence metadata and the mask; they are cached here (keyed by the
    ``position_ids`` tensor object and its version, shapes and mask) so every layer of one forward
    that shares a mask reuses one plan and the metadata is exchanged once.
    """

    def __init__(self, group=None, layout: str | layout_mod.Layout = "zigzag", timeout: float | None = None, backend: str = "auto"):
        group = _as_group(group)
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
        self.comm = Comm(group, timeout=timeout, fresh_scope=True)
        self.group = group
        # "balanced": shard_batch computes a balanced layout for every batch (see balanced_layout)
        self.layout = layout if layout == "balanced" else layout_mod.check_layout(layout)
        self.backend = backend
        key = (self.comm.world_size, self.layout, backend)
        with _INFO_LOCK:
            if key not in _INFO_SEEN:
                _INFO_SEEN.add(key)
                log.info("context parallelism over %d rank(s), %s layout, backend %r (rank %d)",
                         self.comm.world_size, self.layout, backend, self.comm.rank)
        self._plans: dict = {}
        self._metas: dict = {}
        self._batch: BatchRecord | None = None
        # the records of this context's shard_batch calls, with weak references to the tensors each
        # returned: a batch is alive while any of them is
        self._records: list[tuple[list[weakref.ref], BatchRecord]] = []
        self._records_lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, world_size={self.world_size}, layout={self.layout!r})"

    def current_layout(self):
        """The layout tensors are sharded with: the context's, or under ``layout="balanced"`` the one
        computed for the most recent ``shard_batch`` call."""
        if self.layout != "balanced":
            return self.layout
        if self._batch is None:
            raise ValueError('context_parallel(layout="balanced") computes each batch\'s layout in cp.shard_batch: '
                             "call it first (or pass layout= explicitly)")
        return self._batch.layout

    def shard(self, x: torch.Tensor, dim: int = 1, layout=None) -> torch.Tensor:
        """This rank's shard of a full-length tensor along ``dim`` (differentiable); ``layout``
        None: :meth:`current_layout`."""
        return layout_mod.shard(x, dim, self.world_size, layout or self.current_layout(), self.rank)

    def current_batch(self):
        """The record of this context's only live sharded batch, None when there is none, or
        :data:`AMBIGUOUS` when several batches returned by :meth:`shard_batch` are still alive (a
        forward must then name its batch through the tensors it got from ``shard_batch``)."""
        with self._records_lock:
            self._records = [(refs, rec) for refs, rec in self._records if _alive(refs)]
            if not self._records:
                return None
            return self._records[0][1] if len(self._records) == 1 else AMBIGUOUS

    def shard_batch(self, *, shift_labels: bool = True, document_starts: torch.Tensor | None = None, model=None,
                    **inputs) -> dict[str, torch.Tensor]:
        """Shard a full batch for a transformers model; returns the dict of local tensors.

        ``inputs`` are what a data collator returns for the whole (unsharded) batch: every
        (B, L, ...) tensor (``input_ids``, ``inputs_embeds``, ``attention_mask``, ``position_ids``,
        ``labels``, ``token_type_ids``, ...) is sharded along dim 1 with this context's layout.
        The output of transformers' ``DataCollatorWithFlattening`` is taken whole: its
        ``cu_seq_lens_q``/``cu_seq_lens_k``, ``max_length_q``/``max_length_k`` and ``seq_idx``
        describe the documents of the packed row; they are checked, turned into the batch's
        documents and not passed on. Anything else (other scalars, lists, 1-D tensors) raises a
        ValueError naming the key.

        * ``position_ids`` default to ``arange(L)`` so rotary embeddings see global positions.
        * ``document_starts`` (B, L) bool: further tokens that open a document (optional).
        * Under ``context_parallel(layout="balanced")`` the batch gets its own
          :func:`~cp_attention.balanced_layout` from its documents and ``model``'s attention layers
          and size (windows, chunks, token weight; without ``model``: one causal layer).
        * The batch's documents (wherever ``position_ids`` do not increase by one, the collator's
          document boundaries, ``document_starts`` and padding in ``attention_mask``) are recorded in a
          :class:`BatchRecord` bound to the returned tensors: every attention layer under
          ``attn_implementation="cp_flash"`` that runs on them uses these documents, including
          layers that receive no ``position_ids`` (Llama 4, ModernBERT), and including forwards
          recomputed by gradient checkpointing after this context has exited. Several sharded
          batches may be alive at once (prefetching).
        * ``labels`` are shifted by one token globally before sharding (``shift_labels``, so no
          label is lost at a shard boundary; pass ``shift_labels=False`` for masked-LM labels),
          and ``num_items_in_batch`` is added: the global count of label tokens (or the
          ``num_items_in_batch`` passed in, e.g. counted over accumulated micro-batches) divided by
          the world size. Each rank's ``out.loss`` is then ``P`` times its token-weighted share:
          the **mean** over the group of the ranks' losses is the single-device loss, and the
          mean of their gradients (what DDP, FSDP2 and ``all_reduce(AVG)`` compute) is the
          single-device gradient.
        """
        from .integrations.hf_batch import shard_batch  # transformers' conventions live there

        return shard_batch(self, shift_labels=shift_labels, document_starts=document_starts, model=model, **inputs)

    def bind_batch(self, local: dict[str, torch.Tensor], *, meta: SequenceMeta,
                   num_items: torch.Tensor | None = None, padded: bool = False, layout=None) -> BatchRecord:
        """Record a sharded batch: ``local`` (this rank's tensors, ``position_ids`` among them) and
        the global ``meta`` of its documents. The record is bound to every tensor of ``local`` (see
        :func:`batch_of`) and is this context's live batch while any of them is alive."""
        # the record keeps its own copy of the position ids: it must not keep the returned tensors
        # alive, whose lifetime tells whether the batch is still in use
        record = BatchRecord(cp=self, seq_len=meta.seq_len, meta=meta, num_items=num_items,
                             local_position_ids=local["position_ids"].clone(), padded=padded, crc=_meta_crc(meta),
                             layout=layout or self.layout)
        for t in local.values():
            setattr(t, _BATCH_ATTR, record)
        refs = [weakref.ref(t) for t in local.values()]
        with self._records_lock:
            self._records = [(r, rec) for r, rec in self._records if _alive(r)]
            self._records.append((refs, record))
        with _LIVE_LOCK:
            _LIVE[:] = [(r, rec) for r, rec in _LIVE if _alive(r)]
            _LIVE.append((refs, record))
        self._batch = record
        return record

    def gather(self, x: torch.Tensor, dim: int = 1, layout=None) -> torch.Tensor:
        """Every rank's shard along ``dim``, reassembled in original token order, on every rank.

        Not differentiable (a collective on detached data)."""
        if self.world_size == 1:
            return x
        x = x.detach()
        dim = dim % x.dim()
        lengths = self.comm.all_gather(torch.tensor([x.shape[dim]], device=self.comm.device))
        lengths = [int(n) for n in lengths]
        longest = max(lengths)
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim).to(self.comm.device)
        parts = self.comm.all_gather(padded)
        parts = [p.narrow(dim, 0, n).to(x.device) for p, n in zip(parts, lengths)]
        return layout_mod.unshard(parts, dim, layout or self.current_layout())

    @staticmethod
    def _lookup(cache: dict, key):
        """The entry under ``key`` (marked most recently used), or None."""
        if key not in cache:
            return None
        entry = cache.pop(key)
        cache[key] = entry
        return entry[0]

    @staticmethod
    def _store(cache: dict, key, entry, keep_alive=()):
        """Insert ``entry``; returns it. ``keep_alive`` holds the tensors whose ``id`` is part of
        ``key``, so an id cannot be reused by another tensor while the entry lives."""
        cache.pop(key, None)
        cache[key] = (entry, keep_alive)
        while len(cache) > _PLAN_CACHE_SIZE:
            cache.pop(next(iter(cache)))
        return entry


@contextlib.contextmanager
def context_parallel(group=None, layout: str | layout_mod.Layout = "zigzag", timeout: float | None = None, *,
                     mesh_dim: str | None = None, backend: str = "auto"):
    """Make ``group`` (None: the default WORLD group) the context-parallel group of the block.

    ``group``: a ProcessGroup, a 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]`` of a (dp, cp) mesh), or a
    DeviceMesh with the name of its context-parallel dimension in ``mesh_dim``. ``backend``: the
    varlen backend of the block's attention calls that do not name one, ``cp_flash`` layers
    included ("auto", or a name in ``cp_attention.backends.BACKENDS``).

    Inside, :func:`attention` with ``group=None`` shards over this group with this layout::

        with cp_attention.context_parallel(layout="zigzag") as cp:
            q, k, v = (cp.shard(t, dim=1) for t in (q_full, k_full, v_full))
            out = cp_attention.attention(q, k, v, window=4096)
            out_full = cp.gather(out, dim=1)

    Without an initialised torch.distributed and with ``group=None`` the context has world size 1.

    Failures: every wait for the other ranks gives up after ``timeout`` seconds (None:
    ``$CP_ATTENTION_TIMEOUT`` or 300) with a :class:`~cp_attention.comm.RankFailedError`. An
    exception escaping the block (or raised inside attention) is recorded for the group, so ranks
    waiting on this one raise at once, naming it, instead of waiting for the timeout.
    """
    cp = ContextParallel(_as_group(group, mesh_dim), layout, timeout, backend)
    token = _ACTIVE.set(cp)
    try:
        yield cp
    except BaseException as exc:
        cp.comm.report_failure("its context_parallel block", exc)
        raise
    finally:
        _ACTIVE.reset(token)


# ----------------------------------------------------------------------------------------------
# input checks


def _check_inputs(q, k, v, position_ids, cu_seqlens, sinks, backend, same_length: bool = True) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, L_local, heads, head_dim), "
                            f"got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, L_local, heads, head_dim), got {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] and (same_length or q.shape[0] != k.shape[0]):
        raise ValueError(f"q and k must agree on (B, L_local), got {tuple(q.shape[:2])} and "
                         f"{tuple(k.shape[:2])}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads "
                         f"({k.shape[2]}) for GQA/MQA")
    B, L = q.shape[:2]
    if L == 0:
        raise ValueError("q has no tokens on this rank: the sequence length must be >= the world size")
    if position_ids is not None and cu_seqlens is not None:
        raise ValueError("pass either position_ids or cu_seqlens to describe documents, not both")
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point or \
                position_ids.dtype == torch.bool:
            raise TypeError("position_ids must be an integer tensor of shape (B, L_local)")
        if tuple(position_ids.shape) != (B, L):
            raise ValueError(f"position_ids must have shape (B, L_local) = {(B, L)}, got "
                             f"{tuple(position_ids.shape)}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError("cu_seqlens must be an int32 (or int64) tensor of shape (N+1,)")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have shape (N+1,) with N >= 1, got {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens describes one packed row, but B = {B}; use position_ids "
                             f"(B, L_local) for batches with several rows")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            raise TypeError("sinks must be a float tensor of shape (heads,)")
        if tuple(sinks.shape) != (q.shape[2],):
            raise ValueError(f"sinks must have shape (heads,) = ({q.shape[2]},), got {tuple(sinks.shape)}")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")


def _float_bits(x: float | None) -> int:
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _meta_crc(meta: SequenceMeta) -> int:
    """A checksum of the global sequence metadata: length, rows, and per row every document's first
    token and its position (positions rise by one inside a document, so that is all of them)."""
    crc = zlib.crc32(struct.pack("<qqqq", meta.batch, meta.seq_len, meta.doc_start is not None,
                                 meta.position is not None))
    for b, (starts, _) in enumerate(segment_runs(meta, None)):
        crc = zlib.crc32(starts.tobytes(), crc)
        if meta.position is not None:
            crc = zlib.crc32(meta.position.expand(meta.batch, meta.seq_len)[b].numpy()[starts].tobytes(), crc)
    return crc


@dataclass(frozen=True)
class _Header:
    """One rank's side of the agreement exchange: what it was asked to compute and which plan inputs
    it holds cached. One int64 per field (-1: none), all-gathered before every multi-rank attention
    call; the fields in :attr:`PER_RANK` may differ between ranks, every other one must agree."""

    error: int = 1                 # this rank's own checks failed (the rest is then -1)
    batch: int = -1
    local_len: int = -1
    heads: int = -1
    kv_heads: int = -1
    head_dim: int = -1
    dtype: int = -1                # index in _DTYPES
    layout: int = -1               # layout.layout_code
    causal: int = -1
    window: int = -1
    chunk_size: int = -1
    softcap: int = -1              # float bits
    scale: int = -1                # float bits
    sinks: int = -1
    documents: int = -1            # 0 none, 1 position_ids, 2 cu_seqlens
    cu_seqlens_crc: int = -1
    batch_length: int = -1         # the shard_batch record's global length
    batch_documents_crc: int = -1  # ... and its metadata checksum
    plan_cached: int = -1          # this rank holds the plan cached
    meta_cached: int = -1          # ... or the document metadata
    cached_seq_len: int = -1       # the global length of the cached entry
    cached_meta_crc: int = -1      # the metadata checksum of the cached entry
    model_crc: int = -1            # checksum of the model's configuration (cp_flash), -1: none

    PER_RANK: ClassVar[frozenset] = frozenset({"error", "local_len", "plan_cached", "meta_cached",
                                               "cached_seq_len", "cached_meta_crc"})

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, name) for name in self.names()], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, row: torch.Tensor) -> _Header:
        return cls(**dict(zip(cls.names(), (int(x) for x in row.tolist()))))


def _header(q, k, spec, layout, position_ids, cu_seqlens, sinks, batch, cached, model_crc: int = -1) -> _Header:
    """This rank's header. ``cached``: (plan cached, metadata cached, their global length, their
    metadata checksum)."""
    crc = -1
    if cu_seqlens is not None:
        crc = zlib.crc32(cu_seqlens.detach().to("cpu", torch.int64).numpy().tobytes())
    plan_cached, meta_cached, cached_seq_len, cached_meta_crc = cached
    return _Header(
        error=0, batch=q.shape[0], local_len=q.shape[1], heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
        dtype=_DTYPES.index(q.dtype), layout=layout_mod.layout_code(layout), causal=int(spec.causal),
        window=spec.window or -1, chunk_size=spec.chunk_size or -1, softcap=_float_bits(spec.softcap),
        scale=_float_bits(spec.scale), sinks=int(sinks is not None),
        documents=0 if position_ids is None and cu_seqlens is None else (1 if position_ids is not None else 2),
        cu_seqlens_crc=crc, batch_length=-1 if batch is None else batch.seq_len,
        batch_documents_crc=-1 if batch is None else batch.crc, plan_cached=plan_cached, meta_cached=meta_cached,
        cached_seq_len=cached_seq_len, cached_meta_crc=cached_meta_crc, model_crc=model_crc)


def _signature(header: _Header) -> tuple:
    """The fields of a header every rank must agree on (the key of :attr:`BatchRecord.agreed`)."""
    return tuple(getattr(header, name) for name in _Header.names() if name not in _Header.PER_RANK)


def _collective_error(exc: Exception) -> Exception:
    """Mark an error that every rank raises together (nothing for the failure reporting to tell)."""
    exc.cp_collective = True
    return exc


def _exchange_headers(comm: Comm, header: _Header | None, error: Exception | None) -> list[_Header]:
    """All-gather every rank's header (one collective, polled, bounded by the comm's timeout).

    Raises on every rank if any rank failed its local checks (each failing rank its own error, the
    others a copy naming the first failing rank) or if ranks disagree on any shared field. Returns
    every rank's header, in rank order."""
    mine = _Header() if header is None or error is not None else header
    table = comm.all_gather(mine.to_tensor().to(comm.device), "the agreement exchange of attention arguments")
    headers = [_Header.from_tensor(row.cpu()) for row in table]
    failed = [r for r, h in enumerate(headers) if h.error]
    if failed:
        messages = comm.all_gather_object(None if error is None else (type(error).__name__, str(error)))
        if error is not None:  # every failing rank raises its own error
            raise _collective_error(error)
        kind, message = messages[failed[0]]
        exc_type = TypeError if kind == "TypeError" else ValueError
        raise _collective_error(exc_type(f"rank {failed[0]} rejected its inputs: {message}"))
    for name in _Header.names():
        values = [getattr(h, name) for h in headers]
        if name not in _Header.PER_RANK and any(v != values[0] for v in values):
            raise _collective_error(ValueError(
                f"ranks disagree on {name}: {values} (rank order); every rank of the context-parallel "
                f"group must call attention with the same arguments (and the same batch)"))
    return headers


# ----------------------------------------------------------------------------------------------
# the entry point


@dataclass(frozen=True)
class _Resolved:
    cp: ContextParallel | None
    comm: Comm
    layout: str


def _resolve(group, layout, bound: ContextParallel | None = None) -> _Resolved:
    """The context a call runs in: ``bound`` (the context of the batch record the call uses), else
    the active context or ``group``, else a single device."""
    active = _ACTIVE.get()
    group = _as_group(group)
    if bound is not None:
        cp = bound
    elif group is None and active is not None:
        cp = active
    elif group is not None:
        cp = active if active is not None and active.group is group else None
        if cp is None:
            cp = ContextParallel(group, layout if layout is not None else "zigzag")
    else:
        cp = None
    use_layout = layout or (cp.current_layout() if cp is not None else "zigzag")
    # no group and no active context: an ordinary single-device attention, even inside a job
    return _Resolved(cp=cp, comm=cp.comm if cp is not None else Comm(single=True), layout=use_layout)


def _tensor_key(t: torch.Tensor | None):
    return None if t is None else (id(t), t._version, tuple(t.shape), str(t.device))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
    causal: bool = True, window: int | None = None, chunk_size: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None, scale: float | None = None,
    group=None, layout: str | layout_mod.Layout | None = None, backend: str | None = None, mask: MaskSpec | None = None,
) -> torch.Tensor:
    """Attention over a sequence sharded across a process group, honouring every mask.

    Args:
        q: (B, L_local, H, D) this rank's queries, in layout order (see ``ContextParallel.shard``).
        k, v: (B, L_local, K, D) this rank's keys and values; ``H`` must be a multiple of ``K``
            (GQA/MQA); only the ``K`` un-repeated heads travel between ranks.
        position_ids: (B, L_local) this rank's shard of the global position ids. A document starts
            wherever the position does not increase by exactly 1 from the previous token (in
            global order); tokens attend only within their document.
        cu_seqlens: (N+1,) int32 global document boundaries, for B == 1, instead of position_ids.
        causal: decoder (True) or encoder (False) attention.
        window: sliding window; with global positions ``q`` and ``k``, the key is visible when
            ``0 <= q - k < window`` (causal) or ``|q - k| < window``. None: unlimited. For
            ``window=3``, causal::

                1 0 0 0 0
                1 1 0 0 0
                1 1 1 0 0
                0 1 1 1 0
                0 0 1 1 1

        chunk_size: query and key must lie in the same chunk of their document (Llama 4): the same
            ``position // chunk_size``, positions from ``position_ids`` (with ``cu_seqlens``,
            counted from 0 at each document's first token).
        softcap: ``softcap * tanh(scores / softcap)`` on the scaled scores (Gemma 2).
        sinks: (H,) one extra value-less logit per head (gpt-oss). Its gradient, like every
            replicated parameter's, comes from this rank's loss: reduce it over the group with the
            rest (the mean, when each rank's loss is P times its share as ``shard_batch`` makes it).
        scale: score multiplier; None means ``D ** -0.5``.
        group: the process group; None means the active :func:`context_parallel` group, or a
            single device when none is active.
        layout: "zigzag", "contiguous" or a :class:`~cp_attention.layout.Layout`; None means the active
            context's layout (else zigzag).
        backend: "auto" or a name in ``cp_attention.backends.BACKENDS``; None: the active
            context's backend (``context_parallel(backend=...)``), else "auto".
        mask: a :class:`~cp_attention.MaskSpec` instead of the keywords ``causal``, ``window``,
            ``chunk_size``, ``softcap`` and ``scale`` (which must then keep their defaults).

    Returns:
        (B, L_local, H, D) in q's dtype (accumulation in float32), differentiable w.r.t. q, k, v
        and sinks. A query that sees no key returns zeros.

    Raises:
        TypeError / ValueError naming the argument, on every rank, before any K/V moves (ranks
        compare their arguments, shapes, layout and documents before every call).
        RankFailedError when another rank of the group failed (it is named) or did not answer
        within the context's ``timeout``.
    """
    keywords = dict(causal=causal, window=window, chunk_size=chunk_size, softcap=softcap, scale=scale)
    local_error = None
    if mask is not None:
        if not isinstance(mask, MaskSpec):
            local_error = TypeError(f"mask must be a cp_attention.MaskSpec, got {type(mask).__name__}")
        elif keywords != dict(causal=True, window=None, chunk_size=None, softcap=None, scale=None):
            local_error = ValueError("pass the mask either as mask=MaskSpec(...) or as the keywords causal, window, "
                                     "chunk_size, softcap and scale, not both")
    return attend(q, k, v, mask if mask is not None and local_error is None else keywords,
                  position_ids=position_ids, cu_seqlens=cu_seqlens, sinks=sinks, group=group, layout=layout,
                  backend=backend, local_error=local_error)


def attend(q, k, v, mask: MaskSpec | dict, *, position_ids=None, cu_seqlens=None, sinks=None, group=None,
           layout=None, backend: str | None = None, batch: BatchRecord | None = None,
           local_error: Exception | None = None, layer: int | None = None, model_crc: int = -1) -> torch.Tensor:
    """The engine entry behind :func:`attention` and the integrations (same arguments and result).

    ``mask``: a MaskSpec or a dict of its keywords (checked on every rank together). ``batch``: the
    record of a :meth:`ContextParallel.shard_batch` call, whose documents and context the call uses
    instead of ``position_ids`` and the active context. ``local_error``: a caller's check that
    failed on this rank, raised on every rank of the group together (before any K/V moves).
    ``layer``: the model layer index, for :func:`forward_plan_stats` (a model's layers only).
    ``model_crc``: a checksum of the calling model's configuration, agreed with ``batch``'s first call.

    Agreement: a call without ``batch`` all-gathers its header every time. With ``batch``, only the
    batch's first call with each signature (mask, shapes, dtype, layout, model) does; later calls
    with an agreed signature (every other layer of the model, every later forward and checkpoint
    recomputation on this batch) run the agreed plan with no collective, so the collectives per
    forward and backward do not grow with the number of layers."""
    res = _resolve(group, layout or (batch.layout if batch is not None else None), None if batch is None else batch.cp)
    comm = res.comm
    if backend is None:
        backend = res.cp.backend if res.cp is not None else "auto"
    error: Exception | None = None
    spec = impl = None
    try:  # every check that can fail on one rank only runs before the first collective
        if local_error is not None:
            raise local_error
        if layout is not None:
            layout_mod.check_layout(layout)
        spec = mask if isinstance(mask, MaskSpec) else MaskSpec(**mask)
        _check_inputs(q, k, v, position_ids, cu_seqlens, sinks, backend)
        impl = select_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[3], spec=spec)
    except (TypeError, ValueError) as exc:
        error = exc
    if comm.world_size == 1:
        if error is not None:
            raise error
        plan = _plan_single(res, q, k, spec, position_ids, cu_seqlens)
    else:
        plan = _plan_agreed(res, q, k, spec, position_ids, cu_seqlens, sinks, batch, error, model_crc)
    _note_stats(plan.stats, layer, in_model=layer is not None or batch is not None)
    return ring_attention(q, k, v, sinks, plan, comm, impl, scale=spec.resolved_scale(q.shape[3]),
                          softcap=spec.softcap)


def attend_local(q, k, v, plan: RankPlan, spec: MaskSpec, *, sinks=None, backend: str | None = None,
                 layer: int | None = None) -> torch.Tensor:
    """Single-device attention with a plan built by the caller (``plan.build_local_plan``: queries
    and keys at arbitrary positions, e.g. after a KV cache): q (B, Lq, H, D), k/v (B, Lk, K, D) ->
    (B, Lq, H, D). ``backend`` None: the active context's, else "auto"."""
    active = _ACTIVE.get()
    backend = backend or (active.backend if active is not None else "auto")
    _check_inputs(q, k, v, None, None, sinks, backend, same_length=False)
    impl = select_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[3], spec=spec)
    _note_stats(plan.stats, layer, in_model=True)
    return ring_attention(q, k, v, sinks, plan, Comm(single=True), impl, scale=spec.resolved_scale(q.shape[3]),
                          softcap=spec.softcap)


def _plan_spec(spec: MaskSpec) -> MaskSpec:
    """The part of the mask a plan depends on (softcap, sinks and scale act inside the kernels)."""
    return MaskSpec(causal=spec.causal, window=spec.window, chunk_size=spec.chunk_size)


def _make_meta(comm: Comm, layout: str, seq_len: int, B: int, position_ids, cu_seqlens,
               batch: BatchRecord | None) -> SequenceMeta:
    """The global document metadata: from ``batch``, from ``cu_seqlens``, or by all-gathering every
    rank's ``position_ids`` (a collective when the group has several ranks)."""
    P = comm.world_size
    if batch is not None:
        if seq_len != batch.seq_len:
            raise ValueError(f"the attention inputs hold {seq_len} tokens across ranks but the batch given to "
                             f"cp.shard_batch had {batch.seq_len}; pass the tensors shard_batch returned")
        return batch.meta
    if cu_seqlens is not None:  # values checked here, on the (cached) planning path only
        cu = cu_seqlens.detach().cpu()
        if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()[:16]}")
        if int(cu[-1]) != seq_len:
            raise ValueError(f"cu_seqlens must end at the global sequence length {seq_len}, got {int(cu[-1])}")
        return SequenceMeta(batch=1, seq_len=seq_len, doc_start=doc_starts_from_cu_seqlens(cu_seqlens, seq_len))
    if position_ids is None:
        return SequenceMeta(batch=B, seq_len=seq_len)
    if P == 1:
        pos_BL = position_ids.detach().cpu()
    else:
        sizes = layout_mod.local_lengths(seq_len, P, layout)
        padded = torch.zeros(B, max(sizes), dtype=torch.int64, device=comm.device)
        padded[:, :position_ids.shape[1]] = position_ids.detach().to(comm.device, torch.int64)
        parts = [p[:, :n].cpu() for p, n in zip(comm.all_gather(padded, "the position_ids all-gather"), sizes)]
        pos_BL = layout_mod.unshard(parts, 1, layout)
    return SequenceMeta(batch=B, seq_len=seq_len, doc_start=doc_starts_from_position_ids(pos_BL),
                        position=pos_BL.to(torch.int64).contiguous())


def _cache_keys(layout: str, q, k, spec: MaskSpec, position_ids, cu_seqlens, batch):
    """(metadata key, plan key, tensors whose ids the keys hold). Keys hold this rank's view only
    (local length, tensor identities); the global length is checked against the entry."""
    B, L_local = q.shape[:2]
    if batch is not None:
        meta_key = ("batch", id(batch), layout, B, L_local)
        keep = (batch,)
    else:
        meta_key = (layout, B, L_local, _tensor_key(position_ids), _tensor_key(cu_seqlens))
        keep = (position_ids, cu_seqlens)
    return meta_key, (meta_key, _plan_spec(spec), k.shape[2], k.shape[3], k.element_size()), keep


def _build(comm: Comm, layout: str, meta: SequenceMeta, spec: MaskSpec, k) -> RankPlan:
    start = time.perf_counter()
    plan = build_plan(meta, _plan_spec(spec), world_size=comm.world_size, layout=layout, rank=comm.rank,
                      head_kv=k.shape[2], head_dim=k.shape[3], itemsize=k.element_size())
    if log.isEnabledFor(logging.DEBUG):
        log.debug("plan built in %.1f ms: rank %d of %d, %s layout, %d x %d tokens, %s", 1e3 * (time.perf_counter() - start),
                  comm.rank, comm.world_size, layout, meta.batch, meta.seq_len, _plan_spec(spec))
    return plan


def _reused(plan: RankPlan) -> RankPlan:
    log.debug("plan reused from the context's cache (rank %d of %d)", plan.rank, plan.world_size)
    return plan


def _plan_single(res: _Resolved, q, k, spec, position_ids, cu_seqlens) -> RankPlan:
    """World size 1: no exchange; plans cached in the active context, if any."""
    comm, layout, cp = res.comm, res.layout, res.cp

    def make() -> RankPlan:
        meta = _make_meta(comm, layout, q.shape[1], q.shape[0], position_ids, cu_seqlens, None)
        return _build(comm, layout, meta, spec, k)

    if cp is None:
        return make()
    _, plan_key, keep = _cache_keys(layout, q, k, spec, position_ids, cu_seqlens, None)
    entry = cp._lookup(cp._plans, plan_key)
    if entry is not None:
        return _reused(entry[0])
    return cp._store(cp._plans, plan_key, (make(), 0, q.shape[1]), keep)[0]


def _plan_agreed(res: _Resolved, q, k, spec, position_ids, cu_seqlens, sinks, batch, error,
                 model_crc: int = -1) -> RankPlan:
    """Several ranks: one header all-gather before any K/V moves, then this rank's plan; with a
    ``batch`` whose group already agreed on this call's signature, that plan and no collective.

    The header carries every argument the plan depends on, and whether this rank holds the plan
    (or the document metadata) cached, for which global length and with which metadata checksum.
    A cached entry is used only when every rank has one for the same length and checksum;
    otherwise every rank rebuilds together (so a rank whose cache differs can neither hang the
    others in a collective they skip nor compute with stale documents)."""
    comm, layout, cp = res.comm, res.layout, res.cp
    header = None
    if error is None:
        meta_key, plan_key, keep = _cache_keys(layout, q, k, spec, position_ids, cu_seqlens, batch)
        plan_entry = cp._lookup(cp._plans, plan_key)
        meta_entry = cp._lookup(cp._metas, meta_key)
        if batch is not None:
            meta_entry = (batch.meta, batch.crc, batch.seq_len)
        known = plan_entry or meta_entry
        cached = (int(plan_entry is not None), int(meta_entry is not None),
                  -1 if known is None else known[2], -1 if known is None else known[1])
        header = _header(q, k, spec, layout, position_ids, cu_seqlens, sinks, batch, cached, model_crc)
        if batch is not None:
            agreed = batch.agreed.get(_signature(header))
            if agreed is not None:
                return _reused(agreed)
    elif batch is not None and batch.agreed:
        # the others may run an agreed signature with no exchange to meet this rank in: raise here,
        # recorded for the group, so ranks waiting on this one raise RankFailedError naming it at once
        comm.report_failure("context-parallel attention", error)
        raise error
    headers = _exchange_headers(comm, header, error)
    try:
        seq_len = layout_mod.infer_seq_len([h.local_len for h in headers], comm.world_size, layout)
    except ValueError as exc:
        raise _collective_error(exc) from None

    def usable(flag: str) -> bool:
        """Every rank holds the entry, for this length and the same metadata."""
        return all(getattr(h, flag) == 1 and h.cached_seq_len == seq_len
                   and h.cached_meta_crc == headers[0].cached_meta_crc for h in headers)

    if usable("plan_cached"):
        return _remember(batch, header, _reused(plan_entry[0]))
    if usable("meta_cached"):
        meta, crc = meta_entry[0], meta_entry[1]
    else:
        try:
            meta = _make_meta(comm, layout, seq_len, q.shape[0], position_ids, cu_seqlens, batch)
        except ValueError as exc:  # the header made every rank's inputs equal: all raise it
            raise _collective_error(exc) from None
        crc = _meta_crc(meta)
        if batch is None:
            cp._store(cp._metas, meta_key, (meta, crc, seq_len), keep)
    plan = cp._store(cp._plans, plan_key, (_build(comm, layout, meta, spec, k), crc, seq_len), keep)[0]
    return _remember(batch, header, plan)


def _remember(batch: BatchRecord | None, header: _Header, plan: RankPlan) -> RankPlan:
    """Record that the group agreed on ``header``'s signature for ``batch`` (see BatchRecord.agreed)."""
    if batch is not None:
        batch.agreed[_signature(header)] = plan
    return plan
