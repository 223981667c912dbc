"""The mask model: one :class:`MaskSpec` per attention layer plus per-token sequence metadata.

Every input mode (``position_ids``, global ``cu_seqlens``, plain full-length rows) is converted here
into the same two facts per token, in *global* (unsharded) coordinates:

* its global index ``i`` in ``[0, L)``;
* the ``[start, end)`` range of its *attention segment*: the document it belongs to, further cut
  into chunks of ``chunk_size`` positions: two tokens of a document share a chunk when their
  positions ``p`` (``position_ids``; without them, counted from 0 at each document's first token)
  have the same ``p // chunk_size``, as transformers defines Llama 4's chunked attention.

A query at global index ``q`` sees a key at global index ``k`` exactly when both lie in the same
segment and ``lo <= k - q <= hi`` for the band ``(lo, hi)`` of :meth:`MaskSpec.band`.

Legend for tensor names: ``B`` batch rows, ``L`` global sequence length, ``N`` number of documents.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "MaskSpec",
    "SequenceMeta",
    "doc_starts",
    "doc_starts_from_position_ids",
    "doc_starts_from_cu_seqlens",
    "segment_bounds",
    "segment_runs",
    "mask_terms",
    "dense_mask",
    "row_key_intervals",
    "accumulation_dtype",
]

INF = math.inf


@dataclass(kw_only=True, frozen=True)
class MaskSpec:
    """The static description of one attention mask (everything but tensors).

    Sinks are not part of the spec: they are a differentiable tensor passed next to it and do not
    change which (query, key) pairs are visible.
    """

    causal: bool = True
    """True: a query sees only keys at or before it (decoder). False: bidirectional (encoder)."""
    window: int | None = None
    """Sliding window with transformers' meaning: key ``k`` is visible from query ``q`` when
    ``0 <= q - k < window`` (causal) or ``|q - k| < window`` (bidirectional). None: unlimited."""
    chunk_size: int | None = None
    """Chunked attention (Llama 4): query and key must also lie in the same chunk of their document:
    the same ``position // chunk_size``, with the tokens' ``position_ids`` (without them, positions
    count from 0 at each document's first token). A document whose positions start at 5 with
    ``chunk_size=4`` has chunks {5, 6, 7}, {8..11}, ... None: no chunking."""
    softcap: float | None = None
    """Logit soft-capping (Gemma 2): scores become ``softcap * tanh(scores / softcap)`` after
    scaling. None: off."""
    scale: float | None = None
    """Multiplier of ``q @ k^T``. None: ``head_dim ** -0.5``."""
    spans: bool = False
    """The layer opens the batch's bidirectional spans (:attr:`SequenceMeta.spans`: image blocks,
    prefix-LM prefixes): a query inside a span also sees every *later* key of its span, on top of
    what causal, window and documents let it see (transformers' block overlay, ``OR(causal,
    block)``, under the layer's window: Gemma 3 and 4 image tokens). Spans never cross documents.
    False, or a batch without spans: nothing changes. Not combined with ``chunk_size``."""
    selection: bool = False
    """Index-sparse attention (DeepSeek Sparse Attention and the families that copy it): every query
    comes with a set of selected keys, given per call as a tensor of *global* key indices (the
    position of the key in its unsharded row; ``-1``: an empty slot), and sees a key only when the
    rest of the mask lets it *and* the key is selected. A selection never adds a pair: a selected key
    that is later than the query, outside its window or in another document stays hidden, and a key
    selected twice counts once. Not combined with ``spans``."""

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
        for name in ("window", "chunk_size"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be a positive int or None, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be a positive int or None (unlimited), got {value}")
        if self.softcap is not None and not (float(self.softcap) > 0 and math.isfinite(self.softcap)):
            raise ValueError(f"softcap must be a positive finite float or None, got {self.softcap!r}")
        if self.scale is not None and not (math.isfinite(self.scale) and float(self.scale) != 0.0):
            raise ValueError(f"scale must be a finite non-zero float or None, got {self.scale!r}")
        if not isinstance(self.spans, bool):
            raise TypeError(f"spans must be a bool, got {type(self.spans).__name__}")
        if not isinstance(self.selection, bool):
            raise TypeError(f"selection must be a bool, got {type(self.selection).__name__}")
        if self.selection and self.spans:
            raise ValueError("selection (index-selected keys) cannot be combined with spans: no model builds such a "
                             "mask")
        if self.spans and self.chunk_size is not None:
            raise ValueError("spans (bidirectional spans) cannot be combined with chunk_size: no model builds such "
                             "a mask; use one or the other")

    def band(self) -> tuple[float, float]:
        """Inclusive bounds ``(lo, hi)`` on ``k - q`` for visible pairs; ``±inf`` when unlimited.

        causal, window W:         lo = -(W-1), hi = 0
        bidirectional, window W:  lo = -(W-1), hi = W-1
        """
        reach = INF if self.window is None else self.window - 1
        return (-reach, 0 if self.causal else reach)

    def span_band(self) -> tuple[float, float] | None:
        """Inclusive bounds ``(lo, hi)`` on ``k - q`` of the pairs a span adds (both in one span): the
        later keys beyond the band's upper end, ``(hi + 1, inf)``. None when the layer opens no span
        or already sees every later key (bidirectional, unlimited)."""
        hi = self.band()[1]
        return None if not self.spans or hi == INF else (hi + 1, INF)

    def resolved_scale(self, head_dim: int) -> float:
        return float(self.scale) if self.scale is not None else head_dim ** -0.5

    def for_planning(self) -> MaskSpec:
        """The part of the mask a plan depends on: which pairs are visible (causal, window, chunk,
        spans, whether keys are selected). Softcap and scale act inside the kernels, so masks that
        differ only there share plans."""
        if self.softcap is None and self.scale is None:
            return self
        return MaskSpec(causal=self.causal, window=self.window, chunk_size=self.chunk_size, spans=self.spans,
                        selection=self.selection)


@dataclass(frozen=True, eq=False, init=False)
class SequenceMeta:
    """Global document metadata, identical on every rank.

    Documents are given per row as ``starts`` or per token as ``doc_start`` (the constructor takes
    either); the other is made on first read. The planners (``segment_runs``, the balanced layout)
    read only ``starts``, so metadata from ``cu_seqlens`` is never expanded per token for them:

    * ``starts``: None when every row is one document (the common unpacked case); otherwise a tuple
      of B (N_b,) int64 numpy arrays, the sorted global indices of the tokens that open a document
      (each row's first is 0).
    * ``doc_start``: None likewise; otherwise a (B, L) int64 CPU tensor holding, for each token, the
      global index of its document's first token.

    ``position`` is None when positions count from 0 at each document's first token; otherwise a
    (B, L) int64 CPU tensor of every token's position (its ``position_ids``), which places chunk
    boundaries (see :attr:`MaskSpec.chunk_size`).

    ``spans`` is None when the batch has no bidirectional span; otherwise a tuple of B ``(starts,
    ends)`` pairs of sorted (N_s,) int64 numpy arrays: the global ``[start, end)`` ranges of tokens
    that see each other inside a causal sequence (an image's tokens, a prefix), each inside one
    document and at least two tokens long. Layers whose :attr:`MaskSpec.spans` is set apply them.
    """

    batch: int
    seq_len: int
    position: torch.Tensor | None = None
    spans: tuple | None = None
    _runs: dict = field(default_factory=dict, repr=False, compare=False)  # segment_runs, per chunk size

    def __init__(self, batch: int, seq_len: int, doc_start: torch.Tensor | None = None,
                 position: torch.Tensor | None = None, *, starts: tuple[np.ndarray, ...] | None = None,
                 spans: tuple | None = None) -> None:
        if doc_start is not None and starts is not None:
            raise ValueError("SequenceMeta: give the documents as doc_start or as starts, not both")
        object.__setattr__(self, "batch", batch)
        object.__setattr__(self, "seq_len", seq_len)
        object.__setattr__(self, "position", position)
        object.__setattr__(self, "spans", spans)
        object.__setattr__(self, "_runs", {})
        if doc_start is None and starts is None:  # one document per row
            self.__dict__.update(doc_start=None, starts=None)
        elif doc_start is not None:
            self.__dict__["doc_start"] = doc_start
        else:
            self.__dict__["starts"] = tuple(np.asarray(row, dtype=np.int64) for row in starts)

    @functools.cached_property
    def doc_start(self) -> torch.Tensor:
        """(B, L) int64: the global index of each token's document's first token, from ``starts``."""
        L = self.seq_len
        return torch.from_numpy(np.stack([np.repeat(row, np.diff(np.append(row, L))) for row in self.starts]))

    @functools.cached_property
    def starts(self) -> tuple[np.ndarray, ...]:
        """Per row, the (N_b,) sorted global indices of the tokens that open a document, from ``doc_start``."""
        idx_L = np.arange(self.seq_len)
        return tuple(np.flatnonzero(self.doc_start[b].numpy() == idx_L).astype(np.int64) for b in range(self.batch))

    @classmethod
    def from_inputs(cls, batch: int, seq_len: int, *, position_ids: torch.Tensor | None = None,
                    cu_seqlens: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                    opens: torch.Tensor | None = None, span_next: torch.Tensor | None = None) -> SequenceMeta:
        """See :meth:`_from_inputs`; ``span_next`` (B or 1, L) bool: token ``i`` and token ``i + 1`` lie
        in one bidirectional span (the last column is ignored); spans are cut where a document opens
        (or at padding). None: no span."""
        meta = cls._from_inputs(batch, seq_len, position_ids=position_ids, cu_seqlens=cu_seqlens, valid=valid,
                                opens=opens)
        if span_next is None:
            return meta
        return meta.with_spans(span_next)

    def with_spans(self, span_next: torch.Tensor | None) -> SequenceMeta:
        """This metadata with the bidirectional spans ``span_next`` (B or 1, L) bool describes (see
        :meth:`from_inputs`), cut at documents; ``self`` when there is none."""
        if span_next is None:
            return self
        B, L = self.batch, self.seq_len
        nxt = np.broadcast_to(torch.as_tensor(span_next).detach().to("cpu", torch.bool).numpy(), (B, L)).copy()
        nxt[:, -1] = False
        if self.starts is not None:
            for b, row in enumerate(self.starts):
                cut = row[row > 0] - 1  # the token before a document's first one does not join it
                nxt[b, cut] = False
        if not nxt.any():
            return self
        rows = []
        for b in range(B):
            edge = np.diff(np.concatenate([[0], nxt[b].astype(np.int8), [0]]))
            s, e = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1) + 1  # runs [s, e - 1) join e - 1
            rows.append((s.astype(np.int64), e.astype(np.int64)))
        out = SequenceMeta(B, L, position=self.position, spans=tuple(rows),
                           **({"starts": self.starts} if self.starts is not None else {}))
        return out

    @classmethod
    def _from_inputs(cls, batch: int, seq_len: int, *, position_ids: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                     opens: torch.Tensor | None = None) -> SequenceMeta:
        """The metadata of ``batch`` rows of ``seq_len`` tokens in global order, from any input form
        (the one constructor every entry uses; each argument optional):

        * ``position_ids`` (B or 1, L) int: a document opens where they do not increase by one; they
          are kept as the tokens' positions (chunk boundaries);
        * ``cu_seqlens`` (N+1,) int: document boundaries of one packed row (``batch == 1``),
          checked to run from 0 to ``seq_len`` without decreasing;
        * ``valid`` (B, L) bool padding mask: every padding token is a document of its own;
        * ``opens`` (B or 1, L) bool: further document openings.

        None of them: every row is one document (``doc_start`` None). ``cu_seqlens`` alone costs
        O(N), nothing per token; every other input is read once per token (O(L)). Raises ValueError
        naming the argument when ``cu_seqlens`` is malformed."""
        if cu_seqlens is not None:
            cu = torch.as_tensor(cu_seqlens).detach().to("cpu", torch.int64)
            if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
                raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()[:16]}")
            if int(cu[-1]) != seq_len:
                raise ValueError(f"cu_seqlens must end at the global sequence length {seq_len}, got {int(cu[-1])}")
            if batch != 1:
                raise ValueError(f"cu_seqlens describes one packed row, but the batch has {batch} rows; "
                                 f"describe the documents of several rows with position_ids")
            firsts = cu[:-1].numpy()
            firsts = np.unique(firsts[firsts < seq_len])
            if position_ids is None and valid is None and opens is None:
                return cls(batch=1, seq_len=seq_len, starts=(firsts,))
            cu_opens = torch.zeros(1, seq_len, dtype=torch.bool)
            cu_opens[0, torch.from_numpy(firsts)] = True
            opens = cu_opens if opens is None else (torch.as_tensor(opens).to("cpu", torch.bool) | cu_opens)
        position = None
        if position_ids is not None:
            position = torch.as_tensor(position_ids).detach().to("cpu", torch.int64).expand(batch, seq_len)
        if position is None and valid is None and opens is None:
            return cls(batch=batch, seq_len=seq_len)
        opens_BL = _opens(batch, seq_len, position_ids=position, valid=valid, opens=opens)
        return cls(batch=batch, seq_len=seq_len, starts=tuple(np.flatnonzero(row) for row in opens_BL),
                   position=None if position is None else position.contiguous())

    @classmethod
    def of_batch(cls, *, position_ids=None, cu_seqlens=None, seq_len: int | None = None, document_starts=None,
                 caller: str = "this function") -> SequenceMeta:
        """:meth:`from_inputs` with the shape read from the inputs, for the pure entries that describe a
        batch by one of: ``position_ids`` (B, L) or (L,) (with optional ``document_starts`` (B, L)
        bool), else ``cu_seqlens`` (N+1,) of one row, else ``seq_len`` (one document). ``caller``
        names the entry in the error raised when none is given."""
        if position_ids is not None:  # position_ids first; cu_seqlens and seq_len are then not read
            pos = torch.as_tensor(position_ids)
            pos = pos[None] if pos.dim() == 1 else pos
            opens = None if document_starts is None else torch.as_tensor(document_starts)
            return cls.from_inputs(pos.shape[0], pos.shape[1], position_ids=pos, opens=opens)
        if cu_seqlens is not None:
            cu = torch.as_tensor(cu_seqlens)
            return cls.from_inputs(1, int(cu[-1]), cu_seqlens=cu)
        if seq_len is not None:
            return cls.from_inputs(1, seq_len)
        raise ValueError(f"{caller} needs position_ids, cu_seqlens or seq_len")

    def digest(self) -> bytes:
        """A 128-bit digest of the metadata (rows, length, documents, positions): equal for equal
        metadata; what caches key batches by (the agreement's 31-bit checksum is for comparing ranks)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((self.batch, self.seq_len, self.doc_start is None, self.position is None)).encode())
        for t in (self.doc_start, self.position):
            if t is not None:
                h.update(t.expand(self.batch, self.seq_len).contiguous().numpy().tobytes())
        for starts, ends in self.spans or ():
            h.update(b"spans" + starts.tobytes() + b"|" + ends.tobytes())
        return h.digest()

    def span_ends(self) -> torch.Tensor | None:
        """(B, L) int64: for a token inside a bidirectional span, the span's exclusive end; -1 for any
        other token. None when the batch has no span."""
        if self.spans is None:
            return None
        end_BL = torch.full((self.batch, self.seq_len), -1, dtype=torch.int64)
        for b, (starts, ends) in enumerate(self.spans):
            for s, e in zip(starts.tolist(), ends.tolist()):
                end_BL[b, s:e] = e
        return end_BL

    def doc_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(start, end) of each token's document, both (B, L) int64, ``end`` exclusive."""
        B, L = self.batch, self.seq_len
        if self.doc_start is None:
            zeros = torch.zeros(B, L, dtype=torch.int64)
            return zeros, torch.full((B, L), L, dtype=torch.int64)
        start_BL = self.doc_start
        return start_BL, _ends_from_starts(start_BL)


def _ends_from_starts(start_BL: torch.Tensor) -> torch.Tensor:
    """Exclusive document end per token from document starts (documents are contiguous)."""
    B, L = start_BL.shape
    idx_L = torch.arange(L)
    is_first_BL = start_BL == idx_L  # token opens a document
    # the end of a document is the index of the next opening token (or L)
    next_open_BL = torch.where(is_first_BL, idx_L.expand(B, L), torch.full((B, L), L))
    # for token i we need min over j > i of next_open[j]: reverse cumulative min, shifted by one
    rev_min = torch.flip(torch.cummin(torch.flip(next_open_BL, [1]), dim=1).values, [1])
    end_BL = torch.cat([rev_min[:, 1:], torch.full((B, 1), L)], dim=1)
    return end_BL


def doc_starts_from_position_ids(position_ids_BL: torch.Tensor) -> torch.Tensor:
    """Document start per token from global-order position ids, (B, L) -> (B, L) int64.

    A new document starts at token 0 and wherever the position does not increase by exactly 1 from
    the previous token (the usual packing convention restarts positions at 0).
    """
    return doc_starts(position_ids_BL.shape[0], position_ids_BL.shape[1], position_ids=position_ids_BL)


def doc_starts(batch: int, seq_len: int, *, position_ids: torch.Tensor | None = None,
               valid: torch.Tensor | None = None, opens: torch.Tensor | None = None) -> torch.Tensor:
    """Document start per token, (B, L) int64, from any combination of:

    * ``position_ids`` (B, L): a document opens where the position does not increase by exactly 1;
    * ``valid`` (B, L) bool padding mask: every padding token is a one-token document of its own
      (it sees only itself), and a document opens after padding;
    * ``opens`` (B, L) bool: explicit document openings.
    """
    opens_BL = _opens(batch, seq_len, position_ids=position_ids, valid=valid, opens=opens)
    idx_L = np.arange(seq_len, dtype=np.int64)
    return torch.from_numpy(np.maximum.accumulate(np.where(opens_BL, idx_L, 0), axis=1))


def _opens(batch: int, seq_len: int, *, position_ids: torch.Tensor | None = None,
           valid: torch.Tensor | None = None, opens: torch.Tensor | None = None) -> np.ndarray:
    """(B, L) bool: the tokens that open a document (see :func:`doc_starts`), token 0 always."""
    B, L = batch, seq_len
    opens_BL = np.zeros((B, L), dtype=bool)
    opens_BL[:, :1] = True
    if position_ids is not None and L > 1:
        pos = np.broadcast_to(position_ids.detach().to("cpu", torch.int64).numpy(), (B, L))
        opens_BL[:, 1:] |= pos[:, 1:] != pos[:, :-1] + 1
    if valid is not None:
        ok = np.broadcast_to(valid.detach().to("cpu", torch.bool).numpy(), (B, L))
        opens_BL |= ~ok
        if L > 1:
            opens_BL[:, 1:] |= ~ok[:, :-1]
    if opens is not None:
        opens_BL |= np.broadcast_to(opens.detach().to("cpu", torch.bool).numpy(), (B, L))
    return opens_BL


def doc_starts_from_cu_seqlens(cu_seqlens_N1: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Document start per token from global ``cu_seqlens`` (N+1,), for one row: -> (1, L) int64."""
    cu = cu_seqlens_N1.to(torch.int64).cpu()
    idx_L = torch.arange(seq_len)
    # index of the document containing token i: last boundary <= i among cu[:-1]
    doc_of_L = torch.searchsorted(cu[:-1].contiguous(), idx_L, right=True) - 1
    return cu[doc_of_L].unsqueeze(0)


def segment_bounds(
    meta: SequenceMeta, spec: MaskSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention-segment ``[start, end)`` per token, (B, L) int64 each: documents cut into chunks."""
    start_BL, end_BL = meta.doc_bounds()
    if spec.chunk_size is not None:
        C = spec.chunk_size
        idx_L = torch.arange(meta.seq_len)
        pos_BL = idx_L - start_BL if meta.position is None else meta.position.expand(meta.batch, meta.seq_len)
        # within a document positions rise by one per token: its chunk opens pos % C tokens earlier
        chunk_start_BL = idx_L - torch.remainder(pos_BL, C)
        end_BL = torch.minimum(end_BL, chunk_start_BL + C)
        start_BL = torch.maximum(start_BL, chunk_start_BL)
    return start_BL, end_BL


def segment_runs(meta: SequenceMeta, chunk_size: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The attention segments of every row as runs: per row, ``(starts, ends)`` (N_seg,) int64 numpy
    arrays, sorted, covering ``[0, L)``: the documents, cut where ``position // chunk_size`` changes.

    The same segments as :func:`segment_bounds` (which gives them per token), computed per document:
    within a document positions rise by one per token, so a document whose first token has position
    ``p0`` is cut ``(-p0) mod C`` tokens after its start (when that is inside it), then every ``C``
    tokens. Cached on ``meta`` per chunk size."""
    if chunk_size in meta._runs:
        return meta._runs[chunk_size]
    B, L = meta.batch, meta.seq_len
    rows = []
    for b in range(B):
        starts = np.zeros(1, dtype=np.int64) if meta.starts is None else meta.starts[b]
        ends = np.append(starts[1:], L)
        if chunk_size is not None:
            C = chunk_size
            p0 = np.zeros_like(starts) if meta.position is None else \
                meta.position.expand(B, L)[b].numpy()[starts].astype(np.int64)
            first = starts + (-p0) % C           # the first chunk start at or after the document's start
            first = np.where(first == starts, first + C, first)
            count = np.maximum(0, (ends - first + C - 1) // C)
            within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
            cuts = np.repeat(first, count) + C * within
            starts = np.sort(np.concatenate([starts, cuts]))
            ends = np.append(starts[1:], L)
        rows.append((starts, ends))
    meta._runs[chunk_size] = rows
    return rows


def dense_mask(meta: SequenceMeta, spec: MaskSpec) -> torch.Tensor:
    """The full (B, L, L) boolean mask ``[b, q, k]``: True where query q sees key k.

    O(L^2) memory: for oracles, tests and benchmark baselines only; the engine never builds it.
    """
    start_BL, _ = segment_bounds(meta, spec)
    lo, hi = spec.band()
    idx_L = torch.arange(meta.seq_len)
    diff_LL = idx_L[None, :] - idx_L[:, None]  # k - q
    band_LL = (diff_LL >= lo) & (diff_LL <= hi)
    same_BLL = start_BL[:, :, None] == start_BL[:, None, :]
    mask = same_BLL & band_LL[None]
    span_end_BL = meta.span_ends() if spec.spans else None
    if span_end_BL is not None:  # a span's later keys: k > q, both in one span (same end)
        in_span_BL = span_end_BL >= 0
        same_span_BLL = (span_end_BL[:, :, None] == span_end_BL[:, None, :]) & in_span_BL[:, :, None]
        mask |= same_span_BLL & (diff_LL > 0)[None]
    return mask


def mask_terms(meta: SequenceMeta, spec: MaskSpec) -> list[tuple[list, tuple[int, int]]]:
    """The visible pairs as disjoint terms ``(segments, band)``, what the planner fits: per row
    ``(starts, ends)`` runs (:func:`segment_runs`) and the inclusive band ``(lo, hi)`` on ``k - q``
    (clipped to ``[-L, L]``) of the pairs inside one run. The attention segments under the mask's
    band; for a layer that opens the batch's bidirectional spans, also the spans under the band of
    the later keys they add (:meth:`MaskSpec.span_band`). A query's pairs from several terms are
    merged by log-sum-exp like any two kernel calls over the same rows."""
    L = meta.seq_len
    lo, hi = spec.band()
    terms = [(segment_runs(meta, spec.chunk_size), (int(max(lo, -L)), int(min(hi, L))))]
    extra = spec.span_band()
    if extra is not None and meta.spans is not None:
        terms.append((list(meta.spans), (int(extra[0]), L)))
    return terms


# ----------------------------------------------------------------------------------------------
# the varlen contract's semantics (every backend, the ring, the planner and the kernels use them)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results, ``lse`` and gradients accumulate in: float64 for float64 inputs, else
    float32 (the contract's rule, used by every backend, the ring and the compiled op)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_key_intervals(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, causal: bool, window: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every packed query row, the packed key rows ``[lo, hi)`` it sees (CPU int64, (Tq,) each).

    Implements the bottom-right alignment of the contract; ``hi <= lo`` means the row sees nothing.
    """
    cu_q = cu_seqlens_q.detach().to("cpu", torch.int64)
    cu_k = cu_seqlens_k.detach().to("cpu", torch.int64)
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    total_q = int(cu_q[-1])
    seq_of_T = torch.repeat_interleave(torch.arange(len(len_q)), len_q, output_size=total_q)
    i_T = torch.arange(total_q) - cu_q[seq_of_T]
    lk_T = len_k[seq_of_T]
    diag_T = i_T + lk_T - len_q[seq_of_T]  # key aligned with query i (bottom-right)
    left, right = window
    if causal:
        right = 0
    lo_T = torch.zeros_like(i_T) if left < 0 else (diag_T - left).clamp(min=0)
    hi_T = lk_T.clone() if right < 0 else torch.minimum(lk_T, diag_T + right + 1)
    base_T = cu_k[:-1][seq_of_T]
    return lo_T + base_T, torch.maximum(hi_T, lo_T) + base_T
