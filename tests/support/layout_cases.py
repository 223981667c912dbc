"""Drawn document lengths of packed rows, shared by the balanced-layout tests
(tests/unit/test_layouts.py, tests/multirank/test_balanced_engine.py)."""

from __future__ import annotations

import math
import random


def lengths(L: int, rng: random.Random, median: float = 12.0) -> list[int]:
    """Lognormal document lengths (median ``median``) filling ``L`` tokens."""
    out = []
    while sum(out) < L:
        out.append(max(1, min(int(math.exp(math.log(median) + 1.2 * rng.gauss(0, 1))), L - sum(out))))
    return out
