"""The fuzz worker: runs drawn attention cases on every rank against an independent float64 oracle.

A case is a plain dict (so hypothesis can print it as a reproducer)::

    dict(layout="zigzag", B=1, L=37, heads=(4, 2), head_dim=8, causal=True, window=5, chunk_size=None,
         softcap=None, sinks=False, scale=None, docs=("pos", [[(0, 12), (0, 25)]]), dtype="float64",
         seed=3)

``docs``: None (every row one document); ``("pos", rows)`` with, per row, ``(first position,
length)`` per document (position_ids count up from the first position; a document starts wherever
the position does not increase by exactly one, so two documents may also merge); or ``("cu",
lengths)`` for one row with global ``cu_seqlens``.

The oracle here builds its (L x L) mask from the documented semantics alone (no cp_attention
code): key ``k`` is visible from query ``q`` when both lie in the same document and have the same
``position // chunk_size`` (positions from position_ids, else counted from 0 at each document's
first token), and ``0 <= q - k < window``
(causal) or ``|q - k| < window`` (bidirectional).

Legend: ``B`` batch rows, ``L`` global length, ``H``/``K`` query/KV heads, ``D`` head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import cp_attention

GRADS = ("out", "dq", "dk", "dv", "dsinks")


def positions_and_cu(case: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The global ``position_ids`` (B, L) int64 or ``cu_seqlens`` (N+1,) int32 of a case."""
    docs = case.get("docs")
    if docs is None:
        return None, None
    kind, rows = docs
    if kind == "pos":
        pos = [[p for first, n in row for p in range(first, first + n)] for row in rows]
        return torch.tensor(pos, dtype=torch.int64), None
    return None, torch.tensor([0] + list(rows), dtype=torch.int64).cumsum(0).to(torch.int32)


def oracle_mask(case: dict) -> torch.Tensor:
    """(B, L, L) bool, ``[b, q, k]`` True where query q sees key k (documented semantics)."""
    B, L = case["B"], case["L"]
    idx = torch.arange(L)
    position_ids, cu_seqlens = positions_and_cu(case)
    if position_ids is not None:
        opens = torch.ones(B, L, dtype=torch.bool)
        opens[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    else:
        opens = torch.zeros(B, L, dtype=torch.bool)
        opens[:, 0] = True
        if cu_seqlens is not None:
            for start in cu_seqlens[:-1].tolist():
                if start < L:
                    opens[:, start] = True
    doc_start = torch.cummax(torch.where(opens, idx, torch.zeros_like(idx)), dim=1).values  # (B, L)
    same = doc_start[:, :, None] == doc_start[:, None, :]
    if case.get("chunk_size") is not None:  # same position // chunk_size (positions from 0 without them)
        pos = position_ids if position_ids is not None else idx - doc_start
        chunk = torch.div(pos, case["chunk_size"], rounding_mode="floor")
        same &= chunk[:, :, None] == chunk[:, None, :]
    diff = idx[:, None] - idx[None, :]  # q - k
    band = diff >= 0 if case["causal"] else torch.ones(L, L, dtype=torch.bool)
    if case.get("window") is not None:
        band &= diff.abs() < case["window"]
    return same & band[None]


def oracle_attention(q, k, v, mask, *, scale, softcap=None, sinks=None):
    """Dense float64 attention: q (B, L, H, D), k/v (B, L, K, D), mask (B, L, L) -> (B, L, H, D).
    A row that sees no key and has no sink gives zeros."""
    H, K = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(H // K, dim=2), v.repeat_interleave(H // K, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, H, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def run_fuzz_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Worker: every case on this rank; per case the max abs error of this rank's shard of out, dq,
    dk, dv (and of the summed dsinks) against the oracle, the oracle's max magnitude per tensor,
    and whether all results are finite."""
    reports = []
    for case in cases:
        B, L, (H, K), D = case["B"], case["L"], case["heads"], case["head_dim"]
        dtype = getattr(torch, case["dtype"])
        gen = torch.Generator().manual_seed(case["seed"])
        q = torch.randn(B, L, H, D, generator=gen, dtype=torch.float64) * case.get("qk_gain", 1.0)
        k = torch.randn(B, L, K, D, generator=gen, dtype=torch.float64)
        v = torch.randn(B, L, K, D, generator=gen, dtype=torch.float64)
        dout = torch.randn(B, L, H, D, generator=gen, dtype=torch.float64)
        sinks = torch.randn(H, generator=gen, dtype=torch.float64) if case["sinks"] else None
        # the oracle sees exactly the values the engine gets (no input rounding in the error)
        q, k, v, dout = (t.to(dtype).double() for t in (q, k, v, dout))
        sinks = sinks.to(dtype).double() if sinks is not None else None
        scale = case["scale"] if case.get("scale") is not None else D ** -0.5
        leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
        ref = oracle_attention(q, k, v, oracle_mask(case), scale=scale, softcap=case.get("softcap"), sinks=sinks)
        ref_grads = torch.autograd.grad(ref, leaves, dout)
        position_ids, cu_seqlens = positions_and_cu(case)
        layout = case["layout"]
        if layout == "balanced":  # the batch's own balanced layout for its documents and mask
            layout = cp_attention.balanced_layout(
                world_size, position_ids=position_ids, cu_seqlens=cu_seqlens, seq_len=L,
                masks=[dict(causal=case["causal"], window=case.get("window"), chunk_size=case.get("chunk_size"))])
        with cp_attention.context_parallel(layout=layout) as cp:
            ours = [cp.shard(t.detach().to(dtype)).requires_grad_() for t in (q, k, v)]
            sinks_in = sinks.detach().to(dtype).requires_grad_() if sinks is not None else None
            out = cp_attention.attention(
                *ours, position_ids=cp.shard(position_ids) if position_ids is not None else None,
                cu_seqlens=cu_seqlens, causal=case["causal"], window=case.get("window"),
                chunk_size=case.get("chunk_size"), softcap=case.get("softcap"), sinks=sinks_in,
                scale=case.get("scale"))
            out.backward(cp.shard(dout).to(dtype))
            got = dict(out=out, dq=ours[0].grad, dk=ours[1].grad, dv=ours[2].grad)
            want = dict(out=cp.shard(ref.detach()), dq=cp.shard(ref_grads[0]), dk=cp.shard(ref_grads[1]),
                        dv=cp.shard(ref_grads[2]))
            if sinks is not None:
                dsinks = sinks_in.grad.double().clone()
                if world_size > 1:
                    dist.all_reduce(dsinks)
                got["dsinks"], want["dsinks"] = dsinks, ref_grads[3]
        errs = {name: (got[name].double() - want[name]).abs().max().item() for name in got}
        mags = {name: want[name].abs().max().item() for name in got}
        finite = all(bool(torch.isfinite(t).all()) for t in got.values())
        reports.append(dict(errs=errs, mags=mags, finite=finite))
    return reports


def check_cases(world_size: int, cases: list[dict], tol: dict, label=None) -> list[str]:
    """Run ``cases`` on a fresh group of ``world_size`` ranks; the failures (error above
    ``tol[dtype]`` x max(1, the oracle's magnitude), or non-finite results), one line each."""
    from rank_pool import RankPool

    label = label or (lambda i, case: f"case {i}")
    pool = RankPool(world_size)
    try:
        per_rank = pool.run(run_fuzz_cases, cases, timeout=600)
    finally:
        pool.close()
    failures = []
    for rank, reports in enumerate(per_rank):
        for i, (case, rep) in enumerate(zip(cases, reports)):
            for name, err in rep["errs"].items():
                bound = tol[case["dtype"]] * max(1.0, rep["mags"][name])
                if not (rep["finite"] and err <= bound):
                    failures.append(f"rank {rank} {label(i, case)}: {name} error {err:.2e} > {bound:.0e}")
    return failures
