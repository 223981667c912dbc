"""Attention over selected keys (index-sparse attention) across ranks: only the selected keys move.

Each query comes with a set of global key indices (DeepSeek Sparse Attention's top-k, ``-1`` for an
empty slot). One call, given this rank's :class:`~cp_attention.plan.select.SelectPlan`:

1. keeps the selected keys the rest of the mask lets the query see (the plan's ``[lo, hi]``: causal,
   window, chunk, document) and drops repeats: a selection never adds a pair;
2. asks every other rank for the distinct keys its queries selected there (an all-to-all of the
   counts, one of the indices: 8 bytes a key), and receives those K/V rows (one all-to-all of
   ``K * (D + Dv)`` values a key, in the inputs' dtype), never a whole shard;
3. attends: every query is one varlen sequence over its own keys, gathered from this rank's K/V
   and the received rows (the varlen contract, non-causal: the causality is in the selection),
   so every backend runs it, with the sinks applied after as in the ring. The keys are gathered
   per chunk of queries (:data:`GATHER_BYTES`) in the forward and again in the backward.

The backward sends each received key's dK/dV (a sum over this rank's queries) back to its owner,
which adds it to its own: the same all-to-all, reversed.

Cost: every query's keys are copied out of the pool, ``Tq * k`` rows per pass in chunks (a sparse
kernel reading the pool in place would avoid the copies: none of the backends here has one).

Legend: ``B`` batch, ``L`` this rank's tokens, ``H`` query heads, ``K`` K/V heads, ``D`` head dim
of q/k, ``Dv`` of v, ``S`` selection slots per query, ``E = D + Dv``, ``N`` (query, key) pairs kept.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from ..comm import Comm
from ..masks import MaskSpec, accumulation_dtype
from ..plan.select import SelectPlan
from .merge import apply_sinks

__all__ = ["select_attention", "kept_selection", "selected_call_spec"]


def selected_call_spec(spec: MaskSpec) -> MaskSpec:
    """The mask of the varlen call a selected-keys layer makes (what a backend must support): every
    query over its own kept keys, bidirectional, with the layer's softcap and scale."""
    return MaskSpec(causal=False, softcap=spec.softcap, scale=spec.scale)


def kept_selection(key_select_BLS: torch.Tensor, lo_BL: torch.Tensor, hi_BL: torch.Tensor, *, seq_len: int = 0,
                   extra: int = 0) -> torch.Tensor:
    """The selected keys each query keeps, (B, L, S) int64 sorted ascending with ``-1`` in the slots
    dropped: outside ``[lo, hi]`` (causal, window, documents), empty (``-1``) or a repeat. With ``extra``
    keys beyond the row's ``seq_len`` tokens (indices ``seq_len .. seq_len + extra - 1``), those are kept
    as selected: the caller's selection is their visibility."""
    sel_BLS = key_select_BLS.to(torch.int64)
    inside = (sel_BLS >= lo_BL[..., None]) & (sel_BLS <= hi_BL[..., None])
    if extra:
        inside |= (sel_BLS >= seq_len) & (sel_BLS < seq_len + extra)
    sel_BLS = torch.where(inside, sel_BLS, torch.full_like(sel_BLS, -1)).sort(-1).values
    repeat = torch.zeros_like(inside)
    repeat[..., 1:] = (sel_BLS[..., 1:] == sel_BLS[..., :-1]) & (sel_BLS[..., 1:] >= 0)
    return sel_BLS.masked_fill(repeat, -1).sort(-1).values


class _Fetch(torch.autograd.Function):
    """Rows of every rank's (R, K, E) buffer, fetched by the ranks that asked: forward sends
    ``kv[send_rows[p]]`` to each peer ``p`` and returns what the peers sent, in peer order; backward
    returns each received row's gradient to its owner, added into the owner's rows."""

    @staticmethod
    def forward(ctx, kv_RKE, send_rows, recv_counts, comm):
        with comm.reporting("the selected keys' exchange"):
            sends = [kv_RKE[rows].contiguous() for rows in send_rows]
            recvs = [kv_RKE.new_empty((n,) + tuple(kv_RKE.shape[1:])) for n in recv_counts]
            comm.all_to_all(sends, recvs, "the selected keys' exchange")
        ctx.send_rows, ctx.recv_counts, ctx.comm, ctx.shape = send_rows, recv_counts, comm, kv_RKE.shape
        return torch.cat(recvs) if recvs else kv_RKE.new_empty((0,) + tuple(kv_RKE.shape[1:]))

    @staticmethod
    def backward(ctx, grad_NKE):
        comm = ctx.comm
        with comm.reporting("the selected keys' gradient exchange"):
            acc = accumulation_dtype(grad_NKE.dtype)
            sends = [g.to(acc).contiguous() for g in torch.split(grad_NKE, list(ctx.recv_counts))]
            recvs = [grad_NKE.new_empty((rows.numel(),) + tuple(ctx.shape[1:]), dtype=acc) for rows in ctx.send_rows]
            comm.all_to_all(sends, recvs, "the selected keys' gradient exchange")
            grad_RKE = torch.zeros(ctx.shape, dtype=acc, device=grad_NKE.device)
            for rows, g in zip(ctx.send_rows, recvs):
                if rows.numel():
                    grad_RKE.index_add_(0, rows, g)
        return grad_RKE.to(grad_NKE.dtype), None, None, None


def _fetch_latent(latent, send_rows, recv_counts: list[int], comm: Comm, K: int, E: int) -> torch.Tensor:
    """The selected keys' K/V rows (N, K, E) from their latent rows, fetched from their owners (:class:`_Fetch`)
    and expanded here with the layer's own expansion (autograd: its weights' gradient of these rows stays with
    this rank, the rows' gradient returns to their owners)."""
    R = latent.latent.shape[-1]
    fetched_N1R = _Fetch.apply(latent.latent.reshape(-1, 1, R), send_rows, recv_counts, comm)
    if fetched_N1R.shape[0] == 0:  # still a node of the graph: the exchange's backward runs on every rank
        return fetched_N1R.reshape(0, K, E)
    k_1NKD, v_1NKDv = latent.expand(fetched_N1R.reshape(1, -1, R))
    return torch.cat([k_1NKD, v_1NKDv], dim=-1).reshape(-1, K, E)


def _exchange_counts(comm: Comm, counts: list[int], device) -> list[int]:
    """Every peer's count for this rank (an all-to-all of one int64 each)."""
    sends = [torch.tensor([n], dtype=torch.int64, device=device) for n in counts]
    recvs = [torch.zeros(1, dtype=torch.int64, device=device) for _ in counts]
    comm.all_to_all(sends, recvs, "the selected keys' counts")
    return [int(r.item()) for r in recvs]


GATHER_BYTES = 1 << 28
"""Bytes of gathered K/V per chunk of queries (256 MiB): the forward and the backward gather each
chunk's selected keys, run it and drop them, so memory stays O(this) beyond the inputs whatever
``L * k`` is."""


def _chunks(cu_k: list[int], budget_rows: int) -> list[tuple[int, int]]:
    """Query ranges ``[a, b)`` whose gathered keys fit ``budget_rows`` (one query at least)."""
    out, a, T = [], 0, len(cu_k) - 1
    while a < T:
        b = bisect.bisect_right(cu_k, cu_k[a] + budget_rows, lo=a + 1) - 1
        b = min(max(b, a + 1), T)
        out.append((a, b))
        a = b
    return out


class _SelectedAttention(torch.autograd.Function):
    """Each query over its own gathered keys: q (T, H, D), pool (R, K, D + Dv), the pool rows of every
    query's keys concatenated (``rows``, with ``cu_k``: query ``t``'s are ``rows[cu_k[t]:cu_k[t+1]]``),
    sinks (H,) or None -> out (T, H, Dv). One non-causal varlen call per chunk of queries (every query
    one sequence), the keys gathered per chunk in both passes; sinks applied after, as the ring does."""

    @staticmethod
    def forward(ctx, q_THD, pool_RKE, sinks, rows_N, cu_k, D, backend, scale, softcap):
        T, H, _ = q_THD.shape
        Dv = pool_RKE.shape[2] - D
        acc = accumulation_dtype(q_THD.dtype)
        out_THDv = torch.zeros(T, H, Dv, dtype=acc, device=q_THD.device)
        lse_HT = torch.full((H, T), float("-inf"), dtype=acc, device=q_THD.device)
        bounds = cu_k.tolist()
        budget = max(1, GATHER_BYTES // (pool_RKE.shape[1] * pool_RKE.shape[2] * pool_RKE.element_size()))
        spans = _chunks(bounds, budget)
        for a, b in spans:
            k_NKD, v_NKDv, cu_q, cu_kc, most = _gathered(pool_RKE, rows_N, bounds, a, b, D)
            o, lse = backend.forward(q_THD[a:b], k_NKD, v_NKDv, cu_q, cu_kc, 1, most, scale=scale, causal=False,
                                     window=(-1, -1), softcap=softcap)
            out_THDv[a:b], lse_HT[:, a:b] = o.to(acc), lse.to(acc)
        if sinks is not None:
            out_THDv, lse_HT = apply_sinks(out_THDv, lse_HT, sinks)
        out = out_THDv.to(q_THD.dtype)
        ctx.save_for_backward(q_THD, pool_RKE, sinks, rows_N, out, lse_HT)
        ctx.bounds, ctx.spans, ctx.D, ctx.backend, ctx.scale, ctx.softcap = bounds, spans, D, backend, scale, softcap
        return out

    @staticmethod
    def backward(ctx, dout_THDv):
        q_THD, pool_RKE, sinks, rows_N, out_THDv, lse_HT = ctx.saved_tensors
        acc = accumulation_dtype(q_THD.dtype)
        dout_THDv = dout_THDv.contiguous()
        dq_THD = torch.zeros(q_THD.shape, dtype=acc, device=q_THD.device)
        dpool_RKE = torch.zeros(pool_RKE.shape, dtype=acc, device=q_THD.device)
        for a, b in ctx.spans:
            k_NKD, v_NKDv, cu_q, cu_kc, most = _gathered(pool_RKE, rows_N, ctx.bounds, a, b, ctx.D)
            dq, dk, dv = ctx.backend.backward(dout_THDv[a:b], q_THD[a:b], k_NKD, v_NKDv, out_THDv[a:b], lse_HT[:, a:b],
                                              cu_q, cu_kc, 1, most, scale=ctx.scale, causal=False, window=(-1, -1),
                                              softcap=ctx.softcap)
            dq_THD[a:b] = dq
            if k_NKD.shape[0]:
                dpool_RKE.index_add_(0, rows_N[ctx.bounds[a]:ctx.bounds[b]], torch.cat([dk, dv], dim=-1).to(acc))
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[2]:
            # d loss / d sink_h = -sum_t exp(sink_h - lse_ht) * sum_d(dout * out)_ht  (as in the ring)
            delta_HT = (dout_THDv.to(acc) * out_THDv.to(acc)).sum(-1).t()
            dsinks = -(torch.exp(sinks.to(acc)[:, None] - lse_HT) * delta_HT).sum(1).to(sinks.dtype)
        return (dq_THD.to(q_THD.dtype), dpool_RKE.to(pool_RKE.dtype), dsinks, None, None, None, None, None, None)


def _gathered(pool_RKE, rows_N, bounds: list[int], a: int, b: int, D: int):
    """Queries ``[a, b)``'s keys gathered from the pool: (k, v, cu_seqlens_q, cu_seqlens_k, longest)."""
    device = pool_RKE.device
    picked_NKE = pool_RKE[rows_N[bounds[a]:bounds[b]]]
    cu_kc = torch.tensor([x - bounds[a] for x in bounds[a:b + 1]], dtype=torch.int32, device=device)
    cu_q = torch.arange(b - a + 1, dtype=torch.int32, device=device)
    most = max(max(y - x for x, y in zip(bounds[a:b], bounds[a + 1:b + 1])), 1)
    return picked_NKE[..., :D].contiguous(), picked_NKE[..., D:].contiguous(), cu_q, cu_kc, most


def select_attention(q, k, v, key_select, sinks, plan: SelectPlan, comm: Comm, backend, *, scale: float,
                     softcap: float | None, extra_kv=None, latent=None):
    """Attention of this rank's queries over the keys they selected: q (B, L, H, D), k (B, L, K, D),
    v (B, L, K, Dv), key_select (B, L, S) integer global key indices (``-1``: none), sinks (H,) or None
    -> (out (B, L, H, Dv), the call's :class:`~cp_attention.plan.PlanStats` with the bytes it moved).
    ``extra_kv``: (k (B, E, K, D), v (B, E, K, Dv)) keys every rank holds whole, beyond the row's ``T``
    tokens (DeepSeek-V4's compressed entries): index ``T + e`` selects entry ``e`` of the query's row;
    they do not move. Differentiable w.r.t. q, k, v, sinks and the extra keys (each rank's part of
    their gradient: the caller sums it over the ranks). ``latent``: a multi-head latent attention layer's
    :class:`~cp_attention.strategies.latent.LatentKV` of k and v: the selected keys' latent rows move instead
    of their heads and are expanded where they arrive (the stats' ``kv_form`` "latent"). Every rank of
    ``comm`` calls it together."""
    B, L, H, D = q.shape
    K, Dv = k.shape[2], v.shape[3]
    P, rank, device, T = plan.world_size, plan.rank, q.device, plan.seq_len
    E = 0 if extra_kv is None else extra_kv[0].shape[1]
    sel_BLS = kept_selection(key_select.to(device), plan.lo.to(device), plan.hi.to(device), seq_len=T, extra=E)
    beyond_BLS = sel_BLS >= T
    ok_BLS = (sel_BLS >= 0) & ~beyond_BLS
    key_BLS = sel_BLS.clamp(min=0, max=T - 1)
    owner_BLS = plan.owner.to(device)[key_BLS]
    row_BLS = plan.row.to(device)[key_BLS]
    b_BLS = torch.arange(B, device=device)[:, None, None].expand_as(key_BLS)
    lengths = torch.tensor(plan.lengths, dtype=torch.int64, device=device)
    packed_BLS = b_BLS * lengths[owner_BLS] + row_BLS  # the key's row among its owner's packed (B * L_owner) rows
    pool_BLS = torch.zeros_like(packed_BLS)
    mine = ok_BLS & (owner_BLS == rank)
    pool_BLS[mine] = packed_BLS[mine]
    wanted = []
    for p in range(P):
        if p == rank:
            wanted.append(packed_BLS.new_empty(0))
            continue
        wanted.append(torch.unique(packed_BLS[ok_BLS & (owner_BLS == p)]))
    kv_RKE = torch.cat([k, v], dim=-1).reshape(B * L, K, D + Dv)
    send_rows = wanted
    if P > 1:
        asked = _exchange_counts(comm, [w.numel() for w in wanted], device)
        requests = [packed_BLS.new_empty(n) for n in asked]
        comm.all_to_all([w.contiguous() for w in wanted], requests, "the selected keys' indices")
        send_rows = requests
        if latent is None:
            fetched_NKE = _Fetch.apply(kv_RKE, send_rows, [w.numel() for w in wanted], comm)
        else:
            fetched_NKE = _fetch_latent(latent, send_rows, [w.numel() for w in wanted], comm, K, D + Dv)
        base = B * L
        for p in range(P):
            theirs = ok_BLS & (owner_BLS == p)
            if p != rank and wanted[p].numel():
                pool_BLS[theirs] = base + torch.searchsorted(wanted[p], packed_BLS[theirs])
            base += wanted[p].numel()
        pool_RKE = torch.cat([kv_RKE, fetched_NKE])
    else:
        pool_RKE = kv_RKE
    if E:  # every rank's whole copy of the extra keys, after the rows: index T + e of row b is row b * E + e
        extra_base = pool_RKE.shape[0]
        pool_BLS[beyond_BLS] = extra_base + (b_BLS * E + sel_BLS - T)[beyond_BLS]
        pool_RKE = torch.cat([pool_RKE, torch.cat(extra_kv, dim=-1).reshape(B * E, K, D + Dv)])
        ok_BLS = ok_BLS | beyond_BLS
    counts_T = ok_BLS.reshape(B * L, -1).sum(-1)
    rows_N = pool_BLS[ok_BLS]
    cu_k = torch.zeros(B * L + 1, dtype=torch.int64)
    cu_k[1:] = torch.cumsum(counts_T.cpu(), 0)
    # the pool (this rank's K/V and the fetched rows) is an input: its backward reaches the exchange's on
    # every rank, also one that fetched nothing (a peer waits for the gradients of what it sent)
    out = _SelectedAttention.apply(q.reshape(B * L, H, D), pool_RKE, sinks, rows_N, cu_k, D, backend, scale, softcap)
    width = K * (D + Dv) if latent is None else latent.latent.shape[-1]
    row_bytes = width * k.element_size()
    got = sum(w.numel() for w in wanted)
    gave = sum(r.numel() for r in send_rows) if P > 1 else 0
    grad_row_bytes = width * torch.finfo(accumulation_dtype(k.dtype)).bits // 8
    if latent is not None:
        heads_bytes = K * (D + Dv) * k.element_size()
        plan = dataclasses.replace(plan, stats=dataclasses.replace(
            plan.stats, kv_form="latent", heads_kv_bytes_recv=got * heads_bytes,
            heads_kv_bytes_sent=gave * heads_bytes))
    stats = dataclasses.replace(
        plan.stats, peers_recv=tuple(p for p in range(P) if p != rank and wanted[p].numel()),
        peers_send=tuple(p for p in range(P) if p != rank and P > 1 and send_rows[p].numel()),
        kv_bytes_recv=got * row_bytes, kv_bytes_sent=gave * row_bytes, grad_bytes_recv=gave * grad_row_bytes,
        grad_bytes_sent=got * grad_row_bytes, index_bytes_recv=8 * gave, index_bytes_sent=8 * got,
        ring_kv_bytes_recv=B * (plan.seq_len - L) * row_bytes, entries_computed=int(rows_N.numel()),
        entries_visible=int(rows_N.numel()))
    return out.reshape(B, L, H, Dv), stats
