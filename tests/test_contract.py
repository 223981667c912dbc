"""The varlen contract (backends/base.py) on every registered backend, against a float64 loop oracle."""

from __future__ import annotations

import pytest
import torch

from cp_attention.backends import BACKENDS


def naive_varlen(q, k, v, cu_q, cu_k, *, scale, causal, window, softcap):
    """Per-sequence dense attention with flash-attn's bottom-right mask; returns out, lse (H, Tq)."""
    H, K = q.shape[1], k.shape[1]
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        Lq, Lk = qs.shape[0], ks.shape[0]
        ii, jj = torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]
        diag = ii + Lk - Lq
        left, right = window
        if causal:
            right = 0
        mask = torch.ones(Lq, Lk, dtype=torch.bool)
        if left >= 0:
            mask &= jj >= diag - left
        if right >= 0:
            mask &= jj <= diag + right
        s = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(H // K, 1)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1)
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        p = torch.where(mask, torch.exp(s - safe[..., None]), torch.zeros_like(s))
        outs.append(torch.einsum("hqk,khd->qhd", p, vs.repeat_interleave(H // K, 1)))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


# (name, q lengths, k lengths, causal, window, softcap, heads (H, K))
GRID = [
    ("causal", [17], [17], True, (-1, -1), None, (2, 2)),
    ("bidirectional", [13], [13], False, (-1, -1), None, (2, 2)),
    ("window-causal", [40], [40], True, (5, 0), None, (2, 2)),
    ("window-both", [33], [33], False, (4, 7), None, (2, 2)),
    ("window-left-only", [20], [20], False, (0, -1), None, (2, 1)),
    ("varlen-docs", [5, 1, 19, 8], [5, 1, 19, 8], True, (-1, -1), None, (4, 2)),
    ("varlen-window", [9, 30, 4], [9, 30, 4], True, (6, 0), None, (4, 2)),
    ("softcap", [21], [21], True, (-1, -1), 2.5, (2, 2)),
    ("gqa", [25], [25], True, (-1, -1), None, (8, 2)),
    ("mqa", [25], [25], False, (3, 3), None, (4, 1)),
    ("lq<lk-bottom-right", [7, 3], [19, 11], True, (-1, -1), None, (2, 2)),
    ("lq>lk-bottom-right", [19, 12], [7, 4], True, (-1, -1), None, (2, 2)),
    ("lq>lk-window", [19], [7], True, (2, 0), None, (2, 1)),
    ("empty-k", [6, 4, 5], [0, 9, 0], True, (-1, -1), None, (2, 2)),
    ("empty-q", [0, 7, 0], [5, 7, 3], False, (-1, -1), None, (2, 2)),
    ("empty-rows-window", [12], [4], False, (0, 0), None, (2, 2)),
    ("everything", [11, 0, 23, 6], [15, 4, 23, 0], True, (5, 0), 3.0, (6, 2)),
]


def _cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)


def check_backend_on_case(impl, case, dtypes=((torch.float64, 1e-10), (torch.float32, 2e-5)), grad_factor=5):
    """Run ``impl`` (forward and backward) on one GRID case against the float64 loop oracle."""
    _, lq, lk, causal, window, softcap, (H, K) = case
    D = 16
    gen = torch.Generator().manual_seed(len(lq) * 100 + sum(lq) + sum(lk))
    q = torch.randn(sum(lq), H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), K, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), K, D, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(sum(lq), H, D, generator=gen, dtype=torch.float64)
    cu_q, cu_k = _cu(lq), _cu(lk)
    kw = dict(scale=D ** -0.5, causal=causal, window=window, softcap=softcap)
    ref_out, ref_lse = naive_varlen(q, k, v, cu_q, cu_k, **kw)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout, allow_unused=True)
    ref_grads = [torch.zeros_like(t) if g is None else g for g, t in zip(ref_grads, (q, k, v))]
    for dtype, tol in dtypes:
        qd, kd, vd = (t.detach().to(dtype) for t in (q, k, v))
        out, lse = impl.forward(qd, kd, vd, cu_q, cu_k, max(lq), max(lk), **kw)
        assert out.dtype == dtype and out.shape == q.shape
        assert lse.shape == (H, sum(lq)) and lse.dtype in (torch.float32, torch.float64)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        torch.testing.assert_close(out.double(), ref_out.detach(), atol=tol, rtol=0)
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty), "rows that see nothing must have lse = -inf"
        assert (out[empty.any(0)] == 0).all(), "rows that see nothing must output 0"
        torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty].detach(), atol=tol, rtol=0)
        grads = impl.backward(dout.to(dtype), qd, kd, vd, out, lse, cu_q, cu_k, max(lq), max(lk), **kw)
        for g, rg, t in zip(grads, ref_grads, (qd, kd, vd)):
            assert g.shape == t.shape and not torch.isnan(g).any()
            torch.testing.assert_close(g.double(), rg, atol=tol * grad_factor, rtol=0)


@pytest.mark.parametrize("case", GRID, ids=[c[0] for c in GRID])
def test_reference_matches_loop_oracle(case):
    # the GPU backends run the same check: tests/test_triton.py, tests/test_flash_translation.py
    check_backend_on_case(BACKENDS["reference"], case)
