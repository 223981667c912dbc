"""The 2-D split and strategy="auto"'s cost model, without process groups.

Oracles: the split's sub-groups from their stated rule (consecutive head groups, strided rings),
and the modeled time computed by hand from the documented formula on cases small enough to count
score entries and bytes on paper (a tiled kernel computes, per tile of rows, rows x the keys they see).
"""

from __future__ import annotations

import pytest
import torch

import cp_attention
from cp_attention import layout as layout_mod
from cp_attention.masks import MaskSpec, SequenceMeta
from cp_attention.strategies.choice import Candidate, CostModel, candidates, choose, fixed_candidate, layer_time, rank_plans
from cp_attention.strategies.ulysses import Grid, _TokenMap


def test_grid_groups_follow_the_stated_rule():
    grid = Grid(8, 2)
    assert [grid.head_group(r) for r in range(8)] == [(0, 1), (0, 1), (2, 3), (2, 3), (4, 5), (4, 5), (6, 7), (6, 7)]
    assert [grid.ring_group(r) for r in (0, 1, 6)] == [(0, 2, 4, 6), (1, 3, 5, 7), (0, 2, 4, 6)]
    # every pair of distinct ranks shares at most one sub-group (their messages never meet)
    for a in range(8):
        for b in range(8):
            if a != b:
                assert not (b in grid.head_group(a) and b in grid.ring_group(a))
    with pytest.raises(ValueError, match="ulysses_size=3 must divide the world size 8"):
        Grid(8, 3)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_layout_and_token_map_hold_each_head_groups_tokens_in_order(layout):
    L, P, u = 37, 4, 2
    grid = Grid(P, u)
    ring_layout = grid.ring_layout(L, layout)
    x = torch.arange(L)[None, :, None]
    for g in range(grid.ring):
        members = grid.head_group(g * u)
        want = torch.sort(torch.cat([layout_mod.global_index(L, P, layout, r) for r in members])).values
        assert torch.equal(layout_mod.global_index(L, grid.ring, ring_layout, g), want)
        tokens = _TokenMap(L, P, layout, members)
        parts = [layout_mod.shard(x, 1, P, layout, r) for r in members]
        assert torch.equal(tokens.gather(parts).flatten(), want)
        for m, part in enumerate(parts):
            assert torch.equal(tokens.scatter(tokens.gather(parts), m), part)


def test_candidates_and_fixed_strategies():
    assert [c.name for c in candidates(8, 32)] == ["ring", "usp2x4", "usp4x2", "ulysses"]
    assert [c.name for c in candidates(8, 12)] == ["ring", "usp2x4", "usp4x2"]  # 12 heads: not over 8 ranks
    assert [c.name for c in candidates(6, 9)] == ["ring", "usp3x2"]
    assert fixed_candidate("usp", 2, 8, 32) == Candidate(8, 2)
    assert fixed_candidate("ulysses", None, 8, 32) == Candidate(8, 8)
    assert fixed_candidate("auto", None, 8, 32) is None
    with pytest.raises(ValueError, match="strategy='usp' needs ulysses_size"):
        fixed_candidate("usp", None, 8, 32)
    with pytest.raises(ValueError, match="not a multiple of 8; valid ulysses_size for these heads: \\[1, 2, 4\\]"):
        fixed_candidate("usp", 8, 8, 12)
    with pytest.raises(ValueError, match="must divide the world size 8"):
        fixed_candidate("usp", 3, 8, 12)
    with pytest.raises(ValueError, match="CostModel.bandwidth must be positive"):
        CostModel(bandwidth=0)
    assert CostModel().crc == CostModel().crc != CostModel(latency=1e-5).crc


def _dims(H, K, D=4):
    return dict(heads=H, head_dim=D, head_dim_v=D)


def test_layer_time_by_hand_ring_and_ulysses():
    """L = 8 tokens, P = 2, contiguous, causal, H = 2, K = 1, D = Dv = 4, float32; no latency.

    Ring: rank 1's queries 4-7 see its own 4 keys (one tile: 4 rows x 4 keys) and rank 0's 4 (4 x 4):
    32 entries; it receives 4 tokens of K/V (4 x 1 x 8 x 4 B = 128 B), again in the backward, and
    sends their dK/dV back (float32, 128 B): 384 B. Compute: 32 x H 2 x 2 (D + Dv) x 3.5 = 3584.
    Ulysses: each rank attends over all 8 tokens for 1 head: one tile of 8 rows x 8 keys = 64
    entries for one head, half of the (all-heads-normalised) 64 each: 32 x 2 x 16 x 3.5 = 3584. Bytes
    forward: its 4 tokens of 1 query head and the 1 K/V head (4 x (4 + 8) x 4 = 192 B) and the
    other's 4 tokens of its output head back (4 x 4 x 4 = 64 B): 256 B, both ways in the backward: 512 B."""
    meta = SequenceMeta.from_inputs(1, 8)
    spec = MaskSpec()
    dims = _dims(2, 1)
    for overlap in (True, False):
        model = CostModel(latency=0.0, bandwidth=100.0, inter_node_bandwidth=100.0, throughput=1000.0, overlap=overlap)
        ring = rank_plans(meta, spec, Candidate(2, 1), "contiguous", kv_heads=1, itemsize=4, **dims)
        assert ring[1].stats.entries_computed == 32
        want = max(3584 / 1000, 384 / 100) if overlap else 3584 / 1000 + 384 / 100
        assert layer_time(model, ring, **dims) == pytest.approx(want)
        uly = rank_plans(meta, spec, Candidate(2, 2), "contiguous", kv_heads=1, itemsize=4, **dims)
        assert [p.stats.entries_computed for p in uly.values()] == [32, 32]
        assert layer_time(model, uly, **dims) == pytest.approx(3584 / 1000 + 512 / 100)
    # latency: rounds (ring 1, ulysses 2) x forward and backward
    model = CostModel(latency=1.0, bandwidth=1e30, inter_node_bandwidth=1e30, throughput=1e30)
    assert layer_time(model, ring, **dims) == pytest.approx(2.0)
    assert layer_time(model, uly, **dims) == pytest.approx(4.0)
    # groups spanning nodes move at the inter-node bandwidth
    split = CostModel(latency=0.0, bandwidth=1e30, inter_node_bandwidth=100.0, throughput=1e30, ranks_per_node=1)
    assert layer_time(split, ring, **dims) == pytest.approx(384 / 100)


def test_layer_time_by_hand_usp():
    """L = 8, P = 4 in head groups of 2 (ranks {0, 1}, {2, 3}; rings {0, 2}, {1, 3}), contiguous,
    causal, H = 2, K = 1, D = Dv = 4, float32, 2 ranks per node: the all-to-alls within a node, the
    ring across nodes. Each member attends for 1 query head with the one K/V head (replicated).

    All-to-all: a member sends its 2 tokens of the other's query head and the K/V head (2 x (4 + 8) x
    4 B = 96 B) and receives as much, then 2 tokens of outputs (2 x 4 x 4 = 32 B) each way; forward and
    backward: 2 x (96 + 32) = 256 B within the node. Ring over the head groups' 4 tokens each: ring
    rank 1 (ranks 2, 3) receives 4 tokens of K/V (4 x 8 x 4 = 128 B), again in the backward, and sends
    their dK/dV back (128 B): 384 B across nodes. Work of rank 2: queries 4-7 against its 4 keys and
    the 4 received (two tiles of 4 x 4 = 32 entries for one head), the head group's share 16 of the
    all-heads-normalised count: 16 x H 2 x 2 (D + Dv) x 3.5 = 1792."""
    meta = SequenceMeta.from_inputs(1, 8)
    dims = _dims(2, 1)
    plans = rank_plans(meta, MaskSpec(), Candidate(4, 2), "contiguous", kv_heads=1, itemsize=4, **dims)
    assert [p.stats.entries_computed for p in plans.values()] == [8, 8, 16, 16]
    assert plans[2].exchanges == ((0, 0, 0, 0), (96, 96, 32, 32))  # rank 2 is member 0 of its head group
    assert plans[2].ring is plans[3].ring  # one ring plan per head group
    for overlap in (True, False):
        model = CostModel(latency=0.0, bandwidth=100.0, inter_node_bandwidth=10.0, throughput=1000.0,
                          ranks_per_node=2, overlap=overlap)
        body = max(1792 / 1000, 384 / 10) if overlap else 1792 / 1000 + 384 / 10
        assert layer_time(model, plans, **dims) == pytest.approx(256 / 100 + body)
    # one node: everything at the intra-node bandwidth; rounds: 2 all-to-alls + 1 ring round
    model = CostModel(latency=1.0, bandwidth=100.0, inter_node_bandwidth=10.0, throughput=1e30, ranks_per_node=4)
    assert layer_time(model, plans, **dims) == pytest.approx(256 / 100 + 384 / 100 + 2 * 3)


def test_auto_chooses_the_cheapest_and_records_every_candidate():
    L, P, H, K = 1024, 4, 8, 2  # several tiles of 128 rows per rank
    meta = SequenceMeta.from_inputs(1, L)
    dims = dict(heads=H, kv_heads=K, head_dim=8, head_dim_v=8, itemsize=2)
    work_only = CostModel(latency=0.0, bandwidth=1e30, inter_node_bandwidth=1e30, throughput=1e9)
    latency_only = CostModel(latency=1e-3, bandwidth=1e30, inter_node_bandwidth=1e30, throughput=1e30)
    cases = [  # (layout, mask, model, what the model must pick, strictly cheaper than the others)
        ("contiguous", MaskSpec(), work_only, "ulysses", False),  # contiguous causal shards: the ring's work is
        #                                                           unbalanced (usp halves it, ulysses balances it)
        ("zigzag", MaskSpec(), work_only, "ring", False),  # zigzag balances the ring: a tie, the ring first
        ("contiguous", MaskSpec(window=64), latency_only, "ring", True),  # one halo round against two all-to-alls
        ("zigzag", MaskSpec(), latency_only, "ulysses", True),  # P - 1 = 3 rounds against 2 (usp: 2 + 1)
    ]
    for layout, spec, model, want, strict in cases:
        times = {c.name: layer_time(model, rank_plans(meta, spec, c, layout, kv_heads=K, itemsize=2, heads=H,
                                                      head_dim=8, head_dim_v=8),
                                    heads=H, head_dim=8, head_dim_v=8) for c in candidates(P, H)}
        others = [t for name, t in times.items() if name != want]
        assert all(times[want] < t for t in others) if strict else all(times[want] <= t for t in others), times
        for rank in range(P):
            plan = choose(meta, spec, layout, rank, P, model, **dims)
            assert dict(plan.stats.predicted) == pytest.approx(times)
            got = plan.stats.strategy if plan.stats.strategy != "usp" else f"usp{plan.stats.ulysses_size}x2"
            assert got == want, (layout, spec, got, times)
            assert plan.rank == rank


def test_log_labels():
    from cp_attention.engine.stats import predicted_label, strategy_label

    meta = SequenceMeta.from_inputs(1, 256)
    plan = choose(meta, MaskSpec(), "zigzag", 0, 4, CostModel(), heads=4, kv_heads=2, head_dim=8, head_dim_v=8,
                  itemsize=2)
    assert predicted_label(plan.stats).startswith(", chosen by auto: modeled ring ")
    assert [name for name, _ in plan.stats.predicted] == ["ring", "usp2x2", "ulysses"]
    usp = rank_plans(meta, MaskSpec(), Candidate(4, 2), "zigzag", heads=4, kv_heads=2, head_dim=8, head_dim_v=8,
                     itemsize=2, ranks=[3])[3]
    assert strategy_label(usp.stats) == "usp, head groups of 2" and predicted_label(usp.stats) == ""
    assert usp.stats.peers_send == (2, 1)  # its head-group partner, then its ring partner


def test_public_names():
    assert cp_attention.CostModel is CostModel
    with pytest.raises(TypeError, match="cost_model must be a cp_attention.CostModel"):
        with cp_attention.context_parallel(strategy="auto", cost_model={"latency": 0}):
            pass
