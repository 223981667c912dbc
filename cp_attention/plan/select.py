"""The plan of a layer whose keys are selected per query (:attr:`~cp_attention.masks.MaskSpec.selection`:
index-sparse attention): pure, from the documents, the mask and the layout.

Which keys move depends on the selection, a tensor that exists only when the layer runs, so this
plan holds what every call of the layer on these documents shares: where each global token lives
(its rank and its row there) and, for each of this rank's queries, the inclusive range of global
keys the rest of the mask lets it see. :mod:`cp_attention.strategies.select` intersects the
selection with that range, fetches the selected keys other ranks hold and attends.

Legend: ``B`` batch, ``L`` this rank's tokens, ``T`` tokens of the unsharded row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import global_index, local_lengths
from ..masks import MaskSpec, SequenceMeta, segment_bounds
from .types import PlanStats

__all__ = ["SelectPlan", "build_select_plan", "visible_range", "visible_rows"]


@dataclass(frozen=True, eq=False)
class SelectPlan:
    """One rank's plan of a selected-keys layer (strategy ``"select"``).

    ``q_index`` (L,) int64: the global index of each of this rank's tokens; ``owner`` (T,) int64: the
    rank holding each global token, ``row`` (T,) int64: its index among that rank's tokens;
    ``lengths``: every rank's token count; ``lo``/``hi`` (B, L) int64: the first and last global key
    each query may see before the selection (causal, window, chunk, documents); ``stats``: the static
    part of :class:`~cp_attention.plan.PlanStats` (the traffic is counted when the layer runs)."""

    rank: int
    world_size: int
    batch: int
    local_len: int
    seq_len: int
    q_index: torch.Tensor
    owner: torch.Tensor
    row: torch.Tensor
    lengths: tuple[int, ...]
    lo: torch.Tensor
    hi: torch.Tensor
    stats: PlanStats


def visible_range(meta: SequenceMeta, spec: MaskSpec, q_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inclusive global key range ``[lo, hi]`` that queries ``q_index`` (L,) see under ``spec``
    without a selection, each (B, L) int64: the query's segment (document, cut into chunks)
    intersected with its band (causal, window). Empty when ``hi < lo``."""
    start_BT, end_BT = segment_bounds(meta, spec)
    band_lo, band_hi = spec.band()
    T = meta.seq_len
    lo_BL = start_BT[:, q_index]
    hi_BL = end_BT[:, q_index] - 1
    lo_BL = torch.maximum(lo_BL, q_index[None] + int(max(band_lo, -T)))
    hi_BL = torch.minimum(hi_BL, q_index[None] + int(min(band_hi, T)))
    return lo_BL, hi_BL


def visible_rows(meta: SequenceMeta, spec: MaskSpec, q_index: torch.Tensor) -> torch.Tensor:
    """(B, L, T) bool: which global keys queries ``q_index`` (L,) see under ``spec`` (no selection, no
    spans): the rows of the dense mask an indexer scores against, built from :func:`visible_range`."""
    lo_BL, hi_BL = visible_range(meta, spec, q_index)
    j_T = torch.arange(meta.seq_len)
    return (j_T >= lo_BL[..., None]) & (j_T <= hi_BL[..., None])


def build_select_plan(meta: SequenceMeta, spec: MaskSpec, layout, rank: int, world_size: int) -> SelectPlan:
    """Rank ``rank``'s :class:`SelectPlan` of ``spec`` over ``meta``'s documents sharded by ``layout``
    (one device: ``world_size`` 1, any layout)."""
    if not spec.selection:
        raise ValueError("build_select_plan: the mask selects no keys (MaskSpec(selection=True) expected)")
    if spec.spans:
        raise ValueError("a selection cannot be combined with bidirectional spans")
    T = meta.seq_len
    if world_size == 1:
        q_index = torch.arange(T)
        owner, row, lengths = torch.zeros(T, dtype=torch.int64), torch.arange(T), (T,)
    else:
        lengths = tuple(local_lengths(T, world_size, layout))
        owner = torch.empty(T, dtype=torch.int64)
        row = torch.empty(T, dtype=torch.int64)
        q_index = None
        for r in range(world_size):
            idx = global_index(T, world_size, layout, r)
            owner[idx] = r
            row[idx] = torch.arange(idx.numel())
            if r == rank:
                q_index = idx
    lo, hi = visible_range(meta, spec, q_index)
    L = int(q_index.numel())
    stats = PlanStats(rank=rank, world_size=world_size, kernel_calls=1, rounds=0, peers_recv=(), peers_send=(),
                      kv_bytes_recv=0, kv_bytes_sent=0, grad_bytes_recv=0, grad_bytes_sent=0, ring_kv_bytes_recv=0,
                      entries_computed=0, entries_visible=0, strategy="select")
    return SelectPlan(rank=rank, world_size=world_size, batch=meta.batch, local_len=L, seq_len=T, q_index=q_index,
                      owner=owner, row=row, lengths=lengths, lo=lo, hi=hi, stats=stats)
