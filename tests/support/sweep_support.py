"""What the sweep tests share: the environment the sweep subprocesses run in."""

from __future__ import annotations

import os

import cp_attention


def sweep_env() -> dict:
    """The sweep's environment: one thread, this process's cp_attention first on the path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(cp_attention.__file__)))
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
