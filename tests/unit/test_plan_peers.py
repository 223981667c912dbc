"""A rank's plan visits only the ranks that share an attention segment with it (the interval index
of ``plan/ranks.py``), and is the same plan as the one that visits every offset 1..P-1 (the
planner's definition before the index: every offset tried, the empty ones dropped), field by field;
verified token by token at up to 256 ranks. The index itself is checked against a scan of every
rank's runs."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

import cp_attention.plan.build as build_mod
from cp_attention import layout as layout_mod
from cp_attention.layout.balanced import balanced_layout_of
from cp_attention.masks import MaskSpec, SequenceMeta
from cp_attention.plan import build_plan, verify_plan
from cp_attention.plan.ranks import rank_runs


def same(a, b, path="plan") -> None:
    """``a`` and ``b`` equal field by field (dataclasses and other objects, tuples, tensors; private
    dataclass fields, caches, skipped)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            if not f.name.startswith("_"):
                same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif hasattr(a, "__dict__") and not isinstance(a, type):  # a plain object (a head group's token map)
        assert type(a) is type(b), path
        same(sorted(vars(a).items()), sorted(vars(b).items()), path)
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def random_layout(rng: random.Random, L: int, P: int) -> layout_mod.Layout:
    """Any assignment: ``[0, L)`` cut at random, the cuts dealt to the ranks at random (each at least one)."""
    cuts = sorted(rng.sample(range(1, L), min(L - 1, rng.randint(P - 1, 3 * P))))
    bounds = list(zip([0] + cuts, cuts + [L]))
    owner = list(range(P)) + [rng.randrange(P) for _ in range(len(bounds) - P)]
    rng.shuffle(owner)
    runs = [[] for _ in range(P)]
    for r, run in zip(owner, bounds):
        runs[r].append(run)
    return layout_mod.Layout(L, tuple(tuple(layout_mod.merge_ranges(x)) for x in runs))


def random_case(rng: random.Random, P: int, L: int | None = None, B: int | None = None):
    """(meta, spec, layout): random documents (or one per row), sometimes bidirectional spans, any mask
    the planner takes, and a zigzag, contiguous, balanced or arbitrary layout."""
    L = L or rng.choice([rng.randint(P, 40 * P), rng.randint(P, 4000)])  # shards below and above a tile
    B = B or rng.choice([1, 1, 2])
    if rng.random() < 0.85:
        starts = tuple(np.array(sorted({0, *rng.sample(range(1, L), min(L - 1, rng.randint(0, 3 * P + 10)))}))
                       for _ in range(B))
        meta = SequenceMeta(B, L, starts=starts)
    else:
        meta = SequenceMeta(B, L)
    w = rng.choice([1, 2, 7, rng.randint(1, 300), L // (2 * P) + 1, L // 3 + 1])
    specs = [MaskSpec(), MaskSpec(window=w), MaskSpec(chunk_size=rng.randint(1, L)), MaskSpec(causal=False),
             MaskSpec(causal=False, window=w), MaskSpec(window=w, chunk_size=rng.randint(1, L)),
             MaskSpec(causal=False, chunk_size=rng.randint(1, L))]
    if rng.random() < 0.3:
        meta = meta.with_spans(torch.tensor([[rng.random() < 0.8 for _ in range(L)] for _ in range(B)]))
        specs += [MaskSpec(spans=True), MaskSpec(spans=True, window=w)]
    kind = rng.choice(["zigzag", "contiguous", "balanced", "any"])
    if kind == "balanced" and B == 1 and P > 1:
        layout = balanced_layout_of(meta, P)
    elif kind in ("balanced", "any"):
        layout = random_layout(rng, L, P)
    else:
        layout = kind
    return meta, rng.choice(specs), layout


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
