"""The mutation list of tests/mutations.py still applies to the current code (each planted bug's
source text is found exactly once and the mutated file compiles); running the mutants themselves
takes minutes: ``python tests/mutations.py``."""

from __future__ import annotations

import pytest

from mutations import MUTANTS, check_applies


def test_at_least_twelve_mutants_over_the_engine():
    assert len(MUTANTS) >= 12
    assert {"masks", "planner", "merge", "ring", "ring/sinks", "layouts", "flash", "gpu_check",
            "training"} <= {m.area for m in MUTANTS}


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_applies(mutant):
    check_applies(mutant)
