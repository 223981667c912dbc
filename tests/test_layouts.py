"""Layouts as objects (any assignment of tokens to ranks) and balanced layouts for packed batches.

* A :class:`Layout` is validated (every token on exactly one rank, every rank non-empty).
* The engine is exact under arbitrary and balanced layouts: world sizes 2-4, float64 against the
  independent oracle of tests/fuzz_cases.py (<= 1e-9) and float32 (<= 1e-5), documents of one
  token and documents longer than L / P, windows, chunks, bidirectional, sinks, B = 2.
* ``balanced_layout`` on drawn packed batches (lognormal document lengths, several seeds): the
  busiest rank's cost (visible pairs over the layers + token_weight x tokens) is within 5% of the
  mean, and no rank holds more than 1.25 x L / P tokens, where zigzag is far off.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import cp_attention
from cp_attention.balance import token_costs
from cp_attention.layout import Layout
from cp_attention.masks import SequenceMeta, doc_starts
from fuzz_cases import check_cases

TOL = {"float64": 1e-9, "float32": 1e-5}


def test_layout_validation():
    assert Layout(5, (((0, 2),), ((2, 5),))).local_lengths() == [2, 3]
    with pytest.raises(ValueError, match="held by no rank or by two"):
        Layout(5, (((0, 3),), ((2, 5),)))
    with pytest.raises(ValueError, match="held by no rank"):
        Layout(5, (((0, 2),), ((2, 4),)))
    with pytest.raises(ValueError, match="holds no token"):
        Layout(5, (((0, 5),), ()))
    with pytest.raises(ValueError, match="sorted and disjoint"):
        Layout(5, (((3, 5), (0, 2)), ((2, 3),)))
    named = Layout.named("zigzag", 10, 2)
    assert named.indices(0).tolist() == [0, 1, 2, 8, 9] and named.code != Layout.named("contiguous", 10, 2).code
    x = torch.arange(10)[None]
    lay = Layout(10, (((0, 2), (7, 9)), ((2, 7), (9, 10))))
    parts = [cp_attention.layout.shard(x, 1, 2, lay, r) for r in range(2)]
    assert parts[0].tolist() == [[0, 1, 7, 8]] and torch.equal(cp_attention.layout.unshard(parts, 1, lay), x)
    with pytest.raises(ValueError, match="layout is for 10 tokens"):
        cp_attention.layout.shard(torch.arange(12)[None], 1, 2, lay, 0)


def _lengths(L: int, rng: random.Random, median: float = 12.0) -> list[int]:
    out = []
    while sum(out) < L:
        out.append(max(1, min(int(math.exp(math.log(median) + 1.2 * rng.gauss(0, 1))), L - sum(out))))
    return out


def _cases(P: int) -> list[dict]:
    rng = random.Random(P)
    cases, seed = [], 0
    for causal, window, chunk, sinks in ((True, None, None, False), (True, 5, None, True), (False, 7, None, False),
                                         (True, None, 6, False), (True, 9, 4, True)):
        for dtype in ("float64", "float32"):
            for B in (1, 2):
                seed += 1
                L = 41
                rows = []
                for _ in range(B):  # one-token documents and one longer than L / P
                    lengths = [1, 2 * L // 3] + _lengths(L - 1 - 2 * L // 3, rng)
                    rng.shuffle(lengths)
                    rows.append([(rng.choice([0, 0, 3]), n) for n in lengths])
                pos = torch.tensor([[p for first, n in row for p in range(first, first + n)] for row in rows])
                masks = [dict(causal=causal, window=window, chunk_size=chunk)]
                layout = cp_attention.balanced_layout(P, position_ids=pos, masks=masks)
                cases.append(dict(layout=layout, B=B, L=L, heads=(4, 2), head_dim=8, causal=causal, window=window,
                                  chunk_size=chunk, softcap=None, sinks=sinks, scale=None, docs=("pos", rows),
                                  dtype=dtype, seed=seed))
    return cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_engine_is_exact_under_balanced_layouts(world_size):
    cases = _cases(world_size)
    assert any(len(runs) > 1 for c in cases for runs in c["layout"].ranges)  # not just contiguous cuts
    failures = check_cases(world_size, cases, TOL)
    assert not failures, "\n".join(failures[:20])


LAYER_MIXES = {"causal": [{}], "window-4096": [{"window": 4096}], "5 x window-1024 + full": [{"window": 1024}] * 5 + [{}]}


@pytest.mark.parametrize("mix", sorted(LAYER_MIXES))
@pytest.mark.parametrize("token_weight", [0.0, 3000.0, 30000.0])
def test_balanced_layout_meets_the_balance_and_token_goals(mix, token_weight):
    L, P = 32768, 4
    for seed in range(3):
        rng = random.Random(seed)
        lengths = _lengths(L, rng, median=1000.0)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        layout = cp_attention.balanced_layout(P, position_ids=pos, masks=LAYER_MIXES[mix], token_weight=token_weight)
        meta = SequenceMeta(batch=1, seq_len=L, doc_start=doc_starts(1, L, position_ids=pos), position=pos)
        cost = token_costs(meta, LAYER_MIXES[mix], token_weight)
        loads = [float(cost[layout.indices(r)].sum()) for r in range(P)]
        zigzag = Layout.named("zigzag", L, P)
        zloads = [float(cost[zigzag.indices(r)].sum()) for r in range(P)]
        mean = sum(loads) / P
        assert max(loads) <= 1.05 * mean, (seed, max(loads) / mean, max(zloads) / mean)
        assert max(layout.local_lengths()) <= 1.25 * L / P, layout.local_lengths()


def test_token_costs_count_visible_pairs():
    """The cost model against a brute-force count of the visible (query, key) pairs."""
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 3, 4, 5]])
    meta = SequenceMeta(batch=1, seq_len=12, doc_start=doc_starts(1, 12, position_ids=pos), position=pos)
    for mask in ({}, {"window": 3}, {"causal": False, "window": 2}, {"chunk_size": 2}):
        got = token_costs(meta, [mask])
        starts = meta.doc_start[0]
        for q in range(12):
            n = 0
            for k in range(12):
                same = starts[q] == starts[k]
                if mask.get("chunk_size"):
                    same &= int(pos[0, q]) // 2 == int(pos[0, k]) // 2
                d = q - k
                band = (d >= 0 if mask.get("causal", True) else True) and (
                    "window" not in mask or abs(d) < mask["window"])
                n += int(bool(same) and band)
            assert got[q] == n, (mask, q, float(got[q]), n)


def test_bench_layouts_smoke(capsys):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_layouts.py")
    spec = importlib.util.spec_from_file_location("bench_layouts", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--grid", "4096x2", "--seeds", "1", "--traffic-seeds", "1", "--token-weights", "0"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4096 | 2 |")]
    assert len(rows) == 3
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        zigzag, balanced = float(cells[4]), float(cells[6])
        assert balanced <= min(zigzag, 1.1), row
