"""Balanced layouts at hundreds of ranks (issue #36) and the pieces of their partition.

* Goals (a) busiest cost within 5% of the mean and (b) no rank above 1.25 x L / P tokens (issue
  #14's), at P = 128 and 256 on packed rows of thousands of short
  documents (tiny documents are packed in bundles above 8 x P documents), with a document across
  every rank, and for causal, windowed and chunked layers. Costs from ``token_costs`` (a count per
  token, checked against brute force in test_layouts.py), not from the partition's own sums.
* A long document split into many nested pieces gives each piece its budget to within a token's
  cost: the innermost piece takes the rest, so without carrying each piece's rounding to the next
  it collects every miss (a 4-5% overload on 20+ pieces, which made every partition of such a batch
  miss the goal and be tried again).
* The packing's density index finds the bin a scan over every bin finds (the rule of the first
  packing: nearest remaining cost per remaining target token among the bins with room).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import cp_attention
from cp_attention.layout import token_costs
from cp_attention.layout.costs import Costs, Traffic, layer_specs
from cp_attention.layout.bins import Bin, DensityIndex, bin_density
from cp_attention.layout.split import LongDocument
from cp_attention.masks import SequenceMeta
from layout_cases import lengths as _lengths

MIXES = {"causal": [{}], "window-256": [{"window": 256}], "chunked-512": [{"chunk_size": 512}],
         "3 x window-64 + full": [{"window": 64}] * 3 + [{}]}


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _check_goals(pos: torch.Tensor, P: int, masks: list, token_weight: float = 0.0) -> None:
    L = pos.shape[1]
    layout = cp_attention.balanced_layout(P, position_ids=pos, masks=masks, token_weight=token_weight)
    seen = torch.zeros(L, dtype=torch.int64)
    for r in range(P):
        seen[layout.indices(r)] += 1
    assert bool((seen == 1).all())  # every token on exactly one rank
    meta = SequenceMeta.from_inputs(1, L, position_ids=pos)
    cost = token_costs(meta, masks, token_weight)
    loads = torch.stack([cost[layout.indices(r)].sum() for r in range(P)])
    assert float(loads.max()) <= 1.05 * float(cost.sum()) / P, float(loads.max() / (cost.sum() / P))
    assert max(layout.local_lengths()) <= 1.25 * L / P, max(layout.local_lengths()) / (L / P)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("P", [128, 256])
def test_balanced_layout_goals_at_hundreds_of_ranks(P, mix):
    """Thousands of short documents (bundled) over 128 and 256 ranks."""
    lengths = _lengths(64 * 1024, random.Random(P), median=12.0)
    assert len(lengths) > 8 * P  # the bundled packing
    _check_goals(_positions(lengths), P, MIXES[mix])


@pytest.mark.parametrize("P", [64, 128])
def test_balanced_layout_goals_with_a_document_across_every_rank(P):
    """One document of half the row (it spans every rank under zigzag and takes many nested pieces
    here) among short ones, causal and with a dense per-token weight. (At 256 ranks of 256 tokens
    the token goal is missed: a rank holds 1.6 x L / P.)"""
    rest = _lengths(32 * 1024, random.Random(3), median=24.0)
    lengths = [32 * 1024] + rest
    random.Random(4).shuffle(lengths)
    for token_weight in (0.0, 300.0):
        _check_goals(_positions(lengths), P, [{}], token_weight)


def test_nested_split_gives_every_piece_its_budget():
    """A 40k-token causal document in 24 nested pieces of equal budgets: every piece's cost
    (counted per token) within two tokens' cost of its budget, the innermost included."""
    n, m = 40000, 24
    meta = SequenceMeta.from_inputs(1, n)
    layers = layer_specs(None)
    doc = LongDocument(0, n, 0, m, Costs(meta, layers, 0.0), Traffic(meta, layers), most=n)
    per_token = token_costs(meta).tolist()
    budget = sum(per_token) / m
    for runs in doc.pieces:
        cost = sum(sum(per_token[p:q]) for p, q in runs)
        assert abs(cost - budget) <= 2 * n, (cost - budget) / budget  # a token here costs at most n pairs


def test_density_index_finds_what_a_scan_finds():
    """Random bins and items: :class:`DensityIndex` returns the first bin (in order) of those with
    room for the item's cost and tokens whose density is nearest the item's, as a scan does."""
    rng = random.Random(0)
    for _ in range(200):
        bins = []
        for i in range(rng.randint(1, 12)):
            bn = Bin(rng.choice([1.0, 2.0, 5.0]), rng.randint(5, 40), rng.choice([4.0, 10.0, 20.0]))
            bn.load, bn.tokens = rng.choice([0.0, 0.5, 1.0, 3.0]), rng.randint(0, 30)
            bins.append(bn)
        if rng.random() < 0.3:  # equal densities: the first bin in order wins
            bins.append(bins[0].__class__(bins[0].cap_cost, bins[0].cap_tokens, bins[0].target_tokens))
            bins[-1].load, bins[-1].tokens = bins[0].load, bins[0].tokens
        index = DensityIndex(bins)
        c, n = rng.choice([0.1, 0.5, 1.0, 2.0]), rng.randint(1, 10)
        density = math.log(c / n)
        fitting = [bn for bn in bins if bn.cap_cost - bn.load >= c and bn.tokens + n <= bn.cap_tokens]
        want = min(fitting, key=lambda bn: abs(density - bin_density(bn)), default=None)  # first of the nearest
        assert index.nearest(density, c, n) is want


def test_cost_window_bisections_equal_bisect():
    """:meth:`CostWindow.left` / ``right`` (searched from the closed-form root) answer what
    ``bisect`` answers over the window's prefix costs listed one by one, for causal, windowed,
    chunked and mixed layers, with and without a token weight, at values on and between prefixes."""
    import bisect

    rng = random.Random(0)
    L = 60000
    pos = _positions(_lengths(L, random.Random(1), median=300.0))
    meta = SequenceMeta.from_inputs(1, L, position_ids=pos)
    for masks in ([{}], [{"window": 300}], [{"chunk_size": 1000}], [{"window": 64}] * 3 + [{}]):
        costs = Costs(meta, layer_specs(masks), rng.choice([0.0, 7.5]))
        for _ in range(300):
            a = rng.randrange(0, L - 10)
            b = rng.randrange(a + 1, min(L, a + 2500) + 1)
            window = costs.window(a, b)
            prefixes = [costs[a + i] - costs[a] for i in range(b - a + 1)]
            lo = rng.randrange(0, b - a + 1)
            hi = rng.randrange(lo, b - a + 2)
            v = rng.choice(prefixes) if rng.random() < 0.3 else rng.uniform(-10, prefixes[-1] * 1.1)
            assert window.left(v, lo, hi) == bisect.bisect_left(prefixes, v, lo, hi)
            assert window.right(v, lo, hi) == bisect.bisect_right(prefixes, v, lo, hi)


def test_slice_bounds_cut_the_row_in_near_equal_consecutive_slices():
    """A rank's zigzag or contiguous slice in closed form (no list of every slice: reading every
    rank's ranges at 1024 ranks was O(P^2)), checked against the definition: ``n`` consecutive
    slices covering ``[0, L)``, the first ``L % n`` one token longer than the others."""
    from cp_attention.layout.layouts import slice_bounds

    rng = random.Random(0)
    for _ in range(500):
        L, n = rng.randint(0, 5000), rng.randint(1, 300)
        bounds = slice_bounds(L, n)
        assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == L
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))
        assert [b - a for a, b in bounds] == [L // n + 1] * (L % n) + [L // n] * (n - L % n)
