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

Above ``STREAM_ABOVE`` ranks steps 1-4 are replaced by the stream partition (:mod:`.stream`): one pass
over the ranks, each taking whole short documents from one end of the documents sorted by cost per
token while they keep its tokens near its share, and the other end (long documents, read back from
their ends) filling its cost exactly.

Where a rank misses the cost (``ACCEPT``) or the token goal, smaller piece costs are tried (``RETRIES``);
the first partition that meets both is kept, unless an earlier one within ``LOOSE`` of the target
has a busiest rank receiving less. The result is a :class:`~cp_attention.layout.Layout`; exactness
never depends on it.

Modules: this one holds the public entries (:class:`Balanced`, :func:`balanced_layout`) and the choice
of the piece cost; :mod:`.costs` the cost and traffic models, :mod:`.partition` the partition
(steps 1-4), :mod:`.split` the split of one long document into pieces, :mod:`.bins` the packing's
bins and :mod:`.stream` the stream partition.

Legend: ``B`` rows, ``L`` tokens per row, ``P`` ranks, ``D`` documents; a *run* is a ``(start, end)``
range of global token indices, an *item* a list of runs that moves as one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..masks import MaskSpec, SequenceMeta
from ..quiet_gc import paused_gc
from .costs import Costs, Traffic, document_arrays, documents, layer_specs
from .layouts import Layout, as_layout, merge_ranges
from .partition import TOKEN_SLACK, Batch, layout_from_items
from .stream import stream_partition

__all__ = ["Balanced", "as_policy", "balanced_layout", "balanced_layout_of"]

PIECE_COSTS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)
"""Candidate piece costs, as fractions of the per-rank target, tried largest first."""
RETRIES = 4
"""Smaller piece costs tried after the estimated one when a rank misses the cost or token goal."""
ACCEPT = 0.01
"""A partition whose busiest rank is within this fraction of the target (and within the token cap) is kept."""
LOOSE = 0.03
"""... or an earlier one within this fraction whose busiest rank receives less K/V."""
STREAM_ABOVE = 64
"""Above this many ranks the stream partition (:mod:`.stream`) replaces the search of steps 1-4,
whose packing grows faster than P x documents (seconds at 1024 ranks)."""
NEAREST_UP_TO = 32
"""Up to this many ranks both packings are tried for each piece cost (the nearest-density one is
cheap there and sometimes cuts less); above it, the density-balance packing alone."""


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


@paused_gc
def balanced_layout_of(meta: SequenceMeta, world_size: int, *, masks=None, token_weight: float = 0.0,
                       max_token_ratio: float = 1.25) -> Layout:
    """:func:`balanced_layout` for documents already described by ``meta`` (e.g. the metadata
    ``cp.shard_batch`` records), without reading the position ids again."""
    L, P = meta.seq_len, world_size
    if L < P:
        raise ValueError(f"sequence length {L} is shorter than the world size {P}")
    layers = layer_specs(masks)
    if P == 1:
        return Layout(L, (((0, L),),), name="balanced")
    costs = Costs(meta, layers, token_weight)
    cap = max(math.ceil(max_token_ratio * L / P), math.ceil(L / P))
    if P > STREAM_ABOVE:  # one pass over the ranks (:mod:`.stream`)
        owned = stream_partition(costs, *document_arrays(meta), P, cap)
        if all(owned):
            return Layout(L, tuple(tuple(merge_ranges(runs)) for runs in owned), name="balanced")
        return layout_from_items(L, [[[run] for run in runs] for runs in owned], Batch.size_of)
    batch = Batch(costs, P, cap, documents(meta), Traffic(meta, layers))
    first = PIECE_COSTS.index(_piece_cost(costs, batch.docs, P, batch.cap))
    tried = []  # (miss of the tight goals, miss of the loose ones, busiest receive, partition)
    methods = ("greedy", "nearest") if P <= NEAREST_UP_TO else ("greedy",)
    for f in PIECE_COSTS[first:first + 1 + RETRIES]:  # smaller pieces where a rank misses a goal
        options = []
        for method in methods:  # the packings' better partition: the goals, then the busiest receive
            owned = batch.partition(f * batch.target, method)
            load = max(sum(batch.cost_of(item) for item in items) for items in owned) / batch.target
            tokens = max(sum(batch.size_of(item) for item in items) for items in owned) / batch.cap
            recv = max(batch.traffic.recv([run for item in items for run in item])[0] for items in owned)
            options.append((max(load - 1 - ACCEPT, tokens - 1, 0.0), max(load - 1 - LOOSE, tokens - 1, 0.0), recv,
                            owned))
        tried.append(min(options, key=lambda t: t[:3]))
        if tried[-1][0] == 0 and (P > NEAREST_UP_TO or sum(t[0] == 0 for t in tried) > 1):
            break  # (up to NEAREST_UP_TO ranks, the next piece cost too: it may receive less)
    # the first partition within ACCEPT of the target (of two: the one receiving less), unless an
    # earlier one within LOOSE receives less
    tight = min((t for t in tried if t[0] == 0), key=lambda t: t[2], default=None)
    loose = min((t for t in tried if t[1] == 0), key=lambda t: t[2], default=None)
    if tight is None or (loose is not None and loose[2] < tight[2]):
        tight = loose
    best = tight if tight is not None else min(tried, key=lambda t: (t[1], t[0]))
    return layout_from_items(L, best[3], batch.size_of)


@dataclass(frozen=True, eq=False)
class Balanced:
    """A policy, not a layout: each batch gets its own :class:`Layout` from its documents and the
    model's attention layers (:func:`cp_attention.balanced_layout_of`), made by ``cp.shard_batch``.

    ``max_token_ratio``: a rank holds at most this x L / P tokens. ``masks`` / ``token_weight``: the
    layer masks and per-token weight of the cost model; None: the model's, read by ``shard_batch``
    from ``model=`` (one causal layer and no token weight without it)."""

    max_token_ratio: float = 1.25
    masks: tuple | None = None
    token_weight: float | None = None

    name = "balanced"
    per_batch = True

    def __post_init__(self) -> None:
        if not self.max_token_ratio >= 1.0:
            raise ValueError(f"Balanced: max_token_ratio must be >= 1 (a rank holds at least L / P tokens), "
                             f"got {self.max_token_ratio!r}")
        if self.masks is not None:  # hashable and checked now: MaskSpecs of the planning part
            specs = tuple((m if isinstance(m, MaskSpec) else MaskSpec(**m)).for_planning() for m in self.masks)
            object.__setattr__(self, "masks", specs)

    def __eq__(self, other) -> bool:
        if isinstance(other, str):
            return other == self.name
        return isinstance(other, Balanced) and (self.max_token_ratio, self.masks, self.token_weight) == (
            other.max_token_ratio, other.masks, other.token_weight)

    def __hash__(self) -> int:
        return hash((self.name, self.max_token_ratio, self.masks, self.token_weight))

    @property
    def label(self) -> str:
        return repr(self.name)

    def for_batch(self, meta, world_size: int, *, masks=None, token_weight: float = 0.0) -> Layout:
        """The balanced :class:`Layout` of the batch ``meta`` (a :class:`~cp_attention.SequenceMeta`);
        ``masks`` and ``token_weight`` are the model's (the policy's own, when set, win)."""
        return balanced_layout_of(meta, world_size, masks=list(self.masks) if self.masks is not None else masks,
                                  token_weight=self.token_weight if self.token_weight is not None else token_weight,
                                  max_token_ratio=self.max_token_ratio)

    def __str__(self) -> str:
        return self.name


def as_policy(layout):
    """:func:`~cp_attention.layout.layouts.as_layout`, and ``"balanced"`` or a :class:`Balanced` policy
    (what a context accepts: each batch gets its own layout). Raises ValueError naming the options."""
    if isinstance(layout, Balanced):
        return layout
    if isinstance(layout, str) and layout == Balanced.name:
        return Balanced()
    try:
        return as_layout(layout)
    except ValueError:
        raise ValueError(f"layout must be one of ('zigzag', 'contiguous', 'balanced') or a "
                         f"cp_attention.layout.Layout, got {layout!r}") from None
