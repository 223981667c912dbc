"""Balanced layouts for packed batches: which tokens each rank holds so that every rank does the same
work (issue: packed documents run unbalanced under zigzag, which balances one causal sequence).

Cost model (pure): a rank's cost is the (query, key) pairs its queries see, summed over the model's
attention layers and the batch rows, plus ``token_weight`` per token and row (the model's dense
per-token compute, projections and MLP, in units of one visible pair of one layer).

Partition: documents costing more than a small share of a rank's target ("long") are laid out
like zigzag over their concatenation, but cut into 2P chunks of equal *cost* (rank r takes chunks r
and 2P-1-r): equal cost per rank, about equal tokens, and zigzag's traffic for these documents only.
Short documents are never cut (they need no K/V from other ranks): largest first, each goes to the
least loaded rank with room under the token cap (``max_token_ratio`` x L / P: activation memory),
and a local search then moves short documents from the busiest rank to the least busy one while
that lowers the maximum. The result is a :class:`~cp_attention.layout.Layout`.

Legend: ``B`` rows, ``L`` tokens per row, ``P`` ranks.
"""

from __future__ import annotations

import bisect
import math

import torch

from .layout import Layout
from .masks import MaskSpec, SequenceMeta, doc_starts, doc_starts_from_cu_seqlens, segment_bounds

__all__ = ["balanced_layout", "plan_stats", "token_costs"]

PIECES_PER_TARGET = 16  # documents costing more than target / this are long ...
LONG_PIECES_PER_TARGET = 8  # ... cut into pieces of about target / this


def _meta(seq_len: int | None, position_ids, cu_seqlens) -> SequenceMeta:
    if position_ids is not None:
        pos = torch.as_tensor(position_ids).to("cpu", torch.int64)
        pos = pos[None] if pos.dim() == 1 else pos
        B, L = pos.shape
        return SequenceMeta(batch=B, seq_len=L, doc_start=doc_starts(B, L, position_ids=pos), position=pos)
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


def token_costs(meta: SequenceMeta, masks=None, token_weight: float = 0.0) -> torch.Tensor:
    """(L,) float64 cost of each token index as a query: visible keys summed over ``masks`` (one
    entry per attention layer; default one plain causal layer) and the B rows, plus
    ``token_weight`` x B."""
    masks = [{}] if masks is None else list(masks)
    if not masks:
        raise ValueError("masks: give at least one layer (default: one plain causal layer)")
    idx = torch.arange(meta.seq_len)
    total = torch.full((meta.seq_len,), float(token_weight) * meta.batch, dtype=torch.float64)
    for mask in masks:
        spec = _spec(mask)
        start, end = segment_bounds(meta, spec)  # (B, L)
        reach = math.inf if spec.window is None else spec.window - 1
        lo = start if math.isinf(reach) else torch.maximum(start, idx - int(reach))
        hi = idx + 1 if spec.causal else (end if math.isinf(reach) else torch.minimum(end, idx + int(reach) + 1))
        total += (hi - lo).clamp(min=0).sum(0).double()
    return total


def _documents(meta: SequenceMeta) -> list[tuple[int, int]]:
    """Items: the index ranges between the union of every row's document boundaries."""
    if meta.doc_start is None:
        return [(0, meta.seq_len)]
    idx = torch.arange(meta.seq_len)
    opens = (meta.doc_start == idx).any(0)
    starts = torch.nonzero(opens).flatten().tolist()
    return list(zip(starts, starts[1:] + [meta.seq_len]))


def _pieces(a: int, b: int, csum: list[float], piece_cost: float) -> list[list[tuple[int, int]]]:
    """Cut document [a, b) into pieces of about ``piece_cost`` each; a piece is a list of runs.

    Where the cost per token grows along the document (a full causal layer), it is cut into 2m
    chunks of equal tokens and chunk j is paired with chunk 2m-1-j (cheap early tokens with costly
    late ones: equal cost and equal tokens per piece); where it is flat (windows shorter than the
    document), into contiguous pieces of equal cost (one halo per cut)."""
    cost = csum[b] - csum[a]
    n = max(1, min(b - a, math.ceil(cost / piece_cost)))
    if n == 1:
        return [[(a, b)]]
    mid = (a + b) // 2
    if csum[b] - csum[mid] > 1.3 * (csum[mid] - csum[a]) and b - a >= 2 * n:  # growing cost: head-tail pairs
        bounds = [a + ((b - a) * j) // (2 * n) for j in range(2 * n + 1)]
        return [[(bounds[j], bounds[j + 1]), (bounds[2 * n - 1 - j], bounds[2 * n - j])] for j in range(n)]
    cuts = [a]
    for i in range(1, n):
        t = bisect.bisect_left(csum, csum[a] + cost * i / n, a, b + 1)
        cuts.append(min(max(t, cuts[-1] + 1), b - 1))
    bounds = sorted(set(cuts + [b]))
    return [[(p, q)] for p, q in zip(bounds[:-1], bounds[1:]) if q > p]


def _refine(owned, load, tokens, cap, cost_of, size_of, rounds: int = 200) -> None:
    """Local search: move the item from the busiest rank to the least busy one that most lowers the
    busiest load (token cap respected), until no move helps."""
    P = len(owned)
    for _ in range(rounds):
        hi = max(range(P), key=lambda r: load[r])
        lo = min(range(P), key=lambda r: load[r])
        gap = load[hi] - load[lo]
        best, best_item = 0.0, None
        for item in owned[hi]:
            c = cost_of(item)
            if c < gap and tokens[lo] + size_of(item) <= cap:
                gain = min(c, gap - c)  # the new max of the two ranks drops by this much
                if gain > best:
                    best, best_item = gain, item
        if best_item is None:
            return
        owned[hi].remove(best_item)
        owned[lo].append(best_item)
        c, n = cost_of(best_item), size_of(best_item)
        load[hi] -= c
        load[lo] += c
        tokens[hi] -= n
        tokens[lo] += n


def balanced_layout(world_size: int, *, position_ids=None, cu_seqlens=None, seq_len: int | None = None,
                    masks=None, token_weight: float = 0.0, max_token_ratio: float = 1.25) -> Layout:
    """A layout giving every rank about the same cost for this batch (see the module docstring).

    Args:
        world_size: P.
        position_ids: (B, L) or (L,) the batch's positions (documents restart them), or
        cu_seqlens: (N+1,) document boundaries of one row, or neither (with ``seq_len``: one document).
        masks: the model's attention layers, one dict of ``attention()``'s ``causal``/``window``/
            ``chunk_size`` (or a MaskSpec) per layer, repeats allowed; default one plain causal layer.
        token_weight: dense per-token work in units of one visible pair of one layer.
        max_token_ratio: no rank holds more than this x L / P tokens while another has room.

    Returns a :class:`~cp_attention.layout.Layout` (one index set for every row of the batch).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not token_weight >= 0:
        raise ValueError(f"token_weight must be >= 0, got {token_weight!r}")
    meta = _meta(seq_len, position_ids, cu_seqlens)
    L, P = meta.seq_len, world_size
    if L < P:
        raise ValueError(f"sequence length {L} is shorter than the world size {P}")
    csum = [0.0] + torch.cumsum(token_costs(meta, masks, token_weight), 0).tolist()
    target = csum[-1] / P
    cap = max(math.ceil(max_token_ratio * L / P), math.ceil(L / P))
    piece_cost = max(target / PIECES_PER_TARGET, 1e-12)

    def cost_of(runs) -> float:
        return sum(csum[q] - csum[p] for p, q in runs)

    def size_of(runs) -> int:
        return sum(q - p for p, q in runs)

    long_items, short_items = [], []
    for a, b in _documents(meta):
        if csum[b] - csum[a] > piece_cost or b - a > cap // PIECES_PER_TARGET + 1:
            long_items.append(_pieces(a, b, csum, target / LONG_PIECES_PER_TARGET))
        else:
            short_items.append([(a, b)])
    load = [0.0] * P
    tokens = [0] * P
    owned: list[list[list[tuple[int, int]]]] = [[] for _ in range(P)]

    def place(r: int, item) -> None:
        load[r] += cost_of(item)
        tokens[r] += size_of(item)
        owned[r].append(item)

    # largest first, each on the least loaded rank with room; a contiguous piece (flat cost, windowed
    # layers) joins the rank of the previous piece of its document while that rank stays below the
    # target (one cut fewer: one halo less)
    items = [(cost_of(item), i, j, item) for i, pieces in enumerate(long_items) for j, item in enumerate(pieces)]
    items += [(cost_of(item), len(long_items) + i, 0, item) for i, item in enumerate(short_items)]
    items.sort(key=lambda x: (-x[0], x[1], x[2]))
    where: dict[tuple[int, int], int] = {}
    for c, i, j, item in items:
        n = size_of(item)
        prev = where.get((i, j - 1))
        if prev is not None and len(item) == 1 and load[prev] + c <= target * 0.98 and tokens[prev] + n <= cap:
            r = prev
        else:
            fits = [r for r in range(P) if tokens[r] + n <= cap]
            r = min(fits or range(P), key=lambda q: (load[q], tokens[q]))
        place(r, item)
        where[(i, j)] = r
    _refine(owned, load, tokens, cap, cost_of, size_of)
    for r in range(P):  # a rank with nothing takes one token from the rank with most tokens
        if not owned[r]:
            donor = max(range(P), key=lambda d: tokens[d])
            item = max(owned[donor], key=size_of)
            owned[donor].remove(item)
            a, b = item[-1]
            rest = item[:-1] + ([(a, b - 1)] if b - a > 1 else [])
            if rest:
                owned[donor].append(rest)
            load[donor] -= csum[b] - csum[b - 1]
            tokens[donor] -= 1
            place(r, [(b - 1, b)])
    owned = [[run for item in items for run in item] for items in owned]
    ranges = []
    for runs in owned:
        merged: list[list[int]] = []
        for a, b in sorted(runs):
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        ranges.append(tuple((a, b) for a, b in merged))
    return Layout(L, tuple(ranges), name="balanced")


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
