"""Sequence sharding layouts: which global tokens each rank holds, in which local order.

A sequence of ``L`` tokens is cut into ``n`` consecutive slices whose sizes differ by at most one
(the first ``L % n`` slices hold one extra token), so any ``L >= world_size`` is accepted and nothing
is truncated or padded.

* ``"contiguous"``: ``n = P`` slices, rank ``r`` holds slice ``r``.
* ``"zigzag"``: ``n = 2P`` slices, rank ``r`` holds slices ``r`` and ``2P-1-r`` in that order, which
  balances causal work (early and late tokens on every rank).

Local order is always increasing global order.
"""

from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "check_layout", "slice_bounds", "rank_ranges", "local_lengths",
           "global_index", "shard", "unshard", "infer_seq_len"]

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def slice_bounds(seq_len: int, n: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``n`` consecutive slices of ``seq_len`` tokens, sizes differing by <= 1."""
    base, extra = divmod(seq_len, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def rank_ranges(seq_len: int, world_size: int, layout: str, rank: int) -> list[tuple[int, int]]:
    """Global ``[start, end)`` ranges held by ``rank``, in local order (empty ranges dropped)."""
    check_layout(layout)
    if layout == "contiguous":
        ranges = [slice_bounds(seq_len, world_size)[rank]]
    else:
        bounds = slice_bounds(seq_len, 2 * world_size)
        ranges = [bounds[rank], bounds[2 * world_size - 1 - rank]]
    return [(a, b) for a, b in ranges if b > a]


def local_lengths(seq_len: int, world_size: int, layout: str) -> list[int]:
    """Number of tokens each rank holds."""
    return [sum(b - a for a, b in rank_ranges(seq_len, world_size, layout, r)) for r in range(world_size)]


def global_index(seq_len: int, world_size: int, layout: str, rank: int) -> torch.Tensor:
    """Global index of each of ``rank``'s tokens, (L_local,) int64, increasing."""
    parts = [torch.arange(a, b) for a, b in rank_ranges(seq_len, world_size, layout, rank)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def infer_seq_len(lengths: list[int], world_size: int, layout: str) -> int:
    """The global length implied by every rank's local length; ValueError if the layout disagrees."""
    seq_len = sum(lengths)
    expected = local_lengths(seq_len, world_size, layout)
    if list(lengths) != expected:
        raise ValueError(
            f"local sequence lengths {list(lengths)} across ranks do not match the {layout!r} layout of "
            f"{seq_len} tokens over {world_size} ranks, which gives {expected}; shard inputs with "
            f"cp.shard(x, dim=1) (or cp_attention.layout.shard) using the same layout")
    if seq_len < world_size:
        raise ValueError(f"sequence length {seq_len} is shorter than the world size {world_size}: every "
                         f"rank needs at least one token")
    return seq_len


def shard(x: torch.Tensor, dim: int, world_size: int, layout: str, rank: int) -> torch.Tensor:
    """``rank``'s shard of a full-length tensor along ``dim`` (a view when the layout allows)."""
    seq_len = x.shape[dim]
    if seq_len < world_size:
        raise ValueError(f"cannot shard a length-{seq_len} dimension over {world_size} ranks: every "
                         f"rank needs at least one token")
    parts = [x.narrow(dim, a, b - a) for a, b in rank_ranges(seq_len, world_size, layout, rank)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard(parts: list[torch.Tensor], dim: int, layout: str) -> torch.Tensor:
    """Reassemble every rank's shard (in rank order) into the full tensor in global token order."""
    world_size = len(parts)
    seq_len = sum(p.shape[dim] for p in parts)
    pieces: list[tuple[int, torch.Tensor]] = []
    for r, part in enumerate(parts):
        offset = 0
        for a, b in rank_ranges(seq_len, world_size, layout, r):
            pieces.append((a, part.narrow(dim, offset, b - a)))
            offset += b - a
    pieces.sort(key=lambda item: item[0])
    return torch.cat([p for _, p in pieces], dim=dim)
