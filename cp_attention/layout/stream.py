"""The stream partition of a balanced layout, for many ranks (above ``STREAM_ABOVE`` of
:mod:`cp_attention.layout.balanced`): one pass over the ranks, O(documents log documents + ranks),
nothing per token (issue #36: the search of steps 1-4 grows faster than P x documents and takes
seconds at 1024 ranks).

The documents, sorted by cost per token, are one list with two ends:

* the **dense end** (the costliest per token: the long documents) is consumed at token granularity,
  one document at a time, read *back* from its end: a token costs more the later it is (a causal
  layer) or the same past its first window, so the costly part goes first, in contiguous pieces;
  once what is left of the document is cheaper per token than the rest of the batch (its start), it
  goes back among the free documents in parts a rank has room for;
* the **sparse end** (the cheapest per token: short documents) gives whole documents.

Rank by rank, each takes whole documents from the sparse end while they keep its tokens near its
goal (the tokens left over the ranks left, under the cap) once the dense end fills the rest of its
cost; then the dense end fills its cost exactly, as far as its token room allows. A gap smaller than
``SLIVER`` x the target is closed by cutting the next short document instead (a long document is not
cut in slivers over many ranks), and a short document too long for the rank's room is cut at its
start (only its rest receives K/V). A rank's cost is its share of what is left, at most ``SHARE_CAP``
x the target: a rank stopped short by the token cap moves its share to the ranks after it; what no
rank took at the end is spread over the ranks holding its neighbouring tokens, then those with the
least cost.

Against the search of steps 1-4 (:mod:`.partition`), kept up to ``STREAM_ABOVE`` ranks (the
benchmarked range), the stream keeps the busiest rank within about 1% of the target and every rank
under the token cap (the search misses both where about one document falls to a rank). Its busiest
rank receives 0.84-1.16x the search's K/V (geometric mean over the benchmark's layer mixes; up to 2x
for one mix), its mean rank 1.0-1.6x (up to 2.8x): it does not search piece sizes for the shortest
halos (figures: docs/benchmarks.md).

Legend: ``P`` ranks, ``L`` tokens, ``T`` the target cost per rank, ``tau = L / P``; a *run* is a
``(start, end)`` range of global token indices.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .costs import Costs

__all__ = ["stream_partition"]

SHARE_CAP = 1.004
"""A rank's cost share is at most this x the target; what the ranks leave is spread at the end..."""
SPREAD_CAP = 1.01
"""... to ranks up to this x the target."""
LAST_STEP = 0.003
"""A rank's last take may pass its share by this fraction of the target (a token's cost is a grain)."""
ROOM = 0.97
"""A rank fills at most this x the token cap in the stream (the leftovers may fill it)."""
GOAL = 0.95
"""A rank's token goal is the tokens left over the ranks left, at most this x the cap."""
WHOLE_SLACK = 0.02
"""A whole document may pass the rank's token goal by this x L / P."""
CUT_FROM = 0.05
"""A document from the sparse end is cut only while the rank wants this x L / P more tokens..."""
CUT_LONG = 0.1
"""... and it holds more than this x L / P tokens (or more cost than the rank has left)."""
SLIVER = 0.25
"""A rank's cost gap under this x the target is closed from the sparse end (the next short document
cut at the exact cost), not with a sliver of the long document at the dense end: a long document
then spans at most cost / (SLIVER x target) + 1 ranks, not one per rank whose free documents left a
small gap (at 1024 ranks of 128 tokens, a 300-token document in two-token slivers over 100 ranks)."""
LOOK = 0.25
"""The dense end's cost per token read back is that of its next LOOK x L / P tokens."""
PART = 0.6
"""A document's cheap start goes back among the free items in parts of at most this x the cap."""


class _Open:
    """A document being consumed: ``h`` tokens taken from its start, ``k`` from its end; ``order``
    ``"back"`` (from the end backwards: a long document at the dense end) or ``"front"`` (from the
    start: a short one cut at the sparse end)."""

    __slots__ = ("a", "b", "h", "k", "order")

    def __init__(self, a: int, b: int, order: str):
        self.a, self.b, self.h, self.k, self.order = a, b, 0, 0, order

    def done(self) -> bool:
        return self.a + self.h >= self.b - self.k

    def rest(self, costs: Costs) -> tuple[float, int]:
        """The cost and the tokens not taken yet."""
        return costs[self.b - self.k] - costs[self.a + self.h], self.b - self.k - self.a - self.h

    def per_cost(self, costs: Costs, tau: float) -> float:
        """Tokens per unit of cost of what the next takes read (the next ``LOOK x tau`` tokens)."""
        lo, hi = self.a + self.h, self.b - self.k
        n = max(int(LOOK * tau), 1)
        if self.order == "back":
            lo = max(hi - n, lo)
        else:
            hi = min(lo + n, hi)
        return (hi - lo) / max(costs[hi] - costs[lo], 1e-300)

    def _take(self, h: int, k: int) -> tuple[list, int]:
        a, b = self.a, self.b
        runs = [run for run in ((a + self.h, a + h), (b - k, b - self.k)) if run[1] > run[0]]
        n = h - self.h + k - self.k
        self.h, self.k = h, k
        return runs, n

    def take(self, costs: Costs, need: float, most: float) -> tuple[list, float, int]:
        """The most tokens (at most ``most``) whose cost stays within ``need``, maybe none:
        ``(runs, cost, tokens)``."""
        a, b, h, k = self.a, self.b, self.h, self.k
        lo, hi = a + h, b - k
        most = max(min(int(most), hi - lo), 0)
        if self.order == "back":
            t = max(costs.left(costs[hi] - need), lo, hi - most)  # the first start within need
            runs, n = self._take(h, b - t)
            return runs, costs[hi] - costs[t], n
        t = max(min(costs.right(costs[lo] + need) - 1, hi, lo + most), lo)  # the last end within need
        runs, n = self._take(t - a, k)
        return runs, costs[t] - costs[lo], n


class _Free:
    """The documents by cost per token (increasing), consumed from both ends; a document's start can
    come back in (:meth:`insert`). Parallel lists, ``lo`` and ``hi`` the ends still free."""

    def __init__(self, runs: list, cost: list, tokens: list):
        self.runs, self.cost, self.tokens = runs, cost, tokens
        self.density = [c / n for c, n in zip(cost, tokens)]
        self.lo, self.hi = 0, len(runs) - 1

    def __bool__(self) -> bool:
        return self.lo <= self.hi

    def pop_sparse(self) -> tuple[int, int]:
        self.lo += 1
        return self.runs[self.lo - 1]

    def pop_dense(self) -> tuple[int, int]:
        self.hi -= 1
        return self.runs[self.hi + 1]

    def insert(self, run: tuple[int, int], cost: float) -> None:
        n = run[1] - run[0]
        i = bisect.bisect_left(self.density, cost / n, self.lo, self.hi + 1)
        for column, value in ((self.runs, run), (self.cost, cost), (self.tokens, n), (self.density, cost / n)):
            column.insert(i, value)
        self.hi += 1

    def left(self) -> list:
        return self.runs[self.lo:self.hi + 1]


def stream_partition(costs: Costs, a_D: np.ndarray, b_D: np.ndarray, P: int, cap: int) -> list[list]:
    """Every rank's runs for the documents ``[a_D, b_D)`` ((D,) int64, in order, covering the row)
    under the prefix costs ``costs``; no rank above ``cap`` tokens."""
    L = costs.L
    C = costs[L]
    T, tau = C / P, L / P
    free = _free_documents(costs, a_D, b_D)
    dense: _Open | None = None  # the document open at the dense end
    cut: _Open | None = None  # a document cut at the sparse end
    owned: list[list] = [[] for _ in range(P)]
    slack, whole_slack = LAST_STEP * T, WHOLE_SLACK * tau
    done_c, done_n = 0.0, 0
    per, per_of = 0.0, None  # the dense end's tokens per cost, and the state it was read at
    for r in range(P):
        share = min((C - done_c) / (P - r), SHARE_CAP * T)
        goal = min((L - done_n) / (P - r), GOAL * cap)
        limit = cap if r == P - 1 else ROOM * cap
        got_c, got_n = 0.0, 0
        mine = owned[r]
        while True:
            c_rem, room = share - got_c, limit - got_n
            if c_rem <= 0 or room <= 0:
                break
            dense = _dense_end(free, dense)
            if dense is None:
                per = 0.0
            elif per_of != (dense, dense.h, dense.k):
                per, per_of = dense.per_cost(costs, tau), (dense, dense.h, dense.k)
            extra = goal - got_n - c_rem * per  # tokens free documents may add beyond the dense ones
            if cut is None and free:  # whole documents from the sparse end while they keep to the goal
                i, got_c, got_n = _whole_documents(free, c_rem, room, extra, per, whole_slack, got_c, got_n)
                if i > free.lo:
                    mine += free.runs[free.lo:i]
                    free.lo = i
                    continue
            if cut is None and not free and dense is None:
                break
            runs, c, n, cut = _from_sparse(costs, free, cut, dense, c_rem, room, extra, per, slack, whole_slack, tau)
            if runs is None and c_rem < SLIVER * T and dense.rest(costs)[0] > c_rem + slack and (cut or free):
                if cut is None:  # a small gap: short documents, whole while they fit, not a sliver of a long one
                    i, got_c, got_n = _gap_documents(free, c_rem, slack, room, got_c, got_n)
                    if i > free.lo:
                        mine += free.runs[free.lo:i]
                        free.lo = i
                        continue
                    cut = _Open(*free.pop_sparse(), "front")  # ... else the next one's start
                runs, c, n = cut.take(costs, c_rem + slack, room)
                if cut.done():
                    cut = None
            if runs is None:  # the dense end fills the cost, as far as the room allows
                runs, c, n, dense = _from_dense(costs, free, dense, c_rem, slack, room, C - done_c - got_c,
                                                L - done_n - got_n, cap)
            mine += runs
            got_c += c
            got_n += n
            if n == 0:
                break
        done_c += got_c
        done_n += got_n
    left = _untaken(free, dense, cut)
    _spread(costs, left, owned, T, cap)
    return owned


def _free_documents(costs: Costs, a_D: np.ndarray, b_D: np.ndarray) -> _Free:
    """The documents ``[a_D, b_D)`` ((D,) int64) as the free list, cheapest per token first."""
    cost_D = costs.prefix(b_D) - costs.prefix(a_D)
    order = np.argsort(cost_D / (b_D - a_D), kind="stable")  # cheapest per token first
    return _Free(list(zip(a_D[order].tolist(), b_D[order].tolist())), cost_D[order].tolist(),
                 (b_D - a_D)[order].tolist())


def _dense_end(free: _Free, dense: _Open | None) -> _Open | None:
    """The document open at the dense end: the open one until it is done, then the densest free one
    read back from its end; None when neither is left."""
    if (dense is None or dense.done()) and free:
        dense = _Open(*free.pop_dense(), "back")
    elif dense is not None and dense.done():
        dense = None
    return dense


def _whole_documents(free: _Free, c_rem: float, room: float, extra: float, per: float, whole_slack: float,
                     got_c: float, got_n: int) -> tuple[int, float, int]:
    """How far the rank takes whole documents from the sparse end while they fit its cost ``c_rem`` and
    ``room`` and keep its tokens to the goal: ``(the first one not taken, the rank's cost, its tokens)``."""
    cost_I, tokens_I, i, hi = free.cost, free.tokens, free.lo, free.hi
    while i <= hi and c_rem > 0 and room > 0:
        c, n = cost_I[i], tokens_I[i]
        if c > c_rem or n > room or n - c * per > extra + whole_slack:
            break
        c_rem -= c
        room -= n
        extra -= n - c * per
        got_c += c
        got_n += n
        i += 1
    return i, got_c, got_n


def _from_sparse(costs: Costs, free: _Free, cut: _Open | None, dense: _Open | None, c_rem: float, room: float,
                 extra: float, per: float, slack: float, whole_slack: float, tau: float) -> tuple:
    """The sparse end's take, if it gives one: the rest of the cut document where it keeps to the goal,
    else the start of a short document too long for the rank; ``(runs or None, cost, tokens, the cut
    document left open)``."""
    if cut is not None:
        sc, sn = cut.rest(costs)
    elif free:
        sc, sn = free.cost[free.lo], free.tokens[free.lo]
    else:
        return None, 0.0, 0, cut
    if cut is not None and sc <= c_rem and sn <= room and sn - sc * per <= extra + whole_slack:
        runs, c, n = cut.take(costs, math.inf, sn)  # the rest of a cut document
        return runs, c, n, None
    if dense is None or (extra > CUT_FROM * tau and (sn > CUT_LONG * tau or sc > c_rem)):
        if cut is None:  # too long for the rank: its start, as many tokens as it wants
            cut = _Open(*free.pop_sparse(), "front")
        most = room if dense is None else min(room, extra / max(1 - sc / sn * per, 1e-9))
        runs, c, n = cut.take(costs, c_rem + slack, max(most, 1))
        return runs, c, n, None if cut.done() else cut
    return None, 0.0, 0, cut


def _gap_documents(free: _Free, c_rem: float, slack: float, room: float, got_c: float,
                   got_n: int) -> tuple[int, float, int]:
    """How far the rank's small cost gap takes whole short documents from the sparse end while they
    fit: ``(the first one not taken, the rank's cost, its tokens)``."""
    i, c_left, n_left = free.lo, c_rem + slack, room
    while i <= free.hi and free.cost[i] <= c_left and free.tokens[i] <= n_left:
        c_left, n_left, i = c_left - free.cost[i], n_left - free.tokens[i], i + 1
    if i > free.lo:
        got_c, got_n = got_c + c_rem + slack - c_left, got_n + room - n_left
    return i, got_c, got_n


def _from_dense(costs: Costs, free: _Free, dense: _Open, c_rem: float, slack: float, room: float,
                left_c: float, left_n: int, cap: int) -> tuple[list, float, int, _Open | None]:
    """The dense end's take: the most of its document within the rank's cost and room, ``(runs, cost,
    tokens, the document still open)``; once what is left of it (its start) is cheaper per token than
    the rest of the batch (``left_c`` cost, ``left_n`` tokens before this take), that start goes back
    among the free documents in parts a rank has room for."""
    runs, c, n = dense.take(costs, c_rem + slack, room)
    if not dense.done():
        rest_c, rest_n = dense.rest(costs)
        left_c, left_n = left_c - c, left_n - n
        if rest_c * left_n < left_c * rest_n:  # its cheap start: back among the free items
            parts = min(math.ceil(rest_n / (PART * cap)), rest_n)
            edges = [dense.a + dense.h + rest_n * i // parts for i in range(parts + 1)]
            for p, q in zip(edges, edges[1:]):
                free.insert((p, q), costs[q] - costs[p])
            dense = None
    return runs, c, n, dense


def _untaken(free: _Free, dense: _Open | None, cut: _Open | None) -> list:
    """The runs no rank took: the free documents left and the rest of the open ones."""
    left = free.left()
    for d in (dense, cut):
        if d is not None and not d.done():
            left.append((d.a + d.h, d.b - d.k))
    return left


def _spread(costs: Costs, left: list, owned: list[list], T: float, cap: int) -> None:
    """What no rank took (a few targets' worth where about one document falls to a rank): each item,
    costliest first, first to the ranks holding the tokens just before and just after it (their runs
    grow: no new halo), then to the ranks with the least cost; each takes as much as its cost (to
    ``SPREAD_CAP`` x the target, at least a token) and its token room allow."""
    if not left:
        return
    load = [sum(costs[q] - costs[p] for p, q in runs) for runs in owned]
    held = [sum(q - p for p, q in runs) for runs in owned]
    ends = {q: r for r, runs in enumerate(owned) for _, q in runs}  # who holds the token before a run
    starts = {p: r for r, runs in enumerate(owned) for p, _ in runs}  # ... the token after

    def room(r: int) -> tuple[float, int]:
        return max(SPREAD_CAP * T - load[r], 0.0), cap - held[r]

    heap = [(load[r], r) for r in range(len(owned)) if held[r] < cap]
    heapq.heapify(heap)
    for p, q in sorted(left, key=lambda run: costs[run[0]] - costs[run[1]]):
        r = ends.get(p)
        if r is not None:  # the left neighbour's run grows forwards
            afford, n = room(r)
            e = min(q, p + n, costs.right(costs[p] + afford) - 1)
            if e > p:
                owned[r].append((p, e))
                load[r] += costs[e] - costs[p]
                held[r] += e - p
                p = e
        r = starts.get(q)
        if r is not None and q > p:  # the right neighbour's run grows backwards
            afford, n = room(r)
            s = max(p, q - n, costs.left(costs[q] - afford))
            if s < q:
                owned[r].append((s, q))
                load[r] += costs[q] - costs[s]
                held[r] += q - s
                q = s
        while p < q:  # (the ranks' room holds every token: cap x P >= L)
            _, r = heapq.heappop(heap)
            if held[r] >= cap:
                continue
            afford, n = room(r)
            e = min(q, p + n, max(costs.right(costs[p] + afford) - 1, p + 1))
            owned[r].append((p, e))
            load[r] += costs[e] - costs[p]
            held[r] += e - p
            p = e
            if held[r] < cap:
                heapq.heappush(heap, (load[r], r))
