"""The Triton backend on the contract grid (tests/unit/test_contract.py) under the Triton interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from contract_cases import GRID, check_backend_on_case, naive_varlen  # noqa: E402
from contract_cases import cu as _cu  # noqa: E402

from cp_attention.backends.triton import TritonBackend  # noqa: E402
from cp_attention.masks import MaskSpec  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU run needs TRITON_INTERPRET=1 set before triton is imported")

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


@pytest.mark.parametrize("case", GRID, ids=[c[0] for c in GRID])
def test_triton_matches_loop_oracle(case):
    check_backend_on_case(TritonBackend(), case, dtypes=tuple(TOL.items()))


def test_multi_block_split_and_skip():
    """Longer sequences (several 16-row blocks): full blocks, both partial loops and skipped blocks all run."""
    lq, lk, H, K, D = [70, 3], [90, 50], 2, 1, 32
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lq), H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), K, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), K, D, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(sum(lq), H, D, generator=gen, dtype=torch.float64)
    cu_q, cu_k = _cu(lq), _cu(lk)
    for causal, window in ((True, (37, 0)), (False, (20, 45))):
        kw = dict(scale=D ** -0.5, causal=causal, window=window, softcap=None)
        ref_out, _ = naive_varlen(q, k, v, cu_q, cu_k, **kw)
        ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
        out, lse = TritonBackend().forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, max(lq), max(lk), **kw)
        torch.testing.assert_close(out, ref_out.detach(), atol=1e-10, rtol=0)
        grads = TritonBackend().backward(dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k,
                                         max(lq), max(lk), **kw)
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g, rg, atol=1e-9, rtol=0)


def test_head_dim_padding_and_fake():
    """A head dim that is not a power of two is padded inside the kernel; the fake kernels give shapes."""
    lq, H, D = [9], 2, 24
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, H, D, generator=gen) for _ in range(3))
    cu = _cu(lq)
    kw = dict(scale=D ** -0.5, causal=True, window=(-1, -1), softcap=None)
    out, lse = TritonBackend().forward(q, k, v, cu, cu, 9, 9, **kw)
    ref_out, ref_lse = naive_varlen(q.double(), k.double(), v.double(), cu, cu, **kw)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fcu = mode.from_tensor(cu)
        fout, flse = torch.ops.cp_attention.triton_varlen_fwd(fq, fk, fv, fcu, fcu, 9, 9, kw["scale"], True, -1, -1,
                                                             None)
        assert fout.shape == q.shape and flse.shape == (H, 9) and flse.dtype == torch.float32


def test_not_supported_reasons():
    spec = MaskSpec()
    impl = TritonBackend()
    assert impl.not_supported_reasons(device=torch.device("cpu"), dtype=torch.float32, head_dim=64, spec=spec) == []
    assert impl.not_supported_reasons(device=torch.device("cpu"), dtype=torch.int32, head_dim=512, spec=spec)
    old = os.environ.pop("TRITON_INTERPRET")
    try:
        reasons = impl.not_supported_reasons(device=torch.device("cpu"), dtype=torch.float32, head_dim=64, spec=spec)
        assert any("TRITON_INTERPRET" in r for r in reasons)
    finally:
        os.environ["TRITON_INTERPRET"] = old


def test_selected_keys_run_on_triton():
    """Index-sparse attention (a selection of keys per query) on the Triton backend: one non-causal
    varlen sequence per query over its kept keys, against a dense float64 oracle of the definition."""
    import cp_attention

    gen = torch.Generator().manual_seed(3)
    B, L, H, K, D, S = 1, 12, 2, 1, 16, 4
    q = torch.randn(B, L, H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, L, K, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, L, K, D, generator=gen, dtype=torch.float64, requires_grad=True)
    sel = torch.randint(-1, L, (B, L, S), generator=gen)
    keep = torch.zeros(B, L, L, dtype=torch.bool)
    for i in range(L):
        for j in sel[0, i].tolist():
            keep[0, i, j] = 0 <= j <= i
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.expand(B, L, H, D)) * D ** -0.5
    p = torch.softmax(s.masked_fill(~keep[:, None], float("-inf")), -1).nan_to_num(0.0)
    ref = torch.einsum("bhqk,bkhd->bqhd", p, v.expand(B, L, H, D))
    out = cp_attention.attention(q, k, v, key_select=sel, backend="triton")
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    for g, rg in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, rg, atol=1e-9, rtol=0)
