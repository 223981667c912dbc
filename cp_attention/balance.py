"""Balanced layouts for packed batches: which tokens each rank holds so that every rank does the same
work, holds at most a cap of tokens and receives little K/V (issue #14: packed documents run
unbalanced under zigzag, which balances one causal sequence).

Cost model (pure): a rank's cost is the (query, key) pairs its queries see, summed over the model's
attention layers and the batch rows, plus ``token_weight`` per token and row (the model's dense
per-token compute, projections and MLP, in units of one visible pair of one layer). Traffic model: a
rank receives every key its queries see that it does not hold, the planner's count
(:class:`Traffic`); a document held whole by one rank costs none. Placements are compared by the
traffic of the layer whose keys reach furthest (a full layer if there is one: what a rank waits
for), the sum over the layers breaking ties.

Costs in closed form (:class:`Costs`): a token's cost is linear in its index between segment edges
and window kinks, so the cost of any token range is a quadratic per document piece, and the planning
reads nothing per token (O(documents) from ``cu_seqlens``).

Partition, per document (Python loops over documents and ranks, nothing per token):

1. *Long documents.* A piece cost ``x`` (a fraction of the per-rank target, largest first) is chosen
   for which an estimate of the ranks' tokens stays under the cap (:func:`_piece_cost`). Only
   documents costing more than ``x``, or holding more tokens than a rank may, are cut: into ``m``
   pieces, one per rank, nested like zigzag within the document (piece ``j`` is a head chunk and a
   tail chunk around the pieces inside it; the innermost is contiguous)::

       document:  [free start][ 0 ][ 1 ][ 2 ][   3   ][ 2 ][ 1 ][ 0 ]

   Under a causal mask a piece receives every earlier token of its document that it does not hold,
   so the chunks are sized by bisection on the largest receive (outer pieces, which hold the
   document's end, take cheap early tokens), within a token limit per piece; a contiguous split is
   used where it receives less (a window bounds the halo). The document's cheap start stays whole
   outside the nesting (a free item; ``m = floor(cost / x)``) or joins it (one piece more where a
   rank is spare, or costlier pieces), whichever receives least; a document long only in tokens is
   cut into pieces of L / P tokens at its end, its start whole.
2. *Ranks.* Each long document takes ranks of its own while there are some; a later one shares the
   ranks whose pieces nest innermost. Ranks linked by documents form a *group*; the cost of a piece
   stays open until step 4, so a group is one bin of its ranks' total cost.
3. *Free items* (short documents and free starts, whole: no traffic) are packed, largest first, into
   the bins (groups, and the ranks left) whose remaining cost per remaining token is nearest theirs.
   Then every bin is made exact: an over-full bin passes a whole item, else an item cut at the exact
   cost (its head moves and the rest, staying, receives that head, or its tail moves and receives
   the rest: whichever leaves the receiving rank receiving less), else swaps an item for the
   under-full bin's sparsest ones; a group that cannot pass its excess takes in an under-full rank
   (one more piece; the document's start joins the nesting if that receives less).
4. *Groups.* Each rank first gets the free items it needs to reach the target at all (its documents
   cannot give it more than their cost), then the free items go to the ranks whose pieces nest
   innermost, while their tokens stay well under the cap (the outer pieces keep the budget to hold
   many tokens, so they receive less). Each rank's remaining cost is its pieces' budget (a
   transportation problem where documents share ranks); the documents are split with those budgets,
   and a rank left over the cap passes free items (or a cut part of one, where the cut receives
   less) to the group's roomiest rank.

Where a rank misses the cost (``ACCEPT``) or the token goal, smaller piece costs are tried (``RETRIES``);
the first partition that meets both is kept, unless an earlier one within ``LOOSE`` of the target
has a busiest rank receiving less. The result is a :class:`~cp_attention.layout.Layout`; exactness
never depends on it.

Modules: this one holds the public entries, the cost and traffic models and the choice of the
piece cost; :mod:`cp_attention.balance_partition` the partition (steps 1-4) and
:mod:`cp_attention.balance_split` the split of one long document into pieces.

Legend: ``B`` rows, ``L`` tokens per row, ``P`` ranks, ``D`` documents; a *run* is a ``(start, end)``
range of global token indices, an *item* a list of runs that moves as one.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import torch

from .balance_partition import TOKEN_SLACK, Batch, layout_from_items
from .layout import Layout, merge_ranges
from .masks import MaskSpec, SequenceMeta, segment_runs

__all__ = ["Traffic", "balanced_layout", "balanced_layout_of", "token_costs"]

PIECE_COSTS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)
"""Candidate piece costs, as fractions of the per-rank target, tried largest first."""
RETRIES = 4
"""Smaller piece costs tried after the estimated one when a rank misses the cost or token goal."""
ACCEPT = 0.01
"""A partition whose busiest rank is within this fraction of the target (and within the token cap) is kept."""
LOOSE = 0.03
"""... or an earlier one within this fraction whose busiest rank receives less K/V."""


def _spec(mask: dict | MaskSpec) -> MaskSpec:
    if isinstance(mask, MaskSpec):
        return mask
    unknown = set(mask) - {"causal", "window", "chunk_size"}
    if unknown:
        raise ValueError(f"masks: each layer is a dict of attention()'s causal/window/chunk_size, got {sorted(unknown)}")
    return MaskSpec(**mask)


def _layers(masks) -> list[tuple[int, MaskSpec]]:
    """The distinct layer masks, each ``(count, spec)``: how many layers use it."""
    masks = [{}] if masks is None else list(masks)
    if not masks:
        raise ValueError("masks: give at least one layer (default: one plain causal layer)")
    counts: dict[MaskSpec, int] = {}
    for mask in masks:
        spec = _spec(mask).for_planning()  # softcap and scale change no visible pair
        counts[spec] = counts.get(spec, 0) + 1
    return [(count, spec) for spec, count in counts.items()]


def _events(s: np.ndarray, e: np.ndarray, spec: MaskSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The visible keys of a query of segment ``[s, e)`` under ``spec``, for segments ``s``, ``e``
    (N,) int64, as a piecewise linear function of the query's index: events ``(at, jump, slope)``,
    each (E,) int64, where the function's value jumps by ``jump`` and its slope changes by ``slope``.

    With ``R = window - 1`` (no window: no kink) and ``n = e - s``, query ``q`` sees

    * causal: ``min(q - s, R) + 1`` keys: 1 at ``s``, one more per token until ``s + R``;
    * bidirectional, no window: ``n`` keys;
    * bidirectional: ``min(q - s, R)`` keys before it (0 at ``s``, one more per token until ``s + R``)
      and ``min(e - q, R + 1)`` from it on (falling by one per token from ``e - R - 1``, to 0 at ``e``).

    Each part ends at ``e`` with a jump back to 0 and the slope it had removed."""
    n, one, zero = e - s, np.ones_like(s), np.zeros_like(s)
    if spec.window is None and not spec.causal:
        return np.concatenate((s, e)), np.concatenate((n, -n)), np.concatenate((zero, zero))
    R = n if spec.window is None else np.minimum(n, spec.window - 1)  # the rise's length (n: no kink)
    rises = R < n
    at = [s, (s + R)[rises], e]
    jump = [one if spec.causal else zero, zero[rises], -R - 1 if spec.causal else -R]
    slope = [one, -one[rises], -(~rises).astype(np.int64)]
    if not spec.causal:
        fall = e - spec.window  # = e - R - 1: from here on the keys at and after q fall by one per token
        flat = fall > s
        at += [s, fall[flat]]
        jump += [np.minimum(n, spec.window), zero[flat]]
        slope += [-(~flat).astype(np.int64), -one[flat]]
        slope[2] = slope[2] + 1  # the falling part ends at e, at 0, with slope -1
    return np.concatenate(at), np.concatenate(jump), np.concatenate(slope)


class Costs(dict):
    """The cost of every prefix of the row: ``costs[i]`` (a float) is the cost of tokens ``[0, i)``,
    ``0 <= i <= L`` (``len(costs) == L + 1``), in closed form, without an array per token.

    A token's cost as a query (its visible keys summed over the layers and rows, plus ``token_weight``
    x B) is linear in its index between *knots* (the segments' edges in every row and layer, and
    where a window stops widening or starts narrowing: :func:`_events`), so between knots a prefix's
    cost is quadratic: with ``u`` the last knot at or before ``i`` and ``n = i - u``, ``[0, i)`` holds
    ``pairs(u) + n value(u) + slope(u) n (n - 1) / 2`` visible pairs (exact integers) and costs that
    plus ``token_weight x B x i``: the floats a running sum of the per-token costs gives wherever that
    sum is exact (integer token weights), else the exact cost rounded once (a running sum drifts).
    :meth:`left` answers ``bisect``'s question over the whole row from the quadratic's root, settled
    by a few exact comparisons. O(knots) to build. A dict of the prefixes
    read so far, the knots from the start: a read is a lookup (the partition reads documents' edges
    again and again), else a bisection over the knots. :meth:`window` gives one document's view.
    """

    def __init__(self, meta: SequenceMeta, layers: list[tuple[int, MaskSpec]], token_weight: float):
        super().__init__()
        L = meta.seq_len
        at, jump, slope = [np.array([L])], [np.zeros(1, dtype=np.int64)], [np.zeros(1, dtype=np.int64)]  # the end
        for count, spec in layers:
            for starts, ends in segment_runs(meta, spec.chunk_size):
                a, j, s = _events(starts, ends, spec)
                at.append(a)
                jump.append(count * j)
                slope.append(count * s)
        knots, which = np.unique(np.concatenate(at), return_inverse=True)
        jump_K, slope_K = np.zeros(len(knots), dtype=np.int64), np.zeros(len(knots), dtype=np.int64)
        np.add.at(jump_K, which, np.concatenate(jump))
        np.add.at(slope_K, which, np.concatenate(slope))
        slope_K = np.cumsum(slope_K)  # the slope from each knot to the next
        n_K = np.diff(knots)
        value_K = np.cumsum(jump_K + np.concatenate(([0], slope_K[:-1] * n_K)))  # a query's keys at the knot
        pairs_K = np.concatenate(([0], np.cumsum(n_K * value_K[:-1] + slope_K[:-1] * (n_K * (n_K - 1) // 2))))
        self.L, self.weight = L, float(token_weight) * meta.batch
        self.arrays = (knots, pairs_K, value_K, slope_K)
        self.knots, self.pairs, self.value, self.slope = (x.tolist() for x in self.arrays)
        self.at_knots = (pairs_K + self.weight * knots).tolist()  # costs at the knots, increasing
        self.update(zip(self.knots, self.at_knots))  # the documents' edges, read first

    def __missing__(self, i: int) -> float:
        k = bisect.bisect_right(self.knots, i) - 1
        n = i - self.knots[k]
        c = self[i] = self.pairs[k] + n * self.value[k] + self.slope[k] * (n * (n - 1) // 2) + self.weight * i
        return c

    def __len__(self) -> int:
        return self.L + 1

    def window(self, a: int, b: int) -> CostWindow:
        """The costs of the prefixes of the row's tokens ``[a, b)``: ``cs[i] = costs[a + i] - costs[a]``."""
        return CostWindow(self, a, b)

    def prefix(self, idx: np.ndarray) -> np.ndarray:
        """``costs[i]`` for every ``i`` of ``idx`` (int64 numpy), float64 of its shape."""
        knots, pairs, value, slope = self.arrays
        k = np.searchsorted(knots, idx, side="right") - 1
        n = idx - knots[k]
        return pairs[k] + n * value[k] + slope[k] * (n * (n - 1) // 2) + self.weight * idx

    def left(self, v: float) -> int:
        """``bisect.bisect_left(costs, v)``: the first ``i`` with ``costs[i] >= v``, else ``L + 1``."""
        return _settle(lambda i: self[i] >= v, self._guess(v), 0, self.L + 1)

    def _guess(self, v: float) -> int:
        """About the first ``i`` with ``costs[i] >= v``: the root of the quadratic of its knots' run."""
        k = bisect.bisect_left(self.at_knots, v)
        if k == 0 or k == len(self.knots):
            return 0 if k == 0 else self.L + 1
        k -= 1
        u, w, slope = self.knots[k], self.weight, self.slope[k]
        # a n^2 + b n + c: the cost of [u, u + n) less v - costs[u] (> 0), rising through 0 at the answer
        a, b, c = slope / 2, self.value[k] - slope / 2 + w, self.at_knots[k] - v
        root = b + math.sqrt(max(b * b - 4 * a * c, 0.0))
        n = math.ceil(-2 * c / root) if root > 0 else 1
        return min(max(n, 1), self.knots[k + 1] - u) + u


class CostWindow(dict):
    """One document's prefix costs (:meth:`Costs.window`): ``cs[i] = costs[a + i] - costs[a]`` for
    ``0 <= i <= b - a`` (``len(cs) == b - a + 1``), a dict filled on first read like :class:`Costs`
    (the splits of a document read it thousands of times, mostly the same prefixes again);
    ``left``/``right`` are ``bisect``'s on it."""

    def __init__(self, costs: Costs, a: int, b: int):
        super().__init__()
        self.costs, self.a, self.base, self.size = costs, a, costs[a], b - a + 1

    def __missing__(self, i: int) -> float:
        c = self[i] = self.costs[self.a + i] - self.base
        return c

    def __len__(self) -> int:
        return self.size

    def left(self, v: float, lo: int = 0, hi: int | None = None) -> int:
        """``bisect.bisect_left(cs, v, lo, hi)``."""
        return bisect.bisect_left(self, v, lo, self.size if hi is None else hi)

    def right(self, v: float, lo: int = 0, hi: int | None = None) -> int:
        """``bisect.bisect_right(cs, v, lo, hi)``."""
        return bisect.bisect_right(self, v, lo, self.size if hi is None else hi)


def _settle(pred, guess: int, lo: int, hi: int) -> int:
    """The first ``i`` in ``[lo, hi)`` where ``pred`` (false, then true) holds, else ``hi``: what
    ``bisect`` finds, searched outwards from ``guess`` (two calls of ``pred`` when it is right)."""
    i = min(max(guess, lo), hi)
    step = 1
    if i == hi or pred(i):  # the answer is at or below i: step down, doubling
        good, bad = i, None
        while bad is None:
            j = good - step
            if j < lo:
                bad = lo - 1
            elif pred(j):
                good, step = j, 2 * step
            else:
                bad = j
    else:  # above i: step up, doubling
        good, bad = None, i
        while good is None:
            j = bad + step
            if j >= hi:
                good = hi
            elif pred(j):
                good = j
            else:
                bad, step = j, 2 * step
    while good - bad > 1:
        mid = (good + bad) // 2
        if pred(mid):
            good = mid
        else:
            bad = mid
    return good


def token_costs(meta: SequenceMeta, masks=None, token_weight: float = 0.0) -> torch.Tensor:
    """(L,) float64 cost of each token index as a query: visible keys summed over ``masks`` (one
    entry per attention layer; default one plain causal layer) and the B rows, plus
    ``token_weight`` x B (the differences of :class:`Costs`)."""
    costs = Costs(meta, _layers(masks), token_weight)
    return torch.from_numpy(np.diff(costs.prefix(np.arange(meta.seq_len + 1))))


def _documents(meta: SequenceMeta) -> list[tuple[int, int]]:
    """Items: the index ranges between the union of every row's document boundaries."""
    if meta.starts is None:
        return [(0, meta.seq_len)]
    starts = np.unique(np.concatenate(meta.starts)).tolist()
    return list(zip(starts, starts[1:] + [meta.seq_len]))


def _union_segments(meta: SequenceMeta, chunk_size: int | None) -> tuple[list[int], list[int], list[int]]:
    """The attention segments of every row as step functions of the token index over the union of
    their starts ``knots``: from ``knots[k]`` to the next, the first token of a segment holding the
    token in some row is ``lo[k]`` (the least over the rows) and the end of one ``hi[k]`` (the greatest)."""
    rows = segment_runs(meta, chunk_size)
    knots = np.unique(np.concatenate([starts for starts, _ in rows]))
    at = [np.searchsorted(starts, knots, side="right") - 1 for starts, _ in rows]
    lo = np.min([starts[k] for (starts, _), k in zip(rows, at)], axis=0)
    hi = np.max([ends[k] for (_, ends), k in zip(rows, at)], axis=0)
    return knots.tolist(), lo.tolist(), hi.tolist()


class Traffic:
    """K/V tokens a rank holding ``runs`` receives: every key its queries see that it does not hold,
    the planner's count (one row's worth; a union over the rows). :meth:`recv` gives
    ``(heaviest layer, all layers)``: the layer whose keys reach furthest (a full layer if there is
    one) is what a rank waits for, windowed layers' halos are bounded by their windows; the total
    breaks ties."""

    def __init__(self, meta: SequenceMeta, layers: list[tuple[int, MaskSpec]]):
        segments: dict[int | None, tuple] = {}
        self.layers = []
        for count, spec in layers:
            if spec.chunk_size not in segments:
                segments[spec.chunk_size] = _union_segments(meta, spec.chunk_size)
            knots, lo, hi = segments[spec.chunk_size]
            reach = meta.seq_len if spec.window is None else spec.window - 1
            self.layers.append((count, reach, knots, lo, None if spec.causal else hi))
        self.layers.sort(key=lambda layer: (-layer[1], layer[4] is None))  # the heaviest first

    def recv(self, runs) -> tuple[int, int]:
        out = []
        for count, reach, knots, lo, hi in self.layers:
            need = []
            for p, q in runs:
                s = max(lo[bisect.bisect_right(knots, p) - 1], p - reach)
                if s < p:
                    need.append((s, p))
                if hi is not None:
                    e = min(hi[bisect.bisect_right(knots, q - 1) - 1], q + reach)
                    if e > q:
                        need.append((q, e))
            n = 0
            for a, b in merge_ranges(need):
                n += b - a - sum(max(0, min(b, q) - max(a, p)) for p, q in runs)
            out.append((n, count))
        return out[0][0], sum(n * count for n, count in out)


def _piece_cost(costs: Costs, docs: list[tuple[int, int]], P: int, cap: int) -> float:
    """The largest piece cost, as a fraction of the target from PIECE_COSTS, for which the tokens fit,
    estimated by packing the free items (whole documents and free heads) continuously: the ranks
    without a piece take the free items with most cost per token, the ranks with one the rest; both
    must stay under TOKEN_SLACK x cap."""
    target = costs[costs.L] / P
    start_D = np.array([a for a, _ in docs])
    n_D = np.array([b - a for a, b in docs])
    at_D = costs.prefix(start_D)
    cost_D = costs.prefix(start_D + n_D) - at_D
    limit = TOKEN_SLACK * cap
    best = (math.inf, 1.0)
    for f in PIECE_COSTS:
        x = f * target
        m_D = np.floor(cost_D / x)
        k = int(m_D.sum())
        if k > P:
            break
        cut = m_D > 0
        head_D = np.minimum(np.array([costs.left(v) for v in at_D[cut] + cost_D[cut] - m_D[cut] * x],
                                     dtype=np.int64) - start_D[cut], n_D[cut])
        region_D = n_D[cut] - head_D
        free_cost = np.concatenate((cost_D[~cut], cost_D[cut] - m_D[cut] * x))
        free_n = np.concatenate((n_D[~cut], head_D))
        order = np.argsort(-free_cost / np.maximum(free_n, 1))  # most cost per token first
        got_cost, got_n = np.cumsum(free_cost[order]), np.cumsum(free_n[order])
        need = (P - k) * target  # the ranks without a piece: the densest free items
        i = min(int(np.searchsorted(got_cost, need)), len(order) - 1) if len(order) else -1
        fresh = 0.0 if i < 0 else got_n[i] - (got_cost[i] - need) / max(free_cost[order[i]], 1e-300) * free_n[order[i]]
        fresh = min(max(fresh, 0.0), float(free_n.sum()))
        rest = float(free_n.sum()) - fresh
        worst = max(fresh / (P - k) if k < P else 0.0,
                    (float(region_D.sum()) + rest) / k if k else 0.0,
                    float((region_D / np.maximum(m_D[cut], 1)).max()) if k else 0.0)
        if worst <= limit:
            return f
        best = min(best, (worst, f))
    return best[1]


def balanced_layout(world_size: int, *, position_ids=None, cu_seqlens=None, seq_len: int | None = None,
                    masks=None, token_weight: float = 0.0, max_token_ratio: float = 1.25,
                    document_starts=None) -> Layout:
    """A layout giving every rank about the same cost for this batch, cutting few documents where
    their halos are short (see the module docstring).

    Args:
        world_size: P.
        position_ids: (B, L) or (L,) the batch's positions (documents restart them), or
        cu_seqlens: (N+1,) document boundaries of one row, or neither (with ``seq_len``: one document).
        masks: the model's attention layers, one dict of ``attention()``'s ``causal``/``window``/
            ``chunk_size`` (or a MaskSpec) per layer, repeats allowed; default one plain causal layer.
            They give the cost and the traffic of every placement.
        token_weight: dense per-token work in units of one visible pair of one layer.
        max_token_ratio: no rank holds more than this x L / P tokens (activation memory) where the
            documents allow it.
        document_starts: (B, L) bool, with ``position_ids``: further tokens that open a document
            (padding, a collator's document boundaries; what ``cp.shard_batch`` records).

    Returns a :class:`~cp_attention.layout.Layout` (one index set for every row of the batch).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not token_weight >= 0:
        raise ValueError(f"token_weight must be >= 0, got {token_weight!r}")
    meta = SequenceMeta.of_batch(position_ids=position_ids, cu_seqlens=cu_seqlens, seq_len=seq_len,
                                 document_starts=document_starts, caller="balanced_layout")
    return balanced_layout_of(meta, world_size, masks=masks, token_weight=token_weight,
                              max_token_ratio=max_token_ratio)


def balanced_layout_of(meta: SequenceMeta, world_size: int, *, masks=None, token_weight: float = 0.0,
                       max_token_ratio: float = 1.25) -> Layout:
    """:func:`balanced_layout` for documents already described by ``meta`` (e.g. the metadata
    ``cp.shard_batch`` records), without reading the position ids again."""
    L, P = meta.seq_len, world_size
    if L < P:
        raise ValueError(f"sequence length {L} is shorter than the world size {P}")
    layers = _layers(masks)
    if P == 1:
        return Layout(L, (((0, L),),), name="balanced")
    costs = Costs(meta, layers, token_weight)
    batch = Batch(costs, P, max(math.ceil(max_token_ratio * L / P), math.ceil(L / P)), _documents(meta),
                  Traffic(meta, layers))
    first = PIECE_COSTS.index(_piece_cost(costs, batch.docs, P, batch.cap))
    tried = []  # (miss of the tight goals, miss of the loose ones, busiest receive, partition)
    for f in PIECE_COSTS[first:first + 1 + RETRIES]:  # smaller pieces where a rank misses a goal
        owned = batch.partition(f * batch.target)
        load = max(sum(batch.cost_of(item) for item in items) for items in owned) / batch.target
        tokens = max(sum(batch.size_of(item) for item in items) for items in owned) / batch.cap
        recv = max(batch.traffic.recv([run for item in items for run in item])[0] for items in owned)
        tried.append((max(load - 1 - ACCEPT, tokens - 1, 0.0), max(load - 1 - LOOSE, tokens - 1, 0.0), recv, owned))
        if tried[-1][0] == 0:
            break
    # the first partition within ACCEPT of the target, unless an earlier one within LOOSE receives less
    tight = next((t for t in tried if t[0] == 0), None)
    loose = min((t for t in tried if t[1] == 0), key=lambda t: t[2], default=None)
    if tight is None or (loose is not None and loose[2] < tight[2]):
        tight = loose
    best = tight if tight is not None else min(tried, key=lambda t: (t[1], t[0]))
    return layout_from_items(L, best[3], batch.size_of)
