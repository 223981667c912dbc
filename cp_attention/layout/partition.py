"""The partition of a balanced layout (steps 1-4 of :mod:`cp_attention.layout.balanced`): a batch's long
documents cut into pieces and given ranks, the free items packed into bins and made exact, each
group's free items and piece budgets spread over its ranks, and the :class:`~cp_attention.layout.Layout`
of the result.

Legend: ``P`` ranks, ``L`` tokens; ``csum[i]`` the cost of tokens ``[0, i)`` (a
:class:`~cp_attention.layout.costs.Costs`, closed forms per document); a *run* is a
``(start, end)`` range of global token indices, an *item* a list of runs that moves as one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .bins import BUNDLE_SHARE, FILL_TOLERANCE, SEARCH, Bin, Bundle, DensityIndex, bin_density, bundles, fill
from .split import LongDocument
from .layouts import Layout, merge_ranges

if TYPE_CHECKING:
    from .costs import Costs, Traffic

__all__ = ["TOKEN_SLACK", "Batch", "layout_from_items"]

TOKEN_SLACK = 0.95
"""Estimated tokens per rank (choosing the piece cost) and a document's tokens per piece stay under
this fraction of the cap."""
SETTLE_ROUNDS = 3
"""Rounds of passing free items away from a group's ranks over the token cap."""
SETTLE_SLACK = 0.85
"""A group's free items go to its inner pieces' ranks while their estimated tokens stay under this x cap."""
HEAD_TOKENS = 0.75
"""A long document's start longer than this x cap joins its nesting even without a rank to spare."""
BUNDLE_ABOVE = 8
"""With more free documents than this x P, the tiny ones are packed in bundles (:func:`bundles`)."""
BIG_SHARE = 0.25
"""Free items costing or holding more than this share of a rank's target are packed first, one by one."""


class Batch:
    """One batch's cumulative costs (``csum[i]``: cost of tokens ``[0, i)``), documents and targets."""

    def __init__(self, csum: Costs, P: int, cap: int, docs: list[tuple[int, int]], traffic: Traffic):
        self.csum, self.P, self.cap, self.docs, self.traffic = csum, P, cap, docs, traffic
        self.L = csum.L
        self.target, self.tau = csum[self.L] / P, self.L / P
        self.starts = {a for a, _ in docs}
        self.a_D = np.array([a for a, _ in docs], dtype=np.int64)  # the documents as arrays, their costs
        self.b_D = np.array([b for _, b in docs], dtype=np.int64)
        self.cost_D = csum.prefix(self.b_D) - csum.prefix(self.a_D)

    def cost_of(self, item) -> float:
        """The cost of an item's tokens."""
        cs = self.csum
        if len(item) == 1:
            return cs[item[0][1]] - cs[item[0][0]]
        if type(item) is Bundle:
            return item.cost
        return sum([cs[q] - cs[p] for p, q in item])

    @staticmethod
    def size_of(item) -> int:
        """The number of an item's tokens."""
        if len(item) == 1:
            return item[0][1] - item[0][0]
        if type(item) is Bundle:
            return item.tokens
        return sum([q - p for p, q in item])

    def partition(self, x: float, method: str = "greedy") -> list[list]:
        """Every rank's items for pieces of cost ``x`` (steps 1-4 of :mod:`cp_attention.layout.balanced`)."""
        most = math.floor(self.tau)  # tokens a piece may hold: room for free items on its rank
        free, docs_long = self.cut(x, most)
        groups, next_rank, recv = self.assign(docs_long, most)
        for d in docs_long:
            if d.lo > d.a:
                free.append([(d.a, d.lo)])
        bins = (self.pack if method == "greedy" else self.pack_nearest)(free, groups, next_rank, recv)
        fill(bins, self.csum, self.starts, self.target, self.cost_of, self.size_of,
              lambda bn, rank: self.grow(bn, rank, most), lambda run: self.traffic.recv([run])[0],
              several=method == "greedy")

        # 4. ranks: a remaining rank holds its bin; a group spreads its free items, then splits its documents
        owned: list[list] = [[] for _ in range(self.P)]
        for bn in bins:
            if bn.rank is not None:
                owned[bn.rank] = list(bn.items)
                continue
            self.settle(bn, owned)
        return owned

    def cut(self, x: float, most: int) -> tuple[list[list], list[LongDocument]]:
        """Step 1: the free items (whole documents) and the long documents, each laid out over its
        pieces of cost ``x`` (of at most ``most`` tokens where possible) as receives least."""
        csum, P, cap, target, tau = self.csum, self.P, self.cap, self.target, self.tau
        n_D = self.b_D - self.a_D
        long_D = (self.cost_D > x) | (n_D > TOKEN_SLACK * cap)
        longs = list(zip(self.a_D[long_D].tolist(), self.b_D[long_D].tolist()))
        tiny_D = ~long_D & (self.cost_D < BUNDLE_SHARE * target) & (n_D < BUNDLE_SHARE * tau)
        if (~long_D).sum() <= BUNDLE_ABOVE * P:  # few free items: each whole document alone
            tiny_D[:] = False
        rest = ~long_D & ~tiny_D
        free = [[run] for run in zip(self.a_D[rest].tolist(), self.b_D[rest].tolist())]
        if tiny_D.any():
            free += bundles(self.a_D[tiny_D], self.b_D[tiny_D], self.cost_D[tiny_D], target, tau)
        longs.sort(key=lambda d: csum[d[0]] - csum[d[1]])
        spare = P - sum(max(1, int((csum[b] - csum[a]) // x)) for a, b in longs)
        docs_long: list[LongDocument] = []
        for a, b in longs:
            cost, n = csum[b] - csum[a], b - a
            m_cost, m_tokens = min(int(cost // x), P, n // 4 + 1), math.ceil(n / (TOKEN_SLACK * cap))
            options = []
            if m_cost >= m_tokens:  # pieces of cost x; the cheap rest of the document's start stays whole
                lo = min(csum.left(csum[a] + cost - m_cost * x), b - m_cost)
                options.append(LongDocument(a, b, lo, m_cost, csum, self.traffic, most))
            else:  # too many tokens for its cost: pieces of L / P tokens at its end, its start whole
                m = max(1, min(P, math.ceil(n / tau) - 1))
                lo = max(a, b - m * most)
                if csum[b] - csum[lo] <= 0.98 * m * target:
                    options.append(LongDocument(a, b, lo, m, csum, self.traffic, most))
                m_cost = m if options else min(P, n, m_tokens)
                lo = lo if options else a
            if lo > a:  # or the start joins the nesting: with one piece more if there is a rank for it
                m_whole = min(m_cost + 1, P, n)
                too_long = lo - a > HEAD_TOKENS * cap
                if too_long or (spare > 0 and m_whole > m_cost) or not options:
                    whole = LongDocument(a, b, a, m_whole, csum, self.traffic, most)
                    options = [whole] if too_long else options + [whole]
                if cost <= 0.98 * m_cost * target:  # or as costlier pieces
                    options.append(LongDocument(a, b, a, m_cost, csum, self.traffic, most))
            if not options:
                options.append(LongDocument(a, b, a, max(1, min(P, n, m_cost)), csum, self.traffic, most))
            best = min(options, key=lambda d: max(d.recv))
            spare -= best.m - max(1, min(int(cost // x), P))
            docs_long.append(best)
        return free, docs_long

    def assign(self, docs_long: list[LongDocument], most: int) -> tuple[list[dict], int, list[int]]:
        """Step 2: the ranks of the long documents, own ranks while there are some, else shared with
        earlier ones (a document on shared ranks is laid out again in thinner pieces, in place in
        ``docs_long``); the groups ``dict(ranks, longs)``, the first rank left and each rank's
        receive from its equal pieces."""
        csum, P, target, tau = self.csum, self.P, self.target, self.tau
        groups: list[dict] = []
        next_rank = 0
        recv = [0] * P  # the equal pieces' receive per rank, and how far out they nest (1: outermost)
        outer = [0.0] * P
        for d in list(docs_long):
            d_old = d
            if P - next_rank >= d.m:
                d.slots = list(range(next_rank, next_rank + d.m))
                next_rank += d.m
                groups.append(dict(ranks=list(d.slots), longs=[d]))
            else:
                pool, merged = list(range(next_rank, P)), []
                next_rank = P
                m_thin = min(P, d.b - d.lo, math.ceil((d.b - d.lo) / (tau / 2)))
                if m_thin > d.m:  # shared ranks hold two documents' pieces: thinner ones
                    d = LongDocument(d.a, d.b, d.lo, m_thin, csum, self.traffic, most // 2)
                    docs_long[docs_long.index(d_old)] = d
                region = d.cost
                for g in sorted(groups, key=lambda g: -len(g["ranks"])):  # enough ranks and cost room
                    if len(pool) >= d.m and len(pool) * target >= 1.05 * region:
                        break
                    pool += g["ranks"]
                    region += sum(e.cost for e in g["longs"])
                    merged.append(g)
                groups = [g for g in groups if g not in merged]
                groups.append(dict(ranks=sorted(pool), longs=[e for g in merged for e in g["longs"]] + [d]))
                d.slots = [None] * d.m
                taken: set[int] = set()
                for j in range(d.m):  # outermost first, each to the innermost free rank (least receive)
                    r = min((r for r in pool if r not in taken), key=lambda r: (outer[r], recv[r]))
                    d.slots[j] = r
                    taken.add(r)
            for j, r in enumerate(d.slots):
                recv[r] += d.recv[j][0]
                outer[r] = max(outer[r], 1 - j / d.m)
        return groups, next_rank, recv

    def bins(self, groups: list[dict], next_rank: int, recv: list[int]) -> list[Bin]:
        """Step 3's bins: one per group (its ranks' cost less its pieces', their tokens less its
        pieces') and one per remaining rank."""
        P, cap, target, tau = self.P, self.cap, self.target, self.tau
        bins = []
        for g in groups:
            k = len(g["ranks"])
            region_cost = sum(d.cost for d in g["longs"])
            region_tokens = sum(d.b - d.lo for d in g["longs"])
            bins.append(Bin(k * target - region_cost, k * cap - region_tokens,
                             max(k * tau - region_tokens, 0.05 * tau), group=g))
            bins[-1].recv = min(recv[r] for r in g["ranks"])
        return bins + [Bin(target, cap, tau, rank=r) for r in range(next_rank, P)]

    def pack_nearest(self, free: list[list], groups: list[dict], next_rank: int, recv: list[int]) -> list[Bin]:
        """Step 3 by nearest density: the free items, largest first, each to the bin whose remaining
        cost per remaining target token is nearest the item's among those with room for its cost
        and tokens (:class:`DensityIndex`, O(log bins) per item), else to the bin with most token
        room. Exact fills follow from small items placed last; at hundreds of bins the large items
        leave the ranks short of cost at their token cap and the fill slow (:meth:`pack`)."""
        cost_of, size_of, target, tau = self.cost_of, self.size_of, self.target, self.tau
        bins = self.bins(groups, next_rank, recv)
        index = DensityIndex(bins)
        for item in sorted(free, key=lambda item: -max(cost_of(item) / target, size_of(item) / tau)):
            self.place(bins, index, item, cost_of(item), size_of(item))
        return bins

    def pack(self, free: list[list], groups: list[dict], next_rank: int, recv: list[int]) -> list[Bin]:
        """Step 3 by density balance: the items costing or holding more than :data:`BIG_SHARE` of
        a rank first, by nearest density (:meth:`place`); then each bin, those wanting a density
        furthest from the rest's first, takes the free items from the dense or the sparse end of
        the rest (sorted by cost per token) as its remaining cost per remaining token asks, while
        they fit (looking up to :data:`SEARCH` items in from that end, else from the other); what
        no bin took goes where it fits best, else to the bin emptiest in cost. Both the bins' costs
        and tokens come out near their targets, so the fill has little to do. Thousands of tiny
        documents arrive as bundles (:func:`bundles`), which stay whole. O(items + bins log bins)."""
        target, tau = self.target, self.tau
        cost_of, size_of = self.cost_of, self.size_of
        bins = self.bins(groups, next_rank, recv)
        big, pool = [], []
        for item in free:  # items costing or holding a good share of a rank first, the rest by density
            c, n = cost_of(item), size_of(item)
            (big if c > BIG_SHARE * target or n > BIG_SHARE * tau else pool).append((c, n, item))
        big.sort(key=lambda g: -max(g[0] / target, g[1] / tau))
        index = DensityIndex(bins)
        for c, n, item in big:
            self.place(bins, index, item, c, n)
        pool.sort(key=lambda g: g[0] / g[1])  # sparsest first
        taken = [False] * len(pool)
        ends = [0, len(pool) - 1]  # the sparsest and the densest item not taken
        pool_cost, pool_tokens = sum(g[0] for g in pool), sum(g[1] for g in pool)
        tol = FILL_TOLERANCE * target

        def want(bn: Bin) -> float:  # the bin's remaining cost per remaining target token
            return (bn.cap_cost - bn.load) / max(bn.target_tokens - bn.tokens, 1.0)

        def fitting(bn: Bin, dense: bool) -> int | None:  # of the SEARCH items nearest that end
            step, i, seen = (-1, ends[1], 0) if dense else (1, ends[0], 0)
            while 0 <= i < len(pool) and seen < SEARCH and ends[0] <= i <= ends[1]:
                if not taken[i]:
                    c, n, _ = pool[i]
                    if c <= bn.cap_cost - bn.load + tol and bn.tokens + n <= bn.cap_tokens:
                        return i
                    seen += 1
                i += step
            return None

        average = pool_cost / max(pool_tokens, 1)
        for bn in sorted(bins, key=lambda bn: -abs(math.log(max(want(bn), 1e-300) / max(average, 1e-300)))):
            index.remove(bn)
            while ends[0] <= ends[1] and bn.cap_cost - bn.load > tol:  # dense while it needs density
                dense = want(bn) >= pool_cost / max(pool_tokens, 1)
                i = fitting(bn, dense)
                if i is None and not (dense and bn.tokens >= bn.target_tokens):  # (sparse ones would
                    i = fitting(bn, not dense)  # fill its token room and leave its cost short)
                if i is None:
                    break
                c, n, item = pool[i]
                taken[i] = True
                while ends[0] <= ends[1] and taken[ends[0]]:
                    ends[0] += 1
                while ends[0] <= ends[1] and taken[ends[1]]:
                    ends[1] -= 1
                pool_cost -= c
                pool_tokens -= n
                bn.add(item, c, n)
            index.insert(bn)
        pool = [g for g, gone in zip(pool, taken) if not gone]
        for c, n, item in sorted(pool, key=lambda g: -g[0]):  # what no bin took: where it fits best, else
            best = index.nearest(math.log(max(c, 1e-300) / n), c, n)  # to the emptiest bin with token room
            if best is None:
                best = max(bins, key=lambda bn: (bn.tokens + n <= bn.cap_tokens, bn.cap_cost - bn.load))
            index.remove(best)
            best.add(item, c, n)
            index.insert(best)
        return bins

    @staticmethod
    def place(bins: list[Bin], index: DensityIndex, item, c: float, n: int) -> None:
        """Put one item in the bin whose remaining density is nearest its own among those with room
        for its cost and tokens; else (none has) the bin with most token room."""
        density = math.log(max(c, 1e-300) / n)
        best = index.nearest(density, c, n)
        if best is None:
            best_key = None
            for bn in bins:
                room = bn.cap_cost - bn.load
                key = (bn.tokens + n > bn.cap_tokens, 1, bn.tokens - bn.cap_tokens) if room < c else (
                    bn.tokens + n > bn.cap_tokens, 0, abs(density - bin_density(bn)))
                if best_key is None or key < best_key:
                    best, best_key = bn, key
        index.remove(best)
        best.add(item, c, n)
        index.insert(best)

    def grow(self, bn: Bin, rank: Bin, most: int) -> bool:
        """The group of ``bn`` takes in the under-full ``rank``: its largest document takes one more
        piece (its start, a free item here, joins the nesting if that receives less); False where
        the document has no token to spare."""
        csum, cap, target, tau = self.csum, self.cap, self.target, self.tau
        cost_of, size_of = self.cost_of, self.size_of
        d = max(bn.group["longs"], key=lambda d: d.cost)
        if d.m >= d.b - d.lo:
            return False
        for item in rank.items:
            bn.add(item, cost_of(item), size_of(item))
        options = [LongDocument(d.a, d.b, d.lo, d.m + 1, csum, self.traffic, most)]
        start = [(d.a, d.lo)]
        if d.lo > d.a and start in bn.items:  # its start, a free item here, may join the nesting
            options.append(LongDocument(d.a, d.b, d.a, d.m + 1, csum, self.traffic, most))
        e = min(options, key=lambda e: max(e.recv))
        if e.lo < d.lo:
            bn.remove(start, cost_of(start), size_of(start))
            bn.cap_cost -= cost_of(start)
            bn.cap_tokens -= size_of(start)
            bn.target_tokens = max(bn.target_tokens - size_of(start), 0.05 * tau)
        e.slots = d.slots + [rank.rank]
        bn.group["longs"][bn.group["longs"].index(d)] = e
        bn.group["ranks"].append(rank.rank)
        bn.cap_cost += target
        bn.cap_tokens += cap
        bn.target_tokens += tau
        return True

    def settle(self, bn: Bin, owned: list[list]) -> None:
        """A group's ranks (step 4 of :mod:`cp_attention.layout.balanced`): its free items spread over them,
        each rank's remaining cost its pieces' budget, then its long documents split. A rank first gets
        the densest free items it needs to reach the target at all; then the items go, largest
        first, to the rank whose pieces nest innermost (the outer pieces keep large budgets: they
        hold the document's end and receive most, less the more tokens they hold) among those whose
        tokens stay under SETTLE_SLACK x cap (estimated from equal pieces, which shrink by the
        item's cost), else where the tokens stay least. A rank whose split leaves it over the cap
        passes free items to the group's rank with most room (a halo to the rank that receives
        least), and the documents are split again (a few rounds)."""
        spread = _GroupSpread(self, bn.group)
        spread.place(bn.items)
        for round_ in range(SETTLE_ROUNDS + 1):
            pieces, recv, held = spread.split()
            if round_ == SETTLE_ROUNDS:
                break
            moved = False
            for r in sorted(spread.ranks, key=lambda r: -held[r]):
                if held[r] <= self.cap:
                    break
                moved = spread.pass_items(r, held, recv) or moved
                moved = spread.cut_item(r, held, recv) or moved
            if not moved:
                break
        for r in spread.ranks:
            owned[r] = spread.items[r] + pieces[r]


class _GroupSpread:
    """A group's ranks as step 4 settles them (:meth:`Batch.settle`): each rank's free items, their
    cost and tokens, and its equal pieces' cost per token, most cost and nesting."""

    def __init__(self, batch: Batch, g: dict):
        self.batch, self.g, self.ranks = batch, g, g["ranks"]
        self.target, self.cap, self.cost_of, self.size_of = batch.target, batch.cap, batch.cost_of, batch.size_of
        ranks, size_of = self.ranks, self.size_of
        share = {r: 0.0 for r in ranks}  # the equal pieces' cost and tokens per rank
        self.tokens = tokens = {r: 0 for r in ranks}
        self.most_pieces = most_pieces = {r: 0.0 for r in ranks}  # the most its documents can give a rank
        self.outer = outer = {r: 0.0 for r in ranks}  # how far out the rank's pieces nest: free items go to inner ones
        for d in g["longs"]:
            for j, r in enumerate(d.slots):
                share[r] += d.cost / d.m
                tokens[r] += size_of(d.pieces[j])
                most_pieces[r] += d.cost
                outer[r] = max(outer[r], 1 - j / d.m)
        self.per_token = {r: share[r] / max(tokens[r], 1) for r in ranks}
        self.items = {r: [] for r in ranks}
        self.load = {r: 0.0 for r in ranks}
        self.free_tokens = {r: 0 for r in ranks}

    def halo(self, item) -> int:
        """What a free item receives: nothing if it starts a document."""
        return 0 if item[0][0] in self.batch.starts else self.batch.traffic.recv(item)[0]

    def put(self, r: int, item, sign: int = 1) -> None:
        """Rank ``r`` takes the free item (``sign`` -1: gives it away)."""
        if sign > 0:
            self.items[r].append(item)
        else:
            self.items[r].remove(item)
        self.load[r] += sign * self.cost_of(item)
        self.free_tokens[r] += sign * self.size_of(item)

    def after(self, r: int, c: float, n: int) -> float:
        """Rank ``r``'s estimated tokens with an item of cost ``c`` and ``n`` tokens more: its pieces shrink by c."""
        return self.free_tokens[r] + n + min(max(self.target - self.load[r] - c, 0.0), self.most_pieces[r]) / \
            self.per_token[r]

    def place(self, free: list) -> None:
        """The group's free items spread over its ranks (as :meth:`Batch.settle` says)."""
        ranks, load, target, cap = self.ranks, self.load, self.target, self.cap
        cost_of, size_of, after, put = self.cost_of, self.size_of, self.after, self.put
        by_recv = sorted(ranks, key=lambda r: self.outer[r])
        pending = sorted(free, key=lambda item: -size_of(item))
        for r in ranks:  # first the free items a rank needs to reach the target at all, the densest
            for item in sorted(pending, key=lambda item: -cost_of(item) / size_of(item)):
                if load[r] >= target - self.most_pieces[r]:
                    break
                if load[r] + cost_of(item) <= target and after(r, cost_of(item), size_of(item)) <= cap:
                    put(r, item)
                    pending.remove(item)
        for item in pending:
            c, n = cost_of(item), size_of(item)
            fits = [r for r in by_recv if load[r] + c <= target] or [max(ranks, key=lambda r: target - load[r])]
            r = next((r for r in fits if after(r, c, n) <= SETTLE_SLACK * cap), None)
            put(min(fits, key=lambda r: after(r, c, n)) if r is None else r, item)

    def split(self) -> tuple[dict, dict, dict]:
        """The long documents split by the budgets the free items leave: per rank its pieces, its
        receive (heaviest layer, free items' halos included) and its tokens."""
        ranks, items, free_tokens, tokens, cap, size_of = (self.ranks, self.items, self.free_tokens, self.tokens,
                                                            self.cap, self.size_of)
        budgets = _budgets(self.g, {r: self.target - self.load[r] for r in ranks})
        pieces = {r: [] for r in ranks}
        recv = {r: sum(self.halo(item) for item in items[r]) for r in ranks}  # heaviest layer
        for d, bud in zip(self.g["longs"], budgets):
            most = [max(int((cap - free_tokens[r]) * size_of(d.pieces[j]) / max(tokens[r], 1)), 1)
                    for j, r in enumerate(d.slots)]  # the rank's room, shared as equal pieces share it
            for r, piece, got in zip(d.slots, *d.split(bud, most)):
                if piece:
                    pieces[r].append(piece)
                    recv[r] += got[0]
        held = {r: free_tokens[r] + sum(size_of(piece) for piece in pieces[r]) for r in ranks}
        return pieces, recv, held

    def pass_items(self, r: int, held: dict, recv: dict) -> bool:
        """Rank ``r`` over the cap passes free items, the smallest first, each to the roomiest rank
        (``held`` updated); whether one moved."""
        ranks, load, target, cap, halo = self.ranks, self.load, self.target, self.cap, self.halo
        moved = False
        for item in sorted(self.items[r], key=self.size_of):  # the smallest items first, to the roomiest rank
            if held[r] <= cap:
                break
            n, c, h = self.size_of(item), self.cost_of(item), halo(item)
            dest = min((q for q in ranks if q != r and load[q] + c <= target and held[q] + n <= cap),
                       key=lambda q: (recv[q] + h if h else 0, held[q]), default=None)
            if dest is None:
                continue
            self.put(r, item, -1)
            self.put(dest, item)
            held[r] -= n
            held[dest] += n
            moved = True
        return moved

    def cut_item(self, r: int, held: dict, recv: dict) -> bool:
        """Rank ``r`` still over the cap: its largest whole document cut, its head or its tail to another
        rank where the busier receives least (``held`` updated); whether it was cut."""
        ranks, load, target, cap, halo, csum = self.ranks, self.load, self.target, self.cap, self.halo, self.batch.csum
        whole = [item for item in self.items[r] if len(item) == 1 and item[0][0] in self.batch.starts]
        if not (held[r] > cap and whole):
            return False
        item = max(whole, key=self.size_of)  # else its largest item cut: its head or its tail moves
        (p, q), = item
        k = min(2 * (held[r] - cap) + 16, q - p - 1)  # tokens to move, with room for pieces to grow
        best = None
        for dest in (q_ for q_ in ranks if q_ != r and held[q_] + k <= cap):
            for part, rest in (((p, p + k), (p + k, q)), ((q - k, q), (p, q - k))):
                c = csum[part[1]] - csum[part[0]]
                if load[dest] + c > target:
                    continue
                h = halo([part if part[0] > p else rest])
                key = (max(recv[r] + (h if part[0] == p else 0), recv[dest] + (h if part[0] > p else 0)),
                       held[dest])
                if best is None or key < best[0]:
                    best = (key, dest, part, rest)
        if best is None:
            return False
        _, dest, part, rest = best
        self.put(r, item, -1)
        self.put(r, [rest])
        self.put(dest, [part])
        held[r] -= k
        held[dest] += k
        return True


def _budgets(group: dict, gap: dict[int, float], rounds: int = 60) -> list[list[float]]:
    """Each long document's piece costs in a group: every rank's pieces fill its gap (target minus
    its free items) and every document's pieces its region (a transportation problem on the
    document-rank pairs). A rank or a document with one open pair left fixes it (exact, as far as
    the costs allow: none goes below zero); pairs left on cycles (ranks shared both ways) share by
    iterative proportional fitting."""
    longs = group["longs"]
    cost = [[0.0] * d.m for d in longs]
    open_ = {(i, j) for i, d in enumerate(longs) for j in range(d.m)}
    left_doc = [d.cost for d in longs]
    left_rank = {r: max(gap[r], 0.0) for r in group["ranks"]}
    at_rank: dict[int, set] = {r: set() for r in group["ranks"]}
    for i, d in enumerate(longs):
        for j, r in enumerate(d.slots):
            at_rank[r].add((i, j))

    def fix(i: int, j: int, value: float) -> None:
        value = max(min(value, left_doc[i]), 0.0)
        cost[i][j] = value
        left_doc[i] -= value
        left_rank[longs[i].slots[j]] -= value
        open_.discard((i, j))
        at_rank[longs[i].slots[j]].discard((i, j))

    progress = True
    while progress and open_:
        progress = False
        for r, pairs in at_rank.items():  # a rank with one open pair
            if len(pairs) == 1:
                fix(*next(iter(pairs)), left_rank[r])
                progress = True
        for i in range(len(longs)):  # a document with one open pair
            mine = [(i, j) for j in range(longs[i].m) if (i, j) in open_]
            if len(mine) == 1:
                fix(*mine[0], left_doc[i])
                progress = True
    if open_:  # the cycles: proportional fitting from equal shares
        for i, j in open_:
            cost[i][j] = left_doc[i] / sum(1 for i_, _ in open_ if i_ == i)
        for _ in range(rounds):
            per_rank: dict[int, float] = {}
            for i, j in open_:
                r = longs[i].slots[j]
                per_rank[r] = per_rank.get(r, 0.0) + cost[i][j]
            for i, j in open_:
                r = longs[i].slots[j]
                cost[i][j] *= max(left_rank[r], 0.0) / per_rank[r] if per_rank[r] > 0 else 0.0
            per_doc: dict[int, float] = {}
            for i, j in open_:
                per_doc[i] = per_doc.get(i, 0.0) + cost[i][j]
            for i, j in open_:
                cost[i][j] *= left_doc[i] / per_doc[i] if per_doc[i] > 0 else 0.0
    for i, d in enumerate(longs):  # a document's pieces add up to it, whatever the ranks allowed
        total = sum(cost[i])
        cost[i] = [c * d.cost / total for c in cost[i]] if total > 0 else [d.cost / d.m] * d.m
    return cost


def layout_from_items(L: int, owned: list[list], size_of) -> Layout:
    """The Layout of every rank's items; a rank with nothing takes the last token of the largest
    item of the rank with the most tokens."""
    P = len(owned)
    owned = [[[run for run in item if run[1] > run[0]] for item in items] for items in owned]
    owned = [[item for item in items if item] for items in owned]
    for r in range(P):
        if not owned[r]:
            donor = max(range(P), key=lambda d: sum(size_of(item) for item in owned[d]))
            item = max(owned[donor], key=size_of)
            owned[donor].remove(item)
            a, b = max(item, key=lambda run: run[1])
            rest = [run for run in item if run != (a, b)] + ([(a, b - 1)] if b - a > 1 else [])
            if rest:
                owned[donor].append(rest)
            owned[r] = [[(b - 1, b)]]
    ranges = tuple(tuple(merge_ranges(run for item in items for run in item)) for items in owned)
    return Layout(L, ranges, name="balanced")
