"""The engine is exact under balanced layouts (``cp_attention.balanced_layout``): world sizes 2-4,
float64 against the independent oracle of tests/support/fuzz_cases.py (<= 1e-9) and float32 (<= 1e-5),
documents of one token and documents longer than L / P, windows, chunks, bidirectional, sinks, B = 2
(the layouts themselves: tests/unit/test_layouts.py)."""

from __future__ import annotations

import random

import pytest
import torch

import cp_attention
from fuzz_cases import check_cases
from layout_cases import lengths as _lengths

TOL = {"float64": 1e-9, "float32": 1e-5}


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
