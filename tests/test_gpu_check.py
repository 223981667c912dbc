"""benchmarks/gpu_check.py: its verdict (forward and gradient errors against a plain torch baseline;
no GPU backend run on CUDA fails) as a pure function, and end to end in its tiny smoke mode (on CPU:
the reference backend, and a deliberately broken stand-in that the check must catch)."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

from cp_attention.backends import BACKENDS


def _load():
    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load()
BASE = {"out": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}


def _result(errors=None, backend="triton", skipped=None):
    errors = dict(BASE, **(errors or {})) if skipped is None else {}
    return gpu_check.CaseResult("causal", backend, skipped=skipped, errors=errors,
                                baseline=BASE if skipped is None else {},
                                failures=() if skipped else tuple(gpu_check.case_failures(errors, BASE)))


# ----------------------------------------------------------------------------------------------
# the verdict as a pure function


def test_case_passes_within_twice_the_baseline():
    assert gpu_check.case_failures(dict(BASE), BASE) == []
    assert gpu_check.case_failures({key: 2 * value for key, value in BASE.items()}, BASE) == []


def test_forward_error_fails():
    failures = gpu_check.case_failures(dict(BASE, out=2.5e-2), BASE)
    assert len(failures) == 1 and failures[0].startswith("out err")


@pytest.mark.parametrize("grad", ["dq", "dk", "dv"])
def test_gradient_error_fails(grad):
    failures = gpu_check.case_failures(dict(BASE, **{grad: 4.1e-2}), BASE)
    assert len(failures) == 1 and failures[0].startswith(f"{grad} err")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_error_fails(bad):
    assert gpu_check.case_failures(dict(BASE, dk=bad), BASE)


def test_unmeasured_quantity_or_baseline_fails():
    assert gpu_check.case_failures({"out": 1e-3}, BASE)  # gradients not measured
    assert gpu_check.case_failures(dict(BASE), dict(BASE, dv=math.nan))


def test_overall_verdict():
    ok = [_result(), _result(backend="flash/fa3")]
    assert gpu_check.overall_verdict(ok, device_type="cuda")[0] == 0
    assert "PASS" in gpu_check.overall_verdict(ok, device_type="cuda")[1]

    status, line = gpu_check.overall_verdict(ok + [_result({"dq": 1.0})], device_type="cuda")
    assert status == 1 and "FAIL" in line and "causal/triton" in line
    status, line = gpu_check.overall_verdict([_result({"out": 1.0}, backend="reference")], device_type="cpu")
    assert status == 1 and "FAIL" in line


def test_all_skipped_on_cuda_fails():
    skipped = [_result(backend="flash", skipped="not installed"), _result(backend="triton", skipped="no triton")]
    status, line = gpu_check.overall_verdict(skipped, device_type="cuda")
    assert status == 1 and "no GPU backend ran" in line
    assert gpu_check.overall_verdict([], device_type="cuda")[0] == 1
    # only the reference ran on CUDA: still no GPU backend checked
    assert gpu_check.overall_verdict(skipped + [_result(backend="reference")], device_type="cuda")[0] == 1


def test_cpu_run_is_never_a_gpu_pass():
    status, line = gpu_check.overall_verdict([_result(backend="reference")], device_type="cpu")
    assert status == 0 and "not a GPU pass" in line and "PASS" not in line


# ----------------------------------------------------------------------------------------------
# end to end, tiny shapes on CPU


def test_gpu_check_smoke(capsys):
    assert gpu_check.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "== correctness" in out and "== timing" in out and "FAIL" not in out
    assert "no GPU backend on cpu" in out and "not a GPU pass" in out and "PASS" not in out
    rows = [line for line in out.splitlines() if line.split()[1:2] == ["reference"] and " dq " in line]
    assert len(rows) == len(gpu_check.CASES) and all(line.endswith("OK") for line in rows)


class NoisyGradients:
    """The reference backend with noise added to dq: forward exact, one gradient wrong."""

    name = "noisy"

    def __init__(self, scale=0.1):
        self.scale = scale
        self.ref = BACKENDS["reference"]

    def not_supported_reasons(self, **kwargs):
        return self.ref.not_supported_reasons(**kwargs)

    def forward(self, *args, **kwargs):
        return self.ref.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        dq, dk, dv = self.ref.backward(*args, **kwargs)
        gen = torch.Generator().manual_seed(0)
        return dq + self.scale * torch.randn(dq.shape, generator=gen, dtype=dq.dtype), dk, dv


def test_gpu_check_smoke_catches_a_wrong_gradient(capsys):
    assert gpu_check.main(["--smoke"], backends={"noisy": NoisyGradients()}) == 1
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split()[1:2] == ["noisy"] and " dq " in line]
    assert len(rows) == len(gpu_check.CASES)
    assert all("FAIL: dq err" in line and "out err" not in line for line in rows)
    assert "verdict: FAIL" in out


def test_gpu_check_fails_when_every_backend_is_skipped():
    """The real flow with the flash backend on CPU: skipped for every case; judged as on CUDA."""
    results = gpu_check.correctness({"flash": BACKENDS["flash"]}, 64, 16, torch.device("cpu"))
    assert results and all(r.skipped for r in results)
    status, line = gpu_check.overall_verdict(results, device_type="cuda")
    assert status == 1 and "no GPU backend ran" in line
