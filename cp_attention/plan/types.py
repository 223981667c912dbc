"""The plan's types: what one rank runs in one attention call (its kernel calls, the K/V it receives
and sends in each round) and what that costs (:class:`PlanStats`). Built by :mod:`.build`, checked by
:mod:`.verify`, executed by the strategies (:mod:`cp_attention.strategies`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..masks import MaskSpec

__all__ = ["KernelCall", "Step", "Round", "PlanStats", "RankPlan", "WORK_TILE", "clipped_band"]

WORK_TILE = 128  # query rows per tile when counting computed score entries


@dataclass(frozen=True, eq=False)
class KernelCall:
    """One varlen kernel call: query rows ``[q_start, q_end)`` of this rank's packed queries
    (row ``b``, token ``i`` is ``b * L_local + i``) against rows ``[k_start, k_end)`` of the step's
    packed K/V buffer. ``cu_seqlens_q/k`` (int32, CPU) are relative to those starts."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window: tuple[int, int]
    entries_computed: int
    entries_visible: int
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def cu_seqlens_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cu_seqlens_q/k`` on ``device``, copied once per plan and device."""
        key = str(device)
        if key not in self._device_cache:
            self._device_cache[key] = (self.cu_seqlens_q.to(device, non_blocking=True),
                                       self.cu_seqlens_k.to(device, non_blocking=True))
        return self._device_cache[key]


@dataclass(frozen=True, eq=False)
class Step:
    """Attention of this rank's queries against ``source``'s K/V tokens ``spans``: disjoint
    ascending local ``[start, end)`` ranges of ``source``. The step's K/V buffer holds, for every batch
    row, those tokens concatenated: (B, width, H_kv, D) with ``width`` the summed span lengths."""

    source: int
    spans: tuple[tuple[int, int], ...]
    calls: tuple[KernelCall, ...]

    @property
    def width(self) -> int:
        return sum(b - a for a, b in self.spans)


@dataclass(frozen=True, eq=False)
class Round:
    """Exchange round ``offset``: receive from ``(rank - offset) % P`` and/or send to
    ``(rank + offset) % P`` the local K/V tokens ``send_spans`` (None: nothing that way)."""

    offset: int
    recv: Step | None
    send_to: int | None
    send_spans: tuple[tuple[int, int], ...] | None


@dataclass(frozen=True)
class PlanStats:
    """What one rank's plan will do in one forward (the backward moves the same K/V again, and
    returns dK/dV partial sums of the received spans in float32)."""

    rank: int
    world_size: int
    kernel_calls: int
    rounds: int
    peers_recv: tuple[int, ...]
    peers_send: tuple[int, ...]
    kv_bytes_recv: int
    kv_bytes_sent: int
    grad_bytes_recv: int
    grad_bytes_sent: int
    ring_kv_bytes_recv: int
    """What a full ring (every other rank's whole shard) would deliver to this rank."""
    entries_computed: int
    """Scores a tiled kernel computes: for every tile of ``WORK_TILE`` query rows of a varlen
    sequence, rows x the span of keys those rows see (what the reference backend computes; a
    flash kernel's 2-D blocks compute slightly more on diagonals)."""
    entries_visible: int
    """(query, key) pairs the kernels keep; equals the pairs the mask keeps (verified)."""
    strategy: str = "ring"  # "ring" (K/V moves between token shards), "ulysses" or "usp" (cp_attention.strategies.ulysses)
    ulysses_size: int = 1  # ranks exchanging heads: 1 for the ring, P for "ulysses", the head group for "usp"
    predicted: tuple = ()  # strategy="auto": ((candidate, modeled seconds), ...) it weighed (cp_attention.strategies.choice)
    index_bytes_recv: int = 0  # strategy="select": the key indices other ranks asked this rank for (8 bytes a key)
    index_bytes_sent: int = 0  # strategy="select": the key indices this rank asked the others for
    kv_form: str = "heads"
    """What the ring moved for K/V: "heads" (the keys and values), or "latent" (a multi-head latent attention
    layer's latent rows, which the receiver expands: :mod:`cp_attention.strategies.latent`; ``kv_bytes_*`` are
    then the latent bytes counted as the ring posted them)."""
    kv_form_reason: str = ""
    """For a layer that could move its latent: why this form (the cost model's comparison, or what ruled the
    latent out); "" for every other layer."""
    heads_kv_bytes_recv: int | None = None
    """For a layer that could move its latent: the K/V bytes the heads take (received; the plan's count),
    whichever form moved; None for every other layer."""
    heads_kv_bytes_sent: int | None = None
    """... and sent."""


@dataclass(frozen=True, eq=False)
class RankPlan:
    rank: int
    world_size: int
    batch: int
    local_len: int
    local: Step | None
    rounds: tuple[Round, ...]
    stats: PlanStats

    def steps(self) -> list[Step]:
        return ([self.local] if self.local is not None else []) + [r.recv for r in self.rounds if r.recv]

    def schedule(self) -> list[Round]:
        """One round per offset 1..P-1, empty ones included. Every rank walks this same sequence,
        so the messages between any two ranks are posted in the same order on both sides (NCCL
        matches point-to-point messages by order, not by tag)."""
        by_offset = {r.offset: r for r in self.rounds}
        return [by_offset.get(t, Round(offset=t, recv=None, send_to=None, send_spans=None))
                for t in range(1, self.world_size)]


def clipped_band(spec: MaskSpec, seq_len: int) -> tuple[int, int]:
    """``spec.band()`` (the offsets ``[lo, hi]`` of the keys a query may see) clipped to ``+-seq_len``."""
    lo, hi = spec.band()
    return int(max(lo, -seq_len)), int(min(hi, seq_len))
