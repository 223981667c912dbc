"""benchmarks/gpu_check.py runs end to end in its tiny smoke mode (on CPU: reference backend only)."""

from __future__ import annotations

import importlib.util
import os


def test_gpu_check_smoke(capsys):
    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "== correctness" in out and "== timing" in out and "FAIL" not in out
