"""The agreement protocol: before K/V moves, the ranks of a group compare what they were asked to
compute (one all-gather of a fixed-size header), so a mistake on one rank raises on every rank
together instead of hanging the others in a collective it skips.

Why once per batch, not per call: a batch bound by ``cp.shard_batch`` agrees on its first call with
each signature (mask, shapes, dtype, layout, model); later calls with an agreed signature (every
other layer, every later forward and checkpoint recomputation on the batch) run the agreed plan with
no collective, so the collectives per step do not grow with the number of layers. The engine
(:mod:`cp_attention.engine`) decides when to agree; this module is the header and its exchange.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..comm import Comm
from ..layout.layouts import layout_code
from ..masks import SequenceMeta, segment_runs

__all__ = ["DTYPES", "STRATEGIES", "check_strategy", "Header", "make_header", "signature", "exchange_headers", "collective_error", "meta_crc",
           "float_bits"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes attention accepts, in the order of the header's ``dtype`` field."""

STRATEGIES = ("ring", "ulysses", "usp", "auto")
"""How a multi-rank call runs, in the order of the header's ``strategy`` field."""


def check_strategy(strategy, ulysses_size=None) -> str:
    """``strategy`` if it is one of :data:`STRATEGIES` and ``ulysses_size`` fits it (a positive int
    for "usp", None for the others), else ValueError."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)} (see cp_attention.strategies.choice), "
                         f"got {strategy!r}")
    if ulysses_size is not None and (strategy != "usp" or isinstance(ulysses_size, bool)
                                     or not isinstance(ulysses_size, int) or ulysses_size < 1):
        raise ValueError(f"ulysses_size is the head-group size of strategy='usp' (a positive int dividing the world "
                         f"size), got ulysses_size={ulysses_size!r} with strategy={strategy!r}")
    return strategy


def float_bits(x: float | None) -> int:
    """A float as the int64 of its bits (-1 for None), for the header."""
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def meta_crc(meta: SequenceMeta) -> int:
    """A checksum of the global sequence metadata: length, rows, and per row every document's first
    token and its position (positions rise by one inside a document, so that is all of them), and
    the bidirectional spans."""
    crc = zlib.crc32(struct.pack("<qqqq", meta.batch, meta.seq_len, meta.doc_start is not None,
                                 meta.position is not None))
    for b, (starts, _) in enumerate(segment_runs(meta, None)):
        crc = zlib.crc32(starts.tobytes(), crc)
        if meta.position is not None:
            crc = zlib.crc32(meta.position.expand(meta.batch, meta.seq_len)[b].numpy()[starts].tobytes(), crc)
    for span_starts, span_ends in meta.spans or ():  # bidirectional spans
        crc = zlib.crc32(b"spans" + span_starts.tobytes() + span_ends.tobytes(), crc)
    return crc


@dataclass(frozen=True)
class Header:
    """One rank's side of the agreement exchange: what it was asked to compute and which plan inputs
    it holds cached. One int64 per field (-1: none), all-gathered before every multi-rank attention
    call; the fields in :attr:`PER_RANK` may differ between ranks, every other one must agree."""

    error: int = 1                 # this rank's own checks failed (the rest is then -1)
    batch: int = -1
    local_len: int = -1
    heads: int = -1
    kv_heads: int = -1
    head_dim: int = -1
    dtype: int = -1                # index in DTYPES
    layout: int = -1               # layout.layout_code
    causal: int = -1               # causal + 2 * spans (opens the batch's spans) + 4 * selection (selected keys)
    window: int = -1
    chunk_size: int = -1
    softcap: int = -1              # float bits
    scale: int = -1                # float bits
    sinks: int = -1
    documents: int = -1            # 0 none, 1 position_ids, 2 cu_seqlens
    cu_seqlens_crc: int = -1
    batch_length: int = -1         # the shard_batch record's global length
    batch_documents_crc: int = -1  # ... and its metadata checksum
    batch_tokens_crc: int = -1     # ... and the checksum of its tokens (input ids, labels, ...)
    plan_cached: int = -1          # this rank holds the plan cached
    meta_cached: int = -1          # ... or the document metadata
    cached_seq_len: int = -1       # the global length of the cached entry
    cached_meta_crc: int = -1      # the metadata checksum of the cached entry
    model_crc: int = -1            # checksum of the model's configuration (cp_flash), -1: none
    strategy: int = -1             # index in STRATEGIES
    ulysses_size: int = -1         # strategy "usp": ranks per head group
    cost_model_crc: int = -1       # strategy "auto": the cost model's checksum
    latent_dim: int = -1           # a multi-head latent attention layer's latent width (-1: none, or declined)

    PER_RANK: ClassVar[frozenset] = frozenset({"error", "local_len", "plan_cached", "meta_cached",
                                               "cached_seq_len", "cached_meta_crc"})

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, name) for name in self.names()], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, row: torch.Tensor) -> Header:
        return cls(**dict(zip(cls.names(), (int(x) for x in row.tolist()))))


def make_header(q, k, spec, layout, position_ids, cu_seqlens, sinks, batch, cached, model_crc: int = -1,
                strategy: str = "ring", ulysses_size: int | None = None, cost_model_crc: int = -1,
                latent_dim: int = -1) -> Header:
    """This rank's header. ``cached``: (plan cached, metadata cached, their global length, their
    metadata checksum)."""
    crc = -1
    if cu_seqlens is not None:
        crc = zlib.crc32(cu_seqlens.detach().to("cpu", torch.int64).numpy().tobytes())
    plan_cached, meta_cached, cached_seq_len, cached_meta_crc = cached
    return Header(
        error=0, batch=q.shape[0], local_len=q.shape[1], heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
        dtype=DTYPES.index(q.dtype), layout=layout_code(layout),
        causal=int(spec.causal) + 2 * int(spec.spans) + 4 * int(spec.selection),
        window=spec.window or -1, chunk_size=spec.chunk_size or -1, softcap=float_bits(spec.softcap),
        scale=float_bits(spec.scale), sinks=int(sinks is not None),
        documents=0 if position_ids is None and cu_seqlens is None else (1 if position_ids is not None else 2),
        cu_seqlens_crc=crc, batch_length=-1 if batch is None else batch.seq_len,
        batch_documents_crc=-1 if batch is None else batch.crc,
        batch_tokens_crc=-1 if batch is None else batch.tokens_crc, plan_cached=plan_cached, meta_cached=meta_cached,
        cached_seq_len=cached_seq_len, cached_meta_crc=cached_meta_crc, model_crc=model_crc,
        strategy=STRATEGIES.index(strategy), ulysses_size=-1 if ulysses_size is None else ulysses_size,
        cost_model_crc=cost_model_crc, latent_dim=latent_dim)


def signature(header: Header) -> tuple:
    """The fields of a header every rank must agree on (the key of :attr:`BatchRecord.agreed`)."""
    return tuple(getattr(header, name) for name in Header.names() if name not in Header.PER_RANK)


def collective_error(exc: Exception) -> Exception:
    """Mark an error that every rank raises together (nothing for the failure reporting to tell)."""
    exc.cp_collective = True
    return exc


def exchange_headers(comm: Comm, header: Header | None, error: Exception | None) -> list[Header]:
    """All-gather every rank's header (one collective, polled, bounded by the comm's timeout).

    Raises on every rank if any rank failed its local checks (each failing rank its own error, the
    others a copy naming the first failing rank) or if ranks disagree on any shared field. Returns
    every rank's header, in rank order."""
    mine = Header() if header is None or error is not None else header
    table = comm.all_gather(mine.to_tensor().to(comm.device), "the agreement exchange of attention arguments")
    headers = [Header.from_tensor(row.cpu()) for row in table]
    failed = [r for r, h in enumerate(headers) if h.error]
    if failed:
        messages = comm.all_gather_object(None if error is None else (type(error).__name__, str(error)))
        if error is not None:  # every failing rank raises its own error
            raise collective_error(error)
        kind, message = messages[failed[0]]
        exc_type = TypeError if kind == "TypeError" else ValueError
        raise collective_error(exc_type(f"rank {failed[0]} rejected its inputs: {message}"))
    tokens = [h.batch_tokens_crc for h in headers]
    if any(v != tokens[0] for v in tokens):
        raise collective_error(ValueError(
            f"ranks were given different batches: the checksums of the tensors passed to cp.shard_batch differ "
            f"{tokens} (rank order). Every rank of a context-parallel group must shard the SAME full batch; a "
            f"per-rank sampler (a DistributedSampler over every rank, accelerator.prepare(dataloader)) hands each "
            f"rank its own. Sample per data-parallel rank and give every rank of the context-parallel group the "
            f"same batch (CPTrainer does this)"))
    for name in Header.names():
        values = [getattr(h, name) for h in headers]
        if name not in Header.PER_RANK and any(v != values[0] for v in values):
            raise collective_error(ValueError(
                f"ranks disagree on {name}: {values} (rank order); every rank of the context-parallel "
                f"group must call attention with the same arguments (and the same batch)"))
    return headers
