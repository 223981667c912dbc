"""The training example (issue 3, "must show" 5): under CP the loss equals the single-device loss at
every optimizer step (relative difference <= 1e-5)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.transformers]  # spawns gloo ranks; builds transformers models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP = re.compile(r"^step (\d+): .*CP loss (\S+)\s+single-device loss (\S+)\s+relative difference (\S+)$")


def test_train_cp_example_matches_single_device():
    steps = 5
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_cp.py"), "--nproc", "2",
                           "--steps", str(steps)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = [STEP.match(line).groups() for line in out.splitlines() if STEP.match(line)]
    assert [int(r[0]) for r in rows] == list(range(1, steps + 1)), out
    for _, cp, single, _ in rows:
        cp, single = float(cp), float(single)
        assert abs(cp - single) <= 1e-5 * abs(single), out
    assert len({r[1] for r in rows}) > 1, out  # the model and the data change from step to step
    assert "OK: CP loss equals the single-device loss at every step" in out
