"""Sequence sharding layouts: which global tokens each rank holds, in which local order.

A sequence of ``L`` tokens is cut into ``n`` consecutive slices whose sizes differ by at most one
(the first ``L % n`` slices hold one extra token), so any ``L >= world_size`` is accepted and nothing
is truncated or padded.

* ``"contiguous"``: ``n = P`` slices, rank ``r`` holds slice ``r``.
* ``"zigzag"``: ``n = 2P`` slices, rank ``r`` holds slices ``r`` and ``2P-1-r`` in that order, which
  balances causal work (early and late tokens on every rank).

Any other assignment of tokens to ranks is a :class:`Layout` object (for example one balanced
for a batch's documents by :func:`cp_attention.balanced_layout`).

Layouts are objects: :class:`Zigzag`, :class:`Contiguous` and :class:`Layout` answer the same
questions (``rank_ranges``, ``wire_code``), so no function branches on the kind of layout;
:class:`~cp_attention.layout.balanced.Balanced` is a *policy* that makes a :class:`Layout` for each batch
(``context_parallel(layout="balanced")``). A name is parsed once, at the boundary, by
:func:`as_layout`; the functions here also accept a name, for convenience.

Local order is always increasing global order.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch

__all__ = ["LAYOUTS", "Layout", "NamedLayout", "Zigzag", "Contiguous", "as_layout", "merge_ranges",
           "check_layout", "layout_code", "slice_bounds", "rank_ranges", "local_lengths", "global_index", "shard",
           "unshard", "infer_seq_len"]

LAYOUTS = ("zigzag", "contiguous")


class NamedLayout:
    """A layout defined for every length and world size by a rule: :meth:`rank_ranges` says which
    tokens a rank holds. Instances are equal to each other and to their name (``Zigzag() ==
    "zigzag"``), so code that compared a context's layout to a name keeps working."""

    name = ""
    per_batch = False

    def __eq__(self, other) -> bool:
        if isinstance(other, str):
            return other == self.name
        return isinstance(other, NamedLayout) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def label(self) -> str:
        """How messages name the layout."""
        return repr(self.name)

    def rank_ranges(self, seq_len: int, world_size: int, rank: int) -> list[tuple[int, int]]:
        """Global ``[start, end)`` ranges held by ``rank``, in local order (empty ranges dropped)."""
        raise NotImplementedError

    @property
    def wire_code(self) -> int:
        """One int identifying the layout across ranks (the agreement header's field)."""
        return LAYOUTS.index(self.name)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, eq=False)
class Zigzag(NamedLayout):
    """``2P`` slices; rank ``r`` holds slices ``r`` and ``2P-1-r`` (balances one causal sequence)."""

    name = "zigzag"

    def rank_ranges(self, seq_len: int, world_size: int, rank: int) -> list[tuple[int, int]]:
        n = 2 * world_size
        ranges = [slice_bound(seq_len, n, rank), slice_bound(seq_len, n, n - 1 - rank)]
        return [(a, b) for a, b in ranges if b > a]


@dataclass(frozen=True, eq=False)
class Contiguous(NamedLayout):
    """``P`` slices; rank ``r`` holds slice ``r``."""

    name = "contiguous"

    def rank_ranges(self, seq_len: int, world_size: int, rank: int) -> list[tuple[int, int]]:
        a, b = slice_bound(seq_len, world_size, rank)
        return [(a, b)] if b > a else []


def as_layout(layout):
    """The layout object for ``layout``: a name (``"zigzag"``, ``"contiguous"``) or an object, returned
    as it is. Raises ValueError naming the valid options (``"balanced"``, a per-batch policy, is
    parsed by :func:`cp_attention.layout.balanced.as_policy`)."""
    if isinstance(layout, (NamedLayout, Layout)):
        return layout
    named = {"zigzag": Zigzag, "contiguous": Contiguous}
    if isinstance(layout, str) and layout in named:
        return named[layout]()
    raise ValueError(f"layout must be one of {tuple(named)} or a cp_attention.layout.Layout, got {layout!r}")


@dataclass(frozen=True, eq=False)
class Layout:
    """Which global tokens each rank holds, for sequences of ``seq_len`` tokens.

    ``ranges[r]``: rank ``r``'s tokens as sorted, disjoint ``[start, end)`` runs of global indices;
    together the ranks' runs cover ``[0, seq_len)`` exactly once and every rank holds at least one
    token. A rank's local order is increasing global order. Compared by identity (plans are cached
    per layout object); :attr:`code` identifies its content across ranks."""

    seq_len: int
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        covered = []
        for r, runs in enumerate(self.ranges):
            if not runs:
                raise ValueError(f"Layout: rank {r} holds no token; every rank needs at least one")
            for a, b in runs:
                if not 0 <= a < b <= self.seq_len:
                    raise ValueError(f"Layout: rank {r} has run [{a}, {b}) outside [0, {self.seq_len}) or empty")
            if any(runs[i][1] > runs[i + 1][0] for i in range(len(runs) - 1)):
                raise ValueError(f"Layout: rank {r}'s runs must be sorted and disjoint, got {runs[:8]}")
            covered.extend(runs)
        covered.sort()
        at = 0
        for a, b in covered:
            if a != at:
                raise ValueError(f"Layout: tokens [{min(a, at)}, {max(a, at)}) are held by no rank or by two")
            at = b
        if at != self.seq_len:
            raise ValueError(f"Layout: tokens [{at}, {self.seq_len}) are held by no rank")

    @classmethod
    def of_valid(cls, seq_len: int, ranges, name: str = "custom") -> Layout:
        """A Layout of ``ranges`` derived from a checked layout (their union is one by construction),
        without checking them again (O(runs log runs))."""
        layout = object.__new__(cls)
        for field, value in (("seq_len", seq_len), ("ranges", ranges), ("name", name)):
            object.__setattr__(layout, field, value)
        return layout

    @property
    def world_size(self) -> int:
        return len(self.ranges)

    def indices(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s increasing global token indices, (L_local,) int64."""
        return torch.cat([torch.arange(a, b) for a, b in self.ranges[rank]])

    def local_lengths(self) -> list[int]:
        return [sum(b - a for a, b in runs) for runs in self.ranges]

    per_batch = False

    def rank_ranges(self, seq_len: int, world_size: int, rank: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s runs; ValueError unless ``seq_len`` and ``world_size`` are the layout's."""
        if (seq_len, world_size) != (self.seq_len, self.world_size):
            raise ValueError(f"the layout is for {self.seq_len} tokens over {self.world_size} ranks, not "
                             f"{seq_len} tokens over {world_size}; build it for this batch (balanced_layout)")
        return list(self.ranges[rank])

    @property
    def wire_code(self) -> int:
        """One int identifying the layout across ranks (distinct from the named layouts' codes)."""
        return self.code + len(LAYOUTS)

    def __str__(self) -> str:
        return repr(self)

    @property
    def label(self) -> str:
        """How messages name the layout."""
        return repr(self)

    @functools.cached_property
    def code(self) -> int:
        """A positive 31-bit checksum of the assignment (ranks compare layouts by it)."""
        flat = [self.seq_len] + [x for runs in self.ranges for run in runs for x in run] + [-1]
        return zlib.crc32(torch.tensor(flat, dtype=torch.int64).numpy().tobytes()) & 0x7FFFFFFF

    @classmethod
    def named(cls, name: str, seq_len: int, world_size: int) -> Layout:
        """The ``"zigzag"`` or ``"contiguous"`` layout of ``seq_len`` tokens as an object."""
        scheme = as_layout(name)
        return cls(seq_len, tuple(tuple(scheme.rank_ranges(seq_len, world_size, r)) for r in range(world_size)),
                   name=str(scheme))

    def __repr__(self) -> str:
        return (f"Layout({self.name!r}, seq_len={self.seq_len}, world_size={self.world_size}, "
                f"runs per rank={[len(r) for r in self.ranges]}, tokens per rank={self.local_lengths()})")


def merge_ranges(ranges) -> list[tuple[int, int]]:
    """Sorted ``[start, end)`` ranges with overlapping and touching ones joined."""
    merged: list[list[int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def check_layout(layout) -> NamedLayout | Layout:
    """:func:`as_layout` for one attention call or one sharding (no per-batch policy)."""
    return as_layout(layout)


def layout_code(layout) -> int:
    """One int identifying a layout across ranks (its ``wire_code``)."""
    return as_layout(layout).wire_code


def slice_bounds(seq_len: int, n: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``n`` consecutive slices of ``seq_len`` tokens, sizes differing by <= 1."""
    return [slice_bound(seq_len, n, i) for i in range(n)]


def slice_bound(seq_len: int, n: int, i: int) -> tuple[int, int]:
    """``[start, end)`` of slice ``i`` of :func:`slice_bounds` in closed form: the first
    ``seq_len % n`` slices hold one token more."""
    base, extra = divmod(seq_len, n)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def rank_ranges(seq_len: int, world_size: int, layout, rank: int) -> list[tuple[int, int]]:
    """Global ``[start, end)`` ranges held by ``rank``, in local order (empty ranges dropped)."""
    return as_layout(layout).rank_ranges(seq_len, world_size, rank)


def local_lengths(seq_len: int, world_size: int, layout) -> list[int]:
    """Number of tokens each rank holds."""
    return [sum(b - a for a, b in rank_ranges(seq_len, world_size, layout, r)) for r in range(world_size)]


def global_index(seq_len: int, world_size: int, layout, rank: int) -> torch.Tensor:
    """Global index of each of ``rank``'s tokens, (L_local,) int64, increasing."""
    parts = [torch.arange(a, b) for a, b in rank_ranges(seq_len, world_size, layout, rank)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def infer_seq_len(lengths: list[int], world_size: int, layout) -> int:
    """The global length implied by every rank's local length; ValueError if the layout disagrees."""
    seq_len = sum(lengths)
    layout = as_layout(layout)
    fixed = getattr(layout, "seq_len", seq_len)  # a Layout is for one length; a NamedLayout for any
    if seq_len != fixed:
        raise ValueError(f"local sequence lengths {list(lengths)} across ranks add up to {seq_len} tokens, but the "
                         f"layout is for {fixed}; shard the inputs with this layout")
    expected = local_lengths(seq_len, world_size, layout)
    if list(lengths) != expected:
        raise ValueError(
            f"local sequence lengths {list(lengths)} across ranks do not match the {layout.label} layout of "
            f"{seq_len} tokens over {world_size} ranks, which gives {expected}; shard inputs with "
            f"cp.shard(x, dim=1) (or cp_attention.layout.shard) using the same layout")
    if seq_len < world_size:
        raise ValueError(f"sequence length {seq_len} is shorter than the world size {world_size}: every "
                         f"rank needs at least one token")
    return seq_len


def shard(x: torch.Tensor, dim: int, world_size: int, layout, rank: int) -> torch.Tensor:
    """``rank``'s shard of a full-length tensor along ``dim`` (a view when the layout allows)."""
    seq_len = x.shape[dim]
    if seq_len < world_size:
        raise ValueError(f"cannot shard a length-{seq_len} dimension over {world_size} ranks: every "
                         f"rank needs at least one token")
    parts = [x.narrow(dim, a, b - a) for a, b in rank_ranges(seq_len, world_size, layout, rank)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard(parts: list[torch.Tensor], dim: int, layout) -> torch.Tensor:
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
