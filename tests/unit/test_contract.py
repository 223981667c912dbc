"""The varlen contract (backends/base.py) on every registered backend, against a float64 loop oracle
(the grid and the oracle: tests/support/contract_cases.py)."""

from __future__ import annotations

import pytest
import torch

from cp_attention.backends import BACKENDS
from cp_attention.masks import MaskSpec
from contract_cases import GRID, LOW_PRECISION_TOL, accumulation_dtype, check_backend_on_case
from contract_cases import cu as _cu


@pytest.mark.parametrize("case", GRID, ids=[c[0] for c in GRID])
def test_reference_matches_loop_oracle(case):
    # the GPU backends run the same check (gradient dtypes included): tests/unit/test_triton.py (Triton
    # under its CPU interpreter), tests/unit/test_flash_translation.py (flash behind stand-in kernels)
    check_backend_on_case(BACKENDS["reference"], case)


@pytest.mark.parametrize("case", GRID, ids=[c[0] for c in GRID])
def test_reference_low_precision(case):
    """float16/bfloat16 inputs: out in the input dtype, lse and gradients in float32."""
    check_backend_on_case(BACKENDS["reference"], case, dtypes=LOW_PRECISION_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["reference", "triton"])
def test_gradient_dtypes(name, dtype):
    """dq/dk/dv in the accumulation dtype for every input dtype a backend takes on this machine (the
    accuracy checks above run Triton in float32/float64 only, where that dtype is the input's; the
    flash backend's are checked behind stand-in kernels in tests/unit/test_flash_translation.py)."""
    impl = BACKENDS[name]
    reasons = impl.not_supported_reasons(device=torch.device("cpu"), dtype=dtype, head_dim=16, spec=MaskSpec())
    if name == "triton" and dtype == torch.bfloat16:  # refused under the CPU interpreter, by design
        assert any("bfloat16" in r for r in reasons), reasons
        return
    assert not reasons, reasons
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(9, 2, 16, generator=gen).to(dtype) for _ in range(4))
    cu = _cu([4, 5])
    kw = dict(scale=0.25, causal=True)
    out, lse = impl.forward(q, k, v, cu, cu, 5, 5, **kw)
    grads = impl.backward(dout, q, k, v, out, lse, cu, cu, 5, 5, **kw)
    assert [g.dtype for g in grads] == [accumulation_dtype(dtype)] * 3
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
