"""All-to-all head parallelism ("Ulysses"): each rank attends over the whole sequence for a share
of the heads.

Each rank holds ``L_r`` tokens (its layout's) of all ``H`` query and ``K`` K/V heads. One
all-to-all gives rank ``j`` every rank's tokens of its query heads ``[j h, (j+1) h)`` (``h = H /
P``) and of the K/V heads those use, reassembled in global token order for any layout; the rank
then runs single-device attention over the whole sequence with the full mask (documents,
windows, chunks, softcap and its heads' sinks: exactly what one device computes for those heads);
a second all-to-all returns each rank's tokens of every head. The backward runs the reverse
exchanges.

K/V heads (:func:`head_split`): rank ``j`` receives the distinct K/V heads its query heads use,
no more: a head whose GQA group spans two ranks' query heads (``P > K``, or ``K`` not a multiple
of ``P``) goes to both, and the gradients of its copies are summed on its owner. Locally, a
received head is repeated (a view) to as many kernel K/V heads as its query heads need, so that
each kernel K/V head serves ``gcd(H / K, H / P)`` query heads. ``H`` must be a multiple of ``P``.

Bytes rank ``r`` sends per layer, forward: ``L_r (h D + k_j (D + Dv))`` to each other rank ``j``
(``k_j`` the K/V heads ``j`` uses), then ``L_j h Dv`` back to each rank ``j`` (times ``B`` and the item size; the
backward moves the same bytes the other way): independent of the mask, and every rank computes
the same share of the work whatever the layout (:func:`ulysses_stats`).

Legend: ``B`` batch, ``L`` global length, ``L_r`` rank r's tokens, ``H``/``K`` query/KV heads,
``h`` query heads per rank, ``D``/``Dv`` head dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import layout as layout_mod
from .comm import Comm
from .backends.base import accumulation_dtype
from .plan import PlanStats, RankPlan
from .ring import ring_attention

__all__ = ["HeadSplit", "head_split", "UlyssesPlan", "ulysses_attention", "ulysses_stats"]


@dataclass(frozen=True)
class HeadSplit:
    """Which heads each of ``world_size`` ranks attends over: query heads ``q_range(r)``, the
    distinct K/V heads ``kv_range(r)`` those use (what the rank receives), and ``kv_slots[r]``: for
    each of the kernel's ``q_per_rank / group`` K/V heads, its K/V head (original index), so that
    local query head ``i`` uses kernel K/V head ``i // group``."""

    world_size: int
    heads: int
    kv_heads: int
    group: int
    kv_slots: tuple[tuple[int, ...], ...]

    @property
    def q_per_rank(self) -> int:
        return self.heads // self.world_size

    def q_range(self, rank: int) -> tuple[int, int]:
        h = self.q_per_rank
        return rank * h, (rank + 1) * h

    def kv_range(self, rank: int) -> tuple[int, int]:
        """The K/V heads ``[first, end)`` rank ``rank``'s query heads use (consecutive: a run of
        query heads uses a run of GQA groups)."""
        return self.kv_slots[rank][0], self.kv_slots[rank][-1] + 1

    def kv_count(self, rank: int) -> int:
        first, end = self.kv_range(rank)
        return end - first

    @property
    def kv_sent(self) -> int:
        """K/V heads sent to all ranks together (>= ``kv_heads``: a head shared by two ranks' query
        heads goes to both)."""
        return sum(self.kv_count(r) for r in range(self.world_size))

    def repeats(self, rank: int) -> tuple[int, ...] | None:
        """How many kernel K/V heads each received head fills on ``rank`` (None: one each)."""
        slots = self.kv_slots[rank]
        first, end = self.kv_range(rank)
        counts = tuple(slots.count(kv) for kv in range(first, end))
        return None if all(c == 1 for c in counts) else counts


def head_split(heads: int, kv_heads: int, world_size: int) -> HeadSplit:
    """The head split of ``heads`` query and ``kv_heads`` K/V heads over ``world_size`` ranks.

    Raises ValueError when ``heads`` is not a multiple of ``world_size``."""
    if heads % world_size:
        raise ValueError(
            f"strategy='ulysses' splits the query heads over the ranks: {heads} heads are not a multiple of "
            f"{world_size} ranks; use strategy='ring' (any head count) or a world size that divides {heads}")
    h = heads // world_size
    gqa = heads // kv_heads
    group = math.gcd(gqa, h)  # query heads per kernel K/V head on every rank (a divisor of both)
    kv_slots = tuple(tuple((r * h + m * group) // gqa for m in range(h // group)) for r in range(world_size))
    return HeadSplit(world_size=world_size, heads=heads, kv_heads=kv_heads, group=group, kv_slots=kv_slots)


@dataclass(frozen=True, eq=False)
class UlyssesPlan:
    """One rank's head-parallel call: the split, the single-device plan over the whole sequence
    (``local``, the same on every rank), the layout and global length, and the call's statistics."""

    rank: int
    world_size: int
    split: HeadSplit
    local: RankPlan
    layout: object
    seq_len: int
    stats: PlanStats


def ulysses_stats(split: HeadSplit, local: RankPlan, rank: int, seq_len: int, layout, batch: int, head_dim: int,
                  head_dim_v: int, itemsize: int) -> PlanStats:
    """This rank's traffic (the forward's two exchanges; the backward moves the same bytes back)
    and its share of the work: the whole sequence's entries (``local``, one set of heads) split
    evenly over the ranks (each computes ``h`` of the ``H`` heads), the shares adding up exactly."""
    P = split.world_size
    sizes = layout_mod.local_lengths(seq_len, P, layout)
    h = split.q_per_rank
    others = [j for j in range(P) if j != rank]

    def qkv(tokens: int, j: int) -> int:  # rank j's query heads and the K/V heads they use
        return tokens * batch * (h * head_dim + split.kv_count(j) * (head_dim + head_dim_v)) * itemsize

    sent_in = sum(qkv(sizes[rank], j) for j in others)
    recv_in = sum(qkv(sizes[j], rank) for j in others)
    sent_out = sum(sizes[j] for j in others) * batch * h * head_dim_v * itemsize
    recv_out = len(others) * sizes[rank] * batch * h * head_dim_v * itemsize

    def share(total: int) -> int:
        return total * (rank + 1) // P - total * rank // P

    return PlanStats(
        rank=rank, world_size=P, kernel_calls=local.stats.kernel_calls, rounds=2 if P > 1 else 0,
        peers_recv=tuple(others), peers_send=tuple(others), kv_bytes_recv=recv_in + recv_out,
        kv_bytes_sent=sent_in + sent_out, grad_bytes_recv=sent_in + sent_out, grad_bytes_sent=recv_in + recv_out,
        ring_kv_bytes_recv=0, entries_computed=share(local.stats.entries_computed),
        entries_visible=share(local.stats.entries_visible), strategy="ulysses")


# ----------------------------------------------------------------------------------------------
# the two exchanges


def _to_heads(comm: Comm, layout, seq_len: int, xs: list[torch.Tensor], pick) -> list[torch.Tensor]:
    """Every rank's tokens of this rank's heads: ``xs`` are this rank's (B, L_r, N, D) tensors,
    ``pick(x_index, j)`` the heads (a slice or an index tensor) rank ``j`` takes of ``xs[x_index]``;
    returns, per x, the whole sequence (B, L, n, D) of the heads this rank picks, in token order."""
    P, me = comm.world_size, comm.rank
    sizes = layout_mod.local_lengths(seq_len, P, layout)
    B = xs[0].shape[0]
    dtype, device = xs[0].dtype, xs[0].device

    def message(j: int) -> torch.Tensor:
        return torch.cat([_heads(x, pick(i, j)).reshape(-1) for i, x in enumerate(xs)])

    shapes = [(_heads(x, pick(i, me)).shape[2], x.shape[3]) for i, x in enumerate(xs)]
    per_token = sum(n * d for n, d in shapes)
    sends = [message(j) if j != me else None for j in range(P)]
    recvs = [torch.empty(B * sizes[j] * per_token, dtype=dtype, device=device) if j != me else message(me)
             for j in range(P)]
    comm.all_to_all(sends, recvs, "an all-to-all of q, k, v (head parallelism)")
    full = []
    offsets = [0] * P
    for n, d in shapes:
        parts = []
        for j in range(P):
            count = B * sizes[j] * n * d
            parts.append(recvs[j][offsets[j]:offsets[j] + count].view(B, sizes[j], n, d))
            offsets[j] += count
        full.append(layout_mod.unshard(parts, 1, layout))
    return full


def _to_tokens(comm: Comm, layout, xs: list[torch.Tensor], widths) -> list[list[torch.Tensor]]:
    """The reverse: ``xs`` are whole sequences (B, L, n, D) of this rank's heads; ``widths(i, j)``
    the heads rank ``j`` holds of ``xs[i]``; returns, per x, the list over ranks ``j`` of this
    rank's tokens (B, L_me, widths(i, j), D) of rank ``j``'s heads."""
    P, me = comm.world_size, comm.rank
    seq_len = xs[0].shape[1]
    sizes = layout_mod.local_lengths(seq_len, P, layout)
    B = xs[0].shape[0]

    def message(j: int) -> torch.Tensor:
        return torch.cat([layout_mod.shard(x, 1, P, layout, j).reshape(-1) for x in xs])

    def count(i: int, j: int) -> int:
        return B * sizes[me] * widths(i, j) * xs[i].shape[3]

    sends = [message(j) if j != me else None for j in range(P)]
    recvs = [torch.empty(sum(count(i, j) for i in range(len(xs))), dtype=xs[0].dtype, device=xs[0].device)
             if j != me else message(me) for j in range(P)]
    comm.all_to_all(sends, recvs, "an all-to-all of attention outputs (head parallelism)")
    out: list[list[torch.Tensor]] = [[] for _ in xs]
    for j in range(P):
        at = 0
        for i, x in enumerate(xs):
            out[i].append(recvs[j][at:at + count(i, j)].view(B, sizes[me], widths(i, j), x.shape[3]))
            at += count(i, j)
    return out


def _heads(x: torch.Tensor, pick) -> torch.Tensor:
    return x[:, :, pick] if isinstance(pick, slice) else x.index_select(2, pick)


class _Exchange:
    """What both exchanges of one call need (bound to that call): slices only, no device tensor."""

    def __init__(self, plan: UlyssesPlan, comm: Comm):
        self.plan, self.comm = plan, comm
        split = plan.split
        self.q_pick = [slice(*split.q_range(j)) for j in range(split.world_size)]
        self.kv_pick = [slice(*split.kv_range(j)) for j in range(split.world_size)]

    def width(self, i: int, j: int) -> int:
        """Heads rank ``j`` holds of q (``i == 0``) or of k and v."""
        return self.plan.split.q_per_rank if i == 0 else self.plan.split.kv_count(j)


class _ToHeads(torch.autograd.Function):
    """(q, k, v) of this rank's tokens, all heads -> the whole sequence of this rank's heads (its
    query heads and the distinct K/V heads they use)."""

    @staticmethod
    def forward(ctx, q, k, v, ex: _Exchange):
        try:
            ctx.ex, ctx.kv_heads = ex, k.shape[2]
            plan = ex.plan
            return tuple(_to_heads(ex.comm, plan.layout, plan.seq_len, [q, k, v],
                                   lambda i, j: ex.q_pick[j] if i == 0 else ex.kv_pick[j]))
        except BaseException as exc:
            ex.comm.report_failure("head-parallel attention forward", exc)
            raise

    @staticmethod
    def backward(ctx, dq_full, dk_full, dv_full):
        ex = ctx.ex
        try:
            grads = [g.contiguous() for g in (dq_full, dk_full, dv_full)]
            dq_parts, dk_parts, dv_parts = _to_tokens(ex.comm, ex.plan.layout, grads, ex.width)
            dq = torch.cat(dq_parts, dim=2)
            acc = accumulation_dtype(dk_full.dtype)
            B, L_me = dq.shape[:2]
            dk = torch.zeros(B, L_me, ctx.kv_heads, dk_full.shape[3], dtype=acc, device=dq.device)
            dv = torch.zeros(B, L_me, ctx.kv_heads, dv_full.shape[3], dtype=acc, device=dq.device)
            for j, (gk, gv) in enumerate(zip(dk_parts, dv_parts)):  # a head two ranks use: both parts add up
                dk[:, :, ex.kv_pick[j]] += gk.to(acc)
                dv[:, :, ex.kv_pick[j]] += gv.to(acc)
            return dq, dk.to(dk_full.dtype), dv.to(dv_full.dtype), None
        except BaseException as exc:
            ex.comm.report_failure("head-parallel attention backward", exc)
            raise


class _ToTokens(torch.autograd.Function):
    """The whole sequence of this rank's heads -> this rank's tokens, all heads."""

    @staticmethod
    def forward(ctx, out_full, ex: _Exchange):
        try:
            ctx.ex = ex
            return torch.cat(_to_tokens(ex.comm, ex.plan.layout, [out_full.contiguous()], ex.width)[0], dim=2)
        except BaseException as exc:
            ex.comm.report_failure("head-parallel attention forward", exc)
            raise

    @staticmethod
    def backward(ctx, dout):
        ex = ctx.ex
        try:
            plan = ex.plan
            full = _to_heads(ex.comm, plan.layout, plan.seq_len, [dout.contiguous()], lambda i, j: ex.q_pick[j])
            return full[0], None
        except BaseException as exc:
            ex.comm.report_failure("head-parallel attention backward", exc)
            raise


def _expand(x: torch.Tensor, repeats: tuple[int, ...] | None) -> torch.Tensor:
    """(B, L, n, D) -> (B, L, sum(repeats), D), head ``i`` repeated ``repeats[i]`` times (views and
    one cat: its backward sums the copies deterministically)."""
    if repeats is None:
        return x
    B, L, _, D = x.shape
    return torch.cat([x[:, :, i:i + 1].expand(B, L, c, D) for i, c in enumerate(repeats)], dim=2)


def ulysses_attention(q, k, v, sinks, plan: UlyssesPlan, comm: Comm, backend, *, scale: float,
                      softcap: float | None) -> torch.Tensor:
    """Head-parallel attention of this rank's shard: q (B, L_r, H, D), k (B, L_r, K, D), v (B, L_r, K,
    Dv), sinks (H,) or None -> out (B, L_r, H, Dv). Differentiable w.r.t. q, k, v and sinks."""
    ex = _Exchange(plan, comm)
    q_full, k_full, v_full = _ToHeads.apply(q, k, v, ex)
    repeats = plan.split.repeats(comm.rank)
    lo, hi = plan.split.q_range(comm.rank)
    # the whole sequence on this rank: a plan of one rank, run with the group's comm (no exchange;
    # a failure is reported to the group, so the peers waiting in an exchange name this rank)
    out_full = ring_attention(q_full, _expand(k_full, repeats), _expand(v_full, repeats),
                              None if sinks is None else sinks[lo:hi], plan.local, comm, backend, scale=scale,
                              softcap=softcap)
    return _ToTokens.apply(out_full, ex)
