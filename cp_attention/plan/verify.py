"""Verification of plans (tests and debugging): every kernel call against the mask, token by token.

The visible pairs come from the documented semantics (each query's key interval in its attention
segment, extended to the end of its bidirectional span) and :func:`~cp_attention.masks.row_key_intervals`
(the contract's bottom-right alignment), never from the planner's own fitting.
"""

from __future__ import annotations

import torch

from .. import layout as layout_mod
from ..masks import MaskSpec, SequenceMeta, row_key_intervals, segment_bounds
from .types import RankPlan, Step, clipped_band

__all__ = ["check_plan", "check_step"]


# ----------------------------------------------------------------------------------------------
# verification (tests and debugging): every call against the mask, token by token


def _intervals(q_idx: torch.Tensor, k_idx: torch.Tensor, seg_start: torch.Tensor, seg_end: torch.Tensor,
               spec: MaskSpec, span_end: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed query row (``b * Lq + i``), the packed key rows (``b * Lk + j``) it sees.

    ``q_idx``/``k_idx``: increasing global positions of the query and key tokens; ``seg_start``/
    ``seg_end`` (B, T): attention segment of every global position; ``span_end`` (B, T): the end of
    a token's bidirectional span or -1 (its later keys extend the interval). Returns (R,), (R,)."""
    lo_i, hi_i = clipped_band(spec, seg_start.shape[1])
    seg_s_BR, seg_e_BR = seg_start[:, q_idx], seg_end[:, q_idx]
    low_BR = torch.maximum(seg_s_BR, q_idx + lo_i)
    up_BR = torch.minimum(seg_e_BR, q_idx + hi_i + 1)
    if span_end is not None:
        up_BR = torch.maximum(up_BR, span_end[:, q_idx])
    tlo_BR = torch.searchsorted(k_idx, low_BR.contiguous())
    thi_BR = torch.maximum(torch.searchsorted(k_idx, up_BR.contiguous()), tlo_BR)
    base_B1 = (torch.arange(seg_s_BR.shape[0]) * k_idx.numel()).unsqueeze(1)
    return (tlo_BR + base_B1).reshape(-1), (thi_BR + base_B1).reshape(-1)


def check_step(step: Step | None, q_idx: torch.Tensor, k_idx: torch.Tensor, meta: SequenceMeta,
                 spec: MaskSpec, exact_spans: bool) -> int:
    """Check that ``step``'s calls compute every visible pair of the queries at global positions
    ``q_idx`` against the keys at ``k_idx`` (the step's buffer, per batch row) exactly once, and
    (``exact_spans``) that every key of the buffer is seen by some query. Returns the visible pairs."""
    seg_start, seg_end = segment_bounds(meta, spec)
    lo_R, hi_R = _intervals(q_idx, k_idx, seg_start, seg_end, spec, meta.span_ends() if spec.spans else None)
    want = int((hi_R - lo_R).clamp(min=0).sum())
    calls = step.calls if step is not None else ()
    rows, los, his = [], [], []
    for c in calls:
        lo_T, hi_T = row_key_intervals(c.cu_seqlens_q, c.cu_seqlens_k, causal=c.causal, window=c.window)
        keep = hi_T > lo_T
        rows.append(torch.arange(c.q_start, c.q_end)[keep])
        los.append(lo_T[keep] + c.k_start)
        his.append(hi_T[keep] + c.k_start)
    row_X = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    lo_X, hi_X = (torch.cat(xs) if xs else row_X.clone() for xs in (los, his))
    order = torch.argsort(row_X * (int(hi_R.max()) + 2 if hi_R.numel() else 1) + lo_X, stable=True)
    row_X, lo_X, hi_X = row_X[order], lo_X[order], hi_X[order]
    R = lo_R.numel()
    got_lo = torch.full((R,), -1, dtype=torch.int64).scatter_reduce(0, row_X, lo_X, "amin", include_self=False)
    got_hi = torch.full((R,), -1, dtype=torch.int64).scatter_reduce(0, row_X, hi_X, "amax", include_self=False)
    got_n = torch.zeros(R, dtype=torch.int64).scatter_add(0, row_X, hi_X - lo_X)
    same_row = row_X[1:] == row_X[:-1]
    gapless = bool((lo_X[1:][same_row] == hi_X[:-1][same_row]).all())
    live = hi_R > lo_R
    ok = gapless and bool((got_n == (hi_R - lo_R).clamp(min=0)).all()) and \
        bool((got_lo[live] == lo_R[live]).all()) and bool((got_hi[live] == hi_R[live]).all())
    if not ok:
        bad = torch.nonzero(got_n != (hi_R - lo_R).clamp(min=0)).flatten()[:4].tolist()
        raise AssertionError(f"plan verification: the kernel calls of the step from rank "
                             f"{None if step is None else step.source} do not compute exactly the visible pairs "
                             f"(rows {bad}: want {[(int(lo_R[r]), int(hi_R[r])) for r in bad]}); please report this")
    if exact_spans and k_idx.numel():
        used = torch.zeros(k_idx.numel() * meta.batch + 1, dtype=torch.int64)
        used.index_add_(0, lo_R[live], torch.ones_like(lo_R[live]))
        used.index_add_(0, hi_R[live], -torch.ones_like(hi_R[live]))
        seen = (torch.cumsum(used, 0)[:-1] > 0).reshape(meta.batch, -1).any(0)
        if not bool(seen.all()):
            raise AssertionError(f"plan verification: rank {step.source} sends keys no query sees "
                                 f"(buffer rows {torch.nonzero(~seen).flatten()[:8].tolist()}); please report this")
    if step is not None and sum(c.entries_visible for c in step.calls) != want:
        raise AssertionError("plan verification: the calls' visible-pair counts disagree with the mask")
    return want


def check_plan(plan: RankPlan, meta: SequenceMeta, spec: MaskSpec, layout, peer_plan) -> None:
    """Check ``plan`` token by token against the mask: every step's calls compute exactly the visible
    pairs of this rank's queries with the keys of the spans it receives, every received key is seen,
    no visible pair with a rank is missing, and what this rank sends is what its peers' plans
    receive (``peer_plan(rank)``: that rank's plan). O(L) time and memory: for tests and debugging
    (``$CP_ATTENTION_VERIFY_PLANS=1`` runs it
    on every plan built). Raises AssertionError."""
    L, P, r = meta.seq_len, plan.world_size, plan.rank
    q_idx = layout_mod.global_index(L, P, layout, r)
    by_source = {st.source: st for st in plan.steps()}
    for s in range(P):
        k_all = layout_mod.global_index(L, P, layout, s)
        st = by_source.get(s)
        spans = st.spans if st is not None else ((0, k_all.numel()),)
        k_idx = torch.cat([k_all[a:b] for a, b in spans])
        want = check_step(st, q_idx, k_idx, meta, spec, exact_spans=st is not None and s != r)
        if st is None and want:
            raise AssertionError(f"plan verification: rank {r} sees keys of rank {s} but its plan has no step for it")
    for rnd in plan.rounds:  # what this rank sends is exactly what the receiver's plan reads
        if rnd.send_to is not None:
            peer = peer_plan(rnd.send_to)
            got = {st.source: st.spans for st in peer.steps()}.get(r)
            if got != rnd.send_spans:
                raise AssertionError(f"plan verification: rank {r} sends {rnd.send_spans} to rank {rnd.send_to}, "
                                     f"which reads {got}; please report this")
