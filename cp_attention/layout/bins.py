"""Bins of a balanced layout's partition (step 3 of :mod:`cp_attention.layout.balanced`): a bin of
free items against a cost and a token capacity, the index that finds the bin an item packs into,
bundles of tiny documents, and the fill that makes every bin's cost exact.

Legend: ``P`` ranks; an *item* is a list of ``(start, end)`` runs of global token indices that moves
as one; ``csum[i]`` the cost of tokens ``[0, i)`` (:class:`~cp_attention.layout.costs.Costs`).
"""

from __future__ import annotations

import bisect
import functools
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .costs import Costs

__all__ = ["FILL_TOLERANCE", "SEARCH", "BUNDLE_SHARE", "Bin", "bin_density", "DensityIndex", "Bundle", "bundles",
           "fill"]

FILL_TOLERANCE = 1e-3
"""A bin counts as full within this fraction of the per-rank target."""
SEARCH = 16
"""Items tried per move when filling bins exactly."""
BUNDLE_SHARE = 1 / 16
"""A bundle costs and holds at most this share of a rank's target cost and tokens."""


class Bin:
    """Free items packed against a cost capacity (exact) and a token capacity (hard) and target."""

    def __init__(self, cost: float, tokens: int, target_tokens: float, group=None, rank: int | None = None):
        self.cap_cost, self.cap_tokens, self.target_tokens = cost, tokens, target_tokens
        self.group, self.rank = group, rank
        self.load, self.tokens, self._items = 0.0, 0, {}  # id -> item, in the order added
        self.recv = 0  # what the rank (for a group: its rank that receives least) receives, estimated

    @property
    def items(self) -> list:
        return list(self._items.values())

    @items.setter
    def items(self, items: list) -> None:
        self._items = {id(item): item for item in items}

    def add(self, item, cost: float, tokens: int) -> None:
        self._items[id(item)] = item
        self.load += cost
        self.tokens += tokens

    def remove(self, item, cost: float, tokens: int) -> None:
        if self._items.pop(id(item), None) is None:  # an equal item, not this object
            del self._items[next(k for k, x in self._items.items() if x == item)]
        self.load -= cost
        self.tokens -= tokens


def bin_density(bn: Bin) -> float:
    """The log of a bin's remaining cost per remaining target token (what an item's density is matched to)."""
    return math.log(max(bn.cap_cost - bn.load, 1e-300) / max(bn.target_tokens - bn.tokens, 1.0))


class DensityIndex:
    """The bins sorted by :func:`bin_density`: :meth:`nearest` finds the bin an item goes to without
    reading every bin (the packing's O(items x bins) scan was its cost at hundreds of ranks)."""

    def __init__(self, bins: list[Bin]):
        self.bins = bins
        self.pos = {id(bn): i for i, bn in enumerate(bins)}  # ties go to the first bin, as a scan would
        self.key = {id(bn): (bin_density(bn), i) for i, bn in enumerate(bins)}
        self.keys = sorted(self.key.values())

    def remove(self, bn: Bin) -> None:
        del self.keys[bisect.bisect_left(self.keys, self.key[id(bn)])]

    def insert(self, bn: Bin) -> None:
        key = self.key[id(bn)] = (bin_density(bn), self.pos[id(bn)])
        bisect.insort(self.keys, key)

    def nearest(self, density: float, c: float, n: int) -> Bin | None:
        """The first bin (in ``bins`` order) of those whose density is nearest ``density`` among the
        ones with room for cost ``c`` and ``n`` tokens; None if there is none."""
        keys, bins = self.keys, self.bins

        def fits(i: int) -> bool:
            bn = bins[i]
            return bn.cap_cost - bn.load >= c and bn.tokens + n <= bn.cap_tokens

        at = bisect.bisect_left(keys, (density, -1))
        right = next(((keys[j][0] - density, keys[j][1]) for j in range(at, len(keys)) if fits(keys[j][1])), None)
        left, j = None, at - 1
        while j >= 0:  # below: the lowest index among the fitting bins of the nearest density
            d, i = keys[j]
            if left is not None and d != left[2]:
                break
            if fits(i):
                left = (density - d, i, d)
            j -= 1
        options = [x[:2] for x in (left, right) if x is not None]
        return bins[min(options)[1]] if options else None


class Bundle(list):
    """Whole documents (runs) that pack and move as one free item, with their cost and tokens."""

    __slots__ = ("cost", "tokens")


def bundles(a_D, b_D, cost_D, target: float, tau: float) -> list[Bundle]:
    """Tiny documents ``[a_D, b_D)`` (int64 numpy, each under :data:`BUNDLE_SHARE` of a rank's
    cost and tokens) grouped, in order of cost per token, into bundles of about that share
    (thousands of short documents over hundreds of ranks: the packing then handles bundles)."""
    order = np.argsort(cost_D / np.maximum(b_D - a_D, 1), kind="stable")
    a_D, b_D, cost_D = a_D[order], b_D[order], cost_D[order]
    group = np.maximum(np.floor(np.cumsum(cost_D) / (BUNDLE_SHARE * target)),
                       np.floor(np.cumsum(b_D - a_D) / (BUNDLE_SHARE * tau)))
    edges = np.concatenate(([0], np.flatnonzero(np.diff(group)) + 1, [len(group)])).tolist()
    runs = list(zip(a_D.tolist(), b_D.tolist()))
    costs = np.concatenate(([0.0], np.cumsum(cost_D)))
    sizes = np.concatenate(([0], np.cumsum(b_D - a_D)))
    out = []
    for i, j in zip(edges[:-1], edges[1:]):
        bundle = Bundle(runs[i:j])
        bundle.cost, bundle.tokens = float(costs[j] - costs[i]), int(sizes[j] - sizes[i])
        out.append(bundle)
    return out


def fill(bins: list[Bin], csum: Costs, starts: set[int], target: float, cost_of, size_of, grow,
          halo, several: bool = False) -> None:
    """Make every bin's cost its capacity: an over-full bin passes cost to an under-full one by the
    first of: a whole item that fits; the head of one of its items cut at the exact cost (the
    shortest head: the rest of that item, which stays, receives it); where the under-full bin has no
    token room, a swap of an item for cheaper ones of the under-full bin (the sparsest; its head cut
    at the exact cost if need be). Only items that start a document move or are cut, so a moved item
    receives nothing. Where nothing moves, an over-full group takes in an under-full rank of its
    own (``grow(group, rank)``: one more piece of a long document, on that rank)."""
    moves = _Moves(csum, starts, target, cost_of, size_of, halo, several)
    _ease_token_caps(bins, moves.movable, cost_of, size_of)
    excess = _ExcessOrder(bins)
    for _ in range(4 * len(bins) + 8):
        if excess.most() <= moves.tol:
            return
        move = None
        for over, under, give, dense, sparse in excess.pairs(moves.movable, cost_of, size_of, moves.tol):
            best = moves.best(over, under, give, dense, sparse)
            if best is not None:
                move = (over, under, *best[1:])
                break
        if move is None:  # nothing moves: an over-full group takes in an under-full rank
            pair = excess.group_and_rank(moves.tol)
            if pair is None or not grow(*pair):
                return
            bins.remove(pair[1])
            excess.drop(pair[1])
            excess.moved(pair[0])
            continue
        moves.apply(*move)
        excess.moved(move[0], move[1])


def _ease_token_caps(bins: list[Bin], movable, cost_of, size_of) -> None:
    """First no bin over its token cap: its sparsest movable items to the bins with most token room."""
    for bn in bins:
        for item in sorted(movable(bn), key=lambda item: cost_of(item) / size_of(item)):
            if bn.tokens <= bn.cap_tokens:
                break
            dest = max(bins, key=lambda d: d.cap_tokens - d.tokens)
            if dest is bn or dest.tokens + size_of(item) > dest.cap_tokens:
                break
            bn.remove(item, cost_of(item), size_of(item))
            dest.add(item, cost_of(item), size_of(item))


def _cut_points(csum: Costs) -> tuple:
    """``(head, tail)``: ``head(item, cost)`` the end of a one-run item's head of that cost,
    ``tail(item, cost)`` the start of its tail of that cost (cached for one fill)."""

    @functools.lru_cache(maxsize=None)
    def _head(p: int, q: int, cost: float) -> int:
        return min(max(csum.left(csum[p] + cost), p + 1), q - 1)

    @functools.lru_cache(maxsize=None)
    def _tail(p: int, q: int, cost: float) -> int:
        return min(max(csum.left(csum[q] - cost), p + 1), q - 1)

    def head(item, cost: float) -> int:  # end of the item's head of this cost
        return _head(*item[0], cost)

    def tail(item, cost: float) -> int:  # start of the item's tail of this cost
        return _tail(*item[0], cost)

    return head, tail


class _ExcessOrder:
    """The bins by excess cost (load less capacity; ties: bins order), kept sorted as moves change two
    bins at a time."""

    def __init__(self, bins: list[Bin]):
        self.by_pos = dict(enumerate(bins))
        self.at = {id(bn): (bn.load - bn.cap_cost, i) for i, bn in self.by_pos.items()}
        self.order = sorted(self.at.values())

    def most(self) -> float:
        """The largest excess cost of a bin."""
        return self.order[-1][0]

    def drop(self, bn: Bin) -> None:
        """Take ``bn`` out of the order."""
        del self.order[bisect.bisect_left(self.order, self.at[id(bn)])]

    def moved(self, *changed: Bin) -> None:
        """Put the bins whose load changed back in their places."""
        for bn in changed:
            self.drop(bn)
            self.at[id(bn)] = (bn.load - bn.cap_cost, self.at[id(bn)][1])
            bisect.insort(self.order, self.at[id(bn)])

    def pairs(self, movable, cost_of, size_of, tol: float):
        """The pairs ``(over, under, give, dense, sparse)`` to try, fullest and emptiest first."""
        # those with more than 0.1 tol to move; with the over-full bin's movable items (cost, tokens,
        # item), densest first, and the under-full one's sparsest items (read once per bin and move)
        by_pos, order = self.by_pos, self.order
        sparsest = {}
        for ex_o, i in reversed(order):
            if ex_o <= 0.1 * tol:
                return
            give = dense = None
            for ex_u, j in order:
                if -ex_u <= 0.1 * tol:
                    break
                if give is None:
                    give = [(cost_of(item), size_of(item), item) for item in movable(by_pos[i])]
                    dense = sorted(give, key=lambda g: -g[0] / g[1])[:SEARCH]
                if j not in sparsest:
                    sparsest[j] = sorted(movable(by_pos[j]), key=lambda item: cost_of(item) / size_of(item))[:SEARCH]
                yield by_pos[i], by_pos[j], give, dense, sparsest[j]

    def group_and_rank(self, tol: float) -> tuple[Bin, Bin] | None:
        """The first (over-full group, under-full rank) beyond ``tol``, fullest and emptiest first; None if none."""
        by_pos, order = self.by_pos, self.order
        return next(((by_pos[i], by_pos[j]) for ex_o, i in reversed(order) if ex_o > tol
                     for ex_u, j in order if -ex_u > tol
                     if by_pos[i].group is not None and by_pos[j].group is None), None)


class _Moves:
    """The moves of one fill: which items may move, the best move of cost from an over-full bin to an
    under-full one, and making it. A move is ``(key, item, t, back, more)``: ``t`` None (the item
    moves whole), the end of its head (> 0: the head moves) or minus the start of its tail (the tail
    moves); ``back`` the items taken back, ``more`` further whole items that go too."""

    def __init__(self, csum: Costs, starts: set[int], target: float, cost_of, size_of, halo, several: bool):
        self.csum, self.starts, self.cost_of, self.size_of, self.halo = csum, starts, cost_of, size_of, halo
        self.tol, self.several = FILL_TOLERANCE * target, several
        self.head, self.tail = _cut_points(csum)

    def movable(self, bn: Bin) -> list:
        """The bin's whole documents (or bundles of them): they receive nothing anywhere."""
        starts = self.starts
        return [item for item in bn.items if all(run[0] in starts for run in item)]

    def best(self, over: Bin, under: Bin, give: list, dense: list, sparse: list) -> tuple | None:
        """The first kind of move that passes cost from ``over`` to ``under``, its best; None if none."""
        excess = min(over.load - over.cap_cost, under.cap_cost - under.load)
        room, room_over = under.cap_tokens - under.tokens, over.cap_tokens - over.tokens
        whole = [g for g in give if g[0] <= excess + 0.1 * self.tol and g[1] <= room]
        # best: (cut tokens, -net cost, item, its head end or None, items taken back)
        best = self.whole(whole, excess, room) if whole else self.cut(over, under, give, excess, room)
        if best is None and give:  # a dense item for the under-full bin's sparsest ones
            best = self.swap(over, under, dense, sparse, excess, room, room_over)
        return best

    def whole(self, whole: list, excess: float, room: int) -> tuple:
        """Whole items (``whole``: (cost, tokens, item) that fit): the costliest, or with ``several``
        as many as fit, largest first."""
        if self.several:  # whole items, largest first, as many as fit
            whole.sort(key=lambda g: -g[0])
            c_sum, n_sum, chosen = 0.0, 0, []
            for c, n, item in whole:
                if c_sum + c <= excess + 0.1 * self.tol and n_sum + n <= room:
                    chosen.append(item)
                    c_sum += c
                    n_sum += n
            return ((0, -c_sum), chosen[0], None, [], chosen[1:])
        c, n, item = max(whole, key=lambda g: g[0])  # a whole item
        return ((0, -c), item, None, [], [])

    def cut(self, over: Bin, under: Bin, give: list, excess: float, room: int) -> tuple | None:
        """An item cut at the exact cost; None if none fits."""
        # its head moves (the rest, staying, receives the head) or its tail moves (and receives the
        # rest): where the receiving rank then receives less
        head, tail, halo = self.head, self.tail, self.halo
        best = None
        for c, n, item in sorted((g for g in give if g[0] > excess and g[1] > 1 and len(g[2]) == 1),
                                  key=lambda g: g[0])[:SEARCH]:
            (p, q), = item
            t = head(item, excess)
            if t - p <= room:
                key = (over.recv + halo((t, q)), t - p)
                if best is None or key < best[0]:
                    best = (key, item, t, [], [])
            t = tail(item, excess)
            if q - t <= room:
                key = (under.recv + halo((t, q)), q - t)
                if best is None or key < best[0]:
                    best = (key, item, -t, [], [])
        return best

    def swap(self, over: Bin, under: Bin, dense: list, sparse: list, excess: float, room: int,
             room_over: int) -> tuple | None:
        """A dense item (whole, or its head or tail cut) for the under-full bin's sparsest items,
        passing at most ``excess`` net cost within both bins' token room; None if none does."""
        csum, head, tail, halo, tol = self.csum, self.head, self.tail, self.halo, self.tol
        best = None
        c_back = n_back = 0
        for i in range(len(sparse)):
            c_back += self.cost_of(sparse[i])
            n_back += self.size_of(sparse[i])
            for c_all, n_all, item in dense:
                options = [(c_all, n_all, None, max(over.recv, under.recv))]
                if c_all > excess + c_back and n_all > 1 and len(item) == 1:  # cut: its head or tail moves
                    (p, q), = item
                    t = head(item, excess + c_back)
                    options.append((csum[t] - csum[p], t - p, t, over.recv + halo((t, q))))
                    t = tail(item, excess + c_back)
                    options.append((csum[q] - csum[t], q - t, -t, under.recv + halo((t, q))))
                for c, n, t, recv in options:
                    net = c - c_back
                    if net <= 0.1 * tol or net > excess + 0.1 * tol or n - n_back > room or \
                            n_back - n > room_over:
                        continue
                    key = (recv, t is not None, -net)
                    if best is None or key < best[0]:
                        best = (key, item, t, sparse[:i + 1], [])
        return best

    def apply(self, over: Bin, under: Bin, item, t: int | None, back: list, more: list) -> None:
        """Make a move: ``item`` (whole, its head or its tail) and ``more`` from ``over`` to ``under``,
        ``back`` from ``under`` to ``over``."""
        csum, cost_of, size_of, halo = self.csum, self.cost_of, self.size_of, self.halo
        for extra in more:  # several whole items: the others go too
            over.remove(extra, cost_of(extra), size_of(extra))
            under.add(extra, cost_of(extra), size_of(extra))
        over.remove(item, cost_of(item), size_of(item))
        if t is not None and t > 0:  # the head moves, the rest stays and receives it
            (p, q), = item
            over.add([(t, q)], csum[q] - csum[t], q - t)
            over.recv += halo((t, q))
            item = [(p, t)]
        elif t is not None:  # the tail moves and receives the rest, which stays
            (p, q), = item
            over.add([(p, -t)], csum[-t] - csum[p], -t - p)
            under.recv += halo((-t, q))
            item = [(-t, q)]
        under.add(item, cost_of(item), size_of(item))
        for item in back:
            under.remove(item, cost_of(item), size_of(item))
            over.add(item, cost_of(item), size_of(item))
