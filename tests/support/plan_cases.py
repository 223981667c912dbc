"""Random planning cases shared by the planner and pricing tests (tests/unit/test_plan_peers.py,
tests/unit/test_pricing.py): random documents, masks and layouts, and a field-by-field comparison
of plans."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from cp_attention import layout as layout_mod
from cp_attention.layout.balanced import balanced_layout_of
from cp_attention.masks import MaskSpec, SequenceMeta


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
