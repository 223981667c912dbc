"""benchmarks/gpu_check.py: its verdict (forward and gradient errors against a plain torch baseline;
no GPU backend run on CUDA fails) as a pure function, and end to end in its tiny smoke mode (on CPU:
the reference backend, and a deliberately broken stand-in that the check must catch)."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from cp_attention.backends import BACKENDS


def _load():
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load()
BASE = {"out": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}
N_CASES = len(gpu_check.fixed_cases(128)) + len(gpu_check.plan_cases(128))  # the --smoke run's cases


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
    assert len(rows) == N_CASES and all(line.endswith("OK") for line in rows)
    assert out.index("verdict:") < out.index("== timing"), "the verdict comes before any timing"
    assert out.rstrip().splitlines()[-1].startswith("exit status 0")
    # the strategies side by side: every candidate of P = 2 and 4 (4 heads) in each of the 8 settings
    strategies = out.split("== strategies")[1]
    for P, names in ((2, ["ring", "ulysses"]), (4, ["ring", "usp2x2", "ulysses"])):
        for name in names:
            assert len([line for line in strategies.splitlines()
                        if line.startswith(f"P={P} ") and re.search(rf"\s{name}\s+busiest compute", line)]) == 4
    assert strategies.count("auto picks") == 8 and "raised" not in strategies


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
    assert len(rows) == N_CASES
    assert all("FAIL: " in line and "dq err" in line and "out err" not in line for line in rows)
    assert "verdict: FAIL" in out


def test_gpu_check_fails_when_every_backend_is_skipped():
    """The real flow with the flash backend on CPU: skipped for every case; judged as on CUDA."""
    results = gpu_check.correctness({"flash": BACKENDS["flash"]}, 64, 16, torch.device("cpu"))
    assert results and all(r.skipped for r in results)
    status, line = gpu_check.overall_verdict(results, device_type="cuda")
    assert status == 1 and "no GPU backend ran" in line


# ----------------------------------------------------------------------------------------------
# rows for every backend and case, flash skips on sm80+, real plan calls, running from a checkout


def test_plan_cases_are_real_cp_calls():
    """The plan cases hold calls with more queries than keys, windows and several documents, and
    among them the call FlashAttention-2 read wrongly (more queries than keys + 1, right side
    unlimited); no call is repeated."""
    cases = gpu_check.plan_cases(8192)
    calls = [c for cs in cases.values() for c in cs]
    assert len(cases) == 8 and len(calls) == len(set(calls)) >= 30
    assert any(sum(c.lengths_q) > sum(c.lengths_k) + 1 and c.window[1] < 0 for c in calls)
    assert any(len(c.lengths_q) > 1 for c in calls) and any(c.window[0] >= 0 for c in calls)
    assert (4095, 2048, (0, -1)) in {(sum(c.lengths_q), sum(c.lengths_k), c.window) for c in calls}


class Raises:
    """The reference backend, but its forward fails a bare assert (an exception without a message,
    as flash-attn 4's Python checks raise) on calls with more queries than keys."""

    name = "raises"

    def not_supported_reasons(self, **kwargs):
        return BACKENDS["reference"].not_supported_reasons(**kwargs)

    def forward(self, q, k, *args, **kwargs):
        if q.shape[0] > k.shape[0]:
            raise AssertionError()  # no message (pytest would give a plain assert in this file one)
        return BACKENDS["reference"].forward(q, k, *args, **kwargs)

    def backward(self, *args, **kwargs):
        return BACKENDS["reference"].backward(*args, **kwargs)


def test_a_raising_backend_gets_failure_rows_and_the_run_goes_on(capsys):
    assert gpu_check.main(["--smoke"], backends={"raises": Raises(), "reference": BACKENDS["reference"]}) == 1
    out = capsys.readouterr().out
    table = out.split("== timing")[0].splitlines()
    rows = {name: [line for line in table if line.split()[1:2] == [name]] for name in ("raises", "reference")}
    assert len(rows["raises"]) == len(rows["reference"]) == N_CASES, "one row per backend and case"
    raised = [line for line in rows["raises"] if "raised AssertionError" in line]
    assert raised and all("FAIL" in line for line in raised) and all(line.startswith("plan:") for line in raised)
    assert all(line.endswith("OK") for line in rows["reference"])
    assert "verdict: FAIL" in out and out.index("verdict: FAIL") < out.index("== timing")
    assert "raises" in out.split("== timing")[1], "timing still ran"


def test_flash_skip_failure_rule():
    flash = BACKENDS["flash"]
    cpu = torch.device("cpu")
    kw = dict(device=cpu, head_dim=16, spec=gpu_check.MaskSpec())
    assert gpu_check.flash_skip_failure(flash, ["x"], capability=None, **kw) is None  # not CUDA
    assert gpu_check.flash_skip_failure(flash, ["x"], capability=(7, 5), **kw) is None  # before sm80
    assert "sm90" in gpu_check.flash_skip_failure(flash, ["not importable"], capability=(9, 0), **kw)


class StandInFlash:
    """The flash backend over the stand-in kernels of tests/support/flash_stand_ins.py (PyTorch's interface),
    accepted on CPU: its declared support is that of the interfaces, without the device check."""

    name = "flash"

    def __init__(self):
        from cp_attention.backends.flash import aten as aten_mod, backend as flash_mod

        self.backend = flash_mod.FlashBackend("aten")

    def not_supported_reasons(self, *, device, dtype, head_dim, spec, head_dim_v=None):
        name, rejected = self.backend._pick(torch.device("cpu"), head_dim, spec.softcap is not None)
        return [] if name is not None else rejected

    def interface_for(self, **kwargs):
        return self.backend.interface_for(**kwargs)

    def forward(self, *args, **kwargs):
        return self.backend.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        return self.backend.backward(*args, **kwargs)


@pytest.fixture
def stand_in_flash(monkeypatch):
    from flash_stand_ins import fake_aten_backward, fake_aten_forward

    from cp_attention.backends.flash import aten as aten_mod, backend as flash_mod

    monkeypatch.setattr(aten_mod, "aten_flash_forward", fake_aten_forward)
    monkeypatch.setattr(aten_mod, "aten_flash_backward", fake_aten_backward)
    monkeypatch.setattr(flash_mod, "INTERFACES", flash_mod.new_interfaces())
    return aten_mod  # the stand-in runs PyTorch's interface: its adapter's module


def _by_case(results):
    return {(r.case, r.backend.split("/")[0]): r for r in results}


def test_stand_in_flash_on_sm90_passes_and_skips_only_softcap(stand_in_flash):
    results = gpu_check.correctness({"flash": StandInFlash()}, 128, 16, torch.device("cpu"), capability=(9, 0))
    rows = _by_case(results)
    assert len(rows) == N_CASES
    assert rows[("softcap", "flash")].skipped and not rows[("softcap", "flash")].failures  # a declared feature
    ran = [r for r in results if r.skipped is None]
    assert len(ran) == N_CASES - 1 and all(r.backend == "flash/aten" and not r.failures for r in ran)
    assert gpu_check.overall_verdict(results, device_type="cuda")[0] == 0


def test_unfixed_max_seqlen_k_fails_the_plan_rows(stand_in_flash, monkeypatch):
    """The adapter without its max_seqlen_k fix (the kernel's window rule applied by the stand-in):
    the fixed cases (queries and keys of one length) pass, plan rows fail (the zigzag P = 2 one among them)."""
    monkeypatch.setattr(stand_in_flash, "fa2_max_seqlen_k", lambda max_seqlen_q, max_seqlen_k: max_seqlen_k)
    results = gpu_check.correctness({"flash": StandInFlash()}, 128, 16, torch.device("cpu"), capability=(9, 0))
    failed = sorted(r.case for r in results if r.failures)
    assert all(case.startswith("plan:") for case in failed) and "plan:zigzag:P2:1doc" in failed, failed
    assert all("out err" in "; ".join(r.failures) for r in results if r.failures)
    assert gpu_check.overall_verdict(results, device_type="cuda")[0] == 1


def test_flash_skipped_on_sm80_for_another_reason_fails():
    """The real flash backend on CPU, judged as on an sm90 device: skipped everywhere ("flash
    kernels need CUDA tensors"), which is no declared feature: every row fails, and so does the run
    even though another GPU backend passed."""
    results = gpu_check.correctness({"flash": BACKENDS["flash"], "triton-ok": BACKENDS["reference"]}, 64, 16,
                                    torch.device("cpu"), capability=(9, 0))
    flash_rows = [r for r in results if r.backend == "flash"]
    assert len(flash_rows) == len(gpu_check.fixed_cases(64)) + len(gpu_check.plan_cases(64))
    assert all(r.skipped and r.failures and "other than an unsupported feature" in r.failures[0] for r in flash_rows)
    status, line = gpu_check.overall_verdict(results, device_type="cuda")
    assert status == 1 and "causal/flash" in line


@pytest.mark.slow  # 18 s
@pytest.mark.multirank  # starts a Python child process: out of the inner loop (tests/conftest.py)
def test_runs_from_a_checkout_without_install(tmp_path):
    """``python benchmarks/gpu_check.py`` finds the package of its own checkout (the GPU machine
    cannot install it): a copy of the checkout elsewhere runs its own copy of the package."""
    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(root, "cp_attention"), checkout / "cp_attention",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / "benchmarks").mkdir()
    shutil.copy2(os.path.join(root, "benchmarks", "gpu_check.py"), checkout / "benchmarks" / "gpu_check.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke"], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"from {checkout / 'cp_attention'}" in proc.stdout


class AlwaysRaises(Raises):
    name = "always"

    def forward(self, *args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")


def test_a_backend_raising_in_timing_fails_the_run(capsys):
    assert gpu_check.main(["--smoke"], backends={"always": AlwaysRaises()}) == 1
    out = capsys.readouterr().out
    table, timing = out.split("== timing")
    assert len([line for line in table.splitlines() if line.split()[1:2] == ["always"]]) == N_CASES
    assert "verdict: FAIL" in table and "always" in timing and "raised RuntimeError" in timing
    assert "timing: FAIL (3 rows raised" in timing


def test_an_unusable_device_still_gives_every_row(monkeypatch):
    """The oracle's side of a call raising (what a CUDA fault does to every later call): the rows of
    that case fail, every later row fails as "not run", and no exception escapes."""
    calls = []
    real = gpu_check._baseline

    def baseline(*args, **kwargs):
        calls.append(1)
        if len(calls) >= 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu_check, "_baseline", baseline)
    results = gpu_check.correctness({"reference": BACKENDS["reference"]}, 128, 16, torch.device("cpu"))
    assert len(results) == N_CASES
    assert [bool(r.failures) for r in results] == [False, False] + [True] * (N_CASES - 2)
    assert "illegal memory access" in results[2].failures[0]
    assert all(r.failures[0].startswith("not run: ") for r in results[3:])
    assert gpu_check.overall_verdict(results, device_type="cuda")[0] == 1


def test_a_flash_package_that_does_not_import_fails(tmp_path, monkeypatch):
    from cp_attention.backends.flash import aten as aten_mod, backend as flash_mod

    monkeypatch.setattr(flash_mod, "INTERFACES", flash_mod.new_interfaces())
    assert gpu_check.flash_import_failures() == []
    (tmp_path / "flash_attn_interface.py").write_text("import flash_attn_3_missing_extension\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    monkeypatch.setattr(flash_mod, "INTERFACES", flash_mod.new_interfaces())
    rows = gpu_check.flash_import_failures()
    assert [r.backend for r in rows] == ["flash/fa3"] and "flash_attn_3_missing_extension" in rows[0].failures[0]
    assert gpu_check.overall_verdict(rows, device_type="cuda")[0] == 1
