"""Every rank's ring-plan statistics at once, without building the plans: what ``strategy="auto"``'s
cost model reads (:mod:`cp_attention.strategies.pricing`).

:func:`ring_summary` gives, for the ring over the ``P`` ranks of a layout, exactly the numbers that
:func:`.build.build_plan` gives rank by rank: each rank's computed score entries
(:attr:`PlanStats.entries_computed`) and visible pairs, and for every ordered pair of ranks
``(r, s)``, ``r != s``, with a visible pair between ``r``'s queries and ``s``'s keys, the width of
the K/V spans ``r`` receives from ``s`` (its round's :attr:`Step.width`, equal to the width of the
``send_spans`` of ``s``'s round towards ``r``). The rounds follow: rank ``r`` has a round at offset
``t`` when it receives from ``r - t`` or sends to ``r + t`` (mod ``P``).

How, on pieces as the planner (:mod:`.build`), but for all ranks together with numpy, per batch
row and mask term:

* every rank's pieces (maximal ranges of its tokens inside one attention segment), sorted by
  position; for each query piece the key pieces it reaches (inside its segment, within the band's
  ``[a + lo, e + hi)``) form one run of that order (two ``searchsorted``), so the pairs enumerated
  are those with a visible pair, never all ``P^2``;
* a pair where both ranks hold one piece of the segment (the common case: a document inside a
  shard, or a zigzag slice of a longer one) is one varlen sequence whose window, visible pairs and
  tiled work (``WORK_TILE`` rows per tile) are closed forms of the two ranges (the planner's
  ``_fit_ranges`` and ``_seq``), evaluated for all such pairs at once; a pair where every query sees
  every key (most pairs of a long causal document) is its rectangle of rows x keys;
* where a rank holds several pieces of the segment (a zigzag rank's two slices of a document
  crossing the middle of the sequence; a balanced layout's split documents), the planner fits the
  two ranks' pieces together; when only one pair of pieces sees anything, or every live query piece
  sees the same key pieces whole, that fit computes what the pairs compute alone (the closed form
  above, :func:`_blockwise`); otherwise (a rank with itself, a window cutting two pairs of pieces) the
  planner's own :func:`.build.group_sequences` runs, one call per pair of (rank, segment) groups;
* the widths are unions of each pair's key ranges (one sort of all ranges).

Legend: ``P`` ranks, ``L`` global length, ``N`` pieces of a row, ``E`` pairs of pieces (or of ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..masks import MaskSpec, SequenceMeta, mask_terms
from .build import group_sequences
from .ranks import RankRuns, rank_runs
from .types import WORK_TILE

__all__ = ["RingSummary", "ring_summary"]


@dataclass(frozen=True, eq=False)
class RingSummary:
    """What every rank's ring plan over one layout does (see the module docstring). Arrays are int64.

    ``sizes[r]``: rank ``r``'s tokens; ``entries[r]`` / ``visible[r]``: its plan's
    ``entries_computed`` / ``entries_visible``; ``recv_rank[i]`` receives ``width[i]`` tokens per batch
    row from ``send_rank[i]`` (each ordered pair once, ``recv_rank != send_rank``, sorted by
    ``(recv_rank, send_rank)``)."""

    world_size: int
    sizes: tuple[int, ...]
    entries: np.ndarray
    visible: np.ndarray
    recv_rank: np.ndarray
    send_rank: np.ndarray
    width: np.ndarray

    def rounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's rounds, as its plan has them: ``(rank, offset, tokens in, tokens out)``, (n,)
        each, sorted by rank then offset; ``tokens in`` from ``(rank - offset) % P``, ``tokens out`` to
        ``(rank + offset) % P`` (0: nothing that way)."""
        P = self.world_size
        offset = (self.recv_rank - self.send_rank) % P
        # a pair is rank r's receiving round and rank s's sending round, at the same offset
        rank = np.concatenate([self.recv_rank, self.send_rank])
        off = np.concatenate([offset, offset])
        n_in = np.concatenate([self.width, np.zeros_like(self.width)])
        n_out = np.concatenate([np.zeros_like(self.width), self.width])
        key = rank * P + off
        order = np.argsort(key, kind="stable")
        key, n_in, n_out = key[order], n_in[order], n_out[order]
        first = np.flatnonzero(np.diff(key, prepend=-1) != 0) if len(key) else np.zeros(0, dtype=np.int64)
        ukey = key[first]
        return ukey // P, ukey % P, np.add.reduceat(n_in, first) if len(key) else n_in, \
            np.add.reduceat(n_out, first) if len(key) else n_out


def ring_summary(meta: SequenceMeta, spec: MaskSpec, *, world_size: int, layout) -> RingSummary:
    """The ring-plan statistics of every rank of ``layout`` over ``world_size`` ranks for the mask
    ``spec`` (the numbers :func:`.build.build_plan` gives each rank; module docstring). Raises
    ValueError as ``build_plan`` does for a layout of another length or world size."""
    P, L = world_size, meta.seq_len
    index = layout if isinstance(layout, RankRuns) else rank_runs(L, P, layout)
    parts = []
    for segs, (lo, hi) in mask_terms(meta, spec):
        if lo > hi:
            continue
        for starts, ends in segs:
            parts.append(_row_sequences(index, starts, ends, lo, hi, L))
    q, k, k0, k1, work, vis = (np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
                               for i in range(6))
    entries, visible = np.zeros(P, dtype=np.int64), np.zeros(P, dtype=np.int64)
    np.add.at(entries, q, work)
    np.add.at(visible, q, vis)
    other = q != k
    recv_rank, send_rank, width = _union_widths(q[other], k[other], k0[other], k1[other], P, L)
    return RingSummary(world_size=P, sizes=index.sizes, entries=entries, visible=visible, recv_rank=recv_rank,
                       send_rank=send_rank, width=width)


def _row_sequences(index: RankRuns, starts: np.ndarray, ends: np.ndarray, lo: int, hi: int, L: int):
    """Every sequence of every rank pair in one batch row and term (segments ``[starts, ends)``, band
    ``lo <= k - q <= hi``): (query rank, key rank, first key, end key (the key rank's local
    positions), work, visible), (E,) int64 each."""
    ra, rb = index.start, index.end
    i0 = np.searchsorted(ends, ra, side="right")  # the first segment ending after the run's start
    i1 = np.searchsorted(starts, rb, side="left")  # ... the segments starting before its end
    cnt = np.maximum(i1 - i0, 0)
    run = np.repeat(np.arange(len(ra)), cnt)
    seg = np.repeat(i0, cnt) + _within(cnt)
    a = np.maximum(ra[run], starts[seg])
    e = np.minimum(rb[run], ends[seg])
    rank = index.rank[run]
    loc = index.local[run] + a - ra[run]
    N = len(a)
    # groups: one rank's pieces of one segment (adjacent in this rank-major, local order)
    new = np.ones(N, dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (seg[1:] != seg[:-1])
    gid = np.cumsum(new) - 1
    g_first = np.flatnonzero(new)
    g_size = np.diff(np.append(g_first, N))
    # the key pieces each query piece reaches: a run of the pieces in position order, inside its segment
    order = np.argsort(a, kind="stable")
    a_s, e_s, seg_s = a[order], e[order], seg[order]
    j0 = np.maximum(np.searchsorted(e_s, a_s + lo, side="right"), np.searchsorted(seg_s, seg_s, side="left"))
    j1 = np.minimum(np.searchsorted(a_s, e_s + hi, side="left"), np.searchsorted(seg_s, seg_s, side="right"))
    n = np.maximum(j1 - j0, 0)
    qp = order[np.repeat(np.arange(N), n)]
    kp = order[np.repeat(j0, n) + _within(n)]
    G = len(g_first)
    full = (a[kp] >= e[qp] - 1 + lo) & (e[kp] - 1 <= a[qp] + hi)  # every query of the pair sees every key
    alone = _blockwise(qp, kp, gid, g_size, full)
    qs, ks = qp[alone & full], kp[alone & full]  # rows x keys, all visible
    area = (e[qs] - a[qs]) * (e[ks] - a[ks])
    out = [(rank[qs], rank[ks], loc[ks], loc[ks] + e[ks] - a[ks], area, area)]
    qs, ks = qp[alone & ~full], kp[alone & ~full]
    f0, Lk, work, vis, live = _fit_pairs(a[qs], e[qs], a[ks], e[ks], lo, hi, L)
    first_key = loc[ks] + f0
    out.append((rank[qs][live], rank[ks][live], first_key[live], (first_key + Lk)[live], work[live], vis[live]))
    pairs = np.unique(gid[qp[~alone]] * G + gid[kp[~alone]])
    rows = []
    for gq, gk in zip((pairs // G).tolist(), (pairs % G).tolist()):
        fq, fk = int(g_first[gq]), int(g_first[gk])
        Q = list(zip(a[fq:fq + g_size[gq]].tolist(), e[fq:fq + g_size[gq]].tolist()))
        K = list(zip(a[fk:fk + g_size[gk]].tolist(), e[fk:fk + g_size[gk]].tolist()))
        g = int(seg[fq])
        seqs: list = []
        group_sequences(seqs, Q, K, int(starts[g]), int(ends[g]), lo, hi, int(loc[fq]), int(loc[fk]))
        rows.extend((int(rank[fq]), int(rank[fk]), sq.k0, sq.k1, sq.work, sq.visible) for sq in seqs)
    if rows:
        out.append(tuple(np.array(col, dtype=np.int64) for col in zip(*rows)))
    return tuple(np.concatenate([o[i] for o in out]) for i in range(6))


def _blockwise(qp, kp, gid, g_size, full) -> np.ndarray:
    """Which reachable (query piece, key piece) pairs ``qp, kp`` (E,) cost what they cost alone, as
    one sequence each (E,) bool: where both ranks hold one piece of the segment; and where a rank holds
    several (a group), in the two cases where the planner's fitting of the two groups, whatever it
    decides, computes exactly what their pairs compute alone:

    * one pair of pieces of the two groups sees anything: its rows are the groups' only rows that
      see a key, each seeing the keys the pair alone gives it, so any fit is the pair's sequence;
    * every live query piece sees every key of the same key pieces (no key piece partly): every
      sequence the planner can make is a full rectangle of rows x keys, whose tiles compute exactly
      its visible pairs, over the same key pieces.

    ``full``: (E,) whether every query of the pair sees every key. Every other pair of groups goes to
    the planner's :func:`.build.group_sequences`."""
    single = (g_size[gid[qp]] == 1) & (g_size[gid[kp]] == 1)
    many = np.flatnonzero(~single)
    if not len(many):
        return single
    # the pairs of pieces of each pair of groups, query piece by query piece (stable: in position order)
    pair = gid[qp[many]] * len(g_size) + gid[kp[many]]
    order = np.argsort(pair, kind="stable")
    pair, mq, mk, whole = pair[order], qp[many][order], kp[many][order], full[many][order].astype(np.int64)
    first = np.flatnonzero(np.diff(pair, prepend=-1) != 0)
    blocks = np.diff(np.append(first, len(pair)))
    # each live query piece's key pieces of the group: a run of them (a reach is one range of positions)
    new_q = np.ones(len(mq), dtype=bool)
    new_q[1:] = (mq[1:] != mq[:-1]) | (pair[1:] != pair[:-1])
    q_first = np.flatnonzero(new_q)
    q_last = np.append(q_first[1:], len(mq)) - 1
    per_pair = np.searchsorted(first, q_first, side="right") - 1  # the pair of groups of each live query piece
    k_lo, k_hi = mk[q_first], mk[q_last]
    pair_first = np.flatnonzero(np.diff(per_pair, prepend=-1) != 0)
    same_keys = (np.minimum.reduceat(k_lo, pair_first) == np.maximum.reduceat(k_lo, pair_first)) & \
        (np.minimum.reduceat(k_hi, pair_first) == np.maximum.reduceat(k_hi, pair_first))
    easy = (blocks == 1) | ((np.add.reduceat(whole, first) == blocks) & same_keys)
    single[many[order]] = np.repeat(easy, blocks)
    return single


def _within(count: np.ndarray) -> np.ndarray:
    """``0, 1, .., count[i] - 1`` for every ``i``, concatenated."""
    total = int(count.sum())
    return np.arange(total) - np.repeat(np.cumsum(count) - count, count)


def _clip(x, lo, hi):
    return np.minimum(np.maximum(x, lo), hi)


def _clipped_sums(c, step: int, n, lo, hi):
    """``sum(min(max(c + step * t, lo), hi) for t in range(n))`` elementwise, in closed form (``step >
    0``, ``lo < hi``; an unbounded side is a bound beyond every term)."""
    n_lo = _clip((lo - c) // step + 1, 0, n)  # terms at or below lo
    n_hi = _clip(-((c - hi) // step), 0, n)    # terms below hi
    series = (n_hi - n_lo) * c + step * (n_hi * (n_hi - 1) - n_lo * (n_lo - 1)) // 2
    return n_lo * lo + series + (n - n_hi) * hi


def _fit_pairs(qa, qb, ka, kb, lo: int, hi: int, L: int):
    """For query ranges ``[qa, qb)`` and key ranges ``[ka, kb)`` of one segment (arrays, one pair per
    element) under the band ``lo <= k - q <= hi``: the one bottom-right sequence each pair is (query
    ``q`` sees keys ``[clip(q + lo - ka), clip(q + hi + 1 - ka))`` of the range, one line of slope 1),
    as ``(first key, keys, work, visible, live)``: its keys relative to ``ka``, the score entries a
    kernel tiled by ``WORK_TILE`` query rows computes (rows x the keys from the tile's first row's
    first key to its last row's last), the visible pairs, and whether it sees anything."""
    first = np.maximum(qa, ka - hi)  # the first and last rows that see a key
    last = np.minimum(qb, kb - lo) - 1
    live = last >= first
    nk = kb - ka
    k0 = _clip(first + lo - ka, 0, nk)
    k1 = _clip(last + hi + 1 - ka, 0, nk)
    Lq, Lk = last - first + 1, k1 - k0
    off = Lk - Lq
    free = 4 * (L + WORK_TILE)  # a window side no row reaches: "unlimited"
    low_last = _clip(last + lo - ka, 0, nk) - k0  # the last row's first key, the first row's end
    high_first = _clip(first + hi + 1 - ka, 0, nk) - k0
    left = np.where(low_last > 0, Lq - 1 + off - low_last, free)
    right = np.where(high_first < Lk, high_first - 1 - off, free)
    # row j sees [max(0, j + off - left), min(Lk, j + off + right + 1))
    visible = _clipped_sums(off + right + 1, 1, Lq, 0, Lk) - _clipped_sums(off - left, 1, Lq, 0, Lk)
    full, rest = np.divmod(Lq, WORK_TILE)
    tiles = _clipped_sums(WORK_TILE + off + right, WORK_TILE, full, -free, Lk) - \
        _clipped_sums(off - left, WORK_TILE, full, 0, free)
    tail = rest * (np.minimum(Lk, Lq + off + right) - np.maximum(0, Lq - rest + off - left))
    work = WORK_TILE * tiles + tail
    return k0, Lk, work, visible, live


def _union_widths(q, k, k0, k1, P: int, L: int):
    """Per ordered pair ``(q, k)``: the length of the union of its ranges ``[k0, k1)`` (positions
    below ``L``). Returns (pairs' q, pairs' k, widths), sorted by pair."""
    key = q * P + k
    order = np.lexsort((k0, key))
    key = key[order]
    a = key * (L + 1) + k0[order]  # pairs apart: no range of one pair reaches the next pair's
    b = key * (L + 1) + k1[order]
    reach = np.concatenate([[np.iinfo(np.int64).min], np.maximum.accumulate(b)[:-1]]) if len(b) else b
    gain = np.maximum(b - np.maximum(a, reach), 0)
    first = np.flatnonzero(np.diff(key, prepend=-1) != 0) if len(key) else np.zeros(0, dtype=np.int64)
    width = np.add.reduceat(gain, first) if len(key) else gain
    return key[first] // P, key[first] % P, width
