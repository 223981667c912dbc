"""``strategy="auto"`` prices its candidates without building every rank's plan: the statistics of
:func:`ring_summary` and the times of :func:`candidate_time` equal, exactly (integers; floats to the
last bit), what every rank's plan gives (:func:`build_plan`, :func:`rank_plans`, :func:`layer_time`,
the definition), on random documents, masks, layouts, world sizes and cost models; and
:func:`choose` returns the plan and the predictions of the choice made from every rank's plans,
on random cases and on the grid of ``benchmarks/bench_strategies.py``."""

from __future__ import annotations

import dataclasses
import os
import random
import sys

import numpy as np
import pytest

import cp_attention.plan.summary as summary_mod
from cp_attention.masks import MaskSpec, SequenceMeta
from cp_attention.plan import build_plan
from cp_attention.plan.summary import ring_summary
from cp_attention.strategies.choice import CostModel, candidates, choose, layer_time, rank_plans
from cp_attention.strategies.pricing import candidate_time
from plan_cases import random_case, random_layout, same

@pytest.fixture(autouse=True)
def _unverified(monkeypatch):
    """The reference plans are built by the thousand here; the planner's verification (token by
    token, O(L) each) is the business of its own tests."""
    monkeypatch.setenv("CP_ATTENTION_VERIFY_PLANS", "0")


BENCH_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))


def plan_statistics(meta, spec, P, layout):
    """The definition: every rank's plan, read as the cost model reads it: entries, visible pairs,
    the width each rank receives from each peer, and each rank's rounds (offset, in, out)."""
    plans = [build_plan(meta, spec, world_size=P, layout=layout, rank=r, head_kv=1, head_dim=1, itemsize=1,
                        verify=False) for r in range(P)]
    entries = [p.stats.entries_computed for p in plans]
    visible = [p.stats.entries_visible for p in plans]
    widths = sorted((r, rnd.recv.source, rnd.recv.width) for r, p in enumerate(plans) for rnd in p.rounds if rnd.recv)
    rounds = sorted((r, rnd.offset, rnd.recv.width if rnd.recv else 0,
                     sum(b - a for a, b in rnd.send_spans) if rnd.send_spans else 0)
                    for r, p in enumerate(plans) for rnd in p.rounds)
    return entries, visible, widths, rounds


def summary_statistics(meta, spec, P, layout):
    s = ring_summary(meta, spec, world_size=P, layout=layout)
    widths = sorted(zip(s.recv_rank.tolist(), s.send_rank.tolist(), s.width.tolist()))
    return s.entries.tolist(), s.visible.tolist(), widths, sorted(zip(*(x.tolist() for x in s.rounds())))


def old_choose(meta, spec, layout, rank, P, model, *, heads, kv_heads, head_dim, head_dim_v, itemsize):
    """``choose`` as defined from every rank's plan of every candidate (its implementation before pricing)."""
    dims = dict(heads=heads, head_dim=head_dim, head_dim_v=head_dim_v)
    best, times = None, []
    for cand in candidates(P, heads):
        plans = rank_plans(meta, spec, cand, layout, kv_heads=kv_heads, itemsize=itemsize, **dims)
        t = layer_time(model, plans, **dims)
        times.append((cand.name, t))
        if best is None or t < best[0]:
            best = (t, plans[rank])
    plan = best[1]
    return dataclasses.replace(plan, stats=dataclasses.replace(plan.stats, predicted=tuple(times)))


def random_model(rng: random.Random) -> CostModel:
    return CostModel(ranks_per_node=rng.choice([1, 2, 3, 8]), overlap=rng.random() < 0.7,
                     latency=rng.choice([0.0, 20e-6, 1e-3]), throughput=rng.choice([400e12, 1e9]),
                     bandwidth=rng.choice([150e9, 1e6]), backward=rng.choice([2.5, 0.0]))


def random_heads(rng: random.Random) -> dict:
    H = rng.choice([1, 2, 4, 6, 8, 12, 16, 32, 64])
    D = rng.choice([8, 64, 128])
    return dict(heads=H, kv_heads=rng.choice([k for k in (1, 2, 3, 4, 8, 16) if H % k == 0]), head_dim=D,
                head_dim_v=rng.choice([D, 16]))


def test_ring_summary_equals_every_ranks_plan():
    rng = random.Random(1)
    for P in [1, 2, 3, 4, 5, 7, 8, 12, 16, 16, 32, 32, 64] * 5:
        meta, spec, layout = random_case(rng, P)
        assert summary_statistics(meta, spec, P, layout) == plan_statistics(meta, spec, P, layout), (P, spec, layout)


def test_long_documents_over_many_ranks():
    # one to three documents per row over up to 64 ranks: every rank holds pieces of the same
    # documents (a zigzag rank two of each, a balanced or arbitrary layout several), windows and
    # chunks about a shard long cut the pairs of pieces partly
    rng = random.Random(4)
    for P in [2, 3, 4, 8, 16, 32, 64] * 4:
        L = rng.randint(4 * P, 300 * P)
        starts = np.array(sorted({0, *rng.sample(range(1, L), rng.randint(0, 2))}))
        meta = SequenceMeta(1, L, starts=(starts,))
        side = L // (2 * P)
        spec = rng.choice([MaskSpec(), MaskSpec(window=rng.randint(1, 3 * side + 2)), MaskSpec(causal=False),
                           MaskSpec(causal=False, window=rng.randint(1, 3 * side + 2)),
                           MaskSpec(chunk_size=rng.randint(side + 1, 4 * side + 2))])
        layout = rng.choice(["zigzag", "contiguous", random_layout(rng, L, P)])
        assert summary_statistics(meta, spec, P, layout) == plan_statistics(meta, spec, P, layout), (P, spec, layout)


def test_groups_of_several_pieces_fitted_by_the_planner_only_where_needed():
    # one document over a zigzag layout: every rank holds two pieces of it; the pairs of ranks
    # whose pieces see each other whole, or through one pair of pieces, are priced in closed form;
    # each rank with itself, and the few pairs a window cuts twice, go through the planner's fitting
    # (group_sequences): between P and 2 P calls, not P^2
    calls = []
    original = summary_mod.group_sequences
    summary_mod.group_sequences = lambda *a: calls.append(1) or original(*a)
    try:
        for P in (8, 32):
            meta = SequenceMeta(1, 64 * P)
            for spec in (MaskSpec(), MaskSpec(window=100)):
                calls.clear()
                assert summary_statistics(meta, spec, P, "zigzag") == plan_statistics(meta, spec, P, "zigzag")
                assert P <= len(calls) <= 2 * P, (P, spec, len(calls))
    finally:
        summary_mod.group_sequences = original


def test_candidate_time_equals_layer_time_of_every_ranks_plans():
    rng = random.Random(2)
    for P in [1, 2, 3, 4, 6, 8, 8, 12, 16, 16, 32] * 4:
        meta, spec, layout = random_case(rng, P)
        model, dims = random_model(rng), random_heads(rng)
        kw = dict(kv_heads=dims.pop("kv_heads"), itemsize=rng.choice([1, 2, 4]), **dims)
        for cand in candidates(P, dims["heads"]):
            want = layer_time(model, rank_plans(meta, spec, cand, layout, **kw), **dims)
            assert candidate_time(meta, spec, cand, layout, model, **kw) == want, (cand, spec, layout, model)


def test_choose_equals_the_choice_from_every_ranks_plans():
    rng = random.Random(3)
    for P in [1, 2, 4, 6, 8, 16, 32] * 3:
        meta, spec, layout = random_case(rng, P)
        model, dims = random_model(rng), random_heads(rng)
        dims["itemsize"] = 2
        for rank in {0, P // 2, P - 1}:
            same(choose(meta, spec, layout, rank, P, model, **dims), old_choose(meta, spec, layout, rank, P, model,
                                                                              **dims))


def _bench_grid(full: bool):
    sys.path.insert(0, BENCH_DIR)
    import bench_strategies as bench

    grid = bench.GRID if full else dict(seq_lens=[32768, 1048576], world_sizes=[4, 32], data=bench.GRID["data"])
    for name, model in bench.MODELS.items():
        for L in grid["seq_lens"]:
            for P in grid["world_sizes"]:
                for data in grid["data"]:
                    meta = bench._meta(L, data)
                    for mask, _ in model["masks"]:
                        yield name, model, meta, MaskSpec(**mask), P, bench.ITEMSIZE


def _same_choice_on_the_grid(full: bool) -> None:
    """The benchmark's plan-level grid (its models, lengths, world sizes and data, zigzag, rank 0,
    the default model): the same choice and the same predictions as from every rank's plans."""
    model = CostModel()
    for name, m, meta, spec, P, itemsize in _bench_grid(full):
        dims = dict(heads=m["heads"], kv_heads=m["kv_heads"], head_dim=m["head_dim"], head_dim_v=m["head_dim"],
                    itemsize=itemsize)
        same(choose(meta, spec, "zigzag", 0, P, model, **dims), old_choose(meta, spec, "zigzag", 0, P, model, **dims),
             f"{name} L={meta.seq_len} P={P} {spec}")


def test_same_choice_on_the_benchmark_grid():
    _same_choice_on_the_grid(full=False)


@pytest.mark.slow
def test_same_choice_on_the_whole_benchmark_grid():
    _same_choice_on_the_grid(full=True)
