"""The planner: a pure function from every rank's token metadata and one mask to each rank's plan.

For every (query rank ``r``, key/value rank ``s``) pair the planner decides: nothing to do, or the
kernel calls (normally one) that compute exactly the visible (query, key) pairs between ``r``'s
queries and the span of ``s``'s keys that ``s`` has to send. Each call carries flash-attn varlen
arguments: ``cu_seqlens_q/k``, max lengths, ``causal`` and ``window=(left, right)`` with bottom-right
alignment (see ``backends/base.py``).

How, on runs rather than tokens: each rank's tokens are cut into *pieces*, maximal ranges of
consecutive global positions inside one attention segment (a document, or a chunk of one). Only the
segments two ranks share can hold visible pairs. For one segment, query ``q`` sees the keys of the
key rank in ``[max(start, q + lo), min(end, q + hi + 1))``: in local key order both ends are
piecewise linear in the query row, so whether the segment's rows form one varlen sequence with a
single bottom-right ``(left, right)`` is decided exactly from the pieces' edges (``_fit``). When they
do not (a window crossing a zigzag gap), each query piece is tried against the key pieces it
reaches, and in the last resort each (query piece, key piece) pair runs alone, which always fits.
Sequences that admit a common ``(left, right)`` and do not overlap share a kernel call. The cost
follows the number of documents, chunks and the rank's peers (the ranks sharing a segment with it),
not the length: milliseconds at a million tokens. :func:`verify_plan` checks a plan token by token
against the mask (tests run it on every plan: ``$CP_ATTENTION_VERIFY_PLANS=1``).

Legend: ``B`` batch rows, ``L`` global length, ``Q``/``K`` a segment's query/key pieces as global
``(start, end)`` ranges, ``R`` packed query rows of a pair (``b * L_r + i``; verification only).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .. import layout as layout_mod
from ..quiet_gc import paused_gc
from ..masks import MaskSpec, SequenceMeta, mask_terms
from .ranks import RankRuns, rank_runs
from .types import WORK_TILE, KernelCall, PlanStats, RankPlan, Round, Step
from .verify import check_plan, check_step

__all__ = ["build_plan", "build_local_plan", "verify_plan", "group_sequences"]


# ----------------------------------------------------------------------------------------------
# a rank's tokens as pieces of attention segments


class _Pieces(NamedTuple):
    """One rank's tokens of one batch row, cut at attention-segment boundaries, in local order
    (python lists, one entry per piece). The pieces of one segment are adjacent in local order."""

    seg: list            # segment index (non-decreasing)
    start: list          # global [start, end)
    end: list
    local: list          # local index of the piece's first token
    first: dict          # segment index -> (index of its first piece, number of pieces)


def _rank_pieces(runs: list[tuple[int, int]], seg_starts: np.ndarray, seg_ends: np.ndarray) -> _Pieces:
    a = np.array([x for x, _ in runs], dtype=np.int64)
    b = np.array([y for _, y in runs], dtype=np.int64)
    loc = np.cumsum(b - a) - (b - a)
    i0 = np.searchsorted(seg_ends, a, side="right")  # the first segment ending after the run's start
    i1 = np.searchsorted(seg_starts, b, side="left")  # ... the segments starting before its end
    count = i1 - i0
    run_of = np.repeat(np.arange(len(a)), count)
    seg = np.repeat(i0, count) + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
    start = np.maximum(a[run_of], seg_starts[seg])
    end = np.minimum(b[run_of], seg_ends[seg])
    local = loc[run_of] + start - a[run_of]
    useg, first, n = np.unique(seg, return_index=True, return_counts=True)
    return _Pieces(seg.tolist(), start.tolist(), end.tolist(), local.tolist(),
                   dict(zip(useg.tolist(), zip(first.tolist(), n.tolist()))))


# ----------------------------------------------------------------------------------------------
# fitting a group of pieces into one bottom-right varlen sequence, exactly


_EMPTY = ()  # a group with no visible pair


@dataclass
class _Seq:
    q0: int
    q1: int
    k0: int
    k1: int
    left: int | None  # exact value, or None when free (any value >= left_min, or unlimited)
    right: int | None
    left_min: int
    right_min: int
    visible: int
    work: int


def _fit(Q: list, K: list, sa: int, sb: int, lo: int, hi: int):
    """Can the query pieces ``Q`` and key pieces ``K`` of segment ``[sa, sb)`` (lists of global
    ``(start, end)``, increasing, each side adjacent in local order) run as one bottom-right varlen
    sequence computing exactly their visible pairs under the band ``lo <= k - q <= hi``?

    Query ``q`` sees the group's keys with global index in ``[max(sa, q + lo), min(sb, q + hi + 1))``:
    in local key order that is ``[cnt(.), cnt(.))`` with ``cnt(x)`` the group's keys below ``x``.
    Both ends are piecewise linear in the local row (slope 0 or 1), breaking only where ``q + lo``
    or ``q + hi + 1`` crosses a key piece's edge or the segment's, and where the query pieces
    meet; so the rows are handled per stretch between breakpoints, checked at both ends of each.

    Returns None (no single sequence), ``_EMPTY`` (nothing visible) or ``(f, Lq, k0, Lk, left,
    right)``: rows ``[f, f + Lq)`` and keys ``[k0, k0 + Lk)`` of the group (local, from its first
    piece), window sides (None: free)."""
    if len(Q) == 1 and len(K) == 1:
        return _fit_ranges(Q[0], K[0], lo, hi)
    kA = [a for a, _ in K]
    kB = [b for _, b in K]
    kC = [0]
    for a, b in K:
        kC.append(kC[-1] + b - a)
    nK = kC[-1]

    def cnt(x: int) -> int:
        j = bisect.bisect_right(kB, x)
        return nK if j == len(kB) else kC[j] + max(0, x - kA[j])

    def low(q: int) -> int:
        return cnt(max(sa, q + lo))

    def up(q: int) -> int:
        return cnt(min(sb, q + hi + 1))

    edges = kA + kB + [sa, sb]
    bps = sorted({x - lo for x in edges} | {x - hi - 1 for x in edges})
    live = []  # (first row, first global position, rows) of the live part of every stretch
    at = 0
    for qa, qb in Q:
        cuts = [qa] + bps[bisect.bisect_right(bps, qa):bisect.bisect_left(bps, qb)] + [qb]
        for s, e in zip(cuts[:-1], cuts[1:]):
            d0, d1 = up(s) - low(s), up(e - 1) - low(e - 1)  # visible keys, linear in between
            if d0 <= 0 and d1 <= 0:
                continue
            a, b = s, e
            if d0 <= 0:       # rising by one per row
                a = s + 1 - d0
            elif d1 <= 0:     # falling by one per row
                b = s + d0
            live.append((at + a - qa, a, b - a))
        at += qb - qa
    if not live:
        return _EMPTY
    for (i0, _, n0), (i1, _, _) in zip(live[:-1], live[1:]):
        if i0 + n0 != i1:  # rows that see nothing between rows that see something
            return None
    f, qf = live[0][0], live[0][1]
    ql = live[-1][1] + live[-1][2] - 1
    Lq = live[-1][0] + live[-1][2] - f
    k0, k1 = low(qf), up(ql)
    Lk = k1 - k0
    off = Lk - Lq
    rlo_last, rhi_first = low(ql) - k0, up(qf) - k0
    left = Lq - 1 + off - rlo_last if rlo_last > 0 else None
    right = rhi_first - 1 - off if rhi_first < Lk else None
    if (left is not None and left < 0) or (right is not None and right < 0):
        return None
    kinks = sorted(j for j in ((None if left is None else left - off),
                               (None if right is None else Lk - off - right - 1)) if j is not None)

    def ok(j: int, q: int) -> bool:
        want_lo = 0 if left is None else max(0, j + off - left)
        want_hi = Lk if right is None else min(Lk, j + off + right + 1)
        return low(q) - k0 == want_lo and up(q) - k0 == want_hi

    for i0, q0, n in live:
        j0 = i0 - f
        cuts = [j0] + [j for j in kinks if j0 < j < j0 + n] + [j0 + n]
        for ja, jb in zip(cuts[:-1], cuts[1:]):
            if not (ok(ja, q0 + ja - j0) and ok(jb - 1, q0 + jb - 1 - j0)):
                return None
    return f, Lq, k0, Lk, left, right


def _fit_ranges(qr: tuple[int, int], kr: tuple[int, int], lo: int, hi: int):
    """:func:`_fit` for one query range and one key range of a segment, in closed form: query ``q``
    sees keys ``[clip(q + lo - ka), clip(q + hi + 1 - ka))`` of ``[ka, kb)`` (clipped to ``[0, kb -
    ka]``), one line of slope 1 clipped on both sides, which a bottom-right window always fits."""
    (qa, qb), (ka, kb) = qr, kr
    first, last = max(qa, ka - hi), min(qb, kb - lo) - 1  # the rows that see a key
    if last < first or lo > hi:
        return _EMPTY
    nk = kb - ka
    k0 = min(max(first + lo - ka, 0), nk)
    k1 = min(max(last + hi + 1 - ka, 0), nk)
    Lq, Lk = last - first + 1, k1 - k0
    off = Lk - Lq
    rlo_last = min(max(last + lo - ka, 0), nk) - k0
    rhi_first = min(max(first + hi + 1 - ka, 0), nk) - k0
    left = Lq - 1 + off - rlo_last if rlo_last > 0 else None
    right = rhi_first - 1 - off if rhi_first < Lk else None
    return first - qa, Lq, k0, Lk, left, right


def _clipped_sum(c: int, step: int, n: int, lo: int | None, hi: int | None) -> int:
    """``sum(min(max(c + step * t, lo), hi) for t in range(n))`` in closed form (``step > 0``;
    ``lo``/``hi`` None: unbounded, else ``lo < hi``): ``lo`` up to the ``n_lo``-th term, ``hi`` from
    the ``n_hi``-th, an arithmetic series between."""
    n_lo = 0 if lo is None else min(max((lo - c) // step + 1, 0), n)   # terms at or below lo
    n_hi = n if hi is None else min(max(-((c - hi) // step), 0), n)     # terms below hi
    series = (n_hi - n_lo) * c + step * (n_hi * (n_hi - 1) - n_lo * (n_lo - 1)) // 2
    return (0 if lo is None else n_lo * lo) + series + (0 if hi is None else (n - n_hi) * hi)


def _seq(fit, q_base: int, k_base: int) -> _Seq:
    """A fitted group as a sequence in packed coordinates, with its visible pairs and the score
    entries a tiled kernel computes (per tile of ``WORK_TILE`` rows: rows x the keys from the
    first row's first key to the last row's last), in closed form over the tiles."""
    f, Lq, k0, Lk, left, right = fit
    off = Lk - Lq
    visible = (Lq * Lk if right is None else _clipped_sum(off + right + 1, 1, Lq, 0, Lk)) - \
        (0 if left is None else _clipped_sum(off - left, 1, Lq, 0, Lk))
    # the tile of rows [a, b] reads keys [max(0, a + off - left), min(Lk, b + off + right + 1))
    full, rest = divmod(Lq, WORK_TILE)
    hi = full * Lk if right is None else _clipped_sum(WORK_TILE + off + right, WORK_TILE, full, None, Lk)
    lo = 0 if left is None else _clipped_sum(off - left, WORK_TILE, full, 0, None)
    work = WORK_TILE * (hi - lo)
    if rest:  # the last tile, rows [Lq - rest, Lq)
        a = Lq - rest
        work += rest * ((Lk if right is None else min(Lk, Lq + off + right)) -
                        (0 if left is None else max(0, a + off - left)))
    return _Seq(q0=q_base + f, q1=q_base + f + Lq, k0=k_base + k0, k1=k_base + k0 + Lk, left=left, right=right,
                left_min=Lk - 1, right_min=Lq - 1, visible=visible, work=work)


def group_sequences(out: list[_Seq], Q: list, K: list, sa: int, sb: int, lo: int, hi: int,
                    q_base: int, k_base: int) -> None:
    """Append the sequences computing exactly the visible pairs of one segment's query pieces
    ``Q`` against its key pieces ``K`` (``q_base``/``k_base``: packed rows of their first tokens).

    Tried in order: the whole group as one sequence (e.g. a zigzag rank's two slices of one causal
    document); each query piece against all key pieces it reaches; each (query piece, key piece)
    pair, which always fits (both contiguous in global positions). The sequences carry ``q0, q1, k0,
    k1`` (packed rows), ``visible`` and ``work`` (score entries computed); :mod:`.summary` reads them
    for the groups of more than one piece."""
    fit = _fit(Q, K, sa, sb, lo, hi)
    if fit is _EMPTY:
        return
    if fit is not None:
        out.append(_seq(fit, q_base, k_base))
        return
    kA = [a for a, _ in K]
    kB = [b for _, b in K]
    kC = [0]
    for a, b in K:
        kC.append(kC[-1] + b - a)
    q_at = 0
    for qa, qb in Q:
        j0 = bisect.bisect_left(kB, qa + lo + 1)   # key pieces ending after the first row's reach
        j1 = bisect.bisect_right(kA, qb - 1 + hi)  # ... starting before the last row's
        if j1 - j0 > 1 and not (len(Q) == 1 and j1 - j0 == len(K)):  # (that was the whole group)
            fit = _fit([(qa, qb)], K[j0:j1], sa, sb, lo, hi)
            if fit is not None:
                if fit is not _EMPTY:
                    out.append(_seq(fit, q_base + q_at, k_base + kC[j0]))
                q_at += qb - qa
                continue
        for j in range(j0, j1):
            fit = _fit([(qa, qb)], [K[j]], sa, sb, lo, hi)
            if fit is None:  # two contiguous ranges always fit (see _fit)
                raise AssertionError(f"planner: no sequence fits queries [{qa}, {qb}) and keys {K[j]} of segment "
                                     f"[{sa}, {sb}) with band ({lo}, {hi}); please report this")
            if fit is not _EMPTY:
                out.append(_seq(fit, q_base + q_at, k_base + kC[j]))
        q_at += qb - qa


def _pair_sequences(pr: list[_Pieces], ps: list[_Pieces], segs, band: tuple[int, int], Lr: int, Ls: int) -> list[_Seq]:
    """All varlen sequences of the queries ``pr`` (one rank's pieces per batch row) against the keys
    ``ps``, in packed coordinates (row ``b``'s local token ``i`` is ``b * L_local + i``)."""
    lo, hi = band
    seqs: list[_Seq] = []
    for b, (qp, kp) in enumerate(zip(pr, ps)):
        starts, ends = segs[b]
        common = qp.first.keys() & kp.first.keys() if len(qp.first) > len(kp.first) else \
            kp.first.keys() & qp.first.keys()
        for g in sorted(common):
            (iq, nq), (ik, nk) = qp.first[g], kp.first[g]
            Q = list(zip(qp.start[iq:iq + nq], qp.end[iq:iq + nq]))
            K = list(zip(kp.start[ik:ik + nk], kp.end[ik:ik + nk]))
            group_sequences(seqs, Q, K, int(starts[g]), int(ends[g]), lo, hi,
                            b * Lr + qp.local[iq], b * Ls + kp.local[ik])
    seqs.sort(key=lambda x: (x.q0, x.k0))
    return seqs


# ----------------------------------------------------------------------------------------------
# grouping sequences into kernel calls


def _merge_side(cur: int | None, cur_min: int, val: int | None, val_min: int):
    """Combine one window side of a call with a sequence's; None if incompatible."""
    if cur is None and val is None:
        return (None, max(cur_min, val_min))
    if cur is None:
        return (val, 0) if val >= cur_min else None
    if val is None:
        return (cur, 0) if cur >= val_min else None
    return (cur, 0) if cur == val else None


def _calls(seqs: list[_Seq], k_shift) -> list[KernelCall]:
    """Group sequences into as few kernel calls as their windows allow; ``k_shift(k)`` converts a
    packed key row of the pair into the step buffer's row."""

    def k_end(k: int) -> int:  # exclusive ends may sit on the next batch row's first index
        return k_shift(k - 1) + 1

    groups: list[dict] = []
    for sq in seqs:
        for grp in groups:
            if sq.q0 < grp["q_end"] or k_shift(sq.k0) < grp["k_end"]:
                continue
            left = _merge_side(grp["left"], grp["left_min"], sq.left, sq.left_min)
            right = _merge_side(grp["right"], grp["right_min"], sq.right, sq.right_min)
            if left is None or right is None:
                continue
            grp["left"], grp["left_min"] = left
            grp["right"], grp["right_min"] = right
            grp["seqs"].append(sq)
            grp["q_end"], grp["k_end"] = sq.q1, k_end(sq.k1)
            break
        else:
            groups.append(dict(left=sq.left, left_min=sq.left_min, right=sq.right, right_min=sq.right_min,
                               seqs=[sq], q_end=sq.q1, k_end=k_end(sq.k1)))
    calls = []
    for grp in groups:
        seq_list = grp["seqs"]
        q_start, k_start = seq_list[0].q0, k_shift(seq_list[0].k0)
        lens_q, lens_k = [], []
        q_at, k_at = q_start, k_start
        for sq in seq_list:
            k0, k1 = k_shift(sq.k0), k_end(sq.k1)
            if sq.q0 > q_at:  # query rows of this range that see nothing in this call
                lens_q.append(sq.q0 - q_at)
                lens_k.append(0)
            if k0 > k_at:  # keys no query of this call uses
                lens_q.append(0)
                lens_k.append(k0 - k_at)
            lens_q.append(sq.q1 - sq.q0)
            lens_k.append(k1 - k0)
            q_at, k_at = sq.q1, k1
        left = -1 if grp["left"] is None else grp["left"]
        right = -1 if grp["right"] is None else grp["right"]
        cu_q = torch.tensor([0] + lens_q, dtype=torch.int64).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, dtype=torch.int64).cumsum(0).to(torch.int32)
        calls.append(KernelCall(
            q_start=q_start, q_end=q_at, k_start=k_start, k_end=k_at, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=right == 0,
            window=(left, right),
            entries_computed=sum(sq.work for sq in seq_list),
            entries_visible=sum(sq.visible for sq in seq_list)))
    return calls


# ----------------------------------------------------------------------------------------------
# the plan of one rank


def _spans(seqs: list[_Seq], Ls: int) -> tuple[tuple[int, int], ...]:
    """Local token ranges of the key rank needed by these sequences: the union over batch rows of
    their key ranges, merged (so each sequence's keys lie inside one range)."""
    ranges = sorted({(sq.k0 % Ls, (sq.k1 - 1) % Ls + 1) for sq in seqs})
    return tuple(layout_mod.merge_ranges(ranges))



def _step(seqs: list[_Seq], source: int, Ls: int, whole: bool) -> Step | None:
    """The step computing ``seqs`` against ``source``'s keys (``whole``: its whole shard, the local
    step; else only the spans the sequences read)."""
    if not seqs:
        return None
    spans = ((0, Ls),) if whole else _spans(seqs, Ls)
    width = sum(b - a for a, b in spans)
    starts = [a for a, _ in spans]
    before = [0]
    for a, b in spans:
        before.append(before[-1] + b - a)

    def k_shift(k: int) -> int:
        b, j = divmod(k, Ls)
        piece = bisect.bisect_right(starts, j) - 1
        return b * width + before[piece] + (j - starts[piece])

    return Step(source=source, spans=spans, calls=tuple(_calls(seqs, k_shift)))


def _peer_offsets(index: RankRuns, mine: list[list[_Pieces]], terms, rank: int) -> list[int]:
    """The round offsets (increasing, 1..P-1) at which ``rank`` may receive or send: those of the
    ranks holding keys its queries reach or queries its keys are reached by, inside the segments of
    its pieces (``mine[t][b]``: its pieces of term ``t``, row ``b``). Query ``q`` of segment ``[sa,
    sb)`` reaches the keys ``[max(sa, q + lo), min(sb, q + hi + 1))``, so a piece ``[a, e)`` reaches
    ``[max(sa, a + lo), min(sb, e + hi))`` and is reached from ``[max(sa, a - hi), min(sb, e - lo))``.
    Any other rank shares no visible pair with ``rank``: skipping it leaves the plan unchanged."""
    P = index.world_size
    recv, send = [], []
    for (segs, (lo, hi)), rows in zip(terms, mine):
        for (starts, ends), pc in zip(segs, rows):
            if not pc.seg:
                continue
            seg = np.asarray(pc.seg, dtype=np.int64)
            a, e = np.asarray(pc.start, dtype=np.int64), np.asarray(pc.end, dtype=np.int64)
            sa, sb = starts[seg], ends[seg]
            recv.append((np.maximum(sa, a + lo), np.minimum(sb, e + hi)))
            send.append((np.maximum(sa, a - hi), np.minimum(sb, e - lo)))
    if not recv:
        return []
    src = index.holders(np.concatenate([x for x, _ in recv]), np.concatenate([y for _, y in recv]))
    dst = index.holders(np.concatenate([x for x, _ in send]), np.concatenate([y for _, y in send]))
    offsets = np.union1d((rank - src) % P, (dst - rank) % P)
    return offsets[offsets > 0].tolist()


@paused_gc
def build_plan(
    meta: SequenceMeta, spec: MaskSpec, *, world_size: int, layout: str | layout_mod.Layout, rank: int, head_kv: int,
    head_dim: int, itemsize: int, grad_itemsize: int = 4, verify: bool | None = None, head_dim_v: int | None = None,
) -> RankPlan:
    """The plan of ``rank``: a pure function of global metadata, identical wherever it is computed.

    Works on runs, not tokens: each rank's token runs (``layout.rank_ranges``) are cut at the
    attention segments (``masks.segment_runs``), and only the segments two ranks share are fitted,
    so its cost follows the numbers of documents, chunks and ranks, not the sequence length. Only
    the ranks holding tokens within the mask's reach of this rank's pieces are visited (an interval
    index over every rank's runs, :mod:`.ranks`); the rounds are those of every offset that has
    something to move, in offset order, as if every offset had been tried.

    Args:
        meta: global document metadata (B rows of L tokens).
        spec: the mask.
        world_size, layout: how the sequence is sharded (``layout.rank_ranges``).
        rank: whose plan to build (any rank can build any rank's plan, e.g. for statistics).
        head_kv, head_dim, head_dim_v, itemsize: K/V heads, k's and v's head dims (v's None: k's), element size.
        grad_itemsize: element size of the dK/dV partial sums returned in the backward pass.
        verify: check every kernel call against the mask token by token (:func:`verify_plan`;
            O(L), for tests and debugging). None: when ``$CP_ATTENTION_VERIFY_PLANS`` is 1.
    """
    layout_mod.check_layout(layout)
    B, P, L = meta.batch, world_size, meta.seq_len
    index = rank_runs(L, P, layout)
    runs, sizes = index.runs, index.sizes
    terms = mask_terms(meta, spec)  # (segments, band) of each part of the mask
    pieces: dict[tuple[int, int], list[_Pieces]] = {}

    def pieces_of(r: int, t: int) -> list[_Pieces]:
        if (r, t) not in pieces:
            pieces[r, t] = [_rank_pieces(runs[r], *terms[t][0][b]) for b in range(B)]
        return pieces[r, t]

    def seqs(r: int, s: int) -> list[_Seq]:  # every term's, in row order
        return sorted((x for t, (segs, band) in enumerate(terms) for x in _pair_sequences(
            pieces_of(r, t), pieces_of(s, t), segs, band, sizes[r], sizes[s])), key=lambda x: (x.q0, x.k0))

    width = head_dim + (head_dim if head_dim_v is None else head_dim_v)  # K and V, each with its own head dim
    token_bytes, grad_token_bytes = head_kv * width * itemsize * B, head_kv * width * grad_itemsize * B
    local = _step(seqs(rank, rank), rank, sizes[rank], whole=True)
    rounds = []
    for t in _peer_offsets(index, [pieces_of(rank, t) for t in range(len(terms))], terms, rank):
        src, dst = (rank - t) % P, (rank + t) % P
        recv = _step(seqs(rank, src), src, sizes[src], whole=False)
        out = seqs(dst, rank)
        if recv is None and not out:
            continue
        rounds.append(Round(offset=t, recv=recv, send_to=dst if out else None,
                            send_spans=_spans(out, sizes[rank]) if out else None))
    plan = _rank_plan(rank, P, B, sizes, local, tuple(rounds), token_bytes, grad_token_bytes)
    if verify or (verify is None and os.environ.get("CP_ATTENTION_VERIFY_PLANS") == "1"):
        verify_plan(plan, meta, spec, layout)
    return plan


def _rank_plan(rank, P, B, sizes, local, rounds, token_bytes, grad_token_bytes) -> RankPlan:
    steps = ([local] if local else []) + [r.recv for r in rounds if r.recv]
    calls = [c for st in steps for c in st.calls]
    recv_tokens = sum(r.recv.width for r in rounds if r.recv)
    sent_tokens = sum(b - a for r in rounds if r.send_spans for a, b in r.send_spans)
    stats = PlanStats(
        rank=rank, world_size=P, kernel_calls=len(calls),
        rounds=len(rounds),
        peers_recv=tuple(r.recv.source for r in rounds if r.recv),
        peers_send=tuple(r.send_to for r in rounds if r.send_to is not None),
        kv_bytes_recv=recv_tokens * token_bytes, kv_bytes_sent=sent_tokens * token_bytes,
        grad_bytes_recv=sent_tokens * grad_token_bytes, grad_bytes_sent=recv_tokens * grad_token_bytes,
        ring_kv_bytes_recv=(sum(sizes) - sizes[rank]) * token_bytes,
        entries_computed=sum(c.entries_computed for c in calls),
        entries_visible=sum(c.entries_visible for c in calls))
    return RankPlan(rank=rank, world_size=P, batch=B, local_len=sizes[rank], local=local,
                    rounds=rounds, stats=stats)


def _index_runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    """Global ``[start, end)`` runs of consecutive values of an increasing index tensor."""
    if idx.numel() == 0:
        return []
    x = idx.to("cpu", torch.int64).numpy()
    cut = np.flatnonzero(np.diff(x) != 1) + 1
    firsts = np.concatenate([[0], cut])
    lasts = np.concatenate([cut, [len(x)]]) - 1
    return list(zip(x[firsts].tolist(), (x[lasts] + 1).tolist()))


def build_local_plan(
    meta: SequenceMeta, spec: MaskSpec, *, q_idx: torch.Tensor, k_idx: torch.Tensor, verify: bool | None = None,
) -> RankPlan:
    """A single-device plan for queries and keys at arbitrary increasing positions, e.g. the new
    tokens of a generation step (``q_idx``, (Lq,)) against the keys of a KV cache (``k_idx``,
    (Lk,), possibly a sliding window of it). ``meta`` covers every position up to
    ``max(q_idx[-1], k_idx[-1])``. Traffic statistics are zero."""
    q_runs, k_runs = _index_runs(q_idx), _index_runs(k_idx)
    Lq, Lk = q_idx.numel(), k_idx.numel()
    seqs = sorted((x for segs, band in mask_terms(meta, spec) for x in _pair_sequences(
        [_rank_pieces(q_runs, *segs[b]) for b in range(meta.batch)],
        [_rank_pieces(k_runs, *segs[b]) for b in range(meta.batch)], segs, band, Lq, Lk)), key=lambda x: (x.q0, x.k0))
    local = Step(source=0, spans=((0, Lk),), calls=tuple(_calls(seqs, lambda k: k))) if seqs else None
    plan = _rank_plan(0, 1, meta.batch, [Lq], local, (), 0, 0)
    if verify or (verify is None and os.environ.get("CP_ATTENTION_VERIFY_PLANS") == "1"):
        check_step(local, q_idx, k_idx, meta, spec, exact_spans=False)
    return plan



def verify_plan(plan: RankPlan, meta: SequenceMeta, spec: MaskSpec, layout) -> None:
    """Check ``plan`` token by token against the mask (:func:`~cp_attention.plan.verify.check_plan`),
    the peers' plans built here to check what this rank sends. Raises AssertionError."""
    def peer(r: int) -> RankPlan:
        return build_plan(meta, spec, world_size=plan.world_size, layout=layout, rank=r, head_kv=1, head_dim=1,
                          itemsize=1, verify=False)

    check_plan(plan, meta, spec, layout, peer)
