"""Balanced layouts for packed batches: which tokens each rank holds so that every rank does the same
work, holds at most a cap of tokens and receives little K/V (issue #14: packed documents run
unbalanced under zigzag, which balances one causal sequence).

Cost model (pure): a rank's cost is the (query, key) pairs its queries see, summed over the model's
attention layers and the batch rows, plus ``token_weight`` per token and row (the model's dense
per-token compute, projections and MLP, in units of one visible pair of one layer). Traffic model: a
rank receives every key its queries see that it does not hold, the planner's count
(:class:`_Traffic`); a document held whole by one rank costs none. Placements are compared by the
traffic of the layer whose keys reach furthest (a full layer if there is one: what a rank waits
for), the sum over the layers breaking ties.

Partition, per document (Python loops over documents and ranks, numpy over tokens):

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

Legend: ``B`` rows, ``L`` tokens per row, ``P`` ranks, ``D`` documents; a *run* is a ``(start, end)``
range of global token indices, an *item* a list of runs that moves as one.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import torch

from .layout import Layout, merge_ranges
from .masks import MaskSpec, SequenceMeta, doc_starts, doc_starts_from_cu_seqlens, segment_runs

__all__ = ["balanced_layout", "plan_stats", "token_costs"]

PIECE_COSTS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)
"""Candidate piece costs, as fractions of the per-rank target, tried largest first."""
TOKEN_SLACK = 0.95
"""Estimated tokens per rank (choosing the piece cost) and a document's tokens per piece stay under
this fraction of the cap."""
FILL_TOLERANCE = 1e-3
"""A bin counts as full within this fraction of the per-rank target."""
RETRIES = 4
"""Smaller piece costs tried after the estimated one when a rank misses the cost or token goal."""
ACCEPT = 0.01
"""A partition whose busiest rank is within this fraction of the target (and within the token cap) is kept."""
LOOSE = 0.03
"""... or an earlier one within this fraction whose busiest rank receives less K/V."""
SETTLE_ROUNDS = 3
"""Rounds of passing free items away from a group's ranks over the token cap."""
SETTLE_SLACK = 0.85
"""A group's free items go to its inner pieces' ranks while their estimated tokens stay under this x cap."""
HEAD_TOKENS = 0.75
"""A long document's start longer than this x cap joins its nesting even without a rank to spare."""
SEARCH = 16
"""Items tried per move when filling bins exactly."""


def _meta(seq_len: int | None, position_ids, cu_seqlens, document_starts=None) -> SequenceMeta:
    if position_ids is not None:
        pos = torch.as_tensor(position_ids).to("cpu", torch.int64)
        pos = pos[None] if pos.dim() == 1 else pos
        B, L = pos.shape
        opens = None if document_starts is None else torch.as_tensor(document_starts).to("cpu", torch.bool)
        return SequenceMeta(batch=B, seq_len=L, doc_start=doc_starts(B, L, position_ids=pos, opens=opens),
                            position=pos)
    if cu_seqlens is not None:
        cu = torch.as_tensor(cu_seqlens).to("cpu", torch.int64)
        L = int(cu[-1])
        return SequenceMeta(batch=1, seq_len=L, doc_start=doc_starts_from_cu_seqlens(cu, L))
    if seq_len is None:
        raise ValueError("balanced_layout needs position_ids, cu_seqlens or seq_len")
    return SequenceMeta(batch=1, seq_len=seq_len)


def _spec(mask: dict | MaskSpec) -> MaskSpec:
    if isinstance(mask, MaskSpec):
        return mask
    unknown = set(mask) - {"causal", "window", "chunk_size"}
    if unknown:
        raise ValueError(f"masks: each layer is a dict of attention()'s causal/window/chunk_size, got {sorted(unknown)}")
    return MaskSpec(**mask)


def _layers(meta: SequenceMeta, masks) -> list[tuple[int, MaskSpec, np.ndarray, np.ndarray]]:
    """The distinct layer masks, each ``(count, spec, start_BL, end_BL)``: how many layers use it and
    its attention segments (numpy int64), computed once per chunk size."""
    masks = [{}] if masks is None else list(masks)
    if not masks:
        raise ValueError("masks: give at least one layer (default: one plain causal layer)")
    counts: dict[MaskSpec, int] = {}
    for mask in masks:
        spec = _spec(mask)
        spec = MaskSpec(causal=spec.causal, window=spec.window, chunk_size=spec.chunk_size)
        counts[spec] = counts.get(spec, 0) + 1
    need_end = {spec.chunk_size for spec in counts if not spec.causal}
    segments: dict[int | None, tuple[np.ndarray, np.ndarray | None]] = {}
    out = []
    for spec, count in counts.items():
        if spec.chunk_size not in segments:
            segments[spec.chunk_size] = _segment_arrays(meta, spec.chunk_size, spec.chunk_size in need_end)
        out.append((count, spec, *segments[spec.chunk_size]))
    return out


def _segment_arrays(meta: SequenceMeta, chunk_size: int | None, need_end: bool):
    """(start_BL, end_BL) of every token's attention segment (document cut into chunks), numpy int64,
    from the segments' runs (``end_BL`` None unless ``need_end``: causal layers never read it)."""
    B, L = meta.batch, meta.seq_len
    if chunk_size is None and meta.doc_start is not None:
        start_BL = meta.doc_start.numpy().astype(np.int64, copy=False)
    else:
        start_BL = np.empty((B, L), dtype=np.int64)
        for b, (starts, ends) in enumerate(segment_runs(meta, chunk_size)):
            start_BL[b] = np.repeat(starts, ends - starts)
    end_BL = None
    if need_end:
        end_BL = np.empty((B, L), dtype=np.int64)
        for b, (starts, ends) in enumerate(segment_runs(meta, chunk_size)):
            end_BL[b] = np.repeat(ends, ends - starts)
    return start_BL, end_BL


def token_costs(meta: SequenceMeta, masks=None, token_weight: float = 0.0, *, layers=None) -> torch.Tensor:
    """(L,) float64 cost of each token index as a query: visible keys summed over ``masks`` (one
    entry per attention layer; default one plain causal layer) and the B rows, plus
    ``token_weight`` x B."""
    layers = _layers(meta, masks) if layers is None else layers
    idx_L = np.arange(meta.seq_len)
    total_L = np.full(meta.seq_len, float(token_weight) * meta.batch)
    seen_L = np.empty(meta.seq_len, dtype=np.int64)
    for count, spec, start_BL, end_BL in layers:
        reach = None if spec.window is None else spec.window - 1
        for b in range(meta.batch):  # one row at a time, in place: a few passes over L per layer
            if spec.causal:  # keys [max(start, q - reach), q]: min(q - start, reach) + 1 of them
                np.subtract(idx_L, start_BL[b], out=seen_L)
                if reach is not None:
                    np.minimum(seen_L, reach, out=seen_L)
                seen_L += 1
            else:
                lo_L = start_BL[b] if reach is None else np.maximum(start_BL[b], idx_L - reach)
                hi_L = end_BL[b] if reach is None else np.minimum(end_BL[b], idx_L + reach + 1)
                np.subtract(hi_L, lo_L, out=seen_L)
            if count != 1:
                seen_L *= count
            total_L += seen_L
    return torch.from_numpy(total_L)


def _documents(meta: SequenceMeta) -> list[tuple[int, int]]:
    """Items: the index ranges between the union of every row's document boundaries."""
    if meta.doc_start is None:
        return [(0, meta.seq_len)]
    starts = np.unique(np.concatenate([opens for opens, _ in segment_runs(meta, None)])).tolist()
    return list(zip(starts, starts[1:] + [meta.seq_len]))


class _Traffic:
    """K/V tokens a rank holding ``runs`` receives: every key its queries see that it does not hold,
    the planner's count (one row's worth; a union over the rows). :meth:`recv` gives
    ``(heaviest layer, all layers)``: the layer whose keys reach furthest (a full layer if there is
    one) is what a rank waits for, windowed layers' halos are bounded by their windows; the total
    breaks ties."""

    def __init__(self, layers):
        self.layers = []
        for count, spec, start_BL, end_BL in layers:
            lo_L = start_BL.min(0)
            hi_L = None if spec.causal else end_BL.max(0)
            reach = len(lo_L) if spec.window is None else spec.window - 1
            self.layers.append((count, reach, lo_L, hi_L))
        self.layers.sort(key=lambda layer: (-layer[1], layer[3] is None))  # the heaviest first

    def recv(self, runs) -> tuple[int, int]:
        out = []
        for count, reach, lo, hi in self.layers:
            need = []
            for p, q in runs:
                s = max(int(lo[p]), p - reach)
                if s < p:
                    need.append((s, p))
                if hi is not None:
                    e = min(int(hi[q - 1]), q + reach)
                    if e > q:
                        need.append((q, e))
            n = 0
            for a, b in merge_ranges(need):
                n += b - a - sum(max(0, min(b, q) - max(a, p)) for p, q in runs)
            out.append((n, count))
        return out[0][0], sum(n * count for n, count in out)


# ----------------------------------------------------------------------------------------------
# splitting one long document (document-local coordinates: cs[i] = cost of its first i tokens)


def _nest(cs: list[float], lo: int, budgets: list[float], limit: int, most: list[int]):
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
    for j, x in enumerate(budgets[:-1]):
        if x <= 0:
            pieces.append([])
            continue
        base = cs[lo]

        def tail(u: int) -> int:  # tokens of the tail chunk the rest of the budget buys
            return hi - bisect.bisect_left(cs, cs[hi] - (x - (cs[lo + u] - base)), lo + u, hi + 1)

        need = max(hi - limit, hi - lo - inner[j + 1])  # tokens this piece must hold
        u_max = max(0, min(bisect.bisect_right(cs, base + x, lo, hi) - 1, hi - 1) - lo)
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
        lo, hi = lo + u, hi - v
    if lo > limit or hi - lo > most[-1]:
        return None
    pieces.append([(lo, hi)])
    return pieces


def _split_nested(cs: list[float], lo: int, budgets: list[float], most: list[int]) -> list[list[tuple[int, int]]]:
    """The nested split of region ``[lo, n)`` whose largest receive is least (bisection, to within
    n / 256 keys) with at most ``most[j]`` tokens in piece ``j`` where possible; else equal-token
    pairs (zigzag within the region)."""
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


def _split_pairs(cs: list[float], lo: int, budgets: list[float]) -> list[list[tuple[int, int]]]:
    """Region ``[lo, n)`` into nested pieces of equal head and tail chunks (zigzag within the
    region), each chunk pair as long as its budget allows."""
    hi = len(cs) - 1
    pieces = []
    for x in budgets[:-1]:
        a, b = 0, max(0, (hi - lo) // 2 - 1)
        while a < b:  # the longest chunks within the budget
            mid = (a + b + 1) // 2
            if cs[lo + mid] - cs[lo] + cs[hi] - cs[hi - mid] <= x:
                a = mid
            else:
                b = mid - 1
        pieces.append([(lo, lo + a), (hi - a, hi)] if a else [])
        lo, hi = lo + a, hi - a
    pieces.append([(lo, hi)])
    return pieces


def _split_contiguous(cs: list[float], lo: int, budgets: list[float], most: list[int]) -> list[list[tuple[int, int]]]:
    """Region ``[lo, n)`` cut into consecutive pieces of the given costs, the document's end first
    (like the nesting: piece 0 holds the end and receives most); the last piece takes the rest."""
    n = len(cs) - 1
    bounds, acc = [n], cs[n]
    for x in budgets[:-1]:
        acc -= x
        bounds.append(max(bisect.bisect_left(cs, acc, lo, bounds[-1] + 1), lo))
    bounds.append(lo)
    return [[(p, q)] if q > p else [] for q, p in zip(bounds[:-1], bounds[1:])]


class _Long:
    """One long document laid out over ``m`` pieces: ``[a, lo)`` free head (maybe empty), region
    ``[lo, b)``; ``slots[j]`` the rank of piece ``j`` (outermost first)."""

    def __init__(self, a: int, b: int, lo: int, m: int, csum: np.ndarray, traffic: _Traffic, most: int):
        self.a, self.b, self.lo, self.m = a, b, lo, m
        self.cs = _Floats(csum[a:b + 1] - csum[a])
        self.cost = self.cs[-1] - self.cs[lo - a]
        self.traffic = traffic
        self.slots: list[int] = []
        self.pieces, self.recv = self.split([self.cost / m] * m, [max(most, -(-(b - lo) // m))] * m)

    def split(self, budgets: list[float], most: list[int]) -> tuple[list[list[tuple[int, int]]], list[int]]:
        """Pieces (global runs) for these budgets: nested (``most[j]`` tokens in piece ``j`` where
        possible, else a quarter more) or contiguous, whichever receives least among those within
        the token limits (else the one over them least); and each piece's receive."""
        lo = self.lo - self.a
        splits = [_split_nested(self.cs, lo, budgets, most),
                  _split_nested(self.cs, lo, budgets, [m + m // 4 for m in most]),
                  _split_contiguous(self.cs, lo, budgets, most)]
        best = None
        for local in splits:
            pieces = [[(self.a + p, self.a + q) for p, q in runs] for runs in local]
            recv = [self.traffic.recv(runs) for runs in pieces]
            over = max(sum(q - p for p, q in runs) - cap for runs, cap in zip(pieces, most))
            key = (max(over, 0), max(recv))
            if best is None or key < best[0]:
                best = (key, pieces, recv)
        return best[1], best[2]


# ----------------------------------------------------------------------------------------------
# the partition


def _piece_cost(csum: np.ndarray, docs: list[tuple[int, int]], P: int, cap: int) -> float:
    """The largest piece cost, as a fraction of the target from PIECE_COSTS, for which the tokens fit,
    estimated by packing the free items (whole documents and free heads) continuously: the ranks
    without a piece take the free items with most cost per token, the ranks with one the rest; both
    must stay under TOKEN_SLACK x cap."""
    target = csum[-1] / P
    start_D = np.array([a for a, _ in docs])
    n_D = np.array([b - a for a, b in docs])
    cost_D = csum[start_D + n_D] - csum[start_D]
    limit = TOKEN_SLACK * cap
    best = (math.inf, 1.0)
    for f in PIECE_COSTS:
        x = f * target
        m_D = np.floor(cost_D / x)
        k = int(m_D.sum())
        if k > P:
            break
        cut = m_D > 0
        head_D = np.minimum(np.searchsorted(csum, csum[start_D[cut]] + cost_D[cut] - m_D[cut] * x) - start_D[cut],
                            n_D[cut])
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


class _Bin:
    """Free items packed against a cost capacity (exact) and a token capacity (hard) and target."""

    def __init__(self, cost: float, tokens: int, target_tokens: float, group=None, rank: int | None = None):
        self.cap_cost, self.cap_tokens, self.target_tokens = cost, tokens, target_tokens
        self.group, self.rank = group, rank
        self.load, self.tokens, self.items = 0.0, 0, []
        self.recv = 0  # what the rank (for a group: its rank that receives least) receives, estimated

    def add(self, item, cost: float, tokens: int) -> None:
        self.items.append(item)
        self.load += cost
        self.tokens += tokens

    def remove(self, item, cost: float, tokens: int) -> None:
        self.items.remove(item)
        self.load -= cost
        self.tokens -= tokens


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
    return balanced_layout_of(_meta(seq_len, position_ids, cu_seqlens, document_starts), world_size, masks=masks,
                              token_weight=token_weight, max_token_ratio=max_token_ratio)


def balanced_layout_of(meta: SequenceMeta, world_size: int, *, masks=None, token_weight: float = 0.0,
                       max_token_ratio: float = 1.25) -> Layout:
    """:func:`balanced_layout` for documents already described by ``meta`` (e.g. the metadata
    ``cp.shard_batch`` records), without reading the position ids again."""
    L, P = meta.seq_len, world_size
    if L < P:
        raise ValueError(f"sequence length {L} is shorter than the world size {P}")
    layers = _layers(meta, masks)
    csum = np.zeros(L + 1)
    np.cumsum(token_costs(meta, token_weight=token_weight, layers=layers).numpy(), out=csum[1:])
    if P == 1:
        return Layout(L, (((0, L),),), name="balanced")
    batch = _Batch(csum, P, max(math.ceil(max_token_ratio * L / P), math.ceil(L / P)), _documents(meta),
                   _Traffic(layers))
    first = PIECE_COSTS.index(_piece_cost(csum, batch.docs, P, batch.cap))
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
    return _layout(L, best[3], batch.size_of)


class _Floats:
    """Python floats read from a float64 array on demand: the sequence ``bisect`` and the cost sums
    index a few hundred times per batch (converting the whole array, one float per token, costs more
    than everything else at a million tokens)."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray):
        self.values = values

    def __getitem__(self, i: int) -> float:
        return float(self.values[i])

    def __len__(self) -> int:
        return len(self.values)


class _Batch:
    """One batch's cumulative costs (``csum[i]``: cost of tokens ``[0, i)``), documents and targets."""

    def __init__(self, csum: np.ndarray, P: int, cap: int, docs: list[tuple[int, int]], traffic: _Traffic):
        self.csum, self.P, self.cap, self.docs, self.traffic = csum, P, cap, docs, traffic
        self.cs = _Floats(csum)
        self.L = len(csum) - 1
        self.target, self.tau = csum[-1] / P, self.L / P
        self.starts = {a for a, _ in docs}

    def cost_of(self, item) -> float:
        cs = self.cs
        if len(item) == 1:
            return cs[item[0][1]] - cs[item[0][0]]
        return sum([cs[q] - cs[p] for p, q in item])

    @staticmethod
    def size_of(item) -> int:
        if len(item) == 1:
            return item[0][1] - item[0][0]
        return sum([q - p for p, q in item])

    def partition(self, x: float) -> list[list]:
        """Every rank's items for pieces of cost ``x`` (steps 1-4 of the module docstring)."""
        csum, P, cap, target, tau = self.csum, self.P, self.cap, self.target, self.tau
        cost_of, size_of = self.cost_of, self.size_of
        # 1. long documents and their pieces
        free, longs = [], []
        for a, b in self.docs:
            if csum[b] - csum[a] > x or b - a > TOKEN_SLACK * cap:
                longs.append((a, b))
            else:
                free.append([(a, b)])
        longs.sort(key=lambda d: csum[d[0]] - csum[d[1]])
        spare = P - sum(max(1, int((csum[b] - csum[a]) // x)) for a, b in longs)
        docs_long: list[_Long] = []
        most = math.floor(tau)  # tokens a piece may hold: room for free items on its rank
        for a, b in longs:
            cost, n = csum[b] - csum[a], b - a
            m_cost, m_tokens = min(int(cost // x), P, n // 4 + 1), math.ceil(n / (TOKEN_SLACK * cap))
            options = []
            if m_cost >= m_tokens:  # pieces of cost x; the cheap rest of the document's start stays whole
                lo = min(int(np.searchsorted(csum, csum[a] + cost - m_cost * x)), b - m_cost)
                options.append(_Long(a, b, lo, m_cost, csum, self.traffic, most))
            else:  # too many tokens for its cost: pieces of L / P tokens at its end, its start whole
                m = max(1, min(P, math.ceil(n / tau) - 1))
                lo = max(a, b - m * most)
                if csum[b] - csum[lo] <= 0.98 * m * target:
                    options.append(_Long(a, b, lo, m, csum, self.traffic, most))
                m_cost = m if options else min(P, n, m_tokens)
                lo = lo if options else a
            if lo > a:  # or the start joins the nesting: with one piece more if there is a rank for it
                m_whole = min(m_cost + 1, P, n)
                too_long = lo - a > HEAD_TOKENS * cap
                if too_long or (spare > 0 and m_whole > m_cost) or not options:
                    whole = _Long(a, b, a, m_whole, csum, self.traffic, most)
                    options = [whole] if too_long else options + [whole]
                if cost <= 0.98 * m_cost * target:  # or as costlier pieces
                    options.append(_Long(a, b, a, m_cost, csum, self.traffic, most))
            if not options:
                options.append(_Long(a, b, a, max(1, min(P, n, m_cost)), csum, self.traffic, most))
            best = min(options, key=lambda d: max(d.recv))
            spare -= best.m - max(1, min(int(cost // x), P))
            docs_long.append(best)

        # 2. ranks of the long documents: own ranks while there are some, else shared with earlier ones
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
                    d = _Long(d.a, d.b, d.lo, m_thin, csum, self.traffic, most // 2)
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
        for d in docs_long:
            if d.lo > d.a:
                free.append([(d.a, d.lo)])

        # 3. free items into bins: one per group, one per remaining rank
        bins = []
        for g in groups:
            k = len(g["ranks"])
            region_cost = sum(d.cost for d in g["longs"])
            region_tokens = sum(d.b - d.lo for d in g["longs"])
            bins.append(_Bin(k * target - region_cost, k * cap - region_tokens,
                             max(k * tau - region_tokens, 0.05 * tau), group=g))
            bins[-1].recv = min(recv[r] for r in g["ranks"])
        bins += [_Bin(target, cap, tau, rank=r) for r in range(next_rank, P)]
        free.sort(key=lambda item: -max(cost_of(item) / target, size_of(item) / tau))
        for item in free:  # to the bin whose remaining cost per remaining target token is nearest the item's
            c, n = cost_of(item), size_of(item)
            density = math.log(max(c, 1e-300) / n)
            best, best_key = None, None
            for bn in bins:  # else the bin with most token room (its cost is settled later)
                room = bn.cap_cost - bn.load
                key = (bn.tokens + n > bn.cap_tokens, 1, bn.tokens - bn.cap_tokens) if room < c else (
                    bn.tokens + n > bn.cap_tokens, 0,
                    abs(density - math.log(max(room, 1e-300) / max(bn.target_tokens - bn.tokens, 1.0))))
                if best_key is None or key < best_key:
                    best, best_key = bn, key
            best.add(item, c, n)

        def grow(bn: _Bin, rank: _Bin) -> bool:  # the group's largest document takes one more piece
            d = max(bn.group["longs"], key=lambda d: d.cost)
            if d.m >= d.b - d.lo:
                return False
            for item in rank.items:
                bn.add(item, cost_of(item), size_of(item))
            options = [_Long(d.a, d.b, d.lo, d.m + 1, csum, self.traffic, most)]
            start = [(d.a, d.lo)]
            if d.lo > d.a and start in bn.items:  # its start, a free item here, may join the nesting
                options.append(_Long(d.a, d.b, d.a, d.m + 1, csum, self.traffic, most))
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

        _fill(bins, csum, self.starts, target, cost_of, size_of, grow, lambda run: self.traffic.recv([run])[0])

        # 4. ranks: a remaining rank holds its bin; a group spreads its free items, then splits its documents
        owned: list[list] = [[] for _ in range(P)]
        for bn in bins:
            if bn.rank is not None:
                owned[bn.rank] = list(bn.items)
                continue
            self.settle(bn, owned)
        return owned

    def settle(self, bn: _Bin, owned: list[list]) -> None:
        """A group's ranks (step 4 of the module docstring): its free items spread over them, each
        rank's remaining cost its pieces' budget, then its long documents split. A rank first gets
        the densest free items it needs to reach the target at all; then the items go, largest
        first, to the rank whose pieces nest innermost (the outer pieces keep large budgets: they
        hold the document's end and receive most, less the more tokens they hold) among those whose
        tokens stay under SETTLE_SLACK x cap (estimated from equal pieces, which shrink by the
        item's cost), else where the tokens stay least. A rank whose split leaves it over the cap
        passes free items to the group's rank with most room (a halo to the rank that receives
        least), and the documents are split again (a few rounds)."""
        target, cap, cost_of, size_of = self.target, self.cap, self.cost_of, self.size_of
        g = bn.group
        ranks = g["ranks"]
        share = {r: 0.0 for r in ranks}  # the equal pieces' cost and tokens per rank
        tokens = {r: 0 for r in ranks}
        for d in g["longs"]:
            for j, r in enumerate(d.slots):
                share[r] += d.cost / d.m
                tokens[r] += size_of(d.pieces[j])
        per_token = {r: share[r] / max(tokens[r], 1) for r in ranks}
        most_pieces = {r: 0.0 for r in ranks}  # the most its documents can give a rank
        for d in g["longs"]:
            for r in d.slots:
                most_pieces[r] += d.cost
        items = {r: [] for r in ranks}
        load = {r: 0.0 for r in ranks}
        free_tokens = {r: 0 for r in ranks}

        def halo(item) -> int:  # what a free item receives: nothing if it starts a document
            return 0 if item[0][0] in self.starts else self.traffic.recv(item)[0]

        def put(r: int, item, sign: int = 1) -> None:
            if sign > 0:
                items[r].append(item)
            else:
                items[r].remove(item)
            load[r] += sign * cost_of(item)
            free_tokens[r] += sign * size_of(item)

        def after(r: int, c: float, n: int) -> float:  # the rank's tokens: its pieces shrink by c
            return free_tokens[r] + n + min(max(target - load[r] - c, 0.0), most_pieces[r]) / per_token[r]

        outer = {r: 0.0 for r in ranks}  # how far out the rank's pieces nest: free items go to inner ones
        for d in g["longs"]:
            for j, r in enumerate(d.slots):
                outer[r] = max(outer[r], 1 - j / d.m)
        by_recv = sorted(ranks, key=lambda r: outer[r])
        pending = sorted(bn.items, key=lambda item: -size_of(item))
        for r in ranks:  # first the free items a rank needs to reach the target at all, the densest
            for item in sorted(pending, key=lambda item: -cost_of(item) / size_of(item)):
                if load[r] >= target - most_pieces[r]:
                    break
                if load[r] + cost_of(item) <= target and after(r, cost_of(item), size_of(item)) <= cap:
                    put(r, item)
                    pending.remove(item)
        for item in pending:
            c, n = cost_of(item), size_of(item)
            fits = [r for r in by_recv if load[r] + c <= target] or [max(ranks, key=lambda r: target - load[r])]
            r = next((r for r in fits if after(r, c, n) <= SETTLE_SLACK * cap), None)
            put(min(fits, key=lambda r: after(r, c, n)) if r is None else r, item)
        for round_ in range(SETTLE_ROUNDS + 1):
            budgets = _budgets(g, {r: target - load[r] for r in ranks})
            pieces = {r: [] for r in ranks}
            recv = {r: sum(halo(item) for item in items[r]) for r in ranks}  # heaviest layer
            for d, bud in zip(g["longs"], budgets):
                most = [max(int((cap - free_tokens[r]) * size_of(d.pieces[j]) / max(tokens[r], 1)), 1)
                        for j, r in enumerate(d.slots)]  # the rank's room, shared as equal pieces share it
                for r, piece, got in zip(d.slots, *d.split(bud, most)):
                    if piece:
                        pieces[r].append(piece)
                        recv[r] += got[0]
            held = {r: free_tokens[r] + sum(size_of(piece) for piece in pieces[r]) for r in ranks}
            if round_ == SETTLE_ROUNDS:
                break
            moved = False
            for r in sorted(ranks, key=lambda r: -held[r]):
                if held[r] <= cap:
                    break
                for item in sorted(items[r], key=size_of):  # the smallest items first, to the roomiest rank
                    if held[r] <= cap:
                        break
                    n, c, h = size_of(item), cost_of(item), halo(item)
                    dest = min((q for q in ranks if q != r and load[q] + c <= target and held[q] + n <= cap),
                               key=lambda q: (recv[q] + h if h else 0, held[q]), default=None)
                    if dest is None:
                        continue
                    put(r, item, -1)
                    put(dest, item)
                    held[r] -= n
                    held[dest] += n
                    moved = True
                whole = [item for item in items[r] if len(item) == 1 and item[0][0] in self.starts]
                if held[r] > cap and whole:  # else its largest item cut: its head or its tail moves
                    item = max(whole, key=size_of)
                    (p, q), = item
                    k = min(2 * (held[r] - cap) + 16, q - p - 1)  # tokens to move, with room for pieces to grow
                    best = None
                    for dest in (q_ for q_ in ranks if q_ != r and held[q_] + k <= cap):
                        for part, rest in (((p, p + k), (p + k, q)), ((q - k, q), (p, q - k))):
                            c = self.csum[part[1]] - self.csum[part[0]]
                            if load[dest] + c > target:
                                continue
                            h = halo([part if part[0] > p else rest])
                            key = (max(recv[r] + (h if part[0] == p else 0), recv[dest] + (h if part[0] > p else 0)),
                                   held[dest])
                            if best is None or key < best[0]:
                                best = (key, dest, part, rest)
                    if best is not None:
                        _, dest, part, rest = best
                        put(r, item, -1)
                        put(r, [rest])
                        put(dest, [part])
                        held[r] -= k
                        held[dest] += k
                        moved = True
            if not moved:
                break
        for r in ranks:
            owned[r] = items[r] + pieces[r]


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


def _fill(bins: list[_Bin], csum: np.ndarray, starts: set[int], target: float, cost_of, size_of, grow,
          halo) -> None:
    """Make every bin's cost its capacity: an over-full bin passes cost to an under-full one by the
    first of: a whole item that fits; the head of one of its items cut at the exact cost (the
    shortest head: the rest of that item, which stays, receives it); where the under-full bin has no
    token room, a swap of an item for cheaper ones of the under-full bin (the sparsest; its head cut
    at the exact cost if need be). Only items that start a document move or are cut, so a moved item
    receives nothing. Where nothing moves, an over-full group takes in an under-full rank of its
    own (``grow(group, rank)``: one more piece of a long document, on that rank)."""
    tol = FILL_TOLERANCE * target

    def movable(bn: _Bin) -> list:
        return [item for item in bn.items if len(item) == 1 and item[0][0] in starts]

    def head(item, cost: float) -> int:  # end of the item's head of this cost
        (p, q), = item
        return min(max(int(np.searchsorted(csum, csum[p] + cost)), p + 1), q - 1)

    def tail(item, cost: float) -> int:  # start of the item's tail of this cost
        (p, q), = item
        return min(max(int(np.searchsorted(csum, csum[q] - cost)), p + 1), q - 1)

    for bn in bins:  # first no bin over its token cap: its sparsest items to the bins with most room
        for item in sorted(movable(bn), key=lambda item: cost_of(item) / size_of(item)):
            if bn.tokens <= bn.cap_tokens:
                break
            dest = max(bins, key=lambda d: d.cap_tokens - d.tokens)
            if dest is bn or dest.tokens + size_of(item) > dest.cap_tokens:
                break
            bn.remove(item, cost_of(item), size_of(item))
            dest.add(item, cost_of(item), size_of(item))
    for _ in range(4 * len(bins) + 8):
        order = sorted(bins, key=lambda bn: bn.load - bn.cap_cost)
        if order[-1].load - order[-1].cap_cost <= tol:
            return
        move = None
        for over, under in ((o, u) for o in order[::-1] for u in order):  # the fullest and emptiest first
            excess = min(over.load - over.cap_cost, under.cap_cost - under.load)
            if excess <= 0.1 * tol:
                continue
            room, room_over = under.cap_tokens - under.tokens, over.cap_tokens - over.tokens
            give = [(cost_of(item), size_of(item), item) for item in movable(over)]
            best = None  # (cut tokens, -net cost, item, its head end or None, items taken back)
            whole = [g for g in give if g[0] <= excess + 0.1 * tol and g[1] <= room]
            if whole:  # a whole item
                c, n, item = max(whole, key=lambda g: g[0])
                best = ((0, -c), item, None, [])
            else:  # an item cut at the exact cost: its head moves (the rest, staying, receives the head)
                # or its tail moves (and receives the rest): where the receiving rank then receives less
                for c, n, item in sorted((g for g in give if g[0] > excess and g[1] > 1), key=lambda g: g[0])[:SEARCH]:
                    (p, q), = item
                    t = head(item, excess)
                    if t - p <= room:
                        key = (over.recv + halo((t, q)), t - p)
                        if best is None or key < best[0]:
                            best = (key, item, t, [])
                    t = tail(item, excess)
                    if q - t <= room:
                        key = (under.recv + halo((t, q)), q - t)
                        if best is None or key < best[0]:
                            best = (key, item, -t, [])
            if best is None and give:  # a dense item for the under-full bin's sparsest ones
                dense = sorted(give, key=lambda g: -g[0] / g[1])[:SEARCH]
                sparse = sorted(movable(under), key=lambda item: cost_of(item) / size_of(item))[:SEARCH]
                c_back = n_back = 0
                for i in range(len(sparse)):
                    c_back += cost_of(sparse[i])
                    n_back += size_of(sparse[i])
                    for c_all, n_all, item in dense:
                        (p, q), = item
                        options = [(c_all, n_all, None, max(over.recv, under.recv))]
                        if c_all > excess + c_back and n_all > 1:  # cut: its head or its tail moves
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
                                best = (key, item, t, sparse[:i + 1])
            if best is not None:
                move = (over, under, *best[1:])
                break
        if move is None:
            pair = next(((o, u) for o in order[::-1] for u in order if o.group is not None and u.group is None
                         and o.load - o.cap_cost > tol and u.cap_cost - u.load > tol), None)
            if pair is None or not grow(*pair):
                return
            bins.remove(pair[1])
            continue
        over, under, item, t, back = move
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


def _layout(L: int, owned: list[list], size_of) -> Layout:
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


def plan_stats(layout, rank: int, *, world_size: int | None = None, position_ids=None, cu_seqlens=None,
               seq_len: int | None = None, causal: bool = True, window: int | None = None,
               chunk_size: int | None = None, head_kv: int, head_dim: int, dtype=torch.bfloat16):
    """The :class:`~cp_attention.plan.PlanStats` of ``rank`` for a batch and one attention mask under
    ``layout`` (a name, with ``world_size``, or a :class:`~cp_attention.layout.Layout`), without a
    process group: traffic, rounds, kernel calls and visible pairs, from the pure planner."""
    from .plan import build_plan

    meta = _meta(seq_len, position_ids, cu_seqlens)
    if isinstance(layout, Layout):
        world_size = layout.world_size
    elif world_size is None:
        raise ValueError("plan_stats: a layout name needs world_size")
    spec = MaskSpec(causal=causal, window=window, chunk_size=chunk_size)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return build_plan(meta, spec, world_size=world_size, layout=layout, rank=rank, head_kv=head_kv,
                      head_dim=head_dim, itemsize=itemsize).stats
