"""The varlen contract's grid of cases and its float64 loop oracle, shared by the backends' tests
(tests/unit/test_contract.py, test_cpu_backend.py, test_triton.py, test_flash_translation.py and
tests/integrations/test_mla.py)."""

from __future__ import annotations

import torch


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
    # more queries than keys + 1 with a window: FlashAttention-2 reads window sides against max_seqlen_k
    # (backends/flash.py, _fa2_max_seqlen_k); the ring's calls look like these (a zigzag rank's pieces
    # against the halo it receives)
    ("lq>lk+1-left-only", [63], [32], False, (0, -1), None, (2, 1)),
    ("lq>lk+1-right>=lk", [40], [8], False, (0, 10), None, (2, 2)),
    ("lq>lk+1-varlen", [50, 9], [6, 30], False, (3, -1), None, (4, 2)),
    ("lq>lk+1-causal-window", [63, 20], [32, 5], True, (40, 0), None, (2, 2)),
    ("lq>lk+1-causal-narrow", [45], [12], True, (7, 0), None, (2, 1)),
]


def cu(lengths):
    """int32 cu_seqlens of sequence lengths."""
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)


# (dtype, atol, rtol) for backends whose out (and, for flash kernels, dq/dk/dv) is rounded to float16 /
# bfloat16 (unit roundoff 2^-11 / 2^-8): the oracle runs on the same rounded inputs, so ~2x that suffices
LOW_PRECISION_TOL = ((torch.float16, 2e-4, 1e-3), (torch.bfloat16, 2e-3, 8e-3))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype every backend returns dq/dk/dv (and lse) in: the ring's accumulation dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_backend_on_case(impl, case, dtypes=((torch.float64, 1e-10), (torch.float32, 2e-5)), grad_factor=5):
    """Run ``impl`` (forward and backward) on one GRID case against the float64 loop oracle.

    ``dtypes`` holds ``(dtype, atol)`` or ``(dtype, atol, rtol)``. The oracle runs on the inputs as
    rounded to each dtype, so the tolerance measures the backend, not the rounding of its inputs.
    Gradients must come back in :func:`accumulation_dtype` (the contract's float32/float64).
    """
    _, lq, lk, causal, window, softcap, (H, K) = case
    D = 16
    gen = torch.Generator().manual_seed(len(lq) * 100 + sum(lq) + sum(lk))
    q64 = torch.randn(sum(lq), H, D, generator=gen, dtype=torch.float64)
    k64 = torch.randn(sum(lk), K, D, generator=gen, dtype=torch.float64)
    v64 = torch.randn(sum(lk), K, D, generator=gen, dtype=torch.float64)
    dout64 = torch.randn(sum(lq), H, D, generator=gen, dtype=torch.float64)
    cu_q, cu_k = cu(lq), cu(lk)
    kw = dict(scale=D ** -0.5, causal=causal, window=window, softcap=softcap)
    for dtype, tol, *rtol in dtypes:
        rtol = rtol[0] if rtol else 0.0
        qd, kd, vd, doutd = (t.to(dtype) for t in (q64, k64, v64, dout64))
        q, k, v = (t.detach().double().requires_grad_() for t in (qd, kd, vd))
        ref_out, ref_lse = naive_varlen(q, k, v, cu_q, cu_k, **kw)
        ref_grads = torch.autograd.grad(ref_out, (q, k, v), doutd.double(), allow_unused=True)
        ref_grads = [torch.zeros_like(t) if g is None else g for g, t in zip(ref_grads, (q, k, v))]
        out, lse = impl.forward(qd, kd, vd, cu_q, cu_k, max(lq), max(lk), **kw)
        assert out.dtype == dtype and out.shape == q.shape
        assert lse.shape == (H, sum(lq)) and lse.dtype in (torch.float32, torch.float64)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        torch.testing.assert_close(out.double(), ref_out.detach(), atol=tol, rtol=rtol)
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty), "rows that see nothing must have lse = -inf"
        assert (out[empty.any(0)] == 0).all(), "rows that see nothing must output 0"
        torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty].detach(), atol=tol, rtol=rtol)
        grads = impl.backward(doutd, qd, kd, vd, out, lse, cu_q, cu_k, max(lq), max(lk), **kw)
        for g, rg, t in zip(grads, ref_grads, (qd, kd, vd)):
            assert g.dtype == accumulation_dtype(dtype), (
                f"{impl.name}: gradients of {dtype} inputs must be {accumulation_dtype(dtype)} (the contract's "
                f"accumulation dtype), got {g.dtype}")
            assert g.shape == t.shape and not torch.isnan(g).any()
            torch.testing.assert_close(g.double(), rg, atol=tol * grad_factor, rtol=rtol)
