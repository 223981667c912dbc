"""Splitting one long document of a balanced layout into pieces, one per rank (step 1 of the
partition in :mod:`cp_attention.layout.balanced`): nested like zigzag within the document, head and tail
chunks sized by bisection on the largest receive, or contiguous, whichever receives least.

Document-local coordinates: ``cs[i]`` is the cost of the document's first ``i`` tokens (a
:class:`~cp_attention.layout.costs.CostWindow`, whose ``left``/``right`` are ``bisect``'s ``bisect_left``/
``bisect_right`` from closed forms); a *run* is a ``(start, end)`` range of token indices, a *piece*
the list of runs one rank holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .costs import Costs, CostWindow, Traffic

__all__ = ["LongDocument"]

BUDGET_MISS = 0.002
"""A split whose pieces miss their budgets by more than this share of the mean budget is used only
where none misses less."""


def _nest(cs: CostWindow, lo: int, budgets: list[float], limit: int, most: list[int]):
    """Region ``[lo, n)`` into ``len(budgets)`` nested pieces, outermost first (the last: whatever
    is left, contiguous), each receiving at most ``limit`` keys under a full causal mask and piece
    ``j`` holding at most ``most[j]`` tokens; None if that is impossible.

    Piece ``j`` = head chunk ``[lo_j, lo_j + u)`` + tail chunk ``[hi_j - v, hi_j)`` of cost
    ``budgets[j]``: it needs keys ``[0, hi_j)`` and holds ``u + v`` of them, more for a longer head
    chunk (cheaper tokens), which leaves the inner pieces more to receive; each piece takes the
    shortest head chunk that keeps it within ``limit`` and leaves no more tokens than the inner
    pieces may hold."""
    hi = len(cs) - 1
    inner = [0] * (len(most) + 1)
    for j in range(len(most) - 1, -1, -1):
        inner[j] = inner[j + 1] + most[j]
    pieces = []
    short = 0.0  # what the pieces so far fell short of their budgets (up to a token's cost each)
    for j, x in enumerate(budgets[:-1]):
        if x <= 0:
            pieces.append([])
            continue
        x += short
        base = cs[lo]

        def tail(u: int) -> int:  # tokens of the tail chunk the rest of the budget buys
            return hi - cs.left(cs[hi] - (x - (cs[lo + u] - base)), lo + u, hi + 1)

        need = max(hi - limit, hi - lo - inner[j + 1])  # tokens this piece must hold
        u_max = max(0, min(cs.right(base + x, lo, hi) - 1, hi - 1) - lo)
        if u_max + tail(u_max) < need:
            return None
        a, b = 0, u_max
        while a < b:
            mid = (a + b) // 2
            if mid + tail(mid) >= need:
                b = mid
            else:
                a = mid + 1
        u, v = a, tail(a)
        if u + v >= hi - lo or u + v > most[j]:
            return None
        pieces.append(([(lo, lo + u)] if u else []) + ([(hi - v, hi)] if v else []))
        short = x - (cs[lo + u] - cs[lo] + cs[hi] - cs[hi - v])
        lo, hi = lo + u, hi - v
    if lo > limit or hi - lo > most[-1]:
        return None
    pieces.append([(lo, hi)])
    return pieces


def _split_nested(cs: CostWindow, lo: int, budgets: list[float], most: list[int]) -> list[list[tuple[int, int]]]:
    """The nested split of region ``[lo, n)`` whose largest receive is least (bisection, to within
    n / 256 keys) with at most ``most[j]`` tokens in piece ``j`` where possible; else equal-token
    pairs (zigzag within the region). Each piece makes up what the pieces before it fell short of
    their budgets (a piece ends on a token, so it misses its budget by up to a token's cost; over
    many pieces the innermost, which takes the rest, would collect every miss)."""
    n = len(cs) - 1
    best = _nest(cs, lo, budgets, n, most)
    if best is None:
        return _split_pairs(cs, lo, budgets)
    a, b = 0, n
    while b - a > max(1, n >> 8):
        mid = (a + b) // 2
        pieces = _nest(cs, lo, budgets, mid, most)
        if pieces is None:
            a = mid + 1
        else:
            best, b = pieces, mid
    return best


def _split_pairs(cs: CostWindow, lo: int, budgets: list[float]) -> list[list[tuple[int, int]]]:
    """Region ``[lo, n)`` into nested pieces of equal head and tail chunks (zigzag within the
    region), each chunk pair as long as its budget allows."""
    hi = len(cs) - 1
    pieces = []
    carry = 0.0  # what the pieces so far fell short of their budgets
    for x in budgets[:-1]:
        x += carry
        a, b = 0, max(0, (hi - lo) // 2 - 1)
        while a < b:  # the longest chunks within the budget
            mid = (a + b + 1) // 2
            if cs[lo + mid] - cs[lo] + cs[hi] - cs[hi - mid] <= x:
                a = mid
            else:
                b = mid - 1
        pieces.append([(lo, lo + a), (hi - a, hi)] if a else [])
        carry = x - (cs[lo + a] - cs[lo] + cs[hi] - cs[hi - a])
        lo, hi = lo + a, hi - a
    pieces.append([(lo, hi)])
    return pieces


def _split_contiguous(cs: CostWindow, lo: int, budgets: list[float], most: list[int]) -> list[list[tuple[int, int]]]:
    """Region ``[lo, n)`` cut into consecutive pieces of the given costs, the document's end first
    (like the nesting: piece 0 holds the end and receives most); the last piece takes the rest."""
    n = len(cs) - 1
    bounds, acc = [n], cs[n]
    for x in budgets[:-1]:
        acc -= x
        bounds.append(max(cs.left(acc, lo, bounds[-1] + 1), lo))
    bounds.append(lo)
    return [[(p, q)] if q > p else [] for q, p in zip(bounds[:-1], bounds[1:])]


class LongDocument:
    """One long document laid out over ``m`` pieces: ``[a, lo)`` free head (maybe empty), region
    ``[lo, b)``; ``slots[j]`` the rank of piece ``j`` (outermost first)."""

    def __init__(self, a: int, b: int, lo: int, m: int, csum: Costs, traffic: Traffic, most: int):
        self.a, self.b, self.lo, self.m = a, b, lo, m
        self.cs = csum.window(a, b)
        self.cost = self.cs[b - a] - self.cs[lo - a]
        self.traffic = traffic
        self.slots: list[int] = []
        self.pieces, self.recv = self.split([self.cost / m] * m, [max(most, -(-(b - lo) // m))] * m)

    def split(self, budgets: list[float], most: list[int]) -> tuple[list[list[tuple[int, int]]], list[int]]:
        """Pieces (global runs) for these budgets: nested (``most[j]`` tokens in piece ``j`` where
        possible, else a quarter more) or contiguous, whichever receives least among those within
        the token limits (else the one over them least); and each piece's receive."""
        if len(budgets) == 1:  # one piece: the whole region
            return [[(self.lo, self.b)]], [self.traffic.recv([(self.lo, self.b)])]
        lo = self.lo - self.a
        strict = _split_nested(self.cs, lo, budgets, most)
        fits = all(sum(q - p for p, q in runs) <= cap for runs, cap in zip(strict, most))
        splits = [strict] + ([] if fits else [_split_nested(self.cs, lo, budgets, [m + m // 4 for m in most])]) + \
            [_split_contiguous(self.cs, lo, budgets, most)]
        scale = max(sum(budgets) / len(budgets), 1e-300)
        best = None
        for local in splits:
            pieces = [[(self.a + p, self.a + q) for p, q in runs] for runs in local]
            recv = [self.traffic.recv(runs) for runs in pieces]
            over = max(sum(q - p for p, q in runs) - cap for runs, cap in zip(pieces, most))
            miss = max(abs(sum(self.cs[q] - self.cs[p] for p, q in runs) - x) for runs, x in zip(local, budgets))
            key = (max(over, 0), max(miss / scale - BUDGET_MISS, 0.0), max(recv))
            if best is None or key < best[0]:
                best = (key, pieces, recv)
        return best[1], best[2]
