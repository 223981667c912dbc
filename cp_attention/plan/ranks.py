"""Every rank's token runs under a layout, and which ranks hold the tokens of given global ranges.

The planner needs the runs of the ranks a rank exchanges with, and to find those ranks without
looking at every other one: a rank's queries see keys only inside the attention segments they share,
so its peers are the ranks holding tokens in its segments' reach (:meth:`RankRuns.holders`, an
interval index over all ranks' runs, which partition ``[0, L)``).

Legend: ``P`` ranks, ``L`` global length, ``N`` runs of all ranks together.
"""

from __future__ import annotations

import functools

import numpy as np

from .. import layout as layout_mod

__all__ = ["RankRuns", "rank_runs"]


class RankRuns:
    """The runs of ``world_size`` ranks over ``seq_len`` tokens (immutable once built).

    ``runs[r]``: rank ``r``'s global ``[start, end)`` runs in local order; ``sizes[r]``: its token count.
    Flat (N,) int64 arrays in rank-major local order: ``rank``, ``start``, ``end``, ``local`` (the
    local index of the run's first token); and the same runs sorted by global start (``by_start``: their
    indices into the flat arrays), for :meth:`holders`."""

    def __init__(self, seq_len: int, world_size: int, runs: tuple[tuple[tuple[int, int], ...], ...]):
        n_R = np.array([len(rr) for rr in runs], dtype=np.int64)
        flat = np.array([x for rr in runs for run in rr for x in run], dtype=np.int64).reshape(-1, 2)
        self._setup(seq_len, world_size, np.repeat(np.arange(world_size, dtype=np.int64), n_R), flat[:, 0].copy(),
                    flat[:, 1].copy(), n_R)
        self._runs = runs

    @classmethod
    def of_arrays(cls, seq_len: int, world_size: int, rank: np.ndarray, start: np.ndarray,
                  end: np.ndarray) -> RankRuns:
        """The runs given as flat (N,) int64 arrays in rank-major local order (``runs`` built on first read)."""
        index = object.__new__(cls)
        index._setup(seq_len, world_size, rank, start, end, np.bincount(rank, minlength=world_size).astype(np.int64))
        index._runs = None
        return index

    def _setup(self, seq_len: int, world_size: int, rank: np.ndarray, start: np.ndarray, end: np.ndarray,
               n_R: np.ndarray) -> None:
        self.seq_len, self.world_size = seq_len, world_size
        self.rank, self.start, self.end = rank, start, end
        width = self.end - self.start
        size_R = np.zeros(world_size, dtype=np.int64)
        np.add.at(size_R, self.rank, width)
        self.sizes = tuple(size_R.tolist())
        before = np.cumsum(width) - width  # tokens in all earlier runs
        first = np.minimum(np.cumsum(n_R) - n_R, max(len(start) - 1, 0))  # each rank's first run (if any)
        self.local = before - np.repeat(before[first] if len(start) else n_R, n_R)
        self.by_start = np.argsort(self.start, kind="stable")
        self._starts, self._ends = self.start[self.by_start], self.end[self.by_start]
        for a in (self.rank, self.start, self.end, self.local, self.by_start, self._starts, self._ends):
            a.setflags(write=False)

    @property
    def runs(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Every rank's runs as tuples: ``runs[r]`` rank ``r``'s ``(start, end)`` in local order."""
        if self._runs is None:
            cut = np.cumsum(np.bincount(self.rank, minlength=self.world_size))[:-1].tolist()
            pairs = list(zip(self.start.tolist(), self.end.tolist()))
            self._runs = tuple(tuple(pairs[a:b]) for a, b in zip([0] + cut, cut + [len(pairs)]))
        return self._runs

    def holders(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The ranks holding at least one token of some global range ``[lo[i], hi[i])`` (empty ranges
        ignored), sorted, (n,) int64. O(N + len(lo)): the ranges' runs are marked on a difference array."""
        lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
        keep = hi > lo
        i0 = np.searchsorted(self._ends, lo[keep], side="right")  # the first run ending after lo
        i1 = np.searchsorted(self._starts, hi[keep], side="left")  # ... the runs starting before hi
        mark = np.zeros(len(self._starts) + 1, dtype=np.int64)
        np.add.at(mark, i0, 1)
        np.add.at(mark, i1, -1)
        covered = np.cumsum(mark[:-1]) > 0
        return np.unique(self.rank[self.by_start[covered]])


@functools.lru_cache(maxsize=16)
def rank_runs(seq_len: int, world_size: int, layout) -> RankRuns:
    """Every rank's runs of ``layout`` (a name, a named layout or a :class:`~cp_attention.layout.Layout`;
    ``layout.rank_ranges`` is the definition). Raises ValueError as ``rank_ranges`` does (a Layout
    built for another length or world size). Cached: one planning step reads the same layout's runs
    for every mask and every candidate of strategy="auto" (a Layout is immutable and hashed by
    identity, a named layout by its name)."""
    lay = layout_mod.check_layout(layout)
    return RankRuns(seq_len, world_size, tuple(tuple(lay.rank_ranges(seq_len, world_size, r))
                                               for r in range(world_size)))
