"""A rank's plan visits only the ranks that share an attention segment with it (the interval index
of ``plan/ranks.py``), and is the same plan as the one that visits every offset 1..P-1 (the
planner's definition before the index: every offset tried, the empty ones dropped), field by field;
verified token by token at up to 256 ranks. The index itself is checked against a scan of every
rank's runs."""

from __future__ import annotations

import random

import numpy as np
import pytest

import cp_attention.plan.build as build_mod
from cp_attention import layout as layout_mod
from cp_attention.masks import MaskSpec, SequenceMeta
from cp_attention.plan import build_plan, verify_plan
from cp_attention.plan.ranks import rank_runs
from plan_cases import random_case, random_layout, same


def every_offset(monkeypatch) -> None:
    """The planner without the index: every offset 1..P-1 tried (its definition before the index)."""
    monkeypatch.setattr(build_mod, "_peer_offsets", lambda index, mine, terms, rank: list(range(1, index.world_size)))


def _plan(meta, spec, P, layout, rank, verify=False):
    return build_plan(meta, spec, world_size=P, layout=layout, rank=rank, head_kv=2, head_dim=8, itemsize=2,
                      verify=verify)


def test_holders_are_the_ranks_holding_the_tokens():
    rng = random.Random(5)
    for _ in range(200):
        P = rng.choice([1, 2, 3, 5, 8, 16])
        L = rng.randint(P, 300)
        layout = rng.choice(["zigzag", "contiguous", random_layout(rng, L, P) if L > P else "zigzag"])
        index = rank_runs(L, P, layout)
        assert index.runs == tuple(tuple(layout_mod.rank_ranges(L, P, layout, r)) for r in range(P))
        for r in range(P):  # local offsets: the position of each run's first token among the rank's
            idx = layout_mod.global_index(L, P, layout, r).tolist()
            for a, local in zip(index.start[index.rank == r].tolist(), index.local[index.rank == r].tolist()):
                assert idx[local] == a
        lo = np.array([rng.randint(-5, L + 5) for _ in range(rng.randint(0, 4))], dtype=np.int64)
        hi = lo + np.array([rng.randint(-3, L // 2 + 1) for _ in lo], dtype=np.int64)
        want = sorted({r for r in range(P) for a, b in index.runs[r] for x, y in zip(lo.tolist(), hi.tolist())
                       if y > x and a < y and x < b})
        assert index.holders(lo, hi).tolist() == want


def test_plans_equal_the_plans_that_visit_every_offset(monkeypatch):
    rng = random.Random(11)
    cases = [(random_case(rng, P), P) for P in [1, 2, 3, 4, 5, 8, 8, 13, 16, 16, 32] * 4]
    fast = [[_plan(meta, spec, P, layout, r) for r in range(P)] for (meta, spec, layout), P in cases]
    every_offset(monkeypatch)
    for ((meta, spec, layout), P), plans in zip(cases, fast):
        for r in range(P):
            same(plans[r], _plan(meta, spec, P, layout, r), f"P={P} {spec} {layout} rank {r}")


@pytest.mark.parametrize("P, seed", [(64, 0), (128, 1), (256, 2)])
def test_plans_verify_at_many_ranks(P, seed):
    # a few ranks token by token (verify_plan); every rank's sends against what the receivers' plans read
    rng = random.Random(seed)
    for _ in range(3):
        meta, spec, layout = random_case(rng, P, L=rng.randint(3 * P, 6 * P), B=1)
        plans = [_plan(meta, spec, P, layout, r) for r in range(P)]
        for r in {0, 1, P // 2 - 1, P // 2, P - 1, rng.randrange(P)}:
            verify_plan(plans[r], meta, spec, layout)
        sends = {(r, rnd.send_to): rnd.send_spans for r, p in enumerate(plans) for rnd in p.rounds if rnd.send_spans}
        reads = {(st.source, r): st.spans for r, p in enumerate(plans) for st in p.steps() if st.source != r}
        assert sends == reads


def test_a_rank_pairs_only_with_ranks_that_share_a_segment(monkeypatch):
    # 2^20 tokens of 1000 documents over 1024 ranks: one rank's queries and keys meet a handful of
    # ranks; the pair computations are counted (not timed): one per term for the rank itself, two
    # per visited offset. The plan is the one that visits every offset.
    P, L = 1024, 1 << 20
    rng = np.random.default_rng(0)
    weights = rng.lognormal(0.0, 1.0, 1000)
    lengths = np.maximum(1, (weights / weights.sum() * L).astype(np.int64))
    lengths[np.argmax(lengths)] += L - lengths.sum()
    meta = SequenceMeta(1, L, starts=(np.cumsum(lengths) - lengths,))
    calls = []
    original = build_mod._pair_sequences
    monkeypatch.setattr(build_mod, "_pair_sequences", lambda *a: calls.append(1) or original(*a))
    specs = (MaskSpec(), MaskSpec(window=4096), MaskSpec(chunk_size=8192))
    plans = []
    for spec in specs:
        calls.clear()
        plans.append(_plan(meta, spec, P, "zigzag", 5))
        assert 0 < len(plans[-1].rounds) <= 32 and len(calls) == 1 + 2 * len(plans[-1].rounds), len(calls)
    every_offset(monkeypatch)
    for spec, plan in zip(specs, plans):
        same(plan, _plan(meta, spec, P, "zigzag", 5))
